"""The seqio Task behind the query cache: masked queries from annotated files.

`register_pretrain_task` registers one task per (annotated files,
vocabulary, `RealmQueryConfig`): REALM's salient-span masks, or the
ablations' random wordpieces or one random span (`RealmQueryConfig.masking`).
It is not read by the trainer directly: `query_cache` runs the task through
`seqio.beam_utils.PreprocessTask` in an Apache Beam pipeline and writes the
queries to sharded ArrayRecord files that `query_cache.QueryStream` reads.

Pipeline (all seqio preprocessors are tf.data maps):

`seqio.TFExampleDataSource` over the annotated TFRecords (our own or REALM's
released corpus) -> `annotated_to_sentences`: one element per sentence with
at least one salient span; offsets validated in numpy (same rules as
`salient_spans.read_annotated`; bad spans/sentences are dropped -- use
`read_annotated` to count them), sentences tokenized in-graph with
tensorflow_text (same vocabulary and settings as `tokenizer.Tokenizer`) ->
`mask_sentences`: `examples.realm_query` run through `tf.numpy_function` with
a per-element seed from `seqio.map_over_dataset(num_seeds=1)`, so the masks
are reproducible given the seed passed to `get_dataset` (or to
`PreprocessTask`). Sentences without a usable span are filtered out.

Per-host sharding: pass `shard_info=seqio.ShardInfo(index, num_shards)` to
`get_dataset`. The annotated source shards by file when there are at least
as many files as shards, else seqio shards the documents (document i goes to
shard i % num_shards). Either way the shards are disjoint and cover the data.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf

from realm_jax.data import examples as examples_lib
from realm_jax.data import salient_spans as salient_spans_lib
from realm_jax.data import tokenizer as tokenizer_lib

# ------------------------------------------------------------- registry ----

# The spec a task was registered with is kept on the task object, as its
# repr: that survives a reload of this module (seqio's registry is global and
# outlives it), unlike a module-level dict or the dataclass identity.
_SPEC_ATTRIBUTE = "realm_jax_spec"


def add_task(name: str, spec: Any, build: Callable[[], dict[str, Any]], *,
             overwrite: bool = False) -> seqio.Task:
  """Registers a seqio Task once per (name, spec); returns it.

  `spec` (a frozen dataclass) identifies what the task reads by its repr;
  `build()` returns the `seqio.TaskRegistry.add` keyword arguments and is
  called only when registering. A name registered with another spec is an
  error unless `overwrite`.
  """
  if name in seqio.TaskRegistry.names():
    existing = seqio.TaskRegistry.get(name)
    previous = getattr(existing, _SPEC_ATTRIBUTE, None)
    if previous == repr(spec):
      return existing
    if not overwrite:
      raise ValueError(
          f"seqio task {name!r} is already registered with "
          f"{previous or 'a spec unknown to realm_jax.data.tasks'}; pass "
          f"overwrite=True to replace it with {spec!r}, or use another name.")
    seqio.TaskRegistry.remove(name)
  task = seqio.TaskRegistry.add(name, **build())
  setattr(task, _SPEC_ATTRIBUTE, repr(spec))
  return task


def _feature(dtype: tf.DType, rank: int, vocab_size: int = 0) -> seqio.Feature:
  # Ids are made by our own tokenizer; the pass-through vocabulary only
  # records the vocabulary size for seqio's consumers.
  return seqio.Feature(seqio.PassThroughVocabulary(size=vocab_size),
                       add_eos=False, dtype=dtype, rank=rank)


def check_sequence_length(dataset: tf.data.Dataset, *,
                          config: examples_lib.RealmQueryConfig,
                          sequence_length: Mapping[str, Any] | None = None,
                          output_features=None) -> tf.data.Dataset:
  """Lengths are fixed at registration; refuses a conflicting request.

  A pass-through after the cache placeholder (seqio forbids preprocessors
  that take `sequence_length` before it).
  """
  del output_features
  fixed = {"query_ids": config.query_length, "query_mask": config.query_length,
           "mlm_positions": config.max_masks, "mlm_targets": config.max_masks,
           "mlm_weights": config.max_masks}
  for key, length in (sequence_length or {}).items():
    if key in fixed and length is not None and length != fixed[key]:
      raise ValueError(
          f"REALM pre-training: sequence_length[{key!r}]={length} but the "
          f"task was registered with {fixed[key]}; register it with that "
          "length instead (a trimmed query would lose its masks).")
  return dataset


# ------------------------------------------------------ REALM pre-train ----

_ANNOTATED_FEATURES = {
    "title": tf.io.FixedLenFeature([], tf.string, default_value=""),
    "text": tf.io.FixedLenFeature([], tf.string, default_value=""),
    "sentence_byte_start": tf.io.RaggedFeature(tf.int64),
    "sentence_byte_limit": tf.io.RaggedFeature(tf.int64),
    "span_byte_start": tf.io.RaggedFeature(tf.int64),
    "span_byte_limit": tf.io.RaggedFeature(tf.int64),
}


@dataclasses.dataclass(frozen=True)
class PretrainTaskSpec:
  """What a REALM pre-training task reads and how it masks."""
  annotated_pattern: tuple[str, ...]
  vocab_path: str
  lower_case: bool
  query_config: examples_lib.RealmQueryConfig


def _title_hash(title: bytes) -> int:
  from realm_jax.data import blocks  # pylint: disable=g-import-not-at-top
  return int(blocks.title_hash(title.decode("utf-8", "replace")))


def _document_sentences(title, text, ss, sl, ps, pl):
  """numpy: a raw record -> its sentences that hold at least one span."""
  doc = salient_spans_lib.validate_document(
      title, text, ss, sl, ps, pl, [], salient_spans_lib.AnnotationReport())
  sentences, starts, limits, lengths = [], [], [], []
  if not isinstance(doc, str):
    for _, sentence, spans in doc.sentences_with_spans():
      if spans:
        sentences.append(sentence)
        starts.extend(s for s, _ in spans)
        limits.extend(l for _, l in spans)
        lengths.append(len(spans))
  return (np.array(sentences, dtype=object).reshape(-1),
          np.array(starts, np.int64), np.array(limits, np.int64),
          np.array(lengths, np.int64), np.int64(_title_hash(title)))


@functools.lru_cache(maxsize=None)
def _bert_tokenizer(vocab_path: str, lower_case: bool):
  """The tensorflow_text tokenizer of `tokenizer.Tokenizer`, for graphs.

  Built once per vocabulary (building it costs ~1 s); its flat ids and byte
  offsets into the input are exactly what `Tokenizer.tokenize_with_offsets`
  returns.
  """
  return tokenizer_lib.Tokenizer(vocab_path,
                                 lower_case=lower_case).tf_tokenizer


def annotated_to_sentences(dataset: tf.data.Dataset, *, vocab_path: str,
                           lower_case: bool = True) -> tf.data.Dataset:
  """Parsed annotated records -> tokenized sentences with salient spans.

  Returns:
    Elements {ids, byte_starts, byte_limits: [T] int64 (offsets relative to
    the sentence), span_byte_starts, span_byte_limits: [P] int64,
    source_doc_hash: int64}.
  """
  bert = _bert_tokenizer(vocab_path, lower_case)

  def per_document(doc):
    sentences, starts, limits, lengths, doc_hash = tf.numpy_function(
        _document_sentences,
        [doc["title"], doc["text"], doc["sentence_byte_start"],
         doc["sentence_byte_limit"], doc["span_byte_start"],
         doc["span_byte_limit"]],
        [tf.string, tf.int64, tf.int64, tf.int64, tf.int64], stateful=False)
    sentences.set_shape([None])
    for t in (starts, limits, lengths):
      t.set_shape([None])
    doc_hash.set_shape([])
    ids, piece_starts, piece_limits = bert.tokenize_with_offsets(sentences)
    n = tf.shape(sentences)[0]
    return {
        "ids": ids,
        "byte_starts": piece_starts,
        "byte_limits": piece_limits,
        "span_byte_starts": tf.RaggedTensor.from_row_lengths(starts, lengths),
        "span_byte_limits": tf.RaggedTensor.from_row_lengths(limits, lengths),
        "source_doc_hash": tf.fill([n], doc_hash),
    }

  dataset = dataset.map(per_document, num_parallel_calls=tf.data.AUTOTUNE)
  # Slices of ragged tensors come out as RaggedTensorSpec(ragged_rank=0);
  # the identity map turns them into plain [None] tensors.
  return dataset.unbatch().map(lambda ex: {k: v for k, v in ex.items()})


def _realm_query_numpy(ids, starts, limits, span_starts, span_limits,
                       doc_hash, seed, *, special, config):
  rng = np.random.default_rng(np.asarray(seed).astype(np.uint32))
  query = examples_lib.realm_query(
      ids=ids, byte_starts=starts, byte_limits=limits,
      spans=list(zip(span_starts.tolist(), span_limits.tolist())),
      source_doc_hash=int(doc_hash), rng=rng, special=special, config=config)
  if query is None:
    return (np.zeros(config.query_length, np.int32),
            np.zeros(config.query_length, np.int32),
            np.zeros(config.max_masks, np.int32),
            np.zeros(config.max_masks, np.int32),
            np.zeros(config.max_masks, np.float32), False)
  return (query["query_ids"], query["query_mask"], query["mlm_positions"],
          query["mlm_targets"], query["mlm_weights"], True)


def mask_sentences(dataset: tf.data.Dataset, *,
                   config: examples_lib.RealmQueryConfig,
                   special: examples_lib.SpecialIds,
                   output_features=None) -> tf.data.Dataset:
  """`annotated_to_sentences` output -> masked REALM queries.

  Elements with the `examples.REALM_QUERY_FEATURES` (`examples.realm_query`);
  sentences without a usable span are dropped.
  """
  del output_features
  fn = functools.partial(_realm_query_numpy, special=special, config=config)

  @seqio.map_over_dataset(num_seeds=1)
  def mask(ex, seed):
    outputs = tf.numpy_function(
        fn, [ex["ids"], ex["byte_starts"], ex["byte_limits"],
             ex["span_byte_starts"], ex["span_byte_limits"],
             ex["source_doc_hash"], seed],
        [tf.int32, tf.int32, tf.int32, tf.int32, tf.float32, tf.bool],
        stateful=False)
    shapes = [config.query_length] * 2 + [config.max_masks] * 3 + [None]
    names = examples_lib.REALM_QUERY_FEATURES[:5] + ("valid",)
    result = {}
    for name, value, shape in zip(names, outputs, shapes):
      value.set_shape([] if shape is None else [shape])
      result[name] = value
    result["source_doc_hash"] = ex["source_doc_hash"]
    return result

  dataset = mask(dataset).filter(lambda ex: ex["valid"])
  return dataset.map(
      lambda ex: {k: ex[k] for k in examples_lib.REALM_QUERY_FEATURES})


def _compression_reader(patterns: Sequence[str]):
  gzip = [p.endswith(".gz") for p in patterns]
  if any(gzip) and not all(gzip):
    raise ValueError(f"{patterns}: mixing gzip (.gz) and uncompressed "
                     "annotated files in one task is not supported.")
  return functools.partial(tf.data.TFRecordDataset,
                           compression_type="GZIP" if all(gzip) else "")


def _realm_output_features(vocab_size: int) -> dict[str, seqio.Feature]:
  return {
      "query_ids": _feature(tf.int32, 1, vocab_size),
      "query_mask": _feature(tf.int32, 1),
      "mlm_positions": _feature(tf.int32, 1),
      "mlm_targets": _feature(tf.int32, 1, vocab_size),
      "mlm_weights": _feature(tf.float32, 1),
      "source_doc_hash": _feature(tf.int64, 0),
  }


def register_pretrain_task(
    *,
    name: str,
    annotated_pattern: str | Sequence[str],
    query_config: examples_lib.RealmQueryConfig,
    vocab_path: str | None = None,
    lower_case: bool = True,
    overwrite: bool = False,
) -> seqio.Task:
  """Registers one REALM pre-training task (split "train", not shuffled:
  the query cache orders and the trainer shuffles).

  Args:
    name: the task name (the query cache derives it from the files and
      settings, so equal inputs give equal masks).
    annotated_pattern: glob pattern(s) of annotated TFRecord files (".gz"
      ones are read as gzip).
    query_config: lengths and masking ("salient", "random_tokens" or
      "random_spans").
    vocab_path: BERT vocab.txt; default `tokenizer.default_vocab_path()`.
    lower_case: lower-case before WordPiece (uncased vocabularies).
    overwrite: see `add_task`.
  """
  patterns = ((annotated_pattern,) if isinstance(annotated_pattern, str)
              else tuple(annotated_pattern))
  vocab_path = vocab_path or tokenizer_lib.default_vocab_path()
  spec = PretrainTaskSpec(patterns, vocab_path, lower_case, query_config)

  def build():
    tokenizer = tokenizer_lib.Tokenizer(vocab_path, lower_case=lower_case)
    source = seqio.TFExampleDataSource(
        {"train": list(patterns)}, _ANNOTATED_FEATURES,
        reader_cls=_compression_reader(patterns))
    return dict(
        source=source,
        output_features=_realm_output_features(tokenizer.vocab_size),
        preprocessors=[
            functools.partial(annotated_to_sentences, vocab_path=vocab_path,
                              lower_case=lower_case),
            functools.partial(
                mask_sentences, config=query_config,
                special=examples_lib.SpecialIds.from_tokenizer(tokenizer)),
            # Everything above runs offline (`query_cache`, through
            # seqio.beam_utils.PreprocessTask's `preprocess_precache`).
            seqio.CacheDatasetPlaceholder(),
            functools.partial(check_sequence_length, config=query_config),
        ],
        shuffle_buffer_size=None)

  return add_task(name, spec, build, overwrite=overwrite)

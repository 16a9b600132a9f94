r"""Corpus job: documents -> sentences -> blocks of <= 288 wordpieces -> store.

Builds the knowledge corpus Z as a memory-mapped block store (`blocks`,
`block_store`) from a Wikipedia `*-pages-articles*.xml(.bz2)` dump (default:
the enwiki slice inside the gensim wheel), a JSONL file of `{"title": str,
"text": str}` lines, the released ORQA/REALM `blocks.tfr` + `titles.tfr`
(block i = record i, so the released `block_emb` rows pair with the store)
or DPR's `psgs_w100.tsv` (block i = passage i, its id kept: `passage_id`).
Like ORQA, a dump loses its list and disambiguation pages, tables and image
captions unless `keep_*` say otherwise; the store's `dropped.jsonl` names
every skipped article, `report.json` has the counts. An Apache Beam
pipeline:

  Read   one sequential pass (a dump cannot be split): documents numbered
         in file order, in chunks of `documents_per_chunk` (ORQA: never
         inside an article).
  Pack   per chunk, on the workers: remove a dump's markup (the slow part),
         split sentences, tokenize and pack (`blocks.pack_blocks`) into a
         temporary file.
  Store  the launching process streams the chunks in order into
         `write_block_store` (arrays, manifest, report.json: what was kept
         and skipped, by reason, dropped.jsonl), which publishes the store
         atomically.

The store and report are those of a sequential pass, whatever the runner or
the chunking. The command line follows the gin convention (`gin_cli`);
other flags are Beam options (DirectRunner by default; BUILD.md):

  python -m realm_jax.jobs.corpus --gin_file=runs/corpus.gin \
      --gin.INPUT_PATH="'enwiki-20181220-pages-articles.xml.bz2'" \
      --gin.OUTPUT_DIR="'/data/enwiki'" \
      --direct_num_workers=16 --direct_running_mode=multi_processing
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Iterator, Sequence

from absl import logging
import apache_beam as beam
import numpy as np

from realm_jax.core import checks, io_utils, outputs
from realm_jax.core import progress as progress_lib
from realm_jax.data import beam_utils
from realm_jax.data import block_store, block_store_writer
from realm_jax.data import blocks as blocks_lib
from realm_jax.data import formats
from realm_jax.data import tokenizer as tokenizer_lib
from realm_jax.data import wikipedia


# What a dump loses by default (as ORQA): part of the store's fingerprint.
_KEEP = ("keep_lists", "keep_disambiguation", "keep_tables", "keep_captions")


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class CorpusConfig:
  """What `build_corpus` makes (runs/corpus.gin binds the paths).

  Attributes:
    output_dir: the block store directory to create (a gs://... store is
      built in the local cache and uploaded, manifest last).
    input_path: a dump (`*.xml[.bz2]`), a JSONL file, ORQA's `blocks.tfr`
      or its directory (with `titles.tfr`), DPR's `psgs_w100.tsv[.gz]`;
      default: the gensim slice.
    input_format: None: by `input_path`'s name; or "wikipedia_xml",
      "jsonl" or "dpr_tsv" (`id<TAB>text<TAB>title` lines under that
      header: one block per passage, truncated to `max_block_len`, in file
      order, `BlockStore.passage_id(i)` its id) or "squad" (a SQuAD v1.1
      JSON file: each paragraph a document, every one of its blocks
      carrying the paragraph's id as `passage_id`), whatever the name.
    vocab_path: WordPiece vocab.txt; default: BERT uncased.
    max_block_len: wordpieces of `[CLS] title [SEP] body [SEP]`.
    max_documents: only the first N documents (a dump's pages are counted
      before markup removal; ORQA: records).
    orqa_titles_path: ORQA `titles.tfr`; default: beside `blocks.tfr`.
    max_article_chars, max_title_chars: longer ones are skipped
      (`enormous_article`, `title_too_long`).
    allow_truncated: keep the pages read before a dump's XML or
      compression error instead of failing.
    keep_lists: keep a dump's "List of"/"Index of"/"Outline of" pages.
    keep_disambiguation: keep a dump's disambiguation pages.
    keep_tables: keep the text of a dump's tables (a paragraph per row,
      cells joined by " | ").
    keep_captions: keep the captions of a dump's images (a paragraph each).
      By default these four are dropped, as ORQA does; they are part of the
      store's fingerprint.
    documents_per_chunk: the unit of parallel work.
    overwrite: replace an existing store at `output_dir`.
  """
  output_dir: str = checks.path_setting("writes", "block_store")
  input_path: str | None = checks.path_setting("reads", default=None)
  vocab_path: str | None = checks.path_setting("reads", default=None)
  max_block_len: int = blocks_lib.DEFAULT_MAX_BLOCK_LEN
  max_documents: int | None = None
  orqa_titles_path: str | None = checks.path_setting("reads", default=None)
  max_article_chars: int = wikipedia.DEFAULT_MAX_ARTICLE_CHARS
  max_title_chars: int = wikipedia.DEFAULT_MAX_TITLE_CHARS
  allow_truncated: bool = False
  input_format: str | None = None
  keep_lists: bool = False
  keep_disambiguation: bool = False
  keep_tables: bool = False
  keep_captions: bool = False
  documents_per_chunk: int = 256
  overwrite: bool = False

  def __post_init__(self):
    if self.max_block_len < blocks_lib.NUM_SPECIAL_TOKENS + 2:
      raise ValueError(
          f"max_block_len={self.max_block_len} leaves no room for a title "
          "and a body; use at least 5 (REALM uses 288).")
    for name in ("max_documents", "documents_per_chunk"):
      if getattr(self, name) is not None and getattr(self, name) <= 0:
        raise ValueError(f"{name}={getattr(self, name)} must be positive.")


def _orqa_files(input_path: str,
                titles_path: str | None) -> tuple[str, str] | None:
  """(blocks.tfr, titles.tfr) if `input_path` names the ORQA corpus."""
  if io_utils.as_path(input_path).is_dir():
    blocks_tfr = io_utils.join(input_path, "blocks.tfr")
    if not io_utils.as_path(blocks_tfr).exists():
      raise FileNotFoundError(
          f"{input_path} is a directory without blocks.tfr; pass a dump, a "
          "JSONL file or the directory of the ORQA blocks.tfr/titles.tfr.")
    return blocks_tfr, titles_path or io_utils.join(input_path, "titles.tfr")
  if input_path.endswith((".tfr", ".tfrecord", ".tfrecords")):
    return input_path, titles_path or io_utils.join(
        str(io_utils.as_path(input_path).parent), "titles.tfr")
  return None


def _read_chunks(input_path: str, *, size: int, whole_titles: bool, **kwargs
                 ) -> Iterator[tuple[int, tuple[int, str, str, str | None]]]:
  """The Read step: (chunk, (index, title, text, passage_id)); with
  `whole_titles`, a chunk never ends between two records of one title
  (ORQA's and DPR's articles)."""
  chunk, count, last = 0, 0, None
  for row in beam_utils.read_documents(input_path, with_ids=True,
                                       list_dropped=True, **kwargs):
    if count >= size and not (whole_titles and row[1] == last):
      chunk, count = chunk + 1, 0
    count, last = count + 1, row[1]
    yield chunk, row


@functools.lru_cache(maxsize=2)
def _tokenizer(vocab_path: str) -> tokenizer_lib.Tokenizer:
  return tokenizer_lib.Tokenizer(vocab_path)  # once per worker process


def pack_chunk(item, *, tmp_dir: str, vocab_path: str, max_block_len: int,
               input_format: str, input_path: str,
               clean_options: dict[str, bool]) -> dict[str, Any]:
  """The Pack step: (chunk, [(index, title, text, passage_id)]) -> its
  blocks' file; returns the chunk's report and documents (`doc_index`
  counts from 0). A dump's markup is removed with `clean_options`."""
  chunk, rows = item
  rows = sorted(rows, key=lambda row: row[0])
  report, corpus_format = wikipedia.Report(), formats.CORPUS_FORMATS[
      input_format]
  blocks = corpus_format.pack(
      rows, _tokenizer(vocab_path), max_block_len=max_block_len,
      report=report, first_record=rows[0][0], context=dict(
          input_path=input_path, clean_options=clean_options,
          wikitext=corpus_format.wikitext))
  io_utils.atomic_write_bytes(io_utils.join(tmp_dir, f"chunk-{chunk}.jsonl"),
                              "".join(_block_line(b) for b in blocks).encode())
  beam.metrics.Metrics.counter("corpus", "blocks").inc(len(blocks))
  return {"shard": chunk, "report": report.summary(dropped=True),
          "documents": blocks[-1].doc_index + 1 if blocks else 0}


_ARRAYS = ("title_ids", "body_ids", "sentence_starts")


def _block_line(block: blocks_lib.Block) -> str:
  """One block as a JSON line (chunk files are data: never pickled)."""
  record = {f.name: getattr(block, f.name)
            for f in dataclasses.fields(block)}
  for name in _ARRAYS:
    record[name] = {"dtype": record[name].dtype.str,
                    "values": record[name].tolist()}
  return json.dumps(record) + "\n"


def _read_block(line: str) -> blocks_lib.Block:
  record = json.loads(line)  # A chunk file written atomically.
  for name in _ARRAYS:
    record[name] = np.asarray(record[name]["values"],
                              np.dtype(record[name]["dtype"]))
  return blocks_lib.Block(**record)


def _merged_blocks(out: beam_utils.ShardedOutput, stats: list[dict[str, Any]],
                   report: wikipedia.Report) -> Iterator[blocks_lib.Block]:
  """The chunks' blocks in corpus order, `doc_index` counted over all."""
  progress = progress_lib.Progress("corpus: storing chunks", len(stats),
                                   unit="chunks")
  first_doc = 0
  for s in stats:
    report.merge(s["report"])
    path = io_utils.as_path(out.path(f"chunk-{s['shard']}.jsonl"))
    for line in path.read_text(encoding="utf-8").splitlines():
      block = _read_block(line)
      yield dataclasses.replace(block, doc_index=first_doc + block.doc_index)
    first_doc += s["documents"]
    progress.update()


def _reader_options(config: CorpusConfig, input_format: str,
                    orqa: tuple[str, str] | None) -> dict[str, Any]:
  """The keyword arguments of `_read_chunks` that depend on the format."""
  reader = dict(orqa_titles=orqa[1]) if orqa else dict(
      input_format=input_format)
  reader.update({name: getattr(config, name)
                 for name in formats.CORPUS_FORMATS[input_format].options})
  return reader


def build_corpus(*, pipeline_args: Sequence[str] = (), **fields
                 ) -> tuple[block_store.BlockStore, wikipedia.Report]:
  """Builds a block store: `CorpusConfig(**fields)` with the Beam options
  `pipeline_args` (default DirectRunner).

  Returns:
    (the opened store, the report of kept and skipped records).

  Raises:
    ValueError: for bad arguments, or when no block could be built.
    FileExistsError: if `output_dir` exists and not `overwrite`.
    wikipedia.CorruptDumpError: for a malformed dump or TFRecord file.
  """
  config = CorpusConfig(**fields)
  input_path = io_utils.absolute(config.input_path or
                                 wikipedia.default_wikipedia_dump())
  orqa = None if config.input_format else _orqa_files(
      input_path, config.orqa_titles_path)
  input_format = "orqa" if orqa else beam_utils.check_input(
      input_path, config.input_format)
  keep = {name: getattr(config, name) for name in _KEEP}
  reader = _reader_options(config, input_format, orqa)
  corpus_format = formats.CORPUS_FORMATS[input_format]
  vocab_path = config.vocab_path or tokenizer_lib.default_vocab_path()
  report = wikipedia.Report()
  with beam_utils.ShardedOutput(
      config.output_dir, marker="manifest.json", kind=outputs.BLOCK_STORE,
      setting=block_store_writer.SETTING, overwrite=config.overwrite) as out:
    reader_stats = out.path(".reader_stats.json")
    pipeline, runner = beam_utils.pipeline(pipeline_args)
    logging.info("corpus: %s -> %s (max_block_len %d, runner %s)",
                 input_path, out.output_dir, config.max_block_len, runner)
    with pipeline:
      _ = (pipeline
           | "Input" >> beam.Create([orqa[0] if orqa else input_path])
           | "Read" >> beam.FlatMap(
               _read_chunks, size=config.documents_per_chunk,
               whole_titles=corpus_format.whole_titles,
               max_documents=config.max_documents, stats_path=reader_stats,
               **reader)
           | "Pack" >> out.write_shards(functools.partial(
               pack_chunk, tmp_dir=out.tmp_dir, vocab_path=vocab_path,
               max_block_len=config.max_block_len, input_format=input_format,
               input_path=input_path, clean_options=dict(
                   keep_tables=config.keep_tables,
                   keep_captions=config.keep_captions)), "corpus"))
    report.merge(out.load(reader_stats))
    stats = sorted(out.load(out.stats, []), key=lambda s: s["shard"])
    store = block_store_writer.write_block_store(
        _merged_blocks(out, stats, report), out.output_dir,
        tokenizer_vocab_path=vocab_path, source=input_path,
        max_block_len=config.max_block_len, overwrite=config.overwrite,
        report=report, options=keep if corpus_format.wikitext else None)
  logging.info("corpus: %s: %d articles, %d blocks, fingerprint %s",
               out.output_dir, store.num_documents, len(store),
               store.fingerprint)
  report.log_summary(io_utils.join(out.output_dir,
                                   block_store_writer.DROPPED_FILE))
  return store, report


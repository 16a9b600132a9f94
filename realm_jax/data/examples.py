"""REALM pre-training queries and Inverse Cloze Task pairs, in numpy.

REALM query (REALM Sec. 3.4, reference code's behaviour):
  one sentence of a corpus document with ONE salient span masked. Every
  wordpiece lying fully inside the span's bytes becomes [MASK] (always
  [MASK], no 80/10/10 rule); spans with more than `max_masks` (10) such
  wordpieces, or none, are not used. The query is `[CLS] sentence [SEP]`,
  `query_length` (96) long; a long sentence is cut to a window that holds the
  span, ends every mask before position `mask_limit` (94), keeps as many
  sentence tokens as fit and, among such windows, centres the span.

Ablations (REALM Table 5): `masking="random_tokens"` masks ~15% of the
wordpieces of a window (at least 1, at most 10) as in BERT, and
`masking="random_spans"` masks one contiguous run whose length follows
SpanBERT's geometric distribution Geo(p=0.2) truncated to 1..10 wordpieces
(mean ~3.8), measured in wordpieces.

ICT pair (ORQA, Lee et al. 2019): a random sentence of a block is the
pseudo-query `[CLS] sentence [SEP]` (64 long, truncated at the end); with
probability 0.9 the sentence is removed from the block, which is formatted
`[CLS] title [SEP] body [SEP]` (288 long; segment 0 for `[CLS] title [SEP]`,
1 for `body [SEP]`).

All functions are deterministic given a `np.random.Generator`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from realm_jax.core import checks
from realm_jax.data import salient_spans as salient_spans_lib

MASKING_MODES = ("salient", "random_tokens", "random_spans")

# Output features of `realm_query` and `ict_pair`, in a fixed order.
REALM_QUERY_FEATURES = ("query_ids", "query_mask", "mlm_positions",
                        "mlm_targets", "mlm_weights", "source_doc_hash")
ICT_FEATURES = ("query_ids", "query_mask", "query_segment_ids", "block_ids",
                "block_mask", "block_segment_ids", "sentence_removed")


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """Ids of the special wordpieces (from `tokenizer.Tokenizer`)."""
  pad_id: int = 0
  cls_id: int = 101
  sep_id: int = 102
  mask_id: int = 103

  @classmethod
  def from_tokenizer(cls, tokenizer) -> SpecialIds:
    return cls(pad_id=tokenizer.pad_id, cls_id=tokenizer.cls_id,
               sep_id=tokenizer.sep_id, mask_id=tokenizer.mask_id)


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class RealmQueryConfig:
  """How REALM masked-language-model queries are made.

  Attributes:
    query_length: wordpieces of `[CLS] sentence [SEP]` (REALM: 96).
    max_masks: at most this many masked targets (REALM: 10).
    mask_limit: every masked position is < mask_limit; None (the default)
      is query_length - 2 (REALM: 94 of 96), two positions of room
      before the final [SEP].
    masking: "salient" (REALM), "random_tokens" or "random_spans".
    random_token_rate: share of the window masked by "random_tokens".
    span_length_p: parameter of the geometric span length ("random_spans").
  """
  query_length: int = 96
  max_masks: int = 10
  mask_limit: int | None = None
  masking: str = "salient"
  random_token_rate: float = 0.15
  span_length_p: float = 0.2

  def __post_init__(self):
    if self.mask_limit is None:
      object.__setattr__(self, "mask_limit", self.query_length - 2)
    if self.masking not in MASKING_MODES:
      raise ValueError(f"masking={self.masking!r}; use one of {MASKING_MODES}.")
    if self.max_masks < 1:
      raise ValueError(f"max_masks={self.max_masks} must be >= 1.")
    if not 1 + self.max_masks <= self.mask_limit <= self.query_length - 1:
      raise ValueError(
          f"mask_limit={self.mask_limit} must leave room for [CLS] and "
          f"max_masks={self.max_masks} masks and lie before the final [SEP] "
          f"of query_length={self.query_length}: use "
          f"{1 + self.max_masks} <= mask_limit <= {self.query_length - 1}.")
    if not 0.0 < self.random_token_rate <= 1.0:
      raise ValueError(f"random_token_rate={self.random_token_rate} must be "
                       "in (0, 1].")
    if not 0.0 < self.span_length_p <= 1.0:
      raise ValueError(f"span_length_p={self.span_length_p} must be in "
                       "(0, 1].")

  @property
  def window_length(self) -> int:
    """Sentence wordpieces that fit between [CLS] and [SEP]."""
    return self.query_length - 2

  @property
  def max_mask_offset(self) -> int:
    """Largest window offset a mask may have (its position is offset + 1)."""
    return self.mask_limit - 2


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class IctConfig:
  """How Inverse Cloze Task pairs are made (ORQA's settings by default).

  Attributes:
    query_length: wordpieces of the pseudo-query `[CLS] sentence [SEP]`.
    block_length: wordpieces of `[CLS] title [SEP] body [SEP]`.
    remove_probability: chance that the query sentence is removed from the
      block (ORQA: 0.9; the rest teaches lexical matching).
  """
  query_length: int = 64
  block_length: int = 288
  remove_probability: float = 0.9

  def __post_init__(self):
    if self.query_length < 3:
      raise ValueError(f"query_length={self.query_length} must be >= 3 "
                       "([CLS] sentence [SEP]).")
    if self.block_length < 4:
      raise ValueError(f"block_length={self.block_length} must be >= 4 "
                       "([CLS] title [SEP] body [SEP]).")
    if not 0.0 <= self.remove_probability <= 1.0:
      raise ValueError(f"remove_probability={self.remove_probability} must "
                       "be in [0, 1].")


def _padded(tokens, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """`tokens` padded to `length` -> (ids, mask), int32."""
  ids = np.full(length, pad_id, np.int32)
  ids[:len(tokens)] = tokens
  return ids, (np.arange(length) < len(tokens)).astype(np.int32)


# ----------------------------------------------------------- REALM query ----


def span_wordpieces(byte_starts: np.ndarray, byte_limits: np.ndarray,
                    span_start: int, span_limit: int) -> np.ndarray:
  """Indices of the wordpieces lying fully inside bytes [start, limit)."""
  return np.flatnonzero((byte_starts >= span_start) &
                        (byte_limits <= span_limit))


def _centred_window(n: int, first: int, last: int,
                    config: RealmQueryConfig) -> int:
  """Start of the window of `n` sentence pieces that holds pieces first..last.

  Among the starts that keep every mask before `mask_limit` and the span in
  the window, take those that fit the most sentence pieces, then the one that
  centres the span.
  """
  lo = max(0, last - config.max_mask_offset)
  hi = min(first, max(0, n - config.window_length))
  if hi <= lo:
    return lo
  centred = (first + last + 1) // 2 - config.window_length // 2
  return int(np.clip(centred, lo, hi))


def _geometric_length(rng: np.random.Generator, p: float,
                      max_length: int) -> int:
  lengths = np.arange(1, max_length + 1)
  weights = p * (1 - p) ** (lengths - 1)
  return int(rng.choice(lengths, p=weights / weights.sum()))


def _choose_targets(ids, byte_starts, byte_limits, spans, rng,
                    config) -> tuple[int, np.ndarray] | None:
  """Window start and the sentence indices of the pieces to mask."""
  n = len(ids)
  candidates = []
  for start, limit in spans:
    pieces = span_wordpieces(byte_starts, byte_limits, start, limit)
    if 1 <= len(pieces) <= config.max_masks:
      candidates.append(pieces)
  # The ablations use the same sentences as salient masking (those with a
  # usable span), so that only what is masked differs.
  if not candidates:
    return None
  if config.masking == "salient":
    pieces = candidates[rng.integers(len(candidates))]
    return _centred_window(n, pieces[0], pieces[-1], config), pieces
  # Random masks live in a random window; masks may use window offsets
  # 0..max_mask_offset.
  w0 = int(rng.integers(max(0, n - config.window_length) + 1))
  eligible = min(n - w0, config.max_mask_offset + 1)
  if config.masking == "random_tokens":
    count = int(np.clip(round(config.random_token_rate * eligible), 1,
                        min(config.max_masks, eligible)))
    offsets = np.sort(rng.choice(eligible, size=count, replace=False))
  else:  # random_spans
    length = _geometric_length(rng, config.span_length_p,
                               min(config.max_masks, eligible))
    first = int(rng.integers(eligible - length + 1))
    offsets = np.arange(first, first + length)
  return w0, w0 + offsets


def realm_query(
    *,
    ids: np.ndarray,
    byte_starts: np.ndarray,
    byte_limits: np.ndarray,
    spans: Sequence[tuple[int, int]],
    source_doc_hash: int,
    rng: np.random.Generator,
    special: SpecialIds = SpecialIds(),
    config: RealmQueryConfig = RealmQueryConfig(),
) -> dict[str, np.ndarray] | None:
  """Builds one masked REALM query from a tokenized sentence.

  Args:
    ids: [n] wordpiece ids of the sentence.
    byte_starts, byte_limits: [n] byte offsets of the wordpieces (any origin,
      the same as `spans`).
    spans: salient spans `(byte_start, byte_limit)`; one is picked at random.
      The random masking ablations mask other pieces but, like REALM, only
      use sentences with a usable span.
    source_doc_hash: `blocks.title_hash` of the sentence's article, used to
      drop that article from the retrieved candidates.
    rng, special, config: the random generator, special token ids, lengths
      and masking mode.

  Returns:
    A dict of numpy arrays: query_ids [query_length] int32 (masked),
    query_mask [query_length] int32, mlm_positions / mlm_targets [max_masks]
    int32, mlm_weights [max_masks] float32 (1 real, 0 padding),
    source_doc_hash int64 scalar; or None when no span can be masked (no
    span, or every span has 0 or more than `max_masks` wordpieces).
  """
  ids = np.asarray(ids, np.int64)
  chosen = _choose_targets(ids, np.asarray(byte_starts),
                           np.asarray(byte_limits), spans, rng, config)
  if chosen is None:
    return None
  w0, pieces = chosen
  query_ids, query_mask = _padded(
      np.concatenate([[special.cls_id], ids[w0:w0 + config.window_length],
                      [special.sep_id]]), config.query_length, special.pad_id)
  positions = (pieces - w0 + 1).astype(np.int32)
  assert positions.min() >= 1 and positions.max() < config.mask_limit
  query_ids[positions] = special.mask_id
  padding = (0, config.max_masks - len(positions))
  return {
      "query_ids": query_ids,
      "query_mask": query_mask,
      "mlm_positions": np.pad(positions, padding),
      "mlm_targets": np.pad(ids[pieces].astype(np.int32), padding),
      "mlm_weights": np.pad(np.ones(len(positions), np.float32), padding),
      "source_doc_hash": np.int64(source_doc_hash),
  }


def realm_queries_from_document(
    doc: salient_spans_lib.AnnotatedDocument,
    tokenizer,
    rng: np.random.Generator,
    config: RealmQueryConfig = RealmQueryConfig(),
) -> list[dict[str, np.ndarray]]:
  """One query per sentence of `doc` that has a usable salient span.

  Every masking mode uses the sentences that have at least one salient span,
  so the ablations differ from REALM only in what is masked, not in which
  sentences become queries. Sentences are tokenized in one batch; the
  queries come in sentence order (see `realm_query`).
  """
  from realm_jax.data import blocks  # pylint: disable=g-import-not-at-top
  doc_hash = blocks.title_hash(doc.title)
  sentences = [(s, spans) for _, s, spans in doc.sentences_with_spans()
               if spans]
  tokenized = tokenizer.tokenize_with_offsets(
      [s.decode("utf-8") for s, _ in sentences])
  queries = []
  for (_, spans), (ids, starts, limits) in zip(sentences, tokenized):
    query = realm_query(
        ids=ids, byte_starts=starts, byte_limits=limits, spans=spans,
        source_doc_hash=doc_hash, rng=rng,
        special=SpecialIds.from_tokenizer(tokenizer), config=config)
    if query is not None:
      queries.append(query)
  return queries


def read_realm_queries(pattern: str, tokenizer, *, config: RealmQueryConfig,
                       seed: int = 0, max_queries: int | None = None
                       ) -> dict[str, np.ndarray]:
  """A small set of REALM queries, in memory, stacked (evaluation sets).

  Training streams its queries from a cache (`data.query_cache`); this
  reads a held-out file or two (`pattern`: a file, glob or comma-separated
  list of annotated records) for measurements, and stops after
  `max_queries`. Returns `REALM_QUERY_FEATURES` arrays with a leading query
  axis.
  """
  rng = np.random.default_rng([seed, 0])
  queries: list[dict[str, np.ndarray]] = []
  for doc in salient_spans_lib.read_annotated(
      [p for p in pattern.split(",") if p]):
    queries += realm_queries_from_document(doc, tokenizer, rng, config)
    if max_queries is not None and len(queries) >= max_queries:
      queries = queries[:max_queries]
      break
  if not queries:
    raise ValueError(f"{pattern}: no REALM queries (no sentence with a "
                     "usable salient span).")
  return {k: np.stack([q[k] for q in queries]) for k in REALM_QUERY_FEATURES}


# -------------------------------------------------------------- ICT pair ----


def sentence_bounds(num_tokens: int, sentence_starts: Sequence[int]
                    ) -> list[tuple[int, int]]:
  """Token ranges `[start, end)` of the sentences of a block body.

  Tokens before the first listed start (the tail of a sentence that began in
  the previous block) count as a sentence of their own.
  """
  cuts = sorted({0, num_tokens} | {int(s) for s in sentence_starts
                                   if 0 < int(s) < num_tokens})
  return [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def format_block(title_ids: np.ndarray, body_ids: np.ndarray,
                 special: SpecialIds, length: int) -> tuple[np.ndarray, ...]:
  """`[CLS] title [SEP] body [SEP]` -> (ids, mask, segment_ids), int32.

  Truncates like `block_store.BlockStore.retriever_inputs` (the body first, then
  the title), so ICT trains on the inputs the index will embed.
  """
  title = np.asarray(title_ids)[:length - 3]
  body = np.asarray(body_ids)[:length - 3 - len(title)]
  tokens = np.concatenate([[special.cls_id], title, [special.sep_id], body,
                           [special.sep_id]]).astype(np.int32)
  ids, mask = _padded(tokens, length, special.pad_id)
  segments = np.zeros(length, np.int32)
  segments[len(title) + 2:len(tokens)] = 1
  return ids, mask, segments


def ict_pair(
    *,
    body_ids: np.ndarray,
    sentence_starts: Sequence[int],
    title_ids: np.ndarray,
    rng: np.random.Generator,
    special: SpecialIds = SpecialIds(),
    config: IctConfig = IctConfig(),
) -> dict[str, np.ndarray] | None:
  """Builds one Inverse Cloze Task (pseudo-query, block) pair.

  `sentence_starts` are the token offsets in `body_ids` where sentences
  start.

  Returns:
    query_ids / query_mask / query_segment_ids [query_length] int32,
    block_ids / block_mask / block_segment_ids [block_length] int32 and
    sentence_removed (int32 scalar, 1 when the sentence was cut out of the
    block); None for an empty body. A block of one sentence keeps it (its
    body would be empty).
  """
  body_ids = np.asarray(body_ids)
  bounds = sentence_bounds(len(body_ids), sentence_starts)
  if not bounds:
    return None
  start, end = bounds[rng.integers(len(bounds))]
  # Drawn even for one-sentence blocks so the random stream does not depend
  # on the block's sentence count.
  remove = rng.random() < config.remove_probability and len(bounds) > 1
  sentence = body_ids[start:end][:config.query_length - 2]
  query_ids, query_mask = _padded(
      np.concatenate([[special.cls_id], sentence, [special.sep_id]]),
      config.query_length, special.pad_id)
  body = (np.concatenate([body_ids[:start], body_ids[end:]]) if remove
          else body_ids)
  block_ids, block_mask, block_segment_ids = format_block(
      title_ids, body, special, config.block_length)
  return {
      "query_ids": query_ids,
      "query_mask": query_mask,
      "query_segment_ids": np.zeros(config.query_length, np.int32),
      "block_ids": block_ids,
      "block_mask": block_mask,
      "block_segment_ids": block_segment_ids,
      "sentence_removed": np.int32(remove),
  }

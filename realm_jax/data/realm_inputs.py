"""Turning retrieved block ids into REALM pre-training model inputs.

Per query: the searcher's top hits minus its trivial candidates (REALM's
no-trivial-retrieval rule, `TrivialCandidates`), the first `k` kept, the
null document put in front; then the
retriever inputs of every candidate (`[CLS] title [SEP] body [SEP]`, the null
document as `[CLS] [SEP] [SEP]`) and the reader inputs
(`[CLS] x [SEP] body [SEP]`, packed contiguously so the masked positions of
the query are the same in every candidate's reader input).

Everything is vectorised numpy over the whole batch: this runs on the host
every training step.
"""

from __future__ import annotations

import functools
from typing import Mapping

import numpy as np


TRIVIAL_RULES = ("article", "block")


class TrivialCandidates:
  """Which blocks a query may not retrieve: REALM's no-trivial-retrieval rule.

  A masked sentence of X that is also in Z would be filled by copying it
  from its own block. Two rules:

  * "article": no block of the sentence's article (`store.doc_hash` vs the
    query's `source_doc_hash`). Safe whatever X is, but when X and Z are the
    same few articles it also hides every block that is *about* the
    sentence's subject, which is what a question about it needs.
  * "block": only the block that holds the sentence (REALM's reference
    code). The block is found in the sentence's article as the one sharing
    most of the sentence's wordpiece bigrams (masks restored); a sentence
    split over two blocks keeps its other part retrievable.

  Both reduce to keys: block i is excluded for query q iff
  `block_keys[i] == query_keys(q)`.

  The "block" rule runs on the host every training step, so each article's
  block bigrams are computed once and kept (the last `ARTICLE_CACHE`
  articles used): a batch then costs one set lookup per query.
  """

  ARTICLE_CACHE = 4096

  def __init__(self, store, rule: str = "article"):
    if rule not in TRIVIAL_RULES:
      raise ValueError(f"trivial_candidates={rule!r}; use one of "
                       f"{TRIVIAL_RULES}.")
    self.store, self.rule = store, rule
    self.block_keys = (np.asarray(store.doc_hash, np.int64)
                       if rule == "article"
                       else np.arange(len(store), dtype=np.int64))
    self._doc_of_hash = None
    self._article_bigrams = functools.lru_cache(maxsize=self.ARTICLE_CACHE)(
        self._bigrams_of_article)

  @property
  def max_excluded(self) -> int:
    """The most blocks one query can lose to the rule."""
    if self.rule == "block":
      return 1
    return int(np.bincount(self.store.doc_indices).max())

  def query_keys(self, queries: Mapping[str, np.ndarray]) -> np.ndarray:
    """int64 [B]: each query's key (-1 when its article is not in Z)."""
    if self.rule == "article":
      return np.asarray(queries["source_doc_hash"], np.int64)
    return self.source_blocks(queries)

  def source_blocks(self, queries: Mapping[str, np.ndarray]) -> np.ndarray:
    """int64 [B]: the block of each query's sentence, -1 if none."""
    store = self.store
    if self._doc_of_hash is None:
      first = np.asarray(store.doc_block_offsets[:-1], np.int64)
      self._doc_of_hash = dict(zip(
          np.asarray(store.doc_hash)[first[first < len(store)]].tolist(),
          range(len(first))))
      special = store.special_ids()
      self._special = np.asarray([special.cls_id, special.sep_id,
                                  special.pad_id, special.mask_id])
    ids = np.array(queries["query_ids"], np.int64)
    rows = np.arange(len(ids))[:, None]
    weights = np.asarray(queries["mlm_weights"]) > 0
    positions = np.asarray(queries["mlm_positions"])
    restored = np.where(weights, queries["mlm_targets"],
                        ids[rows, positions])
    ids[rows, positions] = restored
    out = np.full(len(ids), -1, np.int64)
    for q, source in enumerate(np.asarray(queries["source_doc_hash"])):
      doc = self._doc_of_hash.get(int(source))
      if doc is None:
        continue
      tokens = ids[q][np.asarray(queries["query_mask"][q]) > 0]
      tokens = tokens[~np.isin(tokens, self._special)]
      blocks, bigrams, owner = self._article_bigrams(doc)
      # Distinct sentence bigrams each block holds (`_bigrams` are unique
      # per block, so a bigram counts once per block); the first on ties.
      shared = np.bincount(owner[np.isin(bigrams, _bigrams(tokens))],
                           minlength=len(blocks))
      out[q] = blocks[int(np.argmax(shared))]
    return out

  def _bigrams_of_article(self, doc: int
                          ) -> tuple[range, np.ndarray, np.ndarray]:
    """(block ids, every block's distinct body bigrams concatenated, the
    position in block ids of each one's block) of article `doc`."""
    blocks = self.store.document_blocks(doc)
    parts = [_bigrams(self.store.body_ids(b)) for b in blocks]
    owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    return blocks, np.concatenate(parts) if parts else np.zeros(
        [0], np.int64), owner


def _bigrams(tokens: np.ndarray) -> np.ndarray:
  tokens = np.asarray(tokens, np.int64)
  if len(tokens) < 2:
    return tokens
  return np.unique(tokens[:-1] * (1 << 32) + tokens[1:])


def select_candidates(retrieved_ids: np.ndarray, block_keys: np.ndarray,
                      query_keys: np.ndarray, k: int) -> np.ndarray:
  """Drops each query's trivial candidates and keeps the first k.

  Args:
    retrieved_ids: int [B, R] searcher hits in rank order, R >= k.
    block_keys: int64 [num_blocks] (`TrivialCandidates.block_keys`; the
      article hash of every block under the "article" rule).
    query_keys: int64 [B] (`TrivialCandidates.query_keys`; the article hash
      of each query's sentence under the "article" rule).
    k: candidates to keep (REALM: 7).

  Returns:
    int64 [B, k] block ids, in rank order.

  Raises:
    ValueError: if a query has fewer than k non-trivial hits; retrieve more
      (R) hits.
  """
  retrieved_ids = np.asarray(retrieved_ids, np.int64)
  allowed = block_keys[retrieved_ids] != np.asarray(
      query_keys, np.int64)[:, None]
  counts = allowed.sum(1)
  if (counts < k).any():
    bad = int(np.argmin(counts))
    raise ValueError(
        f"Query {bad} has only {counts[bad]} retrieved blocks that are not "
        f"trivial candidates but needs {k}; search for more than "
        f"{retrieved_ids.shape[1]} neighbours.")
  # Stable sort puts allowed hits first, keeping their rank order.
  order = np.argsort(~allowed, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(retrieved_ids, order, axis=1)


# log 0 for the null document under BM25's prior: finite, so that no
# logaddexp or gradient meets an infinity; exp of it is 0 in float32.
LOG_ZERO = -1e9


def lexical_log_prior(candidates, hit_ids, hit_scores, null_document: bool,
                      xp=np):
  """log p(z|x) [B, C] by BM25: the softmax of each candidate's BM25 score
  over the query's candidates (`RetrievalConfig.held_prior = "mixture"`).

  A candidate among the query's first R BM25 hits has its score; one
  outside them (a dense candidate BM25 ranks lower) the R-th hit's score,
  an upper bound on its own. The null document (slot 0 when
  `null_document`) gets no BM25 mass. Written once for numpy (the host
  modes) and jax.numpy (`xp=jnp`, device search).

  Args:
    candidates: int [B, W] the candidates' block ids (no null document).
    hit_ids: int [B, R] BM25's first R non-trivial hits, best first.
    hit_scores: float [B, R] their BM25 scores.
    null_document: whether slot 0 of the reader's candidates is the null.
  """
  match = candidates[:, :, None] == hit_ids[:, None, :]
  scores = hit_scores.astype(xp.float32)
  floor = scores.min(axis=1, keepdims=True)
  s = xp.where(match.any(-1), (match * scores[:, None, :]).sum(-1), floor)
  s = s - s.max(axis=1, keepdims=True)
  log_p = s - xp.log(xp.exp(s).sum(axis=1, keepdims=True))
  if null_document:
    log_p = xp.concatenate(
        [xp.full(log_p.shape[:1] + (1,), LOG_ZERO, xp.float32), log_p], 1)
  return log_p.astype(xp.float32)


def null_document_inputs(seq_len: int, cls_id: int, sep_id: int, pad_id: int = 0
                  ) -> dict[str, np.ndarray]:
  """Retriever inputs of the empty document `[CLS] [SEP] [SEP]`."""
  ids = np.full([seq_len], pad_id, np.int32)
  ids[:3] = [cls_id, sep_id, sep_id]
  mask = (np.arange(seq_len) < 3).astype(np.int32)
  segments = (np.arange(seq_len) == 2).astype(np.int32)
  return {"token_ids": ids, "input_mask": mask, "segment_ids": segments}


def reader_length(configured: int | None, query_length: int,
                  block_length: int, *, field: str, queries: str) -> int:
  """The reader's input length: `configured`, or None: the queries' length
  plus the blocks' (`[CLS] x [SEP] body [SEP]` reads a query of
  `query_length` and a body of up to `block_length` - 2 wordpieces).

  Raises:
    ValueError: naming `field` (the config's) and the query cache
      `queries`, if the length does not exceed `query_length`.
  """
  length = configured or query_length + block_length
  if length <= query_length:
    raise ValueError(
        f"{field}={length} must exceed the query_length={query_length} of "
        f"the query cache {queries} (the reader reads [CLS] x [SEP] body "
        f"[SEP]): set it to {query_length} + the block length, or None for "
        "that.")
  return length


def reader_inputs(query_ids: np.ndarray, query_mask: np.ndarray,
                  bodies: np.ndarray, body_lengths: np.ndarray, *,
                  seq_len: int, sep_id: int, pad_id: int = 0
                  ) -> dict[str, np.ndarray]:
  """`[CLS] x [SEP] body [SEP]` for every (query, candidate) pair.

  Queries int [B, Lq] are `[CLS] x [SEP]` then padding; `bodies` int
  [B, C, Lb] (zero-padded, `body_lengths` [B, C], 0 for the null document)
  are truncated to fit `seq_len`.

  Returns:
    {"token_ids", "input_mask", "segment_ids"} int32 [B, C, seq_len];
    segment 0 covers `[CLS] x [SEP]`, segment 1 `body [SEP]`.
  """
  q_len = np.asarray(query_mask).sum(-1).astype(np.int64)          # [B]
  if (q_len >= seq_len).any():
    raise ValueError(f"Reader length {seq_len} leaves no room for a "
                     f"document after queries of {q_len.max()} tokens.")
  b_len = np.minimum(np.asarray(body_lengths, np.int64),
                     seq_len - 1 - q_len[:, None])                  # [B, C]
  cols = np.arange(seq_len)[None, None, :]
  in_query = cols < q_len[:, None, None]
  body_pos = cols - q_len[:, None, None]
  in_body = (body_pos >= 0) & (body_pos < b_len[..., None])
  final_sep = body_pos == b_len[..., None]
  q = np.take_along_axis(
      np.asarray(query_ids), np.minimum(cols[0], query_ids.shape[1] - 1),
      axis=1)[:, None, :]
  body = np.take_along_axis(
      bodies, np.clip(body_pos, 0, bodies.shape[-1] - 1).astype(np.int64)
      * np.ones_like(b_len[..., None]), axis=2)
  ids = np.where(in_query, q, np.where(in_body, body, np.where(
      final_sep, sep_id, pad_id))).astype(np.int32)
  mask = (in_query | in_body | final_sep).astype(np.int32)
  segments = (in_body | final_sep).astype(np.int32)
  return {"token_ids": ids, "input_mask": mask, "segment_ids": segments}


def masked_spans(queries: Mapping[str, np.ndarray]) -> list[np.ndarray]:
  """The masked wordpieces of each query, in position order (int32).

  Salient-span masking masks one span, so this is the span itself; with
  the random masking ablations it is the run of all masked wordpieces.
  """
  spans = []
  for pos, tgt, w in zip(np.asarray(queries["mlm_positions"]),
                         np.asarray(queries["mlm_targets"]),
                         np.asarray(queries["mlm_weights"])):
    real = w > 0
    spans.append(tgt[real][np.argsort(pos[real], kind="stable")].astype(
        np.int32))
  return spans


def holds_spans(spans: list[np.ndarray], bodies: np.ndarray,
                lengths: np.ndarray) -> np.ndarray:
  """bool [B, k]: body [b, c] (its first lengths[b, c] wordpieces) holds
  spans[b] as a contiguous run; an empty span is held nowhere."""
  batch, k = lengths.shape
  found = np.zeros((batch, k), bool)
  for b, span in enumerate(spans):
    for c in range(k):
      body = bodies[b, c, :lengths[b, c]]
      if 0 < len(span) <= len(body):
        windows = np.lib.stride_tricks.sliding_window_view(body, len(span))
        found[b, c] = bool((windows == span).all(axis=1).any())
  return found


Layout = dict[str, tuple[tuple[int, ...], np.dtype]]


def pretraining_layout(*, batch: int, candidates: int, query_length: int,
                       block_length: int, reader_length: int, num_masks: int,
                       held_prior: str = "dense",
                       embedding_size: int | None = None) -> Layout:
  """The pre-training step's batch: {field: (shape, dtype)}.

  The one description of what `pretraining_batch` and the candidate source
  produce (`training.candidates`) and what `realm-aot` lowers the step on
  (tests check the produced batches against it). `candidates` counts the
  null document; `held_prior` other than "dense" adds `dense_prior` [B]
  and "mixture" `lexical_log_prior` [B, C] (`RetrievalConfig.held_prior`);
  `embedding_size` (query-side training) adds the candidates' index
  embeddings [B, C, D].
  """
  b, c, m = batch, candidates, num_masks
  i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
  layout = {
      "query_ids": ((b, query_length), i32),
      "query_mask": ((b, query_length), i32),
      **{f"candidate_{n}": ((b, c, block_length), i32)
         for n in ("ids", "mask", "segment_ids")},
      **{f"reader_{n}": ((b, c, reader_length), i32)
         for n in ("ids", "mask", "segment_ids")},
      "mlm_positions": ((b, m), i32), "mlm_targets": ((b, m), i32),
      "mlm_weights": ((b, m), f32)}
  if held_prior != "dense":
    layout["dense_prior"] = ((b,), f32)
  if held_prior == "mixture":
    layout["lexical_log_prior"] = ((b, c), f32)
  if embedding_size is not None:
    layout["candidate_embeddings"] = ((b, c, embedding_size), f32)
  return layout


def pretraining_batch(queries: Mapping[str, np.ndarray],
                      candidate_block_ids: np.ndarray, block_store, *,
                      doc_len: int = 288, reader_len: int = 384,
                      null_document: bool = True
                      ) -> dict[str, np.ndarray]:
  """The full model input of one REALM pre-training step.

  Args:
    queries: stacked REALM queries (see `realm_jax.data.examples`).
    candidate_block_ids: int [B, k] retrieved blocks (source article
      already dropped, see `select_candidates`).
    block_store: a `realm_jax.data.block_store.BlockStore`.
    doc_len, reader_len: retriever and reader lengths (288, 384 = 96 + 288).
    null_document: put the empty document first (REALM); without it the
      candidates are the k retrieved blocks only (an ablation; the
      "retrieval utility" metric then compares against the top block).

  Returns:
    The batch `Realm.pretraining_logits` and `losses.pretraining_loss`
    take, with C = k + 1 candidates (null document first), or k.
  """
  m = block_store.manifest
  cls_id, sep_id, pad_id = int(m["cls_id"]), int(m["sep_id"]), int(
      m.get("pad_id", 0))
  batch, k = candidate_block_ids.shape
  flat = np.asarray(candidate_block_ids).reshape(-1)
  docs = block_store.retriever_inputs(flat, doc_len)
  null = null_document_inputs(doc_len, cls_id, sep_id, pad_id)

  n_null = 1 if null_document else 0

  def with_null(name):
    x = docs[name].reshape(batch, k, doc_len)
    return np.concatenate(
        [np.broadcast_to(null[name], (batch, n_null, doc_len)), x], 1)

  bodies, lengths = block_store.bodies(flat, doc_len)
  bodies = np.concatenate([np.zeros((batch, n_null, doc_len), np.int32),
                           bodies.reshape(batch, k, doc_len)], 1)
  lengths = np.concatenate([np.zeros((batch, n_null), np.int32),
                            lengths.reshape(batch, k)], 1)
  reader = reader_inputs(queries["query_ids"], queries["query_mask"], bodies,
                         lengths, seq_len=reader_len, sep_id=sep_id,
                         pad_id=pad_id)
  batch = {
      "query_ids": np.asarray(queries["query_ids"], np.int32),
      "query_mask": np.asarray(queries["query_mask"], np.int32),
      "candidate_ids": with_null("token_ids"),
      "candidate_mask": with_null("input_mask"),
      "candidate_segment_ids": with_null("segment_ids"),
      "reader_ids": reader["token_ids"],
      "reader_mask": reader["input_mask"],
      "reader_segment_ids": reader["segment_ids"],
      "mlm_positions": np.asarray(queries["mlm_positions"], np.int32),
      "mlm_targets": np.asarray(queries["mlm_targets"], np.int32),
      "mlm_weights": np.asarray(queries["mlm_weights"], np.float32),
  }
  return batch

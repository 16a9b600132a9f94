"""Where a pre-training step's retrieved blocks come from: one source per mode.

Every source turns step `s`'s masked queries (`QueryStream.batch(s)`) and
the current train state into the sharded global batch of the per-core step,
and reports each query's top-1 block (for the collapse guard):

- `HostCandidates` (retrieval="host"): the query tower on the devices, MIPS
  top (k + margin) of the served index on the host, the query's trivial
  blocks dropped, optionally re-ranked by the current document tower
  (`rerank_candidates`, Atlas-style), the reader inputs assembled on the
  host. In query-side training the frozen index's rows are the candidates'
  embeddings and travel with the batch.
- `OverlappedHostCandidates` (overlap_input=True): the same, with step s+1's
  search and assembly on a host thread while step s trains; a checkpoint
  keeps the prefetched candidates, so a restart replays them exactly.
- `DeviceCandidates` (retrieval="device"): exact search, top k and gathers
  on the devices, against a device copy of the served index.

The served index itself (builder swaps, inline refreshes, staleness) is
`index.service.IndexService`; `source_class` picks the source for a `RetrievalConfig`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.core import distributed, parallel
from realm_jax.index import bm25 as bm25_lib
from realm_jax.index import device_search, embed
from realm_jax.data import realm_inputs
from realm_jax.data import tokenizer as tokenizer_lib
from realm_jax.training.pretrain_config import RetrievalConfig


class CandidateSource:
  """What every mode shares: the run, its queries and the query tower."""

  def __init__(self, config: RetrievalConfig, model, graphdef, store,
               queries, mesh, service, trivial: realm_inputs.TrivialCandidates,
               *, batch_size: int, reader_length: int, query_side: bool):
    """`config`: the run's `RetrievalConfig`; `model`: its RealmConfig;
    `service`: the `index.service.IndexService` serving the index;
    `batch_size`, `reader_length`: the run's; `query_side`: query-side
    training (`RetrieverScheduleConfig.training`)."""
    self.config, self.model, self.store, self.queries = (config, model,
                                                         store, queries)
    self.batch_size, self.reader_length = batch_size, reader_length
    # Query-side training: the document tower never changes, so the index
    # built at the start is exact for the whole run and its rows are the
    # candidates' embeddings.
    self.query_side = query_side
    self.mesh, self.service, self.trivial = mesh, service, trivial
    self.embed_queries = embed.make_query_embedder(graphdef, mesh)
    self.bm25 = None
    self._hits, self._hits_lock = {}, threading.Lock()
    if config.lexical_candidates:
      margin = min(trivial.max_excluded, len(store) - 1)
      if len(store) - margin < self.width:
        raise ValueError(
            f"The block store has {len(store)} blocks; too few for "
            f"{config.num_candidates} dense and {config.lexical_candidates} "
            f"BM25 candidates besides a query's trivial ones "
            f"({config.trivial_candidates!r} rule): lower "
            "RetrievalConfig.lexical_candidates (0: the dense candidates "
            "alone) or num_candidates.")
      # Built once per block store and kept beside it (`bm25.for_store`).
      self.bm25 = bm25_lib.for_store(store)
      # The queries' wordpieces back to words (the cache and the store
      # share BERT's uncased vocabulary: `query_cache` checks it).
      self._vocab = tokenizer_lib.Tokenizer()

  @property
  def width(self) -> int:
    """Candidates per query (besides the null document): k (+ m)."""
    return self.config.num_candidates + self.config.lexical_candidates

  def query_texts(self, local) -> list[str]:
    """The masked queries as BM25 reads them (`masked_query_texts`)."""
    return masked_query_texts(local, self._vocab)

  def lexical_hits(self, local, n: int) -> np.ndarray:
    """int64 [b, n]: each query's first n BM25 blocks that are not
    trivial candidates, in rank order (`lexical_candidates`)."""
    return self.scored_lexical_hits(local, n)[0]

  def scored_lexical_hits(self, local, n: int
                          ) -> tuple[np.ndarray, np.ndarray]:
    """`lexical_hits` and their BM25 scores float32 [b, n]. The last two
    batches' are kept: a step's search and its prior ask for the same."""
    key = (n, np.asarray(local["query_ids"]).tobytes())
    with self._hits_lock:
      if key in self._hits:
        return self._hits[key]
    margin = min(self.trivial.max_excluded, len(self.store) - 1)
    hits, scores = self.bm25.search(self.query_texts(local),
                                    min(len(self.store), n + margin))
    ids = realm_inputs.select_candidates(
        hits, self.trivial.block_keys, self.trivial.query_keys(local), n)
    where = (hits[:, None, :] == ids[:, :, None]).argmax(-1)
    found = ids, np.take_along_axis(scores, where, 1).astype(np.float32)
    with self._hits_lock:
      self._hits[key] = found
      while len(self._hits) > 2:
        self._hits.pop(next(iter(self._hits)))
    return found

  def lexical_prior(self, local, candidates: np.ndarray
                    ) -> dict[str, np.ndarray]:
    """{"lexical_log_prior": [b, C]} when `held_prior` is "mixture" (BM25's
    distribution over the candidates, `realm_inputs.lexical_log_prior`),
    else {}."""
    if self.config.held_prior != "mixture":
      return {}
    ids, scores = self.scored_lexical_hits(local, self.width)
    return {"lexical_log_prior": realm_inputs.lexical_log_prior(
        np.asarray(candidates, np.int64), ids, scores,
        self.config.null_document)}

  def query_embeddings(self, local, state) -> jax.Array:
    """The current query tower's embeddings of this host's `local` rows."""
    q = parallel.shard_batch(self.mesh, {k: local[k] for k in
                                         ("query_ids", "query_mask")})
    return self.embed_queries(state.params, q["query_ids"], q["query_mask"])

  def start(self, state) -> None:
    """Called once the first index is served."""

  def on_serve(self, index) -> None:
    """Called with every index the service swaps in."""

  def batch(self, step: int, state) -> tuple[dict[str, jax.Array],
                                             np.ndarray]:
    """Step `step`'s sharded global batch, and this host's top-1 blocks."""
    raise NotImplementedError

  def checkpoint_meta(self, step: int) -> dict[str, Any]:
    del step
    return {}

  def restore(self, meta: dict[str, Any], step: int) -> None:
    del meta, step

  def close(self) -> None:
    pass


def masked_query_texts(queries, vocab: tokenizer_lib.Tokenizer
                       ) -> list[str]:
  """Masked queries as BM25 reads them: their wordpieces joined back into
  words, without [CLS], [SEP], [MASK] and padding."""
  special = {vocab.pad_id, vocab.cls_id, vocab.sep_id, vocab.mask_id}
  return [vocab.decode([t for t, on in zip(row, row_mask)
                        if on and int(t) not in special])
          for row, row_mask in zip(np.asarray(queries["query_ids"]),
                                   np.asarray(queries["query_mask"]))]


def bm25_recall(store, queries, gold: np.ndarray, trivial: str,
                ks=(1, 5)) -> dict[str, float]:
  """BM25's recall@k of each masked query's gold block, its trivial
  blocks excluded as the dense retriever's are: what BM25 alone would find
  (the learning benchmark reports it beside the dense retriever's)."""
  index = bm25_lib.for_store(store)
  rule = realm_inputs.TrivialCandidates(store, trivial)
  hits, _ = index.search(masked_query_texts(queries, tokenizer_lib.Tokenizer()),
                         min(len(store), max(ks) + rule.max_excluded))
  hits = realm_inputs.select_candidates(hits, rule.block_keys,
                                        rule.query_keys(queries), max(ks))
  gold = np.asarray(gold).reshape(-1, 1)
  return {f"bm25_recall@{k}": float((hits[:, :k] == gold).any(1).mean())
          for k in ks}


def lexical_union(dense: np.ndarray, lexical: np.ndarray,
                  block_keys: np.ndarray, query_keys: np.ndarray,
                  m: int) -> np.ndarray:
  """Each query's dense candidates, then its first `m` lexical hits that
  are neither trivial nor already among them.

  Args:
    dense: int [B, k] the dense candidates (trivial ones already dropped).
    lexical: int [B, R] BM25's hits in rank order.
    block_keys, query_keys: as `realm_inputs.select_candidates` takes them.
    m: lexical blocks to add per query.

  Returns:
    int64 [B, k + m], no block twice in a row, none trivial.

  Raises:
    ValueError: a query has fewer than `m` such hits (search deeper).
  """
  dense = np.asarray(dense, np.int64)
  out = np.empty((dense.shape[0], dense.shape[1] + m), np.int64)
  out[:, :dense.shape[1]] = dense
  for i, (row, hits) in enumerate(zip(dense, np.asarray(lexical, np.int64))):
    taken = set(row.tolist())
    extra = [h for h in hits.tolist() if h not in taken
             and block_keys[h] != query_keys[i]][:m]
    if len(extra) < m:
      raise ValueError(
          f"Query {i} has only {len(extra)} BM25 blocks that are neither "
          f"trivial nor dense candidates but needs {m} "
          f"(lexical_candidates); search deeper than {hits.shape[0]}.")
    out[i, dense.shape[1]:] = extra
  return out


class HostCandidates(CandidateSource):
  """Host MIPS over the served index (optionally re-ranked), with BM25's
  blocks beside them when `lexical_candidates`."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    store = self.store
    # Blocks wanted per query besides its trivial ones: the candidates, or
    # the proposals that re-ranking narrows down to them.
    r = self.config
    self.proposals = r.rerank_candidates or r.num_candidates
    margin = min(self.trivial.max_excluded, len(store) - 1)
    self.search_k = min(len(store), self.proposals + margin)
    if self.search_k - margin < self.proposals:
      raise ValueError(f"The block store has {len(store)} blocks; too few "
                       f"for {self.proposals} candidates besides a query's "
                       f"trivial ones ({r.trivial_candidates!r} rule).")
    if r.rerank_candidates:
      self.embed_documents = embed.make_embed_fn(self.model.retriever,
                                                 self.mesh)
    self.null_embedding = None  # query_side: the frozen null document's

  def start(self, state) -> None:
    if self.query_side:
      self.null_embedding = self._null_embedding(state.params)

  def _null_embedding(self, params) -> np.ndarray | None:
    """The null document's embedding by the (frozen) document tower, when
    it is scored by its embedding."""
    if not (self.config.null_document
            and self.model.retriever.null_score == "embedding"):
      return None
    m = self.store.manifest
    null = realm_inputs.null_document_inputs(
        self.store.max_block_len, int(m["cls_id"]), int(m["sep_id"]),
        int(m.get("pad_id", 0)))
    rows = len(self.mesh.local_devices)
    inputs = parallel.shard_batch(self.mesh, {
        k: np.broadcast_to(v, (rows,) + v.shape) for k, v in null.items()})
    embed_fn = embed.make_embed_fn(self.model.retriever, self.mesh)
    return parallel.local_rows(embed_fn(
        params["retriever"], inputs["token_ids"], inputs["input_mask"],
        inputs["segment_ids"]))[0]

  def search(self, local, q_emb, index, params=None) -> np.ndarray:
    """[b, k] blocks of `index` for the queries, none a trivial candidate
    (re-ranked with `params`' retriever when `rerank_candidates`)."""
    queries = parallel.local_rows(q_emb)
    hits, _ = index.search(queries, self.search_k)
    keys = self.trivial.query_keys(local)
    candidates = realm_inputs.select_candidates(
        hits, self.trivial.block_keys, keys, self.proposals)
    if self.config.rerank_candidates:
      candidates = self.rerank(queries, candidates, params)
    if self.bm25 is not None:
      candidates = lexical_union(
          candidates, self.lexical_hits(local, self.width),
          self.trivial.block_keys, keys, self.config.lexical_candidates)
    if (self.trivial.block_keys[candidates] == keys[:, None]).any():
      raise AssertionError("a trivial candidate reached a query's candidates")
    return candidates

  def rerank(self, queries: np.ndarray, proposals: np.ndarray, params
             ) -> np.ndarray:
    """The top k of each query's proposals [b, L] by the current document
    tower's embeddings (fresh inner products), in score order."""
    b, num_proposals = proposals.shape
    blocks = parallel.shard_batch(self.mesh, self.store.retriever_inputs(
        proposals.reshape(-1), self.store.max_block_len))
    documents = parallel.local_rows(self.embed_documents(
        params["retriever"], blocks["token_ids"], blocks["input_mask"],
        blocks["segment_ids"])).reshape(b, num_proposals, -1)
    scores = np.einsum("bd,bld->bl", queries, documents)
    order = np.argsort(-scores, axis=1, kind="stable")
    k = self.config.num_candidates
    return np.take_along_axis(proposals, order[:, :k], axis=1)

  def host_batch(self, local, candidates) -> dict[str, np.ndarray]:
    """This host's rows of the reader's (and retriever's) inputs."""
    c = self.config
    batch = realm_inputs.pretraining_batch(
        local, candidates, self.store, doc_len=self.store.max_block_len,
        reader_len=self.reader_length, null_document=c.null_document)
    batch.update(self.lexical_prior(local, candidates))
    if self.query_side:
      embeddings = self.service.current.embeddings[candidates.reshape(-1)]
      embeddings = np.asarray(embeddings, np.float32).reshape(
          candidates.shape + (-1,))
      if c.null_document:  # Slot 0 (unread if the null is learned).
        null = (np.zeros(embeddings.shape[-1], np.float32)
                if self.null_embedding is None else self.null_embedding)
        embeddings = np.concatenate([np.broadcast_to(
            null, (len(candidates), 1, embeddings.shape[-1])), embeddings],
                                    axis=1)
      batch["candidate_embeddings"] = embeddings
    return batch

  def batch_with_candidates(self, local, state
                            ) -> tuple[dict[str, jax.Array], np.ndarray]:
    """The sharded batch of the queries `local` with `state`'s retriever
    and the served index (also the retriever gate's held-out batch), and
    the candidates' block ids [b, k]."""
    candidates = self.search(local, self.query_embeddings(local, state),
                             self.service.current, state.params)
    return (parallel.shard_batch(self.mesh, self.host_batch(local,
                                                            candidates)),
            candidates)

  def batch_for(self, local, state) -> tuple[dict[str, jax.Array],
                                             np.ndarray]:
    """`batch_with_candidates`, with only each query's top candidate."""
    batch, candidates = self.batch_with_candidates(local, state)
    return batch, candidates[:, 0]

  def batch(self, step, state):
    return self.batch_for(self.queries.batch(step), state)


class OverlappedHostCandidates(HostCandidates):
  """Host MIPS one step ahead, on a thread, while the devices train."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # (step, future of its (host batch, candidates)).
    self._pending: tuple[int, concurrent.futures.Future] | None = None
    self._saved: dict[int, np.ndarray] = {}
    self._thread = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="pretrain-input")

  def batch(self, step, state):
    pending, self._pending = self._pending, None
    if pending is not None and pending[0] == step:
      host, candidates = pending[1].result()
    else:  # This process's first step: a restart's saved candidates (the
      # uninterrupted run's), else those of this state's retriever.
      local = self.queries.batch(step)
      candidates = self._saved.pop(step, None)
      if candidates is None:
        candidates = self.search(local, self.query_embeddings(local, state),
                                 self.service.current)
      host = self.host_batch(local, candidates)
    # The next step's queries are embedded now, before this step's update
    # is dispatched (so the devices do it first); the host waits for them,
    # searches and assembles on the thread while the devices train.
    nxt = self.queries.batch(step + 1)
    q_emb, index = self.query_embeddings(nxt, state), self.service.current

    def work():
      candidates = self.search(nxt, q_emb, index)
      return self.host_batch(nxt, candidates), candidates

    self._pending = (step + 1, self._thread.submit(work))
    return parallel.shard_batch(self.mesh, host), candidates[:, 0]

  def checkpoint_meta(self, step: int) -> dict[str, Any]:
    """The prefetched candidates of `step` (the first step after checkpoint
    `step`), every host's rows in global order, so a restart replays them."""
    if self._pending is None or self._pending[0] != step:
      return {}
    _, candidates = self._pending[1].result()
    return {"prefetched_candidates": {
        "step": step,
        "ids": distributed.allgather_rows(candidates).tolist()}}

  def restore(self, meta: dict[str, Any], step: int) -> None:
    """Takes this host's rows of a checkpoint's prefetched candidates."""
    saved = meta.get("prefetched_candidates")
    if not (saved and saved["step"] == step):
      return
    ids = np.asarray(saved["ids"], np.int64)
    b, k, hosts = (self.batch_size, self.width, jax.process_count())
    if ids.shape != (b, k):
      logging.warning("checkpoint %d's prefetched candidates have shape %s, "
                      "not this run's %s; searching them again.", step,
                      ids.shape, (b, k))
      return
    me = jax.process_index()
    self._saved[step] = ids[me * b // hosts:(me + 1) * b // hosts]

  def close(self) -> None:
    self._thread.shutdown(wait=True, cancel_futures=True)


class DeviceCandidates(CandidateSource):
  """Exact search and gathers on the devices (`index.device_search`)."""

  device_index = None  # The served index's device copy.

  def on_serve(self, index) -> None:
    if self.device_index is None:
      self.device_index = device_search.DeviceIndex.build(
          self.store, index.embeddings, self.mesh,
          dtype=jnp.dtype(self.config.device_index_dtype),
          block_keys=self.trivial.block_keys)
    else:  # The tokens stay on the devices; only the embeddings change.
      self.device_index = self.device_index.with_embeddings(index.embeddings)

  def batch(self, step, state):
    c = self.config
    local = self.queries.batch(step)
    batch, block_ids = device_search.candidate_batch(
        self.device_index, local, self.query_embeddings(local, state),
        k=c.num_candidates, doc_len=self.store.max_block_len,
        reader_len=self.reader_length, null_document=c.null_document,
        query_keys=self.trivial.query_keys(local),
        # BM25's hits enter as inputs; the union is made on the devices.
        lexical_ids=(self.lexical_hits(local, self.width)
                     if self.bm25 is not None else None),
        lexical_k=c.lexical_candidates)
    if c.held_prior == "mixture":
      ids, scores = self.scored_lexical_hits(local, self.width)
      hits = parallel.shard_batch(self.mesh, {"ids": ids.astype(np.int32),
                                              "scores": scores})
      batch = dict(batch, lexical_log_prior=_device_lexical_prior(
          block_ids, hits["ids"], hits["scores"], c.null_document))
    return batch, block_ids[:, 0]


@functools.partial(jax.jit, static_argnums=3)
def _device_lexical_prior(candidates, hit_ids, hit_scores, null_document):
  """`realm_inputs.lexical_log_prior` on the devices (row by row, so each
  device computes its own rows)."""
  return realm_inputs.lexical_log_prior(candidates, hit_ids, hit_scores,
                                        null_document, xp=jnp)


def source_class(config: RetrievalConfig) -> type[CandidateSource]:
  """The candidate source of a run's `RetrievalConfig`."""
  if config.search == "device":
    return DeviceCandidates
  return (OverlappedHostCandidates if config.overlap_input
          else HostCandidates)

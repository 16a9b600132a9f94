"""Retrieval and REALM batch assembly on the accelerators.

The host path of a REALM step copies query embeddings to the host, searches
there, gathers block tokens from the memory-mapped store and builds the batch
in numpy (`realm_jax.data.realm_inputs`). Here all of that runs on the
devices: a `DeviceIndex` keeps, sharded by rows over the mesh's `data` axis,

- the block embeddings (float32 or bfloat16),
- every block's untruncated retriever input `[CLS] title [SEP] body [SEP]`
  (uint16 when the vocabulary fits, else int32) with its title and body
  lengths, from which the retriever input of any length and the reader body
  are cut,
- every block's article hash (int64 as two int32 words), to drop the query's
  own article,

rows padded to a multiple of the device count (padded rows score -inf).

`search` is an exact top-k per device then a top-k of the devices' top-k's;
ties go to the lower block id, so the ids equal the host exact searcher's.
`candidate_batch` also masks the query's own article before the top-k, which
gives exactly `select_candidates`' first k allowed hits without a margin of
extra hits, and assembles `realm_inputs.pretraining_batch`'s arrays: each
device gathers the candidate rows it owns and a `psum_scatter` hands every
device the rows of its own slice of the batch.
"""

from __future__ import annotations

import functools
from typing import Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from realm_jax.core import parallel
from realm_jax.core.parallel import BATCH, DATA_AXIS, REPLICATED

_QUERY_KEYS = ("query_ids", "query_mask", "mlm_positions", "mlm_targets",
               "mlm_weights")
_CHUNK = 1 << 15  # blocks per host read when building the token table


@flax.struct.dataclass
class DeviceIndex:
  """Block embeddings, tokens and articles, row-sharded over `data`.

  Attributes:
    embeddings: [P, D] float32 or bfloat16 (P = rows padded to the device
      count; row i = block i).
    tokens: uint16/int32 [P, M] `[CLS] title [SEP] body [SEP]`, padded.
    lengths: int32 [P, 2] title and body lengths in wordpieces.
    doc_hash: int32 [P, 2] each block's article hash, split in two words.
  """
  embeddings: jax.Array
  tokens: jax.Array
  lengths: jax.Array
  doc_hash: jax.Array
  num_rows: int = flax.struct.field(pytree_node=False)
  cls_id: int = flax.struct.field(pytree_node=False)
  sep_id: int = flax.struct.field(pytree_node=False)
  pad_id: int = flax.struct.field(pytree_node=False)
  mesh: Mesh = flax.struct.field(pytree_node=False)

  @classmethod
  def build(cls, store, embeddings: np.ndarray, mesh: Mesh,
            dtype=jnp.float32, block_keys=None) -> DeviceIndex:
    """Uploads a `BlockStore`'s tokens and `embeddings` [len(store), D].

    `block_keys` int64 [len(store)]: the no-trivial-retrieval keys
    (`realm_inputs.TrivialCandidates.block_keys`; default the articles'
    hashes)."""
    n, m = len(store), store.max_block_len
    vocab = int(store.manifest.get("vocab_size", 1 << 31))
    tokens = np.empty((n, m), np.uint16 if vocab <= 1 << 16 else np.int32)
    lengths = np.empty((n, 2), np.int32)
    for start in range(0, n, _CHUNK):
      rows = slice(start, min(start + _CHUNK, n))
      x = store.retriever_inputs(np.arange(rows.start, rows.stop), m)
      tokens[rows] = x["token_ids"]
      body = x["segment_ids"].sum(1)  # body [SEP]
      lengths[rows, 0] = x["input_mask"].sum(1) - body - 2
      lengths[rows, 1] = body - 1
    doc_hash = _hash_words(store.doc_hash if block_keys is None
                           else block_keys)
    m = store.manifest
    index = cls(None, _put(mesh, tokens), _put(mesh, lengths),
                _put(mesh, doc_hash), n, int(m["cls_id"]), int(m["sep_id"]),
                int(m.get("pad_id", 0)), mesh)
    return index.with_embeddings(embeddings, dtype)

  def with_embeddings(self, embeddings: np.ndarray,
                      dtype=None) -> DeviceIndex:
    """This index with new block embeddings (an index refresh); the token
    tables stay on the devices. `dtype` defaults to the current one."""
    embeddings = np.asarray(embeddings)
    if embeddings.ndim != 2 or embeddings.shape[0] != self.num_rows:
      raise ValueError(
          f"embeddings must be [{self.num_rows}, dim] (one row per block of "
          f"the store), got shape {embeddings.shape}.")
    if dtype is None:
      dtype = self.embeddings.dtype
    return self.replace(embeddings=_put(self.mesh, embeddings, dtype))


def _hash_words(doc_hash) -> np.ndarray:
  """int64 [n] article hashes as int32 [n, 2] (devices run without x64)."""
  return np.ascontiguousarray(
      np.asarray(doc_hash, np.int64).reshape(-1, 1)).view(np.int32)


def _put(mesh: Mesh, x: np.ndarray, dtype=None) -> jax.Array:
  """`x` row-sharded over `data`, rows zero-padded to the device count."""
  n, d = x.shape[0], mesh.shape[DATA_AXIS]
  shape = (-(-n // d) * d,) + x.shape[1:]
  dtype = np.dtype(dtype or x.dtype)

  def shard(index):
    start, stop, _ = index[0].indices(shape[0])
    out = np.zeros((stop - start,) + shape[1:], dtype)
    out[:max(0, min(stop, n) - start)] = x[start:stop]
    return out

  return jax.make_array_from_callback(shape, parallel.data_sharded(mesh),
                                      shard)


def _top_k(index: DeviceIndex, embeddings, doc_hash, queries, exclude, k,
           approx):
  """Per device: top-k [B, k] (ids, scores) of all queries over all rows."""
  n_loc = embeddings.shape[0]
  offset = jax.lax.axis_index(DATA_AXIS) * n_loc
  # HIGHEST: TPUs and GPUs would otherwise multiply in bf16 / tf32.
  scores = jnp.matmul(queries.astype(jnp.float32),
                      embeddings.astype(jnp.float32).T,
                      precision=jax.lax.Precision.HIGHEST)
  row_ids = offset + jnp.arange(n_loc, dtype=jnp.int32)
  keep = (row_ids < index.num_rows)[None, :]
  if exclude is not None:
    keep = keep & (doc_hash[None] != exclude[:, None]).any(-1)
  scores = jnp.where(keep, scores, -jnp.inf)
  kk = min(k, n_loc)
  if approx:
    scores, pos = jax.lax.approx_max_k(scores, kk)
  else:
    scores, pos = jax.lax.top_k(scores, kk)
  # Devices hold ascending row ranges, and top_k puts the lower index first
  # on ties, so the merged ties keep the lower id.
  scores = jax.lax.all_gather(scores, DATA_AXIS, axis=1, tiled=True)
  ids = jax.lax.all_gather(row_ids[pos], DATA_AXIS, axis=1, tiled=True)
  scores, pos = jax.lax.top_k(scores, k)
  return jnp.take_along_axis(ids, pos, axis=1), scores


@functools.partial(jax.jit, static_argnames=("k", "approx"))
def search(index: DeviceIndex, query_emb: jax.Array, k: int,
           approx: bool = False) -> tuple[jax.Array, jax.Array]:
  """Top-k blocks of queries [B, D]: replicated (ids int32, scores) [B, k].

  `approx` uses `jax.lax.approx_max_k` per device (pays on TPU).
  """
  def per_device(emb, queries):
    return _top_k(index, emb, None, queries, None, k, approx)

  # The merge sees every device's top-k, so all devices hold the same
  # result; shard_map cannot infer that through all_gather.
  return jax.shard_map(per_device, mesh=index.mesh,
                       in_specs=(BATCH, REPLICATED),
                       out_specs=(REPLICATED, REPLICATED), check_vma=False)(
                           index.embeddings, query_emb)


def _retriever_inputs(tok, tl, bl, seq_len, sep_id, pad_id):
  """`[CLS] title [SEP] body [SEP]` cut to `seq_len` like
  `BlockStore.retriever_inputs` (body first, then title)."""
  j = jnp.arange(seq_len)
  t = jnp.minimum(tl, seq_len - 3)[..., None]
  end = t + jnp.minimum(bl[..., None], seq_len - 3 - t) + 3
  src = jnp.where(j <= t, j, j + tl[..., None] - t)
  val = jnp.take_along_axis(tok, jnp.minimum(src, tok.shape[-1] - 1), -1)
  ids = jnp.where(j < end, jnp.where((j == t + 1) | (j == end - 1), sep_id,
                                     val), pad_id)
  return ids, (j < end).astype(jnp.int32), (
      (j >= t + 2) & (j < end)).astype(jnp.int32)


def _reader_inputs(q_ids, q_mask, tok, tl, bl, doc_len, seq_len, sep_id,
                   pad_id):
  """`[CLS] x [SEP] body [SEP]` like `realm_inputs.reader_inputs`, with the
  body (cut to `doc_len`) read from the block rows."""
  q_len = q_mask.sum(-1)[:, None, None]
  j = jnp.arange(seq_len)
  b_len = jnp.minimum(jnp.minimum(bl, doc_len)[..., None],
                      seq_len - 1 - q_len)
  pos = j - q_len
  in_query, final = j < q_len, pos == b_len
  in_body = (pos >= 0) & (pos < b_len)
  q = jnp.take_along_axis(
      q_ids, jnp.broadcast_to(jnp.minimum(j, q_ids.shape[1] - 1),
                              (q_ids.shape[0], seq_len)), 1)[:, None]
  body = jnp.take_along_axis(
      tok, jnp.clip(tl[..., None] + 2 + pos, 0, tok.shape[-1] - 1), -1)
  ids = jnp.where(in_query, q, jnp.where(in_body, body, jnp.where(
      final, sep_id, pad_id)))
  return ids, (in_query | in_body | final).astype(jnp.int32), (
      in_body | final).astype(jnp.int32)


def candidate_batch(index: DeviceIndex, queries: Mapping[str, np.ndarray],
                    query_emb: jax.Array, *, k: int, doc_len: int = 288,
                    reader_len: int = 384, null_document: bool = True,
                    approx: bool = False, query_keys=None,
                    lexical_ids: np.ndarray | None = None,
                    lexical_k: int = 0
                   ) -> tuple[dict[str, jax.Array], jax.Array]:
  """`pretraining_batch(select_candidates(search(...)))` on the devices.

  Args:
    index: the corpus.
    queries: this process's rows of the stacked REALM queries
      (`_QUERY_KEYS` and the int64 `source_doc_hash`), a multiple of its
      device count.
    query_emb: float [B, D] query embeddings of the global batch (sharded
      over `data` or not).
    k, doc_len, reader_len, null_document: as in `realm_inputs`.
    approx: approximate per-device top-k (see `search`).
    query_keys: int64 [b] the queries' no-trivial-retrieval keys, matched
      against the index's block keys (default `source_doc_hash`).
    lexical_ids: int [b, R] this process's queries' BM25 hits in rank
      order, trivial ones already dropped (`RetrievalConfig.
      lexical_candidates`); the first `lexical_k` of each row that are not
      among its dense top k follow them as candidates (R >= k +
      lexical_k makes that always possible).
    lexical_k: m, BM25's candidates per query (0: none).

  Returns:
    (`realm_inputs.pretraining_batch`'s dict (same keys, shapes and dtypes),
    the candidates' block ids int32 [B, k (+ m)] in rank order, dense
    first), every array sharded over `data` on its leading axis.
  """
  batch, width = np.shape(queries["query_ids"])
  devices = index.mesh.shape[DATA_AXIS] // jax.process_count()
  if batch % devices:
    raise ValueError(f"Batch size {batch} must be a multiple of the "
                     f"{devices} devices of the mesh.")
  if width >= reader_len:
    raise ValueError(f"Reader length {reader_len} leaves no room for a "
                     f"document after queries of {width} tokens.")
  if doc_len < 3:
    raise ValueError(f"doc_len must be >= 3, got {doc_len}.")
  local = {name: np.asarray(queries[name]) for name in _QUERY_KEYS}
  local["source_doc_hash"] = _hash_words(
      queries["source_doc_hash"] if query_keys is None else query_keys)
  if lexical_k:
    if lexical_ids is None or np.shape(lexical_ids)[1] < k + lexical_k:
      raise ValueError(f"lexical_k={lexical_k} needs lexical_ids of at "
                       f"least k + lexical_k = {k + lexical_k} hits a row.")
    local["lexical_ids"] = np.asarray(lexical_ids, np.int32)
  sharded = parallel.shard_batch(index.mesh, local)
  query_hash = sharded.pop("source_doc_hash")
  lexical = sharded.pop("lexical_ids", None)
  return _candidate_batch(
      index, sharded, query_emb, query_hash, lexical, k=k, doc_len=doc_len,
      reader_len=reader_len, null_document=null_document, approx=approx,
      lexical_k=lexical_k)


def _with_lexical(ids: jax.Array, lexical: jax.Array, m: int) -> jax.Array:
  """[B, k + m]: the dense ids, then each row's first m lexical hits that
  are not among them (`candidates.lexical_union` on the devices)."""
  fresh = ~(lexical[:, :, None] == ids[:, None, :]).any(-1)
  r = lexical.shape[1]
  order = jnp.where(fresh, 0, r) + jnp.arange(r)[None, :]
  first = jnp.argsort(order, axis=1)[:, :m]
  return jnp.concatenate([ids, jnp.take_along_axis(lexical, first, 1)], 1)


@functools.partial(jax.jit, static_argnames=(
    "k", "doc_len", "reader_len", "null_document", "approx", "lexical_k"))
def _candidate_batch(index, queries, query_emb, query_hash, lexical, *, k,
                     doc_len, reader_len, null_document, approx, lexical_k):
  """The jitted body of `candidate_batch`."""
  def per_device(emb, tokens, lengths, doc_hash, q, q_emb, q_hash, lex):
    ids, _ = _top_k(index, emb, doc_hash,
                    jax.lax.all_gather(q_emb, DATA_AXIS, tiled=True),
                    jax.lax.all_gather(q_hash, DATA_AXIS, tiled=True),
                    k, approx)
    if lexical_k:
      ids = _with_lexical(ids, jax.lax.all_gather(lex, DATA_AXIS,
                                                  tiled=True), lexical_k)
    # Each device fills the candidate rows it owns; the sum over devices,
    # scattered by batch rows, gives each device its queries' rows.
    n_loc = tokens.shape[0]
    local = ids - jax.lax.axis_index(DATA_AXIS) * n_loc
    own = ((local >= 0) & (local < n_loc))[..., None]
    local = jnp.clip(local, 0, n_loc - 1)
    rows = jnp.concatenate([tokens[local].astype(jnp.int32), lengths[local]],
                           -1) * own
    rows = jax.lax.psum_scatter(rows, DATA_AXIS, tiled=True)  # [b, k, M+2]
    if null_document:  # [CLS] [SEP] [SEP]: a block with no title and body.
      null = jnp.zeros_like(rows[:, :1]).at[..., 0].set(index.cls_id)
      rows = jnp.concatenate([null, rows], 1)
    m = tokens.shape[1]
    tok, tl, bl = rows[..., :m], rows[..., m], rows[..., m + 1]
    cand = _retriever_inputs(tok, tl, bl, doc_len, index.sep_id,
                             index.pad_id)
    reader = _reader_inputs(q["query_ids"].astype(jnp.int32),
                            q["query_mask"].astype(jnp.int32), tok, tl, bl,
                            doc_len, reader_len, index.sep_id, index.pad_id)
    out = {name: q[name].astype(jnp.int32) for name in _QUERY_KEYS}
    out["mlm_weights"] = q["mlm_weights"].astype(jnp.float32)
    out.update(zip(("candidate_ids", "candidate_mask",
                    "candidate_segment_ids"), cand))
    out.update(zip(("reader_ids", "reader_mask", "reader_segment_ids"),
                   reader))
    b_loc = q["query_ids"].shape[0]
    own_ids = jax.lax.dynamic_slice_in_dim(
        ids, jax.lax.axis_index(DATA_AXIS) * b_loc, b_loc)
    return out, own_ids

  if lexical is None:  # (A placeholder the body never reads.)
    lexical = jnp.zeros_like(query_hash[..., :1], jnp.int32)
  return jax.shard_map(per_device, mesh=index.mesh,
                       in_specs=(BATCH,) * 8, out_specs=(BATCH, BATCH))(
                           index.embeddings, index.tokens, index.lengths,
                           index.doc_hash, queries, query_emb, query_hash,
                           lexical)

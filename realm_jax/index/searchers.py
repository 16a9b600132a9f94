"""Maximum inner product search (MIPS) over the block embeddings.

REALM's retriever scores a query x against every block z of the corpus with
f(x, z) = Embed(x) . Embed(z); the trainer and the QA jobs only need the top
k blocks, so the block embeddings [N, D] are put behind a `Searcher`:

  searcher = build_searcher(block_embeddings, kind="scann")
  ids, scores = searcher.search_batched(query_embeddings, k=8)
  searcher.save(path); searcher = load_searcher(path)

Three searchers share that interface:

- `ExactSearcher`: brute force. numpy (blocked float32 matmul + a running
  top-k, memory bounded by the block size) or JAX (`backend="jax"`: a jitted
  scan over corpus chunks, `jax.lax.top_k`, merge). The reference for recall.
- `ScannSearcher`: ScaNN's tree (k-means partitions) + asymmetric hashing
  (anisotropic quantization) + exact re-ordering of the best candidates.
  `ORQA_SCANN_CONFIG` is the setting of the released ORQA/REALM code.
- `ShardedSearcher`: one searcher per contiguous row range, top-k of the
  shards' top-k; ids are global row ids. For corpora that are built (or
  embedded) shard by shard.

Results: `ids` int64 [Q, k] (row i of the embedding matrix = block i) and
`scores` float32 [Q, k], sorted by descending inner product; among equal
scores the smaller id comes first (ties at the k-th place may be cut either
way). ScaNN can find fewer than k rows when the partitions it searches hold
fewer than k; the missing slots are id -1 with score -inf.

Every searcher saves to a directory holding `searcher.json` (kind, config,
rows, dim and the searcher-specific fields) next to its data, written to a
temporary directory and renamed into place only when complete;
`load_searcher` dispatches on that file.

This module is the public entry point and holds the exact and sharded
searchers; `search_base` has the configs, the interface, the input checks
and the format, `scann_search` the ScaNN searcher. The kinds a directory
may hold are the `SEARCHERS` table below, written out rather than filled by
registration on import, so that loading never depends on import order.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Mapping, Type

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.core import io_utils
from realm_jax.index import search_base
from realm_jax.index.scann_search import ScannSearcher
from realm_jax.index.search_base import (FORMAT_VERSION, METADATA_FILE,
                                         ORQA_SCANN_CONFIG, SHARD_CONFIGS,
                                         ExactConfig, ScannConfig,
                                         ShardConfig, ShardedConfig, Searcher,
                                         as_config, check_embeddings,
                                         sort_top_k)

__all__ = [
    "FORMAT_VERSION", "METADATA_FILE", "ORQA_SCANN_CONFIG", "ExactConfig",
    "ExactSearcher", "ScannConfig", "ScannSearcher", "Searcher",
    "ShardConfig", "ShardedConfig", "ShardedSearcher", "build_searcher",
    "check_embeddings", "load_searcher", "read_metadata",
]


# -----------------------------------------------------------------------------
# Exact search: numpy or JAX; the reference for recall.
# -----------------------------------------------------------------------------

EMBEDDINGS_FILE = "embeddings.npy"


def _numpy_top_k(embeddings: np.ndarray, queries: np.ndarray, k: int,
                 rows_per_block: int) -> tuple[np.ndarray, np.ndarray]:
  """Exact top-k of queries [q, D] over embeddings [N, D] with numpy."""
  num_queries = queries.shape[0]
  num_rows = embeddings.shape[0]
  # Sorted best-so-far per query; -inf/-1 until k rows have been seen.
  best_scores = np.full((num_queries, k), -np.inf, np.float32)
  best_ids = np.full((num_queries, k), -1, np.int64)
  query_index = np.arange(num_queries)
  # A small first block sets every query's k-th best cheaply (it is the one
  # block that needs a full argpartition); the rest mostly need only the
  # comparison below.
  first = min(rows_per_block, max(8 * k, 2048))
  bounds = [0, *range(first, num_rows, rows_per_block), num_rows]
  for start, stop in zip(bounds[:-1], bounds[1:]):
    block = np.asarray(embeddings[start:stop])
    scores = queries @ block.T  # [q, rows]
    # Only rows beating a query's current k-th best can enter its top k.
    # After the first blocks that is a handful of entries, and the
    # comparison + nonzero costs far less than a per-row argpartition.
    # Strict ">" keeps the earlier (smaller) id on equal scores. flatnonzero
    # + divmod: 2-D np.nonzero is ~7x slower here.
    hit_queries, hit_rows = np.divmod(
        np.flatnonzero(scores > best_scores[:, -1:]), scores.shape[1])
    if hit_queries.size == 0:
      continue
    if hit_queries.size > 4 * k * num_queries:
      # Many hits (the first block): cut each query to its block top-k.
      kk = min(k, scores.shape[1])
      part = np.argpartition(scores, scores.shape[1] - kk, axis=1)[:, -kk:]
      hit_queries = np.repeat(query_index, kk)
      hit_rows = part.reshape(-1)
    hit_scores = scores[hit_queries, hit_rows]
    # Merge hits with the current best: sort by (query, -score, id) and keep
    # the first k of every query (each query has >= k entries, its best).
    all_queries = np.concatenate([np.repeat(query_index, k), hit_queries])
    all_scores = np.concatenate([best_scores.reshape(-1), hit_scores])
    all_ids = np.concatenate([best_ids.reshape(-1), hit_rows + start])
    id_key = np.where(all_ids < 0, np.iinfo(np.int64).max, all_ids)
    order = np.lexsort((id_key, -all_scores, all_queries))
    counts = np.bincount(all_queries, minlength=num_queries)
    group_starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    take = order[group_starts[:, None] + np.arange(k)]
    best_scores = all_scores[take]
    best_ids = all_ids[take]
  return best_ids, best_scores


@functools.partial(jax.jit, static_argnames=("k",))
def _jax_top_k(queries: jax.Array, blocks: jax.Array, num_rows: jax.Array,
               k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of queries [q, D] over blocks [B, R, D] (rows >= num_rows
  are padding)."""
  num_queries = queries.shape[0]
  rows_per_block = blocks.shape[1]
  block_k = min(k, rows_per_block)
  row_offsets = jnp.arange(rows_per_block, dtype=jnp.int32)

  def merge_block(carry, inputs):
    best_scores, best_ids = carry
    block, start = inputs
    # HIGHEST: TPUs and GPUs would otherwise multiply in bf16 / tf32.
    scores = jnp.matmul(queries, block.T, precision=jax.lax.Precision.HIGHEST)
    row_ids = start + row_offsets
    scores = jnp.where(row_ids[None, :] < num_rows, scores, -jnp.inf)
    block_scores, block_pos = jax.lax.top_k(scores, block_k)
    # top_k puts the lower index first on ties, and the carried best (lower
    # ids) comes first in the concatenation, so ties keep the smaller id.
    scores = jnp.concatenate([best_scores, block_scores], axis=1)
    ids = jnp.concatenate([best_ids, row_ids[block_pos]], axis=1)
    best_scores, pos = jax.lax.top_k(scores, k)
    return (best_scores, jnp.take_along_axis(ids, pos, axis=1)), None

  init = (jnp.full((num_queries, k), -jnp.inf, jnp.float32),
          jnp.full((num_queries, k), -1, jnp.int32))
  starts = jnp.arange(blocks.shape[0], dtype=jnp.int32) * rows_per_block
  (scores, ids), _ = jax.lax.scan(merge_block, init, (blocks, starts))
  return ids, scores


class ExactSearcher(Searcher):
  """Brute-force inner product search (numpy or JAX)."""

  kind = "exact"
  config_class = ExactConfig
  config: ExactConfig

  def __init__(self, embeddings: np.ndarray, config: ExactConfig):
    super().__init__(config, embeddings.shape[0], embeddings.shape[1])
    self.embeddings = embeddings
    self.rows_per_block = config.rows_per_block or (
        8192 if config.backend == "jax" else 32768)
    self._device_blocks = None
    if config.backend == "jax":
      self._device_blocks = self._to_device(embeddings)

  def _to_device(self, embeddings: np.ndarray) -> jax.Array:
    # Padded to whole blocks so one compiled scan serves every query batch.
    rows = min(self.rows_per_block, self.num_rows)
    num_blocks = -(-self.num_rows // rows)
    padded = np.zeros((num_blocks * rows, self.dim), np.float32)
    padded[:self.num_rows] = embeddings
    return jnp.asarray(padded.reshape(num_blocks, rows, self.dim))

  @classmethod
  def build(cls, embeddings: np.ndarray,
            config: ExactConfig | Mapping[str, Any] | None = None
           ) -> "ExactSearcher":
    """Wraps `embeddings` (no copy for numpy; a device copy for JAX)."""
    config = as_config(ExactConfig, config)
    return cls(check_embeddings(embeddings), config)

  def _search(self, queries, k):
    per_block = self.config.queries_per_block
    ids = np.empty((queries.shape[0], k), np.int64)
    scores = np.empty((queries.shape[0], k), np.float32)
    for start in range(0, queries.shape[0], per_block):
      chunk = queries[start:start + per_block]
      if self._device_blocks is None:
        chunk_ids, chunk_scores = _numpy_top_k(
            self.embeddings, chunk, k, self.rows_per_block)
      else:
        chunk_ids, chunk_scores = self._jax_search(chunk, k)
      ids[start:start + len(chunk)] = chunk_ids
      scores[start:start + len(chunk)] = chunk_scores
    return ids, scores

  def _jax_search(self, queries, k):
    # Pad the query count to a power of two (<= queries_per_block) so a few
    # compiled shapes serve every batch size.
    num_queries = queries.shape[0]
    padded_size = min(max(8, 1 << (num_queries - 1).bit_length()),
                      max(self.config.queries_per_block, num_queries))
    padded = np.zeros((padded_size, self.dim), np.float32)
    padded[:num_queries] = queries
    ids, scores = _jax_top_k(jnp.asarray(padded), self._device_blocks,
                             jnp.int32(self.num_rows), k=k)
    ids, scores = jax.device_get((ids, scores))
    return ids[:num_queries], scores[:num_queries]

  def _write(self, directory):
    io_utils.save_npy(os.path.join(directory, EMBEDDINGS_FILE),
                      np.asarray(self.embeddings))
    return {"embeddings_file": EMBEDDINGS_FILE}

  @classmethod
  def _read(cls, directory, metadata):
    config = ExactConfig.from_dict(metadata["config"])
    # Memory-mapped: a 13M x 128 corpus is 6.8 GB that the numpy backend
    # streams block by block instead of holding in RAM.
    embeddings = search_base.load_embeddings(search_base.member(
        directory, metadata["embeddings_file"], "embeddings_file"))
    return cls(embeddings, config)


# -----------------------------------------------------------------------------
# Sharded search: one searcher per contiguous row range, top-k of top-k's.
# -----------------------------------------------------------------------------


class ShardedSearcher(Searcher):
  """One searcher per contiguous row range; results merged by score.

  Attributes:
    shards: the searchers, shard s holding rows row_offsets[s] ..
      row_offsets[s + 1] - 1 of the corpus as its rows 0, 1, ...
    row_offsets: int64 [num_shards + 1].
  """

  kind = "sharded"
  config_class = ShardedConfig
  config: ShardedConfig

  def __init__(self, shards: list[Searcher], row_offsets: np.ndarray,
               config: ShardedConfig):
    row_offsets = np.asarray(row_offsets, np.int64)
    if len(shards) + 1 != len(row_offsets) or np.any(
        np.diff(row_offsets) != [s.num_rows for s in shards]):
      raise ValueError(
          f"row_offsets {row_offsets.tolist()} do not match the shard sizes "
          f"{[s.num_rows for s in shards]}.")
    dims = {s.dim for s in shards}
    if len(dims) != 1:
      raise ValueError(f"shards have different dims {sorted(dims)}.")
    super().__init__(config, int(row_offsets[-1]), dims.pop())
    self.shards = shards
    self.row_offsets = row_offsets

  @classmethod
  def build(cls, embeddings: np.ndarray,
            config: ShardedConfig | ShardConfig | Mapping[str, Any] |
            None = None,
            num_shards: int | None = None) -> "ShardedSearcher":
    """Splits `embeddings` into contiguous row ranges, one searcher each.

    `config` is a ShardedConfig (or its dict), or the config of every shard
    (ExactConfig / ScannConfig) with `num_shards`, which overrides
    config.num_shards when given. Ids are global row ids.
    """
    if isinstance(config, ExactConfig):
      config = ShardedConfig(shard_kind="exact", shard_config=config)
    elif isinstance(config, ScannConfig):
      config = ShardedConfig(shard_kind="scann", shard_config=config)
    config = as_config(ShardedConfig, config)
    if num_shards is not None:
      config = dataclasses.replace(config, num_shards=num_shards)
    embeddings = check_embeddings(embeddings)
    num_rows = embeddings.shape[0]
    if config.num_shards > num_rows:
      raise ValueError(
          f"num_shards={config.num_shards} exceeds the {num_rows} rows; use "
          "at most one shard per row.")
    row_offsets = np.array(
        [s * num_rows // config.num_shards
         for s in range(config.num_shards + 1)], np.int64)
    shard_class = SEARCHERS[config.shard_kind]
    shards = [
        shard_class.build(embeddings[row_offsets[s]:row_offsets[s + 1]],
                          config.shard_config)
        for s in range(config.num_shards)
    ]
    return cls(shards, row_offsets, config)

  def _search(self, queries, k):
    all_ids, all_scores = [], []
    for shard, offset in zip(self.shards, self.row_offsets[:-1]):
      ids, scores = shard.search_batched(queries, min(k, shard.num_rows))
      all_ids.append(np.where(ids < 0, -1, ids + offset))
      all_scores.append(scores)
    return sort_top_k(np.concatenate(all_ids, axis=1),
                       np.concatenate(all_scores, axis=1), k)

  def _write(self, directory):
    shard_dirs = []
    for s, shard in enumerate(self.shards):
      name = f"shard_{s:05d}"
      shard.save(os.path.join(directory, name))
      shard_dirs.append(name)
    return {"shard_dirs": shard_dirs,
            "row_offsets": self.row_offsets.tolist()}

  @classmethod
  def _read(cls, directory, metadata):
    config = ShardedConfig.from_dict(metadata["config"])
    shards = [load_searcher(search_base.member(directory, name,
                                               "shard_dirs"))
              for name in metadata["shard_dirs"]]
    return cls(shards, np.asarray(metadata["row_offsets"]), config)


# -----------------------------------------------------------------------------
# The entry point.
# -----------------------------------------------------------------------------

# kind (as saved in searcher.json) -> class.
SEARCHERS: dict[str, Type[Searcher]] = {
    "exact": ExactSearcher, "scann": ScannSearcher,
    "sharded": ShardedSearcher}


def read_metadata(directory: str) -> dict[str, Any]:
  """`search_base.read_metadata`, refusing an unknown searcher kind."""
  metadata = search_base.read_metadata(directory)
  if metadata["kind"] not in SEARCHERS:
    raise ValueError(
        f"{os.path.join(directory, METADATA_FILE)}: unknown searcher kind "
        f"{metadata['kind']!r}; known kinds are {sorted(SEARCHERS)}.")
  return metadata


def load_searcher(directory: str) -> Searcher:
  """Opens any searcher written by `Searcher.save` (ValueError if none)."""
  return SEARCHERS[read_metadata(directory)["kind"]].load(directory)


def build_searcher(embeddings: np.ndarray, kind: str = "scann",
                   num_shards: int = 1, **config: Any) -> Searcher:
  """Builds a searcher over `embeddings`.

  Args:
    embeddings: float32 [N, D], row i = block i.
    kind: "scann" or "exact".
    num_shards: > 1 splits the corpus into that many row ranges, one searcher
      of `kind` each (a ShardedSearcher).
    **config: fields of ScannConfig / ExactConfig.
  """
  if kind not in SHARD_CONFIGS:
    raise ValueError(
        f"kind must be one of {sorted(SHARD_CONFIGS)}, got {kind!r}.")
  shard_config = SHARD_CONFIGS[kind].from_dict(config)
  if num_shards == 1:
    return SEARCHERS[kind].build(embeddings, shard_config)
  return ShardedSearcher.build(
      embeddings, ShardedConfig(num_shards=num_shards, shard_kind=kind,
                                shard_config=shard_config))

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

This module is the public entry point; the code lives in `search_configs`
(the configs), `search_base` (the interface, input checks, the format),
`exact_search`, `scann_search` and `sharded_search`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from realm_jax.index.exact_search import ExactSearcher
from realm_jax.index.scann_search import ScannSearcher
from realm_jax.index.search_base import (FORMAT_VERSION, METADATA_FILE,
                                         SEARCHERS, Searcher,
                                         check_embeddings, load_searcher,
                                         read_metadata)
from realm_jax.index.search_configs import (ORQA_SCANN_CONFIG, SHARD_CONFIGS,
                                            ExactConfig, ScannConfig,
                                            ShardConfig, ShardedConfig)
from realm_jax.index.sharded_search import ShardedSearcher

__all__ = [
    "FORMAT_VERSION", "METADATA_FILE", "ORQA_SCANN_CONFIG", "ExactConfig",
    "ExactSearcher", "ScannConfig", "ScannSearcher", "Searcher",
    "ShardConfig", "ShardedConfig", "ShardedSearcher", "build_searcher",
    "check_embeddings", "load_searcher", "read_metadata",
]


def build_searcher(embeddings: np.ndarray, kind: str = "scann",
                   num_shards: int = 1, **config: Any) -> Searcher:
  """Builds a searcher over `embeddings`.

  Args:
    embeddings: float32 [N, D], row i = block i.
    kind: "scann" or "exact".
    num_shards: > 1 splits the corpus into that many row ranges, one searcher
      of `kind` each (a ShardedSearcher).
    **config: fields of ScannConfig / ExactConfig.

  Returns:
    The searcher.

  Raises:
    ValueError: unknown kind or config field, bad embeddings.
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

"""Sharded MIPS: one searcher per contiguous row range, top-k of top-k's."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import numpy as np

from realm_jax.index.search_base import (SEARCHERS, Searcher, check_embeddings,
                                         load_searcher, register, sort_top_k)
from realm_jax.index.search_configs import (ExactConfig, ScannConfig,
                                            ShardConfig, ShardedConfig,
                                            as_config)


@register
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

    Args:
      embeddings: float32 [N, D].
      config: a ShardedConfig (or its dict), or the config of every shard
        (ExactConfig / ScannConfig) together with `num_shards`.
      num_shards: overrides config.num_shards when given.

    Returns:
      The searcher; ids are global row ids.

    Raises:
      ValueError: bad embeddings or config, or more shards than rows.
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
    shards = [load_searcher(os.path.join(directory, name))
              for name in metadata["shard_dirs"]]
    return cls(shards, np.asarray(metadata["row_offsets"]), config)

"""ScaNN MIPS: k-means tree + asymmetric hashing + exact re-ordering."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Mapping

from absl import logging
import numpy as np

from realm_jax.index.search_base import Searcher, check_embeddings, register
from realm_jax.index.search_configs import (ScannConfig, as_config,
                                            check_positive_int)

SCANN_SUBDIR = "scann"


def _scann_pybind():
  # Imported on first use: `import scann` also imports TensorFlow (~4 s).
  # pylint: disable-next=g-import-not-at-top
  from scann.scann_ops.py import scann_ops_pybind
  return scann_ops_pybind


@register
class ScannSearcher(Searcher):
  """ScaNN tree + asymmetric hashing + re-ordering (see ScannConfig)."""

  kind = "scann"
  config_class = ScannConfig
  config: ScannConfig

  def __init__(self, scann_searcher: Any, config: ScannConfig,
               resolved: Mapping[str, Any], num_rows: int, dim: int):
    super().__init__(config, num_rows, dim)
    self.scann_searcher = scann_searcher
    self.resolved = dict(resolved)
    if config.num_threads:
      scann_searcher.set_num_threads(config.num_threads)

  @classmethod
  def build(cls, embeddings: np.ndarray,
            config: ScannConfig | Mapping[str, Any] | None = None
           ) -> "ScannSearcher":
    """Trains and builds a ScaNN index over `embeddings`.

    Args:
      embeddings: float32 [N, D].
      config: a ScannConfig (or its dict); None = defaults.

    Returns:
      The searcher.

    Raises:
      ValueError: bad embeddings or a config that does not fit the corpus.
    """
    config = as_config(ScannConfig, config)
    embeddings = np.ascontiguousarray(check_embeddings(embeddings))
    num_rows, dim = embeddings.shape
    resolved = config.resolve(num_rows, dim)
    started = time.time()
    # ScaNN's build-time num_neighbors is only a default; every search
    # passes its own k.
    builder = _scann_pybind().builder(embeddings, min(10, num_rows),
                                      "dot_product")
    builder.set_n_training_threads(config.num_threads)
    if resolved["brute_force"]:
      builder = builder.score_brute_force()
    else:
      builder = builder.tree(
          num_leaves=resolved["num_leaves"],
          num_leaves_to_search=resolved["num_leaves_to_search"],
          training_sample_size=resolved["training_sample_size"],
          min_partition_size=resolved["min_partition_size"])
      threshold = config.anisotropic_quantization_threshold
      builder = builder.score_ah(
          config.dims_per_block,
          anisotropic_quantization_threshold=(
              float("nan") if threshold is None else threshold),
          training_sample_size=resolved["training_sample_size"])
      if config.reordering_num_neighbors:
        builder = builder.reorder(config.reordering_num_neighbors)
    searcher = builder.build()
    logging.info("built ScaNN index over %d x %d in %.1f s: %s", num_rows,
                 dim, time.time() - started, resolved)
    return cls(searcher, config, resolved, num_rows, dim)

  def with_search_params(self, num_leaves_to_search: int | None = None,
                         reordering_num_neighbors: int | None = None
                        ) -> "ScannSearcher":
    """The same index searched with other query-time settings.

    Trades recall for speed without rebuilding: the returned searcher shares
    the ScaNN index and differs only in its config and `resolved` settings.

    Args:
      num_leaves_to_search: leaves searched per query (<= num_leaves).
      reordering_num_neighbors: candidates re-scored exactly; > 0 needs an
        index built with re-ordering, 0 returns AH estimates.

    Returns:
      A new ScannSearcher.

    Raises:
      ValueError: a brute-force index (nothing to tune), values out of
        range, or re-ordering asked of an index built without it.
    """
    if self.resolved["brute_force"]:
      raise ValueError(
          "this ScaNN index is brute force (a corpus below "
          "brute_force_below_rows rows); it has no search parameters.")
    config, resolved = self.config, dict(self.resolved)
    if num_leaves_to_search is not None:
      check_positive_int("with_search_params", "num_leaves_to_search",
                          num_leaves_to_search)
      if num_leaves_to_search > resolved["num_leaves"]:
        raise ValueError(
            f"num_leaves_to_search={num_leaves_to_search} exceeds the "
            f"{resolved['num_leaves']} leaves of the index.")
      resolved["num_leaves_to_search"] = num_leaves_to_search
      config = dataclasses.replace(config,
                                   num_leaves_to_search=num_leaves_to_search)
    if reordering_num_neighbors is not None:
      check_positive_int("with_search_params", "reordering_num_neighbors",
                          reordering_num_neighbors, minimum=0)
      if reordering_num_neighbors and not self.config.reordering_num_neighbors:
        raise ValueError(
            "this index was built without re-ordering "
            "(reordering_num_neighbors=0); rebuild it with "
            "reordering_num_neighbors > 0.")
      config = dataclasses.replace(
          config, reordering_num_neighbors=reordering_num_neighbors)
    return ScannSearcher(self.scann_searcher, config, resolved, self.num_rows,
                         self.dim)

  def _search(self, queries, k):
    if self.resolved["brute_force"]:
      pre_reorder, leaves = k, None
    else:
      leaves = self.resolved["num_leaves_to_search"]
      pre_reorder = max(k, self.config.reordering_num_neighbors)
    ids, scores = self.scann_searcher.search_batched_parallel(
        queries, final_num_neighbors=k, pre_reorder_num_neighbors=pre_reorder,
        leaves_to_search=leaves, batch_size=self.config.search_batch_size)
    ids = np.asarray(ids, np.int64)
    scores = np.asarray(scores, np.float32)
    if ids.shape[1] < k:  # pad to k columns, as documented
      pad = k - ids.shape[1]
      ids = np.pad(ids, ((0, 0), (0, pad)))
      scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=np.nan)
    # ScaNN fills the slots it could not fill (searched leaves held < k rows)
    # with id 0 and score NaN.
    missing = np.isnan(scores)
    if missing.any():
      ids = np.where(missing, -1, ids)
      scores = np.where(missing, -np.inf, scores).astype(np.float32)
    return ids, scores

  def _write(self, directory):
    scann_dir = os.path.join(directory, SCANN_SUBDIR)
    os.makedirs(scann_dir)
    # relative_path: the assets list must survive the rename into place.
    self.scann_searcher.serialize(scann_dir, relative_path=True)
    return {"scann_dir": SCANN_SUBDIR, "resolved": self.resolved}

  @classmethod
  def _read(cls, directory, metadata):
    config = ScannConfig.from_dict(metadata["config"])
    searcher = _scann_pybind().load_searcher(
        os.path.join(directory, metadata["scann_dir"]))
    return cls(searcher, config, metadata["resolved"], searcher.size(),
               metadata["dim"])

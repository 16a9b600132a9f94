"""ScaNN MIPS: k-means tree + asymmetric hashing + exact re-ordering.

Its own module because ScaNN (and the TensorFlow it imports) is loaded only
when an index of this kind is built or opened, and because opening one is
where the security checks live: only ScaNN's own assets are read, never its
pickled docids (`checked_scann_assets`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Mapping

from absl import logging
import numpy as np

from realm_jax.index import search_base
from realm_jax.index.search_base import (ScannConfig, Searcher, as_config,
                                         check_embeddings)

SCANN_SUBDIR = "scann"


def _scann_pybind():
  # Imported on first use: `import scann` also imports TensorFlow (~4 s).
  # pylint: disable-next=g-import-not-at-top
  from scann.scann_ops.py import scann_ops_pybind
  return scann_ops_pybind


def _scann_reorder_type(dtype: str):
  # pylint: disable-next=g-import-not-at-top
  from scann.scann_ops.py import scann_builder
  return scann_builder.ReorderType[dtype.upper()]


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
    """Trains and builds a ScaNN index over `embeddings` float32 [N, D]."""
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
        reorder_type = _scann_reorder_type(config.reordering_dtype)
        builder = builder.reorder(config.reordering_num_neighbors,
                                  quantize=reorder_type)
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
    """
    if self.resolved["brute_force"]:
      raise ValueError(
          "this ScaNN index is brute force (a corpus below "
          "brute_force_below_rows rows); it has no search parameters.")
    config, resolved = self.config, dict(self.resolved)
    if num_leaves_to_search is not None:
      # replace() validates the value (ScannConfig.__post_init__).
      config = dataclasses.replace(config,
                                   num_leaves_to_search=num_leaves_to_search)
      if num_leaves_to_search > resolved["num_leaves"]:
        raise ValueError(
            f"num_leaves_to_search={num_leaves_to_search} exceeds the "
            f"{resolved['num_leaves']} leaves of the index.")
      resolved["num_leaves_to_search"] = num_leaves_to_search
    if reordering_num_neighbors is not None:
      config = dataclasses.replace(
          config, reordering_num_neighbors=reordering_num_neighbors)
      if reordering_num_neighbors and not self.config.reordering_num_neighbors:
        raise ValueError(
            "this index was built without re-ordering "
            "(reordering_num_neighbors=0); rebuild it with "
            "reordering_num_neighbors > 0.")
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
    scann_dir = search_base.member(directory, metadata["scann_dir"],
                                   "scann_dir")
    assets = checked_scann_assets(scann_dir)
    # Not ScaNN's `load_searcher`: it unpickles `scann_docids.pkl` when
    # present, i.e. runs code from the index directory. Row i is block i
    # here, so there are no docids, and only ScaNN's own assets (protos and
    # .npy arrays, read by its C++ loader) are opened.
    pybind = _scann_pybind()
    searcher = pybind.ScannSearcher(
        pybind.scann_pybind.ScannNumpy(scann_dir, assets), None)
    return cls(searcher, config, metadata["resolved"], searcher.size(),
               metadata["dim"])


_ASSETS_FILE = "scann_assets.pbtxt"
_CONFIG_FILE = "scann_config.pb"
_ASSET_PATH = re.compile(r'asset_path:\s*"([^"]*)"')


def checked_scann_assets(scann_dir: str) -> str:
  """The assets list of a serialised ScaNN searcher, after checking that
  the directory holds ScaNN's assets and nothing else.

  Args:
    scann_dir: a directory written by `ScannSearcher.save`.

  Returns:
    The text of scann_assets.pbtxt.

  Raises:
    ValueError: no assets list; an asset path that leaves the directory;
      a missing asset; any other file (e.g. `scann_docids.pkl`: ScaNN would
      unpickle it). Such an index is refused, never partly loaded.
  """
  path = os.path.join(scann_dir, _ASSETS_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"{scann_dir}: no {_ASSETS_FILE}; this is not a ScaNN "
                     "searcher written by realm_jax (older ScaNN layouts are "
                     "not loaded): rebuild the index.")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  assets = _ASSET_PATH.findall(text)
  for asset in assets:
    if (os.path.isabs(asset) or os.path.normpath(asset) != asset
        or asset.startswith("..") or os.sep in asset):
      raise ValueError(f"{path}: asset path {asset!r} is not a file of "
                       f"{scann_dir}; rebuild the index.")
  expected = {_ASSETS_FILE, _CONFIG_FILE, *assets}
  present = set(os.listdir(scann_dir))
  links = sorted(n for n in present
                 if os.path.islink(os.path.join(scann_dir, n)))
  if links:
    raise ValueError(f"{scann_dir}: {links} are symbolic links; a ScaNN "
                     "index is read only from its own files. Rebuild it.")
  if expected - present:
    raise ValueError(f"{scann_dir}: missing ScaNN assets "
                     f"{sorted(expected - present)}; rebuild the index.")
  if present - expected:
    raise ValueError(
        f"{scann_dir}: unexpected files {sorted(present - expected)}. A "
        "ScaNN index directory holds only the assets its "
        f"{_ASSETS_FILE} lists; realm_jax refuses to load it (ScaNN's own "
        "loader would unpickle scann_docids.pkl, running code from the "
        "directory). Remove the files or rebuild the index.")
  return text

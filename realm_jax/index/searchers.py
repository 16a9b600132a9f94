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
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import math
import os
import shutil
import tempfile
import time
from typing import Any, ClassVar, Mapping, Type, TypeVar, Union

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax import io_utils

FORMAT_VERSION = 1
METADATA_FILE = "searcher.json"
_EMBEDDINGS_FILE = "embeddings.npy"
_SCANN_SUBDIR = "scann"

_ConfigT = TypeVar("_ConfigT", bound="_Config")
_SearcherT = TypeVar("_SearcherT", bound="Searcher")

# -----------------------------------------------------------------------------
# Input checks shared by every searcher.
# -----------------------------------------------------------------------------

# Rows checked for NaN/inf at a time, so the check of a 13M-row corpus needs
# a few MB of scratch memory rather than a boolean copy of the whole matrix.
_FINITE_CHECK_ROWS = 1 << 16


def _first_non_finite_row(array: np.ndarray) -> int | None:
  for start in range(0, array.shape[0], _FINITE_CHECK_ROWS):
    chunk = np.asarray(array[start:start + _FINITE_CHECK_ROWS])
    bad = np.flatnonzero(~np.isfinite(chunk).all(axis=1))
    if bad.size:
      return start + int(bad[0])
  return None


def check_embeddings(embeddings: Any) -> np.ndarray:
  """Checks a corpus embedding matrix and returns it as a numpy array.

  Args:
    embeddings: float32 array [num_rows, dim], row i = block i. A
      `np.memmap` stays memory-mapped.

  Returns:
    `embeddings` as a numpy array (not copied when it already was one).

  Raises:
    ValueError: wrong type, dtype or rank, an empty corpus or dimension, or a
      row holding NaN or inf.
  """
  if not isinstance(embeddings, np.ndarray):
    embeddings = np.asarray(embeddings)
  if embeddings.ndim != 2:
    raise ValueError(
        f"embeddings must be a 2-D array [num_rows, dim], got shape "
        f"{embeddings.shape}; reshape it (one row per block).")
  if embeddings.dtype != np.float32:
    raise ValueError(
        f"embeddings must be float32, got {embeddings.dtype}; convert with "
        "embeddings.astype(np.float32).")
  if embeddings.shape[0] == 0:
    raise ValueError(
        "embeddings is empty (0 rows): there is nothing to search; embed the "
        "corpus first.")
  if embeddings.shape[1] == 0:
    raise ValueError("embeddings has dim 0; each row needs at least one value.")
  bad = _first_non_finite_row(embeddings)
  if bad is not None:
    raise ValueError(
        f"embeddings row {bad} holds NaN or inf (row {bad} = block {bad}); "
        "fix or re-embed that block before building an index.")
  return embeddings


def _check_queries(queries: Any, dim: int) -> np.ndarray:
  if not isinstance(queries, np.ndarray):
    queries = np.asarray(queries)
  if queries.ndim != 2:
    hint = (" (one query: use queries[None, :])" if queries.ndim == 1 else "")
    raise ValueError(
        f"queries must be a 2-D array [num_queries, dim], got shape "
        f"{queries.shape}{hint}.")
  if queries.dtype != np.float32:
    raise ValueError(
        f"queries must be float32, got {queries.dtype}; convert with "
        "queries.astype(np.float32).")
  if queries.shape[1] != dim:
    raise ValueError(
        f"queries have dim {queries.shape[1]} but the index holds dim-{dim} "
        "embeddings; embed the queries with the retriever that embedded the "
        "corpus.")
  bad = _first_non_finite_row(queries)
  if bad is not None:
    raise ValueError(f"query row {bad} holds NaN or inf; fix that query.")
  return np.ascontiguousarray(queries)


def _check_k(k: Any, num_rows: int) -> int:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
    raise ValueError(f"k must be an int, got {k!r}.")
  if not 1 <= k <= num_rows:
    raise ValueError(
        f"k={k} is out of range: the index holds {num_rows} rows, so k must "
        f"be in [1, {num_rows}]; ask for fewer neighbours or index more "
        "blocks.")
  return int(k)


def _check_positive_int(owner: str, name: str, value: Any,
                        minimum: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(
        f"{owner}.{name} must be an int >= {minimum}, got {value!r}.")


def _sort_top_k(ids: np.ndarray, scores: np.ndarray,
                k: int) -> tuple[np.ndarray, np.ndarray]:
  """Best k columns of every row: score descending, then id ascending."""
  # Invalid slots (id -1) carry score -inf; pushing their sort key past every
  # real id keeps them last among equal (-inf) scores.
  id_key = np.where(ids < 0, np.iinfo(np.int64).max, ids)
  order = np.lexsort((id_key, -scores), axis=-1)[:, :k]
  return (np.take_along_axis(ids, order, axis=1),
          np.take_along_axis(scores, order, axis=1))


# -----------------------------------------------------------------------------
# Configs.
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
  """JSON round trip shared by the searcher configs."""

  def to_dict(self) -> dict[str, Any]:
    """The fields as a JSON-serialisable dict."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls: Type[_ConfigT], values: Mapping[str, Any]) -> _ConfigT:
    """Builds the config from `to_dict()` output.

    Args:
      values: field name -> value.

    Returns:
      The config.

    Raises:
      ValueError: unknown field names, or values that fail validation.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
      raise ValueError(
          f"unknown {cls.__name__} fields {unknown}; valid fields are "
          f"{sorted(names)}.")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class ExactConfig(_Config):
  """Brute-force search.

  Attributes:
    backend: "numpy" (float32 BLAS matmul on the host) or "jax" (jitted
      matmul + `jax.lax.top_k` on the default JAX device; the corpus is
      copied to that device).
    rows_per_block: corpus rows scored per matmul; None = 32768 for numpy,
      8192 for JAX (the faster on 2 CPU cores for 1M x 128). Peak scratch
      memory is queries_per_block x rows_per_block float32 scores.
    queries_per_block: queries scored together.
  """
  backend: str = "numpy"
  rows_per_block: int | None = None
  queries_per_block: int = 256

  def __post_init__(self):
    if self.backend not in ("numpy", "jax"):
      raise ValueError(
          f"ExactConfig.backend must be 'numpy' or 'jax', got "
          f"{self.backend!r}.")
    if self.rows_per_block is not None:
      _check_positive_int("ExactConfig", "rows_per_block",
                          self.rows_per_block)
    _check_positive_int("ExactConfig", "queries_per_block",
                        self.queries_per_block)


@dataclasses.dataclass(frozen=True)
class ScannConfig(_Config):
  """ScaNN tree + asymmetric hashing (AH) + exact re-ordering.

  `None` fields are derived from the corpus size N when the index is built
  (the values used are saved next to the index as `resolved`):
  - below `brute_force_below_rows` rows ScaNN scores every row exactly (no
    tree, no AH: AH needs >= 16 rows per codebook and a tree of tiny
    partitions only costs recall);
  - num_leaves = clip(round(2 sqrt(N)), 1, max_auto_leaves): 2000 leaves of
    ~500 rows for 1M rows;
  - num_leaves_to_search = ceil(leaves_search_fraction x num_leaves), at
    least min(num_leaves, 32): 50 of 2000 leaves for 1M rows, 32 of 283 for
    20k (small corpora have few rows a leaf, and a query's neighbours spread
    over more leaves than 2.5% of them: recall@10 0.94 with 8 leaves, 0.99
    with 32 on the 20k test set);
  - min_partition_size = clip(sample // (5 num_leaves), 1, 50) with sample =
    min(N, training_sample_size). ScaNN drops k-means partitions smaller
    than this during training; its own default of 50 with 100k samples and
    2000 leaves (50 samples a leaf on average) wrecks the tree: on 1M x 128
    clustered vectors, exact scoring inside 50 of 2000 leaves found 81% of
    the true top-10 instead of 100%.

  The defaults (2.5% of the leaves, 100 candidates re-ordered, AH T=0.2) give
  recall@10 ~0.99 at ~30x the speed of exact search on the 1M x 128
  benchmark (docs/benchmarks/mips.md); searching more leaves is what buys
  recall on less clustered data, re-ordering more candidates adds little.

  Attributes:
    num_leaves: k-means partitions of the tree; None = from N (see above).
    num_leaves_to_search: partitions searched per query; None = from
      `leaves_search_fraction`.
    leaves_search_fraction: fraction of the leaves searched when
      num_leaves_to_search is None.
    training_sample_size: rows sampled to train the tree and AH codebooks.
    min_partition_size: see above; None = derived.
    dims_per_block: dimensions per AH sub-space (16 codes each, "lut16").
    anisotropic_quantization_threshold: ScaNN's T (absolute inner product
      threshold of the score-aware AH loss); None = plain k-means AH, as in
      ORQA.
    reordering_num_neighbors: AH candidates re-scored with exact float32
      inner products (max(k, this) per search); 0 = no re-ordering, scores
      are then AH estimates.
    brute_force_below_rows: corpora with fewer rows use exact brute force.
    max_auto_leaves: cap of the automatic num_leaves.
    num_threads: threads for training and batched search; 0 = all cores.
    search_batch_size: queries per thread task in batched search.
  """
  num_leaves: int | None = None
  num_leaves_to_search: int | None = None
  leaves_search_fraction: float = 0.025
  training_sample_size: int = 100_000
  min_partition_size: int | None = None
  dims_per_block: int = 2
  anisotropic_quantization_threshold: float | None = 0.2
  reordering_num_neighbors: int = 100
  brute_force_below_rows: int = 10_000
  max_auto_leaves: int = 8192
  num_threads: int = 0
  search_batch_size: int = 256

  def __post_init__(self):
    name = "ScannConfig"
    if self.num_leaves is not None:
      _check_positive_int(name, "num_leaves", self.num_leaves)
    if self.num_leaves_to_search is not None:
      _check_positive_int(name, "num_leaves_to_search",
                          self.num_leaves_to_search)
      if (self.num_leaves is not None and
          self.num_leaves_to_search > self.num_leaves):
        raise ValueError(
            f"ScannConfig.num_leaves_to_search={self.num_leaves_to_search} "
            f"exceeds num_leaves={self.num_leaves}; search at most every "
            "leaf.")
    if not (isinstance(self.leaves_search_fraction, (int, float)) and
            0 < self.leaves_search_fraction <= 1):
      raise ValueError(
          "ScannConfig.leaves_search_fraction must be in (0, 1], got "
          f"{self.leaves_search_fraction!r}.")
    _check_positive_int(name, "training_sample_size",
                        self.training_sample_size)
    if self.min_partition_size is not None:
      _check_positive_int(name, "min_partition_size", self.min_partition_size)
    _check_positive_int(name, "dims_per_block", self.dims_per_block)
    threshold = self.anisotropic_quantization_threshold
    if threshold is not None and not (
        isinstance(threshold, (int, float)) and math.isfinite(threshold) and
        threshold > 0):
      raise ValueError(
          "ScannConfig.anisotropic_quantization_threshold must be a positive "
          f"float or None (plain AH), got {threshold!r}.")
    _check_positive_int(name, "reordering_num_neighbors",
                        self.reordering_num_neighbors, minimum=0)
    _check_positive_int(name, "brute_force_below_rows",
                        self.brute_force_below_rows, minimum=0)
    _check_positive_int(name, "max_auto_leaves", self.max_auto_leaves)
    _check_positive_int(name, "num_threads", self.num_threads, minimum=0)
    _check_positive_int(name, "search_batch_size", self.search_batch_size)

  def resolve(self, num_rows: int, dim: int) -> dict[str, Any]:
    """The concrete ScaNN settings for a corpus of `num_rows` x `dim`.

    Args:
      num_rows: corpus rows N.
      dim: embedding dimension.

    Returns:
      A dict with `brute_force` (bool) and, for a tree, `num_leaves`,
      `num_leaves_to_search`, `min_partition_size`, `training_sample_size`,
      `dims_per_block`.

    Raises:
      ValueError: more leaves than rows, or dims_per_block > dim.
    """
    if self.num_leaves is None and num_rows < self.brute_force_below_rows:
      return {"brute_force": True}
    if self.dims_per_block > dim:  # a last, shorter block is fine
      raise ValueError(
          f"ScannConfig.dims_per_block={self.dims_per_block} exceeds the "
          f"embedding dim {dim}; use dims_per_block <= {dim}.")
    num_leaves = self.num_leaves
    if num_leaves is None:
      num_leaves = int(min(max(round(2 * math.sqrt(num_rows)), 1),
                           self.max_auto_leaves))
    if num_leaves > num_rows:
      raise ValueError(
          f"ScannConfig.num_leaves={num_leaves} exceeds the {num_rows} rows "
          "of the corpus; use fewer leaves or num_leaves=None (automatic).")
    leaves_to_search = self.num_leaves_to_search
    if leaves_to_search is None:
      leaves_to_search = max(
          math.ceil(self.leaves_search_fraction * num_leaves),
          min(num_leaves, 32))
    leaves_to_search = min(leaves_to_search, num_leaves)
    sample = min(num_rows, self.training_sample_size)
    min_partition_size = self.min_partition_size
    if min_partition_size is None:
      min_partition_size = int(np.clip(sample // (5 * num_leaves), 1, 50))
    return {
        "brute_force": False,
        "num_leaves": num_leaves,
        "num_leaves_to_search": leaves_to_search,
        "min_partition_size": min_partition_size,
        "training_sample_size": sample,
        "dims_per_block": self.dims_per_block,
    }


# The released ORQA/REALM index (language/orqa/utils/scann_utils.py): tree of
# 1000 leaves searching 100, AH with 2 dims a block, no anisotropic loss, no
# re-ordering, ScaNN's default min partition size of 50. Kept for comparison:
# without re-ordering its top-10 ranking comes from AH estimates alone.
ORQA_SCANN_CONFIG = ScannConfig(
    num_leaves=1000,
    num_leaves_to_search=100,
    training_sample_size=100_000,
    min_partition_size=50,
    dims_per_block=2,
    anisotropic_quantization_threshold=None,
    reordering_num_neighbors=0)

ShardConfig = Union[ExactConfig, ScannConfig]


@dataclasses.dataclass(frozen=True)
class ShardedConfig(_Config):
  """Several searchers over contiguous row ranges.

  Attributes:
    num_shards: number of row ranges (sizes differ by at most one row).
    shard_kind: "exact" or "scann".
    shard_config: config of every shard; None = that kind's default.
  """
  num_shards: int = 2
  shard_kind: str = "scann"
  shard_config: ShardConfig | None = None

  def __post_init__(self):
    _check_positive_int("ShardedConfig", "num_shards", self.num_shards)
    if self.shard_kind not in _SHARD_CONFIGS:
      raise ValueError(
          f"ShardedConfig.shard_kind must be one of {sorted(_SHARD_CONFIGS)},"
          f" got {self.shard_kind!r}.")
    config_cls = _SHARD_CONFIGS[self.shard_kind]
    if self.shard_config is None:
      object.__setattr__(self, "shard_config", config_cls())
    elif isinstance(self.shard_config, Mapping):
      object.__setattr__(self, "shard_config",
                         config_cls.from_dict(self.shard_config))
    elif not isinstance(self.shard_config, config_cls):
      raise ValueError(
          f"ShardedConfig.shard_config must be a {config_cls.__name__} for "
          f"shard_kind={self.shard_kind!r}, got "
          f"{type(self.shard_config).__name__}.")

  def to_dict(self) -> dict[str, Any]:
    return {"num_shards": self.num_shards, "shard_kind": self.shard_kind,
            "shard_config": self.shard_config.to_dict()}


_SHARD_CONFIGS: dict[str, Type[_Config]] = {
    "exact": ExactConfig, "scann": ScannConfig}

# -----------------------------------------------------------------------------
# The interface.
# -----------------------------------------------------------------------------


class Searcher(abc.ABC):
  """Top-k maximum inner product search over a fixed [num_rows, dim] corpus.

  Attributes:
    config: the searcher's frozen config.
    num_rows: rows N of the corpus (ids are 0..N-1).
    dim: embedding dimension D.
  """

  kind: ClassVar[str]
  config_class: ClassVar[Type[_Config]]

  def __init__(self, config: _Config, num_rows: int, dim: int):
    self.config = config
    self.num_rows = int(num_rows)
    self.dim = int(dim)

  @classmethod
  @abc.abstractmethod
  def build(cls: Type[_SearcherT], embeddings: np.ndarray,
            config: Any = None) -> _SearcherT:
    """Indexes `embeddings` float32 [N, D] (row i = block i)."""

  def search_batched(self, queries: np.ndarray,
                     k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows by inner product for every query.

    Args:
      queries: float32 [Q, D].
      k: neighbours per query, 1 <= k <= num_rows.

    Returns:
      (ids int64 [Q, k], scores float32 [Q, k]), best first.

    Raises:
      ValueError: wrong dtype, rank or dim, NaN/inf queries, or k out of
        range.
    """
    queries = _check_queries(queries, self.dim)
    k = _check_k(k, self.num_rows)
    if queries.shape[0] == 0:
      return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    ids, scores = self._search(queries, k)
    return ids.astype(np.int64, copy=False), scores.astype(np.float32,
                                                           copy=False)

  @abc.abstractmethod
  def _search(self, queries: np.ndarray,
              k: int) -> tuple[np.ndarray, np.ndarray]:
    """search_batched on checked inputs (Q >= 1)."""

  @abc.abstractmethod
  def _write(self, directory: str) -> dict[str, Any]:
    """Writes the data into an existing empty directory; returns extra
    metadata for searcher.json."""

  @classmethod
  @abc.abstractmethod
  def _read(cls: Type[_SearcherT], directory: str,
            metadata: Mapping[str, Any]) -> _SearcherT:
    """Opens what `_write` wrote."""

  def save(self, directory: str) -> None:
    """Writes the searcher to `directory`, atomically.

    Everything goes to a temporary sibling directory that is renamed to
    `directory` once complete, so readers never see a partial index; an
    existing `directory` is replaced.

    Args:
      directory: destination path on a local disk.
    """
    _require_local(directory)
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(
        prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)
    try:
      extra = self._write(tmp_dir)
      metadata = {
          "format_version": FORMAT_VERSION,
          "kind": self.kind,
          "config": self.config.to_dict(),
          "num_rows": self.num_rows,
          "dim": self.dim,
          **extra,
      }
      with open(os.path.join(tmp_dir, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=1)
      if os.path.exists(directory):
        old_dir = f"{tmp_dir}.old"
        os.rename(directory, old_dir)
        os.rename(tmp_dir, directory)
        shutil.rmtree(old_dir)
      else:
        os.rename(tmp_dir, directory)
    except BaseException:
      shutil.rmtree(tmp_dir, ignore_errors=True)
      raise
    logging.info("saved %s searcher (%d x %d) to %s", self.kind,
                 self.num_rows, self.dim, directory)

  @classmethod
  def load(cls: Type[_SearcherT], directory: str) -> _SearcherT:
    """Opens a searcher written by `save`.

    Args:
      directory: a directory written by `save` of this class.

    Returns:
      The searcher.

    Raises:
      ValueError: not a searcher directory, or one of another kind.
    """
    metadata = read_metadata(directory)
    if metadata["kind"] != cls.kind:
      raise ValueError(
          f"{directory} holds a searcher of kind {metadata['kind']!r}, not "
          f"{cls.kind!r}; open it with load_searcher().")
    searcher = cls._read(directory, metadata)
    if (searcher.num_rows, searcher.dim) != (metadata["num_rows"],
                                             metadata["dim"]):
      raise ValueError(
          f"{directory}: the data holds {searcher.num_rows} x {searcher.dim} "
          f"but {METADATA_FILE} says {metadata['num_rows']} x "
          f"{metadata['dim']}; the directory is corrupt, rebuild it.")
    return searcher

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(num_rows={self.num_rows}, dim={self.dim},"
            f" config={self.config})")


def _require_local(directory: str) -> None:
  """Searchers are local files (ScaNN serializes to them, data is mapped)."""
  if not io_utils.is_local(directory):
    raise ValueError(
        f"{directory}: searchers are saved to and loaded from local "
        "directories; for a gs:// index use realm_jax.index.publish "
        "(publish_index stages it locally and uploads, load_index copies it "
        "to a local cache).")


def read_metadata(directory: str) -> dict[str, Any]:
  """Reads and checks `searcher.json` of a saved searcher.

  Args:
    directory: a directory written by `Searcher.save`.

  Returns:
    The parsed metadata.

  Raises:
    ValueError: the file is missing, unreadable or of another format.
  """
  _require_local(directory)
  path = os.path.join(directory, METADATA_FILE)
  if not os.path.isfile(path):
    raise ValueError(
        f"{directory} is not a saved searcher: {METADATA_FILE} is missing; "
        "write one with Searcher.save().")
  try:
    with open(path) as f:
      metadata = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {path}: {e}; rebuild the index.") from e
  missing = [key for key in ("format_version", "kind", "config", "num_rows",
                             "dim") if key not in metadata]
  if missing:
    raise ValueError(f"{path} lacks {missing}; rebuild the index.")
  if metadata["format_version"] != FORMAT_VERSION:
    raise ValueError(
        f"{path} has format_version {metadata['format_version']}, this code "
        f"reads {FORMAT_VERSION}; rebuild the index with this version.")
  if metadata["kind"] not in _SEARCHERS:
    raise ValueError(
        f"{path}: unknown searcher kind {metadata['kind']!r}; known kinds are "
        f"{sorted(_SEARCHERS)}.")
  return metadata


def _as_config(config_class: Type[_ConfigT], config: Any) -> _ConfigT:
  if config is None:
    return config_class()
  if isinstance(config, Mapping):
    return config_class.from_dict(config)
  if not isinstance(config, config_class):
    raise ValueError(
        f"expected a {config_class.__name__} (or a dict of its fields), got "
        f"{type(config).__name__}.")
  return config


# -----------------------------------------------------------------------------
# Exact search.
# -----------------------------------------------------------------------------


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
    """Wraps `embeddings` (no copy for numpy; a device copy for JAX).

    Args:
      embeddings: float32 [N, D].
      config: an ExactConfig (or its dict); None = numpy defaults.

    Returns:
      The searcher.

    Raises:
      ValueError: bad embeddings or config.
    """
    config = _as_config(ExactConfig, config)
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
    np.save(os.path.join(directory, _EMBEDDINGS_FILE),
            np.asarray(self.embeddings))
    return {"embeddings_file": _EMBEDDINGS_FILE}

  @classmethod
  def _read(cls, directory, metadata):
    config = ExactConfig.from_dict(metadata["config"])
    # Memory-mapped: a 13M x 128 corpus is 6.8 GB that the numpy backend
    # streams block by block instead of holding in RAM.
    embeddings = np.load(os.path.join(directory, metadata["embeddings_file"]),
                         mmap_mode="r")
    return cls(embeddings, config)


# -----------------------------------------------------------------------------
# ScaNN.
# -----------------------------------------------------------------------------


def _scann_pybind():
  # Imported on first use: `import scann` also imports TensorFlow (~4 s).
  # pylint: disable-next=g-import-not-at-top
  from scann.scann_ops.py import scann_ops_pybind
  return scann_ops_pybind


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
    config = _as_config(ScannConfig, config)
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
      _check_positive_int("with_search_params", "num_leaves_to_search",
                          num_leaves_to_search)
      if num_leaves_to_search > resolved["num_leaves"]:
        raise ValueError(
            f"num_leaves_to_search={num_leaves_to_search} exceeds the "
            f"{resolved['num_leaves']} leaves of the index.")
      resolved["num_leaves_to_search"] = num_leaves_to_search
      config = dataclasses.replace(config,
                                   num_leaves_to_search=num_leaves_to_search)
    if reordering_num_neighbors is not None:
      _check_positive_int("with_search_params", "reordering_num_neighbors",
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
    scann_dir = os.path.join(directory, _SCANN_SUBDIR)
    os.makedirs(scann_dir)
    # relative_path: the assets list must survive the rename into place.
    self.scann_searcher.serialize(scann_dir, relative_path=True)
    return {"scann_dir": _SCANN_SUBDIR, "resolved": self.resolved}

  @classmethod
  def _read(cls, directory, metadata):
    config = ScannConfig.from_dict(metadata["config"])
    searcher = _scann_pybind().load_searcher(
        os.path.join(directory, metadata["scann_dir"]))
    return cls(searcher, config, metadata["resolved"], searcher.size(),
               metadata["dim"])


# -----------------------------------------------------------------------------
# Sharded search.
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
    config = _as_config(ShardedConfig, config)
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
    shard_class = _SEARCHERS[config.shard_kind]
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
    return _sort_top_k(np.concatenate(all_ids, axis=1),
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


_SEARCHERS: dict[str, Type[Searcher]] = {
    "exact": ExactSearcher, "scann": ScannSearcher,
    "sharded": ShardedSearcher}

# -----------------------------------------------------------------------------
# Factories.
# -----------------------------------------------------------------------------


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
  if kind not in _SHARD_CONFIGS:
    raise ValueError(
        f"kind must be one of {sorted(_SHARD_CONFIGS)}, got {kind!r}.")
  shard_config = _SHARD_CONFIGS[kind].from_dict(config)
  if num_shards == 1:
    return _SEARCHERS[kind].build(embeddings, shard_config)
  return ShardedSearcher.build(
      embeddings, ShardedConfig(num_shards=num_shards, shard_kind=kind,
                                shard_config=shard_config))


def load_searcher(directory: str) -> Searcher:
  """Opens any searcher written by `Searcher.save`.

  Args:
    directory: the saved directory (it holds searcher.json).

  Returns:
    An ExactSearcher, ScannSearcher or ShardedSearcher.

  Raises:
    ValueError: not a saved searcher, or an unreadable one.
  """
  metadata = read_metadata(directory)
  return _SEARCHERS[metadata["kind"]].load(directory)

"""What every MIPS searcher shares: configs, the interface, the format.

The searchers themselves are in `realm_jax.index.searchers` (exact and
sharded, and the public entry point `build_searcher` / `load_searcher`)
and `realm_jax.index.scann_search` (ScaNN). This module knows none of them,
so the imports run one way: search_base <- scann_search <- searchers.

Configs are frozen dataclasses with a JSON round trip (`to_dict` /
`from_dict`), saved next to every index in `searcher.json`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
from typing import Any, ClassVar, Mapping, Type, TypeVar, Union

from absl import logging
import numpy as np

from realm_jax.core import checks, io_utils, outputs

FORMAT_VERSION = 1
METADATA_FILE = "searcher.json"

ConfigT = TypeVar("ConfigT", bound="SearcherConfig")
_SearcherT = TypeVar("_SearcherT", bound="Searcher")

# -----------------------------------------------------------------------------
# Configs.
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SearcherConfig:
  """JSON round trip shared by the searcher configs."""

  def to_dict(self) -> dict[str, Any]:
    """The fields as a JSON-serialisable dict."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls: Type[ConfigT], values: Mapping[str, Any]) -> ConfigT:
    """Builds the config from `to_dict()` output; ValueError for unknown
    field names or values that fail validation."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
      raise ValueError(
          f"unknown {cls.__name__} fields {unknown}; valid fields are "
          f"{sorted(names)}.")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class ExactConfig(SearcherConfig):
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
    checks.at_least(self, "rows_per_block", integer=True, optional=True)
    checks.at_least(self, "queries_per_block", integer=True)


REORDERING_DTYPES = ("float32", "bfloat16", "int8")


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class ScannConfig(SearcherConfig):
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
  - training_sample_size = min(N, max(100k, samples_per_leaf x num_leaves)):
    k-means needs samples in every leaf; at 4M rows and 4000 leaves, 100k
    samples (25 a leaf) gave recall@10 0.81 where 400k (100 a leaf) gave
    0.94 (docs/benchmarks/mips_scale.md);
  - min_partition_size = clip(sample // (5 num_leaves), 1, 50) with sample
    the training sample size. ScaNN drops k-means partitions smaller
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
    training_sample_size: rows sampled to train the tree and AH codebooks;
      None = from N and the leaves (see above).
    samples_per_leaf: the automatic training sample's rows per leaf.
    min_partition_size: see above; None = derived.
    dims_per_block: dimensions per AH sub-space (16 codes each, "lut16").
    anisotropic_quantization_threshold: ScaNN's T (absolute inner product
      threshold of the score-aware AH loss); None = plain k-means AH, as in
      ORQA.
    reordering_num_neighbors: AH candidates re-scored with exact inner
      products (max(k, this) per search); 0 = no re-ordering, scores are
      then AH estimates.
    reordering_dtype: how the index stores the rows it re-scores: "float32"
      (a full copy, 4 bytes a value), "bfloat16" (2 bytes) or "int8"
      (ScaNN's per-dimension fixed point, 1 byte). At 13.35M x 128 that is
      the difference between 6.8 GB and 1.7 GB of RAM
      (docs/benchmarks/mips_scale.md).
    brute_force_below_rows: corpora with fewer rows use exact brute force.
    max_auto_leaves: cap of the automatic num_leaves. Building costs N x
      num_leaves inner products (every row is assigned to its leaf), but
      fewer leaves cost recall: at 4M rows 2048 leaves gave recall@10 0.57
      where 4000 gave 0.81 (docs/benchmarks/mips_scale.md).
    num_threads: threads for training and batched search; 0 = all cores.
    search_batch_size: queries per thread task in batched search.
  """
  num_leaves: int | None = None
  num_leaves_to_search: int | None = None
  leaves_search_fraction: float = 0.025
  training_sample_size: int | None = None
  samples_per_leaf: int = 100
  min_partition_size: int | None = None
  dims_per_block: int = 2
  anisotropic_quantization_threshold: float | None = 0.2
  reordering_num_neighbors: int = 100
  reordering_dtype: str = "float32"
  brute_force_below_rows: int = 10_000
  max_auto_leaves: int = 8192
  num_threads: int = 0
  search_batch_size: int = 256

  def __post_init__(self):
    checks.at_least(self, "num_leaves", "num_leaves_to_search",
                    "min_partition_size", "training_sample_size",
                    integer=True, optional=True)
    checks.at_least(self, "samples_per_leaf", "dims_per_block",
                    "max_auto_leaves", "search_batch_size", integer=True)
    checks.at_least(self, "reordering_num_neighbors",
                    "brute_force_below_rows", "num_threads", minimum=0,
                    integer=True)
    if self.reordering_dtype not in REORDERING_DTYPES:
      raise ValueError(
          f"ScannConfig.reordering_dtype={self.reordering_dtype!r}; use one "
          f"of {list(REORDERING_DTYPES)}.")
    if None not in (self.num_leaves, self.num_leaves_to_search) and (
        self.num_leaves_to_search > self.num_leaves):
      raise ValueError(
          f"ScannConfig.num_leaves_to_search={self.num_leaves_to_search} "
          f"exceeds num_leaves={self.num_leaves}; search at most every leaf.")
    if not (isinstance(self.leaves_search_fraction, (int, float)) and
            0 < self.leaves_search_fraction <= 1):
      raise ValueError(
          "ScannConfig.leaves_search_fraction must be in (0, 1], got "
          f"{self.leaves_search_fraction!r}.")
    threshold = self.anisotropic_quantization_threshold
    if threshold is not None and not (
        isinstance(threshold, (int, float)) and math.isfinite(threshold) and
        threshold > 0):
      raise ValueError(
          "ScannConfig.anisotropic_quantization_threshold must be a positive "
          f"float or None (plain AH), got {threshold!r}.")

  def resolve(self, num_rows: int, dim: int) -> dict[str, Any]:
    """The concrete ScaNN settings for a corpus of `num_rows` x `dim`.

    A dict with `brute_force` (bool) and, for a tree, `num_leaves`,
    `num_leaves_to_search`, `min_partition_size`, `training_sample_size`,
    `dims_per_block`. ValueError for more leaves than rows, or
    dims_per_block > dim.
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
    sample = self.training_sample_size
    if sample is None:
      sample = max(100_000, self.samples_per_leaf * num_leaves)
    sample = min(num_rows, sample)
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
@checks.type_checked
class ShardedConfig(SearcherConfig):
  """Several searchers over contiguous row ranges.

  Attributes:
    num_shards: number of row ranges (sizes differ by at most one row).
    shard_kind: "exact" or "scann".
    shard_config: config of every shard (or its `to_dict()`, as read from
      JSON); None = that kind's default.
  """
  num_shards: int = 2
  shard_kind: str = "scann"
  shard_config: ShardConfig | Mapping[str, Any] | None = None

  def __post_init__(self):
    checks.at_least(self, "num_shards", integer=True)
    if self.shard_kind not in SHARD_CONFIGS:
      raise ValueError(
          f"ShardedConfig.shard_kind must be one of {sorted(SHARD_CONFIGS)},"
          f" got {self.shard_kind!r}.")
    config_cls = SHARD_CONFIGS[self.shard_kind]
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


SHARD_CONFIGS: dict[str, Type[SearcherConfig]] = {
    "exact": ExactConfig, "scann": ScannConfig}


def as_config(config_class: Type[ConfigT], config: Any) -> ConfigT:
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
  """Checks a corpus embedding matrix float32 [num_rows, dim] (row i =
  block i) and returns it as a numpy array, not copied when it already was
  one (a `np.memmap` stays memory-mapped)."""
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


def check_queries(queries: Any, dim: int) -> np.ndarray:
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


def check_k(k: Any, num_rows: int) -> int:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
    raise ValueError(f"k must be an int, got {k!r}.")
  if not 1 <= k <= num_rows:
    raise ValueError(
        f"k={k} is out of range: the index holds {num_rows} rows, so k must "
        f"be in [1, {num_rows}]; ask for fewer neighbours or index more "
        "blocks.")
  return int(k)


def sort_top_k(ids: np.ndarray, scores: np.ndarray,
                k: int) -> tuple[np.ndarray, np.ndarray]:
  """Best k columns of every row: score descending, then id ascending."""
  # Invalid slots (id -1) carry score -inf; pushing their sort key past every
  # real id keeps them last among equal (-inf) scores.
  id_key = np.where(ids < 0, np.iinfo(np.int64).max, ids)
  order = np.lexsort((id_key, -scores), axis=-1)[:, :k]
  return (np.take_along_axis(ids, order, axis=1),
          np.take_along_axis(scores, order, axis=1))


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
  config_class: ClassVar[Type[SearcherConfig]]

  def __init__(self, config: SearcherConfig, num_rows: int, dim: int):
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
    """Top-k rows by inner product for every query of float32 [Q, D].

    Returns (ids int64 [Q, k], scores float32 [Q, k]), best first, for
    1 <= k <= num_rows; ValueError for bad queries or k.
    """
    queries = check_queries(queries, self.dim)
    k = check_k(k, self.num_rows)
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
    `directory` (on a local disk) once complete, so readers never see a
    partial index; an existing `directory` is replaced.
    """
    require_local(directory)
    directory = os.path.abspath(directory)
    with outputs.output_dir(directory, kind=outputs.SEARCHER,
                            setting="the searcher directory",
                            overwrite=True) as tmp_dir:
      extra = self._write(tmp_dir)
      metadata = {
          "format_version": FORMAT_VERSION,
          "kind": self.kind,
          "config": self.config.to_dict(),
          "num_rows": self.num_rows,
          "dim": self.dim,
          **extra,
      }
      io_utils.write_json(os.path.join(tmp_dir, METADATA_FILE), metadata)
    logging.info("saved %s searcher (%d x %d) to %s", self.kind,
                 self.num_rows, self.dim, directory)

  @classmethod
  def load(cls: Type[_SearcherT], directory: str) -> _SearcherT:
    """Opens a searcher written by `save` of this class (else ValueError)."""
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


def require_local(directory: str) -> None:
  """Searchers are local files (ScaNN serializes to them, data is mapped)."""
  if not io_utils.is_local(directory):
    raise ValueError(
        f"{directory}: searchers are saved to and loaded from local "
        "directories; for a gs:// index use realm_jax.index.publish "
        "(publish_index stages it locally and uploads, load_index copies it "
        "to a local cache).")


def member(directory: str, name: Any, field: str) -> str:
  """The path of entry `name` that searcher.json's `field` names.

  A saved searcher reads only its own directory: `name` must be a plain
  entry of it (no separators, `..` or absolute paths, which would read
  outside the checksummed files of an index) and not a symbolic link.

  Raises:
    ValueError: naming searcher.json, the field and the entry.
  """
  where = f"{os.path.join(directory, METADATA_FILE)}: {field}={name!r}"
  if (not isinstance(name, str) or name in ("", os.curdir, os.pardir)
      or os.path.basename(name) != name or (os.altsep and os.altsep in name)):
    raise ValueError(f"{where} is not an entry of {directory}; a searcher "
                     "reads only its own directory. Rebuild it.")
  path = os.path.join(directory, name)
  if os.path.islink(path):
    raise ValueError(f"{where} is a symbolic link (to {os.readlink(path)!r})"
                     "; a searcher reads only its own files. Rebuild it.")
  return path


def load_embeddings(path: str, *, error: type[Exception] = ValueError
                    ) -> np.ndarray:
  """The [rows, dim] matrix of a local .npy file, memory-mapped.

  Never unpickled: an object array (which numpy stores as a pickle) is
  refused naming the file, as is anything but a 2-D array.

  Raises:
    `error`: naming `path` and what is wrong with it.
  """
  try:
    embeddings = np.load(path, mmap_mode="r", allow_pickle=False)
  except (ValueError, OSError, EOFError) as e:
    raise error(f"{path} is not a plain numeric .npy array ({e}); "
                "realm_jax never unpickles index files. Rebuild the "
                "index.") from e
  if embeddings.ndim != 2:
    raise error(f"{path} holds an array of shape {embeddings.shape}, not "
                "[rows, dim]; rebuild the index.")
  return embeddings


def read_metadata(directory: str) -> dict[str, Any]:
  """Reads and checks `searcher.json` of a saved searcher.

  Raises:
    ValueError: the file is missing, unreadable or of another format.
  """
  require_local(directory)
  return io_utils.read_manifest(
      directory, what="searcher", name=METADATA_FILE,
      format_version=FORMAT_VERSION, missing_error=ValueError,
      fields=("kind", "config", "num_rows", "dim"),
      build="write one with Searcher.save()")

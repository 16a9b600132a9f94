"""Configs of the MIPS searchers (`realm_jax.index.searchers`).

Frozen dataclasses with a JSON round trip (`to_dict` / `from_dict`), saved
next to every index in `searcher.json`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Type, TypeVar, Union

import numpy as np

ConfigT = TypeVar("ConfigT", bound="SearcherConfig")


def check_positive_int(owner: str, name: str, value: Any,
                        minimum: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(
        f"{owner}.{name} must be an int >= {minimum}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class SearcherConfig:
  """JSON round trip shared by the searcher configs."""

  def to_dict(self) -> dict[str, Any]:
    """The fields as a JSON-serialisable dict."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls: Type[ConfigT], values: Mapping[str, Any]) -> ConfigT:
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
    if self.rows_per_block is not None:
      check_positive_int("ExactConfig", "rows_per_block",
                          self.rows_per_block)
    check_positive_int("ExactConfig", "queries_per_block",
                        self.queries_per_block)


@dataclasses.dataclass(frozen=True)
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
      check_positive_int(name, "num_leaves", self.num_leaves)
    if self.num_leaves_to_search is not None:
      check_positive_int(name, "num_leaves_to_search",
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
    check_positive_int(name, "training_sample_size",
                        self.training_sample_size)
    if self.min_partition_size is not None:
      check_positive_int(name, "min_partition_size", self.min_partition_size)
    check_positive_int(name, "dims_per_block", self.dims_per_block)
    threshold = self.anisotropic_quantization_threshold
    if threshold is not None and not (
        isinstance(threshold, (int, float)) and math.isfinite(threshold) and
        threshold > 0):
      raise ValueError(
          "ScannConfig.anisotropic_quantization_threshold must be a positive "
          f"float or None (plain AH), got {threshold!r}.")
    check_positive_int(name, "reordering_num_neighbors",
                        self.reordering_num_neighbors, minimum=0)
    check_positive_int(name, "brute_force_below_rows",
                        self.brute_force_below_rows, minimum=0)
    check_positive_int(name, "max_auto_leaves", self.max_auto_leaves)
    check_positive_int(name, "num_threads", self.num_threads, minimum=0)
    check_positive_int(name, "search_batch_size", self.search_batch_size)

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
class ShardedConfig(SearcherConfig):
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
    check_positive_int("ShardedConfig", "num_shards", self.num_shards)
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

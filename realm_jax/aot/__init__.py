"""realm-aot: every job's step compiled for a TPU pod, from any host.

The TPU compiler (libtpu) runs without a TPU: `get_topology_desc` gives the
devices of a named pod slice (`v5e:8x8`, `v4:4x4x4`, `v5p:2x2x2`), and a
step jitted over a mesh of them lowers on `jax.ShapeDtypeStruct`s and
compiles. Nothing is materialised. The step is the job's own: the same
mesh (`parallel.make_mesh`), shardings and step function its trainer runs,
built from the job's gin files:

    realm-aot --gin_file=pods/pretrain_bert_base_v5e_8x8.gin
    realm-aot --gin_file=experiments/pretrain_tiny_cpu.gin \\
        --gin.TOPOLOGY="'v5e:2x2'"

Steps (`AotConfig.jobs`, by default the one the gin files configure):
"pretrain" (REALM's train step), "ict", "finetune" (open-QA), "embed" (the
index builder's document tower over one host's chips) and "search" (the
exact top-k over a row-sharded `DeviceIndex`).

For each it prints per chip the HBM the compiler plans (arguments, outputs,
temporaries, code) against the chip's capacity, the FLOPs and bytes the
compiler's cost model counts, and a step time estimated by a roofline
(`report.ESTIMATE_METHOD`; the compiler's own `optimal_seconds` comes back
negative for big programs), with the MFU, examples/s and run length that
follow, then one JSON line. A step that does not fit exits with status 1
and says what to change. Every time is the compiler's estimate, not a
measurement. Ctrl-C stops it at once (exit status 130), without waiting for
the compile in flight.

The package: this module is what realm-aot compiles for (`AotConfig`, the
pod slice's `Topology`); `steps.py` builds each job's step on abstract
arrays, `report.py` compiles one and reports it; the job is
`realm_jax.jobs.aot` (`realm-aot`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Any

from realm_jax.core import checks, slices

# The chips and slice names (`core/slices.py`, which the launcher reads).
Chip = slices.Chip
host_bounds, parse_topology = slices.host_bounds, slices.parse_topology
JOBS = ("pretrain", "ict", "finetune", "embed", "search")
# REALM's knowledge corpus: English Wikipedia in 288-wordpiece blocks.
REALM_NUM_BLOCKS = 13_353_718
# The largest count a step holds: positions, lengths, row ids, examples and
# the step counter are int32 on the device (JAX runs without x64).
INT32_MAX = 2**31 - 1
# The largest array realm-aot gives the compiler, per chip: 1 PiB, over
# 10,000 times any chip's HBM (v5p: 95 GiB), so whatever is refused here
# could never fit. Past it libtpu's compile slows to minutes, and near
# 2**62 bytes its int64 byte counts overflow and it aborts (SIGABRT in
# heap_simulator); below it a step too big is a report that says so.
MAX_BYTES_PER_CHIP = 1 << 50


# ----------------------------------------------------------------------------
# Chips and topologies
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Topology:
  """A pod slice: its name, chip and devices (one per chip)."""
  name: str
  chip: Chip
  devices: tuple[Any, ...]

  @property
  def chips(self) -> int:
    return len(self.devices)

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in self.devices})

  def host_devices(self, process_index: int = 0) -> list[Any]:
    return [d for d in self.devices if d.process_index == process_index]


def topology(name: str) -> Topology:
  """The devices of the pod slice `name`, from the TPU compiler (libtpu).

  Raises:
    ValueError: a bad name, or libtpu is not installed.
  """
  chip, dims = parse_topology(name)
  # libtpu takes a lock file (/tmp/libtpu_lockfile) so that two processes
  # do not drive one TPU; compiling drives none, so several realm-aot
  # processes (or test workers) may run at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  bounds = host_bounds(dims)
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError(
        "realm-aot needs the TPU compiler, which is not installed here: "
        "pip install libtpu (the 'tpu' and 'test' extras carry it).")
  desc = topologies.get_topology_desc(
      platform="tpu", topology_name=name,
      chip_config_name=chip.chip_config_name, chips_per_host_bounds=bounds,
      num_slices=1, wrap=(False, False, False))
  return Topology(name, chip, tuple(desc.devices))


# ----------------------------------------------------------------------------
# The config
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class AotConfig:
  """What realm-aot compiles, and for which pod.

  The job's own sizes (batch, lengths, model) come from its configs
  (PretrainConfig, IctTrainConfig, FinetuneConfig, builder.IndexBuildConfig
  and RealmConfig, from the same gin files the job reads); these are the
  ones the job reads from its data. Each count is at most 2**31 - 1
  (`INT32_MAX`), the topology at most one pod and divisible into hosts,
  and a search's arrays at most `MAX_BYTES_PER_CHIP` per chip: past these
  the compiler overflows, aborts or runs for minutes instead of reporting.

  Attributes:
    topology: the pod slice, e.g. "v5e:8x8" (64 chips, 16 hosts), "v4:4x4x4"
      or "v5p:2x2x2"; gin_configs/runs/aot.gin binds it to TOPOLOGY.
    jobs: steps to compile, of `JOBS`; empty: the job whose config the gin
      files bind (pretrain, ict, finetune, or embed for the index builder).
    query_length: pre-training queries' length (the query cache's, 96).
    num_masks: masks per pre-training query (the query cache's max_masks).
    block_length: the block store's max_block_len (288).
    num_blocks: blocks in the corpus (REALM's Wikipedia: 13,353,718): the
      embed step's refresh time and the search step's index.
    search_queries: queries per search step.
    search_k: blocks per query of the search step (ORQA's K = 5000).
    search_dtype: the index's embeddings, "float32" or "bfloat16".
    num_questions: training questions, for a fine-tuning run set in epochs
      (NQ-Open: 79,168).
    serialize_dir: write each compiled executable there
      (`<job>_<topology>.xla`, jax's serialized form) with its optimized
      HLO (`.hlo.txt`: which fusions and collectives the step runs).
    jsonl: append the JSON lines to this file too.
    refresh_recipe: for a pre-training step, the gin file of the index
      builder's embedding that refreshes its index (a `pods/embed_*.gin`
      recipe, on its own slice): realm-aot compiles that recipe too (in a
      child realm-aot, its own gin) and reports the training steps one
      full refresh lasts (`estimated_steps_per_refresh`; REALM: ~500).
  """

  topology: str
  jobs: tuple[str, ...] = ()
  query_length: int = 96
  num_masks: int = 10
  block_length: int = 288
  num_blocks: int = REALM_NUM_BLOCKS
  search_queries: int = 512
  search_k: int = 5000
  search_dtype: str = "float32"
  num_questions: int = 79_168
  serialize_dir: str | None = checks.path_setting(
      "writes", "aot_executables", default=None)
  jsonl: str | None = None
  refresh_recipe: str | None = None

  def __post_init__(self):
    parse_topology(self.topology)
    unknown = sorted(set(self.jobs) - set(JOBS))
    if unknown:
      raise ValueError(f"AotConfig.jobs has {unknown}; choose from {JOBS}.")
    counts = ("query_length", "num_masks", "block_length", "num_blocks",
              "search_queries", "search_k", "num_questions")
    checks.at_least(self, *counts)
    for name in counts:
      value = getattr(self, name)
      if value > INT32_MAX:
        raise ValueError(
            f"AotConfig.{name} must be <= {INT32_MAX:,} (2**31 - 1: the "
            "steps hold positions, lengths, row ids and step counts in "
            f"int32), got {value!r}.")
    if self.search_dtype not in ("float32", "bfloat16"):
      raise ValueError("AotConfig.search_dtype must be 'float32' or "
                       f"'bfloat16', got {self.search_dtype!r}.")
    if "search" in self.jobs:
      self._check_search_sizes()

  def _check_search_sizes(self) -> None:
    """Refuses a search step whose arrays no chip could hold (past
    `MAX_BYTES_PER_CHIP`), naming the fields that make them."""
    if self.search_k > self.num_blocks:
      raise ValueError(
          f"AotConfig.search_k={self.search_k:,} must be <= num_blocks="
          f"{self.num_blocks:,}: a search returns at most every block.")
    chips = math.prod(parse_topology(self.topology)[1])
    rows = -(-self.num_blocks // chips)
    for what, elements, size, fields in (
        ("float32 scores (every query against the chip's rows)",
         self.search_queries * rows, 4, "search_queries or num_blocks"),
        ("token ids (its rows x block_length, 2 bytes each at least)",
         rows * self.block_length, 2, "block_length or num_blocks")):
      if elements * size > MAX_BYTES_PER_CHIP:
        raise ValueError(
            f"AotConfig.{fields.replace(' or ', ' x ')} is too large: each "
            f"of the {chips} chips of {self.topology} would hold "
            f"{elements:,} {what}, {elements * size / 2**50:,.0f} PiB, past "
            f"the {MAX_BYTES_PER_CHIP / 2**50:.0f} PiB realm-aot compiles "
            "for one array (no chip holds a ten-thousandth of it; the "
            f"compiler's byte counts overflow near 2**62): lower "
            f"AotConfig.{fields}, or use a bigger topology.")


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
(`ESTIMATE_METHOD`; the compiler's own `optimal_seconds` comes back
negative for big programs), with the MFU, examples/s and run length that
follow, then one JSON line. A step that does not fit exits with status 1
and says what to change. Every time is the compiler's estimate, not a
measurement. Ctrl-C stops it at once (exit status 130), without waiting for
the compile in flight.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, as a shell reports Ctrl-C.
INTERRUPTED_MESSAGE = ("realm-aot: interrupted (Ctrl-C): stopped without "
                       "waiting for the compile in flight.")


def _interrupted(signum, frame) -> None:
  """realm-aot's Ctrl-C (SIGINT): one line and exit status 130, at once.

  Python runs a signal handler in the main thread between bytecodes, so a
  KeyboardInterrupt would wait for the compiler's C++ call to return
  (minutes for a BERT-base step) and then print a traceback. The compile
  runs in a worker thread instead (`_in_worker`), the main thread waits
  for it, and this handler ends the process with `os._exit`, the compile
  still running. The reports printed before are flushed with their JSON
  lines; an executable (`serialize_dir`) is written atomically.
  """
  # First: a second SIGINT (`timeout -s INT` signals the child and then its
  # group) would run this handler again inside this one, between bytecodes.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  del signum, frame
  os.write(2, (INTERRUPTED_MESSAGE + "\n").encode())
  os._exit(INTERRUPTED_EXIT_STATUS)  # pylint: disable=protected-access


if __name__ == "__main__":
  # Only the compiler is needed: without this a host with libtpu and no TPU
  # spends ~7 s probing for one before it falls back to the CPU.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # Before the imports below (seconds): Ctrl-C during them stops too. A
  # SIGINT ignored from the start (a launcher's `nohup` or `&`) stays so.
  if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
    signal.signal(signal.SIGINT, _interrupted)

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import importlib.util
import json
import math
import re
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding

from realm_jax.core import checks, parallel, slices
from realm_jax.data import qa_inputs, realm_inputs
from realm_jax.index import build as build_lib
from realm_jax.index import builder as builder_lib
from realm_jax.index import device_search, embed
from realm_jax.model import functional
from realm_jax.model.realm import Realm, RealmConfig, Retriever
from realm_jax.training import finetune, ict, loop, pretrain
from realm_jax.training import optimizer as optimizer_lib
# pylint: enable=g-import-not-at-top,wrong-import-position

GIB = slices.GIB
# The chips and slice names (`core/slices.py`, which the launcher reads).
Chip, CHIPS = slices.Chip, slices.CHIPS
host_bounds, parse_topology = slices.host_bounds, slices.parse_topology
ESTIMATE_METHOD = ("roofline: max(flops / peak bf16 FLOP/s, bytes accessed "
                   "/ HBM bandwidth), per chip, from the compiler's cost "
                   "analysis")
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


# ----------------------------------------------------------------------------
# The steps, as the jobs build them
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
  """A job's step ready to lower.

  Attributes:
    job: one of `JOBS`.
    fn: the jitted step.
    args: its arguments, `jax.ShapeDtypeStruct`s with shardings.
    kwargs: static keyword arguments (the search's k).
    global_batch: examples per step over the step's mesh.
    batch_arg: index in `args` of the argument split over the data axis
      (the batch; the search's index rows).
    mesh_devices: devices of the step's mesh.
    notes: what the step is, for the report.
    examples_per_step_total: examples per step over the whole pod (the
      embed step runs on every host at once: global_batch x hosts).
  """
  job: str
  fn: Callable[..., Any]
  args: tuple[Any, ...]
  global_batch: int
  batch_arg: int
  mesh_devices: int
  notes: str
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  examples_per_step_total: int | None = None


def _abstract(tree, sharding):
  """`tree`'s leaves as ShapeDtypeStructs placed by `sharding`."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
      tree)


def _batch(mesh, shapes: dict[str, tuple[tuple[int, ...], Any]],
           sizes: str):
  """A batch dict of ShapeDtypeStructs split over the data axis.

  Raises:
    ValueError: an array would be past `MAX_BYTES_PER_CHIP` per device
      (`sizes` names the fields that set the shapes, for the message).
  """
  for name, (shape, dtype) in shapes.items():
    per_chip = math.prod(shape) // mesh.size * np.dtype(dtype).itemsize
    if per_chip > MAX_BYTES_PER_CHIP:
      raise ValueError(
          f"The step's {name} would be {list(shape)}, {per_chip / 2**50:,.0f}"
          f" PiB on each of its {mesh.size} chips, past the "
          f"{MAX_BYTES_PER_CHIP / 2**50:.0f} PiB realm-aot compiles for one "
          "array (no chip holds a ten-thousandth of it; the compiler's byte "
          f"counts overflow near 2**62): lower {sizes}.")
  sharding = parallel.data_sharded(mesh)
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
          for name, (shape, dtype) in shapes.items()}


def _rng(mesh):
  key = jax.eval_shape(lambda: jax.random.key(0))
  return jax.ShapeDtypeStruct(key.shape, key.dtype,
                              sharding=parallel.replicated(mesh))


def _check_batch(what: str, batch: int, devices: int) -> None:
  if batch > INT32_MAX:
    raise ValueError(
        f"{what} must be <= {INT32_MAX:,} (2**31 - 1: the step counts its "
        f"examples in int32), got {batch!r}.")
  if batch % devices:
    raise ValueError(
        f"{what}={batch} does not divide over the {devices} devices of the "
        f"topology: make it a multiple of {devices} (the jobs refuse it "
        "too).")


def _train_state(params, tx, mesh) -> loop.TrainState:
  """The job's TrainState as ShapeDtypeStructs, replicated (`loop.Run`)."""
  replicated = parallel.replicated(mesh)
  return loop.TrainState(
      jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
      _abstract(params, replicated),
      _abstract(jax.eval_shape(tx.init, params), replicated))


def pretrain_step(config: pretrain.PretrainConfig, model: RealmConfig,
                  aot: AotConfig, mesh) -> Step:
  """REALM pre-training's step: `pretrain.train`'s `loop.make_train_step`
  of `pretrain.make_loss_fn`, with `pretrain.make_optimizer`."""
  _check_batch("PretrainConfig.batch_size", config.batch_size, mesh.size)
  graphdef, params = functional.abstract_init(lambda r: Realm(model, rngs=r))
  tx = pretrain.make_optimizer(config)
  step = loop.make_train_step(
      pretrain.make_loss_fn(graphdef, config.retrieval.null_document), tx,
      mesh, grad_norm_groups=("retriever", "reader"))
  r = config.retrieval
  # BM25's blocks (`lexical_candidates`) are read and scored like the
  # dense ones: k + m candidates, plus the null document.
  b, c = config.batch_size, (r.num_candidates + r.lexical_candidates
                             + int(r.null_document))
  lq, ld, m = aot.query_length, aot.block_length, aot.num_masks
  # The reader's length as pre-training derives it (query + block).
  lr = realm_inputs.reader_length(
      config.reader_length, lq, ld, field="PretrainConfig.reader_length",
      queries="(realm-aot: AotConfig.query_length)")
  shapes = realm_inputs.pretraining_layout(
      batch=b, candidates=c, query_length=lq, block_length=ld,
      reader_length=lr, num_masks=m, held_prior=r.held_prior,
      embedding_size=(model.retriever.embedding_size
                      if config.retriever.training == "query_side" else None))
  return Step("pretrain", step, (_train_state(params, tx, mesh),
                                 _batch(mesh, shapes, (
                                     "PretrainConfig.batch_size, "
                                     "RetrievalConfig.num_candidates or "
                                     "AotConfig's query_length, "
                                     "block_length and num_masks")),
                                 _rng(mesh)),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              notes=f"batch {b} x {c} candidates, query {lq}, blocks {ld}, "
              f"reader {lr}, {m} masks")


def ict_step(config: ict.IctTrainConfig, model: RealmConfig, aot: AotConfig,
             mesh) -> Step:
  """ICT's step: `ict.train`'s train step over the retriever's params."""
  del aot
  _check_batch("IctTrainConfig.batch_size", config.batch_size, mesh.size)
  _, params = functional.abstract_init(lambda r: Realm(model, rngs=r))
  tx = optimizer_lib.bert_optimizer(**config.schedule())
  step = loop.make_train_step(ict.make_loss_fn(ict.retriever_graphdef(model)),
                              tx, mesh)
  b, lq, lb = (config.batch_size, config.pairs.query_length,
               config.pairs.block_length)
  i32 = jnp.int32
  shapes = {"query_ids": ((b, lq), i32), "query_mask": ((b, lq), i32),
            "query_segment_ids": ((b, lq), i32),
            "block_ids": ((b, lb), i32), "block_mask": ((b, lb), i32),
            "block_segment_ids": ((b, lb), i32),
            "sentence_removed": ((b,), i32)}
  return Step("ict", step, (_train_state(params["retriever"], tx, mesh),
                            _batch(mesh, shapes, (
                                "IctTrainConfig.batch_size or IctConfig's "
                                "query_length and block_length")),
                            _rng(mesh)),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              notes=f"batch {b} (in-batch negatives), query {lq}, "
              f"blocks {lb}")


def finetune_step(config: finetune.FinetuneConfig, model: RealmConfig,
                  aot: AotConfig, mesh) -> Step:
  """Open-QA fine-tuning's step (`finetune._step_functions`)."""
  _check_batch("FinetuneConfig.batch_size", config.batch_size, mesh.size)
  if not model.reader.span_head:
    raise ValueError("Fine-tuning needs the reader's span head; set "
                     "ReaderConfig.span_head = True.")
  tx, step, _ = finetune._step_functions(  # pylint: disable=protected-access
      model, mesh, **config.schedule(config.total_steps(aot.num_questions)))
  _, params = functional.abstract_init(lambda r: Realm(model, rngs=r))
  qa, b = config.qa, config.batch_size
  shapes = qa_inputs.qa_layout(
      qa, batch=b, embedding_size=model.retriever.embedding_size,
      max_span_width=model.reader.max_span_width)
  assert set(shapes) == set(finetune.DEVICE_FEATURES), shapes
  return Step("finetune", step, (_train_state(params, tx, mesh),
                                 _batch(mesh, shapes, (
                                     "FinetuneConfig.batch_size or "
                                     "QAConfig's sizes")),
                                 _rng(mesh)),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              notes=f"batch {b}, K {qa.num_retrieved} retrieved, R "
              f"{qa.num_reader_blocks} read, question {qa.question_length}, "
              f"reader {qa.reader_length}")


def embed_step(build: build_lib.IndexBuildConfig, model: RealmConfig,
               aot: AotConfig, topo: Topology) -> Step:
  """The index builder's document tower (`embed.make_embed_fn`) over ONE
  host's chips, as `embed.embed_block_store` runs it on every host (each
  embeds its own share of the rows)."""
  retriever = model.retriever
  if build.bfloat16:
    retriever = dataclasses.replace(retriever, bert=dataclasses.replace(
        retriever.bert, dtype="bfloat16"))
  mesh = parallel.make_mesh(topo.host_devices(0))
  fn = embed.make_embed_fn(retriever, mesh)
  _, params = functional.abstract_init(lambda r: Retriever(
      dataclasses.replace(retriever, null_score="embedding"), rngs=r))
  b, length = build.batch_size_per_device * mesh.size, aot.block_length
  _check_batch(f"IndexBuildConfig.batch_size_per_device x {mesh.size} chips",
               b, mesh.size)
  ids = _batch(mesh, {"x": ((b, length), jnp.int32)}, (
      "IndexBuildConfig.batch_size_per_device or AotConfig.block_length"))[
          "x"]
  return Step("embed", fn, (_abstract(params, parallel.replicated(mesh)),
                            ids, ids, ids),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              examples_per_step_total=b * topo.hosts,
              notes=f"{b} blocks of {length} per host "
              f"({build.batch_size_per_device} per chip), "
              f"{'bfloat16' if build.bfloat16 else 'float32'}, "
              f"{topo.hosts} host(s) in parallel")


def search_step(model: RealmConfig, aot: AotConfig, mesh) -> Step:
  """Exact top-k over a `DeviceIndex` row-sharded over the data axis
  (`device_search.search`, as pre-training's device search holds it)."""
  n, d = aot.num_blocks, model.retriever.embedding_size
  rows = -(-n // mesh.size) * mesh.size
  sharded = parallel.data_sharded(mesh)
  dtype = jnp.bfloat16 if aot.search_dtype == "bfloat16" else jnp.float32
  tokens = jnp.uint16 if model.retriever.bert.vocab_size <= 1 << 16 else (
      jnp.int32)
  index = device_search.DeviceIndex(
      embeddings=jax.ShapeDtypeStruct((rows, d), dtype, sharding=sharded),
      tokens=jax.ShapeDtypeStruct((rows, aot.block_length), tokens,
                                  sharding=sharded),
      lengths=jax.ShapeDtypeStruct((rows, 2), jnp.int32, sharding=sharded),
      doc_hash=jax.ShapeDtypeStruct((rows, 2), jnp.int32, sharding=sharded),
      num_rows=n, cls_id=101, sep_id=102, pad_id=0, mesh=mesh)
  queries = jax.ShapeDtypeStruct((aot.search_queries, d), jnp.float32,
                                 sharding=parallel.replicated(mesh))
  return Step("search", device_search.search, (index, queries),
              kwargs={"k": aot.search_k}, global_batch=aot.search_queries,
              batch_arg=0, mesh_devices=mesh.size,
              notes=f"{aot.search_queries} queries, top {aot.search_k} of "
              f"{n:,} x {d} {aot.search_dtype} rows")


# ----------------------------------------------------------------------------
# Compile and report
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
  """One compiled step, per chip; every time is the compiler's estimate."""
  job: str
  topology: str
  chips: int
  hosts: int
  mesh_devices: int
  global_batch: int
  split_rows: int
  split_rows_per_device: int | None
  fits: bool
  hbm_per_chip_bytes: int | None
  hbm_capacity_bytes: int
  argument_bytes: int | None = None
  output_bytes: int | None = None
  temp_bytes: int | None = None
  code_bytes: int | None = None
  alias_bytes: int | None = None
  flops_per_chip: float | None = None
  bytes_accessed_per_chip: float | None = None
  estimated_step_seconds: float | None = None
  bound: str | None = None
  estimated_mfu: float | None = None
  examples_per_second: float | None = None
  estimated_days: float | None = None
  estimated_refresh_seconds: float | None = None
  num_train_steps: int | None = None
  estimate_method: str = ESTIMATE_METHOD
  compile_seconds: float = 0.0
  notes: str = ""
  error: str | None = None
  advice: str | None = None
  executable: str | None = None

  def json_line(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=False)


def _cost(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older jax: one dict per program.
    cost = cost[0] if cost else {}
  return dict(cost or {})


def _split_rows(step: Step) -> int:
  """Rows (leading axis) of the argument split over the data axis."""
  return jax.tree_util.tree_leaves(step.args[step.batch_arg])[0].shape[0]


def _rows_per_device(compiled, step: Step) -> int | None:
  """Rows of the split argument each device holds, read from the compiled
  input shardings (not from the arguments), so replication would show;
  None if its leaves are split differently."""
  shardings = compiled.input_shardings[0][step.batch_arg]
  arg = step.args[step.batch_arg]
  leaves = jax.tree_util.tree_leaves(arg)
  sharding_leaves = jax.tree_util.tree_leaves(
      shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
  rows = {s.shard_shape(x.shape)[0] for s, x in zip(sharding_leaves, leaves)}
  return rows.pop() if len(rows) == 1 else None


_NEEDED = re.compile(r"required for HLO temporaries \(([\d.]+\w?)\) exceeds "
                     r"available HBM \(([\d.]+\w?)\)")


def advice(job: str, topo: Topology, global_batch: int) -> str:
  """What to change when `job`'s step does not fit `topo`."""
  bigger = ", ".join(c.generation for c in CHIPS.values()
                     if c.hbm_bytes > topo.chip.hbm_bytes)
  if job == "search":
    return "; ".join([
        f"queries: every chip scores all {global_batch} queries against "
        "its rows ([queries, rows per chip] float32 scores): lower "
        "aot.AotConfig.search_queries",
        f"sharding: a bigger topology than {topo.name} ({topo.chips} "
        "chips) holds fewer rows per chip",
        "dtype: --gin.aot.AotConfig.search_dtype=\"'bfloat16'\" halves "
        "the index's embeddings"])
  batch_field = {"pretrain": "pretrain.PretrainConfig.batch_size",
                 "ict": "ict.IctTrainConfig.batch_size",
                 "finetune": "finetune.FinetuneConfig.batch_size",
                 "embed": "builder.IndexBuildConfig.batch_size_per_device"
                 }[job]
  devices = topo.chips if job != "embed" else len(topo.host_devices(0))
  return "; ".join([
      f"per-chip batch: {global_batch / devices:g} examples per chip now: "
      f"lower {batch_field}, or use a bigger topology than {topo.name} "
      f"({topo.chips} chips)",
      "rematerialisation: --gin.bert.BertConfig.remat=True (each BERT "
      "layer's activations recomputed in the backward pass, ~1/3 more "
      "FLOPs)",
      "dtype: --gin.bert.BertConfig.dtype=\"'bfloat16'\" (bfloat16 "
      "activations and matmuls; parameters, LayerNorm and softmax stay "
      "float32)",
      "sharding: parameters and Adam state are replicated on every chip "
      "(the data axis splits the batch only), so a chip with more HBM "
      f"({bigger or 'none is larger'}) is the way past them"])


def compile_step(step: Step, topo: Topology, *,
                 num_train_steps: int | None = None,
                 num_blocks: int | None = None,
                 serialize_dir: str | None = None) -> Report:
  """Lowers and compiles `step` for `topo`'s chips; its report.

  A RESOURCE_EXHAUSTED compile (the program needs more HBM than a chip
  has) is a report with fits=False, the compiler's message and `advice`.
  """
  chip = topo.chip
  report = Report(job=step.job, topology=topo.name, chips=topo.chips,
                  hosts=topo.hosts, mesh_devices=step.mesh_devices,
                  global_batch=step.global_batch,
                  split_rows=_split_rows(step), split_rows_per_device=None,
                  fits=False, hbm_per_chip_bytes=None,
                  hbm_capacity_bytes=chip.hbm_bytes, notes=step.notes)
  start = time.time()
  try:
    compiled = step.fn.lower(*step.args, **step.kwargs).compile()
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    report.compile_seconds = time.time() - start
    needed = _NEEDED.search(str(e))
    report.error = ("RESOURCE_EXHAUSTED: " + (
        f"HLO temporaries need {needed[1]} of the {needed[2]} a "
        f"{chip.generation} chip has free" if needed else
        str(e).splitlines()[0][:300]))
    report.advice = advice(step.job, topo, step.global_batch)
    return report
  report.compile_seconds = time.time() - start
  memory = compiled.memory_analysis()
  report.argument_bytes = int(memory.argument_size_in_bytes)
  report.output_bytes = int(memory.output_size_in_bytes)
  report.temp_bytes = int(memory.temp_size_in_bytes)
  report.code_bytes = int(memory.generated_code_size_in_bytes)
  report.alias_bytes = int(memory.alias_size_in_bytes)
  report.hbm_per_chip_bytes = (report.argument_bytes + report.output_bytes
                               - report.alias_bytes + report.temp_bytes
                               + report.code_bytes)
  report.fits = report.hbm_per_chip_bytes <= chip.hbm_bytes
  if not report.fits:
    report.advice = advice(step.job, topo, step.global_batch)
  report.split_rows_per_device = _rows_per_device(compiled, step)
  cost = _cost(compiled)
  flops, accessed = float(cost.get("flops", 0.0)), float(
      cost.get("bytes accessed", 0.0))
  report.flops_per_chip, report.bytes_accessed_per_chip = flops, accessed
  compute, memory_time = (flops / chip.peak_bf16_flops,
                          accessed / chip.hbm_bytes_per_second)
  seconds = max(compute, memory_time)
  if seconds > 0:
    report.estimated_step_seconds = seconds
    report.bound = "compute" if compute >= memory_time else "memory"
    report.estimated_mfu = compute / seconds
    total = step.examples_per_step_total or step.global_batch
    report.examples_per_second = total / seconds
    if num_train_steps:
      report.num_train_steps = num_train_steps
      report.estimated_days = num_train_steps * seconds / 86400
    if num_blocks and step.job == "embed":
      report.estimated_refresh_seconds = (
          math.ceil(num_blocks / total) * seconds)
  if serialize_dir:
    report.executable = _serialize(compiled, serialize_dir,
                                   f"{step.job}_{topo.name}")
  return report


def _serialize(compiled, directory: str, name: str) -> str:
  """Writes `compiled` (jax's serialized executable) to directory/name.xla
  and its optimized HLO to directory/name.hlo.txt; returns the first."""
  from jax.experimental import serialize_executable  # pylint: disable=g-import-not-at-top
  from realm_jax.core import io_utils  # pylint: disable=g-import-not-at-top
  payload, _, _ = serialize_executable.serialize(compiled)
  path = io_utils.join(directory, name.replace(":", "_") + ".xla")
  io_utils.makedirs(directory)
  io_utils.atomic_write_bytes(path, payload)
  io_utils.atomic_write_text(path[:-len(".xla")] + ".hlo.txt",
                             compiled.as_text())
  return path


def _gb(n: int | None) -> str:
  return "?" if n is None else f"{n / 1e9:.2f} GB"


def format_report(r: Report) -> str:
  """The human-readable lines of a report (per chip)."""
  head = (f"{r.job} on {r.topology} ({r.chips} chips, {r.hosts} hosts; "
          f"mesh of {r.mesh_devices}): {r.notes}")
  if r.hbm_per_chip_bytes is None:
    return "\n".join([head, f"  does NOT fit: {r.error}",
                      f"  to fit, change: {r.advice}"])
  lines = [
      head,
      f"  HBM per chip: arguments {_gb(r.argument_bytes)}, outputs "
      f"{_gb(r.output_bytes)} (aliased {_gb(r.alias_bytes)}), temporaries "
      f"{_gb(r.temp_bytes)}, code {_gb(r.code_bytes)} = "
      f"{_gb(r.hbm_per_chip_bytes)} of {_gb(r.hbm_capacity_bytes)}: "
      + ("fits" if r.fits else "does NOT fit"),
      f"  split over the data axis: {r.split_rows} rows, "
      f"{r.split_rows_per_device} per device",
      f"  compiler's cost analysis per chip: {r.flops_per_chip / 1e12:.3f} "
      f"TFLOP, {r.bytes_accessed_per_chip / 1e9:.2f} GB accessed"]
  if r.estimated_step_seconds:
    lines += [
        f"  estimated step time {r.estimated_step_seconds:.4f} s "
        f"({r.bound}-bound; {r.estimate_method})",
        f"  estimated MFU {100 * r.estimated_mfu:.1f}% of the bf16 peak "
        f"(compiler-counted FLOPs), {r.examples_per_second:,.1f} examples/s"]
  if r.estimated_days is not None:
    lines.append(f"  estimated {r.estimated_days:.2f} days for "
                 f"{r.num_train_steps:,} steps")
  if r.estimated_refresh_seconds is not None:
    lines.append(f"  estimated {r.estimated_refresh_seconds / 60:.1f} min to "
                 "embed the corpus on all hosts")
  if not r.fits:
    lines.append(f"  to fit, change: {r.advice}")
  lines.append(f"  (compiled in {r.compile_seconds:.0f} s; every time above "
               "is an estimate, not a measurement)")
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------


def _check_compiler_can(topo: Topology, model: RealmConfig,
                        jobs: Sequence[str]) -> None:
  """Refuses what crashes the TPU compiler instead of compiling it.

  libtpu 0.0.42.1 dies (SIGSEGV) compiling a v4 train step whose BERT has
  both `remat` and bfloat16 (v5e compiles it; either switch alone compiles
  on v4; seen with the tiny and the BERT-base REALM step).
  """
  berts = (model.retriever.bert, model.reader.bert)
  if topo.chip.generation == "v4" and any(
      b.remat and b.dtype == "bfloat16" for b in berts) and set(jobs) & {
          "pretrain", "ict", "finetune"}:
    raise ValueError(
        "libtpu 0.0.42.1 crashes compiling a v4 train step with both "
        "bert.BertConfig.remat = True and dtype = 'bfloat16': keep one of "
        "them (--gin.bert.BertConfig.remat=False or "
        "--gin.bert.BertConfig.dtype=\"'float32'\").")


def build_steps(aot: AotConfig, topo: Topology, configs: dict[str, Any],
                model: RealmConfig) -> list[tuple[Step, int | None]]:
  """(step, num_train_steps) of each of `aot.jobs` (the configs' jobs if
  empty); `configs` maps a job to its config (PretrainConfig, ...)."""
  jobs = aot.jobs or tuple(configs)
  if not jobs:
    raise ValueError(
        "No job to compile: pass a job's gin file (PretrainConfig, "
        "IctTrainConfig, FinetuneConfig or the index builder's), or set "
        f"AotConfig.jobs to some of {JOBS}.")
  mesh = parallel.make_mesh(topo.devices)
  _check_compiler_can(topo, model, jobs)
  steps = []
  for job in jobs:
    config = configs.get(job)
    if job in ("pretrain", "ict", "finetune") and config is None:
      raise ValueError(f"AotConfig.jobs has {job!r} but no gin file binds "
                       f"its config; pass the job's gin file.")
    if job == "pretrain":
      steps.append((pretrain_step(config, model, aot, mesh),
                    config.num_train_steps))
    elif job == "ict":
      steps.append((ict_step(config, model, aot, mesh),
                    config.num_train_steps))
    elif job == "finetune":
      steps.append((finetune_step(config, model, aot, mesh),
                    config.total_steps(aot.num_questions)))
    elif job == "embed":
      steps.append((embed_step(config or build_lib.IndexBuildConfig(),
                               model, aot, topo), None))
    else:
      steps.append((search_step(model, aot, mesh), None))
  return steps


def claim_serialize_dir(aot: AotConfig) -> None:
  """Before libtpu loads and minutes of compiling: `serialize_dir` must
  be new, empty or realm-aot's own (`outputs.claim`)."""
  if aot.serialize_dir:
    from realm_jax.core import outputs  # pylint: disable=g-import-not-at-top
    outputs.claim(aot.serialize_dir, outputs.AOT_EXECUTABLES,
                  "AotConfig.serialize_dir")


def check(aot: AotConfig, configs: dict[str, Any], model: RealmConfig, *,
          out=sys.stdout) -> list[Report]:
  """Compiles every step of `aot` for its topology; prints each report
  and its JSON line to `out` (and `aot.jsonl`). Returns the reports."""
  claim_serialize_dir(aot)
  topo = topology(aot.topology)
  reports = []
  for step, num_train_steps in build_steps(aot, topo, configs, model):
    logging.info("Compiling the %s step for %s (%d chips): minutes for a "
                 "big model; Ctrl-C stops realm-aot.", step.job, topo.name,
                 topo.chips)
    report = compile_step(step, topo, num_train_steps=num_train_steps,
                          num_blocks=aot.num_blocks,
                          serialize_dir=aot.serialize_dir)
    print(format_report(report), file=out)
    print(report.json_line(), file=out, flush=True)
    if aot.jsonl:
      from realm_jax.core import io_utils  # pylint: disable=g-import-not-at-top
      io_utils.append_jsonl(aot.jsonl, dataclasses.asdict(report))
    reports.append(report)
  return reports


# Job config classes by job, as the gin files bind them.
_JOB_CONFIGS = (("pretrain", pretrain.PretrainConfig),
                ("ict", ict.IctTrainConfig),
                ("finetune", finetune.FinetuneConfig),
                ("embed", builder_lib.BuilderConfig))
RUNS_FILE = "runs/aot.gin"
# What a job's `%gin.REQUIRED` path macros are bound to: realm-aot reads no
# data, so the paths are never opened.
PLACEHOLDER = "unused-by-realm-aot"


def configured_jobs(gin_texts: Sequence[str]) -> dict[str, Any]:
  """The job configs the parsed gin files bind, by job (embed: the index
  builder's IndexBuildConfig)."""
  from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
  configs = {}
  for job, cls in _JOB_CONFIGS:
    named = re.compile(rf"^[ \t]*(?:[\w.]+\.)?{cls.__name__}"
                       rf"(?:\.\w+[ \t]*=|[ \t]*:[ \t]*$)", re.M)
    if any(named.search(t) for t in gin_texts):
      config = gin_config.configured(cls)
      configs[job] = config.index_build if job == "embed" else config
  return configs


def placeholder_bindings(argv: Sequence[str]) -> list[str]:
  """Bindings for the `%gin.REQUIRED` macros of the command line's gin
  files (WORKDIR, BLOCK_STORE, ...), except TOPOLOGY."""
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  files, i = [], 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--gin_file="):
      files.append(arg.split("=", 1)[1])
    elif arg == "--gin_file" and i + 1 < len(argv):
      files.append(argv[i + 1])
      i += 1
    i += 1
  macros = []
  for path in gin_cli.included_gin_files(files):
    macros += [m for m in gin_cli.required_macros(path)
               if m != "TOPOLOGY" and m not in macros]
  return [f"{m} = '{PLACEHOLDER}'" for m in macros]


def job(dry_run: bool) -> None:
  """realm-aot's `job(dry_run)` (gin_cli.run): exits 1 if a step does not
  fit."""
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  # The imported module's class: `python -m` runs this file as a second
  # copy (`__main__`) that gin has not registered.
  from realm_jax import aot as aot_lib  # pylint: disable=g-import-not-at-top
  try:
    aot = gin_config.configured(
        aot_lib.AotConfig, required=f"include {RUNS_FILE} and set TOPOLOGY.")
    texts = gin_cli.included_gin_files(flags.FLAGS.gin_file).values()
    configs = configured_jobs(list(texts))
    model = gin_config.configured(RealmConfig)
  except ValueError as e:  # A config's own check; gin appends its call.
    message = re.sub(r"\n\s*In call to configurable .*", "", str(e),
                     flags=re.S)
    raise SystemExit(f"realm-aot: {message}") from e
  if dry_run:
    print(gin.operative_config_str())
    print(aot)
    for config in configs.values():
      print(config)
    print(model)
    return
  claim_serialize_dir(aot)
  try:
    reports = _in_worker(check, aot, configs, model)
  except ValueError as e:  # A config the job would refuse too.
    raise SystemExit(f"realm-aot: {e}") from e
  too_big = [r for r in reports if not r.fits]
  if too_big:
    raise SystemExit(
        "Does not fit: " + "; ".join(
            f"{r.job} on {r.topology}: {r.error or 'needs ' + _gb(r.hbm_per_chip_bytes) + ' of ' + _gb(r.hbm_capacity_bytes)}"
            f". Change: {r.advice}" for r in too_big))


def _in_worker(fn: Callable[..., Any], *args: Any) -> Any:
  """`fn(*args)` in a worker thread, the main thread waiting for it.

  Python runs signal handlers in the main thread only, between bytecodes:
  with the compile (one C++ call, minutes for a big model) in the main
  thread, Ctrl-C would wait for it to return. Waiting on a thread, the main
  thread runs `_interrupted` at once. `fn`'s exception is raised here.
  """
  outcome = {}

  def target():
    try:
      outcome["value"] = fn(*args)
    except BaseException as e:  # pylint: disable=broad-except
      outcome["error"] = e

  worker = threading.Thread(target=target, name="aot compile",
                            daemon=True)
  worker.start()
  worker.join()
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


def main(argv: Sequence[str] | None = None) -> None:
  """Runs realm-aot on `argv` (default: the command line)."""
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  argv = sys.argv if argv is None else list(argv)
  gin_cli.run(job, runs_file=RUNS_FILE, config_class="realm_jax.aot.AotConfig",
              defaults=placeholder_bindings(argv[1:]))


if __name__ == "__main__":
  main()

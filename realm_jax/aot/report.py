"""realm-aot's compile and report: a step compiled for a pod slice, the HBM
per chip its compiler plans, the FLOPs and bytes its cost model counts, and
a step time estimated by a roofline (`ESTIMATE_METHOD`)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time

import jax

from realm_jax.aot import Topology
from realm_jax.aot.steps import Step
from realm_jax.core import slices

ESTIMATE_METHOD = ("roofline: max(flops / peak bf16 FLOP/s, bytes accessed "
                   "/ HBM bandwidth), per chip, from the compiler's cost "
                   "analysis")


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
  model_flops_per_chip: float | None = None
  estimated_model_mfu: float | None = None
  examples_per_second: float | None = None
  estimated_days: float | None = None
  estimated_refresh_seconds: float | None = None
  refresh_recipe: str | None = None
  refresh_topology: str | None = None
  estimated_steps_per_refresh: float | None = None
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
  bigger = ", ".join(c.generation for c in slices.CHIPS.values()
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
    if step.model_flops:
      report.model_flops_per_chip = step.model_flops / step.mesh_devices
      report.estimated_model_mfu = (report.model_flops_per_chip
                                    / chip.peak_bf16_flops / seconds)
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


def gb(n: int | None) -> str:
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
      f"  HBM per chip: arguments {gb(r.argument_bytes)}, outputs "
      f"{gb(r.output_bytes)} (aliased {gb(r.alias_bytes)}), temporaries "
      f"{gb(r.temp_bytes)}, code {gb(r.code_bytes)} = "
      f"{gb(r.hbm_per_chip_bytes)} of {gb(r.hbm_capacity_bytes)}: "
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
    if r.estimated_model_mfu is not None:
      lines.append(
          f"  estimated MFU {100 * r.estimated_model_mfu:.1f}% with the "
          f"model's own FLOPs ({r.model_flops_per_chip / 1e12:.3f} TFLOP "
          "per chip; rematerialisation's repeats not counted)")
  if r.estimated_days is not None:
    lines.append(f"  estimated {r.estimated_days:.2f} days for "
                 f"{r.num_train_steps:,} steps")
  if r.estimated_steps_per_refresh is not None:
    lines.append(
        f"  estimated {r.estimated_steps_per_refresh:,.0f} training steps "
        f"per index refresh ({r.refresh_recipe} on {r.refresh_topology}: "
        f"{r.estimated_refresh_seconds / 60:.1f} min to embed the corpus)")
  elif r.estimated_refresh_seconds is not None:
    lines.append(f"  estimated {r.estimated_refresh_seconds / 60:.1f} min to "
                 "embed the corpus on all hosts")
  if not r.fits:
    lines.append(f"  to fit, change: {r.advice}")
  lines.append(f"  (compiled in {r.compile_seconds:.0f} s; every time above "
               "is an estimate, not a measurement)")
  return "\n".join(lines)

r"""The gin_configs/pods/ recipes compiled by the TPU compiler (realm-aot).

Runs `python -m realm_jax.jobs.aot --gin_file=pods/<recipe>.gin` for each recipe,
one at a time (a BERT-base train step takes the compiler ~20 min on two
idle cores), and appends every JSON line realm-aot prints to `--output`,
with the recipe, the host's CPU count and its load average around the
compile. Then prints the index staleness of each pre-training recipe: the
steps of training that one full refresh of the corpus lasts (realm-aot
compiles the recipe's `AotConfig.refresh_recipe` beside it). Every time is the compiler's estimate (a roofline over
its cost analysis), not a measurement.

  python benchmarks/tpu_aot.py                    # every recipe
  python benchmarks/tpu_aot.py --recipes=pretrain_bert_base_v5e_8x8,embed_bert_base_v5e_4x4
  python benchmarks/tpu_aot.py --staleness_only --table   # from --output
  python benchmarks/tpu_aot.py --hlo=/tmp/xla/pretrain_v4_4x4x4.hlo.txt

Results: docs/benchmarks/tpu_aot.md (docs/benchmarks/tpu_aot.jsonl).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PODS = os.path.join(ROOT, "gin_configs", "pods")
# The paper's run first, then what its staleness needs, then the rest.
ORDER = ("pretrain_", "embed_", "ict_", "finetune_", "search_")


def recipes() -> list[str]:
  names = [os.path.basename(p)[:-len(".gin")]
           for p in glob.glob(os.path.join(PODS, "*.gin"))]
  return sorted(names, key=lambda n: (
      next(i for i, p in enumerate(ORDER) if n.startswith(p)), n))


def compile_recipe(name: str, output: str, xla_dir: str = "") -> list[dict]:
  """realm-aot on one recipe; its JSON lines, appended to `output`; with
  `xla_dir`, the executables and their optimized HLO are written there."""
  load = os.getloadavg()[0]
  command = [sys.executable, "-m", "realm_jax.jobs.aot",
             f"--gin_file=pods/{name}.gin"]
  if xla_dir:
    command.append(f"--gin.aot.AotConfig.serialize_dir={xla_dir!r}")
  start = time.time()
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          check=False)
  print(result.stdout, flush=True)
  lines = [json.loads(l) for l in result.stdout.splitlines()
           if l.startswith("{")]
  if not lines:
    print(result.stderr[-3000:], file=sys.stderr)
  with open(output, "a", encoding="utf-8") as f:
    for line in lines:
      line.update(recipe=name, command=" ".join(
          ["python -m realm_jax.jobs.aot", f"--gin_file=pods/{name}.gin"]),
                  host_cpus=os.cpu_count(), load_average_before=load,
                  load_average_after=os.getloadavg()[0],
                  wall_seconds=time.time() - start)
      f.write(json.dumps(line) + "\n")
  return lines


def staleness(lines: list[dict]) -> list[dict]:
  """The training steps one full refresh lasts (REALM: about 500), for
  each pre-training line that realm-aot compiled with its refresh recipe
  (`AotConfig.refresh_recipe`)."""
  return [dict(pretrain=r["topology"], embed=r["refresh_topology"],
               refresh_recipe=r["refresh_recipe"],
               refresh_minutes=r["estimated_refresh_seconds"] / 60,
               pretrain_step_seconds=r["estimated_step_seconds"],
               staleness_steps=r["estimated_steps_per_refresh"])
          for r in lines if r["job"] == "pretrain" and r.get("fits")
          and r.get("estimated_steps_per_refresh")]


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
          "u64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.-]+) = (?P<shape>.+?) "
    r"(?P<op>[\w-]+)\((?P<operands>[^)]*)\)(?P<rest>.*)$")


# Instructions that move no data (views of their operands, markers).
_NO_TRAFFIC = {"get-tuple-element", "bitcast", "tuple", "parameter",
               "constant", "after-all", "partition-id", "replica-id",
               "copy-done", "slice-done", "all-gather-done", "all-reduce-done",
               "collective-permute-done"}


def _shape_bytes(text: str) -> int:
  return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in _SHAPE.findall(text))


# The step's parts, by the model's named scopes (realm_jax/model: the
# towers, the reader and its heads; pretrain's loss; the loop's optimizer)
# in an instruction's op_name, and the part of a BERT each one is in.
_COMPONENTS = ("query_tower", "document_tower", "reader", "mlm_head",
               "span_head", "marginal_loss", "optimizer")
_LAYER_PARTS = ("embeddings", "attention_scores", "attention", "ffn")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute")


def _scope(op: str, source: str) -> tuple[str, str, str]:
  """(component, layer part, pass) of an instruction, from its op and the
  JAX op_name that made it: `transpose(` marks the backward pass."""
  base = op.split(":")[0].removesuffix("-start")
  if base in _COLLECTIVES:
    return "collectives", base, ""
  # The compiler's moves between memory spaces (HBM and on-chip), and
  # the custom calls that join sliced copies again.
  if op in ("copy-start", "slice-start", "custom-call:ConcatBitcast"):
    return "memory-space copies", base, ""
  words = set(re.findall(r"\w+", source))
  component = next((c for c in _COMPONENTS if c in words), "other")
  part = next((p for p in _LAYER_PARTS if p in words), "")
  return component, part, "backward" if "transpose(" in source else "forward"


def hlo_traffic(text: str, top: int = 15) -> dict:
  """Where the bytes go in an optimized HLO module's ENTRY computation:
  each top-level instruction's operand + result bytes (a proxy for its
  HBM traffic; a fusion's internal reuse is not seen), totalled by op
  (fusion kind, collective, custom call) and the largest instructions with
  the JAX op that made them."""
  entry = text[text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}\n") + 1]
  shapes, rows = {}, []
  for line in entry.splitlines()[1:]:
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    out = _shape_bytes(m["shape"])
    shapes[m["name"]] = out
    if m["op"] in _NO_TRAFFIC:
      continue
    operands = re.findall(r"%([\w.-]+)", m["operands"])
    traffic = out + sum(shapes.get(o, 0) for o in operands)
    kind = re.search(r"kind=(\w+)|custom_call_target=\"(\w+)\"", m["rest"])
    op = m["op"] + (f":{kind[1] or kind[2]}" if kind else "")
    source = re.search(r'op_name="([^"]+)"', m["rest"])
    rows.append((traffic, op, m["name"], source[1] if source else ""))
  by_op, by_scope = {}, {}
  for traffic, op, _, source in rows:
    for totals, key in ((by_op, op), (by_scope, _scope(op, source))):
      count, total = totals.get(key, (0, 0))
      totals[key] = (count + 1, total + traffic)
  rows.sort(reverse=True)
  return {
      "total_bytes": sum(r[0] for r in rows),
      "by_op": sorted(([op, n, b] for op, (n, b) in by_op.items()),
                      key=lambda r: -r[2]),
      "by_scope": sorted(([*key, n, b] for key, (n, b) in by_scope.items()),
                         key=lambda r: -r[-1]),
      "top": [[b, op, name, source] for b, op, name, source in rows[:top]]}


def table(lines: list[dict]) -> str:
  """A markdown table of the compiled steps (the compiler's estimates)."""
  rows = ["| recipe | job | topology (chips, hosts) | fits | HBM per chip "
          "(args + out + temp + code) | TFLOP / GB accessed per chip | "
          "estimated step | bound | estimated MFU (compiler's FLOPs / "
          "model's) | examples/s | refresh |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in lines:
    if not r.get("fits"):
      rows.append(f"| {r.get('recipe', '')} | {r['job']} | {r['topology']} "
                  f"({r['chips']}, {r['hosts']}) | no | {r.get('error')} "
                  "| | | | | | |")
      continue
    model_mfu = r.get("estimated_model_mfu")
    if r.get("estimated_steps_per_refresh"):
      refresh = (f"{r['estimated_steps_per_refresh']:,.0f} steps per "
                 f"refresh ({r['refresh_topology']})")
    elif r.get("estimated_refresh_seconds"):
      refresh = f"{r['estimated_refresh_seconds'] / 60:.1f} min"
    else:
      refresh = ""
    rows.append(
        f"| {r.get('recipe', '')} | {r['job']} | {r['topology']} "
        f"({r['chips']}, {r['hosts']}) | yes | "
        f"{r['hbm_per_chip_bytes'] / 1e9:.2f} GB of "
        f"{r['hbm_capacity_bytes'] / 2**30:.0f} GiB | "
        f"{r['flops_per_chip'] / 1e12:.2f} / "
        f"{r['bytes_accessed_per_chip'] / 1e9:.1f} | "
        f"{r['estimated_step_seconds']:.3f} s | {r['bound']} | "
        f"{100 * r['estimated_mfu']:.0f}% / "
        + (f"{100 * model_mfu:.0f}%" if model_mfu is not None else "?")
        + f" | {r['examples_per_second']:,.0f} | {refresh} |")
  return "\n".join(rows)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipes", default="",
                      help="Comma-separated recipe names (default: all).")
  parser.add_argument("--output", default=os.path.join(
      ROOT, "docs", "benchmarks", "tpu_aot.jsonl"))
  parser.add_argument("--xla_dir", default="",
                      help="Write each executable and its optimized HLO "
                      "there (AotConfig.serialize_dir).")
  parser.add_argument("--hlo", default="",
                      help="Only print where the bytes go in this optimized "
                      "HLO file (a --xla_dir's <job>_<topology>.hlo.txt).")
  parser.add_argument("--staleness_only", action="store_true",
                      help="Only the staleness (and --table), from "
                      "--output's lines.")
  parser.add_argument("--table", action="store_true",
                      help="Also print --output's lines as a markdown "
                      "table.")
  args = parser.parse_args()
  # A SIGTERM or a SIGHUP (the terminal or ssh session closed) ends the
  # compile in flight too: subprocess.run kills its child when an
  # exception (this SystemExit, 128 + the signal) interrupts it. A signal
  # ignored from the start stays ignored (`nohup` ignores SIGHUP).
  for signum in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(signum) is not signal.SIG_IGN:
      signal.signal(signum, lambda s, _: sys.exit(128 + s))
  if args.hlo:
    with open(args.hlo, encoding="utf-8") as f:
      print(json.dumps(hlo_traffic(f.read()), indent=1))
    return
  if not args.staleness_only:
    for name in (args.recipes.split(",") if args.recipes else recipes()):
      compile_recipe(name, args.output, args.xla_dir)
  with open(args.output, encoding="utf-8") as f:
    lines = [json.loads(l) for l in f if l.strip()]
  for row in staleness(lines):
    print(json.dumps(dict(benchmark="index_staleness", **row)), flush=True)
  if args.table:
    print(table(lines))


if __name__ == "__main__":
  main()

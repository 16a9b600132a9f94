"""`realm-aot` (`python -m realm_jax.jobs.aot`): compiles the
steps the gin files configure (`check`), prints their reports, and exits 1
if one does not fit. Ctrl-C stops it at once (exit status 130), without
waiting for the compile in flight.
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
import json
import re
import subprocess
import threading
from typing import Any, Callable, Sequence

from absl import logging

from realm_jax.aot import AotConfig, topology
from realm_jax.aot.report import Report, compile_step, format_report, gb
from realm_jax.aot.steps import build_steps
from realm_jax.core import gin_text
from realm_jax.index import builder as builder_lib
from realm_jax.model.realm import RealmConfig
from realm_jax.training import finetune, ict, pretrain
# pylint: enable=g-import-not-at-top,wrong-import-position


def claim_serialize_dir(aot: AotConfig) -> None:
  """Before libtpu loads and minutes of compiling: `serialize_dir` must
  be new, empty or realm-aot's own (`outputs.claim`)."""
  if aot.serialize_dir:
    from realm_jax.core import outputs  # pylint: disable=g-import-not-at-top
    outputs.claim(aot.serialize_dir, outputs.AOT_EXECUTABLES,
                  "AotConfig.serialize_dir")


def refresh(recipe: str) -> dict[str, Any]:
  """The embed report of `recipe` (`AotConfig.refresh_recipe`), compiled
  by a child realm-aot: its own gin files, as the builder reads them."""
  logging.info("Compiling the refresh recipe %s (AotConfig.refresh_recipe).",
               recipe)
  result = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.aot", f"--gin_file={recipe}"],
      capture_output=True, text=True, check=False)
  lines = [json.loads(l) for l in result.stdout.splitlines()
           if l.startswith("{")]
  embed = [l for l in lines if l["job"] == "embed" and l["fits"]]
  if result.returncode or not embed:
    raise ValueError(
        f"AotConfig.refresh_recipe={recipe!r} did not give an embed step "
        "that fits (it must be the index builder's recipe, e.g. "
        "pods/embed_bert_base_v5e_4x4.gin): realm-aot on it exited "
        f"{result.returncode}: {result.stderr.strip()[-600:]}")
  return embed[0]


def check(aot: AotConfig, configs: dict[str, Any], model: RealmConfig, *,
          out=sys.stdout) -> list[Report]:
  """Compiles every step of `aot` for its topology; prints each report
  and its JSON line to `out` (and `aot.jsonl`). Returns the reports."""
  claim_serialize_dir(aot)
  topo = topology(aot.topology)
  reports = []
  steps = build_steps(aot, topo, configs, model)
  # Seconds, before the pre-training step's minutes: a bad recipe is told
  # at once.
  embed = (refresh(aot.refresh_recipe) if aot.refresh_recipe and any(
      step.job == "pretrain" for step, _ in steps) else None)
  for step, num_train_steps in steps:
    logging.info("Compiling the %s step for %s (%d chips): minutes for a "
                 "big model; Ctrl-C stops realm-aot.", step.job, topo.name,
                 topo.chips)
    report = compile_step(step, topo, num_train_steps=num_train_steps,
                          num_blocks=aot.num_blocks,
                          serialize_dir=aot.serialize_dir)
    if embed and step.job == "pretrain" and report.estimated_step_seconds:
      report.refresh_recipe = aot.refresh_recipe
      report.refresh_topology = embed["topology"]
      report.estimated_refresh_seconds = embed["estimated_refresh_seconds"]
      report.estimated_steps_per_refresh = (
          report.estimated_refresh_seconds / report.estimated_step_seconds)
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
  for path in gin_text.included_gin_files(files):
    macros += [m for m in gin_text.required_macros(path)
               if m != "TOPOLOGY" and m not in macros]
  return [f"{m} = '{PLACEHOLDER}'" for m in macros]


def job(dry_run: bool) -> None:
  """realm-aot's `job(dry_run)` (gin_cli.run): exits 1 if a step does not
  fit."""
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  try:
    aot = gin_config.configured(
        AotConfig, required=f"include {RUNS_FILE} and set TOPOLOGY.")
    texts = gin_text.included_gin_files(flags.FLAGS.gin_file).values()
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
            f"{r.job} on {r.topology}: {r.error or 'needs ' + gb(r.hbm_per_chip_bytes) + ' of ' + gb(r.hbm_capacity_bytes)}"
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

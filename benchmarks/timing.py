"""Shared helpers of the benchmarks run as `python benchmarks/<name>.py`."""

from __future__ import annotations

import json
import os
import statistics
import time


def emit(**record) -> None:
  """Prints one JSON line, with the XLA flags it ran under."""
  record["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  print(json.dumps(record), flush=True)


def median_seconds(fn, *args, repeats: int) -> float:
  """Median wall time of `fn(*args)` over `repeats` runs after a first
  (compiling) call, waiting for JAX's asynchronous results."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def run_named(kind: str, names: str, known, run, repeats: int) -> None:
  """Runs `run(name, repeats)` for each of the comma-separated `names`
  (keys of `known`, checked first), between two load-average lines."""
  chosen = names.split(",")
  unknown = [name for name in chosen if name not in known]
  if unknown:
    raise SystemExit(f"unknown {kind} {unknown}; choose from {list(known)}")
  emit(kind="load", loadavg=os.getloadavg())
  for name in chosen:
    run(name, repeats)
  emit(kind="load", loadavg=os.getloadavg())

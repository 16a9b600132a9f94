r"""What `core.progress.Progress.update` costs a loop, per update.

Every long loop of the jobs (embedding, extension, the QA eval, BM25,
reader preparation, the Beam workers) calls `update` once per batch. This
benchmark times, in one process, `--updates` iterations of:

  bare        a loop that only counts (`done += 1`): the floor;
  log_lines   the same loop calling `Progress.update()` as a job whose
              stderr is a file does: lines every 30 s, so none is due in
              the run, only the clock read and the comparisons;
  due_lines   `update()` with a line due at every call (period 1e-9 s, the
              lines going nowhere): the cost of formatting one line, paid
              once per period by a real job;
  tqdm_bar    `update()` drawing a tqdm bar (a terminal), into a string.

Each is the median of `--repeats` runs; an `overhead` line per kind gives
nanoseconds per update above the bare loop.

    python benchmarks/progress_overhead.py [--updates=200000] [--repeats=5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))  # The repository, for a run from a source checkout.

import timing  # pylint: disable=g-import-not-at-top,wrong-import-position  # benchmarks/timing.py

from realm_jax.core import progress  # pylint: disable=g-import-not-at-top,wrong-import-position


def _bare(n: int) -> float:
  done, start = 0, time.perf_counter()
  for _ in range(n):
    done += 1
  return time.perf_counter() - start


def _with(make, n: int) -> float:
  bar = make(n)
  start = time.perf_counter()
  for _ in range(n):
    bar.update()
  seconds = time.perf_counter() - start
  bar.close()
  return seconds


KINDS = {
    "log_lines": lambda n: progress.Progress(
        "bench", n + 1, unit="items", every_seconds=30, bar=False,
        log=lambda line: None),
    "due_lines": lambda n: progress.Progress(
        "bench", n + 1, unit="items", every_seconds=1e-9, bar=False,
        log=lambda line: None),
    "tqdm_bar": lambda n: progress.Progress(
        "bench", n + 1, unit="items", bar=True, stream=io.StringIO(),
        log=lambda line: None),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--updates", type=int, default=200_000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--kinds", default=",".join(KINDS))
  args = parser.parse_args()
  kinds = args.kinds.split(",")
  unknown = [k for k in kinds if k not in KINDS]
  if unknown:
    raise SystemExit(f"unknown kinds {unknown}; choose from {list(KINDS)}")
  timing.emit(kind="load", loadavg=os.getloadavg())
  n = args.updates
  bare = statistics.median(_bare(n) for _ in range(args.repeats))
  timing.emit(kind="bare", updates=n, ns_per_iteration=round(1e9 * bare / n,
                                                             1))
  for kind in kinds:
    seconds = statistics.median(_with(KINDS[kind], n)
                                for _ in range(args.repeats))
    timing.emit(kind=kind, updates=n,
                ns_per_iteration=round(1e9 * seconds / n, 1))
    timing.emit(kind="overhead", of=kind,
                ns_per_update=round(1e9 * (seconds - bare) / n, 1))
  timing.emit(kind="load", loadavg=os.getloadavg())


if __name__ == "__main__":
  main()

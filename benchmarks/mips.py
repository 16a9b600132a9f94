r"""MIPS benchmark: exact search (numpy, JAX) vs ScaNN (default, ORQA preset).

One run builds every searcher over the same clustered corpus and prints one
JSON line per measurement: recall@k against exact search, queries/s, build
seconds. Results and the command that produced them: docs/benchmarks/mips.md.

  python benchmarks/mips.py                      # 1M x 128, 2000 queries
  python benchmarks/mips.py --num_rows=50000     # CI-size

The corpus is a Gaussian mixture: `num_centers` centers drawn from N(0, I),
each row a random center plus N(0, cluster_std^2 I) noise; queries are drawn
the same way (fixed seed). num_centers defaults to num_rows // 1000, so a
CI-size run keeps the shape of the 1M one. With the defaults at 1M rows
(1000 centers, cluster_std 1.5, dim 128) 97% of a query's exact top-10 lie
in its own cluster; at
cluster_std 2.0 only ~59% do and the data is close to isotropic, where
partitioning cannot beat brute force by much (try it).

Timings are the fastest of at least `--repeats` passes (and `--min_seconds`
of passes) over all queries after one warm-up pass (the JAX compile,
ScaNN's first touches), so that another process briefly taking the CPU does
not decide the result. Each line also carries `queries_per_cpu_s` (queries
per second of this process's CPU time in that pass, all threads), which
other processes disturb far less than wall time, and the 1-minute load
average when it was measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

from absl import app
from absl import flags
import numpy as np

from realm_jax.index import searchers

_NUM_ROWS = flags.DEFINE_integer("num_rows", 1_000_000, "Corpus rows.")
_DIM = flags.DEFINE_integer("dim", 128, "Embedding dimension.")
_NUM_CENTERS = flags.DEFINE_integer(
    "num_centers", None, "Gaussian mixture centers; default num_rows // 1000 "
    "(1000 rows a cluster at every size).")
_CLUSTER_STD = flags.DEFINE_float(
    "cluster_std", 1.5, "Per-dimension noise around a center (centers ~ "
    "N(0, 1)).")
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 2000, "Queries.")
_K = flags.DEFINE_integer("k", 10, "Neighbours per query (recall@k).")
_SEED = flags.DEFINE_integer("seed", 0, "Data seed.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes; best is kept.")
_MIN_SECONDS = flags.DEFINE_float(
    "min_seconds", 3.0, "Time each searcher for at least this long.")
_SWEEP = flags.DEFINE_bool(
    "sweep", True, "Also time the default ScaNN index at other "
    "num_leaves_to_search / reordering_num_neighbors (no rebuild).")


def clustered_embeddings(num_rows: int, num_queries: int, dim: int,
                         num_centers: int, cluster_std: float,
                         seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Corpus [num_rows, dim] and queries [num_queries, dim], float32.

  Args:
    num_rows: corpus rows.
    num_queries: query rows.
    dim: dimension.
    num_centers: mixture components (uniform weights).
    cluster_std: noise standard deviation per dimension.
    seed: numpy seed.

  Returns:
    (corpus, queries), both drawn from the same mixture.
  """
  rng = np.random.default_rng(seed)
  centers = rng.standard_normal((num_centers, dim), dtype=np.float32)

  def draw(n):
    rows = centers[rng.integers(0, num_centers, n)]
    rows += cluster_std * rng.standard_normal((n, dim), dtype=np.float32)
    return rows

  return draw(num_rows), draw(num_queries)


def recall_at_k(ids: np.ndarray, true_ids: np.ndarray) -> float:
  """Mean over queries of |found ∩ true| / k."""
  k = true_ids.shape[1]
  hits = sum(len(set(a[:k]) & set(b)) for a, b in zip(ids, true_ids))
  return hits / true_ids.size


def _time_search(search: Callable[[], Any], repeats: int,
                 min_seconds: float) -> tuple[float, float]:
  """(wall, process CPU) seconds of the fastest call, after a warm-up call.

  At least `repeats` calls and `min_seconds` of calls, so that a fast
  searcher is also sampled over a window long enough to dodge a burst of
  another process.
  """
  search()
  best_wall, best_cpu = float("inf"), float("inf")
  calls, spent = 0, 0.0
  while calls < repeats or spent < min_seconds:
    wall, cpu = time.perf_counter(), time.process_time()
    search()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if wall < best_wall:
      best_wall, best_cpu = wall, cpu
    calls += 1
    spent += wall
  return best_wall, best_cpu


def run_benchmark(*, num_rows: int = 1_000_000, dim: int = 128,
                  num_centers: int | None = None, cluster_std: float = 1.5,
                  num_queries: int = 2000, k: int = 10, seed: int = 0,
                  repeats: int = 3, min_seconds: float = 3.0,
                  sweep: bool = True,
                  emit: Callable[[dict[str, Any]], None] | None = None
                 ) -> list[dict[str, Any]]:
  """Builds and times every searcher; returns (and emits) one dict each.

  Args:
    num_rows: corpus rows.
    dim: embedding dimension.
    num_centers: mixture centers; None = max(1, num_rows // 1000).
    cluster_std: noise per dimension around a center.
    num_queries: queries timed (all of them, in one batched call).
    k: neighbours per query.
    seed: data seed.
    repeats: timed passes per searcher (best kept).
    min_seconds: keep timing a searcher until this much time is spent.
    sweep: also time the default ScaNN index at other search settings.
    emit: called with every result as it is measured (e.g. print it).

  Returns:
    The measurements, in order.
  """
  num_centers = num_centers or max(1, num_rows // 1000)
  corpus, queries = clustered_embeddings(num_rows, num_queries, dim,
                                         num_centers, cluster_std, seed)
  common = {"num_rows": num_rows, "dim": dim, "num_queries": num_queries,
            "k": k, "num_centers": num_centers, "cluster_std": cluster_std,
            "cpus": os.cpu_count()}
  results = []
  true_ids = None
  exact_qps = 0.0  # the faster exact backend's queries/s

  def measure(name, searcher, build_s, params):
    nonlocal true_ids, exact_qps
    seconds, cpu_seconds = _time_search(
        lambda: searcher.search_batched(queries, k), repeats, min_seconds)
    ids, _ = searcher.search_batched(queries, k)
    if true_ids is None:  # the first searcher is exact numpy: the truth
      true_ids = ids
    qps = num_queries / seconds
    if name.startswith("exact"):
      exact_qps = max(exact_qps, qps)
    result = {
        "name": name, "params": params,
        f"recall@{k}": round(recall_at_k(ids, true_ids), 4),
        "queries_per_s": round(qps, 1),
        "queries_per_cpu_s": round(num_queries / cpu_seconds, 1),
        "speedup_vs_exact": round(qps / exact_qps, 2),
        "build_s": round(build_s, 2),
        **common,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    results.append(result)
    if emit:
      emit(result)

  def build(build_fn):
    started = time.perf_counter()
    searcher = build_fn()
    return searcher, time.perf_counter() - started

  for backend in ("numpy", "jax"):
    config = searchers.ExactConfig(backend=backend)
    searcher, build_s = build(
        lambda c=config: searchers.ExactSearcher.build(corpus, c))
    measure(f"exact_{backend}", searcher, build_s, config.to_dict())
    del searcher

  default, build_s = build(lambda: searchers.ScannSearcher.build(corpus))
  measure("scann_default", default, build_s,
          {**default.config.to_dict(), "resolved": default.resolved})
  orqa, build_s = build(lambda: searchers.ScannSearcher.build(
      corpus, searchers.ORQA_SCANN_CONFIG))
  measure("scann_orqa", orqa, build_s,
          {**orqa.config.to_dict(), "resolved": orqa.resolved})
  del orqa

  if sweep and not default.resolved["brute_force"]:
    num_leaves = default.resolved["num_leaves"]
    for fraction in (0.0125, 0.025, 0.05):
      leaves = max(1, round(fraction * num_leaves))
      for reorder in (100, 250, 500):
        variant = default.with_search_params(
            num_leaves_to_search=leaves, reordering_num_neighbors=reorder)
        measure("scann_default_sweep", variant, 0.0,
                {"num_leaves": num_leaves, "num_leaves_to_search": leaves,
                 "reordering_num_neighbors": reorder})
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")

  def emit(result):
    print(json.dumps(result), flush=True)

  print(f"# {' '.join(sys.argv)}  XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
        f"  load average {os.getloadavg()}", file=sys.stderr, flush=True)
  run_benchmark(num_rows=_NUM_ROWS.value, dim=_DIM.value,
                num_centers=_NUM_CENTERS.value,
                cluster_std=_CLUSTER_STD.value,
                num_queries=_NUM_QUERIES.value, k=_K.value, seed=_SEED.value,
                repeats=_REPEATS.value, min_seconds=_MIN_SECONDS.value,
                sweep=_SWEEP.value, emit=emit)


if __name__ == "__main__":
  app.run(main)

r"""MIPS at REALM's scale: ScaNN over up to 13,353,718 x 128 vectors.

REALM's corpus is 13,353,718 blocks of 128-d embeddings (6.8 GB float32).
For each corpus size this measures, side by side in one run:
  - exact search (numpy, blockwise over the memory-mapped corpus): the
    ground truth and the queries/s baseline;
  - ScaNN builds, each in a fresh child process so that its peak memory is
    its own: build seconds, peak anonymous RSS (the RAM the build really
    holds; the corpus itself is memory-mapped from disk, its page cache is
    reported separately as peak total RSS), queries/s, recall@10 against the
    exact top-10;
  - the re-ordering copy stored as float32, bfloat16 or int8
    (`ScannConfig.reordering_dtype`);
  - a sharded searcher (`ShardedSearcher`: one ScaNN index per row range,
    top-k of the top-k's) built one shard at a time.

  python benchmarks/mips_scale.py                        # the docs' table
  python benchmarks/mips_scale.py --sizes=200000 --num_queries=200   # quick

Data: the Gaussian mixture of benchmarks/mips.py (num_rows // 1000 centers,
cluster_std 1.5) at every size, generated once per size into `--data_dir`
as a .npy file (6.8 GB at full size) and memory-mapped from there.
Results: docs/benchmarks/mips_scale.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags
import numpy as np

PAPER_ROWS = 13_353_718

_SIZES = flags.DEFINE_list(
    "sizes", ["1000000", "4000000", str(PAPER_ROWS)], "Corpus sizes (rows).")
_DIM = flags.DEFINE_integer("dim", 128, "Embedding dimension.")
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 1000, "Queries.")
_K = flags.DEFINE_integer("k", 10, "Neighbours per query (recall@k).")
_DTYPES = flags.DEFINE_list(
    "dtypes", ["float32", "int8"], "ScaNN re-ordering storage measured at "
    "every size.")
_LARGEST_DTYPES = flags.DEFINE_list(
    "largest_dtypes", ["bfloat16"], "Extra re-ordering storage measured at "
    "the largest size only.")
_SHARDS = flags.DEFINE_integer(
    "shards", 4, "Shards of the sharded searcher measured at the largest "
    "size (0: none).")
_SHARD_DTYPE = flags.DEFINE_string(
    "shard_dtype", "int8", "Re-ordering storage of the sharded searcher.")
_NUM_LEAVES = flags.DEFINE_string(
    "num_leaves", None, "ScannConfig.num_leaves for every ScaNN build "
    "(default: ScannConfig's automatic 2 sqrt(N)); 'sqrt' for round(sqrt(N)).")
_SWEEP = flags.DEFINE_list(
    "sweep", ["0.05", "0.1"], "Other leaves_search_fraction values searched "
    "on each index (no rebuild).")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", "/tmp/realm_jax_mips_scale", "Where the corpus .npy and the "
    "exact top-k's are cached.")
_SEED = flags.DEFINE_integer("seed", 0, "Data seed.")
_CHILD = flags.DEFINE_string("child", None, "Internal: one build as JSON.")


class PeakMemory:
  """Samples /proc/self/status every 50 ms: peak RssAnon and VmRSS (bytes)."""

  def __init__(self):
    self.anon = self.total = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _sample(self):
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        name, _, value = line.partition(":")
        if name in ("RssAnon", "VmRSS"):
          fields[name] = int(value.split()[0]) * 1024
    self.anon = max(self.anon, fields.get("RssAnon", 0))
    self.total = max(self.total, fields.get("VmRSS", 0))

  def _run(self):
    while not self._stop.wait(0.05):
      self._sample()

  def stop(self):
    self._stop.set()
    self._thread.join()
    self._sample()


def corpus_path(data_dir: str, num_rows: int, dim: int, seed: int) -> str:
  return os.path.join(data_dir, f"corpus_{num_rows}x{dim}_seed{seed}.npy")


def make_corpus(path: str, num_rows: int, dim: int, seed: int,
                chunk: int = 1 << 20) -> None:
  """Writes the mixture corpus chunk by chunk (never all in RAM), atomically."""
  rng = np.random.default_rng(seed)
  num_centers = max(1, num_rows // 1000)
  centers = rng.standard_normal((num_centers, dim), dtype=np.float32)
  tmp = path + ".tmp"
  out = np.lib.format.open_memmap(tmp, "w+", np.float32, (num_rows, dim))
  started = time.time()
  for start in range(0, num_rows, chunk):
    n = min(chunk, num_rows - start)
    rows = centers[rng.integers(0, num_centers, n)]
    rows += 1.5 * rng.standard_normal((n, dim), dtype=np.float32)
    out[start:start + n] = rows
    done = start + n
    eta = (time.time() - started) / done * (num_rows - done)
    print(f"# corpus {done:,}/{num_rows:,} rows, eta {eta:.0f} s",
          file=sys.stderr, flush=True)
  out.flush()
  del out
  os.replace(tmp, path)


def queries_for(corpus_rows: int, dim: int, num_queries: int, seed: int
               ) -> np.ndarray:
  """Queries drawn from the corpus's mixture (as in benchmarks/mips.py): one
  of the `make_corpus` centers plus the same noise."""
  centers = np.random.default_rng(seed).standard_normal(
      (max(1, corpus_rows // 1000), dim), dtype=np.float32)
  rng = np.random.default_rng(seed + 1)
  rows = centers[rng.integers(0, len(centers), num_queries)]
  return rows + 1.5 * rng.standard_normal(rows.shape, dtype=np.float32)


def recall_at_k(ids: np.ndarray, true_ids: np.ndarray) -> float:
  k = true_ids.shape[1]
  return sum(len(set(a[:k]) & set(b))
             for a, b in zip(ids, true_ids)) / true_ids.size


def best_search_seconds(search, passes: int = 3) -> tuple[float, float]:
  """(wall, CPU) seconds of the fastest of `passes` calls after a warm-up."""
  search()
  best = (float("inf"), float("inf"))
  for _ in range(passes):
    wall, cpu = time.perf_counter(), time.process_time()
    search()
    best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
  return best


def child(spec: dict) -> dict:
  """One build + search in this (fresh) process; returns its measurements."""
  # pylint: disable-next=g-import-not-at-top
  from realm_jax.index import scann_search, search_base, searchers
  scann_search._scann_pybind()  # pylint: disable=protected-access
  corpus = np.load(spec["corpus"], mmap_mode="r")[:spec["num_rows"]]
  queries = np.load(spec["queries"])
  true_ids = np.load(spec["truth"])
  k = true_ids.shape[1]
  memory = PeakMemory()
  memory.stop()
  baseline_anon = memory.anon  # Python, TensorFlow, ScaNN: before the build
  memory = PeakMemory()
  started = time.perf_counter()
  config = search_base.ScannConfig(
      num_leaves=spec["num_leaves"], reordering_dtype=spec["dtype"],
      training_sample_size=spec.get("training_sample_size"))
  if spec["shards"] > 1:
    searcher = searchers.ShardedSearcher.build(
        corpus, search_base.ShardedConfig(num_shards=spec["shards"],
                                          shard_kind="scann",
                                          shard_config=config))
  else:
    searcher = searchers.ScannSearcher.build(corpus, config)
  build_s = time.perf_counter() - started
  memory.stop()
  with open("/proc/self/status", encoding="ascii") as f:
    after_anon = next(int(line.split()[1]) * 1024 for line in f
                      if line.startswith("RssAnon:"))
  wall, cpu = best_search_seconds(
      lambda: searcher.search_batched(queries, k))
  ids, _ = searcher.search_batched(queries, k)
  shards = getattr(searcher, "shards", [searcher])
  sweep = []
  for fraction in spec["sweep"]:
    variants = [s.with_search_params(num_leaves_to_search=max(
        1, round(fraction * s.resolved["num_leaves"]))) for s in shards]
    variant = (searchers.ShardedSearcher(variants, searcher.row_offsets,
                                         searcher.config)
               if len(shards) > 1 else variants[0])
    sweep_wall, _ = best_search_seconds(
        lambda v=variant: v.search_batched(queries, k), passes=2)
    sweep.append({
        "leaves_search_fraction": fraction,
        "queries_per_s": round(len(queries) / sweep_wall, 1),
        f"recall@{k}": round(recall_at_k(
            variant.search_batched(queries, k)[0], true_ids), 4)})
  return {
      "build_s": round(build_s, 1),
      "baseline_anon_gb": round(baseline_anon / 1e9, 2),
      "peak_anon_gb": round(memory.anon / 1e9, 2),
      "build_anon_gb": round((memory.anon - baseline_anon) / 1e9, 2),
      "index_anon_gb": round((after_anon - baseline_anon) / 1e9, 2),
      "peak_rss_gb": round(memory.total / 1e9, 2),
      "queries_per_s": round(len(queries) / wall, 1),
      "queries_per_cpu_s": round(len(queries) / cpu, 1),
      f"recall@{k}": round(recall_at_k(ids, true_ids), 4),
      "resolved": shards[0].resolved,
      "sweep": sweep,
  }


def exact_truth(corpus: np.ndarray, queries: np.ndarray, k: int
               ) -> tuple[np.ndarray, float]:
  """Exact top-k ids (numpy, blockwise over the memory map) and seconds."""
  # pylint: disable-next=g-import-not-at-top
  from realm_jax.index import search_base, searchers
  searcher = searchers.ExactSearcher.build(
      corpus, search_base.ExactConfig(backend="numpy"))
  started = time.perf_counter()
  ids, _ = searcher.search_batched(queries, k)
  return ids, time.perf_counter() - started


def run_child(spec: dict) -> dict:
  result = subprocess.run(
      [sys.executable, __file__, f"--child={json.dumps(spec)}"],
      check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
      text=True)
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _CHILD.value:
    print(json.dumps(child(json.loads(_CHILD.value))), flush=True)
    return
  sizes = sorted(int(s) for s in _SIZES.value)
  dim, k, largest = _DIM.value, _K.value, max(sizes)
  os.makedirs(_DATA_DIR.value, exist_ok=True)
  print(f"# {' '.join(sys.argv)}  load average {os.getloadavg()}",
        file=sys.stderr, flush=True)
  common = {"dim": dim, "k": k, "num_queries": _NUM_QUERIES.value,
            "cpus": os.cpu_count()}
  for num_rows in sizes:
    # Each size is its own mixture of num_rows // 1000 clusters, so every
    # size has the 1M benchmark's shape (1000 rows a cluster).
    path = corpus_path(_DATA_DIR.value, num_rows, dim, _SEED.value)
    if not os.path.exists(path):
      make_corpus(path, num_rows, dim, _SEED.value)
    corpus = np.load(path, mmap_mode="r")
    queries = queries_for(num_rows, dim, _NUM_QUERIES.value, _SEED.value)
    stem = os.path.join(_DATA_DIR.value, f"n{num_rows}_q{len(queries)}")
    np.save(stem + "_queries.npy", queries)
    truth_file = stem + f"_top{k}.npy"
    true_ids, exact_s = exact_truth(corpus, queries, k)
    np.save(truth_file, true_ids)
    exact_qps = len(queries) / exact_s
    row = {"num_rows": num_rows, **common,
           "float32_gb": round(num_rows * dim * 4 / 1e9, 2)}
    print(json.dumps({"name": "exact_numpy", **row, "recall@10": 1.0,
                      "queries_per_s": round(exact_qps, 1),
                      "load_avg_1m": round(os.getloadavg()[0], 2)}),
          flush=True)
    num_leaves = _NUM_LEAVES.value
    if num_leaves == "sqrt":
      num_leaves = round(num_rows ** 0.5)
    elif num_leaves is not None:
      num_leaves = int(num_leaves)
    builds = [(dtype, 1) for dtype in _DTYPES.value]
    if num_rows == largest:
      builds += [(dtype, 1) for dtype in _LARGEST_DTYPES.value]
      if _SHARDS.value > 1:
        builds.append((_SHARD_DTYPE.value, _SHARDS.value))
    for dtype, shards in builds:
      # A sharded searcher's leaves are per shard: sqrt scaling per shard.
      leaves = num_leaves
      if _NUM_LEAVES.value == "sqrt" and shards > 1:
        leaves = round((num_rows / shards) ** 0.5)
      spec = {"corpus": path, "num_rows": num_rows, "dtype": dtype,
              "shards": shards, "num_leaves": leaves,
              "queries": stem + "_queries.npy", "truth": truth_file,
              "sweep": [float(f) for f in _SWEEP.value]}
      result = run_child(spec)
      name = f"scann_{dtype}" + (f"_{shards}shards" if shards > 1 else "")
      result["speedup_vs_exact"] = round(
          result["queries_per_s"] / exact_qps, 1)
      result["build_anon_x_float32"] = round(
          result["build_anon_gb"] / row["float32_gb"], 2)
      for point in result["sweep"]:
        point["speedup_vs_exact"] = round(
            point["queries_per_s"] / exact_qps, 1)
      print(json.dumps({"name": name, **row, "num_shards": shards,
                        "num_leaves_flag": _NUM_LEAVES.value, **result,
                        "load_avg_1m": round(os.getloadavg()[0], 2)}),
            flush=True)


if __name__ == "__main__":
  app.run(main)

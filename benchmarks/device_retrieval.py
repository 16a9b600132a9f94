"""REALM retrieval + batch assembly: host path vs device path, per batch.

Host path (today's pre-training step): query embeddings copied to the host,
exact (numpy) or ScaNN search of k + margin hits, `select_candidates` and
`pretraining_batch` in numpy over the memory-mapped block store, the batch
copied to the devices. Device path: `device_search.candidate_batch` on the
query embeddings where they already are. Both build the same batch; one
JSON line per path with the median wall time per batch.

The store is synthetic (random wordpieces, 4 blocks per article, bodies of
up to doc_len - 3 - title tokens) so that building it takes seconds.

  python benchmarks/device_retrieval.py [--num_blocks=50000] [--batch=16]

Runs on 8 emulated CPU devices unless XLA_FLAGS already sets a count.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import timing  # pylint: disable=g-import-not-at-top,wrong-import-position
from realm_jax.core import parallel  # pylint: disable=g-import-not-at-top,wrong-import-position
from realm_jax.data import block_store_writer, blocks  # pylint: disable=g-import-not-at-top,wrong-import-position
from realm_jax.data.tokenizer import default_vocab_path  # pylint: disable=g-import-not-at-top,wrong-import-position
from realm_jax.index import device_search, searchers  # pylint: disable=g-import-not-at-top,wrong-import-position
from realm_jax.data import realm_inputs  # pylint: disable=g-import-not-at-top,wrong-import-position


def synthetic_blocks(num_blocks: int, doc_len: int, rng):
  for i in range(num_blocks):
    title = rng.integers(1000, 30000, int(rng.integers(1, 6)), np.int32)
    body = rng.integers(1000, 30000, int(rng.integers(
        20, doc_len - 3 - len(title) + 1)), np.int32)
    yield blocks.Block(i // 4, f"t{i // 4}", title, "x", body,
                       np.zeros(1, np.int32))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_blocks", type=int, default=50000)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--k", type=int, default=8)
  parser.add_argument("--margin", type=int, default=16)
  parser.add_argument("--doc_len", type=int, default=288)
  parser.add_argument("--reader_len", type=int, default=384)
  parser.add_argument("--query_len", type=int, default=96)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  mesh = parallel.make_mesh()
  start = time.perf_counter()
  store = block_store_writer.write_block_store(
      synthetic_blocks(args.num_blocks, args.doc_len, rng),
      os.path.join(tempfile.mkdtemp(prefix="device_retrieval_"), "store"),
      tokenizer_vocab_path=default_vocab_path(), source="synthetic",
      max_block_len=args.doc_len)
  store_s = time.perf_counter() - start
  emb = rng.standard_normal((len(store), args.dim)).astype(np.float32)
  b, lq = args.batch, args.query_len
  query_ids = rng.integers(1000, 30000, (b, lq)).astype(np.int32)
  query_ids[:, 0], query_ids[:, -1] = 101, 102
  queries = {
      "query_ids": query_ids, "query_mask": np.ones((b, lq), np.int32),
      "mlm_positions": rng.integers(1, lq - 1, (b, 8)).astype(np.int32),
      "mlm_targets": rng.integers(1000, 30000, (b, 8)).astype(np.int32),
      "mlm_weights": np.ones((b, 8), np.float32),
      "source_doc_hash": store.doc_hash[rng.integers(0, len(store), b)],
  }
  # Query embeddings live on the devices (the query tower's output).
  q_emb = jax.device_put(
      rng.standard_normal((b, args.dim)).astype(np.float32),
      parallel.data_sharded(mesh))
  shape = dict(num_blocks=len(store), dim=args.dim, batch=b, k=args.k,
               doc_len=args.doc_len, reader_len=args.reader_len,
               devices=jax.device_count())
  timing.emit(kind="load", loadavg=os.getloadavg(), store_build_s=store_s)
  kw = dict(doc_len=args.doc_len, reader_len=args.reader_len)

  def host_path(searcher):
    def step():
      hits, _ = searcher.search_batched(np.asarray(q_emb),
                                        args.k + args.margin)
      cands = realm_inputs.select_candidates(
          hits, store.doc_hash, queries["source_doc_hash"], args.k)
      return parallel.shard_batch(mesh, realm_inputs.pretraining_batch(
          queries, cands, store, **kw))
    return step

  reference = jax.device_get(host_path(searchers.build_searcher(
      emb, kind="exact"))())
  for name, config in (("exact", {"backend": "numpy"}), ("scann", {})):
    start = time.perf_counter()
    searcher = searchers.build_searcher(emb, kind=name, **config)
    build_s = time.perf_counter() - start
    seconds = timing.median_seconds(host_path(searcher),
                                    repeats=args.repeats)
    timing.emit(kind="host", searcher=name, ms_per_batch=1e3 * seconds,
                searcher_build_s=build_s, **shape)

  for dtype in (np.float32, jax.numpy.bfloat16):
    start = time.perf_counter()
    index = device_search.DeviceIndex.build(store, emb, mesh, dtype=dtype)
    jax.block_until_ready(index)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(index.with_embeddings(emb))
    swap_s = time.perf_counter() - start
    step = lambda: device_search.candidate_batch(  # pylint: disable=cell-var-from-loop
        index, queries, q_emb, k=args.k, **kw)
    got, _ = jax.device_get(step())
    # bfloat16 scores may rank other blocks; float32 must match exactly.
    same = all(np.array_equal(got[n], v) for n, v in reference.items())
    seconds = timing.median_seconds(step, repeats=args.repeats)
    timing.emit(kind="device", embeddings=np.dtype(dtype).name,
                ms_per_batch=1e3 * seconds, index_build_s=build_s,
                embedding_swap_s=swap_s, same_batch_as_host_exact=same,
                **shape)
  timing.emit(kind="load", loadavg=os.getloadavg())


if __name__ == "__main__":
  main()

"""REALM pre-training step speed on CPU, side by side in one run.

Prints one JSON line per measurement:
  - numpy float32 matmul GFLOP/s on the model's own layer shape (the peak);
  - the jitted data-parallel train step (`loop.make_train_step` with
    BERT's optimizer) for the tiny and MiniLM-L6 configs at REALM's shapes
    (query 96, documents 288, reader 384, k = 7 + null document, 10 masks):
    seconds/step, examples/s, achieved GFLOP/s and its share of the peak;
  - with --builder: trainer steps/s alone and while an index builder process
    embeds a block store beside it.

    python benchmarks/pretrain_step.py [--batch_size=2] [--steps=3] [--builder]

Run with XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= for the faster
CPU dot path (BUILD.md); the flags are printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def emit(**record):
  record["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  print(json.dumps(record), flush=True)


def matmul_peak(tokens: int, hidden: int, inter: int) -> float:
  a = np.random.rand(tokens, hidden).astype(np.float32)
  b = np.random.rand(hidden, inter).astype(np.float32)
  a @ b
  reps, start = 0, time.perf_counter()
  while time.perf_counter() - start < 2.0:
    a @ b
    reps += 1
  return 2 * tokens * hidden * inter * reps / (time.perf_counter() - start
                                               ) / 1e9


def step_flops(cfg, batch: int, cands: int, masks: int, lq=96, ld=288,
               lr=384) -> float:
  from realm_jax.model import realm  # pylint: disable=g-import-not-at-top
  return realm.pretraining_flops(
      cfg, batch=batch, candidates=cands, query_length=lq, block_length=ld,
      reader_length=lr, num_masks=masks)


def build(name: str):
  import dataclasses  # pylint: disable=g-import-not-at-top
  from realm_jax.model import cpu  # pylint: disable=g-import-not-at-top
  from realm_jax.model.bert import BertConfig  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig, ReaderConfig, RetrieverConfig  # pylint: disable=g-import-not-at-top
  if name == "tiny":
    bert = BertConfig(hidden_size=32, num_layers=2, num_heads=4,
                      intermediate_size=64)
    retriever = RetrieverConfig(bert=bert, projection_size=128)
  else:
    bert = BertConfig(hidden_size=384, num_layers=6, num_heads=12,
                      intermediate_size=1536, gelu_approximate=False)
    retriever = RetrieverConfig(bert=bert, projection_size=None,
                                pooling="mean", normalize=True)
  return cpu.for_cpu(RealmConfig(
      retriever=retriever,
      reader=ReaderConfig(bert=dataclasses.replace(bert), span_head=False)))


def time_steps(cfg, batch_size: int, steps: int, seconds: float | None = None):
  import jax  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import Realm  # pylint: disable=g-import-not-at-top
  from realm_jax.testing import tiny  # pylint: disable=g-import-not-at-top
  from realm_jax.training import loop, optimizer, pretrain  # pylint: disable=g-import-not-at-top
  from realm_jax.core import parallel  # pylint: disable=g-import-not-at-top
  graphdef, params = functional.init(lambda r: Realm(cfg, rngs=r), 0)
  mesh = parallel.make_mesh()
  tx = optimizer.bert_optimizer(learning_rate=1e-4, num_train_steps=1000)
  step = loop.make_train_step(pretrain.make_loss_fn(graphdef), tx, mesh)
  state = loop.TrainState(jax.numpy.zeros((), jax.numpy.int32), params,
                          tx.init(params))
  batch = tiny.random_pretraining_batch(
      np.random.default_rng(0), batch=batch_size, candidates=8,
      query_len=96, doc_len=288, num_masks=10,
      vocab_size=cfg.retriever.bert.vocab_size)
  # Reader inputs at REALM's length 384 = query 96 + document 288.
  batch = parallel.shard_batch(mesh, batch)
  state, m = step(state, batch, jax.random.key(0))  # Compile.
  jax.block_until_ready(m)
  times = []
  start = time.perf_counter()
  while len(times) < steps or (seconds and time.perf_counter() - start
                               < seconds):
    t = time.perf_counter()
    state, m = step(state, batch, jax.random.key(0))
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  return float(np.median(times)), len(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch_size", type=int, default=2)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--configs", default="tiny,minilm")
  parser.add_argument("--builder", action="store_true",
                      help="Also measure the trainer beside a builder.")
  parser.add_argument("--block_store", default=None,
                      help="Block store the builder embeds (default: the "
                      "gensim slice, built in a temp dir).")
  args = parser.parse_args()
  peak = matmul_peak(args.batch_size * 8 * 384, 384, 1536)
  emit(benchmark="numpy_matmul_peak", shape=[args.batch_size * 8 * 384,
                                             384, 1536],
       gflops=round(peak, 1))
  for name in args.configs.split(","):
    cfg = build(name)
    seconds, n = time_steps(cfg, args.batch_size, args.steps)
    flops = step_flops(cfg, args.batch_size, 8, 10)
    emit(benchmark="pretrain_step", config=name, batch_size=args.batch_size,
         candidates=8, query_len=96, doc_len=288, reader_len=384,
         steps_timed=n, seconds_per_step=round(seconds, 3),
         examples_per_s=round(args.batch_size / seconds, 3),
         gflops=round(flops / seconds / 1e9, 1),
         share_of_numpy_peak=round(flops / seconds / 1e9 / peak, 3))
  if args.builder:
    cfg = build("tiny")
    alone, n_alone = time_steps(cfg, args.batch_size, args.steps, seconds=20)
    store = args.block_store
    if store is None:
      import tempfile  # pylint: disable=g-import-not-at-top
      from realm_jax.data import corpus_job  # pylint: disable=g-import-not-at-top
      store = os.path.join(tempfile.mkdtemp(), "blocks")
      corpus_job.build_corpus(output_dir=store, max_documents=20)
    # A builder process that embeds the store with MiniLM-sized weights in a
    # loop, as the index builder does between checkpoints.
    code = ("import numpy as np, sys\n"
            "sys.path.insert(0, %r)\n"
            "from benchmarks.pretrain_step import build\n"
            "from realm_jax.data import block_store\n"
            "from realm_jax.index import embed\n"
            "from realm_jax.model import functional\n"
            "from realm_jax.model.realm import Retriever\n"
            "cfg = build('minilm').retriever\n"
            "p = functional.init(lambda r: Retriever(cfg, rngs=r), 0)[1]\n"
            "s = block_store.BlockStore.open(%r)\n"
            "while True: embed.embed_block_store(p, cfg, s)\n"
            % (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               store))
    builder = subprocess.Popen([sys.executable, "-c", code],
                               stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
      time.sleep(20)  # Let it compile and start embedding.
      beside, n_beside = time_steps(cfg, args.batch_size, args.steps,
                                    seconds=20)
    finally:
      builder.kill()
    emit(benchmark="trainer_with_builder", config="tiny",
         batch_size=args.batch_size, steps_per_s_alone=round(1 / alone, 3),
         steps_per_s_with_builder=round(1 / beside, 3),
         slowdown=round(beside / alone, 2), steps_timed=[n_alone, n_beside],
         note="builder embeds with MiniLM weights in a separate process")


if __name__ == "__main__":
  main()

r"""Host time per REALM pre-training step: retrieval on the host vs on device.

Runs the real trainer (`pretrain.train`, experiments/pretrain_tiny_cpu.gin)
twice on the same corpus and queries, with `retrieval="host"` (query
embeddings copied to the host, exact search there, the batch built in numpy
from the block store) and `retrieval="device"` (`index/device_search.py`),
and reports per step: the wall time, and the host time spent building the
batch (`RetrievalInput.batch`), during which the host does not dispatch
device work. One JSON line each, side by side in one run.

    python benchmarks/retrieval_step.py [--copies=64] [--steps=30]

On the emulated CPU devices the device computes on the same 2 cores as the
host, so the step's wall time says little; the host time per batch is the
figure that carries over to an accelerator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import gin

import timing
from realm_jax import gin_cli
from realm_jax.testing import corpus
from realm_jax.training import pretrain


def run(workdir, store, queries, retrieval, steps, batch_size):
  """Trains `steps` steps; returns (wall s/step, host batch s/step) medians
  over the steps after the first two (compilation)."""
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
      f"QUERIES = '{queries}'",
      f"pretrain.PretrainConfig.num_train_steps = {steps}",
      f"pretrain.PretrainConfig.batch_size = {batch_size}",
      "pretrain.PretrainConfig.query_length = 32",
      "pretrain.PretrainConfig.reader_length = 64",
      f"pretrain.PretrainConfig.checkpoint_every = {steps}",
      f"pretrain.PretrainConfig.retrieval = '{retrieval}'"])
  config = gin.get_configurable(pretrain.PretrainConfig)()
  model = gin.get_configurable(pretrain.RealmConfig)()
  batch_seconds = []
  original = pretrain.RetrievalInput.batch

  def timed_batch(self, step, state):
    start = time.perf_counter()
    out = original(self, step, state)
    batch_seconds.append(time.perf_counter() - start)
    return out

  pretrain.RetrievalInput.batch = timed_batch
  try:
    history = pretrain.train(config=config, model=model)
  finally:
    pretrain.RetrievalInput.batch = original
  steps_s = [h["seconds_per_step"] for h in history][2:]
  return statistics.median(steps_s), statistics.median(batch_seconds[2:])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--copies", type=int, default=64,
                      help="Copies of the tiny corpus's articles (blocks).")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--batch_size", type=int, default=8)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    store, annotated = corpus.make_tiny_corpus(os.path.join(tmp, "corpus"),
                                               copies=args.copies)
    queries = corpus.make_query_cache(annotated, os.path.join(tmp, "q"),
                                      query_length=32)
    timing.emit(kind="load", loadavg=os.getloadavg())
    for retrieval in ("host", "device"):
      step_s, batch_s = run(os.path.join(tmp, retrieval), store, queries,
                            retrieval, args.steps, args.batch_size)
      timing.emit(kind="retrieval_step", retrieval=retrieval,
                  seconds_per_step=round(step_s, 4),
                  host_batch_seconds=round(batch_s, 4),
                  host_batch_share=round(batch_s / step_s, 3),
                  copies=args.copies, batch_size=args.batch_size,
                  steps=args.steps)
    timing.emit(kind="load", loadavg=os.getloadavg())


if __name__ == "__main__":
  main()

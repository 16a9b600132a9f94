r"""Host time per REALM pre-training step: serial, overlapped, on device.

Runs the real trainer (`pretrain.train`) on the same corpus and queries in
four input modes: `host` (query embeddings copied to the host, exact
search there, the batch built in numpy from the block store, then the
step), `host_overlap` (the same work for step s+1 on a host thread while
step s trains: `RetrievalConfig.overlap_input`), `device`
(`index/device_search.py`) and `host_rerank` (`host` plus Atlas-style
re-ranking: `--rerank` proposals per query re-embedded by the current
document tower, `RetrievalConfig.rerank_candidates`), and
`host_lexical<m>` (`host` plus BM25's first m blocks beside the dense ones
and the recipe's mixture prior while the retriever is held:
`RetrievalConfig.lexical_candidates`, `held_prior = "mixture"`). It
reports per step: the wall time, and the
host time spent in `RetrievalInput.batch`, during which the host does not
dispatch device work. One JSON line each, side by side in one run.

    python benchmarks/retrieval_step.py [--copies=64] [--steps=30]
    python benchmarks/retrieval_step.py --demo      # the demo's MiniLM shapes
    python benchmarks/retrieval_step.py --modes=host,host_lexical2,host_lexical4

On the emulated CPU devices the device computes on the same 2 cores as the
host, so the step's wall time says little; the host time per batch is the
figure that carries over to an accelerator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import gin

import timing
from realm_jax import gin_cli
from realm_jax.testing import corpus
from realm_jax.training import candidates
from realm_jax.training import pretrain


MODES = {"host": ("host", False), "host_overlap": ("host", True),
         "device": ("device", False),
         # Atlas-style re-ranking of --rerank proposals (serial host input).
         "host_rerank": ("host", False)}


def run(workdir, store, queries, mode, steps, batch_size, demo, rerank):
  """Trains `steps` steps; returns (wall s/step, host s/step in `batch()`,
  of which host -> device copies) medians over the steps after the first
  two (compilation)."""
  lexical = int(mode[len("host_lexical"):]) if mode.startswith(
      "host_lexical") else 0
  retrieval, overlap = MODES["host" if lexical else mode]
  gin.clear_config()
  # The demo's shapes: MiniLM-L6 towers, queries of 48, blocks of 128,
  # reader 176; its builder job replaced by the inline exact index (the
  # same input work per step).
  shapes = ["pretrain.PretrainConfig.reader_length = 64"] if not demo else [
                "pretrain.PretrainConfig.index_mode = 'inline'",
                "pretrain.GateConfig.latest_release = 0",
                "pretrain.PretrainConfig.log_every = 1"]
  gin_cli.parse([("experiments/demo_pretrain.gin" if demo else
                  "experiments/pretrain_tiny_cpu.gin")], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
      f"QUERIES = '{queries}'",
      f"pretrain.PretrainConfig.num_train_steps = {steps}",
      f"pretrain.PretrainConfig.batch_size = {batch_size}",
      f"pretrain.PretrainConfig.checkpoint_every = {steps}",
      "builder.IndexBuildConfig.searcher = 'exact'",
      f"pretrain.RetrievalConfig.search = '{retrieval}'",
      f"pretrain.RetrievalConfig.overlap_input = {overlap}",
      "pretrain.RetrievalConfig.rerank_candidates = "
      f"{rerank if mode == 'host_rerank' else 0}",
      f"pretrain.RetrievalConfig.lexical_candidates = {lexical}",
      "pretrain.RetrievalConfig.held_prior = "
      f"'{'mixture' if lexical else 'dense'}'", *shapes])
  config = gin.get_configurable(pretrain.PretrainConfig)()
  model = gin.get_configurable(pretrain.RealmConfig)()
  # Seconds inside `RetrievalInput.batch` per step, and of those: host ->
  # device copies (shard_batch), the query tower and the re-ranking's
  # document tower (device computations, which the CPU backend runs inside
  # the dispatching call, so on emulated devices they land on the host's
  # clock; on an accelerator they are queued asynchronously). Timed only on
  # the calling thread: overlap_input's worker thread is off the step's
  # critical path by design.
  parts = ("copy", "query_tower", "rerank")
  batch_seconds, spent = [], dict.fromkeys(parts, 0.0)
  sources = candidates.CandidateSource, candidates.HostCandidates
  originals = {"batch": pretrain.RetrievalInput.batch,
               "copy": candidates.parallel.shard_batch,
               "query_tower": sources[0].query_embeddings,
               "rerank": sources[1].rerank}
  main_thread = threading.main_thread()

  def timed(part):
    def fn(*args, **kwargs):
      start = time.perf_counter()
      out = originals[part](*args, **kwargs)
      if threading.current_thread() is main_thread:
        spent[part] += time.perf_counter() - start
      return out
    return fn

  def timed_batch(self, step, state):
    spent.update(dict.fromkeys(parts, 0.0))
    start = time.perf_counter()
    out = originals["batch"](self, step, state)
    batch_seconds.append({"batch": time.perf_counter() - start, **spent})
    return out

  pretrain.RetrievalInput.batch = timed_batch
  candidates.parallel.shard_batch = timed("copy")
  sources[0].query_embeddings = timed("query_tower")
  sources[1].rerank = timed("rerank")
  try:
    history = pretrain.train(config=config, model=model)
  finally:
    pretrain.RetrievalInput.batch = originals["batch"]
    candidates.parallel.shard_batch = originals["copy"]
    sources[0].query_embeddings = originals["query_tower"]
    sources[1].rerank = originals["rerank"]
  steps_s = [h["seconds_per_step"] for h in history][2:]
  return statistics.median(steps_s), {
      k: statistics.median(b[k] for b in batch_seconds[2:])
      for k in ("batch",) + parts}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--copies", type=int, default=64,
                      help="Copies of the tiny corpus's articles (blocks).")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--demo", action="store_true",
                      help="The demo's model (MiniLM-L6) and lengths.")
  parser.add_argument("--modes", default="host,host_overlap,device")
  parser.add_argument("--rerank", type=int, default=32,
                      help="Proposals per query re-ranked in host_rerank.")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    store, annotated = corpus.make_tiny_corpus(
        os.path.join(tmp, "corpus"), copies=args.copies,
        max_block_len=128 if args.demo else 32)
    queries = corpus.make_query_cache(annotated, os.path.join(tmp, "q"),
                                      query_length=48 if args.demo else 32)
    timing.emit(kind="load", loadavg=os.getloadavg())
    for i, mode in enumerate(args.modes.split(",")):  # a mode may repeat
      step_s, host = run(os.path.join(tmp, f"{i}_{mode}"), store, queries,
                         mode, args.steps, args.batch_size, args.demo,
                         args.rerank)
      # What stays on the host on any backend: search, candidate selection,
      # reading the queries and assembling the batch.
      own = host["batch"] - host["query_tower"] - host["rerank"]
      timing.emit(kind="retrieval_step", mode=mode, demo=args.demo,
                  seconds_per_step=round(step_s, 4),
                  host_batch_seconds=round(host["batch"], 4),
                  host_batch_share=round(host["batch"] / step_s, 3),
                  host_to_device_seconds=round(host["copy"], 4),
                  query_tower_seconds=round(host["query_tower"], 4),
                  rerank_document_tower_seconds=round(host["rerank"], 4),
                  host_input_seconds=round(own, 4),
                  rerank_candidates=(args.rerank if mode == "host_rerank"
                                     else 0),
                  lexical_candidates=(int(mode[len("host_lexical"):])
                                      if mode.startswith("host_lexical")
                                      else 0),
                  copies=args.copies, batch_size=args.batch_size,
                  steps=args.steps)
    timing.emit(kind="load", loadavg=os.getloadavg())


if __name__ == "__main__":
  main()

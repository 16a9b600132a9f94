"""Index refresh latency: checkpoint written -> new index live in the trainer.

Runs the real trainer (`index_mode="builder"`) and the real index builder as
two processes on the embedded Wikipedia slice (tiny model, exact search by
default) and prints one JSON line per refreshed index with the breakdown:

  checkpoint committed -> index published (builder: poll, restore,
  embed, build, publish) -> loaded + verified by the watcher -> swapped in
  between two training steps.

    python benchmarks/refresh_latency.py [--steps=40] [--max_documents=10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--checkpoint_every", type=int, default=5)
  parser.add_argument("--max_documents", type=int, default=10)
  parser.add_argument("--searcher", default="exact")
  parser.add_argument("--workdir", default=None)
  args = parser.parse_args()
  root = args.workdir or tempfile.mkdtemp(prefix="refresh_")
  from realm_jax.data import annotate_job, corpus_job, examples, query_cache_writer, wikipedia  # pylint: disable=g-import-not-at-top
  store = os.path.join(root, "blocks")
  if not os.path.exists(store):
    corpus_job.build_corpus(output_dir=store,
                            max_documents=args.max_documents,
                            max_block_len=128)
  annotated = os.path.join(root, "annotated")
  if not os.path.exists(annotated):  # (the job's output appears whole)
    annotate_job.annotate_corpus(
        input_path=wikipedia.default_wikipedia_dump(), output_dir=annotated,
        num_shards=1, max_documents=args.max_documents)
  queries = os.path.join(root, "queries48")
  if not os.path.exists(queries):
    query_cache_writer.build_query_cache(
        f"{annotated}/*.tfr.gz", queries, num_shards=1,
        query_config=examples.RealmQueryConfig(query_length=48))
  workdir = os.path.join(root, "run")
  bindings = [
      f"WORKDIR='{workdir}'", f"BLOCK_STORE='{store}'",
      f"QUERIES='{queries}'",
      f"pretrain.PretrainConfig.num_train_steps={args.steps}",
      f"pretrain.PretrainConfig.checkpoint_every={args.checkpoint_every}",
      "pretrain.PretrainConfig.index_mode='builder'",
      "pretrain.PretrainConfig.keep_checkpoints=1000",
      "pretrain.PretrainConfig.reader_length=176",
  ]
  trainer = subprocess.Popen(
      [sys.executable, "-m", "realm_jax.jobs.pretrain",
       "--gin_file=experiments/pretrain_tiny_cpu.gin",
       *[f"--gin_bindings={b}" for b in bindings]],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  builder = subprocess.Popen(
      [sys.executable, "-m", "realm_jax.jobs.index_builder",
       "--gin_file=models/tiny.gin", "--gin_file=runs/index_builder.gin",
       f"--gin.WORKDIR='{workdir}'", f"--gin.BLOCK_STORE='{store}'",
       f"--gin.builder.IndexBuildConfig.searcher='{args.searcher}'",
       "--gin.builder.BuilderConfig.poll_seconds=0.5",
       "--gin.builder.IndexBuildConfig.keep=1000"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  trainer.wait()
  builder.wait(timeout=600)
  with open(os.path.join(workdir, "index_swaps.json")) as f:
    swaps = json.load(f)
  latencies = []
  for swap in swaps:
    step = swap["index_step"]
    commit = os.path.getmtime(os.path.join(workdir, "checkpoints", str(step),
                                           "commit_success.txt"))
    with open(os.path.join(workdir, "index", str(step),
                           "manifest.json")) as f:
      manifest = json.load(f)
    record = {
        "benchmark": "refresh_latency", "index_step": step,
        "rows": manifest["rows"], "searcher": manifest["searcher"]["kind"],
        "checkpoint_to_published_s": round(manifest["created"] - commit, 2),
        "embed_and_build_s": manifest["build_seconds"],
        "published_to_loaded_s": round(swap["loaded_at"]
                                       - manifest["created"], 2),
        "loaded_to_swapped_s": round(swap["swapped_at"] - swap["loaded_at"],
                                     2),
        "checkpoint_to_live_s": round(swap["swapped_at"] - commit, 2),
    }
    latencies.append(record["checkpoint_to_live_s"])
    print(json.dumps(record), flush=True)
  print(json.dumps({"benchmark": "refresh_latency_summary",
                    "indices_swapped": len(swaps),
                    "median_checkpoint_to_live_s":
                    round(float(np.median(latencies[1:] or latencies)), 2),
                    "note": "index 0 is built before training starts"}))


if __name__ == "__main__":
  main()

r"""The evidence the reader gives the retriever, on training and dev queries.

REALM's retriever follows d log p(y|x) / d f(z) = p(z|x, y) - p(z|x): the
mass the reader's posterior moves between candidates. `training.gate`'s
`gate_statistics` sums it over the answer-bearing candidates (those whose
text holds the masked span): `evidence` per query, and its z-score over the
queries that retrieved one. While the reader ignores the blocks it is
exactly 0. This reads a `benchmarks.learning` run's checkpoints and,
for each step, measures it (with `eval.pretrain_eval`, the checkpoint's own
exact index, k candidates + null) on the first --train_queries of the
training query cache (the queries the retriever's gradient comes from)
and the first --dev_queries of the gate's dev cache (never trained on).
One JSON line per (step, set):

  python benchmarks/gate_evidence.py --workdir=/tmp/gate/w1000_s1_a \
      --condition=realm_fixed600 --steps=500,600,700,800 \
      --output=/tmp/gate/evidence.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from realm_jax import gin_cli  # pylint: disable=wrong-import-position

gin_cli.add_cpu_xla_flag()


def _head(path: str, n: int):
  from realm_jax.data import query_cache  # pylint: disable=g-import-not-at-top
  stream = query_cache.QueryStream(path, seed=0, batch_size=n)
  try:
    return stream.head(n)
  finally:
    stream.close()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True,
                      help="A benchmarks.learning --workdir.")
  parser.add_argument("--condition", default="realm")
  parser.add_argument("--steps", required=True, help="Comma-separated.")
  parser.add_argument("--gin_file", default="experiments/pretrain_world_cpu.gin")
  parser.add_argument("--train_queries", type=int, default=512)
  parser.add_argument("--dev_queries", type=int, default=128)
  parser.add_argument("--output", default=None)
  args = parser.parse_args(argv)

  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import pretrain_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.index import embed  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
  from realm_jax.data import realm_inputs  # pylint: disable=g-import-not-at-top
  from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top

  gin_cli.parse([args.gin_file], ["WORKDIR = 'unused'",
                                  "BLOCK_STORE = 'unused'",
                                  "QUERIES = 'unused'",
                                  "GATE_QUERIES = 'unused'"])
  model = gin.get_configurable(RealmConfig)()
  recipe = gin.get_configurable(pretrain.PretrainConfig)()
  store = block_store.BlockStore.open(
      os.path.join(args.workdir, "world", "blocks"))
  sets = {"train": _head(os.path.join(args.workdir, "queries_salient"),
                         args.train_queries),
          "dev": _head(os.path.join(args.workdir, "queries_dev"),
                       args.dev_queries)}
  reader_length = realm_inputs.reader_length(
      recipe.reader_length, sets["train"]["query_ids"].shape[1],
      store.max_block_len, field="PretrainConfig.reader_length",
      queries=os.path.join(args.workdir, "queries_salient"))
  ckpts = checkpoints.checkpoint_dir(os.path.join(args.workdir,
                                                  args.condition))
  out = open(args.output, "w", encoding="utf-8") if args.output else None
  for step in [int(s) for s in args.steps.split(",")]:
    params = checkpoints.restore_items(ckpts, step, checkpoints.PARAM_ITEMS)
    block_emb, _ = embed.embed_block_store(
        params["retriever"], model.retriever, store, log_every_seconds=1e9)
    for name, queries in sets.items():
      metrics = pretrain_eval.evaluate(
          params, model, store, queries, None,
          num_candidates=recipe.retrieval.num_candidates,
          reader_length=reader_length, block_emb=block_emb,
          trivial_candidates=recipe.retrieval.trivial_candidates)
      line = json.dumps({"condition": args.condition, "step": step,
                         "queries": name, **{k: round(v, 6) for k, v in
                                             metrics.items()}})
      print(line, flush=True)
      if out:
        out.write(line + "\n")
  if out:
    out.close()


if __name__ == "__main__":
  main()

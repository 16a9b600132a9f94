r"""How flat the retriever's posterior p(z|x) is, per `score_scale`.

REALM's retriever learns through p(z|x) = softmax_z f(x, z) over the
candidates of a query. With L2-normalised embeddings (MiniLM) f is a cosine
in [-1, 1], and the top candidates' cosines lie close together, so at
`RetrieverConfig.score_scale = 1` the softmax is nearly uniform and the
retriever's gradient (p(z|x, y) - p(z|x)) nearly vanishes. This measures
it on held-out questions about the Wikipedia slice, with a pre-training
run's query tower and index (e.g. one of `benchmarks.learning
--world=wiki --start=minilm`), and prints one JSON line:

  top_cosines      mean f(x, z) / score_scale of the top k blocks
  scale<s>         for each scale: mean top-1 probability and entropy of
                   softmax(s * cosines) over the top k (uniform: 1/k and
                   log k)

  python benchmarks/retrieval_posterior.py --run=/tmp/lw_a20/query_side \
      --gin_file=experiments/pretrain_minilm_wiki.gin \
      --gin="realm.RetrieverConfig.share_towers = False"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from realm_jax import gin_cli  # pylint: disable=wrong-import-position

gin_cli.add_cpu_xla_flag()

QUESTIONS = os.path.join(os.path.dirname(__file__), "data",
                         "wiki_heldout_qa.jsonl")


def posterior_stats(cosines, scales) -> dict:
  """Top-1 probability and entropy of softmax(s * cosines) per scale."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = {"k": int(cosines.shape[1]),
         "top_cosines": cosines.mean(0).round(4).tolist(),
         "uniform": {"max_p": 1 / cosines.shape[1],
                     "entropy": float(np.log(cosines.shape[1]))}}
  for s in scales:
    z = s * cosines
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out[f"scale{s:g}"] = {
        "max_p": round(float(p.max(1).mean()), 4),
        "entropy": round(float(-(p * np.log(p)).sum(1).mean()), 4)}
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--run", required=True,
                      help="A pre-training workdir (checkpoints/, index/).")
  parser.add_argument("--step", type=int, default=0,
                      help="Its checkpoint (and index) step.")
  parser.add_argument("--gin_file", action="append", required=True,
                      help="The run's model gin files.")
  parser.add_argument("--gin", action="append", default=[])
  parser.add_argument("--questions", default=QUESTIONS)
  parser.add_argument("--question_length", type=int, default=48)
  parser.add_argument("--k", type=int, default=3,
                      help="Candidates (the run's num_candidates).")
  parser.add_argument("--scales", default="1,20")
  args = parser.parse_args(argv)

  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints, gin_config  # pylint: disable=g-import-not-at-top
  from realm_jax.data import qa  # pylint: disable=g-import-not-at-top
  from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import pretrain_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.index import publish  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
  from realm_jax.data import qa_inputs  # pylint: disable=g-import-not-at-top

  gin_cli.parse(args.gin_file, [
      "WORKDIR = ''", "BLOCK_STORE = ''", "QUERIES = ''",
      "GATE_QUERIES = ''"] + args.gin)
  model = gin_config.configured(RealmConfig)
  ckpt = checkpoints.TrainCheckpointer(checkpoints.checkpoint_dir(args.run),
                                       async_save=False)
  try:
    params = ckpt.restore_params(args.step)
  finally:
    ckpt.close()
  blocks = publish.load_index(checkpoints.index_root(args.run),
                              args.step).embeddings.astype(np.float64)
  questions = qa.read_qa_jsonl(args.questions, strict=True)
  q = qa_inputs.tokenize_questions(
      Tokenizer(), [e.question for e in questions], args.question_length)
  embed = pretrain_eval._query_fn(model)  # pylint: disable=protected-access
  query = np.concatenate([np.asarray(embed(
      params, q["question_ids"][i:i + 64], q["question_mask"][i:i + 64]))
                          for i in range(0, len(questions), 64)])
  # Cosines (f / score_scale) of each question's top k blocks.
  scores = query.astype(np.float64) @ blocks.T
  top = -np.sort(-scores, axis=1)[:, :args.k]
  print(json.dumps({"run": args.run, "step": args.step,
                    "questions": len(questions),
                    **posterior_stats(top, [float(s) for s in
                                            args.scales.split(",")])}))


if __name__ == "__main__":
  main()

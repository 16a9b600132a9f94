r"""The calibrated hybrid (issue 70): chosen on some questions, scored on others.

    python -m benchmarks.calibration --data_dir=/tmp/public_data \
        --workdir=/tmp/real_text --sets=describe,demo \
        --output=docs/results/calibration.jsonl

For each set of questions, the questions are split in two, no question in
both: the calibration share is what `realm-calibrate` measures
(`realm_jax.eval.calibrate`: answer recall@k of MiniLM, BM25 and 22
fusions, the choice by `realm_jax.index.calibration.RULE`), the rest is
where the choice is scored, paired against each single ranker and the
fixed-rule hybrid on the same questions. MiniLM-L6 is the dense ranker in
both towers (as `benchmarks/real_text.py`).

  describe  the leads' Wikidata descriptions over the leads
            (`real_text.py --tasks=describe`, 8,986 questions, 12,915
            blocks): `--splits` random calibration sets of
            `--calibration_questions` each (seeds 0, 1, ...), the other
            questions scored. Needs `vital_leads.jsonl` in --data_dir;
            MiniLM's index of the leads and its ranking of the questions are
            the ones real_text.py keeps in --workdir (built there the first
            time: about 7 minutes on 2 cores).
  demo      the demo's questions (`realm_jax/data/demo_qa`) over the
            demo's corpus (16 articles of the gensim slice, blocks of <= 128
            wordpieces): calibrated on train.jsonl (64), scored on dev.jsonl
            (24).

Each rank is computed once for all questions and every candidate's hits
kept, so a split only re-decides. One JSON line per set and split; then
the time of one `calibrate.calibrate` of `--calibration_questions`
describe questions from scratch (embedding, BM25, answer flags, fusions;
MiniLM and the indices already loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from benchmarks import real_text  # pylint: disable=wrong-import-position

KS = (1, 5, 20, 100)


def _hits(examples, dense, bm25, store, config):
  """candidate -> bool [Q, len(KS)] over all `examples` (each ranker asked
  once, `calibrate.rank_and_flag` / `candidate_hits`)."""
  from realm_jax.eval import calibrate  # pylint: disable=g-import-not-at-top
  depth = max(max(config.ks), config.candidates)
  d, b, flags = calibrate.rank_and_flag(examples, dense, bm25, store, depth,
                                        batch_size=len(examples))
  return calibrate.candidate_hits(d, b, flags, config)


def score_split(hits, calib, held, name: str, **info):
  """The JSON line of one split: the choice made on `calib` (bool [Q]),
  scored on `held`, paired against each single ranker and the fixed rule
  ("weighted 0.5")."""
  from realm_jax.index import calibration  # pylint: disable=g-import-not-at-top
  decision = calibration.decide({k: v[calib] for k, v in hits.items()}, KS)
  scored = {k: v[held].astype(np.float64) for k, v in hits.items()}
  chosen = scored[decision.chosen]
  row = {"set": name, **info, "calibration_questions": int(calib.sum()),
         "scored_questions": int(held.sum()), "chosen": decision.chosen,
         "best_single_on_calibration": decision.best_single,
         "calibration_gain": round(decision.gain, 4),
         "calibration_se": round(decision.se, 4),
         "recall": {n: [round(float(x), 4) for x in scored[n].mean(0)]
                    for n in ("bm25", "dense", "weighted 0.5",
                              decision.chosen)}}
  for other in ("bm25", "dense", "weighted 0.5"):
    d = chosen - scored[other]
    se = d.std(0, ddof=1) / np.sqrt(len(d))
    row[f"chosen-{other}"] = [[round(100 * float(m), 2),
                               round(100 * float(e), 2)]
                              for m, e in zip(d.mean(0), se)]
  best = np.maximum(scored["bm25"].mean(0), scored["dense"].mean(0))
  row["chosen-better_single_pts"] = [round(100 * float(x), 2)
                                     for x in chosen.mean(0) - best]
  return row


def describe_rows(args, config):
  """The describe set: random calibration shares, the rest scored."""
  from realm_jax.eval import calibrate  # pylint: disable=g-import-not-at-top
  from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
  stores = real_text.build_stores(args.data_dir, args.workdir, 128,
                                  paragraphs=False)
  examples, _ = real_text.describe_task(args.data_dir, stores)
  made = real_text.Rankers(stores, args.workdir, None)
  weights = real_text.minilm_weights()
  dense, bm25 = made.dense(weights), made.bm25()
  n = len(examples)
  if args.splits:
    start = time.time()
    hits = _hits(examples, dense, bm25, stores[1], config)
    seconds = time.time() - start
  for seed in range(args.splits):
    calib = np.zeros(n, bool)
    calib[np.random.default_rng(seed).permutation(n)[
        :args.calibration_questions]] = True
    yield score_split(hits, calib, ~calib, "describe", seed=seed,
                      blocks=len(stores[1]), all_candidates_seconds=round(
                          seconds, 1))
  # One calibration from scratch: MiniLM embeds the questions (no cache).
  fresh = rankers.DenseRanker(dense.ranker.index,
                              dense.ranker.embed_questions)
  sample = [examples[i] for i in np.random.default_rng(0).permutation(n)[
      :args.calibration_questions]]
  start = time.time()
  record = calibrate.calibrate(sample, dense=fresh, bm25=bm25,
                               store=stores[1], index=dense.ranker.index,
                               config=config)
  yield {"set": "describe", "timing": "calibrate.calibrate",
         "questions": len(sample), "blocks": len(stores[1]),
         "seconds": round(time.time() - start, 1),
         "chosen": record["chosen"], "decision": record["decision"]}


def demo_rows(args, config):
  """The demo's corpus: calibrated on its train questions, scored on its
  dev questions."""
  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store, corpus_job, demo_qa
  from realm_jax.data import qa as qa_lib
  from realm_jax.index import rankers
  # pylint: enable=g-import-not-at-top
  path = os.path.join(args.workdir, "demo_blocks_16docs_128")
  if not os.path.exists(os.path.join(path, "manifest.json")):
    corpus_job.build_corpus(output_dir=path, max_documents=16,
                            max_block_len=128)
  store = block_store.BlockStore.open(path)
  weights = real_text.minilm_weights()
  index = real_text.dense_index(weights.params, weights.model, "minilm_demo",
                                (store, store), args.workdir)
  dense = rankers.DenseRanker.from_params(index, weights.params,
                                          weights.model)
  bm25 = rankers.BM25Ranker(real_text.bm25_index((store, store)))
  train = qa_lib.read_qa_jsonl(demo_qa.path("train"), strict=True)
  dev = qa_lib.read_qa_jsonl(demo_qa.path("dev"), strict=True)
  hits = _hits(train + dev, dense, bm25, store, config)
  calib = np.arange(len(train) + len(dev)) < len(train)
  yield score_split(hits, calib, ~calib, "demo", blocks=len(store))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data_dir", help="fetch_public.py's --output_dir "
                      "(the describe set: vital_leads.jsonl).")
  parser.add_argument("--workdir", required=True,
                      help="real_text.py's --workdir (its stores, MiniLM's "
                      "index and rankings are reused).")
  parser.add_argument("--sets", default="describe,demo")
  parser.add_argument("--calibration_questions", type=int, default=200)
  parser.add_argument("--splits", type=int, default=5,
                      help="describe: random calibration sets (0: only "
                      "the timing of one calibration).")
  parser.add_argument("--output", default=None)
  args = parser.parse_args(argv)
  from realm_jax.eval import calibrate  # pylint: disable=g-import-not-at-top
  config = calibrate.CalibrateConfig(ks=KS)
  os.makedirs(args.workdir, exist_ok=True)
  for name in filter(None, args.sets.split(",")):
    if name not in ("describe", "demo"):
      parser.error(f"--sets: {name!r} is not describe or demo")
    if name == "describe" and not args.data_dir:
      parser.error("--sets=describe needs --data_dir")
    for row in (describe_rows if name == "describe" else demo_rows)(
        args, config):
      real_text._emit(row, args.output)  # pylint: disable=protected-access


if __name__ == "__main__":
  real_text.gin_cli.add_cpu_xla_flag()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()

"""The learning benchmark's command line: `python -m benchmarks.learning`.

`parse_args` reads the flags and fills in each world's defaults; `main`
builds the world and the shared inputs, trains and evaluates every
condition and prints the tables (or, with --table_from, only reads a
previous run's rows; with --prepare_only, only builds the inputs).
"""

from __future__ import annotations

import argparse
import json
import os

import benchmarks.learning as learning
from benchmarks.learning import plots, tables, train, worlds
from benchmarks.learning.conditions import CONDITIONS, EXTRA_CONDITIONS
from benchmarks.learning.evaluate import Evaluator
from benchmarks.learning.prepare import Inputs


def parse_args(argv=None):
  """The flags, with each world's defaults filled in."""
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.learning",
      description=learning.__doc__.split("\n")[0])
  parser.add_argument("--world", choices=("people", "wiki", "vital"),
                      default="people")
  parser.add_argument("--num_documents", type=int, default=0,
                      help="wiki: articles of the enwiki slice; vital: the "
                      "first N leads (0: all).")
  parser.add_argument("--data_dir", default=None,
                      help="vital: benchmarks/data/fetch_public.py's output.")
  parser.add_argument("--max_questions", type=int, default=0,
                      help="vital: the first N SQuAD dev questions (0: all).")
  parser.add_argument("--start", choices=("minilm", "random"),
                      default=None,
                      help="Real text: MiniLM in both towers (no ICT), or a "
                      "small model from random weights with ICT first "
                      "(default: wiki minilm, vital random).")
  parser.add_argument("--trivial", choices=("article", "block"),
                      default=None,
                      help="No-trivial-retrieval rule (default: article for "
                      "people, block for real text).")
  parser.add_argument("--train_articles_every", type=int, default=1,
                      help="wiki: train on every n-th training article only "
                      "(the data-scale probe; held-out, dev and Z unchanged).")
  parser.add_argument("--max_heldout", type=int, default=0,
                      help="Held-out queries evaluated (0: all; real text "
                      "256).")
  parser.add_argument("--workdir", default="/tmp/realm_learning")
  parser.add_argument("--output", default=None, help="JSON lines file.")
  parser.add_argument("--plot", default=None, help="PNG of the curves.")
  parser.add_argument("--conditions", default=None,
                      help=f"Default: {','.join(CONDITIONS)}; wiki: "
                      "ict,realm,query_side (MiniLM: query_side); vital: "
                      "ict,realm.")
  parser.add_argument("--ict_steps", type=int, default=None,
                      help="Default 100; real text 600.")
  parser.add_argument("--steps", type=int, default=None,
                      help="Default 800; real text 1200 (MiniLM 200).")
  parser.add_argument("--refresh_every", type=int, default=None,
                      help="Default 10; real text 20 (MiniLM 25).")
  parser.add_argument("--eval_every", type=int, default=None,
                      help="Default 100.")
  parser.add_argument("--rerank", type=int, default=32,
                      help="stale30_rerank: blocks the stale index proposes.")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--pretrain_seed", type=int, default=None,
                      help="The REALM runs' seed (default --seed); when it "
                      "differs, they start from --seed's ICT and their "
                      "conditions are named <condition>_seed<N>.")
  parser.add_argument("--people", type=int, default=300)
  parser.add_argument("--heldout", type=int, default=100)
  parser.add_argument("--dev", type=int, default=20,
                      help="People whose sentences are the gate's queries.")
  parser.add_argument("--templates", default="a", choices=("a", "b"))
  parser.add_argument("--shuffle_facts", action="store_true",
                      help="Every biography states another person's facts: "
                      "reading never helps (a control for what moves the "
                      "retriever when the reader does not read).")
  parser.add_argument("--gin_file", action="append",
                      default=None, help="Recipe (default: "
                      "experiments/pretrain_world_cpu.gin).")
  parser.add_argument("--table_from", default=None,
                      help="Only print the table (and --plot) of a "
                      "previous --output file.")
  parser.add_argument("--prepare_only", action="store_true",
                      help="Build the world, the query caches, the held-out "
                      "queries and the questions' wordpieces in --workdir, "
                      "then stop: a run on that workdir needs neither "
                      "tensorflow nor spaCy (e.g. on an accelerator host).")
  parser.add_argument("--gin", action="append", default=[],
                      help="Extra binding for every pre-training run.")
  args = parser.parse_args(argv)
  real = args.world != "people"
  args.start = args.start or ("random" if args.world == "vital"
                              else "minilm")
  if args.world == "vital":
    if not args.data_dir:
      parser.error("--world=vital reads --data_dir (the output of "
                   "benchmarks/data/fetch_public.py).")
  args.scratch = not real or args.start == "random"  # ICT from random
  args.trivial = args.trivial or ("block" if real else "article")
  for name, people, minilm, random in (
      ("steps", 800, 200, 1200), ("ict_steps", 100, 0, 600),
      ("refresh_every", 10, 25, 20), ("eval_every", 100, 100, 100)):
    if getattr(args, name) is None:
      setattr(args, name, people if not real else random if args.scratch
              else minilm)
  args.conditions = [c for c in (args.conditions or (
      ",".join(CONDITIONS) if not real else "query_side" if not args.scratch
      else "ict,realm" if args.world == "vital" else "ict,realm,query_side"
  )).split(",") if c]
  if real and not args.max_heldout:
    args.max_heldout = 256
  args.gin_file = args.gin_file or [
      "experiments/pretrain_world_cpu.gin" if not real
      else "experiments/pretrain_wiki_small_cpu.gin" if args.scratch
      else "experiments/pretrain_minilm_wiki_gated.gin"]
  if args.pretrain_seed is None:
    args.pretrain_seed = args.seed
  unknown = set(args.conditions) - set(CONDITIONS + EXTRA_CONDITIONS)
  if unknown:
    parser.error(f"unknown conditions {sorted(unknown)}; use "
                 f"{CONDITIONS + EXTRA_CONDITIONS}")
  if not args.scratch and {"init", "ict", "realm_original"} & set(
      args.conditions):
    parser.error("--start=minilm starts from MiniLM (no ICT): use realm, "
                 "frozen, query_side, stale30, stale30_rerank, "
                 "random_masks, realm_repeat, realm_slow.")
  if args.train_articles_every < 1 or (args.train_articles_every > 1
                                       and args.world != "wiki"):
    parser.error("--train_articles_every is a positive step over the wiki "
                 "slice's training articles (--world=wiki).")
  return args


def _print_tables(rows) -> None:
  print("\n\n".join(filter(None, (tables.table(rows),
                                  tables.paired_table(rows)))))


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.table_from:
    with open(args.table_from, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    _print_tables(rows)
    if args.plot:
      plots.plot(rows, args.plot)
    return
  os.makedirs(args.workdir, exist_ok=True)
  inputs = Inputs(args, worlds.WORLDS[args.world](args))
  if args.prepare_only:
    inputs.prepare_conditions()
    print(f"{args.workdir}: inputs prepared; run again without "
          "--prepare_only to train (tensorflow is no longer needed).")
    return
  evaluator = Evaluator(inputs, args.output)
  if "init" in args.conditions:
    evaluator.report_init()
  if args.scratch:  # ICT warm start, shared by every REALM condition
    train.train_ict(inputs, evaluator, evaluate="ict" in args.conditions)
  pretraining = [c for c in args.conditions if c not in ("init", "ict")]
  if inputs.warmup and "realm" not in pretraining and len(pretraining) > 1:
    pretraining.insert(0, "realm")  # the shared warm-up lives there
  for condition in pretraining:
    train.pretrain(inputs, evaluator, condition)
  evaluator.close()
  _print_tables(evaluator.rows)
  if args.plot:
    plots.plot(evaluator.rows, args.plot)

"""Does REALM pre-training teach the retriever? Measured on held-out people.

    python benchmarks/learning.py --workdir=/tmp/learning \
        --output=docs/results/learning.jsonl --plot=docs/results/learning.png

A synthetic knowledge world (`realm_jax/testing/knowledge_world.py`): 300
fictional people with random birthplaces and birth years; Z = one biography
block per person; X = separate articles whose sentences name a person with
the city or the year as the only salient span; the X articles of 100
people are never trained on and give the held-out queries. Facts are
random, so only the right biography lets the reader fill a held-out mask.

Every condition runs the real jobs (`ict.train`, `pretrain.train` with an
inline exact index rebuilt every `--refresh_every` steps) on the tiny model
of `gin_configs/models/tiny.gin` with the same seed, and every checkpoint
is evaluated by `realm_jax.eval.pretrain_eval` with its own index:

  init            the retriever at its random initialisation (no training)
  ict             ICT warm start only (the baseline REALM must beat)
  realm           ICT + REALM, this repository's recipe
                  (experiments/pretrain_world_cpu.gin): the retriever is
                  released by the gate (the reader's evidence for
                  answer-bearing blocks on the training queries; the wiki
                  recipes: held-out utility on dev articles)
  realm_fixed600  the recipe with the earlier fixed warm-up: the retriever
                  released at step 600 whatever the reader does
  query_side      the recipe, query-side training: unshared towers from
                  the ICT tower, the document tower and the index frozen
                  (built once), the query tower and the reader learn
  realm_original  ICT + REALM as the paper's code runs it: one learning
                  rate for both towers, no reader warm-up, the null
                  document scored by the embedding of `[CLS] [SEP] [SEP]`
  frozen          the recipe with the retriever frozen throughout
  stale30         the recipe with the index rebuilt 30x less often
  stale30_rerank  stale30 with Atlas-style re-ranking: the stale index
                  proposes --rerank blocks, the current retriever picks k
  random_masks    the recipe with random-token masks instead of salient
                  spans (evaluated, like all, on held-out salient spans)
  realm_repeat    `realm` again: the same seed must give the same numbers
  realm_slow      (only when named) the recipe with the retriever at 0.01x

(The ideal-reader diagnostics, ideal_reader, ideal_shuffled and their
query-side pair, and the reader pre-training and adaptation stages were
retired with their trainer options; docs/results/learning.md keeps their
measurements.)

The world: --people, --heldout, --dev (people whose X articles are
neither trained on nor evaluated: a held-out gate's queries), --templates (a or
b, `knowledge_world.TEMPLATES`), --seed, --shuffle_facts (every
biography states another person's facts: the control world where reading
cannot help).

One JSON line per (condition, step) goes to --output; --plot draws the
curves. On 2 CPU cores the default run takes about 45 minutes.

`--world=wiki` runs it on real text: the gensim enwiki slice (all 96
articles, or `--num_documents`; 5,448 blocks of 128 wordpieces, spaCy
salient spans). X is split by article: every 4th article's sentences are
held out (the masked-token metrics), every 8th of the rest are the gate's
dev queries, the others are trained on. Trivial candidates follow
`--trivial` (default for wiki: "block", REALM's reference rule: only the
block holding the sentence is excluded; X and Z are the same articles, so
"article" would hide every block about the sentence's subject). Real
sentences have no single evidence block, so retrieval is measured on 255
held-out open-domain questions about these articles
(benchmarks/data/wiki_heldout_qa.jsonl, answers checked against the text,
never trained on; `qa_recall@k`: an answer-bearing block in the top k).
Two starts:

  --start=random  the paper's ablation: a small BERT from random weights
                  (experiments/pretrain_wiki_small_cpu.gin), ICT, then
                  gated REALM; conditions ict, realm, query_side.
  --start=minilm  the product path: MiniLM-L6 in both towers
                  (experiments/pretrain_minilm_wiki_gated.gin); its step 0
                  is MiniLM with the MLM head fitted by the reader
                  preparation job (`reader_prep`), the baseline;
                  condition query_side (a MiniLM refresh of 5,448 blocks
                  costs minutes on 2 cores), or realm / frozen.

    python benchmarks/learning.py --world=wiki --start=random \
        --workdir=/tmp/lw_random \
        --output=docs/results/learning_wiki_random.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from realm_jax import gin_cli  # pylint: disable=wrong-import-position

gin_cli.add_cpu_xla_flag()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WIKI_QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "data", "wiki_heldout_qa.jsonl")
# Dev questions (never evaluated on): for the recall guard.
WIKI_DEV_QUESTIONS = os.path.join(os.path.dirname(WIKI_QUESTIONS),
                                  "wiki_dev_qa.jsonl")
CONDITIONS = ("init", "ict", "realm", "query_side", "realm_fixed600",
              "frozen", "stale30", "stale30_rerank", "random_masks",
              "realm_repeat", "realm_original")
# Run only when asked for (--conditions=...).
EXTRA_CONDITIONS = ("realm_slow",)


def _bindings(name: str, args) -> list[str]:
  """Gin bindings of a pre-training condition, on top of the recipe file."""
  original = [
      "pretrain.RetrieverScheduleConfig.learning_rate_multiplier = 1.0",
      "pretrain.RetrieverScheduleConfig.freeze_steps = 0",
      "pretrain.PretrainConfig.adam_bias_correction = False",
      "realm.RetrieverConfig.null_score = 'embedding'"]
  fixed = ["pretrain.RetrieverScheduleConfig.gate = 'steps'"]
  query_side = ["pretrain.RetrieverScheduleConfig.training = 'query_side'",
                "realm.RetrieverConfig.share_towers = False"]
  return {
      "realm": [],
      "realm_repeat": [],
      "realm_fixed600": fixed + [
          "pretrain.RetrieverScheduleConfig.freeze_steps = 600"],
      "query_side": query_side,
      "realm_original": original + fixed,
      "frozen": fixed + ["pretrain.RetrieverScheduleConfig."
                         "learning_rate_multiplier = 0.0"],
      "stale30": [f"pretrain.PretrainConfig.checkpoint_every = "
                  f"{30 * args.refresh_every}"],
      "stale30_rerank": [f"pretrain.PretrainConfig.checkpoint_every = "
                         f"{30 * args.refresh_every}",
                         "pretrain.RetrievalConfig.rerank_candidates = "
                         f"{args.rerank}"],
      "random_masks": ["examples.RealmQueryConfig.masking = 'random_tokens'"],
      "realm_slow": ["pretrain.RetrieverScheduleConfig."
                     "learning_rate_multiplier = 0.01"],
  }[name]


def _wiki_world(directory: str, num_documents: int | None):
  """The enwiki slice: block store, and X split by article into train,
  held-out (every 4th article: the masked-token metrics) and dev (every
  8th of the rest: the gate's queries); returns (block_store, train,
  heldout, dev)."""
  store_dir = os.path.join(directory, "blocks")
  splits = {n: os.path.join(directory, f"{n}.tfr.gz")
            for n in ("train", "heldout", "dev")}
  if os.path.exists(os.path.join(store_dir, "manifest.json")) and all(
      map(os.path.exists, splits.values())):  # (built: no Beam, no spaCy)
    return store_dir, splits["train"], splits["heldout"], splits["dev"]
  from realm_jax.data import annotate_job, corpus_job, salient_spans, wikipedia  # pylint: disable=g-import-not-at-top
  if not os.path.exists(os.path.join(store_dir, "manifest.json")):
    corpus_job.build_corpus(output_dir=store_dir, max_block_len=128,
                            max_documents=num_documents)
  annotated = os.path.join(directory, "annotated")
  if not os.path.exists(annotated):  # (the job's output appears whole)
    annotate_job.annotate_corpus(
        input_path=wikipedia.default_wikipedia_dump(), output_dir=annotated,
        num_shards=1, max_documents=num_documents)

  def split(i):
    return "heldout" if i % 4 == 3 else "dev" if i % 8 == 1 else "train"

  if not os.path.exists(splits["dev"]):
    docs = list(salient_spans.read_annotated(
        [salient_spans.shard_path(annotated, 0, 1)]))
    for name, path in splits.items():
      _write_whole(path, [d for i, d in enumerate(docs) if split(i) == name])
  return store_dir, splits["train"], splits["heldout"], splits["dev"]


def _every_nth_article(train_x: str, n: int) -> str:
  """`train_x` thinned to every `n`th article (the data-scale probe),
  written once beside it; `train_x` itself when n is 1."""
  if n == 1:
    return train_x
  path = train_x.replace(".tfr.gz", f"_every{n}.tfr.gz")
  if not os.path.exists(path):
    from realm_jax.data import salient_spans  # pylint: disable=g-import-not-at-top
    _write_whole(path, list(salient_spans.read_annotated([train_x]))[::n])
  return path


def _write_whole(path: str, docs) -> None:
  """Annotated documents to `path`, which appears whole or not at all."""
  from realm_jax.data import salient_spans  # pylint: disable=g-import-not-at-top
  tmp = path.replace(".tfr.gz", ".tmp.tfr.gz")  # Keeps the .gz codec.
  salient_spans.write_annotated(tmp, docs)
  os.replace(tmp, path)


def _configs(gin_files, bindings):
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  gin_cli.parse(gin_files, bindings)
  return gin, gin.get_configurable(RealmConfig)()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--world", choices=("people", "wiki"),
                      default="people")
  parser.add_argument("--num_documents", type=int, default=0,
                      help="wiki: articles of the enwiki slice (0: all).")
  parser.add_argument("--start", choices=("minilm", "random"),
                      default="minilm",
                      help="wiki: MiniLM in both towers (no ICT), or a "
                      "small model from random weights with ICT first.")
  parser.add_argument("--trivial", choices=("article", "block"),
                      default=None,
                      help="No-trivial-retrieval rule (default: article for "
                      "people, block for wiki).")
  parser.add_argument("--train_articles_every", type=int, default=1,
                      help="wiki: train on every n-th training article only "
                      "(the data-scale probe; held-out, dev and Z unchanged).")
  parser.add_argument("--max_heldout", type=int, default=0,
                      help="Held-out queries evaluated (0: all).")
  parser.add_argument("--workdir", default="/tmp/realm_learning")
  parser.add_argument("--output", default=None, help="JSON lines file.")
  parser.add_argument("--plot", default=None, help="PNG of the curves.")
  parser.add_argument("--conditions", default=None,
                      help=f"Default: {','.join(CONDITIONS)}; wiki: "
                      "realm,frozen.")
  parser.add_argument("--ict_steps", type=int, default=None,
                      help="Default 100; wiki 600.")
  parser.add_argument("--steps", type=int, default=None,
                      help="Default 800; wiki 40.")
  parser.add_argument("--refresh_every", type=int, default=None,
                      help="Default 10; wiki 20.")
  parser.add_argument("--eval_every", type=int, default=None,
                      help="Default 100; wiki 20.")
  parser.add_argument("--rerank", type=int, default=32,
                      help="stale30_rerank: blocks the stale index proposes.")
  parser.add_argument("--seed", type=int, default=0)
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
  wiki = args.world == "wiki"
  scratch = not wiki or args.start == "random"  # ICT from random weights
  args.trivial = args.trivial or ("block" if wiki else "article")
  for name, people, minilm, random in (
      ("steps", 800, 200, 1200), ("ict_steps", 100, 0, 600),
      ("refresh_every", 10, 25, 20),
      ("eval_every", 100, 100, 100)):
    if getattr(args, name) is None:
      setattr(args, name, people if not wiki else random if scratch
              else minilm)
  args.conditions = args.conditions or (
      "query_side" if not scratch else "ict,realm,query_side" if wiki
      else ",".join(CONDITIONS))
  if wiki and not args.max_heldout:
    args.max_heldout = 256
  gin_files = args.gin_file or [
      "experiments/pretrain_world_cpu.gin" if not wiki
      else "experiments/pretrain_wiki_small_cpu.gin" if scratch
      else "experiments/pretrain_minilm_wiki_gated.gin"]
  if args.table_from:
    with open(args.table_from, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    print("\n\n".join(filter(None, (table(rows), paired_table(rows)))))
    if args.plot:
      plot(rows, args.plot)
    return

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store, examples, query_cache  # pylint: disable=g-import-not-at-top
  from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import pretrain_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import Realm  # pylint: disable=g-import-not-at-top
  from realm_jax.testing import knowledge_world  # pylint: disable=g-import-not-at-top
  from realm_jax.training import ict, pretrain, reader_prep  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints, gin_config  # pylint: disable=g-import-not-at-top
  from realm_jax.index import publish  # pylint: disable=g-import-not-at-top

  conditions = [c for c in args.conditions.split(",") if c]
  unknown = set(conditions) - set(CONDITIONS + EXTRA_CONDITIONS)
  if unknown:
    parser.error(f"unknown conditions {sorted(unknown)}; use "
                 f"{CONDITIONS + EXTRA_CONDITIONS}")
  if not scratch and {"init", "ict", "realm_original"} & set(conditions):
    parser.error("--start=minilm starts from MiniLM (no ICT): use realm, "
                 "frozen, query_side, stale30, stale30_rerank, "
                 "random_masks, realm_repeat, realm_slow.")
  if args.train_articles_every < 1 or (args.train_articles_every > 1
                                       and not wiki):
    parser.error("--train_articles_every is a positive step over the wiki "
                 "slice's training articles (--world=wiki).")
  os.makedirs(args.workdir, exist_ok=True)
  # A thinned run has its own query cache and run directories (the inputs
  # and ICT of the workdir are shared).
  thinned = (f"_every{args.train_articles_every}"
             if args.train_articles_every > 1 else "")
  questions = ()
  if wiki:
    from realm_jax.data import qa  # pylint: disable=g-import-not-at-top
    store_dir, train_x, heldout_x, dev_x = _wiki_world(
        os.path.join(args.workdir, "wiki"), args.num_documents or None)
    train_x = _every_nth_article(train_x, args.train_articles_every)
    questions = qa.read_qa_jsonl(WIKI_QUESTIONS, strict=True)
  else:
    world = knowledge_world.write_world(
        os.path.join(args.workdir, "world"), seed=args.seed,
        num_people=args.people, num_heldout=args.heldout, num_dev=args.dev,
        templates=args.templates, shuffle_facts=args.shuffle_facts)
    store_dir, train_x, heldout_x, dev_x = (world.block_store, world.train,
                                            world.heldout, world.dev)
  store = block_store.BlockStore.open(store_dir)
  base = [f"WORKDIR = '{args.workdir}'",
          f"BLOCK_STORE = '{store_dir}'",
          f"QUERIES = '{os.path.join(args.workdir, 'queries_salient')}'",
          f"GATE_QUERIES = '{os.path.join(args.workdir, 'queries_dev')}'",
          f"pretrain.PretrainConfig.num_train_steps = {args.steps}",
          f"pretrain.PretrainConfig.checkpoint_every = {args.refresh_every}",
          f"pretrain.PretrainConfig.seed = {args.seed}",
          f"pretrain.RetrievalConfig.trivial_candidates = '{args.trivial}'"
          ] + list(args.gin)
  gin, model = _configs(gin_files, [b for b in base
                                    if ".num_train_steps" not in b])
  recipe = gin.get_configurable(pretrain.PretrainConfig)()
  recipe_queries = gin_config.configured(examples.RealmQueryConfig)
  if wiki and recipe.recall_guard.questions and os.path.samefile(
      recipe.recall_guard.questions, WIKI_QUESTIONS):
    parser.error("RecallGuardConfig.questions is the evaluation's question set "
                 f"({WIKI_QUESTIONS}): guard on dev questions, e.g. "
                 f"{WIKI_DEV_QUESTIONS}.")
  if recipe.retriever.measured and (
      recipe.retriever.freeze_steps >= recipe.num_train_steps):
    # The recipe's bound is its whole run: keep it the whole run.
    base.append(f"pretrain.RetrieverScheduleConfig.freeze_steps = "
                f"{args.steps}")
  if ((recipe.retriever.measured
       and recipe.retriever.gate_queries != recipe.queries)
      or recipe.recall_guard.queries not in ("", recipe.queries)):
    # (A dev split's: the gate's or the recall guard's.)
    if not dev_x:
      parser.error("the recipe's gate or recall guard needs --dev people.")
    dev_cache = os.path.join(args.workdir, "queries_dev")
    if not os.path.exists(dev_cache):
      query_cache.build_query_cache(
          dev_x, dev_cache, query_config=recipe_queries, seed=args.seed,
          num_shards=1)

  def kept(name, make):
    """`make()`'s arrays, kept in the workdir as .npz (no pickles): a run
    there needs no tensorflow_text, e.g. on an accelerator host."""
    path = os.path.join(args.workdir, name + ".npz")
    if os.path.exists(path):
      with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}
    arrays = make()
    np.savez(path + ".tmp.npz", **arrays)
    os.replace(path + ".tmp.npz", path)
    return arrays

  def read_heldout():
    queries = examples.read_realm_queries(
        heldout_x, Tokenizer(),
        config=dataclasses.replace(recipe_queries, masking="salient"),
        seed=args.seed)
    if args.max_heldout:
      keep = np.sort(np.random.default_rng(args.seed).permutation(
          len(queries["query_ids"]))[:args.max_heldout])
      queries = {k: v[keep] for k, v in queries.items()}
    return queries

  def tokenize_questions():
    from realm_jax.training import qa_inputs  # pylint: disable=g-import-not-at-top
    return qa_inputs.tokenize_questions(
        Tokenizer(), [e.question for e in questions],
        recipe_queries.query_length)

  with open(heldout_x, "rb") as f:  # (the world's held-out articles)
    settings = hashlib.sha256(f.read() + repr((
        dataclasses.replace(recipe_queries, masking="salient"), args.seed,
        args.max_heldout)).encode()).hexdigest()[:12]
  heldout = kept(f"heldout_queries_{settings}", read_heldout)
  question_inputs = None
  if questions:
    with open(WIKI_QUESTIONS, "rb") as f:
      asked = hashlib.sha256(f.read() + repr(
          recipe_queries.query_length).encode()).hexdigest()[:12]
    question_inputs = kept(f"question_inputs_{asked}", tokenize_questions)
  if wiki:
    gold = None
  else:
    gold_of = knowledge_world.gold_blocks(
        store, knowledge_world.load_people(world.people))
    gold = np.asarray([gold_of[int(h)]
                       for h in heldout["source_doc_hash"]])

  def queries_for(config):
    """The training sentences masked the condition's way (built once)."""
    path = os.path.join(args.workdir, f"queries_{config.masking}{thinned}")
    if not os.path.exists(path):
      query_cache.build_query_cache(
          train_x, path, query_config=config,
          seed=args.seed, num_shards=1)
    return path

  if args.prepare_only:
    for condition in conditions:
      if condition not in ("init", "ict"):
        _configs(gin_files, base + _bindings(condition, args))
        queries_for(gin_config.configured(examples.RealmQueryConfig))
    print(f"{args.workdir}: inputs prepared; run again without "
          "--prepare_only to train (tensorflow is no longer needed).")
    return
  out = open(args.output, "w", encoding="utf-8") if args.output else None
  rows = []

  def report(condition, step, params, model, seconds=None, block_emb=None,
             **extra):
    row = {"condition": condition, "step": step, **pretrain_eval.evaluate(
        params, model, store, heldout, gold,
        num_candidates=recipe.retrieval.num_candidates,
        reader_length=recipe.reader_length, questions=questions,
        question_length=recipe_queries.query_length,
        trivial_candidates=args.trivial, block_emb=block_emb,
        question_inputs=question_inputs), **extra}
    if seconds is not None:
      row["train_seconds"] = round(seconds, 1)
    rows.append(row)
    line = {k: round(v, 4) if isinstance(v, float) else v
            for k, v in row.items()}
    print(json.dumps({k: v for k, v in line.items()
                      if k != "qa_answer_rank"}), flush=True)
    if out:
      out.write(json.dumps(line) + "\n")
      out.flush()

  def evaluate_run(condition, model, ckpt_dir, seconds, every, first=0,
                   block_emb=None):
    ckpt = checkpoints.TrainCheckpointer(ckpt_dir, async_save=False)
    try:
      for step in ckpt.all_steps():
        if step < first:
          continue
        if step % every == 0 or step == ckpt.latest_step():
          report(condition, step, ckpt.restore_params(step), model,
                 seconds if step == ckpt.latest_step() else None,
                 block_emb=block_emb)
    finally:
      ckpt.close()

  if "init" in conditions:
    _, fresh = functional.init(lambda r: Realm(model, rngs=r), args.seed)
    report("init", 0, fresh, model)

  # ICT warm start, shared by every REALM condition (MiniLM instead).
  ict_dir = os.path.join(args.workdir, "ict")
  ict_ckpts = checkpoints.checkpoint_dir(ict_dir)
  t0 = time.time()
  if scratch:
    gin, model = _configs(gin_files, base + [
        f"ict.IctTrainConfig.workdir = '{ict_dir}'",
        f"ict.IctTrainConfig.num_train_steps = {args.ict_steps}",
        f"ict.IctTrainConfig.checkpoint_every = {args.ict_steps // 4}",
        "ict.IctTrainConfig.keep_checkpoints = 10",
        # ICT never scores the null document; leaving the learned null
        # score out of its checkpoints lets both null modes start from it.
        "realm.RetrieverConfig.null_score = 'embedding'",
        f"ict.IctTrainConfig.seed = {args.seed}"])
    ict.train(config=gin.get_configurable(ict.IctTrainConfig)(), model=model)
    if "ict" in conditions:
      evaluate_run("ict", model, ict_ckpts, time.time() - t0,
                   args.ict_steps // 4)
  start_from = [] if not scratch else [
      f"pretrain.PretrainConfig.init_from = 'checkpoint:{ict_ckpts}'"]

  # REALM conditions. The recipe's reader warm-up (the first
  # `freeze_retriever_steps`, retriever frozen) is the same for every
  # condition but `realm_original`: it runs once, in `realm`'s workdir, and
  # the other conditions resume from its checkpoint at the end of the
  # warm-up with their own settings (same optimiser state, same step).
  # (A gated recipe releases the retriever when its run says so: no
  # warm-up is shared then.)
  warmup = (recipe.retriever.freeze_steps
            if recipe.retriever.gate == "steps" else 0)

  def prepared_reader(condition, queries):
    """MiniLM's reader prepared on the condition's queries (its own job,
    `reader_prep`: MiniLM has no MLM head); pre-training starts from it."""
    prep_dir = os.path.join(args.workdir, condition + thinned + "_reader")
    gin, model = _configs(gin_files, base + _bindings(condition, args) + [
        f"reader_prep.ReaderPrepConfig.workdir = '{prep_dir}'",
        f"reader_prep.ReaderPrepConfig.queries = '{queries}'",
        f"reader_prep.ReaderPrepConfig.seed = {args.seed}"])
    reader_prep.train(
        config=gin.get_configurable(reader_prep.ReaderPrepConfig)(),
        model=model)
    return [f"pretrain.PretrainConfig.init_from = "
            f"'checkpoint:{checkpoints.checkpoint_dir(prep_dir)}'"]

  def run(condition):
    workdir = os.path.join(args.workdir, condition + thinned)
    bindings = _bindings(condition, args)
    _configs(gin_files, base + bindings)
    queries = queries_for(gin_config.configured(examples.RealmQueryConfig))
    gin, model = _configs(gin_files, base + [
        f"pretrain.PretrainConfig.workdir = '{workdir}'",
        "pretrain.PretrainConfig.keep_checkpoints = 1000"]
        + (start_from if scratch else prepared_reader(condition, queries))
        + bindings)
    config = gin.get_configurable(pretrain.PretrainConfig)()
    # A gate on the training queries follows the condition's masking.
    config = dataclasses.replace(
        config, queries=queries, retriever=dataclasses.replace(
            config.retriever, gate_queries=(
                queries if config.retriever.gate_queries == config.queries
                else config.retriever.gate_queries)))
    ckpt_dir = checkpoints.checkpoint_dir(workdir)
    shared = condition not in ("realm", "realm_original") and warmup
    if shared and not os.path.exists(ckpt_dir):
      source = os.path.join(checkpoints.checkpoint_dir(
          os.path.join(args.workdir, "realm" + thinned)), str(warmup))
      shutil.copytree(source, os.path.join(ckpt_dir, str(warmup)))
    t0 = time.time()
    history = pretrain.train(config=config, model=model)
    seconds = time.time() - t0
    # A shared warm-up's last checkpoint is `realm`'s: evaluated there.
    # Query-side: the document tower never moves, so every checkpoint's
    # blocks are the run's one index (not embedded again per checkpoint).
    block_emb = (publish.load_index(checkpoints.index_root(workdir)).embeddings
                 if config.retriever.training == "query_side" else None)
    evaluate_run(condition, model, ckpt_dir, seconds, args.eval_every,
                 first=warmup + 1 if shared else 0, block_emb=block_emb)
    # The training-time guards, for the doc: worst logged values (from the
    # run's metrics.jsonl, so that a resumed run reports them too).
    del history
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      logged = [json.loads(line) for line in f]
    worst = {"condition": condition, "summary": True,
             "train_max_hubness": max(h["hubness"] for h in logged),
             "train_max_null_probability": max(h["null_probability"]
                                               for h in logged),
             "train_seconds": round(seconds, 1)}
    if "retriever_release_step" in logged[-1]:
      release = int(logged[-1]["retriever_release_step"])
      worst["retriever_release_step"] = (release if release < args.steps
                                         else None)  # None: never released
    for key, name in (("gate", "gate.jsonl"),
                      ("recall_guard", "recall_guard.jsonl")):
      decisions = os.path.join(workdir, name)
      if os.path.exists(decisions):
        with open(decisions, encoding="utf-8") as f:
          worst[key] = [json.loads(line) for line in f]
    print(json.dumps(worst), flush=True)
    rows.append(worst)
    if out:
      out.write(json.dumps(worst) + "\n")

  pretraining = [c for c in conditions if c not in ("init", "ict")]
  if warmup and "realm" not in pretraining and len(pretraining) > 1:
    pretraining.insert(0, "realm")  # the shared warm-up lives there
  for condition in pretraining:
    run(condition)
  if out:
    out.close()
  print("\n\n".join(filter(None, (table(rows), paired_table(rows)))))
  if args.plot:
    plot(rows, args.plot)
  del jax


def table(rows) -> str:
  """Markdown table of every evaluated checkpoint, condition by condition."""
  rows = [r for r in rows if "summary" not in r]
  keys = [k for k in ("recall@1", "recall@5", "qa_recall@1", "qa_recall@5",
                      "qa_recall@20", "span_recall", "mlm_accuracy_marginal",
                      "mlm_accuracy_null", "mlm_accuracy_gold",
                      "retrieval_utility", "null_probability", "hubness",
                      "score_spread")
          if any(k in r for r in rows)]
  lines = ["| condition | step | " + " | ".join(keys) + " |",
           "|---|---|" + "---|" * len(keys)]
  for r in rows:
    lines.append(f"| {r['condition']} | {r['step']} | " + " | ".join(
        f"{r[k]:.3f}" if k in r else "-" for k in keys) + " |")
  return "\n".join(lines)


def paired_table(rows, baseline: str = "ict") -> str:
  """Each condition's last checkpoint against the baseline's, question by
  question: the difference in qa_recall@k and its standard error over
  the same questions (`paired_difference`). Empty without per-question
  ranks (real text only; jsonl written before session 28)."""
  last = _last_ranked(rows)
  if baseline not in last or len(last) < 2:
    return ""
  base = last.pop(baseline)
  ks = [int(k.split("@")[1]) for k in base if k.startswith("qa_recall@")]
  lines = [f"Against {baseline} (step {base['step']}), on the same "
           f"{len(base['qa_answer_rank'])} questions (difference +- its "
           "standard error):",
           "| condition | step | " + " | ".join(
               f"qa_recall@{k}" for k in ks) + " |",
           "|---|---|" + "---|" * len(ks)]
  for r in last.values():
    cells = (paired_difference(
        r["qa_answer_rank"], base["qa_answer_rank"], k) for k in ks)
    lines.append(f"| {r['condition']} | {r['step']} | " + " | ".join(
        f"{d:+.3f} +- {se:.3f}" for d, se in cells) + " |")
  return "\n".join(lines)


def _last_ranked(rows) -> dict:
  """Each condition's last row with per-question ranks, by condition."""
  return {r["condition"]: r for r in rows if "qa_answer_rank" in r}


def paired_difference(ranks, baseline, k: int) -> tuple[float, float]:
  """recall@k of `ranks` minus the baseline's on the same questions, and
  that difference's standard error: the per-question differences' sample
  std over sqrt(n) (pairing removes how much harder some questions are)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  ranks, baseline = np.asarray(ranks), np.asarray(baseline)
  if ranks.shape != baseline.shape or ranks.ndim != 1 or len(ranks) < 2:
    raise ValueError(f"ranks {ranks.shape} and baseline {baseline.shape}: "
                     "one rank per question, the same questions, >= 2.")
  d = (ranks < k).astype(np.float64) - (baseline < k)
  return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def plot(rows, path: str) -> None:
  """Held-out recall, reader accuracy, utility, p(null) and hubness per
  step; and each gated condition's gate decisions (summary rows)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  recall = "recall@1" if "recall@1" in rows[0] else "qa_recall@1"
  panels = ((recall, f"held-out {recall}"),) + (
      (("qa_recall@5", "held-out qa_recall@5"),) if recall == "qa_recall@1"
      else ()) + (
      (("span_recall", "held-out span recall (a block holding the masked "
        "span read)"),) if "span_recall" in rows[0] else ()) + (
          ("mlm_accuracy_marginal", "held-out masked-token accuracy"),
          ("retrieval_utility", "held-out retrieval utility (nats)"),
          ("null_probability", "p(null | x)"),
          ("hubness", "hubness")) + (
      (("score_spread", "held-out score spread: std of f(x, z) over Z"),)
      if any("score_spread" in r for r in rows) else ())
  gates = {r["condition"]: r["gate"] for r in rows if r.get("gate")}
  guards = {r["condition"]: r["recall_guard"] for r in rows
            if r.get("recall_guard")}
  adapted = {r["condition"]: r["reader_adaptation"]["curve"] for r in rows
             if r.get("reader_adaptation")}
  pretrained = {r["condition"]: r["reader_mlm"]["curve"] for r in rows
                if r.get("reader_mlm")}
  rows = [r for r in rows if "summary" not in r]
  ranked = _last_ranked(rows)
  if "ict" in ranked and len(ranked) > 1:  # (as paired_table)
    panels += (("paired", "qa_recall@5 minus ICT's, on the same "
                "questions (+- 1 s.e.)"),)
  panels += ((("reader_mlm", "reader masked-LM: held-out accuracy"),
              ("reader_mlm_utility", "reader masked-LM: neighbour utility "
               "(nats)")) if pretrained else ()) + (
                   (("gate", "gate: utility on its queries (nats)"),
                    ("gate_z", "gate: evidence z on its queries"))
             if gates else ()) + (
                 (("guard", "recall guard"),) if guards else ()) + (
                       (("adaptation", "reader adaptation: held-out "
                         "accuracy"),
                        ("adaptation_utility", "reader adaptation: held-out "
                         "utility (nats)")) if adapted else ())
  cols = min(len(panels), 5)
  rows_of_panels = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows_of_panels, cols,
                           figsize=(5 * cols, 4 * rows_of_panels),
                           squeeze=False)
  for ax in axes.flat[len(panels):]:
    ax.set_visible(False)
  axes = axes.flat
  conditions = list(dict.fromkeys(r["condition"] for r in rows))
  for ax, (key, title) in zip(axes, panels):
    if key == "paired":
      _plot_paired(ax, rows, conditions, title)
      continue
    if key in ("gate", "gate_z"):
      for c, decisions in gates.items():
        ax.plot([d["step"] for d in decisions],
                [d["utility" if key == "gate" else "evidence_z"]
                 for d in decisions], marker="o", markersize=3, label=c)
      ax.set_title(title)
      ax.set_xlabel("REALM step")
      continue
    if key in ("reader_mlm", "reader_mlm_utility"):
      for c, curve in pretrained.items():
        steps = [p["step"] for p in curve]
        for name in (("accuracy_neighbour", "accuracy_other")
                     if key == "reader_mlm" else ("neighbour_utility",)):
          ax.plot(steps, [p[name] for p in curve], marker="o", markersize=3,
                  linestyle=":" if name == "accuracy_other" else "-",
                  label=f"{c}: {name.replace('accuracy_', 'with ')}")
      ax.set_title(title)
      ax.set_xlabel("masked-LM step (before REALM)")
      ax.legend(fontsize=8)
      continue
    if key in ("adaptation", "adaptation_utility"):
      for c, curve in adapted.items():
        steps = [p["step"] for p in curve]
        for doc, style in (("null", ":"), ("random", "--"), ("answer", "-")):
          name = (f"accuracy_{doc}" if key == "adaptation" else
                  "utility" if doc == "answer" else "random_utility")
          if doc == "null" and key != "adaptation":
            continue
          ax.plot(steps, [p[name] for p in curve], linestyle=style,
                  marker="o", markersize=3, label=f"{c}: {doc}")
      if key == "adaptation_utility":
        ax.axhline(0.0, color="grey", linestyle="--", linewidth=1)
      ax.set_title(title)
      ax.set_xlabel("adaptation step (before REALM)")
      ax.legend(fontsize=8)
      continue
    if key == "guard":
      for c, decisions in guards.items():
        recall = next(k for k in decisions[0] if k.startswith("recall@"))
        probe = decisions[0].get("probe", "own-block")  # (older logs)
        curves = [x for x in conditions if x not in ("init", "ict")]
        ax.plot([d["step"] for d in decisions],
                [d[recall] for d in decisions], marker="o", markersize=3,
                label=f"{c} ({probe} {recall})",
                color=f"C{curves.index(c)}" if c in curves else None)
        for d in decisions:
          if d["rolled_back"]:
            ax.axvline(d["step"], color="red", linewidth=1)
        ax.axhline(decisions[0]["baseline"], color="grey", linestyle="--",
                   linewidth=1)
      ax.set_title(f"{title}: recall on its probes")
      ax.set_xlabel("REALM step")
      ax.legend(fontsize=8)
      continue
    for c in conditions:
      pts = [(r["step"], r[key]) for r in rows
             if r["condition"] == c and key in r]  # (older rows lack some)
      if not pts:
        continue
      if c in ("init", "ict"):
        ax.axhline(pts[-1][1], linestyle="--", linewidth=1, label=c,
                   color="grey" if c == "init" else "black")
      else:
        # One colour per condition in every panel, even where some lack it.
        ax.plot(*zip(*pts), marker="o", markersize=3, label=c,
                color=f"C{conditions.index(c) % 10}")
    ax.set_title(title)
    ax.set_xlabel("REALM step")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def _plot_paired(ax, rows, conditions, title: str, k: int = 5) -> None:
  """Each checkpoint's qa_recall@k minus ICT's last, question by question,
  with one standard error (`paired_difference`)."""
  base = _last_ranked(rows)["ict"]["qa_answer_rank"]
  for c in conditions:
    pts = [(r["step"], *paired_difference(r["qa_answer_rank"], base, k))
           for r in rows if r["condition"] == c and "qa_answer_rank" in r]
    if c in ("init", "ict") or not pts:
      continue
    steps, d, se = zip(*pts)
    ax.errorbar(steps, d, yerr=se, marker="o", markersize=3, capsize=2,
                label=c, color=f"C{conditions.index(c) % 10}")
  ax.axhline(0.0, color="black", linestyle="--", linewidth=1)
  ax.set_title(title)
  ax.set_xlabel("REALM step")


if __name__ == "__main__":
  main()

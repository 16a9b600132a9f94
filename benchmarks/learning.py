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
  realm           ICT + REALM, this repository's default recipe
                  (runs/pretrain.gin, through
                  experiments/pretrain_world_cpu.gin): the retriever is
                  released by the gate (the reader's evidence for
                  answer-bearing blocks on the training queries, with an
                  effect of at least 0.005 nats; the wiki recipes:
                  held-out utility on dev articles) and rolled back by the
                  recall guard if it then loses recall
  realm_fixed600  the recipe with the earlier fixed warm-up: the retriever
                  released at step 600 whatever the reader does, unguarded
  query_side      the recipe, query-side training: unshared towers from
                  the ICT tower, the document tower and the index frozen
                  (built once), the query tower and the reader learn
  realm_original  ICT + REALM as the paper's code runs it
                  (runs/pretrain_original.gin, added to the recipe file):
                  one learning rate for both towers, no reader warm-up,
                  the null document scored by the embedding of
                  `[CLS] [SEP] [SEP]`
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
`--world=vital` runs it on public text (issue 47): Z = the leads of
Wikipedia's Vital Articles (`--num_documents`: the first N), X = their
sentences split by article as for wiki; from random weights (ICT, then
the gated recipe of `experiments/pretrain_wiki_small_cpu.gin`). Every
checkpoint is evaluated over Z plus the SQuAD v1.1 dev paragraphs (added
after training, never trained on) on the SQuAD dev questions
(`qa_recall@1/5/20/100`, zero-shot: no question is trained on) and on the
cloze probe: the qa_wikidata prompts about a lead, masked
(`cloze_mlm_accuracy_*` with the top k, the null document alone, the gold
lead block). `--data_dir` is the output of
`benchmarks/data/fetch_public.py`; `--pretrain_seed` trains more REALM
seeds from the same ICT (docs/results/real_text.md).

    python benchmarks/learning.py --world=vital --data_dir=/tmp/public \
        --workdir=/tmp/lw_vital --eval_every=300 --output=/tmp/vital.jsonl
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
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from realm_jax import gin_cli  # pylint: disable=wrong-import-position

gin_cli.add_cpu_xla_flag()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WIKI_QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "data", "wiki_heldout_qa.jsonl")
CONDITIONS = ("init", "ict", "realm", "query_side", "realm_fixed600",
              "frozen", "stale30", "stale30_rerank", "random_masks",
              "realm_repeat", "realm_original")
# Run only when asked for (--conditions=...).
EXTRA_CONDITIONS = ("realm_slow",)


def _gin_files(name: str, args) -> list[str]:
  """The gin files of a pre-training condition: the recipe file, then for
  `realm_original` REALM's own settings (runs/pretrain_original.gin)."""
  return args.gin_file + (["runs/pretrain_original.gin"]
                          if name == "realm_original" else [])


def _bindings(name: str, args) -> list[str]:
  """Gin bindings of a pre-training condition, on top of its gin files."""
  # A release on a step count, unguarded (as these conditions were
  # measured before the recall guard was the default).
  fixed = ["pretrain.GateConfig.mode = 'steps'",
           "pretrain.RecallGuardConfig.queries = ''"]
  query_side = ["pretrain.RetrieverScheduleConfig.training = 'query_side'",
                "realm.RetrieverConfig.share_towers = False"]
  return {
      "realm": [],
      "realm_repeat": [],
      "realm_fixed600": fixed + ["pretrain.GateConfig.latest_release = 600"],
      "query_side": query_side,
      "realm_original": [],
      "frozen": fixed + ["pretrain.GateConfig.latest_release = 0",
                         "pretrain.RetrieverScheduleConfig."
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


@dataclasses.dataclass
class World:
  """What one benchmark run trains on and is evaluated on.

  Attributes:
    store_dir: Z, the block store pre-training retrieves from.
    train_x / heldout_x / dev_x: annotated X, split by article (dev: the
      gate's and the recall guard's queries; None: no dev split).
    eval_store_dir: the corpus a checkpoint is evaluated over: Z, or Z with
      blocks added after training (the vital world's SQuAD paragraphs).
    questions: open-domain questions, never trained on (`qa_recall@k`).
    questions_path: their file (its hash names the kept wordpieces).
    gold_blocks: the held-out queries -> each one's evidence block (the
      synthetic worlds), or None (real text).
    cloze: (queries, gold blocks) of the cloze probe, or None.
  """
  store_dir: str
  train_x: str
  heldout_x: str
  dev_x: str | None
  eval_store_dir: str
  questions: tuple = ()
  questions_path: str | None = None
  gold_blocks: Callable[[dict], Any] | None = None
  cloze: tuple | None = None


def _people_world(args) -> World:
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  from realm_jax.testing import knowledge_world  # pylint: disable=g-import-not-at-top
  world = knowledge_world.write_world(
      os.path.join(args.workdir, "world"), seed=args.seed,
      num_people=args.people, num_heldout=args.heldout, num_dev=args.dev,
      templates=args.templates, shuffle_facts=args.shuffle_facts)

  def gold_blocks(heldout):
    import numpy as np  # pylint: disable=g-import-not-at-top
    gold_of = knowledge_world.gold_blocks(
        block_store.BlockStore.open(world.block_store),
        knowledge_world.load_people(world.people))
    return np.asarray([gold_of[int(h)] for h in heldout["source_doc_hash"]])

  return World(world.block_store, world.train, world.heldout, world.dev,
               eval_store_dir=world.block_store, gold_blocks=gold_blocks)


def _split_by_article(annotated: str, directory: str) -> dict[str, str]:
  """An annotated corpus split by article into train, held-out (every 4th
  article: the masked-token metrics) and dev (every 8th of the rest: the
  gate's and the guard's queries), each file written once."""
  splits = {n: os.path.join(directory, f"{n}.tfr.gz")
            for n in ("train", "heldout", "dev")}

  def split(i):
    return "heldout" if i % 4 == 3 else "dev" if i % 8 == 1 else "train"

  if not os.path.exists(splits["dev"]):
    from realm_jax.data import salient_spans  # pylint: disable=g-import-not-at-top
    docs = list(salient_spans.read_annotated(
        [salient_spans.shard_path(annotated, 0, 1)]))
    for name, path in splits.items():
      _write_whole(path, [d for i, d in enumerate(docs) if split(i) == name])
  return splits


def _annotated(input_path: str | None, directory: str,
               num_documents: int | None) -> str:
  """The salient-span annotation of the first `num_documents` of a corpus
  (one shard; the job's output appears whole)."""
  annotated = os.path.join(directory, "annotated")
  if not os.path.exists(annotated):
    from realm_jax.data import annotate_job  # pylint: disable=g-import-not-at-top
    annotate_job.annotate_corpus(input_path=input_path, output_dir=annotated,
                                 num_shards=1, max_documents=num_documents)
  return annotated


def _corpus(input_path: str | None, store_dir: str,
            num_documents: int | None = None) -> str:
  """A block store of 128-wordpiece blocks, built once."""
  if not os.path.exists(os.path.join(store_dir, "manifest.json")):
    from realm_jax.data import corpus_job  # pylint: disable=g-import-not-at-top
    corpus_job.build_corpus(input_path=input_path, output_dir=store_dir,
                            max_block_len=128, max_documents=num_documents)
  return store_dir


def _wiki_world(args) -> World:
  """The enwiki slice: Z = its blocks, X = its sentences by article;
  questions: the 255 held-out ones written about it."""
  from realm_jax.data import qa  # pylint: disable=g-import-not-at-top
  directory = os.path.join(args.workdir, "wiki")
  num_documents = args.num_documents or None
  store_dir = _corpus(None, os.path.join(directory, "blocks"), num_documents)
  splits = _split_by_article(_annotated(None, directory, num_documents),
                             directory)
  return World(store_dir, _every_nth_article(
      splits["train"], args.train_articles_every), splits["heldout"],
               splits["dev"], eval_store_dir=store_dir,
               questions=tuple(qa.read_qa_jsonl(WIKI_QUESTIONS, strict=True)),
               questions_path=WIKI_QUESTIONS)


def _vital_world(args) -> World:
  """The Vital Articles' leads (`benchmarks/data/fetch_public.py`'s
  output in --data_dir): Z = the first --num_documents leads (all: 0), X =
  their sentences by article. Evaluated over Z + the SQuAD dev paragraphs
  (added after training, never trained on) on the SQuAD dev questions, and
  on the cloze probe."""
  from realm_jax.data import block_store, squad  # pylint: disable=g-import-not-at-top
  n = args.num_documents or None
  directory = os.path.join(args.workdir, f"vital{n or ''}")
  os.makedirs(directory, exist_ok=True)
  leads = os.path.join(args.data_dir, "vital_leads.jsonl")
  if n:  # the first n leads, in their file's order
    with open(leads, encoding="utf-8") as f:
      first = [line for _, line in zip(range(n), f)]
    leads = os.path.join(directory, "leads.jsonl")
    _write_text(leads, "".join(first))
  store_dir = _corpus(leads, os.path.join(directory, "blocks"))
  union_jsonl = os.path.join(directory, "union.jsonl")
  if not os.path.exists(union_jsonl):
    with open(leads, encoding="utf-8") as a, open(os.path.join(
        args.data_dir, "squad_dev_paragraphs.jsonl"), encoding="utf-8") as b:
      _write_text(union_jsonl, a.read() + b.read())
  union_dir = _corpus(union_jsonl, os.path.join(directory, "union"))
  block_store.check_extends(block_store.BlockStore.open(store_dir),
                            block_store.BlockStore.open(union_dir))
  splits = _split_by_article(_annotated(leads, directory, None), directory)
  questions_path = os.path.join(args.data_dir, "squad_dev_questions.jsonl")
  questions = [q.example for q in squad.read_questions_jsonl(questions_path)]
  return World(store_dir, splits["train"], splits["heldout"], splits["dev"],
               eval_store_dir=union_dir,
               questions=tuple(questions[:args.max_questions or None]),
               questions_path=questions_path,
               cloze=_cloze_probe(args, directory, store_dir))


def _cloze_probe(args, directory: str, store_dir: str):
  """The qa_wikidata prompts about a lead of Z, written as annotated
  documents ("The capital of X is Y." with Y the salient span; evaluation
  only) to `directory/cloze.tfr.gz`. Returns (that path, {a prompt's title
  hash: its gold block, the subject's first lead block holding the
  answer}); `Bench` masks them with the recipe's `RealmQueryConfig`."""
  from realm_jax.data import block_store, qa, salient_spans  # pylint: disable=g-import-not-at-top
  store = block_store.BlockStore.open(store_dir)
  first_block = {}
  for d in range(store.num_documents):
    b = int(store.doc_block_offsets[d])
    first_block[store.title(b)] = (b, int(store.doc_block_offsets[d + 1]))
  docs, gold = [], []
  with open(os.path.join(args.data_dir, "wikidata_cloze.jsonl"),
            encoding="utf-8") as f:
    for i, line in enumerate(f):
      prompt = json.loads(line)
      if prompt["subject"] not in first_block:
        continue
      lo, hi = first_block[prompt["subject"]]
      found = [(b, a) for b in range(lo, hi) for a in prompt["answers"]
               if qa.has_answer(store.text(b), (a,))]
      if not found:
        continue
      block, answer = found[0]
      text = f"{prompt['prompt']} {answer}."
      start = len(prompt["prompt"].encode()) + 1
      docs.append(salient_spans.AnnotatedDocument(
          title=f"cloze probe {i}", text=text,
          sentence_byte_starts=(0,), sentence_byte_limits=(len(text.encode()),),
          span_byte_starts=(start,),
          span_byte_limits=(start + len(answer.encode()),),
          span_types=("CLOZE",)))
      gold.append(block)
  path = os.path.join(directory, "cloze.tfr.gz")
  if not os.path.exists(path):  # (gzip stamps the time: written once)
    _write_whole(path, docs)
  from realm_jax.data import blocks  # pylint: disable=g-import-not-at-top
  gold_of = {blocks.title_hash(d.title): g for d, g in zip(docs, gold)}
  if set(gold_of) & set(map(int, store.doc_hash)):
    raise ValueError("a cloze probe's title hashes like an article of Z.")
  return path, gold_of


def _write_text(path: str, text: str) -> None:
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
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


def _kept(path: str, make):
  """`make()`'s arrays, kept at `path` (.npz, no pickles): a run there
  needs no tensorflow_text, e.g. on an accelerator host."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if os.path.exists(path):
    with np.load(path, allow_pickle=False) as f:
      return {k: f[k] for k in f.files}
  arrays = make()
  np.savez(path + ".tmp.npz", **arrays)
  os.replace(path + ".tmp.npz", path)
  return arrays


def _sha(path: str, *settings) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read() + repr(settings).encode()).hexdigest()[:12]


def parse_args(argv=None):
  """The flags, with each world's defaults filled in."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


class Bench:
  """One benchmark run: the world, the recipe, and the rows it writes.

  `__init__` builds the inputs (query caches, the held-out queries and the
  questions' wordpieces, kept in the workdir); `train_ict` and
  `pretrain(condition)` run the real jobs; `report` evaluates one set of
  parameters and writes its row.
  """

  def __init__(self, args, world: World):
    import numpy as np  # pylint: disable=g-import-not-at-top
    from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
    from realm_jax.data import block_store, examples, query_cache  # pylint: disable=g-import-not-at-top
    from realm_jax.data import realm_inputs  # pylint: disable=g-import-not-at-top
    from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
    self.args, self.world = args, world
    # A thinned run or another pre-training seed has its own run
    # directories (the inputs and ICT of the workdir are shared).
    self.suffix = (f"_every{args.train_articles_every}"
                   if args.train_articles_every > 1 else "") + (
                       f"_seed{args.pretrain_seed}"
                       if args.pretrain_seed != args.seed else "")
    self.store = block_store.BlockStore.open(world.store_dir)
    self.eval_store = block_store.BlockStore.open(world.eval_store_dir)
    self.base = [
        f"WORKDIR = '{args.workdir}'",
        f"BLOCK_STORE = '{world.store_dir}'",
        f"QUERIES = '{os.path.join(args.workdir, 'queries_salient')}'",
        f"GATE_QUERIES = '{os.path.join(args.workdir, 'queries_dev')}'",
        f"pretrain.PretrainConfig.num_train_steps = {args.steps}",
        f"pretrain.PretrainConfig.checkpoint_every = {args.refresh_every}",
        f"pretrain.PretrainConfig.seed = {args.pretrain_seed}",
        f"pretrain.RetrievalConfig.trivial_candidates = '{args.trivial}'"
    ] + list(args.gin)
    gin, self.model = _configs(args.gin_file, [
        b for b in self.base if ".num_train_steps" not in b])
    self.recipe = gin.get_configurable(pretrain.PretrainConfig)()
    self.query_config = gin_config.configured(examples.RealmQueryConfig)
    # The reader's length as the trainer derives it (queries + blocks).
    self.reader_length = realm_inputs.reader_length(
        self.recipe.reader_length, self.query_config.query_length,
        self.store.max_block_len, field="PretrainConfig.reader_length",
        queries="(the benchmark's)")
    self._check_recipe()
    self.warmup = (self.recipe.gate.latest_release
                   if self.recipe.gate.mode == "steps" else 0)
    if self._needs_dev():
      dev_cache = os.path.join(args.workdir, "queries_dev")
      if not os.path.exists(dev_cache):
        query_cache.build_query_cache(
            world.dev_x, dev_cache, query_config=self.query_config,
            seed=args.seed, num_shards=1)
    salient = dataclasses.replace(self.query_config, masking="salient")
    self.heldout = _kept(os.path.join(args.workdir, "heldout_queries_" + _sha(
        world.heldout_x, salient, args.seed, args.max_heldout) + ".npz"),
                         self._read_heldout)
    self.gold = (None if world.gold_blocks is None
                 else world.gold_blocks(self.heldout))
    self.question_inputs = None
    if world.questions:
      self.question_inputs = _kept(os.path.join(
          args.workdir, "question_inputs_" + _sha(
              world.questions_path, self.query_config.query_length,
              len(world.questions)) + ".npz"), self._tokenize_questions)
    self.cloze = None
    if world.cloze:
      path, gold_of = world.cloze
      queries = _kept(os.path.join(args.workdir, "cloze_queries_" + _sha(
          path, salient) + ".npz"), lambda: self._read_queries(path, salient))
      self.cloze = queries, np.asarray(
          [gold_of[int(h)] for h in queries["source_doc_hash"]])
      print(f"cloze probe: {len(self.cloze[1])} prompts (answers of at most "
            f"{salient.max_masks} wordpieces)", flush=True)
    self.out = (open(args.output, "w", encoding="utf-8") if args.output
                else None)
    self.rows = []

  def _needs_dev(self) -> bool:
    """Whether the gate or the recall guard reads a dev split's queries."""
    recipe = self.recipe
    return ((recipe.gate.measured and recipe.gate.queries != recipe.queries)
            or recipe.recall_guard.queries not in ("", recipe.queries))

  def _check_recipe(self):
    if self._needs_dev() and not self.world.dev_x:
      raise SystemExit("the recipe's gate or recall guard needs --dev "
                       "people.")

  def _read_queries(self, path, config, max_queries=0):
    import numpy as np  # pylint: disable=g-import-not-at-top
    from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
    from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    queries = examples.read_realm_queries(path, Tokenizer(), config=config,
                                          seed=self.args.seed)
    if max_queries:
      keep = np.sort(np.random.default_rng(self.args.seed).permutation(
          len(queries["query_ids"]))[:max_queries])
      queries = {k: v[keep] for k, v in queries.items()}
    return queries

  def _read_heldout(self):
    return self._read_queries(
        self.world.heldout_x,
        dataclasses.replace(self.query_config, masking="salient"),
        self.args.max_heldout)

  def _tokenize_questions(self):
    from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    from realm_jax.data import qa_inputs  # pylint: disable=g-import-not-at-top
    return qa_inputs.tokenize_questions(
        Tokenizer(), [e.question for e in self.world.questions],
        self.query_config.query_length)

  def queries_for(self, config) -> str:
    """The training sentences masked the condition's way (built once)."""
    from realm_jax.data import query_cache  # pylint: disable=g-import-not-at-top
    thinned = (f"_every{self.args.train_articles_every}"
               if self.args.train_articles_every > 1 else "")
    path = os.path.join(self.args.workdir,
                        f"queries_{config.masking}{thinned}")
    if not os.path.exists(path):
      query_cache.build_query_cache(
          self.world.train_x, path, query_config=config,
          seed=self.args.seed, num_shards=1)
    return path

  def prepare(self):
    """Every condition's query cache; nothing trained."""
    from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
    from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
    for condition in self.args.conditions:
      if condition not in ("init", "ict"):
        _configs(_gin_files(condition, self.args),
                 self.base + _bindings(condition, self.args))
        self.queries_for(gin_config.configured(examples.RealmQueryConfig))

  def _write(self, row):
    self.rows.append(row)
    if self.out:
      self.out.write(json.dumps(row) + "\n")
      self.out.flush()

  def report(self, condition, step, params, model, seconds=None,
             block_emb=None):
    """One checkpoint's row: held-out masked queries, the questions and
    (vital) the cloze probe, over the evaluation corpus."""
    from realm_jax.eval import pretrain_eval  # pylint: disable=g-import-not-at-top
    from realm_jax.index import embed  # pylint: disable=g-import-not-at-top
    if block_emb is None or len(block_emb) != len(self.eval_store):
      block_emb, _ = embed.embed_block_store(
          params["retriever"], model.retriever, self.eval_store,
          log_every_seconds=1e9)
    common = dict(num_candidates=self.recipe.retrieval.num_candidates,
                  reader_length=self.reader_length,
                  trivial_candidates=self.args.trivial, block_emb=block_emb)
    row = {"condition": condition, "step": step, **pretrain_eval.evaluate(
        params, model, self.eval_store, self.heldout, self.gold,
        questions=self.world.questions,
        question_length=self.query_config.query_length,
        question_inputs=self.question_inputs,
        qa_ks=(1, 5, 20, 100) if self.cloze else (1, 5, 20), **common)}
    if self.cloze:
      cloze = pretrain_eval.evaluate(params, model, self.eval_store,
                                     *self.cloze, **common)
      row.update({f"cloze_{k}": cloze[k] for k in (
          "recall@1", "recall@5", "mlm_accuracy_marginal",
          "mlm_accuracy_null", "mlm_accuracy_gold")})
    if seconds is not None:
      row["train_seconds"] = round(seconds, 1)
    line = {k: round(v, 4) if isinstance(v, float) else v
            for k, v in row.items()}
    print(json.dumps({k: v for k, v in line.items()
                      if k != "qa_answer_rank"}), flush=True)
    self._write(line)

  def evaluate_run(self, condition, model, ckpt_dir, seconds, every,
                   first=0, block_emb=None):
    from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
    ckpt = checkpoints.TrainCheckpointer(ckpt_dir, async_save=False)
    try:
      for step in ckpt.all_steps():
        if step >= first and (step % every == 0
                              or step == ckpt.latest_step()):
          self.report(condition, step, ckpt.restore_params(step), model,
                      seconds if step == ckpt.latest_step() else None,
                      block_emb=block_emb)
    finally:
      ckpt.close()

  def report_init(self):
    from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
    from realm_jax.model.realm import Realm  # pylint: disable=g-import-not-at-top
    _, fresh = functional.init(lambda r: Realm(self.model, rngs=r),
                               self.args.seed)
    self.report("init", 0, fresh, self.model)

  @property
  def ict_checkpoints(self) -> str:
    from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
    return checkpoints.checkpoint_dir(os.path.join(self.args.workdir, "ict"))

  def train_ict(self, evaluate: bool):
    """The ICT warm start every REALM condition shares (--seed's)."""
    from realm_jax.training import ict  # pylint: disable=g-import-not-at-top
    args, ict_dir = self.args, os.path.join(self.args.workdir, "ict")
    t0 = time.time()
    gin, model = _configs(args.gin_file, self.base + [
        f"ict.IctTrainConfig.workdir = '{ict_dir}'",
        f"ict.IctTrainConfig.num_train_steps = {args.ict_steps}",
        f"ict.IctTrainConfig.checkpoint_every = {args.ict_steps // 4}",
        "ict.IctTrainConfig.keep_checkpoints = 10",
        # ICT never scores the null document; leaving the learned null
        # score out of its checkpoints lets both null modes start from it.
        "realm.RetrieverConfig.null_score = 'embedding'",
        f"ict.IctTrainConfig.seed = {args.seed}"])
    ict.train(config=gin.get_configurable(ict.IctTrainConfig)(), model=model)
    if evaluate:
      self.evaluate_run("ict", model, self.ict_checkpoints, time.time() - t0,
                        args.ict_steps // 4)

  def prepared_reader(self, condition, queries) -> list[str]:
    """MiniLM's reader prepared on the condition's queries (its own job,
    `reader_prep`: MiniLM has no MLM head); pre-training starts from it."""
    from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
    from realm_jax.training import reader_prep  # pylint: disable=g-import-not-at-top
    prep_dir = os.path.join(self.args.workdir,
                            condition + self.suffix + "_reader")
    gin, model = _configs(
        _gin_files(condition, self.args),
        self.base + _bindings(condition, self.args) + [
            f"reader_prep.ReaderPrepConfig.workdir = '{prep_dir}'",
            f"reader_prep.ReaderPrepConfig.queries = '{queries}'",
            f"reader_prep.ReaderPrepConfig.seed = {self.args.seed}"])
    reader_prep.train(
        config=gin.get_configurable(reader_prep.ReaderPrepConfig)(),
        model=model)
    return [f"pretrain.PretrainConfig.init_from = "
            f"'checkpoint:{checkpoints.checkpoint_dir(prep_dir)}'"]

  def pretrain(self, condition):
    """Pre-trains one condition, evaluates its checkpoints and writes its
    summary row (worst guard values, gate and guard decisions)."""
    from realm_jax.core import checkpoints, gin_config  # pylint: disable=g-import-not-at-top
    from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
    from realm_jax.index import publish  # pylint: disable=g-import-not-at-top
    from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
    args, name = self.args, condition + self.suffix
    workdir = os.path.join(args.workdir, name)
    bindings, gin_files = (_bindings(condition, args),
                           _gin_files(condition, args))
    _configs(gin_files, self.base + bindings)
    queries = self.queries_for(gin_config.configured(examples.RealmQueryConfig))
    start = ([f"pretrain.PretrainConfig.init_from = "
              f"'checkpoint:{self.ict_checkpoints}'"] if args.scratch
             else self.prepared_reader(condition, queries))
    gin, model = _configs(gin_files, self.base + [
        f"pretrain.PretrainConfig.workdir = '{workdir}'",
        "pretrain.PretrainConfig.keep_checkpoints = 1000"] + start + bindings)
    config = gin.get_configurable(pretrain.PretrainConfig)()
    # A gate or guard on the training queries follows the condition's
    # masking.
    def masked(path):
      return queries if path == config.queries else path
    config = dataclasses.replace(
        config, queries=queries, gate=dataclasses.replace(
            config.gate, queries=masked(config.gate.queries)),
        recall_guard=dataclasses.replace(
            config.recall_guard,
            queries=masked(config.recall_guard.queries)))
    ckpt_dir = checkpoints.checkpoint_dir(workdir)
    # The fixed warm-up (gate "steps") is the same for every condition but
    # `realm_original`: it runs once, in `realm`'s workdir, and the others
    # resume from its last checkpoint with their own settings.
    shared = condition not in ("realm", "realm_original") and self.warmup
    if shared and not os.path.exists(ckpt_dir):
      source = os.path.join(checkpoints.checkpoint_dir(
          os.path.join(args.workdir, "realm" + self.suffix)), str(self.warmup))
      shutil.copytree(source, os.path.join(ckpt_dir, str(self.warmup)))
    t0 = time.time()
    pretrain.train(config=config, model=model)
    seconds = time.time() - t0
    # Query-side: the document tower never moves, so every checkpoint's
    # blocks are the run's one index (not embedded again per checkpoint).
    block_emb = (publish.load_index(checkpoints.index_root(workdir)).embeddings
                 if config.retriever.training == "query_side" else None)
    self.evaluate_run(name, model, ckpt_dir, seconds, args.eval_every,
                      first=self.warmup + 1 if shared else 0,
                      block_emb=block_emb)
    self._write(self._summary(name, workdir, seconds))
    print(json.dumps(self.rows[-1]), flush=True)

  def _summary(self, name, workdir, seconds) -> dict:
    """The training-time guards, for the doc: worst logged values (from
    the run's metrics.jsonl, so that a resumed run reports them too)."""
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      logged = [json.loads(line) for line in f]
    worst = {"condition": name, "summary": True,
             "train_max_hubness": max(h["hubness"] for h in logged),
             "train_max_null_probability": max(h["null_probability"]
                                               for h in logged),
             "train_seconds": round(seconds, 1)}
    if "retriever_release_step" in logged[-1]:
      release = int(logged[-1]["retriever_release_step"])
      worst["retriever_release_step"] = (
          release if release < self.args.steps else None)  # None: never
    for key, file in (("gate", "gate.jsonl"),
                      ("recall_guard", "recall_guard.jsonl")):
      decisions = os.path.join(workdir, file)
      if os.path.exists(decisions):
        with open(decisions, encoding="utf-8") as f:
          worst[key] = [json.loads(line) for line in f]
    return worst

  def close(self):
    if self.out:
      self.out.close()


WORLDS = {"people": _people_world, "wiki": _wiki_world,
          "vital": _vital_world}


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.table_from:
    with open(args.table_from, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    print("\n\n".join(filter(None, (table(rows), paired_table(rows)))))
    if args.plot:
      plot(rows, args.plot)
    return
  os.makedirs(args.workdir, exist_ok=True)
  bench = Bench(args, WORLDS[args.world](args))
  if args.prepare_only:
    bench.prepare()
    print(f"{args.workdir}: inputs prepared; run again without "
          "--prepare_only to train (tensorflow is no longer needed).")
    return
  conditions = args.conditions
  if "init" in conditions:
    bench.report_init()
  if args.scratch:  # ICT warm start, shared by every REALM condition
    bench.train_ict(evaluate="ict" in conditions)
  pretraining = [c for c in conditions if c not in ("init", "ict")]
  if bench.warmup and "realm" not in pretraining and len(pretraining) > 1:
    pretraining.insert(0, "realm")  # the shared warm-up lives there
  for condition in pretraining:
    bench.pretrain(condition)
  bench.close()
  print("\n\n".join(filter(None, (table(bench.rows),
                                  paired_table(bench.rows)))))
  if args.plot:
    plot(bench.rows, args.plot)


def table(rows) -> str:
  """Markdown table of every evaluated checkpoint, condition by condition."""
  rows = [r for r in rows if "summary" not in r]
  keys = [k for k in ("recall@1", "recall@5", "qa_recall@1", "qa_recall@5",
                      "qa_recall@20", "qa_recall@100", "span_recall",
                      "mlm_accuracy_marginal", "mlm_accuracy_null",
                      "mlm_accuracy_gold", "cloze_mlm_accuracy_marginal",
                      "cloze_mlm_accuracy_null", "cloze_mlm_accuracy_gold",
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

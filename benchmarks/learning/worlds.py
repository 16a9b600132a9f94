"""The learning benchmark's worlds: what a run trains on and is evaluated on.

`WORLDS[--world](args)` builds (once, in --workdir) and returns a `World`:
  people  the synthetic knowledge world (`realm_jax.testing.knowledge_world`)
  wiki    the gensim enwiki slice, split by article; the 255 held-out
          questions of benchmarks/data/wiki_heldout_qa.jsonl
  vital   the Vital Articles' leads (`benchmarks/data/fetch_public.py`'s
          output), evaluated with the SQuAD dev paragraphs added, on the
          SQuAD dev questions and the cloze probe
Every file appears whole or not at all, so an interrupted run resumes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

WIKI_QUESTIONS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
    "wiki_heldout_qa.jsonl")


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


def people_world(args) -> World:
  """The synthetic knowledge world of --people (its held-out queries'
  gold blocks: each person's biography)."""
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


def wiki_world(args) -> World:
  """The enwiki slice: Z = its blocks, X = its sentences by article;
  questions: the 255 held-out ones written about it."""
  from realm_jax.data import qa  # pylint: disable=g-import-not-at-top
  directory = os.path.join(args.workdir, "wiki")
  num_documents = args.num_documents or None
  store_dir = _corpus(None, os.path.join(directory, "blocks"), num_documents)
  splits = _split_by_article(_annotated(None, directory, num_documents),
                             directory)
  return World(store_dir, every_nth_article(
      splits["train"], args.train_articles_every), splits["heldout"],
               splits["dev"], eval_store_dir=store_dir,
               questions=tuple(qa.read_qa_jsonl(WIKI_QUESTIONS, strict=True)),
               questions_path=WIKI_QUESTIONS)


def vital_world(args) -> World:
  """The Vital Articles' leads (`benchmarks/data/fetch_public.py`'s
  output in --data_dir): Z = the first --num_documents leads (all: 0), X =
  their sentences by article. Evaluated over Z + the SQuAD dev paragraphs
  (added after training, never trained on) on the SQuAD dev questions, and
  on the cloze probe."""
  from realm_jax.data import block_store, squad  # pylint: disable=g-import-not-at-top
  from benchmarks import public_sources  # pylint: disable=g-import-not-at-top
  # Every file it reads, before anything is built (one line, exit 1).
  missing = public_sources.missing_files(args.data_dir,
                                         ("leads", "squad", "cloze"))
  if missing:
    raise SystemExit(missing)
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
  answer}); `prepare.Inputs` masks them with the recipe's `RealmQueryConfig`."""
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


def every_nth_article(train_x: str, n: int) -> str:
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


WORLDS = {"people": people_world, "wiki": wiki_world, "vital": vital_world}

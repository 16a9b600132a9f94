r"""Checks wiki_heldout_qa.jsonl (or --qa) against the Wikipedia slice's blocks.

The questions were written by hand from the block texts of the enwiki slice
inside the gensim wheel (`wikipedia.default_wikipedia_dump()`), every
article, blocks of 128 wordpieces. This script rebuilds that block store if
it is missing and checks, for every question:

  * the line is a valid ORQA record (`qa.read_qa_jsonl(strict=True)`) with an
    "article" field naming an article of the store;
  * at least one block contains at least one of its answers, by the
    project's `qa.has_answer_batch` (REALM normalisation: NFD, lower case,
    punctuation, articles a/an/the, whitespace; token boundaries) - and at
    least one of those blocks belongs to the named article;
  * it is not a copy of a demo question (`realm_jax/data/demo_qa/*.jsonl`):
    same normalised question, same (normalised answer, article) pair, or a
    near-paraphrase (content-word Jaccard >= --max_similarity);
  * the same for the questions of each --apart_from file, whose "article"
    field gives their article (by default the held-out file, when another
    file such as wiki_dev_qa.jsonl is checked);
  * it does not duplicate another question of the file (same normalised
    question or same (answer, article) pair).

It prints, per question, the number of answer-bearing blocks (whole corpus,
and within its article), then the totals and the distribution, and exits
with status 1 if any check fails.

  python benchmarks/data/check_wiki_qa.py [--blocks /tmp/wiki_all/blocks]
  python benchmarks/data/check_wiki_qa.py --qa benchmarks/data/wiki_dev_qa.jsonl
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import time

import numpy as np

from realm_jax.data import qa

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
DEFAULT_QA = os.path.join(_HERE, "wiki_heldout_qa.jsonl")
DEFAULT_BLOCKS = "/tmp/wiki_all/blocks"
DEMO_GLOB = os.path.join(_REPO, "realm_jax", "data", "demo_qa", "*.jsonl")
MAX_BLOCK_LEN = 128
# Answer-bearing-block buckets for the distribution.
BUCKETS = ((1, 1), (2, 3), (4, 10), (11, 30), (31, 100), (101, None))
# Question words that say nothing about the content (for the paraphrase
# check); articles are already gone after normalize_answer.
_STOP = frozenset(
    "what which who whom whose when where why how in of to is was were are "
    "did does do for on by from and or as at with its his her their it that "
    "this be been year many much called name named known".split())


def open_store(path: str):
  """The block store at `path`, built first (every article) if missing."""
  # Imported here: the Beam pipeline is only needed to build.
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  if not os.path.exists(os.path.join(path, "manifest.json")):
    from realm_jax.data import corpus_job  # pylint: disable=g-import-not-at-top
    start = time.time()
    # max_documents=None: every article of the slice (0 is refused).
    corpus_job.build_corpus(output_dir=path, max_block_len=MAX_BLOCK_LEN,
                            max_documents=None)
    print(f"built {path} in {time.time() - start:.1f} s")
  store = block_store.BlockStore.open(path)
  if store.max_block_len != MAX_BLOCK_LEN:
    sys.exit(f"{path}: blocks of {store.max_block_len} wordpieces, the "
             f"questions were checked against {MAX_BLOCK_LEN}.")
  return store


def content_words(question: str) -> frozenset[str]:
  return frozenset(w for w in qa.normalize_answer(question).split()
                   if w not in _STOP)


def question_key(question: str, answers, article: str | None) -> tuple:
  """(normalised question, normalised answers, article, content words)."""
  return (qa.normalize_answer(question),
          frozenset(qa.normalize_answer(a) for a in answers), article,
          content_words(question))


def demo_keys(texts, doc_of_block: np.ndarray, titles: list[str]) -> list:
  """`question_key`s of the demo questions.

  Each is attributed to the article, among the first 16 (the demo's), that
  has most of its answer-bearing blocks.
  """
  demo_first_docs = 16
  keys = []
  for path in sorted(glob.glob(DEMO_GLOB)):
    for ex in qa.read_qa_jsonl(path, strict=True):
      hits = qa.has_answer_batch(texts, ex.answers)
      counts = np.bincount(doc_of_block[hits], minlength=len(titles))
      article = titles[int(np.argmax(counts[:demo_first_docs]))]
      keys.append(question_key(ex.question, ex.answers, article))
  return keys


def file_keys(path: str) -> list:
  """`question_key`s of another question file; each needs an "article"."""
  qa.read_qa_jsonl(path, strict=True)
  with open(path, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  if any("article" not in r for r in records):
    sys.exit(f"{path}: a question without an \"article\" field.")
  return [question_key(r["question"], r["answer"], r["article"])
          for r in records]


def apart_from_paths(qa_path: str, given: list[str] | None) -> list[str]:
  """--apart_from; by default the held-out file, unless it is `qa_path`."""
  checked = os.path.abspath(qa_path)
  if given is None:
    return [] if checked == os.path.abspath(DEFAULT_QA) else [DEFAULT_QA]
  if checked in map(os.path.abspath, given):
    sys.exit(f"--apart_from {qa_path}: that is the file checked.")
  return given


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
  return len(a & b) / max(len(a | b), 1)


def bucket_name(lo: int, hi: int | None) -> str:
  if hi is None:
    return f">{lo - 1}"
  return str(lo) if lo == hi else f"{lo}-{hi}"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--qa", default=DEFAULT_QA)
  parser.add_argument("--blocks", default=DEFAULT_BLOCKS,
                      help="block store of every article, 128 wordpieces "
                      "(built here if missing)")
  parser.add_argument("--max_similarity", type=float, default=0.6,
                      help="content-word Jaccard with a demo (or "
                      "--apart_from) question above which a question is a "
                      "near-paraphrase")
  parser.add_argument("--apart_from", action="append", metavar="PATH",
                      help="another question file (with \"article\") to "
                      "keep the checked one apart from, like the demo "
                      "questions; repeatable (default: the held-out file, "
                      "unless it is the checked one)")
  parser.add_argument("--quiet", action="store_true",
                      help="only the failures and the totals")
  args = parser.parse_args()

  store = open_store(args.blocks)
  texts = [store.text(i) for i in range(len(store))]
  doc_of_block = np.asarray(store.doc_indices)
  titles = [store.title(store.document_blocks(d).start)
            for d in range(store.num_documents)]
  doc_of_title = {t: d for d, t in enumerate(titles)}
  print(f"store {args.blocks}: {store.num_documents} articles, "
        f"{len(store)} blocks of <= {store.max_block_len} wordpieces")

  examples = qa.read_qa_jsonl(args.qa, strict=True)
  with open(args.qa, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  assert len(records) == len(examples)

  failures = []

  def fail(i, why):
    failures.append(f"#{i + 1} {records[i]['question']!r}: {why}")

  # Question sets to keep apart from, by name: the demo's, then --apart_from.
  others = {"demo": demo_keys(texts, doc_of_block, titles)}
  for path in apart_from_paths(args.qa, args.apart_from):
    others[os.path.basename(path)] = file_keys(path)

  totals, in_article = [], []
  closest = {name: [] for name in others}
  seen_questions, seen_pairs = {}, {}
  for i, (ex, rec) in enumerate(zip(examples, records)):
    article = rec.get("article")
    if article not in doc_of_title:
      fail(i, f"article {article!r} is not a title of the store")
      totals.append(0), in_article.append(0)
      continue
    hits = qa.has_answer_batch(texts, ex.answers)
    n_total = int(hits.sum())
    n_article = int(hits[store.document_blocks(doc_of_title[article])].sum())
    totals.append(n_total), in_article.append(n_article)
    if not args.quiet:
      print(f"{i + 1:4d} blocks {n_total:4d} in article {n_article:3d}  "
            f"[{article}] {ex.question} -> {list(ex.answers)}")
    if n_total == 0:
      fail(i, "no block contains any of its answers")
    elif n_article == 0:
      fail(i, f"no block of {article!r} contains any of its answers")
    norm_q, norm_answers, _, words = question_key(ex.question, ex.answers,
                                                  article)
    for name, keys in others.items():
      closest[name].append(max(((jaccard(words, k[3]), k[0]) for k in keys),
                               default=(0.0, "")) + (i,))
      for other_q, other_answers, other_article, other_words in keys:
        if norm_q == other_q:
          fail(i, f"same question as a {name} question")
        if article == other_article and norm_answers & other_answers:
          fail(i, f"same (answer, article) as {name} question {other_q!r}")
        if jaccard(words, other_words) >= args.max_similarity:
          fail(i, f"near-paraphrase of {name} question {other_q!r}")
    if norm_q in seen_questions:
      fail(i, f"same question as #{seen_questions[norm_q] + 1}")
    seen_questions.setdefault(norm_q, i)
    for a in norm_answers:
      if (a, article) in seen_pairs:
        fail(i, f"same (answer, article) as #{seen_pairs[a, article] + 1}")
      seen_pairs.setdefault((a, article), i)

  totals = np.asarray(totals)
  per_article = collections.Counter(r.get("article") for r in records)
  print()
  print(f"questions: {len(records)}")
  print(f"articles covered: {len(per_article)} of {store.num_documents} "
        f"(questions per article: min {min(per_article.values())}, "
        f"max {max(per_article.values())})")
  uncovered = [t for t in titles if t not in per_article]
  if uncovered:
    print(f"articles without a question: {uncovered}")
  for name, keys in others.items():
    print(f"{name} questions compared: {len(keys)}; the closest "
          "(content-word Jaccard):")
    for sim, other_q, i in sorted(closest[name], reverse=True)[:5]:
      print(f"  {sim:.2f}  #{i + 1} {records[i]['question']!r} ~ {other_q!r}")
  print("answer-bearing blocks per question (whole corpus):")
  for lo, hi in BUCKETS:
    n = int(((totals >= lo) & ((totals <= hi) if hi else True)).sum())
    print(f"  {bucket_name(lo, hi):>5}: {n:4d}")
  print(f"  median {np.median(totals):.0f}, mean {totals.mean():.1f}, "
        f"max {totals.max()}; <= 10 blocks: {(totals <= 10).sum()} "
        f"({(totals <= 10).mean():.0%})")
  if failures:
    print(f"\n{len(failures)} FAILURE(S):")
    for line in failures:
      print("  " + line)
    return 1
  kept_apart = " or ".join(f"a {name} question" for name in others)
  print("\nOK: every question has an answer-bearing block in its article, "
        f"and none repeats {kept_apart}.")
  return 0


if __name__ == "__main__":
  sys.exit(main())

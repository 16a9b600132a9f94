"""Tests of the demo's QA set (realm_jax.data.demo_qa) against its corpus.

The demo fine-tunes on these questions with the 16-article demo corpus; a
question whose answer is in no block gives the retriever and reader no
positive, so every answer is checked with the project's own `has_answer` on
the real corpus, built as the demo builds it.
"""

import collections
import json

import numpy as np
import pytest

from realm_jax.data import corpus_job
from realm_jax.data import demo_qa
from realm_jax.data import qa
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.model import realm

# The demo's corpus: the first 16 articles of the gensim slice, 128 wordpieces.
_NUM_DOCUMENTS = 16
_MAX_BLOCK_LEN = 128
_ARTICLES = frozenset((
    "Anarchism", "Autism", "Albedo", "A", "Alabama", "Achilles",
    "Abraham Lincoln", "Aristotle", "An American in Paris",
    "Academy Award for Best Production Design", "Academy Awards", "Actrius",
    "Animalia (book)", "International Atomic Time", "Altruism", "Ayn Rand"))
# Reader spans are at most the reader's max_span_width (10) wordpieces.
_MAX_ANSWER_WORDPIECES = realm.ReaderConfig.max_span_width


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(block titles, block texts) of the demo corpus, built fresh."""
  store, _ = corpus_job.build_corpus(
      output_dir=str(tmp_path_factory.mktemp("demo_qa") / "blocks"),
      max_documents=_NUM_DOCUMENTS, max_block_len=_MAX_BLOCK_LEN)
  titles = [store.title(i) for i in range(len(store))]
  texts = [store.text(i) for i in range(len(store))]
  return titles, texts


@pytest.fixture(scope="module")
def splits():
  """split -> examples, read strictly (a malformed line fails the test)."""
  return {split: qa.read_qa_jsonl(demo_qa.path(split), strict=True)
          for split in demo_qa.SPLITS}


def test_path_names_valid_splits_on_error():
  with pytest.raises(ValueError, match="train, dev"):
    demo_qa.path("test")


def test_files_are_well_formed_jsonl():
  # strict=True above already refuses malformed lines; this also refuses
  # blank lines and extra keys, which the reader would silently accept.
  for split in demo_qa.SPLITS:
    with open(demo_qa.path(split), encoding="utf-8") as f:
      lines = f.read().splitlines()
    for line in lines:
      assert set(json.loads(line)) == {"question", "answer"}, line


def test_sizes_and_no_duplicates(splits):
  train, dev = splits["train"], splits["dev"]
  assert len(train) == 64
  assert len(dev) == 24
  for examples in (train, dev):
    questions = [qa.normalize_answer(e.question) for e in examples]
    assert len(set(questions)) == len(questions)
    for e in examples:
      assert not e.is_regex
      assert len(set(e.answers)) == len(e.answers), e
  train_questions = {qa.normalize_answer(e.question) for e in train}
  shared = [e.question for e in dev
            if qa.normalize_answer(e.question) in train_questions]
  assert not shared


def test_answers_are_short(splits):
  tokenizer = Tokenizer(None)
  for examples in splits.values():
    for e in examples:
      lengths = [len(ids) for ids in qa.tokenize_answers(tokenizer, e.answers)]
      assert min(lengths) >= 1, e
      assert max(lengths) <= _MAX_ANSWER_WORDPIECES, (e, lengths)


def test_every_answer_is_in_a_block_of_the_demo_corpus(corpus, splits):
  titles, texts = corpus
  assert set(titles) == _ARTICLES
  # Which articles each split asks about (by the articles holding answers).
  articles_asked = {}
  for split, examples in splits.items():
    missing, one_article, num_blocks = [], 0, []
    articles_asked[split] = collections.Counter()
    for e in examples:
      hits = np.flatnonzero(qa.has_answer_batch(texts, e.answers))
      if not hits.size:
        missing.append(e)
        continue
      hit_titles = {titles[i] for i in hits}
      one_article += len(hit_titles) == 1
      num_blocks.append(hits.size)
      articles_asked[split].update(hit_titles)
    assert not missing, f"{split}: answers in no block: {missing}"
    # Retrieval must matter: most answers sit in the blocks of one article.
    assert one_article >= 0.85 * len(examples), (split, one_article)
    assert np.median(num_blocks) <= 5, (split, num_blocks)
  # Both splits cover every article of the corpus.
  assert set(articles_asked["train"]) == _ARTICLES
  assert set(articles_asked["dev"]) == _ARTICLES

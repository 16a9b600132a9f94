"""Retrieved ids -> REALM model inputs, against a per-example loop."""

import numpy as np
import pytest

from realm_jax.data import blocks
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.testing import corpus
from realm_jax.data import realm_inputs

ARTICLES = corpus.SHORT_ARTICLES


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  return corpus.small_blocks(str(tmp_path_factory.mktemp("s") / "store"),
                             ARTICLES)


def test_select_candidates_drops_the_source_article_keeping_rank(store):
  doc_hash = store.doc_hash
  paris = blocks.title_hash("Paris")
  n = len(store)
  ranked = np.array([list(range(n)), list(reversed(range(n)))])
  out = realm_inputs.select_candidates(ranked, doc_hash,
                                       np.array([paris, paris]), 3)
  for row, hits in zip(out, ranked):
    want = [b for b in hits if doc_hash[b] != paris][:3]
    np.testing.assert_array_equal(row, want)
  with pytest.raises(ValueError, match="search for more"):
    realm_inputs.select_candidates(ranked[:, :2], doc_hash,
                                   np.array([paris, paris]), 2)


def _sentence_queries(tok, sentences, width=24):
  """`[CLS] sentence [SEP]` queries, one wordpiece masked in each."""
  n = len(sentences)
  q = {"query_ids": np.zeros((n, width), np.int32),
       "query_mask": np.zeros((n, width), np.int32),
       "mlm_positions": np.zeros((n, 2), np.int32),
       "mlm_targets": np.zeros((n, 2), np.int32),
       "mlm_weights": np.zeros((n, 2), np.float32),
       "source_doc_hash": np.zeros(n, np.int64)}
  for i, (title, sentence) in enumerate(sentences):
    ids = [tok.cls_id, *tok.tokenize([sentence])[0], tok.sep_id]
    q["query_ids"][i, :len(ids)] = ids
    q["query_mask"][i, :len(ids)] = 1
    q["mlm_positions"][i, 0], q["mlm_targets"][i, 0] = 2, ids[2]
    q["mlm_weights"][i, 0] = 1
    q["query_ids"][i, 2] = tok.mask_id
    q["source_doc_hash"][i] = blocks.title_hash(title)
  return q


def _contains(haystack, needle) -> bool:
  return any(list(haystack[i:i + len(needle)]) == list(needle)
             for i in range(len(haystack) - len(needle) + 1))


def test_block_rule_excludes_only_the_sentences_own_block(store):
  tok = Tokenizer()
  sentences = [(t, x.strip() + ".") for t, text in ARTICLES.items()
               for x in text.split(". ") if x]
  queries = _sentence_queries(tok, sentences)
  found = realm_inputs.TrivialCandidates(store, "block").source_blocks(
      queries)
  checked = 0
  for (title, sentence), block in zip(sentences, found):
    assert store.title(block) == title
    holders = [b for b in range(len(store)) if store.title(b) == title
               and _contains(store.body_ids(b), tok.tokenize([sentence])[0])]
    if holders:  # (else the sentence is split over two blocks)
      assert block in holders, (sentence, block, holders)
      checked += 1
  assert checked >= len(sentences) // 2
  # The article's other blocks stay retrievable under "block", not under
  # "article"; an unknown article excludes nothing.
  n = len(store)
  ranked = np.tile(np.arange(n), (len(sentences), 1))
  for rule in ("block", "article"):
    trivial = realm_inputs.TrivialCandidates(store, rule)
    out = realm_inputs.select_candidates(
        ranked, trivial.block_keys, trivial.query_keys(queries),
        n - trivial.max_excluded)
    for row, (title, _), block in zip(out, sentences, found):
      assert block not in row
      same = [b for b in row if store.title(b) == title]
      assert bool(same) == (rule == "block" and len(
          store.document_blocks(store.doc_index(block))) > 1)
  unknown = dict(queries, source_doc_hash=np.full(len(sentences), 7,
                                                  np.int64))
  assert (realm_inputs.TrivialCandidates(store, "block").query_keys(unknown)
          == -1).all()
  with pytest.raises(ValueError, match="trivial_candidates='sentence'"):
    realm_inputs.TrivialCandidates(store, "sentence")


def test_source_blocks_match_a_set_count_per_block(store):
  # Whole sentences, halves, shuffled words and one-word queries: each
  # query's source block is the article block sharing the most distinct
  # bigrams with it (masks restored), the first such block on ties.
  tok = Tokenizer()
  rng = np.random.default_rng(0)
  sentences = []
  for title, text in ARTICLES.items():
    for x in (y for y in text.split(". ") if y):
      words = x.split()
      sentences += [(title, x), (title, " ".join(words[len(words) // 2:])),
                    (title, " ".join(rng.permutation(words))),
                    (title, words[-1])]
  queries = _sentence_queries(tok, sentences)
  trivial = realm_inputs.TrivialCandidates(store, "block")
  found = trivial.source_blocks(queries)

  def pairs(ids):
    ids = [int(t) for t in ids]
    return set(zip(ids, ids[1:])) if len(ids) > 1 else {(i,) for i in ids}

  for (title, sentence), block in zip(sentences, found):
    ids = pairs(tok.tokenize([sentence])[0])
    article = store.document_blocks(store.doc_index(block))
    shared = [len(ids & pairs(store.body_ids(b))) for b in article]
    assert store.title(block) == title
    assert block == article[int(np.argmax(shared))], (sentence, shared)
  # Each article's bigrams are read once and kept.
  np.testing.assert_array_equal(trivial.source_blocks(queries), found)
  assert trivial._article_bigrams.cache_info().misses == len(ARTICLES)  # pylint: disable=protected-access


def test_pretraining_batch_layout(store):
  tok = Tokenizer()
  rng = np.random.default_rng(0)
  b, lq, k = 2, 12, 3
  query_ids = np.zeros((b, lq), np.int32)
  lengths = [7, 10]
  for i, n in enumerate(lengths):
    query_ids[i, :n] = [tok.cls_id, *rng.integers(2000, 3000, n - 2),
                        tok.sep_id]
  queries = {
      "query_ids": query_ids,
      "query_mask": (query_ids > 0).astype(np.int32),
      "mlm_positions": np.array([[2, 0], [3, 4]], np.int32),
      "mlm_targets": np.array([[5, 0], [6, 7]], np.int32),
      "mlm_weights": np.array([[1, 0], [1, 1]], np.float32),
  }
  cands = np.array([[0, 3, 5], [1, 2, 4]])
  batch = realm_inputs.pretraining_batch(queries, cands, store, doc_len=16,
                                         reader_len=28)
  assert batch["candidate_ids"].shape == (b, k + 1, 16)
  assert batch["reader_ids"].shape == (b, k + 1, 28)
  for i in range(b):
    q = list(query_ids[i, :lengths[i]])
    # Null document first: [CLS] [SEP] [SEP] / [CLS] x [SEP] [SEP].
    assert list(batch["candidate_ids"][i, 0, :3]) == [tok.cls_id, tok.sep_id,
                                                      tok.sep_id]
    assert batch["candidate_mask"][i, 0].sum() == 3
    assert list(batch["reader_ids"][i, 0, :lengths[i] + 1]) == q + [tok.sep_id]
    assert batch["reader_mask"][i, 0].sum() == lengths[i] + 1
    for c in range(k):
      block = cands[i, c]
      retr = store.retriever_inputs([block], 16)
      np.testing.assert_array_equal(batch["candidate_ids"][i, c + 1],
                                    retr["token_ids"][0])
      body = list(store.body_ids(block))
      room = 28 - lengths[i] - 1
      want = q + body[:room] + [tok.sep_id]
      got = batch["reader_ids"][i, c + 1]
      assert list(got[:len(want)]) == want
      assert np.all(got[len(want):] == 0)
      seg = batch["reader_segment_ids"][i, c + 1]
      assert seg[:lengths[i]].sum() == 0
      assert seg[lengths[i]:len(want)].all() and not seg[len(want):].any()
    # Masked positions point at the same query tokens in every candidate.
    for c in range(k + 1):
      np.testing.assert_array_equal(
          batch["reader_ids"][i, c][queries["mlm_positions"][i]],
          query_ids[i][queries["mlm_positions"][i]])


def test_the_readers_length_is_the_queries_plus_the_blocks_unless_set():
  """Pre-training and reader preparation derive it alike (REALM: 96 +
  288 = 384); a length that leaves no room for a block is refused."""
  def length(configured):
    return realm_inputs.reader_length(configured, 96, 288, field="F.n",
                                      queries="/q")
  assert length(None) == 384
  assert length(200) == 200
  with pytest.raises(ValueError, match=r"^F.n=96 must exceed the "
                     r"query_length=96 of the query cache /q"):
    length(96)

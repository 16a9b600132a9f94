"""realm_jax.index.bm25 against an independent numpy BM25, and its results
as the QA eval's predictions (recall@k, gold recall)."""

import collections
import json
import logging
import math
import re

import numpy as np
import pytest

from realm_jax.core import progress
from realm_jax.data import qa, wikipedia
from realm_jax.eval import qa_eval, retrieval_eval
from realm_jax.index import bm25
from realm_jax.testing import corpus

TEXTS = [
    ("Lake Vostrel", "Lake Vostrel is a glacial lake in the Kessar Hills. It "
     "was first mapped in 1871 by the surveyor Ines Marlow. The lake drains "
     "into the river Opal."),
    ("River Opal", "The Opal is a river of the Kessar Hills. Its source is "
     "Lake Vostrel; it flows north to the sea. Rivers, lakes and hills."),
    ("Ines Marlow", "Ines Marlow was a surveyor. She mapped lakes, rivers and "
     "forts of the north between 1865 and 1890."),
    ("Tallin\u00e9 Fort", "Tallin\u00e9 Fort guards the northern pass. Its "
     "garrison left in 1903. The fort is on a hill."),
    ("Kessar Hills", "The Kessar Hills are a range of hills. The hills hold "
     "lakes and a fort; surveyors mapped them."),
]
QUERIES = ["who first mapped lake vostrel?", "Which river drains the lake?",
           "when did the garrison of Tallin\u00e9 fort leave", "hills",
           "the of and", "surveyors mapping lakes in 1871"]


@pytest.fixture(scope="module", name="store")
def _store(tmp_path_factory):
  return corpus.write_store(tmp_path_factory.mktemp("s") / "store",
                            [wikipedia.Document(t, x) for t, x in TEXTS], 24)


def test_analyzer_lowercases_drops_stop_words_and_stems():
  analyzer = bm25.Analyzer()
  assert analyzer(["The Rivers of Kessar, mapped in 1871 by O. Marlow"]) == [
      ["river", "kessar", "map", "1871", "o", "marlow"]]
  assert analyzer(["\uff2c\uff41\uff4b\uff45s"]) == [["lake"]]  # NFKC


def numpy_bm25(docs, query, k1=0.9, b=0.4):
  """Lucene's BM25, written out: idf ln(1 + (N - df + .5)/(df + .5)),
  tf / (tf + k1 (1 - b + b dl / avgdl)), summed over query terms."""
  n = len(docs)
  lengths = np.array([len(d) for d in docs], np.float64)
  avgdl = lengths.mean()
  df = collections.Counter(t for d in docs for t in set(d))
  scores = np.zeros(n)
  for term in query:
    if term not in df:
      continue
    idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
    tf = np.array([d.count(term) for d in docs], np.float64)
    scores += idf * tf / (tf + k1 * (1 - b + b * lengths / avgdl))
  return scores


def test_scores_and_ranks_match_numpy_bm25(store):
  assert len(store) > len(TEXTS)  # 24 wordpieces: several blocks an article
  index = bm25.BM25Index.from_store(store)
  docs = index.analyzer(bm25.block_texts(store))
  assert bm25.block_texts(store)[0].startswith("Lake Vostrel\nLake Vostrel")
  ids, scores = index.search(QUERIES, k=len(store) + 3)
  assert ids.shape == (len(QUERIES), len(store))
  for i, query in enumerate(QUERIES):
    want = numpy_bm25(docs, index.analyzer([query])[0])
    np.testing.assert_allclose(index.scores(query), want, rtol=1e-5,
                               atol=1e-6)
    # Ranks: score descending, ties by the smaller id.
    order = np.lexsort((np.arange(len(store)), -want))
    np.testing.assert_allclose(scores[i], want[order], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want[ids[i]], want[order], atol=1e-6)
    # The same block at every rank whose score no other block has (scores
    # equal up to float32 rounding may come in either order).
    unique = np.array([np.sum(np.abs(want - want[o]) <= 1e-4) == 1
                       for o in order])
    assert unique.sum() >= 3 or query in ("hills", "the of and")
    np.testing.assert_array_equal(ids[i][unique], order[unique])
  assert (scores[QUERIES.index("the of and")] == 0).all()
  assert ids[QUERIES.index("the of and")].tolist() == list(range(len(store)))
  top, _ = index.search(QUERIES[:1], k=2)
  assert store.title(int(top[0, 0])) == "Lake Vostrel"


def test_results_are_qa_eval_predictions_with_recall(store, tmp_path):
  index = bm25.BM25Index.from_store(store)
  examples = [qa.QAExample("who first mapped lake vostrel?",
                           ("Ines Marlow",)),
              qa.QAExample("when did the garrison of Tallin\u00e9 fort "
                           "leave", ("1903",)),
              qa.QAExample("what colour is the sea?", ("purple",))]
  ids, scores = index.search([e.question for e in examples], k=3)
  results = retrieval_eval.retrieval_results(examples, ids, scores, store)
  path = tmp_path / "predictions.jsonl"
  qa_eval.write_predictions(str(path), results)
  lines = [json.loads(x) for x in path.read_text().splitlines()]
  assert lines[0]["retrieved_ids"] == ids[0].tolist()
  assert lines[0]["score"] is None and lines[0]["prediction"] == ""
  assert lines[2]["retrieved_has_answer"] == [False] * 3
  want = [[qa.has_answer(store.text(int(b)), e.answers) for b in row]
          for row, e in zip(ids, examples)]
  assert [r.retrieved_has_answer for r in results] == want
  metrics = qa_eval.aggregate_metrics(results, recall_ks=(1, 3))
  assert metrics["recall@3"] == pytest.approx(
      np.mean([any(w) for w in want]))
  assert metrics["recall@3"] == pytest.approx(2 / 3)
  gold = [store.document_blocks(0), store.document_blocks(3),
          store.document_blocks(1)]
  recall = retrieval_eval.gold_recall(results, [np.array(g) for g in gold],
                                      (1, 3))
  want_gold = [np.isin(ids[i], list(g)) for i, g in enumerate(gold)]
  assert recall == {"gold_recall@1": np.mean([w[0] for w in want_gold]),
                    "gold_recall@3": np.mean([w.any() for w in want_gold])}
  assert recall["gold_recall@1"] >= 2 / 3


def test_indexing_logs_its_progress(store, monkeypatch, caplog):
  """Issue 58: analysing the corpus logs done/total, rate and ETA
  (`core.progress`, here every chunk of 2 texts), then the total time."""
  monkeypatch.setattr(progress, "_every_seconds", [1e-9])
  with caplog.at_level(logging.INFO):
    terms = bm25.Analyzer().corpus_terms(bm25.block_texts(store), chunk=2)
  n = len(store)
  assert terms == bm25.Analyzer()(bm25.block_texts(store))
  assert re.search(rf"BM25 indexing: 2/{n} texts \(\d+%\), [\d.]+ texts/s, "
                   r"ETA \S+", caplog.text), caplog.text
  assert re.search(rf"BM25 indexing: {n}/{n} texts in [\d.]+ s",
                   caplog.text), caplog.text
  caplog.clear()
  with caplog.at_level(logging.INFO):
    bm25.BM25Index.from_store(store)  # Indexing goes through it.
  assert re.search(rf"BM25 indexing: {n}/{n} texts in", caplog.text)


def test_one_string_no_terms_and_bad_k_are_refused():
  """A bare string would be searched character by character (7 rows for
  "capital"); texts without a term and k <= 0 get a sentence, not
  bm25s's or numpy's errors."""
  index = bm25.BM25Index(["The capital of France is Paris.",
                          "Rivers flow to the sea."])
  with pytest.raises(TypeError, match=r"BM25Index.search takes a list of "
                     r"queries, got one str \('capital'\); pass \[query\]"):
    index.search("capital", 2)
  with pytest.raises(TypeError, match=r"Query 2 of 2 is 'None'"):
    index.search(["capital", None], 2)
  for k, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError),
                   ("3", TypeError)):
    with pytest.raises(error, match="k"):
      index.search(["capital"], k)
  assert index.search(["capital"], 1)[0].tolist() == [[0]]
  with pytest.raises(ValueError, match="none of the 2 texts has a term"):
    bm25.BM25Index(["the a", "of ..."])
  with pytest.raises(TypeError, match="got one str"):
    bm25.BM25Index("some text")


def test_persisted_beside_the_store_and_loaded_equal(store, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  local = tmp_path / "store"
  shutil.copytree(store.path, local)
  local = block_store.BlockStore.open(local)
  built = bm25.for_store(local)
  directory = local.path + "/bm25"
  manifest = json.loads(open(directory + "/manifest.json").read())
  assert manifest["store_fingerprint"] == local.fingerprint
  assert manifest["num_rows"] == len(local)
  loaded = bm25.for_store(local)  # found, not rebuilt
  for query in QUERIES:
    np.testing.assert_array_equal(loaded.scores(query), built.scores(query))
  fresh = bm25.BM25Index.from_store(local)
  np.testing.assert_array_equal(loaded.search(QUERIES, 7)[0],
                                fresh.search(QUERIES, 7)[0])
  # Another store's index is refused, naming both fingerprints; nothing is
  # rebuilt.
  other = corpus.write_store(tmp_path / "other", [
      wikipedia.Document(t, x) for t, x in TEXTS[:2]], 24)
  before = sorted(p.name for p in (tmp_path / "store" / "bm25").iterdir())
  with pytest.raises(bm25.BM25StoreMismatchError) as e:
    bm25.for_store(other, directory)
  assert local.fingerprint in str(e.value)
  assert other.fingerprint in str(e.value)
  assert sorted(p.name for p in (tmp_path / "store" / "bm25").iterdir()
                ) == before
  with pytest.raises(FileNotFoundError):
    bm25.for_store(other, str(tmp_path / "none"), build=False)


def test_extended_when_blocks_are_added(tmp_path):
  docs = [wikipedia.Document(t, x) for t, x in TEXTS]
  base = corpus.write_store(tmp_path / "base", docs[:3], 24)
  union = corpus.write_store(tmp_path / "union", docs, 24)
  bm25.for_store(base)
  extended = bm25.extend(base, union)
  assert json.loads((tmp_path / "union" / "bm25" / "manifest.json")
                    .read_text())["store_fingerprint"] == union.fingerprint
  full = bm25.BM25Index.from_store(union)
  for query in QUERIES:
    np.testing.assert_allclose(extended.scores(query), full.scores(query),
                               rtol=1e-6, atol=1e-7)
  assert bm25.for_store(union).num_rows == len(union)
  with pytest.raises(ValueError, match="does not extend"):
    bm25.extend(union, base)


def test_the_index_extension_extends_the_base_stores_bm25(tmp_path):
  from realm_jax.index import extend  # pylint: disable=g-import-not-at-top
  docs = [wikipedia.Document(t, x) for t, x in TEXTS]
  base = corpus.write_store(tmp_path / "base", docs[:2], 24)
  union = corpus.write_store(tmp_path / "union", docs, 24)
  assert not extend.extend_bm25(base, union)  # the base has none
  assert not (tmp_path / "union" / "bm25").exists()
  bm25.for_store(base)
  assert extend.extend_bm25(base, union)
  np.testing.assert_allclose(
      bm25.for_store(union, build=False).scores(QUERIES[0]),
      bm25.BM25Index.from_store(union).scores(QUERIES[0]), rtol=1e-6)
  assert not extend.extend_bm25(base, union)  # already there


def _npy(array):
  import io  # pylint: disable=g-import-not-at-top
  out = io.BytesIO()
  np.save(out, array)
  return out.getvalue()


@pytest.mark.parametrize("name,damage", [
    pytest.param("terms.npy", lambda b: b[:len(b) // 2], id="terms-half"),
    pytest.param("terms.npy", lambda b: b[:-1], id="terms-short"),
    pytest.param("terms.npy", lambda b: b"\x80\x04garbage", id="terms-pickle"),
    pytest.param("terms.npy", lambda b: _npy(np.zeros((2, 2), np.int32)),
                 id="terms-2d"),
    pytest.param("offsets.npy", lambda b: b"", id="offsets-empty"),
    pytest.param("offsets.npy", lambda b: _npy(np.zeros(3, np.float32)),
                 id="offsets-float"),
    pytest.param("vocab.json", lambda b: b[:len(b) // 2], id="vocab-half"),
    pytest.param("vocab.json", lambda b: b"\xff\xfe garbage",
                 id="vocab-garbage"),
    pytest.param("vocab.json", lambda b: b'{"a": 1}', id="vocab-object"),
    pytest.param("manifest.json", lambda b: b[:len(b) // 2],
                 id="manifest-half"),
    pytest.param("manifest.json", lambda b: b"\xff\xfe garbage",
                 id="manifest-garbage"),
    pytest.param("manifest.json", lambda b: b"[1, 2]", id="manifest-list"),
    pytest.param("manifest.json",
                 lambda b: b.replace(b'"num_rows"', b'"rows"'),
                 id="manifest-no-num_rows"),
    pytest.param("manifest.json",
                 lambda b: b.replace(b'"k1": 0.9', b'"k1": "0.9"'),
                 id="manifest-k1-string"),
    pytest.param("manifest.json", lambda b: re.sub(
        rb'"vocab_size": \d+', b'"vocab_size": 1', b),
                 id="manifest-vocab_size"),
])
def test_a_damaged_index_names_its_directory_and_the_way_out(
    store, tmp_path, name, damage):
  """Issue 64, H9a/H9c: a truncated or garbage file of a persisted BM25
  index, or a manifest that is not JSON or misses a field, is one error
  naming the directory, the file, "delete it to rebuild" and the setting
  that names another directory; nothing is rebuilt or changed."""
  directory = tmp_path / "bm25"
  bm25.for_store(store, str(directory))
  path = directory / name
  path.write_bytes(damage(path.read_bytes()))
  before = {p.name: p.read_bytes() for p in directory.iterdir()}
  with pytest.raises(bm25.BM25IndexDamagedError) as e:
    bm25.for_store(store, str(directory))
  message = str(e.value)
  assert f"The BM25 index {directory} is damaged (" in message
  assert name in message and "Delete it to rebuild" in message
  assert "EvalConfig.bm25_dir" in message and "bm25_dir=" in message
  assert "allow_pickle" not in message
  assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_a_read_only_block_store_names_bm25_dir(store, tmp_path):
  """Issue 64, H14: BM25 for a store on a read-only filesystem (no
  `bm25_dir`) fails naming the store, the directory and `bm25_dir`, and
  with `bm25_dir` set it is built there."""
  import shutil  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  copy, ro = tmp_path / "store", tmp_path / "ro"
  shutil.copytree(store.path, copy, ignore=shutil.ignore_patterns("bm25"))
  ro.mkdir()
  mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(copy),
                            str(ro)], capture_output=True, check=False)
  if mounted.returncode:
    pytest.skip(f"cannot mount read-only here: {mounted.stderr!r}")
  ro_store = None
  try:
    ro_store = block_store.BlockStore.open(str(ro))
    with pytest.raises(PermissionError, match=(
        r"Cannot write the BM25 index of block store .*ro to .*ro/bm25 "
        r".*Point bm25_dir .*EvalConfig.bm25_dir.* at a writable")):
      bm25.for_store(ro_store)
    built = bm25.for_store(ro_store, str(tmp_path / "bm25"))
    assert built.num_rows == len(ro_store)
  finally:
    del ro_store  # (Its memory maps keep the mount busy until unmapped.)
    subprocess.run(["umount", "--lazy", str(ro)], check=True)

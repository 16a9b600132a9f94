"""BM25 over the blocks of a block store: the sparse baseline.

The library is `bm25s` (MIT, maintained, numpy only; in the `bench` extra),
with Lucene's scoring (`method="lucene"`, as Anserini / pyserini, whose
BM25 with k1 = 0.9, b = 0.4 is the usual open-QA baseline):

    score(q, d) = sum over query terms t in d of
        ln(1 + (N - df_t + 0.5) / (df_t + 0.5))
        * tf_td / (tf_td + k1 * (1 - b + b * |d| / avgdl))

(a query term counted once per occurrence in the query). A block is
indexed as its title and its text, the two parts the dense retriever reads
(`[CLS] title [SEP] text [SEP]`), and both sides are tokenised alike
(`tokenize`): Unicode NFKC, lower case, runs of word characters (`\\w+`,
so "1871" and "O" are tokens), Lucene's 33 English stop words removed,
then the Snowball English (Porter 2) stemmer (PyStemmer), close to
Anserini's default English analyzer (which stems with Porter 1).

Ranks break ties by block id (the smaller first), as the MIPS searchers
do. `BM25Index.search` returns (ids, scores) shaped like a searcher's, so
`retrieval_eval.retrieval_results` turns them into the QA eval's
predictions and recall@k.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Sequence

import numpy as np

from realm_jax.core import checks
from realm_jax.core import progress as progress_lib

_WORD = re.compile(r"\w+")
K1, B = 0.9, 0.4


def _libraries():
  try:
    import bm25s  # pylint: disable=g-import-not-at-top
    import Stemmer  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        f"BM25 needs bm25s and PyStemmer ({e}): pip install -e '.[bench]' "
        "-c constraints.txt") from e
  return bm25s, Stemmer


class Analyzer:
  """Text -> BM25 terms (see the module docstring)."""

  def __init__(self):
    bm25s, stemmer = _libraries()
    self._stop = frozenset(bm25s.stopwords.STOPWORDS_EN)
    self._stemmer = stemmer.Stemmer("english")

  def __call__(self, texts: Sequence[str]) -> list[list[str]]:
    out = []
    for text in texts:
      words = _WORD.findall(unicodedata.normalize("NFKC", text).lower())
      out.append(self._stemmer.stemWords(
          [w for w in words if w not in self._stop]))
    return out

  def corpus_terms(self, texts: Sequence[str], chunk: int = 1024
                   ) -> list[list[str]]:
    """`self(texts)` for a corpus, logged as "BM25 indexing" progress
    (`core.progress`), the clock read once per `chunk` texts."""
    out = []
    with progress_lib.Progress("BM25 indexing", len(texts),
                               unit="texts") as bar:
      for lo in range(0, len(texts), chunk):
        out += self(texts[lo:lo + chunk])
        bar.update(len(out) - bar.done)
    return out


def block_texts(store) -> list[str]:
  """Each block as BM25 indexes it: title, newline, text."""
  return [f"{store.title(b)}\n{store.text(b)}" for b in range(len(store))]


class BM25Index:
  """BM25 (Lucene scoring, `bm25s`) over a list of texts (row i = id i).

  Attributes:
    k1, b: the BM25 parameters.
    num_rows: texts indexed.
  """

  def __init__(self, texts: Sequence[str], *, k1: float = K1, b: float = B):
    bm25s, _ = _libraries()
    texts = checks.string_list(texts, "BM25Index", what="texts",
                               item="Text", hint="pass [text]")
    if not texts:
      raise ValueError("BM25Index needs at least one text.")
    self.k1, self.b, self.num_rows = k1, b, len(texts)
    self.analyzer = Analyzer()
    terms = self.analyzer.corpus_terms(texts)
    if not any(terms):
      raise ValueError(
          f"BM25Index: none of the {len(texts)} texts has a term to index "
          f"(after lower-casing and removing stop words and non-word "
          f"characters; the first: {texts[0][:60]!r}); give texts with "
          "words.")
    self._bm25 = bm25s.BM25(k1=k1, b=b, method="lucene")
    self._bm25.index(terms, show_progress=False)

  @classmethod
  def from_store(cls, store, **kwargs) -> BM25Index:
    return cls(block_texts(store), **kwargs)

  def scores(self, query: str) -> np.ndarray:
    """float32 [num_rows]: every row's score for one query."""
    terms = self.analyzer([query])[0]
    if not terms:
      return np.zeros(self.num_rows, np.float32)
    return np.asarray(self._bm25.get_scores(terms), np.float32)

  def search(self, queries: Sequence[str], k: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows of each query, best first, ties by the smaller id.

    Returns:
      (ids int64 [Q, min(k, num_rows)], scores float32 [Q, same]).

    Raises:
      TypeError: `queries` is one string (each character would be a
        query) or holds a non-string; `k` is not an int.
      ValueError: `k` < 1.
    """
    queries = checks.string_list(queries, "BM25Index.search",
                                 what="queries", item="Query",
                                 hint="pass [query]")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
      raise TypeError(f"BM25Index.search: k must be an int, got {k!r} "
                      f"({type(k).__name__}).")
    if k < 1:
      raise ValueError(f"BM25Index.search: k={k}; ask for at least one "
                       "row (k >= 1).")
    k = min(int(k), self.num_rows)
    ids = np.zeros([len(queries), k], np.int64)
    out = np.zeros([len(queries), k], np.float32)
    for i, query in enumerate(queries):
      scores = self.scores(query)
      # Candidates: every row scoring at least the k-th best score.
      kth = np.partition(scores, self.num_rows - k)[self.num_rows - k]
      candidates = np.flatnonzero(scores >= kth)
      order = np.lexsort((candidates, -scores[candidates]))[:k]
      ids[i], out[i] = candidates[order], scores[candidates[order]]
    return ids, out

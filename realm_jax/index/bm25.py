"""BM25 over the blocks of a block store: the sparse ranker.

The library is `bm25s` (MIT, maintained, numpy + scipy only; a product
dependency), with Lucene's scoring (`method="lucene"`, as Anserini /
pyserini, whose BM25 with k1 = 0.9, b = 0.4 is the usual open-QA baseline):

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

The index of a block store is built once and persisted beside it
(`for_store`: `<store>/bm25/`, or `<cache>/bm25-<fingerprint>` for a
remote store): its analysed terms (a vocabulary and one row of term ids
per block, plain .npy and JSON, never pickles) under a manifest naming the
store's fingerprint. An index of another store is refused
(`BM25StoreMismatchError`, naming both fingerprints), never rebuilt
silently. When blocks are added (a store that extends another,
`block_store.check_extends`), `extend` analyses only the new blocks.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import unicodedata
from typing import Sequence

import numpy as np

from realm_jax.core import checks
from realm_jax.core import io_utils
from realm_jax.core import outputs
from realm_jax.core import progress as progress_lib

_WORD = re.compile(r"\w+")
K1, B = 0.9, 0.4
FORMAT_VERSION = 1
# What the analyzer does; an index analysed otherwise is refused.
ANALYZER = "nfkc-lower-word-lucene33stop-snowball_english"
DIR_NAME = "bm25"


class BM25StoreMismatchError(ValueError):
  """A persisted BM25 index belongs to another block store."""


def _libraries():
  try:
    import bm25s  # pylint: disable=g-import-not-at-top
    import Stemmer  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        f"BM25 needs bm25s and PyStemmer ({e}), dependencies of realm_jax: "
        "pip install -e . -c constraints.txt") from e
  # bm25s logs every index build at DEBUG ("Building index from IDs").
  logging.getLogger("bm25s").setLevel(logging.WARNING)
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


def block_texts(store, start: int = 0) -> list[str]:
  """Each block from `start` on as BM25 indexes it: title, newline, text."""
  return [f"{store.title(b)}\n{store.text(b)}"
          for b in range(start, len(store))]


def _encode(docs: Sequence[Sequence[str]], vocab: dict[str, int]
            ) -> tuple[np.ndarray, np.ndarray]:
  """Terms -> (flat int32 term ids, int64 row offsets), growing `vocab`."""
  flat, offsets = [], [0]
  for doc in docs:
    flat.extend(vocab.setdefault(t, len(vocab)) for t in doc)
    offsets.append(len(flat))
  return np.asarray(flat, np.int32), np.asarray(offsets, np.int64)


class BM25Index:
  """BM25 (Lucene scoring, `bm25s`) over a list of texts (row i = id i).

  Attributes:
    k1, b: the BM25 parameters.
    num_rows: texts indexed.
    fingerprint: the block store's (None: texts given directly).
  """

  def __init__(self, texts: Sequence[str] | None = None, *, k1: float = K1,
               b: float = B, terms: tuple[list[str], np.ndarray,
                                          np.ndarray] | None = None,
               fingerprint: str | None = None):
    """From `texts`, or from analysed `terms` = (vocabulary, flat term ids,
    row offsets) as `save` writes them."""
    bm25s, _ = _libraries()
    self.analyzer = Analyzer()
    if terms is None:
      texts = checks.string_list(texts, "BM25Index", what="texts",
                                 item="Text", hint="pass [text]")
      if not texts:
        raise ValueError("BM25Index needs at least one text.")
      analysed = self.analyzer.corpus_terms(texts)
      if not any(analysed):
        raise ValueError(
            f"BM25Index: none of the {len(texts)} texts has a term to index "
            f"(after lower-casing and removing stop words and non-word "
            f"characters; the first: {texts[0][:60]!r}); give texts with "
            "words.")
      vocab: dict[str, int] = {}
      flat, offsets = _encode(analysed, vocab)
      terms = (list(vocab), flat, offsets)
    self.vocab, self.flat, self.offsets = terms
    self.k1, self.b, self.num_rows = k1, b, len(self.offsets) - 1
    if self.num_rows < 1:
      raise ValueError("BM25Index needs at least one text.")
    self.fingerprint = fingerprint
    self._bm25 = bm25s.BM25(k1=k1, b=b, method="lucene")
    # The empty term (bm25s' placeholder for an empty row) is one past the
    # vocabulary, as bm25s adds it when indexing from words.
    vocab_ids = {t: i for i, t in enumerate(self.vocab)}
    vocab_ids.setdefault("", len(vocab_ids))
    rows = np.split(self.flat, self.offsets[1:-1])
    self._bm25.index(([r.tolist() for r in rows], vocab_ids),
                     create_empty_token=False, show_progress=False)

  @classmethod
  def from_store(cls, store, **kwargs) -> BM25Index:
    return cls(block_texts(store), fingerprint=store.fingerprint, **kwargs)

  def scores(self, query: str) -> np.ndarray:
    """float32 [num_rows]: every row's score for one query."""
    terms = [t for t in self.analyzer([query])[0]
             if t in self._bm25.vocab_dict]
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
    k = min(checks.positive_count(k, "BM25Index.search: k",
                                  "how many rows to return per query"),
            self.num_rows)
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

  # -- Persistence.

  def save(self, directory: str, setting: str = "bm25_dir") -> None:
    """Writes the analysed terms and a manifest to local `directory`, whole
    or not at all. An existing BM25 index there is replaced; any other
    non-empty directory is refused (`outputs.OwnershipError`, naming
    `setting`)."""
    with outputs.output_dir(directory, kind=outputs.BM25_INDEX,
                            setting=setting, overwrite=True) as tmp:
      io_utils.save_npy(os.path.join(tmp, "terms.npy"), self.flat)
      io_utils.save_npy(os.path.join(tmp, "offsets.npy"), self.offsets)
      io_utils.write_json(os.path.join(tmp, "vocab.json"), self.vocab)
      io_utils.write_json(os.path.join(tmp, "manifest.json"), {
          "format_version": FORMAT_VERSION, "analyzer": ANALYZER,
          "store_fingerprint": self.fingerprint, "num_rows": self.num_rows,
          "k1": self.k1, "b": self.b, "vocab_size": len(self.vocab),
          "num_terms": int(len(self.flat))})

  @classmethod
  def load(cls, directory: str, store=None) -> BM25Index:
    """The index `save` wrote; with `store`, refused unless it is that
    store's (`BM25StoreMismatchError`, naming both fingerprints).

    Raises:
      BM25IndexDamagedError: a file of `directory` is missing, truncated,
        not what `save` writes, or disagrees with the manifest (the error
        names the directory, the file and the way out: delete it to
        rebuild, or another `bm25_dir`).
    """
    manifest = read_manifest(directory)
    if store is not None:
      check_store(manifest, store, directory)
    flat = _load_ids(directory, "terms.npy", np.int32)
    offsets = _load_ids(directory, "offsets.npy", np.int64)
    vocab = _load_vocab(directory)
    problem = (
        f"offsets.npy has {len(offsets)} entries for manifest.json's "
        f"{manifest['num_rows']} rows (+1)"
        if len(offsets) != manifest["num_rows"] + 1 else
        "offsets.npy does not start at 0 and rise to the length of "
        f"terms.npy ({len(flat)})" if offsets[0] != 0 or offsets[-1] != len(
            flat) or np.any(np.diff(offsets) < 0) else
        f"vocab.json has {len(vocab)} terms, manifest.json says "
        f"{manifest['vocab_size']}"
        if len(vocab) != manifest["vocab_size"] else
        f"terms.npy holds term ids outside vocab.json's 0-{len(vocab) - 1}"
        if len(flat) and not 0 <= flat.min() <= flat.max() < len(vocab)
        else None)
    if problem:
      raise BM25IndexDamagedError(_damaged(directory, problem))
    return cls(terms=(vocab, flat, offsets), k1=manifest["k1"],
               b=manifest["b"], fingerprint=manifest["store_fingerprint"])


class BM25IndexDamagedError(ValueError):
  """A persisted BM25 index whose files are missing or damaged."""


def _damaged(directory: str, problem: str) -> str:
  """The message of a damaged BM25 index: which, what, the way out."""
  return (f"The BM25 index {directory} is damaged ({problem}). Delete it to "
          f"rebuild (rm -r {directory}: the next run that ranks with BM25 "
          "builds it again from the block store), or point bm25_dir at "
          "another directory (EvalConfig.bm25_dir, the CLI's "
          "--gin.qa_eval.EvalConfig.bm25_dir; realm_jax.load(..., "
          "bm25_dir=)).")


def _load_ids(directory: str, name: str, dtype) -> np.ndarray:
  """`<directory>/<name>`, a 1-D integer .npy as `save` writes it, as
  `dtype`; BM25IndexDamagedError for anything else."""
  path = os.path.join(directory, name)
  try:
    with open(path, "rb") as f:
      if f.read(6) != b"\x93NUMPY":  # (numpy would offer to unpickle it.)
        raise ValueError("it is not a .npy file")
      f.seek(0)
      array = np.load(f, allow_pickle=False)
  except (OSError, ValueError, EOFError, MemoryError) as e:
    raise BM25IndexDamagedError(_damaged(
        directory, f"{name} does not read as a .npy array: {e}")) from e
  if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
    raise BM25IndexDamagedError(_damaged(
        directory, f"{name} is a {array.dtype} array of shape "
        f"{array.shape}, not a 1-D integer one"))
  return array.astype(dtype, copy=False)


def _load_vocab(directory: str) -> list[str]:
  """`<directory>/vocab.json`, a JSON list of distinct strings;
  BM25IndexDamagedError for anything else."""
  path = os.path.join(directory, "vocab.json")
  try:
    with open(path, "rb") as f:
      vocab = json.loads(f.read().decode("utf-8"))  # Written by `save`.
  except (OSError, ValueError) as e:  # (JSON and UTF-8 errors are too.)
    raise BM25IndexDamagedError(_damaged(
        directory, f"vocab.json does not read as JSON: {e}")) from e
  if not isinstance(vocab, list) or not all(
      isinstance(t, str) for t in vocab) or len(set(vocab)) != len(vocab):
    raise BM25IndexDamagedError(_damaged(
        directory, "vocab.json is not a list of distinct terms"))
  return vocab


def _check_manifest_types(manifest: dict) -> None:
  """TypeError unless the manifest's fields have the types `save` writes."""
  counts = ("num_rows", "vocab_size")
  if not isinstance(manifest, dict) or any(
      not isinstance(manifest[k], int) or isinstance(manifest[k], bool)
      or manifest[k] < 0 for k in counts) or any(
          not isinstance(manifest[k], (int, float))
          or isinstance(manifest[k], bool) for k in ("k1", "b")) or (
              not isinstance(manifest["analyzer"], str)) or not isinstance(
                  manifest["store_fingerprint"], (str, type(None))):
    raise TypeError(
        "num_rows and vocab_size must be counts, k1 and b numbers, "
        "analyzer a string and store_fingerprint a string or null")
  if not (0 <= manifest["k1"] < float("inf") and 0 <= manifest["b"] <= 1):
    raise ValueError(f"k1={manifest['k1']} and b={manifest['b']} must be "
                     "finite, k1 >= 0 and 0 <= b <= 1")


def read_manifest(directory: str) -> dict:
  """The manifest of the BM25 index in `directory`, checked.

  Raises:
    FileNotFoundError: no index there.
    BM25IndexDamagedError: the manifest is not JSON, misses a field, has
      a field of the wrong type or another format version.
  """
  try:
    return io_utils.read_manifest(
        directory, what="BM25 index", format_version=FORMAT_VERSION,
        build="build it with realm_jax.index.bm25.for_store(store)",
        fields=("analyzer", "store_fingerprint", "num_rows", "k1", "b",
                "vocab_size"), check=_check_manifest_types)
  except FileNotFoundError:
    raise
  except (OSError, ValueError, TypeError, KeyError) as e:
    # io_utils' error carries the cause (not UTF-8, not JSON, a field
    # missing or of another type); a format version has none.
    cause = e.__cause__
    raise BM25IndexDamagedError(_damaged(directory, (
        f"manifest.json: {type(cause).__name__}: {cause}" if cause
        else f"manifest.json: {type(e).__name__}: {e}"))) from e


def check_store(manifest: dict, store, directory: str) -> None:
  """BM25StoreMismatchError unless `manifest` is of `store`'s blocks."""
  if (manifest["store_fingerprint"] != store.fingerprint or
      manifest["num_rows"] != len(store)):
    raise BM25StoreMismatchError(
        f"The BM25 index {directory} was built for the block store with "
        f"fingerprint {manifest['store_fingerprint']} "
        f"({manifest['num_rows']} blocks), not for {store.path} (fingerprint"
        f" {store.fingerprint}, {len(store)} blocks). Nothing is rebuilt "
        "silently: delete that directory to index this store, or give the "
        "BM25 index of this store.")
  if manifest["analyzer"] != ANALYZER:
    raise BM25StoreMismatchError(
        f"The BM25 index {directory} was analysed by "
        f"{manifest['analyzer']!r}, not {ANALYZER!r}; delete it and build "
        "it again.")


def default_dir(store) -> str:
  """Where a store's BM25 index lives: `<store>/bm25` beside its blocks, or
  for a remote store `<cache>/bm25-<fingerprint>` on the local disk."""
  if io_utils.is_local(store.path):
    return os.path.join(os.fspath(store.path), DIR_NAME)
  key = "".join(c for c in store.fingerprint if c.isalnum())[:32]
  return os.path.join(io_utils.cache_root(), f"bm25-{key}")


SETTING = ("bm25_dir (--gin.qa_eval.EvalConfig.bm25_dir; "
           "realm_jax.load(..., bm25_dir=))")


def for_store(store, directory: str | None = None, *, build: bool = True,
              setting: str = SETTING) -> BM25Index:
  """The BM25 index of `store`, built once and persisted in `directory`
  (default `default_dir(store)`), loaded from there after.

  A `directory` that holds anything but a BM25 index is never written
  (`outputs.check`, before the blocks are analysed).

  Raises:
    BM25StoreMismatchError: `directory` holds the index of another store.
    FileNotFoundError: none there and not `build`.
    outputs.OwnershipError: `directory` is a non-empty directory no BM25
      build wrote (a workdir, the user's files), or not a directory.
    io_utils.LinkRefusedError: `directory` is a symbolic link.
    PermissionError: `directory` cannot be written (naming `setting`).
  """
  default = directory is None
  directory = directory or default_dir(store)
  where = (f"{setting} (unset: beside the block store)" if default
           else setting)
  # Read or written, it must be a BM25 index (or nothing yet): a block
  # store's manifest is not one, and a workdir is never built over.
  if outputs.check(directory, outputs.BM25_INDEX, where) or not build:
    return BM25Index.load(directory, store)
  index = BM25Index.from_store(store)
  try:
    index.save(directory, where)
  except OSError as e:
    if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
      raise
    raise PermissionError(
        f"Cannot write the BM25 index of block store {store.path} to "
        f"{directory} ({e}); it is built once and kept. Point {setting} at "
        "a writable directory.") from e
  return index


def extend(base_store, union_store, *, base_dir: str | None = None,
           directory: str | None = None) -> BM25Index:
  """The BM25 index of `union_store`, which extends `base_store`
  (`block_store.check_extends`), from the base's persisted index: only the
  new blocks are analysed. Persisted in `directory` (default
  `default_dir(union_store)`).
  """
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  block_store.check_extends(base_store, union_store)
  base = for_store(base_store, base_dir, build=False)
  vocab = {t: i for i, t in enumerate(base.vocab)}
  flat, offsets = _encode(base.analyzer.corpus_terms(block_texts(
      union_store, len(base_store))), vocab)
  index = BM25Index(
      terms=(list(vocab), np.concatenate([base.flat, flat]),
             np.concatenate([base.offsets, offsets[1:] + base.offsets[-1]])),
      k1=base.k1, b=base.b, fingerprint=union_store.fingerprint)
  index.save(directory or default_dir(union_store), "the union store's "
             "BM25 directory")
  return index

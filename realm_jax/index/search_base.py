"""The `Searcher` interface, input checks and the on-disk format.

Implementations (`exact_search`, `scann_search`, `sharded_search`) register
themselves in `SEARCHERS` by kind; `realm_jax.index.searchers` is the public
entry point (`build_searcher`, `load_searcher`).
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import tempfile
from typing import Any, ClassVar, Mapping, Type, TypeVar

from absl import logging
import numpy as np

from realm_jax.core import io_utils
from realm_jax.index.search_configs import SearcherConfig

FORMAT_VERSION = 1
METADATA_FILE = "searcher.json"

_SearcherT = TypeVar("_SearcherT", bound="Searcher")
# kind -> Searcher class, filled by `register` as the implementations load.
SEARCHERS: dict[str, Type["Searcher"]] = {}

# -----------------------------------------------------------------------------
# Input checks shared by every searcher.
# -----------------------------------------------------------------------------

# Rows checked for NaN/inf at a time, so the check of a 13M-row corpus needs
# a few MB of scratch memory rather than a boolean copy of the whole matrix.
_FINITE_CHECK_ROWS = 1 << 16


def _first_non_finite_row(array: np.ndarray) -> int | None:
  for start in range(0, array.shape[0], _FINITE_CHECK_ROWS):
    chunk = np.asarray(array[start:start + _FINITE_CHECK_ROWS])
    bad = np.flatnonzero(~np.isfinite(chunk).all(axis=1))
    if bad.size:
      return start + int(bad[0])
  return None


def check_embeddings(embeddings: Any) -> np.ndarray:
  """Checks a corpus embedding matrix and returns it as a numpy array.

  Args:
    embeddings: float32 array [num_rows, dim], row i = block i. A
      `np.memmap` stays memory-mapped.

  Returns:
    `embeddings` as a numpy array (not copied when it already was one).

  Raises:
    ValueError: wrong type, dtype or rank, an empty corpus or dimension, or a
      row holding NaN or inf.
  """
  if not isinstance(embeddings, np.ndarray):
    embeddings = np.asarray(embeddings)
  if embeddings.ndim != 2:
    raise ValueError(
        f"embeddings must be a 2-D array [num_rows, dim], got shape "
        f"{embeddings.shape}; reshape it (one row per block).")
  if embeddings.dtype != np.float32:
    raise ValueError(
        f"embeddings must be float32, got {embeddings.dtype}; convert with "
        "embeddings.astype(np.float32).")
  if embeddings.shape[0] == 0:
    raise ValueError(
        "embeddings is empty (0 rows): there is nothing to search; embed the "
        "corpus first.")
  if embeddings.shape[1] == 0:
    raise ValueError("embeddings has dim 0; each row needs at least one value.")
  bad = _first_non_finite_row(embeddings)
  if bad is not None:
    raise ValueError(
        f"embeddings row {bad} holds NaN or inf (row {bad} = block {bad}); "
        "fix or re-embed that block before building an index.")
  return embeddings


def check_queries(queries: Any, dim: int) -> np.ndarray:
  if not isinstance(queries, np.ndarray):
    queries = np.asarray(queries)
  if queries.ndim != 2:
    hint = (" (one query: use queries[None, :])" if queries.ndim == 1 else "")
    raise ValueError(
        f"queries must be a 2-D array [num_queries, dim], got shape "
        f"{queries.shape}{hint}.")
  if queries.dtype != np.float32:
    raise ValueError(
        f"queries must be float32, got {queries.dtype}; convert with "
        "queries.astype(np.float32).")
  if queries.shape[1] != dim:
    raise ValueError(
        f"queries have dim {queries.shape[1]} but the index holds dim-{dim} "
        "embeddings; embed the queries with the retriever that embedded the "
        "corpus.")
  bad = _first_non_finite_row(queries)
  if bad is not None:
    raise ValueError(f"query row {bad} holds NaN or inf; fix that query.")
  return np.ascontiguousarray(queries)


def check_k(k: Any, num_rows: int) -> int:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
    raise ValueError(f"k must be an int, got {k!r}.")
  if not 1 <= k <= num_rows:
    raise ValueError(
        f"k={k} is out of range: the index holds {num_rows} rows, so k must "
        f"be in [1, {num_rows}]; ask for fewer neighbours or index more "
        "blocks.")
  return int(k)


def sort_top_k(ids: np.ndarray, scores: np.ndarray,
                k: int) -> tuple[np.ndarray, np.ndarray]:
  """Best k columns of every row: score descending, then id ascending."""
  # Invalid slots (id -1) carry score -inf; pushing their sort key past every
  # real id keeps them last among equal (-inf) scores.
  id_key = np.where(ids < 0, np.iinfo(np.int64).max, ids)
  order = np.lexsort((id_key, -scores), axis=-1)[:, :k]
  return (np.take_along_axis(ids, order, axis=1),
          np.take_along_axis(scores, order, axis=1))


# -----------------------------------------------------------------------------
# The interface.
# -----------------------------------------------------------------------------


class Searcher(abc.ABC):
  """Top-k maximum inner product search over a fixed [num_rows, dim] corpus.

  Attributes:
    config: the searcher's frozen config.
    num_rows: rows N of the corpus (ids are 0..N-1).
    dim: embedding dimension D.
  """

  kind: ClassVar[str]
  config_class: ClassVar[Type[SearcherConfig]]

  def __init__(self, config: SearcherConfig, num_rows: int, dim: int):
    self.config = config
    self.num_rows = int(num_rows)
    self.dim = int(dim)

  @classmethod
  @abc.abstractmethod
  def build(cls: Type[_SearcherT], embeddings: np.ndarray,
            config: Any = None) -> _SearcherT:
    """Indexes `embeddings` float32 [N, D] (row i = block i)."""

  def search_batched(self, queries: np.ndarray,
                     k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows by inner product for every query.

    Args:
      queries: float32 [Q, D].
      k: neighbours per query, 1 <= k <= num_rows.

    Returns:
      (ids int64 [Q, k], scores float32 [Q, k]), best first.

    Raises:
      ValueError: wrong dtype, rank or dim, NaN/inf queries, or k out of
        range.
    """
    queries = check_queries(queries, self.dim)
    k = check_k(k, self.num_rows)
    if queries.shape[0] == 0:
      return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    ids, scores = self._search(queries, k)
    return ids.astype(np.int64, copy=False), scores.astype(np.float32,
                                                           copy=False)

  @abc.abstractmethod
  def _search(self, queries: np.ndarray,
              k: int) -> tuple[np.ndarray, np.ndarray]:
    """search_batched on checked inputs (Q >= 1)."""

  @abc.abstractmethod
  def _write(self, directory: str) -> dict[str, Any]:
    """Writes the data into an existing empty directory; returns extra
    metadata for searcher.json."""

  @classmethod
  @abc.abstractmethod
  def _read(cls: Type[_SearcherT], directory: str,
            metadata: Mapping[str, Any]) -> _SearcherT:
    """Opens what `_write` wrote."""

  def save(self, directory: str) -> None:
    """Writes the searcher to `directory`, atomically.

    Everything goes to a temporary sibling directory that is renamed to
    `directory` once complete, so readers never see a partial index; an
    existing `directory` is replaced.

    Args:
      directory: destination path on a local disk.
    """
    require_local(directory)
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(
        prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)
    try:
      extra = self._write(tmp_dir)
      metadata = {
          "format_version": FORMAT_VERSION,
          "kind": self.kind,
          "config": self.config.to_dict(),
          "num_rows": self.num_rows,
          "dim": self.dim,
          **extra,
      }
      with open(os.path.join(tmp_dir, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=1)
      io_utils.replace_local_dir(tmp_dir, directory)
    except BaseException:
      shutil.rmtree(tmp_dir, ignore_errors=True)
      raise
    logging.info("saved %s searcher (%d x %d) to %s", self.kind,
                 self.num_rows, self.dim, directory)

  @classmethod
  def load(cls: Type[_SearcherT], directory: str) -> _SearcherT:
    """Opens a searcher written by `save`.

    Args:
      directory: a directory written by `save` of this class.

    Returns:
      The searcher.

    Raises:
      ValueError: not a searcher directory, or one of another kind.
    """
    metadata = read_metadata(directory)
    if metadata["kind"] != cls.kind:
      raise ValueError(
          f"{directory} holds a searcher of kind {metadata['kind']!r}, not "
          f"{cls.kind!r}; open it with load_searcher().")
    searcher = cls._read(directory, metadata)
    if (searcher.num_rows, searcher.dim) != (metadata["num_rows"],
                                             metadata["dim"]):
      raise ValueError(
          f"{directory}: the data holds {searcher.num_rows} x {searcher.dim} "
          f"but {METADATA_FILE} says {metadata['num_rows']} x "
          f"{metadata['dim']}; the directory is corrupt, rebuild it.")
    return searcher

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(num_rows={self.num_rows}, dim={self.dim},"
            f" config={self.config})")


def require_local(directory: str) -> None:
  """Searchers are local files (ScaNN serializes to them, data is mapped)."""
  if not io_utils.is_local(directory):
    raise ValueError(
        f"{directory}: searchers are saved to and loaded from local "
        "directories; for a gs:// index use realm_jax.index.publish "
        "(publish_index stages it locally and uploads, load_index copies it "
        "to a local cache).")


def read_metadata(directory: str) -> dict[str, Any]:
  """Reads and checks `searcher.json` of a saved searcher.

  Args:
    directory: a directory written by `Searcher.save`.

  Returns:
    The parsed metadata.

  Raises:
    ValueError: the file is missing, unreadable or of another format.
  """
  require_local(directory)
  path = os.path.join(directory, METADATA_FILE)
  if not os.path.isfile(path):
    raise ValueError(
        f"{directory} is not a saved searcher: {METADATA_FILE} is missing; "
        "write one with Searcher.save().")
  try:
    with open(path) as f:
      metadata = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {path}: {e}; rebuild the index.") from e
  missing = [key for key in ("format_version", "kind", "config", "num_rows",
                             "dim") if key not in metadata]
  if missing:
    raise ValueError(f"{path} lacks {missing}; rebuild the index.")
  if metadata["format_version"] != FORMAT_VERSION:
    raise ValueError(
        f"{path} has format_version {metadata['format_version']}, this code "
        f"reads {FORMAT_VERSION}; rebuild the index with this version.")
  if metadata["kind"] not in _searcher_classes():
    raise ValueError(
        f"{path}: unknown searcher kind {metadata['kind']!r}; known kinds are "
        f"{sorted(_searcher_classes())}.")
  return metadata




def register(cls: Type[_SearcherT]) -> Type[_SearcherT]:
  """Class decorator: makes `cls` loadable by its `kind`."""
  SEARCHERS[cls.kind] = cls
  return cls


def _searcher_classes() -> dict[str, Type[Searcher]]:
  # The implementations register on import; importing them here (not at the
  # top, they import this module) makes every kind known to a reader.
  from realm_jax.index import exact_search, scann_search, sharded_search  # pylint: disable=g-import-not-at-top,unused-import
  return SEARCHERS


def load_searcher(directory: str) -> Searcher:
  """Opens any searcher written by `Searcher.save`.

  Args:
    directory: the saved directory (it holds searcher.json).

  Returns:
    An ExactSearcher, ScannSearcher or ShardedSearcher.

  Raises:
    ValueError: not a saved searcher, or an unreadable one.
  """
  metadata = read_metadata(directory)
  return _searcher_classes()[metadata["kind"]].load(directory)

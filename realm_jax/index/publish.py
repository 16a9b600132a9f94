"""Atomic publication of MIPS indices and the trainer-side index watcher.

Layout under an index root (usually `<workdir>/index`):

  <step>/manifest.json     step, rows, dim, dtype, corpus fingerprint,
                           parameter checksum, file checksums, searcher
                           config, build time
  <step>/embeddings.npy    [rows, dim]; row i = block i of the block store
  <step>/searcher/         the serialized searcher
  LATEST                   the step of the newest complete index

Publication writes everything to `.tmp-<step>-<pid>/`, verifies it, renames
it to `<step>/` and only then replaces LATEST (write + rename), so a reader
never sees a partial index; the K newest indices are kept. Readers verify
the manifest against what they expect (fingerprint, rows, dim) and the file
checksums, and refuse anything else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from typing import Any, Callable

from absl import logging
import numpy as np

LATEST = "LATEST"
MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.npy"
SEARCHER_DIR = "searcher"
_TMP_PREFIX = ".tmp-"


class IndexRejectedError(ValueError):
  """An index that must not be used: partial, corrupt or mismatched."""


def params_checksum(tree: Any) -> str:
  """sha256 over a parameter tree's leaves (paths, dtypes, shapes, bytes)."""
  import jax  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(
      kv[0])):
    array = np.asarray(leaf)
    h.update(jax.tree_util.keystr(path).encode())
    h.update(f"{array.dtype}{array.shape}".encode())
    h.update(np.ascontiguousarray(array).tobytes())
  return h.hexdigest()


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def _file_checksums(directory: str) -> dict[str, dict[str, Any]]:
  out = {}
  for root, _, files in os.walk(directory):
    for name in sorted(files):
      path = os.path.join(root, name)
      rel = os.path.relpath(path, directory)
      if rel == MANIFEST:
        continue
      out[rel] = {"sha256": _sha256(path), "bytes": os.path.getsize(path)}
  return out


def step_dir(index_root: str, step: int) -> str:
  return os.path.join(index_root, str(int(step)))


def read_latest(index_root: str) -> int | None:
  """The step LATEST points at, or None if nothing is published yet."""
  try:
    with open(os.path.join(index_root, LATEST)) as f:
      return int(f.read().strip())
  except FileNotFoundError:
    return None
  except ValueError as e:
    raise IndexRejectedError(
        f"{os.path.join(index_root, LATEST)} is not a step number: {e}") from e


def published_steps(index_root: str) -> list[int]:
  if not os.path.isdir(index_root):
    return []
  return sorted(int(n) for n in os.listdir(index_root) if n.isdigit())


def _write_latest(index_root: str, step: int) -> None:
  tmp = os.path.join(index_root, f"{_TMP_PREFIX}{LATEST}-{os.getpid()}")
  with open(tmp, "w") as f:
    f.write(f"{int(step)}\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(index_root, LATEST))


def clean_stale_temporaries(index_root: str) -> list[str]:
  """Removes leftovers of a builder that died mid-publication."""
  removed = []
  if os.path.isdir(index_root):
    for name in os.listdir(index_root):
      if name.startswith(_TMP_PREFIX):
        path = os.path.join(index_root, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        removed.append(name)
  return removed


@dataclasses.dataclass(frozen=True)
class Expectation:
  """What a reader requires of an index (None = don't check)."""
  corpus_fingerprint: str | None = None
  rows: int | None = None
  dim: int | None = None


def verify_index(directory: str, expect: Expectation = Expectation(), *,
                 checksums: bool = True) -> dict[str, Any]:
  """Checks a published index directory; returns its manifest.

  Raises:
    IndexRejectedError: naming the directory and what is wrong.
  """
  manifest_path = os.path.join(directory, MANIFEST)
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except FileNotFoundError as e:
    raise IndexRejectedError(f"{directory}: no {MANIFEST} (partial index?)"
                             ) from e
  except json.JSONDecodeError as e:
    raise IndexRejectedError(f"{manifest_path} is corrupt: {e}") from e
  for key, want in (("corpus_fingerprint", expect.corpus_fingerprint),
                    ("rows", expect.rows), ("dim", expect.dim)):
    if want is not None and manifest.get(key) != want:
      raise IndexRejectedError(
          f"{directory}: {key} is {manifest.get(key)!r} but the reader "
          f"expects {want!r}; the index was built for another corpus or "
          "model. Rebuild it against this block store.")
  if checksums:
    files = manifest.get("files", {})
    actual = _file_checksums(directory)
    if set(files) != set(actual):
      raise IndexRejectedError(
          f"{directory}: files {sorted(set(files) ^ set(actual))} differ "
          "from the manifest.")
    for name, meta in files.items():
      if actual[name]["sha256"] != meta["sha256"]:
        raise IndexRejectedError(
            f"{directory}/{name}: checksum mismatch (corrupt file).")
  return manifest


def publish_index(index_root: str, step: int, embeddings: np.ndarray,
                  searcher, *, corpus_fingerprint: str, params_sha256: str,
                  build_seconds: float, keep: int = 3,
                  extra: dict[str, Any] | None = None) -> str:
  """Writes, verifies and atomically publishes the index of `step`.

  Args:
    index_root: the index root directory.
    step: the trainer step whose retriever parameters were embedded.
    embeddings: [rows, dim] block embeddings, row i = block i.
    searcher: a `realm_jax.index.searchers` searcher over `embeddings`.
    corpus_fingerprint: the block store's fingerprint.
    params_sha256: `params_checksum` of the retriever parameters.
    build_seconds: embedding + build time, for the manifest.
    keep: how many published indices to keep (>= 1; LATEST always kept).
    extra: more manifest fields.

  Returns:
    The published directory.
  """
  if keep < 1:
    raise ValueError(f"keep={keep} must be >= 1.")
  os.makedirs(index_root, exist_ok=True)
  final = step_dir(index_root, step)
  tmp = os.path.join(index_root, f"{_TMP_PREFIX}{int(step)}-{os.getpid()}")
  if os.path.exists(tmp):
    shutil.rmtree(tmp)
  os.makedirs(tmp)
  try:
    np.save(os.path.join(tmp, EMBEDDINGS),
            np.ascontiguousarray(embeddings))
    searcher.save(os.path.join(tmp, SEARCHER_DIR))
    manifest = {
        "step": int(step),
        "rows": int(embeddings.shape[0]),
        "dim": int(embeddings.shape[1]),
        "dtype": str(embeddings.dtype),
        "corpus_fingerprint": corpus_fingerprint,
        "params_sha256": params_sha256,
        "searcher": {"kind": searcher.kind,
                     "config": searcher.config.to_dict()},
        "build_seconds": round(float(build_seconds), 3),
        "created": time.time(),
        "files": _file_checksums(tmp),
        **(extra or {}),
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
      json.dump(manifest, f, indent=1)
    verify_index(tmp, Expectation(corpus_fingerprint, manifest["rows"],
                                  manifest["dim"]))
    if os.path.exists(final):  # A previous attempt got this far; replace.
      shutil.rmtree(final)
    os.rename(tmp, final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  _write_latest(index_root, step)
  for old in published_steps(index_root)[:-keep]:
    if old != step:
      shutil.rmtree(step_dir(index_root, old), ignore_errors=True)
  return final


@dataclasses.dataclass
class PublishedIndex:
  """A verified index, ready to search."""
  step: int
  manifest: dict[str, Any]
  embeddings: np.ndarray
  searcher: Any

  def search(self, queries: np.ndarray, k: int):
    return self.searcher.search_batched(queries, k)


def load_index(index_root: str, step: int | None = None,
               expect: Expectation = Expectation(), *,
               checksums: bool = True) -> PublishedIndex:
  """Loads and verifies index `step` (default: LATEST).

  Raises:
    IndexRejectedError: nothing published, or the index fails verification.
  """
  from realm_jax.index import searchers  # pylint: disable=g-import-not-at-top
  if step is None:
    step = read_latest(index_root)
    if step is None:
      raise IndexRejectedError(f"{index_root}: no {LATEST} (nothing "
                               "published yet).")
  directory = step_dir(index_root, step)
  manifest = verify_index(directory, expect, checksums=checksums)
  embeddings = np.load(os.path.join(directory, EMBEDDINGS), mmap_mode="r")
  if embeddings.shape != (manifest["rows"], manifest["dim"]):
    raise IndexRejectedError(f"{directory}: embeddings {embeddings.shape} "
                             "do not match the manifest.")
  try:
    searcher = searchers.load_searcher(os.path.join(directory, SEARCHER_DIR))
  except Exception as e:
    raise IndexRejectedError(f"{directory}: searcher unreadable: {e}") from e
  return PublishedIndex(step=int(step), manifest=manifest,
                        embeddings=embeddings, searcher=searcher)


class IndexWatcher:
  """Trainer side: loads new indices in the background, swaps between steps.

  A daemon thread polls LATEST; a new step is loaded and verified off the
  training thread and held as pending. The trainer calls `maybe_swap()`
  between steps. A partial, corrupt or mismatched index is never used: the
  old one stays live and the reason is logged (once per step).
  """

  def __init__(self, index_root: str, expect: Expectation = Expectation(), *,
               poll_seconds: float = 2.0,
               loader: Callable[..., PublishedIndex] = load_index):
    self.index_root = index_root
    self.expect = expect
    self.poll_seconds = poll_seconds
    self._loader = loader
    self._lock = threading.Lock()
    self._current: PublishedIndex | None = None
    self._pending: PublishedIndex | None = None
    self._seen: set[int] = set()
    self.rejected: dict[int, str] = {}
    self.swaps = 0
    # (index step, loaded and verified at, swapped in at), wall-clock.
    self.swap_log: list[tuple[int, float, float]] = []
    self._loaded_at: dict[int, float] = {}
    self._stop = threading.Event()
    self._new = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name="index-watcher")
    self._thread.start()

  def _newest_known(self) -> int:
    steps = [i.step for i in (self._current, self._pending) if i is not None]
    return max(steps, default=-1)

  def poll_once(self) -> None:
    """One look at LATEST (also called by the thread)."""
    try:
      step = read_latest(self.index_root)
    except IndexRejectedError as e:
      logging.warning("Index watcher: %s", e)
      return
    if step is None or step in self._seen or step <= self._newest_known():
      return
    self._seen.add(step)
    try:
      index = self._loader(self.index_root, step, self.expect)
    except (IndexRejectedError, OSError) as e:
      self.rejected[step] = str(e)
      logging.warning("Index watcher: refusing index %d, keeping %s: %s",
                      step, self.current_step, e)
      return
    with self._lock:
      self._pending = index
      self._loaded_at[step] = time.time()
    self._new.set()
    logging.info("Index watcher: index %d loaded and verified.", step)

  def _run(self) -> None:
    while not self._stop.is_set():
      self.poll_once()
      self._stop.wait(self.poll_seconds)

  def maybe_swap(self) -> bool:
    """Makes a pending index current; True if it did. Call between steps."""
    with self._lock:
      if self._pending is None:
        return False
      self._current, self._pending = self._pending, None
      self._new.clear()
      self.swaps += 1
      self.swap_log.append((self._current.step,
                            self._loaded_at.get(self._current.step, 0.0),
                            time.time()))
    logging.info("Index watcher: now serving index %d.", self._current.step)
    return True

  def wait_for_index(self, timeout: float | None = None) -> PublishedIndex:
    """Blocks until an index is available (the first one), then swaps it in."""
    deadline = None if timeout is None else time.time() + timeout
    while self._current is None:
      if self.maybe_swap():
        break
      remaining = None if deadline is None else deadline - time.time()
      if remaining is not None and remaining <= 0:
        raise TimeoutError(f"No valid index under {self.index_root} after "
                           f"{timeout} s.")
      self._new.wait(min(self.poll_seconds, remaining or self.poll_seconds))
    return self._current

  @property
  def current(self) -> PublishedIndex | None:
    return self._current

  @property
  def current_step(self) -> int | None:
    return None if self._current is None else self._current.step

  def staleness(self, train_step: int) -> int | None:
    """Train steps since the parameters the live index was built from."""
    return None if self._current is None else train_step - self._current.step

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=10)

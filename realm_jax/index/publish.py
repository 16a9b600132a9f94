"""Publication of MIPS indices (local or gs://): writing, verifying and
loading index directories.

Layout under an index root (usually `<workdir>/index`, local or `gs://`):

  <step>/manifest.json     step, rows, dim, dtype, corpus fingerprint,
                           parameter checksum, file checksums, searcher
                           config, build time
  <step>/embeddings.npy    [rows, dim]; row i = block i of the block store
  <step>/searcher/         the serialized searcher
  LATEST                   the step of the newest published index
  .progress.json           the index builder's progress
                           (`build_progress.BuildProgress`)

The commit point is LATEST alone, because object stores (GCS) have no
atomic directory rename: publication writes the files into `<step>/`
(manifest.json last, after the checksums were verified), and only then
replaces LATEST (local disk: temp file + rename; GCS: one object upload,
which is atomic). Readers trust only the step LATEST names and verify its
manifest and file checksums, so a publisher killed mid-write leaves a
directory nobody reads (`clean_stale_temporaries` removes it). Re-publishing
the step LATEST names (extending onto the same output again, rebuilding a
step) writes a fresh revision `<step>.<n>/` beside it and switches LATEST
to `<step>.<n>` in one atomic write; the index LATEST named is removed only
after that, so what is served is never withdrawn and never rewritten while
published. The K newest indices are kept.

On a remote root the index is built in a local staging directory (ScaNN
serializes to local files) and uploaded; a reader copies it once into a
local cache (`io_utils.local_copy`, keyed by the manifest) because the
embeddings are memory-mapped, and verifies the copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import time
from typing import Any

from absl import logging
import numpy as np

from realm_jax.core import io_utils
from realm_jax.core import outputs
from realm_jax.index import search_base, searchers

LATEST = "LATEST"
MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.npy"
SEARCHER_DIR = "searcher"
_TMP_PREFIX = ".tmp-"
# Local cached copies of remote indices kept per index root (the live one
# and the previous; an evicted copy stays readable by whoever mapped it).
_CACHED_INDICES = 2

PathLike = io_utils.PathLike


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


def _files(directory: PathLike) -> dict[str, Any]:
  """{relative POSIX path: epath.Path} of the files under `directory`.

  Raises:
    IndexRejectedError: an entry is a symbolic link (an index holds its
      own files; a link could serve, or checksum, a file from anywhere).
  """
  out = {}
  local = io_utils.is_local(directory)

  def visit(path, rel):
    for child in io_utils.listdir(path):
      name = f"{rel}{child.name}"
      if local and os.path.islink(child):
        raise IndexRejectedError(
            f"{child} is a symbolic link (to {os.readlink(child)!r}); an "
            "index is read only from its own files. Rebuild the index.")
      if child.is_dir():
        visit(child, name + "/")
      else:
        out[name] = child

  visit(io_utils.as_path(directory), "")
  return out


def _file_checksums(directory: PathLike, *, hashes: bool = True
                    ) -> dict[str, dict[str, Any]]:
  out = {}
  for rel, path in sorted(_files(directory).items()):
    if rel == MANIFEST:
      continue
    out[rel] = {"bytes": int(path.stat().length)}
    if hashes:
      out[rel]["sha256"] = io_utils.sha256_file(path)
  return out


# An index directory: `<step>`, or `<step>.<revision>` for a re-publication
# of the step LATEST named (ASCII digits only).
_INDEX_NAME = re.compile(r"(\d+)(?:\.(\d+))?", re.ASCII)


def parse_index_name(name: str) -> tuple[int, int] | None:
  """(step, revision) of an index directory's name; None for other names."""
  match = _INDEX_NAME.fullmatch(name)
  if match is None:
    return None
  return int(match.group(1)), int(match.group(2) or 0)


def read_latest_name(index_root: PathLike) -> str | None:
  """The index directory LATEST names (`<step>` or `<step>.<n>`), or None.

  Raises:
    IndexRejectedError: LATEST names no index directory, or is a link.
  """
  path = io_utils.as_path(index_root) / LATEST
  try:
    io_utils.check_no_links(path, index_root)
  except io_utils.LinkRefusedError as e:
    raise IndexRejectedError(str(e)) from None
  try:
    if not path.exists():
      return None
    name = path.read_text().strip()
  except FileNotFoundError:  # Removed between the two calls.
    return None
  except UnicodeDecodeError as e:
    raise IndexRejectedError(f"{path} is not a step number: {e}") from e
  if parse_index_name(name) is None:
    raise IndexRejectedError(f"{path} is not a step number: {name[:40]!r}")
  return name


def read_latest(index_root: PathLike) -> int | None:
  """The step LATEST points at, or None if nothing is published yet.

  Raises:
    IndexRejectedError: LATEST is not a step number, or is a link.
  """
  name = read_latest_name(index_root)
  return None if name is None else parse_index_name(name)[0]


def _index_dirs(index_root: PathLike) -> dict[int, str]:
  """{step: the name of its complete index directory}.

  A complete directory holds a manifest (written last by a publisher). Of
  a step's revisions, the one LATEST names wins (a newer one may be a
  re-publication not yet switched to), else the newest.
  """
  root = io_utils.as_path(index_root)
  if not root.is_dir():
    return {}
  latest = read_latest_name(root)
  out: dict[int, tuple[int, str]] = {}
  for p in root.iterdir():
    parsed = parse_index_name(p.name)
    if parsed is None or not (p / MANIFEST).exists():
      continue
    step, revision = parsed
    rank = (1 if p.name == latest else 0, revision)
    if step not in out or rank > out[step][0]:
      out[step] = (rank, p.name)
  return {step: name for step, (_, name) in out.items()}


def step_dir(index_root: PathLike, step: int) -> str:
  """The directory of index `step` under `index_root` (the revision
  LATEST names, for its step)."""
  name = _index_dirs(index_root).get(int(step), str(int(step)))
  return io_utils.join(index_root, name)


def _complete_steps(index_root: PathLike) -> list[int]:
  """Steps with a complete index directory."""
  return sorted(_index_dirs(index_root))


def published_steps(index_root: PathLike) -> list[int]:
  """Complete indices up to LATEST (a newer one was never published)."""
  latest = read_latest(index_root)
  if latest is None:
    return []
  return [s for s in _complete_steps(index_root) if s <= latest]


def _write_latest(index_root: PathLike, name: str) -> None:
  """Moves the commit point to index directory `name` (one atomic write)."""
  io_utils.atomic_write_text(io_utils.as_path(index_root) / LATEST,
                             f"{name}\n")


def _remove_index_dir(directory: PathLike) -> None:
  """Deletes an index, manifest first: on GCS a tree is removed object by
  object, and a half-deleted index must not look complete.

  Raises:
    io_utils.LinkRefusedError: `directory` is a link (deleting through it
      would delete files outside the index root).
  """
  path = io_utils.as_path(directory)
  io_utils.check_no_links(path, path.parent)
  (path / MANIFEST).unlink(missing_ok=True)
  io_utils.remove(path)


def clean_stale_temporaries(index_root: PathLike) -> list[str]:
  """Removes leftovers of a builder that died mid-publication.

  That is temporaries (`.tmp-*`) and step directories LATEST never named:
  incomplete ones and any newer than LATEST. Call it only while no
  publisher runs (the builder does, when it starts).
  """
  root = io_utils.as_path(index_root)
  if not root.is_dir():
    return []
  latest = read_latest(root)
  served = set(_index_dirs(root).values())
  removed = []
  for path in sorted(root.iterdir(), key=lambda p: p.name):
    name = path.name
    parsed = parse_index_name(name)
    stale = name.startswith(_TMP_PREFIX) or (parsed is not None and (
        name not in served or latest is None or parsed[0] > latest))
    if stale and io_utils.is_local(path) and os.path.islink(path):
      # Neither the link nor what it points at is this job's to delete.
      logging.warning("%s is a symbolic link (to %r), not an index this "
                      "builder wrote: left alone and never read; remove it.",
                      path, os.readlink(path))
    elif stale:
      _remove_index_dir(path) if parsed else io_utils.remove(path)
      removed.append(name)
  return removed


@dataclasses.dataclass(frozen=True)
class Expectation:
  """What a reader requires of an index (None = don't check)."""
  corpus_fingerprint: str | None = None
  rows: int | None = None
  dim: int | None = None


def verify_index(directory: PathLike, expect: Expectation = Expectation(),
                 *, checksums: bool = True) -> dict[str, Any]:
  """Checks a published index directory (local or remote); returns its
  manifest. `checksums`: also check the file list and every file's sha256
  (reads every file).

  Raises:
    IndexRejectedError: naming the directory and what is wrong.
  """
  manifest = io_utils.read_manifest(
      directory, what="index", name=MANIFEST, missing_error=IndexRejectedError,
      error=IndexRejectedError,
      build="publish one with `python -m realm_jax.jobs.index_builder`")
  for key, want in (("corpus_fingerprint", expect.corpus_fingerprint),
                    ("rows", expect.rows), ("dim", expect.dim)):
    if want is not None and manifest.get(key) != want:
      raise IndexRejectedError(
          f"{directory}: {key} is {manifest.get(key)!r} but the reader "
          f"expects {want!r}; the index was built for another corpus or "
          "model. Rebuild it against this block store.")
  if checksums:
    _check_files(directory, manifest, hashes=True)
  return manifest


_PICKLE_SUFFIXES = (".pkl", ".pickle", ".pck", ".pcl")


def _check_files(directory: PathLike, manifest: dict[str, Any], *,
                 hashes: bool) -> None:
  files = manifest.get("files", {})
  actual = _file_checksums(directory, hashes=hashes)
  pickles = sorted(n for n in set(files) | set(actual)
                   if n.endswith(_PICKLE_SUFFIXES))
  if pickles:
    raise IndexRejectedError(
        f"{directory}: {pickles} are pickles; realm_jax never unpickles a "
        "file of an index (it could run any code). Rebuild the index.")
  if set(files) != set(actual):
    raise IndexRejectedError(
        f"{directory}: files {sorted(set(files) ^ set(actual))} differ "
        "from the manifest.")
  for name, meta in files.items():
    if actual[name]["bytes"] != meta["bytes"] or (
        hashes and actual[name]["sha256"] != meta["sha256"]):
      raise IndexRejectedError(
          f"{directory}/{name}: checksum mismatch (corrupt file).")


def publish_index(index_root: PathLike, step: int, embeddings: np.ndarray,
                  searcher, *, corpus_fingerprint: str, params_sha256: str,
                  build_seconds: float, keep: int = 3,
                  extra: dict[str, Any] | None = None,
                  kind: outputs.Kind = outputs.INDEX_ROOT,
                  setting: str = "the index root") -> str:
  """Writes and verifies the index of `step`, then publishes it (LATEST).

  Args:
    index_root: the index root directory (local, or remote as gs://...).
    step: the trainer step whose retriever parameters were embedded.
    embeddings: [rows, dim] block embeddings, row i = block i.
    searcher: a `realm_jax.index.searchers` searcher over `embeddings`.
    corpus_fingerprint: the block store's fingerprint.
    params_sha256: `params_checksum` of the retriever parameters.
    build_seconds: embedding + build time, for the manifest.
    keep: how many published indices to keep (>= 1; LATEST always kept).
    extra: more manifest fields.
    kind: the index root's kind of output (`outputs.claim`: a root of
      another kind, or a directory no job wrote, is refused).
    setting: how the user names `index_root`, for that error.

  Returns the published directory.
  """
  if keep < 1:
    raise ValueError(f"keep={keep} must be >= 1.")
  root = io_utils.as_path(index_root)
  outputs.claim(root, kind, setting)
  final = _fresh_step_dir(root, step)
  local = io_utils.is_local(final)
  # ScaNN serializes to local files: a remote index is staged locally,
  # checked there, and uploaded.
  stage = os.fspath(final) if local else tempfile.mkdtemp(
      prefix=f"realm_jax_publish-{int(step)}-")
  os.makedirs(stage, exist_ok=True)
  try:
    io_utils.save_npy(os.path.join(stage, EMBEDDINGS), embeddings)
    searcher.save(os.path.join(stage, SEARCHER_DIR))
    manifest = _index_manifest(
        stage, step, embeddings, searcher,
        corpus_fingerprint=corpus_fingerprint, params_sha256=params_sha256,
        build_seconds=build_seconds, extra=extra)
    manifest_text = json.dumps(manifest, indent=1)
    if local:
      io_utils.atomic_write_text(os.path.join(stage, MANIFEST),
                                 manifest_text)
      verify_index(stage, Expectation(corpus_fingerprint, manifest["rows"],
                                      manifest["dim"]))
    else:
      io_utils.copy_tree(stage, final)
      # The manifest goes last: a directory without one is incomplete.
      io_utils.atomic_write_text(final / MANIFEST, manifest_text)
      # Uploads are checksummed by the client; listing and sizes are cheap.
      _check_files(final, manifest, hashes=False)
  except BaseException:
    _remove_index_dir(final)
    raise
  finally:
    if not local:
      io_utils.remove(stage)
  _write_latest(root, final.name)  # The commit point: one atomic write.
  for p in list(root.iterdir()):  # The revision it replaced, if any.
    parsed = parse_index_name(p.name)
    if parsed and parsed[0] == int(step) and p.name != final.name:
      try:
        _remove_index_dir(p)
      except io_utils.LinkRefusedError as e:
        logging.warning("not removing the replaced index %s: %s", p, e)
  _remove_old_indices(root, step, keep)
  return os.fspath(final)


def _fresh_step_dir(root: PathLike, step: int):
  """The `io_utils.as_path` of a new, empty directory name for `step`'s
  index under `root`, ready for `publish_index` to write.

  The step LATEST names is never touched: its re-publication gets the next
  revision `<step>.<n>`. Any other directory of `step` (leftovers of an
  attempt that never reached LATEST, an older publication) is removed.
  """
  root_path = io_utils.as_path(root)
  latest = read_latest_name(root)
  revisions = []
  for p in (root_path.iterdir() if root_path.is_dir() else ()):
    parsed = parse_index_name(p.name)
    if parsed is not None and parsed[0] == int(step):
      revisions.append(parsed[1])
      if p.name != latest:
        # Writes (and deletes) through a planted link would land outside.
        io_utils.check_no_links(p, root)
        _remove_index_dir(p)
  live = latest is not None and parse_index_name(latest)[0] == int(step)
  name = (f"{int(step)}.{max(revisions) + 1}" if live else str(int(step)))
  final = root_path / name
  io_utils.check_no_links(final, root)
  return final


def _index_manifest(stage: str, step: int, embeddings: np.ndarray, searcher,
                    *, corpus_fingerprint: str, params_sha256: str,
                    build_seconds: float, extra: dict[str, Any] | None
                    ) -> dict[str, Any]:
  """The manifest of the index files written in `stage` (see
  `publish_index`), with their checksums."""
  return {
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
      "files": _file_checksums(stage),
      **(extra or {}),
  }


def _remove_old_indices(root: PathLike, step: int, keep: int) -> None:
  """Removes all but the newest `keep` published indices (never `step`'s);
  one behind a planted link is left, with a warning."""
  for old in published_steps(root)[:-keep]:
    if old != step:
      try:
        _remove_index_dir(step_dir(root, old))
      except io_utils.LinkRefusedError as e:
        logging.warning("not removing old index %d: %s", old, e)


@dataclasses.dataclass
class PublishedIndex:
  """A verified index, ready to search.

  `revision`: which publication of `step` it is (n of its directory
  `<step>.<n>`, 0 for `<step>`): a re-publication of a step (an extend
  onto the same output, a rebuild) is another index of the same step.
  """
  step: int
  manifest: dict[str, Any]
  embeddings: np.ndarray
  searcher: Any
  revision: int = 0

  @property
  def key(self) -> tuple[int, int]:
    """(step, revision): orders publications, newest last."""
    return self.step, self.revision

  def search(self, queries: np.ndarray, k: int):
    return self.searcher.search_batched(queries, k)


def _cache_key_prefix(index_root: PathLike) -> str:
  root = io_utils.absolute(index_root)
  return f"index-{hashlib.sha256(root.encode()).hexdigest()[:12]}-"


def _cached_copy(index_root: PathLike, step: int, manifest: dict[str, Any],
                 cache_dir: PathLike | None) -> str:
  """A local copy of a remote index (made once per published manifest).

  Older copies of the same root are evicted, keeping the newest
  `_CACHED_INDICES`; a reader still mapping an evicted file keeps reading
  it (POSIX unlink semantics).
  """
  prefix = _cache_key_prefix(index_root)
  digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
  key = f"{prefix}{int(step)}-{digest.hexdigest()[:12]}"
  path = io_utils.local_copy(step_dir(index_root, step), key,
                             cache_dir=cache_dir)
  cache = os.path.dirname(path)
  entries = [n for n in os.listdir(cache)
             if n.startswith(prefix) and n != key]
  entries.sort(key=lambda n: (int(n[len(prefix):].split("-")[0]),
                              os.path.getmtime(os.path.join(cache, n))))
  for name in entries[:max(0, len(entries) - (_CACHED_INDICES - 1))]:
    io_utils.remove(os.path.join(cache, name))
  return path


def load_index(index_root: PathLike, step: int | None = None,
               expect: Expectation = Expectation(), *,
               checksums: bool = True,
               cache_dir: PathLike | None = None) -> PublishedIndex:
  """Loads and verifies index `step` (default: LATEST).

  A remote index (gs://...) is copied once into a local cache directory
  (`cache_dir`, default `io_utils.cache_root()`), since its embeddings are
  memory-mapped and ScaNN reads local files; the copy is verified.

  Raises:
    IndexRejectedError: nothing published, or the index fails verification.
  """
  if step is None:
    step = read_latest(index_root)
    if step is None:
      raise IndexRejectedError(f"{index_root}: no {LATEST} (nothing "
                               "published yet).")
  directory = step_dir(index_root, step)
  try:
    io_utils.check_no_links(directory, index_root)
  except io_utils.LinkRefusedError as e:
    raise IndexRejectedError(str(e)) from None
  if io_utils.is_local(directory):
    local = directory
    manifest = verify_index(directory, expect, checksums=checksums)
    if not checksums:
      _files(directory)  # Refuses links, which only a listing shows.
  else:
    # The manifest alone first: a mismatched index is refused uncopied.
    remote_manifest = verify_index(directory, expect, checksums=False)
    try:
      local = _cached_copy(index_root, step, remote_manifest, cache_dir)
    except FileNotFoundError as e:
      raise IndexRejectedError(f"{directory}: vanished while being copied "
                               f"({e}).") from e
    try:
      manifest = verify_index(local, expect, checksums=checksums)
      if not checksums:
        _check_files(local, manifest, hashes=False)
    except IndexRejectedError as e:
      io_utils.remove(local)  # Copied mid-rewrite, or corrupt: drop it.
      raise IndexRejectedError(f"{directory} (local copy): {e}") from e
  embeddings = search_base.load_embeddings(os.path.join(local, EMBEDDINGS),
                                           error=IndexRejectedError)
  if embeddings.shape != (manifest["rows"], manifest["dim"]):
    raise IndexRejectedError(f"{directory}: embeddings {embeddings.shape} "
                             "do not match the manifest.")
  try:
    searcher = searchers.load_searcher(os.path.join(local, SEARCHER_DIR))
  except Exception as e:
    raise IndexRejectedError(f"{directory}: searcher unreadable: {e}") from e
  _, revision = parse_index_name(os.path.basename(directory)) or (step, 0)
  return PublishedIndex(step=int(step), manifest=manifest,
                        embeddings=embeddings, searcher=searcher,
                        revision=revision)


def resolve_index_root(index_dir: PathLike) -> str:
  """`index_dir`, or `index_dir/index` when only that has a LATEST.

  So a job may be pointed at a pre-training workdir as well as at its
  index root.
  """
  nested = io_utils.join(index_dir, "index")
  if read_latest(index_dir) is None and read_latest(nested) is not None:
    return nested
  return os.fspath(index_dir)


def load_frozen_index(index_dir: PathLike, store, model, *,
                      step: int | None = None,
                      num_retrieved: int | None = None,
                      what: str = "index_dir") -> PublishedIndex:
  """Loads a published index and checks it serves this store and model.

  For the jobs that retrieve from one fixed index (fine-tuning, evaluation,
  ask); the error says which setting to fix.

  Args:
    index_dir: an index root, or a directory holding one as `index/`.
    store: the block store the job reads (its fingerprint and size).
    model: the job's `RealmConfig` (its retriever's embedding size).
    step: the index step; None = LATEST.
    num_retrieved: blocks the job retrieves per query, if it must fit.
    what: the setting `index_dir` came from, for the messages (e.g.
      "FinetuneConfig.index_dir" or "--index_dir").

  Raises:
    IndexRejectedError: nothing published, a corrupt index, another corpus
      (fingerprint or row count), another embedding size, or fewer blocks
      than `num_retrieved`.
  """
  root = resolve_index_root(index_dir)
  dim = model.retriever.embedding_size
  try:
    index = load_index(
        root, step, Expectation(store.fingerprint, len(store), dim))
  except IndexRejectedError as e:
    raise IndexRejectedError(
        f"{what}={os.fspath(index_dir)!r} cannot serve this job: {e} It "
        f"needs an index published over its block_store ({len(store)} "
        f"blocks, corpus fingerprint {store.fingerprint}) with embeddings of "
        f"this model's retriever (embedding size {dim}); build one with "
        "`python -m realm_jax.jobs.index_builder --gin_file=runs/index_builder.gin "
        "--gin.builder.BuilderConfig.one_shot=True` (with the model's gin "
        f"file, WORKDIR and BLOCK_STORE) or point {what} at "
        "the matching index.") from e
  if num_retrieved is not None and num_retrieved > index.manifest["rows"]:
    raise IndexRejectedError(
        f"num_retrieved={num_retrieved} exceeds the "
        f"{index.manifest['rows']} blocks of the index at {root}; lower "
        "num_retrieved.")
  return index

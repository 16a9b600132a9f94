"""Who owns an output directory: a job creates, replaces or deletes only
what it created.

Every directory a job writes whole or in place (block stores, query
caches, annotated corpora, index roots, searchers, BM25 indexes, exports,
eval directories, reader-prep reports) carries a small marker,
`.realm_jax_output.json`, naming the kind of output and its format
version. Before a job writes to a path that already exists it asks
`check`: a missing or empty directory is free; a directory whose marker
names the same kind is the job's to update (or, with `overwrite`, to
replace); anything else (a directory of the user's files, the job's own
workdir, another kind of output, a file, a FIFO, a link) is refused with
an error that names the setting, the path and what is in it. Outputs
written before markers existed are recognised by their layout
(`Kind.legacy`) and get their marker the next time they are written.

    with outputs.output_dir(path, kind=outputs.EXPORT,
                            setting="ExportConfig.output_dir") as tmp:
      ...  # write into tmp; it becomes `path` (with its marker) at the end

    outputs.claim(root, outputs.INDEX_ROOT, "the index root")  # in place

The rule is enforced here, not by each job: `output_dir` and `claim`
take the kind as a required argument, so a new output cannot skip it.
`tests/core/test_output_settings.py` points every path setting that a
job writes at a user's directory, the workdir, each input, a link, a
FIFO and a read-only directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import shutil
import socket
import stat
import time
from typing import Iterator

from realm_jax.core import io_utils

MARKER = ".realm_jax_output.json"
# Entries any kind may hold beside its own files: the marker, a lease, the
# temporaries of a job at work.
_ALWAYS = (MARKER, ".lease", ".tmp-*", ".*.tmp-*")
_SHOWN = 6  # Entries of a refused directory named in the error.


class OwnershipError(FileExistsError):
  """An output setting names a path that no job of that kind created."""


@dataclasses.dataclass(frozen=True)
class Kind:
  """A kind of output directory.

  Attributes:
    name: the marker's `kind` ("bm25_index").
    what: for messages ("a BM25 index").
    version: the format version the marker records.
    legacy: fnmatch patterns of every top-level entry an output of this
      kind written before markers holds; () when none is recognised.
    legacy_requires: an entry such an output always holds.
  """
  name: str
  what: str
  version: int = 1
  legacy: tuple[str, ...] = ()
  legacy_requires: str = ""


# (ranker_calibration.json: realm-calibrate's choice, `index.calibration`.)
_INDEX_ENTRIES = ("LATEST", "[0-9]*", ".progress.json", ".lease",
                  "ranker_calibration.json")
BLOCK_STORE = Kind("block_store", "a block store", legacy=(
    "manifest.json", "*.npy", "report.json", "dropped.jsonl", "vocab.txt",
    "bm25"), legacy_requires="manifest.json")
QUERY_CACHE = Kind("query_cache", "a query cache", legacy=(
    "manifest.json", "queries-*", "dev"), legacy_requires="manifest.json")
ANNOTATED = Kind("annotated_corpus", "an annotated corpus", legacy=(
    "report.json", "*.jsonl*", "*.tfrecord*", "*-of-*"),
                 legacy_requires="report.json")
INDEX_ROOT = Kind("index_root", "an index builder's index root",
                  legacy=_INDEX_ENTRIES)
EXTENDED_INDEX_ROOT = Kind("extended_index_root", "an extended index root")
SEARCHER = Kind("searcher", "a searcher", legacy=(
    "searcher.json", "*.npy", "scann*", "shard-*", "*"),
                legacy_requires="searcher.json")
BM25_INDEX = Kind("bm25_index", "a BM25 index", legacy=(
    "manifest.json", "terms.npy", "offsets.npy", "vocab.json"),
                  legacy_requires="manifest.json")
EXPORT = Kind("export", "an export", legacy=(
    "realm_config.json", "query_tower", "document_tower", "reader",
    "vocab.txt", "*.json", "*.safetensors"),
              legacy_requires="realm_config.json")
EVAL_DIR = Kind("eval_dir", "an eval job's output directory", legacy=(
    "eval_ledger.json", "metrics.jsonl", "summaries", "predictions*",
    "retrieval*", "*.json", "*.jsonl"))
AOT_EXECUTABLES = Kind("aot_executables", "realm-aot's serialized "
                       "executables", legacy=("*.xla", "*.hlo.txt"))
FETCH_CACHE = Kind("fetch_cache", "fetch_public's download cache",
                   legacy=("pkgs",), legacy_requires="pkgs")
PUBLIC_DATA = Kind("public_data", "fetch_public's output directory",
                   legacy=("*.jsonl", "SHA256SUMS"),
                   legacy_requires="SHA256SUMS")
KINDS = {k.name: k for k in (BLOCK_STORE, QUERY_CACHE, ANNOTATED, INDEX_ROOT,
                             EXTENDED_INDEX_ROOT, SEARCHER, BM25_INDEX,
                             EXPORT, EVAL_DIR, AOT_EXECUTABLES, FETCH_CACHE,
                             PUBLIC_DATA)}


def _entries(directory: io_utils.PathLike) -> list[str]:
  return sorted(p.name for p in io_utils.as_path(directory).iterdir())


def _describe(entries: list[str]) -> str:
  shown = ", ".join(entries[:_SHOWN])
  more = len(entries) - _SHOWN
  return shown + (f" and {more} more" if more > 0 else "")


def owner(directory: io_utils.PathLike) -> dict | None:
  """The marker of `directory` ({"kind", "format_version", ...}), or None
  when it has none (or one that is not a regular file of JSON)."""
  path = io_utils.as_path(directory) / MARKER
  if io_utils.is_local(path):
    try:
      mode = os.lstat(path).st_mode
    except OSError:
      return None
    if not stat.S_ISREG(mode):
      return None
  elif not path.exists():
    return None
  try:
    marker = json.loads(path.read_bytes())
  except (OSError, ValueError):
    return None
  return marker if isinstance(marker, dict) else None


def _legacy(kind: Kind, entries: list[str]) -> bool:
  """Whether `entries` are the layout of `kind` from before markers."""
  if not kind.legacy or (kind.legacy_requires and
                         kind.legacy_requires not in entries):
    return False
  own = [e for e in entries
         if not any(fnmatch.fnmatchcase(e, p) for p in _ALWAYS)]
  return bool(own) and all(
      any(fnmatch.fnmatchcase(e, p) for p in kind.legacy) for e in own)


def _refuse_special(path: str, setting: str) -> None:
  """A local `path` that is a link or exists but is no directory."""
  info = io_utils.local_lstat(path)
  if info is None:
    return
  mode = info.st_mode
  if stat.S_ISLNK(mode):
    raise io_utils.LinkRefusedError(
        f"{setting}={path!r} is a symbolic link (to {os.readlink(path)!r}); "
        "a job never writes or deletes its output through a link, since it "
        f"could lead anywhere. Point {setting} at a real directory.")
  if not stat.S_ISDIR(mode):
    what = "a file" if stat.S_ISREG(mode) else io_utils.file_kind(mode)
    raise OwnershipError(
        f"{setting}={path!r} is {what}, not a directory; nothing was "
        f"written. Point {setting} at a new or empty directory.")


def check(directory: io_utils.PathLike, kind: Kind, setting: str, *,
          overwrite: bool = True, exists: str = "") -> bool:
  """Whether `directory` holds an output of `kind` that the job may write.

  Args:
    directory: the output path (local or remote).
    kind: what the job writes there.
    setting: how the user names it, for messages
      ("EvalConfig.bm25_dir", "--gin.OUTPUT_DIR").
    overwrite: whether an existing output of `kind` may be replaced
      (False: `FileExistsError`, with `exists` as its message).
    exists: the message for an existing output and not `overwrite`.

  Returns:
    True: an output of `kind` is there; False: nothing (or an empty
    directory) is.

  Raises:
    io_utils.LinkRefusedError: `directory` is a symbolic link.
    OwnershipError: it is not a directory, or a non-empty one without the
      marker of `kind` (nor `kind`'s layout from before markers).
    FileExistsError: an output of `kind`, and not `overwrite`.
  """
  path = os.fspath(directory)
  if io_utils.is_local(path):
    path = os.path.abspath(path)
    _refuse_special(path, setting)
    if not os.path.isdir(path):
      return False
  elif not io_utils.as_path(path).is_dir():
    return False
  entries = _entries(path)
  if not [e for e in entries
          if not any(fnmatch.fnmatchcase(e, p) for p in _ALWAYS)] and (
              MARKER not in entries):
    return False  # Empty, or a lease and temporaries only.
  marker = owner(path)
  ours = marker is not None and marker.get("kind") == kind.name
  if ours and int(marker.get("format_version", 0)) > kind.version:
    raise OwnershipError(
        f"{setting}={path!r} holds {kind.what} of format version "
        f"{marker.get('format_version')}, newer than this realm_jax writes "
        f"({kind.version}); it is left alone. Upgrade realm_jax or choose "
        f"another {setting}.")
  if not ours and not (marker is None and _legacy(kind, entries)):
    wrote = (f"it was written as {KINDS[marker['kind']].what}"
             if marker and marker.get("kind") in KINDS
             else f"no {MARKER} says a realm_jax job wrote it as {kind.what}")
    raise OwnershipError(
        f"{setting}={path!r} is an existing directory that is not {kind.what}"
        f" ({wrote}; it holds {_describe(entries)}). A job creates, replaces "
        "or deletes only what it created, so nothing was written or "
        f"deleted. Point {setting} at a new or empty directory"
        + (" or at one this job wrote before." if kind.legacy or
           kind is not EXTENDED_INDEX_ROOT else "."))
  if not overwrite:
    raise FileExistsError(exists or (
        f"{setting}={path!r} already holds {kind.what}; choose a new "
        "directory, or ask for it to be replaced."))
  return True


def mark(directory: io_utils.PathLike, kind: Kind, **extra) -> None:
  """Writes `directory`'s marker: `kind`, its format version, who wrote it."""
  io_utils.atomic_write_text(io_utils.join(directory, MARKER), json.dumps({
      "kind": kind.name, "format_version": kind.version,
      "written_by": {"host": socket.gethostname(), "pid": os.getpid(),
                     "time": time.time()}, **extra}, indent=1))


def claim(directory: io_utils.PathLike, kind: Kind, setting: str) -> None:
  """Makes (or adopts) `directory` as an output of `kind` written in
  place (index roots, eval directories): `check`, then create it and its
  marker as needed.

  Raises:
    As `check` (never `FileExistsError` for an output of `kind`).
  """
  check(directory, kind, setting, overwrite=True)
  io_utils.makedirs(directory)
  if (owner(directory) or {}).get("kind") != kind.name:
    mark(directory, kind)


def new_output_tmp(directory: io_utils.PathLike, *, kind: Kind,
                   setting: str, overwrite: bool = False,
                   exists: str = "") -> str:
  """`io_utils.new_output_tmp` after `check`, with the marker of `kind`
  already in the temporary (it becomes `directory` whole).

  Raises:
    As `check`.
  """
  check(directory, kind, setting, overwrite=overwrite, exists=exists)
  tmp = io_utils.new_output_tmp(directory, overwrite=True)
  mark(tmp, kind)
  return tmp


@contextlib.contextmanager
def output_dir(directory: io_utils.PathLike, *, kind: Kind, setting: str,
               overwrite: bool = False, exists: str = "",
               last: tuple[str, ...] = ()) -> Iterator[str]:
  """`io_utils.output_dir` for an output of `kind`: writes it whole or not
  at all, and replaces (with `overwrite`) only an output of `kind`.

  An object store (gs://) has no rename: a remote output is written into a
  local temporary, then uploaded file by file, the files named in `last`
  (relative paths: what a reader opens first) and the marker after all
  others, so an upload cut short leaves no output a reader or `check`
  takes for whole. An output it replaces is removed before the upload.

  Raises:
    As `check`.
  """
  if not io_utils.is_local(directory):
    check(directory, kind, setting, overwrite=overwrite, exists=exists)
    tmp = io_utils.mkdtemp(prefix="realm_jax_output-")
    try:
      mark(tmp, kind)
      yield tmp
      target = io_utils.as_path(directory)
      if target.exists():
        io_utils.remove(target)
      io_utils.copy_tree(tmp, target, skip=(MARKER, *last))
      for rel in (*last, MARKER):
        io_utils.copy_file(os.path.join(tmp, rel), target / rel)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    return
  tmp = new_output_tmp(directory, kind=kind, setting=setting,
                       overwrite=overwrite, exists=exists)
  try:
    yield tmp
    io_utils.replace_local_dir(tmp, os.path.abspath(os.fspath(directory)))
  except BaseException:
    io_utils.discard_output_tmp(tmp)
    raise

"""Work-directory I/O that works on local disks and on `gs://` alike.

Jobs write and read their workdir, index and checkpoints through these
helpers (built on `etils.epath`, which reaches GCS through tf.io.gfile)
instead of `os`, `shutil` and `open`, so a workdir may be
`gs://bucket/run` on a Cloud TPU pod and a plain directory in tests.

What differs between the two kinds of storage, and how it is handled:
  * Atomic files: on a local disk a file is written to a temporary sibling
    and renamed over the target (readers see the old or the new file). An
    object store has no rename, but a single-object upload is atomic (the
    object appears whole when the upload completes), so it is written in
    place.
  * Appends: objects cannot be appended to; `append_text` rewrites the
    whole object (log files are small).
  * Memory maps: `np.load(mmap_mode=...)` needs a local file; `local_copy`
    copies a remote file or directory once into a local cache directory.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import tempfile
from typing import Any, Callable, Iterator, Sequence, Union

from etils import epath

PathLike = Union[str, os.PathLike]

CACHE_ENV = "REALM_JAX_CACHE_DIR"
_CHUNK = 1 << 24


class LinkRefusedError(ValueError):
  """A symbolic link inside a job's own directory, where none belongs.

  A link there could have the job read, overwrite or delete files outside
  its directory, so the entry is refused by name instead of followed.
  """


def as_path(path: PathLike) -> epath.Path:
  """`path` as an epath.Path (gs://... -> a GCS path, else a local one)."""
  return epath.Path(path)


def is_local(path: PathLike) -> bool:
  """True for a path on this machine's filesystem (no `scheme://` prefix)."""
  return "://" not in os.fspath(path)


def absolute(path: PathLike) -> str:
  """An absolute local path, or a remote path as it is (never `cwd/gs:/`)."""
  return os.path.abspath(path) if is_local(path) else os.fspath(
      as_path(path))


def join(path: PathLike, *parts: str) -> str:
  """`os.path.join` for local and remote paths; returns a string."""
  return os.fspath(as_path(path).joinpath(*parts))


def check_no_links(path: PathLike, root: PathLike) -> None:
  """Refuses `path` when it, or a directory between `root` and it, is a link.

  `root` itself may be a link (a workdir put on a bigger disk); what a job
  keeps below it may not. Remote paths have no links.

  Args:
    path: a path at or below `root`.
    root: the job's own directory.

  Raises:
    LinkRefusedError: naming the link and where it points.
    ValueError: `path` is not below `root`.
  """
  if not is_local(path):
    return
  root, path = os.path.abspath(root), os.path.abspath(path)
  rel = os.path.relpath(path, root)
  if rel == os.curdir:
    return
  if rel == os.pardir or rel.startswith(os.pardir + os.sep):
    raise ValueError(f"{path} is not inside {root}.")
  current = root
  for part in rel.split(os.sep):
    current = os.path.join(current, part)
    if os.path.islink(current):
      raise LinkRefusedError(
          f"{current} is a symbolic link (to {os.readlink(current)!r}); "
          f"nothing inside {root} is read, written or deleted through a "
          "link, since it could lead outside. Remove the link (or replace "
          "it with a copy).")


def current_umask() -> int:
  """The process umask, read without changing it where the OS allows.

  Linux reports it in /proc/self/status; elsewhere it is read by setting
  and restoring it (os.umask has no read-only form).
  """
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def honour_umask(path: str, *, directory: bool, fd: int | None = None
                 ) -> None:
  """Gives a fresh `mkstemp`/`mkdtemp` entry the mode `open`/`mkdir` would.

  `tempfile` creates its entries owner-only (0600 files, 0700
  directories) whatever the umask. A job's outputs are renamed into
  place from such temporaries, so without this every index, store,
  export and marker would be unreadable by a serving account or a
  teammate on a shared workdir.
  """
  mode = (0o777 if directory else 0o666) & ~current_umask()
  if fd is not None:
    os.fchmod(fd, mode)
  else:
    os.chmod(path, mode)


def mkdtemp(*, prefix: str, dir: str | None = None) -> str:  # pylint: disable=redefined-builtin
  """`tempfile.mkdtemp` whose directory honours the umask as `mkdir` does.

  Still created exclusively (never an existing directory or a link).
  """
  path = tempfile.mkdtemp(prefix=prefix, dir=dir)
  honour_umask(path, directory=True)
  return path


class NotRegularFileError(ValueError):
  """A job's own record file or directory is a FIFO, a device, a socket,
  or of the other type."""


class SamePlaceError(ValueError):
  """A job's output is one of its inputs under another name (a link, a
  `..`, a bind mount), or lies inside it."""


def real_place(path: PathLike) -> str:
  """Where local `path` is on the filesystem: links and `..` resolved, as
  far as it exists (`os.path.realpath`); a remote path as it is."""
  return (os.path.realpath(os.fspath(path)) if is_local(path)
          else absolute(path))


def same_place(a: PathLike, b: PathLike) -> bool:
  """True when `a` and `b` name the same file or directory: the same real
  path, or (both existing) the same inode (`os.path.samefile`)."""
  if real_place(a) == real_place(b):
    return True
  if is_local(a) and is_local(b):
    try:
      return os.path.samefile(a, b)
    except OSError:  # One of them does not exist (yet).
      return False
  return False


def _inside(path: PathLike, directory: PathLike) -> bool:
  """True when `path` is `directory` or below it: by real path, or (local)
  when one of `path`'s existing ancestors is `directory`'s file by another
  name that no real path shows (a bind mount, a hard-linked mount point)."""
  real, home = real_place(path), real_place(directory)
  if real == home or real.startswith(home.rstrip("/") + "/"):
    return True
  if not (is_local(path) and is_local(directory)
          and os.path.isdir(directory)):
    return False
  current = os.path.abspath(os.fspath(path))
  while True:
    try:
      if os.path.samefile(current, directory):
        return True
    except OSError:  # Not there (yet).
      pass
    parent = os.path.dirname(current)
    if parent == current:
      return False
    current = parent


def check_apart(output: PathLike, output_name: str,
                inputs: dict[str, PathLike | None], *,
                either_way: tuple[str, ...] = ()) -> None:
  """Refuses an output that is one of a job's inputs by another name.

  The one notion of "the same place" for every input/output pair of a
  job (extend, export, the index builder): real paths (links and `..`
  resolved) and, for existing paths, `os.path.samefile`. A plain
  comparison of absolute paths lets a link or an alias through, and the
  job then replaces its own input.

  Args:
    output: the directory the job writes.
    output_name: how the user sets it, for the message
      ("output_root", "--gin.OUTPUT_DIR").
    inputs: {how the user sets it: path}; None entries are skipped.
    either_way: names of `inputs` that may not hold `output` nor lie
      inside it (others: may not be it nor hold it).

  Raises:
    SamePlaceError: naming both settings and the real place.
  """
  for name, path in inputs.items():
    if path is None or path == "":
      continue
    clash = same_place(output, path) or _inside(output, path) or (
        name in either_way and _inside(path, output))
    if clash:
      raise SamePlaceError(
          f"{output_name}={os.fspath(output)!r} and {name}="
          f"{os.fspath(path)!r} are the same place, or one holds the other "
          f"(real paths {real_place(output)!r} and {real_place(path)!r}); "
          f"the job would write over its own input. Choose another "
          f"{output_name}, apart from it.")


def makedirs(path: PathLike) -> None:
  as_path(path).mkdir(parents=True, exist_ok=True)


def read_text(path: PathLike) -> str:
  return as_path(path).read_text()


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
  """Writes `path` so that readers see the old or the new content, whole.

  Local: a temporary sibling `.tmp-<name>-<pid>` (fsynced) renamed over
  `path`. Remote: one upload, which object stores commit atomically. The
  parent directory is created if needed.
  """
  target = as_path(path)
  target.parent.mkdir(parents=True, exist_ok=True)
  if not is_local(target):
    target.write_bytes(data)
    return
  # mkstemp creates the temporary exclusively: never a planted file or link.
  fd, tmp = tempfile.mkstemp(prefix=f".tmp-{target.name}-",
                             dir=os.path.dirname(os.fspath(target)))
  try:
    with os.fdopen(fd, "wb") as f:
      honour_umask(tmp, directory=False, fd=f.fileno())
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, target)  # Replaces a link at target, never follows it.
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def atomic_write_text(path: PathLike, text: str) -> None:
  """`atomic_write_bytes` of UTF-8 text."""
  atomic_write_bytes(path, text.encode("utf-8"))


def append_text(path: PathLike, text: str) -> None:
  """Appends `text` to `path` (created if missing).

  Local files are opened for append. Objects cannot be appended to, so a
  remote file is read and rewritten whole (one atomic upload); meant for
  logs of a few MB such as metrics.jsonl.
  """
  target = as_path(path)
  if is_local(target):
    target.parent.mkdir(parents=True, exist_ok=True)
    check_own_file(target)  # (A FIFO would block the open below forever.)
    # O_NOFOLLOW: a log planted as a link would grow a file anywhere; an
    # existing file must be a plain one with one name (not a hard link).
    try:
      fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                   | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      raise LinkRefusedError(
          f"{target} is a symbolic link (to {os.readlink(target)!r}); a job "
          "never appends through a link, since it could lead outside its "
          "directory. Remove the link (or replace it with a copy).") from None
    with os.fdopen(fd, "a", encoding="utf-8") as f:
      info = os.fstat(fd)
      if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        raise LinkRefusedError(
            f"{target} is not a plain file with one name (it has "
            f"{info.st_nlink} hard links); a job never appends to a file "
            "that other names share. Remove it (or replace it with a "
            "copy).")
      f.write(text)
    return
  old = target.read_bytes() if target.exists() else b""
  atomic_write_bytes(target, old + text.encode("utf-8"))


def listdir(path: PathLike) -> list[epath.Path]:
  """The children of directory `path`, sorted by name.

  Raises:
    FileNotFoundError: `path` is not a directory (TensorFlow's filesystems
      raise their own NotFoundError, which is not an OSError).
  """
  directory = as_path(path)
  try:
    return sorted(directory.iterdir(), key=lambda p: p.name)
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, FileNotFoundError) or not directory.is_dir():
      raise FileNotFoundError(f"{directory} is not a directory: {e}") from e
    raise


def remove(path: PathLike) -> None:
  """Removes a file or a directory tree; a missing path is fine.

  A local symbolic link is removed itself: what it points at is never
  touched (a link to a directory is not a tree to delete).
  """
  target = as_path(path)
  if is_local(target) and os.path.islink(target):
    os.unlink(target)
  elif target.is_dir():
    target.rmtree(missing_ok=True)  # Not a link (checked above).
  elif target.exists():
    target.unlink(missing_ok=True)


def move_aside(path: PathLike, new_name: str) -> str:
  """Renames `path` to `new_name` in the same directory; never deletes it.

  Local: one rename. Remote (no renames on object stores): a copy of the
  tree, then the original's removal, so a crash in between leaves both.

  Returns:
    The new path.
  """
  source = as_path(path)
  dest = source.parent / new_name
  if is_local(source):
    os.rename(source, dest)  # Moves a link itself, never its target.
  elif source.is_dir():
    copy_tree(source, dest)
    remove(source)
  else:
    copy_file(source, dest)
    remove(source)
  return os.fspath(dest)


def copy_file(src: PathLike, dst: PathLike) -> None:
  """Streams one file from `src` to `dst` (any mix of local and remote)."""
  with as_path(src).open("rb") as r, as_path(dst).open("wb") as w:
    shutil.copyfileobj(r, w, _CHUNK)


def copy_tree(src: PathLike, dst: PathLike, *,
              skip: tuple[str, ...] = ()) -> None:
  """Copies the files under directory `src` to `dst` (created as needed).

  Args:
    src: the source directory.
    dst: the destination directory.
    skip: paths relative to `src` (POSIX separators) not to copy.
  """
  src, dst = as_path(src), as_path(dst)
  dst.mkdir(parents=True, exist_ok=True)
  for child in listdir(src):
    if child.name in skip:
      continue
    if child.is_dir():
      copy_tree(child, dst / child.name, skip=tuple(
          s.split("/", 1)[1] for s in skip
          if s.startswith(child.name + "/")))
    else:
      copy_file(child, dst / child.name)


def local_lstat(path: PathLike) -> os.stat_result | None:
  """`os.lstat` of a local `path` (links not followed); None when it does
  not exist or is remote (an object store has no links or FIFOs)."""
  if not is_local(path):
    return None
  try:
    return os.lstat(path)
  except FileNotFoundError:
    return None


def file_kind(mode: int) -> str:
  """What an `st_mode` that is no regular file is, for messages."""
  return ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if
          stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else
          "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
          "not a regular file")


def check_own_file(path: PathLike) -> None:
  """Refuses a job's own record file (metrics.jsonl, a ledger,
  history.json, gate.jsonl) that is a link, has other names, or is not a
  regular file (a FIFO would block the job forever; a device would be
  written to). A missing file, or a remote one, passes.

  Raises:
    LinkRefusedError: a symbolic link, or a file with several hard links.
    NotRegularFileError: a FIFO, a directory, a device or a socket.
  """
  info = local_lstat(path)
  if info is None:
    return
  if stat.S_ISLNK(info.st_mode):
    raise LinkRefusedError(
        f"{os.fspath(path)} is a symbolic link (to "
        f"{os.readlink(path)!r}); a job reads and writes its own records "
        "only, never through a link. Remove the link (or replace it with a "
        "copy).")
  if not stat.S_ISREG(info.st_mode):
    raise NotRegularFileError(
        f"{os.fspath(path)} is {file_kind(info.st_mode)}, not the job's "
        "record file; nothing was read or written. Remove it.")
  if info.st_nlink != 1:
    raise LinkRefusedError(
        f"{os.fspath(path)} has {info.st_nlink} hard links (other names for "
        "the same file, which the job would rewrite); remove it or replace "
        "it with a copy.")


def check_own_dir(path: PathLike, what: str) -> None:
  """Refuses a job's own directory below its workdir (`checkpoints/`,
  `index/`, `eval/`, `summaries/`) that is a link or not a directory; a
  missing one, or a remote one, passes.

  Raises:
    LinkRefusedError, NotRegularFileError: naming `what` and the path.
  """
  info = local_lstat(path)
  if info is None:
    return
  if stat.S_ISLNK(info.st_mode):
    raise LinkRefusedError(
        f"{what} {os.fspath(path)} is a symbolic link (to "
        f"{os.readlink(path)!r}); a job never reads or writes its own "
        "directories through a link, since it could lead anywhere. Remove "
        "the link (a whole workdir may be a link; what it holds may not).")
  if not stat.S_ISDIR(info.st_mode):
    raise NotRegularFileError(
        f"{what} {os.fspath(path)} is {file_kind(info.st_mode)}, not a "
        "directory; remove it.")


def refuse_output_link(path: str) -> None:
  """LinkRefusedError when local output `path` is a symbolic link."""
  if os.path.islink(path):
    raise LinkRefusedError(
        f"{path} is a symbolic link (to {os.readlink(path)!r}); a job "
        "never writes or deletes its output through a link, since it could "
        "lead anywhere. Remove the link or choose another output path.")


def replace_local_dir(tmp_dir: str, directory: str) -> None:
  """Moves the finished local directory `tmp_dir` to `directory`.

  An existing `directory` is moved into a fresh aside directory first and
  deleted only after the new one is in place, so a crash leaves either the
  old or the new tree under `directory` (plus, at worst, a `.<name>.old-*`
  sibling), never a mix. A `directory` that is a link is refused.
  """
  refuse_output_link(directory)
  if not os.path.exists(directory):
    os.rename(tmp_dir, directory)
    return
  aside = mkdtemp(prefix=f".{os.path.basename(directory)}.old-",
                  dir=os.path.dirname(os.path.abspath(directory)))
  os.rename(directory, os.path.join(aside, "old"))
  os.rename(tmp_dir, directory)
  shutil.rmtree(aside)  # Made above; holds the replaced output only.


def new_output_tmp(directory: PathLike, *, overwrite: bool = False,
                   exists: str = "") -> str:
  """A fresh, empty temporary sibling of local output `directory`.

  The first half of `outputs.output_dir` (which also checks who owns
  `directory` and marks the temporary; jobs call that one): finish with `replace_local_dir(tmp, directory)`, or on failure
  `discard_output_tmp(tmp)`.

  Raises:
    LinkRefusedError: `directory` is a symbolic link.
    FileExistsError: `directory` exists and not `overwrite` (message:
      `exists`, or a default).
  """
  directory = os.path.abspath(os.fspath(directory))
  refuse_output_link(directory)
  if os.path.exists(directory) and not overwrite:
    raise FileExistsError(exists or f"{directory} exists; choose a new "
                          "output directory.")
  parent = os.path.dirname(directory)
  os.makedirs(parent, exist_ok=True)
  prefix = f".{os.path.basename(directory)}.tmp-"
  _remove_dead_output_tmps(parent, prefix)
  # mkdtemp makes a new directory (never an existing one or a link); the
  # pid in its name lets a later job remove it if this one is killed.
  return mkdtemp(prefix=f"{prefix}{_host_tag()}.{os.getpid()}-",
                 dir=parent)


def _host_tag() -> str:
  """A short tag of this host, so that a temporary's pid is only judged
  on the host that made it (a shared disk has others)."""
  import socket  # pylint: disable=g-import-not-at-top
  return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _remove_dead_output_tmps(parent: str, prefix: str) -> None:
  """Removes `<prefix><host>.<pid>-*` temporaries of jobs that died (kill
  -9) before they could delete their own: made on this host by a pid that
  no longer runs. A link of such a name is left alone."""
  mine = f"{prefix}{_host_tag()}."
  for name in os.listdir(parent):
    pid = name[len(mine):].split("-", 1)[0]
    path = os.path.join(parent, name)
    if (name.startswith(mine) and pid.isascii() and pid.isdigit()
        and not _pid_alive(int(pid)) and not os.path.islink(path)
        and os.path.isdir(path)):
      shutil.rmtree(path, ignore_errors=True)  # A dead job's own mkdtemp.


def discard_output_tmp(tmp_dir: str) -> None:
  """Deletes a temporary made by `new_output_tmp` (and only such a one)."""
  if not os.path.basename(tmp_dir).startswith(".") or ".tmp-" not in (
      os.path.basename(tmp_dir)) or os.path.islink(tmp_dir):
    raise ValueError(f"{tmp_dir} is not a temporary of new_output_tmp.")
  shutil.rmtree(tmp_dir, ignore_errors=True)  # Checked: ours.


def cache_root() -> str:
  """Where remote files are copied to be memory-mapped.

  `$REALM_JAX_CACHE_DIR`, else `<tempdir>/realm_jax_cache` (on a TPU VM:
  /tmp, the boot disk; set the variable to use a larger local disk).
  """
  return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(),
                                                   "realm_jax_cache")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _remove_dead_temporaries(root: str, key: str) -> None:
  """Removes `.<key>.tmp-<pid>` copies of processes that died mid-copy."""
  prefix = f".{key}.tmp-"
  for name in os.listdir(root):
    pid = name[len(prefix):]
    if name.startswith(prefix) and pid.isdigit() and not _pid_alive(
        int(pid)):
      remove(os.path.join(root, name))


def local_copy(path: PathLike, key: str, *,
               cache_dir: PathLike | None = None) -> str:
  """A local copy of file or directory `path`, made once under `key`.

  The copy goes to `<cache_dir>/.<key>.tmp-<pid>` and is renamed to
  `<cache_dir>/<key>` when complete, so a copy that exists is whole;
  processes on one host share it (a loser of a race drops its own copy).
  `key` must change whenever the content does (e.g. a content
  fingerprint): an existing copy is returned without looking at `path`.

  Args:
    path: a remote (or local) file or directory.
    key: the cache entry's name.
    cache_dir: the cache directory (default `cache_root()`).

  Returns:
    The local path of the copy.
  """
  if not key or "/" in key or key.startswith("."):
    raise ValueError(f"cache key {key!r} must be a plain file name.")
  root = os.fspath(cache_dir) if cache_dir is not None else cache_root()
  dest = os.path.join(root, key)
  if os.path.exists(dest):
    return dest
  os.makedirs(root, exist_ok=True)
  _remove_dead_temporaries(root, key)
  tmp = os.path.join(root, f".{key}.tmp-{os.getpid()}")
  remove(tmp)
  src = as_path(path)
  try:
    if src.is_dir():
      copy_tree(src, tmp)
    else:
      copy_file(src, tmp)
    try:
      os.rename(tmp, dest)  # A fresh cache entry from its own tmp.
    except OSError:
      if not os.path.exists(dest):
        raise
      # Another process finished the same copy first; use it.
  finally:
    remove(tmp)
  return dest


def package_file(package: str, *parts: str, install: str) -> str:
  """A file inside an installed package, found without importing it.

  Raises:
    FileNotFoundError: the package or the file is missing; the message ends
      with `install` (how to install it, or what to pass instead).
  """
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"The Python package {package} is not "
                            f"installed; {install}.")
  path = os.path.join(spec.submodule_search_locations[0], *parts)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing from the installed "
                            f"{package}; {install}.")
  return path


def sha256_file(path: PathLike) -> str:
  """The sha256 hex digest of a local or remote file's bytes."""
  digest = hashlib.sha256()
  with as_path(path).open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      digest.update(chunk)
  return digest.hexdigest()


def save_npy(path: str, array: Any) -> None:
  """`np.save` of `array` (no pickles) to local file `path`, whose failure
  says what failed: numpy's own writer reports a full disk as
  `OSError('1152 requested and 992 written')`, naming neither the file nor
  ENOSPC; here the data goes through Python's file writes, and an OSError
  is raised again with its errno, the file and how much space is left.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  array = np.ascontiguousarray(array)
  try:
    with open(path, "wb") as f:
      np.lib.format.write_array_header_1_0(
          f, np.lib.format.header_data_from_array_1_0(array))
      f.write(memoryview(array.reshape(-1)).cast("B"))
  except OSError as e:
    free = ""
    try:
      stat = os.statvfs(os.path.dirname(os.path.abspath(path)))
      free = f"; {stat.f_bavail * stat.f_frsize} bytes free there"
    except OSError:
      pass
    raise OSError(e.errno, f"{os.strerror(e.errno) if e.errno else e} "
                  f"while writing {path} ({array.nbytes} bytes of data"
                  f"{free})", path) from e


def write_json(path: PathLike, obj: Any) -> None:
  """Writes JSON atomically (local: temp file + rename; GCS: one upload)."""
  atomic_write_text(path, json.dumps(obj, indent=1))


def append_jsonl(path: PathLike, record: dict[str, Any]) -> None:
  """Appends one JSON line (on GCS: rewrites the small file; no appends)."""
  append_text(path, json.dumps(record) + "\n")


def read_manifest(
    directory: PathLike, *, what: str, build: str,
    format_version: int | None = None, fields: Sequence[str] = (),
    check: Callable[[dict[str, Any]], Any] | None = None,
    name: str = "manifest.json",
    missing_error: type[Exception] = FileNotFoundError,
    error: type[ValueError] = ValueError) -> dict[str, Any]:
  """Parses and checks `<directory>/<name>`, the JSON manifest of a `what`.

  Every error names the file, what is wrong and what to do about it, so
  the stores, caches and indices that have a manifest fail alike.

  Args:
    directory: what the manifest describes (local or remote).
    what: its kind for the messages ("block store").
    build: how to make one ("build it with `python -m ...`").
    format_version: the `format_version` this code reads; None: unchecked.
    fields: keys the manifest must have.
    check: `manifest -> Any`: more checks; its KeyError, TypeError or
      ValueError reports a corrupt manifest.
    name: the manifest's file name.
    missing_error: raised when the directory or the manifest is missing.
    error: raised for a corrupt or outdated manifest.
  """
  path = join(directory, name)
  if not as_path(directory).is_dir():
    raise missing_error(f"{what} {directory} does not exist; {build}.")
  if not as_path(path).exists():
    raise missing_error(f"{path} is missing: {directory} is a partial "
                        f"{what} (an interrupted build?); rebuild it.")
  try:
    manifest = json.loads(read_text(path))  # The manifest reader.
    missing = [key for key in fields if key not in manifest]
    if missing:
      raise KeyError(f"no {missing}")
    if check is not None:
      check(manifest)
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise error(f"{path} is corrupt ({e!r}); rebuild the {what}.") from e
  if format_version is not None and manifest.get(
      "format_version") != format_version:
    raise error(f"{path}: format_version {manifest.get('format_version')} "
                f"is not {format_version}; rebuild the {what} with this "
                "version.")
  return manifest

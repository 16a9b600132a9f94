"""One owner per output directory: an exclusive lease for every writing job.

Two trainers on one workdir resume from each other's checkpoints and
interleave their metrics; two index builders delete each other's
publications. Every job that writes (trainers, the index builder, the
evaluation job) therefore holds a lease on what it writes for as long as it
runs, and a second job asking for the same lease is refused within seconds
with the holder's name, host, pid and start time.

- Local directories: `fcntl.flock` on `<dir>/.lease`. The kernel drops the
  lock when the holder exits or is killed (even `kill -9`), so a dead
  holder never blocks anyone; the file's JSON only names the holder.
- Remote directories (gs://...; no locks): the lease file holds the owner
  and a heartbeat that a daemon thread rewrites every `heartbeat_seconds`.
  A lease whose heartbeat is older than `stale_seconds` is taken over (its
  holder died without releasing it), and so, at once, is one whose holder
  was a process of this host that no longer exists; after writing, the new holder reads
  the file back once more after a short delay and gives up if another
  writer won the race. This is best effort (object stores have no
  compare-and-swap here), which the heartbeat interval makes ample for
  jobs started by people or schedulers.

Only process 0 of a multi-host job takes the lease (`distributed.py`
broadcasts its outcome): the workdir belongs to the job, not to a host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
import uuid
from typing import Iterator

from absl import logging
import numpy as np

from realm_jax.core import io_utils

LEASE_FILE = ".lease"
# Remote leases: a heartbeat older than this means the holder died.
STALE_SECONDS = 120.0


class LeaseHeldError(RuntimeError):
  """Another live job owns the directory."""


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds a lease."""
  job: str
  host: str
  pid: int
  token: str
  started: float
  heartbeat: float

  def describe(self, *, heartbeat: bool = True) -> str:
    """Who, where and since when.

    Args:
      heartbeat: mention the last heartbeat; only remote leases beat (a
        local lease's file is written once, so its age says nothing).
    """
    started = datetime.datetime.fromtimestamp(self.started).isoformat(
        timespec="seconds")
    beat = (f", last heartbeat {time.time() - self.heartbeat:.0f} s ago"
            if heartbeat else "")
    return (f"{self.job} (pid {self.pid} on {self.host}, started "
            f"{started}{beat})")

  @classmethod
  def parse(cls, text: str) -> "Holder | None":
    try:
      d = json.loads(text)  # Bad text: None (an unknown holder).
      return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})
    except (ValueError, KeyError, TypeError):
      return None


def _refuse_shared_file(fd: int, path: str) -> None:
  """Closes `fd` and refuses a lease file that is not the job's own plain
  file: a hard link (other names share its bytes, which the lease would
  truncate and overwrite) or not a regular file."""
  info = os.fstat(fd)
  if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
    return
  os.close(fd)
  what = (f"has {info.st_nlink} hard links (other names for the same "
          "file, which the lease would truncate and overwrite)"
          if stat.S_ISREG(info.st_mode) else "is not a regular file")
  raise io_utils.LinkRefusedError(
      f"{path} {what}; a job writes its lease only to a file of its own. "
      "Remove it (the other names keep the content) and start the job "
      "again.")


def _refusal(directory: str, holder: Holder | None) -> LeaseHeldError:
  who = holder.describe(heartbeat=not io_utils.is_local(
      directory)) if holder else "another job"
  return LeaseHeldError(
      f"{directory} is in use by {who}. One job writes a directory at a "
      "time: stop that job, wait for it to finish, or give this one "
      "another directory.")


class Lease:
  """An exclusive lease on a directory; a context manager.

      with Lease(workdir, job="pretrain"):
        ...  # the only writer of workdir

  Args:
    directory: the directory owned (created if missing).
    job: what holds it (shown to a refused job).
    heartbeat_seconds, stale_seconds: remote leases only (see module
      docstring).
  """

  def __init__(self, directory: io_utils.PathLike, *, job: str,
               heartbeat_seconds: float = 30.0,
               stale_seconds: float = STALE_SECONDS):
    if stale_seconds <= 2 * heartbeat_seconds:
      raise ValueError("stale_seconds must exceed two heartbeats.")
    self.directory = io_utils.absolute(directory)
    self.path = io_utils.join(self.directory, LEASE_FILE)
    self.job = job
    self.heartbeat_seconds = heartbeat_seconds
    self.stale_seconds = stale_seconds
    self._fd: int | None = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    now = time.time()
    self.holder = Holder(job=job, host=socket.gethostname(), pid=os.getpid(),
                         token=uuid.uuid4().hex, started=now, heartbeat=now)

  # -- public --------------------------------------------------------------

  def acquire(self) -> "Lease":
    io_utils.makedirs(self.directory)
    if io_utils.is_local(self.directory):
      self._acquire_local()
    else:
      self._acquire_remote()
    logging.info("%s: leased to %s", self.directory, self.holder.describe(
        heartbeat=not io_utils.is_local(self.directory)))
    return self

  def release(self) -> None:
    if self._fd is not None:
      fd, self._fd = self._fd, None
      # Unnamed before unlocked: `live_holder` reads a name as a live job.
      os.ftruncate(fd, 0)
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
      if self._current_remote() == self.holder.token:
        io_utils.remove(self.path)

  def __enter__(self) -> "Lease":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()

  # -- local: flock ----------------------------------------------------------

  def _acquire_local(self) -> None:
    # O_NOFOLLOW: a `.lease` planted as a link would have this job truncate
    # and overwrite whatever file it points at.
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      raise io_utils.LinkRefusedError(
          f"{self.path} is a symbolic link (to {os.readlink(self.path)!r}); "
          "a job never writes through a link in its own directory. Remove "
          "the link and start the job again.") from None
    _refuse_shared_file(fd, self.path)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
        raise
      holder = None
      for _ in range(20):  # The holder may be writing its name just now.
        holder = Holder.parse(_read_local(self.path))
        if holder:
          break
        time.sleep(0.05)
      raise _refusal(self.directory, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(dataclasses.asdict(self.holder)).encode(), 0)
    self._fd = fd

  # -- remote: heartbeat file ----------------------------------------------

  def _read_remote(self) -> Holder | None:
    try:
      return Holder.parse(io_utils.read_text(self.path))
    except FileNotFoundError:
      return None

  def _current_remote(self) -> str | None:
    holder = self._read_remote()
    return holder.token if holder else None

  def _write_remote(self) -> None:
    self.holder = dataclasses.replace(self.holder, heartbeat=time.time())
    io_utils.atomic_write_text(self.path,
                               json.dumps(dataclasses.asdict(self.holder)))

  def _acquire_remote(self) -> None:
    current = self._read_remote()
    if current is not None:
      age = time.time() - current.heartbeat
      # A holder on this host whose process is gone (kill -9, a crash)
      # cannot heartbeat again: its job is resumed now, not in
      # `stale_seconds` (gs:// has no lock that dies with its holder).
      dead_here = (current.host == socket.gethostname()
                   and current.pid != os.getpid()
                   and not _pid_alive(current.pid))
      if age < self.stale_seconds and not dead_here:
        raise _refusal(self.directory, current)
      logging.warning("%s: taking over the lease of %s (%s).",
                      self.directory, current.describe(),
                      "its process is gone" if dead_here else
                      f"no heartbeat for {age:.0f} s > "
                      f"{self.stale_seconds:.0f} s")
    self._write_remote()
    time.sleep(min(1.0, self.heartbeat_seconds / 4))
    winner = self._read_remote()
    if winner is None or winner.token != self.holder.token:
      raise _refusal(self.directory, winner)
    self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                    name=f"lease-{self.job}")
    self._thread.start()

  def _heartbeat(self) -> None:
    while not self._stop.wait(self.heartbeat_seconds):
      try:
        if self._current_remote() != self.holder.token:
          logging.error("%s: the lease was taken over by %s; this job no "
                        "longer owns the directory.", self.directory,
                        self._read_remote())
          return
        self._write_remote()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("%s: lease heartbeat failed (%s); retrying.",
                        self.path, e)


def _read_local(path: str) -> str:
  """A local lease file's text ("" if missing), never through a link."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
  except OSError as e:
    if e.errno in (errno.ENOENT, errno.ELOOP):
      return ""
    raise
  with os.fdopen(fd, encoding="utf-8") as f:
    return f.read()


def live_holder(directory: io_utils.PathLike) -> Holder | None:
  """The job that holds `directory`'s lease now, or None; takes nothing.

  For side jobs that must know whether the owner of a directory still runs
  (the index builder asks whether a trainer continues a run that left a
  DONE marker). Remote: a holder whose heartbeat is fresh (younger than the
  default `stale_seconds`). Local: the holder named in `.lease`, when it
  runs on this host and its pid is alive; a lease is only locked, never
  probed here, since even a brief probe lock would make a starting owner
  refuse itself. A holder on another host cannot be checked and counts as
  gone.
  """
  directory = io_utils.absolute(directory)
  path = io_utils.join(directory, LEASE_FILE)
  if not io_utils.is_local(directory):
    try:
      holder = Holder.parse(io_utils.read_text(path))
    except FileNotFoundError:
      return None
    if holder is None or time.time() - holder.heartbeat >= STALE_SECONDS:
      return None
    return holder
  holder = Holder.parse(_read_local(path))
  if holder is None or holder.host != socket.gethostname():
    return None
  return holder if holder.pid == os.getpid() or _pid_alive(
      holder.pid) else None


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Alive, owned by another user.
    return True
  return True


@contextlib.contextmanager
def job_lease(directory: io_utils.PathLike, job: str,
              **kwargs) -> Iterator[Lease | None]:
  """The lease of a (possibly multi-host) job: process 0 holds it.

  Every process learns whether process 0 got it; all of them raise
  `LeaseHeldError` when it did not (process 0 with the holder's name).
  """
  from realm_jax.core import distributed  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  lease, error = None, None
  if jax.process_index() == 0:
    try:
      lease = Lease(directory, job=job, **kwargs).acquire()
    except LeaseHeldError as e:
      error = e
  if jax.process_count() > 1:
    ok = bool(distributed.broadcast_from_chief(np.bool_(error is None)))
  else:
    ok = error is None
  if not ok:
    raise error or LeaseHeldError(
        f"{directory}: process 0 could not lease it (see its log).")
  try:
    yield lease
  finally:
    if lease is not None:
      lease.release()

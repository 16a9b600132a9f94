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
  holder died without releasing it); after writing, the new holder reads
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
import threading
import time
import uuid
from typing import Iterator

from absl import logging
import numpy as np

from realm_jax.core import io_utils

LEASE_FILE = ".lease"


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

  def describe(self) -> str:
    started = datetime.datetime.fromtimestamp(self.started).isoformat(
        timespec="seconds")
    return (f"{self.job} (pid {self.pid} on {self.host}, started "
            f"{started}, last heartbeat {time.time() - self.heartbeat:.0f} s "
            "ago)")

  @classmethod
  def parse(cls, text: str) -> "Holder | None":
    try:
      d = json.loads(text)
      return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})
    except (ValueError, KeyError, TypeError):
      return None


def _refusal(directory: str, holder: Holder | None) -> LeaseHeldError:
  who = holder.describe() if holder else "another job"
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
               stale_seconds: float = 120.0):
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
    logging.info("%s: leased to %s", self.directory, self.holder.describe())
    return self

  def release(self) -> None:
    if self._fd is not None:
      fd, self._fd = self._fd, None
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
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
        raise
      holder = None
      for _ in range(20):  # The holder may be writing its name just now.
        with open(self.path, encoding="utf-8") as f:
          holder = Holder.parse(f.read())
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
      if age < self.stale_seconds:
        raise _refusal(self.directory, current)
      logging.warning("%s: taking over the lease of %s (no heartbeat for "
                      "%.0f s > %.0f s).", self.directory,
                      current.describe(), age, self.stale_seconds)
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

"""The index builder's progress, for a trainer waiting on it.

The builder's process 0 records what it is doing in
`<index root>/.progress.json` (`BuildProgress`: embedding, publishing,
retrying a failed publication); `builder_status` reads it with the index
root's lease to tell a builder at work from one that is gone, stuck or
failing (`watcher.IndexWatcher.wait_for_index` reports it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from absl import logging

from realm_jax.core import io_utils
from realm_jax.core import lease as lease_lib

PROGRESS = ".progress.json"
# An embedding builder that has not recorded a batch for this long counts
# as stuck (the lease's own bound; a batch takes seconds, the first one's
# compilation under a minute on 2 loaded cores). A searcher build records
# nothing until it ends (ScaNN over millions of rows takes minutes).
PROGRESS_STALE_SECONDS = lease_lib.STALE_SECONDS

PathLike = io_utils.PathLike


class BuildProgress:
  """The index builder's progress on one index, in `<root>/.progress.json`.

  Written by the builder's process 0 (JSON, atomically) as it embeds the
  corpus (`on_embedded`, at most every `every_seconds`), builds and
  publishes, or retries a failed publication (`retrying`), so that a
  trainer waiting for an index can tell a builder at work from one that is
  gone or failing (`IndexWatcher.wait_for_index`).
  """

  def __init__(self, index_root: PathLike, step: int, *,
               every_seconds: float = 5.0):
    self.path = io_utils.join(index_root, PROGRESS)
    self.step, self.every_seconds = int(step), every_seconds
    self._written = 0.0

  def write(self, stage: str, done: int = 0, total: int = 0,
            error: str = "") -> None:
    record = {"step": self.step, "stage": stage, "done": int(done),
              "total": int(total), "error": error, "pid": os.getpid(),
              "host": socket.gethostname(), "updated": time.time()}
    try:
      io_utils.atomic_write_text(self.path, json.dumps(record))
    except OSError as e:  # Progress is advice: never fail a build on it.
      logging.warning("could not write %s: %s", self.path, e)
    self._written = time.time()

  def on_embedded(self, done: int, total: int) -> None:
    if done >= total or time.time() - self._written >= self.every_seconds:
      self.write("embedding", done, total)

  def retrying(self, error: str) -> None:
    self.write("retrying", error=error)


def read_progress(index_root: PathLike) -> dict[str, Any] | None:
  """The builder's last `BuildProgress` record, or None (missing, a link,
  or not such a record)."""
  path = io_utils.join(index_root, PROGRESS)
  try:
    io_utils.check_no_links(path, index_root)
    record = json.loads(io_utils.read_text(path))
  except (OSError, ValueError, io_utils.LinkRefusedError):
    return None
  keys = {"step": int, "stage": str, "done": int, "total": int,
          "error": str, "pid": int, "host": str, "updated": float}
  if not isinstance(record, dict) or not all(
      isinstance(record.get(k), (int, float) if t is float else t)
      for k, t in keys.items()):
    return None
  return record


def builder_status(index_root: PathLike) -> tuple[bool, str]:
  """(at work, what the index builder is doing) for a waiting trainer.

  At work: the job holding the index root's lease (`core.lease`) wrote
  the progress record, is not retrying a failed publication, and, while
  embedding, recorded a batch within `PROGRESS_STALE_SECONDS`. Otherwise
  the text says what is wrong.
  """
  holder = lease_lib.live_holder(index_root)
  if holder is None:
    return False, "no live index builder holds its lease"
  who = f"the {holder.describe(heartbeat=False)}"
  record = read_progress(index_root)
  if record is None or (holder.pid, holder.host) != (record["pid"],
                                                     record["host"]):
    return False, f"{who} has reported no progress"
  age = time.time() - record["updated"]
  if record["stage"] == "retrying":
    return False, (f"{who} is retrying a failed publication of index "
                   f"{record['step']}: {record['error']}")
  if record["stage"] == "embedding" and age >= PROGRESS_STALE_SECONDS:
    return False, f"{who} has reported no progress for {age:.0f} s"
  doing = f"building index {record['step']} ({record['stage']})"
  if record["stage"] == "embedding" and record["total"]:
    doing = (f"embedding the corpus for index {record['step']}: "
             f"{record['done']:,} of {record['total']:,} blocks "
             f"({100 * record['done'] / record['total']:.0f}%)")
  return True, f"{who} is {doing} ({age:.0f} s ago)"

"""The trainer's index watcher: a daemon thread that polls an index root's
LATEST, loads and verifies each new publication off the training thread,
and swaps it in between steps (`IndexWatcher.maybe_swap`)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from absl import logging

from realm_jax.core import io_utils
from realm_jax.index import build_progress
from realm_jax.index.publish import (LATEST, Expectation, IndexRejectedError,
                                     PublishedIndex, load_index,
                                     parse_index_name, read_latest_name)

PathLike = io_utils.PathLike


def _label(index: PublishedIndex) -> str:
  """`6`, or `6 (revision 6.1)` for a re-publication, for the logs."""
  if not index.revision:
    return str(index.step)
  return f"{index.step} (revision {index.step}.{index.revision})"


class IndexWatcher:
  """Trainer side: loads new indices in the background, swaps between steps.

  A daemon thread polls LATEST; a new publication, a newer step or a
  re-publication of the served one (`<step>.<n>`), is loaded and verified
  off the training thread and held as pending. The trainer calls
  `maybe_swap()` between steps. A partial, corrupt or mismatched index is
  never used: the old one stays live and the reason is logged (once per
  publication).
  """

  def __init__(self, index_root: PathLike,
               expect: Expectation = Expectation(), *,
               poll_seconds: float = 2.0,
               loader: Callable[..., PublishedIndex] = load_index):
    self.index_root = index_root
    self.expect = expect
    self.poll_seconds = poll_seconds
    self._loader = loader
    self._lock = threading.Lock()
    self._current: PublishedIndex | None = None
    self._pending: PublishedIndex | None = None
    # Publications looked at, as (step, revision) (`PublishedIndex.key`).
    self._seen: set[tuple[int, int]] = set()
    self.rejected: dict[int, str] = {}
    # (index step, loaded and verified at, swapped in at), wall-clock.
    self.swap_log: list[tuple[int, float, float]] = []
    self._loaded_at: dict[tuple[int, int], float] = {}
    self._stop = threading.Event()
    self._new = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name="index-watcher")
    self._thread.start()

  def _newest_known(self) -> tuple[int, int]:
    keys = [i.key for i in (self._current, self._pending) if i is not None]
    return max(keys, default=(-1, -1))

  def poll_once(self) -> None:
    """One look at LATEST (also called by the thread)."""
    try:
      name = read_latest_name(self.index_root)
    except IndexRejectedError as e:
      logging.warning("Index watcher: %s", e)
      return
    if name is None:
      return
    key = parse_index_name(name)
    if key in self._seen or key <= self._newest_known():
      return
    self._seen.add(key)
    step = key[0]
    try:
      index = self._loader(self.index_root, step, self.expect)
    except (IndexRejectedError, OSError) as e:
      self.rejected[step] = str(e)
      logging.warning("Index watcher: refusing index %s, keeping %s: %s",
                      name, self.current_step, e)
      return
    except Exception as e:  # pylint: disable=broad-except
      # Another filesystem error (e.g. tf.errors from GCS): maybe transient,
      # so the publication is tried again at the next poll.
      self._seen.discard(key)
      logging.warning("Index watcher: could not load index %s (%r); will "
                      "retry.", name, e)
      return
    with self._lock:
      self._pending = index
      self.rejected.pop(step, None)  # A later publication of it is fine.
      self._loaded_at[index.key] = time.time()
    self._new.set()
    logging.info("Index watcher: index %s loaded and verified.",
                 _label(index))

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        self.poll_once()
      except Exception as e:  # pylint: disable=broad-except
        # A flaky filesystem (reading LATEST on GCS) must not end the thread.
        logging.warning("Index watcher: poll failed (%r); retrying.", e)
      self._stop.wait(self.poll_seconds)

  def maybe_swap(self) -> bool:
    """Makes a pending index current; True if it did. Call between steps."""
    with self._lock:
      if self._pending is None:
        return False
      self._current, self._pending = self._pending, None
      self._new.clear()
      self.swap_log.append((self._current.step,
                            self._loaded_at.get(self._current.key, 0.0),
                            time.time()))
    logging.info("Index watcher: now serving index %s.",
                 _label(self._current))
    return True

  def _waiting_for(self) -> str:
    """Why there is no index to serve yet, and the ways out."""
    if self.rejected:
      why = "rejected " + "; ".join(
          f"index {step}: {reason}"
          for step, reason in sorted(self.rejected.items()))
    else:
      why = f"nothing is published there yet (no {LATEST})"
    return (f"{why}. Start (or fix) the index builder for this run, or "
            "let the trainer build its indices itself with "
            "PretrainConfig.index_mode=\"inline\" "
            "(--gin.pretrain.PretrainConfig.index_mode=\"'inline'\").")

  def _report_wait(self, seconds: float) -> None:
    """INFO while a live builder makes progress; else a WARNING with why."""
    at_work, builder = build_progress.builder_status(self.index_root)
    if at_work and not self.rejected:
      logging.info("Index watcher: waiting %.0f s for the first index under "
                   "%s: %s.", seconds, self.index_root, builder)
    else:
      logging.warning("Index watcher: no index to serve after %.0f s "
                      "under %s (%s): %s", seconds, self.index_root,
                      builder, self._waiting_for())

  def wait_for_index(self, timeout: float | None = None,
                     report_seconds: float = 30.0) -> PublishedIndex:
    """Blocks until an index is available (the first one), then swaps it in.

    Says what it waits for every `report_seconds`: at INFO while the index
    builder holding the root's lease reports progress (`builder_status`),
    else a WARNING with the ways out (each rejected index is also logged
    with its reason as the poll rejects it).

    Raises:
      TimeoutError: no valid index within `timeout` seconds; names every
        rejected index with its reason, and the ways out.
    """
    start = time.time()
    deadline = None if timeout is None else start + timeout
    next_report = start + report_seconds
    while self._current is None:
      if self.maybe_swap():
        break
      now = time.time()
      remaining = None if deadline is None else deadline - now
      if remaining is not None and remaining <= 0:
        raise TimeoutError(f"No valid index under {self.index_root} after "
                           f"{timeout} s: {self._waiting_for()}")
      if now >= next_report:
        self._report_wait(now - start)
        next_report = now + report_seconds
      self._new.wait(min(self.poll_seconds, remaining or self.poll_seconds))
    return self._current

  @property
  def current(self) -> PublishedIndex | None:
    return self._current

  @property
  def current_step(self) -> int | None:
    return None if self._current is None else self._current.step

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=10)

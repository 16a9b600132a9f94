"""Following a trainer's checkpoints until its run is over.

The index builder and the evaluation job both run beside a trainer, take
its checkpoints as they appear and stop when it is done. They share this
one loop, so that they cannot drift apart:

* DONE is read BEFORE the checkpoints are listed. The trainer writes DONE
  after its last checkpoint, so a listing made after seeing DONE holds
  that checkpoint; listing first can see DONE without the last checkpoint
  and end the follower one checkpoint short (the builder's final index was
  never built that way).
* DONE counts only when it records the newest checkpoint and no live job
  holds the workdir's lease (`realm_jax.core.lease`): a trainer extending
  a finished run finds the old DONE and clears it only before its first
  step.

Two modes: "newest" (the builder: the newest new checkpoint, superseded
ones skipped) and "every" (the evaluation job: each new checkpoint, in
ascending order).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from absl import logging

from realm_jax.core import checkpoints, io_utils
from realm_jax.core import lease as lease_lib

MODES = ("newest", "every")
# Why a follower stopped (`CheckpointFollower.stopped`), for the logs.
REASONS = {"done": "trainer is done", "timeout": "no DONE marker in time",
           "stop": "stop requested"}


def run_finished(ckpt_dir: io_utils.PathLike, *, grace: float = 0.0,
                 poll: float = 1.0) -> bool:
  """Whether the trainer's run is over: DONE records the newest checkpoint
  and no live job holds the workdir. With `grace` > 0, first waits up to
  `grace` seconds for a trainer that would continue the run."""
  workdir = io_utils.as_path(ckpt_dir).parent
  deadline = time.time() + grace
  while True:
    final = checkpoints.done_step(ckpt_dir)
    if final is None or final < max(checkpoints.finalized_steps(ckpt_dir),
                                    default=-1):
      return False  # No DONE, or a stale one: checkpoints came after it.
    holder = lease_lib.live_holder(workdir)
    if holder is not None:
      logging.log_every_n_seconds(
          logging.INFO, "DONE (step %d) is there, but %s holds %s: waiting "
          "for it to continue or to exit.", 60, final,
          holder.describe(heartbeat=not io_utils.is_local(workdir)), workdir)
      return False
    if time.time() >= deadline:
      return True
    logging.log_first_n(
        logging.INFO, "The run at %s is DONE at step %d; waiting up to %.0f "
        "s for a trainer that continues it.", 1, workdir, final, grace)
    time.sleep(poll)


class CheckpointFollower:
  """Yields a trainer's new checkpoint steps until its run is over.

  After each yielded step the consumer may call `retry(step)` (not readable
  yet: offered again after a pause) or `give_up(step)` (never offered
  again); otherwise the step counts as taken. `stopped` then says why the
  iteration ended: "done", "timeout" or "stop" (`stop.requested`).
  """

  def __init__(self, ckpt_dir: io_utils.PathLike, *, mode: str = "newest",
               after: int = -1, poll_seconds: float = 1.0,
               timeout: float | None = None, done_grace_seconds: float = 0.0,
               skip: Callable[[int], bool] = lambda step: False, stop=None,
               name: str = "follower"):
    if mode not in MODES:
      raise ValueError(f"mode={mode!r}; use one of {MODES}.")
    self.ckpt_dir, self.mode, self.last = ckpt_dir, mode, after
    self.poll, self.timeout, self.grace = (poll_seconds, timeout,
                                           done_grace_seconds)
    self._skip, self._stop, self._name = skip, stop, name
    self._given_up: set[int] = set()
    self._retry: int | None = None
    self.stopped: str | None = None

  def retry(self, step: int) -> None:
    self._retry = step

  def give_up(self, step: int) -> None:
    self._given_up.add(step)

  def _pending(self) -> list[int]:
    return [s for s in checkpoints.finalized_steps(self.ckpt_dir)
            if s > self.last and s not in self._given_up
            and not self._skip(s)]

  def __iter__(self) -> Iterator[int]:
    start, taken, first_look = time.time(), 0, True
    while True:
      # DONE first, then the listing (see the module docstring).
      done = run_finished(self.ckpt_dir, poll=self.poll)
      pending = self._pending()
      if pending:
        if self.mode == "newest" and len(pending) > 1:
          logging.info("%s: skipping superseded checkpoints %s", self._name,
                       pending[:-1])
        step = pending[-1] if self.mode == "newest" else pending[0]
        self._retry = None
        yield step
        if self._retry == step:
          time.sleep(self.poll)
        elif step not in self._given_up:
          self.last, taken = step, taken + 1
        continue
      if done and first_look and not taken and self.grace > 0:
        # A finished run, seen first: a trainer may be about to continue it.
        first_look = False
        if not run_finished(self.ckpt_dir, grace=self.grace, poll=self.poll):
          continue
      first_look = False
      if self._stop is not None and self._stop.requested:
        self.stopped = "stop"
      elif done:
        self.stopped = "done"
      elif self.timeout is not None and time.time() - start > self.timeout:
        logging.warning("%s: no DONE marker after %.0f s", self._name,
                        self.timeout)
        self.stopped = "timeout"
      if self.stopped:
        return
      time.sleep(self.poll)

"""The index a trainer retrieves from: served, swapped in, refreshed.

`IndexService` owns the served `publish.PublishedIndex` of a pre-training
run, in one of two modes:

* "builder": the index builder (its own job) publishes an index for each
  checkpoint; a watcher swaps the newest one in before a step (at the same
  step on every host) and `StalenessMonitor` warns, or stops the run, when
  none arrives;
* "inline": the trainer embeds the corpus itself right after checkpoint s
  and serves index s (`refresh`).

A frozen service (query-side training: the document tower never changes)
serves the index of the first step for the whole run. Every served index
is handed to `on_serve` (the trainer's device copy of it, if any).
"""

from __future__ import annotations

from typing import Any, Callable

from absl import logging

from realm_jax.core import io_utils, parallel
from realm_jax.index import build, publish
from realm_jax.index import watcher as watcher_lib

MODES = ("builder", "inline")


class StaleIndexError(RuntimeError):
  """The served index is older than the run's `stale_index_error`."""


class StalenessMonitor:
  """Builder mode: notices when no fresh index arrives.

  Warns once per served index past `warning` checkpoint intervals, and
  stops the run past `error` intervals (when set).
  """

  def __init__(self, watcher: watcher_lib.IndexWatcher, *, refresh_every: int,
               warning: float, error: float = 0.0):
    self.watcher, self.refresh_every = watcher, refresh_every
    self.warning, self.error = warning, error
    self._warned_for: int | None = None

  def check(self, step: int, index_step: int) -> None:
    age = step - index_step
    intervals = age / self.refresh_every
    if self.error and intervals > self.error:
      raise StaleIndexError(
          f"step {step}: the served index {index_step} is {age} steps old "
          f"(> {self.error:g} x refresh_every={self.refresh_every}) "
          f"and no newer index reached {self.watcher.index_root}. Check the "
          "index builder's log (is it running? can it write there?), then "
          "rerun: training resumes from the last checkpoint.")
    if intervals > self.warning and self._warned_for != index_step:
      self._warned_for = index_step
      logging.warning(
          "STALE INDEX at step %d: still serving index %d (%d steps, > %g "
          "refresh intervals). Is the index builder running and able to "
          "write to %s? Rejected indices: %s", step, index_step, age,
          self.warning, self.watcher.index_root,
          self.watcher.rejected or "none")


class IndexService:
  """The served index of one pre-training run (see the module docstring)."""

  def __init__(self, *, root: str, store, retriever_config, mode: str,
               expect: publish.Expectation,
               build_config: build.IndexBuildConfig,
               wait_seconds: float, last_step: int, refresh_every: int = 1,
               frozen: bool = False,
               staleness: dict[str, Any] | None = None,
               on_serve: Callable[[publish.PublishedIndex], None] | None
               = None):
    if mode not in MODES:
      raise ValueError(f"index_mode={mode!r}; use one of {MODES}.")
    self.root, self.store, self.mode, self.expect = root, store, mode, expect
    # Inline mode builds each index with `build_config` (the run's
    # PretrainConfig.index_build), as the builder job would.
    self.retriever_config, self.build_config = (retriever_config,
                                                build_config)
    self.wait_seconds, self.last_step, self.frozen = (wait_seconds,
                                                      last_step, frozen)
    self.refresh_every = refresh_every
    self._staleness_args = dict(staleness or {}, refresh_every=refresh_every)
    self._on_serve = on_serve
    self.current: publish.PublishedIndex | None = None
    self.watcher: watcher_lib.IndexWatcher | None = None
    self.staleness: StalenessMonitor | None = None

  def _serve(self, index: publish.PublishedIndex) -> None:
    self.current = index
    if self._on_serve is not None:
      self._on_serve(index)

  def start(self, step: int, state, ckpt) -> None:
    """Serves the first index: waits for the builder's, loads this step's
    (inline: a resumed run serves the index of its own step, so it replays
    the same trajectory; a frozen run its one index), or builds it."""
    latest = publish.read_latest(self.root)
    if self.mode == "builder":
      self.watcher = watcher_lib.IndexWatcher(self.root, self.expect)
      self.staleness = StalenessMonitor(self.watcher,
                                        **self._staleness_args)
      self._serve(self.watcher.wait_for_index(timeout=self.wait_seconds))
    elif latest is not None and (
        latest == step or self.frozen
        or latest == step - step % self.refresh_every):  # (between refreshes)
      self._serve(publish.load_index(self.root, latest, self.expect))
    else:
      self.refresh(step, state, ckpt)
    logging.info("serving index %d at step %d", self.current.step, step)

  def refresh_due(self, step: int) -> bool:
    """Inline mode rebuilds the index after checkpoint `step` when it is a
    refresh step (a frozen service never does)."""
    return (self.mode == "inline" and not self.frozen
            and step < self.last_step and step % self.refresh_every == 0)

  def refresh(self, step: int, state, ckpt) -> None:
    """Inline mode: embeds the corpus with `state`'s retriever, publishes."""
    ckpt.wait_until_finished()  # Index s only after checkpoint s is durable.
    build.build_and_publish(
        retriever_params=parallel.host_copy(state.params["retriever"]),
        retriever_config=self.retriever_config, store=self.store,
        root=self.root, step=step, config=self.build_config)
    self._serve(publish.load_index(self.root, step, self.expect))

  def before_step(self, step: int) -> None:
    """Builder mode: swaps in a newer index, checks the served one's age."""
    if self.watcher is not None:
      if self.watcher.maybe_swap():
        self._serve(self.watcher.current)
      self.staleness.check(step, self.current.step)

  def close(self, workdir: str, is_chief: bool) -> None:
    """Stops the watcher; writes its swaps to <workdir>/index_swaps.json."""
    if self.watcher is None:
      return
    self.watcher.close()
    if is_chief:
      io_utils.write_json(
          io_utils.join(workdir, "index_swaps.json"),
          [{"index_step": s, "loaded_at": l, "swapped_at": w}
           for s, l, w in self.watcher.swap_log])

"""REALM's collapse guards: a hub and the null-document trap, reported once.

`CollapseGuard` counts the top-1 blocks of every batch; the trainer logs
their hubness per log window and the guard judges a pool of at least
`min_queries` recent queries (`pretrain.GuardConfig`).
"""

from __future__ import annotations

import collections

from absl import logging
import jax
import numpy as np

from realm_jax.core import parallel


class CollapseGuard:
  """Hubness of the retrieved blocks, and one loud warning per failure mode.

  REALM's two ways to stop learning (docs/results/learning.md): a hub, one
  block every query retrieves with a saturated softmax (its gradient is then
  exactly 0, so the state is absorbing); and the null-document trap,
  p(null|x) ~ 1, where the reader ignores retrieval and the retriever gets
  no signal. Both are judged on the most recent `guard_min_queries` queries
  or more (whole log windows pooled), never on one small batch.
  """

  def __init__(self, config):
    """`config`: the run's `pretrain.GuardConfig`."""
    self.config = config
    self._top1: list[np.ndarray] = []
    self._warned: set[str] = set()
    # The judged pool: (top-1 ids, p(null|x) of a logged step) per log
    # window, newest last, trimmed to the fewest covering min_queries.
    self._pool: collections.deque = collections.deque()
    self._window: np.ndarray | None = None  # the last hubness() window

  def add_top1(self, block_ids: np.ndarray | jax.Array) -> None:
    """Top-1 block ids of a batch. A device array is read only when the
    hubness is computed (at log time), so that the host never waits for the
    device to finish a batch just to count its top-1s."""
    self._top1.append(block_ids)

  def hubness(self) -> float:
    """Share of the queries since the last call whose top-1 is the single
    most common top-1 block (then starts a new window)."""
    if not self._top1:
      return 0.0
    top1 = np.concatenate([
        parallel.local_rows(x) if isinstance(x, jax.Array) else np.asarray(x)
        for x in self._top1]).reshape(-1)
    self._top1 = []
    self._window = top1
    return float(np.bincount(top1).max() / len(top1))

  def pooled(self, null_probability: float
             ) -> tuple[float, float, int] | None:
    """Adds the last log window (its top-1s, its p(null|x)) to the pool;
    returns (hubness, mean p(null|x), queries) over the pool, or None while
    it holds fewer than `guard_min_queries` queries."""
    window, self._window = self._window, None
    if window is None or not len(window):
      return None
    self._pool.append((window, float(null_probability)))
    minimum = self.config.min_queries
    while (len(self._pool) > 1 and
           sum(len(t) for t, _ in self._pool) - len(self._pool[0][0])
           >= minimum):
      self._pool.popleft()
    top1 = np.concatenate([t for t, _ in self._pool])
    if len(top1) < minimum:
      return None
    null = sum(len(t) * p for t, p in self._pool) / len(top1)
    return float(np.bincount(top1).max() / len(top1)), null, len(top1)

  def check(self, step: int, metrics: dict[str, float]) -> None:
    c = self.config
    pooled = self.pooled(metrics["null_probability"])
    if pooled is None:
      return
    hubness, null, n = pooled
    self._warn_once(
        "hubness", hubness > c.hubness_warning,
        "COLLAPSE WARNING at step %d: %.0f%% of the last %d queries "
        "retrieve the same block (hubness > %.2f); a hub's softmax "
        "saturates and its gradient vanishes. Lower the retriever's rate "
        "(RetrieverScheduleConfig.learning_rate_multiplier), warm the "
        "reader up first (GateConfig: the gate or latest_release) and start "
        "from an ICT-trained retriever.", step, 100 * hubness, n,
        c.hubness_warning)
    self._warn_once(
        "null", null > c.null_probability_warning,
        "COLLAPSE WARNING at step %d: p(null|x) = %.3f > %.2f over the "
        "last %d queries; the null document takes the retrieval mass and "
        "the retriever gets no gradient. Use "
        "RetrieverConfig.null_score='learned_mean', or a retriever whose "
        "document embeddings are trained (ICT).", step, null,
        c.null_probability_warning, n)

  def _warn_once(self, kind: str, failed: bool, message: str, *args) -> None:
    if failed and kind not in self._warned:
      self._warned.add(kind)
      logging.warning(message, *args)

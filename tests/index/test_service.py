"""The index service's refresh period (`PretrainConfig.refresh_every`):
an inline index is rebuilt on refresh steps only, and a builder's index is
judged stale in refresh intervals."""

import pytest

from realm_jax.index import publish
from realm_jax.index import service as service_lib
from realm_jax.index import watcher as watcher_lib


def _inline(refresh_every, **kwargs):
  return service_lib.IndexService(
      root="unused", store=None, retriever_config=None, mode="inline",
      expect=publish.Expectation(), build_config=None, wait_seconds=0.0,
      last_step=12, refresh_every=refresh_every, **kwargs)


def test_an_inline_index_is_rebuilt_on_refresh_steps_only():
  # Checkpoints every 2 steps; the last step's index is never needed.
  steps = range(2, 13, 2)
  assert [s for s in steps if _inline(2).refresh_due(s)] == [2, 4, 6, 8, 10]
  assert [s for s in steps if _inline(4).refresh_due(s)] == [4, 8]
  assert not any(_inline(4, frozen=True).refresh_due(s) for s in steps)


def test_staleness_is_counted_in_refresh_intervals(tmp_path):
  monitor = service_lib.StalenessMonitor(
      watcher_lib.IndexWatcher(str(tmp_path)), refresh_every=10, warning=2.0,
      error=4.0)
  monitor.check(40, 0)  # 4 intervals: at the error bound, not past it.
  with pytest.raises(service_lib.StaleIndexError,
                     match=r"index 0 is 41 steps old \(> 4 x "
                     r"refresh_every=10\)"):
    monitor.check(41, 0)

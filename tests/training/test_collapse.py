"""Collapse guards: REALM's two absorbing failure states are seen and reported.

The guard's hubness and warnings on constructed collapsed states; then a
small knowledge world (`realm_jax.testing.knowledge_world`), a short ICT
warm start and a few REALM steps with the recipe
(`experiments/pretrain_world_cpu.gin`: learned null score, a fixed reader
warm-up here, retriever on its own rate), during which p(null|x) and hubness must stay
under the issue's bounds and no collapse warning may fire.
"""

import gin
import numpy as np
import pytest
from absl import logging as absl_logging

from realm_jax import gin_cli
from realm_jax.model.realm import RealmConfig
from realm_jax.testing import knowledge_world
from realm_jax.training import collapse, pretrain

STEPS = 10


@pytest.fixture(scope="module")
def world_and_ict(tmp_path_factory):
  root = tmp_path_factory.mktemp("world")
  files = knowledge_world.write_world(str(root / "world"), num_people=64,
                                      num_heldout=16)
  return files, *knowledge_world.ict_warm_start(str(root), files, steps=30,
                                                batch_size=16)


def _pretrain(workdir, files, queries, ict_ckpts, bindings):
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_world_cpu.gin"], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{files.block_store}'",
      f"QUERIES = '{queries}'",
      f"INIT_FROM = 'checkpoint:{ict_ckpts}'",
      # A fixed warm-up (the recipe's gate is tested in
      # test_retriever_gate.py): 4 frozen steps, then the retriever moves.
      "pretrain.GateConfig.mode = 'steps'",
      "pretrain.RecallGuardConfig.queries = ''",
      f"pretrain.PretrainConfig.num_train_steps = {STEPS}",
      "pretrain.PretrainConfig.batch_size = 16",
      "pretrain.PretrainConfig.log_every = 2",
      # The target, p(null|x) <= 0.5 throughout, as the guard.
      "pretrain.GuardConfig.null_probability_warning = 0.5",
      "pretrain.GateConfig.latest_release = 4"] + bindings)
  try:
    return pretrain.train(
        config=gin.get_configurable(pretrain.PretrainConfig)(),
        model=gin.get_configurable(RealmConfig)())
  finally:
    gin.clear_config()


def _guard(monkeypatch):
  warnings = []
  monkeypatch.setattr(absl_logging, "warning",
                      lambda msg, *a: warnings.append(msg % a))
  config = pretrain.GuardConfig()
  assert config.min_queries == 64
  return collapse.CollapseGuard(config), warnings


def test_hubness_metric_is_per_log_window():
  guard = collapse.CollapseGuard(pretrain.GuardConfig())
  guard.add_top1(np.array([3, 3, 3, 5]))
  guard.add_top1(np.array([3, 3, 1, 3]))
  assert guard.hubness() == pytest.approx(6 / 8)
  assert guard.hubness() == 0.0  # a new window
  guard.add_top1(np.arange(8))
  assert guard.hubness() == pytest.approx(1 / 8)


def _log(guard, step, top1, null=0.2):
  guard.add_top1(np.asarray(top1))
  metrics = {"hubness": guard.hubness(), "null_probability": null}
  guard.check(step, metrics)
  return metrics


def test_a_healthy_small_batch_run_raises_no_alarm(monkeypatch):
  """Batches of 4 (the demo's): two equal top-1s in one batch are 50% of
  that batch, but nothing over the last 64 queries."""
  guard, warnings = _guard(monkeypatch)
  rng = np.random.default_rng(0)
  windows = [rng.integers(0, 1000, 4) for _ in range(40)]
  windows[5] = np.array([7, 7, 1, 2])
  windows[20] = np.array([9, 9, 9, 2])
  logged = [_log(guard, step, w) for step, w in enumerate(windows)]
  assert max(m["hubness"] for m in logged) >= 0.5  # what fired before
  assert not warnings, warnings


def test_a_real_hub_and_the_null_trap_are_reported_once(monkeypatch):
  guard, warnings = _guard(monkeypatch)
  rng = np.random.default_rng(1)
  for step in range(15):  # 60 queries: too few to judge, whatever they are
    _log(guard, step, [3, 3, 3, 3])
  assert not warnings
  for step in range(15, 40):  # a hub: 3 of every 4 queries get block 3
    _log(guard, step, [3, 3, 3, rng.integers(10, 1000)], null=0.2)
  assert len(warnings) == 1, warnings
  assert "step 15" in warnings[0] and "latest_release" in warnings[0]
  assert "last 64 queries" in warnings[0]
  for step in range(40, 80):  # then the null trap
    _log(guard, step, rng.integers(0, 1000, 4), null=0.95)
  assert len(warnings) == 2, warnings
  assert "null_score='learned_mean'" in warnings[1]
  # Only once p(null) 0.95 fills the last 64 queries enough (>= 0.9).
  assert int(warnings[1].split("step ")[1].split(":")[0]) >= 40 + 14


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
def test_the_recipe_does_not_collapse(tmp_path, world_and_ict, monkeypatch):
  files, queries, ict_ckpts = world_and_ict
  warnings = []
  monkeypatch.setattr(absl_logging, "warning",
                      lambda msg, *a: warnings.append(msg % a))
  history = _pretrain(str(tmp_path / "recipe"), files, queries, ict_ckpts,
                      [])
  assert {"grad_norm_retriever", "grad_norm_reader", "hubness",
          "null_probability"} <= set(history[-1])
  for h in history:
    assert h["null_probability"] <= 0.5, history
    assert h["hubness"] <= 0.5, history
  assert not [w for w in warnings if "COLLAPSE" in w], warnings
  # Frozen during the warm-up, the retriever still gets its gradient.
  assert history[-1]["grad_norm_retriever"] > 0
  assert np.isfinite([h["loss"] for h in history]).all()

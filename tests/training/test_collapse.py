"""Collapse guards: REALM's two absorbing failure states are seen and reported.

A small knowledge world (`realm_jax.testing.knowledge_world`), a short ICT
warm start, then a few REALM steps twice: with REALM's original settings
the null document (scored by the embedding of `[CLS] [SEP] [SEP]`) takes
the whole retrieval mass and the guard must warn; with the recipe
(`experiments/pretrain_world_cpu.gin`: learned null score, reader warm-up,
retriever on its own rate) p(null|x) and hubness must stay low. The first
half shows the second can fail.
"""

import gin
import numpy as np
import pytest
from absl import logging as absl_logging

from realm_jax import gin_cli
from realm_jax.model.realm import RealmConfig
from realm_jax.testing import knowledge_world
from realm_jax.training import checkpoints, ict, pretrain

STEPS = 10


@pytest.fixture(scope="module")
def world_and_ict(tmp_path_factory):
  root = tmp_path_factory.mktemp("world")
  files = knowledge_world.write_world(str(root / "world"), num_people=64,
                                      num_heldout=16)
  workdir = str(root / "ict")
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_world_cpu.gin"], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{files.block_store}'",
      f"ANNOTATED = '{files.train}'",
      "ict.IctTrainConfig.num_train_steps = 30",
      "ict.IctTrainConfig.batch_size = 16",
      "realm.RetrieverConfig.null_score = 'embedding'"])
  ict.train(config=gin.get_configurable(ict.IctTrainConfig)(),
            model=gin.get_configurable(RealmConfig)())
  gin.clear_config()
  return files, checkpoints.checkpoint_dir(workdir)


def _pretrain(workdir, files, ict_ckpts, bindings):
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_world_cpu.gin"], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{files.block_store}'",
      f"ANNOTATED = '{files.train}'",
      f"INIT_FROM = 'checkpoint:{ict_ckpts}'",
      f"pretrain.PretrainConfig.num_train_steps = {STEPS}",
      "pretrain.PretrainConfig.batch_size = 16",
      "pretrain.PretrainConfig.log_every = 2",
      "pretrain.PretrainConfig.freeze_retriever_steps = 4"] + bindings)
  try:
    return pretrain.train(
        config=gin.get_configurable(pretrain.PretrainConfig)(),
        model=gin.get_configurable(RealmConfig)())
  finally:
    gin.clear_config()


def test_collapse_is_reported_and_the_recipe_avoids_it(
    tmp_path, world_and_ict, monkeypatch):
  files, ict_ckpts = world_and_ict
  warnings = []
  monkeypatch.setattr(absl_logging, "warning",
                      lambda msg, *a: warnings.append(msg % a))

  original = _pretrain(str(tmp_path / "original"), files, ict_ckpts, [
      "pretrain.PretrainConfig.retriever_learning_rate_multiplier = 1.0",
      "pretrain.PretrainConfig.freeze_retriever_steps = 0",
      "realm.RetrieverConfig.null_score = 'embedding'"])
  assert max(h["null_probability"] for h in original) > 0.9, original
  assert any("COLLAPSE WARNING" in w and "p(null|x)" in w
             for w in warnings), warnings
  assert {"grad_norm_retriever", "grad_norm_reader", "hubness",
          "null_probability"} <= set(original[-1])

  warnings.clear()
  recipe = _pretrain(str(tmp_path / "recipe"), files, ict_ckpts, [])
  for h in recipe:
    assert h["null_probability"] <= 0.5, recipe
    assert h["hubness"] <= 0.5, recipe
  assert not [w for w in warnings if "COLLAPSE" in w], warnings
  # The retriever is frozen during the warm-up, then gets a gradient.
  assert recipe[-1]["grad_norm_retriever"] > 0
  assert np.isfinite([h["loss"] for h in recipe]).all()

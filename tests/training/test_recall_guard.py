"""The recall guard: the retriever rolled back when REALM makes it worse.

A tiny real-text corpus whose sentences are also its blocks (REALM's X
within Z, so every held-out sentence has an own block). The retriever is
released early and trained at a rate that wrecks it; the guard must see
its own-block recall fall, put the initial retriever back exactly and keep
it frozen. With the retriever never released, the guard must never act.
"""

import json
import os

import gin
import jax
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.core import checkpoints
from realm_jax.testing import corpus
from realm_jax.training import ict, pretrain

STEPS = 12


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
  """(block store, query cache, ICT checkpoints): REALM starts from a
  retriever that finds the sentences' own blocks, as on real text."""
  directory = str(tmp_path_factory.mktemp("corpus"))
  store, annotated = corpus.make_tiny_corpus(directory)
  queries = corpus.make_query_cache(
      annotated, os.path.join(directory, "queries"), query_length=32)
  workdir = os.path.join(directory, "ict")
  gin.clear_config()
  try:
    gin_cli.parse(["experiments/ict_tiny_cpu.gin"], [
        f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
        "ict.IctTrainConfig.num_train_steps = 40",
        "ict.IctTrainConfig.batch_size = 8"])
    ict.train(config=gin.get_configurable(ict.IctTrainConfig)(),
              model=gin.get_configurable(ict.RealmConfig)())
  finally:
    gin.clear_config()
  return store, queries, checkpoints.checkpoint_dir(workdir)


def _run(workdir, tiny_corpus, extra=(), **overrides):
  store, queries, ict_checkpoints = tiny_corpus
  values = {"num_train_steps": STEPS, "checkpoint_every": 2,
            "keep_checkpoints": 100, "reader_length": 64, "gate_every": 2,
            "recall_guard_queries": queries, "recall_guard_k": 1,
            "recall_guard_max_drop": 0.0, "recall_guard_patience": 1,
            "freeze_retriever_steps": 2, "learning_rate": 3e-2,
            "retriever_learning_rate_multiplier": 1.0, **overrides}
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
      f"QUERIES = '{queries}'", f"INIT_FROM = 'checkpoint:{ict_checkpoints}'"
  ] + [
          f"pretrain.PretrainConfig.{k} = {v!r}" for k, v in values.items()]
                + list(extra))
  try:
    pretrain.train(config=gin.get_configurable(pretrain.PretrainConfig)(),
                   model=gin.get_configurable(pretrain.RealmConfig)())
  finally:
    gin.clear_config()
  with open(os.path.join(workdir, "recall_guard.jsonl"),
            encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _retriever(workdir, step):
  return checkpoints.restore_items(checkpoints.checkpoint_dir(workdir), step,
                                   checkpoints.PARAM_ITEMS)["retriever"]


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(
      jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


QUERY_SIDE = ("pretrain.PretrainConfig.retriever_training = 'query_side'",
              "realm.RetrieverConfig.share_towers = False")


@pytest.mark.parametrize("extra", [(), QUERY_SIDE], ids=["full", "query_side"])
def test_a_wrecked_retriever_is_rolled_back_and_frozen(tmp_path, tiny_corpus,
                                                       extra):
  workdir = str(tmp_path / "run")
  log = _run(workdir, tiny_corpus, extra)
  assert [e["step"] for e in log][0] == 0
  baseline = log[0]["recall@1"]
  assert all(e["baseline"] == baseline for e in log)
  trip = [e for e in log if e["rolled_back"]]
  assert len(trip) == 1, log
  trip_step = trip[0]["step"]
  assert trip[0]["recall@1"] < baseline and trip[0]["training"]
  # Nothing is evaluated after the rollback, and the retriever the run
  # started with is back, unchanged to the end.
  assert log[-1] is trip[0]
  initial = _retriever(workdir, 0)
  assert not _equal(_retriever(workdir, trip_step), initial)
  for step in range(trip_step + 2, STEPS + 1, 2):
    assert _equal(_retriever(workdir, step), initial), step
  # A restart keeps it so: the checkpoint's meta says the guard tripped
  # and the optimiser state keeps the retriever frozen.
  assert _run(workdir, tiny_corpus, extra, num_train_steps=STEPS + 4) == log
  assert _equal(_retriever(workdir, STEPS + 4), initial)


@pytest.mark.parametrize("field, value", [
    ("recall_guard_max_drop", 1.0), ("recall_guard_max_drop", -0.1),
    ("recall_guard_k", 0), ("recall_guard_patience", 0)])
def test_bad_guard_settings_are_refused(field, value):
  with pytest.raises(ValueError, match=field):
    pretrain.PretrainConfig(workdir="unused", queries="unused",
                            block_store="unused",
                            recall_guard_queries="unused", **{field: value})


def test_a_frozen_retriever_is_never_rolled_back(tmp_path, tiny_corpus):
  log = _run(str(tmp_path / "run"), tiny_corpus,
             freeze_retriever_steps=STEPS)
  assert [e["step"] for e in log] == list(range(0, STEPS, 2))
  assert not any(e["training"] or e["rolled_back"] or e["streak"]
                 for e in log)
  assert len({e["recall@1"] for e in log}) == 1

"""The recall guard: the retriever rolled back when REALM makes it worse.

A tiny real-text corpus whose sentences are also its blocks (REALM's X
within Z, so every held-out sentence has an own block). The retriever is released early and trained at a rate that
wrecks it; the guard must see its recall fall (own-block recall of the
sentences, or a block holding the sentence's masked span), put
the initial retriever back exactly and keep it frozen. With the retriever
never released, the guard must never act.
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
from realm_jax.data import block_store
from realm_jax.index import embed
from realm_jax.data import query_cache
from realm_jax.model import functional
from realm_jax.model.realm import Realm
from realm_jax.data import realm_inputs
from realm_jax.training import ict, pretrain, recall_guard

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


def _binding(key, value):
  """`pretrain.PretrainConfig.key = value`; `part__field`: its part's."""
  part, _, field = key.rpartition("__")
  scope = {"": "PretrainConfig", "retriever": "RetrieverScheduleConfig",
           "gate": "GateConfig", "recall_guard": "RecallGuardConfig"}[part]
  return f"pretrain.{scope}.{field} = {value!r}"


def _run(workdir, tiny_corpus, extra=(), **overrides):
  store, queries, ict_checkpoints = tiny_corpus
  values = {"num_train_steps": STEPS, "checkpoint_every": 2,
            "keep_checkpoints": 100, "reader_length": 64,
            "recall_guard__every": 2, "recall_guard__queries": queries,
            "recall_guard__k": 1, "recall_guard__max_drop": 0.0,
            "recall_guard__patience": 1, "gate__latest_release": 2,
            "learning_rate": 3e-2, "retriever__learning_rate_multiplier": 1.0,
            **overrides}
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
      f"QUERIES = '{queries}'", f"INIT_FROM = 'checkpoint:{ict_checkpoints}'"
  ] + [
          _binding(k, v) for k, v in values.items()] + list(extra))
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


QUERY_SIDE = ("pretrain.RetrieverScheduleConfig.training = 'query_side'",
              "realm.RetrieverConfig.share_towers = False")


OWN_BLOCK = {"recall_guard__probe": "own_block"}


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
@pytest.mark.parametrize("extra, probe", [
    ((), "own-block"), (QUERY_SIDE, "own-block"), ((), "answer-bearing")],
                         ids=["full", "query_side", "answer"])
def test_a_wrecked_retriever_is_rolled_back_and_frozen(tmp_path, tiny_corpus,
                                                       extra, probe):
  workdir = str(tmp_path / "run")
  guard = OWN_BLOCK if probe == "own-block" else {}
  log = _run(workdir, tiny_corpus, extra, **guard)
  assert [e["step"] for e in log][0] == 0
  assert {e["probe"] for e in log} == {probe}
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
  assert _run(workdir, tiny_corpus, extra, num_train_steps=STEPS + 4,
              **guard) == log
  assert _equal(_retriever(workdir, STEPS + 4), initial)


@pytest.mark.parametrize("field, value", [
    ("max_drop", 1.0), ("max_drop", -0.1), ("k", 0), ("patience", 0),
    ("every", 0)])
def test_bad_guard_settings_are_refused(field, value):
  with pytest.raises(ValueError, match=f"RecallGuardConfig.{field}"):
    pretrain.RecallGuardConfig(queries="unused", **{field: value})


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
def test_a_frozen_retriever_is_never_rolled_back(tmp_path, tiny_corpus):
  log = _run(str(tmp_path / "run"), tiny_corpus,
             gate__latest_release=STEPS)
  assert [e["step"] for e in log] == list(range(0, STEPS, 2))
  assert not any(e["training"] or e["rolled_back"] or e["streak"]
                 for e in log)
  assert len({e["recall@1"] for e in log}) == 1
  assert all(e["index_staleness"] == 0 for e in log)


def test_full_training_on_an_inline_index_is_guarded_on_fresh_indices():
  """The search mixes the current query tower with the index's document
  tower: the guard waits for a refresh step, unless the index is exact
  (query-side) or a builder's."""
  def every(guard_every, training="full", **kw):
    config = pretrain.PretrainConfig(
        workdir="unused", queries="unused", block_store="unused",
        index_mode=kw.pop("index_mode", "inline"),
        recall_guard=pretrain.RecallGuardConfig(queries="q",
                                                every=guard_every), **kw)
    return recall_guard.guard_every(
        config.recall_guard, index_mode=config.index_mode, training=training,
        refresh_period=config.refresh_period)
  assert every(50, checkpoint_every=20) == 100
  assert every(50, checkpoint_every=25) == 50
  assert every(25, checkpoint_every=250) == 250
  assert every(50, checkpoint_every=10, refresh_every=20) == 100
  assert every(50, checkpoint_every=20, training="query_side") == 50
  assert every(50, checkpoint_every=20, index_mode="builder") == 50


def test_answer_recall_counts_blocks_that_hold_the_masked_span(
    tmp_path, tiny_corpus):
  """The guard's default probe: recall@k of the initial retriever is the
  share of the sentences with a top-k block (exact search over a fresh
  embedding of every block) that holds the sentence's masked span."""
  store_dir, queries_dir, _ = tiny_corpus
  workdir = str(tmp_path / "run")
  log = _run(workdir, tiny_corpus, gate__latest_release=STEPS,
             num_train_steps=2, recall_guard__k=2)
  assert log[0]["probe"] == "answer-bearing"
  params = checkpoints.restore_items(checkpoints.checkpoint_dir(workdir), 0,
                                     checkpoints.PARAM_ITEMS)
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"], [
      "WORKDIR = 'unused'", "BLOCK_STORE = 'unused'", "QUERIES = 'unused'"])
  try:
    model = gin.get_configurable(pretrain.RealmConfig)()
  finally:
    gin.clear_config()
  store = block_store.BlockStore.open(store_dir)
  block_emb, _ = embed.embed_block_store(
      params["retriever"], model.retriever, store, log_every_seconds=1e9)
  stream = query_cache.QueryStream(queries_dir, seed=0, batch_size=1024)
  try:
    queries = stream.head(1024)
  finally:
    stream.close()
  graphdef, _ = functional.abstract_init(lambda r: Realm(model, rngs=r))
  query_emb = np.asarray(embed.make_query_embedder(graphdef, None)(
      params, queries["query_ids"], queries["query_mask"]))
  top = np.argsort(-(query_emb @ block_emb.T), axis=1, kind="stable")[:, :2]
  spans = realm_inputs.masked_spans(queries)
  held = [any(realm_inputs.holds_spans(
      [span], *(x[None] for x in store.bodies(row, store.max_block_len))
  )[0]) for span, row in zip(spans, top) if len(span)]
  # (The guard's probes: as many as divide over the devices.)
  held = held[:len(held) // jax.device_count() * jax.device_count()]
  assert 0 < np.mean(held) < 1  # (a measure that can move either way)
  assert log[0]["recall@2"] == pytest.approx(np.mean(held), abs=1e-6)

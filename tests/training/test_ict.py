"""Inverse Cloze Task warm start: the global in-batch loss, inputs, the job."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import chex
from etils import epath
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import gin_cli

from realm_jax.core import io_utils
from realm_jax.data import block_store, examples
from realm_jax.model import functional
from realm_jax.model.realm import Realm, Retriever
from realm_jax.testing import corpus, ram_fs, timeouts, tiny
from realm_jax.training import ict
from realm_jax.core import checkpoints, parallel
from realm_jax.checkpoint_import import init_from as init_lib

STEPS = 20
FIRST_CALL = 12  # The run stops here once and resumes.


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
  # Two copies of each article: 18 blocks, 16 of them with >= 2 sentences.
  store, _ = corpus.make_tiny_corpus(str(tmp_path_factory.mktemp("corpus")),
                                     copies=2)
  return store


# ----------------------------------------------------------------------------
# The loss: 8 devices == 1 device == a plain full-batch computation
# ----------------------------------------------------------------------------


def _random_ict_batch(rng, batch, query_len=10, block_len=14, vocab=97):
  def seqs(length):
    ids = rng.integers(5, vocab, size=(batch, length))
    real = rng.integers(3, length + 1, size=batch)
    mask = (np.arange(length) < real[:, None]).astype(np.int32)
    return (ids * mask).astype(np.int32), mask

  query_ids, query_mask = seqs(query_len)
  block_ids, block_mask = seqs(block_len)
  return {"query_ids": query_ids, "query_mask": query_mask,
          "query_segment_ids": np.zeros_like(query_ids),
          "block_ids": block_ids, "block_mask": block_mask,
          "block_segment_ids": ((np.arange(block_len) >= 4) *
                                block_mask).astype(np.int32),
          "sentence_removed": rng.integers(0, 2, batch).astype(np.int32)}


def _full_batch_loss(graphdef, params, batch):
  """-mean log softmax over all B blocks, written without any collective."""
  retriever = functional.bind(graphdef, params)
  q = retriever.embed_queries(batch["query_ids"], batch["query_mask"],
                              batch["query_segment_ids"])
  d = retriever.embed_documents(batch["block_ids"], batch["block_mask"],
                                batch["block_segment_ids"])
  logits = q @ d.T
  return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, -1))), logits


def test_global_in_batch_loss_and_grads_equal_one_device_and_plain_jax():
  assert jax.device_count() == 8
  # Separate towers: the document tower's gradient then comes only through
  # the all_gather, including other cores' queries scoring this core's
  # blocks.
  # (Mean pooling: a fresh pooler gives every input almost the same vector.)
  cfg = tiny.tiny_realm(share_towers=False, pooling="mean")
  graphdef = ict.retriever_graphdef(cfg)
  _, params = functional.init(lambda r: Retriever(cfg.retriever, rngs=r), 0)
  batch = _random_ict_batch(np.random.default_rng(0), batch=16)
  loss_fn = ict.make_loss_fn(graphdef)
  results = []
  for devices in (jax.devices(), jax.devices()[:1]):
    mesh = parallel.make_mesh(devices)
    fn = jax.jit(parallel.data_parallel_value_and_grad(loss_fn, mesh))
    results.append(jax.device_get(
        fn(params, parallel.shard_batch(mesh, batch))))
  (loss8, grads8, m8), (loss1, grads1, m1) = results

  (plain_loss, logits), plain_grads = jax.jit(jax.value_and_grad(
      lambda p: _full_batch_loss(graphdef, p, batch), has_aux=True))(params)
  logits = np.asarray(logits)
  accuracy = np.mean(logits.argmax(-1) == np.arange(16))
  assert 0 < accuracy < 1  # Neither trivial nor hopeless.

  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  np.testing.assert_allclose(loss1, plain_loss, rtol=1e-5)
  np.testing.assert_allclose(m8["accuracy"], accuracy, atol=1e-6)
  np.testing.assert_allclose(m1["accuracy"], accuracy, atol=1e-6)
  np.testing.assert_allclose(m8["sentence_removed"],
                             batch["sentence_removed"].mean(), atol=1e-6)
  scale = max(np.abs(g).max() for g in jax.tree_util.tree_leaves(plain_grads))
  for name, want in (("1 device", grads1), ("8 devices", grads8)):
    chex.assert_trees_all_close(want, jax.device_get(plain_grads), rtol=1e-3,
                                atol=1e-5 * scale, custom_message=name)
  # The document tower really learns (a dropped cross-core term would show
  # in the comparison above; a zero gradient would hide it).
  doc = grads8["document_embedder"]["projection"]["kernel"]
  assert np.abs(doc).max() > 1e-3 * scale


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------


def test_sentence_counts_match_sentence_bounds(store_dir, tmp_path):
  store = block_store.BlockStore.open(store_dir)
  ids = np.arange(len(store))
  want = [len(examples.sentence_bounds(len(store.body_ids(i)),
                                       store.sentence_starts(i)))
          for i in ids]
  np.testing.assert_array_equal(store.sentence_counts(ids), want)
  assert min(want) == 1 and max(want) >= 3  # The corpus has both kinds.
  # A store on a non-local filesystem is read from its local cache copy.
  ram_fs.register()
  remote = ram_fs.unique_root("store")
  io_utils.copy_tree(store_dir, remote)
  cached = block_store.BlockStore.open(remote, cache_dir=tmp_path)
  assert cached.local_path.startswith(str(tmp_path))
  np.testing.assert_array_equal(cached.sentence_counts(ids), want)


def test_examples_are_a_pure_function_of_step_distinct_and_sharded(
    store_dir):
  store = block_store.BlockStore.open(store_dir)
  config = examples.IctConfig(query_length=16, block_length=32)
  make = lambda **kw: ict.IctExamples(store, config=config, seed=3, **kw)
  a, b = make(batch_size=8), make(batch_size=8)
  counts = store.sentence_counts(np.arange(len(store)))
  np.testing.assert_array_equal(a.block_ids, np.flatnonzero(counts >= 2))
  for step in (0, 1, 5):
    batch_a, batch_b = a.batch(step), b.batch(step)
    for k in examples.ICT_FEATURES:
      np.testing.assert_array_equal(batch_a[k], batch_b[k])
    ids = a.block_ids_for_step(step)
    assert len(set(ids.tolist())) == 8  # No block twice in a batch.
    assert batch_a["block_ids"].shape == (8, 32)
    assert batch_a["query_ids"].shape == (8, 16)
    # Each query sentence is a piece of its block's body.
    for row, i in enumerate(ids):
      body = store.body_ids(i)
      q = batch_a["query_ids"][row][1:batch_a["query_mask"][row].sum() - 1]
      assert any(np.array_equal(body[s:s + len(q)], q)
                 for s in range(len(body)))
  # An epoch covers 2 * 8 of the 16 usable blocks once each.
  epoch = np.concatenate([a.block_ids_for_step(s) for s in (0, 1)])
  assert sorted(epoch.tolist()) == sorted(a.block_ids.tolist())
  assert not np.array_equal(a.block_ids_for_step(0), a.block_ids_for_step(2))
  removed = np.concatenate([a.batch(s)["sentence_removed"]
                            for s in range(6)])
  assert 0.7 < removed.mean() < 1.0  # p = 0.9
  # Hosts own disjoint blocks that together are all usable blocks.
  shards = [ict.IctExamples(store, config=config, seed=3, batch_size=4,
                            shard_index=h, num_shards=2) for h in (0, 1)]
  assert not set(shards[0].block_ids) & set(shards[1].block_ids)
  assert sorted(np.concatenate([s.block_ids for s in shards]).tolist()) == (
      a.block_ids.tolist())
  assert all(i % 2 == h for h, s in enumerate(shards) for i in s.block_ids)
  with pytest.raises(ValueError, match="fewer than its batch of 32"):
    make(batch_size=32)


def test_config_errors_say_what_to_change():
  ok = dict(workdir="/w", block_store="/b", batch_size=16)
  ict.IctTrainConfig(**dict(ok, batch_size=12))  # Builds without JAX.
  with pytest.raises(ValueError, match="does not divide evenly over 8 dev"):
    # Checked when the run starts, before anything is read.
    ict.train(config=ict.IctTrainConfig(**dict(ok, batch_size=12)),
              model=tiny.tiny_realm())
  with pytest.raises(ValueError, match="remove_probability"):
    ict.IctTrainConfig(**dict(ok, pairs=examples.IctConfig(
        remove_probability=1.5)))
  with pytest.raises(ValueError, match="query_length"):
    ict.IctTrainConfig(**dict(ok, pairs=examples.IctConfig(
        query_length=2)))
  with pytest.raises(ValueError, match="learning_rate"):
    ict.IctTrainConfig(**dict(ok, learning_rate=0.0))
  with pytest.raises(ValueError, match="WORKDIR"):
    ict.IctTrainConfig(**dict(ok, workdir=""))


# ----------------------------------------------------------------------------
# The job: learning, resume, the saved reader, hand-off to REALM
# ----------------------------------------------------------------------------


def _configs(workdir, store):
  gin.clear_config()
  try:
    gin_cli.parse(["experiments/ict_tiny_cpu.gin"],
                  [f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'"])
    return (gin.get_configurable(ict.IctTrainConfig)(),
            gin.get_configurable(ict.RealmConfig)(),
            gin.operative_config_str())
  finally:
    gin.clear_config()


@pytest.fixture(scope="module")
def ict_run(tmp_path_factory, store_dir):
  workdir = str(tmp_path_factory.mktemp("ict"))
  config, model, operative = _configs(workdir, store_dir)
  assert config.num_train_steps == STEPS and config.batch_size == 16
  first = ict.train(config=config, model=model, operative_config=operative,
                    stop_after=FIRST_CALL)
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  stopped_done = checkpoints.is_done(ckpt_dir)
  # The resumed run gets its workdir as an epath.Path (gs:// paths are).
  second = ict.train(
      config=dataclasses.replace(config, workdir=epath.Path(workdir)),
      model=model, operative_config=operative)
  return workdir, config, model, first, second, stopped_done


def test_ict_learns_and_resumes(ict_run):
  workdir, _, _, first, second, stopped_done = ict_run
  assert [h["step"] for h in first] == list(range(1, FIRST_CALL + 1))
  assert [h["step"] for h in second] == list(range(FIRST_CALL + 1,
                                                   STEPS + 1))
  assert not stopped_done
  history = first + second
  loss = np.array([h["loss"] for h in history])
  accuracy = np.array([h["accuracy"] for h in history])
  # Chance is 1/16; each article is in the batch twice (two copies of the
  # same text), so about 1/2 is the ceiling.
  assert accuracy[:3].mean() < 0.15, accuracy
  assert accuracy[-6:].mean() > 0.3, accuracy
  assert loss[-6:].mean() < 0.8 * math.log(16) < loss[:3].mean(), loss
  for h in history:
    assert {"loss", "accuracy", "grad_norm", "learning_rate",
            "examples_per_second", "seconds_per_step"} <= set(h)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == list(range(1, STEPS + 1))
  assert checkpoints.is_done(checkpoints.checkpoint_dir(workdir))
  with open(os.path.join(workdir, "operative_config.gin")) as f:
    assert "ict.IctTrainConfig.batch_size = 16" in f.read()
  assert os.listdir(os.path.join(workdir, "summaries"))


def test_only_the_retriever_trains(ict_run):
  workdir, config, model, *_ = ict_run
  _, fresh = functional.init(lambda r: Realm(model, rngs=r), config.seed)
  saved = checkpoints.restore_items(checkpoints.checkpoint_dir(workdir),
                                    STEPS, checkpoints.PARAM_ITEMS)
  same = jax.tree_util.tree_map(
      lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
      saved["reader"], fresh["reader"])
  assert all(jax.tree_util.tree_leaves(same))  # Bit-identical.
  moved = jax.tree_util.tree_map(
      lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(),
      saved["retriever"], fresh["retriever"])
  assert moved["query_embedder"]["projection"]["kernel"] > 1e-3


def test_realm_pretraining_and_the_index_builder_read_the_ict_checkpoint(
    ict_run):
  workdir, _, model, *_ = ict_run
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  saved = checkpoints.restore_items(ckpt_dir, STEPS, checkpoints.PARAM_ITEMS)
  # Another seed: everything that survives must have come from the file.
  _, other = functional.init(lambda r: Realm(model, rngs=r), 123)
  params = init_lib.initial_params(model, other, f"checkpoint:{ckpt_dir}")
  for part in ("retriever", "reader"):
    chex.assert_trees_all_equal(jax.device_get(params[part]),
                                jax.device_get(saved[part]))
  assert not np.array_equal(
      other["retriever"]["query_embedder"]["projection"]["kernel"],
      params["retriever"]["query_embedder"]["projection"]["kernel"])
  chex.assert_trees_all_equal(
      jax.device_get(checkpoints.restore_retriever(ckpt_dir, STEPS)),
      jax.device_get(saved["retriever"]))


def test_main_dry_run_prints_the_config(tmp_path, store_dir):
  workdir = str(tmp_path / "never_created")
  out = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ict",
       "--gin_file=experiments/ict_tiny_cpu.gin",
       f"--gin.WORKDIR='{workdir}'", f"--gin.BLOCK_STORE='{store_dir}'",
       "--dry_run"], capture_output=True, text=True,
      timeout=timeouts.HANG_SECONDS, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"IctTrainConfig(workdir='{workdir}'" in out.stdout
  assert "realm.RetrieverConfig.pooling = 'mean'" in out.stdout
  assert not os.path.exists(workdir)

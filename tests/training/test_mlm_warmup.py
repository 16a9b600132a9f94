"""The MLM head warm start: only the head moves, and it learns to predict
masks of queries it never saw; the pre-training job runs it on a fresh
start and records what it did."""

import json
import os

import jax
import numpy as np
import pytest

from realm_jax.data import examples
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import builder
from realm_jax.model import functional
from realm_jax.model.realm import (Realm, RealmConfig, ReaderConfig,
                                   RetrieverConfig)
from realm_jax.testing import corpus, knowledge_world, tiny
from realm_jax.training import mlm_warmup, pretrain
from realm_jax.core import checkpoints


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return knowledge_world.write_world(
      str(tmp_path_factory.mktemp("world")), num_people=48, num_heldout=8)


def _queries(files, query_length=32):
  return examples.read_realm_queries(
      files.train, Tokenizer(), config=examples.RealmQueryConfig(
          query_length=query_length, max_masks=2))


def test_only_the_head_moves_and_heldout_accuracy_rises(world):
  model = tiny.tiny_realm(vocab_size=30522)
  graphdef, params = functional.init(lambda r: Realm(model, rngs=r), 0)
  queries = _queries(world)
  new, report = mlm_warmup.warm_start_mlm_head(
      params, graphdef, queries, sep_id=Tokenizer().sep_id, steps=60,
      batch_size=128, learning_rate=5e-2, seed=0)
  # A random head spreads its mass over 30k wordpieces (loss ~ln 30522 =
  # 10.3); the targets are ~250 city and year wordpieces, so even their
  # distribution alone brings the loss on held-out queries to ~5.4.
  assert report["heldout_loss_before"] > 9.0, report
  assert report["heldout_loss_after"] < 7.0, report
  assert report["heldout_accuracy_before"] < 0.01
  assert report["train_accuracy_after"] > 0.02, report
  assert report["masks"] > 100

  flat_old = dict(jax.tree_util.tree_leaves_with_path(params))
  flat_new = dict(jax.tree_util.tree_leaves_with_path(new))
  assert flat_old.keys() == flat_new.keys()
  moved = {jax.tree_util.keystr(k) for k in flat_old
           if not np.array_equal(np.asarray(flat_old[k]),
                                 np.asarray(flat_new[k]))}
  assert moved and all("mlm_head" in k for k in moved), moved
  assert any("output_bias" in k for k in moved)


def test_a_reader_without_mlm_head_is_refused(world):
  model = tiny.tiny_realm(vocab_size=30522)
  graphdef, params = functional.init(lambda r: Realm(model, rngs=r), 0)
  params = dict(params, reader={k: v for k, v in params["reader"].items()
                                if k != "mlm_head"})
  with pytest.raises(ValueError, match="no MLM head"):
    mlm_warmup.warm_start_mlm_head(params, graphdef, _queries(world),
                                   sep_id=102, steps=1)


def test_the_pretraining_job_warms_the_head_on_a_fresh_start(world, tmp_path):
  bert = tiny.tiny_bert(30522, max_position_embeddings=128)
  model = RealmConfig(retriever=RetrieverConfig(bert=bert, pooling="mean"),
                      reader=ReaderConfig(bert=bert))
  workdir = str(tmp_path / "run")
  config = pretrain.PretrainConfig(
      workdir=workdir, block_store=world.block_store,
      queries=corpus.make_query_cache(world.train, str(tmp_path / "queries"),
                                      query_length=32, max_masks=2),
      num_train_steps=1, batch_size=8, num_candidates=2,
      reader_length=96, checkpoint_every=1,
      index_mode="inline", mlm_head_warmup_steps=40,
      index_build=builder.IndexBuildConfig(searcher="exact"))
  pretrain.train(config=config, model=model)
  with open(os.path.join(workdir, "mlm_head_warmup.json")) as f:
    report = json.load(f)
  assert report["heldout_loss_after"] < report["heldout_loss_before"]
  assert report["masks"] > 100
  ckpt = checkpoints.TrainCheckpointer(checkpoints.checkpoint_dir(workdir))
  assert ckpt.latest_step() == 1

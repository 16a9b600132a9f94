"""Reader preparation: only the MLM head moves, and it learns to predict
masks of queries it never saw; the job writes a checkpoint that
pre-training starts from, and records what it did."""

import json
import logging
import os
import re

import jax
import numpy as np
import pytest

from realm_jax.data import examples, query_cache
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import build
from realm_jax.model import functional
from realm_jax.model.realm import (Realm, RealmConfig, ReaderConfig,
                                   RetrieverConfig)
from realm_jax.testing import corpus, knowledge_world, tiny
from realm_jax.training import pretrain, reader_prep
from realm_jax.core import checkpoints, progress


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return knowledge_world.write_world(
      str(tmp_path_factory.mktemp("world")), num_people=48, num_heldout=8)


def _queries(files, query_length=32):
  return examples.read_realm_queries(
      files.train, Tokenizer(), config=examples.RealmQueryConfig(
          query_length=query_length, max_masks=2))


def test_only_the_head_moves_and_heldout_accuracy_rises(world, monkeypatch,
                                                       caplog):
  model = tiny.tiny_realm(vocab_size=30522)
  graphdef, params = functional.init(lambda r: Realm(model, rngs=r), 0)
  queries = _queries(world)
  monkeypatch.setattr(progress, "_every_seconds", [1e-9])  # Every batch.
  with caplog.at_level(logging.INFO):
    new, _, report = reader_prep.warm_start_mlm_head(
        params, graphdef, queries, sep_id=Tokenizer().sep_id, steps=60,
        batch_size=128, learning_rate=5e-2, seed=0)
  # Progress in the log (issue 58): both loops, with ETA and total time.
  for what, unit, total in (("encoding queries", "queries",
                             min(len(queries["query_ids"]),
                                 reader_prep.MAX_QUERIES)),
                            ("fitting the MLM head", "steps", 60)):
    assert re.search(rf"reader preparation: {what}: \d+/{total} {unit} "
                     rf"\(\d+%\), [\d.]+ {unit}/s, ETA", caplog.text), what
    assert re.search(rf"reader preparation: {what}: {total}/{total} {unit} "
                     r"in [\d.]+ s", caplog.text), caplog.text
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
    reader_prep.warm_start_mlm_head(params, graphdef, _queries(world),
                                   sep_id=102, steps=1)


def _prep_config(world, tmp_path, **kwargs):
  return reader_prep.ReaderPrepConfig(**{**dict(
      workdir=str(tmp_path / "prep"), block_store=world.block_store,
      queries=corpus.make_query_cache(world.train, str(tmp_path / "queries"),
                                      query_length=32, max_masks=2),
      num_train_steps=40, batch_size=256), **kwargs})


def test_pretraining_starts_from_the_prepared_reader(world, tmp_path):
  """The job fits the head, checkpoints the whole model (DONE marked) and
  reports; pre-training's `init_from` reads that checkpoint, and its step 0
  is exactly the prepared model. A second run finds it done."""
  bert = tiny.tiny_bert(30522, max_position_embeddings=128)
  model = RealmConfig(retriever=RetrieverConfig(bert=bert, pooling="mean"),
                      reader=ReaderConfig(bert=bert))
  prep = _prep_config(world, tmp_path)
  report = reader_prep.train(config=prep, model=model)
  assert report["heldout_loss_after"] < report["heldout_loss_before"]
  assert report["masks"] > 100
  with open(os.path.join(prep.workdir, "mlm_head_warmup.json")) as f:
    assert json.load(f) == report
  prep_ckpts = checkpoints.checkpoint_dir(prep.workdir)
  assert checkpoints.done_step(prep_ckpts) == 40
  prepared = checkpoints.restore_items(prep_ckpts, 40,
                                       checkpoints.PARAM_ITEMS)
  _, fresh = functional.init(lambda r: Realm(model, rngs=r), 0)
  flat_fresh = dict(jax.tree_util.tree_leaves_with_path(fresh))
  moved = {jax.tree_util.keystr(k)
           for k, v in jax.tree_util.tree_leaves_with_path(prepared)
           if not np.array_equal(np.asarray(v), np.asarray(flat_fresh[k]))}
  assert moved and all("mlm_head" in k for k in moved), moved
  assert reader_prep.train(config=prep, model=model) == report  # done
  # Rerun on the finished workdir with its report gone or damaged: the
  # report is computed again (the fit is deterministic), the checkpoint
  # is kept.
  report_path = os.path.join(prep.workdir, "mlm_head_warmup.json")
  for damage in (None, b"\xff{\"masks\": 1"):
    os.remove(report_path)
    if damage is not None:
      with open(report_path, "wb") as f:
        f.write(damage)
    again = reader_prep.train(config=prep, model=model)
    assert dict(again, seconds=0) == dict(report, seconds=0)
    with open(report_path) as f:
      assert json.load(f) == again
  assert checkpoints.finalized_steps(prep_ckpts) == [40]

  workdir = str(tmp_path / "run")
  pretrain.train(config=pretrain.PretrainConfig(
      workdir=workdir, block_store=world.block_store, queries=prep.queries,
      init_from=f"checkpoint:{prep_ckpts}", num_train_steps=1, batch_size=8,
      retrieval=pretrain.RetrievalConfig(num_candidates=2), reader_length=96,
      checkpoint_every=1,
      index_mode="inline",
      index_build=build.IndexBuildConfig(searcher="exact")), model=model)
  start = checkpoints.restore_items(checkpoints.checkpoint_dir(workdir), 0,
                                    checkpoints.PARAM_ITEMS)
  for a, b in zip(jax.tree_util.tree_leaves(start),
                  jax.tree_util.tree_leaves(prepared)):
    np.testing.assert_array_equal(a, b)
  assert not os.path.exists(os.path.join(workdir, "mlm_head_warmup.json"))


def test_the_head_is_fit_to_a_sample_of_every_article(world, tmp_path):
  """The cache stores queries by file, article after article: the job reads
  the queries pre-training streams first (a seeded sample), not the first
  articles' (whose entity names a head fit to them would learn to guess)."""
  prep = _prep_config(world, tmp_path, max_queries=16)
  _, queries, _ = reader_prep._inputs(prep)
  stream = query_cache.QueryStream(prep.queries, seed=prep.seed,
                                   batch_size=8)
  try:
    streamed = [stream.batch(step) for step in (0, 1)]
    stored = stream.head(16)["source_doc_hash"]
  finally:
    stream.close()
  for name, value in queries.items():
    np.testing.assert_array_equal(
        value, np.concatenate([b[name] for b in streamed]), err_msg=name)
  assert len(set(queries["source_doc_hash"].tolist())) > len(
      set(stored.tolist())), (queries["source_doc_hash"], stored)


def test_the_config_names_what_to_set(world, tmp_path):
  with pytest.raises(ValueError, match="ReaderPrepConfig.queries is empty"):
    _prep_config(world, tmp_path, queries="")
  with pytest.raises(ValueError, match="max_queries"):
    _prep_config(world, tmp_path, max_queries=0)
  with pytest.raises(ValueError, match="must exceed the query_length=32"):
    reader_prep.train(config=_prep_config(world, tmp_path, reader_length=32),
                      model=tiny.tiny_realm(vocab_size=30522))
  assert not os.path.exists(tmp_path / "prep" / "checkpoints")

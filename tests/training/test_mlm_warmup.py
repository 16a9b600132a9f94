"""The MLM head warm start: only the head moves, and it learns to predict
masks of queries it never saw; the pre-training job runs it on a fresh
start and records what it did. Then the reader adaptation: its answer
blocks, its stop rule, and what it changes."""

import json
import os

import jax
import numpy as np
import pytest

from realm_jax.data import (block_store, blocks, examples, salient_spans,
                            wikipedia)
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import builder
from realm_jax.model import functional
from realm_jax.model.realm import (Realm, RealmConfig, ReaderConfig,
                                   RetrieverConfig)
from realm_jax.testing import corpus, knowledge_world, tiny
from realm_jax.training import mlm_warmup, pretrain, realm_inputs
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


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
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
      index_build=builder.IndexBuildConfig(searcher="exact"),
      reader_adaptation_steps=3, reader_adaptation_eval_every=2,
      reader_adaptation_learning_rate=1e-3)
  pretrain.train(config=config, model=model)
  with open(os.path.join(workdir, "mlm_head_warmup.json")) as f:
    report = json.load(f)
  assert report["heldout_loss_after"] < report["heldout_loss_before"]
  assert report["masks"] > 100
  # Then the reader adaptation (a few steps: the wiring, not the learning).
  with open(os.path.join(workdir, "reader_adaptation.json")) as f:
    report = json.load(f)
  assert report["stop_reason"] == "steps" and report["steps"] == 3
  assert [p["step"] for p in report["curve"]] == [0, 2, 3]
  assert report["heldout_answer_share"] > 0.5, report
  ckpt = checkpoints.TrainCheckpointer(checkpoints.checkpoint_dir(workdir))
  assert ckpt.latest_step() == 1


# ----------------------------------------------------------------------------
# Reader adaptation
# ----------------------------------------------------------------------------


def _brute_force_answer_blocks(queries, store, reader_length, excluded=None):
  """`find_answer_blocks` by exhaustive search: every block, every offset.
  `excluded(i, b)`: block b is trivial for query i (default: its article)."""
  if excluded is None:
    excluded = lambda i, b: (store.doc_hash[b]
                             == queries["source_doc_hash"][i])
  out = []
  for i in range(len(queries["query_ids"])):
    real = queries["mlm_weights"][i] > 0
    order = np.argsort(queries["mlm_positions"][i][real])
    span = list(queries["mlm_targets"][i][real][order])
    length = int(queries["query_mask"][i].sum())
    room = reader_length - length - 1
    ids = queries["query_ids"][i]
    mask_id = ids[queries["mlm_positions"][i][0]]
    words = set(ids[1:length - 1].tolist()) - {int(mask_id)}
    best, best_shared = -1, -1
    for b in range(len(store)):
      if excluded(i, b):
        continue
      body = list(store.body_ids(b)[:room])
      if not any(body[s:s + len(span)] == span
                 for s in range(len(body) - len(span) + 1)):
        continue
      shared = len(words & set(body))
      if shared > best_shared:  # Ascending ids: the lowest wins ties.
        best, best_shared = b, shared
    out.append(best)
  return np.array(out)


def test_answer_blocks_match_a_brute_force_search(world):
  store = block_store.BlockStore.open(world.block_store)
  queries = _queries(world)
  rows = np.arange(0, len(queries["query_ids"]), 9)[:24]
  queries = {k: v[rows].copy() for k, v in queries.items()}
  # Pretend the first 8 queries come from their person's biography: that
  # block (which holds the span and shares the name) is then their own
  # article and must never be chosen.
  gold = knowledge_world.gold_blocks(
      store, knowledge_world.load_people(world.people))
  gold = np.array([gold[int(h)] for h in queries["source_doc_hash"]])
  queries["source_doc_hash"][:8] = store.doc_hash[gold[:8]]

  found = mlm_warmup.find_answer_blocks(queries, store, reader_length=96,
                                        chunk_blocks=7)
  np.testing.assert_array_equal(
      found, _brute_force_answer_blocks(queries, store, 96))
  assert not np.any(found[:8] == gold[:8])
  assert not np.any(store.doc_hash[found[found >= 0]]
                    == queries["source_doc_hash"][found >= 0])
  # Elsewhere the person's own biography is the best answer block (it
  # holds the fact and shares the name); some spans have no other block.
  assert np.all(found[8:] == gold[8:]), (found, gold)
  assert np.any(found[:8] == -1) and np.any(found[:8] >= 0), found


def _sentence(before, span, after):
  return before + span + after, len(before.encode()), len(
      (before + span).encode())


def test_answer_blocks_follow_the_trivial_candidates_rule(tmp_path):
  # Z: Lovelace's article, split into blocks, names London in its first
  # and its last sentence; Babbage's names it once. X: the first sentence,
  # London masked, from Lovelace's article (which Z holds).
  tokenizer = Tokenizer()
  lovelace = ("Ada Lovelace was born in London in 1815. She worked with "
              "Charles Babbage on his analytical engine for many years. She "
              "wrote the first published program for that engine. Ada "
              "Lovelace died in London in 1852.")
  docs = [wikipedia.Document("Ada Lovelace", lovelace),
          wikipedia.Document("Charles Babbage",
                             "Charles Babbage lived in London for decades.")]
  store_dir = str(tmp_path / "blocks")
  block_store.write_block_store(
      blocks.pack_blocks(docs, tokenizer, max_block_len=20), store_dir,
      tokenizer_vocab_path=tokenizer.vocab_path, source="test",
      max_block_len=20)
  store = block_store.BlockStore.open(store_dir)
  own = store.document_blocks(0)
  assert len(own) >= 3 and store.doc_hash[own[0]] == store.doc_hash[own[-1]]
  text, start, limit = _sentence("Ada Lovelace was born in ", "London",
                                 " in 1815.")
  path = str(tmp_path / "x.tfr.gz")
  salient_spans.write_annotated(path, [salient_spans.AnnotatedDocument(
      title="Ada Lovelace", text=text, sentence_byte_starts=(0,),
      sentence_byte_limits=(len(text.encode()),), span_byte_starts=(start,),
      span_byte_limits=(limit,), span_types=("GPE",))])
  queries = examples.read_realm_queries(
      path, tokenizer, config=examples.RealmQueryConfig(query_length=24,
                                                        max_masks=2))
  babbage = store.document_blocks(1)[0]
  source = realm_inputs.TrivialCandidates(store, "block").source_blocks(
      queries)
  assert source[0] == own[0]

  by_article = mlm_warmup.find_answer_blocks(queries, store, reader_length=64)
  by_block = mlm_warmup.find_answer_blocks(
      queries, store, reader_length=64, trivial_candidates="block")
  # "article": only another article's block; "block": the sentence's own
  # block is out, but its article's last block (more shared words than
  # Babbage's) is in.
  assert by_article[0] == babbage
  assert by_block[0] == own[-1]
  np.testing.assert_array_equal(by_block, _brute_force_answer_blocks(
      queries, store, 64, excluded=lambda i, b: b == source[i]))
  with pytest.raises(ValueError, match="trivial_candidates"):
    mlm_warmup.find_answer_blocks(queries, store, reader_length=64,
                                  trivial_candidates="sentence")


def test_reader_adaptation_is_configured_and_checked(world, tmp_path):
  for bad in ({"reader_adaptation_steps": -1},
              {"reader_adaptation_eval_every": 0},
              {"reader_adaptation_learning_rate": 0.0},
              {"reader_adaptation_max_queries": 0},
              {"reader_adaptation_reads": "random"}):
    with pytest.raises(ValueError, match="reader_adaptation"):
      pretrain.PretrainConfig(workdir="", block_store="", queries="", **bad)
  model = tiny.tiny_realm(vocab_size=30522)
  graphdef, params = functional.init(lambda r: Realm(model, rngs=r), 0)
  with pytest.raises(ValueError, match="no MLM head"):
    mlm_warmup.adapt_reader(
        dict(params, reader={k: v for k, v in params["reader"].items()
                             if k != "mlm_head"}), graphdef, _queries(world),
        store=block_store.BlockStore.open(world.block_store), sep_id=102,
        reader_length=64, steps=1)



def _adapt(files, steps, **kwargs):
  """A short adaptation of a fresh tiny reader on `files`' queries."""
  bert = tiny.tiny_bert(30522, max_position_embeddings=80)
  model = RealmConfig(retriever=RetrieverConfig(bert=bert, pooling="mean"),
                      reader=ReaderConfig(bert=bert))
  graphdef, params = functional.init(lambda r: Realm(model, rngs=r), 0)
  store = block_store.BlockStore.open(files.block_store)
  new, report = mlm_warmup.adapt_reader(
      params, graphdef, _queries(files), store=store, sep_id=102,
      reader_length=80, steps=steps, batch_size=8, learning_rate=3e-3,
      seed=0, **kwargs)
  return params, new, report


def _changed(a, b):
  return any(not np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_adaptation_trains_the_reader_only_and_stops_on_utility(
    world, monkeypatch):
  # The measurement, scripted: step 0 is a baseline that never counts;
  # then a streak of 2 evaluations above the threshold stops the run.
  utilities = iter([0.5, 0.01, 0.2, 0.0, 0.1, 0.3, 0.4])
  measure = mlm_warmup._heldout_metrics  # pylint: disable=protected-access

  def scripted(*args):
    return dict(measure(*args), utility=next(utilities))

  monkeypatch.setattr(mlm_warmup, "_heldout_metrics", scripted)
  old, new, report = _adapt(world, 100, eval_every=5, min_utility=0.05)
  assert report["stop_reason"] == "utility" and report["steps"] == 25
  assert [(p["step"], p["streak"]) for p in report["curve"]] == [
      (0, 0), (5, 0), (10, 1), (15, 0), (20, 1), (25, 2)]
  # Held out by article: a tenth of the articles, none trained on.
  queries = _queries(world)
  train, held = mlm_warmup._split_queries(  # pylint: disable=protected-access
      queries["source_doc_hash"], mlm_warmup.ADAPTATION_MAX_QUERIES, 0)
  hashes = np.asarray(queries["source_doc_hash"])
  articles = len(np.unique(hashes))
  assert report["heldout_articles"] == len(np.unique(hashes[held])) == max(
      1, articles // 10)
  assert not set(hashes[train]) & set(hashes[held])
  assert (report["queries"], report["heldout_queries"]) == (len(train),
                                                            len(held))
  assert report["train_answer_share"] > 0.9, report
  assert new["retriever"] is old["retriever"]
  assert _changed(old["reader"]["bert"], new["reader"]["bert"])
  assert _changed(old["reader"]["mlm_head"], new["reader"]["mlm_head"])
  assert not _changed(old["reader"]["span_head"], new["reader"]["span_head"])
  for point in report["curve"]:
    for name in ("null", "random", "answer"):
      assert 0.0 <= point[f"accuracy_{name}"] <= 1.0
    # The early stop's loss when training reads all three: pooled.
    each = [point[f"loss_{name}"] for name in ("null", "random", "answer")]
    assert min(each) <= point["loss_all"] <= max(each)


def test_adaptation_stops_on_overfitting_and_keeps_the_best_reader(
    world, monkeypatch):
  # Scripted held-out losses of what training reads (the answer block's):
  # best at step 10, then 3 evaluations no better -> "overfit" at step 25,
  # returning the reader evaluated at step 10, not the last one.
  losses = iter([9.0, 8.0, 7.0, 7.5, 7.0, 8.0, 1.0])
  seen = []
  measure = mlm_warmup._heldout_metrics  # pylint: disable=protected-access

  def scripted(evaluate, trained, params, batches):
    seen.append(trained)
    return dict(measure(evaluate, trained, params, batches),
                loss_answer=next(losses), utility=0.0)

  monkeypatch.setattr(mlm_warmup, "_heldout_metrics", scripted)
  old, new, report = _adapt(world, 100, eval_every=5, reads="answer")
  assert report["stop_reason"] == "overfit", report
  assert (report["steps"], report["best_step"]) == (25, 10)
  assert [p["best_step"] for p in report["curve"]] == [0, 5, 10, 10, 10, 10]
  best = seen[2]
  for part in ("bert", "mlm_head"):
    for got, want, last in zip(jax.tree.leaves(new["reader"][part]),
                               jax.tree.leaves(best[part]),
                               jax.tree.leaves(seen[-1][part])):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert _changed(best[part], seen[-1][part])
  assert _changed(old["reader"]["bert"], new["reader"]["bert"])
  with pytest.raises(ValueError, match="loss_patience"):
    _adapt(world, 10, loss_patience=0)


def test_answer_only_reads_train_on_the_answer_block_alone(world,
                                                         monkeypatch):
  batches = {}
  loop = mlm_warmup._train_until_useful  # pylint: disable=protected-access

  def spy(params, graphdef, tx, heldout, make_batch, **kwargs):
    batches.update(train=make_batch(0), heldout=heldout[0])
    return loop(params, graphdef, tx, heldout, make_batch, **kwargs)

  monkeypatch.setattr(mlm_warmup, "_train_until_useful", spy)
  old, new, report = _adapt(world, 2, eval_every=1, reads="answer")
  train, heldout = batches["train"], batches["heldout"]
  assert train["token_ids"].shape[:2] == (8, 1)
  assert train["weights"].shape[:2] == (8, 1)
  # Every training row has an answer block (those without one are left
  # out) and reads it: the input is longer than the null document's.
  assert np.all(train["weights"].sum(-1) > 0)
  def document_tokens(slot):
    return (slot["segment_ids"] * slot["input_mask"]).sum(-1)

  null = document_tokens({k: heldout[k][:, mlm_warmup.NULL]
                          for k in ("segment_ids", "input_mask")})
  assert np.all(document_tokens({k: train[k][:, 0] for k in (
      "segment_ids", "input_mask")}) > null.max() + 4)
  assert report["reads"] == "answer" and report["train_answer_share"] == 1.0
  # Held-out evaluations still read all three documents.
  assert heldout["token_ids"].shape[1] == 3
  assert _changed(old["reader"]["bert"], new["reader"]["bert"])
  with pytest.raises(ValueError, match="reads"):
    _adapt(world, 1, reads="random")


def test_shuffled_facts_answer_blocks_are_found_but_not_read(tmp_path):
  # Every biography states the NEXT person's facts. Token matching still
  # finds an answer block for every query: e.g. the PREVIOUS person's
  # biography, which states this person's facts under another name. The
  # person's own biography (what a retriever matching the name returns)
  # misleads and is chosen only where it states the same fact by chance.
  files = knowledge_world.write_world(
      str(tmp_path / "shuffled"), num_people=48, num_heldout=8,
      shuffle_facts=True)
  store = block_store.BlockStore.open(files.block_store)
  people = knowledge_world.load_people(files.people)
  gold = knowledge_world.gold_blocks(store, people)
  previous = {blocks.title_hash(p.article_title):
              gold[blocks.title_hash(q.article_title)]
              for p, q in zip(people, people[-1:] + people[:-1])}
  queries = _queries(files)
  found = mlm_warmup.find_answer_blocks(queries, store, reader_length=80)
  hashes = [int(h) for h in queries["source_doc_hash"]]
  own_bio = np.array([gold[h] for h in hashes])
  assert np.all(found >= 0)  # The previous biography always qualifies.
  assert np.mean(found == own_bio) < 0.1
  # It is the one chosen for the years (rare: it alone states them); a
  # city is also named by other biographies, which tie with it.
  assert np.mean(found == np.array([previous[h] for h in hashes])) > 0.5

  # A tiny reader from scratch does not learn to read within a small
  # budget here: the stop rule holds on to the end.
  _, _, report = _adapt(files, 30, eval_every=10)
  assert report["stop_reason"] == "steps" and report["steps"] == 30
  assert [p["step"] for p in report["curve"]] == [0, 10, 20, 30]
  assert all(p["utility"] <= mlm_warmup.MIN_UTILITY
             for p in report["curve"]), report["curve"]

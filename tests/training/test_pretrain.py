"""REALM pre-training: learning, crash-safe resume, trainer + index builder.

The subprocess tests run the real entry points
(`python -m realm_jax.jobs.pretrain`, `python -m realm_jax.jobs.index_builder`)
on a tiny real-text corpus, with the 8 emulated devices of the test env.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import gin
import jax
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.testing import corpus, timeouts
from realm_jax.training import candidates as candidates_lib
from realm_jax.training import pretrain
from realm_jax.core import checkpoints

STEPS = 8


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("corpus"))
  store, annotated = corpus.make_tiny_corpus(directory)
  return store, corpus.make_query_cache(
      annotated, os.path.join(directory, "queries"), query_length=32)


# PretrainConfig's parts, by field name (`_bindings`' `part__field`).
PARTS = {"retrieval": "RetrievalConfig", "retriever": "RetrieverScheduleConfig",
         "gate": "GateConfig", "guards": "GuardConfig",
         "recall_guard": "RecallGuardConfig"}


def _bindings(workdir, tiny_corpus, **overrides):
  """The run's bindings; `part__field=v` binds a part's field."""
  store, queries = tiny_corpus
  values = {"num_train_steps": STEPS, "checkpoint_every": 2,
            "reader_length": 64, **overrides}

  def binding(key, value):
    part, _, field = key.rpartition("__")
    scope = PARTS[part] if part else "PretrainConfig"
    return f"pretrain.{scope}.{field} = {value!r}"

  return [f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
          f"QUERIES = '{queries}'"] + [
              binding(k, v) for k, v in values.items()]


def _configs(bindings):
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"], bindings)
  return (gin.get_configurable(pretrain.PretrainConfig)(),
          gin.get_configurable(pretrain.RealmConfig)())


def _losses(workdir):
  """Per-step losses from metrics.jsonl (a restarted step's last record)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      out[record["step"]] = record
  return out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_corpus):
  workdir = str(tmp_path_factory.mktemp("reference"))
  config, model = _configs(_bindings(workdir, tiny_corpus))
  history = pretrain.train(config=config, model=model)
  gin.clear_config()
  return workdir, history


def test_loss_decreases_and_metrics_are_logged(reference_run):
  workdir, history = reference_run
  losses = [h["loss"] for h in history]
  assert len(losses) == STEPS
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2, losses
  for h in history:
    assert {"retrieval_utility", "mlm_correct", "index_staleness",
            "examples_per_second", "seconds_per_step"} <= set(h)
    # Inline refresh every 2 steps: the index is at most 2 steps stale.
    assert 0 < h["index_staleness"] <= 2
  assert checkpoints.is_done(checkpoints.checkpoint_dir(workdir))
  assert len(_losses(workdir)) == STEPS


def test_the_unused_span_head_is_not_decayed(reference_run):
  workdir, _ = reference_run
  directory = checkpoints.checkpoint_dir(workdir)
  first, last = (checkpoints.restore_items(directory, step,
                                           checkpoints.PARAM_ITEMS)
                 for step in (0, STEPS))
  assert "span_head" in last["reader"]
  for a, b in zip(jax.tree.leaves(first["reader"]["span_head"]),
                  jax.tree.leaves(last["reader"]["span_head"])):
    np.testing.assert_array_equal(a, b)
  # What the loss reads did train.
  assert not np.array_equal(first["reader"]["bert"]["layer_0"]["output"][
      "kernel"], last["reader"]["bert"]["layer_0"]["output"]["kernel"])


def _pretrain_cmd(bindings, *gin_files):
  files = [f"--gin_file={f}" for f in
           ("experiments/pretrain_tiny_cpu.gin", *gin_files)]
  return [sys.executable, "-m", "realm_jax.jobs.pretrain", *files,
          *[f"--gin_bindings={b}" for b in bindings]]


def _wait_for(predicate, timeout, proc=None):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return True
    if proc is not None and proc.poll() is not None:
      return predicate()
    time.sleep(0.2)
  return False


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
def test_kill_9_then_restart_reproduces_the_loss_trajectory(
    tmp_path, tiny_corpus, reference_run):
  ref_losses = _losses(reference_run[0])
  workdir = str(tmp_path / "run")
  cmd = _pretrain_cmd(_bindings(workdir, tiny_corpus))
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  try:
    assert _wait_for(lambda: os.path.isdir(os.path.join(ckpt_dir, "4")),
                     timeouts.HANG_SECONDS,
                     proc), "the trainer never checkpointed step 4"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert not checkpoints.is_done(ckpt_dir)
  killed_at = max(_losses(workdir))
  assert killed_at < STEPS
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL, timeout=timeouts.HANG_SECONDS)
  assert checkpoints.is_done(ckpt_dir)
  got = _losses(workdir)
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in range(1, STEPS + 1):
    np.testing.assert_allclose(got[step]["loss"], ref_losses[step]["loss"],
                               rtol=1e-4, err_msg=f"step {step}")


def test_an_inline_run_builds_its_index_as_index_build_says(
    tmp_path, tiny_corpus, monkeypatch):
  """An inline-mode trainer builds every index with its whole
  PretrainConfig.index_build (bound as builder.IndexBuildConfig, the
  builder job's class): searcher and searcher_config, the embedding batch
  and dtype, and retention, not just the searcher's name."""
  from realm_jax.index import build, publish  # pylint: disable=g-import-not-at-top
  embedded_with = []
  real = build.embed_lib.embed_block_store

  def embed(*args, **kwargs):
    embedded_with.append((kwargs["batch_size_per_device"],
                          kwargs["bfloat16"]))
    return real(*args, **kwargs)

  monkeypatch.setattr(build.embed_lib, "embed_block_store", embed)
  workdir = str(tmp_path / "run")
  config, model = _configs(_bindings(
      workdir, tiny_corpus, num_train_steps=2, checkpoint_every=1) + [
          "builder.IndexBuildConfig.searcher = 'scann'",
          "builder.IndexBuildConfig.searcher_config = (('num_shards', 2),)",
          "builder.IndexBuildConfig.batch_size_per_device = 1",
          "builder.IndexBuildConfig.bfloat16 = True",
          "builder.IndexBuildConfig.keep = 1"])
  gin.clear_config()
  assert config.index_build == build.IndexBuildConfig(
      searcher="scann", searcher_config=(("num_shards", 2),),
      batch_size_per_device=1, bfloat16=True, keep=1)
  history = pretrain.train(config=config, model=model)
  assert [h["index_step"] for h in history] == [0, 1]
  # Indices 0 and 1, each embedded as bound; only the newest kept.
  assert embedded_with == [(1, True)] * 2
  root = checkpoints.index_root(workdir)
  assert publish.published_steps(root) == [1]
  index = publish.load_index(root)
  assert index.searcher.kind == "sharded"
  assert [s.kind for s in index.searcher.shards] == ["scann", "scann"]


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
def test_trainer_and_index_builder_processes(tmp_path, tiny_corpus):
  workdir = str(tmp_path / "run")
  store, _ = tiny_corpus
  bindings = _bindings(workdir, tiny_corpus, num_train_steps=24,
                       index_mode="builder", keep_checkpoints=5,
                       index_wait_seconds=timeouts.HANG_SECONDS, log_every=1)
  trainer = subprocess.Popen(_pretrain_cmd(bindings),
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  builder = subprocess.Popen(
      [sys.executable, "-m", "realm_jax.jobs.index_builder",
       "--gin_file=models/tiny.gin", "--gin_file=runs/index_builder.gin",
       f"--gin.WORKDIR='{workdir}'", f"--gin.BLOCK_STORE='{store}'",
       "--gin.builder.IndexBuildConfig.searcher='exact'",
       "--gin.builder.BuilderConfig.poll_seconds=0.2",
       f"--gin.builder.BuilderConfig.timeout_seconds={timeouts.HANG_SECONDS}"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    _, trainer_log = trainer.communicate(timeout=timeouts.HANG_SECONDS)
    _, builder_log = builder.communicate(timeout=timeouts.HANG_SECONDS)
  finally:
    for p in (trainer, builder):
      if p.poll() is None:
        p.kill()
  assert trainer.returncode == 0, trainer_log[-3000:]
  assert builder.returncode == 0, builder_log[-3000:]
  records = _losses(workdir)
  index_steps = [records[s]["index_step"] for s in sorted(records)]
  assert index_steps[0] == 0
  assert len(set(index_steps)) >= 2, index_steps  # Swapped at least once.
  assert index_steps == sorted(index_steps)
  for s, r in records.items():
    assert r["index_staleness"] == s - r["index_step"]
  assert "Index watcher: now serving index" in trainer_log
  assert "trainer is done" in builder_log


def test_a_dead_builder_is_noticed(tmp_path, tiny_corpus, monkeypatch):
  """The builder publishes index 0 and dies: the trainer warns once the
  index is stale, then (with stale_index_error) stops with an error that
  names the index directory."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  from realm_jax.index import build, builder  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / "run")
  config, model = _configs(_bindings(
      workdir, tiny_corpus, num_train_steps=20, checkpoint_every=1,
      index_mode="builder", keep_checkpoints=5, index_wait_seconds=300.0,
      guards__stale_index_warning=2.0, guards__stale_index_error=4.0))
  gin.clear_config()
  published = []

  def one_index():
    published.extend(builder.run_builder(
        workdir=workdir, store=block_store.BlockStore.open(config.block_store),
        retriever_config=model.retriever,
        config=builder.BuilderConfig(
            index_build=build.IndexBuildConfig(searcher="exact"),
            poll_seconds=0.1),
        max_indices=1, timeout=timeouts.HANG_SECONDS))

  import threading  # pylint: disable=g-import-not-at-top
  thread = threading.Thread(target=one_index)
  thread.start()
  warnings = []
  monkeypatch.setattr(absl_logging, "warning",
                      lambda msg, *a: warnings.append(msg % a))
  with pytest.raises(pretrain.StaleIndexError, match="index 0 is 5 steps"):
    pretrain.train(config=config, model=model)
  thread.join()
  assert published == [0]
  stale = [w for w in warnings if "STALE INDEX" in w]
  assert len(stale) == 1 and "step 3" in stale[0], warnings
  assert checkpoints.index_root(workdir) in stale[0]


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
def test_retrieval_on_device_trains_like_retrieval_on_host(
    tmp_path, tiny_corpus, reference_run, monkeypatch):
  """RetrievalConfig.search="device": search, candidate gathering and batch
  assembly on the 8 devices give the host path's candidates, so the same
  losses."""
  reference, _ = reference_run
  calls = []
  real = candidates_lib.device_search.candidate_batch
  monkeypatch.setattr(candidates_lib.device_search, "candidate_batch",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))
  workdir = str(tmp_path / "device")
  config, model = _configs(_bindings(workdir, tiny_corpus,
                                     retrieval__search="device"))
  history = pretrain.train(config=config, model=model)
  gin.clear_config()
  want = _losses(reference)
  assert len(history) == STEPS
  for h in history:
    np.testing.assert_allclose(h["loss"], want[h["step"]]["loss"],
                               rtol=1e-5, atol=1e-5)
    assert h["hubness"] == want[h["step"]]["hubness"]
  assert len(calls) == STEPS  # every batch came from the device path


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
def test_overlapped_input_searches_ahead_and_restarts_exactly(
    tmp_path, tiny_corpus, monkeypatch):
  """overlap_input: step s+1's search and batch run on a host thread while
  step s trains, with step s's retriever; a run stopped and restarted
  replays the uninterrupted run, using the candidates its checkpoint saved
  instead of searching with the (newer) restored retriever."""
  import threading  # pylint: disable=g-import-not-at-top
  searches, embedded_with = [], []
  source = candidates_lib.OverlappedHostCandidates
  real_search, real_embed = source.search, source.query_embeddings

  def search(self, local, q_emb, index):
    searches.append(threading.current_thread().name)
    return real_search(self, local, q_emb, index)

  def embed(self, local, state):
    embedded_with.append(int(jax.device_get(state.step)))
    return real_embed(self, local, state)

  monkeypatch.setattr(source, "search", search)
  monkeypatch.setattr(source, "query_embeddings", embed)

  def run(workdir, stop_after=None):
    config, model = _configs(_bindings(workdir, tiny_corpus,
                                       retrieval__overlap_input=True))
    history = pretrain.train(config=config, model=model,
                             stop_after=stop_after)
    gin.clear_config()
    return history

  straight = str(tmp_path / "straight")
  run(straight)
  # Step 0's queries with state 0, then step s+1's with state s.
  assert embedded_with == [0] + list(range(STEPS))
  assert not searches[0].startswith("pretrain-input")
  assert all(n.startswith("pretrain-input") for n in searches[1:])
  assert len(searches) == STEPS + 1  # one look-ahead past the end

  restarted = str(tmp_path / "restarted")
  run(restarted, stop_after=4)
  meta = checkpoints.read_meta(checkpoints.checkpoint_dir(restarted), 4)
  saved = meta["prefetched_candidates"]
  assert saved["step"] == 4
  config, _ = _configs(_bindings(restarted, tiny_corpus))
  gin.clear_config()
  assert np.asarray(saved["ids"]).shape == (config.batch_size,
                                            config.retrieval.num_candidates)
  searches.clear()
  run(restarted)
  # Step 4 came from the checkpoint; steps 5..8 (and the look-ahead) were
  # searched on the thread.
  assert len(searches) == STEPS - 4
  want, got = _losses(straight), _losses(restarted)
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in got:
    np.testing.assert_allclose(got[step]["loss"], want[step]["loss"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # Minutes of training: CI runs it after the suite.
def test_reranking_a_stale_index_trains_like_a_fresh_index(
    tmp_path, tiny_corpus, monkeypatch):
  """rerank_candidates (Atlas-style): with every block outside the query's
  article proposed, re-ranking by the current document tower picks what an
  index rebuilt before every step would, so a run on the never-refreshed
  index of step 0 reproduces the fresh-index run's losses."""
  # One block per article (64 wordpieces): 7 blocks outside each query's
  # article, all of them proposed.
  store, _ = corpus.make_tiny_corpus(str(tmp_path / "corpus64"),
                                     max_block_len=64)
  _, queries = tiny_corpus
  moving = {"retrieval__num_candidates": 3, "gate__latest_release": 0,
            "retriever__learning_rate_multiplier": 1.0,
            "learning_rate": 3e-2}
  reordered = []
  real_rerank = candidates_lib.HostCandidates.rerank

  def rerank(self, queries, proposals, params):
    out = real_rerank(self, queries, proposals, params)
    reordered.append(not np.array_equal(out, proposals[:, :3]))
    return out

  monkeypatch.setattr(candidates_lib.HostCandidates, "rerank", rerank)

  def run(name, **overrides):
    workdir = str(tmp_path / name)
    config, model = _configs(_bindings(workdir, (store, queries),
                                       **moving, **overrides))
    history = pretrain.train(config=config, model=model)
    gin.clear_config()
    return {h["step"]: h for h in history}

  fresh = run("fresh", checkpoint_every=1)
  reranked = run("reranked", checkpoint_every=STEPS,
                 retrieval__rerank_candidates=7)
  assert len(reordered) == STEPS
  # The retriever moved away from the stale index's order.
  assert any(reordered), "the test needs a retriever that moves"
  assert sorted(reranked) == sorted(fresh)
  for step, h in reranked.items():
    assert h["index_step"] == 0 and fresh[step]["index_step"] == step - 1
    np.testing.assert_allclose(h["loss"], fresh[step]["loss"], rtol=1e-5,
                               atol=1e-5)
    assert h["hubness"] == fresh[step]["hubness"]


def test_the_query_settings_come_from_the_cache(tmp_path, tiny_corpus):
  """The trainer declares no masking: it streams the cache's (query_length
  32 here, from its manifest) and refuses a reader too short for it, naming
  the cache."""
  config, model = _configs(_bindings(str(tmp_path / "run"), tiny_corpus,
                                     reader_length=32))
  gin.clear_config()
  assert not {"query_length", "max_masks", "masking"} & {
      f.name for f in dataclasses.fields(config)}
  with pytest.raises(ValueError, match=r"reader_length=32 must exceed the "
                     r"query_length=32 of the query cache .*queries"):
    pretrain.train(config=config, model=model)


def test_rerank_configuration_is_checked(tiny_corpus):
  """Options that exclude each other are refused, naming both."""
  for bad, other in (({"rerank_candidates": 2, "num_candidates": 3},
                      "num_candidates"),
                     ({"rerank_candidates": 8, "overlap_input": True},
                      "overlap_input"),
                     ({"rerank_candidates": 8, "search": "device"},
                      "search")):
    with pytest.raises(ValueError, match=rf"rerank_candidates.*{other}"):
      pretrain.RetrievalConfig(**bad)
  for retrieval in (pretrain.RetrievalConfig(search="device"),
                    pretrain.RetrievalConfig(rerank_candidates=8)):
    with pytest.raises(ValueError, match=r"training='query_side'.*"
                       r"search='device'.*rerank_candidates"):
      pretrain.PretrainConfig(
          workdir="w", block_store="b", queries="q", retrieval=retrieval,
          retriever=pretrain.RetrieverScheduleConfig(training="query_side"))
  with pytest.raises(ValueError, match=r"refresh_every=15 must be a positive "
                     r"multiple of checkpoint_every=10"):
    pretrain.PretrainConfig(workdir="w", block_store="b", queries="q",
                            checkpoint_every=10, refresh_every=15)


def test_query_side_mode_never_changes_the_document_tower_or_the_index(
    tmp_path, tiny_corpus):
  """RetrieverScheduleConfig.training='query_side': one index (step 0) for
  the whole run, a document tower equal to its start, a query tower and
  reader that learn; a shared-tower model is refused."""
  workdir = str(tmp_path / "query_side")
  config, model = _configs(_bindings(
      workdir, tiny_corpus, retriever__training="query_side",
      gate__latest_release=0, retriever__learning_rate_multiplier=1.0,
      learning_rate=3e-2) + [
          "realm.RetrieverConfig.share_towers = False"])
  history = pretrain.train(config=config, model=model)
  gin.clear_config()
  assert len(history) == STEPS and np.isfinite(
      [h["loss"] for h in history]).all()
  assert all(h["index_step"] == 0 for h in history)
  index_root = checkpoints.index_root(workdir)
  assert sorted(p for p in os.listdir(index_root) if p.isdigit()) == ["0"]
  directory = checkpoints.checkpoint_dir(workdir)
  first, last = (checkpoints.restore_items(directory, step,
                                           checkpoints.PARAM_ITEMS)
                 for step in (0, STEPS))
  for a, b in zip(jax.tree.leaves(first["retriever"]["document_embedder"]),
                  jax.tree.leaves(last["retriever"]["document_embedder"])):
    np.testing.assert_array_equal(a, b)
  moved = lambda part: any(  # pylint: disable=g-long-lambda
      not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first[part]),
                                               jax.tree.leaves(last[part])))
  assert moved("reader")
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(first["retriever"]["query_embedder"]),
      jax.tree.leaves(last["retriever"]["query_embedder"])))
  # The served index's rows are still the document tower's embeddings.
  from realm_jax.index import embed, publish  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  store = block_store.BlockStore.open(config.block_store)
  index = publish.load_index(index_root, 0)
  fresh, _ = embed.embed_block_store(last["retriever"], model.retriever,
                                     store)
  np.testing.assert_allclose(fresh, index.embeddings, rtol=1e-4, atol=1e-5)

  shared, model = _configs(_bindings(str(tmp_path / "shared"), tiny_corpus,
                                     retriever__training="query_side"))
  gin.clear_config()
  with pytest.raises(ValueError, match="share_towers"):
    pretrain.train(config=shared, model=model)


def test_a_torn_gate_record_does_not_block_the_resume(tmp_path, tiny_corpus,
                                                      caplog):
  """An evidence-gate run killed while appending to gate.jsonl (after its
  checkpoint of step 4) resumes: the torn record is dropped with a warning
  naming the file, and the resumed run's decisions are whole lines."""
  workdir = str(tmp_path / "run")
  gate = dict(gate__mode="evidence", gate__queries=tiny_corpus[1],
              gate__every=2, gate__num_queries=8, gate__latest_release=None)
  config, model = _configs(_bindings(workdir, tiny_corpus, **gate))
  pretrain.train(config=config, model=model)
  path = os.path.join(workdir, "gate.jsonl")
  with open(path, "rb") as f:
    text = f.read()
  assert [json.loads(l)["step"] for l in text.splitlines()] == [0, 2, 4, 6]
  # The kill: in the middle of the step-6 record, before checkpoint 6.
  last = text.rstrip(b"\n").rfind(b"\n") + 1
  with open(path, "wb") as f:
    f.write(text[:last + (len(text) - last) // 2])
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  for step in (6, 8):
    shutil.rmtree(os.path.join(ckpt_dir, str(step)))
  checkpoints.clear_done_marker(ckpt_dir)
  config, model = _configs(_bindings(workdir, tiny_corpus, **gate))
  with caplog.at_level("WARNING"):
    pretrain.train(config=config, model=model)
  gin.clear_config()
  assert f"{path}: its last record is torn" in caplog.text
  with open(path, encoding="utf-8") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == [0, 2, 4, 6]


def test_the_default_recipe_runs_the_gate_and_the_recall_guard(tmp_path,
                                                               tiny_corpus):
  """runs/pretrain.gin with nothing but a model, a corpus and queries (the
  run's size aside): the evidence gate and the recall guard both evaluate
  the run, on its own queries, and the retriever stays frozen without the
  gate's evidence (no step count releases it)."""
  store, queries = tiny_corpus
  workdir = str(tmp_path / "run")
  gin.clear_config()
  try:
    gin_cli.parse(["models/tiny.gin", "models/cpu.gin", "runs/pretrain.gin"],
                  [f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
                   f"QUERIES = '{queries}'"] + [
                       f"pretrain.{b}" for b in (
                           "PretrainConfig.num_train_steps = 4",
                           "PretrainConfig.batch_size = 8",
                           "PretrainConfig.checkpoint_every = 2",
                           "PretrainConfig.index_mode = 'inline'",
                           "GateConfig.every = 2",
                           "RecallGuardConfig.every = 2",
                           # k + m within the tiny store's 9 blocks.
                           "RetrievalConfig.num_candidates = 4")] + [
                               "builder.IndexBuildConfig.searcher = 'exact'"])
    config = gin.get_configurable(pretrain.PretrainConfig)()
    model = gin.get_configurable(pretrain.RealmConfig)()
  finally:
    gin.clear_config()
  assert config.gate.mode == "evidence" and config.recall_guard.enabled
  assert (config.retrieval.lexical_candidates,
          config.retrieval.held_prior) == (3, "mixture")
  with pytest.raises(ValueError, match="too few for 7 dense and 3 BM25"):
    pretrain.train(config=dataclasses.replace(
        config, retrieval=dataclasses.replace(config.retrieval,
                                              num_candidates=7)),
                   model=model)
  pretrain.train(config=config, model=model)
  records = {}
  for name in ("gate", "recall_guard"):
    with open(os.path.join(workdir, f"{name}.jsonl"), encoding="utf-8") as f:
      records[name] = [json.loads(line) for line in f]
  assert [r["step"] for r in records["gate"]] == [0, 2]
  assert not any(r["released"] for r in records["gate"])
  assert [r["step"] for r in records["recall_guard"]] == [0, 2]
  assert records["recall_guard"][0]["probe"] == "answer-bearing"
  assert not any(r["training"] for r in records["recall_guard"])

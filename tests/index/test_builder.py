"""The index builder: data-parallel embedding, polling, resume, DONE."""

import dataclasses
import io
import logging
import os
import re
import subprocess
import sys
import threading
import time

from etils import epath
import gin
import jax
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.checkpoint_import import core, importers
from realm_jax.core import checkpoints, dataclass_json, io_utils
from realm_jax.core import lease as lease_lib
from realm_jax.data import block_store_writer, blocks, wikipedia
from realm_jax.data.tokenizer import Tokenizer, default_model_dir
from realm_jax.index import build, build_progress, builder, embed, publish
from realm_jax.jobs import index_builder
from realm_jax.model import functional
from realm_jax.model.realm import Realm, RealmConfig, Retriever
from realm_jax.testing import timeouts, tiny

TEXTS = [
    ("Alpha", "Alpha is a letter. It comes first in the Greek alphabet."),
    ("Beta", "Beta is the second letter. It follows alpha."),
    ("Gamma", "Gamma rays are energetic. They come from nuclei. Gamma is "
              "also a letter of the Greek alphabet."),
    ("Delta", "A delta is where a river meets the sea. The Nile has one."),
]
CONFIG = tiny.tiny_realm(vocab_size=30522)
EXACT = build.IndexBuildConfig(searcher="exact")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  tok = Tokenizer()
  docs = [wikipedia.Document(t, x) for t, x in TEXTS]
  return block_store_writer.write_block_store(
      blocks.pack_blocks(docs, tok, max_block_len=16),
      str(tmp_path_factory.mktemp("s") / "store"),
      tokenizer_vocab_path=tok.vocab_path, source="test", max_block_len=16)


def _params(seed, config=CONFIG):
  return functional.init(lambda r: Realm(config, rngs=r), seed)[1]


def _direct_embeddings(retriever_params, store, config=CONFIG):
  graphdef, _ = functional.abstract_init(
      lambda r: Retriever(config.retriever, rngs=r))
  inputs = store.retriever_inputs(np.arange(len(store)), 16)
  return np.asarray(functional.bind(graphdef, retriever_params)
                    .embed_documents(inputs["token_ids"],
                                     inputs["input_mask"],
                                     inputs["segment_ids"]))


def test_data_parallel_embedding_equals_direct_and_host_shares(store):
  params = _params(0)["retriever"]
  want = _direct_embeddings(params, store)
  got, stats = embed.embed_block_store(params, CONFIG.retriever, store,
                                       batch_size_per_device=1)
  assert jax.local_device_count() == 8 and len(store) % 8  # Padded batch.
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert stats.rows == len(store)
  shares = [embed.embed_block_store(params, CONFIG.retriever, store,
                                    batch_size_per_device=2,
                                    process_index=i, process_count=3)[0]
            for i in range(3)]
  np.testing.assert_allclose(np.concatenate(shares), want, atol=2e-5)


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def test_embedding_progress_bar_on_a_terminal_chief_only(store, monkeypatch,
                                                         caplog):
  """Host 0 shows done/total, blocks/s and ETA on a terminal's stderr; other
  hosts and non-terminals (logs, pytest) draw no bar; one INFO line with
  the total time and rate ends it (`core.progress`)."""
  params = _params(0)["retriever"]
  for index, terminal in ((0, True), (1, True), (0, False)):
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with caplog.at_level(logging.INFO):
      caplog.clear()
      embed.embed_block_store(params, CONFIG.retriever, store,
                              batch_size_per_device=1, process_index=index,
                              process_count=2)
    lo, hi = embed.host_row_range(len(store), index, 2)
    share = hi - lo
    if index == 0 and terminal:
      bar = err.getvalue()
      assert "embedding blocks: 100%" in bar and "blocks/s]" in bar
      assert f" {share}/{share} " in bar and "<00:00" in bar  # The ETA.
    else:
      assert not err.getvalue()
    assert re.search(r"embedding blocks: %d/%d blocks in .* s, .* "
                     r"blocks/s \(host %d/2\)" % (share, share, index),
                     caplog.text)


def _save(ckpt, step, seed):
  params = _params(seed)
  ckpt.save(step, params, {"count": np.zeros(())}, {"seed": seed}, force=True)
  ckpt.wait_until_finished()
  return params


def test_builder_skips_superseded_resumes_and_stops_on_done(store, tmp_path):
  workdir = str(tmp_path / "run")
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=5, async_save=False)
  for step, seed in ((1, 1), (2, 2)):
    _save(ckpt, step, seed)
  params3 = _save(ckpt, 3, 3)
  config = builder.BuilderConfig(index_build=EXACT, poll_seconds=0.05)
  published = builder.run_builder(workdir=workdir, store=store,
                                  retriever_config=CONFIG.retriever,
                                  config=config, max_indices=1)
  assert published == [3]  # 1 and 2 were superseded before it looked.
  root = checkpoints.index_root(workdir)
  index = publish.load_index(root, expect=publish.Expectation(
      store.fingerprint, len(store), 16))
  np.testing.assert_allclose(index.embeddings,
                             _direct_embeddings(params3["retriever"], store),
                             atol=2e-5)
  assert index.manifest["params_sha256"] == publish.params_checksum(
      params3["retriever"])

  # A crash mid-publication leaves a temporary and a step directory
  # without manifest; the restarted builder (given an epath.Path workdir
  # this time) removes them, resumes after step 3, builds step 4 and exits
  # on DONE.
  os.makedirs(os.path.join(root, ".tmp-4-999"))
  os.makedirs(os.path.join(root, "4"))
  with open(os.path.join(root, "4", publish.EMBEDDINGS), "w") as f:
    f.write("half")
  assert publish.published_steps(root) == [3]
  _save(ckpt, 4, 4)
  checkpoints.write_done_marker(ckpt_dir, 4)
  published = builder.run_builder(workdir=epath.Path(workdir), store=store,
                                  retriever_config=CONFIG.retriever,
                                  config=config, timeout=timeouts.HANG_SECONDS)
  assert published == [4]
  assert publish.read_latest(root) == 4
  assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
  # Nothing new and DONE: returns at once (no grace for a trainer that
  # would continue the run).
  assert builder.run_builder(
      workdir=workdir, store=store, retriever_config=CONFIG.retriever,
      config=dataclasses.replace(config, done_grace_seconds=0.0),
      timeout=timeouts.HANG_SECONDS) == []


def test_publishing_imported_embeddings_checks_rows(store, tmp_path):
  with pytest.raises(ValueError, match="row i must be block i"):
    build.publish_embeddings(embeddings=np.zeros((3, 16), np.float32),
                             store=store, root=str(tmp_path), step=0)
  emb = np.random.default_rng(0).normal(size=(len(store), 16)).astype(
      np.float32)
  build.publish_embeddings(
      embeddings=emb, store=store, root=str(tmp_path), step=0,
      config=build.IndexBuildConfig(searcher="exact"))
  np.testing.assert_array_equal(publish.load_index(str(tmp_path)).embeddings,
                                emb)


def test_builder_publishes_a_sharded_scann_index(store, tmp_path):
  """The paper-size recipe (docs/benchmarks/mips_scale.md): one ScaNN index
  per row range with a bfloat16 re-ordering copy, set through the
  builder's searcher_config, published and loaded as one searcher whose
  global ids equal exact search's."""
  emb = np.random.default_rng(1).normal(size=(len(store), 16)).astype(
      np.float32)
  build.publish_embeddings(
      embeddings=emb, store=store, root=str(tmp_path), step=0,
      config=build.IndexBuildConfig(searcher_config=(
          ("num_shards", 2), ("reordering_dtype", "bfloat16"))))
  index = publish.load_index(str(tmp_path))
  assert index.searcher.kind == "sharded"
  assert [s.kind for s in index.searcher.shards] == ["scann", "scann"]
  assert index.searcher.config.shard_config.reordering_dtype == "bfloat16"
  queries = emb[:3] + 0.01
  ids, _ = index.searcher.search_batched(queries, 4)
  np.testing.assert_array_equal(
      ids, np.argsort(-(queries @ emb.T), axis=1, kind="stable")[:, :4])


class _Recorded(build_progress.BuildProgress):
  """The builder's progress record, every write also kept in order."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.writes = []

  def write(self, stage, done=0, total=0, error=""):
    self.writes.append((stage, done, total))
    super().write(stage, done, total, error)


def test_a_build_records_its_progress_for_a_waiting_trainer(store, tmp_path):
  """Issue 48: the builder records how far it got (blocks embedded, then
  publishing) in the index root, where a waiting trainer's watcher reads
  it; the record names this process."""
  root = str(tmp_path / "index")
  progress = _Recorded(root, 5, every_seconds=0.0)
  build.build_and_publish(
      retriever_params=_params(0)["retriever"],
      retriever_config=CONFIG.retriever, store=store, root=root, step=5,
      config=dataclasses.replace(EXACT, batch_size_per_device=1),
      progress=progress)
  n = len(store)
  embedded = [w for w in progress.writes if w[0] == "embedding"]
  assert embedded[0] == ("embedding", 0, n)
  assert embedded[-1] == ("embedding", n, n)
  assert [d for _, d, _ in embedded] == sorted(d for _, d, _ in embedded)
  assert progress.writes[-1][0] == "publishing"
  record = build_progress.read_progress(root)
  assert (record["step"], record["stage"], record["pid"]) == (
      5, "publishing", os.getpid())
  assert publish.read_latest(root) == 5


def test_publication_retries_then_fails_loudly(store, tmp_path,
                                               monkeypatch):
  """Transient write errors are retried; persistent ones end the job with
  an error (never a silent stale index)."""
  emb = np.random.default_rng(0).normal(size=(len(store), 8)).astype(
      np.float32)
  real = publish.publish_index
  failures = []

  def flaky(*args, **kwargs):
    if len(failures) < 2:
      failures.append(1)
      raise PermissionError(13, "Permission denied")
    return real(*args, **kwargs)

  monkeypatch.setattr(publish, "publish_index", flaky)
  config = build.IndexBuildConfig(searcher="exact", publish_attempts=3,
                                  retry_seconds=0.01)
  root = str(tmp_path / "index")
  build.publish_embeddings(embeddings=emb, store=store, root=root, step=0,
                           config=config)
  assert publish.read_latest(root) == 0 and len(failures) == 2

  def broken(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(publish, "publish_index", broken)
  with pytest.raises(build.PublishFailedError, match="failed 3 times"):
    build.publish_embeddings(embeddings=emb, store=store, root=root, step=1,
                             config=config,
                             progress=build_progress.BuildProgress(root, 1))
  assert publish.read_latest(root) == 0
  # A waiting trainer hears that the builder is failing, and why.
  record = build_progress.read_progress(root)
  assert record["stage"] == "retrying" and "No space left" in record["error"]


def test_job_command_line_one_shot_and_missing_paths(store, tmp_path,
                                                    capsys):
  """`python -m realm_jax.jobs.index_builder`'s job, as gin_cli.run calls it:
  paths are gin macros (runs/index_builder.gin); one_shot embeds the newest
  checkpoint with the gin model's retriever and exits."""
  workdir = str(tmp_path / "run")
  gin.clear_config()
  try:
    gin_cli.parse(["models/tiny.gin"], [])
    with pytest.raises(SystemExit, match=r"BuilderConfig.workdir is not set"
                       r".*runs/index_builder.gin.*--gin.WORKDIR="):
      index_builder.job(False)
    gin.clear_config()
    gin_cli.parse(["models/tiny.gin", "runs/index_builder.gin"], [
        f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store.path}'",
        "builder.BuilderConfig.one_shot = True",
        "builder.IndexBuildConfig.searcher = 'exact'"])
    index_builder.job(True)
    assert f"workdir='{workdir}'" in capsys.readouterr().out
    model = gin.get_configurable(RealmConfig)()
    ckpt = checkpoints.TrainCheckpointer(checkpoints.checkpoint_dir(workdir),
                                         keep=5, async_save=False)
    params = _params(7, model)
    ckpt.save(7, params, {"count": np.zeros(())}, {}, force=True)
    ckpt.wait_until_finished()
    index_builder.job(False)
  finally:
    gin.clear_config()
  root = checkpoints.index_root(workdir)
  assert publish.published_steps(root) == [7]
  np.testing.assert_allclose(
      publish.load_index(root).embeddings,
      _direct_embeddings(params["retriever"], store, model), atol=2e-5)
  # REALM's block_emb, published as it is (no model file needed).
  emb = np.random.default_rng(1).normal(size=(len(store), 16)).astype(
      np.float32)
  prefix = core.write_tf_checkpoint(str(tmp_path / "encoded.ckpt"),
                                    {"block_emb": emb})
  gin.clear_config()
  try:
    gin_cli.parse(["runs/index_builder.gin"], [
        f"WORKDIR = '{tmp_path / 'imported'}'", f"BLOCK_STORE = '{store.path}'",
        f"builder.BuilderConfig.init_from = 'block_emb:{prefix}'",
        "builder.IndexBuildConfig.searcher = 'exact'"])
    index_builder.job(False)
  finally:
    gin.clear_config()
  index = publish.load_index(checkpoints.index_root(str(tmp_path /
                                                        "imported")))
  assert index.step == 0
  np.testing.assert_array_equal(index.embeddings, emb)
  # Issue 58: the one-shot modes record their progress too.
  assert build_progress.read_progress(checkpoints.index_root(
      str(tmp_path / "imported")))["stage"] == "publishing"
  with pytest.raises(ValueError, match="random weights"):
    builder.BuilderConfig(init_from="scratch")


def test_one_shot_job_logs_progress_to_a_file_and_records_it(tmp_path):
  """Issue 58: `python -m realm_jax.jobs.index_builder` in one-shot mode with
  stderr sent to a file (as on a pod or under nohup) logs progress lines
  with done/total, rate and ETA every `--progress_seconds`, then the total
  time, and writes `index/.progress.json` as the polling mode does."""
  tok = Tokenizer()
  docs = [wikipedia.Document(f"{t} {i}", x) for i in range(12)
          for t, x in TEXTS]
  big = block_store_writer.write_block_store(
      blocks.pack_blocks(docs, tok, max_block_len=16),
      str(tmp_path / "store"), tokenizer_vocab_path=tok.vocab_path,
      source="test", max_block_len=16)
  n = len(big)
  workdir = str(tmp_path / "run")
  ckpt = checkpoints.TrainCheckpointer(checkpoints.checkpoint_dir(workdir),
                                       keep=5, async_save=False)
  ckpt.save(4, _params(4), {"count": np.zeros(())},
            {"model_config": dataclass_json.to_dict(CONFIG)}, force=True)
  ckpt.wait_until_finished()
  log = tmp_path / "builder.log"
  with open(log, "w") as err:
    # A short period, rather than a big store: the lines of a few batches.
    subprocess.run(
        [sys.executable, "-m", "realm_jax.jobs.index_builder",
         "--gin_file=models/tiny.gin", f"--gin.WORKDIR='{workdir}'",
         f"--gin.BLOCK_STORE='{big.path}'",
         "--gin.builder.BuilderConfig.one_shot=True",
         "--gin.builder.IndexBuildConfig.searcher='exact'",
         "--gin.builder.IndexBuildConfig.batch_size_per_device=1",
         "--progress_seconds=0.001"], stdout=subprocess.DEVNULL,
        stderr=err, check=True, timeout=timeouts.HANG_SECONDS)
  text = log.read_text()
  batches = -(-n // (8 * 1))  # 8 devices (conftest), one block each.
  lines = re.findall(
      r"embedding blocks: (\d+)/(\d+) blocks \((\d+)%\), [\d.]+ blocks/s, "
      r"ETA (\S+( s)?) \(host 0/1\)$", text, re.M)
  assert len(lines) >= 2 and batches > 2, text
  done = [int(d) for d, *_ in lines]
  assert all(int(t) == n for _, t, *_ in lines) and done == sorted(done)
  assert re.search(rf"embedding blocks: {n}/{n} blocks in [\d.]+ s, "
                   r"[\d.]+ blocks/s \(host 0/1\)$", text, re.M), text
  record = build_progress.read_progress(checkpoints.index_root(workdir))
  assert (record["step"], record["stage"]) == (4, "publishing")
  assert publish.read_latest(checkpoints.index_root(workdir)) == 4


@pytest.mark.parametrize("bad, message", [
    ({"searcher": "faiss"}, r"searcher='faiss'; use 'scann' or 'exact'"),
    ({"searcher": "exact", "searcher_config": (("num_leaves", 8),)},
     r"unknown ExactConfig fields \['num_leaves'\]"),
    ({"keep": 0}, r"IndexBuildConfig.keep must be an int >= 1"),
    ({"publish_attempts": 0}, r"publish_attempts must be an int >= 1"),
])
def test_an_index_build_config_is_checked_when_built(bad, message):
  """Before any embedding: a searcher name, or a searcher_config field its
  searcher lacks, fails when the config is built (the builder job's and an
  inline trainer's alike)."""
  with pytest.raises(ValueError, match=message):
    build.IndexBuildConfig(**bad)


def test_the_builder_embeds_with_the_checkpoints_own_retriever_config(
    store, tmp_path):
  """A checkpoint that carries its model config is embedded with it, not
  with the gin files' (here: L2-normalised embeddings, which the tiny model
  file does not ask for), in the follow mode and in the one-shot job."""
  trained = dataclasses.replace(CONFIG, retriever=dataclasses.replace(
      CONFIG.retriever, normalize=True))
  params = _params(3)
  for name in ("follow", "one_shot"):
    ckpt = checkpoints.TrainCheckpointer(
        checkpoints.checkpoint_dir(str(tmp_path / name)), keep=5,
        async_save=False)
    ckpt.save(3, params, {"count": np.zeros(())},
              {"model_config": dataclass_json.to_dict(trained)}, force=True)
    ckpt.wait_until_finished()
  want = _direct_embeddings(params["retriever"], store, trained)
  np.testing.assert_allclose(np.linalg.norm(want, axis=1), 1.0, atol=1e-5)

  assert builder.run_builder(
      workdir=str(tmp_path / "follow"), store=store,
      retriever_config=CONFIG.retriever, max_indices=1,
      config=builder.BuilderConfig(index_build=EXACT,
                                   poll_seconds=0.05)) == [3]
  gin.clear_config()
  try:
    gin_cli.parse(["models/tiny.gin", "runs/index_builder.gin"], [
        f"WORKDIR = '{tmp_path / 'one_shot'}'",
        f"BLOCK_STORE = '{store.path}'",
        "builder.BuilderConfig.one_shot = True",
        "builder.IndexBuildConfig.searcher = 'exact'"])
    assert not gin.get_configurable(RealmConfig)().retriever.normalize
    index_builder.job(False)
  finally:
    gin.clear_config()
  for name in ("follow", "one_shot"):
    np.testing.assert_allclose(
        publish.load_index(checkpoints.index_root(str(tmp_path / name)))
        .embeddings, want, atol=2e-5)


def test_job_one_shot_from_minilm_with_no_checkpoint(store, tmp_path):
  """init_from takes every `checkpoint_import.init_from` kind: 'minilm' with the MiniLM
  model file publishes index 0 of the imported retriever's embeddings."""
  workdir = str(tmp_path / "run")
  gin.clear_config()
  try:
    gin_cli.parse(["models/minilm_l6.gin", "runs/index_builder.gin"], [
        f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store.path}'",
        "builder.BuilderConfig.init_from = 'minilm'",
        "builder.IndexBuildConfig.searcher = 'exact'"])
    model = gin.get_configurable(RealmConfig)()
    index_builder.job(False)
  finally:
    gin.clear_config()
  _, bert = importers.load_hf_bert(default_model_dir())
  params = importers.with_bert(_params(0, model), bert["bert"], into="both")
  index = publish.load_index(checkpoints.index_root(workdir))
  assert index.step == 0 and not os.path.exists(
      checkpoints.checkpoint_dir(workdir))
  np.testing.assert_allclose(
      index.embeddings, _direct_embeddings(params["retriever"], store, model),
      atol=2e-5)
  # MiniLM's mean-pooled, L2-normalised sentence embeddings.
  np.testing.assert_allclose(np.linalg.norm(index.embeddings, axis=1), 1.0,
                             atol=1e-5)


def _finished_run(store, tmp_path):
  """A run DONE at step 12, with its index 12 published; its checkpointer."""
  workdir = str(tmp_path / "run")
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=5, async_save=False)
  _save(ckpt, 12, 12)
  checkpoints.write_done_marker(ckpt_dir, 12)
  config = builder.BuilderConfig(index_build=EXACT, poll_seconds=0.05,
                                 done_grace_seconds=0.0)
  assert builder.run_builder(workdir=workdir, store=store,
                             retriever_config=CONFIG.retriever,
                             config=config,
                             timeout=timeouts.HANG_SECONDS) == [12]
  return workdir, ckpt


def _extend(workdir, ckpt, leased: threading.Event):
  """What a trainer that extends the run to step 13 does, in order: it
  leases the workdir, restores and compiles (the old DONE still there),
  clears DONE before its first step, checkpoints, writes DONE, exits."""
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  with lease_lib.Lease(workdir, job="extending trainer"):
    leased.set()
    time.sleep(0.5)
    checkpoints.clear_done_marker(ckpt_dir)
    _save(ckpt, 13, 13)
    time.sleep(0.5)
    checkpoints.write_done_marker(ckpt_dir, 13)


@pytest.mark.parametrize("first", ["builder", "trainer"])
def test_a_leftover_done_does_not_end_an_extended_run(store, tmp_path, first):
  """The old DONE (step 12) must not make the builder exit while a trainer
  extends the run: it indexes step 13, then exits on the new DONE."""
  workdir, ckpt = _finished_run(store, tmp_path)
  config = builder.BuilderConfig(index_build=EXACT, poll_seconds=0.05,
                                 done_grace_seconds=30.0)
  published, leased = [], threading.Event()
  trainer = threading.Thread(target=_extend, args=(workdir, ckpt, leased))
  if first == "trainer":  # No grace: the trainer's lease alone keeps it.
    trainer.start()
    assert leased.wait(timeouts.HANG_SECONDS)
    config = dataclasses.replace(config, done_grace_seconds=0.0)
  job = threading.Thread(target=lambda: published.extend(builder.run_builder(
      workdir=workdir, store=store, retriever_config=CONFIG.retriever,
      config=config, timeout=timeouts.HANG_SECONDS)))
  job.start()
  if first == "builder":
    time.sleep(0.5)  # The builder has seen the old DONE by now.
    trainer.start()
  trainer.join(60)
  job.join(60)
  assert not job.is_alive()
  assert published == [13]
  assert publish.read_latest(checkpoints.index_root(workdir)) == 13


def test_the_final_index_is_built_when_done_lands_after_the_listing(
    store, tmp_path, monkeypatch):
  """The trainer saves its last checkpoint and writes DONE between the
  builder's listing of the checkpoints and its look for DONE. Listing first
  (the old order) then saw DONE without the last checkpoint and exited
  without its index; reading DONE first builds it."""
  workdir = str(tmp_path / "run")
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  root = checkpoints.index_root(workdir)
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=5, async_save=False)
  _save(ckpt, 1, 1)
  listing = checkpoints.finalized_steps
  finished = []

  def racy_listing(directory):
    steps = listing(directory)
    if (not finished and steps == [1]
        and publish.published_steps(root) == [1]):
      finished.append(True)  # The trainer ends right after this listing.
      _save(ckpt, 2, 2)
      checkpoints.write_done_marker(ckpt_dir, 2)
    return steps

  monkeypatch.setattr(checkpoints, "finalized_steps", racy_listing)
  config = builder.BuilderConfig(index_build=EXACT, poll_seconds=0.05,
                                 done_grace_seconds=0.0)
  published = builder.run_builder(workdir=workdir, store=store,
                                  retriever_config=CONFIG.retriever,
                                  config=config, timeout=timeouts.HANG_SECONDS)
  assert finished  # the race happened
  assert published == [1, 2]
  assert publish.read_latest(root) == 2


def test_a_damaged_checkpoint_is_skipped_not_fatal(store, tmp_path, caplog):
  workdir = str(tmp_path / "run")
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=5, async_save=False)
  _save(ckpt, 1, 1)
  _save(ckpt, 2, 2)
  data = os.path.join(ckpt_dir, "2", "retriever", "ocdbt.process_0", "d")
  for name in os.listdir(data):
    with open(os.path.join(data, name), "r+b") as f:
      f.truncate(10)
  config = builder.BuilderConfig(index_build=EXACT, poll_seconds=0.05)
  with caplog.at_level(logging.WARNING):
    assert builder.run_builder(workdir=workdir, store=store,
                               retriever_config=CONFIG.retriever,
                               config=config, max_indices=1,
                               timeout=timeouts.HANG_SECONDS) == [1]
  assert re.search(r"checkpoints/2 does not restore", caplog.text)


def _truncate_retriever(ckpt_dir, step):
  data = os.path.join(ckpt_dir, str(step), "retriever", "ocdbt.process_0", "d")
  for name in os.listdir(data):
    with open(os.path.join(data, name), "r+b") as f:
      f.truncate(10)


def test_a_one_shot_build_of_a_damaged_checkpoint_names_the_way_out(
    store, tmp_path):
  """The one-shot builder on a truncated newest checkpoint: the trainer's
  message (which checkpoint does not restore) and the way out
  (`BuilderConfig.step=<the newest older step>`), not TensorStore's."""
  workdir = str(tmp_path / "run")
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=5, async_save=False)
  _save(ckpt, 2, 2)
  _save(ckpt, 4, 4)
  _truncate_retriever(ckpt_dir, 4)
  one_shot = [f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store.path}'",
              "builder.BuilderConfig.one_shot = True"]
  gin.clear_config()
  gin_cli.parse(["models/tiny.gin", "runs/index_builder.gin"], one_shot)
  try:
    with pytest.raises(SystemExit, match=(
        rf"(?s)^checkpoint {re.escape(ckpt_dir)}/4 does not restore "
        r"\(.*\); its "
        r"files are damaged: index an older one with "
        r"--gin.builder.BuilderConfig.step=2$")):
      index_builder.job(False)
  finally:
    gin.clear_config()
  assert not publish.published_steps(checkpoints.index_root(workdir))


def test_an_index_root_that_is_an_input_by_another_name_is_refused(
    store, tmp_path):
  # W/index a link to W/checkpoints: publishing step 7 would replace
  # checkpoint 7.
  workdir = str(tmp_path / "run")
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=5, async_save=False)
  _save(ckpt, 7, 7)
  before = sorted(os.listdir(ckpt_dir))
  os.symlink(ckpt_dir, checkpoints.index_root(workdir))
  gin.clear_config()
  try:
    gin_cli.parse(["models/tiny.gin", "runs/index_builder.gin"], [
        f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store.path}'",
        "builder.BuilderConfig.one_shot = True",
        "builder.IndexBuildConfig.searcher = 'exact'"])
    with pytest.raises(SystemExit, match=r"index root .* and the checkpoints"
                       r" \(<WORKDIR>/checkpoints\)=.* are the same place"):
      index_builder.job(False)
  finally:
    gin.clear_config()
  assert sorted(os.listdir(ckpt_dir)) == before
  # The builder's index root as another name for its block store.
  other = str(tmp_path / "other")
  os.makedirs(other)
  os.symlink(store.path, checkpoints.index_root(other))
  with pytest.raises(io_utils.SamePlaceError, match="BLOCK_STORE="):
    builder.run_builder(workdir=other, store=store,
                        retriever_config=CONFIG.retriever, config=(
                            builder.BuilderConfig(index_build=EXACT)),
                        timeout=1)

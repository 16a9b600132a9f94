"""realm_jax.index.extend: new blocks added to a published index without
retraining return what a full rebuild on the union returns."""

import logging
import os
import re
import subprocess
import sys

import gin
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.core import checkpoints, dataclass_json, io_utils
from realm_jax.core import lease as lease_lib
from realm_jax.core import progress
from realm_jax.data import wikipedia
from realm_jax.index import build, extend, extend_job, publish
from realm_jax.jobs import index_extend
from realm_jax.model import functional
from realm_jax.model.realm import Realm
from realm_jax.testing import corpus, timeouts, tiny

CONFIG = tiny.tiny_realm(vocab_size=30522)
_WORDS = ("river lake hill fort mapped surveyor glacial northern garrison "
          "cold water pass bridge tower market harbour island valley").split()


def _documents(first, count):
  rng = np.random.default_rng(first)
  return [wikipedia.Document(f"Place {first + i}", " ".join(
      f"The {' '.join(rng.choice(_WORDS, 4))} of place {first + i}." for _
      in range(6))) for i in range(count)]


def _store(path, docs):
  return corpus.write_store(path, docs, 16)


@pytest.fixture(scope="module", name="stores")
def _stores(tmp_path_factory):
  root = tmp_path_factory.mktemp("stores")
  base_docs, new_docs = _documents(0, 12), _documents(100, 6)
  return (_store(root / "base", base_docs),
          _store(root / "union", base_docs + new_docs),
          _store(root / "other", new_docs + base_docs))


def _retriever(seed=0):
  return functional.init(lambda r: Realm(CONFIG, rngs=r), seed)[1][
      "retriever"]


SEARCHERS = {
    "exact": build.IndexBuildConfig(searcher="exact",
                                    batch_size_per_device=2),
    # A real tree (4 leaves) and asymmetric hashing, trained again on the
    # merged embeddings. Two ScaNN builds on the same embeddings need not
    # agree when some leaves are skipped (its k-means is not reproducible
    # run to run), so every leaf is searched and every candidate
    # re-ordered: then both return the exact top-k, built either way.
    "scann": build.IndexBuildConfig(searcher_config=(
        ("num_leaves", 4), ("num_leaves_to_search", 4),
        ("reordering_num_neighbors", 200), ("training_sample_size", 200)),
                                    batch_size_per_device=2),
}


def _assert_same_index(merged, full) -> np.ndarray:
  """`merged` holds `full`'s embeddings and returns what `full` returns
  for queries near every block's embedding; its top-5 ids.

  A tiny random retriever embeds every block nearly alike, so the queries
  are the embeddings' deviations from their mean (which the constant part
  of every score cannot tie), and the ids agree up to ties: two blocks
  whose exact scores differ by less than the embeddings' own float error
  (a job's process embeds on another device count, in another summation
  order) may come in either order.
  """
  e_m = np.asarray(merged.embeddings, np.float64)
  e_f = np.asarray(full.embeddings, np.float64)
  np.testing.assert_allclose(e_m, e_f, atol=1e-5)
  deviations = e_f - e_f.mean(axis=0)
  queries = (deviations / np.linalg.norm(deviations, axis=1, keepdims=True)
             ).astype(np.float32)
  ids_m, scores_m = merged.search(queries, 5)
  ids_f, scores_f = full.search(queries, 5)
  exact = queries.astype(np.float64) @ e_f.T
  # A score moves by at most |q|_1 * max|e_m - e_f| between the two.
  tie = float(np.abs(queries).sum(axis=1).max() * np.abs(e_m - e_f).max())
  tie = max(tie, 1e-6 * float(np.abs(exact).max()))
  picked_m = np.take_along_axis(exact, ids_m, axis=1)
  picked_f = np.take_along_axis(exact, ids_f, axis=1)
  np.testing.assert_allclose(picked_m, picked_f, rtol=0, atol=2 * tie)
  np.testing.assert_allclose(scores_m, scores_f, rtol=0,
                             atol=2 * tie + 1e-5 * float(np.abs(exact).max()))
  # The check can tell a wrong block: ranks 1 and 5 are far more than a
  # tie apart for most queries.
  assert np.median(picked_f[:, 0] - picked_f[:, 4]) > 100 * tie
  return ids_m


@pytest.mark.parametrize("kind", sorted(SEARCHERS))
def test_extended_index_equals_a_full_rebuild(stores, tmp_path, kind):
  base, union, _ = stores
  config, params = SEARCHERS[kind], _retriever()
  assert len(union) > len(base) + 20
  build.build_and_publish(retriever_params=params,
                          retriever_config=CONFIG.retriever, store=base,
                          root=str(tmp_path / "base"), step=7,
                          config=config)
  path = extend.extend_index(
      index_root=str(tmp_path / "base"), base_store=base, union_store=union,
      retriever_params=params, retriever_config=CONFIG.retriever,
      output_root=str(tmp_path / "merged"), config=config)
  build.build_and_publish(retriever_params=params,
                          retriever_config=CONFIG.retriever, store=union,
                          root=str(tmp_path / "full"), step=7,
                          config=config)
  merged = publish.load_index(str(tmp_path / "merged"), expect=(
      publish.Expectation(union.fingerprint, len(union))))
  full = publish.load_index(str(tmp_path / "full"))
  assert path.endswith("7") and merged.step == 7
  assert merged.manifest["new_rows"] == len(union) - len(base)
  assert merged.manifest["extends"]["rows"] == len(base)
  assert merged.searcher.kind == full.searcher.kind == kind
  ids_m = _assert_same_index(merged, full)
  # The new blocks are retrieved.
  assert (ids_m[:, 0] >= len(base)).sum() > 3


def test_refuses_other_parameters_stores_and_the_same_root(stores,
                                                            tmp_path):
  base, union, other = stores
  params = _retriever()
  root = str(tmp_path / "base")
  build.build_and_publish(retriever_params=params,
                          retriever_config=CONFIG.retriever, store=base,
                          root=root, step=0,
                          config=SEARCHERS["exact"])
  common = dict(index_root=root, base_store=base,
                retriever_config=CONFIG.retriever,
                output_root=str(tmp_path / "out"))
  with pytest.raises(ValueError, match="was built with parameters"):
    extend.extend_index(union_store=union, retriever_params=_retriever(1),
                        **common)
  with pytest.raises(ValueError, match="does not extend .* first rows' "
                     "body_ids differ"):
    extend.extend_index(union_store=other, retriever_params=params,
                        **common)
  with pytest.raises(io_utils.SamePlaceError, match="are the same place"):
    extend.extend_index(union_store=union, retriever_params=params,
                        **dict(common, output_root=root))
  with pytest.raises(publish.IndexRejectedError, match="corpus_fingerprint"):
    extend.extend_index(union_store=union, retriever_params=params,
                        **dict(common, base_store=other))
  assert not (tmp_path / "out").exists()


def test_extension_logs_its_progress(stores, tmp_path, monkeypatch, caplog):
  """Issue 58: embedding the new blocks logs done/total, rate and ETA
  (`core.progress`, here every batch), then the total time."""
  base, union, _ = stores
  config, params = SEARCHERS["exact"], _retriever()
  build.build_and_publish(retriever_params=params,
                          retriever_config=CONFIG.retriever, store=base,
                          root=str(tmp_path / "base"), step=3,
                          config=config)
  monkeypatch.setattr(progress, "_every_seconds", [1e-9])
  with caplog.at_level(logging.INFO):
    extend.extend_index(
        index_root=str(tmp_path / "base"), base_store=base,
        union_store=union, retriever_params=params,
        retriever_config=CONFIG.retriever,
        output_root=str(tmp_path / "merged"), config=config)
  new = len(union) - len(base)
  what = "extending index 3: embedding new blocks"
  assert re.search(rf"{what}: \d+/{new} blocks \(\d+%\), [\d.]+ blocks/s, "
                   r"ETA \S+", caplog.text), caplog.text
  assert re.search(rf"{what}: {new}/{new} blocks in [\d.]+ s",
                   caplog.text), caplog.text


def test_an_alias_of_the_base_or_a_leased_root_is_refused(stores, tmp_path):
  base, union, _ = stores
  params = _retriever()
  root = str(tmp_path / "index")
  build.build_and_publish(retriever_params=params,
                          retriever_config=CONFIG.retriever, store=base,
                          root=root, step=6, config=SEARCHERS["exact"])
  before = sorted(os.listdir(root)), (tmp_path / "index" / "6" /
                                      "manifest.json").read_bytes()
  os.symlink(root, tmp_path / "alias")
  common = dict(index_root=root, base_store=base, union_store=union,
                retriever_params=params, retriever_config=CONFIG.retriever,
                config=SEARCHERS["exact"])
  for alias in (str(tmp_path / "alias"), str(tmp_path / "x" / ".." /
                                             "index"), root + "/"):
    with pytest.raises(io_utils.SamePlaceError, match="index_root="):
      extend.extend_index(output_root=alias, **common)
  # Inside the base root, or holding it: refused too.
  for inside in (root + "/sub", str(tmp_path)):
    with pytest.raises(io_utils.SamePlaceError):
      extend.extend_index(output_root=inside, **common)
  assert (sorted(os.listdir(root)), (tmp_path / "index" / "6" /
                                     "manifest.json").read_bytes()) == before
  # A root whose lease a running index builder holds.
  out = str(tmp_path / "out")
  with lease_lib.Lease(out, job="index builder"):
    with pytest.raises(lease_lib.LeaseHeldError, match="index builder"):
      extend.extend_index(output_root=out, **common)
  assert publish.read_latest(out) is None
  # Extended twice onto the same output: the second index replaces the
  # first by LATEST's switch alone (a fresh revision directory).
  extend.extend_index(output_root=out, **common)
  path = extend.extend_index(output_root=out, **common)
  assert path.endswith("6.1")
  assert (tmp_path / "out" / "LATEST").read_text() == "6.1\n"
  assert publish.load_index(out).manifest["new_rows"] == (
      len(union) - len(base))


def _run_with_checkpoint(workdir, step):
  """A pre-training run's workdir with checkpoint `step` (carrying its
  model config, as every run's does); its retriever parameters, restored
  as the index builder restores them."""
  ckpt_dir = checkpoints.checkpoint_dir(str(workdir))
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=5, async_save=False)
  params = functional.init(lambda r: Realm(CONFIG, rngs=r), step)[1]
  ckpt.save(step, params, {"count": np.zeros(())},
            {"model_config": dataclass_json.to_dict(CONFIG)}, force=True)
  ckpt.wait_until_finished()
  return checkpoints.restore_retriever(ckpt_dir, step)


def test_the_extend_job_publishes_what_a_full_rebuild_gives(stores,
                                                            tmp_path):
  """`python -m realm_jax.jobs.index_extend` (realm-index-extend) on the
  index a run's builder published: with no INIT_FROM it embeds the new
  blocks with the run's checkpoint of the index's step, and the published
  index equals a full rebuild over the union store."""
  base, union, _ = stores
  workdir = tmp_path / "run"
  params = _run_with_checkpoint(workdir, 5)
  config = SEARCHERS["exact"]
  index_root = checkpoints.index_root(str(workdir))
  build.build_and_publish(retriever_params=params,
                          retriever_config=CONFIG.retriever, store=base,
                          root=index_root, step=5, config=config)
  out = tmp_path / "extended"
  result = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.index_extend",
       f"--gin.INDEX_DIR='{index_root}'", f"--gin.BLOCK_STORE='{base.path}'",
       f"--gin.UNION_STORE='{union.path}'", f"--gin.OUTPUT_DIR='{out}'",
       "--gin.builder.IndexBuildConfig.searcher='exact'",
       "--gin.builder.IndexBuildConfig.batch_size_per_device=2"],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  new = len(union) - len(base)
  assert f"{new} new blocks over {len(base)}" in result.stdout
  build.build_and_publish(retriever_params=params,
                          retriever_config=CONFIG.retriever, store=union,
                          root=str(tmp_path / "full"), step=5, config=config)
  merged = publish.load_index(str(out), expect=publish.Expectation(
      union.fingerprint, len(union)))
  full = publish.load_index(str(tmp_path / "full"))
  assert merged.step == 5 and merged.manifest["new_rows"] == new
  assert merged.manifest["params_sha256"] == full.manifest["params_sha256"]
  _assert_same_index(merged, full)
  # The base index is untouched: still one index, over the base store.
  assert publish.published_steps(index_root) == [5]
  assert publish.load_index(index_root).manifest["corpus_fingerprint"] == (
      base.fingerprint)


def _job(bindings):
  """The job's `job(False)` as its command line runs it."""
  gin.clear_config()
  try:
    gin_cli.parse(["runs/index_extend.gin"], bindings)
    index_extend.job(False)
  finally:
    gin.clear_config()


def test_the_extend_job_names_a_bad_input_and_writes_nothing(stores,
                                                            tmp_path):
  base, union, _ = stores
  workdir = tmp_path / "run"
  index_root = checkpoints.index_root(str(workdir))
  build.build_and_publish(retriever_params=_retriever(),
                          retriever_config=CONFIG.retriever, store=base,
                          root=index_root, step=2, config=SEARCHERS["exact"])
  out = tmp_path / "extended"
  paths = [f"INDEX_DIR = '{index_root}'", f"BLOCK_STORE = '{base.path}'",
           f"OUTPUT_DIR = '{out}'",
           "builder.IndexBuildConfig.searcher = 'exact'"]
  missing = tmp_path / "no_such_store"
  with pytest.raises(SystemExit, match=(
      f"ExtendConfig.union_store='{missing}' is no block store .*"
      r"--gin.UNION_STORE=")):
    _job(paths + [f"UNION_STORE = '{missing}'"])
  with pytest.raises(SystemExit, match=r"ExtendConfig.output_dir is not set"
                     r".*--gin.OUTPUT_DIR="):
    _job(paths[:2] + [f"UNION_STORE = '{union.path}'", "OUTPUT_DIR = None"])
  # No INIT_FROM, and the run has no checkpoint 2 (the index came from
  # elsewhere): the job asks which retriever built it.
  with pytest.raises(SystemExit, match=(
      r"init_from is not set and .*checkpoints holds no checkpoint 2 .*"
      r"--gin.INIT_FROM=")):
    _job(paths + [f"UNION_STORE = '{union.path}'"])
  # Weights other than the index's: refused by its params_sha256.
  _run_with_checkpoint(workdir, 2)
  with pytest.raises(SystemExit, match="was built with parameters"):
    _job(paths + [f"UNION_STORE = '{union.path}'"])
  assert not out.exists()
  with pytest.raises(ValueError, match="no document tower"):
    extend_job.ExtendConfig(init_from="block_emb:/x/encoded.ckpt")

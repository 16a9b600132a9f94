"""MIPS searchers vs naive numpy search; ScaNN recall, save/load, errors."""

import importlib.util
import json
import os

import numpy as np
import pytest

from realm_jax.index import searchers

BACKENDS = ["numpy", "jax"]


def _naive_top_k(embeddings, queries, k):
  """Full score matrix + stable argsort: ties keep the smaller id first."""
  scores = queries @ embeddings.T
  ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  return ids, np.take_along_axis(scores, ids, axis=1)


def _recall_at_k(ids, true_ids):
  return np.mean([len(set(a) & set(b)) / true_ids.shape[1]
                  for a, b in zip(ids, true_ids)])


def _gaussian_mixture(rng, num_rows, num_queries, dim, num_centers, std):
  centers = rng.standard_normal((num_centers, dim), dtype=np.float32)
  def draw(n):
    points = centers[rng.integers(0, num_centers, n)]
    return points + std * rng.standard_normal((n, dim), dtype=np.float32)
  return draw(num_rows), draw(num_queries)


@pytest.fixture(scope="module")
def random_data():
  rng = np.random.default_rng(0)
  embeddings = rng.standard_normal((3001, 24), dtype=np.float32)
  queries = rng.standard_normal((70, 24), dtype=np.float32)
  return embeddings, queries


@pytest.fixture(scope="module")
def clustered():
  """20k x 32 Gaussian mixture (200 centers), 300 queries near the centers,
  and the exact top-10 from the naive reference."""
  rng = np.random.default_rng(1)
  embeddings, queries = _gaussian_mixture(rng, 20_000, 300, 32, 200, 1.0)
  true_ids, _ = _naive_top_k(embeddings, queries, 10)
  return embeddings, queries, true_ids


@pytest.fixture(scope="module")
def scann_index(clustered):
  return searchers.ScannSearcher.build(clustered[0])


# -----------------------------------------------------------------------------
# Exact search.
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("blocks", [None, (700, 16)])
def test_exact_equals_naive_reference(random_data, backend, blocks):
  embeddings, queries = random_data
  config = searchers.ExactConfig(backend=backend)
  if blocks:  # small blocks: many merges, a ragged last block and batch
    config = searchers.ExactConfig(backend=backend, rows_per_block=blocks[0],
                                   queries_per_block=blocks[1])
  searcher = searchers.ExactSearcher.build(embeddings, config)
  ids, scores = searcher.search_batched(queries, 10)
  ref_ids, ref_scores = _naive_top_k(embeddings, queries, 10)
  assert ids.dtype == np.int64 and scores.dtype == np.float32
  assert ids.shape == scores.shape == (70, 10)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
  assert np.all(np.diff(scores, axis=1) <= 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_with_many_ties(backend):
  # Small integer entries: every inner product is exact in float32 and many
  # are equal, so the top-k is only defined up to ties at the k-th place.
  rng = np.random.default_rng(2)
  embeddings = rng.integers(-2, 3, (500, 6)).astype(np.float32)
  queries = rng.integers(-2, 3, (40, 6)).astype(np.float32)
  config = searchers.ExactConfig(backend=backend, rows_per_block=64,
                                 queries_per_block=16)
  searcher = searchers.ExactSearcher.build(embeddings, config)
  ids, scores = searcher.search_batched(queries, 7)
  _, ref_scores = _naive_top_k(embeddings, queries, 7)
  np.testing.assert_array_equal(scores, ref_scores)
  true_scores = np.einsum("qd,qkd->qk", queries, embeddings[ids])
  np.testing.assert_array_equal(scores, true_scores)
  for row_ids, row_scores in zip(ids, scores):
    assert len(set(row_ids)) == 7
    for a, b, sa, sb in zip(row_ids, row_ids[1:], row_scores, row_scores[1:]):
      assert sa > sb or a < b  # equal scores: smaller id first


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_k_equals_num_rows_sorts_everything(backend):
  rng = np.random.default_rng(3)
  embeddings = rng.standard_normal((37, 5), dtype=np.float32)
  queries = rng.standard_normal((4, 5), dtype=np.float32)
  searcher = searchers.ExactSearcher.build(
      embeddings, searchers.ExactConfig(backend=backend, rows_per_block=10))
  ids, _ = searcher.search_batched(queries, 37)
  np.testing.assert_array_equal(ids, _naive_top_k(embeddings, queries, 37)[0])
  empty_ids, empty_scores = searcher.search_batched(
      np.zeros((0, 5), np.float32), 3)
  assert empty_ids.shape == empty_scores.shape == (0, 3)


def test_exact_save_load_is_memory_mapped(random_data, tmp_path):
  embeddings, queries = random_data
  searcher = searchers.ExactSearcher.build(embeddings)
  searcher.save(str(tmp_path / "exact"))
  loaded = searchers.load_searcher(str(tmp_path / "exact"))
  assert isinstance(loaded, searchers.ExactSearcher)
  assert isinstance(loaded.embeddings, np.memmap)
  assert loaded.config == searcher.config
  for got, want in zip(loaded.search_batched(queries, 5),
                       searcher.search_batched(queries, 5)):
    np.testing.assert_array_equal(got, want)
  assert os.listdir(tmp_path) == ["exact"]  # no temp dirs left behind


# -----------------------------------------------------------------------------
# ScaNN.
# -----------------------------------------------------------------------------


def test_scann_recall_against_exact(clustered, scann_index):
  _, queries, true_ids = clustered
  resolved = scann_index.resolved
  # The automatic rule: a tree of round(2 sqrt(20000)) = 283 leaves.
  assert resolved["brute_force"] is False
  assert resolved["num_leaves"] == 283
  assert resolved["num_leaves_to_search"] == 32
  ids, scores = scann_index.search_batched(queries, 10)
  recall = _recall_at_k(ids, true_ids)
  assert recall >= 0.9, recall
  # Re-ordered results carry exact inner products, best first.
  true_scores = np.einsum("qd,qkd->qk", queries, clustered[0][ids])
  np.testing.assert_allclose(scores, true_scores, rtol=1e-4, atol=1e-4)
  assert np.all(np.diff(scores, axis=1) <= 0)
  # Searching fewer leaves through with_search_params costs recall.
  narrow = scann_index.with_search_params(num_leaves_to_search=2)
  assert _recall_at_k(narrow.search_batched(queries, 10)[0], true_ids) < recall


def test_scann_save_load_round_trip(clustered, scann_index, tmp_path):
  queries = clustered[1]
  path = str(tmp_path / "index" / "scann")
  scann_index.save(path)
  with open(os.path.join(path, searchers.METADATA_FILE)) as f:
    metadata = json.load(f)
  assert metadata["kind"] == "scann"
  assert (metadata["num_rows"], metadata["dim"]) == (20_000, 32)
  assert searchers.ScannConfig.from_dict(
      metadata["config"]) == scann_index.config
  assert metadata["resolved"] == scann_index.resolved
  # The ScaNN assets must not point at the temporary directory.
  assert "tmp" not in open(os.path.join(path, "scann",
                                        "scann_assets.pbtxt")).read()
  assert os.listdir(tmp_path / "index") == ["scann"]
  loaded = searchers.load_searcher(path)
  assert isinstance(loaded, searchers.ScannSearcher)
  assert (loaded.num_rows, loaded.dim) == (20_000, 32)
  for got, want in zip(loaded.search_batched(queries, 10),
                       scann_index.search_batched(queries, 10)):
    np.testing.assert_array_equal(got, want)


def test_scann_small_corpus_is_brute_force_and_exact(random_data):
  embeddings, queries = random_data
  searcher = searchers.build_searcher(embeddings, kind="scann")
  assert searcher.resolved == {"brute_force": True}
  ids, scores = searcher.search_batched(queries, 10)
  ref_ids, ref_scores = _naive_top_k(embeddings, queries, 10)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_scann_pads_missing_neighbours(clustered):
  # One leaf of ~70 rows searched, 100 neighbours asked: ScaNN cannot fill
  # every slot, and the missing ones must read id -1 / score -inf.
  embeddings, queries, _ = clustered
  searcher = searchers.ScannSearcher.build(
      embeddings[:12_000],
      searchers.ScannConfig(num_leaves=200, num_leaves_to_search=1))
  ids, scores = searcher.search_batched(queries[:20], 100)
  missing = ids < 0
  assert missing.any()
  np.testing.assert_array_equal(np.isneginf(scores), missing)
  valid = ~missing
  true_scores = np.einsum("qd,qkd->qk", queries[:20],
                          embeddings[np.where(valid, ids, 0)])
  np.testing.assert_allclose(scores[valid], true_scores[valid], rtol=1e-4,
                             atol=1e-4)


def test_scann_config_resolution_and_orqa_preset():
  config = searchers.ScannConfig()
  big = config.resolve(1_000_000, 128)
  # 100 training samples a leaf: 200k rows train 2000 leaves.
  assert (big["num_leaves"], big["num_leaves_to_search"],
          big["training_sample_size"], big["min_partition_size"]) == (
              2000, 50, 200_000, 20)
  paper = config.resolve(13_353_718, 128)
  assert (paper["num_leaves"], paper["training_sample_size"]) == (7309,
                                                                   730_900)
  # Small corpora: at least 100k samples, never more than the rows.
  assert config.resolve(40_000, 128)["training_sample_size"] == 40_000
  assert config.resolve(250_000, 128)["training_sample_size"] == 100_000
  fixed = searchers.ScannConfig(training_sample_size=50_000)
  assert fixed.resolve(1_000_000, 128)["training_sample_size"] == 50_000
  assert config.resolve(100_000_000, 128)["num_leaves"] == 8192
  assert config.resolve(5_000, 128) == {"brute_force": True}
  orqa = searchers.ORQA_SCANN_CONFIG.resolve(1_000_000, 128)
  assert (orqa["num_leaves"], orqa["num_leaves_to_search"]) == (1000, 100)
  assert searchers.ORQA_SCANN_CONFIG.reordering_num_neighbors == 0
  for c in (config, searchers.ORQA_SCANN_CONFIG):
    assert searchers.ScannConfig.from_dict(
        json.loads(json.dumps(c.to_dict()))) == c


# -----------------------------------------------------------------------------
# Sharded search.
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 4, 7])
def test_sharded_exact_equals_unsharded(random_data, num_shards, tmp_path):
  embeddings, queries = random_data
  whole = searchers.ExactSearcher.build(embeddings).search_batched(queries, 12)
  sharded = searchers.ShardedSearcher.build(
      embeddings, searchers.ExactConfig(), num_shards=num_shards)
  assert sharded.row_offsets[0] == 0 and sharded.row_offsets[-1] == 3001
  _assert_same_neighbours(sharded.search_batched(queries, 12), whole,
                          embeddings, queries)
  sharded.save(str(tmp_path / "sharded"))
  loaded = searchers.load_searcher(str(tmp_path / "sharded"))
  assert isinstance(loaded, searchers.ShardedSearcher)
  assert loaded.config == sharded.config
  _assert_same_neighbours(loaded.search_batched(queries, 12), whole,
                          embeddings, queries)


def _assert_same_neighbours(got, want, embeddings, queries):
  """Same ids and scores up to float32 rounding in another summation order.

  A shard's matrix product blocks its sums differently from the whole
  matrix's (and differently on another CPU), so scores may differ in the
  last bits: within 1e-6 of |q| |e|. Ids must agree except between
  neighbours whose true scores are that close.
  """
  (got_ids, got_scores), (want_ids, want_scores) = got, want
  scale = (np.linalg.norm(queries, axis=1)[:, None]
           * np.linalg.norm(embeddings, axis=1).max())
  tol = 1e-6 * scale
  assert (np.abs(got_scores - want_scores) <= tol).all()
  true = np.einsum("qd,qkd->qk", queries.astype(np.float64),
                   embeddings[want_ids].astype(np.float64))
  near_tie = np.zeros(want_ids.shape, bool)
  near_tie[:, 1:] |= np.abs(np.diff(true, axis=1)) < tol
  near_tie[:, :-1] |= near_tie[:, 1:]
  np.testing.assert_array_equal(np.where(near_tie, -1, got_ids),
                                np.where(near_tie, -1, want_ids))


def test_sharded_k_larger_than_a_shard():
  rng = np.random.default_rng(4)
  embeddings = rng.standard_normal((10, 3), dtype=np.float32)
  queries = rng.standard_normal((5, 3), dtype=np.float32)
  sharded = searchers.build_searcher(embeddings, kind="exact", num_shards=4)
  ids, _ = sharded.search_batched(queries, 8)  # shards hold 2 or 3 rows
  np.testing.assert_array_equal(ids, _naive_top_k(embeddings, queries, 8)[0])


def test_sharded_scann_returns_global_ids(clustered, tmp_path):
  embeddings, queries, true_ids = clustered
  sharded = searchers.build_searcher(embeddings, kind="scann", num_shards=2)
  assert [s.resolved["num_leaves"] for s in sharded.shards] == [200, 200]
  ids, scores = sharded.search_batched(queries, 10)
  assert _recall_at_k(ids, true_ids) >= 0.9
  true_scores = np.einsum("qd,qkd->qk", queries, embeddings[ids])
  np.testing.assert_allclose(scores, true_scores, rtol=1e-4, atol=1e-4)


# -----------------------------------------------------------------------------
# Bad input.
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("embeddings, message", [
    (np.zeros((4, 3), np.float64), "must be float32"),
    (np.zeros(12, np.float32), "2-D array"),
    (np.zeros((0, 8), np.float32), "empty"),
    (np.array([[0, 1], [np.nan, 1], [2, 2]], np.float32), "row 1 holds NaN"),
    (np.array([[0, 1], [1, 1], [np.inf, 2]], np.float32), "row 2 holds NaN"),
])
@pytest.mark.parametrize("kind", ["exact", "scann"])
def test_bad_embeddings(embeddings, message, kind):
  with pytest.raises(ValueError, match=message):
    searchers.build_searcher(embeddings, kind=kind)


@pytest.mark.parametrize("queries, k, message", [
    (np.zeros((2, 4), np.float32), 4, "queries have dim 4 but the index"),
    (np.zeros((2, 3), np.float64), 4, "queries must be float32"),
    (np.zeros(3, np.float32), 4, r"queries\[None, :\]"),
    (np.array([[1, 2, np.nan]], np.float32), 4, "query row 0 holds NaN"),
    (np.zeros((2, 3), np.float32), 11, "k=11 is out of range"),
    (np.zeros((2, 3), np.float32), 0, "k=0 is out of range"),
    (np.zeros((2, 3), np.float32), 2.0, "k must be an int"),
])
@pytest.mark.parametrize("kind", ["exact", "scann"])
def test_bad_queries(queries, k, message, kind):
  searcher = searchers.build_searcher(np.ones((10, 3), np.float32), kind=kind)
  with pytest.raises(ValueError, match=message):
    searcher.search_batched(queries, k)


def test_bad_configs_and_directories(tmp_path):
  with pytest.raises(ValueError, match="backend must be 'numpy' or 'jax'"):
    searchers.ExactConfig(backend="torch")
  with pytest.raises(ValueError, match="exceeds num_leaves"):
    searchers.ScannConfig(num_leaves=10, num_leaves_to_search=20)
  with pytest.raises(ValueError, match="unknown ScannConfig fields"):
    searchers.build_searcher(np.ones((3, 2), np.float32), kind="scann",
                             num_leafs=4)
  with pytest.raises(ValueError, match="kind must be one of"):
    searchers.build_searcher(np.ones((3, 2), np.float32), kind="faiss")
  with pytest.raises(ValueError, match="num_leaves=50 exceeds the 40 rows"):
    searchers.ScannSearcher.build(np.ones((40, 2), np.float32),
                                  searchers.ScannConfig(num_leaves=50))
  with pytest.raises(ValueError, match="dims_per_block=4 exceeds the "
                     "embedding dim 3"):
    searchers.ScannConfig(dims_per_block=4).resolve(20_000, 3)
  with pytest.raises(ValueError, match="num_shards=5 exceeds the 4 rows"):
    searchers.build_searcher(np.ones((4, 2), np.float32), kind="exact",
                             num_shards=5)
  with pytest.raises(ValueError, match="searcher.json is missing"):
    searchers.load_searcher(str(tmp_path))
  exact = searchers.build_searcher(np.ones((4, 2), np.float32), kind="exact")
  exact.save(str(tmp_path / "exact"))
  with pytest.raises(ValueError, match="holds a searcher of kind 'exact'"):
    searchers.ScannSearcher.load(str(tmp_path / "exact"))
  brute = searchers.build_searcher(np.ones((40, 2), np.float32), kind="scann")
  with pytest.raises(ValueError, match="brute force"):
    brute.with_search_params(num_leaves_to_search=1)


# -----------------------------------------------------------------------------
# The benchmark script runs (at a tiny size; its numbers are not checked).
# -----------------------------------------------------------------------------


def test_benchmark_runs_at_ci_size():
  path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                      "mips.py")
  spec = importlib.util.spec_from_file_location("mips_benchmark", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  results = module.run_benchmark(num_rows=12_000, dim=16, num_queries=64,
                                 repeats=1, min_seconds=0.0, sweep=True)
  names = [r["name"] for r in results]
  assert names[:4] == ["exact_numpy", "exact_jax", "scann_default",
                       "scann_orqa"]
  assert names[4:] == ["scann_default_sweep"] * 9
  by_name = {r["name"]: r for r in results}
  assert by_name["exact_numpy"]["recall@10"] == 1.0
  assert by_name["exact_jax"]["recall@10"] == 1.0
  for r in results:
    assert 0 <= r["recall@10"] <= 1 and r["queries_per_s"] > 0
    assert (r["num_rows"], r["dim"], r["num_queries"]) == (12_000, 16, 64)
    json.dumps(r)

"""Device retrieval and batch assembly against the host exact path."""

import jax
import ml_dtypes
import numpy as np
import pytest

from realm_jax.core import parallel
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import device_search, searchers
from realm_jax.testing import corpus
from realm_jax.data import realm_inputs

ARTICLES = {
    **corpus.SHORT_ARTICLES,
    "Great Barrier Reef": "The Great Barrier Reef lies off Australia. It is "
                          "the largest coral reef system in the world.",
}


@pytest.fixture(scope="module")
def mesh():
  return parallel.make_mesh()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  return corpus.small_blocks(str(tmp_path_factory.mktemp("s") / "store"),
                             ARTICLES)


def _search_index(mesh, embeddings, dtype=np.float32):
  """An index over bare embeddings (search needs no tokens)."""
  n = len(embeddings)
  # pylint: disable-next=protected-access
  put = lambda x: device_search._put(mesh, x)
  return device_search.DeviceIndex(
      None, put(np.zeros((n, 3), np.uint16)), put(np.zeros((n, 2), np.int32)),
      put(np.zeros((n, 2), np.int32)), n, 101, 102, 0,
      mesh).with_embeddings(embeddings, dtype)


def _int_data(rng, n, dim, q):
  # Small integers: every summation order gives the exact same scores, so
  # ties are exact and ids must match one for one.
  return (rng.integers(-2, 3, (n, dim)).astype(np.float32),
          rng.integers(-2, 3, (q, dim)).astype(np.float32))


@pytest.mark.parametrize("n", [1003, 64, 11])
def test_search_equals_host_exact_search_with_ties(mesh, n):
  emb, queries = _int_data(np.random.default_rng(n), n, 6, 16)
  k = min(10, n)
  ids, scores = jax.device_get(device_search.search(
      _search_index(mesh, emb), queries, k))
  # Independent reference: sort by (-score, id).
  s = queries.astype(np.float64) @ emb.T.astype(np.float64)
  order = np.lexsort((np.broadcast_to(np.arange(n), s.shape), -s))[:, :k]
  np.testing.assert_array_equal(ids, order)
  np.testing.assert_array_equal(scores, np.take_along_axis(s, order, 1))
  # The host exact searchers: the JAX one breaks every tie by id; the numpy
  # one may cut ties inside its first block either way, so only its scores
  # are compared.
  for backend in ("jax", "numpy"):
    want_ids, want_scores = searchers.ExactSearcher.build(
        emb, {"backend": backend}).search_batched(queries, k)
    np.testing.assert_array_equal(scores, want_scores)
    if backend == "jax":
      np.testing.assert_array_equal(ids, want_ids)
  assert len(np.unique(s.round())) < s.size // 4  # there were ties


def test_approx_flag_runs_exact_on_cpu(mesh):
  emb, queries = _int_data(np.random.default_rng(1), 500, 6, 8)
  index = _search_index(mesh, emb)
  got, _ = device_search.search(index, queries, 5, approx=True)
  want, _ = searchers.ExactSearcher.build(emb).search_batched(queries, 5)
  # approx_max_k may return other rows of equal score: compare scores.
  s = queries @ emb.T
  np.testing.assert_array_equal(np.take_along_axis(s, np.asarray(got), 1),
                                np.take_along_axis(s, want, 1))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_search_float_embeddings(mesh, dtype):
  rng = np.random.default_rng(2)
  emb = rng.standard_normal((2001, 32)).astype(np.float32)
  queries = rng.standard_normal((8, 32)).astype(np.float32)
  ids, _ = jax.device_get(device_search.search(
      _search_index(mesh, emb, dtype), queries, 8))
  # The reference: exact search over the embeddings as stored (rounded).
  stored = emb.astype(dtype).astype(np.float32)
  want, _ = searchers.ExactSearcher.build(stored).search_batched(queries, 8)
  s = queries.astype(np.float64) @ stored.T.astype(np.float64)
  # Random scores have no ties: same ids, or (summation order) the same
  # scores to float32 rounding.
  np.testing.assert_allclose(np.take_along_axis(s, ids, 1),
                             np.take_along_axis(s, want, 1), atol=1e-4)
  assert (ids == want).mean() > 0.95
  if dtype == ml_dtypes.bfloat16:
    full, _ = searchers.ExactSearcher.build(emb).search_batched(queries, 8)
    assert (full != want).any()  # the rounding mattered


def _queries(store, rng, batch=8, width=12):
  tok = Tokenizer()
  query_ids = np.zeros((batch, width), np.int32)
  for i in range(batch):
    n = int(rng.integers(3, width + 1))
    query_ids[i, :n] = [tok.cls_id, *rng.integers(2000, 3000, n - 2),
                        tok.sep_id]
  hashes = np.unique(store.doc_hash)
  return {
      "query_ids": query_ids,
      "query_mask": (query_ids > 0).astype(np.int32),
      "mlm_positions": rng.integers(0, 3, (batch, 2)).astype(np.int32),
      "mlm_targets": rng.integers(0, 900, (batch, 2)).astype(np.int32),
      "mlm_weights": rng.integers(0, 2, (batch, 2)).astype(np.float32),
      "source_doc_hash": hashes[rng.integers(0, len(hashes), batch)],
  }


def _host_candidates(store, emb, queries, q_emb, k):
  hits, _ = searchers.ExactSearcher.build(
      emb, {"backend": "jax"}).search_batched(q_emb, len(store))
  return realm_inputs.select_candidates(
      hits, store.doc_hash, queries["source_doc_hash"], k)


def _host_batch(store, emb, queries, q_emb, k, **kw):
  return realm_inputs.pretraining_batch(
      queries, _host_candidates(store, emb, queries, q_emb, k), store, **kw)


@pytest.mark.parametrize("null_document", [True, False])
@pytest.mark.parametrize("doc_len,reader_len", [(16, 28), (4, 20),
                                                (24, 15), (9, 40)])
def test_candidate_batch_equals_host_batch(mesh, store, null_document,
                                           doc_len, reader_len):
  rng = np.random.default_rng(doc_len)
  emb, q_emb = _int_data(rng, len(store), 4, 8)
  queries = _queries(store, rng)
  index = device_search.DeviceIndex.build(store, emb, mesh)
  kw = dict(doc_len=doc_len, reader_len=reader_len,
            null_document=null_document)
  got, ids = jax.device_get(device_search.candidate_batch(
      index, queries, q_emb, k=3, **kw))
  want = _host_batch(store, emb, queries, q_emb, 3, **kw)
  np.testing.assert_array_equal(ids, _host_candidates(store, emb, queries,
                                                      q_emb, 3))
  assert got.keys() == want.keys()
  for name, value in want.items():
    assert got[name].dtype == value.dtype, name
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_block_rule_on_device_equals_host(mesh, store):
  """trivial_candidates="block": the device path excludes exactly the
  blocks `select_candidates` does with the same keys."""
  rng = np.random.default_rng(3)
  emb, q_emb = _int_data(rng, len(store), 4, 8)
  queries = _queries(store, rng)
  keys = rng.integers(0, len(store), len(q_emb))  # one block per query
  trivial = np.arange(len(store), dtype=np.int64)
  index = device_search.DeviceIndex.build(store, emb, mesh,
                                          block_keys=trivial)
  _, ids = jax.device_get(device_search.candidate_batch(
      index, queries, q_emb, k=3, doc_len=16, reader_len=28,
      query_keys=keys))
  hits, _ = searchers.ExactSearcher.build(
      emb, {"backend": "jax"}).search_batched(q_emb, len(store))
  want = realm_inputs.select_candidates(hits, trivial, keys, 3)
  np.testing.assert_array_equal(ids, want)
  assert not (ids == keys[:, None]).any()
  # (The article rule would have dropped more: not the same candidates.)
  assert (want != _host_candidates(store, emb, queries, q_emb, 3)).any()


def test_swapping_embeddings_keeps_tokens_and_changes_results(mesh, store):
  rng = np.random.default_rng(7)
  emb, q_emb = _int_data(rng, len(store), 4, 8)
  queries = _queries(store, rng)
  index = device_search.DeviceIndex.build(store, emb, mesh,
                                          dtype=ml_dtypes.bfloat16)
  new_emb = -emb[::-1].copy()
  swapped = index.with_embeddings(new_emb)
  assert swapped.tokens is index.tokens
  assert swapped.embeddings.dtype == index.embeddings.dtype
  before, _ = jax.device_get(device_search.candidate_batch(
      index, queries, q_emb, k=2, doc_len=16, reader_len=28))
  after, _ = jax.device_get(device_search.candidate_batch(
      swapped, queries, q_emb, k=2, doc_len=16, reader_len=28))
  want = _host_batch(store, new_emb, queries, q_emb, 2, doc_len=16,
                     reader_len=28)
  for name, value in want.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  assert (before["candidate_ids"] != after["candidate_ids"]).any()


def test_bad_inputs_raise_clear_errors(mesh, store):
  emb = np.zeros((len(store), 4), np.float32)
  index = device_search.DeviceIndex.build(store, emb, mesh)
  with pytest.raises(ValueError, match="one row per block"):
    index.with_embeddings(emb[1:])
  queries = _queries(store, np.random.default_rng(0), batch=4)
  with pytest.raises(ValueError, match="multiple of the 8 devices"):
    device_search.candidate_batch(index, queries, emb[:4], k=2)
  queries = _queries(store, np.random.default_rng(0))
  with pytest.raises(ValueError, match="no room"):
    device_search.candidate_batch(index, queries, emb[:8], k=2,
                                  reader_len=12)

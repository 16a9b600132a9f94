"""BM25's blocks beside the dense ones in pre-training (issue 65):
`RetrievalConfig.lexical_candidates` and `held_prior`."""

import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.data import block_store, realm_inputs
from realm_jax.model import losses
from realm_jax.testing import corpus
from realm_jax.training import candidates, pretrain


def test_the_union_adds_m_lexical_blocks_never_trivial_nor_twice():
  dense = np.array([[5, 6], [1, 2]])
  lexical = np.array([[6, 9, 5, 3, 4], [7, 2, 8, 1, 0]])
  block_keys = np.arange(10) // 2  # blocks 2k and 2k + 1: article k
  query_keys = np.array([4, 3])  # query 0: blocks 8, 9 trivial; 1: 6, 7
  union = candidates.lexical_union(dense, lexical, block_keys, query_keys, 2)
  np.testing.assert_array_equal(union, [[5, 6, 3, 4], [1, 2, 8, 0]])
  with pytest.raises(ValueError, match="Query 0 has only 2 BM25 blocks"):
    candidates.lexical_union(dense, lexical, block_keys, query_keys, 3)


def test_the_devices_union_is_the_hosts():
  """`device_search._with_lexical` (search "device") equals
  `lexical_union` on hits with no trivial block (the host drops those)."""
  from realm_jax.index import device_search  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  dense = np.stack([rng.choice(40, 5, replace=False) for _ in range(16)])
  lexical = np.stack([rng.choice(40, 8, replace=False) for _ in range(16)])
  host = candidates.lexical_union(dense, lexical, np.zeros(40, np.int64),
                                  np.ones(16, np.int64), 3)
  device = device_search._with_lexical(  # pylint: disable=protected-access
      jnp.asarray(dense, jnp.int32), jnp.asarray(lexical, jnp.int32), 3)
  np.testing.assert_array_equal(device, host)


@pytest.mark.parametrize("w", [0.0, 0.3, 1.0])
def test_the_held_prior_is_the_mixture_of_dense_and_uniform(w):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5)).astype(np.float32)
  got = losses.mixed_log_prior(jnp.asarray(logits), jnp.full([3], w))
  dense = np.exp(logits - logits.max(1, keepdims=True))
  dense /= dense.sum(1, keepdims=True)
  np.testing.assert_allclose(np.exp(got), w * dense + (1 - w) / 5,
                             rtol=1e-5, atol=1e-7)
  # No gradient into the retriever while it is held (w = 0).
  grad = jax.grad(lambda x: losses.mixed_log_prior(
      x, jnp.zeros([3]))[:, 1].sum())(jnp.asarray(logits))
  np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize("w", [0.0, 0.5, 1.0])
def test_the_mixture_prior_mixes_dense_and_bm25s(w):
  rng = np.random.default_rng(4)
  logits = rng.normal(size=(3, 5)).astype(np.float32)
  bm25 = rng.dirichlet(np.ones(5), size=3).astype(np.float32)
  got = losses.mixed_log_prior(jnp.asarray(logits), jnp.full([3], w),
                               jnp.log(jnp.asarray(bm25)))
  dense = np.exp(logits - logits.max(1, keepdims=True))
  dense /= dense.sum(1, keepdims=True)
  np.testing.assert_allclose(np.exp(got), w * dense + (1 - w) * bm25,
                             rtol=1e-5, atol=1e-7)


def test_bm25s_prior_is_the_softmax_of_the_candidates_scores():
  """Hits' own scores; a candidate outside the hits the last hit's score;
  nothing for the null document; numpy (host) equals jax.numpy (device)."""
  candidates_ = np.array([[4, 9, 2], [1, 3, 8]])
  hit_ids = np.array([[2, 4, 7], [8, 3, 5]])
  hit_scores = np.array([[9.0, 6.5, 1.0], [3.0, 2.0, 0.5]], np.float32)
  want = np.array([[6.5, 1.0, 9.0], [0.5, 2.0, 3.0]])
  want = np.exp(want) / np.exp(want).sum(1, keepdims=True)
  got = realm_inputs.lexical_log_prior(candidates_, hit_ids, hit_scores,
                                       null_document=True)
  assert got.shape == (2, 4) and got.dtype == np.float32
  np.testing.assert_allclose(np.exp(got[:, 1:]), want, rtol=1e-6)
  assert (np.exp(got[:, 0]) == 0).all()
  on_device = realm_inputs.lexical_log_prior(
      jnp.asarray(candidates_), jnp.asarray(hit_ids), jnp.asarray(hit_scores),
      null_document=True, xp=jnp)
  np.testing.assert_allclose(on_device, got, rtol=1e-6)
  without_null = realm_inputs.lexical_log_prior(
      candidates_, hit_ids, hit_scores, null_document=False)
  np.testing.assert_allclose(without_null, got[:, 1:])


def test_without_a_prior_the_loss_is_realms():
  rng = np.random.default_rng(1)
  args = (jnp.asarray(rng.normal(size=(2, 4)), jnp.float32),
          jnp.asarray(rng.normal(size=(2, 4, 3, 11)), jnp.float32),
          jnp.asarray(rng.integers(0, 11, (2, 3))), jnp.ones((2, 3)))
  realm, _, _ = losses.pretraining_loss(*args)
  dense, _, _ = losses.pretraining_loss(*args, dense_prior=jnp.ones([2]))
  assert float(realm) == float(dense)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("corpus"))
  store, annotated = corpus.make_tiny_corpus(directory)
  return store, corpus.make_query_cache(
      annotated, os.path.join(directory, "queries"), query_length=32)


@pytest.mark.parametrize("search,overlap,prior", [
    # (The uniform prior, an ablation the recipe does not use: slow tier.)
    pytest.param("host", False, "uniform", marks=pytest.mark.slow),
    ("host", True, "mixture"), ("device", False, "mixture")])
def test_a_run_reads_bm25s_blocks_beside_the_dense_ones(tmp_path, tiny_corpus,
                                                      search, overlap, prior):
  """k = 2 dense + m = 2 BM25 candidates, a uniform or mixture prior while
  the gate holds the retriever (released at step 3): the batch has 1 + 4
  candidates, BM25's hits are among them, the mixture's BM25 half is a
  distribution over them with nothing on the null document, and the run
  trains."""
  store, queries = tiny_corpus
  workdir = str(tmp_path / "run")
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"], [
      f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
      f"QUERIES = '{queries}'",
      "pretrain.PretrainConfig.num_train_steps = 4",
      "pretrain.PretrainConfig.checkpoint_every = 2",
      "pretrain.PretrainConfig.reader_length = 64",
      "pretrain.RetrievalConfig.num_candidates = 2",
      "pretrain.RetrievalConfig.lexical_candidates = 2",
      f"pretrain.RetrievalConfig.held_prior = '{prior}'",
      f"pretrain.RetrievalConfig.overlap_input = {overlap}",
      f"pretrain.RetrievalConfig.search = '{search}'",
      "pretrain.GateConfig.mode = 'steps'",
      "pretrain.GateConfig.latest_release = 3",
      "pretrain.RecallGuardConfig.queries = ''"])
  config = gin.get_configurable(pretrain.PretrainConfig)()
  model = gin.get_configurable(pretrain.RealmConfig)()
  block_length = block_store.BlockStore.open(store).max_block_len
  # Every batch's candidates, with BM25's hits for its queries.
  seen = []
  real = pretrain.RetrievalInput.batch

  def spy(self, step, state):
    batch = real(self, step, state)
    seen.append(batch["candidate_ids"].shape)
    # The batch is the layout realm-aot lowers the step on (issue 68).
    assert {k: (tuple(v.shape), np.dtype(v.dtype))
            for k, v in batch.items()} == realm_inputs.pretraining_layout(
                batch=config.batch_size, candidates=5,
                query_length=batch["query_ids"].shape[1],
                block_length=block_length, reader_length=64,
                num_masks=batch["mlm_positions"].shape[1], held_prior=prior)
    assert float(batch["dense_prior"][0]) == (
        1.0 if step >= 3 else 0.5 if prior == "mixture" else 0.0)
    if prior == "mixture":
      p = np.exp(np.asarray(batch["lexical_log_prior"], np.float64))
      assert p.shape == (batch["candidate_ids"].shape[0], 5)
      np.testing.assert_allclose(p.sum(1), 1.0, rtol=1e-5)
      assert (p[:, 0] == 0).all()
    else:
      assert "lexical_log_prior" not in batch
    return batch

  hits = []
  real_hits = candidates.CandidateSource.lexical_hits

  def spy_hits(self, local, n):
    out = real_hits(self, local, n)
    hits.append(out)
    return out

  pretrain.RetrievalInput.batch = spy
  candidates.CandidateSource.lexical_hits = spy_hits
  try:
    history = pretrain.train(config=config, model=model)
  finally:
    pretrain.RetrievalInput.batch = real
    candidates.CandidateSource.lexical_hits = real_hits
    gin.clear_config()
  assert len(history) == 4 and np.isfinite([h["loss"] for h in history]).all()
  # The null document, 2 dense and 2 BM25 blocks per query.
  assert seen and all(shape[1] == 5 for shape in seen)
  assert hits and all(h.shape[1] == 4 for h in hits)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert len([json.loads(line) for line in f]) == 4


def test_the_held_prior_needs_lexical_candidates():
  with pytest.raises(ValueError, match="needs lexical_candidates > 0"):
    pretrain.RetrievalConfig(held_prior="uniform")


def test_bm25_reads_the_masked_queries_words_and_finds_their_blocks(
    tiny_corpus):
  """The masked query's words without [CLS], [SEP], [MASK] and padding
  (wordpieces joined); BM25's recall of blocks it ranks first is 1, and of
  blocks it never ranks in its top 5 is 0."""
  from realm_jax.data import block_store, query_cache, tokenizer  # pylint: disable=g-import-not-at-top
  vocab = tokenizer.Tokenizer()
  ids = vocab.tokenize(["mozart was born in salzburg"])[0]
  row = np.concatenate([[vocab.cls_id], ids[:3], [vocab.mask_id],
                        ids[4:], [vocab.sep_id], [vocab.pad_id] * 3])
  text, = candidates.masked_query_texts(
      {"query_ids": row[None], "query_mask": (row != vocab.pad_id)[None]},
      vocab)
  assert text == "mozart was born salzburg"
  store_dir, queries_dir = tiny_corpus
  store = block_store.BlockStore.open(store_dir)
  stream = query_cache.QueryStream(queries_dir, seed=0, batch_size=8)
  queries = stream.batch(0)
  stream.close()
  from realm_jax.data import realm_inputs  # pylint: disable=g-import-not-at-top
  from realm_jax.index import bm25  # pylint: disable=g-import-not-at-top
  rule = realm_inputs.TrivialCandidates(store, "article")
  hits, _ = bm25.for_store(store).search(
      candidates.masked_query_texts(queries, vocab), len(store))
  hits = realm_inputs.select_candidates(hits, rule.block_keys,
                                        rule.query_keys(queries), 6)
  assert candidates.bm25_recall(store, queries, hits[:, 0], "article") == {
      "bm25_recall@1": 1.0, "bm25_recall@5": 1.0}
  assert candidates.bm25_recall(store, queries, hits[:, 5], "article") == {
      "bm25_recall@1": 0.0, "bm25_recall@5": 0.0}


def test_the_permuted_control_gives_the_retriever_anothers_signal():
  """`RetrieverScheduleConfig.signal = "permuted"`: the loss's value and
  the reader's gradient are REALM's; the retriever's gradient is the
  paper's identity, sum_j w_j (p(z|x, y_j) - p(z|x)), with query i's
  posterior formed from the next query's likelihoods (numpy)."""
  rng = np.random.default_rng(5)
  b, c, m, v = 4, 3, 2, 7
  logits = rng.normal(size=(b, c)).astype(np.float32)
  mlm = rng.normal(size=(b, c, m, v)).astype(np.float32)
  targets = rng.integers(0, v, (b, m))
  weights = np.array([[1, 1], [1, 0], [1, 1], [0, 1]], np.float32)

  def loss(x, y, permuted):
    return losses.pretraining_loss(x, y, jnp.asarray(targets),
                                   jnp.asarray(weights),
                                   permuted_signal=permuted)[0]

  args = (jnp.asarray(logits), jnp.asarray(mlm))
  assert float(loss(*args, True)) == pytest.approx(float(loss(*args, False)),
                                                  rel=1e-6)
  g_reader = [jax.grad(loss, 1)(*args, p) for p in (False, True)]
  np.testing.assert_allclose(g_reader[1], g_reader[0], rtol=1e-5, atol=1e-7)
  g_retriever = jax.grad(loss, 0)(*args, True)
  log_v = mlm - np.log(np.exp(mlm).sum(-1, keepdims=True))
  ll = np.take_along_axis(
      log_v, np.broadcast_to(targets[:, None, :, None], (b, c, m, 1)),
      -1)[..., 0]  # [B, C, M]
  prior = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  want = np.zeros((b, c))
  for i in range(b):
    other = (i - 1) % b  # jnp.roll(x, 1): row i holds row i - 1's
    for j in range(m):
      post = prior[i] * np.exp(ll[other, :, j])
      post /= post.sum()
      want[i] -= weights[other, j] * (post - prior[i])
  np.testing.assert_allclose(g_retriever, want, rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="signal"):
    pretrain.RetrieverScheduleConfig(signal="shuffled")

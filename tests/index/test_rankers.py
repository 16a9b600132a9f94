"""realm_jax.index.rankers: the fusions against independent numpy
computations, and the dense, BM25 and hybrid rankers on a tiny store."""

import numpy as np
import pytest

from realm_jax.data import wikipedia
from realm_jax.index import rankers
from realm_jax.testing import corpus


def _ranking(name, ids, scores):
  ids = np.asarray(ids, np.int64)
  ranks = np.where(ids >= 0, np.arange(ids.shape[1])[None], -1)
  return rankers.Ranking(ids, np.asarray(scores, np.float32),
                         {name: ranks.astype(np.int32)})


A = _ranking("dense", [[3, 1, 4, 0], [2, 0, -1, -1]],
             [[9.0, 7.0, 6.0, 1.0], [0.5, 0.5, 0.0, 0.0]])
B = _ranking("bm25", [[1, 5, 3, 2], [4, 2, 1, 3]],
             [[12.0, 4.0, 3.0, 2.0], [3.0, 2.0, 1.0, 0.5]])


def _numpy_fusion(rankings, weights, method, rrf_k, num_blocks=8):
  """Dense [Q, num_blocks] fused scores, written out per block."""
  out = np.zeros([rankings[0].ids.shape[0], num_blocks])
  for r, w in zip(rankings, weights):
    for q in range(out.shape[0]):
      found = r.ids[q] >= 0
      s = r.scores[q][found].astype(np.float64)
      for rank, (b, v) in enumerate(zip(r.ids[q][found], s)):
        if method == "rrf":
          out[q, b] += w / (rrf_k + rank + 1)
        else:
          span = s.max() - s.min()
          out[q, b] += w * ((v - s.min()) / span if span > 0 else 1.0)
  return out


@pytest.mark.parametrize("method,weights,rrf_k", [
    ("weighted", (0.5, 0.5), 60.0), ("weighted", (0.7, 0.3), 60.0),
    ("rrf", (1.0, 1.0), 60.0), ("rrf", (0.25, 1.0), 2.0)])
def test_fusions_match_numpy(method, weights, rrf_k):
  fused = rankers.fuse([A, B], weights, 5, method=method, rrf_k=rrf_k)
  want = _numpy_fusion([A, B], weights, method, rrf_k)
  for q in range(2):
    candidates = sorted(set(A.ids[q][A.ids[q] >= 0]) |
                        set(B.ids[q][B.ids[q] >= 0]))
    order = sorted(candidates, key=lambda b: (-want[q, b], b))[:5]
    assert fused.ids[q, :len(order)].tolist() == order
    np.testing.assert_allclose(fused.scores[q, :len(order)],
                               want[q, order], rtol=1e-6)
    assert (fused.ids[q, len(order):] == -1).all()
    for r in (A, B):
      name, = r.sources
      where = {int(b): k for k, b in enumerate(r.ids[q]) if b >= 0}
      assert fused.sources[name][q, :len(order)].tolist() == [
          where.get(b, -1) for b in order]


def test_weights_move_the_fusion_between_its_rankers():
  only_a = rankers.fuse([A, B], (1.0, 0.0), 4)
  only_b = rankers.fuse([A, B], (0.0, 1.0), 4)
  assert only_a.ids[0].tolist() == A.ids[0].tolist()
  # (B's last block, normalised to 0, ties with the blocks only A found.)
  assert only_b.ids[0, :3].tolist() == B.ids[0, :3].tolist()
  # Ties (equal fused scores) go to the smaller id.
  assert only_a.ids[1, :2].tolist() == [0, 2]


def test_bad_names_and_configs_are_clear_errors():
  with pytest.raises(ValueError, match="'dnese' is not a ranker.*hybrid"):
    rankers.make_ranker("dnese")
  with pytest.raises(ValueError, match="method"):
    rankers.FusionConfig(method="max")
  with pytest.raises(ValueError, match="weights"):
    rankers.FusionConfig(dense_weight=0.0, bm25_weight=0.0)
  with pytest.raises(ValueError, match="dense ranker"):
    rankers.make_ranker("hybrid", bm25=object())


class _Index:
  """A published index's search over fixed embeddings (exact MIPS)."""

  def __init__(self, embeddings):
    self.embeddings = embeddings

  def search(self, queries, k):
    scores = queries @ self.embeddings.T
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(scores, ids, 1)


def test_hybrid_of_dense_and_bm25_over_a_store(tmp_path):
  docs = [wikipedia.Document(t, x) for t, x in corpus.ARTICLES]
  store = corpus.write_store(tmp_path / "store", docs, 24)
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(len(store), 4)).astype(np.float32)
  question_emb = rng.normal(size=(2, 4)).astype(np.float32)
  dense = rankers.DenseRanker(_Index(emb), lambda qs: question_emb[:len(qs)])
  questions = ["where was mozart born?", "capital of japan"]
  hybrid = rankers.make_ranker("hybrid", store=store, dense=dense,
                               fusion=rankers.FusionConfig(candidates=3))
  assert (tmp_path / "store" / "bm25" / "manifest.json").exists()
  ranking = hybrid.rank(questions, 4)
  d, s = dense.rank(questions, 4), hybrid.sparse.rank(questions, 4)
  assert store.title(int(s.ids[0, 0])) == "Mozart"
  d3, s3 = dense.rank(questions, 4), hybrid.sparse.rank(questions, 4)
  c = hybrid.config
  assert (c.method, c.dense_weight, c.bm25_weight) == ("weighted", 0.5, 0.5)
  want = rankers.fuse([d3, s3], (c.dense_weight, c.bm25_weight), 4)
  np.testing.assert_array_equal(ranking.ids, want.ids)
  assert set(ranking.sources) == {"dense", "bm25"}
  for q in range(2):
    for b, kd, ks in zip(ranking.ids[q], ranking.sources["dense"][q],
                         ranking.sources["bm25"][q]):
      assert kd >= 0 or ks >= 0
      assert kd < 0 or d.ids[q, kd] == b
      assert ks < 0 or s.ids[q, ks] == b
  assert rankers.make_ranker("bm25", store=store).rank(
      questions, 2).ids.tolist() == s.ids[:, :2].tolist()
  assert rankers.make_ranker("dense", dense=dense) is dense


@pytest.mark.parametrize("method", rankers.FUSIONS)
def test_blocks_bm25_scored_0_get_no_bm25_rank(tmp_path, method):
  """Issue 64, H11: BM25 lists every block to fill the depth asked, the
  blocks without a query term (score 0) last, by id. It claims no rank for
  those (`sources`: -1), so neither does the hybrid's evidence, and the
  fusion takes nothing from them: a question with no term in any block is
  ranked by the dense ranker alone."""
  docs = [wikipedia.Document(t, x) for t, x in corpus.ARTICLES]
  store = corpus.write_store(tmp_path / "store", docs, 24)
  n = len(store)
  rng = np.random.default_rng(0)
  emb = rng.normal(size=(n, 4)).astype(np.float32)
  question_emb = rng.normal(size=(2, 4)).astype(np.float32)
  dense = rankers.DenseRanker(_Index(emb), lambda qs: question_emb[:len(qs)])
  questions = ["where was mozart born?", "qwzx vbnj"]
  sparse = rankers.BM25Ranker.for_store(store)
  _, scores = sparse.index.search(questions, n)
  assert 0 < (scores[0] > 0).sum() < n and not (scores[1] > 0).any()
  bm25_alone = sparse.rank(questions, n)
  np.testing.assert_array_equal(bm25_alone.sources["bm25"] >= 0,
                                bm25_alone.scores > 0)
  hybrid = rankers.HybridRanker(dense, sparse, rankers.FusionConfig(
      method=method, candidates=n))
  ranking = hybrid.rank(questions, n)
  for q in range(2):
    ids, values = sparse.index.search([questions[q]], n)
    score = dict(zip(ids[0].tolist(), values[0].tolist()))
    claimed = [int(b) for b, k in zip(ranking.ids[q],
                                      ranking.sources["bm25"][q]) if k >= 0]
    assert claimed == [b for b in ranking.ids[q].tolist() if score[b] > 0]
  # No term anywhere: the dense order, every block, no BM25 rank.
  np.testing.assert_array_equal(ranking.ids[1], dense.rank(questions, n).ids[1])
  assert (ranking.sources["bm25"][1] == -1).all()


def test_a_new_ranker_is_one_class_bound_in_gin():
  """Issue 68: a ranker is chosen by object (`RankerChoice`), by gin
  binding or by its name in `CHOICES`; the eval config, its ledger tag and
  record come from the object; anything else is a clear error."""
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import qa_eval  # pylint: disable=g-import-not-at-top

  class Reversed:
    """BM25's list, worst first: a ranker no module knows."""
    name, reads_bm25 = "reversed", True

    def make(self, dense, bm25):
      del dense
      inner = bm25()

      class _Made:
        name = "reversed"

        def rank(self, questions, depth):
          r = inner.rank(questions, depth)
          return rankers.Ranking(r.ids[:, ::-1], r.scores[:, ::-1],
                                 {k: v[:, ::-1] for k, v in r.sources.items()})
      return _Made()

    def record(self):
      return {"ranker": self.name}

    def tag(self):
      return self.name

  config = qa_eval.EvalConfig(ranker=Reversed())
  assert qa_eval.ranker_tag(config) == "reversed"
  assert qa_eval.ranker_kwargs(config)["ranker"] is config.ranker
  sparse = rankers.BM25Ranker(_Bm25Stub())
  made = rankers.make_ranker(config.ranker, bm25=sparse)
  assert made.rank(["q"], 3).ids.tolist() == [[2, 1, 0]]
  # The t5x way: the choice and its settings bound in gin.
  with gin.unlock_config():
    gin.parse_config("""
        from __gin__ import dynamic_registration
        from realm_jax.index import rankers
        from realm_jax.eval import qa_eval
        qa_eval.EvalConfig.ranker = @rankers.Hybrid()
        rankers.Hybrid.fusion = @rankers.FusionConfig()
        rankers.FusionConfig.dense_weight = 0.2
    """)
  try:
    bound = gin.get_configurable(qa_eval.EvalConfig)()
  finally:
    gin.clear_config()
  assert bound.ranker == rankers.Hybrid(rankers.FusionConfig(dense_weight=0.2))
  assert qa_eval.ranker_record(bound)["fusion"]["dense_weight"] == 0.2
  # A name: the hybrid takes EvalConfig.fusion; the tag is the fusion's.
  by_name = qa_eval.EvalConfig(ranker="hybrid", fusion=bound.ranker.fusion)
  assert qa_eval.ranker_tag(by_name) == qa_eval.ranker_tag(bound) != "hybrid"
  with pytest.raises(TypeError, match="neither a ranker's name nor"):
    rankers.choice(object())


class _Bm25Stub:
  """`BM25Index.search`'s shape: ids 0, 1, 2 with scores 3, 2, 1."""

  def search(self, questions, depth):
    ids = np.tile(np.arange(depth, dtype=np.int64), (len(questions), 1))
    return ids, (depth - ids).astype(np.float32)

"""ScaNN's re-ordering storage: float32, bfloat16 and int8 copies of the rows.

The quantised copies trade re-scoring precision for RAM (a quarter of the
float32 copy for int8). Checked against the exact top-10 of numpy: every
storage keeps recall@10 high, the returned scores are the inner products of
the stored (rounded) rows, and the choice survives save/load.
"""

import numpy as np
import pytest

from realm_jax.index import search_base
from realm_jax.index import searchers


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(3)
  centers = rng.standard_normal((100, 32), dtype=np.float32)
  def draw(n):
    rows = centers[rng.integers(0, 100, n)]
    return rows + rng.standard_normal((n, 32), dtype=np.float32)
  embeddings, queries = draw(20_000), draw(200)
  exact = np.argsort(-(queries @ embeddings.T), axis=1, kind="stable")[:, :10]
  return embeddings, queries, exact


def _recall(ids, exact):
  return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, exact)])


@pytest.mark.parametrize("dtype, min_recall, score_atol",
                         [("float32", 0.97, 1e-3), ("bfloat16", 0.95, 0.5),
                          ("int8", 0.95, 0.5)])
def test_reordering_dtype_recall_and_scores(data, tmp_path, dtype, min_recall,
                                            score_atol):
  embeddings, queries, exact = data
  searcher = searchers.ScannSearcher.build(
      embeddings, search_base.ScannConfig(reordering_dtype=dtype))
  ids, scores = searcher.search_batched(queries, 10)
  assert _recall(ids, exact) >= min_recall
  # Re-ordered scores are (close to) the exact inner products of the rows
  # returned; a quantised copy is off by its rounding, never by AH's error.
  true_scores = np.einsum("qd,qkd->qk", queries, embeddings[ids])
  np.testing.assert_allclose(scores, true_scores, atol=score_atol,
                             rtol=0.02)
  searcher.save(str(tmp_path / "index"))
  loaded = searchers.load_searcher(str(tmp_path / "index"))
  assert loaded.config.reordering_dtype == dtype
  np.testing.assert_array_equal(loaded.search_batched(queries, 10)[0], ids)


def test_int8_storage_is_smaller_on_disk(data, tmp_path):
  embeddings = data[0]
  sizes = {}
  for dtype in ("float32", "int8"):
    directory = tmp_path / dtype
    searchers.ScannSearcher.build(
        embeddings, search_base.ScannConfig(reordering_dtype=dtype)).save(
            str(directory))
    sizes[dtype] = sum(f.stat().st_size for f in directory.rglob("*")
                       if f.is_file())
  # float32 rows: 20k x 32 x 4 = 2.56 MB; int8: 0.64 MB plus scales.
  assert sizes["float32"] - sizes["int8"] > 1.5e6


def test_unknown_reordering_dtype_is_refused():
  with pytest.raises(ValueError, match="reordering_dtype='float16'"):
    search_base.ScannConfig(reordering_dtype="float16")

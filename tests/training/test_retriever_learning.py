"""The retriever learns from the reader: its gradient path, the null score.

REALM's reason to exist is the gradient that reaches the retriever through
the marginal likelihood: d log p(y|x) / d f(x, z) = r(z) =
[p(y|z, x) / p(y|x) - 1] p(z|x). These tests check that the trainer's own
loss delivers exactly that to the retriever's parameters (a sign flip or a
stop-gradient anywhere on the path fails them), and that the learned null
score behaves as documented.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm
from realm_jax.testing import tiny
from realm_jax.training import pretrain


def _reader_that_reads(params, factor=10.0):
  # At a random initialisation documents barely change the tiny reader's
  # output (r(z) ~ 1e-4, a difference of nearly equal float32 numbers);
  # scaled up, they change it by ~0.6 nats and r(z) is well conditioned.
  def scale(path, x):
    name = jax.tree_util.keystr(path)
    return x * factor if name.startswith("['reader']") and (
        "kernel" in name or "embedding" in name) else x
  return jax.tree_util.tree_map_with_path(scale, params)


def _setup(null_score="embedding", **retriever):
  cfg = tiny.tiny_realm(null_score=null_score, **retriever)
  graphdef, params = functional.init(lambda r: Realm(cfg, rngs=r), 0)
  batch = {k: jnp.asarray(v) for k, v in tiny.random_pretraining_batch(
      np.random.default_rng(0), batch=6, candidates=5).items()}
  return graphdef, _reader_that_reads(params), batch


@pytest.mark.parametrize("null_score,retriever", [
    ("embedding", {}), ("learned", {}), ("learned_mean", {}),
    # f(x, z) = 20 cos(x, z): the identity holds for the scaled scores.
    ("learned", {"pooling": "mean", "normalize": True, "score_scale": 20.0})])
def test_retriever_gradient_is_the_papers_identity(null_score, retriever):
  graphdef, params, batch = _setup(null_score, **retriever)
  loss_fn = pretrain.make_loss_fn(graphdef)

  def mean_loss(p):
    loss_sum, weight_sum, _ = loss_fn(p, batch, None)
    return loss_sum / weight_sum

  got = jax.jit(jax.grad(mean_loss))(params)["retriever"]

  # Independently: r(z) per masked token in float64 numpy from the reader's
  # token likelihoods and the retrieval scores, pushed back through the
  # retriever alone.
  def scores(retriever_params):
    model = functional.bind(graphdef, dict(params,
                                           retriever=retriever_params))
    return model.retriever(
        batch["query_ids"], batch["query_mask"], batch["candidate_ids"],
        batch["candidate_mask"], batch["candidate_segment_ids"],
        null_document=True)

  f = np.asarray(jax.jit(scores)(params["retriever"]), np.float64)
  token_ll = np.asarray(jax.jit(lambda p: losses.token_log_likelihoods(
      functional.bind(graphdef, p).pretraining_logits(batch)[1],
      batch["mlm_targets"]))(params), np.float64)               # [B, C, M]
  p_z = np.exp(f - f.max(1, keepdims=True))
  p_z /= p_z.sum(1, keepdims=True)                               # [B, C]
  p_y_z = np.exp(token_ll)
  p_y = np.einsum("bc,bcm->bm", p_z, p_y_z)
  r = (p_y_z / p_y[:, None, :] - 1.0) * p_z[:, :, None]          # [B, C, M]
  w = np.asarray(batch["mlm_weights"], np.float64)
  d_loss_d_f = -np.einsum("bcm,bm->bc", r, w) / w.sum()
  (want,) = jax.jit(lambda p, ct: jax.vjp(scores, p)[1](ct))(
      params["retriever"], jnp.asarray(d_loss_d_f, jnp.float32))

  total = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64))
                      for x in jax.tree_util.tree_leaves(want)))
  assert total > 1e-3, "the check needs a retriever gradient to compare"
  for (path, g), x in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want)):
    err = np.linalg.norm(np.asarray(g, np.float64) - x)
    assert err <= 1e-3 * np.linalg.norm(x) + 1e-6 * total, (
        jax.tree_util.keystr(path), err, np.linalg.norm(x))
  # Both towers learn: the query side and (shared tower) the documents.
  assert np.abs(got["query_embedder"]["projection"]["kernel"]).max() > 0


def test_learned_null_score_follows_the_retrieved_scores():
  graphdef, params, batch = _setup("learned")
  params["retriever"]["null_score_bias"] = jnp.float32(0.7)
  model = functional.bind(graphdef, params)
  logits, _ = model.pretraining_logits(batch)
  np.testing.assert_allclose(logits[:, 0], logits[:, 1:].mean(1) + 0.7,
                             rtol=1e-5, atol=1e-5)
  # The null document's tokens are not read.
  other = dict(batch, candidate_ids=batch["candidate_ids"].at[:, 0].set(7))
  np.testing.assert_array_equal(model.pretraining_logits(other)[0], logits)
  # No gradient flows into real scores through their mean: d L / d f(z)
  # for the real candidates is r(z) alone, and d L / d b = -r(null).
  def loss_of_bias(b):
    p = dict(params, retriever=dict(params["retriever"], null_score_bias=b))
    loss_sum, weight_sum, _ = pretrain.make_loss_fn(graphdef)(p, batch, None)
    return loss_sum / weight_sum
  _, mlm_logits = model.pretraining_logits(batch)
  token_ll = losses.token_log_likelihoods(mlm_logits, batch["mlm_targets"])
  r_null = jax.grad(lambda f: jnp.sum(losses.marginal_log_likelihood(
      f, token_ll) * batch["mlm_weights"]))(logits)[:, 0]
  np.testing.assert_allclose(
      jax.grad(loss_of_bias)(jnp.float32(0.7)),
      -r_null.sum() / batch["mlm_weights"].sum(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("null_score", ["learned", "learned_mean"])
def test_the_learned_null_pushes_every_retrieved_score_only_if_stopped(
    null_score):
  """Raising every retrieved score of a query by c leaves p(z|x) unchanged
  (the null's score rises too), so the loss is flat along it. With
  "learned" (no gradient through the mean) the gradient still pushes
  along it: the retrieved scores' gradients sum to r(null) = post(null) -
  p(null) (per mask, float64 numpy). With "learned_mean" they sum to 0.

  The documents' embeddings come from the batch (no gradient), all with
  last coordinate 1: adding t to the query tower's final LayerNorm offset
  in its last coordinate raises every retrieved score by t."""
  graphdef, params, batch = _setup(null_score)
  docs = np.random.default_rng(2).normal(
      size=batch["candidate_mask"].shape[:2] + (16,))
  docs[..., -1] = 1.0
  batch = dict(batch, candidate_embeddings=jnp.asarray(docs, jnp.float32))
  loss_fn = pretrain.make_loss_fn(graphdef)

  @jax.jit
  def push(weights):  # d loss / d t for the queries `weights` keeps
    def mean_loss(p):
      loss_sum, weight_sum, _ = loss_fn(p, dict(batch, mlm_weights=weights),
                                        None)
      return loss_sum / weight_sum
    return jax.grad(mean_loss)(params)["retriever"]["query_embedder"][
        "layer_norm"]["bias"][-1]

  f, mlm_logits = functional.bind(graphdef, params).pretraining_logits(batch)
  f = np.asarray(f, np.float64)
  token_ll = np.asarray(losses.token_log_likelihoods(
      mlm_logits, batch["mlm_targets"]), np.float64)              # [B, C, M]
  p_z = np.exp(f - f.max(1, keepdims=True))
  p_z /= p_z.sum(1, keepdims=True)
  p_y_z = np.exp(token_ll)
  post_null = p_z[:, :1] * p_y_z[:, 0] / np.einsum("bc,bcm->bm", p_z, p_y_z)
  r_null = post_null - p_z[:, :1]                                 # [B, M]
  w = np.asarray(batch["mlm_weights"], np.float64)
  stopped, got = [], []
  for b in range(len(w)):
    only_b = np.zeros_like(w)
    only_b[b] = w[b]
    stopped.append((only_b[b] * r_null[b]).sum() / only_b[b].sum())
    got.append(float(push(jnp.asarray(only_b, jnp.float32))))
  scale = np.abs(stopped).max()
  assert scale > 1e-3, "the check needs a reader that reads"
  want = np.asarray(stopped) if null_score == "learned" else np.zeros(len(w))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * scale)


def test_learned_null_probability_starts_near_uniform():
  # The embedding of "[CLS] [SEP] [SEP]" is not a document embedding; the
  # learned score puts the null document among the candidates instead.
  graphdef, params, batch = _setup("learned")
  logits, _ = functional.bind(graphdef, params).pretraining_logits(batch)
  p_null = np.asarray(jax.nn.softmax(logits, -1)[:, 0])
  f = np.asarray(logits[:, 1:])
  # Jensen: exp(mean f) <= mean exp(f), so p(null) <= 1 / C.
  assert (p_null <= 1.0 / logits.shape[1] + 1e-6).all()
  assert (p_null > 0).all() and np.isfinite(f).all()

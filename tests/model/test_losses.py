"""REALM's marginal losses against an independent numpy implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.model import losses


def _np_log_softmax(x, axis=-1):
  x = x - x.max(axis=axis, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def _np_pretraining_loss(retrieval_logits, mlm_logits, targets, weights):
  """Straight loops over examples, masks and candidates, in float64."""
  b, c, m, _ = mlm_logits.shape
  total, count, utility = 0.0, 0.0, 0.0
  for i in range(b):
    p_z = np.exp(_np_log_softmax(retrieval_logits[i].astype(np.float64)))
    for j in range(m):
      if not weights[i, j]:
        continue
      p_y = [np.exp(_np_log_softmax(mlm_logits[i, z, j].astype(np.float64))
                    [targets[i, j]]) for z in range(c)]
      marginal = np.log(sum(p_z[z] * p_y[z] for z in range(c)))
      total -= weights[i, j] * marginal
      utility += weights[i, j] * (marginal - np.log(p_y[0]))
      count += weights[i, j]
  return total, count, utility


def test_pretraining_loss_matches_numpy():
  rng = np.random.default_rng(0)
  b, c, m, v = 3, 5, 4, 11
  retrieval_logits = rng.normal(size=(b, c)).astype(np.float32) * 3
  mlm_logits = rng.normal(size=(b, c, m, v)).astype(np.float32) * 2
  targets = rng.integers(0, v, size=(b, m))
  weights = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.float32)
  loss_sum, weight_sum, sums = losses.pretraining_loss(
      retrieval_logits, mlm_logits, targets, weights)
  ref_total, ref_count, ref_utility = _np_pretraining_loss(
      retrieval_logits, mlm_logits, targets, weights)
  np.testing.assert_allclose(loss_sum, ref_total, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weight_sum, ref_count)
  np.testing.assert_allclose(sums["retrieval_utility"], ref_utility,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(sums["marginal_log_likelihood"], -ref_total,
                             rtol=1e-5, atol=1e-5)


def test_padded_masks_are_ignored():
  rng = np.random.default_rng(1)
  retrieval_logits = rng.normal(size=(2, 3)).astype(np.float32)
  mlm_logits = rng.normal(size=(2, 3, 2, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 2))
  weights = np.array([[1, 0], [1, 0]], np.float32)
  base = losses.pretraining_loss(retrieval_logits, mlm_logits, targets,
                                 weights)[0]
  # Changing what sits in a padded slot must not change the loss.
  mlm_logits[:, :, 1] = rng.normal(size=(2, 3, 7)) * 10
  targets[:, 1] = 3
  again = losses.pretraining_loss(retrieval_logits, mlm_logits, targets,
                                  weights)[0]
  np.testing.assert_allclose(base, again, rtol=1e-6)


def test_gradient_identity_per_masked_token():
  """d log p(y_j|x) / d f(x,z) = [p(y_j|z,x) / p(y_j|x) - 1] p(z|x)."""
  rng = np.random.default_rng(2)
  b, c, m, v = 2, 6, 3, 9
  retrieval_logits = jnp.asarray(rng.normal(size=(b, c)), jnp.float32)
  mlm_logits = jnp.asarray(rng.normal(size=(b, c, m, v)) * 2, jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, size=(b, m)))
  token_ll = losses.token_log_likelihoods(mlm_logits, targets)
  for i in range(b):
    for j in range(m):
      grad = jax.grad(lambda f: losses.marginal_log_likelihood(
          f, token_ll)[i, j])(retrieval_logits)
      p_z = jax.nn.softmax(retrieval_logits[i])
      p_y_z = jnp.exp(token_ll[i, :, j])
      p_y = jnp.sum(p_z * p_y_z)
      r = (p_y_z / p_y - 1.0) * p_z
      np.testing.assert_allclose(grad[i], r, atol=1e-5)
      # Other examples' scores get no gradient from this token.
      np.testing.assert_allclose(np.delete(np.asarray(grad), i, 0), 0.0)


def _np_marginal_nll(logits, positives):
  logits = logits.astype(np.float64)
  finite = np.isfinite(logits)
  if not (positives & finite).any():
    return 0.0
  norm = np.log(np.exp(logits[finite]).sum())
  return norm - np.log(np.exp(logits[positives & finite]).sum())


def test_retriever_marginal_loss_matches_numpy_and_zeroes():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(4, 20)).astype(np.float32) * 4
  positives = rng.random((4, 20)) < 0.2
  positives[2] = False  # No positive: zero loss.
  positives[3, 5] = True
  got = losses.retriever_marginal_loss(logits, positives)
  want = [_np_marginal_nll(logits[i], positives[i]) for i in range(4)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert got[2] == 0.0
  grads = jax.grad(lambda x: losses.retriever_marginal_loss(
      x, positives).sum())(jnp.asarray(logits))
  assert np.all(np.isfinite(grads))
  np.testing.assert_allclose(grads[2], 0.0)


def test_reader_marginal_loss_matches_numpy_with_inadmissible_spans():
  rng = np.random.default_rng(4)
  b, r, l, w = 3, 2, 7, 3
  logits = rng.normal(size=(b, r, l, w)).astype(np.float32) * 3
  logits[rng.random(logits.shape) < 0.4] = -np.inf
  positives = rng.random((b, r, l, w)) < 0.15
  positives[1] = False
  # A "positive" on an inadmissible span must not count.
  positives[0, 0, 0, 0] = True
  logits[0, 0, 0, 0] = -np.inf
  got = losses.reader_marginal_loss(logits, positives)
  want = [_np_marginal_nll(logits[i], positives[i]) for i in range(b)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  grads = jax.grad(lambda x: losses.reader_marginal_loss(
      x, positives).sum())(jnp.asarray(logits))
  assert np.all(np.isfinite(grads))


@pytest.mark.parametrize("empty", [True, False])
def test_masked_logsumexp(empty):
  x = jnp.array([1.0, 2.0, 3.0])
  mask = jnp.array([False, False, False]) if empty else jnp.array(
      [True, False, True])
  value, any_ = losses.masked_logsumexp(x, mask)
  assert bool(any_) != empty
  if not empty:
    np.testing.assert_allclose(value, np.log(np.exp(1.0) + np.exp(3.0)),
                               rtol=1e-6)

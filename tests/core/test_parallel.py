"""The shard_map (pmap-style) step on 8 emulated devices vs 1 device."""

import chex
import jax
import numpy as np
import optax
import pytest

from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm
from realm_jax.testing import tiny
from realm_jax.core import parallel
from realm_jax.training import loop


def _setup():
  cfg = tiny.tiny_realm()
  graphdef, params = functional.init(lambda r: Realm(cfg, rngs=r), 0)

  def loss_fn(p, batch, rng):
    model = functional.bind(graphdef, p)
    retrieval_logits, mlm_logits = model.pretraining_logits(
        batch, dropout_rng=rng)
    return losses.pretraining_loss(retrieval_logits, mlm_logits,
                                   batch["mlm_targets"], batch["mlm_weights"])

  return params, loss_fn


def _reader_that_reads(params, factor=10.0):
  """Scales the reader's kernels and embeddings so documents change its output.

  At a random initialisation the tiny reader's log p(y|z, x) differs across
  candidates by ~1e-4 nats, so the retriever's gradient
  r(z) = [p(y|z,x) / p(y|x) - 1] p(z|x) is a difference of nearly equal
  float32 numbers, and any change of summation order (another device count,
  another CPU vendor's kernels) moves it by percents. Scaled by 10 the
  per-candidate spread is ~0.6 nats: the comparison below is then well
  conditioned and can be tight (measured: <= 2e-6 relative per leaf).
  """
  def scale(path, x):
    name = jax.tree_util.keystr(path)
    if name.startswith("['reader']") and ("kernel" in name
                                          or "embedding" in name):
      return x * factor
    return x
  return jax.tree_util.tree_map_with_path(scale, params)


def _assert_gradients_close(got, want, what):
  """Per-leaf relative L2 agreement, robust to summation order.

  Leaves whose true gradient is exactly zero (attention key biases: softmax
  is shift-invariant) are compared against the size of the whole gradient.
  """
  scale = np.sqrt(sum(np.sum(np.square(g))
                      for g in jax.tree_util.tree_leaves(want)))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want)):
    err = np.linalg.norm(np.asarray(g, np.float64) - w)
    bound = 1e-4 * np.linalg.norm(w) + 1e-7 * scale
    assert err <= bound, (what, jax.tree_util.keystr(path), err, bound)


def test_eight_devices_equal_one_device():
  assert jax.device_count() == 8
  params, loss_fn = _setup()
  params = _reader_that_reads(params)
  batch = tiny.random_pretraining_batch(np.random.default_rng(0), batch=16)
  # Uneven numbers of real masks per core: the global normalisation matters.
  assert len({int(batch["mlm_weights"][i:i + 2].sum())
              for i in range(0, 16, 2)}) > 1
  results = []
  for devices in (jax.devices(), jax.devices()[:1]):
    mesh = parallel.make_mesh(devices)
    fn = jax.jit(parallel.data_parallel_value_and_grad(loss_fn, mesh))
    loss, grads, metrics = fn(params, parallel.shard_batch(mesh, batch))
    results.append(jax.device_get((loss, grads, metrics)))
  (loss8, grads8, m8), (loss1, grads1, m1) = results
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  _assert_gradients_close(grads8, grads1, "8 devices vs 1")
  chex.assert_trees_all_close(m8, m1, rtol=1e-5, atol=1e-6)
  # And both equal the plain, unsharded loss and gradient.
  def plain_loss(p):
    loss_sum, weight_sum, _ = loss_fn(p, batch, None)
    return loss_sum / weight_sum
  loss, plain = jax.jit(jax.value_and_grad(plain_loss))(params)
  np.testing.assert_allclose(loss1, loss, rtol=1e-5)
  _assert_gradients_close(grads1, plain, "1 device vs jax.grad")

  # The comparison has the power to catch a sharding bug: averaging each
  # core's own normalised gradient (dividing by the core's mask count
  # instead of the global one) must fail it.
  mesh1 = parallel.make_mesh(jax.devices()[:1])
  fn1 = jax.jit(parallel.data_parallel_value_and_grad(loss_fn, mesh1))
  per_core = [jax.device_get(fn1(params, parallel.shard_batch(
      mesh1, {k: v[i:i + 2] for k, v in batch.items()}))[1])
              for i in range(0, 16, 2)]
  wrong = jax.tree_util.tree_map(lambda *g: np.mean(g, axis=0), *per_core)
  with pytest.raises(AssertionError):
    _assert_gradients_close(wrong, grads1, "local normalisation")


def test_train_step_reduces_loss_on_a_fixed_batch():
  params, loss_fn = _setup()
  mesh = parallel.make_mesh()
  optimizer = optax.adam(3e-3)
  step = loop.make_train_step(loss_fn, optimizer, mesh)
  state = loop.TrainState(jax.numpy.zeros((), jax.numpy.int32), params,
                          optimizer.init(params))
  batch = parallel.shard_batch(
      mesh, tiny.random_pretraining_batch(np.random.default_rng(1), batch=8))
  losses_seen = []
  for _ in range(15):
    state, metrics = step(state, batch, jax.random.key(0))
    losses_seen.append(float(metrics["loss"]))
  assert int(state.step) == 15
  assert losses_seen[-1] < 0.7 * losses_seen[0], losses_seen


def test_shard_batch_rejects_indivisible_batch():
  mesh = parallel.make_mesh()
  with pytest.raises(ValueError, match="not divisible by its 8 local devices"):
    parallel.shard_batch(mesh, {"x": np.zeros((6, 3))})

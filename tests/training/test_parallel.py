"""The shard_map (pmap-style) step on 8 emulated devices vs 1 device."""

import chex
import jax
import numpy as np
import optax
import pytest

from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm
from realm_jax.testing import tiny
from realm_jax.training import parallel


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


def test_eight_devices_equal_one_device():
  assert jax.device_count() == 8
  params, loss_fn = _setup()
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
  # float32 sums in a different order: compare against the gradient scale
  # (some leaves, e.g. biases feeding a LayerNorm, are zero up to rounding).
  scale = max(np.abs(g).max() for g in jax.tree_util.tree_leaves(grads1))
  for g8, g1 in zip(jax.tree_util.tree_leaves(grads8),
                    jax.tree_util.tree_leaves(grads1)):
    np.testing.assert_allclose(g8, g1, rtol=1e-3, atol=1e-5 * scale)
  chex.assert_trees_all_close(m8, m1, rtol=1e-5, atol=1e-6)
  # And both equal the plain, unsharded loss.
  loss_sum, weight_sum, _ = loss_fn(params, batch, None)
  np.testing.assert_allclose(loss1, loss_sum / weight_sum, rtol=1e-5)


def test_train_step_reduces_loss_on_a_fixed_batch():
  params, loss_fn = _setup()
  mesh = parallel.make_mesh()
  optimizer = optax.adam(3e-3)
  step = parallel.make_train_step(loss_fn, optimizer, mesh)
  state = {"step": jax.numpy.zeros((), jax.numpy.int32), "params": params,
           "opt_state": optimizer.init(params)}
  batch = parallel.shard_batch(
      mesh, tiny.random_pretraining_batch(np.random.default_rng(1), batch=8))
  losses_seen = []
  for _ in range(15):
    state, metrics = step(state, batch, jax.random.key(0))
    losses_seen.append(float(metrics["loss"]))
  assert int(state["step"]) == 15
  assert losses_seen[-1] < 0.7 * losses_seen[0], losses_seen


def test_shard_batch_rejects_indivisible_batch():
  mesh = parallel.make_mesh()
  with pytest.raises(ValueError, match="not divisible by its 8 local devices"):
    parallel.shard_batch(mesh, {"x": np.zeros((6, 3))})

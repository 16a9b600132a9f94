"""BERT's optimiser: schedule, decay mask, and a step-by-step numpy oracle."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import realm_jax.model.functional
import realm_jax.model.realm
import realm_jax.testing.tiny
from realm_jax.training import optimizer as opt


# ---------------------------------------------------------------------------
# warmup_steps_for / learning_rate_schedule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_train_steps, expected", [
    (50, 100), (100, 100), (999, 100), (1_005, 100), (1_019, 101),
    (5_000, 500), (12_345, 1_234), (100_000, 10_000), (1_000_000, 10_000),
])
def test_warmup_steps_for(num_train_steps, expected):
  assert opt.warmup_steps_for(num_train_steps) == expected


def test_warmup_steps_for_rejects_non_positive():
  with pytest.raises(ValueError, match="num_train_steps"):
    opt.warmup_steps_for(0)


def _values(schedule, steps):
  return np.array([float(schedule(jnp.asarray(s, jnp.int32))) for s in steps])


def test_schedule_values():
  lr, total, warmup = 2e-3, 1_000, 100
  schedule = opt.learning_rate_schedule(learning_rate=lr,
                                        num_train_steps=total,
                                        warmup_steps=warmup)
  steps = [0, 1, 50, 99, 100, 101, 550, 999, 1_000, 5_000]
  expected = [
      0.0,                      # first update: rate 0, as in BERT
      lr * 1 / 100,
      lr * 50 / 100,
      lr * 99 / 100,            # warmup - 1: still warming up
      lr * (1 - 100 / 1000),    # warmup: the decay line measured from 0
      lr * (1 - 101 / 1000),
      lr * (1 - 550 / 1000),    # middle
      lr * (1 - 999 / 1000),
      0.0,                      # end
      0.0,                      # past the end: stays 0
  ]
  # float32 rounding of lr * (1 - s / total), however XLA orders it (with
  # --xla_cpu_enable_fast_math the end is 1e-10, not 0): a few ulps of lr.
  atol = 1e-6 * lr
  np.testing.assert_allclose(_values(schedule, steps), expected,
                             rtol=1e-6, atol=atol)
  # The same schedule traced under jit, on a step array.
  jitted = jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32))
  np.testing.assert_allclose(np.asarray(jitted), expected, rtol=1e-6,
                             atol=atol)


def test_schedule_default_warmup_and_no_warmup():
  # 5000 steps -> 500 warmup steps by REALM's rule.
  default = opt.learning_rate_schedule(learning_rate=1.0,
                                       num_train_steps=5_000)
  np.testing.assert_allclose(_values(default, [250, 499, 500, 2_500]),
                             [0.5, 0.998, 0.9, 0.5], rtol=1e-6)
  # warmup_steps=0: BERT's `if num_warmup_steps:` skips warmup entirely.
  no_warmup = opt.learning_rate_schedule(learning_rate=1.0,
                                         num_train_steps=10,
                                         warmup_steps=0)
  np.testing.assert_allclose(_values(no_warmup, [0, 5, 10]), [1.0, 0.5, 0.0],
                             rtol=1e-6)


def test_schedule_and_optimizer_reject_bad_arguments():
  with pytest.raises(ValueError, match="warmup_steps"):
    opt.learning_rate_schedule(learning_rate=1.0, num_train_steps=10,
                               warmup_steps=-1)
  with pytest.raises(ValueError, match="clip_norm"):
    opt.bert_optimizer(learning_rate=1.0, num_train_steps=10, clip_norm=0.0)
  with pytest.raises(ValueError, match="beta2"):
    opt.bert_optimizer(learning_rate=1.0, num_train_steps=10, beta2=1.0)


# ---------------------------------------------------------------------------
# Decay mask on REALM's real parameter tree
# ---------------------------------------------------------------------------


def test_decay_mask_on_realm_params():
  _, params = realm_jax.model.functional.init(
      lambda r: realm_jax.model.realm.Realm(
          realm_jax.testing.tiny.tiny_realm(), rngs=r))
  mask = opt.decay_mask(params)
  assert (jax.tree.structure(mask) == jax.tree.structure(params))
  counts = {"layer_norm": 0, "bias": 0, "kernel": 0, "embedding": 0}
  for path, decayed in jax.tree_util.tree_leaves_with_path(mask):
    keys = [k.key for k in path]
    name = "/".join(keys)
    if any("layer_norm" in k for k in keys):
      assert decayed is False, name
      counts["layer_norm"] += 1
    elif keys[-1] in ("bias", "output_bias"):
      assert decayed is False, name
      counts["bias"] += 1
    elif keys[-1] in ("kernel", "embedding"):
      assert decayed is True, name
      counts[keys[-1]] += 1
    else:
      pytest.fail(f"unexpected parameter {name}: extend this test")
  # Reader and retriever BERTs have 3 embedding tables each. LayerNorms
  # (2 leaves each): embeddings + 2 per layer in each 2-layer BERT, plus the
  # MLM head, span head and retriever projection.
  assert counts["embedding"] == 6
  assert counts["layer_norm"] == 2 * (2 * (1 + 2 * 2) + 3)
  assert counts["bias"] > 0 and counts["kernel"] > 0
  assert any(k[-1].key == "output_bias" and not d for k, d in
             jax.tree_util.tree_leaves_with_path(mask))


# ---------------------------------------------------------------------------
# Independent numpy oracle of BERT's AdamWeightDecayOptimizer
# ---------------------------------------------------------------------------


def _bert_reference(params, grads_per_step, *, lr, num_train_steps,
                    num_warmup_steps, weight_decay=0.01, beta_1=0.9,
                    beta_2=0.999, epsilon=1e-6, clip_norm=1.0):
  """BERT's create_optimizer + AdamWeightDecayOptimizer, in float64 loops.

  `params` and each grads dict map '/'-joined variable names to arrays.
  """
  exclude = ["LayerNorm", "layer_norm", "bias"]
  params = {k: np.array(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(x) for k, x in params.items()}
  history = []
  for global_step, grads in enumerate(grads_per_step):
    # Learning rate for this global_step (before its increment).
    step = min(global_step, num_train_steps)
    rate = lr * (1.0 - step / num_train_steps) ** 1.0
    if num_warmup_steps and global_step < num_warmup_steps:
      rate = lr * global_step / num_warmup_steps
    # tf.clip_by_global_norm.
    norm = np.sqrt(sum(np.sum(np.square(np.float64(g)))
                       for g in grads.values()))
    scale = clip_norm / max(norm, clip_norm)
    for name in params:
      g = np.float64(grads[name]) * scale
      m[name] = beta_1 * m[name] + (1.0 - beta_1) * g
      v[name] = beta_2 * v[name] + (1.0 - beta_2) * g * g
      update = m[name] / (np.sqrt(v[name]) + epsilon)
      if not any(re.search(r, name) for r in exclude):
        update = update + weight_decay * params[name]
      params[name] = params[name] - rate * update
    history.append(dict(params))
  return history


def _nest(flat):
  tree = {}
  for name, value in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def _flatten(tree):
  return {"/".join(k.key for k in path): np.asarray(leaf) for path, leaf in
          jax.tree_util.tree_leaves_with_path(tree)}


def test_matches_numpy_bert_optimizer():
  rng = np.random.default_rng(0)
  shapes = {
      "bert/embeddings/word_embeddings/embedding": (11, 6),
      "bert/embeddings/layer_norm/scale": (6,),
      "bert/embeddings/layer_norm/bias": (6,),
      "bert/layer_0/attention/query/kernel": (6, 6),
      "bert/layer_0/attention/query/bias": (6,),
      "bert/layer_0/layer_norm/scale": (6,),
      "bert/layer_0/layer_norm/bias": (6,),
      "mlm_head/transform/kernel": (6, 6),
      "mlm_head/output_bias": (11,),
      "span_head/layer_norm/scale": (3,),
  }
  params = {k: rng.normal(size=s).astype(np.float32) + 0.5
            for k, s in shapes.items()}
  num_steps = 10
  # Large and small gradient steps, so some steps are clipped and some not.
  grad_scales = [0.02, 5.0, 0.05, 3.0, 0.01, 10.0, 0.03, 0.02, 2.0, 0.04]
  grads_per_step = [
      {k: (rng.normal(size=s) * grad_scales[i]).astype(np.float32)
       for k, s in shapes.items()} for i in range(num_steps)]
  norms = [np.sqrt(sum(np.sum(np.square(g, dtype=np.float64))
                       for g in grads.values())) for grads in grads_per_step]
  assert min(norms) < 1.0 < max(norms)  # both branches of the clip are used

  hyper = dict(lr=0.05, num_train_steps=12, num_warmup_steps=3)
  expected = _bert_reference(params, grads_per_step, **hyper)

  tx = opt.bert_optimizer(learning_rate=hyper["lr"],
                          num_train_steps=hyper["num_train_steps"],
                          warmup_steps=hyper["num_warmup_steps"])

  @jax.jit
  def step(p, state, g):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  p = jax.tree.map(jnp.asarray, _nest(params))
  state = tx.init(p)
  for i, grads in enumerate(grads_per_step):
    p, state = step(p, state, jax.tree.map(jnp.asarray, _nest(grads)))
    got = _flatten(p)
    for name in shapes:
      np.testing.assert_allclose(
          got[name], expected[i][name], rtol=1e-6, atol=1e-7,
          err_msg=f"step {i}, {name}")
    if i == 0:  # learning rate 0 on the first update: nothing moves
      for name in shapes:
        np.testing.assert_array_equal(got[name], params[name])
  # The oracle really moved things (and decay mattered): a run with no weight
  # decay must differ on decayed leaves only.
  no_decay = _bert_reference(params, grads_per_step, weight_decay=0.0,
                             **hyper)[-1]
  final = _flatten(p)
  diff = {k: np.max(np.abs(no_decay[k] - final[k])) for k in shapes}
  assert diff["mlm_head/transform/kernel"] > 1e-4
  assert diff["mlm_head/output_bias"] < 1e-6
  assert diff["bert/embeddings/layer_norm/scale"] < 1e-6


def test_adam_without_bias_correction_state_is_float32():
  tx = opt.scale_by_adam_without_bias_correction()
  params = {"w": jnp.ones((3,), jnp.bfloat16)}
  state = tx.init(params)
  assert state.count.dtype == jnp.int32
  assert state.mu["w"].dtype == jnp.float32
  assert state.nu["w"].dtype == jnp.float32
  grads = {"w": jnp.asarray([1.0, -2.0, 0.0], jnp.bfloat16)}
  updates, state = jax.jit(tx.update)(grads, state)
  assert updates["w"].dtype == jnp.bfloat16
  assert int(state.count) == 1
  # First step without bias correction: 0.1 g / (sqrt(0.001) |g| + eps).
  g = np.array([1.0, -2.0, 0.0])
  want = 0.1 * g / (np.sqrt(0.001 * g * g) + 1e-6)
  np.testing.assert_allclose(np.asarray(updates["w"], np.float32), want,
                             rtol=1e-2)


# ---------------------------------------------------------------------------
# realm_optimizer: the retriever on its own rate and schedule
# ---------------------------------------------------------------------------


def _realm_params_and_grads(rng, steps):
  params = {"retriever": {"w": rng.normal(size=(4, 3)).astype(np.float32),
                          "bias": rng.normal(size=(3,)).astype(np.float32)},
            "reader": {"w": rng.normal(size=(3, 2)).astype(np.float32)}}
  grads = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(
      np.float32) * 0.3, params) for _ in range(steps)]
  return params, grads


def _run(tx, params, grads):
  state = tx.init(params)
  trajectory = []
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state, params)
    params = optax.apply_updates(params, updates)
    trajectory.append(jax.tree.map(np.asarray, params))
  return trajectory


def test_realm_optimizer_defaults_are_bert_optimizer():
  params, grads = _realm_params_and_grads(np.random.default_rng(0), 5)
  kwargs = dict(learning_rate=0.1, num_train_steps=10, warmup_steps=2)
  got = _run(opt.realm_optimizer(**kwargs), params, grads)
  want = _run(opt.bert_optimizer(**kwargs), params, grads)
  for g, w in zip(got, want):
    jax.tree.map(np.testing.assert_array_equal, g, w)


def test_realm_optimizer_freezes_then_trains_the_retriever_apart():
  params, grads = _realm_params_and_grads(np.random.default_rng(1), 9)
  freeze, mult = 4, 0.25
  got = _run(opt.realm_optimizer(
      learning_rate=0.1, num_train_steps=9, warmup_steps=2,
      learning_rate_multiplier=mult, latest_release=freeze), params, grads)
  # The reader follows BERT's optimiser over all 9 steps, alone.
  reader = _run(opt.bert_optimizer(learning_rate=0.1, num_train_steps=9,
                                   warmup_steps=2),
                params["reader"], [g["reader"] for g in grads])
  for g, w in zip(got, reader):
    jax.tree.map(np.testing.assert_allclose, g["reader"], w)
  # The retriever does not move (not even weight decay) while frozen...
  for g in got[:freeze]:
    jax.tree.map(np.testing.assert_array_equal, g["retriever"],
                 params["retriever"])
  # ... then follows a fresh BERT optimiser at mult x the rate, over the
  # remaining steps, fed only the gradients after the freeze.
  retriever = _run(opt.bert_optimizer(learning_rate=0.1 * mult,
                                      num_train_steps=9 - freeze,
                                      warmup_steps=2),
                   params["retriever"],
                   [g["retriever"] for g in grads[freeze:]])
  for g, w in zip(got[freeze:], retriever):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 g["retriever"], w)
  assert not np.allclose(got[-1]["retriever"]["w"], params["retriever"]["w"])


def test_realm_optimizer_multiplier_zero_freezes_for_good():
  params, grads = _realm_params_and_grads(np.random.default_rng(2), 4)
  got = _run(opt.realm_optimizer(learning_rate=0.1, num_train_steps=4,
                                 warmup_steps=0,
                                 learning_rate_multiplier=0.0),
             params, grads)
  jax.tree.map(np.testing.assert_array_equal, got[-1]["retriever"],
               params["retriever"])
  assert not np.allclose(got[-1]["reader"]["w"], params["reader"]["w"])
  with pytest.raises(ValueError, match="multiplier"):
    opt.realm_optimizer(learning_rate=0.1, num_train_steps=4,
                        learning_rate_multiplier=-1.0)
  with pytest.raises(ValueError, match="latest_release"):
    opt.realm_optimizer(learning_rate=0.1, num_train_steps=4,
                        latest_release=-1)


def test_realm_optimizer_gate_releases_the_retriever_early():
  """`release_frozen` at update r, with no latest release (None: only on
  the gate's evidence): the retriever then follows a fresh BERT optimiser
  over the N - r updates left."""
  params, grads = _realm_params_and_grads(np.random.default_rng(3), 9)
  tx = opt.realm_optimizer(learning_rate=0.1, num_train_steps=9,
                           warmup_steps=2,
                           learning_rate_multiplier=0.5,
                           latest_release=None)
  state, p, got = tx.init(params), params, []
  assert opt.release_step(state) == 9
  for i, g in enumerate(grads):
    if i == 3:  # The gate opens before update 3; it never moves it later.
      state = opt.release_frozen(state, 3)
      state = opt.release_frozen(state, 5)
    updates, state = jax.jit(tx.update)(g, state, p)
    p = optax.apply_updates(p, updates)
    got.append(jax.tree.map(np.asarray, p))
  assert opt.release_step(state) == 3
  for g in got[:3]:
    jax.tree.map(np.testing.assert_array_equal, g["retriever"],
                 params["retriever"])
  want = _run(opt.bert_optimizer(learning_rate=0.05, num_train_steps=6,
                                 warmup_steps=2),
              params["retriever"], [g["retriever"] for g in grads[3:]])
  for g, w in zip(got[3:], want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 g["retriever"], w)


def test_realm_optimizer_never_moves_frozen_subtrees():
  params, grads = _realm_params_and_grads(np.random.default_rng(4), 4)
  params["retriever"]["document_embedder"] = {
      "w": np.ones((2, 2), np.float32)}
  for g in grads:
    g["retriever"]["document_embedder"] = {"w": np.ones((2, 2), np.float32)}
  got = _run(opt.realm_optimizer(
      learning_rate=0.1, num_train_steps=4, warmup_steps=0,
      frozen=(("retriever", "document_embedder"),)), params, grads)
  np.testing.assert_array_equal(
      got[-1]["retriever"]["document_embedder"]["w"], np.ones((2, 2)))
  assert not np.allclose(got[-1]["retriever"]["w"], params["retriever"]["w"])
  assert not np.allclose(got[-1]["reader"]["w"], params["reader"]["w"])

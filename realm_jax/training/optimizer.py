"""BERT's optimiser (AdamWeightDecayOptimizer) as an optax transformation.

REALM pre-trains and fine-tunes with the optimiser of the original BERT
release, which differs from `optax.adamw` in three ways that matter when
reproducing its numbers:

1. Adam has NO bias correction: `update = m / (sqrt(v) + eps)` with the raw
   moving averages, so early updates are small (about `(1 - b1) / sqrt(1 -
   b2)` ~ 3.2 times smaller than Adam's on the first step).
2. Weight decay is decoupled (added to the Adam update, then scaled by the
   learning rate) and skips LayerNorm parameters and biases.
3. The learning rate is linear warmup over the first `warmup_steps` steps,
   overriding a linear decay that runs from step 0 to `num_train_steps`
   (see `learning_rate_schedule` for the exact formula, which jumps at the
   end of warmup).

Gradients are clipped to global norm 1.0 before all of this.

The transformation is a plain optax chain: its state is a pytree of float32
moments plus int32 step counters, safe under `jax.jit`, `shard_map` and orbax.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

# REALM's warmup rule: 10% of training, at least 100 and at most 10,000 steps.
_MIN_WARMUP_STEPS = 100
_MAX_WARMUP_STEPS = 10_000

# Path components (case-insensitive substrings) whose parameters are not
# decayed. BERT matched the regexes "LayerNorm", "layer_norm" and "bias"
# against the whole variable name; our LayerNorm modules live under keys
# containing "layer_norm" (also "layer_normalization" in the span head).
_LAYER_NORM_MARKERS = ("layer_norm", "layernorm")
_BIAS_MARKER = "bias"


# ---------------------------------------------------------------------------
# Learning-rate schedule
# ---------------------------------------------------------------------------


def warmup_steps_for(num_train_steps: int) -> int:
  """REALM's warmup steps: min(10000, max(100, int(steps / 10)))."""
  if num_train_steps <= 0:
    raise ValueError(f"num_train_steps must be positive, got "
                     f"{num_train_steps}; pass the run's total step count.")
  return min(_MAX_WARMUP_STEPS,
             max(_MIN_WARMUP_STEPS, int(num_train_steps) // 10))


def learning_rate_schedule(*, learning_rate: float, num_train_steps: int,
                           warmup_steps: int | None = None) -> optax.Schedule:
  """BERT's learning rate: linear warmup overriding a linear decay to zero.

  With `lr = learning_rate`, `N = num_train_steps`, `W = warmup_steps` and
  `t` the number of updates already applied (optax's step count, so the
  first update uses `t = 0`, like BERT's `global_step` before increment):

    decayed(t) = lr * (1 - min(t, N) / N)          # polynomial, power 1
    lr(t)      = lr * t / W        if t < W        # warmup overrides
               = decayed(t)        otherwise

  This is exactly what BERT's `create_optimizer` computes: the decay is
  measured from step 0 over all `N` steps (not from the end of warmup), so
  the rate rises to `lr * (W - 1) / W` at `t = W - 1`, then drops to
  `lr * (1 - W / N)` at `t = W` and falls linearly to 0 at `t = N` (and
  stays 0 after). The very first update has learning rate 0. If `W = 0`
  there is no warmup (BERT's `if num_warmup_steps:`). A `W >= N` is allowed,
  as in the reference: training then never leaves warmup.

  `warmup_steps=None` uses `warmup_steps_for(num_train_steps)`.
  """
  if learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0, got {learning_rate}.")
  if num_train_steps <= 0:
    raise ValueError(f"num_train_steps must be positive, got "
                     f"{num_train_steps}; pass the run's total step count.")
  if warmup_steps is None:
    warmup_steps = warmup_steps_for(num_train_steps)
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0 (0 = no warmup), got "
                     f"{warmup_steps}; or pass None for REALM's rule.")
  peak = float(learning_rate)
  total = int(num_train_steps)
  warmup = int(warmup_steps)

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    # (N - t) / N rather than BERT's 1 - t / N: the same value, but exact
    # near the end in float32 (1 - 999/1000 loses ~5 digits).
    decayed = peak * ((total - jnp.minimum(step, total)) / total)
    if not warmup:
      return decayed
    warming = peak * (step / warmup)
    return jnp.where(jnp.asarray(count) < warmup, warming, decayed)

  return schedule


# ---------------------------------------------------------------------------
# Adam without bias correction
# ---------------------------------------------------------------------------


class ScaleByAdamWithoutBiasCorrectionState(NamedTuple):
  """Step count and float32 first/second moments (same tree as params)."""
  count: jax.Array  # int32 scalar
  mu: optax.Updates
  nu: optax.Updates


def scale_by_adam_without_bias_correction(
    b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-6) -> optax.GradientTransformation:
  """Adam's direction as BERT computes it: raw moments, no bias correction.

    mu <- b1 * mu + (1 - b1) * g
    nu <- b2 * nu + (1 - b2) * g^2
    update = mu / (sqrt(nu) + eps)

  Moments are kept in float32 whatever the parameter dtype; the update is
  returned in the gradient's dtype.
  """

  def init_fn(params):
    zeros = lambda p: jnp.zeros(jnp.shape(p), jnp.float32)
    return ScaleByAdamWithoutBiasCorrectionState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(zeros, params),
        nu=jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    del params
    grads32 = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), updates)
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads32)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g),
                      state.nu, grads32)
    new_updates = jax.tree.map(
        lambda m, v, g: (m / (jnp.sqrt(v) + eps)).astype(jnp.result_type(g)),
        mu, nu, updates)
    count = optax.safe_int32_increment(state.count)
    return new_updates, ScaleByAdamWithoutBiasCorrectionState(count, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# Weight-decay mask and the full optimiser
# ---------------------------------------------------------------------------


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _is_decayed(path: tuple[Any, ...]) -> bool:
  names = [_key_name(k).lower() for k in path]
  if any(marker in name for name in names for marker in _LAYER_NORM_MARKERS):
    return False
  # Leaf names "bias", "output_bias" (MLM head), ...: BERT excluded every
  # variable whose name contains "bias".
  return not (names and _BIAS_MARKER in names[-1])


def decay_mask(params: Any, unused: Sequence[tuple[str, ...]] = ()) -> Any:
  """Which parameters get weight decay: not LayerNorm, not biases.

  Nor the subtrees whose key path starts with one of `unused` (see
  `bert_optimizer`). Returns a pytree of Python bools like `params`.
  """
  prefixes = [tuple(p) for p in unused]

  def decayed(path, _):
    keys = tuple(_key_name(k) for k in path)
    if any(keys[:len(p)] == p for p in prefixes):
      return False
    return _is_decayed(path)

  return jax.tree_util.tree_map_with_path(decayed, params)


def bert_optimizer(*, learning_rate: float, num_train_steps: int,
                   warmup_steps: int | None = None,
                   weight_decay: float = 0.01, beta1: float = 0.9,
                   beta2: float = 0.999, epsilon: float = 1e-6,
                   clip_norm: float = 1.0,
                   unused: Sequence[tuple[str, ...]] = (),
                   bias_correction: bool = False,
                   _unit_rate: bool = False
                   ) -> optax.GradientTransformation:
  """BERT's AdamWeightDecayOptimizer with its gradient clipping and schedule.

  Per step, on gradients `g` and parameters `p`:

    g = g * clip_norm / max(global_norm(g), clip_norm)
    u = m / (sqrt(v) + eps)                  # Adam, no bias correction
    u = u + weight_decay * p                 # only where decay_mask(p)
    p = p - lr(t) * u                        # via optax.apply_updates

  with `lr(t)` from `learning_rate_schedule`. `update` needs `params`.

  Args:
    learning_rate, num_train_steps, warmup_steps: the schedule.
    weight_decay, beta1, beta2, epsilon, clip_norm: as above.
    unused: key-path prefixes of subtrees the loss never reads, e.g.
      `(("reader", "span_head"),)` in pre-training. Their gradients are
      zero, so Adam leaves them alone; excluding them from weight decay
      too keeps them exactly as initialised or loaded.
    bias_correction: use Adam's bias-corrected moments (`optax.scale_by_adam`)
      instead of BERT's raw ones. BERT's raw second moment makes steps 2-3x
      larger than Adam's for the first ~1000 updates; on the learning
      benchmark that made a reader trained from scratch memorise training
      facts instead of learning to read (docs/results/learning.md).

  Raises:
    ValueError: if a hyper-parameter is out of range.
  """
  if weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
  for name, beta in (("beta1", beta1), ("beta2", beta2)):
    if not 0.0 <= beta < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {beta}.")
  if epsilon <= 0:
    raise ValueError(f"epsilon must be > 0, got {epsilon}.")
  if clip_norm <= 0:
    raise ValueError(f"clip_norm must be > 0, got {clip_norm}; BERT uses 1.0.")
  schedule = learning_rate_schedule(learning_rate=learning_rate,
                                    num_train_steps=num_train_steps,
                                    warmup_steps=warmup_steps)
  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      (optax.scale_by_adam(beta1, beta2, epsilon) if bias_correction else
       scale_by_adam_without_bias_correction(beta1, beta2, epsilon)),
      optax.add_decayed_weights(
          weight_decay, mask=functools.partial(decay_mask, unused=unused)),
      # `_unit_rate`: the caller applies the schedule (`delayed`).
      optax.scale_by_learning_rate(1.0 if _unit_rate else schedule),
  )


# ---------------------------------------------------------------------------
# REALM pre-training: the retriever on its own rate and schedule
# ---------------------------------------------------------------------------


class DelayedState(NamedTuple):
  count: jax.Array    # int32 scalar: updates seen, frozen ones included
  release: jax.Array  # int32 scalar: the first update that trains
  inner: Any


def _schedule_from(*, learning_rate: float, warmup_steps: int | None,
                   count: jax.Array, total: jax.Array) -> jax.Array:
  """`learning_rate_schedule` at update `count` of `total`, where `total`
  is only known when the retriever is released (a traced int)."""
  step = jnp.asarray(count, jnp.float32)
  total = jnp.maximum(jnp.asarray(total, jnp.int32), 1)
  decayed = learning_rate * ((total - jnp.minimum(step, total)) / total)
  warmup = (jnp.asarray(warmup_steps, jnp.int32) if warmup_steps is not None
            else jnp.minimum(_MAX_WARMUP_STEPS,
                             jnp.maximum(_MIN_WARMUP_STEPS, total // 10)))
  warming = learning_rate * (step / jnp.maximum(warmup, 1))
  return jnp.where((warmup > 0) & (count < warmup), warming, decayed)


def delayed(inner: optax.GradientTransformation, start_step: int, *,
            learning_rate: float | None = None,
            num_train_steps: int | None = None,
            warmup_steps: int | None = None
            ) -> optax.GradientTransformation:
  """`inner`, but zero updates (and an untouched inner state) before a step.

  Before the release (update `start_step`, or an earlier one set during
  the run with `release_frozen`), the parameters do not move at all (no
  weight decay either) and `inner` sees nothing, so its moments start when
  the parameters start to train. The release step lives in the state: a
  run-measured gate can move it, and a checkpoint keeps it.

  With `learning_rate` and `num_train_steps`, `inner` must end in a unit
  step (`scale_by_learning_rate(1.0)`) and this applies BERT's schedule
  (`learning_rate_schedule`) from the release over the `num_train_steps -
  release` updates left, whenever the release comes.
  """
  start_step = int(start_step)
  scheduled = learning_rate is not None

  def init_fn(params):
    return DelayedState(jnp.zeros([], jnp.int32),
                        jnp.asarray(start_step, jnp.int32),
                        inner.init(params))

  def update_fn(updates, state, params=None):
    def frozen(_):
      return jax.tree.map(jnp.zeros_like, updates), state.inner

    def training(_):
      new, inner_state = inner.update(updates, state.inner, params)
      if scheduled:
        rate = _schedule_from(learning_rate=learning_rate,
                              warmup_steps=warmup_steps,
                              count=state.count - state.release,
                              total=num_train_steps - state.release)
        new = jax.tree.map(lambda u: u * rate.astype(u.dtype), new)
      return new, inner_state

    new_updates, inner_state = jax.lax.cond(
        state.count < state.release, frozen, training, None)
    return new_updates, DelayedState(
        optax.safe_int32_increment(state.count), state.release, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def _delayed_states(opt_state) -> list[DelayedState]:
  is_delayed = lambda x: isinstance(x, DelayedState)  # pylint: disable=unnecessary-lambda-assignment
  return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_delayed)
          if is_delayed(x)]


def release_step(opt_state) -> int | None:
  """The update at which the delayed (retriever) part starts to train, or
  None if the optimiser has no delayed part."""
  states = _delayed_states(opt_state)
  return int(jax.device_get(states[0].release)) if states else None


def _move_release(opt_state, move):
  """`opt_state` with every delayed part's release replaced by
  `move(release)`. Same structure and shardings."""
  def moved(x):
    return x._replace(release=move(x.release)) if isinstance(
        x, DelayedState) else x
  return jax.tree_util.tree_map(
      moved, opt_state, is_leaf=lambda x: isinstance(x, DelayedState))


def release_frozen(opt_state, step: int):
  """`opt_state` with every delayed part released at update `step` (never
  later than it was already due). Same structure and shardings."""
  return _move_release(opt_state, lambda r: jnp.minimum(
      r, jnp.asarray(step, r.dtype)))


# `freeze_again`'s release: never (a continued run's extra steps included).
NEVER = np.iinfo(np.int32).max


def freeze_again(opt_state):
  """`opt_state` with every delayed part frozen again, for good: its
  release moves to `NEVER` (the recall guard's rollback). Its inner state
  (Adam's moments) is kept but unused. Same structure and shardings."""
  return _move_release(opt_state, lambda r: jnp.maximum(
      r, jnp.asarray(NEVER, r.dtype)))


def _check_retriever_schedule(multiplier: float,
                              latest_release: int | None) -> None:
  if multiplier < 0:
    raise ValueError("learning_rate_multiplier must be >= 0, got "
                     f"{multiplier}.")
  if latest_release is not None and latest_release < 0:
    raise ValueError(f"latest_release must be >= 0 or None, got "
                     f"{latest_release}.")


def realm_optimizer(*, learning_rate: float, num_train_steps: int,
                    warmup_steps: int | None = None,
                    learning_rate_multiplier: float = 1.0,
                    latest_release: int | None = 0,
                    frozen: Sequence[tuple[str, ...]] = (),
                    unused: Sequence[tuple[str, ...]] = (),
                    bias_correction: bool = False
                    ) -> optax.GradientTransformation:
  """BERT's optimiser for {"retriever", "reader"} params, retriever apart.

  The keywords are the run's config's: `learning_rate_multiplier`
  (`RetrieverScheduleConfig`, the retriever's rate relative to the
  reader's) and `latest_release` (`GateConfig`). With the defaults
  (multiplier 1, released at 0) this is exactly `bert_optimizer` over all
  parameters, as REALM trained. Otherwise the retriever and the reader get
  separate BERT optimisers (each with its own global-norm clip and Adam
  moments):
  - reader: peak `learning_rate` over `num_train_steps`;
  - retriever: frozen until its release, then peak `learning_rate *
    learning_rate_multiplier` with its own warmup over the steps left. The
    release is update `latest_release` (a reader warm-up: the reader
    learns to read retrieved blocks before the retriever follows its
    signal) or earlier, when a gate measured in the run calls
    `release_frozen`; None: only then.

  Why apart: the retriever's gradient is ~1e-3 of the reader's until the
  reader uses documents, so it is mostly noise; Adam scales every
  parameter's step to the learning rate whatever the gradient's size, and
  one shared rate moved the retriever into a collapsed state within 50
  steps (docs/results/learning.md).

  `frozen`: key-path prefixes (from the root) that never change, e.g. the
  document tower in query-side training. `warmup_steps` applies to each
  part (None: BERT's rule on its length); `unused` and `bias_correction`
  are as in `bert_optimizer` (`unused` paths from the root: each part sees
  the whole tree, the other part's leaves masked). A multiplier of 0
  freezes the retriever for the whole run.
  """
  _check_retriever_schedule(learning_rate_multiplier, latest_release)
  reader = bert_optimizer(learning_rate=learning_rate,
                          num_train_steps=num_train_steps,
                          warmup_steps=warmup_steps, unused=unused,
                          bias_correction=bias_correction)
  if learning_rate_multiplier == 1.0 and latest_release == 0 and not frozen:
    return reader
  retriever = _delayed_retriever(
      learning_rate, learning_rate_multiplier,
      num_train_steps=num_train_steps, warmup_steps=warmup_steps,
      latest_release=latest_release, unused=unused,
      bias_correction=bias_correction)
  return optax.multi_transform({"retriever": retriever, "reader": reader,
                                "frozen": optax.set_to_zero()},
                               _part_labels(frozen))


def _delayed_retriever(learning_rate: float, multiplier: float, *,
                       num_train_steps: int, warmup_steps: int | None,
                       latest_release: int | None,
                       unused: Sequence[tuple[str, ...]],
                       bias_correction: bool
                       ) -> optax.GradientTransformation:
  """`realm_optimizer`'s retriever part: BERT's optimiser at peak
  `learning_rate * multiplier` (multiplier 0: frozen for the whole run),
  released at update `latest_release` (or earlier by `release_frozen`;
  None: only by it)."""
  # A retriever frozen for good (multiplier 0, or a freeze as long as the
  # run) keeps the same optimiser state structure, so a run can resume
  # from another's checkpoint with a different freeze or multiplier.
  release = (num_train_steps if multiplier == 0 or latest_release is None
             else min(latest_release, num_train_steps))
  return delayed(
      bert_optimizer(learning_rate=1.0, num_train_steps=1, warmup_steps=0,
                     unused=unused, bias_correction=bias_correction,
                     _unit_rate=True),
      release, learning_rate=learning_rate * multiplier,
      num_train_steps=num_train_steps, warmup_steps=warmup_steps)


def _part_labels(frozen: Sequence[tuple[str, ...]]):
  """`realm_optimizer`'s labels: "frozen" under a `frozen` prefix, else
  the top-level key."""
  frozen = tuple(tuple(p) for p in frozen)

  def label(path, _) -> str:
    keys = tuple(_key_name(k) for k in path)
    if any(keys[:len(p)] == p for p in frozen):
      return "frozen"
    return keys[0]

  return lambda params: jax.tree_util.tree_map_with_path(label, params)

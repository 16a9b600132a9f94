"""The training loop every trainer shares."""

from __future__ import annotations

import functools

import jax
import optax

from realm_jax.core import io_utils
from realm_jax.core import parallel


def start_run(workdir: io_utils.PathLike, operative_config: str, *,
              is_chief: bool):
  """Creates the workdir, saves the operative gin config, returns a writer.

  Only process 0 writes the config and TensorBoard summaries; the others
  get a logging-only writer.
  """
  io_utils.makedirs(workdir)
  if is_chief and operative_config:
    io_utils.atomic_write_text(io_utils.join(workdir, "operative_config.gin"),
                               operative_config)
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  # TensorBoard's writer opens gs:// itself (tf.io.gfile).
  return metric_writers.create_default_writer(
      io_utils.join(workdir, "summaries"), just_logging=not is_chief)


def make_train_step(loss_fn: parallel.LossFn, optimizer, mesh,
                    grad_norm_groups: tuple[str, ...] = ()):
  """A jitted `train_step(state, batch, rng) -> (state, metrics)`.

  `state` is a dict {"step", "params", "opt_state"}; it is donated. The
  optimizer update runs on the replicated gradients outside `shard_map`, so
  every device applies the same update to its replica. Metrics hold the
  loss, the global gradient norm and `grad_norm_<group>` for each top-level
  key of the params named in `grad_norm_groups`.
  """
  grad_fn = parallel.data_parallel_value_and_grad(loss_fn, mesh)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def train_step(state, batch, rng):
    step_rng = jax.random.fold_in(rng, state["step"])
    loss, grads, metrics = grad_fn(state["params"], batch, step_rng)
    updates, opt_state = optimizer.update(grads, state["opt_state"],
                                          state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    for group in grad_norm_groups:
      metrics[f"grad_norm_{group}"] = optax.tree.norm(grads[group])
    return {"step": state["step"] + 1, "params": params,
            "opt_state": opt_state}, metrics

  return train_step

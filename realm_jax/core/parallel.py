"""Data parallelism, pmap-style, written with `jax.shard_map`.

Every device holds a replica of the parameters and its slice of the global
batch along the `data` mesh axis; the step body sees per-core shapes and
combines gradients with collectives named by the axis, exactly like `pmap`,
but over global arrays, so the same code runs on one CPU, 8 emulated devices
and a multi-host pod.

Mesh axis type: `Auto`. Inside `shard_map` every axis is manual anyway; code
outside it (input placement, retrieval glue, the optimizer update) stays free
to let XLA pick shardings, which `Explicit` axes would turn into type errors
for ops such as gathers over the sharded batch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
# The two partition specs of pmap-style code: a value every device holds
# whole (parameters, a PRNG key) and one split on its leading axis (a batch).
REPLICATED = P()
BATCH = P(DATA_AXIS)

# loss_fn(params, batch, rng) -> (loss_sum, weight_sum, metric_sums): sums
# over this core's examples; the step divides by the global weight.
LossFn = Callable[[Any, Mapping[str, jax.Array], jax.Array | None],
                  tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


def make_mesh(devices=None) -> Mesh:
  """A 1-D mesh over `devices` (default: all devices of all processes)."""
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.asarray(devices), (DATA_AXIS,),
              axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def data_sharded(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(DATA_AXIS))


def shard_batch(mesh: Mesh, local_batch: Mapping[str, np.ndarray]
                ) -> dict[str, jax.Array]:
  """Global arrays, split on the leading axis, from this process's examples.

  Raises:
    ValueError: if the process-local batch does not divide over the local
      devices.
  """
  n_local = len(mesh.local_devices)
  out = {}
  for name, value in local_batch.items():
    value = np.asarray(value)
    if value.shape[0] % n_local:
      raise ValueError(
          f"Batch feature {name!r} has {value.shape[0]} examples on this "
          f"host, not divisible by its {n_local} local devices; make the "
          "per-host batch size a multiple of the local device count.")
    out[name] = jax.make_array_from_process_local_data(
        data_sharded(mesh), value)
  return out


def host_copy(tree):
  """numpy copy of replicated arrays (works when they span several hosts)."""
  def one(x):
    if isinstance(x, jax.Array):
      return np.asarray(x.addressable_data(0))
    return x
  return jax.tree_util.tree_map(one, tree)


def local_rows(array: jax.Array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in order."""
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start)
  return np.concatenate([np.asarray(s.data) for s in shards])


def data_parallel(fn: Callable[..., Any], mesh: Mesh | None, *, in_specs,
                  out_specs) -> Callable[..., Any]:
  """`fn` compiled to run pmap-style over the `data` axis of `mesh`.

  The one place that writes `jit(shard_map(...))`: `fn` sees per-device
  shards (REPLICATED arguments whole, BATCH arguments as this device's
  slice of the leading axis) and its outputs are assembled by `out_specs`.
  A pytree argument takes one spec for all its leaves (e.g. BATCH for a
  batch dict). Without a mesh (one device) it is plain `jax.jit(fn)`, so
  callers that run on a single device need no second code path.
  """
  if mesh is None:
    return jax.jit(fn)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                               out_specs=out_specs))


def data_parallel_value_and_grad(loss_fn: LossFn, mesh: Mesh):
  """Builds a per-core gradient function over the `data` axis.

  The returned function takes replicated params, a batch sharded on its
  leading axis and an optional PRNG key, and returns replicated
  `(loss, grads, metrics)` where loss = global loss_sum / global weight_sum,
  grads are its exact gradients (each core's gradient of its own share,
  summed over the axis) and metrics are metric_sums / global weight_sum.
  The dropout key is folded with the core index so cores drop differently.
  """

  def per_core(params, batch, rng):
    if rng is not None:
      rng = jax.random.fold_in(rng, jax.lax.axis_index(DATA_AXIS))

    # Mark the replicated params as varying over `data`, so their gradient
    # below is this core's own (as under pmap) and the reduction is the
    # explicit psum; left invariant, shard_map's transpose would psum them
    # implicitly.
    params = jax.lax.pcast(params, DATA_AXIS, to="varying")

    def share_of_loss(p):
      loss_sum, weight_sum, metric_sums = loss_fn(p, batch, rng)
      total = jnp.maximum(jax.lax.psum(weight_sum, DATA_AXIS), 1.0)
      return loss_sum / total, (metric_sums, total)

    (share, (metric_sums, total)), grads = jax.value_and_grad(
        share_of_loss, has_aux=True)(params)
    loss = jax.lax.psum(share, DATA_AXIS)
    grads = jax.lax.psum(grads, DATA_AXIS)
    metrics = jax.tree_util.tree_map(
        lambda m: jax.lax.psum(m, DATA_AXIS) / total, metric_sums)
    metrics["weight"] = total
    return loss, grads, metrics

  def fn(params, batch, rng=None):
    # Not jitted here: it runs inside the caller's jitted train step.
    rng_spec = None if rng is None else REPLICATED
    return jax.shard_map(
        per_core, mesh=mesh, in_specs=(REPLICATED, BATCH, rng_spec),
        out_specs=(REPLICATED, REPLICATED, REPLICATED))(params, batch, rng)

  return fn

"""Multi-host helpers: `jax.distributed.initialize()` behind one switch.

Every job calls `maybe_initialize()` first thing in `main()`, before anything
touches a JAX backend. It initialises the JAX distributed system only when
asked, so one code path serves a laptop, a GPU box and every host of a Cloud
TPU pod:

* on a pod, `launch/tpu_pod.py` starts each job with
  `REALM_JAX_DISTRIBUTED=1`; JAX then finds the coordinator, the process
  count and this host's id from the TPU metadata;
* for several processes on one machine (tests, debugging), pass
  `coordinator_address="127.0.0.1:PORT"`, `num_processes` and `process_id`
  (or set `REALM_JAX_COORDINATOR_ADDRESS`, `REALM_JAX_NUM_PROCESSES`,
  `REALM_JAX_PROCESS_ID` and optionally `REALM_JAX_LOCAL_DEVICE_IDS`, which
  lets unmodified jobs run as several processes);
* otherwise nothing happens: a single process needs no coordinator.

No absl flags are defined here: jobs read the environment or pass their own
flags' values in, so importing this module never clashes with a job's flags.

The other helpers are the multi-host hygiene every job follows: `is_chief()`
guards writes of summaries, configs and pointers; `broadcast_from_chief()`
hands seeds and stop decisions from process 0 to everyone; `barrier()` makes
every process meet before exit; `check_divisible()` fails loudly, saying
what to change, when a size does not split over devices or hosts.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

# Set by launch/tpu_pod.py on every pod worker.
ENV_DISTRIBUTED = "REALM_JAX_DISTRIBUTED"
# Explicit topology for multi-process runs on one machine (or any cluster
# JAX cannot detect by itself).
ENV_COORDINATOR_ADDRESS = "REALM_JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "REALM_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "REALM_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "REALM_JAX_LOCAL_DEVICE_IDS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _env_flag(name: str) -> bool:
  value = os.environ.get(name, "").strip().lower()
  if value in _TRUE:
    return True
  if value in _FALSE:
    return False
  raise ValueError(f"{name}={os.environ[name]!r} is not a boolean; set it to "
                   "1 to initialise jax.distributed or 0 (or unset it) to "
                   "run as a single process.")


def _env_int(name: str) -> int | None:
  value = os.environ.get(name, "").strip()
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name}={value!r} is not an integer.") from None


def _env_device_ids() -> list[int] | None:
  value = os.environ.get(ENV_LOCAL_DEVICE_IDS, "").strip()
  if not value:
    return None
  try:
    return [int(v) for v in value.split(",")]
  except ValueError:
    raise ValueError(f"{ENV_LOCAL_DEVICE_IDS}={value!r} is not a "
                     "comma-separated list of device ids, e.g. 0,1.") from None


def _asks_for_distributed(coordinator_address: str | None,
                          num_processes: int | None,
                          process_id: int | None,
                          local_device_ids: int | Sequence[int] | None, *,
                          auto: bool) -> bool:
  """Whether `maybe_initialize` should initialise, checking the topology.

  Raises:
    ValueError: as `maybe_initialize` documents.
  """
  explicit = {"coordinator_address": coordinator_address,
              "num_processes": num_processes, "process_id": process_id}
  given = [k for k, v in explicit.items() if v is not None]
  if not auto and not given:
    if local_device_ids is not None:
      raise ValueError("local_device_ids is set but nothing asks for a "
                       "multi-process run; also pass coordinator_address, "
                       "num_processes and process_id, or drop it.")
    return False
  if not auto and len(given) < len(explicit):
    missing = sorted(set(explicit) - set(given))
    raise ValueError(
        f"Got {', '.join(given)} but not {', '.join(missing)}: pass "
        "coordinator_address, num_processes and process_id together (or the "
        f"{ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
        f"environment variables), or set {ENV_DISTRIBUTED}=1 (or force=True) "
        "to let JAX detect the rest on a Cloud TPU pod.")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes={num_processes}; it must be >= 1.")
  if (process_id is not None and num_processes is not None
      and not 0 <= process_id < num_processes):
    raise ValueError(f"process_id={process_id} is not in [0, "
                     f"{num_processes}); number processes from 0.")
  return True


def maybe_initialize(*, coordinator_address: str | None = None,
                     num_processes: int | None = None,
                     process_id: int | None = None,
                     local_device_ids: int | Sequence[int] | None = None,
                     force: bool = False) -> bool:
  """Calls `jax.distributed.initialize()` when this run is multi-process.

  It is asked for by `force=True`, by `REALM_JAX_DISTRIBUTED=1` in the
  environment (what the pod launcher sets), or by an explicit topology:
  `coordinator_address`, `num_processes` and `process_id` given together as
  arguments or through the `REALM_JAX_*` environment variables (arguments
  win). Otherwise it returns False and touches nothing, so JAX still starts
  as one process. Call it before any other JAX call: JAX refuses to
  initialise the distributed system once a backend is up.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: number of processes in the run.
    process_id: this process's id in [0, num_processes).
    local_device_ids: devices this process owns (default: all it sees).
    force: initialise even without arguments or environment variables,
      letting JAX detect the cluster (Cloud TPU, Slurm, Open MPI).

  Returns:
    True if the distributed system is initialised (by this call or an
    earlier one), False if this is a single-process run.

  Raises:
    ValueError: for a partial explicit topology without `force` or
      `REALM_JAX_DISTRIBUTED=1`, out-of-range ids, or malformed environment
      variables.
  """
  if jax.distributed.is_initialized():
    return True
  coordinator_address = (coordinator_address or
                         os.environ.get(ENV_COORDINATOR_ADDRESS) or None)
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  if local_device_ids is None:
    local_device_ids = _env_device_ids()
  if not _asks_for_distributed(
      coordinator_address, num_processes, process_id, local_device_ids,
      auto=force or _env_flag(ENV_DISTRIBUTED)):
    return False
  logging.info("jax.distributed.initialize(coordinator_address=%s, "
               "num_processes=%s, process_id=%s, local_device_ids=%s)",
               coordinator_address, num_processes, process_id,
               local_device_ids)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id,
                             local_device_ids=local_device_ids)
  logging.info("jax.distributed: process %d of %d, %d local of %d devices.",
               jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True


def is_chief() -> bool:
  """True on process 0, the one that writes summaries, configs, pointers."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Blocks until every process has reached the barrier called `name`.

  A no-op for a single process. Every process must call it with the same
  name, in the same order; a mismatch fails instead of hanging silently.
  """
  if jax.process_count() == 1:
    return
  multihost_utils.sync_global_devices(name)


def allgather_rows(local: np.ndarray) -> np.ndarray:
  """Every host's `local` rows concatenated in host order (a global
  batch's rows, when each host holds its contiguous share)."""
  if jax.process_count() == 1:
    return np.asarray(local)
  return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def broadcast_from_chief(pytree: Any) -> Any:
  """Returns process 0's value of `pytree` on every process.

  Use it for anything every process must agree on but may compute
  differently: seeds, "stop now" decisions, the step of the index to load.
  Every process must pass the same structure, shapes and dtypes. The leaves
  come back as numpy arrays; booleans stay booleans, and with several
  processes other dtypes go through JAX, so 64-bit leaves come back 32-bit
  unless `jax_enable_x64` is set.
  """
  leaves, treedef = jax.tree_util.tree_flatten(pytree)
  leaves = [np.asarray(x) for x in leaves]
  # The broadcast is a psum in which only process 0 contributes; sum a
  # boolean as an integer so that it is not an "or" in disguise.
  sent = [x.astype(np.int32) if x.dtype == np.bool_ else x for x in leaves]
  received = multihost_utils.broadcast_one_to_all(sent)
  received = [np.asarray(r).astype(np.bool_) if x.dtype == np.bool_
              else np.asarray(r) for x, r in zip(leaves, received)]
  return jax.tree_util.tree_unflatten(treedef, received)


def check_divisible(what: str, n: int, by: int, *,
                    by_what: str | None = None) -> int:
  """Checks that size `what`=`n` splits evenly into `by` parts; `n // by`.

  `by_what` says what `by` counts (e.g. "devices (4 hosts x 4 chips)") in
  the error message, which names the nearest valid values.
  """
  if by < 1:
    raise ValueError(f"Cannot split {what}={n} over {by} "
                     f"{by_what or 'parts'}; that count must be >= 1.")
  if n < 0:
    raise ValueError(f"{what}={n} is negative.")
  if n % by:
    below, above = n // by * by, (n // by + 1) * by
    nearest = f"{below} or {above}" if below else str(above)
    over = f" {by_what}" if by_what else ""
    raise ValueError(
        f"{what}={n} does not divide evenly over {by}{over}; set {what} to "
        f"a multiple of {by} (e.g. {nearest}).")
  return n // by

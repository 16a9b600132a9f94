"""realm_jax.core.distributed: when jax.distributed is initialised, and the helpers.

The tests that really initialise the distributed system run in a fresh
Python process: JAX allows it only before a backend starts, and the pytest
process has started one (tests/conftest.py). The two-process run over
localhost lives with the jobs' multi-process tests.
"""

import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from realm_jax.core import distributed
from realm_jax.testing import timeouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_VARS = (distributed.ENV_DISTRIBUTED, distributed.ENV_COORDINATOR_ADDRESS,
            distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
            distributed.ENV_LOCAL_DEVICE_IDS)


@pytest.fixture(name="clean_env")
def _clean_env(monkeypatch):
  for name in ENV_VARS:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_python(code: str, env_updates: dict[str, str]) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
  env.update(env_updates, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=env, capture_output=True, text=True,
                          timeout=timeouts.HANG_SECONDS, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


# ----------------------------------------------------------------------------
# maybe_initialize
# ----------------------------------------------------------------------------


def test_single_process_is_skipped(clean_env):
  del clean_env
  assert distributed.maybe_initialize() is False
  assert distributed.maybe_initialize(force=False) is False
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("value", ["0", "", "false", "No"])
def test_env_switch_off_is_skipped(clean_env, value):
  clean_env.setenv(distributed.ENV_DISTRIBUTED, value)
  assert distributed.maybe_initialize() is False
  assert not jax.distributed.is_initialized()


def test_skip_leaves_jax_free_to_initialise_then_explicit_args_do():
  # If the skipped path had started a backend, the explicit initialise
  # below would raise ("must be called before any JAX computations").
  port = _free_port()
  out = _run_python(f"""
      from realm_jax.core import distributed
      import jax
      assert distributed.maybe_initialize() is False
      assert not jax.distributed.is_initialized()
      assert distributed.maybe_initialize(
          coordinator_address="127.0.0.1:{port}", num_processes=1,
          process_id=0) is True
      assert jax.distributed.is_initialized()
      # Idempotent: a second call (another module's main) is a no-op.
      assert distributed.maybe_initialize() is True
      print("count", jax.process_count(), "chief", distributed.is_chief())
      """, {})
  assert "count 1 chief True" in out


def test_environment_topology_initialises():
  # What the pod launcher sets (the switch), plus the explicit topology a
  # local multi-process run gives through the environment.
  port = _free_port()
  out = _run_python("""
      from realm_jax.core import distributed
      import jax
      assert distributed.maybe_initialize() is True
      print("initialised", jax.distributed.is_initialized(),
            jax.process_index(), jax.process_count())
      """, {distributed.ENV_DISTRIBUTED: "1",
            distributed.ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{port}",
            distributed.ENV_NUM_PROCESSES: "1",
            distributed.ENV_PROCESS_ID: "0"})
  assert "initialised True 0 1" in out


def test_partial_topology_is_refused_before_initialising(clean_env):
  with pytest.raises(ValueError, match=r"not num_processes, process_id") as e:
    distributed.maybe_initialize(coordinator_address="127.0.0.1:1234")
  assert "REALM_JAX_DISTRIBUTED=1" in str(e.value)
  clean_env.setenv(distributed.ENV_PROCESS_ID, "1")
  with pytest.raises(ValueError, match="coordinator_address, num_processes"):
    distributed.maybe_initialize()
  assert not jax.distributed.is_initialized()


def test_bad_values_are_refused(clean_env):
  with pytest.raises(ValueError, match=r"process_id=2 is not in \[0, 2\)"):
    distributed.maybe_initialize(coordinator_address="127.0.0.1:1234",
                                 num_processes=2, process_id=2)
  with pytest.raises(ValueError, match="local_device_ids is set"):
    distributed.maybe_initialize(local_device_ids=[0])
  clean_env.setenv(distributed.ENV_DISTRIBUTED, "maybe")
  with pytest.raises(ValueError, match="REALM_JAX_DISTRIBUTED='maybe'"):
    distributed.maybe_initialize()
  clean_env.setenv(distributed.ENV_DISTRIBUTED, "0")
  clean_env.setenv(distributed.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match="REALM_JAX_NUM_PROCESSES='two'"):
    distributed.maybe_initialize()
  assert not jax.distributed.is_initialized()


# ----------------------------------------------------------------------------
# Single-process behaviour of the helpers
# ----------------------------------------------------------------------------


def test_chief_barrier_broadcast_single_process():
  assert distributed.is_chief()
  distributed.barrier("test")  # Returns at once with one process.
  tree = {"seed": 7, "stop": np.bool_(True), "x": np.arange(3, dtype=np.int32)}
  out = distributed.broadcast_from_chief(tree)
  assert set(out) == {"seed", "stop", "x"}
  assert int(out["seed"]) == 7
  assert out["stop"].dtype == np.bool_ and bool(out["stop"])
  np.testing.assert_array_equal(out["x"], [0, 1, 2])


# ----------------------------------------------------------------------------
# check_divisible
# ----------------------------------------------------------------------------


def test_check_divisible_returns_the_quotient():
  assert distributed.check_divisible("batch_size", 512, 64) == 8
  assert distributed.check_divisible("batch_size", 0, 8) == 0


def test_check_divisible_says_what_to_change():
  with pytest.raises(ValueError) as e:
    distributed.check_divisible("batch_size", 30, 8,
                                by_what="devices (2 hosts x 4)")
  message = str(e.value)
  assert message.startswith("batch_size=30 does not divide evenly over 8 "
                            "devices (2 hosts x 4)")
  assert "set batch_size to a multiple of 8 (e.g. 24 or 32)" in message
  with pytest.raises(ValueError, match=r"multiple of 16 \(e.g. 16\)"):
    distributed.check_divisible("per_host_batch", 5, 16)


def test_check_divisible_bad_divisor():
  with pytest.raises(ValueError, match="over 0 hosts; that count must be"):
    distributed.check_divisible("batch_size", 8, 0, by_what="hosts")
  with pytest.raises(ValueError, match="batch_size=-8 is negative"):
    distributed.check_divisible("batch_size", -8, 4)

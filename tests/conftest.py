"""Every test runs JAX on 8 emulated CPU devices.

The flag must be set before JAX initialises its backends, so it is set here at
import time, before any test module imports jax.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow (tokenizer, TFRecords, checkpoint reading) must not grab a GPU or
# all host threads next to JAX.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import ast  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

_AST_PARSE = ast.parse


def _ast_parse(*args, **kwargs):
  """`ast.parse`, retried on CPython 3.11's spurious "AST constructor
  recursion depth mismatch" SystemError (python/cpython#106905).

  The ast module's depth counter is shared by threads, and Python 3.11
  parses source lines to place a traceback's carets: a background thread
  formatting an exception (an orbax reader left over from the
  damaged-checkpoint tests logs one) can run it in the middle of a test's
  `ast.parse` of realm_jax's sources (test_layers, test_cli_hints, ...).
  """
  for attempt in range(5):
    try:
      return _AST_PARSE(*args, **kwargs)
    except SystemError as e:
      if "recursion depth mismatch" not in str(e) or attempt == 4:
        raise
  raise AssertionError("unreachable")


ast.parse = _ast_parse


def pytest_sessionstart(session):
  del session
  n = jax.device_count()
  if n != 8:
    raise pytest.UsageError(
        f"Expected 8 emulated CPU devices, JAX sees {n}: XLA_FLAGS was read "
        "before tests/conftest.py could set it.")


def pytest_configure(config):
  # Long stress loops (e.g. the launcher's 20 runs): `-m "not slow"` skips
  # them.
  config.addinivalue_line(
      "markers", "slow: a long stress test; deselect with -m 'not slow'")

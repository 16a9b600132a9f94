"""Every test runs JAX on 8 emulated CPU devices.

The flag must be set before JAX initialises its backends, so it is set here at
import time, before any test module imports jax.

Most of the suite's time is XLA compiling small programs, many of them more
than once (each test builds its own train step; a job run in a subprocess
compiles what the test before it compiled). One persistent compilation
cache per test session, in a fresh temporary directory shared by the xdist
workers and the jobs they start (through the environment), compiles each
program once. It starts empty: nothing of an earlier run is reused.
"""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow (tokenizer, TFRecords, checkpoint reading) must not grab a GPU or
# all host threads next to JAX.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

_CACHE_VARIABLE = "REALM_JAX_TEST_COMPILATION_CACHE"
# The process that made the session's cache (pytest's own, or xdist's
# controller) removes it at the end; the workers it starts inherit it.
_OWN_CACHE = _CACHE_VARIABLE not in os.environ
if _OWN_CACHE:
  os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="realm_jax_xla_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_VARIABLE]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

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


def pytest_configure(config):
  config.addinivalue_line(
      "markers",
      "slow: a long test, left out of README's test command "
      "(-m \"not slow\") and run by CI after it (-m slow).")
  config.addinivalue_line(
      "markers",
      "network: needs the package index (PyPI); also marked slow, so only "
      "CI's slow tier runs it, and it skips, saying why, where the index "
      "cannot be reached.")


def pytest_sessionstart(session):
  del session
  n = jax.device_count()
  if n != 8:
    raise pytest.UsageError(
        f"Expected 8 emulated CPU devices, JAX sees {n}: XLA_FLAGS was read "
        "before tests/conftest.py could set it.")


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE:
    shutil.rmtree(os.environ[_CACHE_VARIABLE], ignore_errors=True)

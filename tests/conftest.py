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

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_sessionstart(session):
  del session
  n = jax.device_count()
  if n != 8:
    raise pytest.UsageError(
        f"Expected 8 emulated CPU devices, JAX sees {n}: XLA_FLAGS was read "
        "before tests/conftest.py could set it.")

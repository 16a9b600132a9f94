"""The `gcs` fixture: a GCS emulator for the tests of this directory.

One emulator per test session (per xdist worker), on 127.0.0.1 and a free
port, holding one bucket; stopped, with its proxy, at the end. Each test
works under its own `gs://<bucket>/<unique prefix>` (`gcs_root`), and runs
what touches `gs://` in subprocesses started with `gcs.subprocess_env()`:
the clients read the emulator settings when they make their GCS client,
as a job on a pod reads its environment.
"""

import uuid

import pytest

from realm_jax.testing import gcs_emulator


@pytest.fixture(scope="session")
def gcs():
  with gcs_emulator.GcsEmulator("test-bucket") as emulator:
    yield emulator


@pytest.fixture
def gcs_root(gcs, request):
  """A fresh `gs://` directory in the emulator's bucket, for one test."""
  name = request.node.name.split("[")[0].replace("_", "-")[:40]
  return f"gs://{gcs.bucket}/{name}-{uuid.uuid4().hex[:8]}"

"""`gs://` on a GCS emulator: each client, and publication's commit point.

The emulator (`realm_jax.testing.gcs_emulator`, the `gcs` fixture) speaks
the GCS JSON API with its semantics: no rename, objects replaced whole,
listing by prefix. These tests run realm_jax's own file code, orbax and an
index publication against it in a subprocess; test_gcs_rehearsal.py runs
the jobs themselves (slow).
"""

import json
import os
import subprocess
import sys

import pytest

from realm_jax.testing import gcs_emulator, timeouts

_JOB = os.path.join(os.path.dirname(__file__), "round_trip_job.py")


def test_no_tls_no_rename_and_no_other_host_through_the_proxy(gcs):
  """The proxy answers for the GCS hosts only, and the emulator has GCS's
  object semantics (there is no directory to rename)."""
  import urllib.request  # pylint: disable=g-import-not-at-top
  proxy = gcs.env()["https_proxy"]
  opener = urllib.request.build_opener(urllib.request.ProxyHandler(
      {"https": proxy}))
  with pytest.raises(OSError, match="403"):
    opener.open("https://example.com/", timeout=30)
  assert any(r.startswith("CONNECT example.com") for r in gcs.refused)
  with pytest.raises(RuntimeError, match="not running"):
    gcs_emulator.GcsEmulator().env()


def test_every_client_reaches_the_emulator_and_an_index_publishes(
    gcs, gcs_root):
  done = subprocess.run([sys.executable, _JOB, gcs_root],
                        env=gcs.subprocess_env(), capture_output=True,
                        text=True, timeout=timeouts.HANG_SECONDS, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  assert got["gfile"] == [["b.txt"], "through tf.io.gfile"]
  assert got["epath"] == ["through epath and again", True, ["c.txt"]]
  assert got["orbax"] == [3, [[0, 1, 2], [3, 4, 5]], [0.5] * 4]
  assert got["index"][:2] == [2, [2]]
  # It all landed in the emulator, under the test's prefix.
  prefix = gcs_root[len(f"gs://{gcs.bucket}/"):] + "/"
  objects = gcs.list_objects(prefix)
  names = {n[len(prefix):] for n in objects}
  assert {"gfile/b.txt", "epath/c.txt", "index/LATEST",
          "index/2/manifest.json", "index/2/embeddings.npy"} <= names
  assert "gfile/a.txt" not in names
  assert not any(n.startswith("index/1/") for n in names)  # keep=1
  # The commit point: LATEST was written after every file of the index it
  # names, the manifest after every other file (generations are upload
  # times), so a reader of LATEST never finds a partial index.
  generation = {n[len(prefix):]: int(o["generation"])
                for n, o in objects.items()}
  index_files = {n: g for n, g in generation.items()
                 if n.startswith("index/2/") and not n.endswith("/")}
  assert len(index_files) >= 3
  assert generation["index/LATEST"] > max(index_files.values())
  manifest = index_files.pop("index/2/manifest.json")
  assert manifest > max(index_files.values())
  # orbax's step on GCS: written in place, with its commit marker.
  assert "checkpoints/3/commit_success.txt" in names

"""Two CPU processes on localhost (jax.distributed, 4 devices each) give the
same REALM pre-training losses and the same sharded index as one process
with 8 devices."""

import json
import os
import socket
import subprocess
import sys

import gin
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.index import publish
from realm_jax.testing import corpus, timeouts
from realm_jax.training import pretrain

STEPS = 4


def _bindings(workdir, store, queries):
  return [f"WORKDIR='{workdir}'", f"BLOCK_STORE='{store}'",
          f"QUERIES='{queries}'",
          f"pretrain.PretrainConfig.num_train_steps={STEPS}",
          "pretrain.PretrainConfig.checkpoint_every=2",
          "pretrain.PretrainConfig.reader_length=64"]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.mark.slow  # Minutes (two processes): CI runs it after the suite.
def test_two_processes_match_one(tmp_path):
  store, annotated = corpus.make_tiny_corpus(str(tmp_path / "corpus"))
  # Two shards: each process streams its own one.
  queries = corpus.make_query_cache(annotated, str(tmp_path / "queries"),
                                    num_shards=2, query_length=32)
  single = str(tmp_path / "single")
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"],
                _bindings(single, store, queries))
  pretrain.train(config=gin.get_configurable(pretrain.PretrainConfig)(),
                 model=gin.get_configurable(pretrain.RealmConfig)())
  gin.clear_config()

  multi = str(tmp_path / "multi")
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "realm_jax.testing.multiprocess",
       f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}", "--", *_bindings(multi, store, queries)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outputs = [p.communicate(timeout=timeouts.HANG_SECONDS)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  assert "process 0 of 2 done with 8 devices" in outputs[0]
  assert "process 1 of 2 done with 8 devices" in outputs[1]

  want, got = _losses(single), _losses(multi)
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  for step in want:
    np.testing.assert_allclose(got[step], want[step], rtol=1e-4,
                               err_msg=f"step {step}")
  # Each host embedded half of the blocks; the assembled index is the
  # single-process one.
  steps = publish.published_steps(os.path.join(single, "index"))
  assert steps and steps == publish.published_steps(
      os.path.join(multi, "index"))
  for step in steps:
    a = publish.load_index(os.path.join(single, "index"), step)
    b = publish.load_index(os.path.join(multi, "index"), step)
    assert b.manifest["hosts"] == 2 and a.manifest["hosts"] == 1
    np.testing.assert_allclose(b.embeddings, a.embeddings, atol=1e-5)
  # Only process 0 wrote the run's files, once.
  assert len(_losses(multi)) == STEPS

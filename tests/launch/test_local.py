"""launch/local.sh: the trainer and builder commands (dry run), and a real
run stopped by SIGTERM or by the death of its index builder."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from realm_jax.testing import timeouts


ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_local_launcher_dry_run():
  out = subprocess.run(
      ["bash", os.path.join(ROOT, "launch", "local.sh"), "/tmp/run",
       "/tmp/blocks", "/tmp/queries", "models/minilm_l6.gin", "--",
       "INIT_FROM='minilm'"],
      env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True,
      check=True).stdout.strip().splitlines()
  assert len(out) == 2
  builder, trainer = (shlex.split(line.rstrip(" &")) for line in out)
  assert out[0].endswith("&")  # The builder runs in the background.
  assert builder[1:3] == ["-m", "realm_jax.jobs.index_builder"]
  assert builder[3:] == ["--gin_file=models/minilm_l6.gin",
                         "--gin_file=runs/index_builder.gin",
                         "--gin.WORKDIR='/tmp/run'",
                         "--gin.BLOCK_STORE='/tmp/blocks'"]
  assert trainer[1:3] == ["-m", "realm_jax.jobs.pretrain"]
  assert "--gin.WORKDIR='/tmp/run'" in trainer
  assert "--gin.QUERIES='/tmp/queries'" in trainer
  assert "--gin.pretrain.PretrainConfig.index_mode='builder'" in trainer
  assert "--gin_bindings=INIT_FROM='minilm'" in trainer


def test_local_launcher_usage():
  result = subprocess.run(["bash", os.path.join(ROOT, "launch", "local.sh")],
                          capture_output=True, text=True)
  assert result.returncode == 2 and "Usage" in result.stdout


def _launch(tmp_path, steps=1000, name="run"):
  from realm_jax.testing import corpus  # pylint: disable=g-import-not-at-top
  store, annotated = corpus.make_tiny_corpus(str(tmp_path / "corpus"))
  queries = corpus.make_query_cache(annotated, str(tmp_path / "queries"),
                                    query_length=32)
  workdir = str(tmp_path / name)
  bindings = [f"pretrain.{k}={v}" for k, v in (
      ("PretrainConfig.num_train_steps", steps),
      ("PretrainConfig.batch_size", 8), ("RetrievalConfig.num_candidates", 2),
      ("PretrainConfig.reader_length", 64),
      ("PretrainConfig.checkpoint_every", 2), ("PretrainConfig.log_every", 1),
      ("GateConfig.mode", "'steps'"), ("GateConfig.latest_release", 0),
      ("RecallGuardConfig.queries", "''"),
      ("PretrainConfig.index_wait_seconds", 300.0))]
  proc = subprocess.Popen(
      ["bash", os.path.join(ROOT, "launch", "local.sh"), workdir, store,
       queries, "models/tiny.gin", "--", *bindings],
      env=dict(os.environ, PYTHON=sys.executable), cwd=ROOT,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      start_new_session=True)
  return proc, workdir


def _wait_for_step(workdir, step, proc, timeout=timeouts.HANG_SECONDS):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    if os.path.exists(path):
      with open(path) as f:
        if sum(1 for _ in f) >= step:
          return
    time.sleep(0.5)
  raise AssertionError(f"no step {step} within {timeout} s")


def _children_of(pid):
  out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)],
                       capture_output=True, text=True).stdout
  return [int(x) for x in out.split()]


def test_sigterm_stops_both_cleanly_and_publishes_the_last_index(tmp_path):
  from realm_jax.index import publish  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  proc, workdir = _launch(tmp_path)
  try:
    _wait_for_step(workdir, 3, proc)
    children = _children_of(proc.pid)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, log = proc.communicate(timeout=timeouts.HANG_SECONDS)
    assert proc.returncode == 0, log[-3000:]
    assert time.time() - t0 < timeouts.HANG_SECONDS
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  for pid in children:  # Nothing left running.
    assert not os.path.exists(f"/proc/{pid}") or open(
        f"/proc/{pid}/stat").read().split()[2] == "Z"
  ckpt = checkpoints.TrainCheckpointer(checkpoints.checkpoint_dir(workdir))
  last = ckpt.latest_step()
  assert last is not None and last >= 3
  assert not checkpoints.is_done(checkpoints.checkpoint_dir(workdir))
  # The trainer's last (SIGTERM) checkpoint became the last index.
  assert publish.read_latest(checkpoints.index_root(workdir)) == last


def test_a_dead_builder_ends_the_run_with_its_status(tmp_path):
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  proc, workdir = _launch(tmp_path)
  try:
    _wait_for_step(workdir, 2, proc)
    out = subprocess.run(["pgrep", "-f", "-g", str(proc.pid),
                          "realm_jax.jobs.index_builder"],
                         capture_output=True, text=True).stdout.split()
    assert len(out) == 1, out
    os.kill(int(out[0]), signal.SIGKILL)
    _, log = proc.communicate(timeout=timeouts.HANG_SECONDS)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert proc.returncode == 128 + signal.SIGKILL, log[-3000:]
  assert "index builder exited with status 137" in log
  # The trainer was stopped cleanly: it checkpointed its last step.
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    logged = max(json.loads(line)["step"] for line in f)
  ckpt = checkpoints.TrainCheckpointer(checkpoints.checkpoint_dir(workdir))
  assert ckpt.latest_step() == logged


# How many finished runs `test_a_finished_run_exits_0_every_time` checks
# (issue 49: 2 of 4 exited 143). At that rate 8 runs miss the race with
# probability 0.5**8 = 0.4%; 20 runs (0.0001%) took 9.5 of CI's 28 minutes
# (issue 68). REALM_LAUNCHER_RUNS=20 for a longer check.
RUNS = int(os.environ.get("REALM_LAUNCHER_RUNS", "8"))


@pytest.mark.slow
def test_a_finished_run_exits_0_every_time(tmp_path):
  """A run that trains to the end and publishes its last index exits 0,
  every time: the builder, which sees DONE and exits by itself, is not
  signalled while it exits (it used to be, and died with 143 in 2 of 4
  runs)."""
  from realm_jax.index import publish  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  for i in range(RUNS):
    proc, workdir = _launch(tmp_path, steps=4, name=f"run{i}")
    try:
      _, log = proc.communicate(timeout=900)
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"run {i}: {log[-3000:]}"
    ckpt_dir = checkpoints.checkpoint_dir(workdir)
    assert checkpoints.done_step(ckpt_dir) == 4
    assert publish.read_latest(checkpoints.index_root(workdir)) == 4

"""launch/tpu_pod.py --executor=local: the pod's per-host commands run here.

The fast tests check what the local executor changes in each host's
command line (nothing but the interpreter, the coordinator, the process id
and the CPU devices) and how it supervises hosts (fake ones, no JAX). The
slow one rehearses REALM pre-training on a v5e:4x4 slice as the launcher
starts it: 4 trainer hosts of 2 CPU devices each and the index builder as
its own process, one workdir; it kills one host, checks that the launcher
stops the others and names the dead one, relaunches, and compares every
step's loss with one process of 8 devices.
"""

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import gin
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.core import distributed
from realm_jax.testing import launcher, timeouts

ROOT, TOOL = launcher.ROOT, launcher.TOOL
tpu_pod = launcher.load_tpu_pod()

POD = ["--name=realm-v5e", "--zone=us-west4-a", "--builder_vm=realm-builder",
       "--model_gin=models/tiny.gin", "--topology=v5e:4x4",
       "--skip_aot_check"]


def _flags(workdir, store):
  return [*POD, f"--workdir={workdir}", f"--block_store={store}"]


def _remote_job(cmd):
  """(env, argv after python) of the job a gcloud ssh --command starts."""
  script = next(a for a in cmd if a.startswith("--command="))
  words = shlex.split(script[len("--command="):])
  i = words.index("nohup")
  j = next(k for k in range(i + 2, len(words))
           if words[k].endswith("/.venv/bin/python"))
  return words[i + 2:j], words[j + 1:words.index(">>", j)]


def test_topology_hosts_as_the_compiler_counts_them():
  for name, hosts in (("v5e:4x4", 4), ("v5e:2x2", 1), ("v5e:8x8", 16),
                      ("v4:2x2x1", 1), ("v4:2x2x2", 2), ("v4:4x4x4", 16),
                      ("v5p:2x2x4", 4)):
    assert tpu_pod.topology_hosts(name) == hosts, name
  with pytest.raises(tpu_pod.UsageError, match="--topology='v5litepod-16' "
                     "is not a TPU topology name"):
    tpu_pod.topology_hosts("v5litepod-16")


def test_local_hosts_run_the_pods_commands(capsys):
  """Each local host runs the command line the pod's host would, with only
  the local settings added after the pod's environment."""
  argv = ["train", *_flags("/tmp/run", "/tmp/blocks"),
          "--queries=/tmp/queries",
          "--gin_file=experiments/pretrain_tiny_cpu.gin",
          "--gin=pretrain.PretrainConfig.batch_size=8",
          "--env=XLA_FLAGS=--xla_cpu_enable_fast_math=false"]
  assert tpu_pod.main([*argv, "--dry_run"]) == 0
  (ssh,) = [shlex.split(l) for l in capsys.readouterr().out.splitlines()]
  pod_env, pod_argv = _remote_job(ssh)
  assert tpu_pod.main([*argv, "--executor=local", "--dry_run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 4  # v5e:4x4: 4 hosts of 4 chips.
  ports = set()
  for i, line in enumerate(lines):
    words = shlex.split(line)
    assert words[0] == "env"
    k = words.index(sys.executable)
    assert words[k + 1:] == pod_argv  # The pod's job, flag for flag.
    env = words[1:k]
    assert env[:len(pod_env)] == pod_env  # Then only what differs here:
    local = dict(e.split("=", 1) for e in env[len(pod_env):])
    assert local.pop(distributed.ENV_PROCESS_ID) == str(i)
    assert local.pop(distributed.ENV_NUM_PROCESSES) == "4"
    address = local.pop(distributed.ENV_COORDINATOR_ADDRESS)
    assert address.startswith("127.0.0.1:")
    ports.add(address)
    assert local == {
        "JAX_ENABLE_COMPILATION_CACHE": "false",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_cpu_enable_fast_math=false "
                     "--xla_force_host_platform_device_count=2"}
  assert len(ports) == 1  # One coordinator.
  # The env names the launcher sets are the ones the jobs read.
  assert (tpu_pod.ENV_COORDINATOR_ADDRESS, tpu_pod.ENV_NUM_PROCESSES,
          tpu_pod.ENV_PROCESS_ID) == (distributed.ENV_COORDINATOR_ADDRESS,
                                      distributed.ENV_NUM_PROCESSES,
                                      distributed.ENV_PROCESS_ID)

  # The builder: one host, no coordinator.
  builder = ["builder", *_flags("/tmp/run", "/tmp/blocks"),
             "--builder_gin=builder.IndexBuildConfig.searcher='exact'"]
  assert tpu_pod.main([*builder, "--dry_run"]) == 0
  pod_env, pod_argv = _remote_job(shlex.split(capsys.readouterr().out))
  assert tpu_pod.main([*builder, "--executor=local", "--local_devices=1",
                       "--dry_run"]) == 0
  (words,) = [shlex.split(l) for l in capsys.readouterr().out.splitlines()]
  k = words.index(sys.executable)
  assert words[k + 1:] == pod_argv
  assert words[1:k] == [*pod_env, "JAX_PLATFORMS=cpu", "XLA_FLAGS=" + " ".join(
      [f for f in os.environ.get("XLA_FLAGS", "").split()
       if "device_count" not in f]
      + ["--xla_force_host_platform_device_count=1"])]


@pytest.mark.parametrize("argv, message", [
    (["logs", *POD], "logs acts on the pod"),
    (["train", *[f for f in POD if not f.startswith("--topology")],
      "--workdir=/w", "--block_store=/b", "--queries=/q",
      "--gin_file=experiments/pretrain_tiny_cpu.gin"], "pass --topology"),
    (["builder", *POD, "--workdir=/w", "--block_store=/b",
      "--builder_worker=all"], "not rehearsed locally"),
    (["train", *POD, "--local_devices=0"], "at least 1 CPU device"),
])
def test_local_usage_errors(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    tpu_pod.main([*argv, "--executor=local", "--dry_run"])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def _fake_hosts(tmp_path, scripts):
  return [tpu_pod.LocalHost(f"worker {i} (process {i} of {len(scripts)})",
                            (sys.executable, "-c", script),
                            str(tmp_path / f"worker{i}" / "job.log"))
          for i, script in enumerate(scripts)]


def test_executor_stops_the_others_when_a_host_dies(tmp_path):
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()
  ignores_sigterm = ("import signal, time; signal.signal(signal.SIGTERM, "
                     "signal.SIG_IGN); print('up', flush=True); "
                     "time.sleep(600)")
  # Dies once the host that ignores SIGTERM is up.
  dies = ("import os, pathlib, time\n"
          f"log = pathlib.Path({str(tmp_path / 'worker1' / 'job.log')!r})\n"
          "while 'up' not in log.read_text():\n"
          "  time.sleep(0.05)\n"
          "os.kill(os.getpid(), 9)\n")
  out = io.StringIO()
  executor = tpu_pod.LocalExecutor(
      _fake_hosts(tmp_path, ["import time; time.sleep(600)", ignores_sigterm,
                             dies]),
      workdir=str(tmp_path), stop_seconds=1, out=out)
  t = time.monotonic()
  assert executor.run() == 128 + signal.SIGKILL
  assert time.monotonic() - t < 30
  text = out.getvalue()
  assert ("worker 2 (process 2 of 3) died with signal 9 (SIGKILL); stopped "
          "the other 2 hosts; relaunch the same command to resume from step "
          "4.") in text
  assert str(tmp_path / "worker2" / "job.log") in text
  assert "up" in (tmp_path / "worker1" / "job.log").read_text()


def test_a_host_that_exited_first_is_named_not_counted_stopped(tmp_path):
  out = io.StringIO()
  executor = tpu_pod.LocalExecutor(
      _fake_hosts(tmp_path, ["pass", "import time; time.sleep(600)",
                             "import os, time; time.sleep(3); "
                             "os.kill(os.getpid(), 9)"]),
      workdir=str(tmp_path), stop_seconds=1, out=out)
  assert executor.run() == 128 + signal.SIGKILL
  assert ("worker 2 (process 2 of 3) died with signal 9 (SIGKILL); stopped "
          "the other 1 host (already exited: worker 0 (process 0 of 3), exit "
          "status 0); relaunch") in out.getvalue(), out.getvalue()


def test_executor_exit_statuses(tmp_path):
  out = io.StringIO()
  ok = tpu_pod.LocalExecutor(_fake_hosts(tmp_path, ["pass", "pass"]),
                             workdir=None, out=out)
  assert ok.run() == 0 and "all 2 hosts finished" in out.getvalue()
  failed = tpu_pod.LocalExecutor(
      _fake_hosts(tmp_path, ["import sys; sys.exit(3)"]), workdir=None,
      out=out)
  assert failed.run() == 3
  assert ("worker 0 (process 0 of 1) died with exit status 3; no other host "
          "was running; relaunch the same command to resume from the newest "
          "checkpoint, if any.") in out.getvalue()


# ----------------------------------------------------------------------------
# Four hosts, as the pod starts them
# ----------------------------------------------------------------------------

STEPS = 6


def _bindings(*, single=None):
  """The run's gin bindings; the retriever is frozen, so every index the
  builder publishes is the step-0 one and the losses do not depend on when
  the trainer swaps one in."""
  bindings = [f"pretrain.PretrainConfig.num_train_steps={STEPS}",
              "pretrain.PretrainConfig.checkpoint_every=2",
              "pretrain.PretrainConfig.reader_length=64",
              "pretrain.RetrieverScheduleConfig.learning_rate_multiplier=0.0"]
  if single:
    bindings += [f"WORKDIR='{single[0]}'", f"BLOCK_STORE='{single[1]}'",
                 f"QUERIES='{single[2]}'"]
  return bindings


def _losses(workdir):
  """Each step's loss, the last logged (a relaunch logs again the steps
  after the checkpoint it resumes from)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _launch(subcommand, workdir, store, queries, extra=()):
  argv = [sys.executable, TOOL, subcommand, *_flags(workdir, store),
          "--executor=local", *extra]
  if subcommand == "train":
    argv += [f"--queries={queries}",
             "--gin_file=experiments/pretrain_tiny_cpu.gin",
             *[f"--gin={b}" for b in _bindings()]]
  return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True,
                          start_new_session=True)


class _Stderr:
  """A launcher's stderr, read as it comes (a thread keeps the pipe empty)."""

  def __init__(self, proc):
    self.lines, self._proc = [], proc
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self):
    for line in self._proc.stderr:
      self.lines.append(line)

  def text(self):
    return "".join(self.lines)

  def pids(self):
    """Host name -> pid, of every host the launcher started."""
    return {m[1]: int(m[2]) for m in re.finditer(
        r"tpu_pod.py: (.+) started: pid (\d+)", self.text())}

  def wait(self, timeout=timeouts.HANG_SECONDS):
    self._proc.wait(timeout=timeout)
    self._thread.join(timeout=60)
    return self._proc.returncode


def _wait(condition, proc, what):
  deadline = time.monotonic() + timeouts.HANG_SECONDS
  while not condition():
    assert proc.poll() is None, f"the launcher ended before {what}"
    assert time.monotonic() < deadline, f"no {what}"
    time.sleep(0.2)


@pytest.mark.slow  # ~6 min on 2 loaded cores: 4 hosts and a builder, twice.
def test_four_hosts_as_the_pod_starts_them(tmp_path):
  from realm_jax.testing import corpus  # pylint: disable=g-import-not-at-top
  from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
  store, annotated = corpus.make_tiny_corpus(str(tmp_path / "corpus"))
  # Four shards: each host streams its own one.
  queries = corpus.make_query_cache(annotated, str(tmp_path / "queries"),
                                    num_shards=4, query_length=32)
  # The reference: one process, 8 devices (this one), the index inline.
  single = str(tmp_path / "single")
  gin.clear_config()
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"],
                _bindings(single=(single, store, queries)))
  pretrain.train(config=gin.get_configurable(pretrain.PretrainConfig)(),
                 model=gin.get_configurable(pretrain.RealmConfig)())
  gin.clear_config()
  want = _losses(single)
  assert sorted(want) == list(range(1, STEPS + 1))

  workdir = str(tmp_path / "pod")
  procs, launchers = [], []
  try:
    builder = _launch("builder", workdir, store, queries,
                      ["--builder_gin=builder.IndexBuildConfig.searcher="
                       "'exact'"])
    procs.append(builder)
    builder_err = _Stderr(builder)
    launchers.append(builder_err)
    train = _launch("train", workdir, store, queries)
    procs.append(train)
    err = _Stderr(train)
    launchers.append(err)
    _wait(lambda: len(err.pids()) == 4, train, "4 hosts")
    pids = {int(name.split()[1]): pid for name, pid in err.pids().items()}
    metrics = os.path.join(workdir, "metrics.jsonl")
    _wait(lambda: os.path.exists(metrics) and os.path.isdir(
        os.path.join(workdir, "checkpoints", "2")) and max(_losses(workdir))
          >= 3, train, "step 3")
    os.kill(pids[2], signal.SIGKILL)
    t = time.monotonic()
    assert err.wait() == 128 + signal.SIGKILL, err.text()[-3000:]
    stopped_in = time.monotonic() - t
    assert stopped_in < 60, stopped_in  # FAILED_RUN_STOP_SECONDS + polls.
    for pid in pids.values():  # No host left running.
      assert not os.path.exists(f"/proc/{pid}") or open(
          f"/proc/{pid}/stat").read().split()[2] == "Z"
    # A peer's collectives may see the dead host and exit first: the
    # launcher names those, and stops the rest.
    match = re.search(
        r"worker 2 \(process 2 of 4\) died with signal 9 \(SIGKILL\); "
        r"(?:stopped the other (\d) hosts?|no other host was running)"
        r"(?: \(already exited: (.*?)\))?; relaunch the same command to "
        r"resume from step (\d+)\.", err.text())
    assert match, err.text()[-3000:]
    exited = match[2].count("worker") if match[2] else 0
    assert int(match[1] or 0) + exited == 3, match[0]
    resume = int(match[3])
    assert 2 <= resume < STEPS
    logged = max(_losses(workdir))

    # The same launch again: resumes there and trains to the end.
    train = _launch("train", workdir, store, queries)
    procs.append(train)
    err = _Stderr(train)
    launchers.append(err)
    assert err.wait() == 0, err.text()[-3000:]
    assert "all 4 hosts finished" in err.text()
    assert builder_err.wait() == 0, builder_err.text()[-3000:]
  finally:
    # The hosts run in sessions of their own: a failed test kills them too.
    for pid in [p for l in launchers for p in l.pids().values()] + [
        p.pid for p in procs]:
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          cmdline = f.read()
        if b"realm_jax" in cmdline or b"tpu_pod.py" in cmdline:  # Ours.
          os.kill(pid, signal.SIGKILL)
      except (FileNotFoundError, ProcessLookupError):
        pass
  logs = os.path.join(workdir, "logs")
  for i in range(4):
    with open(os.path.join(logs, f"worker{i}", "pretrain.log")) as f:
      log = f.read()
    assert f"process {i} of 4, 2 local of 8 devices" in log
    assert f"resumed from {os.path.join(workdir, 'checkpoints')} step " \
           f"{resume}" in log, log[-3000:]
  got = _losses(workdir)
  assert sorted(got) == list(range(1, STEPS + 1)), (got, logged)
  for step in want:
    np.testing.assert_allclose(got[step], want[step], rtol=1e-4,
                               err_msg=f"step {step}")
  print(f"stopped {stopped_in:.1f} s after the kill; resumed from step "
        f"{resume} (step {logged} was logged)")

"""The shared training loop's progress: step N/TOTAL, steps/s and the ETA."""

import itertools
import json
import logging
import os
import re
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from realm_jax.core import checkpoints, parallel
from realm_jax.model.realm import RealmConfig
from realm_jax.testing import timeouts
from realm_jax.training import loop


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (12.4, "12s"), (59.6, "1m00s"), (245, "4m05s"),
    (3600, "1h00m"), (3720, "1h02m"), (90061, "25h01m")])
def test_format_eta(seconds, text):
  assert loop.format_eta(seconds) == text


def test_progress_arithmetic():
  # 4 steps in 10 s, at step 6 of 106: 2.5 s/step, 100 steps to go.
  p = loop.progress(4, 10.0, 6, 106, batch_size=32)
  assert p == pytest.approx(dict(
      seconds_per_step=2.5, steps_per_sec=0.4, examples_per_second=12.8,
      eta_seconds=250.0))


def _linear_loss(params, batch, dropout_rng):
  del dropout_rng
  error = batch["x"] @ params["w"] - batch["y"]
  return jnp.sum(error ** 2), jnp.sum(jnp.ones_like(error)), {}


def test_log_line_and_metrics_carry_progress(tmp_path, monkeypatch):
  config = loop.TrainConfig(
      workdir=str(tmp_path / "run"), block_store="", num_train_steps=6,
      batch_size=8, learning_rate=0.1, warmup_steps=0, log_every=2,
      checkpoint_every=3)
  lines = []
  real_info = loop.logging.info

  def info(msg, *args, **kwargs):
    if isinstance(msg, str) and msg.startswith("step "):
      lines.append(msg % args)
    real_info(msg, *args, **kwargs)

  monkeypatch.setattr(loop.logging, "info", info)
  # The injected clock advances 1000 s per reading: one reading at the
  # start and one per logged step, so 2 steps take 1000 s (500 s/step).
  clock = itertools.count(0.0, 1000.0).__next__
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 3)).astype(np.float32),
           "y": rng.normal(size=(8,)).astype(np.float32)}
  with loop.Run(config, RealmConfig(), job="test trainer") as run:
    tx = optax.sgd(0.1)
    fresh = {"retriever": {"w": np.zeros(3, np.float32)},
             "reader": {"b": np.ones(2, np.float32)}}
    state, params, _ = run.init_or_restore(
        fresh, tx, lambda: fresh, trained=lambda p: p["retriever"])
    history = run.loop(
        state, loop.make_train_step(_linear_loss, tx, run.mesh),
        lambda step, _: parallel.shard_batch(run.mesh, batch), meta={},
        saved_params=lambda s: dict(params, retriever=s.params), clock=clock)

  assert len(lines) == 3  # Exactly one line per logged step.
  for line, step, eta in zip(lines, (2, 4, 6), ("33m20s", "16m40s", "0s")):
    assert line.startswith(f"step {step}/6: loss "), line
    assert line.endswith(", 500.000 s/step, 0.00 steps/s, 0.0 examples/s, "
                         f"eta {eta}"), line
  assert [h["eta_seconds"] for h in history] == [2000.0, 1000.0, 0.0]
  assert [h["steps_per_sec"] for h in history] == [0.002] * 3
  assert [h["examples_per_second"] for h in history] == [0.016] * 3
  logged = [json.loads(line) for line in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [m["eta_seconds"] for m in logged] == [2000.0, 1000.0, 0.0]
  # The loss the log line shows is the trained one: it goes down.
  losses = [h["loss"] for h in history]
  assert losses[0] > losses[1] > losses[2]


def _run(workdir, steps, *, checkpoint_every=2, log_every=1,
         hooks=loop.Hooks(), stop_after=None):
  """Trains the linear model of `_linear_loss`; returns this call's history.

  Deterministic: a resumed run logs the metrics an uninterrupted one does.
  """
  config = loop.TrainConfig(
      workdir=str(workdir), block_store="", num_train_steps=steps,
      batch_size=8, learning_rate=0.1, warmup_steps=0, log_every=log_every,
      checkpoint_every=checkpoint_every)
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 3)).astype(np.float32),
           "y": rng.normal(size=(8,)).astype(np.float32)}
  with loop.Run(config, RealmConfig(), job="test trainer") as run:
    tx = optax.sgd(0.1)
    fresh = {"retriever": {"w": np.zeros(3, np.float32)},
             "reader": {"b": np.ones(2, np.float32)}}
    state, params, _ = run.init_or_restore(
        fresh, tx, lambda: fresh, trained=lambda p: p["retriever"])
    return run.loop(
        state, loop.make_train_step(_linear_loss, tx, run.mesh),
        lambda step, _: parallel.shard_batch(run.mesh, batch), meta={},
        saved_params=lambda s: dict(params, retriever=s.params),
        hooks=hooks, stop_after=stop_after)


def _logged(workdir):
  return [json.loads(line) for line in
          (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_logs_each_step_once(tmp_path):
  """kill -9 after step 5 (checkpoint 4, steps 1-5 logged, no history.json):
  the resumed run drops step 5's line, logs 5-6 again, and history.json
  covers the whole run."""
  workdir = tmp_path / "run"
  want = _run(tmp_path / "reference", 6)
  _run(workdir, 6, stop_after=5)
  ckpt_dir = workdir / "checkpoints"
  assert checkpoints.finalized_steps(ckpt_dir) == [2, 4, 5]
  # What kill -9 after step 5's log line, before its checkpoint, leaves.
  os.rename(ckpt_dir / "5", tmp_path / "5")
  os.remove(workdir / "history.json")
  assert [m["step"] for m in _logged(workdir)] == [1, 2, 3, 4, 5]
  _run(workdir, 6)
  assert [m["step"] for m in _logged(workdir)] == [1, 2, 3, 4, 5, 6]
  history = json.loads((workdir / "history.json").read_text())
  assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([h["loss"] for h in history],
                             [h["loss"] for h in want], rtol=1e-6)


def test_an_extended_run_clears_done_before_its_first_step(tmp_path):
  workdir = tmp_path / "run"
  ckpt_dir = workdir / "checkpoints"
  _run(workdir, 4)
  assert checkpoints.done_step(ckpt_dir) == 4
  seen = []
  _run(workdir, 6, hooks=loop.Hooks(before_step=lambda step: seen.append(
      (step, checkpoints.is_done(ckpt_dir)))))
  assert seen == [(4, False), (5, False)]
  assert checkpoints.done_step(ckpt_dir) == 6


@pytest.mark.parametrize("damage", ["truncated array", "empty meta"])
def test_resume_falls_back_past_a_broken_checkpoint(tmp_path, caplog,
                                                    damage):
  workdir = tmp_path / "run"
  _run(workdir, 4)
  ckpt_dir = workdir / "checkpoints"
  if damage == "empty meta":
    (ckpt_dir / "4" / "meta" / "metadata").write_text("")
  else:
    # TensorStore's data files (the process's and the merged ones).
    for f in (ckpt_dir / "4" / "retriever").rglob("*"):
      if f.parent.name == "d":
        os.truncate(f, 10)
  with caplog.at_level(logging.WARNING):
    history = _run(workdir, 6)
  # Resumed from 2, not 4; warned naming 4; 4 moved aside, not deleted.
  assert [h["step"] for h in history] == [3, 4, 5, 6]
  assert re.search(rf"{ckpt_dir / '4'} does not restore", caplog.text)
  aside = [p.name for p in ckpt_dir.iterdir() if "unrestorable" in p.name]
  assert len(aside) == 1 and aside[0].startswith("4.unrestorable-")
  assert checkpoints.finalized_steps(ckpt_dir)[-1] == 6


def test_no_checkpoint_restores_names_them_all_moves_none(tmp_path):
  workdir = tmp_path / "run"
  _run(workdir, 4)
  ckpt_dir = workdir / "checkpoints"
  for step in (2, 4):
    (ckpt_dir / str(step) / "meta" / "metadata").write_text("")
  with pytest.raises(checkpoints.CheckpointRestoreError) as e:
    _run(workdir, 6)
  for step in (2, 4):
    assert f"{ckpt_dir / str(step)}: JSONDecodeError" in str(e.value)
  assert sorted(p.name for p in ckpt_dir.iterdir()
                if p.name.isdigit()) == ["2", "4"]


_DAMAGED_RESUME = """
import os, sys
import jax
import numpy as np
from realm_jax.core import checkpoints

directory = sys.argv[1]
rng = np.random.default_rng(0)
# A reader of 32 arrays in several TensorStore data files: a restore fails
# on the damaged files while the largest one's reads are still in flight.
params = {"retriever": {"w": np.ones(8, np.float32)},
          "reader": {f"w{i}": rng.standard_normal(500_000, dtype=np.float32)
                     for i in range(32)}}
opt_state = {"count": np.zeros((), np.int32)}
saver = checkpoints.TrainCheckpointer(directory, async_save=False)
for step in (2, 4):
  saver.save(step, params, opt_state, force=True)
saver.close()


def damage(step):
  data = os.path.join(directory, str(step), "reader", "ocdbt.process_0", "d")
  files = sorted((os.path.join(data, f) for f in os.listdir(data)),
                 key=os.path.getsize)
  for path in files[:-1]:
    os.truncate(path, 10)


device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
abstract = lambda tree: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
damage(4)
resumed = checkpoints.TrainCheckpointer(directory).restore_newest(
    abstract(params), abstract(opt_state))
print("resumed from", resumed[0], flush=True)
damage(2)
checkpoints.TrainCheckpointer(directory).restore_newest(
    abstract(params), abstract(opt_state))
"""


def test_a_damaged_checkpoint_is_reported_once_on_stderr(tmp_path):
  """The trainer's resume past a damaged checkpoint, and its failure when
  none restores, in a process of its own: stderr holds the warning, then
  the one error, and none of the dozens of `Event loop is closed` and
  `Exception ignored in <coroutine ...>` tracebacks that orbax's closed
  event loop gave for the reads still in flight (38 to 56 of them with
  this checkpoint), nor TensorStore's spec dumps."""
  directory = tmp_path / "checkpoints"
  done = subprocess.run(
      [sys.executable, "-c", _DAMAGED_RESUME, str(directory)],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS)
  assert done.returncode == 1, done.stderr[-3000:]
  assert done.stdout.strip() == "resumed from 2"
  assert f"checkpoint {directory / '4'} does not restore (" in done.stderr
  assert (f"CheckpointRestoreError: No checkpoint under {directory} "
          f"restores: {directory / '2'}: Exception: Encountered error while "
          "reading array index") in done.stderr, done.stderr[-3000:]
  for noise in ("Event loop is closed", "Exception ignored",
                "TensorStore(", "Task was destroyed"):
    assert noise not in done.stderr, done.stderr[-3000:]
  assert done.stderr.count("Traceback") == 1, done.stderr[-3000:]


_FAILING_SAVE = """
import os, sys, time
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]
import test_loop
from realm_jax.core import checkpoints
from realm_jax.training import loop

checkpoints.EXIT_GRACE_SECONDS = 2.0
workdir = sys.argv[1]


def break_the_checkpoint_directory(step):
  # Orbax's next write (its temporary step directory) fails, in its
  # background threads, as on a directory turned immutable. Only once
  # checkpoint 3 is in place: a save in flight fails in another way.
  if step == 3:
    path = os.path.join(workdir, "checkpoints")
    while 3 not in checkpoints.finalized_steps(path):
      time.sleep(0.05)
    time.sleep(0.2)
    os.rename(path, path + ".moved")
    open(path, "w").close()


test_loop._run(workdir, 8, checkpoint_every=1, hooks=loop.Hooks(
    before_step=break_the_checkpoint_directory))
"""


def test_a_failed_checkpoint_save_ends_the_trainer(tmp_path):
  """The save fails in orbax's background threads, which then wait for
  ever for signals that never come: the trainer must still exit, non-zero,
  naming the path (a hang fails this test by its timeout)."""
  workdir = tmp_path / "run"
  t0 = time.time()
  done = subprocess.run(
      [sys.executable, "-c", _FAILING_SAVE, str(workdir),
       os.path.dirname(__file__)],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS)
  assert done.returncode != 0, done.stderr[-3000:]
  assert time.time() - t0 < timeouts.HANG_SECONDS
  assert (f"CheckpointSaveError: Saving a checkpoint to "
          f"{workdir / 'checkpoints'} failed" in done.stderr), (
              done.stderr[-3000:])
  assert "Not a directory" in done.stderr


def test_without_tensorflow_the_metrics_go_to_the_log(tmp_path, monkeypatch,
                                                      caplog):
  """clu's TensorBoard writer needs TensorFlow; a host without it (an
  accelerator host, say) gets a logging writer and says so once."""
  find_spec = loop.importlib.util.find_spec
  monkeypatch.setattr(
      loop.importlib.util, "find_spec",
      lambda name, *a: None if name == "tensorflow" else find_spec(name, *a))
  with caplog.at_level(logging.INFO):
    writer = loop.start_run(str(tmp_path / "run"), "", is_chief=True)
    writer.write_scalars(7, {"loss": np.float32(2.5), "hubness": 0.125})
    writer.flush()
    writer.close()
  assert isinstance(writer, loop.LoggingWriter)
  assert "no TensorBoard summaries" in caplog.text
  assert "[7] hubness=0.125, loss=2.5" in caplog.text
  assert not (tmp_path / "run" / "summaries").exists()

"""The shared training loop's progress: step N/TOTAL, steps/s and the ETA."""

import itertools
import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from realm_jax.core import parallel
from realm_jax.model.realm import RealmConfig
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

"""The product path with a `gs://` workdir, on the GCS emulator (slow).

Each job runs as `python -m ...` in a subprocess whose environment points
every client at the emulator (`GcsEmulator.subprocess_env()`): tiny REALM
pre-training with the index builder beside it (index swaps), fine-tuning
from its checkpoint against its index, evaluation, export, and
`realm_jax.load` of the run and of the export; then a trainer killed with
SIGKILL while it writes a checkpoint, and its resume, which repeats the
losses of an uninterrupted run exactly. The inputs (block store, query
cache, QA file) stay local; everything the jobs write is on `gs://`. The
test reads the bucket through the emulator's own API, never through the
clients under test.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from realm_jax.testing import corpus, timeouts

pytestmark = pytest.mark.slow  # Minutes of training: CI's slow tier.

QA = [("Where was Mozart born?", ["Salzburg"]),
      ("What is the capital of France?", ["Paris"]),
      ("When was the Eiffel Tower built?", ["1889"]),
      ("What is the capital of Japan?", ["Tokyo"]),
      ("When did the Berlin Wall fall?", ["1989"]),
      ("Where was Albert Einstein born?", ["Ulm"]),
      ("Which city lies on the Nile?", ["Cairo"]),
      ("When did Shakespeare die?", ["1616"])]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  directory = tmp_path_factory.mktemp("gcs_inputs")
  store, annotated = corpus.make_tiny_corpus(str(directory))
  queries = corpus.make_query_cache(annotated, str(directory / "queries"),
                                    query_length=32)
  qa = directory / "qa.jsonl"
  qa.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                        for q, a in QA))
  return {"store": store, "queries": queries, "qa": str(qa)}


def _pretrain(gcs, workdir, inputs, **overrides):
  values = {"num_train_steps": 8, "checkpoint_every": 2, "reader_length": 64,
            **overrides}
  return subprocess.Popen(
      [sys.executable, "-m", "realm_jax.jobs.pretrain",
       "--gin_file=experiments/pretrain_tiny_cpu.gin",
       f"--gin.WORKDIR='{workdir}'", f"--gin.BLOCK_STORE='{inputs['store']}'",
       f"--gin.QUERIES='{inputs['queries']}'"] + [
           f"--gin.pretrain.PretrainConfig.{k}={v!r}"
           for k, v in values.items()],
      env=gcs.subprocess_env(), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def _run(gcs, args, what):
  done = subprocess.run([sys.executable, *args], env=gcs.subprocess_env(),
                        capture_output=True, text=True, check=False,
                        timeout=timeouts.HANG_SECONDS)
  assert done.returncode == 0, f"{what}: {done.stderr[-4000:]}"
  return done.stdout


def _records(gcs, workdir):
  """{step: metrics record} of a run's metrics.jsonl (a step's last)."""
  text = gcs.read(f"{workdir}/metrics.jsonl")
  assert text is not None, f"{workdir}/metrics.jsonl was never written"
  return {r["step"]: r for r in map(json.loads, text.decode().splitlines())}


def _check_latest_complete(gcs, index_root, seen):
  """What LATEST names now is a complete index (its manifest is there)."""
  latest = gcs.read(f"{index_root}/LATEST")
  if latest is not None:
    name = latest.decode().strip()
    assert f"{index_root}/{name}/manifest.json".removeprefix(
        f"gs://{gcs.bucket}/") in gcs.list_objects(f"{index_root}/{name}/"), (
            f"LATEST names {name}, which has no manifest yet")
    seen.add(name)


def test_pretrain_with_builder_finetune_eval_export_load(gcs, gcs_root,
                                                         inputs):
  timings = {}
  run, index_root = f"{gcs_root}/run", f"{gcs_root}/run/index"
  start = time.time()
  trainer = _pretrain(gcs, run, inputs, num_train_steps=12,
                      index_mode="builder", keep_checkpoints=5,
                      index_wait_seconds=timeouts.HANG_SECONDS, log_every=1)
  builder = subprocess.Popen(
      [sys.executable, "-m", "realm_jax.jobs.index_builder",
       "--gin_file=models/tiny.gin", "--gin_file=runs/index_builder.gin",
       f"--gin.WORKDIR='{run}'", f"--gin.BLOCK_STORE='{inputs['store']}'",
       "--gin.builder.IndexBuildConfig.searcher='exact'",
       "--gin.builder.BuilderConfig.poll_seconds=0.2",
       f"--gin.builder.BuilderConfig.timeout_seconds={timeouts.HANG_SECONDS}"],
      env=gcs.subprocess_env(), stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)
  seen = set()
  try:
    # A reader of LATEST, all along: never an incomplete index.
    while trainer.poll() is None and time.time() - start < (
        timeouts.HANG_SECONDS):
      _check_latest_complete(gcs, index_root, seen)
      time.sleep(0.1)
    _, trainer_log = trainer.communicate(timeout=timeouts.HANG_SECONDS)
    if trainer.returncode:  # The builder would wait for it in vain.
      builder.kill()
    _, builder_log = builder.communicate(timeout=timeouts.HANG_SECONDS)
  finally:
    for p in (trainer, builder):
      if p.poll() is None:
        p.kill()
        p.wait()
  timings["pretrain + builder"] = time.time() - start
  assert trainer.returncode == 0, trainer_log[-4000:]
  assert builder.returncode == 0, builder_log[-4000:]
  records = _records(gcs, run)
  assert sorted(records) == list(range(1, 13))
  index_steps = [records[s]["index_step"] for s in sorted(records)]
  assert len(set(index_steps)) >= 2, index_steps  # Swapped at least once.
  assert index_steps == sorted(index_steps)
  assert "Index watcher: now serving index" in trainer_log
  assert len(seen) >= 2, seen
  assert gcs.read(f"{run}/checkpoints/12/commit_success.txt") is not None

  # Fine-tuning from the pre-training checkpoint, against its index.
  start = time.time()
  ft = f"{gcs_root}/finetune"
  _run(gcs, ["-m", "realm_jax.jobs.finetune",
             "--gin_file=experiments/finetune_tiny_cpu.gin",
             f"--gin.WORKDIR='{ft}'", f"--gin.BLOCK_STORE='{inputs['store']}'",
             f"--gin.TRAIN_JSONL='{inputs['qa']}'",
             f"--gin.INDEX_DIR='{index_root}'",
             f"--gin.INIT_FROM='checkpoint:{run}/checkpoints'",
             "--gin.finetune.FinetuneConfig.num_train_steps=4",
             "--gin.finetune.FinetuneConfig.checkpoint_every=2"], "finetune")
  timings["finetune"] = time.time() - start
  assert sorted(_records(gcs, ft)) == [1, 2, 3, 4]

  # Evaluation of its checkpoint, results on gs://.
  start = time.time()
  out = _run(gcs, ["-m", "realm_jax.jobs.qa_eval",
                   "--gin_file=experiments/eval_tiny_cpu.gin",
                   f"--gin.WORKDIR='{ft}'",
                   f"--gin.BLOCK_STORE='{inputs['store']}'",
                   f"--gin.QA_FILE='{inputs['qa']}'",
                   f"--gin.INDEX_DIR='{index_root}'",
                   "--gin.EvalConfig.step=4"], "eval")
  timings["eval"] = time.time() - start
  printed = json.loads(out.strip().splitlines()[-1])
  assert printed["step"] == 4 and printed["num_examples"] == len(QA)
  assert gcs.read(f"{ft}/eval/eval_ledger.json") is not None

  # Export to gs://, then realm_jax.load of the run and of the export.
  start = time.time()
  export = f"{gcs_root}/export"
  _run(gcs, ["-m", "realm_jax.jobs.export", "--gin_file=runs/export.gin",
             f"--gin.WORKDIR='{ft}'", f"--gin.OUTPUT_DIR='{export}'"],
       "export")
  timings["export"] = time.time() - start
  assert gcs.read(f"{export}/realm_config.json") is not None
  assert not gcs.list_objects(f"{export}.tmp-export")
  start = time.time()
  out = _run(gcs, ["-c", (
      "import json, realm_jax\n"
      f"a = realm_jax.load({ft!r})\n"
      f"b = realm_jax.load({export!r}, block_store={inputs['store']!r}, "
      f"index_dir={index_root!r})\n"
      "q = 'What is the capital of France?'\n"
      "print(json.dumps([a.ask(q).prediction, b.ask(q).prediction]))")],
           "realm_jax.load")
  timings["load"] = time.time() - start
  from_run, from_export = json.loads(out.strip().splitlines()[-1])
  assert from_run == from_export
  print("timings (s):", {k: round(v, 1) for k, v in timings.items()})


def _kill_during_checkpoint(gcs, proc, checkpoint):
  """SIGKILLs `proc` as soon as the first object of `checkpoint` (a step
  directory) is in the bucket; returns whether its commit marker was
  missing then (the kill landed mid-write)."""
  prefix = checkpoint.removeprefix(f"gs://{gcs.bucket}/") + "/"
  deadline = time.time() + timeouts.HANG_SECONDS
  try:
    while time.time() < deadline and proc.poll() is None:
      objects = gcs.list_objects(prefix)
      if any(not n.endswith("/") for n in objects):
        break
      time.sleep(0.02)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
  return prefix + "commit_success.txt" not in gcs.list_objects(prefix)


def test_kill_9_during_a_checkpoint_write_then_resume_on_gcs(gcs, gcs_root,
                                                             inputs):
  timings = {}
  start = time.time()
  reference = _pretrain(gcs, f"{gcs_root}/reference", inputs)
  _, log = reference.communicate(timeout=timeouts.HANG_SECONDS)
  assert reference.returncode == 0, log[-4000:]
  timings["uninterrupted"] = time.time() - start
  want = _records(gcs, f"{gcs_root}/reference")

  start = time.time()
  run = f"{gcs_root}/run"
  killed = _pretrain(gcs, run, inputs)
  assert _kill_during_checkpoint(gcs, killed, f"{run}/checkpoints/4"), (
      "the kill came after checkpoint 4 was committed")
  assert gcs.read(f"{run}/checkpoints/DONE") is None
  # A half-written step is on the store; the resume must not take it.
  assert max(_records(gcs, run)) < 8
  resumed = _pretrain(gcs, run, inputs)
  _, log = resumed.communicate(timeout=timeouts.HANG_SECONDS)
  assert resumed.returncode == 0, log[-4000:]
  timings["killed + resumed"] = time.time() - start
  got = _records(gcs, run)
  assert sorted(got) == list(range(1, 9))
  for step in range(1, 9):
    np.testing.assert_allclose(got[step]["loss"], want[step]["loss"],
                               rtol=1e-4, err_msg=f"step {step}")
  assert gcs.read(f"{run}/checkpoints/8/commit_success.txt") is not None
  print("timings (s):", {k: round(v, 1) for k, v in timings.items()})

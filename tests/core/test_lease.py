"""One owner per output directory: refused within seconds, naming the
holder; a dead holder's lease is taken over; every writing job leases."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from realm_jax.core import io_utils
from realm_jax.core import lease as lease_lib
from realm_jax.testing import ram_fs

_HOLD = """
import sys, time
from realm_jax.core import lease
lease.Lease(sys.argv[1], job="holder job").acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_owner_is_refused_until_the_first_dies(tmp_path):
  workdir = str(tmp_path / "run")
  holder = subprocess.Popen([sys.executable, "-c", _HOLD, workdir],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    t0 = time.time()
    with pytest.raises(lease_lib.LeaseHeldError) as e:
      lease_lib.Lease(workdir, job="second").acquire()
    assert time.time() - t0 < 5
    message = str(e.value)
    assert "holder job" in message and f"pid {holder.pid}" in message
    assert workdir in message
    # kill -9: the kernel drops the lock, nothing stale is left to clean.
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with lease_lib.Lease(workdir, job="second") as lease:
      with open(os.path.join(workdir, ".lease")) as f:
        assert json.load(f)["token"] == lease.holder.token
      with pytest.raises(lease_lib.LeaseHeldError, match="second"):
        lease_lib.Lease(workdir, job="third").acquire()
    # Released: the next owner gets it at once.
    lease_lib.Lease(workdir, job="third").acquire().release()
  finally:
    holder.kill()
    holder.wait()


def _heartbeat(path) -> float:
  """The remote lease file's heartbeat. ram_fs, unlike an object store,
  can show the file while the heartbeat thread rewrites it (CI once read
  a torn JSON line): read again until it parses."""
  for _ in range(10_000):
    holder = lease_lib.Holder.parse(io_utils.read_text(path))
    if holder is not None:
      return holder.heartbeat
  raise AssertionError(f"{path}: never a whole lease record")


def test_remote_leases_heartbeat_and_stale_takeover():
  ram_fs.register()
  root = ram_fs.unique_root("lease")
  first = lease_lib.Lease(root, job="first", heartbeat_seconds=0.2,
                          stale_seconds=1.0).acquire()
  path = io_utils.join(root, ".lease")
  beat = _heartbeat(path)
  time.sleep(0.6)
  assert _heartbeat(path) > beat
  with pytest.raises(lease_lib.LeaseHeldError, match="first"):
    lease_lib.Lease(root, job="second", heartbeat_seconds=0.2,
                    stale_seconds=1.0).acquire()
  first.release()
  assert not io_utils.as_path(path).exists()

  # A holder that died without releasing: its heartbeat stops, and after
  # stale_seconds the lease is taken over.
  dead = {"job": "dead job", "host": "h", "pid": 1, "token": "t",
          "started": time.time() - 100, "heartbeat": time.time()}
  io_utils.atomic_write_text(path, json.dumps(dead))
  with pytest.raises(lease_lib.LeaseHeldError, match="dead job"):
    lease_lib.Lease(root, job="second", heartbeat_seconds=0.2,
                    stale_seconds=1.0).acquire()
  dead["heartbeat"] = time.time() - 5
  io_utils.atomic_write_text(path, json.dumps(dead))
  with lease_lib.Lease(root, job="second", heartbeat_seconds=0.2,
                       stale_seconds=1.0):
    assert json.loads(io_utils.read_text(path))["job"] == "second"


def test_every_writing_job_leases_what_it_writes(tmp_path):
  """Trainers lease their workdir; the index builder (and an inline-index
  trainer) the index directory; the evaluation job its output directory."""
  from realm_jax.eval import qa_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.index import builder  # pylint: disable=g-import-not-at-top
  from realm_jax.testing import knowledge_world, tiny  # pylint: disable=g-import-not-at-top
  from realm_jax.training import finetune, ict, pretrain  # pylint: disable=g-import-not-at-top
  files = knowledge_world.write_world(str(tmp_path / "world"), num_people=16,
                                      num_heldout=4)
  model = tiny.tiny_realm(vocab_size=30522)
  workdir = str(tmp_path / "run")
  jobs = {
      "pretrain": lambda: pretrain.train(
          config=pretrain.PretrainConfig(
              workdir=workdir, block_store=files.block_store,
              queries="unread", index_mode="inline"), model=model),
      "ict": lambda: ict.train(config=ict.IctTrainConfig(
          workdir=workdir, block_store=files.block_store), model=model),
      "finetune": lambda: finetune.train(config=finetune.FinetuneConfig(
          workdir=workdir, train_jsonl="unused.jsonl", index_dir="unused",
          block_store=files.block_store, num_train_steps=1), model=model),
  }
  with lease_lib.Lease(workdir, job="someone else"):
    for name, job in jobs.items():
      with pytest.raises(lease_lib.LeaseHeldError, match="someone else"):
        job()
  with lease_lib.Lease(checkpoints.index_root(workdir), job="someone else"):
    with pytest.raises(lease_lib.LeaseHeldError, match="someone else"):
      builder.run_builder(workdir=workdir, store=None,
                          retriever_config=model.retriever)
    # An inline-index trainer publishes indices itself.
    with pytest.raises(lease_lib.LeaseHeldError, match="someone else"):
      jobs["pretrain"]()
  out = str(tmp_path / "eval")
  with lease_lib.Lease(out, job="someone else"):
    with pytest.raises(lease_lib.LeaseHeldError, match="someone else"):
      qa_eval.run_eval_job(checkpoint_dir="x", output_dir=out, examples=[],
                           model_config=model, index=None, store=None)


def _planted_lease(tmp_path, link):
  """A workdir whose `.lease` is `link(victim, lease)` of a precious file;
  (victim, workdir)."""
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  workdir = tmp_path / "run"
  workdir.mkdir()
  link(victim, workdir / ".lease")
  return victim, workdir


def test_a_lease_file_planted_as_a_link_is_refused(tmp_path):
  """A `.lease` linked to another file: the job neither truncates nor
  overwrites that file, and names the link."""
  victim, workdir = _planted_lease(tmp_path, os.symlink)
  with pytest.raises(io_utils.LinkRefusedError,
                     match=r"run/\.lease is a symbolic link"):
    lease_lib.Lease(str(workdir), job="builder").acquire()
  assert victim.read_text() == "precious"


def test_a_lease_file_planted_as_a_hard_link_is_refused(tmp_path):
  """`ln precious.txt W/.lease`: O_NOFOLLOW sees no link, but the file
  has two names; the job refuses it and leaves its content alone, on
  acquire and (had it been taken) on release."""
  victim, workdir = _planted_lease(tmp_path, os.link)
  with pytest.raises(io_utils.LinkRefusedError,
                     match=r"run/\.lease has 2 hard links"):
    with lease_lib.Lease(str(workdir), job="builder"):
      pass
  assert victim.read_text() == "precious"
  # Once the extra name is gone, the lease works (and is the job's own).
  os.unlink(workdir / ".lease")
  with lease_lib.Lease(str(workdir), job="builder"):
    pass
  assert victim.read_text() == "precious"


def test_local_refusals_name_no_heartbeat(tmp_path):
  """Local leases do not heartbeat, so a refusal must not report a
  'last heartbeat' age; remote ones do and say so."""
  workdir = str(tmp_path / "run")
  with lease_lib.Lease(workdir, job="first"):
    with pytest.raises(lease_lib.LeaseHeldError) as e:
      lease_lib.Lease(workdir, job="second").acquire()
  assert "first" in str(e.value) and "heartbeat" not in str(e.value)
  ram_fs.register()
  root = ram_fs.unique_root("lease")
  with lease_lib.Lease(root, job="first", heartbeat_seconds=0.2,
                       stale_seconds=1.0):
    with pytest.raises(lease_lib.LeaseHeldError, match="last heartbeat"):
      lease_lib.Lease(root, job="second", heartbeat_seconds=0.2,
                      stale_seconds=1.0).acquire()


def test_live_holder_sees_running_owners_only(tmp_path):
  workdir = str(tmp_path / "run")
  assert lease_lib.live_holder(workdir) is None
  holder = subprocess.Popen([sys.executable, "-c", _HOLD, workdir],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    assert lease_lib.live_holder(workdir).pid == holder.pid
  finally:
    holder.kill()
    holder.wait()
  assert lease_lib.live_holder(workdir) is None  # Killed: its name stays.
  with lease_lib.Lease(workdir, job="mine"):
    assert lease_lib.live_holder(workdir).job == "mine"
  assert lease_lib.live_holder(workdir) is None  # Released.

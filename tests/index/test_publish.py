"""Atomic index publication and the trainer-side watcher."""

import json
import logging
import multiprocessing
import os
import pathlib
import pickle
import re
import socket
import subprocess
import threading
import time
import types

import numpy as np
import pytest

from realm_jax.core import outputs
from realm_jax.core import lease as lease_lib
from realm_jax.index import build_progress, publish, searchers
from realm_jax.index import watcher as watcher_lib
from realm_jax.testing import timeouts

FINGERPRINT = "corpus-abc"


def _publish(root, step, rows=50, dim=8, fingerprint=FINGERPRINT, keep=3,
             seed=None):
  rng = np.random.default_rng(step if seed is None else seed)
  emb = rng.normal(size=(rows, dim)).astype(np.float32)
  searcher = searchers.build_searcher(emb, "exact")
  publish.publish_index(root, step, emb, searcher,
                        corpus_fingerprint=fingerprint,
                        params_sha256=f"p{step}", build_seconds=0.1,
                        keep=keep)
  return emb


def test_publish_then_load_round_trip(tmp_path):
  root = str(tmp_path / "index")
  emb = _publish(root, 7)
  assert publish.read_latest(root) == 7
  index = publish.load_index(root, expect=publish.Expectation(
      FINGERPRINT, 50, 8))
  assert index.step == 7 and index.manifest["params_sha256"] == "p7"
  np.testing.assert_array_equal(index.embeddings, emb)
  ids, _ = index.search(emb[:3], 4)
  want = np.argsort(-(emb[:3] @ emb.T), axis=1)[:, :4]
  np.testing.assert_array_equal(ids, want)
  manifest = index.manifest
  assert {"step", "rows", "dim", "dtype", "corpus_fingerprint",
          "params_sha256", "files", "searcher", "build_seconds",
          "created"} <= set(manifest)
  assert "embeddings.npy" in manifest["files"]


class _Store:
  """What load_frozen_index reads of a block store."""
  fingerprint = FINGERPRINT

  def __len__(self):
    return 50


def _model(dim):
  return types.SimpleNamespace(
      retriever=types.SimpleNamespace(embedding_size=dim))


def test_frozen_index_from_a_root_or_a_workdir(tmp_path):
  workdir = tmp_path / "run"
  root = str(workdir / "index")
  _publish(root, 3)
  assert publish.resolve_index_root(str(workdir)) == root
  assert publish.resolve_index_root(root) == root
  for where in (root, str(workdir)):
    index = publish.load_frozen_index(where, _Store(), _model(8),
                                      num_retrieved=50)
    assert index.step == 3
  with pytest.raises(publish.IndexRejectedError,
                     match=r"--index_dir=.*cannot serve this job.*dim is 8"
                     r".*embedding size 16.*point --index_dir at"):
    publish.load_frozen_index(root, _Store(), _model(16),
                              what="--index_dir")
  with pytest.raises(publish.IndexRejectedError,
                     match="num_retrieved=51 exceeds the 50 blocks"):
    publish.load_frozen_index(root, _Store(), _model(8), num_retrieved=51)


def test_keeps_the_k_newest(tmp_path):
  root = str(tmp_path / "index")
  for step in (1, 2, 3, 4, 5):
    _publish(root, step, keep=2)
  assert publish.published_steps(root) == [4, 5]
  assert publish.read_latest(root) == 5


@pytest.mark.parametrize("damage", ["corrupt", "fingerprint", "partial",
                                    "dim"])
def test_bad_indices_are_refused(tmp_path, damage):
  root = str(tmp_path / "index")
  _publish(root, 1)
  # Polls once when it starts, then only when asked (no race with the
  # damage done below).
  watcher = watcher_lib.IndexWatcher(
      root, publish.Expectation(FINGERPRINT, 50, 8), poll_seconds=3600)
  assert watcher.wait_for_index(timeout=timeouts.HANG_SECONDS).step == 1
  if damage == "corrupt":
    _publish(root, 2)
    path = os.path.join(root, "2", "embeddings.npy")
    with open(path, "r+b") as f:
      f.seek(-4, os.SEEK_END)
      f.write(b"\x00\x01\x02\x03")
    match = "checksum mismatch"
  elif damage == "fingerprint":
    _publish(root, 2, fingerprint="another-corpus")
    match = "corpus_fingerprint"
  elif damage == "dim":
    _publish(root, 2, dim=4)
    match = "dim is 4"
  else:
    os.makedirs(os.path.join(root, "2"))
    with open(os.path.join(root, "LATEST"), "w") as f:
      f.write("2\n")
    match = "partial index"
  with pytest.raises(publish.IndexRejectedError, match=match):
    publish.load_index(root, expect=publish.Expectation(FINGERPRINT, 50, 8))
  # The watcher refuses it too and keeps serving index 1.
  try:
    watcher.poll_once()
    assert match.split()[0] in watcher.rejected[2]
    assert not watcher.maybe_swap()
    assert watcher.current_step == 1
  finally:
    watcher.close()


def _slow_publish(root, started, step=2):
  class SlowSearcher:
    kind = "exact"

    class config:  # pylint: disable=invalid-name
      to_dict = staticmethod(lambda: {})

    def save(self, directory):
      os.makedirs(directory)
      with open(os.path.join(directory, "half"), "w") as f:
        f.write("x")
      started.set()
      time.sleep(60)

  emb = np.ones((50, 8), np.float32)
  publish.publish_index(root, step, emb, SlowSearcher(),
                        corpus_fingerprint=FINGERPRINT, params_sha256="",
                        build_seconds=0)


def _listed(root):
  """An index root's entries: its ownership marker (`outputs.MARKER`) and
  whatever LATEST names, nothing else."""
  names = sorted(os.listdir(root))
  assert outputs.MARKER in names
  return [n for n in names if n != outputs.MARKER]


def test_a_killed_builder_leaves_nothing_visible(tmp_path):
  root = str(tmp_path / "index")
  emb = _publish(root, 1)
  ctx = multiprocessing.get_context("spawn")  # fork + JAX threads can deadlock
  started = ctx.Event()
  child = ctx.Process(target=_slow_publish, args=(root, started))
  child.start()
  assert started.wait(30)
  child.kill()  # SIGKILL mid-write.
  child.join()
  assert publish.read_latest(root) == 1
  assert publish.published_steps(root) == [1]
  np.testing.assert_array_equal(publish.load_index(root).embeddings, emb)
  # The half-written step directory was never named by LATEST.
  assert _listed(root) == ["1", "2", "LATEST"]
  assert publish.clean_stale_temporaries(root) == ["2"]
  assert _listed(root) == ["1", "LATEST"]
  _publish(root, 2)  # A restarted builder publishes the step again.
  assert publish.published_steps(root) == [1, 2]


def test_republishing_the_served_step_never_withdraws_it(tmp_path):
  root = str(tmp_path / "index")
  emb = _publish(root, 1)
  ctx = multiprocessing.get_context("spawn")
  started = ctx.Event()
  # Step 1 again (an extend onto the same output, a rebuild), killed while
  # it writes: what LATEST served is still served, whole.
  child = ctx.Process(target=_slow_publish, args=(root, started, 1))
  child.start()
  assert started.wait(30)
  child.kill()
  child.join()
  assert publish.read_latest(root) == 1
  np.testing.assert_array_equal(publish.load_index(root).embeddings, emb)
  assert _listed(root) == ["1", "1.1", "LATEST"]
  assert publish.clean_stale_temporaries(root) == ["1.1"]
  # A finished re-publication becomes visible by LATEST's switch alone,
  # and the index it replaced goes after it.
  new = _publish(root, 1, seed=5)
  assert (tmp_path / "index" / "LATEST").read_text() == "1.1\n"
  assert _listed(root) == ["1.1", "LATEST"]
  np.testing.assert_array_equal(publish.load_index(root).embeddings, new)
  _publish(root, 2)
  assert publish.published_steps(root) == [1, 2]
  np.testing.assert_array_equal(publish.load_index(root, 1).embeddings, new)
  assert publish.clean_stale_temporaries(root) == []


def test_watcher_swaps_under_a_running_loop(tmp_path):
  root = str(tmp_path / "index")
  _publish(root, 10)
  watcher = watcher_lib.IndexWatcher(
      root, publish.Expectation(FINGERPRINT, 50, 8), poll_seconds=0.02)
  try:
    first = watcher.wait_for_index(timeout=timeouts.HANG_SECONDS)
    assert first.step == 10
    served = []

    def builder():
      time.sleep(0.2)
      _publish(root, 20)

    thread = threading.Thread(target=builder)
    thread.start()
    deadline = time.time() + 30
    while time.time() < deadline:
      watcher.maybe_swap()  # Between "steps".
      served.append(watcher.current_step)
      if watcher.current_step == 20:
        break
      time.sleep(0.01)
    thread.join()
    assert served[0] == 10 and served[-1] == 20
    assert len(watcher.swap_log) == 2
  finally:
    watcher.close()


def test_watcher_swaps_in_a_republication_of_the_served_step(tmp_path):
  """Step 6 published again (an extend onto the same output, a rebuild)
  is written as `6.1/` and LATEST switches to it: a running trainer's
  watcher swaps it in, though the step is the one it serves; a newer step
  is swapped in after it."""
  root = str(tmp_path / "index")
  first = _publish(root, 6)
  watcher = watcher_lib.IndexWatcher(
      root, publish.Expectation(FINGERPRINT, 50, 8), poll_seconds=3600)
  try:
    # The thread's first poll; then it sleeps, and the test polls.
    assert watcher.wait_for_index(timeout=timeouts.HANG_SECONDS).key == (6, 0)
    np.testing.assert_array_equal(watcher.current.embeddings, first)
    watcher.poll_once()
    assert not watcher.maybe_swap()  # Nothing new.
    second = _publish(root, 6, seed=5)
    assert (tmp_path / "index" / "LATEST").read_text() == "6.1\n"
    watcher.poll_once()
    assert watcher.maybe_swap()
    assert watcher.current.key == (6, 1) and watcher.current_step == 6
    np.testing.assert_array_equal(watcher.current.embeddings, second)
    assert [step for step, _, _ in watcher.swap_log] == [6, 6]
    third = _publish(root, 7)
    watcher.poll_once()
    assert watcher.maybe_swap() and watcher.current.key == (7, 0)
    np.testing.assert_array_equal(watcher.current.embeddings, third)
  finally:
    watcher.close()


def test_manifest_is_json_with_checksums(tmp_path):
  root = str(tmp_path / "index")
  _publish(root, 3)
  with open(os.path.join(root, "3", "manifest.json")) as f:
    manifest = json.load(f)
  for name, meta in manifest["files"].items():
    assert len(meta["sha256"]) == 64
    assert os.path.getsize(os.path.join(root, "3", name)) == meta["bytes"]


def test_watcher_retries_after_a_filesystem_error(tmp_path):
  root = str(tmp_path / "index")
  _publish(root, 4)
  failures = []

  def flaky_loader(*args):
    if not failures:  # E.g. a tf.errors.UnavailableError from GCS.
      failures.append(1)
      raise RuntimeError("transient")
    return publish.load_index(*args)

  watcher = watcher_lib.IndexWatcher(root, poll_seconds=0.02,
                                     loader=flaky_loader)
  try:
    assert watcher.wait_for_index(timeout=timeouts.HANG_SECONDS).step == 4
    assert failures == [1] and not watcher.rejected
  finally:
    watcher.close()


def test_waiting_for_an_index_says_why_and_the_way_out(tmp_path, caplog):
  """A builder-mode trainer with no valid index hears, while it waits,
  why each index was rejected, and the timeout names index_mode="inline"."""
  root = str(tmp_path / "index")
  empty = watcher_lib.IndexWatcher(root, poll_seconds=0.02)
  try:
    with pytest.raises(TimeoutError, match="nothing is published"):
      empty.wait_for_index(timeout=0.2)
  finally:
    empty.close()
  _publish(root, 3, fingerprint="another corpus")
  watcher = watcher_lib.IndexWatcher(
      root, publish.Expectation(FINGERPRINT, 50, 8), poll_seconds=0.02)
  try:
    with caplog.at_level(logging.WARNING):
      with pytest.raises(TimeoutError) as e:
        watcher.wait_for_index(timeout=1.0, report_seconds=0.3)
  finally:
    watcher.close()
  message = str(e.value)
  assert "index 3: " in message and "corpus_fingerprint" in message
  assert 'index_mode="inline"' in message
  waiting = [r.getMessage() for r in caplog.records
             if "no index to serve after" in r.getMessage()]
  assert waiting and "index 3: " in waiting[0]
  assert 'index_mode="inline"' in waiting[0]


def _hear_the_wait(root, caplog, timeout):
  """The watcher's reports while it waits (INFO and up), and its error."""
  watcher = watcher_lib.IndexWatcher(
      root, publish.Expectation(FINGERPRINT, 50, 8), poll_seconds=0.02)
  error = None
  try:
    with caplog.at_level(logging.INFO):
      watcher.wait_for_index(timeout=timeout, report_seconds=0.1)
  except TimeoutError as e:
    error = e
  finally:
    watcher.close()
  said = [(r.levelno, r.getMessage()) for r in caplog.records
          if r.getMessage().startswith("Index watcher: ") and (
              "waiting" in r.getMessage() or "no index" in r.getMessage())]
  return said, error


def test_a_progressing_builder_is_reported_at_info(tmp_path, caplog):
  """Issue 48: the demo's trainer waited for index 0 while the builder
  beside it embedded the corpus, and said WARNING. A builder that holds
  the index root's lease and records its progress is reported at INFO,
  with that progress."""
  root = str(tmp_path / "index")
  progress = build_progress.BuildProgress(root, 0, every_seconds=0.0)
  progress.on_embedded(0, 100)
  stop = threading.Event()

  def build():
    for done in range(1, 101):
      if stop.wait(0.01):
        return
      progress.on_embedded(done, 100)
    _publish(root, 0)

  with lease_lib.Lease(root, job="index builder"):
    builder = threading.Thread(target=build)
    builder.start()
    try:
      said, error = _hear_the_wait(root, caplog, timeout=60)
    finally:
      stop.set()
      builder.join()
  assert error is None
  assert said and all(level == logging.INFO for level, _ in said), said
  assert "index builder (pid" in said[0][1]
  assert re.search(r"embedding the corpus for index 0: \d+ of 100 blocks",
                   said[0][1]), said[0][1]


def _dead_pid():
  child = subprocess.Popen(["true"])
  child.wait()
  return child.pid


@pytest.mark.parametrize("builder", ["none", "dead", "stuck", "retrying"])
def test_a_gone_stuck_or_failing_builder_still_warns(tmp_path, caplog,
                                                      builder):
  """No builder, a dead one (its lease and progress name a pid that is
  gone), one that stopped recording batches, or one retrying a failed
  publication: the wait is reported as a WARNING saying which."""
  root = str(tmp_path / "index")
  os.makedirs(root)
  lease = None
  if builder == "dead":
    pid = _dead_pid()
    record = {"job": "index builder", "host": socket.gethostname(),
              "pid": pid, "token": "t", "started": time.time(),
              "heartbeat": time.time()}
    pathlib.Path(root, lease_lib.LEASE_FILE).write_text(json.dumps(record))
    progress = build_progress.BuildProgress(root, 0)
    progress.on_embedded(10, 100)
    path = pathlib.Path(root, build_progress.PROGRESS)
    path.write_text(json.dumps(dict(json.loads(path.read_text()), pid=pid)))
  elif builder in ("stuck", "retrying"):
    lease = lease_lib.Lease(root, job="index builder").acquire()
    progress = build_progress.BuildProgress(root, 0)
    if builder == "retrying":
      progress.retrying("publishing index 0 failed (OSError 28)")
    else:
      progress.on_embedded(10, 100)
      path = pathlib.Path(root, build_progress.PROGRESS)
      path.write_text(json.dumps(dict(
          json.loads(path.read_text()),
          updated=time.time() - build_progress.PROGRESS_STALE_SECONDS - 5)))
  try:
    said, error = _hear_the_wait(root, caplog, timeout=0.5)
  finally:
    if lease:
      lease.release()
  assert isinstance(error, TimeoutError)
  assert said and all(level == logging.WARNING for level, _ in said), said
  why = {"none": "no live index builder holds its lease",
         "dead": "no live index builder holds its lease",
         "stuck": "has reported no progress for",
         "retrying": "is retrying a failed publication of index 0: "
                     "publishing index 0 failed (OSError 28)"}[builder]
  assert why in said[0][1], said[0][1]
  assert 'index_mode="inline"' in said[0][1]


class _PlantedPickle:
  """Unpickling it creates `path`: proof that code from the file ran."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_a_planted_pickle_never_runs(tmp_path):
  """ScaNN's own loader unpickles scann_docids.pkl; realm_jax refuses an
  index holding one, even when its manifest lists it."""
  root = str(tmp_path / "index")
  emb = np.random.default_rng(0).normal(size=(2000, 8)).astype(np.float32)
  searcher = searchers.build_searcher(emb, "scann")
  publish.publish_index(root, 1, emb, searcher,
                        corpus_fingerprint=FINGERPRINT, params_sha256="p1",
                        build_seconds=0.1)
  step_dir = os.path.join(root, "1")
  scann_dir = os.path.join(step_dir, publish.SEARCHER_DIR, "scann")
  marker = str(tmp_path / "pwned")
  with open(os.path.join(scann_dir, "scann_docids.pkl"), "wb") as f:
    pickle.dump(_PlantedPickle(marker), f)
  # The attacker also lists the file in the (unsigned) manifest.
  manifest_path = os.path.join(step_dir, publish.MANIFEST)
  with open(manifest_path) as f:
    manifest = json.load(f)
  manifest["files"] = publish._file_checksums(step_dir)
  with open(manifest_path, "w") as f:
    json.dump(manifest, f)

  with pytest.raises(publish.IndexRejectedError, match="pickle"):
    publish.load_index(root, expect=publish.Expectation(FINGERPRINT, 2000, 8))
  with pytest.raises(ValueError, match="scann_docids.pkl"):
    searchers.load_searcher(os.path.join(step_dir, publish.SEARCHER_DIR))
  assert not os.path.exists(marker)

  # The plant is live: ScaNN's own loader (what realm_jax used to call)
  # runs it.
  from scann.scann_ops.py import scann_ops_pybind  # pylint: disable=g-import-not-at-top
  scann_ops_pybind.load_searcher(scann_dir)
  assert os.path.exists(marker)


def test_scann_assets_outside_the_directory_are_refused(tmp_path):
  emb = np.random.default_rng(0).normal(size=(500, 8)).astype(np.float32)
  directory = str(tmp_path / "s")
  searchers.build_searcher(emb, "scann").save(directory)
  assets = os.path.join(directory, "scann", "scann_assets.pbtxt")
  with open(assets) as f:
    text = f.read()
  with open(assets, "w") as f:
    f.write(text.replace('asset_path: "dataset.npy"',
                         'asset_path: "../../elsewhere/dataset.npy"'))
  with pytest.raises(ValueError, match="not a file of"):
    searchers.load_searcher(directory)


def test_links_out_of_the_index_root_are_refused(tmp_path):
  """No read, write or delete follows a link out of the index root."""
  root = tmp_path / "index"
  outside = tmp_path / "outside"
  victim = outside / "victim"
  victim.mkdir(parents=True)
  (victim / publish.MANIFEST).write_text("precious")
  _publish(str(root), 1)
  # A link where a stale step would be: the builder's cleanup leaves both
  # the link and its target alone (it used to delete victim/manifest.json,
  # then crash in rmtree).
  os.symlink(victim, root / "99")
  assert publish.clean_stale_temporaries(str(root)) == []
  assert (victim / publish.MANIFEST).read_text() == "precious"
  # Publishing that step would write (and first delete) through the link.
  with pytest.raises(ValueError, match="99 is a symbolic link"):
    _publish(str(root), 99)
  assert (victim / publish.MANIFEST).read_text() == "precious"
  os.remove(root / "99")

  # A published index whose files are links to copies outside (the
  # checksums still match): refused by name, checked or not.
  step = root / "1"
  expect = publish.Expectation(FINGERPRINT, 50, 8)
  for name in (publish.EMBEDDINGS, publish.SEARCHER_DIR):
    os.rename(step / name, outside / name)
    os.symlink(outside / name, step / name)
    for checksums in (True, False):
      with pytest.raises(publish.IndexRejectedError,
                         match=f"{name} is a symbolic link"):
        publish.load_index(str(root), expect=expect, checksums=checksums)
    os.remove(step / name)
    os.rename(outside / name, step / name)
  publish.load_index(str(root), expect=expect)  # Restored: it loads.

  # The step directory itself, and LATEST, as links.
  os.symlink(step, root / "5")
  with pytest.raises(publish.IndexRejectedError, match="5 is a symbolic"):
    publish.load_index(str(root), 5, expect)
  (outside / "latest").write_text("1\n")
  os.remove(root / publish.LATEST)
  os.symlink(outside / "latest", root / publish.LATEST)
  with pytest.raises(publish.IndexRejectedError, match="LATEST is a symb"):
    publish.read_latest(str(root))


@pytest.mark.parametrize("where", ["relative", "absolute", "link"])
def test_searcher_files_outside_its_directory_are_refused(tmp_path, where):
  emb = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
  directory = tmp_path / "s"
  searchers.build_searcher(emb, "exact").save(str(directory))
  outside = tmp_path / "outside" / "x.npy"
  outside.parent.mkdir()
  np.save(outside, emb)
  meta_path = directory / searchers.METADATA_FILE
  meta = json.loads(meta_path.read_text())
  if where == "link":
    os.remove(directory / meta["embeddings_file"])
    os.symlink(outside, directory / meta["embeddings_file"])
  else:
    meta["embeddings_file"] = (str(outside) if where == "absolute" else
                               "../outside/x.npy")
    meta_path.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="embeddings_file=.*(not an entry|"
                     "symbolic link)"):
    searchers.load_searcher(str(directory))


def test_object_array_embeddings_are_refused_naming_the_file(tmp_path):
  """numpy stores an object array as a pickle: refused with the file's
  name, never unpickled, even when the manifest's checksums match."""
  root = tmp_path / "index"
  _publish(str(root), 1, rows=3, dim=2)
  step = root / "1"
  marker = tmp_path / "pwned"
  objects = np.empty((3, 2), dtype=object)
  objects[0, 0] = _PlantedPickle(str(marker))
  for path in (step / publish.EMBEDDINGS,
               step / publish.SEARCHER_DIR / "embeddings.npy"):
    np.save(path, objects, allow_pickle=True)
  manifest = json.loads((step / publish.MANIFEST).read_text())
  manifest["files"] = publish._file_checksums(step)
  (step / publish.MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(publish.IndexRejectedError,
                     match=r"1/embeddings.npy is not a plain numeric"):
    publish.load_index(str(root))
  with pytest.raises(ValueError,
                     match=r"searcher/embeddings.npy is not a plain numeric"):
    searchers.load_searcher(str(step / publish.SEARCHER_DIR))
  assert not marker.exists()

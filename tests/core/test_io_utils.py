"""Workdir I/O on local paths, epath.Path objects and a non-local filesystem.

The non-local filesystem is TensorFlow's in-memory `ram://` (through the
same epath backend as gs://, see `realm_jax.testing.ram_fs`): `os`, `open`
and `np.load(mmap_mode=...)` cannot reach it, so these tests fail if a
converted module still uses them on a workdir path.
"""

import json
import os
import subprocess

from etils import epath
import numpy as np
import pytest

from realm_jax.core import io_utils, outputs
from realm_jax.data import beam_utils, block_store, block_store_writer
from realm_jax.data import blocks, corpus_job
from realm_jax.data import wikipedia
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import build, publish, searchers
from realm_jax.index import watcher as watcher_lib
from realm_jax.testing import ram_fs, timeouts
from realm_jax.core import checkpoints
from realm_jax.training import loop

ram_fs.register()
FINGERPRINT = "corpus-abc"


def _ram(name):
  return ram_fs.unique_root(name)


# ---------------------------------------------------------------------------
# The helpers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("as_epath", [False, True])
def test_local_helpers(tmp_path, as_epath):
  wrap = epath.Path if as_epath else str
  target = wrap(tmp_path / "a" / "b.json")
  io_utils.atomic_write_text(target, "one")
  io_utils.atomic_write_text(target, "two")  # Replaces.
  assert (tmp_path / "a" / "b.json").read_text() == "two"
  assert os.listdir(tmp_path / "a") == ["b.json"]  # No temporary left.
  log = wrap(tmp_path / "log.jsonl")
  io_utils.append_text(log, "1\n")
  io_utils.append_text(log, "2\n")
  assert (tmp_path / "log.jsonl").read_text() == "1\n2\n"
  assert io_utils.is_local(target) and io_utils.is_local("rel/dir")
  assert io_utils.absolute("rel") == os.path.abspath("rel")
  assert io_utils.join(wrap(tmp_path), "x", "y") == str(tmp_path / "x" / "y")


def test_replace_local_dir(tmp_path):
  dest = str(tmp_path / "out")
  for version in ("one", "two"):
    tmp = str(tmp_path / f"tmp-{version}")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "v"), "w") as f:
      f.write(version)
    io_utils.replace_local_dir(tmp, dest)
    with open(os.path.join(dest, "v")) as f:
      assert f.read() == version
    assert not os.path.exists(tmp)
  # The old tree is gone, not left beside the new one.
  assert sorted(os.listdir(tmp_path)) == ["out"]


def test_remote_paths_stay_remote():
  assert not io_utils.is_local("gs://bucket/run")
  assert not io_utils.is_local(epath.Path("gs://bucket/run"))
  # os.path.abspath would make this "<cwd>/gs:/bucket/run".
  assert io_utils.absolute("gs://bucket/run") == "gs://bucket/run"
  assert io_utils.join(epath.Path("gs://bucket/run"),
                       "checkpoints") == "gs://bucket/run/checkpoints"
  assert checkpoints.checkpoint_dir("gs://b/r") == "gs://b/r/checkpoints"
  assert checkpoints.index_root("gs://b/r") == "gs://b/r/index"


def test_remote_writes_and_appends():
  root = _ram("io")
  io_utils.atomic_write_text(f"{root}/d/x.txt", "hello")
  io_utils.append_text(f"{root}/d/log", "1\n")
  io_utils.append_text(f"{root}/d/log", "2\n")  # Rewrites the object.
  assert io_utils.read_text(f"{root}/d/x.txt") == "hello"
  assert io_utils.read_text(f"{root}/d/log") == "1\n2\n"
  io_utils.write_json(f"{root}/h.json", [{"step": 1}])
  io_utils.append_jsonl(f"{root}/m.jsonl", {"loss": 0.5})
  assert json.loads(io_utils.read_text(f"{root}/h.json")) == [{"step": 1}]
  assert json.loads(io_utils.read_text(f"{root}/m.jsonl")) == {"loss": 0.5}


def test_local_copy_is_made_once_and_whole(tmp_path):
  root = _ram("copy")
  io_utils.atomic_write_text(f"{root}/d/a.txt", "A")
  io_utils.atomic_write_text(f"{root}/d/sub/b.txt", "B")
  cache = tmp_path / "cache"
  # A copy abandoned by a dead process is removed; a live one is not.
  os.makedirs(cache / ".k.tmp-999999999")
  os.makedirs(cache / f".k.tmp-{os.getppid()}")
  local = io_utils.local_copy(f"{root}/d", "k", cache_dir=cache)
  assert local == str(cache / "k")
  assert (cache / "k" / "a.txt").read_text() == "A"
  assert (cache / "k" / "sub" / "b.txt").read_text() == "B"
  assert sorted(os.listdir(cache)) == [f".k.tmp-{os.getppid()}", "k"]
  io_utils.remove(f"{root}/d")
  # The key names the content: the existing copy is used, unread.
  assert io_utils.local_copy(f"{root}/d", "k", cache_dir=cache) == local
  io_utils.atomic_write_text(f"{root}/f.txt", "F")
  assert open(io_utils.local_copy(f"{root}/f.txt", "f", cache_dir=cache)
              ).read() == "F"
  with pytest.raises(FileNotFoundError):
    io_utils.local_copy(f"{root}/nothing", "n", cache_dir=cache)
  assert not [n for n in os.listdir(cache) if n.startswith(".n.")]


# ---------------------------------------------------------------------------
# Index publication on a non-local root
# ---------------------------------------------------------------------------


def _publish(root, step, rows=50, dim=8, keep=3):
  emb = np.random.default_rng(step).normal(size=(rows, dim)).astype(
      np.float32)
  publish.publish_index(root, step, emb, searchers.build_searcher(emb,
                                                                  "exact"),
                        corpus_fingerprint=FINGERPRINT,
                        params_sha256=f"p{step}", build_seconds=0.1,
                        keep=keep)
  return emb


def _names(root):
  """The entries of an index root, but its ownership marker."""
  return sorted(p.name for p in epath.Path(root).iterdir()
                if p.name != outputs.MARKER)


def test_remote_publish_load_round_trip(tmp_path):
  root, cache = _ram("index"), tmp_path / "cache"
  expect = publish.Expectation(FINGERPRINT, 50, 8)
  for step in (1, 2, 3):
    emb = _publish(root, step, keep=2)
    index = publish.load_index(root, expect=expect, cache_dir=cache)
    assert index.step == step and index.manifest["params_sha256"] == f"p{step}"
    np.testing.assert_array_equal(index.embeddings, emb)
    # Mapped from the local cache copy, not from ram://.
    assert index.embeddings.filename.startswith(str(cache))
    ids, _ = index.search(emb[:2], 3)
    np.testing.assert_array_equal(
        ids, np.argsort(-(emb[:2] @ emb.T), axis=1)[:, :3])
  assert _names(root) == ["2", "3", "LATEST"]
  assert publish.published_steps(root) == [2, 3]
  assert len(os.listdir(cache)) == 2  # Older copies evicted.
  # The watcher reads the remote root the same way.
  watcher = watcher_lib.IndexWatcher(root, expect, poll_seconds=3600,
                                     loader=lambda r, s, e: publish.load_index(
                                         r, s, e, cache_dir=cache))
  try:
    assert watcher.wait_for_index(timeout=timeouts.HANG_SECONDS).step == 3
  finally:
    watcher.close()
  # Re-publishing the live step rewrites it behind a LATEST moved back.
  emb = _publish(root, 3, rows=50, keep=2)
  assert publish.read_latest(root) == 3
  np.testing.assert_array_equal(
      publish.load_index(root, cache_dir=cache).embeddings, emb)


def test_remote_corrupt_and_partial_indices_are_refused(tmp_path):
  root, cache = _ram("index"), tmp_path / "cache"
  emb = _publish(root, 1)
  _publish(root, 2)
  path = epath.Path(root) / "2" / publish.EMBEDDINGS
  data = bytearray(path.read_bytes())
  data[-4:] = b"\x00\x01\x02\x03"
  path.write_bytes(bytes(data))
  with pytest.raises(publish.IndexRejectedError, match="checksum mismatch"):
    publish.load_index(root, cache_dir=cache)
  assert os.listdir(cache) == []  # The bad copy is not kept.
  # A publisher that died mid-write: files, no manifest, LATEST untouched.
  publish._write_latest(root, 1)  # pylint: disable=protected-access
  io_utils.atomic_write_text(f"{root}/3/{publish.EMBEDDINGS}", "half")
  assert publish.published_steps(root) == [1]
  np.testing.assert_array_equal(
      publish.load_index(root, cache_dir=cache).embeddings, emb)
  assert publish.clean_stale_temporaries(root) == ["2", "3"]
  assert _names(root) == ["1", "LATEST"]


def test_remote_publication_failure_publishes_nothing(tmp_path):
  root = _ram("index")
  _publish(root, 1)

  class FailingSearcher:
    kind, config = "exact", None

    def save(self, directory):
      os.makedirs(directory)
      raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    publish.publish_index(root, 2, np.ones((50, 8), np.float32),
                          FailingSearcher(), corpus_fingerprint=FINGERPRINT,
                          params_sha256="", build_seconds=0)
  assert publish.read_latest(root) == 1 and _names(root) == ["1", "LATEST"]
  assert publish.load_index(root, cache_dir=tmp_path).step == 1


def test_searchers_refuse_remote_directories():
  searcher = searchers.build_searcher(np.eye(4, dtype=np.float32), "exact")
  with pytest.raises(ValueError, match="local directories"):
    searcher.save(_ram("s"))
  with pytest.raises(ValueError, match="local directories"):
    searchers.load_searcher(_ram("s"))


# ---------------------------------------------------------------------------
# Block stores, the builder, checkpoints and the run helpers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
  tok = Tokenizer()
  docs = [wikipedia.Document("Alpha", "Alpha is a letter. It comes first."),
          wikipedia.Document("Beta", "Beta is the second letter.")]
  path = str(tmp_path_factory.mktemp("s") / "store")
  block_store_writer.write_block_store(
      blocks.pack_blocks(docs, tok, max_block_len=16), path,
      tokenizer_vocab_path=tok.vocab_path, source="test", max_block_len=16)
  return path


def test_block_store_remote_cache(store_dir, tmp_path):
  direct = block_store.BlockStore.open(store_dir)
  assert direct.local_path == store_dir
  cache = tmp_path / "cache"
  # cache=True takes the remote path on a local store.
  cached = block_store.BlockStore.open(store_dir, cache=True, cache_dir=cache)
  assert cached.path == store_dir
  assert os.path.dirname(cached.local_path) == str(cache)
  assert cached.doc_hash.filename.startswith(cached.local_path)
  np.testing.assert_array_equal(cached.retriever_inputs([0, 1])["token_ids"],
                                direct.retriever_inputs([0, 1])["token_ids"])
  # A store on a non-local filesystem is copied by default.
  remote = _ram("store")
  io_utils.copy_tree(store_dir, remote)
  store = block_store.BlockStore.open(remote, cache_dir=tmp_path / "c2",
                                      verify=True)
  assert store.path == remote and store.fingerprint == direct.fingerprint
  assert store.local_path.startswith(str(tmp_path / "c2"))
  assert store.text(0) == direct.text(0)
  with pytest.raises(ValueError, match="cannot be memory-mapped"):
    block_store.BlockStore.open(remote, cache=False)
  with pytest.raises(FileNotFoundError, match="block store .* does not exist"):
    block_store.BlockStore.open(_ram("nothing"), cache_dir=tmp_path)


def test_block_store_written_to_a_remote_directory(tmp_path, monkeypatch):
  monkeypatch.setenv(io_utils.CACHE_ENV, str(tmp_path / "cache"))
  tok = Tokenizer()

  def store_blocks(*texts):
    docs = [wikipedia.Document(f"T{i}", t) for i, t in enumerate(texts)]
    return blocks.pack_blocks(docs, tok, max_block_len=16)

  kwargs = dict(tokenizer_vocab_path=tok.vocab_path, source="test",
                max_block_len=16)
  remote = _ram("written")
  store = block_store_writer.write_block_store(
      store_blocks("Alpha is a letter.", "Beta is too."), remote, **kwargs)
  assert store.path == remote and len(store) == 2
  assert (io_utils.as_path(remote) / "manifest.json").exists()
  # Built in the cache and left there: opening the remote store again maps
  # that copy (one cache entry, no build directory left behind).
  assert sorted(os.listdir(tmp_path / "cache")) == [
      os.path.basename(store.local_path)]
  again = block_store.BlockStore.open(remote, verify=True)
  assert again.local_path == store.local_path and again.text(1) == (
      "Beta is too.")
  with pytest.raises(FileExistsError, match="overwrite"):
    block_store_writer.write_block_store(store_blocks("Gamma."), remote,
                                         **kwargs)
  replaced = block_store_writer.write_block_store(
      store_blocks("Gamma."), remote, overwrite=True, **kwargs)
  assert len(replaced) == 1 and replaced.fingerprint != store.fingerprint
  assert block_store.BlockStore.open(remote).text(0) == "Gamma."

  # A build that fails leaves nothing remote and nothing in the cache.
  def failing():
    yield from store_blocks("Delta is here.")
    raise RuntimeError("killed")

  broken = _ram("broken")
  before = sorted(os.listdir(tmp_path / "cache"))
  with pytest.raises(RuntimeError, match="killed"):
    block_store_writer.write_block_store(failing(), broken, **kwargs)
  assert not io_utils.as_path(broken).exists()
  assert sorted(os.listdir(tmp_path / "cache")) == before
  # So does an upload that fails half-way (no manifest was uploaded).
  real_copy, copies = io_utils.copy_file, []

  def flaky_copy(src, dst):
    copies.append(dst)
    if len(copies) == 3:
      raise OSError("connection reset")
    real_copy(src, dst)

  monkeypatch.setattr(io_utils, "copy_file", flaky_copy)
  with pytest.raises(OSError, match="connection reset"):
    block_store_writer.write_block_store(store_blocks("Delta."), broken,
                                         **kwargs)
  assert not io_utils.as_path(broken).exists()
  assert sorted(os.listdir(tmp_path / "cache")) == before


def test_corpus_job_writes_a_remote_store(tmp_path, monkeypatch):
  monkeypatch.setenv(io_utils.CACHE_ENV, str(tmp_path / "cache"))
  remote = _ram("corpus")
  store, _ = corpus_job.build_corpus(output_dir=remote, max_documents=3,
                                     max_block_len=64)
  assert store.path == remote and len(store) > 3
  assert block_store.BlockStore.open(remote).fingerprint == store.fingerprint


@pytest.mark.parametrize("root_kind", ["str", "epath", "ram"])
def test_builder_publishes_to_any_root(store_dir, tmp_path, root_kind):
  store = block_store.BlockStore.open(store_dir)
  root = {"str": str(tmp_path / "i"), "epath": epath.Path(tmp_path / "i"),
          "ram": _ram("i")}[root_kind]
  emb = np.random.default_rng(0).normal(size=(len(store), 4)).astype(
      np.float32)
  path = build.publish_embeddings(
      embeddings=emb, store=store, root=root, step=5,
      config=build.IndexBuildConfig(searcher="exact"))
  assert path == io_utils.join(root, "5")
  index = publish.load_index(root, expect=publish.Expectation(
      store.fingerprint, len(store), 4), cache_dir=tmp_path / "cache")
  np.testing.assert_array_equal(index.embeddings, emb)


@pytest.mark.parametrize("as_epath", [False, True])
def test_checkpoints_and_run_files_take_epath(tmp_path, as_epath):
  wrap = epath.Path if as_epath else str
  workdir = wrap(tmp_path / "run")
  writer = loop.start_run(workdir, "x = 1\n", is_chief=True)
  writer.close()
  assert (tmp_path / "run" / "operative_config.gin").read_text() == "x = 1\n"
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  ckpt = checkpoints.TrainCheckpointer(wrap(ckpt_dir), async_save=False)
  params = {"retriever": {"w": np.arange(4.0, dtype=np.float32)},
            "reader": {"b": np.ones(2, np.float32)}}
  ckpt.save(3, params, {"count": np.zeros(())}, force=True)
  ckpt.wait_until_finished()
  ckpt.close()
  assert checkpoints.finalized_steps(wrap(ckpt_dir)) == [3]
  restored = checkpoints.restore_retriever(wrap(ckpt_dir), 3)
  np.testing.assert_array_equal(restored["w"], params["retriever"]["w"])
  assert not checkpoints.is_done(wrap(ckpt_dir))
  checkpoints.write_done_marker(wrap(ckpt_dir), 3)
  assert checkpoints.is_done(wrap(ckpt_dir))
  assert json.loads((tmp_path / "run" / "checkpoints" / "DONE").read_text()
                    ) == {"final_step": 3}
  assert not [n for n in os.listdir(ckpt_dir) if "tmp" in n]


def test_links_are_removed_not_followed_and_refused_inside_a_job(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep.txt").write_text("precious")
  job = tmp_path / "job"
  (job / "sub").mkdir(parents=True)
  os.symlink(outside, job / "sub" / "link")
  io_utils.check_no_links(job / "sub", job)
  with pytest.raises(io_utils.LinkRefusedError, match=r"sub/link is a symb"):
    io_utils.check_no_links(job / "sub" / "link" / "keep.txt", job)
  # The job's own root may be a link (a workdir on another disk).
  os.symlink(job, tmp_path / "job_link")
  io_utils.check_no_links(tmp_path / "job_link" / "sub", tmp_path / "job_link")
  io_utils.remove(job / "sub" / "link")
  assert not os.path.lexists(job / "sub" / "link")
  assert (outside / "keep.txt").read_text() == "precious"


def test_job_outputs_go_through_a_fresh_temporary_never_a_link(tmp_path):
  """`output_dir` (every local job output directory) and the atomic file
  writes: a link planted at the output, or where an old-style temporary
  of a predictable name would go, is never written through or deleted."""
  victim = tmp_path / "victim"
  victim.mkdir()
  (victim / "keep.txt").write_text("precious")
  os.symlink(victim, tmp_path / "out")
  with pytest.raises(io_utils.LinkRefusedError, match="out' is a symbolic"):
    with outputs.output_dir(str(tmp_path / "out"), kind=outputs.EXPORT,
                            setting="out", overwrite=True):
      pass
  with pytest.raises(io_utils.LinkRefusedError):
    io_utils.replace_local_dir(str(tmp_path), str(tmp_path / "out"))
  with pytest.raises(io_utils.LinkRefusedError):  # The Beam jobs' outputs.
    beam_utils.ShardedOutput(str(tmp_path / "out"), marker="manifest.json",
                             kind=outputs.QUERY_CACHE, setting="out",
                             overwrite=True)
  # A planted file at the old temporary name of an atomic write.
  os.symlink(victim / "keep.txt",
             tmp_path / f".tmp-manifest.json-{os.getpid()}")
  io_utils.atomic_write_text(str(tmp_path / "manifest.json"), "{}")
  assert (victim / "keep.txt").read_text() == "precious"
  assert (tmp_path / "manifest.json").read_text() == "{}"
  # A failed job deletes only the temporary it made; no output appears.
  with pytest.raises(RuntimeError):
    with outputs.output_dir(str(tmp_path / "new"), kind=outputs.EXPORT,
                            setting="new") as tmp:
      (tmp_path / "new.txt").write_text("not the job's")
      raise RuntimeError("the job failed")
  assert not os.path.exists(tmp) and not os.path.exists(tmp_path / "new")
  with outputs.output_dir(str(tmp_path / "new"), kind=outputs.EXPORT,
                          setting="new") as tmp:
    with open(os.path.join(tmp, "v"), "w") as f:
      f.write("whole")
  assert (tmp_path / "new" / "v").read_text() == "whole"
  with pytest.raises(FileExistsError, match="already holds an export"):
    with outputs.output_dir(str(tmp_path / "new"), kind=outputs.EXPORT,
                            setting="new"):
      pass
  with pytest.raises(ValueError, match="not a temporary"):
    io_utils.discard_output_tmp(str(victim))
  assert sorted(os.listdir(victim)) == ["keep.txt"]


def test_a_full_disk_is_named_with_the_file(tmp_path):
  """`save_npy` (publication's embeddings, searchers, signatures) on a
  full device: ENOSPC with the file named, not numpy's '1152 requested
  and 992 written'. /dev/full fails every write with ENOSPC."""
  import errno  # pylint: disable=g-import-not-at-top
  with pytest.raises(OSError) as e:
    io_utils.save_npy("/dev/full", np.ones((64, 32), np.float32))
  assert e.value.errno == errno.ENOSPC
  assert "No space left on device while writing /dev/full (8192 bytes" in (
      str(e.value))
  array = np.arange(12, dtype=np.float32).reshape(3, 4)
  io_utils.save_npy(str(tmp_path / "a.npy"), array)
  np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), array)


def test_appends_and_summaries_never_go_through_a_link(tmp_path):
  """A `metrics.jsonl` planted as a link (symbolic or hard) is refused,
  never grown; so is a `summaries/` link for the TensorBoard writer."""
  outside = tmp_path / "outside.txt"
  outside.write_text("precious\n")
  workdir = tmp_path / "w"
  workdir.mkdir()
  os.symlink(outside, workdir / "metrics.jsonl")
  with pytest.raises(io_utils.LinkRefusedError, match="symbolic link"):
    io_utils.append_jsonl(str(workdir / "metrics.jsonl"), {"step": 1})
  from realm_jax.core import records  # pylint: disable=g-import-not-at-top
  with pytest.raises(io_utils.LinkRefusedError, match="symbolic link"):
    records.keep_records(str(workdir / "metrics.jsonl"))  # On resume.
  os.remove(workdir / "metrics.jsonl")
  os.link(outside, workdir / "metrics.jsonl")
  with pytest.raises(io_utils.LinkRefusedError, match="2 hard links"):
    io_utils.append_text(str(workdir / "metrics.jsonl"), "x\n")
  assert outside.read_text() == "precious\n"
  os.remove(workdir / "metrics.jsonl")
  io_utils.append_jsonl(str(workdir / "metrics.jsonl"), {"step": 1})
  io_utils.append_jsonl(str(workdir / "metrics.jsonl"), {"step": 2})
  assert (workdir / "metrics.jsonl").read_text() == (
      '{"step": 1}\n{"step": 2}\n')
  (tmp_path / "elsewhere").mkdir()
  os.symlink(tmp_path / "elsewhere", workdir / "summaries")
  with pytest.raises(io_utils.LinkRefusedError, match="summaries"):
    loop.start_run(str(workdir), "", is_chief=True)
  assert not os.listdir(tmp_path / "elsewhere")


def test_a_bind_mounted_alias_is_the_same_place(tmp_path):
  """Issue 64, E6: a bind mount of the base index root (no link shows it)
  is refused like a symbolic link, as the output itself or as a directory
  above the output."""
  base, alias = tmp_path / "w" / "index", tmp_path / "alias"
  base.mkdir(parents=True)
  alias.mkdir()
  (base / "LATEST").write_text("6\n")
  mounted = subprocess.run(["mount", "--bind", str(base), str(alias)],
                           capture_output=True, check=False)
  if mounted.returncode:
    pytest.skip(f"cannot bind-mount here: {mounted.stderr!r}")
  try:
    for output in (alias, alias / "extended", alias / "a" / "b"):
      with pytest.raises(io_utils.SamePlaceError, match="index_root"):
        io_utils.check_apart(str(output), "output_root",
                             {"index_root": str(base)},
                             either_way=("index_root",))
    io_utils.check_apart(str(tmp_path / "elsewhere"), "output_root",
                         {"index_root": str(base)}, either_way=("index_root",))
  finally:
    subprocess.run(["umount", str(alias)], check=True)

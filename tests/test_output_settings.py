"""One harness over every path setting a job writes (issue 64).

The settings are found from the configs, not listed here: every field of a
realm_jax `*Config` dataclass that names a path carries its role
(`checks.path_setting`), and each "writes" setting is run through its job's
real command line with the setting pointed at a directory of the user's
files, the job's own workdir, each of the job's inputs, another job's
output, a symbolic link to a victim, a FIFO and a read-only directory.
Each case must end in the job's normal result or a clear error (an exit
status and one message naming the path, no traceback), with the victim
byte-identical. A new "writes" setting without a runner below fails
`test_every_written_setting_has_a_runner`; a path-like field without a
role fails `test_every_path_setting_says_what_the_job_does_with_it`.
"""

import dataclasses
import hashlib
import importlib
import json
import os
import pkgutil
import re
import stat
import subprocess
import sys

import numpy as np
import pytest

import realm_jax
from realm_jax.core import checkpoints, checks, dataclass_json, outputs
from realm_jax.data import qa_inputs
from realm_jax.index import bm25, build
from realm_jax.testing import corpus, timeouts, tiny

# Field names that name a path (a new one must say its role).
_PATH_LIKE = re.compile(
    r"(_dir|_root|_path|_file|^workdir$|store$|^queries$|^annotated$|"
    r"^init_from$)")
QA_CONFIG = qa_inputs.QAConfig(question_length=16, num_retrieved=6,
                               num_reader_blocks=3, reader_length=48)


def _configs() -> list[type]:
  """Every `*Config` dataclass defined in realm_jax (but its tests' kit)."""
  found = {}
  for info in pkgutil.walk_packages(realm_jax.__path__, "realm_jax."):
    if info.name.startswith("realm_jax.testing"):
      continue
    module = importlib.import_module(info.name)
    for name, obj in vars(module).items():
      if (isinstance(obj, type) and dataclasses.is_dataclass(obj)
          and name.endswith("Config") and obj.__module__ == module.__name__):
        found[f"{obj.__module__}.{name}"] = obj
  return [found[k] for k in sorted(found)]


def _path_fields() -> list[tuple[str, dataclasses.Field]]:
  """(Class.field, field) of every path-like field, inherited ones once."""
  rows = {}
  for cls in _configs():
    for f in dataclasses.fields(cls):
      if _PATH_LIKE.search(f.name) and "str" in str(f.type):
        owner = next(c for c in cls.__mro__ if f.name in getattr(
            c, "__annotations__", {}))
        rows[f"{owner.__name__}.{f.name}"] = f
  return sorted(rows.items())


def _written() -> list[str]:
  return [name for name, f in _path_fields()
          if f.metadata.get(checks.PATH_ROLE) == "writes"]


def test_every_path_setting_says_what_the_job_does_with_it():
  unmarked = [name for name, f in _path_fields()
              if f.metadata.get(checks.PATH_ROLE) not in checks.PATH_ROLES]
  assert not unmarked, (
      f"{unmarked}: declare each with checks.path_setting('reads' | "
      "'writes', kind | 'home'); a 'writes' one also needs a runner in "
      "tests/test_output_settings.py.")
  kinds = {f.metadata.get(checks.OUTPUT_KIND) for name, f in _path_fields()
           if f.metadata.get(checks.PATH_ROLE) == "writes"}
  assert kinds <= set(outputs.KINDS), kinds - set(outputs.KINDS)
  # The issue's outputs are all among them.
  assert {"ExportConfig.output_dir", "ExtendConfig.output_dir",
          "EvalConfig.output_dir", "EvalConfig.bm25_dir",
          "CorpusConfig.output_dir", "QueryCacheConfig.output_dir",
          "AnnotateConfig.output_dir"} <= set(_written())


# -- The world the jobs run in: a run with a checkpoint and its index, a
# block store, an annotated corpus, a corpus input, a QA file, and another
# run's index root.


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  store, config, _, params, workdir = tiny.indexed_tiny_corpus(
      tmp_path_factory, "outputs")
  ckpt = checkpoints.TrainCheckpointer(str(workdir / "checkpoints"),
                                       async_save=False)
  ckpt.save(1, params, {"count": np.zeros((), np.int32)}, {
      "index_step": 0, "task_class": "FinetuneConfig",
      "model_config": dataclass_json.to_dict(config)}, force=True)
  ckpt.close()
  base = tmp_path_factory.mktemp("inputs")
  _, annotated = corpus.make_tiny_corpus(
      str(tmp_path_factory.getbasetemp() / "tiny_qa_corpus"))
  docs = base / "docs.jsonl"
  docs.write_text("".join(json.dumps({"title": t, "text": x}) + "\n"
                          for t, x in corpus.ARTICLES))
  qa_file = base / "dev.jsonl"
  qa_file.write_text(json.dumps({"question": "Where was Mozart born?",
                                 "answer": ["Salzburg"]}) + "\n")
  other = tmp_path_factory.mktemp("other") / "run" / "index"
  build.build_and_publish(
      retriever_params=params["retriever"], retriever_config=config.retriever,
      store=store, root=str(other), step=3,
      config=build.IndexBuildConfig(searcher="exact"))
  b = config.retriever.bert
  model = [f"--gin.BertConfig.{f.name}={getattr(b, f.name)!r}"
           for f in dataclasses.fields(b)] + [
               "--gin.RetrieverConfig.projection_size=16",
               "--gin.RetrieverConfig.pooling='mean'",
               "--gin.ReaderConfig.span_hidden_size=8",
               "--gin.ReaderConfig.max_span_width=4"]
  qa = [f"--gin.QAConfig.{f.name}={getattr(QA_CONFIG, f.name)}"
        for f in dataclasses.fields(QA_CONFIG)]
  return dict(workdir=str(workdir), store=str(store.path),
              checkpoints=str(workdir / "checkpoints"),
              index=str(workdir / "index"), annotated=annotated,
              docs=str(docs), qa_file=str(qa_file), other_index=str(other),
              model=model, qa=qa)


def _gin(name: str, value: str) -> str:
  return f"--gin.{name}={value!r}"


# Each runner: (argv given the world and the target, the inputs by name).
_EVAL_MODEL = ["--gin_file=models/tiny.gin"]


def _export(w, t):
  return ["realm_jax.jobs.export", _gin("WORKDIR", w["workdir"]),
          _gin("OUTPUT_DIR", t)], ["checkpoints"]


def _extend(w, t):
  return ["realm_jax.jobs.index_extend", *_EVAL_MODEL, *w["model"],
          _gin("INDEX_DIR", w["index"]), _gin("BLOCK_STORE", w["store"]),
          _gin("UNION_STORE", w["store"]), _gin("OUTPUT_DIR", t),
          _gin("INIT_FROM", f"checkpoint:{w['checkpoints']}@1")], [
              "index", "store", "checkpoints"]


def _eval_output(w, t):
  return ["realm_jax.jobs.qa_eval", *_EVAL_MODEL, "--gin_file=runs/eval.gin",
          *w["model"], *w["qa"], _gin("WORKDIR", w["workdir"]),
          _gin("BLOCK_STORE", w["store"]), _gin("QA_FILE", w["qa_file"]),
          _gin("qa_eval.EvalConfig.output_dir", t),
          "--gin.qa_eval.EvalConfig.step=1"], [
              "checkpoints", "index", "store", "qa_file"]


def _ask_bm25(w, t):
  return ["realm_jax.jobs.ask", *_EVAL_MODEL, "--gin_file=runs/eval.gin",
          *w["model"], *w["qa"], _gin("WORKDIR", w["workdir"]),
          _gin("BLOCK_STORE", w["store"]),
          _gin("qa_eval.EvalConfig.ranker", "hybrid"),
          _gin("qa_eval.EvalConfig.bm25_dir", t),
          "Where was Mozart born?"], ["checkpoints", "index", "store"]


def _corpus(w, t):
  return ["realm_jax.jobs.corpus", _gin("INPUT_PATH", w["docs"]),
          _gin("OUTPUT_DIR", t)], ["docs"]


def _query_cache(w, t):
  return ["realm_jax.jobs.query_cache", _gin("ANNOTATED", w["annotated"]),
          _gin("OUTPUT_DIR", t)], ["annotated"]


def _annotate(w, t):
  return ["realm_jax.jobs.annotate", _gin("INPUT_PATH", w["docs"]),
          _gin("OUTPUT_DIR", t)], ["docs"]


def _aot(w, t):
  del w
  return ["realm_jax.jobs.aot", "--gin_file=models/tiny.gin",
          "--gin.TOPOLOGY='v5e:2x2'", "--gin.aot.AotConfig.jobs=('search',)",
          _gin("aot.AotConfig.serialize_dir", t)], []


RUNNERS = {
    "AotConfig.serialize_dir": _aot,
    "ExportConfig.output_dir": _export,
    "ExtendConfig.output_dir": _extend,
    "EvalConfig.output_dir": _eval_output,
    "EvalConfig.bm25_dir": _ask_bm25,
    "CorpusConfig.output_dir": _corpus,
    "QueryCacheConfig.output_dir": _query_cache,
    "AnnotateConfig.output_dir": _annotate,
}


def test_every_written_setting_has_a_runner():
  assert sorted(RUNNERS) == sorted(_written()), (
      "each checks.path_setting('writes', ...) field needs a runner in "
      "RUNNERS (its job's command line), so that the harness covers it.")


def _snapshot(path: str) -> dict[str, tuple]:
  """Everything at `path` (not following links): type, mode, bytes."""
  out = {}

  def visit(p, rel):
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
      out[rel] = ("link", os.readlink(p))
    elif stat.S_ISDIR(st.st_mode):
      out[rel] = ("dir", stat.S_IMODE(st.st_mode))
      for name in sorted(os.listdir(p)):
        visit(os.path.join(p, name), f"{rel}/{name}")
    elif stat.S_ISREG(st.st_mode):
      with open(p, "rb") as f:
        out[rel] = ("file", stat.S_IMODE(st.st_mode),
                    hashlib.sha256(f.read()).hexdigest())
    else:
      out[rel] = ("special", stat.S_IFMT(st.st_mode))

  visit(path, ".")
  return out


def _user_files(path) -> str:
  os.makedirs(os.path.join(path, "sub"))
  with open(os.path.join(path, "notes.txt"), "w") as f:
    f.write("the user's notes")
  with open(os.path.join(path, "sub", "data.bin"), "wb") as f:
    f.write(bytes(range(256)))
  return str(path)


CASES = ["user_files", "workdir", "inputs", "another_jobs_output", "link",
         "fifo", "read_only"]


def _targets(case: str, world, inputs, tmp_path) -> list[tuple[str, str]]:
  """(target, victim) pairs of `case`."""
  if case == "user_files":
    d = _user_files(tmp_path / "mine")
    return [(d, d)]
  if case == "workdir":
    return [(world["workdir"], world["workdir"])]
  if case == "inputs":
    return [(world[name], world[name]) for name in inputs]
  if case == "another_jobs_output":
    return [(world["other_index"], os.path.dirname(world["other_index"]))]
  if case == "link":
    victim = _user_files(tmp_path / "victim")
    os.symlink(victim, tmp_path / "link")
    return [(str(tmp_path / "link"), victim)]
  if case == "fifo":
    os.mkfifo(tmp_path / "fifo")
    return [(str(tmp_path / "fifo"), str(tmp_path / "fifo"))]
  assert case == "read_only"
  d = _user_files(tmp_path / "ro")
  for p in (os.path.join(d, "sub"), d):
    os.chmod(p, 0o555)
  return [(d, d)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("setting", _written())
def test_a_written_setting_never_harms_what_the_job_did_not_create(
    world, setting, case, tmp_path):
  runner = RUNNERS.get(setting)
  assert runner, f"no runner for {setting} (see RUNNERS)"
  _, inputs = runner(world, "/unused")
  for target, victim in _targets(case, world, inputs, tmp_path):
    argv, _ = runner(world, target)
    before = _snapshot(victim)
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    if argv[0] == "realm_jax.jobs.aot":
      env.pop("JAX_PLATFORMS")  # realm-aot sets it itself.
    proc = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True,
        timeout=timeouts.HANG_SECONDS, cwd=tmp_path, env=env)
    what = f"{setting}={target} ({case}): exit {proc.returncode}"
    assert _snapshot(victim) == before, f"{what} changed {victim}"
    if proc.returncode:
      assert "Traceback" not in proc.stderr, f"{what}:\n{proc.stderr}"
      assert os.path.basename(target) in proc.stderr.strip().splitlines(
      )[-1], f"{what}: the error does not name the path:\n{proc.stderr}"


def test_the_issues_data_losses_are_refused_in_the_api(world, tmp_path):
  """bm25_dir naming the fine-tuning workdir (`realm_jax.load(...,
  bm25_dir=)` builds through `bm25.for_store`) deletes nothing."""
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  store = block_store.BlockStore.open(world["store"])
  before = _snapshot(world["workdir"])
  with pytest.raises(outputs.OwnershipError,
                     match=r"bm25_dir.*holds checkpoints, index"):
    bm25.for_store(store, world["workdir"])
  assert _snapshot(world["workdir"]) == before
  # An empty directory, or a BM25 index, is the build's to write.
  (tmp_path / "empty").mkdir()
  index = bm25.for_store(store, str(tmp_path / "empty"))
  assert outputs.owner(tmp_path / "empty")["kind"] == "bm25_index"
  assert bm25.for_store(store, str(tmp_path / "empty")).num_rows == (
      index.num_rows)

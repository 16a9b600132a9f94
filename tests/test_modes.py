"""Every file and directory a job creates honours the process umask, as
`open()` and `mkdir()` would: under umask 022 another user (a serving
account, a teammate on a shared workdir) can read every index, block
store, export, checkpoint marker and fetched file; under 077 nobody else
can.

The jobs run in a subprocess that sets its own umask (the umask is
process-wide: tests run side by side under xdist)."""

import json
import os
import stat
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs each writer under each umask given on the command line, into
# <out>/<mask>/; prints nothing (the test walks the trees).
_JOBS = r"""
import importlib.util, os, sys
import numpy as np
from realm_jax import export
from realm_jax.core import checkpoints, io_utils
from realm_jax.data import wikipedia
from realm_jax.index import build
from realm_jax.model import functional
from realm_jax.model.realm import Realm
from realm_jax.testing import corpus, tiny

spec = importlib.util.spec_from_file_location(
    "fetch_public", os.path.join(sys.argv[1], "benchmarks", "data",
                                 "fetch_public.py"))
fetch_public = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = fetch_public
spec.loader.exec_module(fetch_public)

config = tiny.tiny_realm(vocab_size=30522)
_, params = functional.init(lambda r: Realm(config, rngs=r), 0)
docs = [wikipedia.Document(f"Place {i}", f"The river of place {i} is cold. "
                           "It meets the lake.") for i in range(24)]
for mask in sys.argv[3:]:
  os.umask(int(mask, 8))
  out = os.path.join(sys.argv[2], mask)
  store = corpus.write_store(os.path.join(out, "store"), docs, 16)
  workdir = os.path.join(out, "run")
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, keep=2, async_save=False)
  ckpt.save(1, params, {"count": np.zeros(())}, {"seed": 0}, force=True)
  ckpt.wait_until_finished()
  checkpoints.write_done_marker(ckpt_dir, 1)
  io_utils.append_jsonl(os.path.join(workdir, "metrics.jsonl"), {"step": 1})
  io_utils.write_json(os.path.join(workdir, "history.json"), {"steps": [1]})
  for kind, searcher in (("exact", build.IndexBuildConfig(
      searcher="exact")), ("scann", build.IndexBuildConfig(
          searcher_config=(("num_leaves", 2), ("num_leaves_to_search", 2),
                           ("training_sample_size", 20))))):
    build.build_and_publish(
        retriever_params=params["retriever"],
        retriever_config=config.retriever, store=store,
        root=os.path.join(out, "index-" + kind), step=1, config=searcher)
  export.export_model(params, config, os.path.join(out, "export"))
  fetch_public.write_outputs({"a.jsonl": "{}\n", "b.jsonl": "{}\n"},
                             os.path.join(out, "public"))
"""


def _modes(root):
  """{path relative to root: permission bits} of everything below root."""
  modes = {}
  for parent, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(parent, name)
      modes[os.path.relpath(path, root)] = (
          stat.S_IMODE(os.lstat(path).st_mode), os.path.isdir(path))
  return modes


def test_every_output_honours_the_umask(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(
          os.pathsep) if p]))
  subprocess.run([sys.executable, "-c", _JOBS, _ROOT, str(tmp_path),
                  "022", "077"], check=True, env=env, cwd=str(tmp_path))
  for mask in ("022", "077"):
    umask = int(mask, 8)
    modes = _modes(tmp_path / mask)
    # What the issue saw as owner-only must be there, and be checked.
    for path in ("index-exact/LATEST", "index-exact/1/manifest.json",
                 "index-exact/1/searcher", "index-exact/1/searcher/"
                 "searcher.json", "index-scann/1/searcher",
                 "run/checkpoints/DONE", "run/history.json",
                 "run/metrics.jsonl", "store", "store/manifest.json",
                 "export", "public", "public/SHA256SUMS", "public/a.jsonl"):
      assert path in modes, (path, sorted(modes))
    wrong = {path: oct(mode) for path, (mode, is_dir) in modes.items()
             if mode != (0o777 if is_dir else 0o666) & ~umask}
    assert not wrong, (mask, json.dumps(wrong, indent=1))

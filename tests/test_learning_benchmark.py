"""benchmarks/learning.py --prepare_only: a workdir that trains without
TensorFlow (the held-out queries and the questions kept as .npz)."""

import importlib.util
import os

import numpy as np

from realm_jax.data import examples

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _learning(monkeypatch):
  # Importing it adds to $XLA_FLAGS and sets $TF_CPP_MIN_LOG_LEVEL: both
  # are restored after the test.
  for name in ("XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL"):
    monkeypatch.setenv(name, os.environ.get(name, ""))
  spec = importlib.util.spec_from_file_location(
      "learning", os.path.join(_ROOT, "benchmarks", "learning.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_prepare_only_builds_the_inputs_and_trains_nothing(
    tmp_path, capsys, monkeypatch):
  learning = _learning(monkeypatch)
  workdir = tmp_path / "w"
  learning.main([f"--workdir={workdir}", "--people=24", "--heldout=6",
                 "--dev=3", "--conditions=realm,query_side",
                 "--prepare_only"])
  assert "inputs prepared" in capsys.readouterr().out
  names = set(os.listdir(workdir))
  assert {"world", "queries_salient"} <= names
  assert not {"realm", "query_side", "ict"} & names  # nothing trained
  kept = [n for n in names if n.startswith("heldout_queries_")]
  assert len(kept) == 1 and kept[0].endswith(".npz")
  with np.load(workdir / kept[0], allow_pickle=False) as f:
    got = {k: f[k] for k in f.files}
  assert set(got) == set(examples.REALM_QUERY_FEATURES)
  assert len(got["query_ids"]) > 0
  # Each held-out sentence once, masked (salient spans).
  assert len(np.unique(got["query_ids"], axis=0)) == len(got["query_ids"])
  assert (got["mlm_weights"].sum(1) >= 1).all()
  # Prepared again, it is the same file with the same arrays (kept when
  # there, rebuilt identically when not).
  learning.main([f"--workdir={workdir}", "--people=24", "--heldout=6",
                 "--dev=3", "--conditions=realm", "--prepare_only"])
  assert set(os.listdir(workdir)) == names
  os.remove(workdir / kept[0])
  learning.main([f"--workdir={workdir}", "--people=24", "--heldout=6",
                 "--dev=3", "--conditions=realm", "--prepare_only"])
  with np.load(workdir / kept[0], allow_pickle=False) as f:
    for k in got:
      np.testing.assert_array_equal(f[k], got[k])

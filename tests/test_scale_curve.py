"""benchmarks.scale_curve: the scale curve's table from the learning
benchmark's and real_text.py's JSON lines."""

import json

import numpy as np
import pytest

from benchmarks import scale_curve


def _row(condition, step, ranks):
  ranks = np.asarray(ranks)
  return {"condition": condition, "step": step,
          **{f"qa_recall@{k}": float(np.mean(ranks < k))
             for k in (1, 5, 20, 100)},
          "qa_answer_rank": ranks.tolist()}


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_each_realm_run_is_paired_with_its_ict(tmp_path, capsys):
  rng = np.random.default_rng(0)
  ict = rng.integers(0, 200, size=50)
  realm = np.where(rng.random(50) < 0.3, 0, ict)  # found first more often
  small = _write(tmp_path / "n10.jsonl", [
      _row("ict", 300, ict + 7), _row("ict", 600, ict),
      _row("realm", 600, realm),
      {"condition": "realm", "summary": True, "retriever_release_step": 150,
       "train_max_hubness": 0.01, "train_max_null_probability": 0.2}])
  large = _write(tmp_path / "n30.jsonl", [
      _row("ict", 600, ict), _row("realm_seed1", 600, ict),
      {"condition": "realm_seed1", "summary": True,
       "retriever_release_step": None, "train_max_hubness": 0.0,
       "train_max_null_probability": 0.1}])
  bm25 = _write(tmp_path / "bm25.jsonl", [
      {"task": "squad", "retriever": "bm25", "recall@1": 0.5, "recall@5": 0.7,
       "recall@20": 0.8, "recall@100": 0.9},
      {"task": "squad", "retriever": "ict", "recall@1": 0.1, "recall@5": 0.1,
       "recall@20": 0.1, "recall@100": 0.1},  # a checkpoint's: left out
      {"task": "cloze", "retriever": "bm25", "recall@1": 0.1,
       "recall@5": 0.1, "recall@20": 0.1, "recall@100": 0.1}])
  plot = tmp_path / "scale.png"
  scale_curve.main([f"--runs=10={small},30={large}",
                    f"--baselines=10={bm25}", f"--plot={plot}"])
  lines = capsys.readouterr().out.splitlines()
  assert [x.split(" | ")[:3] for x in lines[2:]] == [
      ["| 10", "bm25", "-"], ["| 10", "ict", "600"], ["| 10", "realm", "600"],
      ["| 30", "ict", "600"], ["| 30", "realm_seed1", "600"]]
  d = (realm < 5).astype(float) - (ict < 5)
  want = f"{100 * d.mean():+.1f} +- {100 * d.std(ddof=1) / np.sqrt(50):.1f}"
  assert d.mean() > 0 and want in lines[4]
  assert lines[4].endswith("| 150 | 0.010 | 0.20 |")
  assert lines[6].endswith("| +0.0 +- 0.0 | +0.0 +- 0.0 | never | 0.000 | "
                           "0.10 |")
  assert plot.stat().st_size > 0
  with pytest.raises(SystemExit):  # a run without ICT's ranks
    scale_curve.main([f"--runs=10={bm25}"])
  with pytest.raises(SystemExit):
    scale_curve.main([f"--runs={small}"])  # no number of leads

"""The annotation job's command line (the job itself: test_salient_spans)."""

import json
import os
import subprocess
import sys

from realm_jax.data import salient_spans as ss
from realm_jax.testing import timeouts


def test_command_line(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps(d) + "\n" for d in [
      {"title": "Ada", "text": "Ada Lovelace was born in London in 1815."},
      {"title": "Bob", "text": "Bob Smith moved to Paris in 1901."},
      {"title": "Cid", "text": "Cid lived in Spain."}]))
  out = tmp_path / "annotated"
  result = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.annotate",
       "--gin_file=runs/annotate.gin", f"--gin.INPUT_PATH='{corpus}'",
       f"--gin.OUTPUT_DIR='{out}'", "--gin.AnnotateConfig.num_shards=2",
       "--gin.AnnotateConfig.max_documents=2",
       "--direct_num_workers=1"],  # a Beam option
      capture_output=True, text=True, cwd=tmp_path, check=False,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
      timeout=timeouts.HANG_SECONDS)
  assert result.returncode == 0, result.stderr[-2000:]
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert summary["documents"] == 2 and summary["num_shards"] == 2
  report = json.loads((out / "report.json").read_text())
  assert report["reader"]["documents"] == 2 and report["spans"] >= 4
  assert [d.title for d in ss.read_annotated(ss.shard_path(str(out), 0, 2))
          ] == ["Ada"]

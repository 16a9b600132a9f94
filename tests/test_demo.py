"""The demo's pipeline end to end, at smoke-test size (tiny random BERT).

README's main command runs the same code with MiniLM-L6 and the full demo
sizes; this runs every stage (corpus, annotation, pre-training with the
index builder beside the trainer, fine-tuning, evaluation, ask) on three
articles so that a broken hand-off between jobs fails CI.
"""

import json
import os

from realm_jax import demo


def test_demo_runs_every_stage(tmp_path, capsys):
  config = demo.DemoConfig(
      workdir=str(tmp_path), num_documents=3, max_block_len=48,
      train_steps=2, batch_size=8, num_candidates=2, checkpoint_every=1,
      searcher="exact", finetune_steps=2, finetune_batch_size=8,
      finetune_learning_rate=1e-3, num_retrieved=8, num_reader_blocks=2,
      question_length=16, model="tiny")
  summary = demo.run_demo(config)

  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
           if line.startswith("{")]
  stages = [line["stage"] for line in lines]
  for stage in ("corpus", "salient_spans", "index_builder", "pretrain",
                "pretrain_done", "finetune", "eval", "done"):
    assert stage in stages, stage
  # The builder beside the trainer published index 0 (what the trainer
  # started from), each checkpoint's index, and the final step's (which
  # fine-tuning freezes).
  done = lines[stages.index("pretrain_done")]
  assert done["indices_published"][0] == 0
  assert done["indices_published"][-1] == config.train_steps
  assert os.path.exists(tmp_path / "pretrain" / "index_swaps.json")
  # Evaluation wrote predictions with evidence, for both splits.
  counts = {}
  for split in ("dev", "train"):
    path = tmp_path / "eval" / f"predictions_{split}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all(r["evidence"] for r in records)
    counts[split] = len(records)
  assert summary["dev_questions"] == counts["dev"]
  assert 0.0 <= summary["dev_exact_match"] <= 1.0
  assert 0.0 <= summary["dev_recall_at_5"] <= 1.0

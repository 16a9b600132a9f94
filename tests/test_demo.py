"""The demo's pipeline end to end, at smoke-test size (tiny random BERT).

README's main command runs the same code with MiniLM-L6 and the full demo
sizes; this runs every stage (corpus, annotation, pre-training with the
index builder beside the trainer, fine-tuning, evaluation, ask) on three
articles so that a broken hand-off between jobs fails CI.
"""

import json
import os

import pytest

from realm_jax import demo


def _what_ask_answers_with(ask_gin: str):
  """(EvalConfig.workdir, QA sizes) of `realm_jax.jobs.ask --gin_file=ask_gin`,
  resolved as ask resolves them."""
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import qa_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
  from realm_jax.data import qa_inputs  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    gin_cli.parse([ask_gin], [])
    workdir = gin.get_configurable(qa_eval.EvalConfig)().workdir
    _, qa = qa_eval.checked_run_configs(
        checkpoints.checkpoint_dir(workdir), None,
        gin.get_configurable(RealmConfig)(),
        gin.get_configurable(qa_inputs.QAConfig)(), [])
  finally:
    gin.clear_config()
  return workdir, qa


@pytest.mark.slow  # Minutes (every job): CI runs it after the suite.
def test_demo_runs_every_stage(tmp_path, capsys):
  config = demo.DemoConfig(
      workdir=str(tmp_path), num_documents=3, max_block_len=48,
      train_steps=2, finetune_steps=2, model="tiny",
      pretrain_bindings=(
          "builder.IndexBuildConfig.searcher = 'exact'",
          "pretrain.PretrainConfig.batch_size = 8",
          "pretrain.RetrievalConfig.num_candidates = 2",
          "pretrain.PretrainConfig.checkpoint_every = 1"),
      finetune_bindings=(
          "finetune.FinetuneConfig.batch_size = 8",
          "finetune.FinetuneConfig.learning_rate = 1e-3",
          "qa_inputs.QAConfig.num_retrieved = 8",
          "qa_inputs.QAConfig.num_reader_blocks = 2",
          "qa_inputs.QAConfig.question_length = 16"))
  summary = demo.run_demo(config)

  out = capsys.readouterr().out
  lines = [json.loads(line) for line in out.splitlines()
           if line.startswith("{")]
  stages = [line["stage"] for line in lines]
  for stage in ("corpus", "salient_spans", "index_builder", "pretrain",
                "pretrain_done", "finetune", "eval", "done"):
    assert stage in stages, stage
  # Every logged step is streamed once, in order, before its stage ends.
  assert [l["step"] for l in lines if l["stage"] == "pretrain"] == [1, 2]
  assert stages.index("pretrain") < stages.index("pretrain_done")
  assert [l["step"] for l in lines if l["stage"] == "finetune"] == [2]
  # Each showcased question is shown with its gold answer and a verdict.
  assert out.count("   gold: ") == len(demo.DEMO_QUESTIONS)
  assert out.count("RIGHT") + out.count("WRONG") == len(demo.DEMO_QUESTIONS)
  assert "python -m realm_jax.jobs.ask" in out and "tensorboard" in out
  # The ask hint's gin file names the fine-tuned run, whose checkpoint
  # carries its QA settings: ask answers with those.
  workdir, qa = _what_ask_answers_with(str(tmp_path / "ask.gin"))
  assert workdir == str(tmp_path / "finetune")
  assert (qa.question_length, qa.num_retrieved, qa.num_reader_blocks,
          qa.reader_length) == (16, 8, 2, 16 + 48)
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
  # What pre-training changed: recall at its first and last checkpoint
  # (each with its own index), then after fine-tuning, with EM.
  change = lines[stages.index("retrieval_change")]
  assert (change["start_step"], change["end_step"]) == (0, config.train_steps)
  table = out[out.index("What pre-training changed"):].splitlines()
  assert "recall@1" in table[1] and "EM" in table[1]
  assert table[2].split()[:5] == ["start", "of", "pre-training", "(step",
                                  "0)"]
  assert float(table[2].split()[-2]) == change["start_recall@1"]
  assert table[4].split()[-1] == f"{summary['dev_exact_match']:.3f}"
  assert float(table[4].split()[-2]) == summary["dev_recall_at_5"]
  # Then the same model with the BM25 and the hybrid ranker.
  evals = {l.get("ranker"): l for l in lines
           if l["stage"] == "eval" and l["split"] == "dev"}
  for row, ranker in zip(table[5:7], ("bm25", "hybrid")):
    assert row.split()[:4] == ["after", "fine-tuning,", ranker, "ranker"]
    assert summary[f"dev_recall_at_5_{ranker}"] == evals[ranker]["recall@5"]
    assert row.split()[-2] == f"{evals[ranker]['recall@5']:.3f}"
    assert row.split()[-3] == f"{evals[ranker]['recall@1']:.3f}"
    assert row.split()[-1] == f"{evals[ranker]['exact_match']:.3f}"
  assert (tmp_path / "eval" / "predictions_dev_hybrid.jsonl").exists()
  # A healthy run raises no alarm.
  assert "WARNING" not in out + capsys.readouterr().err
  assert 0.0 <= summary["dev_exact_match"] <= 1.0
  assert 0.0 <= summary["dev_recall_at_5"] <= 1.0


def test_stage_configs_come_from_the_experiment_files(tmp_path):
  """The demo runs experiments/demo_{pretrain,finetune}.gin; its flags only
  override steps, and reader lengths follow the corpus's block length."""
  config = demo.DemoConfig(workdir=str(tmp_path), max_block_len=100,
                           finetune_steps=5)
  assert demo.stages(config) == ("reader_prep", "pretrain", "finetune")
  prep, model, _ = demo.stage_configs(config, "reader_prep")
  assert prep.init_from == "minilm" and prep.num_train_steps == 50
  assert prep.workdir == str(tmp_path / "reader_prep")
  run, model, operative = demo.stage_configs(config, "pretrain")
  assert (run.num_train_steps, run.gate.latest_release) == (8, 4)
  # Pre-training starts from the prepared reader.
  assert run.init_from == "checkpoint:" + str(
      tmp_path / "reader_prep" / "checkpoints")
  assert run.index_mode == "builder"
  # The trainer derives the reader's length: the queries' + the blocks'.
  assert run.reader_length is None
  assert model.retriever.pooling == "mean" and model.retriever.normalize
  assert "num_train_steps = 8" in operative
  # The operative config is what runs: the batch included.
  assert f"batch_size = {run.batch_size}" in operative
  run, model, _ = demo.stage_configs(config, "finetune")
  assert (run.num_train_steps, run.checkpoint_every) == (5, 5)
  assert run.init_from.startswith("checkpoint:")
  assert run.workdir == str(tmp_path / "finetune")
  assert run.qa.reader_length == run.qa.question_length + 100
  assert model.retriever.null_score == "learned_mean"

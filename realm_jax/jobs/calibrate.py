"""`realm-calibrate`: the hybrid ranker's fusion measured on questions of
one's own (`eval.calibrate.calibrate`), written beside the index."""

import json
from typing import Sequence

from absl import logging

from realm_jax import gin_cli
from realm_jax.core import checkpoints, gin_config
from realm_jax.data import block_store, formats, qa_inputs
from realm_jax.eval import calibrate, qa_eval
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.index import calibration, publish, rankers
from realm_jax.model.realm import RealmConfig


def job(dry_run: bool, bindings: Sequence[str] = ()) -> None:
  config = gin_config.configured(calibrate.CalibrateConfig)
  eval_config = gin_config.configured(qa_eval.EvalConfig)
  model_config = gin_config.configured(RealmConfig)
  qa_config = gin_config.configured(qa_inputs.QAConfig)
  if dry_run:
    print(config, eval_config, model_config, sep="\n")
    return
  qa_eval.require(eval_config, block_store="BLOCK_STORE")
  if not config.questions_file:
    raise SystemExit(
        "Set the questions to calibrate on: --gin.CALIBRATION_QUESTIONS="
        "\"'mine.jsonl'\" (CalibrateConfig.questions_file: questions with "
        "answers of your own, ORQA JSONL or SQuAD JSON; never the "
        "evaluation set).")
  try:
    examples = formats.read_questions(config.questions_file,
                                      config.questions_format,
                                      regex_answers=config.regex_answers)
  except (OSError, ValueError, KeyError) as e:
    raise SystemExit(f"CalibrateConfig.questions_file="
                     f"{config.questions_file!r}: {e}") from e
  checkpoint_dir = eval_config.checkpoint_dir or (
      checkpoints.checkpoint_dir(eval_config.workdir)
      if eval_config.workdir else None)
  if checkpoint_dir and not eval_config.init_from:
    model_config, qa_config = qa_eval.checked_run_configs(
        checkpoint_dir, eval_config.step, model_config, qa_config, bindings)
  store = block_store.BlockStore.open(eval_config.block_store)
  model = qa_model_lib.load_qa_model(
      model_config=model_config, store=store, workdir=eval_config.workdir,
      checkpoint_dir=eval_config.checkpoint_dir, step=eval_config.step,
      init_from=eval_config.init_from, index_dir=eval_config.index_dir,
      index_step=eval_config.index_step, qa_config=qa_config,
      batch_size=eval_config.batch_size, ranker=rankers.Dense())
  root = model.index_root
  bm25 = rankers.BM25Ranker.for_store(store, eval_config.bm25_dir)
  source = {"questions_file": config.questions_file,
            "questions_sha256": qa_eval.examples_fingerprint(examples),
            "held_out": config.held_out,
            "weights": ({"init_from": eval_config.init_from}
                        if eval_config.init_from else
                        {"checkpoint_dir": checkpoint_dir,
                         "step": model.params_step})}
  try:
    record = calibrate.calibrate(examples, dense=model.ranker, bm25=bm25,
                                 store=store, index=model.index,
                                 config=config, source=source,
                                 batch_size=max(eval_config.batch_size, 256))
  except ValueError as e:
    raise SystemExit(f"CalibrateConfig.questions_file="
                     f"{config.questions_file!r}: {e}") from e
  path = calibration.write(publish.resolve_index_root(root), record)
  logging.info("wrote %s", path)
  print(json.dumps({"calibration": path, "ranker": record["chosen"],
                    "decision": record["decision"]}))


def main() -> None:
  gin_cli.run(lambda dry_run: job(dry_run, gin_cli.command_line_bindings()),
              runs_file="runs/eval.gin",
              config_class="realm_jax.eval.qa_eval.EvalConfig")


if __name__ == "__main__":
  main()

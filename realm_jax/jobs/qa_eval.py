"""`realm-eval`: open-QA evaluation (`eval.qa_eval`) of a run's checkpoints
as they come, or of imported weights once."""

import dataclasses
import json
import os
from typing import Sequence

import jax

from realm_jax import gin_cli
from realm_jax.core import checkpoints, gin_config, io_utils, outputs
from realm_jax.core import parallel
from realm_jax.data import block_store, formats, qa_inputs
from realm_jax.eval import qa_eval
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.index import publish
from realm_jax.model.realm import RealmConfig


def job(dry_run: bool, bindings: Sequence[str] = ()) -> None:
  config = gin_config.configured(qa_eval.EvalConfig)
  qa_config = gin_config.configured(qa_inputs.QAConfig)
  model_config = gin_config.configured(RealmConfig)
  if dry_run:
    print(config, qa_config, model_config, sep="\n")
    return
  qa_eval.require(config, block_store="BLOCK_STORE", qa_file="QA_FILE")
  workdir = config.workdir
  checkpoint_dir = config.checkpoint_dir or (
      checkpoints.checkpoint_dir(workdir) if workdir else None)
  index_dir = config.index_dir or (checkpoints.index_root(workdir)
                                   if workdir else None)
  if not (checkpoint_dir or config.init_from) or not index_dir:
    raise SystemExit("Set WORKDIR (a run's workdir), or INDEX_DIR and "
                     "INIT_FROM (or EvalConfig.checkpoint_dir).")
  if not config.init_from and qa_eval.has_checkpoint(checkpoint_dir, config):
    model_config, qa_config = qa_eval.checked_run_configs(
        checkpoint_dir, config.step, model_config, qa_config, bindings)
  output_dir = config.output_dir or io_utils.join(
      workdir or os.fspath(io_utils.as_path(io_utils.absolute(
          checkpoint_dir or ".")).parent), "eval")
  # Before any model loads: apart from every input, and an eval directory.
  io_utils.check_apart(output_dir, qa_eval.OUTPUT_SETTING, {
      "EvalConfig.checkpoint_dir (<WORKDIR>/checkpoints)": checkpoint_dir,
      "INDEX_DIR": index_dir, "BLOCK_STORE": config.block_store,
      "QA_FILE": config.qa_file, "EvalConfig.bm25_dir": config.bm25_dir},
                       either_way=(
                           "EvalConfig.checkpoint_dir (<WORKDIR>/checkpoints)",
                           "INDEX_DIR", "BLOCK_STORE", "EvalConfig.bm25_dir"))
  outputs.claim(output_dir, outputs.EVAL_DIR, qa_eval.OUTPUT_SETTING)
  store = block_store.BlockStore.open(config.block_store)
  examples = formats.read_questions(config.qa_file, config.qa_format,
                                    regex_answers=config.regex_answers)
  devices = jax.local_devices()
  mesh = parallel.make_mesh(devices) if len(devices) > 1 else None
  if config.init_from:  # Imported weights: evaluated once.
    qa_model = qa_model_lib.load_qa_model(
        model_config=model_config, store=store, init_from=config.init_from,
        index_dir=index_dir, index_step=config.index_step,
        qa_config=qa_config, batch_size=config.batch_size,
        num_evidence=config.num_evidence, mesh=mesh,
        **qa_eval.ranker_kwargs(config))
    # (The calibration beside the index may have chosen the ranker.)
    config = dataclasses.replace(config, ranker=qa_model.ranker_choice)
    tag = qa_eval.ranker_tag(config)
    predictions = io_utils.join(output_dir, "predictions", "init_from" + (
        "" if tag == "dense" else f".{tag}"))
    metrics = qa_eval.evaluate(
        qa_model, examples, recall_ks=config.recall_ks,
        predictions_path=predictions + ".jsonl",
        dpr_path=predictions + ".dpr.json" if config.dpr_retrieval else None)
    metrics = dict(metrics, **qa_eval.ranker_record(config))
    io_utils.write_json(io_utils.join(output_dir, "init_from_metrics.json"
                                      if tag == "dense" else
                                      f"init_from_metrics.{tag}.json"),
                        dict(metrics, init_from=config.init_from))
    print(json.dumps(metrics))
    return
  result = qa_eval.run_eval_job(
      checkpoint_dir=checkpoint_dir, output_dir=output_dir,
      examples=examples, model_config=model_config,
      index=publish.load_frozen_index(index_dir, store, model_config,
                                      step=config.index_step,
                                      what="INDEX_DIR"),
      store=store, qa_config=qa_config, config=config, mesh=mesh,
      steps=None if config.step is None else [config.step],
      timeout=config.timeout_seconds, index_dir=index_dir)
  for step in result.evaluated:
    print(json.dumps(result.metrics[step]))


def main() -> None:
  gin_cli.run(lambda dry_run: job(dry_run, gin_cli.command_line_bindings()),
              runs_file="runs/eval.gin",
              config_class="realm_jax.eval.qa_eval.EvalConfig")


if __name__ == "__main__":
  main()

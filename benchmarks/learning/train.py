"""The jobs a learning benchmark run trains with, each the real one.

`train_ict`: the ICT warm start every REALM condition of --seed shares.
`pretrain`: one condition's REALM pre-training from it (or, MiniLM, from
the reader that `reader_prep` prepared on the condition's queries), its
checkpoints evaluated and its summary row written: the training-time
guards' worst values and the gate's and the recall guard's decisions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from benchmarks.learning.evaluate import Evaluator
from benchmarks.learning.prepare import configs, Inputs


def ict_checkpoints(inputs: Inputs) -> str:
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  return checkpoints.checkpoint_dir(os.path.join(inputs.args.workdir, "ict"))


def train_ict(inputs: Inputs, evaluator: Evaluator, evaluate: bool) -> None:
  """The ICT warm start every REALM condition shares (--seed's); with
  `evaluate`, the rows of its checkpoints (condition `ict`)."""
  from realm_jax.training import ict  # pylint: disable=g-import-not-at-top
  args, ict_dir = inputs.args, os.path.join(inputs.args.workdir, "ict")
  t0 = time.time()
  gin, model = configs(args.gin_file, inputs.base + [
      f"ict.IctTrainConfig.workdir = '{ict_dir}'",
      f"ict.IctTrainConfig.num_train_steps = {args.ict_steps}",
      f"ict.IctTrainConfig.checkpoint_every = {args.ict_steps // 4}",
      "ict.IctTrainConfig.keep_checkpoints = 10",
      # ICT never scores the null document; leaving the learned null
      # score out of its checkpoints lets both null modes start from it.
      "realm.RetrieverConfig.null_score = 'embedding'",
      f"ict.IctTrainConfig.seed = {args.seed}"])
  ict.train(config=gin.get_configurable(ict.IctTrainConfig)(), model=model)
  if evaluate:
    evaluator.evaluate_run("ict", model, ict_checkpoints(inputs),
                           time.time() - t0, args.ict_steps // 4)


def _prepared_reader(inputs: Inputs, condition: str, queries: str) -> list[str]:
  """MiniLM's reader prepared on the condition's queries (its own job,
  `reader_prep`: MiniLM has no MLM head); the binding that starts
  pre-training from it."""
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.training import reader_prep  # pylint: disable=g-import-not-at-top
  prep_dir = os.path.join(inputs.args.workdir,
                          condition + inputs.suffix + "_reader")
  gin, model = inputs.condition_configs(
      condition, f"reader_prep.ReaderPrepConfig.workdir = '{prep_dir}'",
      f"reader_prep.ReaderPrepConfig.queries = '{queries}'",
      f"reader_prep.ReaderPrepConfig.seed = {inputs.args.seed}")
  reader_prep.train(
      config=gin.get_configurable(reader_prep.ReaderPrepConfig)(),
      model=model)
  return [f"pretrain.PretrainConfig.init_from = "
          f"'checkpoint:{checkpoints.checkpoint_dir(prep_dir)}'"]


def pretrain(inputs: Inputs, evaluator: Evaluator, condition: str) -> None:
  """Pre-trains one condition, evaluates its checkpoints and writes its
  summary row (worst guard values, gate and guard decisions)."""
  from realm_jax.core import checkpoints, gin_config  # pylint: disable=g-import-not-at-top
  from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
  from realm_jax.index import publish  # pylint: disable=g-import-not-at-top
  from realm_jax.training import pretrain as pretrain_job  # pylint: disable=g-import-not-at-top
  args, name = inputs.args, condition + inputs.suffix
  workdir = os.path.join(args.workdir, name)
  inputs.condition_configs(condition)
  queries = inputs.queries_for(
      gin_config.configured(examples.RealmQueryConfig))
  start = ([f"pretrain.PretrainConfig.init_from = "
            f"'checkpoint:{ict_checkpoints(inputs)}'"] if args.scratch
           else _prepared_reader(inputs, condition, queries))
  gin, model = inputs.condition_configs(
      condition, f"pretrain.PretrainConfig.workdir = '{workdir}'",
      "pretrain.PretrainConfig.keep_checkpoints = 1000", *start)
  config = gin.get_configurable(pretrain_job.PretrainConfig)()
  # A gate or guard on the training queries follows the condition's
  # masking.
  def masked(path):
    return queries if path == config.queries else path
  config = dataclasses.replace(
      config, queries=queries, gate=dataclasses.replace(
          config.gate, queries=masked(config.gate.queries)),
      recall_guard=dataclasses.replace(
          config.recall_guard, queries=masked(config.recall_guard.queries)))
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  # The fixed warm-up (gate "steps") is the same for every condition but
  # `realm_original`: it runs once, in `realm`'s workdir, and the others
  # resume from its last checkpoint with their own settings.
  shared = condition not in ("realm", "realm_original") and inputs.warmup
  if shared and not os.path.exists(ckpt_dir):
    source = os.path.join(checkpoints.checkpoint_dir(
        os.path.join(args.workdir, "realm" + inputs.suffix)),
                          str(inputs.warmup))
    shutil.copytree(source, os.path.join(ckpt_dir, str(inputs.warmup)))
  t0 = time.time()
  pretrain_job.train(config=config, model=model)
  seconds = time.time() - t0
  # Query-side: the document tower never moves, so every checkpoint's
  # blocks are the run's one index (not embedded again per checkpoint).
  block_emb = (publish.load_index(checkpoints.index_root(workdir)).embeddings
               if config.retriever.training == "query_side" else None)
  evaluator.evaluate_run(name, model, ckpt_dir, seconds, args.eval_every,
                         first=inputs.warmup + 1 if shared else 0,
                         block_emb=block_emb)
  evaluator.write(summary(name, workdir, seconds, args.steps))
  print(json.dumps(evaluator.rows[-1]), flush=True)


def summary(name: str, workdir: str, seconds: float, steps: int) -> dict:
  """The training-time guards, for the doc: worst logged values (from
  the run's metrics.jsonl, so that a resumed run reports them too), the
  release step (None: never) and the gate's and the guard's decisions."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    logged = [json.loads(line) for line in f]
  worst = {"condition": name, "summary": True,
           "train_max_hubness": max(h["hubness"] for h in logged),
           "train_max_null_probability": max(h["null_probability"]
                                             for h in logged),
           "train_seconds": round(seconds, 1)}
  if "retriever_release_step" in logged[-1]:
    release = int(logged[-1]["retriever_release_step"])
    worst["retriever_release_step"] = release if release < steps else None
  for key, file in (("gate", "gate.jsonl"),
                    ("recall_guard", "recall_guard.jsonl")):
    decisions = os.path.join(workdir, file)
    if os.path.exists(decisions):
      with open(decisions, encoding="utf-8") as f:
        worst[key] = [json.loads(line) for line in f]
  return worst

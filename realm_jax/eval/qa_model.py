"""The answering model: REALM over a frozen index, batched, from checkpoints.

`QAModel` is the inference object shared by the evaluation
(`realm_jax.eval.qa_eval`), `python -m realm_jax.jobs.ask` and the demo:
question -> query embedding -> top K blocks of a frozen published index ->
reader over the top R -> the (block, span) with the highest joint score
(span score + retrieval logit, REALM's prediction rule), returned with the
evidence blocks and their p(z|x) = softmax of the retrieval logits over all
K retrieved blocks (so the shown probabilities sum to <= 1). It works with
this codebase's checkpoints and with imported released checkpoints
(`init_from`, e.g. "orqa:<ckpt>", whose index is their `block_emb`
published by `python -m realm_jax.jobs.index_builder --gin_file=...
--gin_file=runs/index_builder.gin
--gin.builder.BuilderConfig.init_from="'block_emb:<encoded.ckpt>'"`).

    model = load_qa_model(model_config=..., store=..., workdir=...)
    result = model.predict(["Where was Mozart born?"])[0]
    result.prediction, result.score, result.evidence[0].probability
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from typing import Any, Sequence

from absl import logging
import jax
import numpy as np

from realm_jax.checkpoint_import import core, exported
from realm_jax.core import checkpoints, checks, dataclass_json, parallel
from realm_jax.data import qa as qa_lib
from realm_jax.data import qa_inputs
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import calibration, embed, publish, rankers
from realm_jax.model import functional
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.checkpoint_import import init_from as init_lib


# ----------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Evidence:
  """One retrieved block shown with an answer.

  Attributes:
    block_id: row of the block store.
    rank: 0-based rank among the retrieved blocks.
    title: the block's article title.
    text: the block's text.
    probability: p(z|x), softmax of the retrieval logits over all K
      retrieved blocks.
    retrieval_logit: f(x, z) = Embed(x) . Embed(z).
    has_answer: an answer occurs in the text (None without answers).
    found_by: which ranker found the block and at what 1-based rank in
      its own list, e.g. {"dense": 3, "bm25": 1} (hybrid: one or both).
  """
  block_id: int
  rank: int
  title: str
  text: str
  probability: float
  retrieval_logit: float
  has_answer: bool | None = None
  found_by: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class QAResult:
  """The answer to one question and where it came from.

  Attributes:
    question: the question.
    prediction: the answer span, as it is written in the block's text.
    score: its joint score (span score + retrieval logit); -inf when no
      block could be read.
    block_id: the block the answer came from (-1 for none).
    evidence: the top blocks (and the answer's block if not among them).
    retrieved_ids: block ids in rank order (K, or the recall depth if
      deeper).
    retrieved_scores: the ranker's scores: dense, the index's inner
      products Embed(x) . Embed(z) (the retrieval logits divided by the
      retriever's `score_scale`); bm25, BM25 scores; hybrid, fused ones.
    answers: reference answers, when given.
    is_regex: the answers are regular expressions.
    correct: exact match (regex match) against the answers.
    retrieved_has_answer: per retrieved block, an answer is in its text.
    reader_has_answer: the reader could select an answer (the reader
      oracle of `realm_jax.eval.qa_eval`).
  """
  question: str
  prediction: str
  score: float
  block_id: int
  evidence: list[Evidence]
  retrieved_ids: list[int]
  retrieved_scores: list[float] = dataclasses.field(default_factory=list)
  answers: list[str] | None = None
  is_regex: bool = False
  correct: bool | None = None
  retrieved_has_answer: list[bool] | None = None
  reader_has_answer: bool | None = None

  def to_json(self) -> dict[str, Any]:
    """A JSON-ready dict (non-finite floats become null)."""
    out = dataclasses.asdict(self)
    out["score"] = _finite_or_none(self.score)
    out["retrieved_scores"] = [_finite_or_none(x)
                               for x in self.retrieved_scores]
    for e in out["evidence"]:
      e["retrieval_logit"] = _finite_or_none(e["retrieval_logit"])
    return out


def _finite_or_none(x: float) -> float | None:
  return float(x) if math.isfinite(x) else None


def check_question(question: str, tokenizer: Tokenizer,
                   question_length: int) -> str | None:
  """Refuses a question that asks nothing; says when one is cut.

  The model reads `[CLS] question [SEP]` in `question_length` wordpieces,
  so a longer question loses its end; an empty one would still be answered
  (with whatever the empty query retrieves), which hides a mistake.

  Args:
    question: the question.
    tokenizer: the model's tokenizer.
    question_length: `QAConfig.question_length`.

  Returns:
    None, or a warning saying how many of its wordpieces were kept.

  Raises:
    TypeError: not a str.
    ValueError: empty, whitespace or nothing the tokenizer keeps.
  """
  _refuse_non_question(question, "The question")
  num_pieces = len(tokenizer.tokenize([question])[0])
  if not num_pieces:
    raise ValueError(f"The question {question!r} has no wordpieces (only "
                     "characters the tokenizer drops); ask in words.")
  kept = question_length - 2  # [CLS] and [SEP].
  if num_pieces <= kept:
    return None
  start = question[:60] + ("..." if len(question) > 60 else "")
  return (f"The question {start!r} was cut: {kept} of its {num_pieces} "
          f"wordpieces were kept (QAConfig.question_length={question_length}"
          " holds [CLS] and [SEP] too); the rest was not read.")


# ----------------------------------------------------------------------------
# The inference object
# ----------------------------------------------------------------------------


def qa_model_config(config: RealmConfig) -> RealmConfig:
  """The model that answers: span head on, MLM head off (not used)."""
  return dataclasses.replace(config, reader=dataclasses.replace(
      config.reader, mlm_head=False, span_head=True))


@functools.lru_cache(maxsize=8)
def _compiled(model_config: RealmConfig, mesh):
  """(embed_queries, qa_logits) jitted once per model config and mesh."""
  graphdef, _ = functional.abstract_init(
      lambda r: Realm(model_config, rngs=r))

  def logits(params, batch):
    return functional.bind(graphdef, params).qa_logits(batch)

  batch = parallel.BATCH
  return (embed.make_query_embedder(graphdef, mesh),
          parallel.data_parallel(logits, mesh,
                                 in_specs=(parallel.REPLICATED, batch),
                                 out_specs=(batch, batch)))


UNTRAINED_SPAN_HEAD = (
    "the reader's span head is not trained (freshly initialised): answers "
    "are nonsense until it is fine-tuned; retrieval recall is valid. "
    "Fine-tune with `python -m realm_jax.jobs.finetune "
    "--gin_file=models/<model>.gin --gin_file=runs/finetune.gin "
    "--gin.INIT_FROM=\"'<these weights>'\" ...` and answer with its "
    "workdir.")


def _fit_params(model_config: RealmConfig, loaded: dict[str, Any],
                where: str, seed: int = 0) -> tuple[dict[str, Any], bool]:
  """`loaded` reshaped to the answering model's tree, and whether it has
  a (trained) span head.

  Items the answering model does not use (the MLM head of a pre-training
  or fine-tuning checkpoint) are dropped. A missing span head (a
  pre-trained, not fine-tuned, checkpoint) is freshly initialised with a
  warning: its answers mean nothing but recall@k still does (REALM's
  zero-shot retrieval recall). Anything else missing is an error.
  """
  _, abstract = functional.abstract_init(
      lambda r: Realm(model_config, rngs=r))
  want, got = core.flatten(abstract), core.flatten(loaded)
  wrong = [f"{'/'.join(p)}: {np.shape(got[p])} vs model {want[p].shape}"
           for p in want if p in got and np.shape(got[p]) != want[p].shape]
  missing = [p for p in want if p not in got]
  span_head = ("reader", "span_head")
  if wrong or any(p[:2] != span_head for p in missing):
    raise core.CheckpointMismatchError(
        where, ["/".join(p) for p in missing], [], wrong)
  dropped = sorted({"/".join(p[:2]) for p in got if p not in want})
  if dropped:
    logging.info("%s: not used for answering: %s", where, dropped)
  out = {p: got[p] for p in want if p in got}
  if missing:
    logging.warning("%s: %s", where, UNTRAINED_SPAN_HEAD)
    _, fresh = functional.init(lambda r: Realm(model_config, rngs=r), seed)
    fresh = core.flatten(fresh)
    out.update({p: fresh[p] for p in missing})
  return core.unflatten(out), not missing


# ----------------------------------------------------------------------------
# The configs a checkpoint carries
# ----------------------------------------------------------------------------


def run_index_dir(checkpoint_dir: str, step: int | None = None) -> str:
  """The index a run's checkpoint answers with when none is given: the
  one it trained against (a fine-tuning run's `index_dir`, in its task
  config), else the run's own `<workdir>/index`."""
  step = checkpoints.newest_step(checkpoint_dir) if step is None else step
  task = checkpoints.read_meta(checkpoint_dir, step).get("task_config")
  return (task or {}).get("index_dir") or checkpoints.index_root(
      os.path.dirname(os.fspath(checkpoint_dir).rstrip("/")))


def without_span_head(params: dict[str, Any]) -> dict[str, Any]:
  """`params` less the reader's span head: an untrained one is dropped, so
  that `_fit_params` announces it (and initialises it) like a missing one."""
  return dict(params, reader={k: v for k, v in params["reader"].items()
                              if k != "span_head"})


def checkpoint_params(checkpoint_dir: str, step: int,
                      **kwargs) -> dict[str, Any]:
  """The retriever and reader of checkpoint `step` to answer with, less a
  span head that its meta says was never trained (a pre-training or ICT
  checkpoint's), so that loading announces it (`without_span_head`).

  Args:
    checkpoint_dir, step: the checkpoint.
    **kwargs: more `checkpoints.restore_items` arguments (`way_out`).
  """
  params = checkpoints.restore_items(checkpoint_dir, step,
                                     checkpoints.PARAM_ITEMS, **kwargs)
  if span_head_trained(checkpoints.read_meta(checkpoint_dir, step)) is False:
    params = without_span_head(params)
  return params


_SPAN_HEAD = ("reader", "span_head")


def _marked_span_head(fresh: dict[str, Any]) -> dict[str, Any]:
  """`fresh` with its span head's leaves all NaN: what `initial_params`
  leaves of them shows that the imported weights had none."""
  flat = core.flatten(fresh)
  return core.unflatten({
      p: np.full(np.shape(v), np.nan, np.asarray(v).dtype)
      if p[:2] == _SPAN_HEAD else v for p, v in flat.items()})


def _span_head_imported(params: dict[str, Any], fresh: dict[str, Any]
                        ) -> tuple[dict[str, Any], bool]:
  """(`params` with `fresh`'s leaves back where the NaN mark of
  `_marked_span_head` is left, whether `initial_params` filled the span
  head from the imported weights). Neither identity (a Hugging Face BERT,
  `minilm`, is merged into the whole fresh tree and comes back as copies)
  nor the values of a fresh head (a trained head may start as one) could
  tell."""
  flat, before = core.flatten(params), core.flatten(fresh)
  marked = {p for p, v in flat.items() if p[:2] == _SPAN_HEAD
            and np.isnan(np.asarray(v)).all()}
  imported = any(p[:2] == _SPAN_HEAD and p not in marked for p in flat)
  flat.update({p: before[p] for p in marked})
  return core.unflatten(flat), imported


def _init_checkpoint_untrained(init_from: str) -> bool:
  """Whether `init_from` is `checkpoint:<dir>[@step]` whose meta, or
  `export:<dir>` whose realm_config.json, says its span head was not
  trained."""
  kind, _, rest = init_from.partition(":")
  if kind == "export":
    return exported.span_head_trained(rest) is False
  if kind != "checkpoint":
    return False
  what = f"init_from='checkpoint:{rest}'"
  directory, step = checkpoints.parse_step_suffix(rest, what)
  step = checkpoints.existing_step(directory, step, name=what)
  return span_head_trained(checkpoints.read_meta(directory, step)) is False


def span_head_trained(meta: dict[str, Any]) -> bool | None:
  """Whether a checkpoint's reader span head was trained, by its meta.

  Fine-tuning records `span_head_trained`; checkpoints written before it
  did tell by their task (only fine-tuning trains the span head, though
  pre-training checkpoints carry an untrained one). None: the meta does
  not say (the presence of span-head parameters decides).
  """
  if "span_head_trained" in meta:
    return bool(meta["span_head_trained"])
  if "task_class" in meta:
    return meta["task_class"] == "FinetuneConfig"
  return None



def configs_of(directory: str, step: int) -> dict[str, Any]:
  """The meta of checkpoint `step` of `directory`, which must carry the
  model config (ValueError otherwise; FileNotFoundError or TypeError for
  a step that is not there)."""
  step = checkpoints.existing_step(directory, step)
  meta = checkpoints.read_meta(directory, step)
  if "model_config" not in meta:
    raise ValueError(
        f"Checkpoint {directory}/{step} carries no model config (written "
        "before configs were saved in checkpoints): use "
        "qa_model.load_qa_model with the run's model config, or the ask "
        "command with the run's gin files.")
  return meta


def _run_qa_config(meta: dict[str, Any], where: str
                   ) -> qa_inputs.QAConfig | None:
  """The QA sizes a fine-tuning checkpoint's meta carries, else None (other
  runs, and checkpoints written before configs were saved)."""
  if meta.get("task_class") != "FinetuneConfig":
    return None
  return qa_inputs.qa_config_of_task(meta.get("task_config") or {},
                                     f"{where}:task_config")


def run_configs(directory: str, step: int) -> tuple[
    RealmConfig, qa_inputs.QAConfig | None, dict[str, Any]]:
  """(model config, the QA sizes of a fine-tuning run or None, the task
  config as JSON) from checkpoint `step` of `directory`."""
  meta = configs_of(directory, step)
  where = f"{directory}/{step}/meta"
  model_config = dataclass_json.from_dict(
      RealmConfig, meta["model_config"], f"{where}:model_config")
  return (model_config, _run_qa_config(meta, where),
          meta.get("task_config") or {})


class QAModel:
  """Answers questions with REALM over a frozen published index.

  Batched: `predict` runs `batch_size` questions per call of the jitted
  model (the last batch is padded and the padding dropped); with a `mesh`
  the batch is split over its `data` axis (`parallel.data_parallel`).
  """

  def __init__(self, model_config: RealmConfig, params: dict[str, Any],
               index: publish.PublishedIndex, store,
               qa_config: qa_inputs.QAConfig = qa_inputs.QAConfig(), *,
               tokenizer: Tokenizer | None = None, mesh=None,
               batch_size: int = 8, num_evidence: int = 5,
               step: int | None = None,
               ranker: str | rankers.RankerChoice = "dense",
               bm25_dir: str | None = None):
    """Builds the answering model.

    Args:
      model_config: the REALM config (its reader gets a span head).
      params: {"retriever", "reader"}; an MLM head is ignored.
      index: the frozen index of the block store (row i = block i).
      store: the block store.
      qa_config: sizes; K and R are capped at the corpus size. Answer
        spans are up to the reader's `ReaderConfig.max_span_width`.
      tokenizer: default: the BERT uncased vocabulary of the store.
      mesh: a 1-D `data` mesh over local devices, or None for one device.
      batch_size: questions per model call (a multiple of the mesh size).
      num_evidence: evidence blocks per answer by default.
      step: the checkpoint step, for the record.
      ranker: which blocks the reader reads: a `rankers.RankerChoice`
        (`rankers.Dense()`: the query tower over `index`; `BM25()`: BM25
        over `store`, its index found or built beside the store;
        `Hybrid(fusion)`: both fused) or its name (`rankers.CHOICES`).
        p(z|x) is always the retriever's softmax over the ranked blocks
        (their embeddings are the index's).
      bm25_dir: the BM25 index (default beside the store).
    """
    self.ranker_choice = rankers.choice(ranker, where="ranker")
    # The index root it was loaded from (`load_qa_model`; None: not known).
    self.index_root: str | None = None
    self.model_config = qa_model_config(model_config)
    self.store = store
    self.index = index
    self.tokenizer = tokenizer or Tokenizer()
    store.check_vocab(self.tokenizer.vocab_path)
    fingerprint = index.manifest.get("corpus_fingerprint")
    if index.embeddings.shape[0] != len(store) or (
        fingerprint not in (None, store.fingerprint)):
      raise ValueError(
          f"Index {index.step} ({index.embeddings.shape[0]} rows, corpus "
          f"{fingerprint}) was not built from this block store ({len(store)}"
          f" blocks, {store.fingerprint}); publish an index of this store.")
    k = min(qa_config.num_retrieved, len(store))
    self.qa_config = dataclasses.replace(
        qa_config, num_retrieved=k,
        num_reader_blocks=min(qa_config.num_reader_blocks, k))
    max_len = self.model_config.reader.bert.max_position_embeddings
    if self.qa_config.reader_length > max_len:
      raise ValueError(
          f"QAConfig.reader_length={self.qa_config.reader_length} exceeds "
          f"the reader's max_position_embeddings={max_len}.")
    n_devices = 1 if mesh is None else mesh.devices.size
    if mesh is not None and any(
        d.process_index != jax.process_index() for d in mesh.devices.flat):
      raise ValueError("QAModel's mesh must hold local devices only (the "
                       "eval job is a single-process side job).")
    if batch_size < 1 or batch_size % n_devices:
      raise ValueError(f"batch_size={batch_size} must be a positive multiple"
                       f" of the mesh's {n_devices} devices.")
    if num_evidence < 1:
      raise ValueError(f"num_evidence={num_evidence} must be >= 1.")
    self.mesh = mesh
    self.batch_size = batch_size
    self.num_evidence = num_evidence
    self._embed, self._qa_logits = _compiled(self.model_config, mesh)
    # BM25's index, found or built once (shared by `with_params` copies).
    self._bm25 = (rankers.BM25Ranker.for_store(store, bm25_dir)
                  if self.ranker_choice.reads_bm25 else None)
    self._set_params(params, step)

  # -- Construction from checkpoints.

  @classmethod
  def from_checkpoint(cls, checkpoint_dir: str, step: int | None = None, *,
                      model_config: RealmConfig, index, store,
                      **kwargs) -> QAModel:
    """From a realm_jax checkpoint directory (newest step by default);
    only its `retriever` and `reader` items are read."""
    step = checkpoints.newest_step(checkpoint_dir) if step is None else step
    params = checkpoint_params(checkpoint_dir, step, way_out=(
        "answer with an older step: step={older} (realm_jax.load(..., "
        "step={older}); realm-ask and the eval job: "
        "--gin.qa_eval.EvalConfig.step={older})"))
    return cls(model_config, params, index, store, step=step, **kwargs)

  @classmethod
  def from_init(cls, init_from: str, *, model_config: RealmConfig, index,
                store, seed: int = 0, **kwargs) -> QAModel:
    """From an `init_from` string (`realm_jax.checkpoint_import.init_from`).

    E.g. "orqa:<ckpt>" (a released fine-tuned checkpoint), "hf_realm:...",
    "realm:<embedder>,<bert>" or "checkpoint:<dir>[@step]". For released
    weights the index comes from their `block_emb`, published with
    `build.publish_embeddings` (or `python -m realm_jax.jobs.index_builder
    ... --gin.builder.BuilderConfig.init_from="'block_emb:<ckpt>'"`).
    """
    both_heads = dataclasses.replace(model_config, reader=dataclasses.replace(
        model_config.reader, mlm_head=True, span_head=True))
    _, fresh = functional.init(lambda r: Realm(both_heads, rngs=r), seed)
    params, imported = _span_head_imported(init_lib.initial_params(
        both_heads, _marked_span_head(fresh), init_from), fresh)
    if not imported or _init_checkpoint_untrained(init_from):
      # Left fresh by `initial_params` (MiniLM, BERT, REALM pre-training
      # have none), or a realm_jax checkpoint that says it was not trained:
      # dropped, and initialised again with a warning (`_fit_params`).
      params = without_span_head(params)
    return cls(model_config, params, index, store, **kwargs)

  def with_params(self, params: dict[str, Any],
                  step: int | None = None) -> QAModel:
    """The same model (compiled functions, index, store) with new params."""
    other = copy.copy(self)
    other._set_params(params, step)  # pylint: disable=protected-access
    return other

  def _set_params(self, params: dict[str, Any], step: int | None) -> None:
    params, self.span_head_trained = _fit_params(
        self.model_config, params, f"params of step {step}")
    self.params = jax.device_put(params, jax.local_devices()[0]
                                 if self.mesh is None else
                                 parallel.replicated(self.mesh))
    self.params_step = step
    # The dense ranker embeds with these parameters (a copy made by
    # `with_params` gets its own).
    self.ranker = self.ranker_choice.make(
        lambda: rankers.DenseRanker(self.index, self._embed_questions),
        lambda: self._bm25)

  def _embed_questions(self, questions: Sequence[str]) -> np.ndarray:
    """float32 [Q, D]: the query tower's embeddings (batches padded to
    `batch_size`, over the mesh)."""
    out = []
    for lo in range(0, len(questions), self.batch_size):
      chunk = list(questions[lo:lo + self.batch_size])
      padded = chunk + [chunk[-1]] * (self.batch_size - len(chunk))
      q = self._place(qa_inputs.tokenize_questions(
          self.tokenizer, padded, self.qa_config.question_length))
      out.append(np.asarray(self._embed(self.params, q["question_ids"],
                                        q["question_mask"]),
                            np.float32)[:len(chunk)])
    return np.concatenate(out)

  def _place(self, batch: dict[str, np.ndarray]):
    return (batch if self.mesh is None else
            parallel.shard_batch(self.mesh, batch))

  # -- Prediction.

  def check_question(self, question: str) -> str | None:
    """`check_question` with this model's tokenizer and question length:
    ValueError for an empty question, a warning for a cut one."""
    return check_question(question, self.tokenizer,
                          self.qa_config.question_length)

  def ask(self, question: str, top_k: int | None = None) -> QAResult:
    """One question's answer: `.prediction`, `.score`, `.evidence` (the
    top_k blocks, default the model's num_evidence, with p(z|x)).

    Raises ValueError for an empty or whitespace question; a question
    longer than `QAConfig.question_length` is answered from its first
    wordpieces with a logged warning saying how many were kept.
    """
    warning = self.check_question(question)
    if warning:
      logging.warning("%s", warning)
    return self.predict([question], num_evidence=top_k)[0]

  def predict(self, questions: Sequence[str], *,
              answers: Sequence[Sequence[str]] | None = None,
              is_regex: bool | Sequence[bool] = False,
              num_evidence: int | None = None,
              recall_depth: int = 0) -> list[QAResult]:
    """Answers questions, with evidence (and correctness given answers).

    Args:
      questions: question strings.
      answers: per question, its reference answers (enables `correct`,
        `retrieved_has_answer`, `reader_has_answer`).
      is_regex: the answers are regular expressions (one flag, or one per
        question).
      num_evidence: evidence blocks per answer (default: the model's).
      recall_depth: retrieve at least this deep for `retrieved_has_answer`
        (capped at the corpus size); the model itself reads K.

    Raises:
      TypeError: `questions` is one string (not a list of them), or holds
        something other than strings; an item of `answers` is one string
        (not a list of them).
      ValueError: an empty or whitespace question.
    """
    questions = _question_list(questions)
    n = len(questions)
    if answers is not None:
      answers = _answer_lists(answers, n)
    regex = ([bool(is_regex)] * n if isinstance(is_regex, (bool, np.bool_))
             else [bool(x) for x in is_regex])
    if len(regex) != n:
      raise ValueError(f"{len(regex)} is_regex flags for {n} questions.")
    num_evidence = (self.num_evidence if num_evidence is None else
                    checks.positive_count(
                        num_evidence, "top_k (num_evidence)",
                        "how many evidence blocks to return with the answer"))
    out = []
    for lo in range(0, n, self.batch_size):
      hi = min(n, lo + self.batch_size)
      out.extend(self._predict_batch(
          questions[lo:hi], None if answers is None else answers[lo:hi],
          regex[lo:hi], num_evidence, recall_depth))
    return out

  def _predict_batch(self, questions, answers, regex, num_evidence,
                     recall_depth) -> list[QAResult]:
    cfg, store, n = self.qa_config, self.store, len(questions)
    padded = questions + [questions[-1]] * (self.batch_size - n)
    q = qa_inputs.tokenize_questions(self.tokenizer, padded,
                                     cfg.question_length)
    depth = min(len(store), max(cfg.num_retrieved, recall_depth))
    ranking = self.ranker.rank(padded, depth)
    ids, scores = ranking.ids, ranking.scores
    batch = qa_inputs.qa_batch(q, ids[:, :cfg.num_retrieved],
                               self.index.embeddings, store, cfg)
    retrieval, reader = self._qa_logits(self.params, self._place(
        {k: batch[k] for k in qa_inputs.MODEL_FEATURES}))
    retrieval = np.asarray(retrieval, np.float64)[:n]
    batch = {k: v[:n] for k, v in batch.items()}
    preds = qa_inputs.decode_predictions(np.asarray(reader)[:n], batch,
                                         self.tokenizer)
    texts = self._answer_texts(preds, batch)
    probs = _softmax(retrieval)
    if answers is not None:
      # Block ids < 0: the searcher found fewer blocks than asked for.
      flags = [qa_lib.has_answer_batch(
          [store.text(b) if b >= 0 else "" for b in ids[i]], answers[i],
          regex[i]) & (ids[i] >= 0) for i in range(n)]
      oracle = self._reader_oracle(batch, answers, regex, flags)
    results = []
    for i in range(n):
      ranks = [r for r in range(min(num_evidence, cfg.num_retrieved))
               if batch["retrieved_mask"][i, r]]
      best = preds[i]
      answer_rank = [r for r in range(cfg.num_reader_blocks)
                     if batch["retrieved_ids"][i, r] == best.block_id]
      has_span = math.isfinite(best.score)
      if has_span and answer_rank and answer_rank[0] not in ranks:
        ranks.append(answer_rank[0])
      evidence = [Evidence(
          block_id=int(ids[i, r]), rank=r, title=store.title(ids[i, r]),
          text=store.text(ids[i, r]), probability=float(probs[i, r]),
          retrieval_logit=float(retrieval[i, r]),
          has_answer=None if answers is None else bool(flags[i][r]),
          found_by={name: int(found[i, r]) + 1 for name, found in
                    ranking.sources.items() if found[i, r] >= 0})
                  for r in ranks]
      result = QAResult(
          question=questions[i], prediction=texts[i] if has_span else "",
          score=best.score, block_id=best.block_id if has_span else -1,
          evidence=evidence, retrieved_ids=[int(x) for x in ids[i]],
          retrieved_scores=[float(x) for x in scores[i]],
          is_regex=regex[i])
      if answers is not None:
        result.answers = list(answers[i])
        result.correct = qa_lib.is_correct(result.prediction, answers[i],
                                           regex[i])
        result.retrieved_has_answer = [bool(x) for x in flags[i]]
        result.reader_has_answer = bool(oracle[i])
      results.append(result)
    return results

  def _answer_texts(self, preds, batch) -> list[str]:
    """The predicted spans as written in the blocks' texts.

    ORQA answers with the block's original words; decoding wordpieces
    would turn "Stratford-upon-Avon" into "stratford - upon - avon", which
    the normaliser no longer matches. The block text is re-tokenised with
    byte offsets (input bytes: FastBertTokenizer); if its wordpieces are
    not the stored ones (e.g. a sentence cut by the packer), the decoded
    wordpieces are used instead.
    """
    texts = [self.store.text(max(p.block_id, 0)) for p in preds]
    tokenized = self.tokenizer.tokenize_with_offsets(texts)
    out = []
    for i, (p, text, (ids, starts, limits)) in enumerate(
        zip(preds, texts, tokenized)):
      s = p.start - int(batch["block_start"][i, 0])
      e = p.end - int(batch["block_start"][i, 0])
      body = self.store.body_ids(max(p.block_id, 0))
      if 0 <= s <= e < min(len(ids), len(body)) and np.array_equal(
          ids[:e + 1], body[:e + 1]):
        out.append(text.encode("utf-8")[starts[s]:limits[e]].decode(
            "utf-8", errors="replace"))
      else:
        out.append(p.answer)
    return out

  def _reader_oracle(self, batch, answers, regex, flags) -> np.ndarray:
    r = self.qa_config.num_reader_blocks
    # One batched tokenizer call for every text answer of the batch.
    flat = [a for a, x in zip(answers, regex) if not x for a in a]
    pieces = iter(qa_lib.tokenize_answers(self.tokenizer, flat))
    answer_ids = [[] if x else [next(pieces) for _ in a]
                  for a, x in zip(answers, regex)]
    gold = qa_inputs.span_positives(
        batch["reader_ids"], batch["block_start"], batch["block_end"],
        answer_ids, self.model_config.reader.max_span_width)
    gold &= batch["retrieved_mask"][:, :r, None, None]
    text_level = np.array([f[:r].any() for f in flags])
    return np.where(regex, text_level, gold.any(axis=(1, 2, 3)))


def _question_list(questions: Sequence[str]) -> list[str]:
  """`questions` as a list, refusing what `predict` would answer wrongly:
  one string (each character would become a question), a non-string
  item, an empty question."""
  questions = checks.string_list(
      questions, "predict", what="questions", item="Question",
      hint="use ask(question) or predict([question])")
  for i, question in enumerate(questions):
    _refuse_non_question(question, f"Question {i + 1} of {len(questions)}")
  return questions


def _answer_lists(answers: Sequence[Sequence[str]], n: int
                  ) -> list[list[str]]:
  """`predict`'s reference answers: one list of strings per question (a
  bare string would be read as its characters: "Paris" -> P, a, r...)."""
  if isinstance(answers, (str, bytes)):
    raise TypeError(
        f"predict's answers takes one list of answers per question, got "
        f"one {type(answers).__name__} ({_short(answers)!r}); pass "
        f"answers=[[{_short(answers)!r}]].")
  answers = list(answers)
  if len(answers) != n:
    raise ValueError(f"{len(answers)} answer lists for {n} questions.")
  return [checks.string_list(
      a, f"predict's answers[{i}]", what="reference answers",
      item=f"answers[{i}]: answer",
      hint=f"each question takes a list of answers: answers[{i}]="
      f"[{_short(a)!r}]") for i, a in enumerate(answers)]


def _refuse_non_question(question: Any, name: str) -> None:
  """TypeError for a non-string, ValueError for an empty question (`name`:
  how the message calls it)."""
  if not isinstance(question, str):
    raise TypeError(f"{name} is {_short(question)!r} "
                    f"({type(question).__name__}); a question is a str.")
  if not question.strip():
    raise ValueError(f"{name} {question!r} is empty; ask something, "
                     "e.g. 'Where was Mozart born?'.")
  problem = checks.utf8_problem(question)
  if problem:
    raise ValueError(f"{name} is {problem}: '{checks.shown_bytes(question)}'; "
                     "ask it in UTF-8.")


def _short(value: Any, limit: int = 60) -> Any:
  text = value if isinstance(value, (str, bytes)) else repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def _softmax(logits: np.ndarray) -> np.ndarray:
  """Row softmax over finite entries (-inf = not retrieved -> 0)."""
  finite = np.isfinite(logits)
  top = np.where(finite, logits, -np.inf).max(axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  e = np.where(finite, np.exp(np.where(finite, logits, 0.0) - top), 0.0)
  total = e.sum(axis=-1, keepdims=True)
  return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def load_qa_model(*, model_config: RealmConfig, store,
                  workdir: str | None = None,
                  checkpoint_dir: str | None = None, step: int | None = None,
                  init_from: str | None = None, index_dir: str | None = None,
                  index_step: int | None = None,
                  qa_config: qa_inputs.QAConfig | None = None,
                  **kwargs) -> QAModel:
  """A `QAModel` from a run's workdir, a checkpoint dir or imported weights.

  Args:
    model_config: the REALM config the weights belong to.
    store: the block store the index was built from.
    workdir: a run's workdir: `checkpoints/` and `index/` inside.
    checkpoint_dir: explicit checkpoint directory (overrides the workdir's).
    step: checkpoint step (default: the newest).
    init_from: imported weights instead of a checkpoint (see
      `realm_jax.checkpoint_import.init_from`).
    index_dir: published index root, or a directory holding one as
      `index/` (overrides the workdir's).
    index_step: index step (default: LATEST).
    qa_config: the QA sizes; default: those a fine-tuning checkpoint
      carries (`FinetuneConfig.qa`), else (imported weights, other runs)
      `QAConfig()`.
    **kwargs: more `QAModel` arguments (mesh, batch_size, ranker, ...).
      The hybrid with the default fusion ranks as the calibration beside
      the index says, if there is one for this index
      (`calibration.resolve`; the model's `ranker_choice.record()` says
      which ranker, weights and where they came from).
  """
  what = "index_dir (the CLI: --gin.INDEX_DIR)"
  if workdir:
    checkpoint_dir = checkpoint_dir or checkpoints.checkpoint_dir(workdir)
  if not index_dir and checkpoint_dir and not init_from:
    index_dir = run_index_dir(checkpoint_dir, step)
    what = ("the index the run trained against (another: index_dir=, the "
            "CLI's --gin.INDEX_DIR)")
  elif not index_dir and workdir:
    index_dir = checkpoints.index_root(workdir)
  if not index_dir:
    raise ValueError("No index: give index_dir (a published index root; the "
                     "CLI: --gin.INDEX_DIR) or a workdir with index/ inside.")
  if init_from:
    make = functools.partial(QAModel.from_init, init_from)
  elif not checkpoint_dir:
    raise ValueError("No weights: give workdir, checkpoint_dir or init_from.")
  else:
    step = checkpoints.newest_step(checkpoint_dir) if step is None else step
    meta = checkpoints.read_meta(checkpoint_dir, step)
    qa_config = qa_config or _run_qa_config(
        meta, f"{checkpoint_dir}/{step}/meta")
    if index_step is None:
      # A fine-tuned query tower belongs with the index it was trained on,
      # which need not be LATEST any more.
      index_step = meta.get("index_step")
      if index_step not in publish.published_steps(
          publish.resolve_index_root(index_dir)):
        index_step = None
    make = functools.partial(QAModel.from_checkpoint, checkpoint_dir, step)
  index = publish.load_frozen_index(index_dir, store, model_config,
                                    step=index_step, what=what)
  root = publish.resolve_index_root(index_dir)
  kwargs["ranker"] = calibration.resolve(kwargs.get("ranker", "dense"), root,
                                         index=index, store=store)
  model = make(model_config=model_config, store=store, index=index,
               qa_config=qa_config or qa_inputs.QAConfig(), **kwargs)
  model.index_root = root
  return model


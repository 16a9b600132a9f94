"""Open-domain QA inputs: questions -> retrieved blocks -> model batch.

Shared by fine-tuning, evaluation and `ask`. The document index is frozen:
the retrieval logits are the TRAINABLE query embedding dotted with the
block embeddings stored in the published index (gathered on the host), so
the question tower learns without re-embedding thousands of blocks. Blocks
are pre-tokenized in the block store (no re-tokenisation per question).

Per question (batched over many questions):
  retrieved_ids [K]            top K blocks of the frozen index (K = 5000 in
                               the paper), in rank order
  retrieved_embeddings [K, D]  their frozen embeddings
  has_answer [K]               an answer's wordpieces occur in the block
  reader_* [R, L]              `[CLS] question [SEP] body [SEP]` for the top
                               R = 5 blocks (L = 320 = 32 + 288)
  block_start/block_end [R]    first / last body position in the reader input
  gold_spans [R, L, W]         spans (start, width) equal to an answer; W is
                               the reader's `ReaderConfig.max_span_width`
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from realm_jax.core import checks, dataclass_json
from realm_jax.data import qa as qa_lib
from realm_jax.data import realm_inputs
from realm_jax.data import signatures
from realm_jax.data.tokenizer import tokenize_questions  # pylint: disable=unused-import


# What `Realm.qa_logits` reads from a `qa_batch`.
MODEL_FEATURES = ("question_ids", "question_mask", "retrieved_embeddings",
                  "retrieved_mask", "reader_ids", "reader_mask",
                  "reader_segment_ids", "block_start", "block_end")


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class QAConfig:
  """Sizes of the open-QA pipeline (ORQA's values by default).

  Fine-tuning holds one (`FinetuneConfig.qa`) and its checkpoints carry it,
  so evaluating or asking a fine-tuned run uses the run's. The widest
  answer span W is the model's (`ReaderConfig.max_span_width`), not a QA
  size.

  Attributes:
    question_length: `[CLS] question [SEP]` wordpieces (32).
    num_retrieved: K, blocks the retriever loss marginalises over (5000).
    num_reader_blocks: R, top blocks the reader reads (5).
    reader_length: reader input length, question_length + block body (320
      = 32 + 288).
  """
  question_length: int = 32
  num_retrieved: int = 5000
  num_reader_blocks: int = 5
  reader_length: int = 320

  def __post_init__(self):
    if self.num_reader_blocks > self.num_retrieved:
      raise ValueError(
          f"num_reader_blocks={self.num_reader_blocks} exceeds num_retrieved="
          f"{self.num_retrieved}; the reader reads the top retrieved blocks.")
    if self.reader_length <= self.question_length:
      raise ValueError("reader_length must exceed question_length.")
    checks.at_least(self, "question_length", "num_retrieved",
                    "num_reader_blocks")


# The QA sizes a fine-tuning run's config (`training.finetune.FinetuneConfig`)
# held as its own fields before it had `qa`.
_FLAT_QA_FIELDS = ("question_length", "num_retrieved", "num_reader_blocks",
                   "reader_length")


def nest_qa_fields(task_config: dict[str, Any]) -> dict[str, Any]:
  """A fine-tuning run's task config JSON (`dataclass_json.to_dict` of a
  FinetuneConfig, which a checkpoint carries), with its QA sizes under
  `qa` as today's FinetuneConfig holds them.

  Checkpoints written before `FinetuneConfig.qa` hold them as flat fields
  (question_length, num_retrieved, num_reader_blocks, reader_length,
  max_span_width): the first four become `qa`, and max_span_width (None
  or, by a check of the time, the reader's) is dropped: the width is the
  model's `ReaderConfig.max_span_width`. A new config is returned as it is.
  """
  data = dict(task_config)
  if "qa" not in data:
    data.pop("max_span_width", None)
    data["qa"] = {k: data.pop(k) for k in _FLAT_QA_FIELDS if k in data}
  return data


def qa_config_of_task(task_config: dict[str, Any], where: str) -> QAConfig:
  """The `QAConfig` of a fine-tuning run's task config JSON, old or new
  (`nest_qa_fields`). Serving (eval, ask, `realm_jax.load`) reads only
  this part, so it needs no training module. `where` names the source in
  errors."""
  return dataclass_json.from_dict(
      QAConfig, nest_qa_fields(task_config)["qa"], f"{where}.qa")


def span_positives(reader_ids: np.ndarray, block_start: np.ndarray,
                   block_end: np.ndarray,
                   answer_ids: Sequence[Sequence[np.ndarray]],
                   max_span_width: int) -> np.ndarray:
  """bool [B, R, L, W]: (start, width) spans inside the block equal to an
  answer's wordpieces."""
  b, r, length = reader_ids.shape
  cols = np.arange(length)
  inside = ((cols >= block_start[..., None]) & (cols <= block_end[..., None]))
  gold = qa_lib.gold_spans_batch(
      reader_ids.reshape(b * r, length),
      [answer_ids[i] for i in range(b) for _ in range(r)],
      max_span_width=max_span_width,
      token_mask=inside.reshape(b * r, length))
  out = np.zeros((b * r, length, max_span_width), bool)
  rows, slots = np.nonzero(gold.starts >= 0)
  starts = gold.starts[rows, slots]
  widths = gold.ends[rows, slots] - starts
  out[rows, starts, widths] = True
  return out.reshape(b, r, length, max_span_width)


def qa_batch(questions: dict[str, np.ndarray], retrieved_ids: np.ndarray,
             block_embeddings: np.ndarray, store, config: QAConfig, *,
             answer_ids: Sequence[Sequence[np.ndarray]] | None = None,
             max_span_width: int | None = None) -> dict[str, np.ndarray]:
  """The model batch for questions and their retrieved blocks.

  Arrays as described in the module docstring, plus `retrieved_mask`, for
  `retrieved_ids` int [B, K] in rank order (-1 = none found) and the
  index's `block_embeddings` [num_blocks, D] (may be mmap). `answer_ids`
  (per question, the wordpiece arrays of its answers from
  `qa.tokenize_answers`) adds `has_answer` and `gold_spans` of spans up to
  `max_span_width` wordpieces (the reader's `ReaderConfig.max_span_width`,
  required with `answer_ids`).
  """
  if answer_ids is not None and max_span_width is None:
    raise TypeError("qa_batch: answer_ids needs max_span_width (the "
                    "reader's ReaderConfig.max_span_width).")
  retrieved_ids = np.asarray(retrieved_ids, np.int64)
  b, k = retrieved_ids.shape
  valid = retrieved_ids >= 0
  safe_ids = np.where(valid, retrieved_ids, 0)
  r = config.num_reader_blocks
  top = safe_ids[:, :r].reshape(-1)
  m = store.manifest
  sep_id, pad_id = int(m["sep_id"]), int(m.get("pad_id", 0))
  body_len = config.reader_length - 2
  bodies, lengths = store.bodies(top, body_len)
  lengths = np.where(valid[:, :r].reshape(-1), lengths, 0)
  reader = realm_inputs.reader_inputs(
      questions["question_ids"], questions["question_mask"],
      bodies.reshape(b, r, body_len), lengths.reshape(b, r),
      seq_len=config.reader_length, sep_id=sep_id, pad_id=pad_id)
  q_len = questions["question_mask"].sum(-1).astype(np.int32)
  n_body = reader["segment_ids"].sum(-1) - 1  # segment 1 = body + [SEP].
  block_start = np.broadcast_to(q_len[:, None], (b, r)).astype(np.int32)
  block_end = (block_start + n_body - 1).astype(np.int32)
  out = {
      "question_ids": questions["question_ids"],
      "question_mask": questions["question_mask"],
      "retrieved_ids": retrieved_ids,
      "retrieved_mask": valid,
      "retrieved_embeddings": np.asarray(block_embeddings[safe_ids.reshape(
          -1)], np.float32).reshape(b, k, -1),
      "reader_ids": reader["token_ids"],
      "reader_mask": reader["input_mask"],
      "reader_segment_ids": reader["segment_ids"],
      "block_start": block_start,
      "block_end": block_end,
  }
  if answer_ids is not None:
    out["has_answer"] = has_answer(store, safe_ids, answer_ids) & valid
    out["gold_spans"] = span_positives(
        reader["token_ids"], block_start, block_end, answer_ids,
        max_span_width)
  return out


def qa_layout(config: QAConfig, *, batch: int, embedding_size: int,
              max_span_width: int) -> realm_inputs.Layout:
  """The fine-tuning step's batch: {field: (shape, dtype)}, the
  `MODEL_FEATURES` and the labels (`has_answer`, `gold_spans`) that
  `qa_batch` produces with `answer_ids`; what `realm-aot` lowers the step
  on (tests check `qa_batch`'s against it)."""
  b, k, r = batch, config.num_retrieved, config.num_reader_blocks
  lq, lr = config.question_length, config.reader_length
  i32, f32, flag = (np.dtype(np.int32), np.dtype(np.float32),
                    np.dtype(np.bool_))
  return {
      "question_ids": ((b, lq), i32), "question_mask": ((b, lq), i32),
      "retrieved_embeddings": ((b, k, embedding_size), f32),
      "retrieved_mask": ((b, k), flag),
      **{f"reader_{n}": ((b, r, lr), i32)
         for n in ("ids", "mask", "segment_ids")},
      "block_start": ((b, r), i32), "block_end": ((b, r), i32),
      "has_answer": ((b, k), flag),
      "gold_spans": ((b, r, lr, max_span_width), flag)}


def has_answer(store, block_ids: np.ndarray,
               answer_ids: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
  """bool [B, K]: block_ids[i, j]'s body contains an answer of question i.

  Token level (the stored wordpieces), exact: the blocks' token signatures
  rule out most of the K blocks (`signatures.may_contain`, no false
  negatives) and the wordpiece match runs on the candidates only, instead
  of on all B x K x 288 stored pieces.
  """
  b, k = block_ids.shape
  block_signatures = store.signatures
  candidates = np.zeros((b, k), bool)
  for i in range(b):
    if len(answer_ids[i]):
      candidates[i] = signatures.may_contain(
          block_signatures[block_ids[i]], signatures.of_answers(answer_ids[i]))
  rows, cols = np.nonzero(candidates)
  found = np.zeros((b, k), bool)
  if rows.size:
    bodies, _ = store.bodies(block_ids[rows, cols], store.max_block_len)
    found[rows, cols] = qa_lib.gold_spans_batch(
        bodies, [answer_ids[i] for i in rows],
        max_span_width=store.max_block_len, max_spans=1).has_answer
  return found


@dataclasses.dataclass
class Prediction:
  """The best (block, span) of one question."""
  answer: str
  score: float
  block_id: int
  start: int
  end: int


def decode_predictions(reader_logits: np.ndarray, batch: dict[str, np.ndarray],
                       tokenizer) -> list[Prediction]:
  """argmax over (block, span) of reader_logits [B, R, L, W]."""
  b, r, length, w = reader_logits.shape
  flat = reader_logits.reshape(b, -1)
  best = np.argmax(flat, axis=1)
  out = []
  for i, j in enumerate(best):
    block, start, width = np.unravel_index(j, (r, length, w))
    ids = batch["reader_ids"][i, block, start:start + width + 1]
    out.append(Prediction(
        answer=tokenizer.decode(ids), score=float(flat[i, j]),
        block_id=int(batch["retrieved_ids"][i, block]), start=int(start),
        end=int(start + width)))
  return out

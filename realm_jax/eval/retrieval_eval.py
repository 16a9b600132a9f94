"""Retrieval-only evaluation: any retriever's ranking as QA predictions.

A retriever without a reader (BM25, a dense retriever's index alone) is
scored with the QA eval's own definitions: its ranking becomes one
`qa_model.QAResult` per question (no prediction: `prediction` "", `score`
-inf, `block_id` -1, no evidence; `retrieved_ids` and `retrieved_scores`
in rank order, `retrieved_has_answer` by `qa.has_answer` on each block's
text), written with `qa_eval.write_predictions`, and recall@k is
`qa_eval.aggregate_metrics`' (an answer string in the text of one of the
top k blocks). `gold_recall` adds recall of a gold block (e.g. a block of
the question's SQuAD paragraph) at each k.

The rankings themselves come from the product's rankers
(`realm_jax.index.rankers`: dense, BM25, hybrid).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from realm_jax.data import qa as qa_lib
from realm_jax.eval.qa_model import QAResult


def retrieval_results(examples: Sequence[qa_lib.QAExample], ids: np.ndarray,
                      scores: np.ndarray, store) -> list[QAResult]:
  """One reader-less `QAResult` per question from a ranking.

  Args:
    examples: the questions with their answers.
    ids: int [num_questions, depth] block ids in rank order (-1: none).
    scores: float [num_questions, depth] the retriever's scores.
    store: the block store the ids index.

  Returns:
    The results (`qa_eval.aggregate_metrics` gives their recall@k).

  Raises:
    ValueError: `ids`, `scores` and `examples` do not have one row each.
  """
  ids, scores = np.asarray(ids), np.asarray(scores)
  if ids.shape != scores.shape or ids.shape[0] != len(examples):
    raise ValueError(f"ids {ids.shape} and scores {scores.shape} must have "
                     f"one row per question ({len(examples)}).")
  results = []
  for e, row, row_scores in zip(examples, ids, scores):
    flags = qa_lib.has_answer_batch(
        [store.text(int(b)) if b >= 0 else "" for b in row], e.answers,
        e.is_regex) & (row >= 0)
    results.append(QAResult(
        question=e.question, prediction="", score=float("-inf"), block_id=-1,
        evidence=[], retrieved_ids=[int(b) for b in row],
        retrieved_scores=[float(s) for s in row_scores],
        answers=list(e.answers), is_regex=e.is_regex, correct=False,
        retrieved_has_answer=[bool(x) for x in flags],
        reader_has_answer=None))
  return results


def gold_recall(results: Sequence[QAResult],
                gold_blocks: Sequence[np.ndarray],
                ks: Sequence[int]) -> dict[str, float]:
  """Share of questions with a gold block among their top k, per k.

  Args:
    results: results with `retrieved_ids`.
    gold_blocks: per result, its gold block ids (e.g.
      `squad.paragraph_blocks` of its paragraph; those among its retrieved
      blocks suffice; none: a miss).
    ks: the k.

  Returns:
    {"gold_recall@k": share}.
  """
  if len(results) != len(gold_blocks) or not results:
    raise ValueError(f"{len(results)} results but {len(gold_blocks)} gold "
                     "block sets; pass one set per result (and at least "
                     "one result).")
  hits = {k: 0 for k in ks}
  for r, gold in zip(results, gold_blocks):
    found = np.isin(np.asarray(r.retrieved_ids), np.asarray(gold, np.int64))
    for k in ks:
      hits[k] += bool(found[:k].any())
  return {f"gold_recall@{k}": hits[k] / len(results) for k in ks}

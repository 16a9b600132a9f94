"""Markdown tables of a learning benchmark run's rows (`--table_from`).

`table`: every evaluated checkpoint; `paired_table`: each condition's last
checkpoint against ICT's on the same questions (real text), with the
paired difference's standard error (`paired_difference`, which
benchmarks/scale_curve.py uses too).
"""

from __future__ import annotations


def table(rows) -> str:
  """Markdown table of every evaluated checkpoint, condition by condition."""
  rows = [r for r in rows if "summary" not in r]
  keys = [k for k in ("recall@1", "recall@5", "qa_recall@1", "qa_recall@5",
                      "qa_recall@20", "qa_recall@100", "span_recall",
                      "mlm_accuracy_marginal", "mlm_accuracy_null",
                      "mlm_accuracy_gold", "cloze_mlm_accuracy_marginal",
                      "cloze_mlm_accuracy_null", "cloze_mlm_accuracy_gold",
                      "retrieval_utility", "null_probability", "hubness",
                      "score_spread")
          if any(k in r for r in rows)]
  lines = ["| condition | step | " + " | ".join(keys) + " |",
           "|---|---|" + "---|" * len(keys)]
  for r in rows:
    lines.append(f"| {r['condition']} | {r['step']} | " + " | ".join(
        f"{r[k]:.3f}" if k in r else "-" for k in keys) + " |")
  return "\n".join(lines)


def paired_table(rows, baseline: str = "ict") -> str:
  """Each condition's last checkpoint against the baseline's, question by
  question: the difference in qa_recall@k and its standard error over
  the same questions (`paired_difference`). Empty without per-question
  ranks (real text only; jsonl written before session 28)."""
  last = last_ranked(rows)
  if baseline not in last or len(last) < 2:
    return ""
  base = last.pop(baseline)
  ks = [int(k.split("@")[1]) for k in base if k.startswith("qa_recall@")]
  lines = [f"Against {baseline} (step {base['step']}), on the same "
           f"{len(base['qa_answer_rank'])} questions (difference +- its "
           "standard error):",
           "| condition | step | " + " | ".join(
               f"qa_recall@{k}" for k in ks) + " |",
           "|---|---|" + "---|" * len(ks)]
  for r in last.values():
    cells = (paired_difference(
        r["qa_answer_rank"], base["qa_answer_rank"], k) for k in ks)
    lines.append(f"| {r['condition']} | {r['step']} | " + " | ".join(
        f"{d:+.3f} +- {se:.3f}" for d, se in cells) + " |")
  return "\n".join(lines)


def last_ranked(rows) -> dict:
  """Each condition's last row with per-question ranks, by condition."""
  return {r["condition"]: r for r in rows if "qa_answer_rank" in r}


def paired_difference(ranks, baseline, k: int) -> tuple[float, float]:
  """recall@k of `ranks` minus the baseline's on the same questions, and
  that difference's standard error: the per-question differences' sample
  std over sqrt(n) (pairing removes how much harder some questions are)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  ranks, baseline = np.asarray(ranks), np.asarray(baseline)
  if ranks.shape != baseline.shape or ranks.ndim != 1 or len(ranks) < 2:
    raise ValueError(f"ranks {ranks.shape} and baseline {baseline.shape}: "
                     "one rank per question, the same questions, >= 2.")
  d = (ranks < k).astype(np.float64) - (baseline < k)
  return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))

"""realm-calibrate: the hybrid's fusion measured on your own questions.

Ranks questions with answers (ORQA JSONL, or SQuAD JSON: `data.formats`)
once with the run's dense ranker (its query tower over its index, loaded
as the eval job and `ask` load it) and once with BM25 over the block
store, measures answer recall@k (an answer string in a top-k block,
`qa.has_answer`, as the eval does) of both and of each fusion of a grid
(`rankers.fuse`: "weighted" and "rrf", dense weight 0, 0.1, ..., 1), and
chooses by `index.calibration.RULE`: a fusion only where it beats the
better single ranker beyond 2 standard errors of the paired per-question
difference, else that ranker alone. The choice is written beside the index
(`<index root>/ranker_calibration.json`), where the eval job, `ask` and
`realm_jax.load` read it for the hybrid with the default fusion
(`index.calibration.resolve`).

    realm-calibrate --gin_file=models/<model>.gin --gin.WORKDIR="'W'" \\
        --gin.BLOCK_STORE="'B'" --gin.CALIBRATION_QUESTIONS="'mine.jsonl'"

Its command line: `realm_jax.jobs.calibrate`.

The weights, index and blocks are `qa_eval.EvalConfig`'s (runs/eval.gin:
WORKDIR or INIT_FROM + INDEX_DIR, BLOCK_STORE, EvalConfig.bm25_dir);
`CalibrateConfig` says which questions and what is measured. Use
questions of your own, never the evaluation set: a choice measured on the
questions it is then scored on is tuned to them. With
`CalibrateConfig.held_out` a share of them is left out of the choice and
scored after it (in the file, "held_out"), an honest check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any, Sequence

from absl import logging
import numpy as np

from realm_jax.core import checks
from realm_jax.core import progress as progress_lib
from realm_jax.data import formats
from realm_jax.data import qa as qa_lib
from realm_jax.index import calibration, rankers


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class CalibrateConfig:
  """What realm-calibrate measures (the model, index and blocks are
  `qa_eval.EvalConfig`'s).

  Attributes:
    questions_file: questions with answers of your own
      (CALIBRATION_QUESTIONS in runs/eval.gin); never the evaluation set.
    questions_format: `data.formats.QUESTION_FORMATS` (None: a `.json`
      file is SQuAD's, any other ORQA JSONL).
    regex_answers: the answers are regular expressions (CuratedTrec).
    max_questions: only the first N questions of the file (None: all).
    held_out: the share of the questions left out of the choice and scored
      after it (chosen by a hash of the question: the same each run).
    ks: the k of answer recall@k; the rankers rank max(ks) deep.
    dense_weights: the grid of the dense ranker's weight (BM25's: 1 - w).
    methods: the fusions tried (`rankers.FUSIONS`).
    rrf_k: RRF's constant.
    candidates: each ranker's list length in a fusion
      (`FusionConfig.candidates`).
  """
  questions_file: str | None = checks.path_setting("reads", default=None)
  questions_format: str | None = None
  regex_answers: bool = False
  max_questions: int | None = None
  held_out: float = 0.0
  ks: tuple[int, ...] = calibration.KS
  dense_weights: tuple[float, ...] = calibration.DENSE_WEIGHTS
  methods: tuple[str, ...] = rankers.FUSIONS
  rrf_k: float = 60.0
  candidates: int = 100

  def __post_init__(self):
    if self.questions_format not in (None, *formats.QUESTION_FORMATS):
      raise ValueError(
          f"CalibrateConfig.questions_format={self.questions_format!r} is "
          f"not one of {tuple(formats.QUESTION_FORMATS)} (or None: by the "
          "file name).")
    if not self.ks or min(self.ks) < 1:
      raise ValueError(f"CalibrateConfig.ks={self.ks} must be positive "
                       "integers, e.g. (1, 5, 20, 100).")
    if not 0.0 <= self.held_out < 1.0:
      raise ValueError(f"CalibrateConfig.held_out={self.held_out} is a "
                       "share of the questions, in [0, 1).")
    if self.max_questions is not None and self.max_questions < 2:
      raise ValueError(f"CalibrateConfig.max_questions={self.max_questions}"
                       " must be >= 2 (a standard error needs two).")
    if not self.dense_weights or any(
        not 0.0 <= w <= 1.0 for w in self.dense_weights):
      raise ValueError(f"CalibrateConfig.dense_weights={self.dense_weights} "
                       "must be weights in [0, 1] (BM25's is 1 - w).")
    bad = [m for m in self.methods if m not in rankers.FUSIONS]
    if not self.methods or bad:
      raise ValueError(f"CalibrateConfig.methods={self.methods}: each one "
                       f"of {rankers.FUSIONS}.")
    if self.candidates < max(self.ks) or self.rrf_k < 0:
      raise ValueError(
          f"CalibrateConfig.candidates={self.candidates} must be >= "
          f"max(ks)={max(self.ks)}, and rrf_k >= 0.")

  def grid(self) -> dict[str, rankers.FusionConfig]:
    """The fusions tried (`calibration.fusion_grid`)."""
    return calibration.fusion_grid(self.dense_weights, self.methods,
                                   rrf_k=self.rrf_k,
                                   candidates=self.candidates)


def held_out_mask(examples: Sequence[qa_lib.QAExample],
                  share: float) -> np.ndarray:
  """bool [Q]: the questions left out of the choice (a hash of each
  question under `share`: the same questions each run, whatever their
  order)."""
  return np.array([int(hashlib.sha256(e.question.encode()).hexdigest()[:8],
                       16) / 2 ** 32 < share for e in examples], bool)


def rank_and_flag(examples: Sequence[qa_lib.QAExample], dense: rankers.Ranker,
                  bm25: rankers.Ranker, store, depth: int,
                  batch_size: int = 256
                  ) -> tuple[rankers.Ranking, rankers.Ranking,
                             list[dict[int, bool]]]:
  """(the dense ranking, BM25's, per question {block: has an answer}) of
  `examples`, each ranked `depth` deep once, over the blocks either
  ranker listed (`qa.has_answer_batch`)."""
  parts: list[list[rankers.Ranking]] = [[], []]
  flags: list[dict[int, bool]] = []
  with progress_lib.Progress("calibration: ranking", len(examples),
                             unit="questions") as bar:
    for lo in range(0, len(examples), batch_size):
      chunk = examples[lo:lo + batch_size]
      questions = [e.question for e in chunk]
      found = [r.rank(questions, depth) for r in (dense, bm25)]
      for part, ranking in zip(parts, found):
        part.append(ranking)
      for i, e in enumerate(chunk):
        blocks = sorted({int(b) for r in found for b in r.ids[i] if b >= 0})
        has = qa_lib.has_answer_batch([store.text(b) for b in blocks],
                                      e.answers, e.is_regex)
        flags.append(dict(zip(blocks, has.tolist())))
      bar.update(len(chunk))
  return (*(_concat(p, depth) for p in parts), flags)


def _concat(parts: Sequence[rankers.Ranking], depth: int) -> rankers.Ranking:
  """Rankings of consecutive question batches as one (padded to `depth`
  columns with -1)."""
  def pad(x, fill):
    return np.pad(x, ((0, 0), (0, depth - x.shape[1])), constant_values=fill)
  names = list(parts[0].sources)
  return rankers.Ranking(
      np.concatenate([pad(p.ids, -1) for p in parts]),
      np.concatenate([pad(p.scores, -np.inf) for p in parts]),
      {n: np.concatenate([pad(p.sources[n], -1) for p in parts])
       for n in names})


def candidate_hits(dense: rankers.Ranking, bm25: rankers.Ranking,
                   flags: Sequence[dict[int, bool]],
                   config: CalibrateConfig) -> dict[str, np.ndarray]:
  """candidate -> bool [Q, len(ks)]: answer hits of the dense ranking,
  BM25's, and each fusion of `config.grid()` of their top `candidates`."""
  ks, depth = config.ks, max(config.ks)
  hits = {"dense": calibration.hits_at(dense.ids[:, :depth], flags, ks),
          "bm25": calibration.hits_at(bm25.ids[:, :depth], flags, ks)}
  top = [rankers.Ranking(r.ids[:, :config.candidates],
                         r.scores[:, :config.candidates],
                         {n: s[:, :config.candidates]
                          for n, s in r.sources.items()})
         for r in (dense, bm25)]
  grid = config.grid()
  with progress_lib.Progress("calibration: fusions", len(grid),
                             unit="fusions") as bar:
    for name, f in grid.items():
      fused = rankers.fuse(top, (f.dense_weight, f.bm25_weight), depth,
                           method=f.method, rrf_k=f.rrf_k)
      hits[name] = calibration.hits_at(fused.ids, flags, ks)
      bar.update(1)
  return hits


def held_out_scores(hits: dict[str, np.ndarray], decision: calibration.Decision,
                    ks: Sequence[int]) -> dict[str, Any]:
  """Answer recall@k, on the held-out questions, of the chosen candidate,
  each single ranker and the default fusion ("weighted 0.5"), and the
  chosen one's paired difference from the better single ranker there."""
  names = dict.fromkeys([decision.chosen, *calibration.SINGLES,
                         "weighted 0.5"])
  out = {"questions": int(len(hits["dense"]))}
  for name in names:
    if name in hits:
      out[name] = {f"recall@{k}": round(float(r), 4)
                   for k, r in zip(ks, hits[name].mean(0))}
  if len(hits["dense"]) >= 2:
    d = hits[decision.chosen].astype(float) - hits[
        decision.best_single].astype(float)
    se = d.std(0, ddof=1) / np.sqrt(len(d))
    out["chosen_minus_best_single"] = {
        f"@{k}": [round(float(m), 4), round(float(e), 4)]
        for k, m, e in zip(ks, d.mean(0), se)}
  return out


def calibrate(examples: Sequence[qa_lib.QAExample], *,
              dense: rankers.Ranker, bm25: rankers.Ranker, store, index,
              config: CalibrateConfig = CalibrateConfig(),
              source: dict[str, Any] | None = None,
              batch_size: int = 256) -> dict[str, Any]:
  """The calibration record of `examples` (`calibration.record_of`).

  Args:
    examples: questions with answers.
    dense, bm25: the rankers (the model's query tower over `index`, BM25
      over `store`).
    store, index: the block store and the published index ranked from
      (the record names the index step and the corpus fingerprint).
    config: what is measured.
    source: what the record says of the questions and weights.
    batch_size: questions ranked at once.

  Raises:
    ValueError: fewer than 2 questions left to choose on.
  """
  start = time.time()
  examples = list(examples)[:config.max_questions]
  held = held_out_mask(examples, config.held_out)
  if (~held).sum() < 2:
    raise ValueError(
        f"{(~held).sum()} question(s) to calibrate on (of {len(examples)}, "
        f"held_out={config.held_out}): need at least 2, and some hundreds "
        "for a choice beyond the noise.")
  if (~held).sum() < 100:
    logging.warning("calibrating on %d questions: a fusion must gain much "
                    "to pass 2 standard errors; some hundreds decide "
                    "better.", (~held).sum())
  depth = max(max(config.ks), config.candidates)
  dense_ranking, bm25_ranking, flags = rank_and_flag(
      examples, dense, bm25, store, depth, batch_size)
  hits = candidate_hits(dense_ranking, bm25_ranking, flags, config)
  decision = calibration.decide({k: v[~held] for k, v in hits.items()},
                                config.ks)
  extra = {"seconds": round(time.time() - start, 1)}
  if held.any():
    extra["held_out"] = held_out_scores({k: v[held] for k, v in hits.items()},
                                        decision, config.ks)
  record = calibration.record_of(
      decision, config.grid(), index=index, store=store, ks=config.ks,
      questions=int((~held).sum()), source=source or {}, extra=extra)
  logging.info("calibration on %d questions: %s -> %s", (~held).sum(),
               decision.reason, json.dumps(record["chosen"]))
  return record

"""The hybrid calibrated on the user's own questions (issue 70).

The default hybrid fuses by a fixed rule (`rankers.FusionConfig()`: equal
weights of min-max normalised scores), chosen without any questions. With a
weak dense ranker it falls far below BM25; with a strong one it trails the
dense ranker at deep k. `realm-calibrate` (`realm_jax.eval.calibrate`)
ranks questions with answers of the user's own once with the dense ranker
and once with BM25, measures answer recall@k of both and of every fusion
of a grid (`decide`), and writes the choice beside the index:

    <index root>/ranker_calibration.json

The choice (`RULE`): each candidate's score is its mean answer recall over
the ks; S is the better single ranker (BM25 on a tie); F is the best-scoring
fusion that trails S by no more than 2 standard errors of the paired
per-question difference at any k; F is chosen only if its paired
per-question gain over S (the mean of the per-question score differences)
is above 0 and above 2 standard errors of that mean, else S. So the
calibrated hybrid never ranks with a fusion that the questions showed
below its better component: then it ranks with that component alone, and
says so.

Who reads it (`resolve`): the eval job, `ask` and `realm_jax.load`, when
the ranker is the hybrid with the default fusion (`EvalConfig.ranker =
"hybrid"`, `EvalConfig.fusion` unset); an explicit fusion wins over the
file. The file counts only for the index it was measured on (step,
revision and corpus fingerprint); for another one the fixed rule stays,
with a warning. Every metrics record and `ask` say which ranker and
weights they used and where those came from (`Resolved.record`):
"calibration" (the file), "fixed rule" (no file) or "configuration" (an
explicit fusion).

The file belongs to the index root it lies in (an index builder's or an
extended one; `outputs.INDEX_ROOT`): `write` refuses any other directory,
and its name is among the index root's own entries.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Mapping, Sequence

from absl import logging
import numpy as np

from realm_jax.core import io_utils, outputs
from realm_jax.index import rankers

CALIBRATION_FILE = "ranker_calibration.json"
FORMAT_VERSION = 1
KS = (1, 5, 20, 100)
DENSE_WEIGHTS = tuple(round(0.1 * i, 1) for i in range(11))
SINGLES = ("dense", "bm25")
RULE = (
    "score = mean answer recall@k over the ks; S = the better single ranker "
    "(bm25 on a tie); F = the best-scoring fusion that trails S by no more "
    "than 2 standard errors of the paired per-question difference at any "
    "k; F if its paired per-question gain over S is > 0 and > 2 standard "
    "errors, else S")
# Where `resolve` says a choice came from.
FROM_CALIBRATION, FIXED_RULE, CONFIGURED = ("calibration", "fixed rule",
                                            "configuration")


def calibration_file(index_root: io_utils.PathLike) -> str:
  """<index_root>/ranker_calibration.json."""
  return io_utils.join(index_root, CALIBRATION_FILE)


# ----------------------------------------------------------------------------
# The candidates and the rule
# ----------------------------------------------------------------------------


def fusion_grid(dense_weights: Sequence[float] = DENSE_WEIGHTS,
                methods: Sequence[str] = rankers.FUSIONS, *,
                rrf_k: float = 60.0, candidates: int = 100
                ) -> dict[str, rankers.FusionConfig]:
  """name -> fusion, for each method and dense weight w (BM25: 1 - w),
  in grid order ("weighted 0.3", ...; the order breaks ties)."""
  grid = {}
  for method in methods:
    for w in dense_weights:
      w = round(float(w), 6)
      grid[f"{method} {w:g}"] = rankers.FusionConfig(
          method=method, dense_weight=w, bm25_weight=round(1.0 - w, 6),
          rrf_k=rrf_k, candidates=candidates)
  return grid


def hits_at(ids: np.ndarray, flags: Sequence[Mapping[int, bool]],
            ks: Sequence[int]) -> np.ndarray:
  """bool [Q, len(ks)]: whether a block of each question's top k holds an
  answer, from `flags` (per question, block id -> has an answer; a block
  missing from it has none) and the ranking `ids` (-1: none)."""
  ids = np.asarray(ids)
  found = np.array([[bool(f.get(int(b), False)) if b >= 0 else False
                     for b in row] for f, row in zip(flags, ids)],
                   bool).reshape(ids.shape)
  first = np.where(found.any(1), found.argmax(1), np.iinfo(np.int64).max)
  return first[:, None] < np.asarray(ks)[None]


@dataclasses.dataclass(frozen=True)
class Decision:
  """What `decide` chose, and why.

  Attributes:
    chosen: the chosen candidate's name (a single ranker's or a fusion's).
    best_single: S, the better single ranker ("dense" or "bm25").
    best_fusion: F, the best eligible fusion (None: none is eligible).
    gain, se: F's paired per-question score gain over S and its standard
      error (fractions; 0 when no fusion is eligible).
    table: one row per candidate: name, recall@k, score, its paired gain
      over S and standard error, the ks at which it trails S by more than
      2 standard errors.
    reason: one sentence.
  """
  chosen: str
  best_single: str
  best_fusion: str | None
  gain: float
  se: float
  table: list[dict[str, Any]]
  reason: str


def _paired(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(mean, standard error of the mean) of the per-question a - b, over
  axis 0."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  return d.mean(0), d.std(0, ddof=1) / math.sqrt(len(d))


def decide(hits: Mapping[str, np.ndarray], ks: Sequence[int]) -> Decision:
  """The calibrated choice among single rankers and fusions (`RULE`).

  Args:
    hits: candidate name -> bool [Q, len(ks)] (`hits_at`): "dense" and
      "bm25", and the fusions (in grid order: it breaks ties).
    ks: the k of each column.

  Raises:
    ValueError: "dense" or "bm25" is missing, fewer than 2 questions, or
      the arrays disagree in shape.
  """
  if any(s not in hits for s in SINGLES):
    raise ValueError(f"decide needs the hits of {SINGLES}, got "
                     f"{sorted(hits)}.")
  shape = np.shape(hits["dense"])
  if len(shape) != 2 or shape[1] != len(ks) or shape[0] < 2:
    raise ValueError(f"hits of shape {shape}: need [questions >= 2, "
                     f"{len(ks)} ks].")
  for name, h in hits.items():
    if np.shape(h) != shape:
      raise ValueError(f"hits of {name!r} are {np.shape(h)}, not {shape}.")
  per_q = {n: np.asarray(h, np.float64).mean(1) for n, h in hits.items()}
  score = {n: float(s.mean()) for n, s in per_q.items()}
  single = max(reversed(SINGLES), key=lambda n: score[n])  # bm25 on a tie
  table, eligible = [], []
  for name, h in hits.items():
    gain, se = _paired(per_q[name], per_q[single])
    k_gain, k_se = _paired(h, hits[single])
    trails = [k for k, g, e in zip(ks, k_gain, k_se) if g < -2 * e]
    table.append({"candidate": name, **{
        f"recall@{k}": round(float(r), 4)
        for k, r in zip(ks, np.asarray(h, np.float64).mean(0))},
                  "score": round(score[name], 4),
                  "gain": round(float(gain), 4), "se": round(float(se), 4),
                  "trails_at": trails})
    if name not in SINGLES and not trails:
      eligible.append((name, float(gain), float(se)))
  # The best score is the best paired gain (same questions, same S).
  best = max(eligible, key=lambda x: x[1], default=None)
  if best is None:
    return Decision(single, single, None, 0.0, 0.0, table,
                    f"every fusion trails {single} by more than 2 standard "
                    f"errors at some k: {single} ranks alone")
  name, gain, se = best
  shown = f"{100 * gain:+.2f} +- {100 * se:.2f} points"
  if gain > 0 and gain > 2 * se:
    return Decision(name, single, name, gain, se, table,
                    f"the fusion {name} gains {shown} over {single} "
                    "(beyond 2 standard errors)")
  return Decision(single, single, name, gain, se, table,
                  f"the best fusion {name} gains {shown} over {single}, "
                  f"not beyond 2 standard errors: {single} ranks alone")


def candidate_choice(name: str, grid: Mapping[str, rankers.FusionConfig]
                     ) -> rankers.RankerChoice:
  """The ranker choice of a candidate of `decide`."""
  if name in SINGLES:
    return rankers.choice(name)
  return rankers.Hybrid(grid[name])


# ----------------------------------------------------------------------------
# The file
# ----------------------------------------------------------------------------


SETTING = ("the index root (EvalConfig.index_dir, default <WORKDIR>/index), "
           f"where realm-calibrate writes {CALIBRATION_FILE}")
_INDEX_KINDS = (outputs.INDEX_ROOT.name, outputs.EXTENDED_INDEX_ROOT.name)


def write(index_root: io_utils.PathLike, record: dict[str, Any]) -> str:
  """Writes `record` as <index_root>/ranker_calibration.json (atomic).

  Raises:
    OwnershipError: `index_root` is not an index root (an index builder's,
      or an extended one).
    LinkRefusedError, NotRegularFileError: the file is a link, has other
      names or is no regular file.
  """
  root = io_utils.as_path(index_root)
  kind = (outputs.owner(root) or {}).get("kind")
  if kind not in _INDEX_KINDS:
    # A root from before markers passes as the builder's, anything else is
    # refused naming what it holds.
    if not outputs.check(root, outputs.INDEX_ROOT, SETTING):
      raise outputs.OwnershipError(
          f"{SETTING}: {io_utils.absolute(index_root)!r} holds no index; "
          "point it at the published index the calibration was measured "
          "on.")
  path = calibration_file(root)
  io_utils.check_own_file(path)
  io_utils.write_json(path, record)
  return path


def _field(record: dict[str, Any], name: str, kind, path: str):
  value = record.get(name)
  if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
    raise ValueError(f"{path}: field {name!r} is {value!r}, not "
                     f"{getattr(kind, '__name__', kind)}; rerun "
                     "realm-calibrate (or delete the file to rank with the "
                     "fixed rule).")
  return value


def read(index_root: io_utils.PathLike) -> dict[str, Any] | None:
  """The calibration beside `index_root` (None: there is none), checked:
  {"chosen": its `RankerChoice`, "index_step", "index_revision",
  "corpus_fingerprint", ...: the file's fields}.

  Raises:
    ValueError: the file is no JSON, of a newer format, or a field is
      missing or wrong, naming the file and the field.
  """
  path = calibration_file(index_root)
  io_utils.check_own_file(path)
  if not io_utils.as_path(path).exists():
    return None
  try:
    record = json.loads(io_utils.read_text(path))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not JSON ({e}); rerun realm-calibrate (or "
                     "delete it to rank with the fixed rule).") from e
  if not isinstance(record, dict):
    raise ValueError(f"{path} holds {type(record).__name__}, not a "
                     "calibration object; rerun realm-calibrate.")
  version = _field(record, "format_version", int, path)
  if version > FORMAT_VERSION:
    raise ValueError(f"{path} is of format version {version}, newer than "
                     f"this realm_jax reads ({FORMAT_VERSION}); upgrade "
                     "realm_jax or rerun realm-calibrate.")
  _field(record, "index_step", int, path)
  _field(record, "index_revision", int, path)
  _field(record, "corpus_fingerprint", str, path)
  _field(record, "questions", int, path)
  return dict(record, chosen=rankers.from_record(
      record.get("chosen"), f"{path}: field 'chosen'"), path=path)


# ----------------------------------------------------------------------------
# Who reads it: the choice of the eval job, `ask`, `realm_jax.load`
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A ranker choice and where it came from; a `RankerChoice` itself.

  Attributes:
    choice: the choice it ranks with.
    source: FROM_CALIBRATION, FIXED_RULE or CONFIGURED.
    note: one sentence: which file, measured on what, or why not.
    calibration: the calibration file read (None: none was used).
  """
  choice: rankers.RankerChoice
  source: str
  note: str
  calibration: str | None = None

  @property
  def name(self) -> str:
    return self.choice.name

  @property
  def reads_bm25(self) -> bool:
    return self.choice.reads_bm25

  def make(self, dense, bm25) -> rankers.Ranker:
    return self.choice.make(dense, bm25)

  def record(self) -> dict[str, Any]:
    """The choice's record, and where it came from ("ranker_from", a
    "ranker_note" and the "calibration" file when one was used)."""
    return {**self.choice.record(), "ranker_from": self.source,
            "ranker_note": self.note,
            **({"calibration": self.calibration} if self.calibration
               else {})}

  def tag(self) -> str:
    """The choice's own tag: the same ranker is the same evaluation."""
    return self.choice.tag()

  def describe(self) -> str:
    """One line: the ranker, its weights and where they came from."""
    return f"{describe(self.choice)}, from the {self.source}: {self.note}"


def describe(choice: rankers.RankerChoice) -> str:
  """"bm25", or "hybrid (weighted, dense 0.3, bm25 0.7)"."""
  fusion = getattr(choice, "fusion", None)
  if fusion is None:
    return choice.name
  return (f"{choice.name} ({fusion.method}, dense {fusion.dense_weight:g}, "
          f"bm25 {fusion.bm25_weight:g})")


def calibratable(choice: rankers.RankerChoice) -> bool:
  """Whether the calibration decides for `choice`: the hybrid with the
  default fusion (an explicit fusion wins over the file)."""
  return (isinstance(choice, rankers.Hybrid)
          and choice.fusion == rankers.FusionConfig())


def resolve(ranker: str | rankers.RankerChoice,
            index_root: io_utils.PathLike | None, *, index=None,
            store=None, fusion: rankers.FusionConfig | None = None,
            where: str = "ranker") -> rankers.RankerChoice:
  """The choice to rank with: `ranker` (with `fusion`), or for the hybrid
  with the default fusion the calibration beside `index_root`, when it
  was measured on `index` (step, revision) over `store` (fingerprint).

  Returns:
    A `Resolved` for the hybrid (whatever the calibration chose: a fusion,
    or the better single ranker alone), else `ranker`'s choice as it is.

  Raises:
    ValueError: an unknown ranker, or a calibration file that cannot be
      read (`read`).
  """
  chosen = rankers.choice(ranker, fusion=fusion, where=where)
  if isinstance(chosen, Resolved) or not isinstance(chosen, rankers.Hybrid):
    return chosen
  if not calibratable(chosen):
    return Resolved(chosen, CONFIGURED, "an explicit fusion, which wins over "
                    "a calibration file")
  if index_root is None:
    return Resolved(chosen, FIXED_RULE, "no index root to look for "
                    f"{CALIBRATION_FILE} in")
  path = calibration_file(index_root)
  record = read(index_root)
  if record is None:
    resolved = Resolved(chosen, FIXED_RULE, f"no {path} (realm-calibrate "
                        "measures one on questions of your own)")
    logging.info("%s", resolved.describe())
    return resolved
  measured = (record["index_step"], record["index_revision"],
              record["corpus_fingerprint"])
  serving = (None if index is None else int(index.step),
             None if index is None else int(getattr(index, "revision", 0)),
             None if store is None else store.fingerprint)
  if any(s is not None and s != m for s, m in zip(serving, measured)):
    resolved = Resolved(chosen, FIXED_RULE, (
        f"{path} was measured on index step {measured[0]} revision "
        f"{measured[1]} of corpus {measured[2][:12]}, not step {serving[0]} "
        f"revision {serving[1]} of corpus {str(serving[2])[:12]}: rerun "
        "realm-calibrate"))
    logging.warning("%s", resolved.describe())
    return resolved
  decision = record.get("decision") or {}
  resolved = Resolved(record["chosen"], FROM_CALIBRATION, (
      f"{path}, {record['questions']} questions: "
      f"{decision.get('reason', 'see the file')}"), path)
  if not isinstance(record["chosen"], rankers.Hybrid):
    logging.warning("the calibration %s showed no fusion above %s: the "
                    "hybrid ranks with %s alone (%s)", path,
                    record["chosen"].name, record["chosen"].name,
                    decision.get("reason", ""))
  logging.info("%s", resolved.describe())
  return resolved


def record_of(decision: Decision, grid: Mapping[str, rankers.FusionConfig],
              *, index, store, ks: Sequence[int], questions: int,
              source: dict[str, Any], extra: dict[str, Any] | None = None
              ) -> dict[str, Any]:
  """The file's JSON: the chosen `RankerChoice.record()`, what it was
  measured on, the rule, the decision and every candidate's recall."""
  chosen = candidate_choice(decision.chosen, grid)
  return {
      "format_version": FORMAT_VERSION,
      "written_by": "realm-calibrate (python -m realm_jax.jobs.calibrate)",
      "written_at": time.time(),
      "chosen": chosen.record(),
      "index_step": int(index.step),
      "index_revision": int(getattr(index, "revision", 0)),
      "corpus_fingerprint": store.fingerprint,
      "blocks": len(store),
      "questions": int(questions),
      "ks": [int(k) for k in ks],
      "rule": RULE,
      "decision": {
          "chosen": decision.chosen, "best_single": decision.best_single,
          "best_fusion": decision.best_fusion,
          "gain": round(decision.gain, 6), "se": round(decision.se, 6),
          "reason": decision.reason},
      "candidates": [
          dict(row, **({"fusion": dataclasses.asdict(grid[row["candidate"]])}
                       if row["candidate"] in grid else {}))
          for row in decision.table],
      "source": source,
      **(extra or {})}

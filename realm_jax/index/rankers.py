"""Rankers: questions -> (block ids, scores), best first.

One seam for every way the product finds blocks (the eval job, `ask`,
`realm_jax.load`, the benchmarks):

  dense   `DenseRanker`: a query tower over a published index (MIPS).
  bm25    `BM25Ranker`: BM25 over the block store (`realm_jax.index.bm25`,
          built once per store and persisted beside it).
  hybrid  `HybridRanker`: both, fused (`FusionConfig`, set in gin):
          "weighted": each ranker's scores over its own top `candidates`
            min-max normalised per question to [0, 1] (a block missing
            from a ranker's list counts as that list's minimum, 0), then
            summed with the weights;
          "rrf": reciprocal-rank fusion, sum of weight / (rrf_k + rank)
            (rank 1-based; a missing block adds nothing).
          Ties go to the smaller block id.

A job chooses its ranker before any model exists, as an object
(`RankerChoice`: `Dense()`, `BM25()`, `Hybrid(fusion)`), bound in gin
(`EvalConfig.ranker = @rankers.Hybrid()`) or named (`"hybrid"`, looked up
in `CHOICES`); the model then makes it (`RankerChoice.make`) from its own
dense ranker and the store's BM25. A new ranker is one class with the
`RankerChoice` members, added to `CHOICES` to be named on the command
line.

Every ranking also says, for each block, at which rank each ranker found
it (`Ranking.sources`; -1: not in that ranker's list), which `ask` shows.
BM25 finds only the blocks it scores above 0 (a query term in them): the
blocks of score 0 that fill its list to the depth asked (by id) are read,
but BM25 claims no rank for them and a fusion takes nothing from them.

The default fusion is a fixed rule, chosen without any questions: the
weighted fusion with equal weights (dense 0.5, BM25 0.5), each ranker's
scores min-max normalised per question, so neither ranker's scale
decides. A fixed RRF lost @1 to BM25 on SQuAD-style questions, so the
scores, not only the ranks, are fused. Measured on SQuAD-open in
docs/results/real_text.md, "The hybrid".

Equal weights assume a dense ranker of about BM25's strength (MiniLM).
Normalisation gives a weak ranker's first block the same 1.0 as BM25's,
so with a retriever trained from random weights (ICT or REALM on 1,000
leads, 5-6% recall@5 alone) the hybrid falls from BM25's 74.6% recall@1
on SQuAD-open to 21%. With such a retriever rank with "bm25", or weigh the
dense ranker 0.1 and BM25 0.9; at none of the weights measured
(0.05-0.5) did it add more than 0.1 point to BM25's recall.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from typing import Any, Callable, ClassVar, Protocol, Sequence

import numpy as np

from realm_jax.core import checks
from realm_jax.data.tokenizer import Tokenizer, tokenize_questions
from realm_jax.index import bm25 as bm25_lib

FUSIONS = ("weighted", "rrf")


@dataclasses.dataclass
class Ranking:
  """The top blocks of each question.

  Attributes:
    ids: int64 [Q, d] block ids, best first (-1: none).
    scores: float32 [Q, d] the ranker's scores.
    sources: ranker name -> int32 [Q, d]: the 0-based rank at which that
      ranker found the block (-1: not in its list).
  """
  ids: np.ndarray
  scores: np.ndarray
  sources: dict[str, np.ndarray]


class Ranker(Protocol):
  """questions -> `Ranking` of the top `depth` blocks."""
  name: str

  def rank(self, questions: Sequence[str], depth: int) -> Ranking:
    ...


def _questions(questions: Sequence[str], where: str) -> list[str]:
  """`questions` as a list; one bare str (each character would be a
  question) or a non-string is a TypeError naming `where`."""
  return checks.string_list(questions, where, what="questions",
                            item="Question", hint="pass [question]")


def _own(name: str, ids: np.ndarray, scores: np.ndarray) -> Ranking:
  ranks = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
  return Ranking(ids, scores, {name: np.where(ids >= 0, ranks, -1)})


class DenseRanker:
  """A query tower over a published index (`publish.PublishedIndex`).

  Args:
    index: the published index (searcher + embeddings).
    embed_questions: questions -> float32 [Q, D] query embeddings.
  """

  def __init__(self, index, embed_questions: Callable[[Sequence[str]],
                                                       np.ndarray],
               name: str = "dense"):
    self.index, self.embed_questions, self.name = index, embed_questions, name

  @classmethod
  def from_params(cls, index, params: dict[str, Any], model_config, *,
                  question_length: int = 32, batch_size: int = 256,
                  tokenizer: Tokenizer | None = None,
                  name: str = "dense") -> DenseRanker:
    """`params`' query tower (of a `Realm` of `model_config`), on one
    device, `[CLS] question [SEP]` in `question_length` wordpieces."""
    from realm_jax.index import embed as embed_lib  # pylint: disable=g-import-not-at-top
    from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
    from realm_jax.model.realm import Realm  # pylint: disable=g-import-not-at-top
    graphdef, _ = functional.abstract_init(lambda r: Realm(model_config,
                                                           rngs=r))
    embed_queries = embed_lib.make_query_embedder(graphdef, None)
    tokenizer = tokenizer or Tokenizer()

    def embed_questions(questions):
      q = tokenize_questions(tokenizer, list(questions), question_length)
      return np.concatenate([np.asarray(embed_queries(
          params, q["question_ids"][lo:lo + batch_size],
          q["question_mask"][lo:lo + batch_size]), np.float32)
                             for lo in range(0, len(questions), batch_size)])
    return cls(index, embed_questions, name)

  def rank(self, questions: Sequence[str], depth: int) -> Ranking:
    questions = _questions(questions, "DenseRanker.rank")
    depth = min(depth, int(self.index.embeddings.shape[0]))
    ids, scores = self.index.search(
        np.asarray(self.embed_questions(questions), np.float32), depth)
    ids = np.asarray(ids, np.int64)[:len(questions)]
    return _own(self.name, ids,
                np.asarray(scores, np.float32)[:len(questions)])


class BM25Ranker:
  """BM25 over a block store (`bm25.BM25Index`)."""

  def __init__(self, index: bm25_lib.BM25Index, name: str = "bm25"):
    self.index, self.name = index, name

  @classmethod
  def for_store(cls, store, directory: str | None = None) -> BM25Ranker:
    """The store's persisted BM25 index, built there the first time
    (`bm25.for_store`)."""
    return cls(bm25_lib.for_store(store, directory))

  def rank(self, questions: Sequence[str], depth: int) -> Ranking:
    """The top `depth` blocks; those scored 0 (no query term in them) fill
    the list but are not found by BM25 (`sources`: -1)."""
    questions = _questions(questions, "BM25Ranker.rank")
    ids, scores = self.index.search(questions, depth)
    ranking = _own(self.name, ids, scores)
    ranking.sources[self.name] = np.where(scores > 0,
                                          ranking.sources[self.name], -1)
    return ranking


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class FusionConfig:
  """How `HybridRanker` fuses (module docstring).

  Attributes:
    method: "weighted" (normalised scores) or "rrf" (reciprocal ranks).
    dense_weight, bm25_weight: the weights of the two rankers.
    rrf_k: RRF's constant (60 as Cormack et al.).
    candidates: each ranker's list length (at least the depth asked).
  """
  method: str = "weighted"
  dense_weight: float = 0.5
  bm25_weight: float = 0.5
  rrf_k: float = 60.0
  candidates: int = 100

  def __post_init__(self):
    if self.method not in FUSIONS:
      raise ValueError(f"FusionConfig.method={self.method!r} is not one of "
                       f"{FUSIONS}.")
    if min(self.dense_weight, self.bm25_weight) < 0 or not (
        self.dense_weight + self.bm25_weight > 0):
      raise ValueError(
          f"FusionConfig weights ({self.dense_weight}, {self.bm25_weight}) "
          "must be >= 0 and not both 0.")
    if self.rrf_k < 0 or self.candidates < 1:
      raise ValueError("FusionConfig.rrf_k must be >= 0 and candidates >= 1.")


def _minmax(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """Per row, scores scaled to [0, 1] over the found blocks (all equal:
  1)."""
  found = ids >= 0
  s = np.where(found, scores, np.nan).astype(np.float64)
  lo = np.nanmin(np.where(found.any(1, keepdims=True), s, 0.0), 1,
                 keepdims=True)
  hi = np.nanmax(np.where(found.any(1, keepdims=True), s, 0.0), 1,
                 keepdims=True)
  span = hi - lo
  out = np.where(span > 0, (s - lo) / np.where(span > 0, span, 1.0), 1.0)
  return np.where(found, out, 0.0)


def _found_only(ranking: Ranking) -> Ranking:
  """`ranking` with the blocks no source of it found (-1 in every source)
  left out (id -1)."""
  found = np.zeros(ranking.ids.shape, bool)
  for ranks in ranking.sources.values():
    found |= ranks >= 0
  return Ranking(np.where(found, ranking.ids, -1), ranking.scores,
                 ranking.sources)


def fuse(rankings: Sequence[Ranking], weights: Sequence[float], depth: int,
         *, method: str = "weighted", rrf_k: float = 60.0) -> Ranking:
  """The top `depth` blocks of the fused rankings (module docstring).

  A block that a ranking lists but that none of its sources found (BM25's
  blocks of score 0) takes no part: it adds nothing to the fused scores,
  nor to the min-max range.

  Returns:
    A `Ranking` whose scores are the fused scores and whose sources are
    every input's (ranks in each input's own list); fewer than `depth`
    columns when no question has that many candidates.
  """
  if method not in FUSIONS:
    raise ValueError(f"fusion method {method!r} is not one of {FUSIONS}.")
  rankings = [_found_only(r) for r in rankings]
  n = rankings[0].ids.shape[0]
  out_ids = np.full([n, depth], -1, np.int64)
  out_scores = np.full([n, depth], -np.inf, np.float32)
  names = [name for r in rankings for name in r.sources]
  sources = {name: np.full([n, depth], -1, np.int32) for name in names}
  parts = []
  for r in rankings:
    if method == "rrf":
      ranks = np.arange(r.ids.shape[1], dtype=np.float64)[None] + 1
      parts.append(np.where(r.ids >= 0, 1.0 / (rrf_k + ranks), 0.0))
    else:
      parts.append(_minmax(r.scores, r.ids))
  for q in range(n):
    fused: dict[int, float] = {}
    for r, part, w in zip(rankings, parts, weights):
      for b, v in zip(r.ids[q], part[q]):
        if b >= 0:
          fused[int(b)] = fused.get(int(b), 0.0) + w * float(v)
    ids = np.fromiter(fused, np.int64, len(fused))
    values = np.fromiter(fused.values(), np.float64, len(fused))
    order = np.lexsort((ids, -values))[:depth]
    out_ids[q, :len(order)] = ids[order]
    out_scores[q, :len(order)] = values[order]
    for r in rankings:
      for name, ranks in r.sources.items():
        where = {int(b): int(k) for b, k in zip(r.ids[q], ranks[q]) if b >= 0}
        sources[name][q, :len(order)] = [where.get(int(b), -1)
                                         for b in ids[order]]
  # No column no question fills (fewer blocks than `depth` in all).
  width = int((out_ids >= 0).sum(1).max()) if n else 0
  return Ranking(out_ids[:, :width], out_scores[:, :width],
                 {k: v[:, :width] for k, v in sources.items()})


class HybridRanker:
  """Dense and BM25 fused (`fuse` with a `FusionConfig`)."""

  def __init__(self, dense: Ranker, sparse: Ranker,
               config: FusionConfig = FusionConfig(), name: str = "hybrid"):
    self.dense, self.sparse, self.config, self.name = (dense, sparse, config,
                                                       name)

  def rank(self, questions: Sequence[str], depth: int) -> Ranking:
    questions = _questions(questions, "HybridRanker.rank")
    c = self.config
    candidates = max(depth, c.candidates)
    rankings = [self.dense.rank(questions, candidates),
                self.sparse.rank(questions, candidates)]
    return fuse(rankings, (c.dense_weight, c.bm25_weight), depth,
                method=c.method, rrf_k=c.rrf_k)


class _Unset:
  """A choice without settings: its record and its tag are its name."""
  name: ClassVar[str]

  def record(self) -> dict[str, Any]:
    return {"ranker": self.name}

  def tag(self) -> str:
    return self.name


@dataclasses.dataclass(frozen=True)
class Dense(_Unset):
  """Choice: the dense ranker (the model's query tower over its index)."""
  name: ClassVar[str] = "dense"
  reads_bm25: ClassVar[bool] = False

  def make(self, dense: Callable[[], Ranker],
           bm25: Callable[[], Ranker]) -> Ranker:
    del bm25
    return dense()


@dataclasses.dataclass(frozen=True)
class BM25(_Unset):
  """Choice: BM25 over the block store."""
  name: ClassVar[str] = "bm25"
  reads_bm25: ClassVar[bool] = True

  def make(self, dense: Callable[[], Ranker],
           bm25: Callable[[], Ranker]) -> Ranker:
    del dense
    return bm25()


@dataclasses.dataclass(frozen=True)
class Hybrid:
  """Choice: the dense ranker and BM25 fused by `fusion`."""
  fusion: FusionConfig = FusionConfig()
  name: ClassVar[str] = "hybrid"
  reads_bm25: ClassVar[bool] = True

  def make(self, dense: Callable[[], Ranker],
           bm25: Callable[[], Ranker]) -> Ranker:
    return HybridRanker(dense(), bm25(), self.fusion)

  def record(self) -> dict[str, Any]:
    return {"ranker": self.name, "fusion": dataclasses.asdict(self.fusion)}

  def tag(self) -> str:
    """"hybrid-<12 hex digits of the fusion's sha256>": each fusion its
    own."""
    fusion = json.dumps(dataclasses.asdict(self.fusion), sort_keys=True)
    return f"{self.name}-{hashlib.sha256(fusion.encode()).hexdigest()[:12]}"


@typing.runtime_checkable
class RankerChoice(Protocol):
  """Which ranker a job ranks with, chosen before any model exists.

  A new ranker is one class with these members, and its entry in
  `CHOICES` (or a gin binding: `EvalConfig.ranker = @rankers.MyRanker()`).

  Attributes:
    name: its name on the command line (`EvalConfig.ranker = "dense"`).
    reads_bm25: whether `make` calls `bm25` (BM25's index is then found
      or built beside the store).
  """
  name: ClassVar[str]
  reads_bm25: ClassVar[bool]

  def make(self, dense: Callable[[], Ranker],
           bm25: Callable[[], Ranker]) -> Ranker:
    """The ranker, from the model's dense ranker and the store's BM25
    (each made when called)."""

  def record(self) -> dict[str, Any]:
    """What a metrics record says of it: {"ranker": name, ...settings}."""

  def tag(self) -> str:
    """Its key in the eval ledger and its files' names."""


CHOICES: dict[str, type[RankerChoice]] = {
    c.name: c for c in (Dense, BM25, Hybrid)}
RANKERS = tuple(CHOICES)


def choice(ranker: str | RankerChoice, *, fusion: FusionConfig | None = None,
           where: str = "EvalConfig.ranker") -> RankerChoice:
  """`ranker` as a `RankerChoice`: a name picks its class in `CHOICES`
  (the hybrid with `fusion`, default `FusionConfig()`); a choice object is
  returned as it is. An unknown name is a ValueError listing the known."""
  if not isinstance(ranker, str):
    if not isinstance(ranker, RankerChoice):
      raise TypeError(f"{where}={ranker!r} is neither a ranker's name nor a "
                      "ranker choice (rankers.Dense(), BM25(), Hybrid()).")
    return ranker
  if ranker not in CHOICES:
    raise ValueError(f"{where}={ranker!r} is not a ranker; use one of "
                     f"{', '.join(RANKERS)} (e.g. --gin.qa_eval.EvalConfig."
                     "ranker=\"'hybrid'\").")
  if ranker == Hybrid.name:
    return Hybrid(fusion or FusionConfig())
  return CHOICES[ranker]()


def from_record(record: Any, where: str) -> RankerChoice:
  """The choice a `RankerChoice.record()` describes ({"ranker": name} and,
  for the hybrid, {"fusion": {...}}): `record` read back. Anything else is
  a ValueError naming `where` (e.g. the file it was read from)."""
  if not isinstance(record, dict) or record.get("ranker") not in CHOICES:
    raise ValueError(f"{where}: {record!r} is not a ranker's record "
                     "({\"ranker\": one of " + ", ".join(RANKERS) + "}).")
  if record["ranker"] != Hybrid.name:
    return choice(record["ranker"], where=where)
  fusion = record.get("fusion")
  names = {f.name for f in dataclasses.fields(FusionConfig)}
  if not isinstance(fusion, dict) or not set(fusion) <= names:
    raise ValueError(f"{where}: the hybrid's \"fusion\" {fusion!r} is not "
                     f"a FusionConfig (fields {sorted(names)}).")
  try:
    return Hybrid(FusionConfig(**fusion))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: the hybrid's \"fusion\": {e}") from e


def make_ranker(name: str | RankerChoice, *, store=None,
                dense: Ranker | None = None, bm25: Ranker | None = None,
                fusion: FusionConfig | None = None,
                bm25_dir: str | None = None) -> Ranker:
  """The ranker `name` (a name of `CHOICES` or a `RankerChoice`).

  Args:
    name: which.
    store: the block store (for BM25 when `bm25` is not given: its index
      is found or built beside the store, `bm25.for_store`).
    dense: the dense ranker (dense and hybrid).
    bm25: a BM25 ranker already made (else one from `store`).
    fusion: the hybrid's fusion, for a name.
    bm25_dir: the BM25 index's directory (default beside the store).
  """
  chosen = choice(name, fusion=fusion, where="ranker")

  def made_dense() -> Ranker:
    if dense is None:
      raise ValueError(f"ranker {chosen.name!r} needs a dense ranker.")
    return dense

  def made_bm25() -> Ranker:
    if bm25 is not None:
      return bm25
    if store is None:
      raise ValueError(f"ranker {chosen.name!r} needs the block store for "
                       "BM25.")
    return BM25Ranker.for_store(store, bm25_dir)
  return chosen.make(made_dense, made_bm25)

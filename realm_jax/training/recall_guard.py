"""The recall guard: REALM's retriever rolled back when it gets worse.

Used by `pretrain.train` when `RecallGuardConfig.queries` is set (the
default recipe, runs/pretrain.gin, sets it). It reads only its own part of
the run's config (`RecallGuardConfig`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from absl import logging
import jax
import numpy as np

from realm_jax.core import distributed, io_utils, parallel, records
from realm_jax.data import query_cache
from realm_jax.training import optimizer as optimizer_lib
from realm_jax.data import realm_inputs
from realm_jax.training.pretrain_config import RecallGuardConfig


def guard_every(guard: RecallGuardConfig, *, index_mode: str, training: str,
                refresh_period: int) -> int:
  """The recall guard's cadence: `guard.every`, or with full training
  ("full") on an inline index, the first multiple of it that is also a
  refresh step (`refresh_period`), so that every evaluation searches a
  fresh index."""
  if index_mode == "inline" and training == "full":
    return math.lcm(guard.every, refresh_period)
  return guard.every


class RecallGuard:
  """Rolls the retriever back when REALM makes it worse at retrieval.

  A release can be wrong: on real text the evidence gate released a
  retriever on a statistically strong but tiny reader signal, and REALM's
  updates then cost it most of its recall (docs/results/learning.md). No
  statistic of the reader measured before the release told that run from
  one that gained, so this guard watches the retriever itself, after the
  release, on a task it must not get worse at: finding held-out
  sentences' answer-bearing or own blocks (`RecallGuardConfig.queries`
  and `probe`). Every `every` steps it searches the served index with the
  current query tower and measures recall@`k`. The first evaluation, with
  the retriever still as the run started, is the baseline. After the
  release, `patience` evaluations in a row more than `max_drop` below it
  roll the retriever back to the run's initial one and freeze it for the
  rest of the run.

  Until the release the retriever does not move (`optimizer.delayed`), so
  the initial retriever (`init_from`'s, kept on the host) is the retriever
  at the release. In full REALM the served index was built by the drifted
  document tower; the next refresh re-embeds the corpus with the restored
  one. Baseline, streak and the
  trip step go into the checkpoints' meta, every evaluation into the log
  and recall_guard.jsonl, with the served index's staleness.

  In full REALM the search mixes the current query tower with the index's
  older document tower, and that mismatch alone costs recall: on the
  Wikipedia slice 10 steps of staleness cost 15 points of question
  recall@5 early in a run (docs/results/learning.md). So with an inline
  index the guard evaluates only on fresh indices, every `guard_every`
  steps; with a builder's index, compare its log's `index_staleness`
  column.
  """

  def __init__(self, config: RecallGuardConfig, query_config, inputs, store,
               initial_retriever, workdir: str, is_chief: bool, *,
               seed: int, batch_size: int, every: int):
    """`query_config`: the masked queries the run trains on (the guard's
    cache must match them); `inputs`: the run's `pretrain.RetrievalInput`;
    `initial_retriever`: the run's initial retriever parameters (host
    arrays); `seed`, `batch_size`: the run's; `every`: `guard_every`."""
    self.config, self.inputs, self.is_chief = config, inputs, is_chief
    self.initial_retriever = initial_retriever
    self.path = io_utils.join(workdir, "recall_guard.jsonl")
    probe = _PROBES[config.probe](config, query_config, store, seed)
    devices, hosts, me = (jax.process_count() * len(inputs.mesh.local_devices),
                          jax.process_count(), jax.process_index())
    n = probe.size // devices * devices
    if not n:
      raise ValueError(f"{probe.source}: {probe.size} {probe.name} probes "
                       f"for the recall guard, fewer than the {devices} "
                       f"devices (one each at least). {probe.advice}")
    self.probe = probe.take(me * n // hosts, (me + 1) * n // hosts)
    self.chunk = max(batch_size // hosts, len(inputs.mesh.local_devices))
    self.baseline, self.streak, self.tripped = None, 0, None
    self.last = float("nan")
    self.every = every

  def restore(self, meta: dict[str, Any], start_step: int) -> None:
    saved = meta.get("recall_guard", {})
    self.baseline = saved.get("baseline")
    self.streak = int(saved.get("streak", 0))
    self.tripped = saved.get("tripped")
    if self.is_chief:
      records.keep_records(self.path, lambda r: r["step"] < start_step)

  def recall(self, state) -> float:
    """The share of the guard's probes (this host's rows, gathered) whose
    target is among the served index's top `k` for `state`'s
    query tower."""
    host, index, probe = self.inputs.host, self.inputs.index, self.probe
    found = []
    for lo in range(0, probe.size, self.chunk):
      rows = slice(lo, lo + self.chunk)
      chunk = {k: v[rows] for k, v in probe.queries.items()}
      q_emb = parallel.local_rows(host.query_embeddings(chunk, state))
      hits, _ = index.search(np.asarray(q_emb, np.float32), self.config.k)
      found.append(probe.found(hits, rows))
    return float(np.mean(distributed.allgather_rows(np.concatenate(found))))

  def update_state(self, step: int, state):
    c = self.config
    if self.tripped is not None or step % self.every:
      return state
    recall = self.last = self.recall(state)
    staleness = step - self.inputs.index.step
    release = optimizer_lib.release_step(state.opt_state)
    training = release is not None and step > release
    if self.baseline is None:
      if training:
        raise ValueError(
            "the recall guard's first evaluation (step "
            f"{step}) found the retriever already training since step "
            f"{release}: its baseline must be the initial retriever. Turn "
            "the guard on from the start of a run.")
      self.baseline = recall
    floor = self.baseline - c.max_drop
    self.streak = self.streak + 1 if training and recall < floor else 0
    trips = bool(distributed.broadcast_from_chief(
        np.int32(self.streak >= c.patience)))
    logging.info(
        "recall guard at step %d (index %d steps stale): %s recall@%d %.4f "
        "(baseline %.4f, floor %.4f); %s", step, staleness, self.probe.name,
        c.k, recall, self.baseline, floor,
        ("retriever frozen" if not training else
         f"below the floor {self.streak}/{c.patience} in a row"
         + (": ROLL BACK the retriever to the run's initial one and freeze "
            "it" if trips else "")))
    if self.is_chief:
      io_utils.append_jsonl(self.path, {
          "step": step, "probe": self.probe.name,
          f"recall@{c.k}": recall,
          "baseline": self.baseline, "training": training,
          "index_staleness": staleness, "streak": self.streak,
          "rolled_back": trips})
    if not trips:
      return state
    self.tripped = step
    return state.replace(
        params=dict(state.params, retriever=_placed_like(
            self.initial_retriever, state.params["retriever"])),
        opt_state=optimizer_lib.freeze_again(state.opt_state))

  def checkpoint_meta(self) -> dict[str, Any]:
    return {"recall_guard": {"baseline": self.baseline, "streak": self.streak,
                             "tripped": self.tripped}}


class _Probes:
  """What the guard retrieves for: `queries` (token arrays, one row per
  probe) and `targets` (what each row must find); subclasses say how a
  row's hits are judged (`found`)."""

  queries: dict
  targets: np.ndarray

  @property
  def size(self) -> int:
    return len(self.targets)

  def take(self, lo: int, hi: int):
    """These probes' rows [lo, hi)."""
    part = copy.copy(self)
    part.queries = {k: v[lo:hi] for k, v in self.queries.items()}
    part.targets = self.targets[lo:hi]
    return part


class _OwnBlocks(_Probes):
  """Probe "own_block": masked sentences, each found when the block that
  holds it is retrieved (ICT's task)."""

  name = "own-block"
  advice = ("The guard measures held-out sentences of articles that are in "
            "the corpus (REALM's Wikipedia: X within Z); use such a cache, "
            "or RecallGuardConfig.probe='answer' where the queries' "
            "articles are not in the corpus.")

  def __init__(self, config: RecallGuardConfig, query_config, store,
               seed: int):
    self.source = f"RecallGuardConfig.queries {config.queries}"
    queries = _sentences(config, query_config, seed)
    own = realm_inputs.TrivialCandidates(store, "block").source_blocks(
        queries)
    keep = own >= 0  # (sentences whose block is in the store)
    self.queries = {k: queries[k][keep] for k in ("query_ids", "query_mask")}
    self.targets = own[keep]

  def found(self, hits: np.ndarray, rows: slice) -> np.ndarray:
    """bool [len(hits)]: each row's own block is among its hits."""
    return (hits == self.targets[rows, None]).any(1)


class _AnswerBearing(_Probes):
  """Probe "answer": masked sentences, each found when a retrieved block
  holds its masked span (the blocks the reader's evidence points to,
  `gate.answer_bearing`). Unlike own-block recall it needs no overlap of
  X and Z: a synthetic world's sentences and biographies are separate
  texts."""

  name = "answer-bearing"
  advice = ("The guard measures masked sentences whose span some block of "
            "the store holds; use a larger query cache.")

  def __init__(self, config: RecallGuardConfig, query_config, store,
               seed: int):
    self.source = f"RecallGuardConfig.queries {config.queries}"
    self.store = store
    queries = _sentences(config, query_config, seed)
    spans = realm_inputs.masked_spans(queries)
    keep = np.asarray([len(span) > 0 for span in spans], bool)
    self.queries = {k: queries[k][keep] for k in ("query_ids", "query_mask")}
    self.targets = np.empty(int(keep.sum()), object)
    self.targets[:] = [span for span, kept in zip(spans, keep) if kept]

  def found(self, hits: np.ndarray, rows: slice) -> np.ndarray:
    """bool [len(hits)]: a hit of each row holds its masked span."""
    valid = hits >= 0
    bodies, lengths = self.store.bodies(
        np.where(valid, hits, 0).reshape(-1), self.store.max_block_len)
    held = realm_inputs.holds_spans(
        list(self.targets[rows]), bodies.reshape(*hits.shape, -1),
        lengths.reshape(hits.shape))
    return (held & valid).any(1)


def _sentences(config: RecallGuardConfig, query_config, seed: int
               ) -> dict[str, np.ndarray]:
  """The first `num_queries` of the guard's cache (its held-out dev split
  where it has one, `query_cache.held_out`), masked as the run's queries
  (`query_config`)."""
  stream = query_cache.QueryStream(
      query_cache.held_out(config.queries, "RecallGuardConfig.queries"),
      seed=seed, batch_size=config.num_queries)
  try:
    stream.check(query_config)
    return stream.head(config.num_queries)
  finally:
    stream.close()


_PROBES = {"answer": _AnswerBearing, "own_block": _OwnBlocks}


def _placed_like(values, like):
  """Host arrays `values` as global arrays with `like`'s shardings/dtypes."""
  def place(value, old):
    value = np.asarray(value, old.dtype)
    if value.shape != old.shape:
      raise ValueError(f"initial retriever parameter of shape {value.shape} "
                       f"where the run has {old.shape}.")
    return jax.make_array_from_callback(old.shape, old.sharding,
                                        lambda index: value[index])
  return jax.tree.map(place, values, like)

"""The retriever gate: REALM's retriever released when the reader reads.

Used by `pretrain.train` with a measured `RetrieverScheduleConfig.gate`
("utility" or "evidence", both defined by `gate_statistics`, which
`eval.pretrain_eval` also reports).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping

from absl import logging
import jax
import numpy as np

from realm_jax.core import distributed, io_utils, parallel, records
from realm_jax.data import qa, query_cache
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.model import functional, losses
from realm_jax.training import optimizer as optimizer_lib
from realm_jax.training import qa_inputs
from realm_jax.training import realm_inputs


def answer_bearing(queries: Mapping[str, np.ndarray], candidates: np.ndarray,
                   store, *, null_document: bool = True) -> np.ndarray:
  """bool [B, C]: candidate c of query b holds the query's masked span.

  `candidates` [B, k] are block ids; the null document (column 0 when
  `null_document`) holds nothing. A block holds the span when its body
  has the span's wordpieces contiguously (`realm_inputs.holds_spans`).
  """
  batch, k = candidates.shape
  bodies, lengths = store.bodies(np.asarray(candidates).reshape(-1),
                                 store.max_block_len)
  found = realm_inputs.holds_spans(realm_inputs.masked_spans(queries),
                                   bodies.reshape(batch, k, -1),
                                   lengths.reshape(batch, k))
  return np.concatenate([np.zeros((batch, 1), bool), found], 1) if (
      null_document) else found


def gate_statistics(retrieval_logits: np.ndarray, token_ll: np.ndarray,
                    weights: np.ndarray, bearing: np.ndarray
                    ) -> dict[str, float]:
  """The gate's two statistics on a batch of queries (numpy, float64).

  Args:
    retrieval_logits: [B, C] f(x, z), the null document first.
    token_ll: [B, C, M] log p(y_j|z, x).
    weights: [B, M] 1 for real masks.
    bearing: bool [B, C] answer-bearing candidates (`answer_bearing`).

  Returns:
    utility: mean over real masks of log p(y_j|x) - log p(y_j|z_0, x),
      z_0 the null document (the top block in a run without one).
    evidence: per query b with an answer-bearing candidate,
      e_b = mean_j sum_{z answer-bearing} [p(z|x, y_j) - p(z|x)], the
      mass the reader's posterior moves onto answer-bearing blocks. REALM's
      retriever gradient is d log p(y_j|x) / d f(z) = p(z|x, y_j) - p(z|x),
      so e_b is the ascent on the answer-bearing blocks' scores per mask:
      > 0 when the reader's evidence pulls the retriever toward them,
      exactly 0 while the reader ignores the blocks. `evidence` is its
      mean, `evidence_z` mean / standard error (0 with < 2 such queries),
      `answer_bearing_queries` their number.
  """
  logits = np.asarray(retrieval_logits, np.float64)
  ll = np.asarray(token_ll, np.float64)
  w = np.asarray(weights, np.float64)
  log_prior = logits - _logsumexp(logits, 1)[:, None]            # [B, C]
  joint = log_prior[:, :, None] + ll                              # [B, C, M]
  marginal = _logsumexp(joint, 1)                                 # [B, M]
  posterior = np.exp(joint - marginal[:, None, :])                # [B, C, M]
  moved = np.einsum("bcm,bc->bm", posterior - np.exp(log_prior)[:, :, None],
                    np.asarray(bearing, np.float64))
  masks = w.sum(1)
  rows = bearing.any(1) & (masks > 0)
  per_query = (moved * w).sum(1)[rows] / masks[rows]
  n = len(per_query)
  mean = float(per_query.mean()) if n else 0.0
  sd = float(per_query.std(ddof=1)) if n > 1 else 0.0
  return {
      "utility": float(((marginal - ll[:, 0]) * w).sum() / max(w.sum(), 1)),
      "evidence": mean,
      "evidence_z": mean / (sd / math.sqrt(n)) if sd > 0 else 0.0,
      "answer_bearing_queries": n,
  }


def gate_decision(stats: Mapping[str, float], streak: int, *, mode: str,
                  min_utility: float, min_evidence_z: float,
                  patience: int) -> tuple[int, bool]:
  """One gate evaluation's decision: (the new streak, whether to release).

  An evaluation is significant when its test passes: for "evidence",
  `evidence_z >= min_evidence_z`; for "utility", `utility >= min_utility`.
  `streak` counts significant evaluations in a row. The retriever is
  released when the streak reaches `patience` *and* the reader's measured
  effect, `utility` (nats per mask the blocks add to the masked tokens),
  reaches the floor `min_utility` at this evaluation. A z-test over a
  thousand queries is "significant" at a ten-thousandth of a nat: two
  held-out worlds released on 0.0001 nats at z 9.9 and lost their ICT
  recall (docs/results/learning.md), so significance alone never
  releases.

  Args:
    stats: `gate_statistics`'s `utility` and `evidence_z`.
    streak: significant evaluations in a row before this one.
    mode: "evidence" or "utility".
    min_utility, min_evidence_z, patience: the gate's thresholds.
  """
  significant = (stats["evidence_z"] >= min_evidence_z if mode == "evidence"
                 else stats["utility"] >= min_utility)
  streak = streak + 1 if significant else 0
  return streak, streak >= patience and stats["utility"] >= min_utility


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
  top = np.max(x, axis=axis, keepdims=True)
  return np.squeeze(top, axis) + np.log(np.sum(np.exp(x - top), axis=axis))


class RetrieverGate:
  """Releases the retriever when the reader is measured to read.

  REALM's cold start: until the reader uses the retrieved blocks, the
  retriever's gradient r(z) = [p(y|z,x)/p(y|x) - 1] p(z|x) is noise, and
  following it destroys the warm start (a fixed warm-up tuned on one world
  released it too early on a larger one: docs/results/learning.md). So the
  retriever stays frozen until the reader, evaluated on a fixed slice of
  `RetrieverScheduleConfig.gate_queries` with the served index, passes the
  gate's test (`gate`: "utility" or "evidence", see `gate_statistics`)
  `gate_patience` evaluations in a row. The release
  step is written into the optimiser state (so a checkpoint keeps it), the
  streak into the checkpoints' meta (so a restart decides the same), every
  evaluation into the log and gate.jsonl.
  """

  def __init__(self, config, query_config, inputs, graphdef, store,
               workdir: str, is_chief: bool):
    """`config`: the `pretrain.PretrainConfig`; `query_config`: the
    masked queries it trains on (the gate's cache must match them);
    `inputs`: the run's `pretrain.RetrievalInput`; `store`: its blocks."""
    self.config, self.inputs, self.is_chief = config, inputs, is_chief
    self.store = store
    self.path = io_utils.join(workdir, "gate.jsonl")
    queries = _gate_queries(config, query_config)
    # This host's rows of the fixed batch: as many as the cache has, to a
    # multiple of the devices.
    devices, hosts, me = (jax.process_count() * len(inputs.mesh.local_devices),
                          jax.process_count(), jax.process_index())
    n = len(queries["query_ids"]) // devices * devices
    if not n:
      raise ValueError(
          f"gate_queries {config.retriever.gate_queries} gives "
          f"{len(queries['query_ids'])} queries, fewer than the {devices} "
          "devices; use a larger cache.")
    if n < config.retriever.gate_num_queries:
      logging.info("retriever gate: %d queries of %s (gate_num_queries=%d; "
                   "the cache has %d, cut to a multiple of %d devices).", n,
                   config.retriever.gate_queries,
                   config.retriever.gate_num_queries,
                   len(queries["query_ids"]), devices)
    self.queries = {k: v[me * n // hosts:(me + 1) * n // hosts]
                    for k, v in queries.items()}
    null_document = config.retrieval.null_document

    def evaluate(params, batch):
      retrieval_logits, mlm_logits = functional.bind(
          graphdef, params).pretraining_logits(
              batch, null_document=null_document)
      return retrieval_logits, losses.token_log_likelihoods(
          mlm_logits, batch["mlm_targets"])

    self.evaluate = jax.jit(evaluate)
    # Evaluated a training batch at a time: the reader never holds more
    # rows than in training (2,048 gate queries x k + 1 MiniLM blocks in
    # one call is 64 batches of 32), and one shape compiles (two when the
    # slice is not a multiple of the batch).
    self.chunk = max(config.batch_size // hosts,
                     len(inputs.mesh.local_devices))
    self.streak, self.last = 0, {}
    self.release = config.retriever.freeze_steps

  def restore(self, meta: dict[str, Any], start_step: int, state) -> None:
    self.streak = int(meta.get("retriever_gate", {}).get("streak", 0))
    self.release = optimizer_lib.release_step(state.opt_state)
    if self.is_chief:
      # Decisions after the restored step are replayed by this run.
      records.keep_records(self.path, lambda r: r["step"] < start_step)

  def statistics(self, state) -> dict[str, float]:
    """`gate_statistics` of the gate's queries (every host's rows)."""
    parts = []
    for lo in range(0, len(self.queries["query_ids"]), self.chunk):
      chunk = {k: v[lo:lo + self.chunk] for k, v in self.queries.items()}
      batch, candidates = self.inputs.held_out_batch(chunk, state)
      logits, token_ll = self.evaluate(state.params, batch)
      parts.append((np.asarray(parallel.local_rows(logits)),
                    np.asarray(parallel.local_rows(token_ll)),
                    answer_bearing(
                        chunk, candidates, self.store,
                        null_document=self.config.retrieval.null_document)))
    logits, token_ll, bearing = (np.concatenate(p) for p in zip(*parts))
    gather = distributed.allgather_rows
    return gate_statistics(gather(logits), gather(token_ll),
                           gather(self.queries["mlm_weights"]),
                           gather(bearing))

  def update_state(self, step: int, state):
    release = self.release  # (Host copy: no device sync every step.)
    if (release is None or step >= release
        or step % self.config.retriever.gate_every):
      return state
    c = self.config.retriever
    stats = self.last = self.statistics(state)
    self.streak, opens = gate_decision(
        stats, self.streak, mode=c.gate, min_utility=c.gate_min_utility,
        min_evidence_z=c.gate_min_evidence_z, patience=c.gate_patience)
    opens = bool(distributed.broadcast_from_chief(np.int32(opens)))
    test = (f"evidence z >= {c.gate_min_evidence_z:g}" if c.gate == "evidence"
            else f"utility >= {c.gate_min_utility:g} nats")
    logging.info(
        "retriever gate at step %d: utility %.4f nats, evidence %.5f (z %.2f "
        "over %d queries with an answer-bearing block); %s: %d/%d in a row, "
        "effect floor %g nats -> %s", step, stats["utility"],
        stats["evidence"], stats["evidence_z"],
        stats["answer_bearing_queries"], test, self.streak, c.gate_patience,
        c.gate_min_utility, "RELEASE the retriever" if opens else
        f"hold (release at step {release} at the latest)")
    if self.is_chief:
      io_utils.append_jsonl(self.path, {
          "step": step, **stats, "streak": self.streak, "released": opens})
    if not opens:
      return state
    self.release = step
    return state.replace(opt_state=optimizer_lib.release_frozen(
        state.opt_state, step))

  def checkpoint_meta(self) -> dict[str, Any]:
    return {"retriever_gate": {"streak": self.streak}}


def _gate_queries(config, query_config) -> dict[str, np.ndarray]:
  """The first `gate_num_queries` of the gate's cache; its errors say that
  the cache at fault is `RetrieverScheduleConfig.gate_queries`."""
  schedule = config.retriever
  try:
    stream = query_cache.QueryStream(
        schedule.gate_queries, seed=config.seed,
        batch_size=max(schedule.gate_num_queries, 1))
    try:
      stream.check(query_config)
      return stream.head(schedule.gate_num_queries)
    finally:
      stream.close()
  except (OSError, ValueError) as e:
    raise type(e)(
        f"RetrieverScheduleConfig.gate_queries={schedule.gate_queries!r} "
        f"(the retriever gate's query cache): {e}") from e


def guard_every(config) -> int:
  """The recall guard's cadence: `recall_guard.every`, or with full
  training on an inline index, the first multiple of it that is also a
  refresh step (`refresh_period`), so that every evaluation searches a
  fresh index."""
  every = config.recall_guard.every
  if config.index_mode == "inline" and config.retriever.training == "full":
    return math.lcm(every, config.refresh_period)
  return every


class RecallGuard:
  """Rolls the retriever back when REALM makes it worse at retrieval.

  A release can be wrong: on real text the evidence gate released a
  retriever on a statistically strong but tiny reader signal, and REALM's
  updates then cost it most of its recall (docs/results/learning.md). No
  statistic of the reader measured before the release told that run from
  one that gained, so this guard watches the retriever itself, after the
  release, on a task it must not get worse at: finding held-out
  sentences' own blocks (ICT's task; `RecallGuardConfig.queries`,
  sentences of articles that are in the corpus, never trained on). Every
  `gate_every` steps it searches the served index with the current query
  tower and measures recall@`recall_guard_k` of the own block. The first
  evaluation, with the retriever still as the run started, is the
  baseline. After the release, `recall_guard_patience` evaluations in a
  row more than `recall_guard_max_drop` below it roll the retriever back
  to the run's initial one and freeze it for the rest of the run.

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
  index the guard evaluates only on fresh indices, every
  `guard_every(config)` steps; with a builder's index, compare its log's
  `index_staleness` column.
  """

  def __init__(self, config, query_config, inputs, store, initial_retriever,
               workdir: str, is_chief: bool):
    """`config`: the `pretrain.PretrainConfig`; `query_config`: the masked
    queries it trains on (the guard's cache must match them); `inputs`: the
    run's `pretrain.RetrievalInput`; `initial_retriever`: the run's
    initial retriever parameters (host arrays)."""
    self.config, self.inputs, self.is_chief = config, inputs, is_chief
    self.initial_retriever = initial_retriever
    self.path = io_utils.join(workdir, "recall_guard.jsonl")
    probe = (_Questions(config, query_config, store)
             if config.recall_guard.questions else
             _PROBES[config.recall_guard.probe](config, query_config, store))
    devices, hosts, me = (jax.process_count() * len(inputs.mesh.local_devices),
                          jax.process_count(), jax.process_index())
    n = probe.size // devices * devices
    if not n:
      raise ValueError(f"{probe.source}: {probe.size} {probe.name} probes "
                       f"for the recall guard, fewer than the {devices} "
                       f"devices (one each at least). {probe.advice}")
    self.probe = probe.take(me * n // hosts, (me + 1) * n // hosts)
    self.chunk = max(config.batch_size // hosts,
                     len(inputs.mesh.local_devices))
    self.baseline, self.streak, self.tripped = None, 0, None
    self.last = float("nan")
    self.every = guard_every(config)

  def restore(self, meta: dict[str, Any], start_step: int) -> None:
    saved = meta.get("recall_guard", {})
    self.baseline = saved.get("baseline")
    self.streak = int(saved.get("streak", 0))
    self.tripped = saved.get("tripped")
    if self.is_chief:
      records.keep_records(self.path, lambda r: r["step"] < start_step)

  def recall(self, state) -> float:
    """The share of the guard's probes (this host's rows, gathered) whose
    target is among the served index's top `recall_guard_k` for `state`'s
    query tower."""
    host, index, probe = self.inputs.host, self.inputs.index, self.probe
    found = []
    for lo in range(0, probe.size, self.chunk):
      rows = slice(lo, lo + self.chunk)
      chunk = {k: v[rows] for k, v in probe.queries.items()}
      q_emb = parallel.local_rows(host.query_embeddings(chunk, state))
      hits, _ = index.search(np.asarray(q_emb, np.float32),
                             self.config.recall_guard.k)
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
    floor = self.baseline - c.recall_guard.max_drop
    self.streak = self.streak + 1 if training and recall < floor else 0
    trips = bool(distributed.broadcast_from_chief(
        np.int32(self.streak >= c.recall_guard.patience)))
    logging.info(
        "recall guard at step %d (index %d steps stale): %s recall@%d %.4f "
        "(baseline %.4f, floor %.4f); %s", step, staleness, self.probe.name,
        c.recall_guard.k, recall, self.baseline, floor,
        ("retriever frozen" if not training else
         f"below the floor {self.streak}/{c.recall_guard.patience} in a row"
         + (": ROLL BACK the retriever to the run's initial one and freeze "
            "it" if trips else "")))
    if self.is_chief:
      io_utils.append_jsonl(self.path, {
          "step": step, "probe": self.probe.name,
          f"recall@{c.recall_guard.k}": recall,
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
  """The guard's probes from `recall_guard_queries`: held-out sentences,
  each found when the block that holds it is retrieved (ICT's task)."""

  name = "own-block"
  advice = ("The guard measures held-out sentences of articles that are in "
            "the corpus (REALM's Wikipedia: X within Z); use such a cache, "
            "dev questions (recall_guard_questions), or no guard where the "
            "queries' articles are not in the corpus.")

  def __init__(self, config, query_config, store):
    self.source = f"recall_guard_queries {config.recall_guard.queries}"
    stream = query_cache.QueryStream(
        config.recall_guard.queries, seed=config.seed,
        batch_size=config.recall_guard.num_queries)
    try:
      stream.check(query_config)
      queries = stream.head(config.recall_guard.num_queries)
    finally:
      stream.close()
    own = realm_inputs.TrivialCandidates(store, "block").source_blocks(
        queries)
    keep = own >= 0  # (sentences whose block is in the store)
    self.queries = {k: queries[k][keep] for k in ("query_ids", "query_mask")}
    self.targets = own[keep]

  def found(self, hits: np.ndarray, rows: slice) -> np.ndarray:
    """bool [len(hits)]: each row's own block is among its hits."""
    return (hits == self.targets[rows, None]).any(1)


class _AnswerBearing(_Probes):
  """The guard's probes from `recall_guard_queries`: masked sentences,
  each found when a retrieved block holds its masked span (the blocks
  the reader's evidence points to, `answer_bearing`). Unlike own-block
  recall it needs no overlap of X and Z: a synthetic world's sentences
  and biographies are separate texts."""

  name = "answer-bearing"
  advice = ("The guard measures masked sentences whose span some block of "
            "the store holds; use a larger query cache.")

  def __init__(self, config, query_config, store):
    self.source = f"recall_guard_queries {config.recall_guard.queries}"
    self.store = store
    stream = query_cache.QueryStream(
        config.recall_guard.queries, seed=config.seed,
        batch_size=config.recall_guard.num_queries)
    try:
      stream.check(query_config)
      queries = stream.head(config.recall_guard.num_queries)
    finally:
      stream.close()
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


class _Questions(_Probes):
  """The guard's probes from `recall_guard_questions`: dev questions about
  the corpus, each found when a retrieved block holds one of its answers
  (`qa.has_answer`, as `eval.pretrain_eval.qa_recall` counts)."""

  name = "question"
  advice = ("Give a file of at least that many questions about the corpus "
            "(ORQA JSONL), kept apart from the evaluation questions.")

  def __init__(self, config, query_config, store):
    path = config.recall_guard.questions
    self.source, self.store = f"recall_guard_questions {path}", store
    questions = qa.read_qa_jsonl(path, strict=True)
    questions = questions[:config.recall_guard.num_queries]
    tokens = qa_inputs.tokenize_questions(
        Tokenizer(), [q.question for q in questions],
        query_config.query_length)
    self.queries = {"query_ids": tokens["question_ids"],
                    "query_mask": tokens["question_mask"]}
    self.targets = np.empty(len(questions), object)
    self.targets[:] = questions

  def found(self, hits: np.ndarray, rows: slice) -> np.ndarray:
    """bool [len(hits)]: a hit of each row holds one of its answers."""
    return np.asarray([
        qa.has_answer_batch([self.store.text(int(j)) for j in row if j >= 0],
                            q.answers, q.is_regex).any()
        for row, q in zip(hits, self.targets[rows])], bool)


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

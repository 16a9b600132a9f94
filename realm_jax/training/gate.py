"""The retriever gate: REALM's retriever released when the reader reads.

Used by `pretrain.train` with a measured `GateConfig.mode` ("evidence" or
"utility", both defined by `gate_statistics`, which `eval.pretrain_eval`
also reports; the release by `gate_decision`). It reads only its own part
of the run's config (`GateConfig`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from absl import logging
import jax
import numpy as np

from realm_jax.core import distributed, io_utils, parallel, records
from realm_jax.data import query_cache
from realm_jax.model import functional, losses
from realm_jax.training import optimizer as optimizer_lib
from realm_jax.data import realm_inputs
from realm_jax.training.pretrain_config import GateConfig


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
  `GateConfig.queries` with the served index, passes the gate's test
  (`mode`: "evidence" or "utility", see `gate_statistics`) `patience`
  evaluations in a row with an effect of at least `min_utility` nats
  (`gate_decision`). The release step is written into the optimiser state
  (so a checkpoint keeps it), the streak into the checkpoints' meta (so a
  restart decides the same), every evaluation into the log and
  gate.jsonl.
  """

  def __init__(self, config: GateConfig, query_config, inputs, graphdef,
               store, workdir: str, is_chief: bool, *, seed: int,
               batch_size: int, null_document: bool):
    """`query_config`: the masked queries the run trains on (the gate's
    cache must match them); `inputs`: the run's `pretrain.RetrievalInput`;
    `store`: its blocks; `seed`, `batch_size`: the run's;
    `null_document`: its candidates' (`RetrievalConfig`)."""
    self.config, self.inputs, self.is_chief = config, inputs, is_chief
    self.store, self.null_document = store, null_document
    self.path = io_utils.join(workdir, "gate.jsonl")
    queries = _gate_queries(config, query_config, seed)
    # This host's rows of the fixed batch: as many as the cache has, to a
    # multiple of the devices.
    devices, hosts, me = (jax.process_count() * len(inputs.mesh.local_devices),
                          jax.process_count(), jax.process_index())
    n = len(queries["query_ids"]) // devices * devices
    if not n:
      raise ValueError(
          f"GateConfig.queries {config.queries} gives "
          f"{len(queries['query_ids'])} queries, fewer than the {devices} "
          "devices; use a larger cache.")
    if n < config.num_queries:
      logging.info("retriever gate: %d queries of %s (num_queries=%d; the "
                   "cache has %d, cut to a multiple of %d devices).", n,
                   config.queries, config.num_queries,
                   len(queries["query_ids"]), devices)
    self.queries = {k: v[me * n // hosts:(me + 1) * n // hosts]
                    for k, v in queries.items()}

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
    self.chunk = max(batch_size // hosts, len(inputs.mesh.local_devices))
    self.streak, self.last = 0, {}
    # Until restored from the optimiser state: the latest release (None:
    # never without the gate's evidence).
    self.release = config.latest_release

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
                    answer_bearing(chunk, candidates, self.store,
                                   null_document=self.null_document)))
    logits, token_ll, bearing = (np.concatenate(p) for p in zip(*parts))
    gather = distributed.allgather_rows
    return gate_statistics(gather(logits), gather(token_ll),
                           gather(self.queries["mlm_weights"]),
                           gather(bearing))

  def update_state(self, step: int, state):
    release = self.release  # (Host copy: no device sync every step.)
    released = release is not None and step >= release
    if released or step % self.config.every:
      return state
    c = self.config
    stats = self.last = self.statistics(state)
    self.streak, opens = gate_decision(
        stats, self.streak, mode=c.mode, min_utility=c.min_utility,
        min_evidence_z=c.min_evidence_z, patience=c.patience)
    opens = bool(distributed.broadcast_from_chief(np.int32(opens)))
    test = (f"evidence z >= {c.min_evidence_z:g}" if c.mode == "evidence"
            else f"utility >= {c.min_utility:g} nats")
    logging.info(
        "retriever gate at step %d: utility %.4f nats, evidence %.5f (z %.2f "
        "over %d queries with an answer-bearing block); %s: %d/%d in a row, "
        "effect floor %g nats -> %s", step, stats["utility"],
        stats["evidence"], stats["evidence_z"],
        stats["answer_bearing_queries"], test, self.streak, c.patience,
        c.min_utility, "RELEASE the retriever" if opens else
        "hold (no release without the gate's evidence)"
        if c.latest_release is None else
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


def _gate_queries(config: GateConfig, query_config, seed: int
                  ) -> dict[str, np.ndarray]:
  """The first `num_queries` of the gate's cache; its errors say that the
  cache at fault is `GateConfig.queries`.

  The utility gate reads the cache's held-out dev split where it has one
  (`query_cache.held_out`): it measures reading on sentences never
  trained on. The evidence gate reads the training queries, whose
  gradient the retriever follows (on held-out ones it was backwards,
  docs/results/learning.md).
  """
  try:
    if config.mode == "utility":
      path = query_cache.held_out(config.queries, "GateConfig.queries")
    else:
      path = config.queries
      logging.info("GateConfig.queries: the %s gate reads %s as given (the "
                   "training queries, for the evidence gate; not a dev "
                   "split).", config.mode, path)
    stream = query_cache.QueryStream(
        path, seed=seed, batch_size=max(config.num_queries, 1))
    try:
      stream.check(query_config)
      return stream.head(config.num_queries)
    finally:
      stream.close()
  except (OSError, ValueError) as e:
    raise type(e)(
        f"GateConfig.queries={config.queries!r} (the retriever gate's query "
        f"cache): {e}") from e

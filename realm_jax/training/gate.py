"""The retriever gate: REALM's retriever released when the reader reads.

Used by `pretrain.train` with `PretrainConfig.retriever_gate="utility"`.
"""

from __future__ import annotations

import json
from typing import Any

from absl import logging
import jax
import numpy as np

from realm_jax.core import distributed, io_utils
from realm_jax.data import query_cache
from realm_jax.training import optimizer as optimizer_lib


class RetrieverGate:
  """Releases the retriever when the reader is measured to read.

  REALM's cold start: until the reader uses the retrieved blocks, the
  retriever's gradient r(z) = [p(y|z,x)/p(y|x) - 1] p(z|x) is noise, and
  following it destroys the warm start (a fixed warm-up tuned on one world
  released it too early on a larger one: docs/results/learning.md). So the
  retriever stays frozen until the retrieval utility on held-out queries
  (`PretrainConfig.gate_queries`, never trained on) clears
  `gate_min_utility` nats for `gate_patience` evaluations in a row. The
  release step is written into the optimiser state (so a checkpoint keeps
  it), the streak into the checkpoints' meta (so a restart decides the
  same), every decision into the log and gate.jsonl.
  """

  def __init__(self, config, query_config, inputs, loss_fn, workdir: str,
               is_chief: bool):
    """`config`: the `pretrain.PretrainConfig`; `query_config`: the
    masked queries it trains on (the gate's cache must match them);
    `inputs`: the run's `pretrain.RetrievalInput`."""
    self.config, self.inputs, self.is_chief = config, inputs, is_chief
    self.path = io_utils.join(workdir, "gate.jsonl")
    stream = query_cache.QueryStream(
        config.gate_queries, seed=config.seed,
        batch_size=max(config.gate_num_queries, 1))
    try:
      stream.check(query_config)
      queries = stream.head(config.gate_num_queries)
    finally:
      stream.close()
    # This host's rows of the fixed held-out batch.
    n, hosts, me = (len(queries["query_ids"]), jax.process_count(),
                    jax.process_index())
    if n % (hosts * len(inputs.mesh.local_devices)):
      raise ValueError(
          f"gate_queries {config.gate_queries} gives {n} queries, not a "
          f"multiple of the {hosts * len(inputs.mesh.local_devices)} "
          "devices; set gate_num_queries to a multiple of it (and at most "
          "the cache's size).")
    self.queries = {k: v[me * n // hosts:(me + 1) * n // hosts]
                    for k, v in queries.items()}
    self.evaluate = jax.jit(lambda params, batch: loss_fn(params, batch,
                                                          None))
    self.streak, self.last_utility = 0, float("nan")
    self.release = config.freeze_retriever_steps

  def restore(self, meta: dict[str, Any], start_step: int, state) -> None:
    self.streak = int(meta.get("retriever_gate", {}).get("streak", 0))
    self.release = optimizer_lib.release_step(state.opt_state)
    if self.is_chief and io_utils.as_path(self.path).exists():
      # Decisions after the restored step are replayed by this run.
      kept = [line for line in io_utils.read_text(self.path).splitlines()
              if line.strip() and json.loads(line)["step"] < start_step]
      io_utils.atomic_write_text(self.path,
                                 "".join(l + "\n" for l in kept))

  def utility(self, state) -> float:
    """Held-out retrieval utility, nats per mask, with the served index."""
    batch = self.inputs.held_out_batch(self.queries, state)
    _, weights, sums = self.evaluate(state.params, batch)
    return float(jax.device_get(sums["retrieval_utility"])) / max(
        float(jax.device_get(weights)), 1.0)

  def update_state(self, step: int, state):
    release = self.release  # (Host copy: no device sync every step.)
    if release is None or step >= release or step % self.config.gate_every:
      return state
    c = self.config
    utility = self.last_utility = self.utility(state)
    self.streak = self.streak + 1 if utility >= c.gate_min_utility else 0
    opens = bool(distributed.broadcast_from_chief(
        np.int32(self.streak >= c.gate_patience)))
    logging.info(
        "retriever gate at step %d: held-out utility %.4f nats (threshold "
        "%.3f), %d/%d in a row -> %s", step, utility, c.gate_min_utility,
        self.streak, c.gate_patience,
        "RELEASE the retriever" if opens else
        f"hold (release at step {release} at the latest)")
    if self.is_chief:
      io_utils.append_jsonl(self.path, {
          "step": step, "utility": utility, "streak": self.streak,
          "released": opens})
    if not opens:
      return state
    self.release = step
    return state.replace(opt_state=optimizer_lib.release_frozen(
        state.opt_state, step))

  def checkpoint_meta(self) -> dict[str, Any]:
    return {"retriever_gate": {"streak": self.streak}}

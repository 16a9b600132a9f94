"""REALM pre-training: salient-span MLM with a retriever and a live index.

One step:
  query embeddings with the current parameters -> MIPS top (k + margin) of
  the live (stale) index -> drop blocks of the query's own article -> null
  document + top k -> gather block tokens from the block store -> a per-core
  step (`jax.shard_map` over `data`) that re-embeds the candidates with the
  current parameters (so gradients reach both towers), runs the reader's MLM
  at the masked positions and takes the per-token marginal loss.

The index is either refreshed by a separate index builder process that
polls this job's checkpoints (`index_mode="builder"`, the paper's set-up), or
rebuilt in-process right after a checkpoint, every `refresh_every` steps
(default: every `checkpoint_every`; `index_mode="inline"`, for small CPU
runs and exactly reproducible restarts).

    python -m realm_jax.jobs.pretrain \\
        --gin_file=experiments/pretrain_tiny_cpu.gin \\
        --gin.WORKDIR="'/tmp/run'" --gin.BLOCK_STORE="'/tmp/blocks'" \\
        --gin.QUERIES="'/tmp/queries'"

QUERIES is a query cache: the annotated corpus X masked once, offline, by
the Beam job `python -m realm_jax.jobs.query_cache`; each host streams its
shards of it (`data.query_cache.QueryStream`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from realm_jax.core import checkpoints, distributed, io_utils, parallel
from realm_jax.data import block_store
from realm_jax.data import query_cache
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import publish
from realm_jax.index import service as service_lib
from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.checkpoint_import import init_from as init_lib
from realm_jax.training import candidates as candidates_lib
from realm_jax.training import collapse, loop
from realm_jax.data import realm_inputs
from realm_jax.training import gate as gate_lib
from realm_jax.training import optimizer as optimizer_lib
from realm_jax.training import recall_guard as recall_guard_lib
# The run's settings; gin binds them as pretrain.PretrainConfig and its
# parts as pretrain.<Part> (re-exported here for gin).
from realm_jax.training.pretrain_config import DOCUMENT_TOWER
from realm_jax.training.pretrain_config import GateConfig  # pylint: disable=unused-import
from realm_jax.training.pretrain_config import GuardConfig  # pylint: disable=unused-import
from realm_jax.training.pretrain_config import PretrainConfig
from realm_jax.training.pretrain_config import RecallGuardConfig  # pylint: disable=unused-import
from realm_jax.training.pretrain_config import RetrievalConfig  # pylint: disable=unused-import
from realm_jax.training.pretrain_config import RetrieverScheduleConfig  # pylint: disable=unused-import
from realm_jax.training.pretrain_config import UNUSED_BY_PRETRAINING

# ----------------------------------------------------------------------------
# The per-core step
# ----------------------------------------------------------------------------


def make_loss_fn(graphdef, null_document: bool = True,
                 permuted_signal: bool = False):
  """REALM's loss (`losses.pretraining_loss`) of the bound model
  (`permuted_signal`: the no-information control,
  `RetrieverScheduleConfig.signal`)."""
  def loss_fn(params, batch, dropout_rng):
    model = functional.bind(graphdef, params)
    retrieval_logits, mlm_logits = model.pretraining_logits(
        batch, null_document=null_document, dropout_rng=dropout_rng)
    with jax.named_scope("marginal_loss"):
      return losses.pretraining_loss(retrieval_logits, mlm_logits,
                                     batch["mlm_targets"],
                                     batch["mlm_weights"],
                                     batch.get("dense_prior"),
                                     batch.get("lexical_log_prior"),
                                     permuted_signal=permuted_signal)
  return loss_fn


# Raised by a builder-mode run when no fresh index arrives (index.service).
StaleIndexError = service_lib.StaleIndexError


# ----------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------


class RetrievalInput:
  """The batches of pre-training: masked queries -> retrieval -> inputs.

  Composes the served index (`index.service`: swapped in from the builder,
  or rebuilt inline after a checkpoint), the run's candidate source
  (`training.candidates`: host, overlapped host or device search) and the
  collapse guard. Every host builds its rows of the global batch.
  """

  def __init__(self, config: PretrainConfig, model: RealmConfig, graphdef,
               store, queries, mesh):
    self.config, self.queries, self.mesh = config, queries, mesh
    self.guard = collapse.CollapseGuard(config.guards)
    self.service = service_lib.IndexService(
        root=checkpoints.index_root(config.workdir), store=store,
        retriever_config=model.retriever, mode=config.index_mode,
        expect=publish.Expectation(store.fingerprint, len(store),
                                   model.retriever.embedding_size),
        build_config=config.index_build,
        wait_seconds=config.index_wait_seconds,
        last_step=config.num_train_steps,
        refresh_every=config.refresh_period,
        frozen=config.retriever.training == "query_side",
        staleness=dict(warning=config.guards.stale_index_warning,
                       error=config.guards.stale_index_error),
        on_serve=lambda index: self.source.on_serve(index))
    args = (config.retrieval, model, graphdef, store, queries, mesh,
            self.service, realm_inputs.TrivialCandidates(
                store, config.retrieval.trivial_candidates))
    run = dict(batch_size=config.batch_size,
               reader_length=config.reader_length,
               query_side=config.retriever.training == "query_side")
    self.source = candidates_lib.source_class(config.retrieval)(*args, **run)
    # Whether the retriever trains at a step (the gate's release, once it
    # is measured: `pretrain` rebinds it), for `RetrievalConfig.held_prior`.
    latest = config.gate.latest_release
    self.released = lambda step: latest is not None and step >= latest
    # Fixed held-out queries (the retriever gate's) are searched on the host.
    self.host = (self.source
                 if isinstance(self.source, candidates_lib.HostCandidates)
                 else candidates_lib.HostCandidates(*args, **run))

  @property
  def index(self):
    """The served index."""
    return self.service.current

  def serve(self, start_step: int, state, ckpt) -> None:
    """Serves the first index (waiting for the builder, or building it)."""
    self.service.start(start_step, state, ckpt)
    self.source.start(state)

  def held_out_batch(self, local, state
                     ) -> tuple[dict[str, jax.Array], np.ndarray]:
    """The sharded batch of the fixed queries `local` (this host's rows),
    searched with `state`'s retriever in the served index, and their
    candidates' block ids [b, k]."""
    return self.host.batch_with_candidates(local, state)

  def batch(self, step: int, state) -> dict[str, jax.Array]:
    batch, top1 = self.source.batch(step, state)
    self.guard.add_top1(top1)
    if self.config.retrieval.held_prior != "dense":
      # The reader's retrieval distribution while the gate holds the
      # retriever: uniform over the candidates, or half REALM's p(z|x) and
      # half BM25's (the batch's lexical_log_prior); REALM's p(z|x) after.
      held = 0.5 if self.config.retrieval.held_prior == "mixture" else 0.0
      prior = np.full(len(top1), 1.0 if self.released(step) else held,
                      np.float32)
      batch = dict(batch, dense_prior=parallel.shard_batch(
          self.mesh, {"dense_prior": prior})["dense_prior"])
    return batch

  def log_metrics(self, step: int, metrics: dict[str, float]
                  ) -> dict[str, float]:
    metrics.update(hubness=self.guard.hubness(), index_step=self.index.step,
                   index_staleness=step - self.index.step)
    self.guard.check(step, metrics)
    return metrics

  def close(self, workdir: str, is_chief: bool) -> None:
    self.source.close()
    self.queries.close()
    self.service.close(workdir, is_chief)


def make_optimizer(config: PretrainConfig):
  """REALM's optimizer with the run's retriever schedule and release."""
  s = config.retriever
  return optimizer_lib.realm_optimizer(
      **config.schedule(),
      learning_rate_multiplier=s.learning_rate_multiplier,
      latest_release=config.gate.latest_release,
      frozen=(DOCUMENT_TOWER,) if s.training == "query_side" else (),
      unused=UNUSED_BY_PRETRAINING,
      bias_correction=config.adam_bias_correction)


def _hooks(inputs: RetrievalInput, gate: gate_lib.RetrieverGate | None,
           guard: recall_guard_lib.RecallGuard | None,
           run: loop.Run) -> loop.Hooks:
  """The trainer's work around `Run.loop`: index swaps and refreshes,
  collapse and gate metrics, prefetched candidates, the gate's release and
  the recall guard's rollback."""

  def checkpoint_meta(step):
    return {**inputs.source.checkpoint_meta(step),
            **(gate.checkpoint_meta() if gate else {}),
            **(guard.checkpoint_meta() if guard else {})}

  def log_metrics(step, metrics):
    metrics = inputs.log_metrics(step, metrics)
    if gate is not None:
      metrics.update(retriever_release_step=gate.release,
                     gate_utility=gate.last.get("utility", float("nan")),
                     gate_evidence_z=gate.last.get("evidence_z",
                                                   float("nan")))
    if guard is not None:
      metrics.update(recall_guard_recall=guard.last,
                     retriever_rolled_back=float(guard.tripped is not None))
    return metrics

  def update_state(step, state):
    if guard is not None:
      state = guard.update_state(step, state)
      if guard.tripped is not None:  # Frozen for good: no gate any more.
        return state
    return gate.update_state(step, state) if gate else state

  def after_checkpoint(step, state):
    if inputs.service.refresh_due(step):
      inputs.service.refresh(step, state, run.ckpt)

  return loop.Hooks(before_step=inputs.service.before_step,
                    after_checkpoint=after_checkpoint,
                    log_metrics=log_metrics, checkpoint_meta=checkpoint_meta,
                    update_state=update_state if gate or guard else None)


def _check_towers(config: PretrainConfig, model: RealmConfig) -> None:
  """Query-side training needs a document tower of its own."""
  if (config.retriever.training == "query_side"
      and model.retriever.share_towers):
    raise ValueError(
        "RetrieverScheduleConfig.training='query_side' freezes the document "
        "tower only: "
        "set realm.RetrieverConfig.share_towers = False (both towers start "
        "from the same weights).")


def _open_inputs(config: PretrainConfig):
  """(block store, this host's query stream, the reader's length), checked
  against the tokenizer's vocabulary; the reader's length is derived from
  the queries' and the blocks' unless set."""
  store = block_store.BlockStore.open(config.block_store)
  tokenizer = Tokenizer()
  store.check_vocab(tokenizer.vocab_path)
  # Each host streams its shards of the cache; the global batch of a step
  # is the same for any host count, and a restart replays it exactly.
  queries = query_cache.QueryStream(
      config.queries, batch_size=config.batch_size,
      seed=int(distributed.broadcast_from_chief(np.int64(config.seed))),
      process_index=jax.process_index(),
      process_count=jax.process_count())
  queries.check(vocab_sha256=io_utils.sha256_file(tokenizer.vocab_path))
  return store, queries, realm_inputs.reader_length(
      config.reader_length, queries.query_config.query_length,
      store.max_block_len,
      field="PretrainConfig.reader_length", queries=config.queries)


def _initial_retriever(config: PretrainConfig, model: RealmConfig, fresh,
                       state, start_step: int):
  """A host copy of the run's initial retriever (the recall guard's
  rollback target), taken now (the train step donates the state's
  buffers): the state's own until the release, else `init_from`'s again
  (a restart after the release)."""
  release = optimizer_lib.release_step(state.opt_state)
  untrained = start_step == 0 or (release is not None
                                  and start_step <= release)
  return jax.device_get(
      state.params["retriever"] if untrained else
      init_lib.initial_params(model, fresh, config.init_from)["retriever"])


def train(*, config: PretrainConfig, model: RealmConfig,
          operative_config: str = "", stop_after: int | None = None
          ) -> list[dict[str, float]]:
  """Runs (or resumes) REALM pre-training (arguments as `ict.train`)."""
  _check_towers(config, model)
  inline = config.index_mode == "inline"  # Publishes the indices itself.
  index_lease = (checkpoints.index_root(config.workdir),
                 "pretrain trainer (inline index)")
  with loop.Run(config, model, job="pretrain trainer",
                operative_config=operative_config,
                lease_paths=[index_lease] if inline else []) as run:
    store, queries, reader_length = _open_inputs(config)
    config = dataclasses.replace(config, reader_length=reader_length)
    graphdef, fresh = functional.init(lambda r: Realm(model, rngs=r),
                                      config.seed)
    tx = make_optimizer(config)
    state, _, restored = run.init_or_restore(
        fresh, tx, lambda: init_lib.initial_params(model, fresh,
                                                   config.init_from))
    start_step = int(jax.device_get(state.step))
    inputs = RetrievalInput(config, model, graphdef, store, queries,
                            run.mesh)
    inputs.source.restore(restored, start_step)
    loss_fn = make_loss_fn(graphdef, config.retrieval.null_document,
                           config.retriever.signal == "permuted")
    gate = None
    if config.gate.measured:
      gate = gate_lib.RetrieverGate(
          config.gate, queries.query_config, inputs, graphdef, store,
          config.workdir, run.is_chief, seed=config.seed,
          batch_size=config.batch_size,
          null_document=config.retrieval.null_document)
      gate.restore(restored, start_step, state)
      inputs.released = lambda step: (gate.release is not None
                                      and step >= gate.release)
    guard = None
    if config.recall_guard.enabled:
      guard = recall_guard_lib.RecallGuard(
          config.recall_guard, queries.query_config, inputs, store,
          _initial_retriever(config, model, fresh, state, start_step),
          config.workdir, run.is_chief, seed=config.seed,
          batch_size=config.batch_size,
          every=recall_guard_lib.guard_every(
              config.recall_guard, index_mode=config.index_mode,
              training=config.retriever.training,
              refresh_period=config.refresh_period))
      guard.restore(restored, start_step)

    meta = {"seed": config.seed}
    if run.ckpt.latest_step() is None:
      # The builder (or inline refresh) embeds these.
      run.save(start_step, state.params, state.opt_state, meta)
    inputs.serve(start_step, state, run.ckpt)
    try:
      return run.loop(
          state, loop.make_train_step(
              loss_fn, tx, run.mesh,
              grad_norm_groups=("retriever", "reader")),
          inputs.batch, meta=meta,
          log_line=("loss %.4f utility %.4f mlm_acc %.3f p(null) %.3f "
                    "hubness %.3f staleness %d",
                    ("loss", "retrieval_utility", "mlm_correct",
                     "null_probability", "hubness", "index_staleness")),
          hooks=_hooks(inputs, gate, guard, run),
          stop_after=stop_after)
    finally:
      inputs.close(config.workdir, run.is_chief)

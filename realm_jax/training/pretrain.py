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
rebuilt in-process right after a checkpoint every `checkpoint_every` steps
(`index_mode="inline"`, for small CPU runs and exactly reproducible restarts).

    python -m realm_jax.training.pretrain \\
        --gin_file=experiments/pretrain_tiny_cpu.gin \\
        --gin.WORKDIR="'/tmp/run'" --gin.BLOCK_STORE="'/tmp/blocks'" \\
        --gin.ANNOTATED="'/tmp/annotated/*.tfr.gz'"
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.core import lease as lease_lib
from realm_jax.core import distributed, io_utils
from realm_jax.data import block_store
from realm_jax.data import examples as examples_lib
from realm_jax.data import salient_spans
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import builder as builder_lib
from realm_jax.index import publish
from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.training import mlm_warmup
from realm_jax.core import checkpoints, parallel
from realm_jax.training import realm_inputs
from realm_jax.training import init as init_lib
from realm_jax.core import preemption
from realm_jax.training import loop
from realm_jax.training import optimizer as optimizer_lib

INDEX_MODES = ("inline", "builder")
# Parameters the masked-LM loss never reads (a reader built with the span
# head for later fine-tuning): no weight decay, so they stay as initialised.
UNUSED_BY_PRETRAINING = (("reader", "span_head"),)


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  """A REALM pre-training run.

  Attributes:
    workdir: checkpoints/, index/, summaries and the operative config.
    block_store: the knowledge corpus Z (a block store directory).
    annotated: REALM annotated records of the pre-training corpus X (a
      file, glob or comma-separated list of them).
    init_from: initial weights when the workdir has no checkpoint (see
      `realm_jax.training.init`).
    num_train_steps: total steps.
    batch_size: global batch (queries per step); must divide by devices.
    learning_rate: peak learning rate (REALM: 3e-5); the reader's when the
      retriever has its own schedule.
    warmup_steps: None = BERT's rule, min(10000, max(100, steps / 10)).
    retriever_learning_rate_multiplier: the retriever's peak rate relative
      to `learning_rate` (REALM: 1; 0 freezes the retriever).
    freeze_retriever_steps: reader warm-up: the retriever does not move for
      this many steps (REALM: 0). See `optimizer.realm_optimizer`.
    adam_bias_correction: Adam's bias-corrected moments instead of BERT's
      raw ones (REALM: False); see `optimizer.bert_optimizer`.
    mlm_head_warmup_steps: a fresh run (no checkpoint yet) first fits the
      reader's MLM head alone to the queries' masks for this many steps
      (0: off). For checkpoints without an MLM head (MiniLM); see
      `training.mlm_warmup`.
    num_candidates: retrieved blocks per query k (REALM: 7), plus the null
      document when `null_document`.
    null_document: put the empty document first among the candidates.
    masking: "salient" (REALM), "random_tokens" or "random_spans".
    max_masks: masked targets per query at most (REALM: 10); the reader's
      vocabulary logits are computed for this many slots per candidate, so
      corpora of short spans train faster with fewer.
    query_length, reader_length: 96 and 384 (= 96 + 288) in REALM.
    checkpoint_every: checkpoint (and, inline, index refresh) period.
    keep_checkpoints: orbax retention; >= 5 when a builder reads them.
    index_mode: "inline" or "builder".
    searcher: "exact" or "scann" (inline index).
    index_wait_seconds: builder mode: how long to wait for the first index.
    log_every: metrics period.
    hubness_warning: warn once when the share of the queries since the last
      log whose top-1 block is the single most common one exceeds this.
    null_probability_warning: warn once when the mean p(null|x) of a
      logged step exceeds this.
    stale_index_warning: builder mode: warn (once per served index) when it
      is more than this many checkpoint intervals older than the step (the
      builder died, lags, or cannot write); `index_staleness` is logged as
      a metric every `log_every` steps.
    stale_index_error: builder mode: stop with an error past this many
      intervals (0: never).
    seed: everything random derives from it.
  """

  workdir: str
  block_store: str
  annotated: str
  init_from: str | None = None
  num_train_steps: int = 1000
  batch_size: int = 8
  learning_rate: float = 3e-5
  warmup_steps: int | None = None
  retriever_learning_rate_multiplier: float = 1.0
  freeze_retriever_steps: int = 0
  adam_bias_correction: bool = False
  mlm_head_warmup_steps: int = 0
  num_candidates: int = 7
  null_document: bool = True
  masking: str = "salient"
  max_masks: int = 10
  query_length: int = 96
  reader_length: int = 384
  checkpoint_every: int = 100
  keep_checkpoints: int = 5
  index_mode: str = "inline"
  searcher: str = "exact"
  index_wait_seconds: float = 600.0
  log_every: int = 10
  hubness_warning: float = 0.3
  null_probability_warning: float = 0.9
  stale_index_warning: float = 4.0
  stale_index_error: float = 0.0
  seed: int = 0

  def __post_init__(self):
    if self.index_mode not in INDEX_MODES:
      raise ValueError(f"index_mode={self.index_mode!r}; use one of "
                       f"{INDEX_MODES}.")
    if self.batch_size % jax.device_count():
      raise ValueError(
          f"batch_size={self.batch_size} does not divide over "
          f"{jax.device_count()} devices; use a multiple of the device "
          "count.")
    if self.index_mode == "builder" and self.keep_checkpoints < 5:
      raise ValueError("keep_checkpoints must be >= 5 when an index builder "
                       "reads the checkpoints.")
    if self.reader_length <= self.query_length:
      raise ValueError("reader_length must exceed query_length (the reader "
                       "reads [CLS] x [SEP] body [SEP]).")
    for name in ("num_train_steps", "num_candidates", "checkpoint_every",
                 "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"PretrainConfig.{name} must be >= 1.")


# ----------------------------------------------------------------------------
# Input: masked queries, deterministic by step
# ----------------------------------------------------------------------------


def realm_query_config(config: PretrainConfig, masking: str | None = None
                       ) -> examples_lib.RealmQueryConfig:
  """How the run's queries are masked (`masking` overrides the run's)."""
  # REALM: masks end before position 94 of 96; shorter queries keep the
  # same two positions of room.
  return examples_lib.RealmQueryConfig(
      query_length=config.query_length,
      max_masks=min(config.max_masks, config.query_length - 4),
      mask_limit=config.query_length - 2,
      masking=masking or config.masking)


class QuerySet:
  """REALM queries held as stacked numpy arrays, batched by step number.

  The batch of step s is a pure function of (seed, s): epoch e = s * B // N
  uses permutation(seed, e). A restarted run therefore sees exactly the
  batches it would have seen. Each host keeps its own shard of the queries.
  """

  def __init__(self, arrays: dict[str, np.ndarray], seed: int):
    self.arrays = arrays
    self.size = len(arrays["query_ids"])
    self.seed = seed
    if self.size == 0:
      raise ValueError("No REALM queries: the annotated corpus has no "
                       "sentence with a usable salient span.")

  @classmethod
  def from_annotated(cls, pattern: str, tokenizer: Tokenizer, *,
                     config: examples_lib.RealmQueryConfig, seed: int,
                     shard_index: int = 0, num_shards: int = 1) -> "QuerySet":
    paths = [p for p in pattern.split(",") if p]
    rng = np.random.default_rng([seed, shard_index])
    queries: list[dict[str, np.ndarray]] = []
    report = salient_spans.AnnotationReport()
    for i, doc in enumerate(salient_spans.read_annotated(paths,
                                                         report=report)):
      if i % num_shards == shard_index:
        queries += examples_lib.realm_queries_from_document(
            doc, tokenizer, rng, config)
    logging.info("host %d/%d: %d REALM queries (%s masking) from %s",
                 shard_index, num_shards, len(queries), config.masking,
                 report.to_dict())
    if not queries:
      raise ValueError(f"{pattern}: no REALM queries (no sentence with a "
                       "usable salient span).")
    return cls({k: np.stack([q[k] for q in queries]) for k in queries[0]},
               seed)

  def batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
    first = step * batch_size
    idx = []
    while len(idx) < batch_size:
      epoch, offset = divmod(first + len(idx), self.size)
      order = np.random.default_rng([self.seed, epoch]).permutation(
          self.size)
      idx += list(order[offset:offset + batch_size - len(idx)])
    return {k: v[np.asarray(idx)] for k, v in self.arrays.items()}


# ----------------------------------------------------------------------------
# The per-core step
# ----------------------------------------------------------------------------


def make_loss_fn(graphdef, null_document: bool = True):
  def loss_fn(params, batch, dropout_rng):
    model = functional.bind(graphdef, params)
    retrieval_logits, mlm_logits = model.pretraining_logits(
        batch, null_document=null_document, dropout_rng=dropout_rng)
    return losses.pretraining_loss(retrieval_logits, mlm_logits,
                                   batch["mlm_targets"], batch["mlm_weights"])
  return loss_fn


def make_query_embedder(graphdef, mesh):
  """jit(shard_map) of the query tower over the data axis."""
  data = jax.sharding.PartitionSpec(parallel.DATA_AXIS)

  def per_core(params, ids, mask):
    return functional.bind(graphdef, params).retriever.embed_queries(ids,
                                                                     mask)

  return jax.jit(jax.shard_map(
      per_core, mesh=mesh,
      in_specs=(jax.sharding.PartitionSpec(), data, data), out_specs=data))


def local_rows(array: jax.Array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in order."""
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start)
  return np.concatenate([np.asarray(s.data) for s in shards])


# ----------------------------------------------------------------------------
# Collapse guards
# ----------------------------------------------------------------------------


class CollapseGuard:
  """Hubness of the retrieved blocks, and one loud warning per failure mode.

  REALM's two ways to stop learning (docs/results/learning.md): a hub, one
  block every query retrieves with a saturated softmax (its gradient is then
  exactly 0, so the state is absorbing); and the null-document trap,
  p(null|x) ~ 1, where the reader ignores retrieval and the retriever gets
  no signal.
  """

  def __init__(self, config: PretrainConfig):
    self.config = config
    self._top1: list[np.ndarray] = []
    self._warned: set[str] = set()

  def add_top1(self, block_ids: np.ndarray) -> None:
    self._top1.append(np.asarray(block_ids).reshape(-1))

  def hubness(self) -> float:
    """Share of the queries since the last call whose top-1 is the single
    most common top-1 block (then starts a new window)."""
    if not self._top1:
      return 0.0
    top1 = np.concatenate(self._top1)
    self._top1 = []
    return float(np.bincount(top1).max() / len(top1))

  def check(self, step: int, metrics: dict[str, float]) -> None:
    c = self.config
    self._warn_once(
        "hubness", metrics["hubness"] > c.hubness_warning,
        "COLLAPSE WARNING at step %d: %.0f%% of the queries retrieve the "
        "same block (hubness > %.2f); a hub's softmax saturates and its "
        "gradient vanishes. Lower the retriever's rate "
        "(retriever_learning_rate_multiplier), warm the reader up first "
        "(freeze_retriever_steps) and start from an ICT-trained "
        "retriever.", step, 100 * metrics["hubness"], c.hubness_warning)
    self._warn_once(
        "null", metrics["null_probability"] > c.null_probability_warning,
        "COLLAPSE WARNING at step %d: p(null|x) = %.3f > %.2f; the null "
        "document takes the retrieval mass and the retriever gets no "
        "gradient. Use RetrieverConfig.null_score='learned', or a "
        "retriever whose document embeddings are trained (ICT).", step,
        metrics["null_probability"], c.null_probability_warning)

  def _warn_once(self, kind: str, failed: bool, message: str, *args) -> None:
    if failed and kind not in self._warned:
      self._warned.add(kind)
      logging.warning(message, *args)


class StaleIndexError(RuntimeError):
  """The served index is older than `PretrainConfig.stale_index_error`."""


class StalenessMonitor:
  """Builder mode: notices when no fresh index arrives.

  Warns once per served index past `stale_index_warning` checkpoint
  intervals, and stops the run past `stale_index_error` (when set).
  """

  def __init__(self, config: PretrainConfig, watcher: publish.IndexWatcher):
    self.config, self.watcher = config, watcher
    self._warned_for: int | None = None

  def check(self, step: int, index_step: int) -> None:
    c = self.config
    age = step - index_step
    intervals = age / c.checkpoint_every
    if c.stale_index_error and intervals > c.stale_index_error:
      raise StaleIndexError(
          f"step {step}: the served index {index_step} is {age} steps old "
          f"(> {c.stale_index_error:g} x checkpoint_every="
          f"{c.checkpoint_every}) and no newer index reached "
          f"{self.watcher.index_root}. Check the index builder's log (is it "
          "running? can it write there?), then rerun: training resumes "
          "from the last checkpoint.")
    if intervals > c.stale_index_warning and self._warned_for != index_step:
      self._warned_for = index_step
      logging.warning(
          "STALE INDEX at step %d: still serving index %d (%d steps, > %g "
          "checkpoint intervals). Is the index builder running and able to "
          "write to %s? Rejected indices: %s", step, index_step, age,
          c.stale_index_warning, self.watcher.index_root,
          self.watcher.rejected or "none")


# ----------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------


def train(*, config: PretrainConfig, model: RealmConfig,
          operative_config: str = "", stop_after: int | None = None
          ) -> list[dict[str, float]]:
  """Runs (or resumes) the job under an exclusive lease on its workdir
  (`realm_jax.core.lease`: a second job on the same workdir is refused)."""
  with contextlib.ExitStack() as leases:
    leases.enter_context(lease_lib.job_lease(config.workdir,
                                             "pretrain trainer"))
    if config.index_mode == "inline":  # It publishes the indices itself.
      leases.enter_context(lease_lib.job_lease(
          builder_lib.index_root(config.workdir), "pretrain trainer (inline "
          "index)"))
    return _train(config=config, model=model,
                  operative_config=operative_config, stop_after=stop_after)


def _train(*, config: PretrainConfig, model: RealmConfig,
           operative_config: str = "", stop_after: int | None = None
           ) -> list[dict[str, float]]:
  """Runs (or resumes) REALM pre-training.

  Args:
    config: the run.
    model: the REALM model config.
    operative_config: gin's operative config text, saved in the workdir.
    stop_after: return after this many steps of this call (tests).

  Returns:
    The logged metrics, one dict per logged step.
  """
  is_chief = jax.process_index() == 0
  writer = loop.start_run(config.workdir, operative_config,
                               is_chief=is_chief)

  # -- Data: the knowledge corpus and the masked queries.
  store = block_store.BlockStore.open(config.block_store)
  tokenizer = Tokenizer()
  store.check_vocab(tokenizer.vocab_path)
  query_config = realm_query_config(config)
  # Every host holds the query set and takes its slice of each step's
  # global batch: the batches (and so the losses) do not depend on the
  # number of hosts, and a restart replays them exactly.
  seed = int(distributed.broadcast_from_chief(np.int64(config.seed)))
  queries = QuerySet.from_annotated(
      config.annotated, tokenizer, config=query_config, seed=seed)
  per_host = distributed.check_divisible("batch_size", config.batch_size,
                                         jax.process_count(),
                                         by_what="hosts")
  host_rows = slice(jax.process_index() * per_host,
                    (jax.process_index() + 1) * per_host)
  margin = int(min(np.bincount(store.doc_indices).max(), len(store) - 1))
  search_k = min(len(store), config.num_candidates + margin)
  if search_k - margin < config.num_candidates:
    raise ValueError(f"The block store has {len(store)} blocks; too few for "
                     f"{config.num_candidates} candidates outside a query's "
                     "own article.")

  # -- Model, optimizer, state.
  mesh = parallel.make_mesh()
  graphdef, fresh = functional.init(lambda r: Realm(model, rngs=r),
                                    config.seed)
  tx = optimizer_lib.realm_optimizer(
      learning_rate=config.learning_rate,
      num_train_steps=config.num_train_steps,
      warmup_steps=config.warmup_steps,
      retriever_learning_rate_multiplier=(
          config.retriever_learning_rate_multiplier),
      freeze_retriever_steps=config.freeze_retriever_steps,
      unused=UNUSED_BY_PRETRAINING,
      bias_correction=config.adam_bias_correction)
  ckpt = checkpoints.TrainCheckpointer(
      checkpoints.checkpoint_dir(config.workdir),
      keep=config.keep_checkpoints)
  start_step = ckpt.latest_step()
  replicated = parallel.replicated(mesh)
  if start_step is not None:
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                       sharding=replicated), fresh)
    abstract_opt = jax.eval_shape(tx.init, fresh)
    abstract_opt = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=replicated), abstract_opt)
    params, opt_state, meta = ckpt.restore(start_step, abstract, abstract_opt)
    logging.info("resumed from %s step %d (%s)", ckpt.directory, start_step,
                 meta)
  else:
    params = init_lib.initial_params(model, fresh, config.init_from)
    if config.mlm_head_warmup_steps:
      # Every host runs the same deterministic warm start on the same
      # queries, so the replicated parameters agree.
      params, report = mlm_warmup.warm_start_mlm_head(
          params, graphdef, queries.arrays,
          sep_id=int(store.manifest["sep_id"]), store=store,
          reader_length=config.reader_length,
          steps=config.mlm_head_warmup_steps, seed=config.seed)
      if is_chief:
        io_utils.write_json(io_utils.join(config.workdir,
                                           "mlm_head_warmup.json"), report)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    start_step = 0
  state = {"step": jax.device_put(jnp.asarray(start_step, jnp.int32),
                                  replicated),
           "params": params, "opt_state": opt_state}
  train_step = loop.make_train_step(
      make_loss_fn(graphdef, config.null_document), tx, mesh,
      grad_norm_groups=("retriever", "reader"))
  embed_queries = make_query_embedder(graphdef, mesh)

  # -- The index: inline refresh, or a watcher on the builder's output.
  index_root = builder_lib.index_root(config.workdir)
  expect = publish.Expectation(store.fingerprint, len(store),
                               model.retriever.embedding_size)
  builder_config = builder_lib.BuilderConfig(searcher_kind=config.searcher)

  def save(step):
    ckpt.save(step, state["params"], state["opt_state"],
              {"seed": config.seed}, force=True)

  def inline_refresh(step):
    ckpt.wait_until_finished()  # Index s only after checkpoint s is durable.
    # Every host embeds its share of the blocks; process 0 publishes.
    builder_lib.build_and_publish(
        retriever_params=parallel.host_copy(state["params"]["retriever"]),
        retriever_config=model.retriever, store=store, root=index_root,
        step=step, config=builder_config)
    return publish.load_index(index_root, step, expect)

  watcher = None
  if config.index_mode == "builder":
    if ckpt.latest_step() is None:
      save(start_step)  # The builder embeds these weights first.
    watcher = publish.IndexWatcher(index_root, expect)
    index = watcher.wait_for_index(timeout=config.index_wait_seconds)
  else:
    # Inline, index s is always built right after checkpoint s; a resumed
    # run serves the index of its own step (rebuilt if the previous run died
    # before publishing it) and so replays the same trajectory.
    if ckpt.latest_step() is None:
      save(start_step)
    if publish.read_latest(index_root) == start_step:
      index = publish.load_index(index_root, start_step, expect)
    else:
      index = inline_refresh(start_step)
  logging.info("serving index %d at step %d", index.step, start_step)

  # -- The loop.
  preempted = preemption.Preemption()
  guard = CollapseGuard(config)
  staleness = StalenessMonitor(config, watcher) if watcher else None
  history, base_rng = [], jax.random.key(config.seed)
  step, t_last, steps_since_log = start_step, time.time(), 0
  end = config.num_train_steps if stop_after is None else min(
      config.num_train_steps, start_step + stop_after)
  while step < end:
    if watcher is not None:
      if watcher.maybe_swap():
        index = watcher.current
      staleness.check(step, index.step)
    local = {k: v[host_rows] for k, v in
             queries.batch(step, config.batch_size).items()}
    q = parallel.shard_batch(mesh, {k: local[k] for k in ("query_ids",
                                                          "query_mask")})
    q_emb = local_rows(embed_queries(state["params"], q["query_ids"],
                                     q["query_mask"]))
    hits, _ = index.search(q_emb, search_k)
    candidates = realm_inputs.select_candidates(
        hits, store.doc_hash, local["source_doc_hash"], config.num_candidates)
    guard.add_top1(candidates[:, 0])
    # Never a trivial retrieval: no candidate from the query's own article.
    if (store.doc_hash[candidates] == local["source_doc_hash"][:, None]).any():
      raise AssertionError("a query's own article reached its candidates")
    batch = realm_inputs.pretraining_batch(
        local, candidates, store, doc_len=store.max_block_len,
        reader_len=config.reader_length,
        null_document=config.null_document)
    state, metrics = train_step(state, parallel.shard_batch(mesh, batch),
                                base_rng)
    step += 1
    steps_since_log += 1
    if step % config.log_every == 0 or step == end:
      metrics = {k: float(v) for k, v in parallel.host_copy(metrics).items()}
      now = time.time()
      metrics.update(
          hubness=guard.hubness(),
          index_step=index.step, index_staleness=step - index.step,
          seconds_per_step=(now - t_last) / steps_since_log,
          examples_per_second=config.batch_size * steps_since_log
          / (now - t_last))
      t_last, steps_since_log = now, 0
      writer.write_scalars(step, metrics)
      history.append(dict(metrics, step=step))
      if is_chief:
        io_utils.append_jsonl(io_utils.join(config.workdir, "metrics.jsonl"),
                               dict(metrics, step=step))
      logging.info("step %d: loss %.4f utility %.4f mlm_acc %.3f "
                   "p(null) %.3f hubness %.3f staleness %d, %.2f s/step",
                   step, metrics["loss"], metrics["retrieval_utility"],
                   metrics["mlm_correct"], metrics["null_probability"],
                   metrics["hubness"], metrics["index_staleness"],
                   metrics["seconds_per_step"])
      guard.check(step, metrics)
    # The stop decision is process 0's, so every host stops at one step.
    stop = bool(distributed.broadcast_from_chief(
        np.int32(preempted.requested))) if jax.process_count() > 1 else (
            preempted.requested)
    if step % config.checkpoint_every == 0 or step == end or stop:
      save(step)
      if config.index_mode == "inline" and step < config.num_train_steps:
        index = inline_refresh(step)
    if stop:
      logging.warning("Stop requested (SIGTERM or Ctrl-C): checkpointed "
                      "step %d, exiting.", step)
      break
  preempted.close()
  ckpt.wait_until_finished()
  if step >= config.num_train_steps and is_chief:
    checkpoints.write_done_marker(ckpt.directory, step)
  if watcher is not None:
    watcher.close()
    if is_chief:
      io_utils.write_json(io_utils.join(config.workdir, "index_swaps.json"),
                  [{"index_step": s, "loaded_at": l, "swapped_at": w}
                   for s, l, w in watcher.swap_log])
  writer.flush()
  ckpt.close()
  if is_chief:
    io_utils.write_json(io_utils.join(config.workdir, "history.json"),
                         history)
  distributed.barrier("pretrain-exit")
  return history


if __name__ == "__main__":
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  gin_cli.run(gin_cli.training_job("realm_jax.training.pretrain",
                                   "PretrainConfig"))

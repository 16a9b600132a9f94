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
        --gin.QUERIES="'/tmp/queries'"

QUERIES is a query cache: the annotated corpus X masked once, offline, by
the Beam job `python -m realm_jax.data.query_cache`; each host streams its
shards of it (`data.query_cache.QueryStream`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.core import checkpoints, checks, distributed, io_utils
from realm_jax.core import parallel
from realm_jax.data import block_store
from realm_jax.data import examples as examples_lib
from realm_jax.data import query_cache
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import builder as builder_lib
from realm_jax.index import device_search
from realm_jax.index import embed
from realm_jax.index import publish
from realm_jax.index import service as service_lib
from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.checkpoint_import import init_from as init_lib
from realm_jax.training import collapse, loop, mlm_warmup, realm_inputs
from realm_jax.training import gate as gate_lib
from realm_jax.training import optimizer as optimizer_lib

INDEX_MODES = ("inline", "builder")
RETRIEVER_TRAINING = ("full", "query_side")
RETRIEVER_GATES = ("steps", "utility")
# The query-side mode's frozen subtree: the document tower.
DOCUMENT_TOWER = ("retriever", "document_embedder")
# Parameters the masked-LM loss never reads (a reader built with the span
# head for later fine-tuning): no weight decay, so they stay as initialised.
UNUSED_BY_PRETRAINING = (("reader", "span_head"),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig(loop.TrainConfig):
  """A REALM pre-training run (`loop.TrainConfig`; REALM's defaults).

  Attributes:
    queries: the pre-training corpus X as a query cache directory (masked
      REALM queries written by `python -m realm_jax.data.query_cache` with
      this run's query_length, max_masks and masking; its shard count a
      multiple of the host count).
    learning_rate: the reader's when the retriever has its own schedule.
    retriever_learning_rate_multiplier: the retriever's peak rate relative
      to `learning_rate` (REALM: 1; 0 freezes the retriever).
    freeze_retriever_steps: reader warm-up: the retriever does not move for
      this many steps (REALM: 0). See `optimizer.realm_optimizer`. With
      `retriever_gate="utility"` it is the upper bound: the gate may
      release the retriever earlier (set it to num_train_steps to release
      the retriever only on the gate's evidence).
    retriever_training: "full" (REALM: both towers learn, the index is
      refreshed) or "query_side" (Atlas's cheap variant: the document
      tower and so the index stay fixed; only the query tower and the
      reader learn, the index is built once and never refreshed, and the
      candidates' embeddings come from the index instead of being
      recomputed). Needs RetrieverConfig.share_towers=False; a source with
      one tower initialises both.
    retriever_gate: "steps" (release the retriever at
      freeze_retriever_steps) or "utility": every `gate_every` steps, the
      retrieval utility (log p(y|x) - log p(y|null, x), nats per mask) of
      the reader on `gate_num_queries` held-out queries (`gate_queries`,
      candidates from the served index) is measured; the retriever is
      released once it is >= `gate_min_utility` for `gate_patience`
      evaluations in a row, i.e. when the reader has started to use the
      retrieved blocks. Decisions go to the log and to gate.jsonl.
    gate_queries: a query cache of sentences never trained on (built like
      `queries`, from held-out articles of X).
    gate_every, gate_num_queries, gate_min_utility, gate_patience: see
      `retriever_gate`.
    adam_bias_correction: Adam's bias-corrected moments instead of BERT's
      raw ones (REALM: False); see `optimizer.bert_optimizer`.
    mlm_head_warmup_steps: a fresh run (no checkpoint yet) first fits the
      reader's MLM head alone to the queries' masks for this many steps
      (0: off). For checkpoints without an MLM head (MiniLM); see
      `training.mlm_warmup`.
    reader_adaptation_steps: a fresh run then trains the reader (its BERT
      body and MLM head; the retriever does not move) on the queries' masks,
      each read with the null document, a random block and an answer block
      (another article's block holding the masked span), for at most this
      many steps (0: off); it stops sooner once an answer block helps on
      held-out queries (`mlm_warmup.adapt_reader`). Its curve and stop
      reason go to reader_adaptation.json.
    reader_adaptation_learning_rate: its peak learning rate (BERT's
      optimiser with Adam's bias correction, warmup, linear decay).
    reader_adaptation_eval_every: its held-out evaluations' period (steps).
    reader_adaptation_min_utility: its stop threshold: the answer block's
      held-out utility (nats per mask) must exceed it at 2 evaluations in a
      row.
    num_candidates: retrieved blocks per query k (REALM: 7), plus the null
      document when `null_document`.
    null_document: put the empty document first among the candidates.
    trivial_candidates: REALM's no-trivial-retrieval rule: "article" (no
      block of the sentence's own article) or "block" (only the block that
      holds the sentence, as REALM's reference code). See
      `realm_inputs.TrivialCandidates`.
    masking: "salient" (REALM), "random_tokens" or "random_spans".
    max_masks: masked targets per query at most (REALM: 10); the reader's
      vocabulary logits are computed for this many slots per candidate, so
      corpora of short spans train faster with fewer.
    query_length, reader_length: 96 and 384 (= 96 + 288) in REALM.
    checkpoint_every: also the inline index refresh period.
    index_mode: "builder" (REALM: a separate job refreshes the index) or
      "inline" (rebuilt in-process after each checkpoint: small CPU runs,
      exactly reproducible restarts).
    searcher: "scann" or "exact" (inline index).
    retrieval: "host" (the served index's searcher on the host, then the
      batch built in numpy from the memory-mapped block store) or "device":
      the served index's embeddings and the block tokens live on the
      devices, sharded by rows, and exact top-k search, the candidates'
      tokens and the batch are computed there (`index/device_search.py`);
      the query embeddings never leave the devices. For corpora that fit in
      device memory (13.35M x 128 bf16 is 3.4 GB, plus ~7.7 GB of uint16
      tokens at 288, over all devices).
    device_index_dtype: "float32" or "bfloat16" block embeddings (retrieval
      "device").
    overlap_input: retrieval "host": the next step's search, candidate
      gathering and batch assembly run on a host thread while the devices
      compute this step. The next step's candidates are then chosen with
      this step's retriever (one update older; the index is hundreds of
      steps older anyway) and, so that a restart replays the run exactly,
      the candidates of the step after a checkpoint are saved in it.
      Retrieval "device" overlaps by itself (asynchronous dispatch).
    rerank_candidates: Atlas-style re-ranking (0: off): the served index
      proposes this many blocks per query (outside its own article), the
      current document tower re-embeds them and the `num_candidates` with
      the highest fresh scores are kept. A stale index then only has to
      put the right block among the proposals, not in the top k. It costs
      a forward pass of the document tower over batch x rerank_candidates
      blocks every step: for refresh intervals much longer than REALM's
      ~500 steps (docs/benchmarks/refresh_cost.md). Retrieval "host"
      without `overlap_input` (the re-embedding needs the step's own
      parameters, which the update step donates).
    index_wait_seconds: builder mode: how long to wait for the first index.
    hubness_warning: warn once when the share of the recent queries whose
      top-1 block is the single most common one exceeds this (judged over
      the last `guard_min_queries` queries or more, pooled over log windows;
      the logged `hubness` metric is the last log window's).
    null_probability_warning: warn once when the mean p(null|x) of the
      logged steps covering the last `guard_min_queries` queries exceeds
      this.
    guard_min_queries: the fewest queries the collapse guards judge: with
      batches of 4, two equal top-1s would read as 50% hubness.
    stale_index_warning: builder mode: warn (once per served index) when it
      is more than this many checkpoint intervals older than the step (the
      builder died, lags, or cannot write); `index_staleness` is logged as
      a metric every `log_every` steps.
    stale_index_error: builder mode: stop with an error past this many
      intervals (0: never).
  """

  queries: str
  num_train_steps: int = 200_000
  batch_size: int = 512
  learning_rate: float = 3e-5
  retriever_learning_rate_multiplier: float = 1.0
  freeze_retriever_steps: int = 0
  retriever_training: str = "full"
  retriever_gate: str = "steps"
  gate_queries: str = ""
  gate_every: int = 50
  gate_num_queries: int = 128
  gate_min_utility: float = 0.1
  gate_patience: int = 2
  adam_bias_correction: bool = False
  mlm_head_warmup_steps: int = 0
  reader_adaptation_steps: int = 0
  reader_adaptation_learning_rate: float = 1e-4
  reader_adaptation_eval_every: int = 50
  reader_adaptation_min_utility: float = mlm_warmup.MIN_UTILITY
  num_candidates: int = 7
  null_document: bool = True
  trivial_candidates: str = "article"
  masking: str = "salient"
  max_masks: int = 10
  query_length: int = 96
  reader_length: int = 384
  checkpoint_every: int = 500
  index_mode: str = "builder"
  searcher: str = "scann"
  retrieval: str = "host"
  device_index_dtype: str = "float32"
  overlap_input: bool = False
  rerank_candidates: int = 0
  index_wait_seconds: float = 600.0
  hubness_warning: float = 0.3
  null_probability_warning: float = 0.9
  guard_min_queries: int = 64
  stale_index_warning: float = 4.0
  stale_index_error: float = 0.0

  def __post_init__(self):
    super().__post_init__()
    checks.at_least(self, "num_candidates", "guard_min_queries")
    checks.at_least(self, "reader_adaptation_steps", minimum=0, integer=True)
    checks.at_least(self, "reader_adaptation_eval_every", integer=True)
    if not self.reader_adaptation_learning_rate > 0:
      raise ValueError("reader_adaptation_learning_rate must be > 0, got "
                       f"{self.reader_adaptation_learning_rate!r}.")
    if self.index_mode not in INDEX_MODES:
      raise ValueError(f"index_mode={self.index_mode!r}; use one of "
                       f"{INDEX_MODES}.")
    if self.index_mode == "builder" and self.keep_checkpoints < 5:
      raise ValueError("keep_checkpoints must be >= 5 when an index builder "
                       "reads the checkpoints.")
    if self.retrieval not in ("host", "device"):
      raise ValueError(f"retrieval={self.retrieval!r}; use 'host' or "
                       "'device'.")
    if self.device_index_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"device_index_dtype={self.device_index_dtype!r}; use "
                       "'float32' or 'bfloat16'.")
    if self.rerank_candidates and (
        self.rerank_candidates < self.num_candidates
        or self.retrieval != "host" or self.overlap_input):
      raise ValueError(
          f"rerank_candidates={self.rerank_candidates} needs "
          f">= num_candidates ({self.num_candidates}) proposals, "
          "retrieval='host' and overlap_input=False; set it to 0 to turn "
          "re-ranking off.")
    if self.trivial_candidates not in realm_inputs.TRIVIAL_RULES:
      raise ValueError(
          f"trivial_candidates={self.trivial_candidates!r}; use one of "
          f"{realm_inputs.TRIVIAL_RULES}.")
    if self.retriever_training not in RETRIEVER_TRAINING:
      raise ValueError(f"retriever_training={self.retriever_training!r}; "
                       f"use one of {RETRIEVER_TRAINING}.")
    if self.retriever_training == "query_side" and (
        self.rerank_candidates or self.retrieval != "host"):
      raise ValueError(
          "retriever_training='query_side' keeps the index exact for the "
          "whole run: it needs retrieval='host' and rerank_candidates=0.")
    if self.retriever_gate not in RETRIEVER_GATES:
      raise ValueError(f"retriever_gate={self.retriever_gate!r}; use one of "
                       f"{RETRIEVER_GATES}.")
    if self.retriever_gate == "utility":
      checks.at_least(self, "gate_every", "gate_num_queries", "gate_patience",
                      integer=True)
      if not self.gate_queries:
        raise ValueError(
            "retriever_gate='utility' measures the reader on held-out "
            "queries: set gate_queries to a query cache built from articles "
            "that are not in `queries` (python -m realm_jax.data.query_cache "
            "on them), or use retriever_gate='steps'.")
      if not self.freeze_retriever_steps:
        raise ValueError(
            "retriever_gate='utility' with freeze_retriever_steps=0 releases "
            "the retriever at step 0; set freeze_retriever_steps to the "
            "latest release (num_train_steps: only on the gate's evidence).")
    if self.reader_length <= self.query_length:
      raise ValueError("reader_length must exceed query_length (the reader "
                       "reads [CLS] x [SEP] body [SEP]).")


# ----------------------------------------------------------------------------
# Input: masked queries, deterministic by step
# ----------------------------------------------------------------------------


def realm_query_config(config: PretrainConfig, masking: str | None = None
                       ) -> examples_lib.RealmQueryConfig:
  """How the run's queries are masked (`masking` overrides the run's)."""
  return dataclasses.replace(query_cache.trainer_query_config(config),
                             masking=masking or config.masking)


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


# Raised by a builder-mode run when no fresh index arrives (index.service).
StaleIndexError = service_lib.StaleIndexError


# ----------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------


class RetrievalInput:
  """The batches of pre-training: masked queries -> MIPS -> reader inputs.

  Retrieves from the index `service` serves (`index.service`: swapped in
  from the builder, or rebuilt inline after a checkpoint). Every host
  embeds its queries, searches and builds its rows of the global batch.
  """

  def __init__(self, config: PretrainConfig, model: RealmConfig, graphdef,
               store, queries, mesh):
    self.config, self.model, self.store, self.queries = (config, model,
                                                         store, queries)
    self.mesh = mesh
    self.embed_queries = embed.make_query_embedder(graphdef, mesh)
    self.guard = collapse.CollapseGuard(config)
    # Blocks wanted per query besides its trivial ones: the candidates, or
    # the proposals that re-ranking narrows down to them.
    self.trivial = realm_inputs.TrivialCandidates(store,
                                                  config.trivial_candidates)
    self.proposals = config.rerank_candidates or config.num_candidates
    margin = min(self.trivial.max_excluded, len(store) - 1)
    self.search_k = min(len(store), self.proposals + margin)
    if self.search_k - margin < self.proposals:
      raise ValueError(f"The block store has {len(store)} blocks; too few "
                       f"for {self.proposals} candidates besides a query's "
                       f"trivial ones ({config.trivial_candidates!r} rule).")
    if config.rerank_candidates:
      self.embed_documents = embed.make_embed_fn(model.retriever, mesh)
    # Query-side training: the document tower never changes, so the index
    # built at the start is exact for the whole run and its rows are the
    # candidates' embeddings.
    self.query_side = config.retriever_training == "query_side"
    self.null_embedding = None  # query_side: the frozen null document's
    self.device_index = None  # retrieval="device": the served index's copy
    self.service = service_lib.IndexService(
        root=checkpoints.index_root(config.workdir), store=store,
        retriever_config=model.retriever, mode=config.index_mode,
        expect=publish.Expectation(store.fingerprint, len(store),
                                   model.retriever.embedding_size),
        builder_config=builder_lib.BuilderConfig(
            searcher_kind=config.searcher),
        wait_seconds=config.index_wait_seconds,
        last_step=config.num_train_steps, frozen=self.query_side,
        staleness=dict(checkpoint_every=config.checkpoint_every,
                       warning=config.stale_index_warning,
                       error=config.stale_index_error),
        on_serve=self._serve)
    # overlap_input: (step, future of its (host batch, candidates)).
    self._pending: tuple[int, concurrent.futures.Future] | None = None
    self._saved_candidates: dict[int, np.ndarray] = {}
    self._thread = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="pretrain-input")

  @property
  def index(self):
    """The served index."""
    return self.service.current

  def _serve(self, index) -> None:
    """Keeps the device copy of the served index (if used) current."""
    if self.config.retrieval != "device":
      return
    if self.device_index is None:
      self.device_index = device_search.DeviceIndex.build(
          self.store, index.embeddings, self.mesh,
          dtype=jnp.dtype(self.config.device_index_dtype),
          block_keys=self.trivial.block_keys)
    else:  # The tokens stay on the devices; only the embeddings change.
      self.device_index = self.device_index.with_embeddings(index.embeddings)

  def serve(self, start_step: int, state, ckpt) -> None:
    """Serves the first index (waiting for the builder, or building it)."""
    self.service.start(start_step, state, ckpt)
    if self.query_side:
      self.null_embedding = self._null_embedding(state.params)

  def _null_embedding(self, params) -> np.ndarray | None:
    """The null document's embedding by the (frozen) document tower, when
    it is scored by its embedding."""
    if not (self.config.null_document
            and self.model.retriever.null_score == "embedding"):
      return None
    m = self.store.manifest
    null = realm_inputs.null_document_inputs(
        self.store.max_block_len, int(m["cls_id"]), int(m["sep_id"]),
        int(m.get("pad_id", 0)))
    rows = len(self.mesh.local_devices)
    inputs = parallel.shard_batch(self.mesh, {
        k: np.broadcast_to(v, (rows,) + v.shape) for k, v in null.items()})
    embed_fn = embed.make_embed_fn(self.model.retriever, self.mesh)
    return parallel.local_rows(embed_fn(
        params["retriever"], inputs["token_ids"], inputs["input_mask"],
        inputs["segment_ids"]))[0]

  def _query_embeddings(self, local, state) -> jax.Array:
    q = parallel.shard_batch(self.mesh, {k: local[k] for k in
                                         ("query_ids", "query_mask")})
    return self.embed_queries(state.params, q["query_ids"], q["query_mask"])

  def _candidates(self, local, q_emb, index, params=None) -> np.ndarray:
    """Host search: [b, k] blocks, none a trivial candidate (re-ranked
    with `params`' retriever when `rerank_candidates`)."""
    queries = parallel.local_rows(q_emb)
    hits, _ = index.search(queries, self.search_k)
    keys = self.trivial.query_keys(local)
    candidates = realm_inputs.select_candidates(
        hits, self.trivial.block_keys, keys, self.proposals)
    if self.config.rerank_candidates:
      candidates = self._rerank(queries, candidates, params)
    if (self.trivial.block_keys[candidates] == keys[:, None]).any():
      raise AssertionError("a trivial candidate reached a query's candidates")
    return candidates

  def _rerank(self, queries: np.ndarray, proposals: np.ndarray, params
              ) -> np.ndarray:
    """The top k of each query's proposals [b, L] by the current document
    tower's embeddings (fresh inner products), in score order."""
    b, num_proposals = proposals.shape
    blocks = parallel.shard_batch(self.mesh, self.store.retriever_inputs(
        proposals.reshape(-1), self.store.max_block_len))
    documents = parallel.local_rows(self.embed_documents(
        params["retriever"], blocks["token_ids"], blocks["input_mask"],
        blocks["segment_ids"])).reshape(b, num_proposals, -1)
    scores = np.einsum("bd,bld->bl", queries, documents)
    order = np.argsort(-scores, axis=1, kind="stable")
    return np.take_along_axis(proposals, order[:, :self.config.num_candidates],
                              axis=1)

  def _host_batch(self, local, candidates) -> dict[str, np.ndarray]:
    c = self.config
    batch = realm_inputs.pretraining_batch(
        local, candidates, self.store, doc_len=self.store.max_block_len,
        reader_len=c.reader_length, null_document=c.null_document)
    if self.query_side:
      embeddings = np.asarray(self.index.embeddings[candidates.reshape(-1)],
                              np.float32).reshape(candidates.shape + (-1,))
      if c.null_document:  # Slot 0 (unread when the null score is learned).
        null = (np.zeros(embeddings.shape[-1], np.float32)
                if self.null_embedding is None else self.null_embedding)
        embeddings = np.concatenate([np.broadcast_to(
            null, (len(candidates), 1, embeddings.shape[-1])), embeddings],
                                    axis=1)
      batch["candidate_embeddings"] = embeddings
    return batch

  def batch(self, step: int, state) -> dict[str, jax.Array]:
    c = self.config
    if c.retrieval == "device":
      local = self.queries.batch(step)
      batch, block_ids = device_search.candidate_batch(
          self.device_index, local, self._query_embeddings(local, state),
          k=c.num_candidates, doc_len=self.store.max_block_len,
          reader_len=c.reader_length, null_document=c.null_document,
          query_keys=self.trivial.query_keys(local))
      self.guard.add_top1(block_ids[:, 0])
      return batch
    if c.overlap_input:
      host, candidates = self._overlapped(step, state)
    else:
      local = self.queries.batch(step)
      candidates = self._candidates(
          local, self._query_embeddings(local, state), self.index,
          state.params)
      host = self._host_batch(local, candidates)
    self.guard.add_top1(candidates[:, 0])
    return parallel.shard_batch(self.mesh, host)

  def _overlapped(self, step: int, state):
    """(host batch, candidates) of `step`; starts the next step's."""
    pending, self._pending = self._pending, None
    if pending is not None and pending[0] == step:
      host, candidates = pending[1].result()
    else:  # This process's first step: a restart's saved candidates (the
      # uninterrupted run's), else those of this state's retriever.
      local = self.queries.batch(step)
      candidates = self._saved_candidates.pop(step, None)
      if candidates is None:
        candidates = self._candidates(
            local, self._query_embeddings(local, state), self.index)
      host = self._host_batch(local, candidates)
    # The next step's queries are embedded now, before this step's update
    # is dispatched (so the devices do it first); the host waits for them,
    # searches and assembles on the thread while the devices train.
    nxt = self.queries.batch(step + 1)
    q_emb, index = self._query_embeddings(nxt, state), self.index

    def work():
      candidates = self._candidates(nxt, q_emb, index)
      return self._host_batch(nxt, candidates), candidates

    self._pending = (step + 1, self._thread.submit(work))
    return host, candidates

  def checkpoint_meta(self, step: int) -> dict[str, Any]:
    """The prefetched candidates of `step` (the first step after checkpoint
    `step`), every host's rows in global order, so a restart replays them."""
    if self._pending is None or self._pending[0] != step:
      return {}
    _, candidates = self._pending[1].result()
    return {"prefetched_candidates": {
        "step": step,
        "ids": distributed.allgather_rows(candidates).tolist()}}

  def restore_candidates(self, meta: dict[str, Any], step: int) -> None:
    """Takes this host's rows of a checkpoint's prefetched candidates."""
    saved = meta.get("prefetched_candidates")
    if not (self.config.overlap_input and saved and saved["step"] == step):
      return
    ids = np.asarray(saved["ids"], np.int64)
    b, hosts = self.config.batch_size, jax.process_count()
    if ids.shape != (b, self.config.num_candidates):
      logging.warning("checkpoint %d's prefetched candidates have shape %s, "
                      "not this run's %s; searching them again.", step,
                      ids.shape, (b, self.config.num_candidates))
      return
    me = jax.process_index()
    self._saved_candidates[step] = ids[me * b // hosts:(me + 1) * b // hosts]

  def log_metrics(self, step: int, metrics: dict[str, float]
                  ) -> dict[str, float]:
    metrics.update(hubness=self.guard.hubness(), index_step=self.index.step,
                   index_staleness=step - self.index.step)
    self.guard.check(step, metrics)
    return metrics

  def close(self, workdir: str, is_chief: bool) -> None:
    self._thread.shutdown(wait=True, cancel_futures=True)
    self.queries.close()
    self.service.close(workdir, is_chief)


def make_optimizer(config: PretrainConfig):
  """REALM's optimizer with the run's retriever schedule."""
  return optimizer_lib.realm_optimizer(
      **config.schedule(),
      retriever_learning_rate_multiplier=(
          config.retriever_learning_rate_multiplier),
      freeze_retriever_steps=config.freeze_retriever_steps,
      gated=config.retriever_gate == "utility",
      frozen=((DOCUMENT_TOWER,) if config.retriever_training == "query_side"
              else ()),
      unused=UNUSED_BY_PRETRAINING,
      bias_correction=config.adam_bias_correction)


def _initial_params(config: PretrainConfig, model: RealmConfig, graphdef,
                    fresh, queries, store, is_chief: bool):
  """`init_from`, then the MLM-head warm start and the reader adaptation
  when the config asks."""
  params = init_lib.initial_params(model, fresh, config.init_from)
  if config.mlm_head_warmup_steps:
    params = _warm_start_head(config, graphdef, params, queries, store,
                              is_chief)
  if config.reader_adaptation_steps:
    # Deterministic from the seed on the same queries: every host adapts
    # the reader identically, so the replicated parameters agree.
    params, report = mlm_warmup.adapt_reader(
        params, graphdef,
        queries.head(mlm_warmup.ADAPTATION_MAX_QUERIES), store=store,
        sep_id=int(store.manifest["sep_id"]),
        reader_length=config.reader_length,
        steps=config.reader_adaptation_steps,
        learning_rate=config.reader_adaptation_learning_rate,
        eval_every=config.reader_adaptation_eval_every,
        min_utility=config.reader_adaptation_min_utility, seed=config.seed)
    if is_chief:
      io_utils.write_json(
          io_utils.join(config.workdir, "reader_adaptation.json"), report)
  return params


def _warm_start_head(config: PretrainConfig, graphdef, params, queries, store,
                     is_chief: bool):
  """The MLM-head warm start (`mlm_warmup.warm_start_mlm_head`)."""
  # Every host runs the same deterministic warm start on the same queries,
  # so the replicated parameters agree.
  params, report = mlm_warmup.warm_start_mlm_head(
      params, graphdef, queries.head(mlm_warmup.MAX_QUERIES),
      sep_id=int(store.manifest["sep_id"]),
      store=store, reader_length=config.reader_length,
      steps=config.mlm_head_warmup_steps, seed=config.seed)
  if is_chief:
    io_utils.write_json(io_utils.join(config.workdir, "mlm_head_warmup.json"),
                        report)
  return params


def _hooks(inputs: RetrievalInput, gate: gate_lib.RetrieverGate | None,
           run: loop.Run) -> loop.Hooks:
  """The trainer's work around `Run.loop`: index swaps and refreshes,
  collapse and gate metrics, prefetched candidates, the gate's release."""

  def checkpoint_meta(step):
    return {**inputs.checkpoint_meta(step),
            **(gate.checkpoint_meta() if gate else {})}

  def log_metrics(step, metrics):
    metrics = inputs.log_metrics(step, metrics)
    if gate is not None:
      metrics.update(retriever_release_step=gate.release,
                     gate_utility=gate.last_utility)
    return metrics

  def after_checkpoint(step, state):
    if inputs.service.refresh_due(step):
      inputs.service.refresh(step, state, run.ckpt)

  return loop.Hooks(before_step=inputs.service.before_step,
                    after_checkpoint=after_checkpoint,
                    log_metrics=log_metrics, checkpoint_meta=checkpoint_meta,
                    update_state=gate.update_state if gate else None)


def train(*, config: PretrainConfig, model: RealmConfig,
          operative_config: str = "", stop_after: int | None = None
          ) -> list[dict[str, float]]:
  """Runs (or resumes) REALM pre-training (arguments as `ict.train`)."""
  if config.retriever_training == "query_side" and model.retriever.share_towers:
    raise ValueError(
        "retriever_training='query_side' freezes the document tower only: "
        "set realm.RetrieverConfig.share_towers = False (both towers start "
        "from the same weights).")
  inline = config.index_mode == "inline"  # Publishes the indices itself.
  index_lease = (checkpoints.index_root(config.workdir),
                 "pretrain trainer (inline index)")
  with loop.Run(config, model, job="pretrain trainer",
                operative_config=operative_config,
                lease_paths=[index_lease] if inline else []) as run:
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
    queries.check(realm_query_config(config),
                  vocab_sha256=io_utils.sha256_file(tokenizer.vocab_path))
    graphdef, fresh = functional.init(lambda r: Realm(model, rngs=r),
                                      config.seed)
    tx = make_optimizer(config)
    state, _, restored = run.init_or_restore(
        fresh, tx, lambda: _initial_params(
            config, model, graphdef, fresh, queries, store, run.is_chief))
    start_step = int(jax.device_get(state.step))
    inputs = RetrievalInput(config, model, graphdef, store, queries,
                            run.mesh)
    inputs.restore_candidates(restored, start_step)
    loss_fn = make_loss_fn(graphdef, config.null_document)
    gate = None
    if config.retriever_gate == "utility":
      gate = gate_lib.RetrieverGate(config, realm_query_config(config),
                                    inputs, loss_fn, config.workdir,
                                    run.is_chief)
      gate.restore(restored, start_step, state)

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
          hooks=_hooks(inputs, gate, run),
          stop_after=stop_after)
    finally:
      inputs.close(config.workdir, run.is_chief)


if __name__ == "__main__":
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  gin_cli.run(gin_cli.training_job("realm_jax.training.pretrain",
                                   "PretrainConfig"))

"""Inverse Cloze Task (ICT): the retriever's warm start before REALM.

ICT (ORQA, Lee et al. 2019; REALM Sec. 3.4) trains the dual encoder to find
the block a sentence came from: a random sentence of a block is the
pseudo-query and, with probability 0.9, it is cut out of the block, so the
retriever must learn more than word overlap. The negatives are the other
blocks of the GLOBAL batch: each core embeds its queries and blocks, gathers
every core's block embeddings and takes a softmax over all B of them.

Only the retriever trains. The reader keeps its initial weights (REALM
starts its reader from BERT) but is saved in every checkpoint beside the
retriever, with the same orbax items as pre-training, so that

    REALM pre-training:  init_from = "checkpoint:<ict workdir>/checkpoints"
    the index builder:   --gin.WORKDIR="'<ict workdir>'" \\
                         --gin.builder.BuilderConfig.one_shot=True

read an ICT run directly.

    python -m realm_jax.jobs.ict \\
        --gin_file=experiments/ict_tiny_cpu.gin \\
        --gin.WORKDIR="'/tmp/ict'" --gin.BLOCK_STORE="'/data/blocks'"
"""

from __future__ import annotations

import dataclasses

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.core import parallel
from realm_jax.data import block_store
from realm_jax.data import examples as examples_lib
from realm_jax.model import functional
from realm_jax.model import realm as realm_lib
from realm_jax.model.realm import Realm, RealmConfig, Retriever
from realm_jax.checkpoint_import import init_from as init_lib
from realm_jax.training import loop
from realm_jax.training import optimizer as optimizer_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class IctTrainConfig(loop.TrainConfig):
  """An ICT warm-start run (`loop.TrainConfig`; the reference's defaults).

  Attributes:
    block_store: ICT pairs come from its blocks.
    init_from: e.g. "minilm" or "tf_bert:<ckpt>"; the reader is saved as it
      comes from there.
    batch_size: the number of in-batch candidates per query.
    pairs: how the pairs are made (`examples.IctConfig`: query and block
      lengths, the chance the sentence is cut from its block), bound as
      `examples.IctConfig.<field>` in gin (runs/ict.gin). Its block_length
      is capped at the store's `max_block_len` (longer would only be
      padding); a shorter length truncates the blocks.
  """

  num_train_steps: int = 100_000
  batch_size: int = 4096
  learning_rate: float = 1e-4
  pairs: examples_lib.IctConfig = examples_lib.IctConfig()

  def __post_init__(self):
    for name in ("workdir", "block_store"):
      if not getattr(self, name):
        raise ValueError(f"IctTrainConfig.{name} is empty; set the "
                         f"{name.upper()} gin macro.")
    super().__post_init__()
    if self.batch_size < 2:
      raise ValueError("batch_size must be >= 2: ICT needs in-batch "
                       "negatives.")


# ----------------------------------------------------------------------------
# Input: ICT pairs from the block store, deterministic by step
# ----------------------------------------------------------------------------


class IctExamples:
  """ICT pairs from this host's blocks, batched by step number.

  Host h of H owns blocks h, h + H, h + 2H, ...; of those it uses the blocks
  with at least two sentences (so the query sentence can be removed), or
  every non-empty block if there are too few of them. Each epoch is a
  permutation of the usable blocks, cut into whole batches (the remainder
  changes every epoch), so a batch never holds a block twice: a duplicate
  would be a second "correct" block among the in-batch negatives.

  The batch of step s is a pure function of (seed, host, s): a restarted run
  sees exactly the batches it would have seen.
  """

  def __init__(self, store: block_store.BlockStore, *,
               config: examples_lib.IctConfig, batch_size: int, seed: int,
               shard_index: int = 0, num_shards: int = 1):
    """Selects the blocks.

    Args:
      store: the block store.
      config: query/block lengths and removal probability.
      batch_size: examples per batch on this host.
      seed: the run's seed.
      shard_index, num_shards: this host and the number of hosts.

    Raises:
      ValueError: when this host has fewer usable blocks than batch_size.
    """
    self.store = store
    self.config = config
    self.batch_size = batch_size
    self.seed = seed
    self.shard_index = shard_index
    self.special = store.special_ids()
    shard = np.arange(shard_index, len(store), num_shards, dtype=np.int64)
    counts = store.sentence_counts(shard)
    self.block_ids = shard[counts >= 2]
    if len(self.block_ids) < batch_size:
      logging.warning(
          "host %d: only %d blocks with >= 2 sentences for a batch of %d; "
          "using single-sentence blocks too (their sentence stays in).",
          shard_index, len(self.block_ids), batch_size)
      self.block_ids = shard[counts >= 1]
    if len(self.block_ids) < batch_size:
      raise ValueError(
          f"{store.path}: host {shard_index} of {num_shards} has "
          f"{len(self.block_ids)} non-empty blocks, fewer than its batch of "
          f"{batch_size} (in-batch negatives need distinct blocks); use a "
          "smaller batch_size or a bigger corpus.")
    self.batches_per_epoch = len(self.block_ids) // batch_size
    self._epoch_order: tuple[int, np.ndarray | None] = (-1, None)
    logging.info("host %d/%d: ICT over %d of %d blocks, %d batches per "
                 "epoch", shard_index, num_shards, len(self.block_ids),
                 len(store), self.batches_per_epoch)

  def block_ids_for_step(self, step: int) -> np.ndarray:
    """Block ids [batch_size] of this host's batch of step `step`."""
    epoch, k = divmod(int(step), self.batches_per_epoch)
    # One permutation per epoch, kept: 13M blocks take ~0.1 s to shuffle.
    if self._epoch_order[0] != epoch:
      self._epoch_order = (epoch, np.random.default_rng(
          [self.seed, self.shard_index, 0, epoch]).permutation(
              len(self.block_ids)))
    order = self._epoch_order[1]
    return self.block_ids[order[k * self.batch_size:
                                (k + 1) * self.batch_size]]

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """ICT features (`examples.ICT_FEATURES`) of step `step`, stacked."""
    rng = np.random.default_rng([self.seed, self.shard_index, 1, int(step)])
    pairs = []
    for i in self.block_ids_for_step(step):
      pairs.append(examples_lib.ict_pair(
          body_ids=self.store.body_ids(i),
          sentence_starts=self.store.sentence_starts(i),
          title_ids=self.store.title_ids(i), rng=rng, special=self.special,
          config=self.config))
    return {k: np.stack([p[k] for p in pairs])
            for k in examples_lib.ICT_FEATURES}


# ----------------------------------------------------------------------------
# The per-core loss: in-batch negatives over the global batch
# ----------------------------------------------------------------------------


def ict_loss(retriever: Retriever, batch: dict[str, jax.Array],
             dropout_rng: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """ICT softmax over every block of the global batch, for one core.

  Must run inside `jax.shard_map` over `parallel.DATA_AXIS` (a 1-device
  mesh for an unsharded computation). Core c holds b pairs; its query i's
  correct block is global row c * b + i of the gathered block embeddings.
  The all_gather's transpose (a reduce-scatter) sends every core's
  gradient with respect to a block embedding back to the core that
  computed it, so the document tower gets the gradient of the global loss.

  Args:
    retriever: the bound retriever.
    batch: this core's ICT features ([b, query_length], [b, block_length]).
    dropout_rng: PRNG key or None (no dropout).

  Returns:
    loss_sum: sum over this core's queries of -log p(correct block | query).
    weight_sum: b, the number of queries.
    metric_sums: `accuracy` (the correct block scores highest) and
      `sentence_removed` (the query sentence was cut from its block).
  """
  q_rng, b_rng = (None, None) if dropout_rng is None else tuple(
      jax.random.split(dropout_rng))
  query_embeddings = retriever.embed_queries(
      batch["query_ids"], batch["query_mask"], batch["query_segment_ids"],
      dropout_rng=q_rng)  # [b, D]
  block_embeddings = retriever.embed_documents(
      batch["block_ids"], batch["block_mask"], batch["block_segment_ids"],
      dropout_rng=b_rng)  # [b, D]
  global_blocks = jax.lax.all_gather(block_embeddings, parallel.DATA_AXIS,
                                     tiled=True)  # [B, D]
  retrieval_logits = realm_lib.retrieval_logits(
      query_embeddings, global_blocks, retriever.config.score_scale)  # [b, B]
  b = query_embeddings.shape[0]
  correct = jax.lax.axis_index(parallel.DATA_AXIS) * b + jnp.arange(b)
  log_probs = jax.nn.log_softmax(retrieval_logits.astype(jnp.float32), -1)
  nll = -jnp.take_along_axis(log_probs, correct[:, None], axis=-1)[:, 0]
  # Derived from the batch (not a Python constant) so that it varies over
  # the data axis like the other per-core sums.
  weights = jnp.ones_like(nll)
  accuracy = (jnp.argmax(retrieval_logits, -1) == correct).astype(
      jnp.float32)
  return nll.sum(), weights.sum(), {
      "accuracy": accuracy.sum(),
      "sentence_removed": batch["sentence_removed"].astype(
          jnp.float32).sum()}


def retriever_graphdef(model: RealmConfig):
  """Graph of a standalone Retriever; its params = Realm params["retriever"]."""
  graphdef, _ = functional.abstract_init(
      lambda r: Retriever(model.retriever, rngs=r))
  return graphdef


def make_loss_fn(graphdef):
  """`parallel.LossFn` over the RETRIEVER's params (the reader is not used)."""
  def loss_fn(params, batch, dropout_rng):
    return ict_loss(functional.bind(graphdef, params), batch, dropout_rng)
  return loss_fn


# ----------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------


def _check_model(model: RealmConfig, store: block_store.BlockStore,
                 config: IctTrainConfig, block_length: int) -> None:
  bert = model.retriever.bert
  vocab = int(store.manifest.get("vocab_size", 0))
  if vocab > bert.vocab_size:
    raise ValueError(
        f"{store.path} was tokenized with a {vocab}-word vocabulary but the "
        f"retriever embeds {bert.vocab_size}; use a model config with the "
        "store's vocabulary.")
  longest = max(config.pairs.query_length, block_length)
  if longest > bert.max_position_embeddings:
    raise ValueError(
        f"ICT sequences of {longest} wordpieces exceed the retriever's "
        f"max_position_embeddings={bert.max_position_embeddings}; shorten "
        "query_length/block_length.")


def train(*, config: IctTrainConfig, model: RealmConfig,
          operative_config: str = "", stop_after: int | None = None
          ) -> list[dict[str, float]]:
  """Runs (or resumes) ICT training of the retriever.

  Resume precedence: the newest checkpoint in `config.workdir`, else
  `config.init_from`, else a fresh initialisation. Only the retriever is in
  the train state; the reader sits beside it, replicated, and is only ever
  saved. `operative_config` (gin's) is saved in the workdir; `stop_after`
  returns after that many steps of this call (tests). Returns the logged
  metrics, one dict per logged step (`loop.Run.loop`).
  """
  with loop.Run(config, model, job="ict trainer",
                operative_config=operative_config) as run:
    store = block_store.BlockStore.open(config.block_store)
    block_length = min(config.pairs.block_length, store.max_block_len)
    if config.pairs.block_length < store.max_block_len:
      logging.warning("block_length=%d < the store's max_block_len=%d: ICT "
                      "sees truncated blocks.", config.pairs.block_length,
                      store.max_block_len)
    _check_model(model, store, config, block_length)
    examples = IctExamples(
        store, config=dataclasses.replace(config.pairs,
                                          block_length=block_length),
        batch_size=config.batch_size // jax.process_count(),
        seed=config.seed, shard_index=jax.process_index(),
        num_shards=jax.process_count())
    tx = optimizer_lib.bert_optimizer(**config.schedule())
    _, fresh = functional.init(lambda r: Realm(model, rngs=r), config.seed)
    state, params, _ = run.init_or_restore(
        fresh, tx, lambda: init_lib.initial_params(model, fresh,
                                                   config.init_from),
        trained=lambda p: p["retriever"])
    return run.loop(
        state, loop.make_train_step(make_loss_fn(retriever_graphdef(model)),
                                    tx, run.mesh),
        lambda step, _: parallel.shard_batch(run.mesh, examples.batch(step)),
        meta={"seed": config.seed, "job": "ict",
              "block_store_fingerprint": store.fingerprint},
        saved_params=lambda state: {"retriever": state.params,
                                    "reader": params["reader"]},
        log_line=("loss %.4f accuracy %.3f", ("loss", "accuracy")),
        stop_after=stop_after)

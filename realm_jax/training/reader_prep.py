"""Reader preparation: the reader's masked-LM head fitted before REALM.

Checkpoints without an MLM head (sentence-embedding packages such as
MiniLM, or a BERT exported without its pre-training heads) start REALM with
a random head: its predictions are noise over 30k wordpieces, so masked-LM
accuracy stays at 0 and the reader cannot yet tell the retriever which
documents help, until many joint steps have taught it the vocabulary.

This job, run before pre-training as ICT is, trains only the head
(`reader/mlm_head/*`: transform, layer norm and output bias; the output
embeddings stay tied to the frozen input ones) on the run's own
salient-span queries, read as pre-training reads them, half with the null
document and half with a (random) block:

1. the frozen reader encodes `[CLS] x [SEP] [SEP]` or `[CLS] x [SEP] block
   [SEP]` once per query and the hidden states at the masks are kept;
2. Adam fits the head to those features for `num_train_steps` steps;
3. a tenth of the queries is held out, and the head's masked-token accuracy
   and loss on them are reported before and after (mlm_head_warmup.json).

It writes one checkpoint, which pre-training starts from:

    python -m realm_jax.jobs.reader_prep \\
        --gin_file=experiments/pretrain_minilm_wiki.gin \\
        --gin.WORKDIR="'/tmp/prep'" --gin.BLOCK_STORE="'/tmp/blocks'" \\
        --gin.QUERIES="'/tmp/queries'"
    python -m realm_jax.jobs.pretrain \\
        --gin_file=experiments/pretrain_minilm_wiki.gin \\
        --gin.WORKDIR="'/tmp/run'" --gin.BLOCK_STORE="'/tmp/blocks'" \\
        --gin.QUERIES="'/tmp/queries'" \\
        --gin.INIT_FROM="'checkpoint:/tmp/prep/checkpoints'"

The cost is one forward pass of the reader over the queries used and a few
seconds of head-only steps. Nothing but the head moves, so the retriever
(and index 0) are `init_from`'s.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Mapping

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from realm_jax.checkpoint_import import init_from as init_lib
from realm_jax.core import checkpoints, checks, io_utils
from realm_jax.core import progress as progress_lib
from realm_jax.data import block_store, query_cache
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.model import functional
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.data import realm_inputs
from realm_jax.training import loop


# Queries the warm start reads (a seeded sample of the query cache:
# `QueryStream.sample`).
MAX_QUERIES = 1024

def _reader_inputs(queries: Mapping[str, np.ndarray], sep_id: int, store,
                   block_ids: np.ndarray | None, reader_length: int
                   ) -> dict[str, np.ndarray]:
  """`[CLS] x [SEP] body [SEP]`, or `[CLS] x [SEP] [SEP]` without blocks."""
  n, query_len = queries["query_ids"].shape
  if block_ids is None:
    bodies, lengths = np.zeros([n, 1, 1], np.int32), np.zeros([n, 1])
    reader_length = query_len + 1
  else:
    bodies, lengths = store.bodies(block_ids, store.max_block_len)
    bodies, lengths = bodies[:, None], np.asarray(lengths)[:, None]
  inputs = realm_inputs.reader_inputs(
      queries["query_ids"], queries["query_mask"], bodies, lengths,
      seq_len=reader_length, sep_id=sep_id)
  return {k: v[:, 0] for k, v in inputs.items()}


def mask_features(params: dict[str, Any], graphdef,
                  queries: Mapping[str, np.ndarray], *, sep_id: int,
                  store=None, block_ids: np.ndarray | None = None,
                  reader_length: int = 0,
                  batch_size: int = 64,
                  progress: progress_lib.Progress | None = None
                  ) -> dict[str, np.ndarray]:
  """Reader hidden states at every real mask of stacked REALM `queries`.

  Each query is read with block `block_ids[i]` of `store` in a reader input
  of `reader_length`; without `block_ids`, with the null document. Returns
  {"hidden": float32 [N, H], "targets": int32 [N]} over the N masks with
  weight > 0. `progress` counts the queries encoded.
  """

  @jax.jit
  def encode(params, ids, mask, segments, positions):
    reader = functional.bind(graphdef, params).reader
    hidden, _ = reader.bert(ids, mask, segments, dropout_rng=None)
    return jnp.take_along_axis(hidden, positions[..., None],
                               axis=1).astype(jnp.float32)

  inputs = _reader_inputs(queries, sep_id, store, block_ids, reader_length)
  n = len(queries["query_ids"])
  hidden = []
  for lo in range(0, n, batch_size):
    s = slice(lo, min(n, lo + batch_size))
    hidden.append(np.asarray(encode(
        params, inputs["token_ids"][s], inputs["input_mask"][s],
        inputs["segment_ids"][s], queries["mlm_positions"][s])))
    if progress:
      progress.update(s.stop - s.start)
  hidden = np.concatenate(hidden)                                # [n, M, H]
  real = np.asarray(queries["mlm_weights"]) > 0
  return {"hidden": hidden[real],
          "targets": np.asarray(queries["mlm_targets"])[real].astype(np.int32)}


def _features(params, graphdef, queries, rows, *, sep_id, store,
              reader_length, rng, progress) -> dict[str, np.ndarray]:
  """Features of `rows`: the first half with the null document, the rest
  each with a random block of another article (as pre-training reads both:
  a head fit on the null document alone is miscalibrated with documents)."""
  subset = {k: np.asarray(v)[rows] for k, v in queries.items()}
  if store is None:
    return mask_features(params, graphdef, subset, sep_id=sep_id,
                         progress=progress)
  half = len(rows) // 2
  blocks = rng.integers(0, len(store), len(rows) - half)
  own = store.doc_hash[blocks] == subset["source_doc_hash"][half:]
  blocks[own] = (blocks[own] + 1) % len(store)  # Rarely the own article.
  parts = [mask_features(params, graphdef,
                         {k: v[:half] for k, v in subset.items()},
                         sep_id=sep_id, progress=progress),
           mask_features(params, graphdef,
                         {k: v[half:] for k, v in subset.items()},
                         sep_id=sep_id, store=store, block_ids=blocks,
                         reader_length=reader_length, progress=progress)]
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _head_features(params, graphdef, queries, *, sep_id, store,
                   reader_length, max_queries, seed
                   ) -> dict[str, dict[str, np.ndarray]]:
  """{"train", "heldout"} `_features` of a seeded subset of at most
  `max_queries` queries, a tenth of it (at least one) held out."""
  rng = np.random.default_rng(seed)
  n = len(queries["query_ids"])
  chosen = np.sort(rng.permutation(n)[:max_queries])
  held = np.zeros(len(chosen), bool)
  held[rng.permutation(len(chosen))[:max(1, len(chosen) // 10)]] = True
  with progress_lib.Progress(
      "reader preparation: encoding queries", len(chosen), unit="queries",
      host=progress_lib.jax_host()) as bar:
    return {name: _features(params, graphdef, queries, chosen[rows],
                            sep_id=sep_id, store=store,
                            reader_length=reader_length, rng=rng,
                            progress=bar)
            for name, rows in (("train", ~held), ("heldout", held))}


def _head_fns(params, graphdef, tx):
  """(jitted Adam step of the MLM head, its evaluation) on mask features;
  every parameter but the head is that of `params`."""

  def head_logits(head, hidden):
    reader = functional.bind(
        graphdef, dict(params, reader=dict(params["reader"], mlm_head=head))
    ).reader
    return reader.mlm_head(
        hidden, reader.bert.embeddings.word_embeddings.embedding[...])

  def loss_fn(head, hidden, targets):
    log_probs = jax.nn.log_softmax(head_logits(head, hidden), -1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[:, None], -1))

  @jax.jit
  def step(head, opt_state, hidden, targets):
    loss, grads = jax.value_and_grad(loss_fn)(head, hidden, targets)
    updates, opt_state = tx.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, loss

  @jax.jit
  def sums(head, hidden, targets):
    log_probs = jax.nn.log_softmax(head_logits(head, hidden), -1)
    ll = jnp.take_along_axis(log_probs, targets[:, None], -1)[:, 0]
    return jnp.sum(jnp.argmax(log_probs, -1) == targets), -jnp.sum(ll)

  def evaluate(head, f, chunk=1024):
    """(accuracy, mean negative log-likelihood) over the masks of `f`."""
    m = len(f["targets"])
    parts = [sums(head, f["hidden"][lo:lo + chunk], f["targets"][lo:lo + chunk])
             for lo in range(0, m, chunk)]
    return (sum(float(c) for c, _ in parts) / max(m, 1),
            sum(float(n) for _, n in parts) / max(m, 1))

  return step, evaluate


def _fit_head(step, opt_state, head, train, *, steps, batch_size, seed):
  """`steps` head steps on seeded random batches of the `train` masks
  (logging the loss four times); returns (head, Adam's state)."""
  m = len(train["targets"])
  with progress_lib.Progress(
      "reader preparation: fitting the MLM head", steps, unit="steps",
      host=progress_lib.jax_host()) as bar:
    for i in range(steps):
      rows = np.random.default_rng([seed, i]).integers(0, m,
                                                       min(batch_size, m))
      head, opt_state, loss = step(head, opt_state, train["hidden"][rows],
                                   train["targets"][rows])
      if (i + 1) % max(1, steps // 4) == 0:
        logging.info("MLM head warm start: step %d/%d, loss %.3f", i + 1,
                     steps, float(loss))
      bar.update()
  return head, opt_state


def _head_report(evaluate, head, features, before, t0) -> dict[str, float]:
  """`warm_start_mlm_head`'s report (logged): masks, held-out accuracy and
  loss `before` (and after) the fit, train accuracy, seconds since t0."""
  after = evaluate(head, features["heldout"])
  m = len(features["train"]["targets"])
  report = {
      "masks": float(m),
      "heldout_masks": float(len(features["heldout"]["targets"])),
      "heldout_accuracy_before": before[0],
      "heldout_accuracy_after": after[0],
      "heldout_loss_before": before[1],
      "heldout_loss_after": after[1],
      "train_accuracy_after": evaluate(head, features["train"])[0],
      "seconds": round(time.time() - t0, 1),
  }
  logging.info("MLM head warm start on %d masks: held-out accuracy %.3f -> "
               "%.3f, loss %.2f -> %.2f (%.1f s)", m, before[0], after[0],
               before[1], after[1], report["seconds"])
  return report


def warm_start_mlm_head(params: dict[str, Any], graphdef,
                        queries: Mapping[str, np.ndarray], *, sep_id: int,
                        store=None, reader_length: int = 0,
                        steps: int = 200, batch_size: int = 256,
                        learning_rate: float = 3e-3,
                        max_queries: int = MAX_QUERIES,
                        seed: int = 0
                        ) -> tuple[dict[str, Any], Any, dict[str, float]]:
  """Fits `reader/mlm_head` to the queries' masks.

  Args:
    params: {"retriever", "reader"} parameters; the reader has an MLM head.
    graphdef: the `Realm` graph definition.
    queries: stacked REALM queries (`examples.REALM_QUERY_FEATURES`).
    sep_id: the tokenizer's [SEP] id.
    store, reader_length: the knowledge corpus and the reader's length:
      half of the queries are read with a random block (the rest with the
      null document). Without a store, all with the null document.
    steps, batch_size, learning_rate: the head's Adam steps over masks.
    max_queries: queries encoded (a random subset when there are more).
    seed: subset, held-out split and batch order.

  Returns:
    The parameters with a new head (everything else is the same object),
    the head's Adam state, and {"masks", "heldout_masks",
    "heldout_accuracy_before"/"_after", "heldout_loss_before"/"_after"
    (mean negative log-likelihood),
    "train_accuracy_after", "seconds"}.

  Raises:
    ValueError: if the reader has no MLM head or the queries have no mask.
  """
  if "mlm_head" not in params.get("reader", {}):
    raise ValueError("warm_start_mlm_head: the reader has no MLM head "
                     "(ReaderConfig.mlm_head=False).")
  t0 = time.time()
  features = _head_features(params, graphdef, queries, sep_id=sep_id,
                            store=store, reader_length=reader_length,
                            max_queries=max_queries, seed=seed)
  if len(features["train"]["targets"]) == 0:
    raise ValueError("warm_start_mlm_head: the queries have no mask.")
  tx = optax.adam(learning_rate)
  step, evaluate = _head_fns(params, graphdef, tx)
  head = jax.tree_util.tree_map(jnp.asarray, params["reader"]["mlm_head"])
  before = evaluate(head, features["heldout"])
  head, opt_state = _fit_head(step, tx.init(head), head, features["train"],
                              steps=steps, batch_size=batch_size, seed=seed)
  report = _head_report(evaluate, head, features, before, t0)
  reader = dict(params["reader"], mlm_head=head)
  return dict(params, reader=reader), opt_state, report


# -----------------------------------------------------------------------------
# The job
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReaderPrepConfig(loop.TrainConfig):
  """A reader preparation run (`loop.TrainConfig`): the MLM head's fit.

  Attributes:
    queries: the pre-training query cache (the masks the head learns); a
      seeded sample of `max_queries` queries of it is read
      (`QueryStream.sample`), a tenth of them held out.
    init_from: the weights to prepare, e.g. "minilm" (see
      `realm_jax.checkpoint_import.init_from`).
    num_train_steps: the head's Adam steps over the masks' features.
    batch_size: masks per step.
    learning_rate: Adam's (constant) rate.
    reader_length: the reader's input, query + block, as pre-training reads
      it; None: the cache's query_length + the block store's max_block_len.
    max_queries: queries encoded.
  """

  queries: str = checks.path_setting("reads")
  num_train_steps: int = 200
  batch_size: int = 256
  learning_rate: float = 3e-3
  reader_length: int | None = None
  max_queries: int = MAX_QUERIES

  def __post_init__(self):
    for name in ("workdir", "block_store", "queries"):
      if not getattr(self, name):
        raise ValueError(f"ReaderPrepConfig.{name} is empty; set the "
                         f"{name.upper()} gin macro.")
    super().__post_init__()
    checks.at_least(self, "max_queries")
    checks.at_least(self, "reader_length", optional=True)


def _inputs(config: ReaderPrepConfig):
  """(block store, a sample of the cache's queries, reader length)."""
  store = block_store.BlockStore.open(config.block_store)
  tokenizer = Tokenizer()
  store.check_vocab(tokenizer.vocab_path)
  # Every host reads the same sample, from every article (the cache's own
  # order, `QueryStream.head`, is by file: its first queries are the first
  # few articles', whose names a head fit to them learns to guess).
  queries = query_cache.QueryStream(
      config.queries, seed=config.seed, batch_size=int(
          query_cache.read_manifest(config.queries)["num_shards"]))
  try:
    queries.check(vocab_sha256=io_utils.sha256_file(tokenizer.vocab_path))
    query_length = queries.query_config.query_length
    head = queries.sample(config.max_queries)
  finally:
    queries.close()
  return store, head, realm_inputs.reader_length(
      config.reader_length, query_length, store.max_block_len,
      field="ReaderPrepConfig.reader_length", queries=config.queries)


def train(*, config: ReaderPrepConfig, model: RealmConfig,
          operative_config: str = "", stop_after: int | None = None
          ) -> dict[str, float]:
  """Prepares the reader once: `init_from`'s weights with the MLM head fit
  to the queries' masks (`warm_start_mlm_head`, deterministic from the
  seed: every host computes the same), saved as checkpoint
  `num_train_steps` of `config.workdir` (DONE marked) for pre-training's
  `init_from = "checkpoint:<workdir>/checkpoints"`, and its report as
  mlm_head_warmup.json. A workdir that holds the checkpoint already is
  left as it is. Returns the report. (`stop_after`: unused, the fit is
  one piece.)"""
  del stop_after
  with loop.Run(config, model, job="reader preparation",
                operative_config=operative_config) as run:
    store, queries, reader_length = _inputs(config)
    graphdef, fresh = functional.init(lambda r: Realm(model, rngs=r),
                                      config.seed)
    tx = optax.adam(config.learning_rate)
    _, params, restored = run.init_or_restore(
        fresh, tx, lambda: init_lib.initial_params(model, fresh,
                                                   config.init_from),
        trained=_head)
    report_path = io_utils.join(config.workdir, "mlm_head_warmup.json")
    if restored:
      logging.info("reader preparation: %s is prepared already",
                   run.ckpt.directory)
      report = _saved_report(report_path)
      if report is not None:
        return report
      # The fit is deterministic from the seed: the report is computed
      # again from the initial weights; the checkpoint stays as it is.
      params = init_lib.initial_params(model, fresh, config.init_from)
    params, opt_state, report = warm_start_mlm_head(
        jax.device_get(params), graphdef, queries,
        sep_id=int(store.manifest["sep_id"]), store=store,
        reader_length=reader_length, steps=config.num_train_steps,
        batch_size=config.batch_size, learning_rate=config.learning_rate,
        max_queries=config.max_queries, seed=config.seed)
    if run.is_chief:
      io_utils.write_json(report_path, report)
    if restored:
      return report
    run.save(config.num_train_steps, params, opt_state,
             {"seed": config.seed, "job": "reader_prep"})
    run.ckpt.wait_until_finished()
    if run.is_chief:
      checkpoints.write_done_marker(run.ckpt.directory,
                                    config.num_train_steps)
    return report


def _saved_report(path: str) -> dict[str, float] | None:
  """The report of a finished preparation, or None (with a warning saying
  it is recomputed) when it is missing or damaged."""
  try:
    report = json.loads(io_utils.as_path(path).read_bytes())
    if not isinstance(report, dict):
      raise ValueError(f"a JSON {type(report).__name__}, not an object")
    return report
  except FileNotFoundError:
    problem = "is missing"
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError too.
    problem = f"is damaged ({e})"
  logging.warning("reader preparation: %s %s; the checkpoint is prepared "
                  "and kept as it is, and the report is computed again "
                  "(the fit is deterministic from the seed).", path, problem)
  return None


def _head(params):
  return params["reader"]["mlm_head"]

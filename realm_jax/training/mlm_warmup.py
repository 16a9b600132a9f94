"""A warm start of the reader's masked-LM head on the pre-training queries.

Checkpoints without an MLM head (sentence-embedding packages such as
MiniLM, or a BERT exported without its pre-training heads) start REALM with
a random head: its predictions are noise over 30k wordpieces, so masked-LM
accuracy stays at 0 and the reader cannot yet tell the retriever which
documents help, until many joint steps have taught it the vocabulary.

This module trains only the head (`reader/mlm_head/*`: transform, layer
norm and output bias; the output embeddings stay tied to the frozen input
ones) on the run's own salient-span queries, read as pre-training reads
them, half with the null document and half with a (random) block:

1. the frozen reader encodes `[CLS] x [SEP] [SEP]` or `[CLS] x [SEP] block
   [SEP]` once per query and the hidden states at the masks are kept;
2. Adam fits the head to those features for `steps` steps;
3. a tenth of the queries is held out, and the head's masked-token accuracy
   and loss on them are reported before and after.

The cost is one forward pass of the reader over the queries used and a few
seconds of head-only steps; `PretrainConfig.mlm_head_warmup_steps` turns it
on for a run that starts from such a checkpoint. It touches nothing but the
head, so the retriever (and index 0) are unchanged.

`adapt_reader` goes further (`PretrainConfig.reader_adaptation_steps`):
it trains the reader's BERT body as well as its head, reading each query
with the null document, a random block and an "answer block" (another
article's block that holds the masked span, `find_answer_blocks`), until
the answer block helps on held-out queries. Still nothing of the
retriever moves.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from realm_jax.model import functional, losses
from realm_jax.training import optimizer as optimizer_lib
from realm_jax.training import realm_inputs


# Queries the warm start reads (the first ones of the run's query stream).
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
                  batch_size: int = 64) -> dict[str, np.ndarray]:
  """Reader hidden states at every real mask of stacked REALM `queries`.

  Each query is read with block `block_ids[i]` of `store` in a reader input
  of `reader_length`; without `block_ids`, with the null document. Returns
  {"hidden": float32 [N, H], "targets": int32 [N]} over the N masks with
  weight > 0.
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
  hidden = np.concatenate(hidden)                                # [n, M, H]
  real = np.asarray(queries["mlm_weights"]) > 0
  return {"hidden": hidden[real],
          "targets": np.asarray(queries["mlm_targets"])[real].astype(np.int32)}


def _features(params, graphdef, queries, rows, *, sep_id, store,
              reader_length, rng) -> dict[str, np.ndarray]:
  """Features of `rows`: the first half with the null document, the rest
  each with a random block of another article (as pre-training reads both:
  a head fit on the null document alone is miscalibrated with documents)."""
  subset = {k: np.asarray(v)[rows] for k, v in queries.items()}
  if store is None:
    return mask_features(params, graphdef, subset, sep_id=sep_id)
  half = len(rows) // 2
  blocks = rng.integers(0, len(store), len(rows) - half)
  own = store.doc_hash[blocks] == subset["source_doc_hash"][half:]
  blocks[own] = (blocks[own] + 1) % len(store)  # Rarely the own article.
  parts = [mask_features(params, graphdef,
                         {k: v[:half] for k, v in subset.items()},
                         sep_id=sep_id),
           mask_features(params, graphdef,
                         {k: v[half:] for k, v in subset.items()},
                         sep_id=sep_id, store=store, block_ids=blocks,
                         reader_length=reader_length)]
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
  return {name: _features(params, graphdef, queries, chosen[rows],
                          sep_id=sep_id, store=store,
                          reader_length=reader_length, rng=rng)
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
  (logging the loss four times); returns the head."""
  m = len(train["targets"])
  for i in range(steps):
    rows = np.random.default_rng([seed, i]).integers(0, m, min(batch_size, m))
    head, opt_state, loss = step(head, opt_state, train["hidden"][rows],
                                 train["targets"][rows])
    if (i + 1) % max(1, steps // 4) == 0:
      logging.info("MLM head warm start: step %d/%d, loss %.3f", i + 1,
                   steps, float(loss))
  return head


def warm_start_mlm_head(params: dict[str, Any], graphdef,
                        queries: Mapping[str, np.ndarray], *, sep_id: int,
                        store=None, reader_length: int = 0,
                        steps: int = 200, batch_size: int = 256,
                        learning_rate: float = 3e-3,
                        max_queries: int = MAX_QUERIES,
                        seed: int = 0) -> tuple[dict[str, Any],
                                                dict[str, float]]:
  """Fits `reader/mlm_head` to the queries' masks; returns (params, report).

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
    and {"masks", "heldout_masks", "heldout_accuracy_before"/"_after",
    "heldout_loss_before"/"_after" (mean negative log-likelihood),
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
  train = features["train"]
  m = len(train["targets"])
  head = _fit_head(step, tx.init(head), head, train, steps=steps,
                   batch_size=batch_size, seed=seed)
  after = evaluate(head, features["heldout"])
  report = {
      "masks": float(m),
      "heldout_masks": float(len(features["heldout"]["targets"])),
      "heldout_accuracy_before": before[0],
      "heldout_accuracy_after": after[0],
      "heldout_loss_before": before[1],
      "heldout_loss_after": after[1],
      "train_accuracy_after": evaluate(head, train)[0],
      "seconds": round(time.time() - t0, 1),
  }
  logging.info("MLM head warm start on %d masks: held-out accuracy %.3f -> "
               "%.3f, loss %.2f -> %.2f (%.1f s)", m, before[0], after[0],
               before[1], after[1], report["seconds"])
  reader = dict(params["reader"], mlm_head=head)
  return dict(params, reader=reader), report


# -----------------------------------------------------------------------------
# Reader adaptation: the body as well as the head, with answer blocks.
# -----------------------------------------------------------------------------

# Queries reader adaptation reads (the first ones of the run's query stream);
# those of a tenth of their articles are held out.
ADAPTATION_MAX_QUERIES = 2048
# Documents each query is read with: the null document, a random block of
# another article, an answer block (when one exists).
NULL, RANDOM, ANSWER = 0, 1, 2
# What a training step reads (held-out evaluations always read all three):
# "all" the three documents, "answer" the answer block alone (only queries
# that have one train). With "all", two reads in three reward a reader for
# ignoring its document.
READS = ("all", "answer")
# The answer block must help by more than this (nats per held-out mask) to
# stop adaptation. Not 0: before the reader reads, a block's mere presence
# shifts the log-likelihood of every mask by ~1e-4 nats, of either sign, and
# a threshold of 0 then stops a reader that reads nothing (measured on the
# knowledge world: 5e-5 nats at step 50, every accuracy 0).
MIN_UTILITY = 0.05
# Held-out evaluations without a better held-out loss before adaptation
# stops as overfitting. A 2-layer reader from random weights on the
# Wikipedia slice's 1,657 answer-bearing sentences bottomed out at step 200
# of 3,000 and then memorised them: held-out loss 7.4 -> 10.7 nats
# (docs/results/learning.md).
LOSS_PATIENCE = 3


def _postings(store, firsts: np.ndarray, width: int, max_postings: int,
              chunk_blocks: int) -> dict[int, tuple[np.ndarray, ...]]:
  """Where the wordpieces `firsts` occur in the block bodies.

  One pass over the store in chunks of blocks (stopped early once every
  wordpiece has `max_postings` occurrences, which caps the cost of frequent
  ones). Returns {wordpiece: (block ids, body columns, windows int32
  [P, width] of the body from each occurrence on, zero past its end)}.
  """
  counts = {int(w): 0 for w in firsts}
  found = {w: [] for w in counts}
  wanted = np.array(sorted(counts), np.int32)
  for lo in range(0, len(store), chunk_blocks):
    ids = np.arange(lo, min(len(store), lo + chunk_blocks))
    bodies, _ = store.bodies(ids, store.max_block_len)
    rows, cols = np.nonzero(np.isin(bodies, wanted))
    padded = np.pad(bodies, ((0, 0), (0, width)))
    words = bodies[rows, cols]
    for w in np.unique(words):
      sel = np.flatnonzero(words == w)[:max_postings - counts[int(w)]]
      counts[int(w)] += len(sel)
      found[int(w)].append((ids[rows[sel]], cols[sel], padded[
          rows[sel, None], cols[sel, None] + np.arange(width)]))
    wanted = np.array([w for w in wanted if counts[int(w)] < max_postings],
                      np.int32)
    if not len(wanted):
      break
  empty = (np.zeros([0], np.int64), np.zeros([0], np.int64),
           np.zeros([0, width], np.int32))
  return {w: tuple(np.concatenate(p) for p in zip(*parts)) if parts
          else empty for w, parts in found.items()}


def _query_words(query_ids: np.ndarray, query_mask: np.ndarray,
                 positions: np.ndarray) -> np.ndarray:
  """The query's distinct wordpieces, without [CLS], [SEP] and masks."""
  n = int(np.asarray(query_mask).sum())
  keep = np.zeros(len(query_ids), bool)
  keep[1:n - 1] = True
  keep[positions] = False
  return np.unique(query_ids[keep])


def find_answer_blocks(queries: Mapping[str, np.ndarray], store, *,
                       reader_length: int, trivial_candidates: str = "article",
                       max_postings: int = 4096, max_matches: int = 64,
                       chunk_blocks: int = 4096) -> np.ndarray:
  """An answer block per query: a non-trivial block that holds its span.

  A block qualifies when its body holds the query's masked wordpieces
  (`realm_inputs.masked_spans`) as a contiguous run, where the reader sees
  it (within the `reader_length - len(query) - 1` body tokens the reader
  input keeps),
  and REALM's no-trivial-retrieval rule allows it (`trivial_candidates`,
  as in training: "article" excludes every block of the query's article,
  "block" only the block that holds the sentence), so the reader never
  learns to copy the sentence's own context. Of the qualifying blocks, the
  one that shares the most distinct wordpieces with the unmasked query is
  chosen (the block a retriever would most likely return: on the knowledge
  world, the person's biography rather than another one that names the
  same city), the lowest block id on ties.

  The search is by token matching over an inverted index, built in one pass
  over the store, from the queries' first masked wordpieces to their first
  `max_postings` occurrences (lowest block ids first); at most
  `max_matches` (the lowest ids) qualifying blocks per query are compared.

  Args:
    queries: stacked REALM queries (`examples.REALM_QUERY_FEATURES`).
    store: the knowledge corpus (`block_store.BlockStore`).
    reader_length: the reader's input length.
    trivial_candidates: the rule ("article" or "block";
      `realm_inputs.TrivialCandidates`).
    max_postings, max_matches, chunk_blocks: cost caps (see above) and the
      blocks read at a time.

  Returns:
    int64 [num_queries] block ids, -1 where no block qualifies.
  """
  spans = realm_inputs.masked_spans(queries)
  n = len(spans)
  out = np.full([n], -1, np.int64)
  lengths = [len(s) for s in spans if len(s)]
  if not lengths or not len(store):
    return out
  index = _postings(store, np.unique([s[0] for s in spans if len(s)]),
                    max(lengths), max_postings, chunk_blocks)
  trivial = realm_inputs.TrivialCandidates(store, trivial_candidates)
  block_keys, query_keys = trivial.block_keys, trivial.query_keys(queries)
  for i, span in enumerate(spans):
    if not len(span):
      continue
    blocks, cols, windows = index[int(span[0])]
    room = (reader_length - int(np.sum(queries["query_mask"][i])) - 1)
    ok = ((windows[:, :len(span)] == span).all(1)
          & (cols + len(span) <= room)
          & (block_keys[blocks] != query_keys[i]))
    candidates = np.unique(blocks[ok])[:max_matches]
    if not len(candidates):
      continue
    words = _query_words(np.asarray(queries["query_ids"][i]),
                         queries["query_mask"][i],
                         np.asarray(queries["mlm_positions"][i])[
                             np.asarray(queries["mlm_weights"][i]) > 0])
    bodies, _ = store.bodies(candidates, max(room, 1))
    shared = [len(np.intersect1d(b[b > 0], words)) for b in bodies]
    out[i] = candidates[int(np.argmax(shared))]
  return out


def _random_blocks(rng: np.random.Generator, store,
                   source_doc_hash: np.ndarray) -> np.ndarray:
  """A uniformly random block per query, of another article than its own."""
  doc_hash = np.asarray(store.doc_hash)
  own_hash = np.asarray(source_doc_hash, np.int64)
  blocks = rng.integers(0, len(store), len(own_hash))
  for _ in range(8):  # Redraws: the own article is a tiny share of a corpus.
    own = doc_hash[blocks] == own_hash
    if not own.any():
      return blocks
    blocks[own] = rng.integers(0, len(store), int(own.sum()))
  own = doc_hash[blocks] == own_hash
  blocks[own] = (blocks[own] + 1) % len(store)  # Next article's, usually.
  return blocks


def _adaptation_batch(queries: Mapping[str, np.ndarray], rows: np.ndarray,
                      random_blocks: np.ndarray, answer_blocks: np.ndarray,
                      store, *, sep_id: int, reader_length: int
                      ) -> dict[str, np.ndarray]:
  """Reader inputs [B, 3, L] of `rows`, each read with the null document,
  its random block and its answer block; "weights" [B, 3, M] are the real
  masks', zero for the answer slot of a query without an answer block."""
  b = len(rows)
  has = answer_blocks >= 0
  blocks = np.stack([random_blocks, np.where(has, answer_blocks, 0)], 1)
  bodies, lengths = store.bodies(blocks.reshape(-1), store.max_block_len)
  bodies = bodies.reshape(b, 2, -1) * np.stack(
      [np.ones_like(has), has], 1)[..., None]
  lengths = lengths.reshape(b, 2) * np.stack([np.ones_like(has), has], 1)
  bodies = np.concatenate([np.zeros_like(bodies[:, :1]), bodies], 1)
  lengths = np.concatenate([np.zeros_like(lengths[:, :1]), lengths], 1)
  q = {k: np.asarray(v)[rows] for k, v in queries.items()}
  inputs = realm_inputs.reader_inputs(
      q["query_ids"], q["query_mask"], bodies, lengths,
      seq_len=reader_length, sep_id=sep_id,
      pad_id=int(store.manifest.get("pad_id", 0)))
  read = np.stack([np.ones(b), np.ones(b), has], 1).astype(np.float32)
  return dict(inputs, mlm_positions=q["mlm_positions"].astype(np.int32),
              mlm_targets=q["mlm_targets"].astype(np.int32),
              weights=(q["mlm_weights"][:, None, :].astype(np.float32)
                       * read[:, :, None]))


def reader_fns(graphdef, tx):
  """Jitted (train step, evaluation) of the reader's body and head, on
  batches of reader inputs [B, D, L] (D documents per row), "mlm_positions"
  and "mlm_targets" [B, M] and "weights" [B, D, M]: the step minimises the
  weighted mean masked-token loss; the evaluation returns log-likelihoods
  and correctness [B, D, M]."""

  def token_ll(params, trained, batch, dropout_rng):
    reader = dict(params["reader"], **trained)
    model = functional.bind(graphdef, dict(params, reader=reader)).reader
    positions = jnp.broadcast_to(batch["mlm_positions"][:, None, :],
                                 batch["weights"].shape)
    logits = model.mlm_logits(batch["token_ids"], batch["input_mask"],
                              batch["segment_ids"], positions,
                              dropout_rng=dropout_rng)
    return logits, losses.token_log_likelihoods(logits, batch["mlm_targets"])

  def loss_fn(trained, params, batch, dropout_rng):
    _, ll = token_ll(params, trained, batch, dropout_rng)
    w = batch["weights"]
    return -jnp.sum(ll * w) / jnp.maximum(jnp.sum(w), 1.0)

  @jax.jit
  def step(trained, opt_state, params, batch, dropout_rng):
    loss, grads = jax.value_and_grad(loss_fn)(trained, params, batch,
                                              dropout_rng)
    updates, opt_state = tx.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss

  @jax.jit
  def evaluate(trained, params, batch):
    logits, ll = token_ll(params, trained, batch, None)
    correct = jnp.argmax(logits, -1) == batch["mlm_targets"][:, None, :]
    return ll, correct

  return step, evaluate


def _heldout_metrics(evaluate, trained, params, batches) -> dict[str, float]:
  """Held-out masked-token accuracy with each document and the utilities.

  `batches` are `_adaptation_batch`es of the held-out queries (padding rows
  have zero weights). Utilities are mean log-likelihood differences over
  real masks, in nats: the answer block's over the queries that have one.
  """
  sums = np.zeros([3, 3])  # [document, (correct, log-likelihood, masks)]
  answer_gain = random_gain = 0.0
  for batch in batches:
    ll, correct = (np.asarray(x, np.float64)
                   for x in evaluate(trained, params, batch))
    w = np.asarray(batch["weights"], np.float64)
    for doc in (NULL, RANDOM, ANSWER):
      sums[doc] += [np.sum(correct[:, doc] * w[:, doc]),
                    np.sum(ll[:, doc] * w[:, doc]), np.sum(w[:, doc])]
    answer_gain += np.sum((ll[:, ANSWER] - ll[:, NULL]) * w[:, ANSWER])
    random_gain += np.sum((ll[:, RANDOM] - ll[:, NULL]) * w[:, RANDOM])

  def ratio(x, n):
    return float(x / n) if n else float("nan")

  names = {NULL: "null", RANDOM: "random", ANSWER: "answer"}
  out = {f"accuracy_{names[d]}": ratio(sums[d, 0], sums[d, 2])
         for d in names}
  out.update({f"loss_{names[d]}": ratio(-sums[d, 1], sums[d, 2])
              for d in names})
  out["loss_all"] = ratio(-sums[:, 1].sum(), sums[:, 2].sum())
  out["utility"] = ratio(answer_gain, sums[ANSWER, 2])
  out["random_utility"] = ratio(random_gain, sums[RANDOM, 2])
  return out


def _split_queries(doc_hash: np.ndarray, max_queries: int, seed: int
                   ) -> tuple[np.ndarray, np.ndarray]:
  """(training rows, held-out rows): a seeded subset of at most
  `max_queries` queries; the rows of a fixed tenth of its articles are held
  out. By article, not by sentence: a reader memorises the blocks it
  trains on, so held-out sentences of a training article measure that
  memory rather than reading (on the Wikipedia slice their answer blocks
  hurt by 0.6-1.0 nats while retrieval on unseen articles helped,
  docs/results/learning.md)."""
  rng = np.random.default_rng([seed, 3])
  chosen = np.sort(rng.permutation(len(doc_hash))[:max_queries])
  chosen_hash = np.asarray(doc_hash)[chosen]
  articles = np.unique(chosen_hash)
  out = rng.permutation(articles)[:max(1, len(articles) // 10)]
  held = np.isin(chosen_hash, out)
  return chosen[~held], chosen[held]


def _evaluation_batches(queries, rows, answer_blocks, store, *, sep_id,
                        reader_length, batch_size, seed) -> list[dict]:
  """The held-out queries' fixed batches (one random block each, drawn
  once), padded to `batch_size` rows with zero weights (one compilation)."""
  random_blocks = _random_blocks(np.random.default_rng([seed, 4]), store,
                                 np.asarray(queries["source_doc_hash"])[rows])
  batches = []
  for lo in range(0, len(rows), batch_size):
    part = np.arange(lo, min(len(rows), lo + batch_size))
    pad = np.concatenate([part, np.full(batch_size - len(part), part[0])])
    batch = _adaptation_batch(queries, rows[pad], random_blocks[pad],
                              answer_blocks[pad], store, sep_id=sep_id,
                              reader_length=reader_length)
    batch["weights"][len(part):] = 0.0
    batches.append(batch)
  return batches


def _log_evaluation(point: dict[str, Any], steps: int, t0: float,
                    min_utility: float, patience: int) -> None:
  step = point["step"]
  elapsed = time.time() - t0
  eta = elapsed / step * (steps - step) if step else float("nan")
  logging.info(
      "reader adaptation: step %d/%d (%.0f%%), %.0f s, ETA <= %.0f s; "
      "held-out accuracy null %.3f random %.3f answer %.3f; answer-block "
      "utility %.4f nats (> %g: %d/%d in a row), random block %.4f",
      step, steps, 100.0 * step / steps, elapsed, eta,
      point["accuracy_null"], point["accuracy_random"],
      point["accuracy_answer"], point["utility"], min_utility,
      point["streak"], patience, point["random_utility"])


def _json_safe(value):
  """NaN (no held-out answer block) as null: strict JSON has no NaN."""
  return None if isinstance(value, float) and np.isnan(value) else value


def _heldout_loss(point: dict[str, Any], reads: str) -> float:
  """The held-out loss of what training reads: the answer block's alone, or
  all three documents' pooled."""
  return point["loss_answer"] if reads == "answer" else point["loss_all"]


def _train_until_useful(params, graphdef, tx, heldout, make_batch, *,
                        steps, eval_every, min_utility, patience, reads,
                        loss_patience, seed, t0):
  """`adapt_reader`'s loop: (reader body and head, curve, stop reason,
  steps trained, step of the best held-out loss)."""
  step_fn, evaluate = reader_fns(graphdef, tx)
  trained = {k: jax.tree_util.tree_map(jnp.asarray, params["reader"][k])
             for k in ("bert", "mlm_head")}
  opt_state, curve, streak, reason, done = tx.init(trained), [], 0, "steps", 0
  best, worse = (np.inf, trained, 0), 0  # (held-out loss, reader, step)
  for done in range(steps + 1):
    if done % eval_every == 0 or done == steps:
      point = {"step": done, **_heldout_metrics(evaluate, trained, params,
                                                heldout)}
      # Step 0 is the baseline: only what training did counts.
      streak = streak + 1 if done and point["utility"] > min_utility else 0
      loss = _heldout_loss(point, reads)
      if loss < best[0]:
        best, worse = (loss, trained, done), 0
      elif np.isfinite(loss):
        worse += 1
      curve.append(dict(point, streak=streak, best_step=best[2],
                        seconds=round(time.time() - t0, 1)))
      _log_evaluation(curve[-1], steps, t0, min_utility, patience)
      if streak >= patience:
        reason = "utility"
        break
      if worse >= loss_patience and done < steps:
        # Memorising the training sentences, not learning to read: keep
        # the reader of the best held-out loss.
        reason, trained = "overfit", best[1]
        break
    if done == steps:
      break
    trained, opt_state, _ = step_fn(
        trained, opt_state, params, make_batch(done),
        jax.random.fold_in(jax.random.key(seed), done))
  return trained, curve, reason, done, best[2]


def _check_adaptation_args(params: dict[str, Any], steps: int,
                           eval_every: int, patience: int, loss_patience: int,
                           reads: str) -> None:
  """Raises `adapt_reader`'s ValueErrors about its arguments."""
  if reads not in READS:
    raise ValueError(f"adapt_reader: reads={reads!r}; use one of {READS}.")
  if "mlm_head" not in params.get("reader", {}):
    raise ValueError("adapt_reader: the reader has no MLM head "
                     "(ReaderConfig.mlm_head=False).")
  if min(steps, eval_every, patience, loss_patience) < 1:
    raise ValueError("adapt_reader: steps, eval_every, patience and "
                     "loss_patience must be >= 1, got "
                     f"{steps}, {eval_every}, {patience}, {loss_patience}.")


def reader_optimizer(learning_rate: float, steps: int):
  """BERT's optimiser (clipping, weight decay, warmup then linear decay over
  `steps`) with Adam's bias correction: raw moments' larger early steps
  make a reader memorise facts rather than read (docs/results/learning.md).
  """
  return optimizer_lib.bert_optimizer(
      learning_rate=learning_rate, num_train_steps=steps,
      warmup_steps=steps // 10, bias_correction=True)


def _adaptation_queries(queries: dict[str, np.ndarray], store, *,
                        max_queries: int, seed: int, reader_length: int,
                        trivial_candidates: str, reads: str
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(training rows, held-out rows, answer block of every query): the
  `_split_queries` rows (training rows without an answer block left out
  when `reads` is "answer"), and `find_answer_blocks` for them (-1
  elsewhere).

  Raises:
    ValueError: if there are too few articles to hold a tenth out, or no
      training query has an answer block to read.
  """
  train, held = _split_queries(queries["source_doc_hash"], max_queries,
                               seed)
  if not len(train):
    raise ValueError("adapt_reader: too few articles to hold a tenth of "
                     "them out (the queries come from "
                     f"{len(np.unique(queries['source_doc_hash']))}).")
  answers = np.full(len(queries["query_ids"]), -1, np.int64)
  used = np.concatenate([train, held])
  answers[used] = find_answer_blocks({k: v[used] for k, v in queries.items()},
                                     store, reader_length=reader_length,
                                     trivial_candidates=trivial_candidates)
  if reads == "answer":
    train = train[answers[train] >= 0]
    if not len(train):
      raise ValueError("adapt_reader: reads='answer', but no training query "
                       "has an answer block.")
  return train, held, answers


def _adaptation_report(curve, reason, done, steps, train, held, answers,
                       doc_hash, t0, **settings) -> dict[str, Any]:
  """`adapt_reader`'s report (see there); "seconds" since `t0`."""
  return {
      "curve": [{k: _json_safe(v) for k, v in p.items()} for p in curve],
      "stop_reason": reason, "steps": done, "max_steps": steps, **settings,
      "queries": len(train), "heldout_queries": len(held),
      "heldout_articles": len(np.unique(doc_hash[held])),
      "train_answer_share": float(np.mean(answers[train] >= 0)),
      "heldout_answer_share": float(np.mean(answers[held] >= 0)),
      "seconds": round(time.time() - t0, 1)}


def _training_batches(queries, train, answers, store, *, sep_id,
                      reader_length, batch_size, reads, seed):
  """step -> that step's `_adaptation_batch` of random training rows (the
  answer slot alone when `reads` is "answer"): a function of the seed."""

  def make_batch(done):
    rng = np.random.default_rng([seed, 5, done])
    rows = rng.choice(train, min(batch_size, len(train)), replace=False)
    batch = _adaptation_batch(
        queries, rows, _random_blocks(rng, store, queries["source_doc_hash"][
            rows]), answers[rows], store, sep_id=sep_id,
        reader_length=reader_length)
    if reads == "answer":
      for k in ("token_ids", "input_mask", "segment_ids", "weights"):
        batch[k] = batch[k][:, ANSWER:ANSWER + 1]
    return batch

  return make_batch


def adapt_reader(params: dict[str, Any], graphdef,
                 queries: Mapping[str, np.ndarray], *, store, sep_id: int,
                 reader_length: int, steps: int, batch_size: int = 16,
                 learning_rate: float = 1e-4, eval_every: int = 50,
                 min_utility: float = MIN_UTILITY, patience: int = 2,
                 trivial_candidates: str = "article", reads: str = "all",
                 max_queries: int = ADAPTATION_MAX_QUERIES,
                 loss_patience: int = LOSS_PATIENCE,
                 seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
  """Trains the reader (BERT body and MLM head) until an answer block helps.

  REALM's cold start: a reader that gains nothing from the retrieved blocks
  learns to ignore them, and the retriever gets no signal. So first the
  reader alone learns the run's salient-span masks (plain masked-LM loss),
  each query read with the null document, a random block of another
  article and its answer block if any (`find_answer_blocks`; only the
  latter with `reads="answer"`). Every `eval_every` steps (step 0 is a
  baseline) a tenth of the articles, held out, is measured: accuracies
  per document and the utility log p(y|answer, x) - log p(y|null, x) in
  nats per mask. It stops once that utility exceeds `min_utility` at
  `patience` evaluations in a row ("utility"); once the held-out loss of
  what training reads (answer block, or the three pooled) has not beaten
  its best for `loss_patience` evaluations, returning that best reader
  ("overfit": memorising, not reading); or after `steps` ("steps").

  Args:
    params: {"retriever", "reader"} parameters; the reader has an MLM head.
    graphdef: the `Realm` graph definition.
    queries: stacked REALM queries (`examples.REALM_QUERY_FEATURES`).
    store, sep_id, reader_length: the knowledge corpus, [SEP] and the
      reader's input length.
    steps: the most training steps (the stop rule may end sooner).
    batch_size: queries per step (each read with 3 documents).
    learning_rate: the peak rate of BERT's optimiser (after a warmup of
      steps // 10, decaying linearly to 0 at `steps`).
    eval_every, min_utility, patience, loss_patience: the evaluations and
      the stop rules (`MIN_UTILITY` says why the threshold is not 0).
    trivial_candidates: the run's no-trivial-retrieval rule, which answer
      blocks obey ("article" or "block").
    reads: what a training step reads (`READS`).
    max_queries: queries used (a seeded subset when there are more).
    seed: subset, split, blocks, batches, dropout (a pure function).

  Returns:
    The parameters with the new reader (the retriever is the same object)
    and a report: {"curve" (the evaluations), "stop_reason", "steps",
    "best_step", "max_steps", "trivial_candidates", "reads", the query
    counts and answer-block shares, "seconds"}.

  Raises:
    ValueError: on a reader without an MLM head, a count < 1, unknown
      `reads`, or too few (answer-bearing, for "answer") queries.
  """
  _check_adaptation_args(params, steps, eval_every, patience, loss_patience,
                         reads)
  t0 = time.time()
  queries = {k: np.asarray(v) for k, v in queries.items()}
  train, held, answers = _adaptation_queries(
      queries, store, max_queries=max_queries, seed=seed, reads=reads,
      reader_length=reader_length, trivial_candidates=trivial_candidates)
  heldout = _evaluation_batches(queries, held, answers, store, sep_id=sep_id,
                                reader_length=reader_length,
                                batch_size=batch_size, seed=seed)
  tx = reader_optimizer(learning_rate, steps)
  make_batch = _training_batches(queries, train, answers, store,
                                 sep_id=sep_id, reader_length=reader_length,
                                 batch_size=batch_size, reads=reads,
                                 seed=seed)
  trained, curve, reason, done, best_step = _train_until_useful(
      params, graphdef, tx, heldout, make_batch, steps=steps,
      eval_every=eval_every, min_utility=min_utility, patience=patience,
      reads=reads, loss_patience=loss_patience, seed=seed, t0=t0)
  report = _adaptation_report(curve, reason, done, steps, train, held,
                              answers, queries["source_doc_hash"], t0,
                              best_step=best_step, reads=reads,
                              trivial_candidates=trivial_candidates)
  logging.info("reader adaptation stopped at step %d/%d (%s) after %.0f s",
               done, steps, reason, report["seconds"])
  return dict(params, reader=dict(params["reader"], **trained)), report

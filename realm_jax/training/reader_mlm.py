"""BERT's masked-LM pre-training of the reader, on the knowledge corpus.

REALM starts its reader from BERT. A reader from random weights (the
paper's ablation on real text, docs/results/learning.md) knows no language
yet, and on the Wikipedia slice, training it on the run's few thousand
masked sentences memorises them before it learns to read a retrieved block
(`mlm_warmup.adapt_reader`). This step gives it what BERT's pre-training
would, from the text the run already has: the blocks, whose wordpieces
are many times the sentences' salient spans, masked afresh at every
draw.

Every example has the reader's own shape, `[CLS] a [SEP] b [SEP]` in
`reader_length` wordpieces. `a` is a window of up to `query_length - 2`
wordpieces of a block, as long as a query. `b` is, half of the time, the
next block of the same article (the one before, for an article's last
block), else a block of another article: BERT's sentence pairs, without
the next-sentence loss. `mask_rate` of each segment's wordpieces are
masked in spans of 1 to 3 (80% [MASK], 10% another wordpiece of the batch,
10% unchanged), so a masked name in `a` can often be copied from `b`, as
REALM's reader copies a masked span from a retrieved block.

A tenth of the articles is held out. Every `eval_every` steps the reader
reads a fixed set of held-out windows, their masks in `a` only, once with
the neighbouring block and once with another article's: the masked-token
loss and accuracy of each, and the *neighbour utility* log p(a's masks |
neighbour) - log p(a's masks | other article), in nats per mask, which
says whether the reader reads across the separator. Training stops once
the held-out loss has not improved for `loss_patience` evaluations,
keeping the best reader. Nothing of the retriever moves.
"""

from __future__ import annotations

import math
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.training import mlm_warmup
from realm_jax.training import realm_inputs

# Evaluations without a better held-out loss before training stops.
LOSS_PATIENCE = 3
# Held-out windows read at every evaluation (each with two partners).
EVAL_EXAMPLES = 512
_NEIGHBOUR, _OTHER = 0, 1


def split_blocks(doc_hash: np.ndarray, seed: int
                 ) -> tuple[np.ndarray, np.ndarray]:
  """(training blocks, held-out blocks): a seeded tenth of the articles
  (at least one) is held out whole.

  Raises:
    ValueError: on a corpus of a single article.
  """
  doc_hash = np.asarray(doc_hash)
  articles = np.unique(doc_hash)
  if len(articles) < 2:
    raise ValueError("reader masked-LM pre-training holds out a tenth of "
                     "the articles; the block store has only "
                     f"{len(articles)}.")
  rng = np.random.default_rng([seed, 6])
  held = np.isin(doc_hash, rng.permutation(articles)[:max(
      1, len(articles) // 10)])
  return np.flatnonzero(~held), np.flatnonzero(held)


def neighbours(doc_hash: np.ndarray, blocks: np.ndarray) -> np.ndarray:
  """The next block of the same article, else the one before, else -1."""
  doc_hash = np.asarray(doc_hash)
  n = len(doc_hash)
  nxt, prev = np.minimum(blocks + 1, n - 1), np.maximum(blocks - 1, 0)
  own = doc_hash[blocks]
  return np.where((nxt != blocks) & (doc_hash[nxt] == own), nxt,
                  np.where((prev != blocks) & (doc_hash[prev] == own), prev,
                           -1))


def _other_articles(rng: np.random.Generator, doc_hash: np.ndarray,
                    pool: np.ndarray, blocks: np.ndarray) -> np.ndarray:
  """A block of `pool` from another article than each of `blocks`'."""
  doc_hash = np.asarray(doc_hash)
  other = pool[rng.integers(0, len(pool), len(blocks))]
  for _ in range(16):  # Redraws: one article is a small share of a corpus.
    same = doc_hash[other] == doc_hash[blocks]
    if not same.any():
      return other
    other[same] = pool[rng.integers(0, len(pool), int(same.sum()))]
  raise ValueError("reader masked-LM pre-training: could not draw a block "
                   "of another article (the corpus is nearly one article).")


def mask_spans(ids: np.ndarray, maskable: np.ndarray, rng: np.random.Generator,
               *, rate: float, max_predictions: int, mask_id: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Masks `rate` of each row's `maskable` positions (at least one) in spans
  of 1 to 3: 80% become `mask_id`, 10% another maskable wordpiece of the
  batch, 10% stay.

  Returns:
    (ids with the masks applied, positions, targets, weights), the last
    three int32/int32/float32 [N, max_predictions] (weight 0: padding).
  """
  ids = np.array(ids)
  n = len(ids)
  positions = np.zeros([n, max_predictions], np.int32)
  targets = np.zeros([n, max_predictions], np.int32)
  weights = np.zeros([n, max_predictions], np.float32)
  vocabulary = ids[maskable]
  for i in range(n):
    candidates = np.flatnonzero(maskable[i])
    if not len(candidates):
      continue
    budget = min(max_predictions, max(1, round(rate * len(candidates))))
    picked: set[int] = set()
    while len(picked) < budget:
      start = int(candidates[rng.integers(len(candidates))])
      for p in range(start, min(start + int(rng.integers(1, 4)),
                                ids.shape[1])):
        if maskable[i, p] and len(picked) < budget:
          picked.add(p)
    chosen = np.sort(np.fromiter(picked, np.int64))
    k = len(chosen)
    positions[i, :k], targets[i, :k], weights[i, :k] = (
        chosen, ids[i, chosen], 1.0)
    draw = rng.random(k)
    ids[i, chosen[draw < 0.8]] = mask_id
    swap = chosen[(draw >= 0.8) & (draw < 0.9)]
    ids[i, swap] = vocabulary[rng.integers(0, len(vocabulary), len(swap))]
  return ids, positions, targets, weights


class PairMaker:
  """Reader inputs `[CLS] a [SEP] b [SEP]` from the block store's blocks."""

  def __init__(self, store, *, query_length: int, reader_length: int,
               mask_rate: float):
    if query_length < 3 or reader_length <= query_length:
      raise ValueError("reader masked-LM pre-training needs query_length "
                       ">= 3 and reader_length > query_length, got "
                       f"{query_length} and {reader_length}.")
    self.store = store
    self.query_length, self.reader_length = query_length, reader_length
    self.rate = mask_rate
    # Most masks a segment gets: a's window and b's block (+ [SEP]s).
    self.max_a = max(1, math.ceil(mask_rate * (query_length - 2)))
    self.max_b = max(1, math.ceil(mask_rate * (reader_length - 3)))
    manifest = store.manifest
    self.cls_id, self.sep_id = int(manifest["cls_id"]), int(
        manifest["sep_id"])
    self.mask_id, self.pad_id = int(manifest["mask_id"]), int(
        manifest.get("pad_id", 0))

  def windows(self, blocks: np.ndarray, rng: np.random.Generator
              ) -> tuple[np.ndarray, np.ndarray]:
    """`[CLS] a [SEP]` (ids, mask) int32 [N, query_length]: a random window
    of each block."""
    bodies, lengths = self.store.bodies(blocks, self.store.max_block_len)
    lengths = np.asarray(lengths)
    width = np.minimum(lengths, self.query_length - 2)
    start = (rng.random(len(blocks)) * (lengths - width + 1)).astype(int)
    cols = np.arange(self.query_length)[None, :]
    src = np.clip(start[:, None] + cols - 1, 0, bodies.shape[1] - 1)
    ids = np.where(cols == 0, self.cls_id, np.where(
        cols <= width[:, None], np.take_along_axis(bodies, src, 1),
        np.where(cols == width[:, None] + 1, self.sep_id, self.pad_id)))
    return ids.astype(np.int32), (cols <= width[:, None] + 1).astype(np.int32)

  def read_with(self, query: tuple[np.ndarray, np.ndarray],
                partners: np.ndarray) -> dict[str, np.ndarray]:
    """Reader inputs {"token_ids", "input_mask", "segment_ids"} [N, L]."""
    bodies, lengths = self.store.bodies(partners, self.store.max_block_len)
    inputs = realm_inputs.reader_inputs(
        query[0], query[1], bodies[:, None], np.asarray(lengths)[:, None],
        seq_len=self.reader_length, sep_id=self.sep_id, pad_id=self.pad_id)
    return {k: v[:, 0] for k, v in inputs.items()}

  def _maskable(self, ids: np.ndarray, where: np.ndarray) -> np.ndarray:
    return where.astype(bool) & ~np.isin(
        ids, [self.cls_id, self.sep_id, self.pad_id])

  def _mask_a(self, rng):
    def mask(ids, mask):
      return mask_spans(ids, self._maskable(ids, mask), rng, rate=self.rate,
                        max_predictions=self.max_a, mask_id=self.mask_id)
    return mask

  def training_batch(self, blocks: np.ndarray, partners: np.ndarray,
                     rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A batch with `mask_rate` of each segment masked."""
    ids, mask = self.windows(blocks, rng)
    ids, *a = self._mask_a(rng)(ids, mask)
    batch = self.read_with((ids, mask), partners)
    ids, *b = mask_spans(
        batch["token_ids"], self._maskable(
            batch["token_ids"], batch["segment_ids"] * batch["input_mask"]),
        rng, rate=self.rate, max_predictions=self.max_b,
        mask_id=self.mask_id)
    return _masked_batch(dict(batch, token_ids=ids),
                         *(np.concatenate(x, 1) for x in zip(a, b)))

  def evaluation_pair(self, blocks: np.ndarray, partners: np.ndarray,
                      rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """The same masked windows (masks in `a` only) read with each column of
    `partners` [N, 2] (neighbour, other article)."""
    ids, mask = self.windows(blocks, rng)
    ids, *a = self._mask_a(rng)(ids, mask)
    return [_masked_batch(self.read_with((ids, mask), partners[:, j]), *a)
            for j in range(2)]


def _masked_batch(batch, positions, targets, weights):
  """A reader batch [N, 1, L] with its masks ([N, M]; weights [N, 1, M])."""
  return {**{k: v[:, None] for k, v in batch.items()},
          "mlm_positions": positions, "mlm_targets": targets,
          "weights": weights[:, None]}


def _evaluation_batches(maker: PairMaker, held: np.ndarray, doc_hash,
                        *, batch_size: int, seed: int) -> list[list[dict]]:
  """Fixed held-out windows, each read with its neighbour and with another
  article's block, in batches padded to `batch_size` (zero weights)."""
  rng = np.random.default_rng([seed, 7])
  blocks = held[neighbours(doc_hash, held) >= 0]
  if not len(blocks):
    raise ValueError("reader masked-LM pre-training: no held-out article "
                     "has two blocks to pair (blocks too long for the "
                     "articles?).")
  blocks = np.sort(rng.permutation(blocks)[:EVAL_EXAMPLES])
  partners = np.stack([neighbours(doc_hash, blocks), _other_articles(
      rng, doc_hash, np.arange(len(doc_hash)), blocks)], 1)
  batches = []
  for lo in range(0, len(blocks), batch_size):
    part = np.arange(lo, min(len(blocks), lo + batch_size))
    pad = np.concatenate([part, np.full(batch_size - len(part), part[0])])
    pair = maker.evaluation_pair(blocks[pad], partners[pad], rng)
    for batch in pair:
      batch["weights"][len(part):] = 0.0
    batches.append(pair)
  return batches


def _heldout_metrics(evaluate, trained, params, batches) -> dict[str, float]:
  """Held-out loss (both partners pooled), accuracy with each partner and
  the neighbour utility, per mask of `a`."""
  sums = np.zeros([2, 3])  # [partner, (correct, log-likelihood, masks)]
  for pair in batches:
    for j, batch in enumerate(pair):
      ll, correct = (np.asarray(x, np.float64)
                     for x in evaluate(trained, params, batch))
      w = np.asarray(batch["weights"], np.float64)
      sums[j] += [np.sum(correct * w), np.sum(ll * w), np.sum(w)]
  n = sums[_NEIGHBOUR, 2]
  return {"loss": float(-sums[:, 1].sum() / sums[:, 2].sum()),
          "accuracy_neighbour": float(sums[_NEIGHBOUR, 0] / n),
          "accuracy_other": float(sums[_OTHER, 0] / n),
          "neighbour_utility": float(
              (sums[_NEIGHBOUR, 1] - sums[_OTHER, 1]) / n)}


def _training_batches(maker: PairMaker, train: np.ndarray, doc_hash, *,
                      batch_size: int, seed: int):
  """step -> that step's training batch (a pure function of the seed)."""
  near = neighbours(doc_hash, train)

  def make_batch(step):
    rng = np.random.default_rng([seed, 8, step])
    rows = rng.integers(0, len(train), batch_size)
    blocks = train[rows]
    partners = _other_articles(rng, doc_hash, train, blocks)
    pair = (rng.random(batch_size) < 0.5) & (near[rows] >= 0)
    partners[pair] = near[rows][pair]
    return maker.training_batch(blocks, partners, rng)

  return make_batch


def _train(params, graphdef, tx, heldout, make_batch, *, steps, eval_every,
           loss_patience, seed, t0):
  """The training loop: (reader body and head, curve, stop reason, steps
  trained, best step)."""
  step_fn, evaluate = mlm_warmup.reader_fns(graphdef, tx)
  trained = {k: jax.tree_util.tree_map(jnp.asarray, params["reader"][k])
             for k in ("bert", "mlm_head")}
  opt_state, curve, reason, done = tx.init(trained), [], "steps", 0
  best, worse = (np.inf, trained, 0), 0  # (held-out loss, reader, step)
  for done in range(steps + 1):
    if done % eval_every == 0 or done == steps:
      point = {"step": done, **_heldout_metrics(evaluate, trained, params,
                                                heldout)}
      if point["loss"] < best[0]:
        best, worse = (point["loss"], trained, done), 0
      else:
        worse += 1
      elapsed = time.time() - t0
      curve.append(dict(point, best_step=best[2],
                        seconds=round(elapsed, 1)))
      logging.info(
          "reader masked-LM: step %d/%d, %.0f s, ETA <= %.0f s; held-out "
          "loss %.3f (best at %d), accuracy with the neighbour %.3f / "
          "another article %.3f, neighbour utility %.4f nats", done, steps,
          elapsed, elapsed / max(done, 1) * (steps - done), point["loss"],
          best[2], point["accuracy_neighbour"], point["accuracy_other"],
          point["neighbour_utility"])
      if worse >= loss_patience and done < steps:
        reason = "overfit"  # Memorising the training articles.
        break
    if done == steps:
      break
    trained, opt_state, _ = step_fn(
        trained, opt_state, params, make_batch(done),
        jax.random.fold_in(jax.random.key(seed), done))
  return best[1], curve, reason, done, best[2]


def pretrain_reader(params: dict[str, Any], graphdef, store, *, steps: int,
                    query_length: int, reader_length: int,
                    batch_size: int = 32, learning_rate: float = 1e-3,
                    mask_rate: float = 0.15, eval_every: int = 250,
                    loss_patience: int = LOSS_PATIENCE, seed: int = 0
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
  """BERT's masked-LM pre-training of the reader on `store`'s blocks.

  See the module docstring for the examples, the held-out measures and
  the stop rule.

  Args:
    params: {"retriever", "reader"} parameters; the reader has an MLM head.
    graphdef: the `Realm` graph definition.
    store: the knowledge corpus (`block_store.BlockStore`).
    steps: the most training steps (the stop rule may end sooner).
    query_length, reader_length: the run's query and reader input lengths
      (the window `a` is at most `query_length - 2` wordpieces).
    batch_size: pairs per step.
    learning_rate: the peak rate of BERT's optimiser (Adam's bias
      correction; warmup over steps // 10, then linear decay to 0).
    mask_rate: the share of each segment's wordpieces masked.
    eval_every, loss_patience: held-out evaluations and the stop rule.
    seed: split, pairs, masks, dropout (a pure function of it).

  Returns:
    The parameters with the new reader (the retriever is the same object)
    and a report: {"curve", "stop_reason", "steps", "best_step",
    "max_steps", "train_blocks", "heldout_blocks", "heldout_articles",
    "seconds", the settings}.

  Raises:
    ValueError: on a reader without an MLM head, a count < 1, a rate
      outside (0, 1), or a corpus too small to hold out and pair.
  """
  if "mlm_head" not in params.get("reader", {}):
    raise ValueError("reader masked-LM pre-training: the reader has no MLM "
                     "head (ReaderConfig.mlm_head=False).")
  if min(steps, batch_size, eval_every, loss_patience) < 1:
    raise ValueError("reader masked-LM pre-training: steps, batch_size, "
                     "eval_every and loss_patience must be >= 1, got "
                     f"{steps}, {batch_size}, {eval_every}, {loss_patience}.")
  if not 0 < mask_rate < 1:
    raise ValueError(f"reader masked-LM pre-training: mask_rate={mask_rate}"
                     "; use a share in (0, 1), e.g. BERT's 0.15.")
  t0 = time.time()
  doc_hash = np.asarray(store.doc_hash)
  train, held = split_blocks(doc_hash, seed)
  maker = PairMaker(store, query_length=query_length,
                    reader_length=reader_length, mask_rate=mask_rate)
  heldout = _evaluation_batches(maker, held, doc_hash,
                                batch_size=batch_size, seed=seed)
  tx = mlm_warmup.reader_optimizer(learning_rate, steps)
  trained, curve, reason, done, best_step = _train(
      params, graphdef, tx, heldout, _training_batches(
          maker, train, doc_hash, batch_size=batch_size, seed=seed),
      steps=steps, eval_every=eval_every, loss_patience=loss_patience,
      seed=seed, t0=t0)
  report = {"curve": curve, "stop_reason": reason, "steps": done,
            "best_step": best_step, "max_steps": steps,
            "train_blocks": len(train), "heldout_blocks": len(held),
            "heldout_articles": len(np.unique(doc_hash[held])),
            "batch_size": batch_size, "learning_rate": learning_rate,
            "mask_rate": mask_rate, "seconds": round(time.time() - t0, 1)}
  logging.info("reader masked-LM pre-training stopped at step %d/%d (%s), "
               "kept step %d, after %.0f s", done, steps, reason, best_step,
               report["seconds"])
  return dict(params, reader=dict(params["reader"], **trained)), report

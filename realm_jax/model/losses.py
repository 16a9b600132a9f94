"""REALM's marginal likelihoods and metrics.

Pre-training (per masked token j, as the released code does):
  log p(y_j|x) = logsumexp_z [log_softmax_z f(x, z) + log p(y_j|z, x)]
  loss = -mean over real masks.
Open-QA fine-tuning:
  retriever loss = -log sum_{z positive} p(z|x) over the retrieved blocks,
  reader loss    = -log sum_{(z, s) positive} p(z, s|x) over (block, span),
each zeroed for an example with no positive.

Pre-training returns SUMS over masks plus the mask count, so a data-parallel
step can divide by the global count and get exactly the single-device loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf inside log-sum-exps: keeps gradients NaN-free when
# a row has no admissible entry (its result is then discarded).
_NEG = -1e30


def masked_logsumexp(x: jax.Array, mask: jax.Array,
                     axis=-1) -> tuple[jax.Array, jax.Array]:
  """log sum exp of the entries where `mask` is true.

  Returns:
    (value, any): value is finite garbage where no entry is admitted; `any`
    says where at least one is, so callers can select with jnp.where.
  """
  safe = jnp.where(mask, x, _NEG)
  return jax.nn.logsumexp(safe, axis=axis), jnp.any(mask, axis=axis)


def token_log_likelihoods(mlm_logits: jax.Array,
                          mlm_targets: jax.Array) -> jax.Array:
  """log p(y_j|z, x): [B, C, M, V] logits, [B, M] targets -> [B, C, M]."""
  log_probs = jax.nn.log_softmax(mlm_logits.astype(jnp.float32), axis=-1)
  targets = jnp.broadcast_to(mlm_targets[:, None, :, None],
                             log_probs.shape[:-1] + (1,))
  return jnp.take_along_axis(log_probs, targets, axis=-1)[..., 0]


def marginal_log_likelihood(retrieval_logits: jax.Array,
                            token_ll: jax.Array) -> jax.Array:
  """log p(y_j|x) = logsumexp_z [log p(z|x) + log p(y_j|z, x)] -> [B, M]."""
  log_p_z = jax.nn.log_softmax(retrieval_logits.astype(jnp.float32), axis=-1)
  return jax.nn.logsumexp(log_p_z[:, :, None] + token_ll, axis=1)


def mixed_log_prior(retrieval_logits: jax.Array,
                    dense_prior: jax.Array | None,
                    other_log_prior: jax.Array | None = None) -> jax.Array:
  """log p(z|x) [B, C]: REALM's softmax of f(x, z) where `dense_prior` is
  1, `other_log_prior` (log-probabilities [B, C]; None: uniform over the C
  candidates) where it is 0, their mixture between (`dense_prior` [B] in
  [0, 1]; None: REALM's everywhere)."""
  log_dense = jax.nn.log_softmax(retrieval_logits.astype(jnp.float32), -1)
  if dense_prior is None:
    return log_dense
  w = dense_prior.astype(jnp.float32)[:, None]
  if other_log_prior is None:
    other = jnp.broadcast_to(
        -jnp.log(jnp.float32(retrieval_logits.shape[-1])), log_dense.shape)
  else:
    other = other_log_prior.astype(jnp.float32)
  mixed = jnp.logaddexp(jnp.log(jnp.maximum(w, 1e-30)) + log_dense,
                        jnp.log(jnp.maximum(1 - w, 1e-30)) + other)
  # The ends exactly (and no gradient into the retriever at w = 0).
  return jnp.where(w >= 1, log_dense, jnp.where(w <= 0, other, mixed))


def pretraining_loss(
    retrieval_logits: jax.Array,
    mlm_logits: jax.Array,
    mlm_targets: jax.Array,
    mlm_weights: jax.Array,
    dense_prior: jax.Array | None = None,
    lexical_log_prior: jax.Array | None = None,
    permuted_signal: bool = False,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """REALM's per-masked-token marginal loss, as sums.

  Args:
    retrieval_logits: [B, C] f(x, z); candidate 0 is the null document.
    mlm_logits: [B, C, M, V] reader logits at the masked positions.
    mlm_targets: int [B, M] original wordpiece ids.
    mlm_weights: [B, M] 1 for real masks, 0 for padding.
    dense_prior: optional [B] weight of REALM's p(z|x) against a uniform
      prior over the candidates, or against `lexical_log_prior` where it is
      given (`mixed_log_prior`; the reader's distribution while the gate
      holds the retriever, `RetrievalConfig.held_prior`). None: REALM's
      p(z|x).
    lexical_log_prior: optional [B, C] log-probabilities of the candidates
      by BM25's scores (`candidates.lexical_log_prior`).
    permuted_signal: the no-information control
      (`RetrieverScheduleConfig.signal = "permuted"`): the retriever's
      gradient comes from the next row's reader likelihoods (rolled by one
      query), so it has REALM's form and size but says nothing about its
      own query; the reader's gradient and the loss's value are REALM's.

  Returns:
    loss_sum: -sum_j w_j log p(y_j|x).
    weight_sum: sum_j w_j (divide loss_sum by its global value).
    metric_sums: sums over real masks of `marginal_log_likelihood`,
      `null_log_likelihood` (log p(y_j|null doc, x)), `retrieval_utility`
      (their difference), `mlm_correct` (argmax of the marginal predictive
      distribution equals the target) and `null_probability` (p(z_0|x) of
      the query, candidate 0 being the null document).
  """
  weights = mlm_weights.astype(jnp.float32)
  token_ll = token_log_likelihoods(mlm_logits, mlm_targets)
  log_p_z = mixed_log_prior(retrieval_logits, dense_prior,
                            lexical_log_prior)
  marginal = jax.nn.logsumexp(log_p_z[:, :, None] + token_ll, axis=1)
  null_ll = token_ll[:, 0, :]
  # Marginal predictive distribution over the vocabulary for accuracy.
  log_p_v = jax.nn.logsumexp(
      log_p_z[:, :, None, None]
      + jax.nn.log_softmax(mlm_logits.astype(jnp.float32), -1), axis=1)
  correct = (jnp.argmax(log_p_v, -1) == mlm_targets).astype(jnp.float32)
  metric_sums = {
      "marginal_log_likelihood": jnp.sum(marginal * weights),
      "null_log_likelihood": jnp.sum(null_ll * weights),
      "retrieval_utility": jnp.sum((marginal - null_ll) * weights),
      "mlm_correct": jnp.sum(correct * weights),
      "null_probability": jnp.sum(jnp.exp(log_p_z[:, :1]) * weights),
  }
  objective = marginal * weights
  if permuted_signal:
    sg = jax.lax.stop_gradient
    other_ll, other_w = (jnp.roll(token_ll, 1, axis=0),
                         jnp.roll(weights, 1, axis=0))
    reader = jax.nn.logsumexp(sg(log_p_z)[:, :, None] + token_ll, axis=1)
    retriever = jax.nn.logsumexp(log_p_z[:, :, None] + sg(other_ll),
                                 axis=1) * other_w
    objective = reader * weights + retriever - sg(retriever)
  return -jnp.sum(objective), jnp.sum(weights), metric_sums


def retriever_marginal_loss(retrieval_logits: jax.Array,
                            positives: jax.Array,
                            valid: jax.Array | None = None) -> jax.Array:
  """Open-QA retriever loss per question.

  Args:
    retrieval_logits: [B, K] scores of the retrieved blocks.
    positives: bool [B, K], the block's text contains an answer.
    valid: optional bool [B, K], False for padding blocks.

  Returns:
    float32 [B]: -log sum_{positive} p(z|x), 0 where no positive.
  """
  if valid is None:
    valid = jnp.ones_like(positives, dtype=bool)
  logits = retrieval_logits.astype(jnp.float32)
  log_norm, _ = masked_logsumexp(logits, valid)
  log_pos, has_pos = masked_logsumexp(logits, positives & valid)
  return jnp.where(has_pos, log_norm - log_pos, 0.0)


def reader_marginal_loss(reader_logits: jax.Array,
                         positives: jax.Array) -> jax.Array:
  """Open-QA reader loss per question over (block, span) pairs.

  `reader_logits` [B, R, L, W] are span scores with the block's retrieval
  logit added, -inf for inadmissible spans; `positives` bool [B, R, L, W]
  marks the spans equal to an answer. Returns float32 [B]:
  -log sum_{positive (z, s)} p(z, s|x), 0 where no positive.
  """
  batch = reader_logits.shape[0]
  logits = reader_logits.astype(jnp.float32).reshape(batch, -1)
  return retriever_marginal_loss(logits, positives.reshape(batch, -1),
                                 jnp.isfinite(logits))

"""Straightforward reference versions of optimised model code.

Tests and benchmarks compare the optimised code against these; they are
written the obvious way, not the fast way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def naive_span_scores(params, hidden, max_span_width: int, eps: float):
  """The span head as ORQA writes it.

  Builds every span's hidden vector x = ReLU(start[s] + end[s + w]), a
  [..., L, W, H] tensor, LayerNorms it and applies the one-output dense
  layer. `realm_jax.model.realm.SpanHead` computes the
  same scores from three feature sums of x.

  Args:
    params: the span head's parameters {"intermediate", "layer_norm",
      "output"}, as in a reader's params["span_head"].
    hidden: float32 [..., L, hidden] reader hidden states.
    max_span_width: W.
    eps: the LayerNorm epsilon.

  Returns:
    float32 [..., L, W] scores (spans past the end use zero end vectors).
  """
  proj = (hidden @ params["intermediate"]["kernel"]
          + params["intermediate"]["bias"])
  start, end = jnp.split(proj, 2, axis=-1)
  seq_len = hidden.shape[-2]
  padded = jnp.pad(end, [(0, 0)] * (end.ndim - 2)
                   + [(0, max_span_width - 1), (0, 0)])
  end_at = jnp.stack([padded[..., w:w + seq_len, :]
                      for w in range(max_span_width)], axis=-2)
  x = jax.nn.relu(start[..., :, None, :] + end_at)
  # LayerNorm as Flax computes it (the head before it was fused).
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.maximum(
      jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean), 0.)
  x = (x - mean) * jax.lax.rsqrt(var + eps)
  x = x * params["layer_norm"]["scale"] + params["layer_norm"]["bias"]
  return (x @ params["output"]["kernel"])[..., 0] + params["output"]["bias"][0]

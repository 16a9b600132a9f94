r"""The reader's span head: the fused head vs the naive one, side by side.

The span head scores every (start, width) span with
Dense_1(LayerNorm(ReLU(start[s] + end[s + w]))). The naive way (ORQA's)
builds that hidden vector for every span, a [..., L, W, 256] tensor, and
autodiff keeps it (and its normalised copy) for the backward pass.
`realm_jax.model.realm.SpanHead` instead computes three feature sums per
span (`span_feature_sums`, a custom VJP that recomputes x in the backward
pass), from which LayerNorm + Dense_1 follow exactly. `--batching` picks
`ReaderConfig.span_head_batching` for the fused head: "per_row" (the CPU
option of gin_configs/models/cpu.gin, one reader block at a time; the
default here, as in docs/benchmarks/span_head.md) or "whole_batch" (the
model's default).

For each shape, one JSON line per implementation with the median seconds
of the jitted forward pass and of forward + backward (gradient w.r.t. the
head's parameters and its input hidden states), and XLA's compiled
temporary buffer size for forward + backward (`memory_analysis`), then a
`comparison` line (speed-up and memory ratio) after checking that both give
the same scores and gradients.

Shapes (hidden states [B, R, L, H] in, reader length L, W = 10, 256):
  tiny_b16      the fine-tuning benchmark's tiny reader: B 16, R 5, L 320,
                H 32;
  minilm_b8     MiniLM-L6 at batch 8: B 8, R 5, L 320, H 384;
  bert_base_b1  REALM's fine-tuning (batch 1, BERT-base): B 1, R 5, L 288,
                H 768.

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= \
        python benchmarks/span_head.py [--shapes=tiny_b16,minilm_b8] \
        [--batching=per_row]
"""

from __future__ import annotations

import argparse

import timing  # benchmarks/timing.py, beside this file

SHAPES = {
    "tiny_b16": (16, 5, 320, 32),
    "minilm_b8": (8, 5, 320, 384),
    "bert_base_b1": (1, 5, 288, 768),
}


def run_shape(name: str, repeats: int, batching: str = "per_row") -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
  from realm_jax.model.bert import BertConfig  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import Reader, ReaderConfig  # pylint: disable=g-import-not-at-top
  from realm_jax.testing import reference  # pylint: disable=g-import-not-at-top

  b, r, seq_len, h = SHAPES[name]
  bert = BertConfig(hidden_size=h, num_layers=1, num_heads=4,
                    intermediate_size=4 * h)
  cfg = ReaderConfig(bert=bert, mlm_head=False, span_head_batching=batching)
  graphdef, params = functional.init(lambda rngs: Reader(cfg, rngs=rngs), 0)
  rng = np.random.default_rng(0)
  head = jax.tree_util.tree_map(
      lambda x: jnp.asarray(x + 0.1 * rng.normal(size=x.shape), jnp.float32),
      params["span_head"])
  hidden = jnp.asarray(rng.normal(size=(b, r, seq_len, h)), jnp.float32)
  weights = jnp.asarray(
      rng.normal(size=(b, r, seq_len, cfg.max_span_width)), jnp.float32)

  def fused(p, x):
    return functional.bind(graphdef, {**params, "span_head": p}).span_head(x)

  def naive(p, x):
    return reference.naive_span_scores(p, x, cfg.max_span_width,
                                       cfg.span_layer_norm_eps)

  results = {}
  for impl, fn in (("naive", naive), ("fused", fused)):
    forward = jax.jit(fn)
    grad = jax.jit(jax.grad(
        lambda p, x, fn=fn: jnp.sum(weights * jnp.tanh(fn(p, x))),
        argnums=(0, 1)))
    memory = grad.lower(head, hidden).compile().memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None)
    record = dict(
        shape=name, impl=impl, batching=batching, batch=b, blocks=r,
        reader_length=seq_len,
        hidden=h, span_hidden=cfg.span_hidden_size,
        max_span_width=cfg.max_span_width,
        forward_s=round(timing.median_seconds(forward, head, hidden,
                                              repeats=repeats), 5),
        forward_backward_s=round(timing.median_seconds(grad, head, hidden,
                                                       repeats=repeats), 5),
        forward_backward_temp_mb=None if temp is None else round(
            temp / 2**20, 1))
    results[impl] = (record, forward(head, hidden), grad(head, hidden))
    timing.emit(kind="span_head", **record)

  (naive_rec, naive_out, naive_grad), (fused_rec, fused_out, fused_grad) = (
      results["naive"], results["fused"])
  scale = float(jnp.max(jnp.abs(naive_out)))
  out_err = float(jnp.max(jnp.abs(naive_out - fused_out))) / scale
  grad_err = max(
      float(jnp.max(jnp.abs(a - c)) / (jnp.max(jnp.abs(a)) + 1e-30))
      for a, c in zip(jax.tree_util.tree_leaves(naive_grad),
                      jax.tree_util.tree_leaves(fused_grad)))
  if out_err > 1e-4 or grad_err > 1e-4:
    raise AssertionError(f"{name}: fused and naive heads disagree "
                         f"(scores {out_err:.2e}, gradients {grad_err:.2e}).")
  naive_temp = naive_rec["forward_backward_temp_mb"]
  fused_temp = fused_rec["forward_backward_temp_mb"]
  timing.emit(
      kind="comparison", shape=name,
      forward_speedup=round(
          naive_rec["forward_s"] / fused_rec["forward_s"], 2),
      forward_backward_speedup=round(
          naive_rec["forward_backward_s"] / fused_rec["forward_backward_s"],
          2),
      temp_memory_ratio=(round(naive_temp / fused_temp, 1) if fused_temp
                         else None),
      max_relative_score_difference=float(f"{out_err:.2e}"),
      max_relative_gradient_difference=float(f"{grad_err:.2e}"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batching", default="per_row",
                      choices=("per_row", "whole_batch"))
  args = parser.parse_args()
  timing.run_named(
      "shape", args.shapes, SHAPES,
      lambda name, repeats: run_shape(name, repeats, args.batching),
      args.repeats)


if __name__ == "__main__":
  main()

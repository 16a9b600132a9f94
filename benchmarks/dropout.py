r"""Dropout masks: 16-bit halves of random words vs `jax.random.bernoulli`.

With `BertConfig.dropout_mask_bits=16` (the CPU option that
gin_configs/models/cpu.gin sets) `realm_jax.model.bert.dropout` draws its
keep mask with `keep_mask_16bit`, two elements per 32-bit random word; the
default, 32, uses `jax.random.bernoulli` (one word per element). This
benchmark runs both side by side in one process:

  mask     the attention-probability dropout of one layer, [B*R, heads,
           L, L] for the fine-tuning reader (tiny at batch 16, MiniLM at
           batch 8; R 5, L 320): median seconds of the jitted
           `jnp.where(mask, x * scale, 0)`;
  reader   forward + backward of the reader's BERT over the same blocks
           with dropout on, with each mask, and with dropout off (the
           floor): median seconds per step.

Prints one JSON line per measurement and a `comparison` line per shape.

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= \
        python benchmarks/dropout.py [--configs=tiny,minilm]
"""

from __future__ import annotations

import argparse

import timing  # benchmarks/timing.py, beside this file

CONFIGS = {
    # name: (batch, hidden, layers, heads, intermediate)
    "tiny": (16, 32, 2, 4, 64),
    "minilm": (8, 384, 6, 12, 1536),
}
READER_BLOCKS, READER_LENGTH = 5, 320


def run_config(name: str, repeats: int) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.model import bert as bert_lib  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top

  batch, hidden, layers, heads, intermediate = CONFIGS[name]
  rows = batch * READER_BLOCKS
  key = jax.random.key(0)
  probs = jnp.full((rows, heads, READER_LENGTH, READER_LENGTH),
                   1.0 / READER_LENGTH, jnp.float32)
  bits = {"bernoulli": 32, "halves16": 16}
  mask_s = {}
  for impl, b in bits.items():
    apply = jax.jit(lambda x, k, b=b: bert_lib.dropout(x, 0.1, k, b))
    mask_s[impl] = timing.median_seconds(apply, probs, key, repeats=repeats)
    timing.emit(kind="mask", config=name, impl=impl, shape=list(probs.shape),
                seconds=round(mask_s[impl], 4))

  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1000, 20000, (rows, READER_LENGTH)),
                    jnp.int32)
  mask = jnp.ones_like(ids)

  step_s = {}
  for impl in ("bernoulli", "halves16", "off"):
    cfg = bert_lib.BertConfig(hidden_size=hidden, num_layers=layers,
                              num_heads=heads, intermediate_size=intermediate,
                              dropout_mask_bits=bits.get(impl, 32))
    graphdef, params = functional.init(
        lambda r, cfg=cfg: bert_lib.Bert(cfg, rngs=r), 0)
    dropout_rng = None if impl == "off" else key

    def loss(p, g=graphdef, r=dropout_rng):
      h, _ = functional.bind(g, p)(ids, mask, dropout_rng=r)
      return jnp.sum(jnp.sin(h))

    grad = jax.jit(jax.grad(loss))
    step_s[impl] = timing.median_seconds(grad, params, repeats=repeats)
    timing.emit(kind="reader", config=name, impl=impl, batch=batch,
                blocks=READER_BLOCKS, reader_length=READER_LENGTH,
                forward_backward_seconds=round(step_s[impl], 4))
  timing.emit(
      kind="comparison", config=name,
      mask_speedup=round(mask_s["bernoulli"] / mask_s["halves16"], 2),
      reader_step_speedup=round(step_s["bernoulli"] / step_s["halves16"], 2),
      dropout_share_before=round(1 - step_s["off"] / step_s["bernoulli"], 3),
      dropout_share_after=round(1 - step_s["off"] / step_s["halves16"], 3))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--configs", default=",".join(CONFIGS))
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  timing.run_named("config", args.configs, CONFIGS, run_config, args.repeats)


if __name__ == "__main__":
  main()

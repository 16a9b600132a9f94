r"""What the pod recipes' bfloat16 numerics cost on this CPU, per step.

The learning benchmark (`benchmarks.learning`) would measure what
bfloat16 costs in quality by training with the pod recipes' numeric
settings (`bert.BertConfig.dtype = "bfloat16"`, `softmax_dtype` and
`residual_dtype = "compute"`) beside float32 on the same worlds. This
times the forward + backward pass of the learning recipe's BERT (the
tiny one: hidden 32, 2 layers, 4 heads, with gin_configs/models/cpu.gin's
CPU settings) over one reader batch (32 queries x 7 blocks x 96 tokens),
side by side in one process, for each setting: XLA:CPU has no fast
bfloat16 kernels for matrices this small, so a bfloat16 run of that
benchmark is as many times slower as this says.

Prints one JSON line per setting (median seconds) and a `comparison`.

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= \
        python benchmarks/cpu_bfloat16.py
"""

from __future__ import annotations

import argparse

import timing  # benchmarks/timing.py, beside this file

SETTINGS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16_softmax": {"dtype": "bfloat16", "softmax_dtype": "compute"},
    "pod_recipe": {"dtype": "bfloat16", "softmax_dtype": "compute",
                   "residual_dtype": "compute"},
}
ROWS, LENGTH = 32 * 7, 96


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.model import bert as bert_lib  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top

  ids = jnp.asarray(np.random.default_rng(0).integers(1000, 20000,
                                                      (ROWS, LENGTH)),
                    jnp.int32)
  mask = jnp.ones_like(ids)
  seconds = {}
  for name, numerics in SETTINGS.items():
    cfg = bert_lib.BertConfig(
        hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
        attention_batching="per_sequence", dropout_mask_bits=16, **numerics)
    graphdef, params = functional.init(
        lambda r, cfg=cfg: bert_lib.Bert(cfg, rngs=r), 0)

    def loss(p, g=graphdef):
      return jnp.sum(functional.bind(g, p)(ids, mask)[0] ** 2)

    seconds[name] = timing.median_seconds(jax.jit(jax.grad(loss)), params,
                                          repeats=args.repeats)
    timing.emit(kind="forward_backward", setting=name, **numerics,
                rows=ROWS, length=LENGTH, seconds=round(seconds[name], 4))
  timing.emit(kind="comparison", **{
      f"{name}_vs_float32": round(s / seconds["float32"], 2)
      for name, s in seconds.items() if name != "float32"})


if __name__ == "__main__":
  main()

r"""What `BertConfig.attention = "flash"` changes in a BERT step, by the TPU
compiler's cost analysis (libtpu, on this CPU host).

Compiles the forward and backward pass of a BERT-base stack (bfloat16,
`--layers` layers, `--sequences` sequences of `--length` per chip, replicated
parameters, gradients summed over the `data` axis as the jobs' steps do)
inside `shard_map` for a TPU slice, once per attention: XLA with attention
dropout 0.1 (today's training), XLA without, the Pallas flash kernel
(which has none), and XLA with dropout 0.1 and its softmax in bfloat16
(`BertConfig.softmax_dtype = "compute"`). Prints one JSON line each with
the compiler's FLOPs, bytes accessed and temporaries per chip; `--hlo_dir`
writes each optimized HLO for `benchmarks/tpu_aot.py --hlo`. Every figure is the compiler's
estimate, not a measurement. A 2-layer compile takes 6-9 min on two loaded
cores.

  python benchmarks/tpu_attention_bytes.py --topology=v5e:2x2 --hlo_dir=/tmp/hlo

Results: docs/benchmarks/tpu_aot.md ("Fused attention on TPU").
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from realm_jax import aot
from realm_jax.core import parallel
from realm_jax.model import functional
from realm_jax.model.bert import Bert, BertConfig
# pylint: enable=g-import-not-at-top,wrong-import-position

VARIANTS = (("xla", 0.1, "float32"), ("xla", 0.0, "float32"),
            ("flash", 0.0, "float32"), ("xla", 0.1, "compute"))


def compile_bert_step(topology: str, attention: str, attention_dropout: float,
                      softmax_dtype: str = "float32", *, length: int,
                      sequences: int, layers: int, hlo_dir: str = "") -> dict:
  """The compiler's cost of one BERT forward + backward pass per chip."""
  mesh = parallel.make_mesh(aot.topology(topology).devices)
  config = BertConfig(num_layers=layers, dtype="bfloat16",
                      attention=attention,
                      attention_dropout=attention_dropout,
                      softmax_dtype=softmax_dtype)
  graphdef, params = functional.abstract_init(
      lambda r: Bert(config, rngs=r))

  def per_core(p, ids, mask, rng):
    def loss(p):
      h, pooled = functional.bind(graphdef, p)(ids, mask, dropout_rng=rng)
      return jnp.sum(h.astype(jnp.float32) ** 2) + jnp.sum(pooled)
    value, grads = jax.value_and_grad(loss)(
        jax.lax.pcast(p, parallel.DATA_AXIS, to="varying"))
    return (jax.lax.psum(value, parallel.DATA_AXIS),
            jax.lax.psum(grads, parallel.DATA_AXIS))

  step = jax.shard_map(per_core, mesh=mesh,
                       in_specs=(P(), parallel.BATCH, parallel.BATCH, P()),
                       out_specs=(P(), P()))
  replicated, split = parallel.replicated(mesh), parallel.data_sharded(mesh)
  tokens = jax.ShapeDtypeStruct((sequences * mesh.size, length), jnp.int32,
                                sharding=split)
  args = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(
              x.shape, x.dtype, sharding=replicated), params),
          tokens, tokens,
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                               sharding=replicated))
  start = time.time()
  compiled = jax.jit(step).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    softmax = "" if softmax_dtype == "float32" else f"_softmax_{softmax_dtype}"
    path = os.path.join(hlo_dir, f"bert_{attention}_{attention_dropout}"
                        f"{softmax}_{topology.replace(':', '_')}.hlo.txt")
    with open(path, "w", encoding="utf-8") as f:
      f.write(compiled.as_text())
  return dict(
      benchmark="tpu_attention_bytes", topology=topology, attention=attention,
      attention_dropout=attention_dropout, softmax_dtype=softmax_dtype,
      length=length,
      sequences_per_chip=sequences, layers=layers,
      flops_per_chip=cost.get("flops"),
      bytes_accessed_per_chip=cost.get("bytes accessed"),
      temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
      compile_seconds=round(time.time() - start, 1),
      note="the TPU compiler's estimates; the flash kernels' backward "
      "declares no FLOPs")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:2x2")
  parser.add_argument("--length", type=int, default=384,
                      help="Sequence length (REALM's reader: 384).")
  parser.add_argument("--sequences", type=int, default=64,
                      help="Sequences per chip (REALM at 8 examples per "
                      "chip x 8 candidates: 64).")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--variants", default=",".join(
      ":".join(map(str, v)) for v in VARIANTS),
                      help="attention:attention_dropout[:softmax_dtype], "
                      "comma-separated.")
  parser.add_argument("--hlo_dir", default="")
  args = parser.parse_args()
  for variant in args.variants.split(","):
    attention, dropout, *softmax = variant.split(":")
    print(json.dumps(compile_bert_step(
        args.topology, attention, float(dropout), *softmax,
        length=args.length,
        sequences=args.sequences, layers=args.layers,
        hlo_dir=args.hlo_dir)), flush=True)


if __name__ == "__main__":
  main()

r"""BERT attention on CPU: one sequence at a time vs the whole batch.

With `BertConfig.attention_batching="per_sequence"` (the CPU option that
gin_configs/models/cpu.gin sets) `realm_jax.model.bert.BertAttention`
attends one sequence at a time (`lax.map`), so that a sequence's
[heads, L, L] scores stay in cache through softmax, dropout and the context
matmul; with the default "whole_batch" it attends the whole batch at once.
This benchmark runs both side by side in one process and prints one JSON
line per measurement, then a `comparison` line per case:

  embed    forward pass of the document tower's BERT, batch 32 x 288 (the
           index builder's shape), no dropout: MiniLM-L6 and BERT-base;
  train    forward + backward of the reader's BERT with dropout over the
           fine-tuning benchmark's reader blocks (5 per question, 320
           tokens): MiniLM-L6 at batch 8 (40 x 320), the tiny test model
           (hidden 32, 2 layers) at batch 16 (80 x 320).

Median seconds of 3 runs after compilation.

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= \
        python benchmarks/attention.py [--cases=embed_minilm,train_minilm]
"""

from __future__ import annotations

import argparse

import timing  # benchmarks/timing.py, beside this file

MODELS = {
    # name: (hidden, layers, heads, intermediate)
    "minilm": (384, 6, 12, 1536),
    "bert_base": (768, 12, 12, 3072),
    "tiny": (32, 2, 4, 64),
}
CASES = {
    # name: (kind, model, batch, length)
    "embed_minilm": ("embed", "minilm", 32, 288),
    "embed_bert_base": ("embed", "bert_base", 32, 288),
    "train_minilm": ("train", "minilm", 40, 320),
    "train_tiny": ("train", "tiny", 80, 320),
}


def run_case(name: str, repeats: int) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.model import bert as bert_lib  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top

  kind, model, batch, length = CASES[name]
  hidden, layers, heads, intermediate = MODELS[model]
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1000, 20000, (batch, length)), jnp.int32)
  mask = jnp.ones_like(ids)
  key = jax.random.key(0)

  def make_fn(path):
    cfg = bert_lib.BertConfig(hidden_size=hidden, num_layers=layers,
                              num_heads=heads, intermediate_size=intermediate,
                              attention_batching=path)
    graphdef, params = functional.init(
        lambda r: bert_lib.Bert(cfg, rngs=r), 0)
    if kind == "embed":
      fn = lambda p: functional.bind(graphdef, p)(ids, mask)[1]
    else:
      fn = jax.grad(lambda p: jnp.sum(jnp.sin(functional.bind(
          graphdef, p)(ids, mask, dropout_rng=key)[0])))
    return jax.jit(fn), params

  seconds = {}
  for path in ("whole_batch", "per_sequence"):
    fn, params = make_fn(path)
    seconds[path] = timing.median_seconds(fn, params, repeats=repeats)
    timing.emit(kind=kind, case=name, model=model, path=path, batch=batch,
                length=length, seconds=round(seconds[path], 4),
                sequences_per_second=round(batch / seconds[path], 2))
  timing.emit(
      kind="comparison", case=name,
      speedup=round(seconds["whole_batch"] / seconds["per_sequence"], 3))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  timing.run_named("case", args.cases, CASES, run_case, args.repeats)


if __name__ == "__main__":
  main()

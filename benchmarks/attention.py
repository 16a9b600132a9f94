r"""BERT attention on CPU: one sequence at a time vs the whole batch.

`realm_jax.model.bert.BertAttention` attends one sequence at a time
(`lax.map`) on CPU, so that a sequence's [heads, L, L] scores stay in cache
through softmax, dropout and the context matmul; on accelerators it
attends the whole batch at once. This benchmark runs both code paths side
by side in one process (switching `bert._one_example_at_a_time`) and prints
one JSON line per measurement, then a `comparison` line per case:

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
  cfg = bert_lib.BertConfig(hidden_size=hidden, num_layers=layers,
                            num_heads=heads, intermediate_size=intermediate)
  graphdef, params = functional.init(lambda r: bert_lib.Bert(cfg, rngs=r), 0)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1000, 20000, (batch, length)), jnp.int32)
  mask = jnp.ones_like(ids)
  key = jax.random.key(0)

  def make_fn():  # A fresh jit per path: the path is chosen when tracing.
    if kind == "embed":
      return jax.jit(lambda p: functional.bind(graphdef, p)(ids, mask)[1])
    return jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(functional.bind(
        graphdef, p)(ids, mask, dropout_rng=key)[0]))))

  original = bert_lib._one_example_at_a_time  # pylint: disable=protected-access
  seconds = {}
  try:
    for path, by_example in (("whole_batch", False), ("by_example", True)):
      bert_lib._one_example_at_a_time = lambda *_, b=by_example: b  # pylint: disable=protected-access
      seconds[path] = timing.median_seconds(make_fn(), params, repeats=repeats)
      timing.emit(kind=kind, case=name, model=model, path=path, batch=batch,
                  length=length, seconds=round(seconds[path], 4),
                  sequences_per_second=round(batch / seconds[path], 2))
  finally:
    bert_lib._one_example_at_a_time = original  # pylint: disable=protected-access
  timing.emit(kind="comparison", case=name,
              speedup=round(seconds["whole_batch"] / seconds["by_example"], 3))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  timing.run_named("case", args.cases, CASES, run_case, args.repeats)


if __name__ == "__main__":
  main()

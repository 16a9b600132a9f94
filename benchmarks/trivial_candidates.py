r"""Host time of REALM's no-trivial-retrieval rule per training batch.

Every pre-training step computes, on the host, which blocks each query may
not retrieve (`realm_inputs.TrivialCandidates.query_keys`). The "article"
rule reads the query's article hash. The "block" rule (REALM's reference
code) finds the block holding the sentence: the block of its article
sharing most of its wordpiece bigrams. A py-spy profile of the MiniLM
query-side run on an H200 (docs/results/learning.md) found 56% of the
training loop's wall time there, with the rule recomputing every block's
bigrams for every query. Measured here, side by side on the same batches:

  article          the article rule;
  block_per_query  the block rule as it was: every block of the query's
                   article re-read and its bigrams recomputed per query
                   (written out below as the baseline);
  block_cold       `TrivialCandidates(store, "block")` on a fresh object:
                   the first pass, which computes and keeps each article's
                   bigrams;
  block            the same object on the next batches (the steady state
                   of a run: the articles are cached).

Each "block" variant must return the baseline's blocks exactly. Median
seconds per batch of `--batch_size` queries, one JSON line each.

Inputs: a learning benchmark's workdir on the embedded Wikipedia slice
(96 articles, 5,448 blocks of 128), e.g.

    python -m benchmarks.learning --world=wiki --start=random \
        --workdir=$D --prepare_only
    python benchmarks/trivial_candidates.py --workdir=$D
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

import timing
from realm_jax.data import block_store, query_cache
from realm_jax.data import realm_inputs


def block_per_query(store, queries) -> np.ndarray:
  """The "block" rule with nothing kept between queries (the baseline)."""
  special = store.special_ids()
  special = np.asarray([special.cls_id, special.sep_id, special.pad_id,
                        special.mask_id])
  first = np.asarray(store.doc_block_offsets[:-1], np.int64)
  doc_of_hash = dict(zip(
      np.asarray(store.doc_hash)[first[first < len(store)]].tolist(),
      range(len(first))))

  def bigrams(tokens):
    tokens = np.asarray(tokens, np.int64)
    if len(tokens) < 2:
      return tokens
    return np.unique(tokens[:-1] * (1 << 32) + tokens[1:])

  ids = np.array(queries["query_ids"], np.int64)
  rows = np.arange(len(ids))[:, None]
  positions = np.asarray(queries["mlm_positions"])
  ids[rows, positions] = np.where(np.asarray(queries["mlm_weights"]) > 0,
                                  queries["mlm_targets"],
                                  ids[rows, positions])
  out = np.full(len(ids), -1, np.int64)
  for q, source in enumerate(np.asarray(queries["source_doc_hash"])):
    doc = doc_of_hash.get(int(source))
    if doc is None:
      continue
    tokens = ids[q][np.asarray(queries["query_mask"][q]) > 0]
    wanted = bigrams(tokens[~np.isin(tokens, special)])
    blocks = store.document_blocks(doc)
    shared = [np.isin(wanted, bigrams(store.body_ids(b))).sum()
              for b in blocks]
    out[q] = blocks[int(np.argmax(shared))]
  return out


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.machine()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True,
                      help="A prepared wiki learning workdir (wiki/blocks, "
                      "queries_salient).")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--batches", type=int, default=20)
  args = parser.parse_args()

  store = block_store.BlockStore.open(
      os.path.join(args.workdir, "wiki", "blocks"))
  stream = query_cache.QueryStream(
      os.path.join(args.workdir, "queries_salient"), seed=0,
      batch_size=args.batch_size)
  try:
    batches = [stream.batch(s) for s in range(args.batches)]
  finally:
    stream.close()
  machine = f"{_cpu_model()}, {os.cpu_count()} cores"
  timing.emit(kind="load", loadavg=os.getloadavg())
  baseline = [block_per_query(store, b) for b in batches]
  warm = realm_inputs.TrivialCandidates(store, "block")

  def cold(batch):
    return realm_inputs.TrivialCandidates(store, "block").query_keys(batch)

  conditions = {
      "article": realm_inputs.TrivialCandidates(store, "article").query_keys,
      "block_per_query": lambda b: block_per_query(store, b),
      "block_cold": cold,
      "block": warm.query_keys,
  }
  for b in batches:  # The run's steady state: its articles are cached.
    warm.query_keys(b)
  for name, fn in conditions.items():
    seconds = []
    for batch, expected in zip(batches, baseline):
      start = time.perf_counter()
      keys = fn(batch)
      seconds.append(time.perf_counter() - start)
      if name != "article" and not np.array_equal(keys, expected):
        raise AssertionError(f"{name}: other blocks than the baseline's")
    timing.emit(kind="trivial_candidates", condition=name,
                batch_size=args.batch_size, batches=len(batches),
                blocks=len(store), articles=len(store.doc_block_offsets) - 1,
                median_ms_per_batch=round(1e3 * statistics.median(seconds),
                                          3),
                machine=machine)
  timing.emit(kind="load", loadavg=os.getloadavg())


if __name__ == "__main__":
  main()

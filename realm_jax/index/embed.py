"""Embedding the whole block store with the retriever's document tower
(and the data-parallel query tower of the trainers and QA).

Data-parallel, pmap-style (`parallel.data_parallel`) over the builder's local
devices (`data` axis), parameters replicated, each device a slice of every
batch. On a pod each host embeds its own contiguous share of the rows
(`process_index` of `process_count`), with no cross-host communication; the
shares are concatenated in row order. Output row i is block i.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import numpy as np

from realm_jax.core import parallel
from realm_jax.core import progress as progress_lib
from realm_jax.model import functional
from realm_jax.model.realm import Retriever, RetrieverConfig
from realm_jax.model.realm import document_tower_params


def host_row_range(num_rows: int, process_index: int,
                   process_count: int) -> tuple[int, int]:
  """Contiguous share [lo, hi) of the rows for one host."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is not in "
                     f"[0, {process_count}).")
  per = -(-num_rows // process_count)
  return min(num_rows, process_index * per), min(num_rows,
                                                 (process_index + 1) * per)


@functools.lru_cache(maxsize=16)
def make_embed_fn(retriever_config: RetrieverConfig, mesh):
  """Data-parallel document embedding: params, [B, L] inputs -> [B, D].

  Cached per (config, mesh): a trainer that refreshes its index inline
  every few steps would otherwise trace and compile it again each time.
  """
  # Documents do not depend on how the null document is scored: the tower
  # is built without the learned null score, and its parameter (if the
  # checkpoint has one) is not passed in.
  graphdef, _ = functional.abstract_init(lambda r: Retriever(
      dataclasses.replace(retriever_config, null_score="embedding"), rngs=r))

  def per_core(params, token_ids, input_mask, segment_ids):
    return functional.bind(graphdef, document_tower_params(
        params)).embed_documents(token_ids, input_mask, segment_ids)

  batch = parallel.BATCH
  return parallel.data_parallel(
      per_core, mesh, in_specs=(parallel.REPLICATED, batch, batch, batch),
      out_specs=batch)


def make_query_embedder(graphdef, mesh):
  """The query tower of a `Realm` graphdef over the data axis:
  (params, ids, mask) -> [B, D]."""
  def per_core(params, ids, mask):
    return functional.bind(graphdef, params).retriever.embed_queries(ids,
                                                                     mask)

  batch = parallel.BATCH
  return parallel.data_parallel(
      per_core, mesh, in_specs=(parallel.REPLICATED, batch, batch),
      out_specs=batch)


@dataclasses.dataclass
class EmbedStats:
  rows: int
  seconds: float

  @property
  def blocks_per_second(self) -> float:
    return self.rows / max(self.seconds, 1e-9)


def _embedder(retriever_params: Any, retriever_config: RetrieverConfig,
              bfloat16: bool, devices):
  """(mesh, the jitted document tower, its replicated parameters)."""
  if bfloat16:
    retriever_config = dataclasses.replace(
        retriever_config,
        bert=dataclasses.replace(retriever_config.bert, dtype="bfloat16"))
  mesh = parallel.make_mesh(devices or jax.local_devices())
  return (mesh, make_embed_fn(retriever_config, mesh),
          jax.device_put(retriever_params, parallel.replicated(mesh)))


def _embed_rows(embed, params, mesh, store, ids: np.ndarray, batch: int,
                seq_len: int) -> np.ndarray:
  """The embeddings of blocks `ids` (at most one batch, padded to it)."""
  padded = np.pad(ids, (0, batch - len(ids)), mode="edge")
  inputs = store.retriever_inputs(padded, seq_len)
  sharding = parallel.data_sharded(mesh)
  emb = embed(params, *(jax.device_put(inputs[k], sharding) for k in
                        ("token_ids", "input_mask", "segment_ids")))
  return np.asarray(emb)[:len(ids)]


def _host_rows(num_blocks: int, rows: tuple[int, int] | None,
               process_index: int, process_count: int) -> tuple[int, int]:
  """This host's share [lo, hi) of the blocks `rows` (default: all)."""
  first_row, end_row = rows if rows is not None else (0, num_blocks)
  if not 0 <= first_row <= end_row <= num_blocks:
    raise ValueError(f"rows={rows} is not a range of the {num_blocks} "
                     "blocks of the store.")
  lo, hi = host_row_range(end_row - first_row, process_index, process_count)
  return first_row + lo, first_row + hi


def embed_block_store(
    retriever_params: Any,
    retriever_config: RetrieverConfig,
    store,
    *,
    batch_size_per_device: int = 16,
    seq_len: int | None = None,
    bfloat16: bool = False,
    devices=None,
    process_index: int = 0,
    process_count: int = 1,
    log_every_seconds: float | None = None,
    what: str = "embedding blocks",
    on_progress: Callable[[int, int], None] | None = None,
    rows: tuple[int, int] | None = None,
) -> tuple[np.ndarray, EmbedStats]:
  """Embeds this host's share of the blocks.

  Args:
    retriever_params, retriever_config: the retriever.
    store: a `realm_jax.data.block_store.BlockStore`.
    batch_size_per_device: blocks per device per step.
    seq_len: document length (default: the store's max_block_len).
    bfloat16: compute in bfloat16 (parameters stay float32).
    devices: devices to use (default: this process's local devices).
    process_index, process_count: this host's share of the rows. Progress
      (`core.progress`: blocks done / total, blocks/s, ETA): host 0 draws a
      bar when stderr is a terminal; otherwise every host logs a line every
      `log_every_seconds`; every host logs its total time at the end.
    log_every_seconds: the period of the progress lines (default: the
      jobs' `--progress_seconds`, 30 s).
    what: what the progress lines call the work.
    on_progress: called with (rows embedded, rows of this host) after each
      batch (the builder's `build_progress.BuildProgress`).
    rows: embed only the blocks [first, end) (e.g. the blocks added to an
      indexed corpus), shared among the hosts; default: every block.

  Returns:
    (embeddings float32 [rows of this host, dim], stats).

  Raises:
    ValueError: `rows` is not a range of the store's blocks.
  """
  mesh, embed, params = _embedder(retriever_params, retriever_config,
                                  bfloat16, devices)
  seq_len = seq_len or store.max_block_len
  lo, hi = _host_rows(len(store), rows, process_index, process_count)
  batch = batch_size_per_device * mesh.size
  out = np.zeros([hi - lo, retriever_config.embedding_size], np.float32)
  start = time.time()
  on_progress = on_progress or (lambda done, total: None)
  on_progress(0, hi - lo)
  with progress_lib.Progress(
      what, hi - lo, unit="blocks", every_seconds=log_every_seconds,
      host=(process_index, process_count)) as bar:
    for first in range(lo, hi, batch):
      ids = np.arange(first, min(hi, first + batch))
      out[first - lo:first - lo + len(ids)] = _embed_rows(
          embed, params, mesh, store, ids, batch, seq_len)
      bar.update(len(ids))
      on_progress(first - lo + len(ids), hi - lo)
  stats = EmbedStats(rows=hi - lo, seconds=time.time() - start)
  return out, stats

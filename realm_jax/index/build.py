"""Building and publishing an index: the library half of the index builder.

`build_and_publish` embeds a block store with given retriever parameters
(data-parallel, on one or several hosts), builds the MIPS searcher and
publishes `<root>/<step>/` atomically (`publish.publish_index`: manifest,
checksums, LATEST); `publish_embeddings` does the last two for embeddings
already made (an imported `block_emb`, an extended index).
`IndexBuildConfig` says how (searcher, batch, dtype, retention, retries).

Its users: the builder job (`index.builder`: polling, lease, preemption,
follow), an inline-mode trainer (`index.service`) and the extension of a
published index (`index.extend`). They import this module only, so a
trainer or an extension does not load the job's machinery.
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
from typing import Any, Callable

from absl import logging
import jax
import numpy as np

from realm_jax.checkpoint_import import importers
from realm_jax.checkpoint_import import init_from as init_lib
from realm_jax.core import checkpoints, checks, dataclass_json, distributed
from realm_jax.core import io_utils
from realm_jax.core import outputs
from realm_jax.index import embed as embed_lib
from realm_jax.index import build_progress, publish, search_base, searchers
from realm_jax.model import functional
from realm_jax.model.realm import Realm, RealmConfig, RetrieverConfig


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class IndexBuildConfig:
  """How an index is built and published, by the builder job
  (`BuilderConfig.index_build`), by an inline-mode trainer
  (`PretrainConfig.index_build`) and by the extend job
  (`ExtendConfig.index_build`). Gin binds these fields to
  `@builder.IndexBuildConfig()` (runs/index_builder.gin, runs/pretrain.gin,
  runs/index_extend.gin: `builder.IndexBuildConfig` is this class), so one
  binding `builder.IndexBuildConfig.<field> = V` sets them all.

  Attributes:
    searcher: the MIPS searcher, "scann" or "exact".
    searcher_config: kind-specific overrides as (name, value) pairs: fields
      of `searchers.ScannConfig` / `ExactConfig`, and `num_shards` (> 1: one
      searcher per row range; see `searchers.build_searcher`).
    keep: published indices kept.
    batch_size_per_device: embedding batch per device.
    bfloat16: embed in bfloat16 (parameters stay float32).
    publish_attempts: tries to write an index before giving up (a
      filesystem error: full or unwritable disk, a flaky bucket); the job
      then fails (non-zero exit) rather than leave the trainer on a stale
      index without a word.
    retry_seconds: first pause between tries; doubled each time (<= 60 s).
  """
  searcher: str = "scann"
  searcher_config: tuple[tuple[str, Any], ...] = ()
  keep: int = 3
  batch_size_per_device: int = 16
  bfloat16: bool = False
  publish_attempts: int = 5
  retry_seconds: float = 2.0

  def __post_init__(self):
    if self.searcher not in search_base.SHARD_CONFIGS:
      raise ValueError(f"IndexBuildConfig.searcher={self.searcher!r}; use "
                       "'scann' or 'exact'.")
    overrides = dict(self.searcher_config)
    overrides.pop("num_shards", None)
    # Unknown names fail here, before any embedding.
    search_base.SHARD_CONFIGS[self.searcher].from_dict(overrides)
    checks.at_least(self, "keep", "batch_size_per_device",
                    "publish_attempts", integer=True)
    if self.retry_seconds < 0:
      raise ValueError("IndexBuildConfig.retry_seconds must be >= 0.")




class PublishFailedError(RuntimeError):
  """An index could not be written after every retry."""


def _retrying(fn: Callable[[], Any], what: str, config: IndexBuildConfig,
              on_retry: Callable[[str], None] | None = None):
  """fn(), retried on filesystem errors with exponential backoff;
  `on_retry` hears each failure that will be retried."""
  for attempt in range(1, config.publish_attempts + 1):
    try:
      return fn()
    except OSError as e:
      if attempt == config.publish_attempts:
        raise PublishFailedError(
            f"{what} failed {attempt} times, last with {e!r}. Check that "
            "the index directory is writable and has space; the trainer "
            "keeps its current index until a new one is published.") from e
      delay = min(60.0, config.retry_seconds * 2 ** (attempt - 1))
      logging.warning("%s failed (%r); attempt %d of %d in %.1f s", what, e,
                      attempt + 1, config.publish_attempts, delay)
      if on_retry:
        on_retry(f"{what} failed ({e!r}); attempt {attempt + 1} of "
                 f"{config.publish_attempts} in {delay:.0f} s")
      time.sleep(delay)


def build_and_publish(*, retriever_params: Any,
                      retriever_config: RetrieverConfig, store, root: str,
                      step: int,
                      config: IndexBuildConfig = IndexBuildConfig(),
                      devices=None,
                      progress: build_progress.BuildProgress | None = None
                      ) -> str:
  """Embeds the store with `retriever_params` and publishes index `step`.

  `progress` (the builder job's process 0) records how far it got, for a
  trainer that waits on it.

  With several processes (a multi-host builder), each host embeds its
  contiguous share of the rows on its local devices and writes it to
  `<root>/.tmp-shards-<step>/`; process 0 assembles the rows in order (the
  result is identical to a single-process build), builds the searcher and
  publishes; every process returns the published path.
  """
  start = time.time()
  index, count = jax.process_index(), jax.process_count()
  embeddings, stats = embed_lib.embed_block_store(
      retriever_params, retriever_config, store,
      batch_size_per_device=config.batch_size_per_device,
      bfloat16=config.bfloat16, devices=devices, process_index=index,
      process_count=count, on_progress=progress and progress.on_embedded)
  shard_dir = io_utils.join(root, f".tmp-shards-{int(step)}")
  if count > 1:
    buffer = io.BytesIO()
    np.save(buffer, embeddings)
    io_utils.atomic_write_bytes(
        io_utils.join(shard_dir, f"part-{index:05d}.npy"), buffer.getvalue())
    distributed.barrier(f"index-{step}-shards-written")
    if index == 0:
      parts = []
      for i in range(count):
        with io_utils.as_path(shard_dir).joinpath(
            f"part-{i:05d}.npy").open("rb") as f:
          parts.append(np.load(f))
      embeddings = np.concatenate(parts)
  path = publish.step_dir(root, step)
  if index == 0:
    path = publish_embeddings(
        embeddings=embeddings, store=store, root=root, step=step,
        config=config,
        params_sha256=publish.params_checksum(retriever_params),
        start_time=start, progress=progress,
        extra={"blocks_per_second": round(stats.blocks_per_second * count,
                                          2), "hosts": count})
    if count > 1:
      io_utils.remove(shard_dir)
  if count > 1:
    distributed.barrier(f"index-{step}-published")
  return path


def init_from_source(init_from: str) -> str | None:
  """The file or directory an `init_from` ("checkpoint:<dir>@<step>",
  "hf_bert:<dir>", ...) reads, or None when it names no path."""
  source = init_from.partition(":")[2].split(",")[0] or None
  if source and io_utils.is_local(source) and not os.path.exists(source):
    # `<dir>@<step>`, or a name that is no path (the import says so).
    source = source.rpartition("@")[0] or None
    if source and not os.path.exists(source):
      source = None
  return source


def publish_embeddings(*, embeddings: np.ndarray, store, root: str,
                       step: int,
                       config: IndexBuildConfig = IndexBuildConfig(),
                       params_sha256: str = "", start_time: float | None
                       = None, extra: dict[str, Any] | None = None,
                       progress: build_progress.BuildProgress | None = None,
                       kind: outputs.Kind = outputs.INDEX_ROOT,
                       setting: str = "the index root") -> str:
  """Builds a searcher over given embeddings and publishes it.

  Also the path for an imported `block_emb` (REALM's encoded.ckpt): the
  rows must pair with the block store's blocks.
  """
  if embeddings.shape[0] != len(store):
    raise ValueError(
        f"{embeddings.shape[0]} embedding rows but the block store at "
        f"{store.path if hasattr(store, 'path') else store} has {len(store)} "
        "blocks; row i must be block i (use the block store built from the "
        "same corpus).")
  start_time = start_time or time.time()
  if progress:
    progress.write("publishing")
  t = time.time()
  searcher = searchers.build_searcher(embeddings, config.searcher,
                                      **dict(config.searcher_config))
  build = time.time() - t
  path = _retrying(lambda: publish.publish_index(
      root, step, embeddings, searcher,
      corpus_fingerprint=store.fingerprint, params_sha256=params_sha256,
      build_seconds=time.time() - start_time, keep=config.keep,
      extra=dict(extra or {}, searcher_build_seconds=round(build, 3)),
      kind=kind, setting=setting),
                   f"publishing index {step} to {root}", config,
                   on_retry=progress and progress.retrying)
  logging.info("published index %d (%d rows) to %s in %.1f s", step,
               embeddings.shape[0], path, time.time() - start_time)
  return path


def checkpoint_retriever_config(ckpt_dir: str, step: int,
                                default: RetrieverConfig) -> RetrieverConfig:
  """The retriever config checkpoint `step` was trained with (the model
  config its meta carries), as eval and export read it; `default` (the gin
  model's) only for checkpoints written before configs were saved."""
  meta = checkpoints.read_meta(ckpt_dir, step)
  if "model_config" not in meta:
    logging.warning("checkpoint %s/%d carries no model config; embedding "
                    "with the gin files' retriever config.", ckpt_dir, step)
    return default
  ours = dataclass_json.from_dict(
      RealmConfig, meta["model_config"],
      f"{ckpt_dir}/{step}/meta:model_config").retriever
  if ours != default:
    logging.info("retriever config from checkpoint %d: %s (the gin files "
                 "say %s)", step, ours, default)
  return ours



def checkpoint_retriever(ckpt_dir: str, step: int, default: RetrieverConfig,
                         way_out: str = "") -> tuple[RetrieverConfig, Any]:
  """(retriever config, retriever parameters) of checkpoint `step`: the
  parameters restored alone, the config the checkpoint carries
  (`checkpoint_retriever_config`). `way_out` ends the message of a
  checkpoint that does not restore (`checkpoints.restore_items`)."""
  params = checkpoints.restore_retriever(
      ckpt_dir, step, **({"way_out": way_out} if way_out else {}))
  return checkpoint_retriever_config(ckpt_dir, step, default), params


def imported_retriever(init_from: str, model: RealmConfig
                       ) -> tuple[RetrieverConfig, Any]:
  """(retriever config, retriever parameters) of imported weights.

  "realm:<embedder ckpt>[,<bert ckpt>]" and "orqa:<ckpt>" bring their own
  retriever config; any other `checkpoint_import.init_from` string
  ("minilm", "hf_bert:<dir>", "export:<dir>", "checkpoint:<dir>[@N]", ...)
  is loaded into `model`'s retriever (the gin model files').
  """
  kind, _, source = init_from.partition(":")
  if kind == "realm":
    return importers.load_realm_embedder(source.split(",")[0])
  if kind == "orqa":
    realm_config, params = importers.load_orqa(source)
    return realm_config.retriever, params["retriever"]
  _, fresh = functional.init(lambda r: Realm(model, rngs=r), 0)
  return model.retriever, init_lib.initial_params(model, fresh,
                                                  init_from)["retriever"]

"""Adding blocks to a published index without retraining.

REALM's knowledge corpus can change after training: a trained retriever
serves blocks it never saw, as long as they are embedded with its own
document tower. `extend_index` takes an index published over a block store
(`base`), and a store `union` that begins with the base's blocks
(`block_store.check_extends`: e.g. a corpus built from the base's input
followed by new documents); it embeds only the new blocks with the
retriever parameters the index was built from (checked against the
manifest's `params_sha256`), appends them to the index's embeddings, builds
the searcher on the merged embeddings (ScaNN's tree and codebooks are
trained again on them; exact search needs nothing) and publishes the
result over `union` under another index root, as the builder publishes
(`build.publish_embeddings`: manifest, checksums, LATEST). The result is
what a full rebuild on `union` gives (tests/index/test_extend.py), at the
cost of embedding the new blocks only.

    from realm_jax.index import extend
    extend.extend_index(index_root=..., base_store=base, union_store=union,
                        retriever_params=params, retriever_config=cfg,
                        output_root=...)
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
import numpy as np

from realm_jax.core import io_utils
from realm_jax.core import outputs
from realm_jax.core import lease as lease_lib
from realm_jax.data import block_store
from realm_jax.index import build
from realm_jax.index import embed as embed_lib
from realm_jax.index import publish
from realm_jax.model.realm import RetrieverConfig


def _base_index(index_root: str, step: int | None, base_store,
                retriever_params: Any) -> tuple[publish.PublishedIndex, str]:
  """(the verified base index, the parameters' checksum), refusing
  parameters other than those the index was built with."""
  base = publish.load_index(index_root, step, publish.Expectation(
      base_store.fingerprint, len(base_store)))
  checksum = publish.params_checksum(retriever_params)
  if base.manifest.get("params_sha256") != checksum:
    raise ValueError(
        f"{publish.step_dir(index_root, base.step)} was built with "
        f"parameters {base.manifest.get('params_sha256')}, not these "
        f"({checksum}); embed the new blocks with the index's own "
        "checkpoint, or rebuild the whole index.")
  return base, checksum


def extend_bm25(base_store, union_store) -> bool:
  """The base store's BM25 index (if it has one beside it) extended to
  `union_store`'s blocks beside that store (only the new blocks are
  analysed), unless the union already has its own. Whether one was made."""
  from realm_jax.index import bm25  # pylint: disable=g-import-not-at-top
  base_dir, union_dir = bm25.default_dir(base_store), bm25.default_dir(
      union_store)
  if not os.path.exists(os.path.join(base_dir, "manifest.json")) or (
      os.path.exists(os.path.join(union_dir, "manifest.json"))):
    return False
  bm25.extend(base_store, union_store, base_dir=base_dir,
              directory=union_dir)
  return True


SETTING = "output_root (the extend job: --gin.OUTPUT_DIR)"


def check_output(output_root: str, *, index_root: str, base_store,
                 union_store, inputs: dict[str, str | None] | None = None
                 ) -> None:
  """Refuses an output root that is one of the job's inputs by any name
  (`io_utils.check_apart`: the base index, both stores, and `inputs`,
  e.g. the checkpoint the retriever is read from), or an existing
  directory that is not an extended index root (`outputs.check`: a
  builder's index root, a workdir, the user's files).

  Raises:
    io_utils.SamePlaceError, outputs.OwnershipError,
    io_utils.LinkRefusedError.
  """
  inputs = dict(inputs or {})
  io_utils.check_apart(output_root, "output_root", {
      "index_root": index_root,
      "base_store": getattr(base_store, "path", None),
      "union_store": getattr(union_store, "path", None), **inputs},
                       either_way=("index_root", *inputs))
  outputs.check(output_root, outputs.EXTENDED_INDEX_ROOT, SETTING)


def extend_index(*, index_root: str, base_store, union_store,
                 retriever_params: Any, retriever_config: RetrieverConfig,
                 output_root: str, step: int | None = None,
                 config: build.IndexBuildConfig = build.IndexBuildConfig(),
                 devices=None, inputs: dict[str, str | None] | None = None
                 ) -> str:
  """Publishes the index of `index_root` extended to `union_store`'s blocks.

  Args:
    index_root: the published index (over `base_store`) to extend.
    base_store: the block store that index serves.
    union_store: a store that begins with `base_store`'s blocks.
    retriever_params, retriever_config: the retriever the index was built
      with (its `params_sha256` must match).
    output_root: where the extended index is published (another index
      root: the base index stays as it is, for its own store).
    step: the base index's step (default LATEST); the extended index is
      published under the same step.
    config: how the searcher is built and published (as the builder's).
    devices: devices to embed on (default: local devices).
    inputs: more inputs the output must be apart from ({how the user
      names it: path}), e.g. the checkpoint `retriever_params` came from.

  Returns:
    The published directory.

  Raises:
    ValueError: `union_store` does not extend `base_store`, or the
      parameters are not the index's.
    io_utils.SamePlaceError: `output_root` is `index_root` (or a store,
      or one of `inputs`) under any name, or one holds the other.
    outputs.OwnershipError: `output_root` exists and is not an extended
      index root (an index builder's root, a workdir, the user's files).
    lease.LeaseHeldError: another job (an index builder) publishes to
      `output_root`.
    publish.IndexRejectedError: the base index does not serve `base_store`.
  """
  # Another name for the base index (a link, `..`) is the same place.
  check_output(output_root, index_root=index_root, base_store=base_store,
               union_store=union_store, inputs=inputs)
  start = time.time()
  # Inputs are checked before anything is created under output_root.
  base, checksum = _base_index(index_root, step, base_store,
                               retriever_params)
  block_store.check_extends(base_store, union_store)
  # The index builder's lease: an extend is refused on a root a builder
  # (or another extend) publishes to, and a builder refused while it runs.
  with lease_lib.job_lease(output_root, "index extend"):
    return _extend(base, checksum, index_root=index_root,
                   base_store=base_store, union_store=union_store,
                   retriever_params=retriever_params,
                   retriever_config=retriever_config,
                   output_root=output_root, config=config, devices=devices,
                   start=start)


def _extend(base: publish.PublishedIndex, checksum: str, *, index_root,
            base_store, union_store, retriever_params, retriever_config,
            output_root, config, devices, start) -> str:
  """Embeds the new blocks and publishes (under the output root's lease)."""
  new, stats = embed_lib.embed_block_store(
      retriever_params, retriever_config, union_store,
      batch_size_per_device=config.batch_size_per_device,
      bfloat16=config.bfloat16, devices=devices,
      rows=(len(base_store), len(union_store)),
      what=f"extending index {base.step}: embedding new blocks")
  embeddings = np.concatenate([np.asarray(base.embeddings, np.float32),
                               new])
  logging.info("extending index %d: %d blocks + %d new ones", base.step,
               len(base_store), new.shape[0])
  extend_bm25(base_store, union_store)
  return build.publish_embeddings(
      embeddings=embeddings, store=union_store, root=output_root,
      step=base.step, config=config, params_sha256=checksum,
      start_time=start, extra={
          "extends": {
              "index": os.fspath(publish.step_dir(index_root, base.step)),
              "corpus_fingerprint": base_store.fingerprint,
              "rows": len(base_store)},
          "new_rows": int(new.shape[0]),
          "blocks_per_second": round(stats.blocks_per_second, 2)},
      kind=outputs.EXTENDED_INDEX_ROOT, setting=SETTING)

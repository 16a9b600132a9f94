"""The index builder job: checkpoint -> embeddings -> MIPS index -> publish.

Runs beside the trainer as its own process (on a pod: its own host job) and
never blocks it. Loop:

  1. look at the trainer's orbax checkpoint directory; take the NEWEST step
     newer than the last published index (steps superseded while the
     builder was busy are skipped);
  2. restore only the retriever parameters of that step;
  3. embed every block of the block store (data-parallel), build the
     searcher, publish `index/<step>/` atomically and move LATEST;
  4. stop when the trainer's DONE marker is there and nothing newer is
     left to build.

It resumes after a crash: stale temporaries are removed and the last
published step is the starting point. One-shot modes embed once from given
retriever parameters (a checkpoint step, or any imported weights: REALM,
ORQA, MiniLM, an export, ...), or publish an imported `block_emb` matrix
as it is. The workdir may be local or `gs://` (paths go through
`realm_jax.core.io_utils`).

    python -m realm_jax.jobs.index_builder --gin_file=models/tiny.gin \\
        --gin_file=runs/index_builder.gin --gin.WORKDIR="'W'" \\
        --gin.BLOCK_STORE="'B'" [--gin.builder.BuilderConfig.one_shot=True]
    python -m realm_jax.jobs.index_builder --gin_file=models/minilm_l6.gin \\
        --gin_file=runs/index_builder.gin --gin.WORKDIR="'W'" \\
        --gin.BLOCK_STORE="'B'" --gin.builder.BuilderConfig.init_from="'minilm'"

How each index is built (searcher, batch, dtype, retention) is
`IndexBuildConfig`, which an inline-mode trainer shares:
`--gin.builder.IndexBuildConfig.searcher="'exact'"`. The embedding and the
publication are the library `index.build`; this module is the job around
it (polling, lease, preemption, the one-shot modes); its command line is
`realm_jax.jobs.index_builder`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

from absl import logging
import jax

from realm_jax.checkpoint_import import importers
from realm_jax.core import checkpoints, checks, distributed
from realm_jax.core import follow, gin_config
from realm_jax.core import io_utils
from realm_jax.core import outputs
from realm_jax.core import lease as lease_lib
from realm_jax.core import preemption
from realm_jax.data import block_store
from realm_jax.index import build, build_progress, publish
from realm_jax.model.realm import RealmConfig, RetrieverConfig

# The name the gin files bind (`builder.IndexBuildConfig.<field>`, and
# `@builder.IndexBuildConfig()` in runs/index_builder.gin and
# runs/pretrain.gin): the library's class itself.
IndexBuildConfig = build.IndexBuildConfig


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class BuilderConfig:
  """The index builder job (runs/index_builder.gin).

  Attributes:
    workdir, block_store: the job's paths: the trainer's workdir
      (checkpoints/ in, index/ out) and the block store it retrieves from.
    one_shot: the job embeds one checkpoint (`step`, default the newest)
      and exits.
    step: one-shot: the checkpoint step; init_from: the step to publish
      under (default 0).
    init_from: the job publishes once from imported weights: "realm:<embedder
      ckpt>[,<bert ckpt>]", "orqa:<ckpt>" (its retriever),
      "block_emb:<encoded.ckpt>" (REALM's embeddings as they are), or any
      other `checkpoint_import.init_from` string ("minilm",
      "hf_bert:<dir>", "export:<dir>", ...) loaded into the gin model's
      retriever.
    timeout_seconds: the job exits after this long without DONE (None: never).
    poll_seconds: pause between looks at the checkpoint directory.
    done_grace_seconds: a builder that finds the run finished (DONE, and
      nothing left to index) at its first look waits this long for a
      trainer to take the workdir and continue the run before it exits:
      launchers start the builder first, and a trainer that extends a
      finished run clears the old DONE only once it runs.
    index_build: how each index is built (searcher, batch, dtype, retention,
      retries), bound as `builder.IndexBuildConfig.<field>` in gin.
  """
  workdir: str | None = checks.path_setting("home", default=None)
  block_store: str | None = checks.path_setting("reads", default=None)
  one_shot: bool = False
  step: int | None = None
  init_from: str | None = checks.path_setting("reads", default=None)
  timeout_seconds: float | None = None
  poll_seconds: float = 5.0
  done_grace_seconds: float = 60.0
  index_build: build.IndexBuildConfig = build.IndexBuildConfig()

  def __post_init__(self):
    if self.poll_seconds <= 0:
      raise ValueError("BuilderConfig.poll_seconds must be > 0.")
    if self.init_from == "scratch":
      raise ValueError("BuilderConfig.init_from='scratch' would index random "
                       "weights; name weights to import (e.g. 'minilm').")



def check_places(root: str, workdir: str, store, init_from: str = ""
                 ) -> None:
  """Refuses an index root that is an input of the builder by another name
  (`io_utils.check_apart`): the checkpoints (publishing step 7 there would
  replace checkpoint 7), the block store, or what `init_from` reads; and
  one that is not an index builder's root (`outputs.check`)."""
  source = build.init_from_source(init_from)
  io_utils.check_apart(root, "the index root (<WORKDIR>/index)", {
      "the checkpoints (<WORKDIR>/checkpoints)":
          checkpoints.checkpoint_dir(workdir),
      "BLOCK_STORE": getattr(store, "path", None),
      "init_from": source}, either_way=(
          "the checkpoints (<WORKDIR>/checkpoints)", "BLOCK_STORE",
          "init_from"))
  outputs.check(root, outputs.INDEX_ROOT, "the index root (<WORKDIR>/index)")


def run_builder(*, workdir: str, store, retriever_config: RetrieverConfig,
                config: BuilderConfig = BuilderConfig(),
                max_indices: int | None = None, timeout: float | None = None,
                devices=None,
                on_publish: Callable[[int, str], None] | None = None
                ) -> list[int]:
  """`_run_builder` under an exclusive lease on the index directory
  (`realm_jax.core.lease`: a second builder is refused, naming the first)."""
  check_places(checkpoints.index_root(workdir), workdir, store)
  with lease_lib.job_lease(checkpoints.index_root(workdir),
                           "index builder"):
    return _run_builder(workdir=workdir, store=store,
                        retriever_config=retriever_config, config=config,
                        max_indices=max_indices, timeout=timeout,
                        devices=devices, on_publish=on_publish)


def _run_builder(*, workdir: str, store, retriever_config: RetrieverConfig,
                 config: BuilderConfig = BuilderConfig(),
                 max_indices: int | None = None,
                 timeout: float | None = None, devices=None,
                 on_publish: Callable[[int, str], None] | None = None
                 ) -> list[int]:
  """Polls the trainer's checkpoints and publishes fresh indices until DONE.

  Args:
    workdir: the trainer's workdir (checkpoints/ and index/ inside).
    store: the block store the trainer retrieves from.
    retriever_config: the trainer's retriever config, for checkpoints that
      carry none (each checkpoint's own config is used when it has one).
    config: builder settings.
    max_indices: stop after publishing this many (tests, one-offs).
    timeout: stop after this many seconds without DONE.
    devices: devices to embed on (default: local devices).
    on_publish: called with (step, path) after each publication.

  Returns:
    The steps published by this call.
  """
  ckpt_dir = checkpoints.checkpoint_dir(workdir)
  root = checkpoints.index_root(workdir)
  # Process 0 alone, before anyone writes: another host's fresh shard files
  # must not be taken for leftovers.
  if jax.process_index() == 0:
    removed = publish.clean_stale_temporaries(root)
    if removed:
      logging.info("removed leftovers of an interrupted publication: %s",
                   removed)
  distributed.barrier("index-builder-cleaned")
  published = publish.published_steps(root)
  last = published[-1] if published else -1
  logging.info("index builder: resuming after step %d", last)
  start, out = time.time(), []
  # SIGTERM / Ctrl-C: publish the newest checkpoint not yet indexed (the
  # trainer's last, when a launcher stops the trainer first), then exit.
  stop = preemption.Preemption()
  try:
    return _poll(ckpt_dir, last, out, start, stop, store=store, root=root,
                 retriever_config=retriever_config, config=config,
                 max_indices=max_indices, timeout=timeout,
                 devices=devices, on_publish=on_publish)
  finally:
    stop.close()


def _poll(ckpt_dir, last, out, start, stop, *, store, root,
          retriever_config, config, max_indices, timeout, devices,
          on_publish) -> list[int]:
  """The builder's loop: publish the newest new checkpoint, or wait
  (`core.follow`: DONE is read before the checkpoints are listed)."""
  follower = follow.CheckpointFollower(
      ckpt_dir, mode="newest", after=last, poll_seconds=config.poll_seconds,
      timeout=None if timeout is None else timeout - (time.time() - start),
      done_grace_seconds=config.done_grace_seconds, stop=stop,
      name="index builder")
  for step in follower:
    try:
      trained_with, params = build.checkpoint_retriever(
          ckpt_dir, step, retriever_config)
    except FileNotFoundError:
      # Deleted by the trainer's retention between listing and reading.
      logging.warning("checkpoint %d vanished before it was read", step)
      continue
    except Exception as e:  # pylint: disable=broad-except
      # A damaged checkpoint (truncated array file, DATA_LOSS): the
      # builder only reads checkpoints, so it skips this one for good
      # (the trainer moves it aside when it resumes) and takes the
      # newest older one, instead of dying on it.
      if not isinstance(e, checkpoints.CheckpointRestoreError):
        e = (f"checkpoint {io_utils.join(ckpt_dir, str(step))} does not "
             f"restore ({type(e).__name__}: {e})")
      logging.warning("%s; skipping it.", e)
      follower.give_up(step)
      continue
    path = build.build_and_publish(
        retriever_params=params, retriever_config=trained_with, store=store,
        root=root, step=step, config=config.index_build, devices=devices,
        progress=(build_progress.BuildProgress(root, step)
                  if jax.process_index() == 0 else None))
    out.append(step)
    if on_publish:
      on_publish(step, path)
    if max_indices is not None and len(out) >= max_indices:
      return out
  logging.info("%s; index builder exits after %s",
               follow.REASONS[follower.stopped], out)
  return out


# ---------------------------------------- the job's modes (jobs/index_builder)


def _chief_progress(root: str, step: int
                    ) -> build_progress.BuildProgress | None:
  """Process 0's `index/.progress.json` record in the one-shot modes, as
  the polling mode writes it (a watcher reads the same numbers)."""
  return (build_progress.BuildProgress(root, step)
          if jax.process_index() == 0 else None)


def run_modes(config: BuilderConfig, store, root: str) -> None:
  """The job's modes (`realm_jax.jobs.index_builder`, under its lease)."""
  kind, _, source = (config.init_from or "").partition(":")
  if not kind and not config.one_shot:
    _run_builder(workdir=config.workdir, store=store,
                 retriever_config=gin_config.configured(RealmConfig)
                 .retriever, config=config, timeout=config.timeout_seconds)
    return
  step = config.step or 0
  if kind == "block_emb":
    build.publish_embeddings(embeddings=importers.load_block_emb(source),
                             store=store, root=root, step=step,
                             config=config.index_build,
                             params_sha256="imported:" + source,
                             progress=_chief_progress(root, step))
    return
  if kind:  # Imported weights (other kinds into the gin model's retriever).
    retriever_config, params = build.imported_retriever(
        config.init_from, gin_config.configured(RealmConfig))
  else:  # One shot from the trainer's checkpoint, with its retriever config.
    ckpt_dir = checkpoints.checkpoint_dir(config.workdir)
    try:
      step = (config.step if config.step is not None
              else checkpoints.newest_step(ckpt_dir))
    except FileNotFoundError as e:
      raise SystemExit(str(e)) from e
    try:
      retriever_config, params = build.checkpoint_retriever(
          ckpt_dir, step, gin_config.configured(RealmConfig).retriever,
          way_out=("index an older one with "
                   "--gin.builder.BuilderConfig.step={older}"))
    except checkpoints.CheckpointRestoreError as e:
      raise SystemExit(str(e)) from e
  build.build_and_publish(retriever_params=params,
                          retriever_config=retriever_config, store=store,
                          root=root, step=step, config=config.index_build,
                          progress=_chief_progress(root, step))


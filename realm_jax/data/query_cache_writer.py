"""Building the REALM query cache (`query_cache`'s format), offline.

`build_query_cache` (the job `realm-query-cache`) runs the seqio task of
`tasks.register_pretrain_task` through `seqio.beam_utils.PreprocessTask`
(one Beam element per annotated file; per-file seeds, so the masks are
reproducible) and writes the queries to `num_shards` ArrayRecord files of
`tf.train.Example`s, one record per chunk (random access), plus
`manifest.json` (rows per shard, features, masking config, vocabulary
sha256, source files). A query goes to shard hash(file, index in file) %
num_shards and each shard is sorted by (file, index), so the cache's
content does not depend on the runner or on how it split the work. The
output appears atomically, manifest last (`beam_utils.ShardedOutput`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Sequence

from absl import logging

from realm_jax.core import io_utils, outputs
from realm_jax.data import examples as examples_lib
from realm_jax.data.query_cache import (DEFAULT_SHARDS, DEV_DIR,
                                        FORMAT_VERSION, MANIFEST,
                                        QueryStream, encode_query,
                                        in_dev_split, output_shard,
                                        query_features, shard_name)

# One record per chunk: `QueryStream` reads rows at random.
_WRITER_OPTIONS = "group_size:1"


def _expand(annotated: str | Sequence[str]) -> list[str]:
  """The files `annotated`'s glob patterns match (a string may hold several,
  comma-separated), sorted within each pattern."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  patterns = ([p for p in annotated.split(",") if p]
              if isinstance(annotated, str) else list(annotated))
  files = []
  for pattern in patterns:
    found = sorted(tf.io.gfile.glob(pattern))
    if not found:
      raise FileNotFoundError(f"no annotated file matches {pattern!r}.")
    files += found
  return files


def write_shard(item, *, tmp_dir: str, num_shards: int) -> dict[str, int]:
  """(shard, [(file, index, record)]) -> one ArrayRecord file; its stats.

  Shard `num_shards` is the dev split's one shard, in `tmp_dir/dev/`.
  """
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  k, rows = item
  rows = sorted(rows, key=lambda r: (r[0], r[1]))
  name = shard_name(k, num_shards)
  if k == num_shards:
    name = DEV_DIR + "/" + shard_name(0, 1)
    io_utils.makedirs(io_utils.join(tmp_dir, DEV_DIR))
  local = io_utils.is_local(tmp_dir)
  path = (os.path.join(tmp_dir, name) if local else
          os.path.join(tempfile.mkdtemp(), os.path.basename(name)))
  writer = array_record_module.ArrayRecordWriter(path, _WRITER_OPTIONS)
  size = 0
  for _, _, record in rows:
    writer.write(record)
    size += len(record)
  writer.close()
  if not local:
    io_utils.copy_file(path, io_utils.join(tmp_dir, name))
    shutil.rmtree(os.path.dirname(path))  # Its own mkdtemp above.
  return {"shard": k, "rows": len(rows), "bytes": size}


def _preprocess_transform():
  """`seqio.beam_utils.PreprocessTask` that names the file of a read error
  and logs each file's query count."""
  from seqio import beam_utils  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class PreprocessAnnotated(beam_utils.PreprocessTask):

    def _emit_examples(self, shard):
      index, name = shard
      count = 0
      try:
        for example in super()._emit_examples(shard):
          count += 1
          yield example
      except tf.errors.OpError as e:
        raise ValueError(
            f"{name}: not a readable annotated TFRecord file ({e.message}); "
            "re-run salient_spans on its source or remove it.") from e
      log = logging.info if count else logging.warning
      log("query cache: annotated file %d of %d (%s): %d queries", index + 1,
          len(self.shards), name, count)

  return PreprocessAnnotated


def _to_record(example: dict[str, Any], num_shards: int, seed: int = 0,
               dev_share: float = 0.0):
  """(shard, (file, index, record)); shard `num_shards` is the dev split."""
  from seqio import beam_utils  # pylint: disable=g-import-not-at-top
  source = int(example[beam_utils.SOURCE_SHARD_ID_PROVENANCE_KEY])
  index = int(example[beam_utils.ID_WITHIN_SHARD_PROVENANCE_KEY])
  shard = (num_shards if in_dev_split(int(example["source_doc_hash"]), seed,
                                      dev_share)
           else output_shard(source, index, num_shards))
  return shard, (source, index, encode_query(example))


def _task_registration(files: Sequence[str], vocab_path: str | None,
                       lower_case: bool,
                       query_config: examples_lib.RealmQueryConfig
                       ) -> tuple[dict[str, Any], str]:
  """`tasks.register_pretrain_task`'s arguments for the cache's seqio task,
  and the sha256 of its vocabulary (default `tokenizer.default_vocab_path()`).

  seqio seeds each input file's masks from the task name, so the name
  holds no path: the same files and settings give the same masks wherever
  they (and the vocabulary) are stored.
  """
  from realm_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  vocab_path = vocab_path or tokenizer_lib.default_vocab_path()
  vocab_sha256 = io_utils.sha256_file(vocab_path)
  spec = json.dumps([[os.path.basename(f) for f in files], vocab_sha256,
                     lower_case, dataclasses.asdict(query_config)],
                    sort_keys=True)
  task_name = ("realm_query_cache_" +
               hashlib.sha256(spec.encode()).hexdigest()[:16])
  return dict(annotated_pattern=tuple(files), name=task_name,
              vocab_path=vocab_path, lower_case=lower_case,
              query_config=query_config, overwrite=True), vocab_sha256


def build_query_cache(
    annotated: str | Sequence[str],
    output_dir: str,
    *,
    query_config: examples_lib.RealmQueryConfig = (
        examples_lib.RealmQueryConfig()),
    seed: int = 0,
    num_shards: int = DEFAULT_SHARDS,
    vocab_path: str | None = None,
    lower_case: bool = True,
    pipeline_args: Sequence[str] = (),
    overwrite: bool = False,
    dev_share: float = 0.0,
) -> dict[str, Any]:
  """Annotated TFRecords -> a query cache directory (a Beam pipeline).

  Args:
    annotated: glob pattern(s) of annotated TFRecord files (a string may
      hold several, comma-separated; ".gz" files are gzip).
    output_dir: the cache directory to create (`overwrite`: replace one).
    query_config: lengths and masking mode.
    seed: the masking seed (per-file seeds derive from it).
    num_shards: output shards; a multiple of every host count the cache
      will be read with. Each shard is sorted in one worker's memory
      (~1.2 kB per query), so keep shards under ~1M queries.
    vocab_path: BERT vocab.txt (default `tokenizer.default_vocab_path()`);
      must be the block store's. `lower_case`: as in `tokenizer.Tokenizer`.
    pipeline_args: Beam options (`--runner=...`); default DirectRunner.
    dev_share: the share of documents whose queries go to the held-out dev
      split `<output_dir>/dev/` (one shard, a cache of its own) instead of
      the training shards (`in_dev_split`); 0: none (the command line's
      default is `DEFAULT_DEV_SHARE`).

  Returns the manifest written. Raises FileExistsError (`output_dir` exists
  and not `overwrite`), FileNotFoundError (a pattern matches no file) or
  ValueError (a malformed input file, named; no query at all; an empty
  shard: use fewer shards).
  """
  from realm_jax.data import beam_utils  # pylint: disable=g-import-not-at-top
  from realm_jax.data import tasks  # pylint: disable=g-import-not-at-top

  if num_shards < 1:
    raise ValueError(f"num_shards={num_shards} must be >= 1.")
  if not 0 <= dev_share < 1:
    raise ValueError(f"dev_share={dev_share} must be in [0, 1).")
  output = beam_utils.ShardedOutput(
      output_dir, marker=MANIFEST, kind=outputs.QUERY_CACHE,
      setting="QueryCacheConfig.output_dir (--gin.OUTPUT_DIR)",
      overwrite=overwrite)
  files = _expand(annotated)
  register, vocab_sha256 = _task_registration(files, vocab_path, lower_case,
                                              query_config)
  task = tasks.register_pretrain_task(**register)
  start = time.time()
  with output as out:
    _run_pipeline(pipeline_args, out, task, register, num_files=len(files),
                  num_shards=num_shards, seed=seed, dev_share=dev_share)
    manifest = finish_cache(
        out.tmp_dir, out.output_dir, out.load(out.stats, []),
        num_shards=num_shards, query_config=query_config, seed=seed,
        vocab_sha256=vocab_sha256, source_files=files,
        extra={"lower_case": lower_case, "seqio_task": register["name"],
               "build_seconds": round(time.time() - start, 1)},
        dev_share=dev_share)
  logging.info("query cache %s: %d queries in %d shards (%.0f s)",
               out.output_dir, manifest["num_queries"], num_shards,
               time.time() - start)
  return manifest


def _run_pipeline(pipeline_args: Sequence[str], out, task,
                  register: dict[str, Any], *, num_files: int,
                  num_shards: int, seed: int, dev_share: float) -> None:
  """Runs the Beam pipeline that writes the cache's shards into `out`."""
  import apache_beam as beam  # pylint: disable=g-import-not-at-top
  from realm_jax.data import beam_utils  # pylint: disable=g-import-not-at-top

  pipeline, runner = beam_utils.pipeline(pipeline_args)
  logging.info("query cache: %d annotated files -> %d shards in %s "
               "(runner %s)", num_files, num_shards, out.output_dir, runner)
  with pipeline:
    _ = (
        pipeline
        | "Queries" >> _preprocess_transform()(
            task, "train", preprocessors_seed=seed, add_provenance=True,
            setup_fn=_Register(register))
        | "Encode" >> beam.Map(_to_record, num_shards, seed, dev_share)
        | "Write" >> out.write_shards(
            functools.partial(write_shard, tmp_dir=out.tmp_dir,
                              num_shards=num_shards),
            "query_cache", num_shards + (dev_share > 0)))


def finish_cache(tmp_dir: str, output_dir: str, stats: list[dict[str, int]],
                 *, num_shards: int,
                 query_config: examples_lib.RealmQueryConfig, seed: int,
                 vocab_sha256: str, source_files: Sequence[str],
                 extra: dict[str, Any] | None = None,
                 dev_share: float = 0.0) -> dict[str, Any]:
  """Writes the manifest of the shards in `tmp_dir` (`stats`: what
  `write_shard` returned for each; shard `num_shards` is the dev split's)
  and publishes them at `output_dir`; returns the manifest. Raises
  ValueError for no query at all, a shard without queries, or a
  `dev_share` that held out no query."""
  dev = [s for s in stats if int(s["shard"]) == num_shards]
  stats = [s for s in stats if int(s["shard"]) != num_shards]
  by_shard = {int(s["shard"]): s for s in stats}
  total = sum(s["rows"] for s in stats)
  if not total:
    raise ValueError(f"{list(source_files)}: no REALM queries (no sentence "
                     "with a usable salient span).")
  empty = sorted(set(range(num_shards)) - set(by_shard))
  if empty:
    raise ValueError(
        f"{len(empty)} of {num_shards} shards got no query ({total} queries "
        "in all); build the cache with fewer shards (num_shards).")
  if dev_share > 0 and not dev:
    raise ValueError(
        f"dev_share={dev_share} held out no document of the {total} "
        "queries' (the dev split would be empty): raise "
        "QueryCacheConfig.dev_share, or set it to 0 for no dev split.")

  def manifest_of(rows, files):
    return {
        "format_version": FORMAT_VERSION,
        "num_shards": len(files),
        "num_queries": sum(r["rows"] for r in rows),
        "shard_rows": [r["rows"] for r in rows],
        "shard_bytes": [r["bytes"] for r in rows],
        "shard_files": files,
        "record_format": "tf.train.Example; ArrayRecord " + _WRITER_OPTIONS,
        "features": query_features(query_config),
        "query_config": dataclasses.asdict(query_config),
        "seed": seed,
        "vocab_sha256": vocab_sha256,
        "source_files": list(source_files),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }

  manifest = manifest_of([by_shard[k] for k in range(num_shards)],
                         [shard_name(k, num_shards) for k in range(num_shards)])
  files = list(manifest["shard_files"])
  if dev:
    dev_manifest = dict(manifest_of(dev, [shard_name(0, 1)]),
                        split="dev", dev_share=dev_share)
    manifest["dev"] = {"dir": DEV_DIR, "share": dev_share,
                       "num_queries": dev_manifest["num_queries"]}
    # Inside the cache: published with it, its manifest before the cache's.
    io_utils.atomic_write_text(io_utils.join(tmp_dir, DEV_DIR, MANIFEST),
                               json.dumps(dev_manifest, indent=1))
    files += [f"{DEV_DIR}/{shard_name(0, 1)}", f"{DEV_DIR}/{MANIFEST}"]

  def check(directory):  # Refuse what is unreadable.
    QueryStream(directory, seed=0, batch_size=num_shards).close()
    if dev:
      QueryStream(os.path.join(directory, DEV_DIR), seed=0,
                  batch_size=1).close()

  from realm_jax.data import beam_utils  # pylint: disable=g-import-not-at-top
  beam_utils.publish(tmp_dir, output_dir, MANIFEST,
                     json.dumps(manifest, indent=1), files,
                     kind=outputs.QUERY_CACHE, check=check)
  return manifest


class _Register:
  """Registers the task on a Beam worker (a process without the driver's
  seqio registry); picklable."""

  def __init__(self, kwargs: dict[str, Any]):
    self.kwargs = kwargs

  def __call__(self) -> None:
    from realm_jax.data import tasks  # pylint: disable=g-import-not-at-top
    tasks.register_pretrain_task(**self.kwargs)

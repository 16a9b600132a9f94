r"""The REALM query cache: masked queries on disk, streamed per host by step.

Pre-training reads masked REALM queries (`examples.REALM_QUERY_FEATURES`).
Making them (parse the annotated corpus, tokenize, mask) is done ONCE,
offline, by an Apache Beam pipeline, and every host then streams only its
part of each step's batch from the result:

* `query_cache_writer.build_query_cache` (also `realm-query-cache`)
  writes the cache: `num_shards` ArrayRecord files of `tf.train.Example`s
  (`encode_query`; a query's shard is `output_shard`, or the dev split's,
  `in_dev_split`) and `manifest.json`.
  The command line (runs/query_cache.gin) masks as
  `examples.RealmQueryConfig` is bound (`QueryCacheConfig`), and the
  trainer reads that config from the manifest; other flags are Beam
  options (`--runner=DataflowRunner ...`; BUILD.md).

* `QueryStream` is the trainer's reader. Row r of a global batch of B
  (N <= B shards) comes from shard k = floor(r * N / B): each shard fills
  one contiguous block of c_k ~ B / N rows of every batch, and at step s
  its rows give its elements s * c_k, s * c_k + 1, ...; element j of shard
  k is row `permute(j mod rows_k; seed, k, epoch = j // rows_k)` of that
  shard, a keyed Feistel permutation (O(1) memory; no index over the
  rows). Host h of H (H dividing N and B) takes rows [h B/H, (h+1) B/H),
  which are exactly those of its shards [h N/H, (h+1) N/H). So every host
  count sees the same global batch, row for row (each example lands on the
  same device, with the same dropout key), each host opens only its shards,
  and a batch is a pure function of (seed, step): a restarted run replays
  exactly. Shards wrap around independently (their row counts differ
  slightly).

A reader holds no per-row state of its own; ArrayRecord keeps each opened
shard's chunk offsets in memory (~14 bytes a row of this host's shards,
~17 MB for 1.25M rows). Opening reads the shards' footers only, so the time
to the first batch does not grow with the corpus.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Sequence

from absl import logging
import numpy as np

from realm_jax.core import checks, io_utils
from realm_jax.data import examples as examples_lib

FORMAT_VERSION = 1
# Shards a cache gets by default: a global batch of at least 8 streams it on
# 1, 2, 4 or 8 hosts. Pods set `QueryCacheConfig.num_shards` (a multiple of
# the trainer's host count, at most its global batch size).
DEFAULT_SHARDS = 8
MANIFEST = "manifest.json"
# The held-out dev split of a cache, one shard in `<cache>/dev/`: the
# queries of a seeded share of the documents (`QueryCacheConfig.dev_share`,
# by document, so no sentence of a dev article is trained on). The gate and
# the recall guard read it (`held_out`).
DEV_DIR = "dev"
DEFAULT_DEV_SHARE = 0.05
# Random access: one record per chunk (`query_cache_writer`), no read-ahead.
# The chunk index stays in memory (~14 bytes a row of this host's shards):
# the "offloaded" index re-reads it from the footer on every access, 100x
# slower at 125k rows.
_READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


def shard_name(k: int, num_shards: int) -> str:
  return f"queries-{k:05d}-of-{num_shards:05d}.array_record"


def query_features(config: examples_lib.RealmQueryConfig
                   ) -> dict[str, dict[str, Any]]:
  """Name -> {"dtype", "shape"} of one query (`examples.realm_query`)."""
  q, m = config.query_length, config.max_masks
  return {"query_ids": {"dtype": "int32", "shape": [q]},
          "query_mask": {"dtype": "int32", "shape": [q]},
          "mlm_positions": {"dtype": "int32", "shape": [m]},
          "mlm_targets": {"dtype": "int32", "shape": [m]},
          "mlm_weights": {"dtype": "float32", "shape": [m]},
          "source_doc_hash": {"dtype": "int64", "shape": []}}


# -----------------------------------------------------------------------------
# Row encoding: tf.train.Example, seqio's cache format.
# -----------------------------------------------------------------------------


def encode_query(query: dict[str, Any]) -> bytes:
  """One query (numpy or eager tensors) -> a serialized tf.train.Example."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  feature = {}
  for name in examples_lib.REALM_QUERY_FEATURES:
    value = np.asarray(query[name]).reshape(-1)
    if value.dtype.kind == "f":
      feature[name] = tf.train.Feature(float_list=tf.train.FloatList(
          value=value.tolist()))
    else:
      feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(
          value=value.tolist()))
  # Features sorted by name: the same bytes in every process (protobuf
  # writes a map in an order that differs between processes).
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString(deterministic=True)


@functools.cache
def _example_class():
  """tf.train.Example's message class, built from its schema with protobuf
  alone: reading a cache needs no TensorFlow (e.g. on an accelerator host
  without it). Same wire format: field numbers and types as TensorFlow's
  example.proto and feature.proto."""
  from google.protobuf import descriptor_pb2  # pylint: disable=g-import-not-at-top
  from google.protobuf import descriptor_pool  # pylint: disable=g-import-not-at-top
  from google.protobuf import message_factory  # pylint: disable=g-import-not-at-top
  fdp = descriptor_pb2.FieldDescriptorProto
  proto = descriptor_pb2.FileDescriptorProto(
      name="realm_jax/query_cache_example.proto",
      package="realm_jax.query_cache", syntax="proto3")

  def message(name, *fields, into=proto.message_type):
    m = into.add(name=name)
    for number, field, kind, type_name, label in fields:
      m.field.add(name=field, number=number, type=kind, label=label,
                  type_name=type_name)
    return m

  repeated, optional = fdp.LABEL_REPEATED, fdp.LABEL_OPTIONAL
  pkg = ".realm_jax.query_cache."
  message("BytesList", (1, "value", fdp.TYPE_BYTES, None, repeated))
  message("FloatList", (1, "value", fdp.TYPE_FLOAT, None, repeated))
  message("Int64List", (1, "value", fdp.TYPE_INT64, None, repeated))
  message("Feature",
          (1, "bytes_list", fdp.TYPE_MESSAGE, pkg + "BytesList", optional),
          (2, "float_list", fdp.TYPE_MESSAGE, pkg + "FloatList", optional),
          (3, "int64_list", fdp.TYPE_MESSAGE, pkg + "Int64List", optional))
  features = message("Features", (1, "feature", fdp.TYPE_MESSAGE,
                                  pkg + "Features.FeatureEntry", repeated))
  entry = message("FeatureEntry",
                  (1, "key", fdp.TYPE_STRING, None, optional),
                  (2, "value", fdp.TYPE_MESSAGE, pkg + "Feature", optional),
                  into=features.nested_type)
  entry.options.map_entry = True
  message("Example", (1, "features", fdp.TYPE_MESSAGE, pkg + "Features",
                      optional))
  pool = descriptor_pool.DescriptorPool()
  pool.Add(proto)
  return message_factory.GetMessageClass(
      pool.FindMessageTypeByName("realm_jax.query_cache.Example"))


def decode_queries(records: Sequence[bytes], features: dict[str, Any]
                   ) -> dict[str, np.ndarray]:
  """Serialized queries -> stacked arrays with the manifest's dtypes.

  Raises:
    ValueError: a record that is no Example, lacks a feature, or holds a
      feature of another size than the manifest's.
  """
  from google.protobuf import message as message_lib  # pylint: disable=g-import-not-at-top
  example = _example_class()
  out = {name: np.empty((len(records), *f["shape"]), f["dtype"])
         for name, f in features.items()}
  for i, record in enumerate(records):
    try:
      feature = example.FromString(record).features.feature
    except message_lib.DecodeError as e:
      raise ValueError(f"query record {i} is not a tf.train.Example ({e}); "
                       "rebuild the cache.") from e
    for name, f in features.items():
      if name not in feature:
        raise ValueError(f"query record {i} lacks the feature {name!r} its "
                         "manifest lists; rebuild the cache.")
      kind = "float_list" if f["dtype"].startswith("float") else "int64_list"
      values = getattr(feature[name], kind).value
      if len(values) != out[name][i].size:
        raise ValueError(
            f"query record {i}: feature {name!r} holds {len(values)} "
            f"values, its manifest says shape {f['shape']}; rebuild the "
            "cache.")
      out[name][i] = np.asarray(values).reshape(f["shape"])
  return out


# -----------------------------------------------------------------------------
# Keyed permutations and shard assignment.
# -----------------------------------------------------------------------------


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def _mix64(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: a bijective 64-bit mix of a uint64 array
  (array products wrap silently, as wanted)."""
  x = (x ^ (x >> _S30)) * _M1
  x = (x ^ (x >> _S27)) * _M2
  return x ^ (x >> _S31)


def permute(index: np.ndarray, n, key) -> np.ndarray:
  """A keyed pseudo-random permutation of [0, n), evaluated pointwise.

  A 4-round Feistel network on the smallest even number of bits covering
  n, with cycle walking back into [0, n): a bijection of [0, n) for every
  key, computed without materialising it (so a shard of any size costs
  O(1) memory, where `np.random.permutation` would hold n int64s).

  Args:
    index: int array [m] of positions in [0, n).
    n: the domain size (>= 1), an int or an int array [m].
    key: 4 round keys: uint64 [4] or [m, 4].

  Returns:
    int64 [m]: the permuted positions.
  """
  x = np.array(index, np.uint64).reshape(-1)
  n = np.broadcast_to(np.asarray(n, np.uint64), x.shape)
  keys = np.broadcast_to(np.asarray(key, np.uint64), x.shape + (4,))
  bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(
      np.uint64)
  half = (bits + np.uint64(1)) // np.uint64(2)
  mask = (np.uint64(1) << half) - np.uint64(1)

  def feistel(v, half, mask, keys):
    left, right = v >> half, v & mask
    for r in range(4):
      left, right = right, left ^ (_mix64(right ^ keys[:, r]) & mask)
    return (left << half) | right

  todo = np.arange(len(x))
  while len(todo):  # cycle walking; expected < 4 rounds (the domain < 4n)
    x[todo] = feistel(x[todo], half[todo], mask[todo], keys[todo])
    todo = todo[x[todo] >= n[todo]]
  return x.astype(np.int64)


def _epoch_key(seed: int, shard: int, epoch: int) -> list[int]:
  return np.random.SeedSequence([seed, shard, epoch]).generate_state(
      4, np.uint64).tolist()


def in_dev_split(doc_hash: int, seed: int, dev_share: float) -> bool:
  """Whether document `doc_hash` (a query's `source_doc_hash`) is held out:
  a seeded hash of the document below `dev_share`, the same for every
  sentence of it, whatever file or worker it comes from."""
  if dev_share <= 0:
    return False
  h = _mix64(np.array([doc_hash], np.int64).view(np.uint64) ^ _dev_salt(seed))
  return float(h[0]) / 2.0**64 < dev_share


@functools.lru_cache(maxsize=8)
def _dev_salt(seed: int) -> np.uint64:
  return np.random.SeedSequence([seed, 0x6465765F]).generate_state(
      1, np.uint64)[0]


def output_shard(source_index: int, index_in_source: int, num_shards: int
                 ) -> int:
  """The cache shard of query `index_in_source` of annotated file
  `source_index`: a hash, so shards are even and hold every file."""
  h = _mix64(np.array([(source_index << 40) ^ index_in_source], np.uint64))
  return int(h[0] % np.uint64(num_shards))


# -----------------------------------------------------------------------------
# The manifest.
# -----------------------------------------------------------------------------


def held_out(cache_dir: str, what: str) -> str:
  """The cache a held-out measurement reads for `cache_dir`: its dev split
  `<cache_dir>/dev` when it has one, else `cache_dir` itself; the log says
  which (`what`: the setting, e.g. "GateConfig.queries")."""
  manifest = read_manifest(cache_dir)
  dev = manifest.get("dev")
  if isinstance(dev, dict) and dev.get("dir") == DEV_DIR:
    path = os.path.join(cache_dir, DEV_DIR)
    logging.info("%s: reading %s, the held-out dev split of %s (%s queries "
                 "of %s%% of its documents, never trained on).", what, path,
                 cache_dir, dev.get("num_queries"),
                 round(100 * float(dev.get("share", 0)), 2))
    return path
  logging.info(
      "%s: reading %s itself: it has no held-out dev split (a cache built "
      "with dev_share=0, or one given for the purpose). For a training "
      "cache that means training queries; the query-cache job holds out "
      "a dev split by default (QueryCacheConfig.dev_share).", what,
      cache_dir)
  return cache_dir


def read_manifest(cache_dir: str) -> dict[str, Any]:
  """Parses and checks `<cache_dir>/manifest.json` (`io_utils.read_manifest`:
  FileNotFoundError for no cache or manifest, ValueError for a corrupt or
  outdated one)."""

  def check(manifest):
    rows = [int(r) for r in manifest["shard_rows"]]
    for name in examples_lib.REALM_QUERY_FEATURES:
      np.dtype(manifest["features"][name]["dtype"])
      [int(d) for d in manifest["features"][name]["shape"]]  # pylint: disable=expression-not-assigned
    if len(rows) != int(manifest["num_shards"]) or min(rows, default=0) < 1:
      raise ValueError(f"shard_rows {rows} must list num_shards "
                       f"({manifest['num_shards']}) non-empty shards")
    if int(manifest.get("num_queries", -1)) != sum(rows):
      raise ValueError(f"num_queries {manifest.get('num_queries')} is not "
                       f"the sum of shard_rows ({sum(rows)})")

  return io_utils.read_manifest(
      cache_dir, what="query cache", format_version=FORMAT_VERSION,
      check=check, build="build it with `python -m realm_jax.jobs."
      "query_cache --gin_file=runs/query_cache.gin ...`")


def _open_shard(path: str, expected_rows: int):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  if not os.path.exists(path):
    raise FileNotFoundError(f"query cache shard {path} is missing; the "
                            "cache is incomplete: rebuild it.")
  try:
    reader = array_record_module.ArrayRecordReader(path, _READER_OPTIONS)
  except (RuntimeError, ValueError, OSError) as e:
    raise ValueError(f"query cache shard {path} is corrupt ({e}); rebuild "
                     "the cache.") from e
  if not reader.ok():
    # The reader opens anything and reports why only from close() (e.g.
    # "should be at least 64KB big" for a pickle put in a shard's place).
    try:
      reader.close()
      reason = "unreadable"
    except (RuntimeError, ValueError, OSError) as e:
      reason = str(e)
    raise ValueError(f"query cache shard {path} is not an ArrayRecord file "
                     f"({reason}); rebuild the cache.")
  if (found := reader.num_records()) != expected_rows:
    reader.close()
    raise ValueError(
        f"query cache shard {path} holds {found} queries, its manifest says "
        f"{expected_rows}: the shard and the manifest come from different "
        "builds; rebuild the cache.")
  return reader


# -----------------------------------------------------------------------------
# The reader.
# -----------------------------------------------------------------------------


class QueryStream:
  """This host's rows of each step's global batch of REALM queries.

  See the module docstring for the order. Attributes: `manifest`,
  `query_config` (the masking the cache was built with), `shards` (the
  shards this host reads).
  """

  def __init__(self, cache_dir: str, *, seed: int, batch_size: int,
               process_index: int = 0, process_count: int = 1):
    """Opens this host's shards of a cache written by `build_query_cache`.

    Args:
      cache_dir: the cache directory (local, or a mounted remote one).
      seed: the run's data seed (the epochs' permutations).
      batch_size: the GLOBAL batch size.
      process_index, process_count: this host and the number of hosts.

    Raises:
      FileNotFoundError: a missing cache, manifest or shard.
      ValueError: a corrupt cache, a shard that disagrees with the
        manifest, or a host count that divides neither the shard count nor
        the batch size.
    """
    if not io_utils.is_local(cache_dir):
      raise ValueError(
          f"query cache {cache_dir} is not on a local disk: ArrayRecord "
          "reads local files; copy the cache (or this host's shards) to a "
          "local disk or mount the bucket (gcsfuse).")
    self.cache_dir = os.fspath(cache_dir)
    self.manifest = read_manifest(self.cache_dir)
    num_shards = int(self.manifest["num_shards"])
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} is not in [0, "
                       f"{process_count}).")
    if num_shards % process_count:
      raise ValueError(
          f"{self.cache_dir} has {num_shards} shards, not a multiple of the "
          f"{process_count} hosts (each host reads whole shards); rebuild "
          "the cache with num_shards a multiple of the host count.")
    if num_shards > batch_size:
      raise ValueError(
          f"{self.cache_dir} has {num_shards} shards, more than the global "
          f"batch_size={batch_size} (every shard gives rows to every batch); "
          "rebuild the cache with num_shards <= the batch size.")
    if batch_size < 1 or batch_size % process_count:
      raise ValueError(f"batch_size={batch_size} must be a positive "
                       f"multiple of the {process_count} hosts.")
    self.seed, self.batch_size = int(seed), int(batch_size)
    self.process_index, self.process_count = process_index, process_count
    self.num_shards = num_shards
    self.shard_rows = np.asarray(self.manifest["shard_rows"], np.int64)
    self.features = {n: self.manifest["features"][n]
                     for n in examples_lib.REALM_QUERY_FEATURES}
    self.query_config = examples_lib.RealmQueryConfig(
        **self.manifest["query_config"])
    per_host = num_shards // process_count
    self.shards = list(range(process_index * per_host,
                             (process_index + 1) * per_host))
    self._readers = {k: self._open(k) for k in self.shards}
    self._keys: dict[tuple[int, int], np.ndarray] = {}

  def _open(self, k: int):
    return _open_shard(
        os.path.join(self.cache_dir, shard_name(k, self.num_shards)),
        int(self.shard_rows[k]))

  def __len__(self) -> int:
    return int(self.manifest["num_queries"])

  def check(self, query_config: examples_lib.RealmQueryConfig | None = None,
            vocab_sha256: str | None = None) -> None:
    """Raises ValueError unless the cache was built with these settings."""
    if query_config is not None and query_config != self.query_config:
      raise ValueError(
          f"{self.cache_dir} was built with {self.query_config}, the run "
          f"asks for {query_config}; rebuild the cache with the run's "
          "masking settings.")
    if vocab_sha256 is not None and vocab_sha256 != self.manifest[
        "vocab_sha256"]:
      raise ValueError(f"{self.cache_dir} was tokenized with another "
                       "vocabulary than the block store; rebuild it.")

  def _key(self, shard: int, epoch: int) -> np.ndarray:
    """Round keys of (shard, epoch), derived once (a few per step)."""
    key = self._keys.get((shard, epoch))
    if key is None:
      if len(self._keys) > 4 * len(self.shards):
        self._keys.clear()
      key = self._keys[shard, epoch] = np.asarray(
          _epoch_key(self.seed, shard, epoch), np.uint64)
    return key

  def _decode(self, records: Sequence[bytes]) -> dict[str, np.ndarray]:
    return decode_queries(records, self.features)

  def positions(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(shard, row) of this host's queries of global batch `step`, in order
    of global position."""
    b, n, hosts = self.batch_size, self.num_shards, self.process_count
    r = np.arange(self.process_index * b // hosts,
                  (self.process_index + 1) * b // hosts, dtype=np.int64)
    shard = r * n // b
    first = -(-shard * b // n)  # The shard's first row: ceil(k * B / N).
    count = -(-(shard + 1) * b // n) - first
    j = int(step) * count + (r - first)
    rows_k = self.shard_rows[shard]
    epoch, offset = j // rows_k, j % rows_k
    keys = np.stack([self._key(k, e) for k, e in zip(shard.tolist(),
                                                      epoch.tolist())])
    return shard, permute(offset, rows_k, keys)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This host's `batch_size / process_count` queries of step `step`.

    Returns:
      query_ids, query_mask [b, query_length] int32; mlm_positions,
      mlm_targets [b, max_masks] int32; mlm_weights [b, max_masks] float32;
      source_doc_hash [b] int64 (as `examples.realm_query`, stacked).
    """
    shard, row = self.positions(step)
    records: list[bytes] = [b""] * len(row)
    for k in np.unique(shard).tolist():
      at = np.flatnonzero(shard == k)
      for i, record in zip(at, self._readers[k].read(row[at].tolist())):
        records[i] = record
    return self._decode(records)

  def head(self, n: int) -> dict[str, np.ndarray]:
    """The first n queries of the cache in storage order (shard 0 first;
    every host gets the same ones). Each shard is sorted by (annotated
    file, index), so these are the first files' queries: for a sample of
    the corpus, use `sample`."""
    return self._read_per_shard(n, lambda k, take: (0, take))

  def sample(self, n: int) -> dict[str, np.ndarray]:
    """n distinct queries, a seeded sample of the cache (every host with
    the same seed gets the same ones): shard 0's first n elements of the
    stream's first epoch (`permute` of its rows), then shard 1's, ...
    Shards are hash-assigned over the annotated files, so shard 0 alone
    samples the whole corpus. For a one-shard cache these are exactly the
    first n queries the stream serves at this seed."""
    return self._read_per_shard(n, lambda k, take: (permute(
        np.arange(take), int(self.shard_rows[k]),
        self._key(k, 0)).tolist(),))

  def _read_per_shard(self, n: int, rows) -> dict[str, np.ndarray]:
    """min(n, len(self)) queries, `rows(k, take)`'s (the reader's `read`
    arguments) from shard k = 0, 1, ... until there are enough."""
    n = min(int(n), len(self))
    records: list[bytes] = []
    k = 0
    while len(records) < n:
      reader = self._readers.get(k) or self._open(k)
      take = min(n - len(records), int(self.shard_rows[k]))
      records += reader.read(*rows(k, take))
      if k not in self._readers:
        reader.close()
      k += 1
    return self._decode(records)

  def close(self) -> None:
    for reader in self._readers.values():
      reader.close()
    self._readers = {}


# -----------------------------------------------------------------------------
# Command line.
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class QueryCacheConfig:
  """The command line's `build_query_cache` (runs/query_cache.gin binds the
  paths).

  Attributes:
    annotated: glob pattern(s) of the annotated files, comma-separated.
    output_dir: the cache directory to create.
    query_config: how the queries are masked (query_length, max_masks,
      masking; REALM's 96/10/salient by default). It is written into the
      manifest, and the trainer takes it from there: bind
      `examples.RealmQueryConfig` once, in the experiment's gin file.
    num_shards: ArrayRecord shards. The trainer reads every shard in each
      step's batch, so it needs at most its global batch size, and a
      multiple of its host count (`QueryStream`); `DEFAULT_SHARDS` (8)
      suits any batch of at least 8 on up to 8 hosts.
    seed: the masking seed (and the dev split's).
    vocab_path: the wordpiece vocabulary (default: the bundled one).
    overwrite: replace an existing cache.
    dev_share: the share of documents held out as the cache's dev split
      (`<output_dir>/dev/`, one shard): their queries are never trained
      on, and the retriever gate and the recall guard read them
      (`held_out`). 0: no dev split.
  """
  annotated: str = checks.path_setting("reads")
  output_dir: str = checks.path_setting("writes", "query_cache")
  query_config: examples_lib.RealmQueryConfig = (
      examples_lib.RealmQueryConfig())
  num_shards: int = DEFAULT_SHARDS
  seed: int = 0
  vocab_path: str | None = checks.path_setting("reads", default=None)
  overwrite: bool = False
  dev_share: float = DEFAULT_DEV_SHARE

  def __post_init__(self):
    if self.num_shards < 1:
      raise ValueError(f"QueryCacheConfig.num_shards={self.num_shards} must "
                       "be >= 1.")
    if not 0 <= self.dev_share < 1:
      raise ValueError(f"QueryCacheConfig.dev_share={self.dev_share} must "
                       "be in [0, 1) (0: no dev split).")

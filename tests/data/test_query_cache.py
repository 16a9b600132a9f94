"""Tests of realm_jax.data.query_cache: the Beam job and QueryStream."""

import collections
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

from realm_jax.core import outputs
from realm_jax.data import blocks
from realm_jax.data import examples as ex
from realm_jax.data import query_cache as qc
from realm_jax.data import query_cache_writer as qcw
from realm_jax.data import salient_spans as ss
from realm_jax.data import tokenizer as tokenizer_lib
from realm_jax.testing import timeouts

CONFIG = ex.RealmQueryConfig()


def _fake_queries(first: int, n: int) -> list[dict[str, np.ndarray]]:
  """Queries whose source_doc_hash is a unique id (first, first+1, ...)."""
  out = []
  for i in range(first, first + n):
    rng = np.random.default_rng(i)
    out.append({
        "query_ids": rng.integers(0, 30000, 96).astype(np.int32),
        "query_mask": (np.arange(96) < 20).astype(np.int32),
        "mlm_positions": np.arange(1, 11, dtype=np.int32),
        "mlm_targets": rng.integers(0, 30000, 10).astype(np.int32),
        "mlm_weights": (np.arange(10) < 3).astype(np.float32),
        "source_doc_hash": np.int64(i),
    })
  return out


def write_fake_cache(path, rows_per_shard, seed=0):
  """A cache without Beam: shard k holds the given number of fake queries."""
  tmp = f"{path}.tmp"
  os.makedirs(tmp)
  stats, first = [], 0
  for k, n in enumerate(rows_per_shard):
    records = [(0, i, qc.encode_query(q))
               for i, q in enumerate(_fake_queries(first, n))]
    first += n
    stats.append(qcw.write_shard((k, records), tmp_dir=tmp,
                                 num_shards=len(rows_per_shard)))
  return qcw.finish_cache(tmp, str(path), stats,
                          num_shards=len(rows_per_shard), query_config=CONFIG,
                          seed=seed, vocab_sha256="0" * 64,
                          source_files=["fake"])


@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory):
  path = tmp_path_factory.mktemp("fake") / "cache"
  write_fake_cache(path, [13, 11, 12, 9])
  return str(path)


def _ids(batch):
  return batch["source_doc_hash"].tolist()


def test_permute_is_a_bijection():
  for n in (1, 2, 3, 7, 64, 1000, 4097):
    for key in ([1, 2, 3, 4], [5, 6, 7, 8]):
      assert sorted(qc.permute(np.arange(n), n, key).tolist()) == list(
          range(n))
  # Two epochs' orders agree no more than chance does.
  a = qc.permute(np.arange(1000), 1000, qc._epoch_key(0, 0, 0))
  b = qc.permute(np.arange(1000), 1000, qc._epoch_key(0, 0, 1))
  assert np.mean(a == b) < 0.01


def test_batch_shapes_dtypes_and_head(fake_cache):
  stream = qc.QueryStream(fake_cache, seed=3, batch_size=8)
  assert len(stream) == 45
  batch = stream.batch(0)
  expected = {"query_ids": (np.int32, (8, 96)),
              "query_mask": (np.int32, (8, 96)),
              "mlm_positions": (np.int32, (8, 10)),
              "mlm_targets": (np.int32, (8, 10)),
              "mlm_weights": (np.float32, (8, 10)),
              "source_doc_hash": (np.int64, (8,))}
  assert {k: (v.dtype.type, v.shape) for k, v in batch.items()} == expected
  # Rows decode to what was written.
  queries = {int(q["source_doc_hash"]): q for q in _fake_queries(0, 45)}
  for i, doc in enumerate(_ids(batch)):
    for name in expected:
      np.testing.assert_array_equal(batch[name][i], queries[doc][name])
  head = stream.head(20)
  assert _ids(head) == list(range(20))  # shard 0 (13 rows), then shard 1
  assert len(_ids(stream.head(100))) == 45
  assert stream.query_config == CONFIG
  stream.check(query_config=CONFIG)
  with pytest.raises(ValueError, match="masking settings"):
    stream.check(query_config=ex.RealmQueryConfig(masking="random_spans"))


def test_sample_is_the_streams_first_epoch_not_the_storage_order(
    fake_cache, tmp_path):
  """`sample` draws shard by shard in the stream's epoch-0 order (a seeded
  sample of every file), where `head` reads each shard from its start."""
  stream = qc.QueryStream(fake_cache, seed=3, batch_size=8)
  key = qc._epoch_key(3, 0, 0)  # Shard 0 holds ids 0-12, shard 1 13-23.
  expected = qc.permute(np.arange(13), 13, key).tolist() + (
      13 + qc.permute(np.arange(7), 11, qc._epoch_key(3, 1, 0))).tolist()
  assert _ids(stream.sample(20)) == expected
  assert _ids(stream.sample(20)) != list(range(20))
  assert sorted(_ids(stream.sample(100))) == list(range(45))
  assert _ids(qc.QueryStream(fake_cache, seed=4, batch_size=8).sample(5)) != (
      expected[:5])
  # One shard: the first n queries the run streams at that seed.
  one = str(tmp_path / "one")
  write_fake_cache(one, [40])
  stream = qc.QueryStream(one, seed=7, batch_size=1)
  streamed = [_ids(stream.batch(s))[0] for s in range(25)]
  assert _ids(stream.sample(25)) == streamed
  for name, value in stream.sample(25).items():
    np.testing.assert_array_equal(
        value, np.concatenate([stream.batch(s)[name] for s in range(25)]))


def test_deterministic_by_step_and_resume(fake_cache):
  a = qc.QueryStream(fake_cache, seed=1, batch_size=8)
  steps = [_ids(a.batch(s)) for s in range(12)]
  b = qc.QueryStream(fake_cache, seed=1, batch_size=8)  # a restarted run
  assert [_ids(b.batch(s)) for s in (7, 3, 11)] == [steps[7], steps[3],
                                                     steps[11]]
  c = qc.QueryStream(fake_cache, seed=2, batch_size=8)
  assert [_ids(c.batch(s)) for s in range(12)] != steps


@pytest.mark.parametrize("batch_size", [8, 12])
def test_same_global_batches_for_any_host_count(fake_cache, batch_size):
  def global_batches(hosts):
    streams = [qc.QueryStream(fake_cache, seed=5, batch_size=batch_size,
                              process_index=h, process_count=hosts)
               for h in range(hosts)]
    assert sorted(k for s in streams for k in s.shards) == [0, 1, 2, 3]
    out = []
    for step in range(10):
      parts = [_ids(s.batch(step)) for s in streams]
      assert all(len(p) == batch_size // hosts for p in parts)
      # Row for row: host h's rows are block h of the global batch, so an
      # example lands on the same device whatever the host count.
      out.append([i for p in parts for i in p])
    return out

  one = global_batches(1)
  assert global_batches(2) == one
  assert global_batches(4) == one
  # Every query once per epoch: 10 steps cover the 4 shards evenly.
  assert len({i for batch in one for i in batch}) > batch_size


def test_epochs_wrap_per_shard(fake_cache):
  # Batch 8 over 4 shards: 2 rows of each shard per step. Shard 3 (9 rows,
  # ids 36..44) wraps after 4.5 steps; every epoch is a permutation.
  stream = qc.QueryStream(fake_cache, seed=0, batch_size=8)
  seen = [i for s in range(18) for i in _ids(stream.batch(s)) if i >= 36]
  assert len(seen) == 36
  epochs = [seen[e * 9:(e + 1) * 9] for e in range(4)]
  assert all(sorted(e) == list(range(36, 45)) for e in epochs)
  assert len({tuple(e) for e in epochs}) == 4  # a new order each epoch


def test_reader_errors(fake_cache, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    qc.QueryStream(str(tmp_path / "nope"), seed=0, batch_size=8)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
    qc.QueryStream(str(tmp_path / "empty"), seed=0, batch_size=8)
  with pytest.raises(ValueError, match="not a multiple of the 3 hosts"):
    qc.QueryStream(fake_cache, seed=0, batch_size=6, process_count=3)
  with pytest.raises(ValueError, match="multiple of the 2 hosts"):
    qc.QueryStream(fake_cache, seed=0, batch_size=7, process_count=2)

  broken = tmp_path / "broken"
  write_fake_cache(broken, [3, 4])
  manifest = json.loads((broken / "manifest.json").read_text())
  # A shard from another build: the counts disagree.
  manifest["shard_rows"] = [4, 3]
  (broken / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(ValueError, match=r"00000-of-00002.*holds 3 queries.*"
                     "manifest says 4"):
    qc.QueryStream(str(broken), seed=0, batch_size=2)
  manifest["shard_rows"] = [3, 4]
  manifest["format_version"] = 99
  (broken / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(ValueError, match="format_version"):
    qc.QueryStream(str(broken), seed=0, batch_size=2)
  (broken / "manifest.json").write_text("{not json")
  with pytest.raises(ValueError, match="corrupt"):
    qc.QueryStream(str(broken), seed=0, batch_size=2)
  manifest["format_version"] = qc.FORMAT_VERSION
  (broken / "manifest.json").write_text(json.dumps(manifest))
  os.remove(broken / qc.shard_name(1, 2))
  with pytest.raises(FileNotFoundError, match="00001-of-00002.*missing"):
    qc.QueryStream(str(broken), seed=0, batch_size=2)
  # Host 0 of 2 reads shard 0 only, so it opens.
  qc.QueryStream(str(broken), seed=0, batch_size=2, process_count=2)


def test_a_pickle_in_place_of_a_shard_fails_at_open_naming_it(tmp_path):
  cache = tmp_path / "cache"
  write_fake_cache(cache, [3, 4])
  shard = cache / qc.shard_name(1, 2)
  shard.write_bytes(pickle.dumps({"rows": list(range(4))}))
  # It used to fail in the reader's close(), with no file name.
  with pytest.raises(ValueError, match=r"00001-of-00002.array_record is "
                     "not an ArrayRecord file"):
    qc.QueryStream(str(cache), seed=0, batch_size=2)


# -------------------------------------------------------- the Beam job ----


def _document(k: int) -> ss.AnnotatedDocument:
  """An article of 3 sentences; the first two have salient spans."""
  sentences = [(f"Person{k} Smith was born in City{k} in {1800 + k}.",
                [f"Person{k} Smith", f"City{k}", f"{1800 + k}"]),
               (f"The river Flow{k} runs through the valley.", [f"Flow{k}"]),
               ("Nothing salient happens here.", [])]
  text = " ".join(s for s, _ in sentences)
  data = text.encode()
  s_starts, s_limits, p_starts, p_limits = [], [], [], []
  for sentence, subs in sentences:
    start = data.index(sentence.encode())
    s_starts.append(start)
    s_limits.append(start + len(sentence.encode()))
    for sub in subs:
      p = start + sentence.encode().index(sub.encode())
      p_starts.append(p)
      p_limits.append(p + len(sub.encode()))
  return ss.AnnotatedDocument(f"Article {k}", text, tuple(s_starts),
                              tuple(s_limits), tuple(p_starts),
                              tuple(p_limits))


@pytest.fixture(scope="module")
def annotated(tmp_path_factory):
  root = tmp_path_factory.mktemp("annotated")
  docs = [_document(k) for k in range(24)]
  ss.write_annotated(str(root / "part-0.tfr.gz"), docs[:10])
  ss.write_annotated(str(root / "part-1.tfr.gz"), docs[10:])
  return root


@pytest.fixture(scope="module")
def beam_cache(annotated, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("beam") / "cache")
  manifest = qcw.build_query_cache(str(annotated / "part-*.tfr.gz"), out,
                                   num_shards=4, seed=7)
  return out, manifest


def test_beam_job_end_to_end(beam_cache, annotated):
  out, manifest = beam_cache
  tok = tokenizer_lib.Tokenizer()
  assert manifest["num_queries"] == 48  # 2 sentences with spans x 24
  assert sorted(os.listdir(out)) == sorted(manifest["shard_files"] + [
      "manifest.json", outputs.MARKER])
  assert not [p for p in os.listdir(os.path.dirname(out)) if ".tmp-" in p]
  assert manifest["query_config"] == {
      "query_length": 96, "max_masks": 10, "mask_limit": 94,
      "masking": "salient", "random_token_rate": 0.15, "span_length_p": 0.2}
  assert manifest["source_files"] == [str(annotated / "part-0.tfr.gz"),
                                      str(annotated / "part-1.tfr.gz")]
  with open(tok.vocab_path, "rb") as f:
    assert manifest["vocab_sha256"] == hashlib.sha256(f.read()).hexdigest()
  stream = qc.QueryStream(out, seed=0, batch_size=8)
  queries = stream.head(48)
  sentences = {}  # doc hash -> the wordpieces of its sentences with spans
  for k in range(24):
    doc = _document(k)
    texts = [s.decode() for _, s, spans in doc.sentences_with_spans()
             if spans]
    sentences[blocks.title_hash(doc.title)] = {
        tuple(ids.tolist()) for ids, _, _ in tok.tokenize_with_offsets(texts)}
  assert collections.Counter(queries["source_doc_hash"].tolist()) == {
      h: 2 for h in sentences}
  restored_all = collections.Counter()
  for i in range(48):
    n = int(queries["mlm_weights"][i].sum())
    assert 1 <= n <= 10
    positions = queries["mlm_positions"][i][:n]
    assert (queries["query_ids"][i][positions] == tok.mask_id).all()
    restored = queries["query_ids"][i].copy()
    restored[positions] = queries["mlm_targets"][i][:n]
    length = int(queries["query_mask"][i].sum())
    assert restored[0] == tok.cls_id and restored[length - 1] == tok.sep_id
    doc_hash = int(queries["source_doc_hash"][i])
    assert tuple(restored[1:length - 1].tolist()) in sentences[doc_hash]
    restored_all[(doc_hash, tuple(restored[1:length - 1].tolist()))] += 1
  assert len(restored_all) == 48  # every sentence with a span, once


def test_beam_job_is_deterministic(beam_cache, annotated, tmp_path):
  """The same files give the same masks wherever they are stored (seqio
  seeds a file's masks from the task name, which must not hold a path)."""
  out, manifest = beam_cache
  moved = tmp_path / "elsewhere"
  shutil.copytree(annotated, moved)
  again = qcw.build_query_cache(str(moved / "part-*.tfr.gz"),
                                str(tmp_path / "again"), num_shards=4, seed=7)
  assert again["shard_rows"] == manifest["shard_rows"]
  for name in manifest["shard_files"]:
    with open(os.path.join(out, name), "rb") as a, open(
        tmp_path / "again" / name, "rb") as b:
      assert a.read() == b.read()


@pytest.fixture(scope="module")
def job_cache(annotated, tmp_path_factory):
  """The command line's cache of the 24 articles, with the job's defaults
  but for the masking and shard count: (cache dir, the job's stderr)."""
  gin_file = os.path.join(os.path.dirname(__file__), "..", "..",
                          "gin_configs", "runs", "query_cache.gin")
  with open(gin_file, encoding="utf-8") as f:
    assert "realm_jax.training" not in f.read()
  tmp_path = tmp_path_factory.mktemp("job")
  out = tmp_path / "cache"
  result = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.query_cache",
       f"--gin.ANNOTATED='{annotated}/part-*.tfr.gz'",
       f"--gin.OUTPUT_DIR='{out}'",
       "--gin.RealmQueryConfig.query_length=32",
       "--gin.RealmQueryConfig.max_masks=2",
       "--gin.QueryCacheConfig.num_shards=4",
       "--direct_num_workers=1"],  # a Beam option
      capture_output=True, text=True, cwd=tmp_path, check=False,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
      timeout=timeouts.HANG_SECONDS)
  assert result.returncode == 0, result.stderr[-2000:]
  return str(out), result


def test_command_line_masks_as_bound_and_the_trainer_reads_it(job_cache):
  """The masking is examples.RealmQueryConfig's gin binding, written into
  the manifest; the trainer's stream reads it from there. The job finds
  runs/query_cache.gin itself, which imports nothing from training/."""
  out, result = job_cache
  assert "realm_jax.training" not in result.stderr
  for hosts in (1, 2, 4):
    stream = qc.QueryStream(out, seed=0, batch_size=4,
                            process_count=hosts)
    assert stream.query_config == ex.RealmQueryConfig(
        query_length=32, max_masks=2, mask_limit=30)
    assert stream.batch(0)["query_ids"].shape == (4 // hosts, 32)
    stream.close()
  assert stream.manifest["num_shards"] == 4


def _doc_hashes(cache):
  stream = qc.QueryStream(cache, seed=0,
                          batch_size=qc.read_manifest(cache)["num_shards"])
  try:
    return collections.Counter(
        stream.head(len(stream))["source_doc_hash"].tolist())
  finally:
    stream.close()


def test_the_job_holds_out_a_dev_split_of_whole_documents(job_cache):
  """By default the job writes the training cache and, in its `dev/`, a
  one-shard cache of the queries of a seeded 5% of the documents: every
  query is in one of them, and no document in both."""
  out, result = job_cache
  manifest = qc.read_manifest(out)
  dev = os.path.join(out, qc.DEV_DIR)
  assert manifest["dev"] == {"dir": "dev", "share": qc.DEFAULT_DEV_SHARE,
                             "num_queries": qc.read_manifest(dev)[
                                 "num_queries"]}
  assert json.loads(result.stdout.strip().splitlines()[-1])[
      "dev_queries"] == manifest["dev"]["num_queries"]
  train, held = _doc_hashes(out), _doc_hashes(dev)
  assert not set(train) & set(held)
  everything = {blocks.title_hash(f"Article {k}") for k in range(24)}
  assert set(train) | set(held) == everything
  assert sum(train.values()) + sum(held.values()) == 48  # nothing lost
  # The split is the documents' seeded hash (5 of these 24 at seed 0).
  assert set(held) == {h for h in everything
                       if qc.in_dev_split(h, 0, qc.DEFAULT_DEV_SHARE)}
  assert len(held) == 5
  assert qc.read_manifest(dev)["split"] == "dev"


def test_the_utility_gate_and_the_recall_guard_read_the_dev_split(
    job_cache, beam_cache, caplog):
  """Pointed at a cache with a dev split (runs/pretrain.gin binds both to
  QUERIES), the utility gate and the recall guard read its held-out
  queries, and say so; the evidence gate reads the training queries (its
  signal is the retriever's own gradient). At a cache without a dev split
  (built with dev_share=0) they read the cache itself, and the log says
  that it has none."""
  import logging  # pylint: disable=g-import-not-at-top
  from realm_jax.training import gate, pretrain_config, recall_guard  # pylint: disable=g-import-not-at-top
  out, _ = job_cache
  query_config = ex.RealmQueryConfig(**qc.read_manifest(out)["query_config"])
  held = _doc_hashes(os.path.join(out, qc.DEV_DIR))
  utility = pretrain_config.GateConfig(
      mode="utility", latest_release=None, queries=out, num_queries=2048)
  guard = pretrain_config.RecallGuardConfig(queries=out, num_queries=1024)
  with caplog.at_level(logging.INFO):
    read = [gate._gate_queries(utility, query_config, 0),  # pylint: disable=protected-access
            recall_guard._sentences(guard, query_config, 0)]  # pylint: disable=protected-access
  for queries in read:
    assert collections.Counter(
        queries["source_doc_hash"].tolist()) == held
  said = [r.getMessage() for r in caplog.records]
  for what in ("GateConfig.queries", "RecallGuardConfig.queries"):
    assert any(m.startswith(f"{what}: reading {out}/dev, the held-out dev "
                            f"split of {out}") for m in said), said
  evidence = dataclasses.replace(utility, mode="evidence")
  trained = gate._gate_queries(evidence, query_config, 0)  # pylint: disable=protected-access
  assert collections.Counter(
      trained["source_doc_hash"].tolist()) == _doc_hashes(out)
  caplog.clear()
  no_dev, _ = beam_cache
  with caplog.at_level(logging.INFO):
    queries = gate._gate_queries(dataclasses.replace(  # pylint: disable=protected-access
        utility, queries=no_dev, num_queries=16), CONFIG, 0)
  assert len(queries["query_ids"]) == 16
  assert any(r.getMessage().startswith(
      f"GateConfig.queries: reading {no_dev} itself: it has no held-out dev "
      "split") for r in caplog.records)


def test_query_config_defaults_and_shard_count():
  # mask_limit follows query_length: two positions of room before [SEP].
  assert ex.RealmQueryConfig().mask_limit == 94
  assert ex.RealmQueryConfig(query_length=48).mask_limit == 46
  config = qc.QueryCacheConfig(annotated="a", output_dir="o")
  assert config.num_shards == qc.DEFAULT_SHARDS == 8
  assert config.query_config == ex.RealmQueryConfig()
  with pytest.raises(ValueError, match="num_shards=0 must be >= 1"):
    qc.QueryCacheConfig(annotated="a", output_dir="o", num_shards=0)
  assert config.dev_share == qc.DEFAULT_DEV_SHARE == 0.05
  with pytest.raises(ValueError, match=r"dev_share=1.0 must be in \[0, 1\)"):
    qc.QueryCacheConfig(annotated="a", output_dir="o", dev_share=1.0)


@pytest.mark.parametrize("batch_size", [8, 12, 24, 512])
def test_the_default_shards_open_on_every_host_count(tmp_path, batch_size):
  """A cache of the default 8 shards opens in QueryStream with a batch of
  at least 8 on 1, 2, 4 or 8 hosts (those that divide the batch), and each
  host reads its share of every step's global batch."""
  write_fake_cache(tmp_path / "c", [2] * qc.DEFAULT_SHARDS)
  hosts_tried = [h for h in (1, 2, 4, 8) if batch_size % h == 0]
  assert len(hosts_tried) >= 3
  for hosts in hosts_tried:
    stream = qc.QueryStream(str(tmp_path / "c"), seed=0,
                            batch_size=batch_size, process_count=hosts,
                            process_index=hosts - 1)
    try:
      assert len(stream.batch(0)["query_ids"]) == batch_size // hosts
    finally:
      stream.close()


def test_beam_job_errors(beam_cache, annotated, tmp_path):
  out, _ = beam_cache
  pattern = str(annotated / "part-*.tfr.gz")
  with pytest.raises(FileExistsError, match="already exists"):
    qcw.build_query_cache(pattern, out, num_shards=4)
  with pytest.raises(FileNotFoundError, match="no annotated file matches"):
    qcw.build_query_cache(str(tmp_path / "none-*"), str(tmp_path / "c"))
  bad = tmp_path / "bad.tfr"
  bad.write_bytes(b"this is not a TFRecord file" * 10)
  with pytest.raises(Exception, match="bad.tfr: not a readable annotated"):
    qcw.build_query_cache(str(bad), str(tmp_path / "c"))
  with pytest.raises(ValueError, match="shards got no query"):
    qcw.build_query_cache(str(annotated / "part-0.tfr.gz"),
                          str(tmp_path / "c"), num_shards=64)
  # Nothing half-written is left behind.
  assert not [p for p in os.listdir(tmp_path) if p.startswith("c")]


def test_decoding_matches_tensorflow_parse_example():
  """The protobuf-only decoder reads what TensorFlow's parser reads, value
  for value (negative and 64-bit ints, float32 weights)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  queries = _fake_queries(0, 5)
  queries[1]["source_doc_hash"] = np.int64(-(2**62) - 7)
  queries[2]["mlm_weights"] = np.asarray(
      [0.1, 1 / 3, -2.5, 1e-30, 3e38, 0, 0, 0, 0, 0], np.float32)
  records = [qc.encode_query(q) for q in queries]
  features = qc.query_features(CONFIG)
  got = qc.decode_queries(records, features)
  want = tf.io.parse_example(tf.constant(records), {
      name: tf.io.FixedLenFeature(
          f["shape"],
          tf.float32 if f["dtype"].startswith("float") else tf.int64)
      for name, f in features.items()})
  for name, f in features.items():
    assert got[name].dtype == np.dtype(f["dtype"]), name
    np.testing.assert_array_equal(
        got[name], want[name].numpy().astype(f["dtype"]), err_msg=name)
  assert got["source_doc_hash"][1] == -(2**62) - 7


def test_decoding_errors_name_the_record_and_feature():
  features = qc.query_features(CONFIG)
  good = qc.encode_query(_fake_queries(0, 1)[0])
  with pytest.raises(ValueError, match="query record 1 is not a "
                     "tf.train.Example"):
    qc.decode_queries([good, b"\xff\xff not a proto"], features)
  short = dict(features, mlm_targets={"dtype": "int32", "shape": [11]})
  with pytest.raises(ValueError, match=r"record 0: feature 'mlm_targets' "
                     r"holds 10 values, its manifest says shape \[11\]"):
    qc.decode_queries([good], short)
  extra = dict(features, answer={"dtype": "int32", "shape": [1]})
  with pytest.raises(ValueError, match="record 0 lacks the feature "
                     "'answer'"):
    qc.decode_queries([good], extra)


def test_the_trainer_reads_a_cache_without_tensorflow(fake_cache):
  """An accelerator host without TensorFlow (or spaCy, Beam) still reads
  the query cache: the same batch as here, in a process where importing
  them fails."""
  code = f"""
import importlib.abc, importlib.util, sys
ABSENT = ("tensorflow", "spacy", "apache_beam", "seqio")
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: (
    None if name.split(".")[0] in ABSENT else find_spec(name, *a))
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in ABSENT:
      raise ModuleNotFoundError(name, name=name)
sys.meta_path.insert(0, Block())
from realm_jax.data import query_cache as qc
batch = qc.QueryStream({fake_cache!r}, seed=0, batch_size=8).batch(3)
assert "tensorflow" not in sys.modules
print(batch["source_doc_hash"].tolist())
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=False,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
  assert out.returncode == 0, out.stderr[-2000:]
  want = qc.QueryStream(fake_cache, seed=0, batch_size=8).batch(3)
  assert json.loads(out.stdout.strip().splitlines()[-1]) == _ids(want)

"""The Beam jobs on a Dask cluster (`--runner=dask`, realm_jax.data.beam_dask).

A local cluster of 2 worker processes (1 thread each, on 127.0.0.1) runs
the corpus, annotation and query-cache jobs; each output equals the
DirectRunner's: the data files byte for byte (so also the shard layout,
which the query cache's reader depends on: shard k's row order drives its
keyed permutation), the manifests and reports but for times, dates and the
runner's name. The runner's own test (a toy pipeline) is in the default
suite; the jobs' comparisons, whose workers first import TensorFlow and
spaCy, are in the slow tier.
"""

import bz2
import collections
import json
import os
import subprocess
import sys
import time
import uuid

import apache_beam as beam
from apache_beam.options import pipeline_options
from apache_beam.transforms import window
from apache_beam.utils import windowed_value
import distributed
import psutil
import pytest

from realm_jax.data import annotate_job
from realm_jax.data import beam_dask
from realm_jax.data import beam_utils
from realm_jax.data import block_store
from realm_jax.data import corpus_job
from realm_jax.data import query_cache, query_cache_writer
from realm_jax.data import salient_spans
from realm_jax.testing import timeouts

# What may differ between two runs of a job: when and by what it ran.
_VOLATILE = {"created", "time", "build_seconds", "annotation_seconds",
             "sentences_per_second", "runner", "written_by"}


@pytest.fixture(scope="module")
def cluster():
  """A local Dask cluster: 2 worker processes of 1 thread, on 127.0.0.1."""
  with beam_dask.local_cluster(2) as c, distributed.Client(c) as client:
    client.wait_for_workers(2, timeout=120)
    yield c, client


def _dask(cluster_and_client):
  return ["--runner=dask",
          f"--dask_client_address={cluster_and_client[0].scheduler_address}"]


def _files(directory) -> dict[str, bytes]:
  """Every file under `directory` (relative path -> bytes), JSON files
  without their volatile fields."""
  found = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        data = f.read()
      if name.endswith(".json"):
        data = json.loads(data)
        for key in ("manifest", None) if isinstance(data, dict) else ():
          part = data.get(key, {}) if key else data
          for volatile in _VOLATILE & set(part):
            part[volatile] = "*"
      found[os.path.relpath(path, directory)] = data
  return found


def _tiny_dump(path, n):
  """A bz2 dump of n short pages with names, places and dates (spaCy's
  salient spans) and markup to remove."""
  pages = "".join(
      f"<page><title>Page {i}</title><ns>0</ns><revision><text>"
      f"'''Page {i}''' is about [[topic {i}]].{{{{cite}}}} Anna Berg met "
      f"Paul Roth in Paris in {1900 + i}. It has {i} facts.</text>"
      "</revision></page>" for i in range(n))
  with bz2.open(path, "wt") as f:
    f.write(f"<mediawiki>{pages}</mediawiki>")
  return str(path)


# ----------------------------------------------------------------- runner


class _CountFn(beam.DoFn):
  """Passes nothing on; emits its bundle's count from finish_bundle (Beam's
  Dask translation dropped such outputs)."""

  def start_bundle(self):
    self.count = 0

  def process(self, element):
    del element
    self.count += 1
    return []

  def finish_bundle(self):
    yield windowed_value.WindowedValue(self.count, 0,
                                       [window.GlobalWindow()])


def _slow_pid(i, directory):
  """(i % 4, (i, this process)), noting the call in `directory`."""
  with open(os.path.join(directory, "calls.txt"), "a") as f:
    f.write(f"{i}\n")
  time.sleep(0.02)
  return i % 4, (i, os.getpid())


def _write_group(item, directory):
  k, values = item
  with open(os.path.join(directory, f"group-{k}.json"), "w") as f:
    json.dump(sorted(i for i, _ in values), f)
  with open(os.path.join(directory, f"pids-{k}.json"), "w") as f:
    json.dump(sorted({pid for _, pid in values}), f)


def _write_total(total, directory):
  with open(os.path.join(directory, "total.json"), "w") as f:
    json.dump(total, f)


def _toy(pipeline_args, directory):
  """One element fanned out to 40 (as the jobs' sequential reads), two
  sinks: 4 groups' files, and the total that finish_bundle counted."""
  os.makedirs(directory)
  pipeline, _ = beam_utils.pipeline(pipeline_args)
  with pipeline:
    items = (pipeline
             | beam.Create(["input"])
             | beam.FlatMap(lambda _: range(40))
             | beam.Reshuffle()
             | beam.Map(_slow_pid, directory))
    _ = (items
         | "Group" >> beam.GroupByKey()
         | "WriteGroups" >> beam.Map(_write_group, directory))
    _ = (items
         | "Count" >> beam.ParDo(_CountFn())
         | "Sum" >> beam.CombineGlobally(sum).without_defaults()
         | "WriteTotal" >> beam.Map(_write_total, directory))


def test_runner_spreads_the_work_runs_every_sink_and_refuses_the_rest(
    cluster, tmp_path):
  """`--runner=dask`: the toy pipeline's files are the DirectRunner's; its
  one input element's fan-out ran on both workers, once; both sinks ran;
  what Beam's Dask translation would run wrong is refused by name, and a
  worker's error reaches the caller."""
  _toy([], str(tmp_path / "direct"))
  _toy(_dask(cluster), str(tmp_path / "dask"))
  direct, dask = (_files(tmp_path / d) for d in ("direct", "dask"))

  def outputs(files):  # what does not depend on the processes
    return {k: v for k, v in files.items()
            if not k.startswith(("pids-", "calls"))}

  assert outputs(dask) == outputs(direct)
  assert outputs(dask)["total.json"] == 40 and len(outputs(dask)) == 5
  for files in (direct, dask):  # The step both sinks read ran once each.
    assert sorted(map(int, files["calls.txt"].split())) == list(range(40))
  pids = {pid for name, value in dask.items() if name.startswith("pids-")
          for pid in value}
  workers = set(cluster[1].run(os.getpid).values())
  assert pids == workers and len(workers) == 2

  def pipeline():
    return beam.Pipeline(options=pipeline_options.PipelineOptions(
        _dask(cluster) + ["--runner=" + beam_dask.RUNNER]))

  with pytest.raises(NotImplementedError, match=r"Split.*: a DoFn with "
                     r"several outputs .* not supported by the Dask runner"):
    with pipeline() as p:
      _ = (p | beam.Create([1]) | "Split" >> beam.FlatMap(
          lambda x: [x, beam.pvalue.TaggedOutput("odd", x)]).with_outputs(
              "odd", main="all"))
  (tmp_path / "in.txt").write_text("a\n")
  with pytest.raises(NotImplementedError, match="not supported by the Dask"):
    with pipeline() as p:
      _ = p | beam.io.ReadFromText(str(tmp_path / "in.txt"))

  def fail(x):
    raise ValueError(f"element {x} is bad")

  with pytest.raises(ValueError, match="element 3 is bad"):
    with pipeline() as p:
      _ = p | beam.Create([3]) | beam.Map(fail)


def test_dask_runner_flags_are_beam_options(monkeypatch):
  """The command line takes the Dask runner's flags (gin_cli refuses what
  Beam would drop); without dask, --runner=dask says what to install."""
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  assert gin_cli.beam_unknown_args([
      "--runner=dask", "--dask_client_address=tcp://127.0.0.1:8786",
      "--dask_workers=2", "--dask_npartitions=8", "--dask_wrkers=2"]) == [
          "--dask_wrkers=2"]
  assert beam_utils.pipeline(["--runner=Dask"])[1] == "DaskRunner"
  assert beam_utils.pipeline([])[1] == "DirectRunner"
  monkeypatch.setattr(beam_dask, "_MISSING",
                      ImportError("No module named 'distributed'"))
  with pytest.raises(ImportError, match=r"pip install -e \"\.\[dask\]\""):
    beam_utils.pipeline(["--runner=dask"])


# ------------------------------------------------------------------- jobs


@pytest.mark.slow
def test_corpus_job_on_dask_writes_the_directrunner_store(cluster, tmp_path):
  dump = _tiny_dump(tmp_path / "dump.xml.bz2", 30)
  stores = {}
  for name, args in (("direct", []), ("dask", _dask(cluster))):
    start = time.perf_counter()
    stores[name], _ = corpus_job.build_corpus(
        input_path=dump, output_dir=str(tmp_path / name),
        documents_per_chunk=4, pipeline_args=args)
    print(f"corpus job, 30 pages, {name}: "
          f"{time.perf_counter() - start:.1f} s")
  assert stores["dask"].fingerprint == stores["direct"].fingerprint
  assert len(stores["dask"]) == len(stores["direct"]) >= 30
  assert _files(tmp_path / "dask") == _files(tmp_path / "direct")
  block_store.BlockStore.open(str(tmp_path / "dask"))


@pytest.mark.slow
def test_annotation_and_query_cache_on_dask_equal_the_directrunner(
    cluster, tmp_path):
  """spaCy loads in the Dask workers; the annotated shards, then the query
  cache built from them (3 annotated files: one element each), are the
  DirectRunner's, file for file."""
  dump = _tiny_dump(tmp_path / "dump.xml.bz2", 24)
  reports = {}
  for name, args in (("direct", []), ("dask", _dask(cluster))):
    start = time.perf_counter()
    reports[name] = annotate_job.annotate_corpus(
        dump, str(tmp_path / "annotated" / name), num_shards=3,
        pipeline_args=args)
    print(f"annotation job, 24 pages, {name}: "
          f"{time.perf_counter() - start:.1f} s")
  assert reports["dask"]["runner"] == "DaskRunner"
  assert reports["dask"]["documents"] == 24
  direct, dask = (_files(tmp_path / "annotated" / n)
                  for n in ("direct", "dask"))
  assert dask == direct  # every shard byte for byte (the same layout)

  def documents(name):  # the annotated documents, as a multiset
    return collections.Counter(salient_spans.read_annotated(
        str(tmp_path / "annotated" / name / "*.tfr.gz"), strict=True))

  assert documents("dask") == documents("direct")
  assert sum(documents("dask").values()) == 24
  manifests = {}
  for name, args in (("direct", []), ("dask", _dask(cluster))):
    start = time.perf_counter()
    manifests[name] = query_cache_writer.build_query_cache(
        str(tmp_path / "annotated" / "direct" / "*.tfr.gz"),
        str(tmp_path / "queries" / name), num_shards=2, dev_share=0.2,
        pipeline_args=args)
    print(f"query-cache job, 3 files, {name}: "
          f"{time.perf_counter() - start:.1f} s")
  assert manifests["dask"]["num_queries"] == manifests["direct"][
      "num_queries"] > 12
  assert manifests["dask"]["dev"] == manifests["direct"]["dev"]
  assert manifests["dask"]["shard_rows"] == manifests["direct"]["shard_rows"]
  assert _files(tmp_path / "queries" / "dask") == _files(
      tmp_path / "queries" / "direct")
  streams = [query_cache.QueryStream(str(tmp_path / "queries" / n), seed=3,
                                     batch_size=4) for n in ("direct",
                                                             "dask")]
  for step in range(3):
    a, b = (s.batch(step) for s in streams)
    assert all((a[f] == b[f]).all() for f in a)


@pytest.mark.slow
def test_command_line_runner_dask_starts_and_stops_its_own_cluster(
    tmp_path):
  """`--runner=dask --dask_workers=2` without an address: the job starts a
  local cluster of 2 workers, writes the DirectRunner's store and stops
  the cluster (no process left behind)."""
  dump = _tiny_dump(tmp_path / "dump.xml.bz2", 12)
  marker = f"test-beam-dask-{uuid.uuid4().hex}"  # in its processes' env
  stores = {}
  for name, args in (("direct", ["--runner=DirectRunner"]),
                     ("dask", ["--runner=dask", "--dask_workers=2"])):
    out = tmp_path / name
    command = [sys.executable, "-m", "realm_jax.jobs.corpus",
               "--gin_file=runs/corpus.gin", f"--gin.INPUT_PATH='{dump}'",
               f"--gin.OUTPUT_DIR='{out}'", *args]
    start = time.perf_counter()
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, check=False,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                 REALM_JAX_TEST_MARKER=marker),
        timeout=timeouts.HANG_SECONDS)
    print(f"corpus job command, 12 pages, {name}: "
          f"{time.perf_counter() - start:.1f} s")
    assert result.returncode == 0, result.stderr[-3000:]
    stores[name] = block_store.BlockStore.open(str(out))
  assert "a local cluster started for this job" in result.stderr
  assert "2 worker threads" in result.stderr
  assert stores["dask"].fingerprint == stores["direct"].fingerprint
  assert not _processes_with(marker)  # its workers ended with it


def _processes_with(marker: str) -> list[int]:
  """The live processes whose environment holds `marker`."""
  found = []
  for process in psutil.process_iter():
    try:
      if process.environ().get("REALM_JAX_TEST_MARKER") == marker:
        found.append(process.pid)
    except (psutil.Error, OSError):
      continue  # gone, or not ours to read
  return found

r"""Pre-training input: in-memory queries (before) vs the query cache (after).

Builds a synthetic annotated corpus (real-looking sentences about made-up
people, places, organisations and dates, with their salient spans), then
measures, each condition in a fresh subprocess (peak RSS of the child:
VmHWM, see `_peak_rss_mb`):

  before        what pre-training did: every host reads every annotated
                record and holds every query (`salient_spans.read_annotated`
                + `examples.realm_queries_from_document` + `np.stack`, the
                calls of the former `QuerySet.from_annotated`), then takes
                its rows of step 0. Time to first batch and peak RSS.
  after         `query_cache.QueryStream` for host 0 of `--hosts` over a
                cache of N rows: time to first batch, peak RSS and the
                steady-state examples/s of `batch(step)` for this host.
  beam          the offline job (`query_cache_writer.build_query_cache`,
                Beam DirectRunner, one worker) on the corpus: queries/s and
                sentences/s per worker, the figure to divide a corpus by.

The large caches of the "after" runs are written directly with the
ArrayRecord writer (`query_cache_writer.write_shard`), cycling through the real
encoded queries of the beam run, so that the reader is measured at sizes
the 2-core machine cannot preprocess in minutes. Prints one JSON line per
measurement and writes them to `docs/benchmarks/input.jsonl`.

  python benchmarks/input.py [--before_sentences=25000,100000]
      [--after_rows=1000000,10000000] [--beam_sentences=50000]
      [--hosts=8] [--batch_size=512] [--steps=300] [--workdir=DIR]
"""

import time

_T0 = time.time()  # a child's clock starts before its imports

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Iterator

from absl import app
from absl import flags

_BEFORE = flags.DEFINE_list("before_sentences", ["25000", "100000"],
                            "Corpus sizes (sentences) of the before runs.")
_AFTER = flags.DEFINE_list("after_rows", ["1000000", "10000000"],
                           "Cache sizes (queries) of the after runs.")
_BEAM = flags.DEFINE_integer("beam_sentences", 50_000,
                             "Corpus size of the Beam job run.")
_HOSTS = flags.DEFINE_integer("hosts", 8, "Hosts of the slice (v4-64: 8).")
_BATCH = flags.DEFINE_integer("batch_size", 512, "Global batch (REALM).")
_SHARDS = flags.DEFINE_integer("num_shards", 64, "Cache shards.")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps timed by the reader.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch (default: a temp "
                               "dir, removed at the end).")
_OUTPUT = flags.DEFINE_string(
    "output", os.path.join(os.path.dirname(__file__), "..", "docs",
                           "benchmarks", "input.jsonl"), "JSON lines file.")
_CHILD = flags.DEFINE_string("child", None, "Internal: one measurement.")

SENTENCES_PER_DOC = 64
# Few big files: the Beam job builds one tf.data graph per file (~1 s).
NUM_FILES = 4

# ------------------------------------------------------ synthetic corpus ----

_FIRST = ("Anna Pierre Maria Johann Elena Thomas Sofia Henri Clara Louis "
          "Marta Oscar Irene Viktor Laura Hugo Nora Felix Alice Ernst").split()
_LAST = ("Keller Moreau Novak Lindqvist Ferreira Brandt Costa Dubois Weber "
         "Rossi Larsen Horvat Schmidt Jensen Marino Fischer Nagy Petrov").split()
_CITIES = ("Lyon Porto Graz Uppsala Bologna Leipzig Bergen Gdansk Ghent "
           "Basel Turin Aarhus Brno Seville Utrecht Tartu Split Cork").split()
_COUNTRIES = ("France Portugal Austria Sweden Italy Germany Norway Poland "
              "Belgium Switzerland Denmark Spain Estonia Ireland").split()
_FIELDS = ("physics chemistry law medicine history botany music geology "
           "architecture economics mathematics philosophy").split()
_ORGS = ("Royal Society", "National Museum", "Academy of Sciences",
         "Philharmonic Orchestra", "Maritime Company", "Botanical Garden",
         "State Railway", "Geographical Society")
_MONTHS = ("January February March April May June July August September "
           "October November December").split()
_PLAIN = ("It remained the largest of its kind for several decades.",
          "The work was widely praised at the time.",
          "Little is known about the early years.",
          "The building was later restored and opened to visitors.")


def _sentence(rng) -> tuple[str, list[str]]:
  """One sentence and its salient substrings (names, places, dates)."""
  pick = lambda xs: xs[int(rng.integers(len(xs)))]  # pylint: disable=unnecessary-lambda-assignment
  person = f"{pick(_FIRST)} {pick(_LAST)}"
  city, country, org = pick(_CITIES), pick(_COUNTRIES), pick(_ORGS)
  year = str(int(rng.integers(1700, 2000)))
  date = f"{int(rng.integers(1, 29))} {pick(_MONTHS)} {year}"
  kind = int(rng.integers(6))
  if kind == 0:
    return f"{person} was born in {city} on {date}.", [person, city, date]
  if kind == 1:
    return (f"In {year}, the {org} opened a new building in {city}.",
            [year, f"the {org}", city])
  if kind == 2:
    return (f"{person} studied {pick(_FIELDS)} at the University of {city}.",
            [person, f"the University of {city}"])
  if kind == 3:
    return (f"The river flows for {int(rng.integers(20, 900))} kilometres "
            f"through {country} before it reaches {city}.", [country, city])
  if kind == 4:
    return (f"{person} moved to {country} in {year} and joined the {org}.",
            [person, country, year, f"the {org}"])
  return pick(_PLAIN), []


def synthetic_documents(num_sentences: int, seed: int = 0) -> Iterator[Any]:
  """Annotated documents of SENTENCES_PER_DOC sentences each."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.data import salient_spans  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  for d in range(-(-num_sentences // SENTENCES_PER_DOC)):
    sentences = [_sentence(rng) for _ in range(SENTENCES_PER_DOC)]
    text = " ".join(s for s, _ in sentences)
    data = text.encode()
    ss, sl, ps, pl, at = [], [], [], [], 0
    for sentence, subs in sentences:
      raw = sentence.encode()
      start = data.index(raw, at)
      at = start + len(raw)
      ss.append(start)
      sl.append(at)
      for sub in subs:
        p = start + raw.index(sub.encode())
        ps.append(p)
        pl.append(p + len(sub.encode()))
    yield salient_spans.AnnotatedDocument(
        f"Synthetic article {d}", text, tuple(ss), tuple(sl), tuple(ps),
        tuple(pl))


def write_corpus(directory: str, num_sentences: int) -> str:
  """NUM_FILES annotated TFRecord files; returns their glob pattern."""
  from realm_jax.data import salient_spans  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  docs = list(synthetic_documents(num_sentences))
  for k in range(NUM_FILES):
    salient_spans.write_annotated(
        os.path.join(directory, f"annotated-{k:05d}-of-{NUM_FILES:05d}.tfr"),
        docs[k::NUM_FILES])
  return os.path.join(directory, "annotated-*.tfr")


# ------------------------------------------------------------ the child ----


def _peak_rss_mb() -> float:
  """This process's peak RSS. Linux keeps `getrusage`'s ru_maxrss across
  exec, so a child would report the forking parent's peak; VmHWM belongs
  to the new address space."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _before(spec: dict[str, Any], t0: float) -> dict[str, Any]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
  from realm_jax.data import salient_spans  # pylint: disable=g-import-not-at-top
  from realm_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  tokenizer = tokenizer_lib.Tokenizer()
  config = examples.RealmQueryConfig()
  rng = np.random.default_rng([0, 0])
  queries = []
  for doc in salient_spans.read_annotated(spec["pattern"]):
    queries += examples.realm_queries_from_document(doc, tokenizer, rng,
                                                    config)
  arrays = {k: np.stack([q[k] for q in queries]) for k in queries[0]}
  del queries
  # Step 0, this host's rows (epoch 0's permutation, as QuerySet.batch).
  n = len(arrays["query_ids"])
  order = np.random.default_rng([0, 0]).permutation(n)
  per_host = spec["batch_size"] // spec["hosts"]
  local = {k: v[order[:spec["batch_size"]]][:per_host]
           for k, v in arrays.items()}
  assert len(local["query_ids"]) == per_host
  return {"queries": n, "time_to_first_batch_s": time.time() - t0,
          "peak_rss_mb": _peak_rss_mb(),
          "array_bytes": int(sum(v.nbytes for v in arrays.values()))}


def _after(spec: dict[str, Any], t0: float) -> dict[str, Any]:
  from realm_jax.data import query_cache  # pylint: disable=g-import-not-at-top
  stream = query_cache.QueryStream(
      spec["cache"], seed=0, batch_size=spec["batch_size"],
      process_index=0, process_count=spec["hosts"])
  first = stream.batch(0)
  ttfb = time.time() - t0
  rss_first = _peak_rss_mb()
  per_host = len(first["query_ids"])
  # Steps far apart touch cold parts of the shards, as a long run does.
  start = time.time()
  for step in range(1, spec["steps"] + 1):
    stream.batch(step * 997)
  seconds = time.time() - start
  return {"queries": len(stream), "shards_opened": len(stream.shards),
          "time_to_first_batch_s": ttfb, "peak_rss_mb_first_batch": rss_first,
          "peak_rss_mb": _peak_rss_mb(), "rows_per_host_step": per_host,
          "examples_per_s_per_host": spec["steps"] * per_host / seconds,
          "ms_per_batch": 1000 * seconds / spec["steps"]}


def _beam(spec: dict[str, Any], t0: float) -> dict[str, Any]:
  from realm_jax.data import query_cache_writer  # pylint: disable=g-import-not-at-top
  start = time.time()
  manifest = query_cache_writer.build_query_cache(
      spec["pattern"], spec["cache"], num_shards=spec["num_shards"],
      pipeline_args=["--runner=DirectRunner"])
  seconds = time.time() - start
  return {"queries": manifest["num_queries"], "seconds": seconds,
          "queries_per_s_per_worker": manifest["num_queries"] / seconds,
          "sentences_per_s_per_worker": spec["sentences"] / seconds,
          "peak_rss_mb": _peak_rss_mb(), "startup_s": start - t0}


def _child(spec_json: str, t0: float) -> None:
  spec = json.loads(spec_json)
  # Both paths need TensorFlow (TFRecords, the tokenizer, tf.Example
  # parsing); its import is timed apart from the work.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,unused-import
  from realm_jax.data import query_cache, salient_spans  # pylint: disable=g-import-not-at-top,unused-import
  import_s = time.time() - t0
  rss_imports = _peak_rss_mb()
  result = {"before": _before, "after": _after, "beam": _beam}[spec["kind"]](
      spec, t0)
  if "time_to_first_batch_s" in result:
    result["first_batch_after_imports_s"] = (
        result["time_to_first_batch_s"] - import_s)
  print("RESULT " + json.dumps({"import_s": import_s,
                                "peak_rss_mb_after_imports": rss_imports,
                                **result}), flush=True)


# ----------------------------------------------------------- the parent ----


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__),
       "--child=" + json.dumps(spec)], env=env, capture_output=True,
      text=True, check=False)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  raise RuntimeError(f"child {spec} failed:\n{proc.stderr[-4000:]}")


def _write_big_cache(directory: str, rows: int, records: list[bytes],
                     num_shards: int) -> None:
  """A cache of `rows` queries cycling through `records` (real queries)."""
  from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
  from realm_jax.data import query_cache_writer  # pylint: disable=g-import-not-at-top
  tmp = directory + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  stats = []
  for k in range(num_shards):
    n = rows // num_shards + (k < rows % num_shards)
    shard = ((0, i, records[(k + i * num_shards) % len(records)])
             for i in range(n))
    stats.append(query_cache_writer.write_shard((k, shard), tmp_dir=tmp,
                                                num_shards=num_shards))
  query_cache_writer.finish_cache(
      tmp, directory, stats, num_shards=num_shards,
      query_config=examples.RealmQueryConfig(), seed=0,
      vocab_sha256="synthetic", source_files=["synthetic"])


def _emit(record: dict[str, Any], out) -> None:
  line = json.dumps({"benchmark": "input", **record})
  print(line, flush=True)
  out.write(line + "\n")
  out.flush()


def _consumption(hosts: int, batch_size: int) -> dict[str, Any]:
  """Queries/s per host a TPU v4-64 slice consumes in REALM pre-training."""
  params = 110e6  # BERT-base, reader and query tower alike
  reader_tokens = batch_size * 8 * 384  # 8 candidates x 384 wordpieces
  query_tokens = batch_size * 96
  flops = 6 * params * (reader_tokens + query_tokens)
  chips, peak, mfu = 32, 275e12, 0.40
  steps_per_s = chips * peak * mfu / flops
  return {"flops_per_step": flops, "steps_per_s": steps_per_s,
          "queries_per_s_slice": steps_per_s * batch_size,
          "queries_per_s_per_host": steps_per_s * batch_size / hosts}


def main(argv) -> None:
  del argv
  if _CHILD.value:
    _child(_CHILD.value, _T0)
    return
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="input_bench_")
  os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
  hosts, batch = _HOSTS.value, _BATCH.value
  with open(_OUTPUT.value, "w") as out:
    _emit({"measurement": "machine", "platform": platform.platform(),
           "cpus": os.cpu_count(), "python": platform.python_version()}, out)
    _emit({"measurement": "tpu_v4_64_consumption", "hosts": hosts,
           "batch_size": batch, **_consumption(hosts, batch)}, out)
    # Beam job: per-worker preprocessing rate, and the real queries the
    # big caches are made of.
    pattern = write_corpus(os.path.join(workdir, "beam_corpus"),
                           _BEAM.value)
    beam_cache = os.path.join(workdir, "beam_cache")
    result = _run_child({"kind": "beam", "pattern": pattern,
                         "cache": beam_cache, "num_shards": _SHARDS.value,
                         "sentences": _BEAM.value})
    _emit({"measurement": "beam_direct_runner", "sentences": _BEAM.value,
           **result}, out)
    for sentences in map(int, _BEFORE.value):
      pattern = write_corpus(os.path.join(workdir, f"corpus_{sentences}"),
                             sentences)
      result = _run_child({"kind": "before", "pattern": pattern,
                           "hosts": hosts, "batch_size": batch})
      _emit({"measurement": "before_in_memory", "sentences": sentences,
             **result}, out)
      shutil.rmtree(os.path.dirname(pattern), ignore_errors=True)
    result = _run_child({"kind": "after", "cache": beam_cache,
                         "hosts": hosts, "batch_size": batch,
                         "steps": _STEPS.value})
    _emit({"measurement": "after_query_stream", "cache": "beam_job",
           **result}, out)
    from realm_jax.data import query_cache  # pylint: disable=g-import-not-at-top
    stream = query_cache.QueryStream(beam_cache, seed=0,
                                     batch_size=_SHARDS.value)
    records = []
    for k in range(stream.num_shards):
      records += query_cache._open_shard(  # pylint: disable=protected-access
          os.path.join(beam_cache, query_cache.shard_name(
              k, stream.num_shards)), int(stream.shard_rows[k])).read_all()
    for rows in map(int, _AFTER.value):
      cache = os.path.join(workdir, f"cache_{rows}")
      start = time.time()
      _write_big_cache(cache, rows, records, _SHARDS.value)
      written = time.time() - start
      result = _run_child({"kind": "after", "cache": cache, "hosts": hosts,
                           "batch_size": batch, "steps": _STEPS.value})
      _emit({"measurement": "after_query_stream", "cache_rows": rows,
             "cache_write_s": written, **result}, out)
      shutil.rmtree(cache, ignore_errors=True)
  if not _WORKDIR.value:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)

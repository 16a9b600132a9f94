r"""Salient-span annotation of a corpus: an Apache Beam pipeline.

Turns a Wikipedia dump or a JSONL corpus into the pre-training corpus X in
REALM's record format (`salient_spans`: sentences and salient spans, gzip
TFRecords of tf.train.Example):

  Read       the input file, one sequential pass (a dump cannot be split):
             documents numbered 0, 1, ... in file order. A dump's pages are
             passed on as wikitext (`wikipedia.iter_wikipedia_pages`), so the
             markup removal runs in parallel in the next step; a JSONL file
             is read by `wikipedia.iter_jsonl_documents`.
  Reshuffle  spreads the documents over the workers (without it, a runner
             fuses the annotation into the one reading worker).
  Annotate   a DoFn that loads spaCy once per worker (`setup`), removes the
             markup of dump pages (`wikitext.clean_wikitext`) and annotates
             (`salient_spans.annotate_document`; uid = the document number).
  Write      document i goes to shard i % num_shards, each shard sorted by i,
             as `annotated-<k>-of-<n>.tfr.gz` (`salient_spans.shard_path`);
             shards that got no document are written empty.

The output depends only on the input, `num_shards`, `max_documents` and the
spaCy model, never on the runner or on how it split the work. It appears
atomically: everything is written under `<output_dir>.tmp-<id>`, which is
renamed to `output_dir` once `report.json` is in it (a remote `output_dir`
gets `report.json` last). A failed run leaves no output and is re-run from
the start: there is no per-shard resume (a runner retries failed work items
itself).

Beam options on the command line go to the pipeline unchanged (DirectRunner
by default):

  python -m realm_jax.data.annotate_job --input_path=enwiki.xml.bz2 \
      --output_dir=/data/annotated --num_shards=5000 \
      --direct_num_workers=16 --direct_running_mode=multi_processing
  python -m realm_jax.data.annotate_job ... --runner=DataflowRunner \
      --project=P --region=R --temp_location=gs://B/tmp \
      --setup_file=./setup.py   # (or --runner=FlinkRunner / SparkRunner)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Iterator, Sequence
import uuid

from absl import logging
import apache_beam as beam
from apache_beam.options import pipeline_options

from realm_jax.core import io_utils
from realm_jax.data import salient_spans
from realm_jax.data import wikipedia
from realm_jax.data import wikitext

REPORT = "report.json"
_SHARD_STATS = ".shard_stats.json"
_READER_STATS = ".reader_stats.json"
_LOG_SECONDS = 30.0
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _counter(name: str):
  return beam.metrics.Metrics.counter("annotate", name)


def check_input(input_path: str) -> None:
  """Fails early, naming the file, on a missing input or unknown format."""
  if not io_utils.as_path(input_path).exists():
    raise FileNotFoundError(f"corpus {input_path} does not exist.")
  name = os.path.basename(input_path).lower()
  for suffix in (".bz2", ".gz"):
    name = name.removesuffix(suffix)
  if not (wikipedia.is_wikipedia_dump(input_path) or
          name.endswith(_JSONL_SUFFIXES)):
    raise ValueError(
        f"{input_path}: unknown corpus format; expected a Wikipedia dump "
        "(*-pages-articles*.xml[.bz2]) or JSONL lines {\"title\", \"text\"} "
        "(*.jsonl[.gz]).")


def read_documents(input_path: str, *, max_documents: int | None,
                   stats_path: str) -> Iterator[tuple[int, str, str]]:
  """The Read step: `(index, title, text)` of the input's documents.

  A dump yields wikitext (cleaned by the Annotate step). The reader's report
  (kept and skipped records, by reason) goes to `stats_path` at the end.

  Raises:
    ValueError: the file cannot be read (corrupt compression or XML); the
      message names it.
  """
  local_dir = None
  path = input_path
  if not io_utils.is_local(input_path):  # the readers open local files
    local_dir = tempfile.mkdtemp(prefix="annotate_input_")
    path = os.path.join(local_dir, os.path.basename(input_path))
    io_utils.copy_file(input_path, path)
  report = wikipedia.Report()
  documents = (wikipedia.iter_wikipedia_pages(path, report)
               if wikipedia.is_wikipedia_dump(path) else
               wikipedia.iter_jsonl_documents(path, report))
  read = _counter("documents_read")
  count, start = 0, time.time()
  last_log = start
  try:
    for doc in documents:
      if max_documents is not None and count >= max_documents:
        break
      yield count, doc.title, doc.text
      count += 1
      read.inc()
      if time.time() - last_log > _LOG_SECONDS:
        last_log = time.time()
        logging.info("annotate: read %d documents of %s (%.1f/s)", count,
                     input_path, count / (last_log - start))
  except (OSError, EOFError, ValueError) as e:
    if input_path in str(e) or path in str(e):
      raise
    raise ValueError(
        f"{input_path}: cannot read the corpus after {count} documents "
        f"({type(e).__name__}: {e}); the file is corrupt or not in the "
        "format its name says.") from e
  finally:
    if local_dir:
      shutil.rmtree(local_dir, ignore_errors=True)
  summary = report.summary()
  summary["documents"] = count
  io_utils.atomic_write_text(stats_path, json.dumps(summary))
  logging.info("annotate: read all %d documents of %s in %.1fs", count,
               input_path, time.time() - start)


class AnnotateFn(beam.DoFn):
  """(index, title, text) -> (shard, (index, record or None, stats)).

  `record` is a serialized tf.train.Example (None for a skipped document);
  `stats` holds the document's counts, or {"skip": reason}.
  """

  def __init__(self, *, spacy_model: str, num_shards: int, wikitext: bool,
               input_path: str):
    super().__init__()
    self._spacy_model = spacy_model
    self._num_shards = num_shards
    self._wikitext = wikitext
    self._input_path = input_path
    self._nlp = None

  def setup(self):
    self._nlp = salient_spans.load_nlp(self._spacy_model)
    self._annotated = _counter("documents_annotated")
    self._skipped = _counter("documents_skipped")
    self._sentences = _counter("sentences")
    self._spans = _counter("spans")
    self._documents = self._sentence_count = 0
    self._start = self._last_log = time.time()

  def _skip(self, index: int, reason: str):
    self._skipped.inc()
    return index % self._num_shards, (index, None, {"skip": reason})

  def process(self, element):
    index, title, text = element
    try:
      if self._wikitext:
        text = wikitext.clean_wikitext(text)
        if not text:  # as `wikipedia.iter_wikipedia_dump` counts it
          yield self._skip(index, "empty_article")
          return
      doc = salient_spans.annotate_document(title, text, self._nlp,
                                            uid=str(index))
    except (ValueError, KeyError, UnicodeError) as e:
      logging.warning("%s: document %d (%r) skipped: %s", self._input_path,
                      index, title[:80], e)
      yield self._skip(index, f"document_{type(e).__name__}")
      return
    if not doc.sentence_byte_starts:
      yield self._skip(index, "document_without_sentences")
      return
    record = salient_spans.to_tf_example(doc).SerializeToString()
    sentences, spans = len(doc.sentence_byte_starts), len(doc.span_byte_starts)
    self._annotated.inc()
    self._sentences.inc(sentences)
    self._spans.inc(spans)
    self._documents += 1
    self._sentence_count += sentences
    if time.time() - self._last_log > _LOG_SECONDS:
      self._last_log = time.time()
      logging.info(
          "annotate: this worker annotated %d documents, %d sentences "
          "(%.1f sentences/s)", self._documents, self._sentence_count,
          self._sentence_count / (self._last_log - self._start))
    yield index % self._num_shards, (index, record, {
        "sentences": sentences, "spans": spans,
        "span_types": list(doc.span_types)})


def write_shard(item, *, tmp_dir: str, num_shards: int) -> dict[str, Any]:
  """(shard, [(index, record, stats)]) -> the shard file; its report."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  k, rows = item
  rows = sorted(rows, key=lambda row: row[0])
  path = salient_spans.shard_path(tmp_dir, k, num_shards)
  tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"  # a retried write starts over
  report = salient_spans.AnnotationReport()
  options = tf.io.TFRecordOptions(compression_type="GZIP")
  with tf.io.TFRecordWriter(tmp, options) as writer:
    for _, record, stats in rows:
      if record is None:
        report.skip(stats["skip"])
        continue
      writer.write(record)
      report.documents += 1
      report.sentences += stats["sentences"]
      report.spans += stats["spans"]
      report.span_types.update(stats["span_types"])
  tf.io.gfile.rename(tmp, path, overwrite=True)
  _counter("shards_written").inc()
  logging.info("annotate: wrote shard %d of %d (%d documents, %d sentences)",
               k, num_shards, report.documents, report.sentences)
  return {"shard": k, **report.to_dict()}


def _publish(tmp_dir: str, output_dir: str, report: dict[str, Any]) -> None:
  """report.json last; then `tmp_dir` becomes `output_dir` at once."""
  text = json.dumps(report, indent=2, sort_keys=True)
  if io_utils.is_local(output_dir):
    io_utils.atomic_write_text(os.path.join(tmp_dir, REPORT), text)
    io_utils.replace_local_dir(tmp_dir, output_dir)
    return
  # No atomic rename on object stores: the report goes last.
  io_utils.remove(output_dir)
  io_utils.makedirs(output_dir)
  for k in range(report["num_shards"]):
    name = os.path.basename(salient_spans.shard_path("", k,
                                                     report["num_shards"]))
    io_utils.copy_file(io_utils.join(tmp_dir, name),
                       io_utils.join(output_dir, name))
  io_utils.atomic_write_text(io_utils.join(output_dir, REPORT), text)
  io_utils.remove(tmp_dir)


def annotate_corpus(
    input_path: str,
    output_dir: str,
    *,
    num_shards: int,
    max_documents: int | None = None,
    spacy_model: str = salient_spans.SPACY_MODEL,
    pipeline_args: Sequence[str] = (),
    overwrite: bool = False,
) -> dict[str, Any]:
  """Annotates a corpus with salient spans into sharded TFRecords (Beam).

  Args:
    input_path: Wikipedia dump (.xml[.bz2]) or JSONL `{"title", "text"}`
      ([.gz|.bz2]); local or remote (a remote file is copied to the reading
      worker).
    output_dir: the directory to create: `num_shards` files named by
      `salient_spans.shard_path` and `report.json`.
    num_shards: output shards; document i goes to shard i % num_shards.
    max_documents: only the first N documents of the input (for trials; a
      dump's pages are counted before markup removal).
    spacy_model: spaCy package name (installed on every worker).
    pipeline_args: Beam pipeline options (`--runner=...`, ...); default
      DirectRunner.
    overwrite: replace an existing `output_dir`.

  Returns:
    The report, also written to `output_dir/report.json`: documents,
    sentences, spans, skipped documents by reason, span types, the reader's
    report, documents per shard, seconds and sentences per second.

  Raises:
    FileExistsError: `output_dir` exists and not `overwrite`.
    FileNotFoundError: `input_path` does not exist.
    ValueError: bad arguments, an input of unknown format or that cannot be
      read (the file is named), or an input without any usable document.
  """
  if num_shards < 1:
    raise ValueError(f"num_shards={num_shards} must be >= 1.")
  if max_documents is not None and max_documents < 1:
    raise ValueError(f"max_documents={max_documents} must be >= 1.")
  output_dir = io_utils.absolute(output_dir)
  input_path = io_utils.absolute(input_path)
  if io_utils.as_path(output_dir).exists() and not overwrite:
    raise FileExistsError(f"{output_dir} already exists; pass overwrite=True "
                          "(--overwrite) or another path.")
  check_input(input_path)
  tmp_dir = f"{output_dir}.tmp-{uuid.uuid4().hex[:12]}"
  io_utils.makedirs(tmp_dir)
  shard_stats = io_utils.join(tmp_dir, _SHARD_STATS)
  reader_stats = io_utils.join(tmp_dir, _READER_STATS)
  options = pipeline_options.PipelineOptions(list(pipeline_args))
  runner = options.view_as(pipeline_options.StandardOptions).runner
  logging.info("annotate: %s -> %d shards in %s (runner %s)", input_path,
               num_shards, output_dir, runner or "DirectRunner")
  start = time.time()
  try:
    with beam.Pipeline(options=options) as pipeline:
      _ = (
          pipeline
          | "Input" >> beam.Create([input_path])
          | "Read" >> beam.FlatMap(read_documents, max_documents=max_documents,
                                   stats_path=reader_stats)
          | "Reshuffle" >> beam.Reshuffle()
          | "Annotate" >> beam.ParDo(AnnotateFn(
              spacy_model=spacy_model, num_shards=num_shards,
              wikitext=wikipedia.is_wikipedia_dump(input_path),
              input_path=input_path))
          | "Group" >> beam.GroupByKey()
          | "Write" >> beam.Map(write_shard, tmp_dir=tmp_dir,
                                num_shards=num_shards)
          | "Collect" >> beam.combiners.ToList()
          | "Stats" >> beam.Map(lambda s: io_utils.atomic_write_text(
              shard_stats, json.dumps(s))))
    report = _finish(tmp_dir, num_shards, shard_stats, reader_stats)
    seconds = time.time() - start
    report.update(
        input_path=input_path, max_documents=max_documents,
        spacy_model=spacy_model, runner=runner or "DirectRunner",
        annotation_seconds=round(seconds, 3),
        sentences_per_second=round(report["sentences"] / seconds, 1))
    if not report["documents"]:
      raise ValueError(
          f"{input_path}: no document could be annotated (reader: "
          f"{report['reader']['skipped']}, annotation: {report['skipped']}).")
    _publish(tmp_dir, output_dir, report)
  except BaseException:
    io_utils.remove(tmp_dir)
    raise
  logging.info("annotate: %s: %d documents, %d sentences, %d spans in %.1fs",
               output_dir, report["documents"], report["sentences"],
               report["spans"], seconds)
  return report


def _finish(tmp_dir: str, num_shards: int, shard_stats: str,
            reader_stats: str) -> dict[str, Any]:
  """Writes the empty shards and merges the per-shard reports."""
  stats = (json.loads(io_utils.read_text(shard_stats))
           if io_utils.as_path(shard_stats).exists() else [])
  reader = json.loads(io_utils.read_text(reader_stats))
  io_utils.remove(shard_stats)
  io_utils.remove(reader_stats)
  by_shard = {int(s["shard"]): s for s in stats}
  total = salient_spans.AnnotationReport()
  for k in range(num_shards):
    if k in by_shard:
      total.merge(salient_spans.AnnotationReport.from_dict(by_shard[k]))
    else:
      salient_spans.write_annotated(
          salient_spans.shard_path(tmp_dir, k, num_shards), [])
  report = total.to_dict()
  report.update(
      num_shards=num_shards, reader=reader,
      shard_documents=[by_shard[k]["documents"] if k in by_shard else 0
                       for k in range(num_shards)])
  return report


# -----------------------------------------------------------------------------
# Command line.
# -----------------------------------------------------------------------------


def main(argv: Sequence[str]) -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  report = annotate_corpus(
      f.input_path or wikipedia.default_wikipedia_dump(), f.output_dir,
      num_shards=f.num_shards, max_documents=f.max_documents,
      spacy_model=f.spacy_model, pipeline_args=list(argv[1:]),
      overwrite=f.overwrite)
  print(json.dumps({k: report[k] for k in (
      "documents", "sentences", "spans", "num_shards",
      "annotation_seconds")}))


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string(
      "input_path", None, "Wikipedia dump (.xml.bz2) or JSONL {title, text}; "
      "default: the gensim Wikipedia slice.")
  flags.DEFINE_string("output_dir", None, "The annotated corpus directory.")
  flags.DEFINE_integer("num_shards", 8, "Output shards.")
  flags.DEFINE_integer("max_documents", None, "Only the first N documents.")
  flags.DEFINE_string("spacy_model", salient_spans.SPACY_MODEL,
                      "spaCy NER package.")
  flags.DEFINE_bool("overwrite", False, "Replace an existing output_dir.")
  flags.mark_flag_as_required("output_dir")
  # Flags this module does not define are Beam pipeline options.
  app.run(main, flags_parser=lambda argv: flags.FLAGS(argv, known_only=True))

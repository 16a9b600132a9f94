r"""Salient-span annotation of a corpus: an Apache Beam pipeline.

Turns a Wikipedia dump or a JSONL corpus into the pre-training corpus X in
REALM's record format (`salient_spans`: sentences and salient spans, gzip
TFRecords of tf.train.Example):

  Read       the input file, one sequential pass (a dump cannot be split):
             documents numbered 0, 1, ... in file order; a dump's pages as
             wikitext (`beam_utils.read_documents`), cleaned in parallel.
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
atomically, `report.json` last (`beam_utils.ShardedOutput`). A failed run
leaves no output and is re-run from the start: there is no per-shard resume
(a runner retries failed work items itself).

The command line follows the gin convention (`gin_cli`); flags it does not
define are Beam options (DirectRunner by default; BUILD.md has cluster
runners' commands):

  python -m realm_jax.jobs.annotate --gin_file=runs/annotate.gin \
      --gin.INPUT_PATH="'enwiki.xml.bz2'" --gin.OUTPUT_DIR="'/data/annotated'" \
      --direct_num_workers=16 --direct_running_mode=multi_processing
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time
from typing import Any, Sequence
import uuid

from absl import logging
import apache_beam as beam

from realm_jax.core import checks, io_utils, outputs
from realm_jax.data import beam_utils
from realm_jax.data import salient_spans
from realm_jax.data import wikipedia
from realm_jax.data import wikitext

REPORT = "report.json"
_READER_STATS = ".reader_stats.json"


_LOCAL = threading.local()  # this thread's spaCy pipelines, by model


def _nlp(model: str):
  """spaCy's pipeline, loaded once per worker thread (freed with it): a
  runner may call `setup` once per bundle (the Dask runner: per
  partition)."""
  loaded = _LOCAL.__dict__.setdefault("nlp", {})
  if model not in loaded:
    loaded[model] = salient_spans.load_nlp(model)
  return loaded[model]


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
    self._nlp = _nlp(self._spacy_model)
    self._progress = beam_utils.worker_progress(
        "annotate: annotating documents (this worker)", unit="documents")
    self._skipped = beam.metrics.Metrics.counter("annotate", "skipped")

  def teardown(self):
    self._progress.close()  # This worker's total and rate.

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
    self._progress.update()
    yield index % self._num_shards, (
        index, salient_spans.serialize(doc), {
            "sentences": len(doc.sentence_byte_starts),
            "spans": len(doc.span_byte_starts),
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
  tf.io.gfile.rename(tmp, path, overwrite=True)  # Inside its own tmp_dir.
  return {"shard": k, **report.to_dict()}


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class AnnotateConfig:
  """What `annotate_corpus` makes (runs/annotate.gin binds the paths).

  Attributes:
    output_dir: the directory to create: `num_shards` files named by
      `salient_spans.shard_path` and `report.json`.
    input_path: Wikipedia dump (.xml[.bz2]) or JSONL `{"title", "text"}`
      ([.gz|.bz2]); local or remote (copied to the reading worker).
      Default: the gensim Wikipedia slice.
    num_shards: output shards; document i goes to shard i % num_shards.
    max_documents: only the first N documents of the input (for trials; a
      dump's pages are counted before markup removal).
    spacy_model: spaCy package name (installed on every worker).
    overwrite: replace an existing `output_dir`.
  """
  output_dir: str = checks.path_setting("writes", "annotated_corpus")
  input_path: str | None = checks.path_setting("reads", default=None)
  num_shards: int = 8
  max_documents: int | None = None
  spacy_model: str = salient_spans.SPACY_MODEL
  overwrite: bool = False

  def __post_init__(self):
    for name in ("num_shards", "max_documents"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")


def annotate_corpus(input_path: str | None, output_dir: str, *,
                    pipeline_args: Sequence[str] = (), **fields
                    ) -> dict[str, Any]:
  """Annotates a corpus with salient spans into sharded TFRecords (Beam):
  `AnnotateConfig(input_path=, output_dir=, **fields)`, with the Beam
  options `pipeline_args` (default DirectRunner).

  Returns the report, also written to `output_dir/report.json`: documents,
  sentences, spans, skipped documents by reason, span types, the reader's
  report, documents per shard, seconds and sentences per second. Raises
  FileExistsError (`output_dir` exists and not `overwrite`),
  FileNotFoundError (no `input_path`) or ValueError (bad arguments, an
  input of unknown format or that cannot be read, named, or without any
  usable document).
  """
  config = AnnotateConfig(output_dir=output_dir, input_path=input_path,
                          **fields)
  num_shards = config.num_shards
  input_path = io_utils.absolute(input_path or
                                 wikipedia.default_wikipedia_dump())
  beam_utils.check_input(input_path)
  with beam_utils.ShardedOutput(
      output_dir, marker=REPORT, kind=outputs.ANNOTATED,
      setting="AnnotateConfig.output_dir (--gin.OUTPUT_DIR)",
      overwrite=config.overwrite) as out:
    reader_stats = out.path(_READER_STATS)
    pipeline, runner = beam_utils.pipeline(pipeline_args)
    logging.info("annotate: %s -> %d shards in %s (runner %s)", input_path,
                 num_shards, out.output_dir, runner)
    start = time.time()
    with pipeline:
      _add_steps(pipeline, config, input_path, out, reader_stats)
    report = _finish(out.tmp_dir, num_shards, out.load(out.stats, []),
                     out.load(reader_stats))
    seconds = time.time() - start
    report.update(
        input_path=input_path, max_documents=config.max_documents,
        spacy_model=config.spacy_model, runner=runner,
        annotation_seconds=round(seconds, 3),
        sentences_per_second=round(report["sentences"] / seconds, 1))
    if not report["documents"]:
      raise ValueError(
          f"{input_path}: no document could be annotated (reader: "
          f"{report['reader']['skipped']}, annotation: {report['skipped']}).")
    beam_utils.publish(out.tmp_dir, out.output_dir, REPORT, json.dumps(
        report, indent=2, sort_keys=True), [
            os.path.basename(salient_spans.shard_path("", k, num_shards))
            for k in range(num_shards)], kind=outputs.ANNOTATED)
  logging.info("annotate: %s: %d documents, %d sentences, %d spans in %.1fs",
               out.output_dir, report["documents"], report["sentences"],
               report["spans"], seconds)
  return report


def _add_steps(pipeline: beam.Pipeline, config: AnnotateConfig,
               input_path: str, out: beam_utils.ShardedOutput,
               reader_stats: str) -> None:
  """Adds the read, annotate and write steps to `pipeline`."""
  num_shards = config.num_shards
  _ = (
      pipeline
      | "Input" >> beam.Create([input_path])
      | "Read" >> beam.FlatMap(beam_utils.read_documents,
                               max_documents=config.max_documents,
                               stats_path=reader_stats)
      | "Reshuffle" >> beam.Reshuffle()
      | "Annotate" >> beam.ParDo(AnnotateFn(
          spacy_model=config.spacy_model, num_shards=num_shards,
          wikitext=wikipedia.is_wikipedia_dump(input_path),
          input_path=input_path))
      | "Write" >> out.write_shards(
          functools.partial(write_shard, tmp_dir=out.tmp_dir,
                            num_shards=num_shards), "annotate", num_shards))


def _finish(tmp_dir: str, num_shards: int, stats: list[dict[str, Any]],
            reader: dict[str, Any]) -> dict[str, Any]:
  """Writes the empty shards and merges the per-shard reports."""
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


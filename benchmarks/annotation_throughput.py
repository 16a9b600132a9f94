r"""Salient-span annotation throughput and span statistics.

Runs the real annotation job (`annotate_job.annotate_corpus`, a Beam
pipeline) on the same documents with Beam's in-process DirectRunner and with
N worker processes (`--direct_num_workers=N
--direct_running_mode=multi_processing`), then reads the annotated output
back and measures what pre-training will see. Prints one JSON line per
measurement:

  annotate_corpus     sentences/s of the whole pipeline (reading, pipeline
                      and worker start-up, spaCy load included) and per
                      CPU-second, per process count
  salient_spans       spans per sentence, share of sentences with a span and
                      with a span usable as a REALM query (1..10 wordpieces),
                      entity vs date share, counts per type

Default corpus: the enwiki slice in the gensim wheel (96 articles, ~21k
sentences); on 2 cores the whole run takes about 2 minutes.

  python benchmarks/annotation_throughput.py [--num_processes=2]
      [--max_documents=20] [--input_path=...]
"""

import json
import os
import platform
import resource
import tempfile
import time
from typing import Any, Sequence

from absl import app
from absl import flags
from absl import logging

from realm_jax.data import annotate_job
from realm_jax.data import salient_spans
from realm_jax.data import tokenizer as tokenizer_lib
from realm_jax.data import wikipedia

_INPUT_PATH = flags.DEFINE_string(
    "input_path", None, "Corpus; default: the gensim Wikipedia slice.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", os.cpu_count() or 2,
    "N for the multi-process run (Beam's --direct_num_workers).")
_MAX_DOCUMENTS = flags.DEFINE_integer(
    "max_documents", None, "Only the first N documents.")


def _emit(record: dict[str, Any]) -> None:
  print(json.dumps({"benchmark": "annotation_throughput", **record}),
        flush=True)


def _cpu_seconds() -> float:
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _run_job(input_path: str, processes: int,
             max_documents: int | None, workdir: str) -> str:
  output_dir = os.path.join(workdir, f"p{processes}")
  cpu_start = _cpu_seconds()
  start = time.time()
  pipeline_args = [] if processes == 1 else [
      f"--direct_num_workers={processes}",
      "--direct_running_mode=multi_processing"]
  report = annotate_job.annotate_corpus(
      input_path=input_path, output_dir=output_dir,
      num_shards=max(2, 4 * processes), max_documents=max_documents,
      pipeline_args=pipeline_args)
  total = time.time() - start
  cpu = _cpu_seconds() - cpu_start
  _emit({
      "measure": "annotate_corpus",
      "processes": processes,
      "documents": report["documents"],
      "sentences": report["sentences"],
      "job_seconds": round(report["annotation_seconds"], 2),
      "sentences_per_second": round(report["sentences_per_second"], 1),
      "end_to_end_seconds": round(total, 2),
      "end_to_end_sentences_per_second": round(report["sentences"] / total,
                                               1),
      # CPU time of this process and its (finished) Beam worker processes:
      # throughput per core, which other load on a shared machine does not
      # distort.
      "cpu_seconds": round(cpu, 2),
      "sentences_per_cpu_second": round(report["sentences"] / cpu, 1),
      "cpu_count": os.cpu_count(),
      "load_average_1min": round(os.getloadavg()[0], 2),
  })
  return output_dir


def _span_statistics(output_dir: str) -> None:
  """Spans per sentence, usable-query share, entity vs date share."""
  tokenizer = tokenizer_lib.Tokenizer()
  sentences = with_span = usable = spans = 0
  types: dict[str, int] = {}
  for doc in salient_spans.read_annotated(
      os.path.join(output_dir, "annotated-*.tfr.gz")):
    rows = list(doc.sentences_with_spans())
    sentences += len(rows)
    rows = [(s, sp) for _, s, sp in rows if sp]
    with_span += len(rows)
    spans += sum(len(sp) for _, sp in rows)
    for t in doc.span_types:
      types[t] = types.get(t, 0) + 1
    tokenized = tokenizer.tokenize_with_offsets(
        [s.decode("utf-8") for s, _ in rows])
    for (_, sp), (_, starts, limits) in zip(rows, tokenized):
      if any(1 <= ((starts >= a) & (limits <= b)).sum() <= 10
             for a, b in sp):
        usable += 1
  dates = types.get(salient_spans.DATE_TYPE, 0)
  _emit({
      "measure": "salient_spans",
      "sentences": sentences,
      "spans": spans,
      "spans_per_sentence": round(spans / max(sentences, 1), 3),
      "sentences_with_span_share": round(with_span / max(sentences, 1), 3),
      "sentences_with_usable_span_share": round(usable / max(sentences, 1),
                                                3),
      "entity_share": round((spans - dates) / max(spans, 1), 3),
      "date_share": round(dates / max(spans, 1), 3),
      "span_types": dict(sorted(types.items(), key=lambda kv: -kv[1])),
  })


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  input_path = _INPUT_PATH.value or wikipedia.default_wikipedia_dump()
  _emit({"measure": "setup", "input_path": input_path,
         "max_documents": _MAX_DOCUMENTS.value,
         "spacy_model": salient_spans.SPACY_MODEL,
         "python": platform.python_version()})
  with tempfile.TemporaryDirectory() as workdir:
    output_dir = _run_job(input_path, 1, _MAX_DOCUMENTS.value, workdir)
    if _NUM_PROCESSES.value > 1:
      _run_job(input_path, _NUM_PROCESSES.value, _MAX_DOCUMENTS.value,
               workdir)
    _span_statistics(output_dir)


if __name__ == "__main__":
  app.run(main)

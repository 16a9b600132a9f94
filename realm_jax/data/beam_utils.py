"""What the Beam data jobs share: reading a corpus, sharded atomic output.

`corpus_job`, `annotate_job` and `query_cache` write every file under
`<output_dir>.tmp-<id>` (`ShardedOutput`), which becomes `output_dir` at
once when its marker file (a manifest or report) is in it; a remote
`output_dir` gets the files copied, the marker last. A failed run leaves no
output and is run again from the start (runners retry work items).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator, Sequence
import uuid

import apache_beam as beam
from apache_beam.options import pipeline_options

from realm_jax.core import io_utils
from realm_jax.core import outputs
from realm_jax.core import progress as progress_lib
from realm_jax.data import formats
from realm_jax.data import wikipedia


def pipeline(pipeline_args: Sequence[str]) -> tuple[beam.Pipeline, str]:
  """A pipeline with these Beam options, and its runner's name.

  `--runner=dask` (or `DaskRunner`) is `beam_dask.DaskRunner`: a Dask
  cluster (`--dask_client_address=...`, or a local one of
  `--dask_workers=N` processes); see `realm_jax.data.beam_dask`.
  """
  options = pipeline_options.PipelineOptions(list(pipeline_args))
  standard = options.view_as(pipeline_options.StandardOptions)
  # Beam's own default tries to download its Prism runner at run time;
  # without a --runner the jobs run on the DirectRunner, offline.
  standard.runner = standard.runner or "DirectRunner"
  name = standard.runner
  if dask_runner_named(name):
    from realm_jax.data import beam_dask  # pylint: disable=g-import-not-at-top
    beam_dask.check_installed()
    standard.runner, name = beam_dask.RUNNER, "DaskRunner"
  return beam.Pipeline(options=options), name


def dask_runner_named(runner: str | None) -> bool:
  """Whether `--runner=runner` is the Dask runner (`beam_dask`), without
  importing dask."""
  return bool(runner) and (
      runner.lower() in ("dask", "daskrunner") or
      runner == "realm_jax.data.beam_dask.DaskRunner")


def worker_progress(what: str, total: int | None = None, *,
                    unit: str) -> progress_lib.Progress:
  """A Beam worker's count (`core.progress`), as log lines even on a
  terminal: several workers' bars would overwrite each other."""
  return progress_lib.Progress(what, total, unit=unit, bar=False)


def check_input(input_path: str, input_format: str | None = None) -> str:
  """Fails early, naming the file, on a missing input or unknown format.

  Returns `input_format` (`formats.CORPUS_FORMATS`), or if None the format
  its name says (`formats.corpus_format_of`).
  """
  if input_format is not None:
    formats.corpus_format(input_format)
  if not io_utils.as_path(input_path).exists():
    raise FileNotFoundError(f"corpus {input_path} does not exist.")
  return input_format or formats.corpus_format_of(input_path).name


def read_documents(input_path: str, *, max_documents: int | None,
                   stats_path: str, orqa_titles: str | None = None,
                   input_format: str | None = None, with_ids: bool = False,
                   list_dropped: bool = False, **reader_kwargs
                   ) -> Iterator[tuple[Any, ...]]:
  """`(index, title, text)` of a corpus's documents, in file order: a
  dump's pages as wikitext (`wikipedia.iter_wikipedia_pages`; the jobs
  remove the markup in parallel), JSONL documents, DPR's passages, or
  ORQA's records (`blocks.tfr` with `orqa_titles`), a SQuAD JSON file's
  paragraphs (`input_format="squad"`); `with_ids` appends the DPR passage
  id or the SQuAD paragraph id (None for other formats). The reader's report (kept and
  skipped records by reason, "documents", with `list_dropped` every skipped
  article's title) goes to `stats_path` at the end. A file that cannot be
  read raises ValueError naming it.
  """
  local_dir, path = None, input_path
  if not io_utils.is_local(input_path) and not orqa_titles:
    # The readers open local files (ORQA's TFRecords are read by TF).
    local_dir = tempfile.mkdtemp(prefix="corpus_input_")
    path = os.path.join(local_dir, os.path.basename(input_path))
    io_utils.copy_file(input_path, path)
  report = wikipedia.Report()
  if orqa_titles:
    documents = formats.CORPUS_FORMATS["orqa"].read(
        path, report, orqa_titles=orqa_titles)
  else:
    documents = (formats.corpus_format(input_format) if input_format else
                 formats.corpus_format_of(input_path)).read(
                     path, report, **reader_kwargs)
  progress = progress_lib.Progress(f"reading {input_path}", max_documents,
                                   unit="documents")
  try:
    for doc_id, title, text in documents:
      yield (progress.done, title, text) + ((doc_id,) if with_ids else ())
      progress.update()
      if progress.done == max_documents:
        break
    progress.close()  # The last line: documents read, time, rate.
  except (OSError, EOFError, ValueError) as e:
    if input_path in str(e) or path in str(e):
      raise
    raise ValueError(
        f"{input_path}: cannot read the corpus after {progress.done} "
        f"documents ({type(e).__name__}: {e}); the file is corrupt or not in "
        "the format its name says.") from e
  finally:
    progress.close(stopped=True)  # No-op unless it ended on an error.
    if local_dir:
      shutil.rmtree(local_dir, ignore_errors=True)  # Own mkdtemp.
  io_utils.atomic_write_text(stats_path, json.dumps(
      dict(report.summary(list_dropped), documents=progress.done)))


class ShardedOutput:
  """A job's output, written under `tmp_dir` and published at once.

    with ShardedOutput(output_dir, marker=..., overwrite=...) as out:
      with pipeline:
        _ = pipeline | ... | out.write_shards(write, job)  # (key, value)s
      stats = out.load(out.stats)  # what `write` returned for each key
      publish(out.tmp_dir, out.output_dir, marker, marker_text, files,
              kind=out.kind)

  Leaving the block removes `tmp_dir` (gone already once published).
  """

  def __init__(self, output_dir: str, *, marker: str, kind: outputs.Kind,
               setting: str, overwrite: bool):
    self.output_dir = io_utils.absolute(output_dir)
    # Before the pipeline runs: only an output of `kind`, and a link never.
    outputs.check(self.output_dir, kind, setting, overwrite=overwrite,
                  exists=f"{self.output_dir} already exists; pass "
                  "overwrite=True or another path.")
    self.marker, self.kind = marker, kind
    # A fresh random name (Beam workers may be remote: no mkdtemp).
    self.tmp_dir = f"{self.output_dir}.tmp-{uuid.uuid4().hex}"
    self.stats = self.path(".shard_stats.json")

  def __enter__(self) -> ShardedOutput:
    io_utils.makedirs(self.tmp_dir)
    return self

  def __exit__(self, *exc) -> None:
    io_utils.remove(self.tmp_dir)

  def path(self, name: str) -> str:
    return io_utils.join(self.tmp_dir, name)

  def write_shards(self, write: Callable[[Any], Any], job: str,
                   total: int | None = None) -> beam.PTransform:
    """(key, value)s -> `write((key, [value, ...]))` once per key (writes
    that shard); the list of what it returned is saved to `stats`."""
    stats, progress = self.stats, []  # a Progress per worker (unpickled)

    def counted(item):
      if not progress:
        progress.append(worker_progress(
            f"{job}: writing shards (this worker)", total, unit="shards"))
      result = write(item)
      progress[0].update()
      return result

    @beam.ptransform_fn
    def transform(pcoll):
      return (pcoll
              | "Group" >> beam.GroupByKey()
              | "Write" >> beam.Map(counted)
              # Without defaults: no side input (an empty input writes no
              # stats; `load` gives its default).
              | "Collect" >> beam.CombineGlobally(
                  beam.combiners.ToListCombineFn()).without_defaults()
              | "Stats" >> beam.Map(lambda s: io_utils.atomic_write_text(
                  stats, json.dumps(s))))

    return transform()  # pylint: disable=no-value-for-parameter

  @staticmethod
  def load(path: str, default: Any = None) -> Any:
    """A JSON stats file, then removed (`default` if there is none)."""
    if not io_utils.as_path(path).exists():
      return default
    value = json.loads(io_utils.read_text(path))  # Atomic stats file.
    io_utils.remove(path)
    return value


def publish(tmp_dir: str, output_dir: str, marker: str, text: str,
            files: Sequence[str], *, kind: outputs.Kind,
            check: Callable[[str], Any] | None = None) -> None:
  """Writes the marker file (`text`) last: then `tmp_dir` becomes
  `output_dir` (`check(tmp_dir)` refuses what cannot be read back), with
  the ownership marker of `kind` (`outputs.mark`)."""
  outputs.mark(tmp_dir, kind)
  files = [*files, outputs.MARKER]
  if io_utils.is_local(output_dir):
    io_utils.atomic_write_text(io_utils.join(tmp_dir, marker), text)
    if check:
      check(tmp_dir)
    io_utils.replace_local_dir(tmp_dir, output_dir)
    return
  # No atomic rename on object stores: readers need the marker, so it goes
  # last.
  io_utils.remove(output_dir)
  io_utils.makedirs(output_dir)
  for name in files:
    io_utils.copy_file(io_utils.join(tmp_dir, name),
                       io_utils.join(output_dir, name))
  io_utils.atomic_write_text(io_utils.join(output_dir, marker), text)
  io_utils.remove(tmp_dir)

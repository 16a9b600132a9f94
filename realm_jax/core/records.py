"""Append-only JSONL records that a job reads back when it resumes.

A job appends one JSON object a line to its record files (the trainer's
metrics.jsonl, the gate's gate.jsonl, the recall guard's
recall_guard.jsonl, the eval job's metrics.jsonl) and reads them back when
it resumes, to cut them to the restored step or to extend them. Every such
read goes through `read_records`, under one rule:

  * A torn last record (the job was killed mid-append: the line has no
    newline and is not whole JSON) is dropped with a warning naming the
    file and the record; `keep_records` rewrites the file without it, so
    the next append starts a fresh line.
  * A damaged record before the last one is not what a kill leaves: it is
    an error naming the file and the line, and nothing is rewritten.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from absl import logging

from realm_jax.core import io_utils

Record = dict[str, Any]


class RecordError(ValueError):
  """A damaged record in the middle of an append-only record file."""


def _parse(line: str, required: Sequence[str]) -> tuple[Record | None, str]:
  """`line` as a record, or (None, what is wrong with it)."""
  try:
    record = json.loads(line)  # The records mechanism itself.
  except json.JSONDecodeError as e:
    return None, f"not JSON: {e}"
  if not isinstance(record, dict):
    return None, f"a JSON {type(record).__name__}, not an object"
  missing = [k for k in required if k not in record]
  if missing:
    return None, f"it has no {missing}"
  return record, ""


def _scan(path: io_utils.PathLike, text: str, required: Sequence[str]
          ) -> tuple[list[Record], str | None]:
  """The whole records of `text` and the torn last line (None if none)."""
  lines = text.split("\n")
  records = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    record, error = _parse(line, required)
    if record is not None:
      records.append(record)
    elif number == len(lines):  # The last line, without its newline.
      logging.warning(
          "%s: its last record is torn (the job was stopped while "
          "appending it) and is dropped: %r", path, _shorten(line))
      return records, line
    else:
      raise RecordError(
          f"{path}, line {number}: a damaged record ({error}): "
          f"{_shorten(line)!r}. Only a torn last record (a kill mid-append) "
          "is dropped by itself; fix or delete that line and restart.")
  return records, None


def _shorten(line: str, limit: int = 200) -> str:
  return line if len(line) <= limit else line[:limit] + "..."


def read_records(path: io_utils.PathLike, *,
                 required: Sequence[str] = ("step",)) -> list[Record]:
  """The records of append-only JSONL file `path` ([] if it is missing).

  Args:
    path: the file (local or remote).
    required: keys every record has.

  Raises:
    RecordError: a record before the last one is damaged (not JSON, not an
      object, or without a `required` key), naming the file and line.
  """
  if not io_utils.as_path(path).exists():
    return []
  return _scan(path, io_utils.read_text(path), required)[0]


def keep_records(path: io_utils.PathLike,
                 keep: Callable[[Record], bool] = lambda record: True, *,
                 required: Sequence[str] = ("step",)) -> list[Record]:
  """On resume: keeps the records of `path` that `keep` accepts.

  The file is rewritten atomically when a record goes (dropped by `keep`,
  or a torn last one) or its last line lacks a newline, so that the job's
  next append starts a line of its own. A missing file stays missing.

  Returns:
    The records kept.

  Raises:
    RecordError: as `read_records`.
  """
  if not io_utils.as_path(path).exists():
    return []
  text = io_utils.read_text(path)
  records, torn = _scan(path, text, required)
  kept = [r for r in records if keep(r)]
  if len(kept) < len(records):
    logging.info("%s: %d records dropped on resume (logged again from the "
                 "restored step on)", path, len(records) - len(kept))
  if len(kept) < len(records) or torn is not None or (
      text and not text.endswith("\n")):
    io_utils.atomic_write_text(path, "".join(json.dumps(r) + "\n"
                                             for r in kept))
  return kept

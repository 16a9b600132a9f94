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
  * Files are read as bytes and each line decoded by itself, so a byte
    that is not UTF-8 is a damaged record (or a torn last one) like any
    other; so is a record whose `step` is not an integer.
  * A line ends at LF, CRLF or a lone CR (old Mac style), as when the
    files were read as text (universal newlines): a file saved with
    CR-only line ends keeps its records, and a rewrite ends them with LF.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

from absl import logging

from realm_jax.core import io_utils

Record = dict[str, Any]
# Line ends as universal newlines reads them: CRLF, LF or a lone CR.
_LINE_END = re.compile(rb"\r\n|\r|\n")


class RecordError(ValueError):
  """A damaged record in the middle of an append-only record file."""


def _parse(line: bytes, required: Sequence[str]
           ) -> tuple[Record | None, str, bool]:
  """`line` as a record, or (None, what is wrong with it, whether a kill
  mid-append could have left it: cut bytes that do not decode or parse)."""
  try:
    record = json.loads(line.decode("utf-8"))  # The records mechanism.
  except UnicodeDecodeError as e:
    return None, f"not UTF-8: {e}", True
  except json.JSONDecodeError as e:
    return None, f"not JSON: {e}", True
  if not isinstance(record, dict):
    return None, f"a JSON {type(record).__name__}, not an object", True
  missing = [k for k in required if k not in record]
  if missing:
    return None, f"it has no {missing}", True
  step = record.get("step")
  if "step" in record and (not isinstance(step, int)
                           or isinstance(step, bool)):
    return None, (f"its step is {step!r} ({type(step).__name__}), not an "
                  "integer"), False
  return record, "", False


def _scan(path: io_utils.PathLike, data: bytes, required: Sequence[str]
          ) -> tuple[list[Record], bytes | None]:
  """The whole records of `data` and the torn last line (None if none)."""
  lines = _LINE_END.split(data)
  records = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    record, error, cut = _parse(line, required)
    if record is not None:
      records.append(record)
    elif number == len(lines) and cut:  # The last line, without newline.
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


def _shorten(line: bytes, limit: int = 200) -> str:
  text = line.decode("utf-8", errors="backslashreplace")
  return text if len(text) <= limit else text[:limit] + "..."


def read_records(path: io_utils.PathLike, *,
                 required: Sequence[str] = ("step",)) -> list[Record]:
  """The records of append-only JSONL file `path` ([] if it is missing).

  Args:
    path: the file (local or remote).
    required: keys every record has.

  Raises:
    RecordError: a record before the last one is damaged (not UTF-8, not
      JSON, not an object, or without a `required` key), or any record's
      `step` is not an integer, naming the file and line.
  """
  if not io_utils.as_path(path).exists():
    return []
  return _scan(path, _read(path), required)[0]


def _read(path: io_utils.PathLike) -> bytes:
  """The bytes of a record file, never read through a link (a job reads
  and rewrites only its own records)."""
  io_utils.check_own_file(path)  # A link, a FIFO, another name: refused.
  return io_utils.as_path(path).read_bytes()


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
    io_utils.LinkRefusedError: `path` is a symbolic link.
  """
  if not io_utils.as_path(path).exists():
    return []
  data = _read(path)
  records, torn = _scan(path, data, required)
  kept = [r for r in records if keep(r)]
  if len(kept) < len(records):
    logging.info("%s: %d records dropped on resume (logged again from the "
                 "restored step on)", path, len(records) - len(kept))
  if len(kept) < len(records) or torn is not None or (
      data and not data.endswith(b"\n")):
    io_utils.atomic_write_text(path, "".join(json.dumps(r) + "\n"
                                             for r in kept))
  return kept

"""Append-only JSONL records read back on resume: the torn-last-record rule.

Every record file a job resumes from (the trainer's metrics.jsonl, the
gate's gate.jsonl, the recall guard's recall_guard.jsonl, the eval job's
metrics.jsonl) is read through `realm_jax.core.records`; cut at any byte
of its last record, it still reads (the record dropped with a warning),
and once rewritten the job's next append starts a line of its own.
"""

import json

import pytest

from realm_jax.core import io_utils, records

# Records as each job writes them (io_utils.append_jsonl, one a line).
KINDS = {
    "metrics.jsonl": [{"step": 1, "loss": 2.5, "learning_rate": 1e-3},
                      {"step": 2, "loss": float("nan"), "eta": "0:01"}],
    "gate.jsonl": [{"step": 2, "utility": 0.01, "evidence_z": 1.5,
                    "passed": False, "streak": 0, "released": False},
                   {"step": 4, "utility": 0.2, "evidence_z": 3.5,
                    "passed": True, "streak": 1, "released": False}],
    "recall_guard.jsonl": [{"step": 2, "recall": 0.5, "baseline": 0.5,
                            "index_staleness": 0},
                           {"step": 4, "recall": 0.25, "baseline": 0.5,
                            "index_staleness": 2}],
    "eval_metrics.jsonl": [{"step": 3, "exact_match": 0.0,
                            "eval_seconds": 1.5},
                           {"step": 6, "exact_match": 0.25,
                            "eval_seconds": 1.25}],
}


def _write(path, kind):
  for record in KINDS[kind]:
    io_utils.append_jsonl(str(path), record)
  return path.read_bytes()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_cut_at_every_byte_of_the_last_record_still_resumes(
    tmp_path, kind, caplog):
  """For every offset inside the last record: read_records drops it with a
  warning naming the file and the record; keep_records rewrites the file
  so that the next append is a whole line, and that line reads back."""
  full = _write(tmp_path / kind, kind)
  start = full.rstrip(b"\n").rfind(b"\n") + 1
  first = json.loads(json.dumps(KINDS[kind][0]))
  for cut in range(start + 1, len(full) - 1):
    path = tmp_path / f"cut-{cut}-{kind}"
    path.write_bytes(full[:cut])
    caplog.clear()
    with caplog.at_level("WARNING"):
      got = records.read_records(str(path))
    assert json.dumps(got) == json.dumps([first]), cut
    assert f"{path}: its last record is torn" in caplog.text, cut
    assert repr(full[start:cut].decode())[:60] in caplog.text, cut
    records.keep_records(str(path))
    assert path.read_bytes() == full[:start], cut
    io_utils.append_jsonl(str(path), {"step": 99})
    assert [r["step"] for r in records.read_records(str(path))] == [
        first["step"], 99], cut


def test_a_last_record_without_its_newline_is_whole_and_kept(tmp_path):
  full = _write(tmp_path / "metrics.jsonl", "metrics.jsonl")
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(full[:-1])
  assert [r["step"] for r in records.read_records(str(path))] == [1, 2]
  records.keep_records(str(path))
  io_utils.append_jsonl(str(path), {"step": 3})
  assert [r["step"] for r in records.read_records(str(path))] == [1, 2, 3]


@pytest.mark.parametrize("damage", [b'{"step": 1, "lo\n', b"not json\n",
                                    b"[1, 2]\n", b'{"loss": 1.0}\n'])
def test_a_damaged_middle_record_is_an_error_naming_file_and_line(
    tmp_path, damage):
  path = tmp_path / "gate.jsonl"
  path.write_bytes(b'{"step": 0}\n' + damage + b'{"step": 2}\n')
  before = path.read_bytes()
  with pytest.raises(records.RecordError, match=f"{path}, line 2: "):
    records.read_records(str(path))
  with pytest.raises(records.RecordError, match="line 2"):
    records.keep_records(str(path))
  assert path.read_bytes() == before  # Nothing rewritten.


def test_keep_records_cuts_to_the_resumed_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  for step in range(1, 6):
    io_utils.append_jsonl(str(path), {"step": step})
  kept = records.keep_records(str(path), lambda r: r["step"] <= 3)
  assert [r["step"] for r in kept] == [1, 2, 3]
  assert [r["step"] for r in records.read_records(str(path))] == [1, 2, 3]
  assert records.keep_records(str(tmp_path / "missing.jsonl")) == []
  assert not (tmp_path / "missing.jsonl").exists()


@pytest.mark.parametrize("damage,error", [
    (b'{"step": 1, "loss": "\xff\xfe"}\n', "not UTF-8"),
    (b'{"step": "two"}\n', "its step is 'two' \\(str\\), not an integer"),
    (b'{"step": 1.5}\n', "its step is 1.5 \\(float\\)"),
    (b'{"step": true}\n', "its step is True \\(bool\\)")])
def test_undecodable_or_wrongly_typed_records_name_file_and_line(
    tmp_path, damage, error):
  """Records are read as bytes: a byte that is not UTF-8 or a step that is
  no integer is a RecordError naming the file and line, not a bare
  UnicodeDecodeError or TypeError."""
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 0}\n' + damage + b'{"step": 2}\n')
  with pytest.raises(records.RecordError, match=f"{path}, line 2: a "
                     f"damaged record \\({error}"):
    records.keep_records(str(path), lambda r: r["step"] <= 1)
  # Whole but wrongly typed, it is an error even as the last record.
  if b"step" in damage and b"\xff" not in damage:
    path.write_bytes(b'{"step": 0}\n' + damage.rstrip(b"\n"))
    with pytest.raises(records.RecordError, match=f"{path}, line 2: "):
      records.read_records(str(path))


def test_a_torn_last_record_cut_inside_a_character_is_dropped(tmp_path):
  path = tmp_path / "metrics.jsonl"
  line = '{"step": 1, "note": "Zürich"}'.encode()
  path.write_bytes(b'{"step": 0}\n' + line[:line.index(b"\xc3") + 1])
  assert records.keep_records(str(path)) == [{"step": 0}]
  assert path.read_bytes() == b'{"step": 0}\n'


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("end", [b"\r", b"\r\n"], ids=["CR", "CRLF"])
def test_cr_only_and_crlf_line_ends_keep_their_records(tmp_path, kind, end):
  """A record file saved with CR-only (old Mac) or CRLF line ends keeps
  every record, as a file read as text did (issue 64, R4: split at LF
  alone, a CR-only file was one torn "last record" and all were dropped);
  a torn last record is still dropped, and the next append reads back."""
  want = json.loads(json.dumps(KINDS[kind]))
  lines = [json.dumps(r).encode() for r in KINDS[kind]]
  path = tmp_path / kind
  path.write_bytes(end.join(lines) + end)
  assert json.dumps(records.read_records(str(path))) == json.dumps(want)
  assert json.dumps(records.keep_records(str(path))) == json.dumps(want)
  io_utils.append_jsonl(str(path), {"step": 99})
  assert [r["step"] for r in records.read_records(str(path))] == [
      r["step"] for r in want] + [99]
  path.write_bytes(end.join(lines) + end + lines[0][:5])  # torn
  assert json.dumps(records.keep_records(str(path))) == json.dumps(want)
  with pytest.raises(records.RecordError, match=f"{path}, line 2: "):
    path.write_bytes(end.join([lines[0], b"not json", lines[1]]))
    records.read_records(str(path))

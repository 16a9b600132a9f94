"""A job's own records and directories are never links, FIFOs or devices
(issue 64, item 2): `index/`, `checkpoints/`, `eval/`, `summaries/`,
`metrics.jsonl`, the eval ledger, `history.json`, `gate.jsonl`."""

import os

import pytest

from realm_jax.core import checkpoints, io_utils, outputs, records
from realm_jax.eval import qa_eval
from realm_jax.index import builder


def _plant(tmp_path, name: str, how: str) -> tuple[str, str]:
  """`tmp_path/name` planted as `how`; (its path, the victim's)."""
  victim = tmp_path / "victim.txt"
  victim.write_text('{"step": 1}\n')
  path = tmp_path / name
  if how == "symlink":
    os.symlink(victim, path)
  elif how == "hardlink":
    os.link(victim, path)
  elif how == "fifo":
    os.mkfifo(path)
  else:
    assert how == "directory"
    path.mkdir()
  return str(path), str(victim)


@pytest.mark.parametrize("how", ["symlink", "hardlink", "fifo", "directory"])
@pytest.mark.parametrize("name", ["metrics.jsonl", "gate.jsonl",
                                  "recall_guard.jsonl"])
def test_record_files_that_are_not_plain_files_are_refused(tmp_path, name,
                                                          how):
  """Read back, kept on resume, or appended to: refused naming the file,
  at once (a FIFO would block the job forever), the victim untouched."""
  path, victim = _plant(tmp_path, name, how)
  error = (io_utils.LinkRefusedError if how in ("symlink", "hardlink")
           else io_utils.NotRegularFileError)
  for use in (records.read_records, records.keep_records,
              lambda p: io_utils.append_text(p, '{"step": 2}\n')):
    with pytest.raises(error, match=name):
      use(path)
  assert open(victim).read() == '{"step": 1}\n'


@pytest.mark.parametrize("how", ["symlink", "fifo"])
def test_the_eval_ledger_and_history_are_never_read_through_a_link_or_fifo(
    tmp_path, how):
  path, _ = _plant(tmp_path, qa_eval.LEDGER, how)
  with pytest.raises((io_utils.LinkRefusedError,
                      io_utils.NotRegularFileError), match=qa_eval.LEDGER):
    qa_eval._read_ledger(path, {})  # pylint: disable=protected-access
  path, _ = _plant(tmp_path, "history.json", how)
  with pytest.raises((io_utils.LinkRefusedError,
                      io_utils.NotRegularFileError), match="history.json"):
    io_utils.check_own_file(path)


@pytest.mark.parametrize("how", ["symlink", "fifo"])
def test_checkpoints_and_index_directories_are_never_links(tmp_path, how):
  """A trainer's `checkpoints/` and the builder's `index/`, planted as a
  link to a victim directory (or as a FIFO), are refused before anything
  is written; the victim keeps its files."""
  for name in ("checkpoints", "index"):
    victim = tmp_path / f"victim_{name}"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    path = tmp_path / "w" / name
    path.parent.mkdir(exist_ok=True)
    if how == "symlink":
      os.symlink(victim, path)
    else:
      os.mkfifo(path)
  with pytest.raises((io_utils.LinkRefusedError,
                      io_utils.NotRegularFileError), match="checkpoints"):
    checkpoints.TrainCheckpointer(str(tmp_path / "w" / "checkpoints"))
  with pytest.raises((io_utils.LinkRefusedError, outputs.OwnershipError),
                     match="index"):
    builder.check_places(str(tmp_path / "w" / "index"),
                         str(tmp_path / "w"), store=None)
  for name in ("checkpoints", "index"):
    assert os.listdir(tmp_path / f"victim_{name}") == ["keep.txt"]
  # A workdir that is itself a link (put on a bigger disk) is fine.
  os.symlink(tmp_path / "real", tmp_path / "linked")
  (tmp_path / "real").mkdir()
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "linked" /
                                           "checkpoints"))
  ckpt.close()

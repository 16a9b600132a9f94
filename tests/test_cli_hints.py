"""Commands that messages and docstrings tell users to run take their flags.

Hints once said `python -m realm_jax.jobs.index_builder --one_shot` and
`--block_emb=...`, flags no job defines (issue 27, item 9); the builder
takes `--gin.builder.BuilderConfig.one_shot=True`. Every string in
realm_jax/ (messages, docstrings) and every comment of gin_configs/ is
scanned for `python -m realm_jax.<module> ...` and `realm-<script> ...`
commands, and each `--flag` of them must be one that module's command line
accepts: the absl flags it defines, argparse options it adds, gin_cli's
flags (`--gin_file`, `--gin_bindings`, `--dry_run`, `--gin.X=Y`) when it
runs through `gin_cli`, absl's own (`--verbosity`, ...) and, for the Beam
data jobs, Beam's pipeline options.
"""

from __future__ import annotations

import ast
import collections
import functools
import pathlib
import re
import tomllib

import pytest

from realm_jax import cli
from realm_jax import gin_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "realm_jax"

# A command: in backticks, up to the closing one (across line breaks);
# otherwise to the end of its line (a line ending in a backslash goes on).
_COMMAND = re.compile(
    r"(?P<tick>`)?(?:python3? -m (?P<module>realm_jax(?:\.\w+)+)|"
    r"(?<![\w/-])(?P<script>realm-[a-z]+(?:-[a-z]+)*))"
    r"(?P<args>(?(tick)[^`]*|(?:\\\n|[^`\n])*))")
_FLAG = re.compile(r"(?<![\w-])--(?P<name>[A-Za-z_][\w.]*)")
# absl's flags that every absl program takes (absl.app, absl.logging and the
# flag parser itself).
_ABSL_SPECIAL = {"help", "helpshort", "helpfull", "helpxml", "flagfile",
                 "undefok", "?"}


def _strings(tree: ast.AST) -> list[str]:
  """The str literals of a module (f-strings with `{}` for each field)."""
  parts = {id(v) for node in ast.walk(tree)
           if isinstance(node, ast.JoinedStr) for v in node.values}
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.JoinedStr):
      out.append("".join(v.value if isinstance(v, ast.Constant) else "{}"
                         for v in node.values))
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in parts):
      out.append(node.value)
  return out


def _commands(text: str) -> list[tuple[str, list[str]]]:
  """(module or console script, its `--flag` names) of each command."""
  return [(m["module"] or m["script"],
           [f["name"] for f in _FLAG.finditer(m["args"])])
          for m in _COMMAND.finditer(text)]


def _hint_sources() -> list[tuple[str, str]]:
  """(where, text) of everything shown to users that may hold commands."""
  out = []
  for path in sorted(PACKAGE.rglob("*.py")):
    where = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out.extend((where, s) for s in _strings(tree) if "realm" in s)
  for path in sorted((ROOT / "gin_configs").rglob("*.gin")):
    comments = [line.split("#", 1)[1] for line in
                path.read_text(encoding="utf-8").splitlines() if "#" in line]
    out.append((str(path.relative_to(ROOT)), "\n".join(comments)))
  return out


@functools.lru_cache(maxsize=None)
def _scripts() -> dict[str, str]:
  """Console script -> module (pyproject.toml -> realm_jax/cli.py)."""
  scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "project"]["scripts"]
  return {name: cli.SCRIPTS[target.split(":")[1]]
          for name, target in scripts.items()}


def _defined_flags(tree: ast.AST) -> set[str]:
  """absl `DEFINE_*("name", ...)` and argparse `add_argument("--name")`."""
  names = set()
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and node.args and
            isinstance(node.args[0], ast.Constant) and
            isinstance(node.args[0].value, str)):
      continue
    func = node.func.attr if isinstance(node.func, ast.Attribute) else (
        getattr(node.func, "id", ""))
    if func.startswith("DEFINE_"):
      names.add(node.args[0].value)
    elif func == "add_argument":
      names.update(a.value.lstrip("-") for a in node.args
                   if isinstance(a, ast.Constant)
                   and str(a.value).startswith("--"))
  return names


def _calls(tree: ast.AST, owner: str, name: str) -> bool:
  """Whether the module calls `<owner>.<name>(...)`."""
  return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == name and isinstance(n.func.value, ast.Name)
             and n.func.value.id == owner for n in ast.walk(tree))


@functools.lru_cache(maxsize=None)
def _absl_flags() -> frozenset[str]:
  from absl import app, flags, logging  # pylint: disable=g-import-not-at-top
  names = set(_ABSL_SPECIAL)
  for module in (app, logging):
    for flag in flags.FLAGS.get_flags_for_module(module):
      names.update(n for n in (flag.name, flag.short_name) if n)
  return frozenset(names)


@functools.lru_cache(maxsize=None)
def _beam_options() -> frozenset[str]:
  from apache_beam.options import pipeline_options  # pylint: disable=g-import-not-at-top
  return frozenset(pipeline_options.PipelineOptions([]).get_all_options())


class _Job:
  """What one module's command line accepts."""

  def __init__(self, module: str):
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    if not path.exists():
      raise AssertionError(f"no module {module} ({path})")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    gin_tree = ast.parse((PACKAGE / "gin_cli.py").read_text())
    self.defined = _defined_flags(tree)
    self.beam = _calls(tree, "gin_cli", "run_data_job")
    self.uses_gin = self.beam or _calls(tree, "gin_cli", "run")
    self.absl = self.uses_gin or _calls(tree, "app", "run")
    self.gin_flags = _defined_flags(gin_tree) if self.uses_gin else set()

  def accepts(self, flag: str) -> bool:
    if flag in self.defined or flag in self.gin_flags:
      return True
    if flag.startswith("no") and flag[2:] in self.defined:  # absl booleans.
      return True
    if self.uses_gin and flag.startswith("gin."):
      # What gin_cli turns into a binding (`--gin.A.b=V` -> `A.b = V`).
      return bool(gin_cli.split_gin_flags([f"--{flag}=1"])[1])
    if self.absl and flag in _absl_flags():
      return True
    return self.beam and flag in _beam_options()


def _problems(commands) -> list[str]:
  problems = []
  for where, (target, flags) in commands:
    module = _scripts().get(target, target)
    if target.startswith("realm-") and target not in _scripts():
      problems.append(f"{where}: no console script {target}")
      continue
    job = _Job(module)
    problems.extend(f"{where}: {target} does not accept --{flag}"
                    for flag in flags if not job.accepts(flag))
  return problems


ALL_COMMANDS = [(where, command) for where, text in _hint_sources()
                for command in _commands(text)]


def test_the_scan_finds_the_commands():
  modules = {target for _, (target, _) in ALL_COMMANDS}
  assert {"realm_jax.jobs.index_builder", "realm_jax.jobs.ask",
          "realm_jax.jobs.pretrain", "realm_jax.jobs.corpus",
          "realm_jax.jobs.demo"} <= modules
  assert sum(len(flags) for _, (_, flags) in ALL_COMMANDS) >= 40


def test_every_hinted_flag_is_accepted():
  assert not _problems(ALL_COMMANDS), "\n".join(_problems(ALL_COMMANDS))


@pytest.mark.parametrize("text, bad", [
    ("build one with `python -m realm_jax.jobs.index_builder --one_shot` or",
     ["realm_jax.jobs.index_builder does not accept --one_shot"]),
    ("published by `python -m realm_jax.jobs.index_builder --block_emb=...`).",
     ["realm_jax.jobs.index_builder does not accept --block_emb"]),
    ("python -m realm_jax.jobs.index_builder "
     "--gin_file=runs/index_builder.gin \\\n"
     "    --workdir=W --gin.builder.BuilderConfig.one_shot=True",
     ["realm_jax.jobs.index_builder does not accept --workdir"]),
    # The demo is no gin job: it has its own flags.
    ("python -m realm_jax.jobs.demo --workdir=/tmp/d --gin.DemoConfig.x=1",
     ["realm_jax.jobs.demo does not accept --gin.DemoConfig.x"]),
    ("realm-ask --json --top_k=2 --verbosity=1 --nojson 'Who?'", []),
    ("realm-ask --topk=2 'Who?'", ["realm-ask does not accept --topk"]),
    ("realm-corpus --gin_file=runs/corpus.gin --direct_num_workers=4", []),
    ("python -m realm_jax.jobs.pretrain --gin.WORKDIR=\"'W'\" "
     "--dry_run\nthen --one_shot on another line", []),
    ("realm-builder --x", ["no console script realm-builder"]),
])
def test_the_check_catches_flags_a_job_does_not_take(text, bad):
  problems = _problems([("hint", c) for c in _commands(text)])
  assert [p.split(": ", 1)[1] for p in problems] == bad


# ------------------------------------------- gin flags named outside commands

# `--gin.A.b=V` / `--gin.MACRO=V` anywhere in a message, docstring or gin
# comment (a hint like "rerun with --gin.CorpusConfig.overwrite=True" is no
# `python -m` command): placeholders (one letter, `{...}`, `<...>`) aside.
_GIN_FLAG = re.compile(r"--gin\.(?P<target>[A-Za-z_][\w.]*)=")


def _all_hint_texts() -> list[tuple[str, str]]:
  """(where, text): every str literal of realm_jax/, every gin comment."""
  out = []
  for path in sorted(PACKAGE.rglob("*.py")):
    where = str(path.relative_to(ROOT))
    out.extend((where, s) for s in _strings(
        ast.parse(path.read_text(encoding="utf-8"))))
  return out + [(where, text) for where, text in _hint_sources()
                if where.endswith(".gin")]


@functools.lru_cache(maxsize=None)
def _configurables() -> dict[str, set[str]]:
  """Class or function name -> its fields / parameters, across realm_jax/."""
  names = collections.defaultdict(set)
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.ClassDef):
        names[node.name].update(
            n.target.id for n in node.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
      elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        names[node.name].update(
            x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
  return names


@functools.lru_cache(maxsize=None)
def _macros() -> frozenset[str]:
  """Every macro a gin file defines (`NAME = ...`)."""
  return frozenset(
      m for path in (ROOT / "gin_configs").rglob("*.gin")
      for m in re.findall(r"^([A-Z_][A-Z0-9_]*)\s*=",
                          path.read_text(encoding="utf-8"), re.M))


def _gin_flag_problems(texts) -> list[str]:
  problems = []
  for where, text in texts:
    for match in _GIN_FLAG.finditer(text):
      parts = match["target"].split(".")
      if len(parts[-1]) == 1 or (len(parts) > 1 and len(parts[-2]) == 1):
        continue  # A placeholder: --gin.X=Y, --gin.A.b=V.
      if len(parts) == 1:
        if parts[0] not in _macros():
          problems.append(f"{where}: no gin file defines {parts[0]}")
      elif parts[-1] not in _configurables().get(parts[-2], ()):
        problems.append(f"{where}: {parts[-2]} has no field {parts[-1]} "
                        f"(--gin.{match['target']})")
  return problems


def test_every_hinted_gin_flag_names_a_field():
  """e.g. the block store's "already exists" hint: once "(--overwrite)",
  which the corpus job dropped; now --gin.CorpusConfig.overwrite=True."""
  texts = _all_hint_texts()
  assert sum(len(_GIN_FLAG.findall(t)) for _, t in texts) >= 40
  assert any("--gin.CorpusConfig.overwrite=True" in t for _, t in texts)
  assert not _gin_flag_problems(texts), "\n".join(_gin_flag_problems(texts))
  assert _gin_flag_problems([
      ("hint", "pass --gin.CorpusConfig.overwrit=True"),
      ("hint", "set --gin.OUTPUT_DIRS=\"'x'\" or --gin.A.b=V")]) == [
          "hint: CorpusConfig has no field overwrit "
          "(--gin.CorpusConfig.overwrit)",
          "hint: no gin file defines OUTPUT_DIRS"]


def test_no_hint_names_a_bare_pre_gin_flag():
  """"(--overwrite)" and the like: a flag no job defines, outside any
  command. Hints name gin flags instead."""
  stale = re.compile(r"\(--(overwrite|output_dir|one_shot|block_emb|"
                     r"max_block_len|num_shards)\b")
  found = [f"{where}: {m.group(0)}" for where, text in _all_hint_texts()
           for m in stale.finditer(text)]
  assert not found, "\n".join(found)

"""Every documented command runs as written (issue 28, item 7).

A user copies a command from the docs; a stale one (a moved test, a
dropped flag, a module that lost its `__main__`) should fail CI, not them.
The commands are read from README.md, BUILD.md, docs/**/*.md and
launch/README.md (fenced shell blocks, backslash continuations joined, and
inline code spans), and from the launchers' own usage examples (the
docstring of launch/tpu_pod.py, the header of launch/local.sh). The
example commands of the gin files' headers are tests/test_gin_examples.py's,
the commands in realm_jax/'s strings tests/test_cli_hints.py's.

Each command that runs something of this repo is dry-run:
  * `python -m realm_jax.<job>` and the `realm-<job>` console scripts with
    `--dry_run` (parse the flags and gin files, build and check the
    configs, print them, do nothing); a module must have a `__main__`
    block (one without exits 0 and does nothing). A bound number or
    boolean must show in the printed config;
  * `python benchmarks/<x>.py` and `python -m benchmarks.<x>`: its own
    argparse / absl parser reads the flags (an unknown flag or a bad value
    fails) and the script stops there;
  * `python -m pytest`: the test files, and the tests a node id names,
    exist; `-n` needs pytest-xdist;
  * `python launch/tpu_pod.py` with `--dry_run` and `launch/local.sh` with
    DRY_RUN=1: each prints the commands it would run, and the job commands
    among them (inside the `gcloud ... ssh --command=...`) are dry-run in
    turn;
  * `pip` is not run, but its `-c` / `-r` files and the extras it names
    must exist.
Placeholders become temporary paths: shell variables (`$D`, `$WORKDIR`;
one defined as a command, `T="python launch/tpu_pod.py"`, is expanded),
`<tag>`, `...` inside a value; a `...` standing for more flags gets the
job's must-set gin macros; `[--optional=flag]` is checked as a flag;
`--flag=N` becomes 2. A file a job writes and a command then reads
(the demo's `<workdir>/ask.gin`) is written there first, as the job
writes it (`_WRITTEN_BY_A_JOB`). A block whose first line is `# NAME.ext` and whose
lines are flags is that file (`@pod.args`). An inline span with no
arguments, or with capitalised parameter names (`launch/local.sh WORKDIR
...`), names a command: its module, script or file must exist.
Commands that cannot be dry-run are skipped through `_SKIPPED`; those whose
documented outcome is a failure are checked for it through `_FAILS`.
`_STALE` holds stale commands that the checks must refuse.

docs/results/learning_log.md is left out: a verbatim log whose commands
ran at the code of their own day (its header says so; tests/test_doc_names.py
leaves it out too).

The `python -m` / `python -c` commands run in children forked from one
process that has imported the heavy libraries (`_FORK_SERVER`), 4 at a
time: a fresh interpreter spends most of a dry run importing them (about
3 minutes for all on a loaded 2-core machine, under 1 minute so).
REALM_DOCS_FORK=0 runs each in a fresh interpreter instead.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import functools
import importlib.util
import itertools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import threading
import tomllib

import pytest

# The neighbouring tests and their helpers (pytest puts tests/ on sys.path).
import test_cli_help
import test_cli_hints
import test_gin_examples
from realm_jax.core import gin_text
from realm_jax.testing import timeouts

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Their helpers.
# pylint: disable=protected-access
_BINDING = test_gin_examples._BINDING  # `--gin.A.b=V`
_PLACEHOLDER = test_gin_examples._PLACEHOLDER  # `$D`, `<tag>`, `...`
_runs_file = test_gin_examples._runs_file  # module -> its own gin file
_script_entries = test_cli_help._scripts  # realm-x -> "module:function"
_script_modules = test_cli_hints._scripts  # realm-x -> module
_MAIN = test_cli_help._MAIN  # `if __name__ == "__main__":`
# pylint: enable=protected-access

# Commands of this repo's docs that cannot be dry-run, by program: why.
# (`pip` is not run either, but the constraints / requirements files and
# the extras it names must exist.) Anything else of this repo is dry-run;
# other programs (gcloud, git, shell builtins, printed outputs) are not
# this repo's.
_SKIPPED = {
    "tensorboard": "a server that runs until it is stopped",
}
# Commands whose documented outcome is a failure: a substring of the
# command -> what its dry run must print (docs/reliability.md shows how a
# bad value is refused).
_FAILS = {
    "--gin.pretrain.PretrainConfig.checkpoint_every=2.5":
        "ConfigTypeError: PretrainConfig.checkpoint_every must be int, "
        "got 2.5 (float)",
    "--gin.realm.RetrieverConfig.score_scale=1e309":
        "ConfigTypeError: RetrieverConfig.score_scale must be finite, got "
        "inf",
    "RetrieverScheduleConfig.learning_rate_multiplier=-1.0":
        "RetrieverScheduleConfig.learning_rate_multiplier must be >= 0, "
        "got -1.0",
    "--gin_file=runs/index_builder.gin --one_shot":
        "Unknown command line flag 'one_shot'; did you mean "
        "--gin.BuilderConfig.one_shot=True?",
    "--gin.aot.AotConfig.num_blocks=1000000000000000000000000000000":
        "AotConfig.num_blocks must be <= 2,147,483,647",
    "--gin.TOPOLOGY='v5e:3x3'":
        "AotConfig.topology='v5e:3x3' does not divide into hosts",
}
# REALM_DOCS_FORK=0: every command in an interpreter of its own (slower;
# rules the fork server out when a result looks odd).
_FORK = os.environ.get("REALM_DOCS_FORK", "1") != "0"
_SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
_PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
# Words that may precede a command: shell keywords, prefixes.
_PREFIXES = {"do", "then", "else", "time", "nohup", "env", "exec", "{", "(",
             "!"}
_SEPARATORS = {";", "&&", "||", "&", "|", "\n", ";;", "(", ")", "{", "}"}
_REDIRECTIONS = {">", ">>", "<", ">&", "&>", "<&", "&>>", ">|"}
# A usage synopsis names its parameters in capitals.
_SYNOPSIS = re.compile(r"^\[?[A-Z][A-Z0-9_]+(\.\.\.)?\]?$")


@dataclasses.dataclass
class Command:
  """One documented command, as it will be checked."""
  where: str  # file:line
  text: str  # as documented (continuations joined)
  kind: str  # job script benchmark pytest launcher pip mention skipped
  target: str  # module, console script or repo path
  args: list[str]
  elided: bool = False  # a `...` stands for more flags
  reason: str = ""  # why it is skipped / why it cannot be read


# ------------------------------------------------------------ reading docs


def _strip_comment(line: str) -> str:
  """`line` up to a `#` that starts a word outside quotes."""
  quote, prev = "", " "
  for i, c in enumerate(line):
    if quote:
      if c == quote and (quote == "'" or prev != "\\"):
        quote = ""
    elif c in "'\"" and prev != "\\":
      quote = c
    elif c == "#" and prev in " \t":
      return line[:i]
    prev = c if not (c == "\\" and prev == "\\") else " "
  return line


def _tokens(text: str) -> list[str]:
  """The shell words and operators of `text` (a `<tag>` placeholder is a
  word, not two redirections)."""
  text = re.sub(r"<(\w+)>", "\x00\\1\x01", text)
  lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  lexer.commenters = ""
  return [t.replace("\x00", "<").replace("\x01", ">") for t in lexer]


def _simple_commands(tokens: list[str]) -> list[list[str]]:
  """The words of each simple command (split at `;`, `&&`, `|`, `&`, ...;
  redirections and shell prefixes dropped)."""
  commands, words, i = [], [], 0
  while i < len(tokens):
    token = tokens[i]
    if token in _SEPARATORS:
      commands.append(words)
      words = []
    elif token in _REDIRECTIONS:
      if words and words[-1].isdigit():  # `2>&1`
        words.pop()
      i += 1  # Its target.
    else:
      words.append(token)
    i += 1
  commands.append(words)
  out = []
  for words in commands:
    while words and (words[0] in _PREFIXES or (
        _ASSIGNMENT.match(words[0]) and len(words) > 1 and
        not all(_ASSIGNMENT.match(w) for w in words))):
      words = words[1:]  # `XLA_FLAGS=... python ...`, `nohup env X=1 ...`
    if words:
      out.append(words)
  return out


@functools.lru_cache(maxsize=None)
def _console_scripts() -> dict[str, str]:
  return _script_entries()


def _classify(words: list[str]) -> tuple[str, str, list[str]] | None:
  """(kind, target, args) of a command of this repo, else None."""
  program, rest = words[0], words[1:]
  if _PYTHON.search(program):
    if len(rest) >= 2 and rest[0] == "-m":
      if rest[1] == "realm_jax" or rest[1].startswith("realm_jax."):
        return "job", rest[1], rest[2:]
      if rest[1] == "benchmarks" or rest[1].startswith("benchmarks."):
        return "benchmark", rest[1], rest[2:]
      if rest[1] == "pytest":
        return "pytest", "pytest", rest[2:]
      if rest[1] == "pip":
        return "pip", "pip", rest[2:]
      return ("skipped", rest[1], rest[2:]) if rest[1] in _SKIPPED else None
    if rest and re.match(r"^(\./)?(benchmarks|launch)/[\w/]+\.py$", rest[0]):
      path = rest[0].removeprefix("./")
      kind = "benchmark" if path.startswith("benchmarks/") else "launcher"
      return kind, path, rest[1:]
    return None
  if re.match(r"^(\./)?launch/\w+\.sh$", program):
    return "launcher", program.removeprefix("./"), rest
  if re.match(r"^realm-[a-z]+(-[a-z]+)*$", program):
    return "script", program, rest
  if program == "pip":
    return "pip", "pip", rest
  if program in _SKIPPED:
    return "skipped", program, rest
  return None


def _commands_in(text: str, where: str, line: int, variables: dict,
                 inline: bool = False) -> list[Command]:
  """The commands of this repo in one logical shell line (`inline`: a
  code span in prose, where a command without arguments only names it)."""
  try:
    tokens = _tokens(text)
  except ValueError as e:  # Unbalanced quotes: prose, unless it names a job.
    words = text.split()
    if words and _classify(words):
      return [Command(f"{where}:{line}", text, "broken", words[0], [],
                      reason=f"cannot be read as a shell command: {e}")]
    return []
  out = []
  for words in _simple_commands(tokens):
    if all(_ASSIGNMENT.match(w) for w in words):
      for w in words:  # `D=/tmp/realm`, `T="python launch/tpu_pod.py"`
        name, _, value = w.partition("=")
        variables[name] = value
      continue
    expanded = []
    for w in words:
      name = re.fullmatch(r"\$\{?(\w+)\}?", w)
      if name and " " in variables.get(name[1], ""):
        expanded.extend(shlex.split(variables[name[1]]))
      else:
        expanded.append(w)
    found = _classify(expanded)
    if found is None:
      continue
    kind, target, args = found
    if "<" in target:  # `python -m realm_jax.<module>`: no command.
      continue
    command = Command(f"{where}:{line}", " ".join(words), kind, target, [])
    for a in args:
      if a == "...":
        command.elided = True
        continue
      if re.fullmatch(r"\[--[^\[\]]+\]", a):  # An optional flag.
        a = a[1:-1]
      a = re.sub(r"^(--[\w.-]+)=N$", r"\1=2", a)
      command.args.append(a)
    if kind == "skipped":
      command.reason = _SKIPPED[target]
    elif kind not in {"pytest", "pip"} and (
        (inline or command.elided) and not command.args or
        any(_SYNOPSIS.match(a) for a in args)):
      command.kind = "mention"
    out.append(command)
  return out


def _shell_text(lines: list[tuple[int, str]], where: str,
                variables: dict, inline: bool = False) -> list[Command]:
  """The commands of a block of shell lines (number, text); `inline`: the
  lines are prose (a docstring), not a code block."""
  out, pending, start = [], "", 0
  for number, line in lines:
    if not pending:
      start = number
      if line.lstrip().startswith("#"):
        continue
    line = _strip_comment(line)
    if line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
      continue
    out.extend(_commands_in(pending + line, where, start, variables,
                            inline))
    pending = ""
  if pending:
    out.extend(_commands_in(pending, where, start, variables, inline))
  return out


def _markdown(path: pathlib.Path, files: dict[str, str]) -> list[Command]:
  """The commands of a Markdown file: fenced shell blocks, then inline
  spans. `files`: the files its blocks spell out (`# pod.args` blocks)."""
  where = str(path.relative_to(ROOT))
  lines = path.read_text(encoding="utf-8").splitlines()
  variables: dict[str, str] = {}
  out, prose, block, fence, lang = [], [], None, "", ""
  for number, line in enumerate(lines, 1):
    opening = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
    if block is None and opening:
      block, fence, lang = [], opening[1], opening[2].lower()
      prose.append("")
      continue
    if block is not None:
      prose.append("")
      if line.strip().startswith(fence):
        named = block and re.match(r"#\s*(\S+\.\w+)\b", block[0][1])
        if named and all(l.strip().startswith("--") for _, l in block[1:]):
          files[named[1]] = "".join(l.strip() + "\n" for _, l in block[1:])
        elif lang in _SHELL_LANGS:
          out.extend(_shell_text(block, where, variables))
        block = None
      else:
        block.append((number, line))
      continue
    prose.append(line)
  text = "\n".join(prose)
  for span in re.finditer(r"`([^`]+)`", text):
    if "\n\n" in span[1]:
      continue
    number = text.count("\n", 0, span.start()) + 1
    out.extend(_commands_in(span[1].replace("\n", " "), where, number,
                            variables, inline=True))
  return out


def _launcher_examples() -> list[Command]:
  """The usage examples in launch/'s docstrings and header comments."""
  out = []
  for path in sorted((ROOT / "launch").iterdir()):
    where = str(path.relative_to(ROOT))
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
      tree = ast.parse(source)
      doc = ast.get_docstring(tree, clean=False) or ""
      lines = list(enumerate(doc.splitlines(), tree.body[0].lineno))
    elif path.suffix == ".sh":
      lines = []
      for number, line in enumerate(source.splitlines(), 1):
        if number == 1 and line.startswith("#!"):
          continue
        if not line.startswith("#"):
          break
        lines.append((number, line[1:].removeprefix(" ")))
    else:
      continue
    out.extend(_shell_text(lines, where, {}, inline=True))
  return out


def _documented() -> tuple[list[Command], dict[str, str]]:
  files: dict[str, str] = {}
  paths = [ROOT / "README.md", ROOT / "BUILD.md",
           *sorted((ROOT / "docs").rglob("*.md")), ROOT / "launch/README.md"]
  paths.remove(ROOT / "docs" / "results" / "learning_log.md")
  commands = [c for p in paths for c in _markdown(p, files)]
  return commands + _launcher_examples(), files


# ------------------------------------------------------------ checking them


def _module_path(module: str) -> pathlib.Path:
  return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _benchmark_path(target: str) -> pathlib.Path:
  """The file a benchmark command runs: a script's path, or a module's
  file (a package's `__main__.py`)."""
  if "/" in target:
    return ROOT / target
  package = ROOT.joinpath(*target.split("."))
  return package / "__main__.py" if package.is_dir() else _module_path(target)


def _job_problem(module: str) -> str:
  path = _module_path(module)
  if not path.exists():
    return f"no module {module} ({path.relative_to(ROOT)})"
  if not _MAIN.search(path.read_text(encoding="utf-8")):
    return (f"{module} has no `if __name__ == \"__main__\":` block: "
            "`python -m` runs nothing")
  return ""


def _module_of(command: Command) -> str:
  if command.kind == "script":
    return _script_modules()[command.target]
  return command.target


def _substituted(args: list[str], tmp: pathlib.Path) -> list[str]:
  def path(match):
    return str(tmp / (match["name"] or match["tag"] or "path").lower())
  return [_PLACEHOLDER.sub(path, a) for a in args]


# Stops a script once its argparse / absl parser has read the flags.
_PARSE_ONLY = r"""
import argparse, os, runpy, sys
def stop():
  print("FLAGS PARSED", flush=True)
  os._exit(0)
parse_args = argparse.ArgumentParser.parse_args
def parse_only(self, args=None, namespace=None):
  parse_args(self, args, namespace)  # Exits 2 on a flag it does not take.
  stop()
argparse.ArgumentParser.parse_args = parse_only
from absl import app, flags
def run(main, argv=None, **kwargs):
  flags.FLAGS(sys.argv if argv is None else argv)  # Raises on a bad flag.
  stop()
app.run = run
if sys.argv[1] == "-m":  # -m ROOT MODULE ARGS: `python -m MODULE ARGS`
  root, module = sys.argv[2:4]
  sys.argv = sys.argv[3:]
  sys.path.insert(0, root)
  runpy.run_module(module, run_name="__main__", alter_sys=True)
else:  # SCRIPT ARGS: `python SCRIPT ARGS`
  script = sys.argv[1]
  sys.argv = sys.argv[1:]
  sys.path.insert(0, os.path.dirname(script))
  runpy.run_path(script, run_name="__main__")
sys.exit("the script ran without reading flags through argparse or absl")
"""


def _environment() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("REALM_JAX_")}  # No distributed runtime.
  env.update(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu",
             PYTHON=sys.executable, DRY_RUN="1")
  return env


# A fork server: imports the heavy third-party libraries once, then forks
# a child for each `python -m MODULE ARGS` / `python -c CODE ARGS` it is
# sent (one JSON line each), which runs it as the interpreter would (runpy;
# fresh absl flags and gin registry: realm_jax itself is not imported
# here), its stdout and stderr in files; it answers each with the child's
# exit status. A dry run costs 1.5-3.5 s of CPU in a fresh interpreter,
# nearly all of it in these imports; here, a fraction of a second.
_PRELOAD = ("numpy", "jax", "flax.nnx", "optax", "orbax.checkpoint",
            "apache_beam", "apache_beam.options.pipeline_options", "gin",
            "absl.app", "absl.flags", "absl.logging", "etils.epath")
_FORK_SERVER = r"""
import atexit, json, os, runpy, select, signal, sys, time, traceback
for name in sys.argv[1:]:
  try:
    __import__(name)
  except Exception:  # pylint: disable=broad-except
    pass


def child(request):
  signal.alarm(request["timeout"])
  for fd, path, mode in ((0, os.devnull, os.O_RDONLY),
                         (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                         (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
    os.dup2(os.open(path, mode, 0o644), fd)
  flag, what, args = request["argv"][1], request["argv"][2], request["argv"][3:]
  code = 0
  try:
    if flag == "-m":
      sys.argv = [what, *args]
      runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:
      sys.argv = ["-c", *args]
      exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  try:
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    os._exit(code)


running, pending, done = {}, b"", False
while not done or running:
  if not done and select.select([0], [], [], 0.02)[0]:
    chunk = os.read(0, 1 << 16)
    done = not chunk
    pending += chunk
    while b"\n" in pending:
      line, pending = pending.split(b"\n", 1)
      request = json.loads(line)
      pid = os.fork()
      if pid == 0:
        child(request)
      running[pid] = request["id"]
  elif done:
    time.sleep(0.02)
  while running:
    pid, status = os.waitpid(-1, os.WNOHANG)
    if not pid:
      break
    answer = {"id": running.pop(pid), "rc": os.waitstatus_to_exitcode(status)}
    os.write(1, (json.dumps(answer) + "\n").encode())
"""


class _ForkServer:
  """The test's end of `_FORK_SERVER`."""

  def __init__(self, tmp: pathlib.Path, env: dict[str, str]):
    self.tmp = tmp / "fork_server"
    self.tmp.mkdir()
    # pylint: disable=consider-using-with
    self.log = open(self.tmp / "server.log", "w+", encoding="utf-8")
    self.process = subprocess.Popen(
        [sys.executable, "-c", _FORK_SERVER, *_PRELOAD], cwd=tmp, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
    # pylint: enable=consider-using-with
    self.lock, self.count = threading.Lock(), itertools.count()
    self.waiting: dict[int, concurrent.futures.Future] = {}
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self):
    for line in self.process.stdout:
      answer = json.loads(line)
      with self.lock:
        self.waiting.pop(answer["id"]).set_result(answer["rc"])
    with self.lock:  # It died: nothing more will come.
      self.log.seek(0)
      error = RuntimeError(f"the fork server died:\n{self.log.read()[-2000:]}")
      for future in self.waiting.values():
        future.set_exception(error)
      self.waiting.clear()

  def run(self, argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    future = concurrent.futures.Future()
    with self.lock:
      n = next(self.count)
      out, err = self.tmp / f"{n}.out", self.tmp / f"{n}.err"
      self.waiting[n] = future
      self.process.stdin.write((json.dumps({
          "id": n, "argv": argv, "timeout": timeout, "stdout": str(out),
          "stderr": str(err)}) + "\n").encode())
      self.process.stdin.flush()
    rc = future.result(timeout=timeout + 60)
    return subprocess.CompletedProcess(
        argv, rc, out.read_text(encoding="utf-8", errors="replace"),
        err.read_text(encoding="utf-8", errors="replace"))

  def close(self):
    self.process.stdin.close()
    self.process.wait(timeout=timeouts.HANG_SECONDS)
    self.log.close()


class _Runner:
  """Runs each distinct command line once (several docs share some), at
  most `pool`'s size at a time: `python -m` / `python -c` in the fork
  server, anything else (the launchers) as a subprocess."""

  def __init__(self, tmp: pathlib.Path, pool, fork: bool = True):
    self.tmp, self.pool, self.futures = tmp, pool, {}
    self.env = _environment()
    self.server = _ForkServer(tmp, self.env) if fork else None
    self.lock = threading.Lock()

  def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
    if self.server and argv[0] == sys.executable and argv[1] in {"-m", "-c"}:
      return self.server.run(argv, timeout=timeouts.HANG_SECONDS)
    return subprocess.run(argv, capture_output=True, text=True, cwd=self.tmp,
                          env=self.env, timeout=timeouts.HANG_SECONDS,
                          check=False)

  def run(self, argv: list[str]) -> subprocess.CompletedProcess:
    with self.lock:
      key = tuple(argv)
      if key not in self.futures:
        self.futures[key] = self.pool.submit(self._run, argv)
    return self.futures[key].result()

  def close(self):
    if self.server:
      self.server.close()


def _failed(result: subprocess.CompletedProcess, shown: str) -> str:
  output = (result.stderr or result.stdout)[-2500:]
  return f"`{shown}` exited with status {result.returncode}:\n{output}"


def _check_job(command: Command, args: list[str], runner: _Runner) -> list[str]:
  module = _module_of(command)
  problem = _job_problem(module)
  if problem:
    return [problem]
  if command.elided:  # `...`: the flags the job's own gin file requires.
    given = {a.split("=", 1)[0] for a in args}
    source = _module_path(module).read_text(encoding="utf-8")
    if "gin_cli.run" in source:
      args = args + [f"--gin.{m}='{runner.tmp / m.lower()}'"
                     for m in gin_text.required_macros(_runs_file(module))
                     if f"--gin.{m}" not in given]
  args = args + ([] if "--dry_run" in args else ["--dry_run"])
  if command.kind == "script":
    target = _console_scripts()[command.target]
    module, function = target.split(":")
    argv = [sys.executable, "-c", f"import sys; sys.argv[0] = "
            f"{command.target!r}; import {module}; {module}.{function}()"]
  else:
    argv = [sys.executable, "-m", module]
  result = runner.run(argv + args)
  shown = shlex.join([*(["python", "-m"] if command.kind == "job" else []),
                      command.target, *args])
  expected = [v for k, v in _FAILS.items() if k in command.text]
  if expected:
    if result.returncode == 0 or expected[0] not in result.stderr:
      return [f"`{shown}` should fail with {expected[0]!r}, as documented;"
              f" it exited with {result.returncode}:\n{result.stderr[-2500:]}"]
    return []
  if result.returncode != 0:
    return [_failed(result, shown)]
  problems = []
  for arg in args:
    binding = _BINDING.match(arg)
    if (binding and "." in binding["target"] and
        re.fullmatch(r"-?\d+(\.\d+)?|True|False", binding["value"])):
      field = binding["target"].rpartition(".")[2]
      if f"{field}={binding['value']}" not in result.stdout:
        problems.append(f"`{shown}`: {arg} does not show in the printed "
                        "config")
  return problems


def _check_pytest(command: Command) -> list[str]:
  problems, args = [], command.args
  for i, arg in enumerate(args):
    if arg == "-n" or arg.startswith("-n") and arg[2:].isdigit() or (
        arg.startswith("--numprocesses")):
      if importlib.util.find_spec("xdist") is None:
        problems.append(f"{arg}: pytest-xdist is not installed")
    if arg.startswith("-") or (i and args[i - 1] in {"-n", "-k", "-m"}):
      continue
    if "<" in arg:  # `<file>::<test>`: a placeholder.
      continue
    path, _, node = arg.partition("::")
    if not (ROOT / path).exists():
      problems.append(f"no test path {path}")
    elif node:
      name = re.split(r"[\[:]", node)[0]
      if not re.search(rf"^\s*def {re.escape(name)}\(",
                       (ROOT / path).read_text(encoding="utf-8"), re.M):
        problems.append(f"{path} has no test {name}")
  return problems


def _check_pip(command: Command) -> list[str]:
  """`pip install -e ".[demo]" -c constraints.txt`: not run, but its files
  and extras must exist."""
  problems, args = [], command.args
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "project"].get("optional-dependencies", {})
  for i, arg in enumerate(args):
    if i and args[i - 1] in {"-c", "-r", "--constraint", "--requirement"}:
      if not (ROOT / arg).exists():
        problems.append(f"no file {arg}")
    local = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
    for extra in local[1].split(",") if local else []:
      if extra not in extras:
        problems.append(f"pyproject.toml has no extra {extra!r}")
  return problems


def _check_benchmark(command: Command, args: list[str],
                     runner: _Runner) -> list[str]:
  path, module = _benchmark_path(command.target), "/" not in command.target
  if not path.exists():
    return [f"no {'module' if module else 'script'} {command.target} "
            f"({path.relative_to(ROOT)})"]
  source = path.read_text(encoding="utf-8")
  if not module and "parse_args(" not in source and "app.run(" not in source:
    return [f"{command.target} reads no flags through argparse or absl: "
            "this test cannot dry-run it"]
  run = ["-m", str(ROOT), command.target] if module else [str(path)]
  result = runner.run([sys.executable, "-c", _PARSE_ONLY, *run, *args])
  shown = shlex.join(["python", *(["-m"] if module else []), command.target,
                      *args])
  if result.returncode != 0 or "FLAGS PARSED" not in result.stdout:
    return [_failed(result, shown)]
  return []


def _inner_jobs(output: str, command: Command) -> list[Command]:
  """The job commands a launcher's dry run printed (also those inside a
  `gcloud ... ssh --command=...`)."""
  jobs = []
  for line in output.splitlines():
    try:
      words = shlex.split(line)
    except ValueError:
      continue
    texts = [w.partition("=")[2] for w in words if w.startswith("--command=")]
    for text in texts or [line]:
      for found in _commands_in(text, command.where, 0, {}):
        if found.kind in {"job", "script"}:
          found.where = command.where
          jobs.append(found)
  return jobs


def _check_launcher(command: Command, args: list[str],
                    runner: _Runner) -> list[str]:
  path = ROOT / command.target
  if not path.exists():
    return [f"no launcher {command.target}"]
  if path.suffix == ".py":
    args = args + ([] if "--dry_run" in args else ["--dry_run"])
    argv = [sys.executable, str(path), *args]
  else:  # DRY_RUN=1 (set for every command) prints its commands.
    argv = ["bash", str(path), *args]
  result = runner.run(argv)
  shown = shlex.join([*(["python"] if path.suffix == ".py" else []),
                      command.target, *args])
  if result.returncode != 0:
    return [_failed(result, shown)]
  jobs = _inner_jobs(result.stdout, command)
  if not jobs and re.search(r"-m realm_jax\.\w", result.stdout):
    return [f"`{shown}` printed a job this test could not read:\n"
            f"{result.stdout[-2500:]}"]
  return [f"via `{shown}`: {p}" for job in jobs
          for p in _check_job(job, job.args, runner)]


def _check_mention(command: Command) -> list[str]:
  if command.kind == "mention" and command.target.startswith("realm_jax"):
    problem = _job_problem(command.target)
    return [problem] if problem else []
  if command.target.startswith("realm-"):
    return ([] if command.target in _console_scripts() else
            [f"no console script {command.target} (pyproject.toml)"])
  if command.target.split(".")[0] == "benchmarks":  # `python -m benchmarks.x`
    path = _benchmark_path(command.target)
    return [] if path.exists() else [f"no benchmark {command.target}"]
  return [] if (ROOT / command.target).exists() else [
      f"no file {command.target}"]


def _demo_ask_gin(path: pathlib.Path) -> None:
  from realm_jax import demo  # pylint: disable=g-import-not-at-top
  config = demo.DemoConfig(workdir=str(path.parent))
  demo.write_ask_gin(config, dict(demo._paths(config), ask_gin=str(path)))  # pylint: disable=protected-access


# Files that a documented command reads and a job writes, by the name a
# placeholder path ends in (`<workdir>/ask.gin`): the writer, called with
# the temporary path, writes it as that job does (the demo's ask.gin names
# its run's checkpoint, index and blocks).
_WRITTEN_BY_A_JOB = {"ask.gin": _demo_ask_gin}


def _write_job_outputs(args: list[str], tmp: pathlib.Path) -> None:
  for arg in args:
    value = pathlib.Path(arg.partition("=")[2] or arg)
    writer = _WRITTEN_BY_A_JOB.get(value.name)
    if writer and tmp in value.parents and not value.exists():
      value.parent.mkdir(parents=True, exist_ok=True)
      writer(value)


def check(command: Command, runner: _Runner) -> list[str]:
  """What is wrong with `command` ([] when it runs as documented)."""
  args = _substituted(command.args, runner.tmp)
  _write_job_outputs(args, runner.tmp)
  if command.kind == "skipped":
    return []
  if command.kind == "broken":
    return [command.reason]
  if command.kind == "mention":
    return _check_mention(command)
  if command.kind == "pytest":
    return _check_pytest(command)
  if command.kind == "pip":
    return _check_pip(command)
  if command.kind in {"job", "script"}:
    if command.kind == "script" and command.target not in _console_scripts():
      return [f"no console script {command.target} (pyproject.toml)"]
    return _check_job(command, args, runner)
  if command.kind == "benchmark":
    return _check_benchmark(command, args, runner)
  if command.kind == "launcher":
    return _check_launcher(command, args, runner)
  raise AssertionError(command)


COMMANDS, FILES = _documented()


def _ids() -> list[str]:
  ids, seen = [], {}
  for c in COMMANDS:
    short = (pathlib.Path(c.target).stem if "/" in c.target else
             c.target.rpartition(".")[2])
    name = f"{c.where}:{short}"
    seen[name] = seen.get(name, 0) + 1
    ids.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
  return ids


# Stale commands, each of which the check must refuse (what it says).
_STALE = [
    ("python -m realm_jax.jobs.corpus --gin_file=runs/corpus.gin \\\n"
     "  --gin.OUTPUT_DIR=\"'$D/blocks'\" --max_block_len=128",
     "--max_block_len is not an absl, gin or Apache Beam pipeline option"),
    ("python -m realm_jax.data.salient_spans --output_dir=D --num_shards=2",
     "has no `if __name__"),
    ("python -m pytest tests/training/test_parallel.py::test_x",
     "no test path tests/training/test_parallel.py"),
    ("python -m pytest tests/core/test_parallel.py::test_nothing_here",
     "has no test test_nothing_here"),
    ("python benchmarks/mips.py --num_rowz=5", "num_rowz"),
    ("python -m benchmarks.learning --no_such_flag", "no_such_flag"),
    ("python -m benchmarks.no_such_benchmark --steps=2",
     "no module benchmarks.no_such_benchmark"),
    ("pip install -e \".[demo,no_such_extra]\" -c constraints.txt",
     "no extra 'no_such_extra'"),
    ("realm-ask --gin_file=experiments/eval_tiny_cpu.gin --topk=2 'Who?'",
     "Unknown command line flag 'topk'"),
    ("python launch/tpu_pod.py train --name=r --zone=z --workdir=gs://b/w \\\n"
     "  --block_store=/b --queries=/q --gin_file=models/no_such_model.gin \\\n"
     "  --gin_file=runs/pretrain.gin", "no_such_model.gin"),
    ("launch/local.sh $D/run $D/blocks $D/queries models/tiny.gin -- \\\n"
     "  \"pretrain.PretrainConfig.no_such_field=1\"", "no_such_field"),
]


def _stale_commands() -> list[Command]:
  out = []
  for i, (text, _) in enumerate(_STALE):
    commands = _shell_text(list(enumerate(text.splitlines(), 1)),
                           f"stale{i}", {})
    assert len(commands) == 1, (text, commands)
    out.append(commands[0])
  return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """The problems of each documented command (and of `_STALE`'s), checked
  in parallel."""
  tmp = tmp_path_factory.mktemp("documented_commands")
  for name, text in FILES.items():
    (tmp / name).write_text(text, encoding="utf-8")
  stale = _stale_commands()
  commands = COMMANDS + stale
  with concurrent.futures.ThreadPoolExecutor(max_workers=4) as processes, \
      concurrent.futures.ThreadPoolExecutor(max_workers=8) as checks:
    runner = _Runner(tmp, processes, fork=_FORK)
    try:
      found = list(checks.map(lambda c: check(c, runner), commands))
    finally:
      runner.close()
  return found[:len(COMMANDS)], found[len(COMMANDS):]


def test_the_commands_are_found():
  by_kind = {}
  for c in COMMANDS:
    by_kind.setdefault(c.kind, set()).add((c.where.split(":")[0], c.target))
  jobs = by_kind["job"]
  assert ("README.md", "realm_jax.jobs.demo") in jobs  # The Quick start demo.
  assert ("docs/results/demo.md", "realm_jax.jobs.demo") in jobs
  assert ("README.md", "pytest") in by_kind["pytest"]  # And its test line.
  assert {("BUILD.md", "realm_jax.jobs.corpus"),
          ("BUILD.md", "realm_jax.jobs.annotate"),
          ("BUILD.md", "realm_jax.jobs.query_cache"),
          ("BUILD.md", "realm_jax.jobs.pretrain"),
          ("BUILD.md", "realm_jax.jobs.ask"),
          ("docs/recipes.md", "realm_jax.jobs.export"),
          ("docs/benchmarks/data.md", "realm_jax.jobs.annotate")
          } <= jobs | by_kind["mention"]
  assert {("BUILD.md", "launch/local.sh"),
          ("launch/README.md", "launch/tpu_pod.py"),
          ("launch/tpu_pod.py", "launch/tpu_pod.py"),
          ("launch/local.sh", "launch/local.sh")} <= by_kind["launcher"]
  assert ("docs/reliability.md", "realm-pretrain") in by_kind["script"]
  assert ("README.md", "pip") in by_kind["pip"]
  assert ("docs/recipes.md", "tensorboard") in by_kind["skipped"]
  assert len(by_kind["benchmark"]) >= 10
  assert len(COMMANDS) >= 100
  assert FILES.get("pod.args", "").startswith("--name=")


@pytest.mark.parametrize("i", range(len(COMMANDS)), ids=_ids())
def test_a_documented_command_runs(i, results):
  command = COMMANDS[i]
  if command.kind == "skipped":
    pytest.skip(f"{command.target}: {command.reason}")
  problems = results[0][i]
  if problems:
    pytest.fail("\n".join([f"{command.where}: {command.text}", *problems]),
                pytrace=False)


@pytest.mark.parametrize("i", range(len(_STALE)),
                         ids=[f"stale{i}" for i in range(len(_STALE))])
def test_a_stale_command_fails(i, results):
  problems = results[1][i]
  assert problems and _STALE[i][1] in "\n".join(problems), problems

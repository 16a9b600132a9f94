"""realm_jax's layers import downwards only.

Lowest first: core < data, model < checkpoint_import < index < training <
eval < the entry points (ask, demo, gin_cli) < the jobs (`realm_jax.jobs`,
the console scripts' modules) < cli (which lists them). `realm_jax.testing`
is test support and may import anything; nothing else may import it. A
module may import its own package and lower layers; `data` and `model`
share a layer but stay independent of each other, while the entry points
may use one another. Every import counts, at module level or inside a function, except
those under `if __name__ == "__main__":` (an entry point's own start-up,
e.g. a job module reaching for the gin command line).

The walk is static (ast), so an upward import hidden in a function body,
which only fails when that function runs, is caught here too.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import realm_jax

ROOT = pathlib.Path(realm_jax.__file__).parent
PACKAGE = "realm_jax"

# Lowest first. A group with several names is one layer; see
# SAME_LAYER_IMPORTS for whether its members may import one another.
LAYERS = (
    ("core",),
    ("data", "model"),
    ("checkpoint_import",),
    ("index",),
    ("training",),
    ("eval",),
    ("aot", "api", "ask", "demo", "export", "gin_cli"),
    ("jobs",),
    ("cli",),
    ("testing",),
)
# Layers whose members may import one another (the entry points).
SAME_LAYER_IMPORTS = {("aot", "api", "ask", "demo", "export", "gin_cli")}

# (importing module, imported module) pairs tolerated for now, each with the
# reason and what will remove it. Keep it empty.
ALLOWLIST: dict[tuple[str, str], str] = {}


def _rank(part: str) -> int:
  for rank, layer in enumerate(LAYERS):
    if part in layer:
      return rank
  raise AssertionError(
      f"realm_jax.{part} is in no layer; add it to LAYERS in "
      f"{pathlib.Path(__file__).name}.")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _is_module(name: str) -> bool:
  """`name` (dotted, under realm_jax) is a module or package of the tree."""
  path = ROOT.parent.joinpath(*name.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_main_block(node: ast.AST) -> bool:
  if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
    return False
  sides = [node.test.left, *node.test.comparators]
  return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
          and any(isinstance(s, ast.Constant) and s.value == "__main__"
                  for s in sides))


def _imports(tree: ast.AST, module: str, is_package: bool):
  """(line, imported realm_jax module) of every import outside main blocks."""
  package = module if is_package else module.rpartition(".")[0]
  stack = [tree]
  while stack:
    node = stack.pop()
    if _is_main_block(node):
      continue
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        full = f"{base}.{alias.name}"
        yield node.lineno, full if _is_module(full) else base
    stack.extend(ast.iter_child_nodes(node))


def _part(module: str) -> str | None:
  """The layer member a realm_jax module belongs to (None: the root)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def _violations() -> list[str]:
  out = []
  for path in sorted(ROOT.rglob("*.py")):
    module = _module_name(path)
    part = _part(module)
    if part is None or part == "testing":
      continue
    tree = ast.parse(path.read_text(), str(path))
    for line, imported in _imports(tree, module, path.name == "__init__.py"):
      if imported.split(".")[0] != PACKAGE:
        continue
      other = _part(imported)
      if other is None or other == part:
        continue
      rank, other_rank = _rank(part), _rank(other)
      if other_rank < rank:
        continue
      if other_rank == rank and LAYERS[rank] in SAME_LAYER_IMPORTS:
        continue
      if (module, imported) in ALLOWLIST:
        continue
      relation = "the same layer" if other_rank == rank else "a higher layer"
      out.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} imports "
                 f"{imported}, {relation} ({LAYERS[other_rank]} vs "
                 f"{LAYERS[rank]})")
  return out


def test_imports_go_downwards():
  violations = _violations()
  assert not violations, (
      "upward imports (order, lowest first: "
      f"{' < '.join('/'.join(layer) for layer in LAYERS)}):\n"
      + "\n".join(violations))


def test_the_allowlist_holds_only_live_imports():
  """An allowlisted import that is gone must leave the list too."""
  live = set()
  for path in sorted(ROOT.rglob("*.py")):
    module = _module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    live |= {(module, imported) for _, imported in
             _imports(tree, module, path.name == "__init__.py")}
  assert not set(ALLOWLIST) - live, sorted(set(ALLOWLIST) - live)


def test_the_walk_sees_function_level_imports_and_skips_main_blocks():
  source = (
      "import realm_jax.core.io_utils\n"
      "def f():\n"
      "  from realm_jax.eval import qa_eval\n"
      "if __name__ == '__main__':\n"
      "  from realm_jax import gin_cli\n"
      "from realm_jax.index import nope\n")
  found = {name for _, name in _imports(ast.parse(source),
                                        "realm_jax.training.x", False)}
  # `nope` is no module, so the import names its package.
  assert found == {"realm_jax.core.io_utils", "realm_jax.eval.qa_eval",
                   "realm_jax.index"}


# ----------------------------------------------------------------------------
# Serving loads no training code (issue 55, item 5)
# ----------------------------------------------------------------------------

# Serving module -> the modules it must not reach, directly or through any
# chain of imports (module level or in a function body: the static walk
# above, followed transitively).
SERVING = {
    "realm_jax.api": ("realm_jax.training",),
    "realm_jax.ask": ("realm_jax.training",),
    "realm_jax.eval.qa_model": ("realm_jax.training",),
    # The library half of the index builder (`index.build`), not the job.
    "realm_jax.index.service": ("realm_jax.training",
                                "realm_jax.index.builder"),
    "realm_jax.index.extend": ("realm_jax.training",
                               "realm_jax.index.builder"),
}


def _path_of(module: str) -> pathlib.Path:
  path = ROOT.parent.joinpath(*module.split("."))
  return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _chains(start: str) -> dict[str, list[str]]:
  """Every realm_jax module `start` reaches -> one import chain to it
  (packages count as the modules their `__init__` is)."""
  chains, todo = {start: [start]}, [start]
  while todo:
    module = todo.pop()
    path = _path_of(module)
    tree = ast.parse(path.read_text(), str(path))
    for _, imported in _imports(tree, module, path.name == "__init__.py"):
      parts = imported.split(".")
      if parts[0] != PACKAGE:
        continue
      # `import realm_jax.a.b` runs realm_jax/a/__init__.py too.
      for i in range(2, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in chains and _is_module(name):
          chains[name] = chains[module] + [name]
          todo.append(name)
  return chains


def test_serving_modules_reach_no_training_module():
  problems = []
  for module, banned in SERVING.items():
    for reached, chain in sorted(_chains(module).items()):
      if any(reached == b or reached.startswith(b + ".") for b in banned):
        problems.append(" -> ".join(chain))
  assert not problems, "serving imports what it must not:\n" + "\n".join(
      problems)


def test_importing_serving_loads_no_training_module():
  """The same, as Python runs it: what `sys.modules` holds after the
  imports. (optax is there all the same: flax.nnx imports it itself.)"""
  code = ("import sys\n"
          + "".join(f"import {m}\n" for m in SERVING)
          + "print('\\n'.join(m for m in sys.modules if "
            "m.startswith(('realm_jax.training', 'realm_jax.index.builder'))"
            "))\n")
  out = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True,
      check=True, cwd=ROOT.parent, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3"))
  assert out.stdout.split() == [], out.stdout

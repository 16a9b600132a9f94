"""realm_jax's layers import downwards only.

Lowest first: core < data, model < checkpoint_import < index < training <
eval < the entry points (ask, demo, gin_cli). `realm_jax.testing` is test
support and may import anything; nothing else may import it. A module may
import its own package and lower layers; `data` and `model` share a layer
but stay independent of each other, while the entry points may use one
another. Every import counts, at module level or inside a function, except
those under `if __name__ == "__main__":` (an entry point's own start-up,
e.g. a job module reaching for the gin command line).

The walk is static (ast), so an upward import hidden in a function body,
which only fails when that function runs, is caught here too.
"""

from __future__ import annotations

import ast
import pathlib

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
    ("aot", "api", "ask", "cli", "demo", "export", "gin_cli"),
    ("testing",),
)
# Layers whose members may import one another (the entry points).
SAME_LAYER_IMPORTS = {("aot", "api", "ask", "cli", "demo", "export", "gin_cli")}

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

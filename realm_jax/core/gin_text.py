"""Gin files read as text: where a name is found, what a file includes,
which macros it binds. Standard library only: the pod launcher
(launch/tpu_pod.py, which does not import realm_jax) reads it by path.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A source checkout keeps the gin files beside the package; a wheel carries
# them inside it (setup.py maps gin_configs/ to realm_jax/gin_configs).
GIN_CONFIGS = next(
    (d for d in (os.path.join(os.path.dirname(_PACKAGE), "gin_configs"),
                 os.path.join(_PACKAGE, "gin_configs")) if os.path.isdir(d)),
    os.path.join(_PACKAGE, "gin_configs"))

_INCLUDE = re.compile(r"""^\s*include\s+(['"])(?P<path>.+?)\1""", re.M)
# A top-level macro binding, `NAME = value`.
_MACRO = re.compile(r"^(?P<name>[A-Z_][A-Z0-9_]*)\s*=[ \t]*(?P<value>.*)",
                    re.M)


def find_gin_file(name: str) -> str | None:
  """The real path of the gin file `name` as gin_cli's `parse` finds it (as
  given, then in `gin_configs/`, then in the working directory), or None."""
  prefixes = [""] if os.path.isabs(name) else ["", GIN_CONFIGS, os.getcwd()]
  for prefix in prefixes:
    path = os.path.join(prefix, name)
    if os.path.isfile(path):
      return os.path.realpath(path)
  return None


def included_gin_files(gin_files: Sequence[str]) -> dict[str, str]:
  """Real path -> text of `gin_files` and of every file they include
  (files not found are left out, for the job to report)."""
  seen, todo = {}, list(gin_files)
  while todo:
    path = find_gin_file(todo.pop())
    if path is None or path in seen:
      continue
    with open(path, encoding="utf-8") as f:
      seen[path] = f.read()
    todo.extend(m["path"] for m in _INCLUDE.finditer(seen[path]))
  return seen


def macros(gin_file: str) -> list[tuple[str, str]]:
  """(name, value text) of each top-level macro binding in `gin_file`, in
  order (none if it is not found)."""
  path = find_gin_file(gin_file) if gin_file else None
  if path is None:
    return []
  with open(path, encoding="utf-8") as f:
    return [(m["name"], m["value"]) for m in _MACRO.finditer(f.read())]


def required_macros(gin_file: str) -> list[str]:
  """The macros `gin_file` binds to `%gin.REQUIRED` (its "Must set")."""
  return [name for name, value in macros(gin_file)
          if value.startswith("%gin.REQUIRED")]


def string_macro(gin_files: Sequence[str], macro: str) -> str | None:
  """The first string `gin_files` (or their includes) bind `macro` to."""
  for path in included_gin_files(gin_files):
    for name, value in macros(path):
      found = re.match(r"['\"](?P<text>[^'\"]+)['\"]", value)
      if name == macro and found:
        return found["text"]
  return None

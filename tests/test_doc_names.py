"""Every `Config.field` the docs, docstrings and gin files cite exists.

A name such as `GateConfig.latest_release` (in backticks, prose or a
`--gin.pretrain.GateConfig.latest_release=...` binding of a documented
command) must be a field, property or method of that config class, read
from the source of `realm_jax/` (its dataclasses, with their bases). A
renamed field then fails here until every doc that cites it follows.
docs/results/learning_log.md is the one exception: a verbatim log of past
sessions, whose commands ran at the code of their day (its header says
so).
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CITED = re.compile(r"\b([A-Z]\w*Config)\.([a-z_]\w*)")
LOG = ROOT / "docs" / "results" / "learning_log.md"


def config_attributes() -> dict[str, set[str]]:
  """Config class name -> the names it has (fields, properties, methods,
  its bases' included), from realm_jax's source."""
  classes = {}
  for path in sorted((ROOT / "realm_jax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
        names = {n.target.id for n in node.body
                 if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name)}
        names |= {n.name for n in node.body
                  if isinstance(n, ast.FunctionDef)}
        bases = [b.attr if isinstance(b, ast.Attribute) else
                 getattr(b, "id", "") for b in node.bases]
        classes[node.name] = names, bases

  def resolve(name):
    names, bases = classes[name]
    return names.union(*(resolve(b) for b in bases if b in classes))

  return {name: resolve(name) for name in classes}


def unknown_names(text: str, attributes: dict[str, set[str]]
                  ) -> list[tuple[int, str]]:
  """(line, `Class.field`) of each cited field its config class lacks."""
  return [(number, f"{cls}.{field}")
          for number, line in enumerate(text.splitlines(), 1)
          for cls, field in CITED.findall(line)
          if cls in attributes and field not in attributes[cls]]


def _sources() -> list[pathlib.Path]:
  docs = [ROOT / "README.md", ROOT / "BUILD.md", ROOT / "launch/README.md",
          *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.md")]
  # (Not tests/: they plant wrong names on purpose.)
  code = [p for d in ("realm_jax", "benchmarks", "launch")
          for p in (ROOT / d).rglob("*.py")]
  return sorted(p for p in docs + code + list(
      (ROOT / "gin_configs").rglob("*.gin")) if p.exists() and p != LOG)


@pytest.fixture(scope="module")
def attributes():
  return config_attributes()


def test_the_configs_are_found(attributes):
  assert {"PretrainConfig", "GateConfig", "RecallGuardConfig",
          "FinetuneConfig", "RealmConfig"} <= set(attributes)
  # Inherited fields count (PretrainConfig extends loop.TrainConfig).
  assert {"workdir", "gate", "refresh_period"} <= attributes["PretrainConfig"]


@pytest.mark.parametrize("path", _sources(),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_config_field_exists(path, attributes):
  unknown = unknown_names(path.read_text(encoding="utf-8"), attributes)
  assert not unknown, f"{path.relative_to(ROOT)} cites fields that no " \
      f"config has (line, name): {unknown}"


def test_a_retired_name_is_found(attributes):
  text = ("The release was `RetrieverScheduleConfig.freeze_steps`.\n"
          "    --gin.pretrain.GateConfig.latest_release=None \\\n"
          "    --gin.pretrain.RetrieverScheduleConfig.gate_every=2\n")
  assert unknown_names(text, attributes) == [
      (1, "RetrieverScheduleConfig.freeze_steps"),
      (3, "RetrieverScheduleConfig.gate_every")]


def test_the_log_says_its_commands_ran_at_their_own_code():
  head = "\n".join(LOG.read_text(encoding="utf-8").splitlines()[:12])
  assert "at or before commit" in head and "renamed" in head, head

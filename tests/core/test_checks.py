"""Config types: one check (`checks.field_types`) in every config dataclass.

A non-integer in an integer field must fail when the config is built, before
a job writes anything (issue 27, item 5: `checkpoint_every=2.5` trained and
saved only steps 0 and the last, `num_candidates=2.5` failed at step 1 after
writing checkpoint 0 and index 0, `batch_size=8.0` trained).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import pathlib
import typing
from typing import Any, Callable, Literal, Optional

import numpy as np
import pytest

from realm_jax.core import checks

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "realm_jax"


@dataclasses.dataclass(frozen=True)
class _Example:
  count: int = 1
  rate: float = 0.5
  flag: bool = False
  name: str = "x"
  limit: Optional[int] = None
  steps: int | None = None
  ks: tuple[int, ...] = (1, 5)
  pair: tuple[str, float] = ("a", 1.0)
  mode: Literal["a", "b"] = "a"
  factory: Callable[..., Any] | None = None
  extra: dict[str, int] = dataclasses.field(default_factory=dict)
  anything: Any = None

  def __post_init__(self):
    checks.field_types(self)


@pytest.mark.parametrize("field, value", [
    ("count", 2.5), ("count", 8.0), ("count", True), ("count", "3"),
    ("count", None), ("rate", "0.5"), ("rate", False), ("flag", 1),
    ("flag", "True"), ("name", 3), ("limit", 2.5), ("steps", 1.0),
    ("ks", [1, 5]), ("ks", (1, 2.5)), ("pair", ("a",)), ("pair", (1, 1.0)),
    ("mode", "c"), ("factory", 3), ("extra", {"a": 1.5}), ("extra", [])])
def test_wrong_types_are_refused_by_name(field, value):
  with pytest.raises(checks.ConfigTypeError) as e:
    _Example(**{field: value})
  message = str(e.value)
  assert message.startswith(f"_Example.{field} must be ")
  assert repr(value) in message and type(value).__name__ in message
  # Also a ValueError: code catching bad configs' ValueErrors still does.
  assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("field, value", [
    ("count", 3), ("count", np.int64(3)), ("rate", 1), ("rate", np.float32(2)),
    ("flag", True), ("flag", np.bool_(True)), ("name", pathlib.Path("/tmp")),
    ("limit", None), ("limit", 4), ("ks", ()), ("pair", ("b", 2)),
    ("mode", "b"), ("factory", len), ("extra", {"a": 1}),
    ("anything", object())])
def test_right_types_pass(field, value):
  assert getattr(_Example(**{field: value}), field) is value


def test_the_message_names_the_expected_type():
  with pytest.raises(checks.ConfigTypeError,
                     match=r"_Example\.steps must be int \| None, got 1\.0 "
                     r"\(float\)\."):
    _Example(steps=1.0)
  with pytest.raises(checks.ConfigTypeError,
                     match=r"_Example\.count must be int, got True \(bool\)"):
    _Example(count=True)


# ---------------------------------------------------------------------------
# Every config dataclass of realm_jax calls the check.
# ---------------------------------------------------------------------------

# Values for the fields without a default (the same for every config).
REQUIRED = dict(workdir="/tmp/w", block_store="/tmp/b", queries="/tmp/q",
                train_jsonl="/tmp/t.jsonl", index_dir="/tmp/i",
                output_dir="/tmp/o", annotated="/tmp/a/*", batch_size=8,
                learning_rate=1e-3, topology="v5e:2x2")
# What a config needs beyond its defaults to be valid.
EXTRA = {"FinetuneConfig": dict(num_epochs=1.0)}


def _config_classes() -> list[tuple[str, str]]:
  """(module, class) of every dataclass named *Config in realm_jax."""
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
      if (isinstance(node, ast.ClassDef) and node.name.endswith("Config")
          and any("dataclass" in ast.unparse(d)
                  for d in node.decorator_list)):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix(
            "").parts)
        found.append((module, node.name))
  return found


CONFIG_CLASSES = _config_classes()


def test_the_configs_are_found():
  names = {name for _, name in CONFIG_CLASSES}
  assert {"TrainConfig", "PretrainConfig", "IctTrainConfig",
          "FinetuneConfig", "BertConfig", "RealmConfig", "BuilderConfig",
          "EvalConfig", "QAConfig", "ScannConfig"} <= names


def _wrong_value(hint: Any) -> Any:
  """A value that `hint` does not admit."""
  options = typing.get_args(hint) if typing.get_origin(hint) in (
      typing.Union, getattr(__import__("types"), "UnionType")) else (hint,)
  return "1" if float in options else 2.5


def _a_valid_config(module: str, name: str):
  """(a valid instance of config class `name`, its init fields, their
  resolved types)."""
  cls = getattr(importlib.import_module(module), name)
  hints = typing.get_type_hints(cls)
  fields = [f for f in dataclasses.fields(cls) if f.init]
  required = {f.name: REQUIRED[f.name] for f in fields
              if f.default is dataclasses.MISSING
              and f.default_factory is dataclasses.MISSING}
  return cls(**required, **EXTRA.get(name, {})), fields, hints


@pytest.mark.parametrize("module, name", CONFIG_CLASSES,
                         ids=[n for _, n in CONFIG_CLASSES])
def test_every_config_refuses_wrong_types(module, name):
  config, fields, hints = _a_valid_config(module, name)
  for f in fields:
    if hints[f.name] is Any:
      continue
    wrong = _wrong_value(hints[f.name])
    with pytest.raises(checks.ConfigTypeError,
                       match=rf"^{name}\.{f.name} must be .*, got "
                       rf"{wrong!r} \({type(wrong).__name__}\)\.$"):
      dataclasses.replace(config, **{f.name: wrong})
    if hints[f.name] is int:
      # A whole float is no int either (`batch_size=8.0`); nor a bool.
      for other in (8.0, True):
        with pytest.raises(checks.ConfigTypeError):
          dataclasses.replace(config, **{f.name: other})


def test_float_fields_take_ints_as_gin_writes_them():
  from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
  config = pretrain.PretrainConfig(
      workdir="w", block_store="b", queries="q", learning_rate=1,
      index_wait_seconds=600,
      guards=pretrain.GuardConfig(stale_index_warning=4))
  assert config.learning_rate == 1


@pytest.mark.parametrize("field, value", [
    ("checkpoint_every", 2.5), ("num_candidates", 2.5), ("batch_size", 8.0),
    ("num_train_steps", 12.0), ("keep_checkpoints", True)])
def test_the_issues_values_fail_before_a_run_starts(field, value, tmp_path):
  """The values of the issue, refused when PretrainConfig is built: the
  trainer gets no config, so it writes nothing."""
  from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
  kwargs = dict(workdir=str(tmp_path / "w"), block_store="b", queries="q",
                index_mode="inline")
  cls = pretrain.PretrainConfig
  if field == "num_candidates":  # (a field of a part, which refuses it)
    cls, kwargs = pretrain.RetrievalConfig, {}
  with pytest.raises(checks.ConfigTypeError,
                     match=rf"{cls.__name__}\.{field} must be int"):
    cls(**kwargs, **{field: value})
  assert not os.path.exists(tmp_path / "w")


def _admits_float(hint: Any) -> bool:
  options = typing.get_args(hint) if typing.get_origin(hint) in (
      typing.Union, getattr(__import__("types"), "UnionType")) else (hint,)
  return float in options


@pytest.mark.parametrize("module, name", CONFIG_CLASSES,
                         ids=[n for _, n in CONFIG_CLASSES])
def test_every_float_field_refuses_inf_and_nan(module, name):
  """inf and nan (`--gin...=1e309` parses to inf) fail when the config is
  built, in every config's float fields, unless a field allows them."""
  config, fields, hints = _a_valid_config(module, name)
  for f in fields:
    if not _admits_float(hints[f.name]) or f.metadata.get(
        checks.ALLOW_NONFINITE):
      continue
    for bad in (float("inf"), float("-inf"), float("nan"), np.float32("inf")):
      with pytest.raises(checks.ConfigTypeError,
                         match=rf"^{name}\.{f.name} must be finite, got "):
        dataclasses.replace(config, **{f.name: bad})


def test_non_finite_numbers_inside_containers_and_by_choice():
  @dataclasses.dataclass(frozen=True)
  class Holder:
    weights: tuple[float, ...] = (1.0,)
    bound: float = dataclasses.field(
        default=float("inf"), metadata={checks.ALLOW_NONFINITE: True})

    def __post_init__(self):
      checks.field_types(self)

  assert Holder().bound == float("inf")
  with pytest.raises(checks.ConfigTypeError, match=r"weights must be finite"):
    Holder(weights=(1.0, float("nan")))


def test_score_scale_must_be_positive_and_finite():
  from realm_jax.model import realm  # pylint: disable=g-import-not-at-top
  from realm_jax.testing import tiny  # pylint: disable=g-import-not-at-top
  bert = tiny.tiny_realm().retriever.bert
  for scale in (float("inf"), 1e309, 0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="score_scale must be"):
      realm.RetrieverConfig(bert=bert, score_scale=scale)


def test_type_checked_runs_the_types_first_then_the_own_checks():
  calls = []

  @dataclasses.dataclass(frozen=True)
  @checks.type_checked
  class Sized:
    size: int = 1

    def __post_init__(self):
      calls.append(self.size)
      checks.at_least(self, "size")

  @dataclasses.dataclass(frozen=True)
  class Bigger(Sized):  # Inherits both checks; its own field is typed too.
    extra: float = 0.0

  @dataclasses.dataclass(frozen=True)
  @checks.type_checked
  class Plain:  # No __post_init__ of its own.
    name: str = "x"

  with pytest.raises(checks.ConfigTypeError, match=r"Sized\.size must be int"):
    Sized(size=2.5)
  assert not calls  # The own check never saw the wrong type.
  with pytest.raises(ValueError, match=r"Sized\.size must be >= 1"):
    Sized(size=0)
  with pytest.raises(checks.ConfigTypeError, match=r"Bigger\.extra must be"):
    Bigger(extra="1")
  with pytest.raises(ValueError, match=r"Bigger\.size must be >= 1"):
    Bigger(size=0)
  with pytest.raises(checks.ConfigTypeError, match=r"Plain\.name must be"):
    Plain(name=3)
  assert Bigger(size=3, extra=1).extra == 1 and Plain().name == "x"


def test_a_negative_retriever_multiplier_is_refused_by_its_own_name(tmp_path):
  """`RetrieverScheduleConfig.learning_rate_multiplier=-1` fails when the
  config is built, under the name the user sets (not the optimizer's old
  `retriever_learning_rate_multiplier`), before a run creates W/index."""
  from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"^RetrieverScheduleConfig\."
                     r"learning_rate_multiplier must be >= 0, got -1.0"):
    pretrain.RetrieverScheduleConfig(learning_rate_multiplier=-1.0)
  with pytest.raises(ValueError, match=r"^GateConfig\.latest_release=-2 "
                     r"must be >= 0"):
    pretrain.GateConfig(latest_release=-2)
  assert pretrain.RetrieverScheduleConfig(
      learning_rate_multiplier=0.0).learning_rate_multiplier == 0.0

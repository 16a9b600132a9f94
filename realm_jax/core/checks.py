"""Config validation whose messages name the config and the field."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import numbers
import os
import types
import typing
from typing import Any, TypeVar

import numpy as np

_T = TypeVar("_T")


def at_least(config: Any, *names: str, minimum: float = 1,
             integer: bool = False, optional: bool = False) -> None:
  """Raises ValueError unless every field `names` of `config` is >= minimum.

  Args:
    config: a config object (its class names it in the message).
    *names: its fields to check.
    minimum: the smallest valid value.
    integer: the values must be ints (a bool is never a number here).
    optional: None passes.
  """
  kind = numbers.Integral if integer else numbers.Real
  for name in names:
    value = getattr(config, name)
    if value is None and optional:
      continue
    if (isinstance(value, bool) or not isinstance(value, kind) or
        value < minimum):
      raise ValueError(
          f"{type(config).__name__}.{name} must be "
          f"{'an int ' if integer else ''}>= {minimum}, got {value!r}.")


def positive_count(value: Any, name: str, what: str) -> int:
  """`value`, an argument counting something (`top_k`, `k`), as an int
  >= 1: a bool, a float or a str is a TypeError, 0 or less a ValueError
  (either would otherwise be silently misread). `name` is the argument as
  the caller knows it, `what` says what it counts."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be an "
                    f"int >= 1: {what}.")
  if value < 1:
    raise ValueError(f"{name}={value} must be >= 1: {what}.")
  return int(value)


class ConfigTypeError(TypeError, ValueError):
  """A config field holds a value of another type than it declares.

  Also a ValueError: callers that catch a bad config's ValueError (a union
  of configs tried in turn when reading JSON, a job's error report) treat
  a wrong type as the bad value it is.
  """


# Every config field that names a path says what the job does with it, in
# its metadata (`path_setting`): "reads" it, "writes" an output of an
# `outputs.Kind` there (created, replaced or deleted only as that kind), or
# it is the job's "home" (a workdir: the job adds its own entries below
# it). tests/core/test_output_settings.py finds the "writes" settings this
# way and points each at the user's files, the workdir, the inputs, a
# link, a FIFO and a read-only directory; a path-like field without a role
# fails that test.
PATH_ROLE = "path_role"
OUTPUT_KIND = "output_kind"
PATH_ROLES = ("reads", "writes", "home")


def path_setting(role: str, kind: str | None = None, *,
                 default: Any = dataclasses.MISSING) -> Any:
  """A dataclass field naming a path, with its role (`PATH_ROLE`) and, for
  "writes", the `outputs.Kind` name it writes (`OUTPUT_KIND`)."""
  if role not in PATH_ROLES or (role == "writes") != (kind is not None):
    raise ValueError(f"path_setting({role!r}, {kind!r}): role is one of "
                     f"{PATH_ROLES}; a kind goes with 'writes' only.")
  metadata = {PATH_ROLE: role, **({OUTPUT_KIND: kind} if kind else {})}
  return dataclasses.field(default=default, metadata=metadata)


# A float field that may hold inf or nan says so in its metadata:
# `dataclasses.field(default=..., metadata={ALLOW_NONFINITE: True})`.
ALLOW_NONFINITE = "allow_nonfinite"


@functools.lru_cache(maxsize=None)
def _field_hints(cls: type) -> tuple[tuple[str, Any, bool], ...]:
  """(name, resolved type, non-finite allowed) of each init field of
  dataclass `cls`.

  The modules use `from __future__ import annotations`, so the annotations
  are strings until `typing.get_type_hints` resolves them. Cached per
  class: configs are built often (`dataclasses.replace`).
  """
  hints = typing.get_type_hints(cls)
  return tuple((f.name, hints[f.name], bool(f.metadata.get(ALLOW_NONFINITE)))
               for f in dataclasses.fields(cls) if f.init)


def _non_finite(value: Any) -> Any:
  """The first inf or nan in `value` (a number, or one inside a tuple,
  list or dict), else None."""
  if isinstance(value, numbers.Real) and not isinstance(
      value, numbers.Integral):
    return None if math.isfinite(value) else value
  if isinstance(value, dict):
    value = list(value.values())
  if isinstance(value, (tuple, list)):
    for item in value:
      if _non_finite(item) is not None:
        return _non_finite(item)
  return None


def _type_name(hint: Any) -> str:
  if hint is type(None):
    return "None"
  if isinstance(hint, type) and not typing.get_args(hint):
    return hint.__name__
  return str(hint).replace("typing.", "")


def _matches(value: Any, hint: Any) -> bool:
  """Whether `value` is of type `hint` (recursing into containers)."""
  if hint is Any or isinstance(hint, typing.TypeVar):
    return True
  if hint is None or hint is type(None):
    return value is None
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_matches(value, a) for a in args)
  if origin is typing.Literal:
    return value in args
  if origin is tuple:
    if not isinstance(value, tuple):
      return False
    if len(args) == 2 and args[1] is Ellipsis:
      return all(_matches(v, args[0]) for v in value)
    return not args or (len(args) == len(value) and
                        all(_matches(v, a) for v, a in zip(value, args)))
  if origin in (list, collections.abc.Sequence):
    kind = list if origin is list else collections.abc.Sequence
    return (isinstance(value, kind) and not isinstance(value, str) and
            (not args or all(_matches(v, args[0]) for v in value)))
  if origin in (dict, collections.abc.Mapping):
    kind = dict if origin is dict else collections.abc.Mapping
    return isinstance(value, kind) and (not args or all(
        _matches(k, args[0]) and _matches(v, args[1])
        for k, v in value.items()))
  if origin is collections.abc.Callable or hint is collections.abc.Callable:
    return callable(value)
  # A bool is an int to Python, never to a config: `batch_size=True` is a
  # mistake. numpy scalars (e.g. read from an array) are registered with
  # `numbers`.
  if hint is bool:
    return isinstance(value, (bool, np.bool_))
  if hint is int:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
  if hint is float:  # An int is a float here (gin writes `1` for `1.0`).
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
  if hint is str:
    # Python callers pass paths as `pathlib.Path`; io_utils takes both.
    return isinstance(value, (str, os.PathLike))
  if isinstance(hint, type):
    return isinstance(value, hint)
  return True  # A form this check does not model (e.g. a Protocol).


def type_checked(cls: type[_T]) -> type[_T]:
  """Class decorator of a config dataclass: `field_types` runs first.

  Put it under `@dataclasses.dataclass`: building an instance runs
  `field_types` and then the class's own `__post_init__`, if it has one.
  Subclasses inherit it, and their fields are checked too.
  """
  after = getattr(cls, "__post_init__", None)

  def __post_init__(self) -> None:
    field_types(self)
    if after is not None:
      after(self)

  __post_init__.__qualname__ = f"{cls.__qualname__}.__post_init__"
  cls.__post_init__ = __post_init__
  return cls


def field_types(config: Any) -> None:
  """Raises ConfigTypeError unless each field of `config` has its type.

  The one type check of every config dataclass (`type_checked` runs it
  first in `__post_init__`), before any comparison, so that
  `checkpoint_every=2.5` or `batch_size=8.0` fail when the config is built,
  not steps later after outputs were written. Numbers must be finite (inf
  or nan, also inside containers, only where the field's metadata has
  `ALLOW_NONFINITE`). Types come from the class's annotations (a
  subclass's fields included): `int` takes no float and no bool, `float`
  takes an int, `Optional[...]`, unions, `Literal`, tuples (of fixed or
  any length), lists and dicts are checked with their items.

  Args:
    config: a dataclass instance.

  Raises:
    ConfigTypeError: naming the class, the field, the value and the type.
  """
  for name, hint, allow_non_finite in _field_hints(type(config)):
    value = getattr(config, name)
    if not _matches(value, hint):
      raise ConfigTypeError(
          f"{type(config).__name__}.{name} must be {_type_name(hint)}, got "
          f"{value!r} ({type(value).__name__}).")
    bad = None if allow_non_finite else _non_finite(value)
    if bad is not None:
      raise ConfigTypeError(
          f"{type(config).__name__}.{name} must be finite, got {value!r} "
          f"({bad!r} is not a number a run can use; a literal such as 1e309 "
          "overflows to inf).")


def _shorten(value: Any, limit: int = 60) -> Any:
  text = value if isinstance(value, (str, bytes)) else repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def string_list(value: Any, name: str, *, what: str = "strings",
                item: str = "Item", hint: str = "") -> list[str]:
  """`value`, a sequence of strings, as a list; refuses what would be
  silently misread.

  One rule for every public API that takes several strings (questions,
  reference answers, BM25 queries and texts): a bare `str` (or `bytes`)
  is itself a sequence, of characters, and would be taken as that many
  one-character items, so it is refused, as is an item that is no string.

  Args:
    value: what the caller passed.
    name: who takes it, for the message ("predict").
    what: what it is a list of, in the message ("questions").
    item: how the message calls one item ("Question").
    hint: what to pass instead, e.g. "use ask(question) or
      predict([question])".

  Raises:
    TypeError: `value` is one string or bytes, is not iterable, or holds
      something other than a str (the message names its position,
      counted from 1 as the command line counts questions).
  """
  if isinstance(value, (str, bytes)):
    raise TypeError(
        f"{name} takes a list of {what}, got one {type(value).__name__} "
        f"({_shorten(value)!r}){'; ' + hint if hint else ''}.")
  if not isinstance(value, collections.abc.Iterable):
    raise TypeError(f"{name} takes a list of {what}, got "
                    f"{_shorten(value)!r} ({type(value).__name__}).")
  out = list(value)
  for i, x in enumerate(out):
    if not isinstance(x, str):
      raise TypeError(f"{item} {i + 1} of {len(out)} is {_shorten(x)!r} "
                      f"({type(x).__name__}); {name} takes a list of "
                      f"{what}, each a str.")
  return out


def utf8_problem(text: str) -> str | None:
  """Why `text` is not valid UTF-8, or None.

  A str holds lone surrogates where its bytes were not UTF-8: Python
  decodes command-line arguments with surrogateescape (the byte 0xff
  becomes '\\udcff'), and JSON can spell one ("\\ud800"). Such text
  can be neither tokenized nor written out as UTF-8 JSON.
  """
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    code = ord(text[e.start])
    what = (f"the byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff
            else f"a lone surrogate U+{code:04X}")
    return f"not valid UTF-8 ({what} at character {e.start + 1})"
  return None


def shown_bytes(text: str, limit: int = 60) -> str:
  """`text` for a message: its start, with bytes that are not UTF-8 as
  \\xNN escapes (lone surrogates as \\uNNNN)."""
  text = text[:limit] + ("..." if len(text) > limit else "")
  try:
    raw = text.encode("utf-8", "surrogateescape")
  except UnicodeEncodeError:  # A surrogate that stands for no byte.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
  return raw.decode("utf-8", "backslashreplace")

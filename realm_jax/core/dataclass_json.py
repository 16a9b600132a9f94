"""Config dataclasses to and from JSON, without executing anything read.

Checkpoints and exports carry their configs as JSON (`to_dict`); reading
them back (`from_dict`) walks the *expected* dataclass's field types, so a
file can only fill in values of known fields: no class is looked up by a
name found in the file. Unknown fields and wrong types are errors that name
the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def to_dict(config: Any) -> dict[str, Any]:
  """A (nested) config dataclass as JSON-ready dicts (paths as strings)."""
  text = json.dumps(dataclasses.asdict(config), default=str)
  return json.loads(text)  # A string made here, no file.


def _convert(value: Any, kind: Any, where: str) -> Any:
  origin = typing.get_origin(kind)
  if dataclasses.is_dataclass(kind):
    if not isinstance(value, dict):
      raise ValueError(f"{where}: expected an object for {kind.__name__}, "
                       f"got {type(value).__name__}.")
    return from_dict(kind, value, where)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(kind)
    if value is None and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return _convert(value, option, where)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(errors[0] if errors else f"{where}: no type fits.")
  if origin in (tuple, list):
    if not isinstance(value, list):
      raise ValueError(f"{where}: expected a list, got {value!r}.")
    args = [a for a in typing.get_args(kind) if a is not Ellipsis]
    item = args[0] if args else Any
    items = [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items
  if origin is dict or kind is Any:
    return value
  if kind is float and isinstance(value, (int, float)) and not isinstance(
      value, bool):
    return float(value)
  if kind in (int, str, bool) and type(value) is kind:  # pylint: disable=unidiomatic-typecheck
    return value
  if origin is typing.Literal and value in typing.get_args(kind):
    return value
  name = getattr(kind, "__name__", kind)
  raise ValueError(f"{where}: {value!r} is not a {name}.")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
  """`cls` rebuilt from `to_dict`'s output; `where` names the source in
  errors (e.g. "<ckpt>/realm_config.json")."""
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(data) - fields)
  if unknown:
    raise ValueError(f"{where}: unknown {cls.__name__} fields {unknown}; "
                     "was it written by a newer realm_jax?")
  values = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in data.items()}
  try:
    return cls(**values)
  except ValueError as e:  # The config's own checks: name the source.
    if str(e).startswith(where):
      raise
    raise type(e)(f"{where}: {e}") from e

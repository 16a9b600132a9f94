"""Config validation whose messages name the config and the field."""

from __future__ import annotations

import numbers
from typing import Any


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

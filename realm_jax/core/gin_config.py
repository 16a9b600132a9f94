"""How every job resolves its configs from gin: one function, `configured`.

A job's config classes are gin configurables (`from __gin__ import
dynamic_registration` in its gin files); the job builds each one it reads
with `configured(cls)` after the command line was parsed
(`realm_jax.gin_cli`), then captures `gin.operative_config_str()`, so the
saved operative config is what ran.
"""

from __future__ import annotations

from typing import TypeVar

import gin

T = TypeVar("T")


def configured(cls: type[T], *, required: str = "") -> T:
  """`cls` as the parsed gin files and bindings configure it.

  Args:
    cls: the config class, as imported from its module (not `__main__`,
      where `python -m` runs a second copy that gin has not registered).
    required: "" gives `cls`'s defaults when no gin file mentions it (jobs
      that read several configs and accept files binding only some);
      otherwise the hint of the SystemExit raised then (e.g. the gin file
      to pass).

  Raises:
    SystemExit: `required` and no gin file mentions `cls`.
  """
  try:
    factory = gin.get_configurable(cls)
  except ValueError as e:  # Not registered: no gin file names it.
    if required:
      raise SystemExit(f"{cls.__name__} is not configured: {required}") from e
    factory = cls
  return factory()

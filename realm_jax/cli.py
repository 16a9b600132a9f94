"""Console scripts (pyproject.toml): `realm-pretrain ARGS` runs
`python -m realm_jax.jobs.pretrain ARGS`, and so on for every job.
`--help` exits 0 in each (`gin_cli.define_help_flags`), the demo's too."""

from __future__ import annotations

import pkgutil
import runpy

from realm_jax import jobs

# pyproject.toml's `realm_jax.cli:<name>` -> the module it runs: each module
# of realm_jax/jobs/, the job list.
SCRIPTS = {m.name: f"realm_jax.jobs.{m.name}"
           for m in pkgutil.iter_modules(jobs.__path__)}


def _entry(module: str):
  def run() -> None:
    from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
    gin_cli.define_help_flags()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  run.__doc__ = f"`python -m {module}`."
  return run


# The entry points: `demo = _entry("realm_jax.jobs.demo")`, and so on.
globals().update({name: _entry(module) for name, module in SCRIPTS.items()})

"""Gin at the edges: `--gin_file` (repeatable), `--gin.X=Y`, `--dry_run`.

Every job's `__main__` calls `run(job)`; `job(dry_run)` builds its configs
with `gin.get_configurable(...)()` and runs. `--gin.A.b=V` becomes the
binding `A.b = V` (t5x's convention); `--gin_bindings` works too.
Relative gin file paths are looked up in the working directory, then in the
repository's `gin_configs/`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Sequence

GIN_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "gin_configs")


# jax 0.10.2's XLA:CPU fuses dots into YNNPACK kernels that run on one
# thread on 2-core machines; an empty fusion-type set turns that off: BERT
# forward passes 1.3-1.6x faster (docs/benchmarks/embedding.md). Affects the
# CPU backend only.
CPU_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def default_xla_flags() -> None:
  """Adds `CPU_XLA_FLAG` to $XLA_FLAGS unless the user set that flag.

  Read when JAX starts its backends, so jobs call it before any JAX work
  (`run` does, first thing).
  """
  current = os.environ.get("XLA_FLAGS", "")
  if CPU_XLA_FLAG.rstrip("=") not in current:
    os.environ["XLA_FLAGS"] = f"{current} {CPU_XLA_FLAG}".strip()


def split_gin_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Pulls `--gin.X=Y` arguments out of argv (absl can't define them)."""
  rest, bindings = [], []
  for arg in argv:
    if arg.startswith("--gin.") and "=" in arg:
      key, value = arg[len("--gin."):].split("=", 1)
      bindings.append(f"{key} = {value}")
    else:
      rest.append(arg)
  return rest, bindings


class _NoGinProbeErrors(logging.Filter):
  """Drops gin's "Path not found" errors, logged for each search-path prefix
  it probes before the one holding the file (a missing file still raises)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.msg == "Path not found: %s" and
                record.pathname.endswith("resource_reader.py"))


def parse(gin_files: Sequence[str], bindings: Sequence[str]) -> None:
  """Parses gin files and bindings (gin_configs/ is on the search path)."""
  import gin  # pylint: disable=g-import-not-at-top
  gin.add_config_file_search_path(GIN_CONFIGS)
  gin.add_config_file_search_path(os.getcwd())
  probe_filter = _NoGinProbeErrors()
  logger = logging.getLogger()  # gin logs through the root logger.
  logger.addFilter(probe_filter)
  try:
    gin.parse_config_files_and_bindings(list(gin_files), list(bindings))
  finally:
    logger.removeFilter(probe_filter)


def training_job(module_name: str, config_class: str
                 ) -> Callable[[bool], None]:
  """The `job(dry_run)` of a trainer module with `train(config, model, ...)`.

  Builds `module.<config_class>` and `RealmConfig` from gin. The classes are
  looked up in the imported module (not `__main__`, where `python -m` runs
  a second copy that gin has not registered).
  """

  def job(dry_run: bool) -> None:
    import importlib  # pylint: disable=g-import-not-at-top
    import gin  # pylint: disable=g-import-not-at-top
    from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
    module = importlib.import_module(module_name)
    config = gin.get_configurable(getattr(module, config_class))()
    model = gin.get_configurable(RealmConfig)()
    if dry_run:
      print(gin.operative_config_str())
      print(config)
      print(model)
      return
    module.train(config=config, model=model,
                 operative_config=gin.operative_config_str())

  return job


def run(job: Callable[[bool], None]) -> None:
  """absl entry point: parses gin flags, then calls `job(dry_run)`."""
  default_xla_flags()
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_multi_string("gin_file", [], "Gin config files.")
  flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings.")
  flags.DEFINE_bool("dry_run", False, "Print the resolved config and exit.")
  argv, extra = split_gin_flags(sys.argv)

  def main(args):
    del args
    # Multi-host: joins the pod's JAX runtime when the launcher asks for it
    # (REALM_JAX_DISTRIBUTED=1 or an explicit coordinator); a no-op otherwise.
    from realm_jax.core import distributed  # pylint: disable=g-import-not-at-top
    distributed.maybe_initialize()
    f = flags.FLAGS
    parse(f.gin_file, list(f.gin_bindings) + extra)
    job(f.dry_run)

  app.run(main, argv=argv)

"""Gin at the edges: `--gin_file` (repeatable), `--gin.X=Y`, `--dry_run`.

Every job's `__main__` calls `run(job)` (Beam data jobs: `run_data_job`);
`job(dry_run)` builds its configs with `gin.get_configurable(...)()`. `--gin.A.b=V` becomes the
binding `A.b = V` (t5x's convention); `--gin_bindings` works too.
Relative gin file paths are looked up in the working directory, then in the
repository's `gin_configs/`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Sequence

from realm_jax.core import logs

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# A source checkout keeps the gin files beside the package; a wheel carries
# them inside it (setup.py maps gin_configs/ to realm_jax/gin_configs).
GIN_CONFIGS = next(
    (d for d in (os.path.join(os.path.dirname(_PACKAGE), "gin_configs"),
                 os.path.join(_PACKAGE, "gin_configs")) if os.path.isdir(d)),
    os.path.join(_PACKAGE, "gin_configs"))


# jax 0.10.2's XLA:CPU fuses dots into YNNPACK kernels that run on one
# thread on 2-core machines; an empty fusion-type set turns that off: BERT
# forward passes 1.3-1.6x faster (docs/benchmarks/embedding.md). It is
# experimental and CPU-only, so only CPU jobs ask for it: gin files through
# `cpu_xla_flag` (gin_configs/models/cpu.gin), Python entry points by
# calling `add_cpu_xla_flag`.
CPU_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def add_cpu_xla_flag() -> None:
  """Adds `CPU_XLA_FLAG` to $XLA_FLAGS unless the user set that flag.

  XLA reads $XLA_FLAGS when JAX starts its backends; afterwards this has no
  effect (and says so in the log).
  """
  current = os.environ.get("XLA_FLAGS", "")
  if CPU_XLA_FLAG.rstrip("=") in current:
    return
  os.environ["XLA_FLAGS"] = f"{current} {CPU_XLA_FLAG}".strip()
  if "jax" in sys.modules:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    if xla_bridge.backends_are_initialized():
      logging.warning("%s was added to XLA_FLAGS after JAX started its "
                      "backends, so it has no effect in this process.",
                      CPU_XLA_FLAG)


def cpu_xla_flag(enabled: bool = False) -> bool:
  """Whether the operative gin config asks for `CPU_XLA_FLAG`.

  Bound by gin_configs/models/cpu.gin (`gin_cli.cpu_xla_flag.enabled =
  True`); accelerator runs leave it False.
  """
  return enabled


def gin_asks_for_cpu_xla_flag() -> bool:
  """`cpu_xla_flag()` as the parsed gin config binds it."""
  import gin  # pylint: disable=g-import-not-at-top
  try:
    configurable = gin.get_configurable(cpu_xla_flag)
  except ValueError:  # Not registered: no gin file mentions it.
    return False
  return bool(configurable())


def apply_gin_xla_flags() -> None:
  """Adds `CPU_XLA_FLAG` if the parsed gin config asks for it.

  Call after `parse` and before anything starts a JAX backend (`run` does).
  """
  if gin_asks_for_cpu_xla_flag():
    add_cpu_xla_flag()


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


def command_line_bindings() -> list[str]:
  """The gin bindings of this process's command line (`--gin.A.b=V` and
  `--gin_bindings`): what the QA jobs hold to a checkpoint's configs."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  given = flags.FLAGS["gin_bindings"].value if (
      "gin_bindings" in flags.FLAGS and flags.FLAGS.is_parsed()) else []
  return split_gin_flags(sys.argv[1:])[1] + list(given or [])


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


def _configured(module_name: str, config_class: str, gin_file: str = ""):
  """(module, `module.<config_class>` as gin binds it). The class is looked
  up in the imported module (not `__main__`, where `python -m` runs a
  second copy that gin has not registered)."""
  import importlib  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(module_name)
  try:
    factory = gin.get_configurable(getattr(module, config_class))
  except ValueError as e:  # Not registered: no gin file mentions it.
    raise SystemExit(f"{config_class} is not configured: pass --gin_file="
                     f"{gin_file or '...'} and set its paths.") from e
  return module, factory()


def training_job(module_name: str, config_class: str
                 ) -> Callable[[bool], None]:
  """The `job(dry_run)` of a trainer module with `train(config, model, ...)`:
  builds `module.<config_class>` and `RealmConfig` from gin."""

  def job(dry_run: bool) -> None:
    import gin  # pylint: disable=g-import-not-at-top
    from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
    module, config = _configured(module_name, config_class)
    model = gin.get_configurable(RealmConfig)()
    if dry_run:
      print(gin.operative_config_str())
      print(config)
      print(model)
      return
    module.train(config=config, model=model,
                 operative_config=gin.operative_config_str())

  return job


def run_data_job(module_name: str, config_class: str, gin_file: str,
                 defaults: Sequence[str] = ()) -> None:
  """`run` of a Beam data job: `module.run(config, pipeline_args)`.

  `config` is `module.<config_class>` as `gin_file` (and the command line)
  bind it; the flags absl does not know are the Beam pipeline options.
  `defaults`: bindings parsed before the command line's (the macros that
  a trainer's gin files require and the job does not read).
  """

  def job(dry_run: bool, pipeline_args: list[str]) -> None:
    import gin  # pylint: disable=g-import-not-at-top
    module, config = _configured(module_name, config_class, gin_file)
    if dry_run:
      print(gin.operative_config_str())
      print(config, "Beam options:", pipeline_args)
    else:
      module.run(config, pipeline_args)

  run(job, pipeline_args=True, distributed=False, defaults=defaults)


def run(job: Callable[..., None], *, positional_args: bool = False,
        pipeline_args: bool = False, distributed: bool = True,
        defaults: Sequence[str] = ()) -> None:
  """absl entry point: parses gin flags, then calls `job(dry_run)`.

  With `positional_args`, the job is `job(dry_run, args)` and gets the
  command line's positional arguments (e.g. `ask`'s questions); with
  `pipeline_args` (the Beam data jobs), the flags absl does not know too
  (Beam's options, `--runner=...`). `distributed=False` never joins the JAX
  distributed runtime (nor imports JAX): data jobs use no accelerator, and
  on a pod host whose launcher sets REALM_JAX_DISTRIBUTED=1 they would wait
  for the trainer's processes. `defaults`: bindings parsed before the
  command line's.

  Order matters: gin is parsed before anything starts JAX, so that the
  XLA flags the config asks for (`apply_gin_xla_flags`) are in place when
  the backends start; the distributed runtime is joined after that and
  before the job.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_multi_string("gin_file", [], "Gin config files.")
  flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings.")
  flags.DEFINE_bool("dry_run", False, "Print the resolved config and exit.")
  argv, extra = split_gin_flags(sys.argv)

  def main(args):
    f = flags.FLAGS
    logs.quiet_libraries(f.verbosity)
    parse(f.gin_file, [*defaults, *f.gin_bindings, *extra])
    apply_gin_xla_flags()
    if distributed:
      # Multi-host: joins the pod's JAX runtime when the launcher asks for
      # it (REALM_JAX_DISTRIBUTED=1 or an explicit coordinator); a no-op
      # otherwise.
      from realm_jax.core import distributed as dist  # pylint: disable=g-import-not-at-top
      dist.maybe_initialize()
      logs.hide_gpus_from_tensorflow()
    if positional_args or pipeline_args:
      job(f.dry_run, list(args[1:]))
    else:
      job(f.dry_run)

  app.run(main, argv=argv, flags_parser=(
      (lambda a: flags.FLAGS(a, known_only=True)) if pipeline_args
      else app.parse_flags_with_usage))

"""Gin at the edges: `--gin_file` (repeatable), `--gin.X=Y`, `--dry_run`.

Every job (`realm_jax/jobs/`) calls `run(job)` (Beam jobs: `run_data_job`);
`job(dry_run)` builds its configs with `core.gin_config.configured(...)`.
`--gin.A.b=V` becomes the binding `A.b = V` (t5x's convention);
`--gin_bindings` works too.
Relative gin file paths are looked up in the working directory, then in the
repository's `gin_configs/`.

A job finds its own config: its runs file (e.g. `runs/corpus.gin`, named
where the job is defined) is parsed first, before the command line's
`--gin_file`s (which override it), unless one of those is or includes it,
or binds the job's config class itself.
`--help` exits 0 and says so; a data job refuses a flag that neither absl,
gin nor Beam's `PipelineOptions` takes, since Beam would drop it silently.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import logging
import os
import re
import sys
from typing import Callable, Sequence

from realm_jax.core import gin_text, io_utils, logs, outputs
from realm_jax.core import progress

# jax 0.10.2's XLA:CPU fuses dots into YNNPACK kernels that run on one
# thread on 2-core machines; an empty fusion-type set turns that off: BERT
# forward passes 1.3-1.6x faster (docs/benchmarks/embedding.md). It is
# experimental and CPU-only, so only CPU jobs ask for it: gin files through
# `cpu_xla_flag` (gin_configs/models/cpu.gin), Python entry points by
# calling `add_cpu_xla_flag`.
CPU_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def add_cpu_xla_flag() -> None:
  """Adds `CPU_XLA_FLAG` to $XLA_FLAGS unless the user set that flag.

  Not added where $JAX_PLATFORMS names no CPU (e.g. `cuda`): another jaxlib
  on an accelerator host may not know this experimental flag, and XLA
  stops at unknown flags. XLA reads $XLA_FLAGS when JAX starts its
  backends; afterwards this has no effect (and says so in the log).
  """
  current = os.environ.get("XLA_FLAGS", "")
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if CPU_XLA_FLAG.rstrip("=") in current or (
      platforms and "cpu" not in platforms.split(",")):
    return
  os.environ["XLA_FLAGS"] = f"{current} {CPU_XLA_FLAG}".strip()
  if "jax" in sys.modules:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    if xla_bridge.backends_are_initialized():
      logging.warning("%s was added to XLA_FLAGS after JAX started its "
                      "backends, so it has no effect in this process.",
                      CPU_XLA_FLAG)


def platform_when_unset() -> str | None:
  """Sets JAX_PLATFORMS=cpu on a host with neither a TPU chip nor a GPU
  (NVIDIA or AMD) when the user set no platform; returns what it set.

  Otherwise JAX, with libtpu installed (the test extra), probes for a TPU
  on every start: ~7 s, and libtpu's "Failed to find host bounds", an
  `E0000 ... unexpected worker hostname` trace and a CUDA probe's error
  before the job's own first line. The host is scanned as JAX scans it
  (PCI vendor ids, /dev/nvidia*), without starting JAX; a TPU VM or a GPU
  host keeps JAX's own choice, and so does any JAX_PLATFORMS the user set.
  """
  if os.environ.get("JAX_PLATFORMS"):
    return None
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  try:
    tpu_chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    gpu = (hardware_utils.has_visible_nvidia_gpu() or
           hardware_utils.num_available_amd_gpus() > 0)
  except (OSError, ValueError):  # An unreadable /sys: leave it to JAX.
    return None
  if tpu_chips or gpu:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if xla_bridge.backends_are_initialized():
    return None
  os.environ["JAX_PLATFORMS"] = "cpu"  # And the job's child processes.
  jax.config.update("jax_platforms", "cpu")
  return "cpu"


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
  gin.add_config_file_search_path(gin_text.GIN_CONFIGS)
  gin.add_config_file_search_path(os.getcwd())
  probe_filter = _NoGinProbeErrors()
  logger = logging.getLogger()  # gin logs through the root logger.
  logger.addFilter(probe_filter)
  try:
    gin.parse_config_files_and_bindings(list(gin_files), list(bindings))
  finally:
    logger.removeFilter(probe_filter)


# ------------------------------------------------------- its own gin file

def job_gin_files(gin_files: Sequence[str], runs_file: str,
                  config_class: str = "") -> list[str]:
  """The gin files a job parses: its own `runs_file` first (the command
  line's `gin_files` override what it binds), unless one of `gin_files`
  (or a file it includes) is it, or binds `config_class` (dotted or not)
  itself: the runs file's `%gin.REQUIRED` macros would then be left unset.
  """
  own = gin_text.find_gin_file(runs_file) if runs_file else None
  if own is None:
    return list(gin_files)
  given = gin_text.included_gin_files(gin_files)
  name = re.escape(config_class.rpartition(".")[2])
  binds = re.compile(rf"^[ \t]*(?:[\w.]+/)?(?:[\w.]+\.)?{name}"
                     rf"(?:\.\w+[ \t]*=|[ \t]*:[ \t]*$)", re.M)
  if own in given or (name and any(binds.search(t) for t in given.values())):
    return list(gin_files)
  return [runs_file, *gin_files]


def _config_class(config_class: str):
  """The class of a dotted `module.Class` name (None if it has none)."""
  module, _, name = config_class.rpartition(".")
  return getattr(importlib.import_module(module), name) if module else None


def _config_parts(config_class: str) -> list[tuple[str, str]]:
  """(field, class name) of the config fields of `config_class` that are
  configs themselves (bound as `@module.Class()` in gin: e.g.
  BuilderConfig.index_build, an IndexBuildConfig)."""
  cls = _config_class(config_class)
  if cls is None or not dataclasses.is_dataclass(cls):
    return []
  return [(f.name, type(f.default).__name__) for f in dataclasses.fields(cls)
          if dataclasses.is_dataclass(f.default)]


# ------------------------------------------------------------------ --help

_HELP_EPILOG = [""]


def _help_epilog(runs_file: str, config_class: str,
                 pipeline_args: bool) -> str:
  """What `--help` says after absl's usage: the gin flags, the job's own
  gin file and (data jobs) Beam's options."""
  lines = [
      "", "gin flags (realm_jax.gin_cli):",
      "  --gin_file: a gin file (repeatable), looked up in the working",
      f"    directory, then in {gin_text.GIN_CONFIGS}",
      "  --gin.A.b=V: the gin binding A.b = V (a string in both quotes:",
      "    --gin.OUTPUT_DIR=\"'/data/x'\")",
      "  --gin_bindings: 'A.b = V' bindings (repeatable)",
      "  --dry_run: parse the flags and gin files, build and check the",
      "    config, print it and exit without doing the work",
      "  --progress_seconds: seconds between the progress lines (done/total,",
      "    rate, ETA) of long loops when stderr is not a terminal (30)"]
  if runs_file:
    lines += ["", f"This job's own gin file: {runs_file}, parsed before the",
              "--gin_file's (which override it) unless one of them "
              "includes it", "or binds the job's config itself."]
    macros = gin_text.required_macros(runs_file)
    if macros:
      lines.append("Must set: " + " ".join(
          f"--gin.{m}=\"'...'\"" for m in macros))
  if config_class:
    name = config_class.rpartition(".")[2]
    lines.append(f"Its config: {name} (--gin.{name}.<field>=V).")
    lines += [f"Its {field}: {part} (--gin.{part}.<field>=V)."
              for field, part in _config_parts(config_class)]
  if pipeline_args:
    lines += ["", "Other flags are Apache Beam pipeline options "
              "(--runner=DirectRunner,", "--direct_num_workers=N, "
              "--runner=dask --dask_workers=N: a Dask cluster, BUILD.md,",
              "...); a flag that neither absl, gin nor Beam takes is "
              "refused."]
  return "\n".join(lines)


def define_help_flags(epilog: str = "") -> None:
  """absl's `--help` (`-?`), `--helpshort` (`-h`) and `--helpfull`, exiting
  with status 0 (absl's exit 1, which scripts and CI read as a failure),
  `epilog` printed after absl's usage. Call before `app.run` (`run` does);
  again to change the epilog."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  _HELP_EPILOG[0] = epilog
  help_flag = _help_flag_class()
  if "help" in flags.FLAGS and isinstance(flags.FLAGS["help"], help_flag):
    return
  app.define_help_flags()  # absl's (once), replaced here.
  for name in ("help", "?", "helpshort", "helpfull"):
    if name in flags.FLAGS:
      delattr(flags.FLAGS, name)
  for name, short_name, full in (("help", "?", False),
                                 ("helpshort", "h", False),
                                 ("helpfull", None, True)):
    flags.DEFINE_flag(help_flag(name, short_name, full))


@functools.lru_cache(maxsize=None)
def _help_flag_class():
  """absl's help flag, printing `_HELP_EPILOG` too and exiting 0."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top

  class HelpFlag(flags.BooleanFlag):

    def __init__(self, name: str, short_name: str | None, full: bool):
      super().__init__(name, False, "show full help" if full
                       else "show this help", short_name=short_name,
                       allow_hide_cpp=True)
      self.full = full

    def parse(self, argument):
      if self._parse(argument):
        app.usage(shorthelp=not self.full, writeto_stdout=True)
        if _HELP_EPILOG[0]:
          print(_HELP_EPILOG[0])
        if not self.full:
          print("\nTry --helpfull to get a list of all flags.")
        sys.stdout.flush()
        sys.exit(0)

  return HelpFlag


# ------------------------------------------------- flags Beam would drop


class _BeamParser(Exception):
  """Carries Beam's own option parser out of `get_all_options`."""


def beam_unknown_args(args: Sequence[str]) -> list[str]:
  """The arguments Beam's `PipelineOptions` would drop (it logs a warning
  and goes on): parsed with the very parser Beam builds from every
  `PipelineOptions` subclass (the `add_extra_args_fn` hook hands it over)."""
  from apache_beam.options import pipeline_options  # pylint: disable=g-import-not-at-top
  if any("dask" in arg.lower() for arg in args):
    # The Dask runner's options (its own and Beam's DaskOptions, which
    # needs dask installed), registered on import.
    from realm_jax.data import beam_dask  # pylint: disable=g-import-not-at-top,unused-import

  def capture(parser):
    raise _BeamParser(parser)

  try:
    pipeline_options.PipelineOptions(list(args)).get_all_options(
        add_extra_args_fn=capture)
  except _BeamParser as e:
    return e.args[0].parse_known_args(list(args))[1]
  raise AssertionError("Beam did not call add_extra_args_fn")


def _gin_value(value: str | None) -> str:
  """`value` as a gin literal on a shell command line."""
  if value is None:
    return "True"
  try:
    literal = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    literal = value
  return value if not isinstance(literal, str) else f"\"'{value}'\""


def _suggestion(flag: str, value: str | None, runs_file: str,
                config_class: str) -> str:
  """The gin flag that sets what `--flag` meant, or ""."""
  name = flag.lstrip("-").replace("-", "_")
  if name.upper() in dict(gin_text.macros(runs_file)):
    return f"--gin.{name.upper()}={_gin_value(value)}"
  cls = _config_class(config_class) if config_class else None
  if cls is not None and dataclasses.is_dataclass(cls) and name in {
      f.name for f in dataclasses.fields(cls) if f.init}:
    return f"--gin.{cls.__name__}.{name}={_gin_value(value)}"
  return ""


def refuse_unknown_args(args: Sequence[str], runs_file: str = "",
                        config_class: str = "") -> None:
  """Exits (status 1) naming each argument of `args` (what absl left for
  Beam) that Beam would drop, with the gin flag meant where there is one."""
  unknown = beam_unknown_args(args)
  problems, i = [], 0
  while i < len(unknown):
    arg, i = unknown[i], i + 1
    if not arg.startswith("-"):
      problems.append(f"unexpected argument {arg!r} (this job takes flags "
                      "only)")
      continue
    flag, eq, value = arg.partition("=")
    if not eq and i < len(unknown) and not unknown[i].startswith("-"):
      value, i = unknown[i], i + 1  # `--flag value`
    hint = _suggestion(flag, value if eq or value else None, runs_file,
                       config_class)
    problems.append(f"{flag} is not an absl, gin or Apache Beam pipeline "
                    "option (Beam would drop it)" + (
                        f"; did you mean {hint}?" if hint else ""))
  if problems:
    sys.stderr.write("".join(f"FATAL Flags parsing error: {p}\n"
                             for p in problems) +
                     "Pass --helpshort or --helpfull to see help on flags.\n")
    sys.exit(1)


# -------------------------------------------------------------------- jobs


def _configured(module_name: str, config_class: str, gin_file: str = ""):
  """(module, `module.<config_class>` as gin binds it)."""
  from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(module_name)
  return module, gin_config.configured(
      getattr(module, config_class),
      required=f"pass --gin_file={gin_file or '...'} and set its paths.")


def training_job(module_name: str, config_class: str, runs_file: str = ""
                 ) -> Callable[[bool], None]:
  """The `job(dry_run)` of a trainer module with `train(config, model, ...)`:
  builds `module.<config_class>` and `RealmConfig` from gin. Its own gin
  file (`run` parses it) is `runs_file`, by default `runs/<module>.gin`
  (`runs/pretrain.gin` for `realm_jax.training.pretrain`)."""

  def job(dry_run: bool) -> None:
    import gin  # pylint: disable=g-import-not-at-top
    from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
    from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
    module, config = _configured(module_name, config_class)
    model = gin_config.configured(RealmConfig)
    if dry_run:
      print(gin.operative_config_str())
      print(config)
      print(model)
      return
    module.train(config=config, model=model,
                 operative_config=gin.operative_config_str())

  job.runs_file = runs_file or f"runs/{module_name.rpartition('.')[2]}.gin"
  job.config_class = f"{module_name}.{config_class}"
  return job


def run_data_job(work: Callable[..., None], module_name: str,
                 config_class: str, gin_file: str,
                 defaults: Sequence[str] = ()) -> None:
  """`run` of a Beam data job: `work(config, pipeline_args)`.

  `config` is `module.<config_class>` as `gin_file` (the job's own, parsed
  first unless a `--gin_file` includes it) and the command line bind it;
  the flags absl does not know are the Beam pipeline options, and one that
  Beam does not know either is refused. `defaults`: bindings parsed before
  the command line's (the macros that a trainer's gin files require and
  the job does not read).
  """

  def job(dry_run: bool, pipeline_args: list[str]) -> None:
    import gin  # pylint: disable=g-import-not-at-top
    _, config = _configured(module_name, config_class, gin_file)
    if dry_run:
      print(gin.operative_config_str())
      print(config, "Beam options:", pipeline_args)
      return
    try:
      work(config, pipeline_args)
    except FileExistsError as e:
      flag = f"--gin.{config_class}.overwrite=True"
      raise SystemExit(str(e) if flag in str(e) else
                       f"{e} (From the command line: {flag}.)") from e

  run(job, pipeline_args=True, distributed=False, defaults=defaults,
      runs_file=gin_file, config_class=f"{module_name}.{config_class}")


def _parse_or_exit(gin_files: Sequence[str], bindings: Sequence[str]
                   ) -> None:
  """`parse`, exiting with the flag to pass for a `%gin.REQUIRED` macro
  that nothing set (gin raises a ValueError naming `NAME/macro.value`)."""
  try:
    parse(gin_files, bindings)
  except ValueError as e:
    missing = re.match(r"(\w+)/macro\.value set to `%gin\.REQUIRED`", str(e))
    if not missing:
      raise
    raise SystemExit(
        f"{missing[1]} is not set: pass --gin.{missing[1]}=\"'...'\" "
        f"(gin files: {', '.join(gin_files)}; see --help).") from e


def run(job: Callable[..., None], *, positional_args: bool = False,
        pipeline_args: bool = False, distributed: bool = True,
        defaults: Sequence[str] = (), runs_file: str | None = None,
        config_class: str | None = None) -> None:
  """absl entry point: parses gin flags, then calls `job(dry_run)`.

  With `positional_args`, the job is `job(dry_run, args)` and gets the
  command line's positional arguments (e.g. `ask`'s questions); with
  `pipeline_args` (the Beam data jobs), the flags absl does not know too
  (Beam's options, `--runner=...`), after refusing any that Beam does not
  know. `distributed=False` never joins the JAX distributed runtime (nor
  imports JAX): data jobs use no accelerator, and on a pod host whose
  launcher sets REALM_JAX_DISTRIBUTED=1 they would wait for the trainer's
  processes. `defaults`: bindings parsed before the command line's.
  `runs_file`: the job's own gin file (`job_gin_files`); `config_class`:
  the dotted name of its config (for `--help` and for the gin flag a
  refused flag meant). Both default to the job's attributes of those names
  (`training_job` sets them).

  Order matters: gin is parsed before anything starts JAX, so that the
  XLA flags the config asks for (`apply_gin_xla_flags`) are in place when
  the backends start; the distributed runtime is joined after that and
  before the job.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  if distributed:
    platform_when_unset()
  runs_file = getattr(job, "runs_file", "") if runs_file is None else runs_file
  config_class = (getattr(job, "config_class", "") if config_class is None
                  else config_class)
  flags.DEFINE_multi_string("gin_file", [], "Gin config files.")
  flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings.")
  flags.DEFINE_bool("dry_run", False, "Print the resolved config and exit.")
  flags.DEFINE_float(
      "progress_seconds", progress.DEFAULT_EVERY_SECONDS,
      "Seconds between the progress lines (done/total, rate, ETA) that long "
      "loops log when stderr is not a terminal (core.progress).")
  flags.register_validator("progress_seconds", lambda seconds: seconds > 0,
                           "--progress_seconds must be > 0")
  define_help_flags(_help_epilog(runs_file, config_class, pipeline_args))
  argv, extra = split_gin_flags(sys.argv)

  def main(args):
    f = flags.FLAGS
    logs.quiet_libraries(f.verbosity)
    progress.set_default_every_seconds(f.progress_seconds)
    if pipeline_args:
      refuse_unknown_args(args[1:], runs_file, config_class)
    _parse_or_exit(job_gin_files(f.gin_file, runs_file, config_class),
                   [*defaults, *f.gin_bindings, *extra])
    apply_gin_xla_flags()
    if distributed:
      # Multi-host: joins the pod's JAX runtime when the launcher asks for
      # it (REALM_JAX_DISTRIBUTED=1 or an explicit coordinator); a no-op
      # otherwise.
      from realm_jax.core import distributed as dist  # pylint: disable=g-import-not-at-top
      dist.maybe_initialize()
      logs.hide_gpus_from_tensorflow()
    try:
      if positional_args or pipeline_args:
        job(f.dry_run, list(args[1:]))
      else:
        job(f.dry_run)
    except (outputs.OwnershipError, io_utils.LinkRefusedError,
            io_utils.SamePlaceError, io_utils.NotRegularFileError) as e:
      # A refused output path: nothing was written; the message says which
      # setting and what to do, a traceback would only hide it.
      raise SystemExit(f"{type(e).__name__}: {e}") from None

  app.run(main, argv=argv, flags_parser=(
      (lambda a: flags.FLAGS(a, known_only=True)) if pipeline_args
      else functools.partial(parse_flags_with_hints, runs_file=runs_file,
                             config_class=config_class)))


def parse_flags_with_hints(argv: Sequence[str], *, runs_file: str = "",
                           config_class: str = "") -> list[str]:
  """absl's `parse_flags_with_usage` for the jobs without Beam options: an
  unknown flag also gets the gin flag it meant, as `refuse_unknown_args`
  gives the Beam jobs (`--one_shot` -> `did you mean
  --gin.BuilderConfig.one_shot=True?`)."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  try:
    return flags.FLAGS(list(argv))
  except flags.UnrecognizedFlagError as e:
    # absl's flagvalue is the whole argument (`--index_dir=/i`).
    _, eq, value = str(e.flagvalue or "").partition("=")
    hint = _suggestion("--" + e.flagname, value if eq else None, runs_file,
                       config_class)
    if not hint:
      return app.parse_flags_with_usage(list(argv))
    sys.stderr.write(f"FATAL Flags parsing error: {e}; did you mean {hint}?"
                     "\nPass --helpshort or --helpfull to see help on "
                     "flags.\n")
    sys.exit(1)

"""Quiet logs: realm_jax's own records, library records only when asked.

`import realm_jax` calls `quiet_libraries()`, and every entry point calls
it again with absl's `--verbosity` once flags are parsed. At verbosity 0
(absl's default) the INFO and WARNING records of the libraries underneath
(orbax's option dumps and handler registries, JAX's backend probes, clu,
Beam, seqio's example dumps, TensorFlow's C++ start-up lines such as its
CUDA probe on a CPU machine) are hidden; their errors are not. At
`--verbosity=1` (or `-v 1`) and above everything is shown.
"""

from __future__ import annotations

import glob
import logging
import os

# Where the records of the libraries come from (absl records carry the
# logging call's file path; Python loggers have names).
LIBRARY_PATHS = ("/orbax/", "/clu/", "/jax/", "/jaxlib/", "/etils/",
                 "/seqio/", "/apache_beam/", "/tensorflow/", "/flax/",
                 "/tensorflow_datasets/", "/scann/", "/gin/")
LIBRARY_LOGGERS = ("jax", "orbax", "apache_beam", "tensorflow", "clu",
                   "etils", "seqio", "tensorflow_datasets", "flax", "gin")


class LibraryFilter(logging.Filter):
  """Drops library records below `min_level`; keeps everything else."""

  def __init__(self, min_level: int = logging.ERROR):
    super().__init__()
    self.min_level = min_level

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= self.min_level:
      return True
    path = record.pathname.replace(os.sep, "/")
    return not any(p in path for p in LIBRARY_PATHS)


_FILTER = LibraryFilter()


_TF_LEVEL_SET_HERE = False


def libraries_quiet() -> bool:
  """Whether library records are hidden (`quiet_libraries` at verbosity
  0): for a library that sets its own loggers' levels on import (dask's
  distributed)."""
  return _FILTER in logging.getLogger().filters


def quiet_libraries(verbosity: int = 0) -> None:
  """Hides library INFO/WARNING records, or (`verbosity` >= 1) shows them.

  `import realm_jax` calls it with 0; entry points call it again with
  absl's `--verbosity`. TensorFlow reads its C++ log level once, when it is
  imported, so that part only applies before. Idempotent.
  """
  global _TF_LEVEL_SET_HERE
  # absl.logging must create the "absl" logger (an ABSLLogger, which
  # records each call's real file); a plain logging.getLogger("absl") first
  # would make every absl record look as if it came from absl itself.
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  loggers = (logging.getLogger(), absl_logging.get_absl_logger())
  if verbosity >= 1:
    if _TF_LEVEL_SET_HERE:
      os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    for name in LIBRARY_LOGGERS:
      logging.getLogger(name).setLevel(logging.NOTSET)
    for logger in loggers:
      for x in (logger, *logger.handlers):
        x.removeFilter(_FILTER)
    return
  if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    _TF_LEVEL_SET_HERE = True
  for name in LIBRARY_LOGGERS:
    logging.getLogger(name).setLevel(logging.ERROR)
  for logger in loggers:
    for x in (logger, *logger.handlers):
      if _FILTER not in x.filters:
        x.addFilter(_FILTER)


def hide_gpus_from_tensorflow() -> None:
  """Keeps TensorFlow (tokenizer, TFRecords) off the GPUs JAX uses.

  TF would otherwise reserve most of each GPU's memory when it first runs
  an op. Only on machines with NVIDIA devices (checked without starting
  JAX, whose backends must start after the XLA flags are set): elsewhere
  TF is not imported here (importing it costs seconds).
  """
  if not glob.glob("/dev/nvidia[0-9]*"):
    return
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")

"""Small pieces every training job's loop shares.

Workdir paths may be local or `gs://`: files go through `realm_jax.io_utils`.
"""

from __future__ import annotations

import json
import signal
from typing import Any

from realm_jax import io_utils


class Preemption:
  """Turns SIGTERM (preemption, `kill`) and a first Ctrl-C (SIGINT) into a
  request to checkpoint and stop between steps. A second Ctrl-C interrupts
  at once (KeyboardInterrupt), without that checkpoint."""

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.requested = False
    self._previous = {}
    try:
      for s in signals:
        if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
          continue  # Started to ignore Ctrl-C (a launcher's child): keep it.
        self._previous[s] = signal.signal(s, self._handler)
    except ValueError:  # Not the main thread (e.g. inside a test runner).
      pass

  def close(self) -> None:
    """Gives the signals back to their previous handlers (after the loop)."""
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handler(self, signum, frame):
    del frame
    self.requested = True
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)


def write_json(path: io_utils.PathLike, obj: Any) -> None:
  """Writes JSON atomically (local: temp file + rename; GCS: one upload)."""
  io_utils.atomic_write_text(path, json.dumps(obj, indent=1))


def append_jsonl(path: io_utils.PathLike, record: dict[str, Any]) -> None:
  """Appends one JSON line (on GCS: rewrites the small file; no appends)."""
  io_utils.append_text(path, json.dumps(record) + "\n")


def start_run(workdir: io_utils.PathLike, operative_config: str, *,
              is_chief: bool):
  """Creates the workdir, saves the operative gin config, returns a writer.

  Only process 0 writes the config and TensorBoard summaries; the others
  get a logging-only writer.
  """
  io_utils.makedirs(workdir)
  if is_chief and operative_config:
    io_utils.atomic_write_text(io_utils.join(workdir, "operative_config.gin"),
                               operative_config)
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  # TensorBoard's writer opens gs:// itself (tf.io.gfile).
  return metric_writers.create_default_writer(
      io_utils.join(workdir, "summaries"), just_logging=not is_chief)

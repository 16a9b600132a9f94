"""Small pieces every training job's loop shares."""

from __future__ import annotations

import json
import os
import signal
from typing import Any


class Preemption:
  """Turns SIGTERM into a request to checkpoint and stop between steps."""

  def __init__(self):
    self.requested = False
    try:
      signal.signal(signal.SIGTERM, self._handler)
    except ValueError:  # Not the main thread (e.g. inside a test runner).
      pass

  def _handler(self, signum, frame):
    del signum, frame
    self.requested = True


def write_json(path: str, obj: Any) -> None:
  """Writes JSON atomically (temp file + rename)."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def start_run(workdir: str, operative_config: str, *, is_chief: bool):
  """Creates the workdir, saves the operative gin config, returns a writer.

  Only process 0 writes the config and TensorBoard summaries; the others
  get a logging-only writer.
  """
  os.makedirs(workdir, exist_ok=True)
  if is_chief and operative_config:
    with open(os.path.join(workdir, "operative_config.gin"), "w") as f:
      f.write(operative_config)
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  return metric_writers.create_default_writer(
      os.path.join(workdir, "summaries"), just_logging=not is_chief)

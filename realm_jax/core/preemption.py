"""Preemption: SIGTERM and Ctrl-C become a request to checkpoint and stop."""

from __future__ import annotations

import signal


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

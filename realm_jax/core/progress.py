"""How far a long loop is and when it will end: a bar or log lines.

Every long loop of the jobs (embedding the corpus, extending an index, the
QA eval, BM25 indexing, reader preparation, the Beam workers) counts its
work with one `Progress`:

    with progress.Progress("embedding blocks", total=n, unit="blocks",
                           host=(jax.process_index(), jax.process_count())
                           ) as bar:
      for batch in batches:
        ...
        bar.update(len(batch))

On a terminal it draws a tqdm bar on stderr (host 0 only). Anywhere else
(a file, a pod host's log, `nohup`) it logs a line every `every_seconds`
(default 30 s; the jobs' `--progress_seconds` flag sets it), holding
done/total, the rate and the ETA:

    embedding blocks: 4,800/15,319 blocks (31%), 32.1 blocks/s, ETA 5m28s

and on reaching `total` (or at `close`) a last line with the total time:

    embedding blocks: 15,319/15,319 blocks in 480.3 s, 31.9 blocks/s

Multi-host jobs pass `host`, and every line ends with `(host i/n)`.

`update` costs one clock read and two comparisons while the period has not
elapsed: nothing is formatted or logged between lines
(benchmarks/progress_overhead.py measures it).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, TextIO

from absl import logging

DEFAULT_EVERY_SECONDS = 30.0
_every_seconds = [DEFAULT_EVERY_SECONDS]


def set_default_every_seconds(seconds: float) -> None:
  """The log period of every `Progress` created afterwards without one
  (the jobs' `--progress_seconds`)."""
  if not seconds > 0:
    raise ValueError(f"progress period {seconds} s must be > 0.")
  _every_seconds[0] = float(seconds)


def default_every_seconds() -> float:
  """The log period a `Progress` gets when given none."""
  return _every_seconds[0]


def format_duration(seconds: float) -> str:
  """42 s, 7m21s, 2h03m: an ETA as a reader takes it in at a glance."""
  if not math.isfinite(seconds):
    return "?"
  s = max(0, int(round(seconds)))
  if s < 60:
    return f"{s} s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


def jax_host() -> tuple[int, int] | None:
  """`host` for a loop of a JAX job: (process_index, process_count) on a
  pod, None on one host (its lines then name none)."""
  import jax  # pylint: disable=g-import-not-at-top
  count = jax.process_count()
  return (jax.process_index(), count) if count > 1 else None


def _is_terminal(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):  # No isatty, or a closed stream.
    return False


class Progress:
  """Counts the work of one loop and reports it (see the module docstring).

  Attributes:
    what, total, unit: what is counted ("embedding blocks"), how many there
      are (None: unknown; the lines then have no percentage and no ETA) and
      their name ("blocks").
    done: how many were counted so far.
    every_seconds: the period of the log lines.
    closed: the last line was written.
  """

  def __init__(self, what: str, total: int | None = None, *,
               unit: str = "items", every_seconds: float | None = None,
               host: tuple[int, int] | None = None,
               bar: bool | None = None, stream: TextIO | None = None,
               clock: Callable[[], float] = time.monotonic,
               log: Callable[[str], None] | None = None):
    """Starts counting.

    Args:
      what, total, unit: see the class attributes.
      every_seconds: the log period (default `default_every_seconds()`).
      host: (process_index, process_count) of a multi-host job: named in
        every line; only process 0 draws a bar.
      bar: draw a tqdm bar on `stream` instead of logging lines (default:
        when `stream` is a terminal and this is process 0). Other processes
        on a terminal log their last line only.
      stream: the bar's stream (default: sys.stderr, as it is now).
      clock: seconds, monotonic (tests pass a fake one).
      log: where lines go (default: absl's logging.info).
    """
    self.what, self.total, self.unit = what, total, unit
    self.every_seconds = (default_every_seconds() if every_seconds is None
                          else float(every_seconds))
    if not self.every_seconds > 0:
      raise ValueError(f"Progress every_seconds={every_seconds} must be > 0.")
    self.done, self.closed = 0, False
    self._host = "" if host is None else f" (host {host[0]}/{host[1]})"
    self._clock, self._log = clock, log or logging.info
    stream = sys.stderr if stream is None else stream
    terminal = _is_terminal(stream)
    chief = host is None or host[0] == 0
    self._bar = None
    if bar if bar is not None else (terminal and chief):
      import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm.tqdm(total=total, desc=what, unit=unit,
                            file=stream, dynamic_ncols=True)
    # Lines between the first and the last: only where no bar shows them,
    # and not on other hosts' terminals (their lines would cut the bar).
    self._lines = self._bar is None and not (terminal and not chief)
    self._end = math.inf if total is None else total
    self.start = clock()
    self._next = self.start + self.every_seconds if self._lines else math.inf

  # The hot path: one clock read and two comparisons between lines.
  def update(self, n: int = 1) -> None:
    """Counts `n` more; logs a line if the period elapsed, the last line on
    reaching `total`."""
    self.done += n
    if self.done >= self._end:
      self.close()
    elif self._bar is not None:
      self._bar.update(n)
    elif (now := self._clock()) >= self._next:
      self._log_line(now)

  def seconds(self) -> float:
    """Seconds since the start."""
    return self._clock() - self.start

  def _counts(self) -> str:
    if self.total is None:
      return f"{self.done:,} {self.unit}"
    return f"{self.done:,}/{self.total:,} {self.unit}"

  def line(self, now: float) -> str:
    """The line for the count at `now` (a clock reading)."""
    elapsed = now - self.start
    rate = self.done / elapsed if elapsed > 0 else math.inf
    text = f"{self.what}: {self._counts()}"
    if self.total:
      text += f" ({100 * self.done // self.total}%)"
    text += f", {rate:.1f} {self.unit}/s"
    if self.total is not None:
      eta = (self.total - self.done) / rate if rate > 0 else math.inf
      text += f", ETA {format_duration(eta)}"
    return text + self._host

  def _log_line(self, now: float) -> None:
    self._next = now + self.every_seconds
    self._log(self.line(now))

  def last_line(self, now: float, stopped: bool = False) -> str:
    """The last line: the count, the total time and the mean rate; of a
    loop `stopped` by an error, saying so."""
    elapsed = now - self.start
    rate = self.done / elapsed if elapsed > 0 else math.inf
    return (f"{self.what}: {'stopped at ' if stopped else ''}"
            f"{self._counts()} {'after' if stopped else 'in'} "
            f"{elapsed:.1f} s, {rate:.1f} {self.unit}/s{self._host}")

  def close(self, stopped: bool = False) -> None:
    """Writes the last line (once; `stopped`: the loop ended on an error)
    and closes the bar."""
    if self.closed:
      return
    self.closed = True
    if self._bar is not None:
      self._bar.update(self.done - self._bar.n)
      self._bar.close()
    self._log(self.last_line(self._clock(), stopped))

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    self.close(stopped=exc_type is not None)

"""core.progress: a bar on a terminal, timed log lines anywhere else."""

import io

import pytest

from realm_jax.core import progress


class _Clock:
  """A fake monotonic clock: tests move it by hand."""

  def __init__(self, now=100.0):
    self.now, self.reads = now, 0

  def __call__(self):
    self.reads += 1
    return self.now


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def _progress(clock, lines, **kwargs):
  kwargs.setdefault("stream", io.StringIO())
  return progress.Progress("embedding blocks", unit="blocks", clock=clock,
                           log=lines.append, **kwargs)


def test_lines_every_period_with_rate_and_eta_then_the_total_time():
  clock, lines = _Clock(), []
  bar = _progress(clock, lines, total=1000, every_seconds=30)
  for _ in range(29):  # 290 blocks in 29 s: the period has not elapsed.
    clock.now += 1
    bar.update(10)
  assert lines == []
  clock.now += 1
  bar.update(10)  # 300 blocks at 30 s.
  assert lines == ["embedding blocks: 300/1,000 blocks (30%), 10.0 blocks/s, "
                   "ETA 1m10s"]
  clock.now += 29
  bar.update(100)
  assert len(lines) == 1  # The next line is due at 60 s.
  clock.now += 1
  bar.update(200)  # 600 at 60 s.
  assert lines[1] == ("embedding blocks: 600/1,000 blocks (60%), 10.0 "
                      "blocks/s, ETA 40 s")
  clock.now += 20
  bar.update(400)  # Reaching the total writes the last line at once.
  assert lines[2] == ("embedding blocks: 1,000/1,000 blocks in 80.0 s, "
                      "12.5 blocks/s")
  assert bar.closed
  bar.close()  # Once only.
  assert len(lines) == 3


def test_update_reads_the_clock_only_and_formats_nothing_between_lines():
  clock, lines = _Clock(), []
  bar = _progress(clock, lines, total=10**6, every_seconds=30)
  reads = clock.reads
  for _ in range(1000):
    bar.update()
  assert clock.reads - reads == 1000 and lines == []


def test_unknown_total_host_and_close_at_an_early_stop():
  clock, lines = _Clock(), []
  with _progress(clock, lines, every_seconds=5, host=(3, 4)) as bar:
    clock.now += 5
    bar.update(7)
    clock.now += 2.5
    bar.update(8)
  assert lines == [
      "embedding blocks: 7 blocks, 1.4 blocks/s (host 3/4)",
      "embedding blocks: 15 blocks in 7.5 s, 2.0 blocks/s (host 3/4)"]


def test_eta_formats_and_default_period():
  assert [progress.format_duration(s) for s in
          (0.4, 59.4, 60, 441, 3599, 3600, 7380, float("inf"))] == [
              "0 s", "59 s", "1m00s", "7m21s", "59m59s", "1h00m", "2h03m",
              "?"]
  assert progress.default_every_seconds() == progress.DEFAULT_EVERY_SECONDS
  try:
    progress.set_default_every_seconds(0.25)
    assert progress.Progress("x").every_seconds == 0.25
  finally:
    progress.set_default_every_seconds(progress.DEFAULT_EVERY_SECONDS)
  with pytest.raises(ValueError, match="must be > 0"):
    progress.set_default_every_seconds(0)
  with pytest.raises(ValueError, match="must be > 0"):
    progress.Progress("x", every_seconds=-1)


def test_a_bar_on_the_chiefs_terminal_only():
  """Host 0 on a terminal: a tqdm bar, no timed lines, the last line still
  logged. Another host's terminal: the last line only. A file: lines."""
  for host, stream, bar_drawn, timed in (
      ((0, 2), _Terminal(), True, False), ((1, 2), _Terminal(), False, False),
      ((0, 2), io.StringIO(), False, True)):
    clock, lines = _Clock(), []
    bar = _progress(clock, lines, total=20, every_seconds=1, host=host,
                    stream=stream)
    for _ in range(10):
      clock.now += 1
      bar.update(2)
    drawn = stream.getvalue()
    assert (("embedding blocks: 100%" in drawn and " 20/20 " in drawn)
            == bar_drawn), drawn
    if not bar_drawn:
      assert not drawn
    assert lines[-1] == ("embedding blocks: 20/20 blocks in 10.0 s, 2.0 "
                         f"blocks/s (host {host[0]}/2)")
    assert (len(lines) > 1) == timed


def test_a_loop_closed_short_of_its_total_says_it_stopped():
  clock, lines = _Clock(), []
  with pytest.raises(RuntimeError):
    with _progress(clock, lines, total=50, every_seconds=30) as bar:
      clock.now += 4
      bar.update(10)
      raise RuntimeError("a batch failed")
  assert lines == ["embedding blocks: stopped at 10/50 blocks after 4.0 s, "
                   "2.5 blocks/s"]
  # Ended short of `total` without an error (fewer documents than a cap):
  # the plain last line.
  lines.clear()
  bar = _progress(clock, lines, total=50, every_seconds=30)
  clock.now += 2
  bar.update(3)
  bar.close()
  assert lines == ["embedding blocks: 3/50 blocks in 2.0 s, 1.5 blocks/s"]

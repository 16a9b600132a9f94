"""Library records are hidden at verbosity 0; realm_jax's and errors stay."""

import logging

from realm_jax.core import logs


def _record(path, level):
  return logging.LogRecord("absl", level, path, 1, "message", (), None)


def test_library_info_and_warnings_are_dropped_errors_kept():
  f = logs.LibraryFilter()
  orbax = "/venv/lib/python3.11/site-packages/orbax/checkpoint/manager.py"
  ours = "/repo/realm_jax/training/loop.py"
  assert not f.filter(_record(orbax, logging.INFO))
  assert not f.filter(_record(orbax, logging.WARNING))
  assert f.filter(_record(orbax, logging.ERROR))
  assert f.filter(_record(ours, logging.INFO))


def test_quiet_libraries_filters_the_absl_logger(caplog):
  logs.quiet_libraries(0)
  absl_logger = logging.getLogger("absl")
  try:
    with caplog.at_level(logging.INFO, logger="absl"):
      absl_logger.handle(_record("/x/orbax/checkpoint/a.py", logging.INFO))
      absl_logger.handle(_record("/x/realm_jax/index/builder.py",
                                 logging.INFO))
    assert [r.pathname for r in caplog.records] == [
        "/x/realm_jax/index/builder.py"]
  finally:
    absl_logger.removeFilter(logs._FILTER)  # pylint: disable=protected-access


def test_absl_records_keep_their_callers_file():
  """Quieting must not replace absl's logger (whose records carry the
  calling file, which the filter needs)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import realm_jax, logging\n"
          "from absl import logging as l\n"
          "seen = []\n"
          "class H(logging.Handler):\n"
          "  def emit(self, r): seen.append(r.pathname)\n"
          "l.get_absl_logger().addHandler(H())\n"
          "l.warning('x')\n"
          "print(seen[0])\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout.strip()
  assert out == "<string>", out

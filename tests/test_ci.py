"""CI (.ci/run) runs README's test command as written, then the slow tests.

README's Quick start gives the command a user runs to test a clone; CI must
run that very line (not a variant of it), so that what passes in CI passes
for them. The long tests, marked `slow`, are left out of it and run by CI
after it.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
  """The pytest line of README.md's Quick start."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  lines = [line for block in re.findall(r"```bash\n(.*?)```", quick_start,
                                        re.S)
           for line in block.splitlines() if "pytest" in line]
  assert len(lines) == 1, lines
  return lines[0]


def test_ci_runs_readmes_test_command_then_the_slow_tests():
  command = _readme_test_command()
  assert "python -m pytest tests " in command
  # It deselects the slow tests and prints its time (pytest's summary
  # line) and its slowest tests.
  assert '-m "not slow"' in command and "--durations=" in command
  ci = [line.strip() for line in
        (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
  assert command in ci
  slow = [line for line in ci
          if line.startswith("python -m pytest tests ") and "-m slow" in line]
  assert len(slow) == 1, ci
  assert ci.index(slow[0]) > ci.index(command)


def test_the_slow_marker_is_registered(pytestconfig):
  markers = pytestconfig.getini("markers")
  assert any(m.startswith("slow:") for m in markers), markers


def test_slow_is_marked_by_name():
  """`-m slow` selects by the marker's name: a misspelt one
  (`mark.Slow`, `mark.slowest`) would silently run in the
  fast suite."""
  for path in sorted(ROOT.glob("tests/**/*.py")):
    text = path.read_text(encoding="utf-8")
    for name in re.findall(r"pytest\.mark\.(\w*slow\w*)", text, re.I):
      assert name == "slow", (path, name)

"""Every relative link between the docs resolves.

The Markdown files the documented-commands test reads (README.md, BUILD.md,
docs/**/*.md, launch/README.md): each `[text](target)` or `![alt](target)`
whose target is not a URL must name a file or directory that exists,
relative to the linking file. A doc that moves (issue 48 moved the design
notes and the learning log) must take its links with it.
"""

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _docs() -> list[pathlib.Path]:
  return [ROOT / "README.md", ROOT / "BUILD.md",
          *sorted((ROOT / "docs").rglob("*.md")), ROOT / "launch/README.md"]


def _links(text: str) -> list[tuple[int, str]]:
  """(line, target) of each link outside fenced code blocks and spans."""
  out, fenced = [], False
  for number, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if fenced:
      continue
    line = re.sub(r"`[^`]*`", "", line)
    out.extend((number, m[1]) for m in _LINK.finditer(line))
  return out


def _broken(path: pathlib.Path) -> list[str]:
  where = path.relative_to(ROOT)
  out = []
  for number, target in _links(path.read_text(encoding="utf-8")):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
      continue  # A URL (https:, mailto:) or an anchor in the same page.
    file = target.split("#", 1)[0]
    if not (path.parent / file).exists():
      out.append(f"{where}:{number}: {target} (no such file)")
  return out


def test_the_link_finder_reads_links_and_skips_code():
  text = ("see [a](x.md) and ![p](img/p.png \"t\")\n"
          "`[not](a_link.md)`\n"
          "```\n[nor](this.md)\n```\n"
          "[web](https://example.com) [here](#top)\n")
  assert _links(text) == [(1, "x.md"), (1, "img/p.png"),
                          (6, "https://example.com"), (6, "#top")]


def test_a_missing_target_is_named(tmp_path, monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  doc = tmp_path / "doc.md"
  (tmp_path / "there.md").write_text("x")
  doc.write_text("[ok](there.md) [gone](moved/away.md#part)\n")
  assert _broken(doc) == ["doc.md:1: moved/away.md#part (no such file)"]


@pytest.mark.parametrize("path", _docs(),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
  assert path.exists(), path
  assert not _broken(path)

"""Wikitext to plain prose: what the corpus and annotation jobs read.

Drops what is not prose about the subject (reference sections, citations,
tables, infoboxes and other templates, media and category links) and keeps
the text of links and of inline templates (dates, conversions, `nowrap`).
Table cells and image captions can be kept instead (ORQA drops them), and
what is dropped of them is counted.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import mwparserfromhell
from mwparserfromhell import nodes


# Sections that hold no prose about the subject.
_DROPPED_SECTIONS = frozenset({
    "see also", "references", "external links", "further reading", "notes",
    "footnotes", "bibliography", "sources", "citations", "notes and references",
    "references and notes", "works cited",
})
# Tags whose content is not prose: citations, tables, formulas, code, media.
_DROPPED_TAGS = frozenset({
    "ref", "references", "gallery", "math", "chem", "ce", "timeline",
    "imagemap", "score", "graph", "mapframe", "maplink", "syntaxhighlight",
    "source", "pre", "templatedata", "noinclude", "hiero", "categorytree",
    "inputbox", "indicator",
})
# Tags that end a line of text.
_BREAK_TAGS = frozenset({"li", "dt", "dd", "hr", "p", "div", "blockquote"})
_DROPPED_LINK_NAMESPACES = frozenset({"file", "image", "category", "media"})
_IMAGE_NAMESPACES = frozenset({"file", "image"})
# The parameters of an image link that are not its caption.
_IMAGE_OPTION = re.compile(
    r"\s*(?:thumb(?:nail)?|frame(?:d|less)?|border|left|right|cent(?:er|re)|"
    r"none|upright|baseline|middle|sub|super|top|text-top|bottom|text-bottom|"
    r"\d*(?:x\d+)?\s*px|(?:alt|link|upright|page|lang|class|thumb(?:nail)?|"
    r"start|end|loop)\s*=.*)\s*", re.IGNORECASE | re.DOTALL)
_CELLS = ("td", "th")
# Interlanguage links of old dumps: [[de:Anarchismus]], [[zh-min-nan:...]].
_INTERLANGUAGE = re.compile(r"^(?:[a-z]{2,3}(?:-[a-z]+)*|simple)$")
# Templates whose text is part of the sentence; every other template
# (infoboxes, citations, navboxes, maintenance tags) is dropped.
_TEXT_TEMPLATES = frozenset({
    "nowrap", "nobr", "small", "smaller", "big", "em", "strong", "nobold",
    "noitalic", "sic", "not a typo", "lang",
})
_DATE_TEMPLATES = frozenset({
    "birth date", "death date", "birth date and age", "death date and age",
    "start date", "end date", "start date and age", "dts", "date",
})
_CONVERT_JOINERS = frozenset({"-", "–", "to", "and", "or", "x", "by", "+"})
_MONTHS = ("January", "February", "March", "April", "May", "June", "July",
           "August", "September", "October", "November", "December")


@dataclasses.dataclass(frozen=True)
class _Options:
  keep_tables: bool
  keep_captions: bool
  removed: collections.Counter


def clean_wikitext(wikitext: str, *, keep_tables: bool = False,
                   keep_captions: bool = False,
                   removed: collections.Counter | None = None) -> str:
  """Turns wikitext into plain prose.

  Drops templates (except a few inline ones: `lang`, `nowrap`, `convert`,
  date templates), references, file/image/category and interlanguage links,
  tables, formulas, comments, HTML tags (their text is kept), section
  headings, and the "See also", "References", "External links",
  "Further reading" and "Notes" sections. Keeps the text of wikilinks and
  external links. Each remaining line becomes a paragraph: whitespace inside
  it is collapsed and paragraphs are separated by a blank line.

  Args:
    wikitext: the `<text>` of a page.
    keep_tables: keep the text of table cells: a paragraph per row (and
      per table caption), its cells joined by " | ".
    keep_captions: keep the caption of each `[[File:...|...|caption]]`
      (not of galleries or infoboxes) as a paragraph of its own.
    removed: if given, counts what was dropped of these: "tables",
      "table_cells" and "captions".

  Returns:
    The plain text ("" when nothing is left).
  """
  parts: list[str] = []
  options = _Options(keep_tables, keep_captions,
                     collections.Counter() if removed is None else removed)
  _render(mwparserfromhell.parse(wikitext), parts, options, top_level=True)
  return _tidy("".join(parts))


def _render(wikicode, parts: list[str], options: _Options,
            top_level: bool = False) -> None:
  """Appends the plain text of `wikicode`'s nodes to `parts`."""
  dropping_level = None  # heading level of the section being dropped
  for node in wikicode.nodes:
    if isinstance(node, nodes.Heading):
      if dropping_level is not None and node.level > dropping_level:
        continue
      title = _tidy_line(_plain(node.title, options)).lower().rstrip(":")
      dropping_level = (
          node.level if top_level and title in _DROPPED_SECTIONS else None)
      # The heading text itself is dropped: a one-word "sentence" like
      # "History" is a poor query or context.
      parts.append("\n")
      continue
    if dropping_level is not None:
      continue
    if isinstance(node, nodes.Text):
      parts.append(node.value)
    elif isinstance(node, nodes.Wikilink):
      _render_wikilink(node, parts, options)
    elif isinstance(node, nodes.Tag):
      name = str(node.tag).strip().lower()
      if name == "table" and node.contents is not None:
        _render_table(node, parts, options)
        continue
      if name in _DROPPED_TAGS:
        continue
      if name in _BREAK_TAGS:
        parts.append("\n")
      elif name == "br":
        parts.append(" ")
      if node.contents is not None and not node.self_closing:
        _render(node.contents, parts, options)
        if name in _BREAK_TAGS:
          parts.append("\n")
    elif isinstance(node, nodes.HTMLEntity):
      parts.append(node.normalize())
    elif isinstance(node, nodes.ExternalLink):
      if node.title is not None:
        _render(node.title, parts, options)
    elif isinstance(node, nodes.Template):
      _render_template(node, parts, options)
    # Comments, arguments ({{{1}}}) and anything else carry no prose.


def _render_table(table, parts: list[str], options: _Options) -> None:
  """A paragraph per row (cells joined by " | "), or counts what it drops."""
  if not options.keep_tables:
    options.removed["tables"] += 1
    options.removed["table_cells"] += sum(
        str(tag.tag).strip().lower() in _CELLS
        for tag in table.contents.ifilter_tags())
    return
  rows = [[]]

  def collect(wikicode):
    for node in wikicode.ifilter_tags(recursive=False):
      name = str(node.tag).strip().lower()
      if node.contents is None:
        continue
      if name == "caption" or str(node).startswith("|+"):  # a caption row
        rows.extend([[mwparserfromhell.parse(
            str(node.contents).removeprefix("+"))], []])
      elif name in _CELLS:
        rows[-1].append(node.contents)
      elif name in ("tr", "tbody", "thead", "tfoot"):
        rows.append([])
        collect(node.contents)
        rows.append([])

  collect(table.contents)
  for row in rows:
    cells = [_tidy_line(_plain(cell, options)) for cell in row]
    parts.append("\n" + " | ".join(cell for cell in cells if cell) + "\n")


def _plain(wikicode, options: _Options) -> str:
  parts: list[str] = []
  _render(wikicode, parts, options)
  return "".join(parts)


def _render_wikilink(link, parts: list[str], options: _Options) -> None:
  target = str(link.title).strip()
  inline = target.startswith(":")  # [[:Category:X]] is an ordinary link
  namespace = target.lstrip(":").split(":", 1)[0].strip().lower() if (
      ":" in target) else ""
  if not inline and namespace in _DROPPED_LINK_NAMESPACES:
    if namespace in _IMAGE_NAMESPACES and link.text is not None:
      _render_caption(link.text, parts, options)
    return
  if link.text is not None:
    _render(link.text, parts, options)
  elif inline or not _INTERLANGUAGE.match(namespace):  # [[de:...]]: dropped
    parts.append(_plain(link.title, options).lstrip(":"))


def _render_caption(text, parts: list[str], options: _Options) -> None:
  """An image's caption (its last parameter that is not an option) as a
  paragraph, or counted as removed."""
  caption = []  # the nodes after the last "|" outside nested links
  for node in text.nodes:
    if isinstance(node, nodes.Text) and "|" in node.value:
      caption = [node.value.rsplit("|", 1)[1]]
    else:
      caption.append(str(node))
  caption = "".join(caption)
  if not caption.strip() or _IMAGE_OPTION.fullmatch(caption):
    return
  if not options.keep_captions:
    options.removed["captions"] += 1
    return
  parts.append("\n" + _plain(mwparserfromhell.parse(caption), options) +
               "\n")


def _param(template, name: str, options: _Options) -> str | None:
  return (_tidy_line(_plain(template.get(name).value, options))
          if template.has(name) else None)


def _render_template(template, parts: list[str], options: _Options) -> None:
  name = str(template.name).strip().lower().replace("_", " ")
  if name in _TEXT_TEMPLATES or name.startswith("lang-"):
    if text := _param(template, "2" if name == "lang" else "1", options):
      parts.append(text)
  elif name in ("convert", "cvt"):
    values = [_param(template, str(i), options) or "" for i in range(1, 5)]
    if values[1] in _CONVERT_JOINERS:
      parts.append(" ".join(v for v in values if v))
    elif values[0]:
      parts.append(" ".join(v for v in values[:2] if v))
  elif name in _DATE_TEMPLATES:
    if date := _render_date([_param(template, str(i), options)
                             for i in range(1, 4)]):
      parts.append(date)


def _render_date(values: list[str | None]) -> str | None:
  """{{birth date|1879|3|14}} -> "14 March 1879" (dates are salient spans)."""
  year, month, day = values
  if not year or not year.isdigit():
    return None
  if not month or not month.isdigit() or not 1 <= int(month) <= 12:
    return year
  if day and day.isdigit():
    return f"{int(day)} {_MONTHS[int(month) - 1]} {year}"
  return f"{_MONTHS[int(month) - 1]} {year}"


_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_SPACES = re.compile(r"\s+")
_EMPTY_PARENTHESES = re.compile(r"\(\s*(?:[,;:]\s*)*\)")
_LEADING_SEPARATOR = re.compile(r"\(\s*[,;:]\s*")
_TRAILING_SEPARATOR = re.compile(r"\s*[,;:]\s*\)")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"\s+([,;:!?]|\.(?!\.))")
_HAS_WORD = re.compile(r"\w")


def _tidy_line(line: str) -> str:
  line = _SPACES.sub(" ", line).strip()
  # Removed templates and references leave "()" and "( ; x)" behind, e.g.
  # "Anarchism ({{IPA}}) is" -> "Anarchism () is".
  line = _EMPTY_PARENTHESES.sub("", line)
  line = _LEADING_SEPARATOR.sub("(", line)
  line = _TRAILING_SEPARATOR.sub(")", line)
  line = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", line)
  return _SPACES.sub(" ", line).strip()


# mwparserfromhell leaves markup it cannot parse (an unbalanced quote inside a
# <ref>, a malformed table) as plain text; these remove what is left of it.
_LEFTOVER_REF = re.compile(
    r"<ref\b[^>]*?/>|<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_LEFTOVER_TAG = re.compile(
    r"</?(?:ref|references|br|small|big|sup|sub|span|div|center|font|b|i|u|s|"
    r"p|code|blockquote|nowiki|abbr|poem|onlyinclude|includeonly)\b[^>\n]*>",
    re.IGNORECASE)
_LEFTOVER_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_LEFTOVER_QUOTES = re.compile(r"'{2,}")
_TABLE_LINE = ("{|", "|", "!")


def _tidy(text: str) -> str:
  text = _LEFTOVER_REF.sub("", _MAGIC_WORD.sub("", text))
  text = _LEFTOVER_QUOTES.sub("", _LEFTOVER_TAG.sub("", text))
  text = _LEFTOVER_TEMPLATE.sub("", _LEFTOVER_TEMPLATE.sub("", text))
  paragraphs = []
  for line in text.split("\n"):
    if line.lstrip().startswith(_TABLE_LINE):
      continue  # a row of a table the parser did not recognise
    line = _tidy_line(line)
    # Lines without a single word character are leftovers of markup ("*",
    # "|}", "()").
    if _HAS_WORD.search(line):
      paragraphs.append(line)
  return "\n\n".join(paragraphs)

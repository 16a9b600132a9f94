"""Documents of the knowledge corpus Z: Wikipedia dumps, JSONL, sentences.

Readers of the corpus formats; the first three yield `Document(title, text)`
with plain text whose paragraphs are separated by blank lines:

- `iter_wikipedia_dump`: a MediaWiki `*-pages-articles*.xml(.bz2)` export,
  streamed with `xml.etree.ElementTree.iterparse` (memory stays flat on the
  full 20 GB dump) and cleaned with mwparserfromhell.
- `iter_jsonl_documents`: one `{"title": str, "text": str}` object a line
  (optionally .gz or .bz2), for a user's own corpus.
- `iter_documents`: picks one of the two from the file name.
- `iter_dpr_passages`: DPR's `psgs_w100.tsv`, `(id, title, text)` a line.

Bad input never stops a reader silently: every record kept or skipped is
counted by reason in a `Report`, and the first few examples of each reason
are logged with the file and the record (line number or page title); the
title of every skipped article is kept (`Report.dropped`). A dump
that is malformed at the XML level (truncated download, corrupt bz2 stream)
cannot be resynchronised by an XML parser, so it raises `CorruptDumpError`
naming the file, the position and the last good page; pass
`allow_truncated=True` to keep what was read before the damage instead (it is
counted as `truncated_file`). A page that is well-formed XML but lacks its
title, namespace or text is skipped and counted as `malformed_page`.

`split_sentences` is a rule-based sentence splitter returning character
offsets; `realm_jax.data.blocks` packs those sentences into blocks.
"""

from __future__ import annotations

import bz2
import collections
import csv
import dataclasses
import functools
import gzip
import hashlib
import itertools
import json
import multiprocessing.pool
import os
import re
from typing import Any, IO, Iterator
import xml.etree.ElementTree as ET

from absl import logging

from realm_jax.core import io_utils
from realm_jax.data import wikitext as wikitext_lib

# The embedded default corpus: a real enwiki slice inside the gensim wheel.
_GENSIM_DUMP = os.path.join(
    "test", "test_data",
    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")

# Wikipedia titles are at most 255 UTF-8 bytes; anything longer is not a
# title (a JSONL file with swapped fields, for example).
DEFAULT_MAX_TITLE_CHARS = 256
# The longest English Wikipedia articles have ~1.2M characters of wikitext;
# beyond 2M it is a dump artefact (or a log file pasted into a JSONL corpus)
# and mwparserfromhell would spend minutes and gigabytes on it.
DEFAULT_MAX_ARTICLE_CHARS = 2_000_000


# -----------------------------------------------------------------------------
# Documents and the report.
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
  """One article of the knowledge corpus.

  Attributes:
    title: article title (used in the retriever input and `title_hash`).
    text: plain text; paragraphs are separated by blank lines.
  """
  title: str
  text: str


# Skips that are the normal content of a dump (not bad input): logged at
# INFO level rather than as warnings.
_FILTER_REASONS = frozenset({
    "redirect", "non_article_namespace", "list_or_index_page",
    "disambiguation",
})


class CorruptDumpError(ValueError):
  """A dump or corpus file is malformed beyond record-level recovery."""


@dataclasses.dataclass
class Report:
  """Counts of the records a corpus job kept, skipped and changed, by reason.

  `skip` and `note` log the first `max_examples` occurrences of each reason
  with where they happened (file and record), so a user can find them; every
  skipped article's title is kept in `dropped` (the store's dropped.jsonl).

  Attributes:
    kept: counts of kept items ("documents", "blocks", "sentences", ...).
    skipped: counts of skipped records by reason.
    notes: counts of records kept but changed, by reason (a sentence split
      across blocks, a block truncated to the budget, the tables or
      captions of an article removed, ...).
    removed: totals of what was removed from kept articles ("tables",
      "table_cells", "captions"; see `wikitext.clean_wikitext`).
    examples: the first `max_examples` locations of each skip or note reason.
    dropped: (reason, title) of every skipped record that has a title (not
      redirects or other namespaces' pages: they are not articles), in the
      order they were skipped.
    max_examples: how many examples of each reason are logged and kept.
  """
  kept: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  skipped: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  notes: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  removed: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  dropped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  max_examples: int = 3

  def keep(self, what: str = "documents", n: int = 1) -> None:
    """Counts `n` kept items of kind `what`."""
    self.kept[what] += n

  def skip(self, reason: str, where: str, detail: str = "",
           title: str | None = None) -> None:
    """Counts one skipped record and logs it if it is among the first few;
    keeps the `title` of a skipped article."""
    self.skipped[reason] += 1
    if title is not None:
      self.dropped.append((reason, title))
    self._example(reason, where, detail, self.skipped[reason],
                  logging.INFO if reason in _FILTER_REASONS else
                  logging.WARNING, "skipped")

  def note(self, reason: str, where: str, detail: str = "") -> None:
    """Counts one record that was kept but changed (split, truncated, ...)."""
    self.notes[reason] += 1
    self._example(reason, where, detail, self.notes[reason], logging.INFO,
                  "note")

  def _example(self, reason, where, detail, count, level, kind) -> None:
    if count > self.max_examples:
      return
    message = f"{where}" + (f" ({detail})" if detail else "")
    self.examples.setdefault(reason, []).append(message)
    logging.log(level, "%s %s: %s", kind, reason, message)
    if count == self.max_examples:
      logging.log(level, "further '%s' records are only counted", reason)

  def count_removed(self, where: str, removed: dict[str, int]) -> None:
    """Counts the tables and captions removed from one kept article."""
    self.removed.update(removed)
    if removed.get("tables"):
      self.note("tables_removed", where, f"{removed['tables']} tables, "
                f"{removed.get('table_cells', 0)} cells")
    if removed.get("captions"):
      self.note("captions_removed", where, f"{removed['captions']} captions")

  def summary(self, dropped: bool = False) -> dict[str, Any]:
    """JSON-serialisable counts and examples (and `dropped` if asked: it
    grows with the corpus)."""
    summary = {
        "kept": dict(sorted(self.kept.items())),
        "skipped": dict(sorted(self.skipped.items())),
        "notes": dict(sorted(self.notes.items())),
        "removed": dict(sorted(self.removed.items())),
        "examples": {k: list(v) for k, v in sorted(self.examples.items())},
    }
    return dict(summary, dropped=self.dropped) if dropped else summary

  def merge(self, summary: dict[str, Any]) -> None:
    """Adds another report's `summary(dropped=True)` (merged in document
    order, the examples are those a sequential pass would keep)."""
    for name in ("kept", "skipped", "notes", "removed"):
      getattr(self, name).update(summary.get(name, {}))
    self.dropped.extend(tuple(item) for item in summary.get("dropped", ()))
    for reason, examples in summary["examples"].items():
      kept = self.examples.setdefault(reason, [])
      kept += examples[:self.max_examples - len(kept)]

  def log_summary(self, dropped_path: str = "dropped.jsonl") -> None:
    """Logs the counts, and a line per skip reason saying where the titles
    are."""
    logging.info("corpus report: %s", json.dumps(self.summary()))
    listed = collections.Counter(reason for reason, _ in self.dropped)
    for reason, count in sorted(self.skipped.items()):
      logging.info("skipped %d records as '%s': %s", count, reason,
                   f"every title is in {dropped_path}" if listed[reason]
                   else "counted only (not articles)")
    if self.removed:
      logging.info(
          "removed from kept articles: %d tables (%d cells) of %d articles "
          "and %d image captions of %d articles", self.removed["tables"],
          self.removed["table_cells"], self.notes["tables_removed"],
          self.removed["captions"], self.notes["captions_removed"])


# -----------------------------------------------------------------------------
# Wikipedia dump.
# -----------------------------------------------------------------------------


def default_wikipedia_dump() -> str:
  """Path of the enwiki dump slice shipped in the gensim wheel (the default
  corpus), found without importing gensim (slow)."""
  return io_utils.package_file(
      "gensim", _GENSIM_DUMP, install="install gensim>=4.3 (`pip install "
      "gensim`) or pass the path of a *-pages-articles*.xml.bz2 dump or a "
      "JSONL file")


_TITLE_PREFIXES_SKIPPED = ("list of ", "index of ", "outline of ")
_DISAMBIGUATION_TEMPLATE = re.compile(
    r"\{\{\s*(?:disambig(?:uation)?|dab|hndis|geodis)\s*[|}]", re.IGNORECASE)


def _local(tag: str) -> str:
  # Dumps carry a versioned namespace ({http://www.mediawiki.org/xml/
  # export-0.10/}page); match on the local name so every version works.
  return tag.rsplit("}", 1)[-1]


def _open_binary(path: str) -> IO[bytes]:
  if path.endswith(".bz2"):
    return bz2.open(path, "rb")
  if path.endswith(".gz"):
    return gzip.open(path, "rb")
  return open(path, "rb")


def iter_wikipedia_pages(
    path: str,
    report: Report,
    *,
    max_article_chars: int = DEFAULT_MAX_ARTICLE_CHARS,
    max_title_chars: int = DEFAULT_MAX_TITLE_CHARS,
    allow_truncated: bool = False,
    keep_lists: bool = False,
    keep_disambiguation: bool = False,
) -> Iterator[Document]:
  """Streams the article pages of a dump, with their raw wikitext.

  Keeps main-namespace pages that are not redirects, lists, indexes, outlines
  or disambiguation pages (as ORQA); yields `Document(title, wikitext)` in
  dump order (see `clean_wikitext`).

  Args:
    path: a `*-pages-articles*.xml` file, optionally `.bz2` or `.gz`.
    report: receives the skip counts.
    max_article_chars: longer wikitext is skipped as `enormous_article`.
    max_title_chars: longer titles are skipped as `title_too_long`.
    allow_truncated: on an XML or compression error, stop and count
      `truncated_file` instead of raising `CorruptDumpError`.
    keep_lists: keep "List of", "Index of" and "Outline of" pages
      (otherwise skipped as `list_or_index_page`).
    keep_disambiguation: keep disambiguation pages (otherwise skipped as
      `disambiguation`).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"Wikipedia dump {path} does not exist.")
  last_title = None
  with _open_binary(path) as stream:
    try:
      for page in _pages(stream):
        title = page.get("title")
        where = f"{path}: page '{title}'" if title else (
            f"{path}: page after '{last_title}'")
        if title is None or page.get("ns") is None or page.get("bad_ns"):
          report.skip("malformed_page", where, "missing title or namespace")
          continue
        last_title = title
        if document := _page_document(
            page, where, report, keep_lists=keep_lists,
            keep_disambiguation=keep_disambiguation,
            max_article_chars=max_article_chars,
            max_title_chars=max_title_chars):
          yield document
    except (ET.ParseError, EOFError, OSError) as e:
      _damaged_dump(e, path, last_title, report,
                    allow_truncated=allow_truncated)


def _pages(stream: IO[bytes]) -> Iterator[dict[str, Any]]:
  """The `_read_page`s of a dump's <page> elements, in dump order."""
  root = None
  for event, element in ET.iterparse(stream, events=("start", "end")):
    if root is None:
      root = element
    if event != "end" or _local(element.tag) != "page":
      continue
    page = _read_page(element)
    # Drop the finished page from the tree: without this the root keeps
    # every page and memory grows with the dump.
    element.clear()
    root.clear()
    yield page


def _page_document(page: dict[str, Any], where: str, report: Report, *,
                   keep_lists: bool, keep_disambiguation: bool,
                   max_article_chars: int, max_title_chars: int
                   ) -> Document | None:
  """The `Document` of a well-formed page (`_read_page`, with a title and
  a namespace), or None if it is skipped (and counted in `report`); see
  `iter_wikipedia_pages`."""
  title = page["title"]
  if page["ns"] != 0:
    report.skip("non_article_namespace", where, f"ns={page['ns']}")
    return None
  text = page.get("text")
  if page.get("redirect") or (
      text and text.lstrip()[:9].lower() == "#redirect"):
    report.skip("redirect", where)
    return None
  lowered = title.lower()
  if not keep_lists and lowered.startswith(_TITLE_PREFIXES_SKIPPED):
    report.skip("list_or_index_page", where, title=title)
    return None
  if not keep_disambiguation and (
      lowered.endswith("(disambiguation)") or
      (text and _DISAMBIGUATION_TEMPLATE.search(text))):
    report.skip("disambiguation", where, title=title)
    return None
  return _check_document(
      title, text, where, report, max_article_chars=max_article_chars,
      max_title_chars=max_title_chars)


def _damaged_dump(error: Exception, path: str, last_title: str | None,
                  report: Report, *, allow_truncated: bool) -> None:
  """An XML or compression `error` reading the dump at `path`: counted as
  `truncated_file` if `allow_truncated`.

  Raises:
    CorruptDumpError: unless `allow_truncated`.
  """
  position = getattr(error, "position", None)
  at = f" at line {position[0]}, column {position[1]}" if position else ""
  message = (
      f"{path}: malformed dump{at} after page '{last_title}': {error}. The "
      "file is truncated or corrupt; re-download it and check its "
      "sha1 against the dump's *-sha1sums.txt")
  if not allow_truncated:
    raise CorruptDumpError(
        message + ", or pass allow_truncated=True to keep the pages "
        "before the damage.") from error
  report.skip("truncated_file", path, message)


def _read_page(page: ET.Element) -> dict[str, Any]:
  fields: dict[str, Any] = {}
  for child in page.iter():
    name = _local(child.tag)
    if name == "title" and "title" not in fields:
      fields["title"] = (child.text or "").strip() or None
    elif name == "ns" and "ns" not in fields:
      try:
        fields["ns"] = int((child.text or "").strip())
      except ValueError:
        fields["ns"], fields["bad_ns"] = -1, True
    elif name == "redirect":
      fields["redirect"] = True
    elif name == "text":
      # The last <text> is the newest revision in a multi-revision export.
      fields["text"] = child.text
  return fields


def _check_document(title, text, where, report, *, max_article_chars,
                    max_title_chars) -> Document | None:
  """Applies the checks shared by every reader; counts what it rejects."""
  if len(title) > max_title_chars:
    report.skip("title_too_long", where,
                f"{len(title)} > {max_title_chars} characters", title)
    return None
  if text is None or not text.strip():
    report.skip("empty_article", where, title=title)
    return None
  if len(text) > max_article_chars:
    report.skip("enormous_article", where,
                f"{len(text)} > {max_article_chars} characters", title)
    return None
  return Document(title=title, text=text)


def _clean(wikitext: str, options: dict[str, bool]
           ) -> tuple[str, collections.Counter]:
  removed = collections.Counter()
  return wikitext_lib.clean_wikitext(wikitext, removed=removed,
                                     **options), removed


def _article(title: str, text: str, removed: dict[str, int], report: Report,
             where: str) -> Document | None:
  if not text:
    report.skip("empty_article", where, "no text left after removing markup",
                title)
    return None
  report.keep("articles_read")
  report.count_removed(where, removed)
  return Document(title=title, text=text)


def clean_page(title: str, wikitext: str, report: Report, where: str,
               **options: bool) -> Document | None:
  """A page's article once its markup is removed (`clean_wikitext` with
  `options`: keep_tables, keep_captions), or None if no text is left
  (`empty_article`); counts in `report` what it removed."""
  return _article(title, *_clean(wikitext, options), report, where)


def iter_wikipedia_dump(
    path: str,
    report: Report,
    *,
    keep_tables: bool = False,
    keep_captions: bool = False,
    pool: multiprocessing.pool.Pool | None = None,
    window: int = 256,
    **page_options,
) -> Iterator[Document]:
  """Streams the cleaned articles of a Wikipedia dump, in dump order.

  Articles that are empty once cleaned are skipped as `empty_article`.

  Args:
    path: the dump.
    report: receives the counts.
    keep_tables, keep_captions: see `wikitext.clean_wikitext`.
    pool: a process pool that runs `clean_wikitext` (the slowest step; about
      2 MB of wikitext per second per core), or None to clean in this
      process. Create it with the "spawn" start method when TensorFlow is
      loaded in this process.
    window: pages per batch handed to the pool. One batch is cleaned while
      the previous one is consumed, so memory stays bounded however fast
      the consumer is.
    **page_options: see `iter_wikipedia_pages` (max_article_chars,
      max_title_chars, allow_truncated, keep_lists, keep_disambiguation).
  """
  pages = iter_wikipedia_pages(path, report, **page_options)
  clean = functools.partial(_clean, options=dict(
      keep_tables=keep_tables, keep_captions=keep_captions))

  def cleaned(batch, results):
    for page, result in zip(batch, results):
      if document := _article(page.title, *result, report,
                              f"{path}: page '{page.title}'"):
        yield document

  if pool is None:
    for page in pages:
      yield from cleaned([page], [clean(page.text)])
    return
  # Pages are read here (so dump errors surface in this process) and cleaned
  # by the pool one window ahead of the consumer.
  in_flight = None
  while True:
    batch = list(itertools.islice(pages, window))
    submitted = batch and (batch, pool.map_async(
        clean, [page.text for page in batch], chunksize=4))
    if in_flight:
      yield from cleaned(in_flight[0], in_flight[1].get())
    if not submitted:
      return
    in_flight = submitted


# -----------------------------------------------------------------------------
# JSONL documents and dispatch.
# -----------------------------------------------------------------------------


def iter_jsonl_documents(
    path: str,
    report: Report,
    *,
    max_article_chars: int = DEFAULT_MAX_ARTICLE_CHARS,
    max_title_chars: int = DEFAULT_MAX_TITLE_CHARS,
) -> Iterator[Document]:
  """Streams `{"title": str, "text": str}` lines of a JSONL file.

  Other keys are ignored. Lines that are not valid UTF-8, not JSON, not an
  object with string "title" and "text", or whose title is empty, are skipped
  and counted (`invalid_utf8`, `bad_json`, `bad_record`, `empty_title`) with
  their line number; so are byte-identical repeats of an earlier line
  (`duplicate_article`, naming that line) and empty, enormous and
  too-long-titled documents (see `iter_wikipedia_pages`). The text is used
  as is: blank lines separate paragraphs. `path` may be compressed (`.gz`,
  `.bz2`).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"JSONL corpus {path} does not exist.")
  seen = {}  # 8-byte digest of a line -> its first line number.
  with _open_binary(path) as f:
    for line_number, raw in enumerate(f, start=1):
      where = f"{path}:{line_number}"
      if not raw.strip():
        continue
      if (record := _jsonl_record(raw, where, report)) is None:
        continue
      title, text = record
      first = seen.setdefault(hashlib.blake2b(raw.strip(),
                                              digest_size=8).digest(),
                              line_number)
      if first != line_number:  # The same article twice adds nothing.
        report.skip("duplicate_article", where,
                    f"'{title[:80]}': the same bytes as line {first}",
                    title=title)
        continue
      if document := _check_document(
          title, text, f"{where} '{title[:80]}'", report,
          max_article_chars=max_article_chars, max_title_chars=max_title_chars):
        report.keep("articles_read")
        yield document


def _jsonl_record(raw: bytes, where: str,
                  report: Report) -> tuple[str, str] | None:
  """(title, text) of a JSONL line, or None if it is skipped (and counted in
  `report`); see `iter_jsonl_documents`."""
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    report.skip("invalid_utf8", where, str(e))
    return None
  try:
    record = json.loads(line)  # Input corpus, not job output.
  except json.JSONDecodeError as e:
    report.skip("bad_json", where, str(e))
    return None
  if not (isinstance(record, dict) and isinstance(record.get("title"), str)
          and isinstance(record.get("text"), str)):
    report.skip("bad_record", where, 'expected {"title": str, "text": str}')
    return None
  title, text = record["title"].strip(), record["text"]
  try:
    # JSON escapes can encode lone surrogates, which are not text.
    title.encode("utf-8")
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    report.skip("invalid_utf8", where, str(e))
    return None
  if not title:
    report.skip("empty_title", where)
    return None
  return title, text


DPR_HEADER = ("id", "text", "title")


def iter_dpr_passages(path: str) -> Iterator[tuple[str, str, str]]:
  """Streams `(id, title, text)` of DPR's passage file, in file order.

  `psgs_w100.tsv` (optionally .gz/.bz2) has the header `id, text, title`
  and one passage a line, tab-separated, quoted as Python's csv module
  writes (a field with quotes is quoted, its quotes doubled). No passage is
  skipped, so passage i is line i + 2: a malformed line (wrong number of
  fields, empty id or text, invalid UTF-8) raises `CorruptDumpError` naming
  the file and the line; so does a passage id used before (gold passages
  are matched by id), naming both lines.
  """
  seen = _SeenIds()
  for line, (passage_id, text, title) in _dpr_rows(path):
    if seen.add(passage_id):
      first = next(n for n, row in _dpr_rows(path) if row[0] == passage_id)
      raise CorruptDumpError(
          f"{path}:{line}: passage id {passage_id!r} is also the id of line "
          f"{first}; ids must be unique (gold passages are matched by id). "
          "Fix or remove one of the two lines.")
    yield passage_id, title, text


class _SeenIds:
  """The passage ids met so far: decimal ids (DPR's: 1..21M) as bits,
  others in a set."""

  def __init__(self):
    self._bits, self._other = bytearray(), set()

  def add(self, passage_id: str) -> bool:
    """Adds `passage_id`; whether it was there already."""
    if not (passage_id.isdigit() and passage_id.isascii() and (
        passage_id == "0" or passage_id[0] != "0") and len(passage_id) < 12):
      seen = passage_id in self._other
      self._other.add(passage_id)
      return seen
    n = int(passage_id)
    if n >> 3 >= len(self._bits):
      self._bits.extend(bytes(max(n >> 3, 2 * len(self._bits)) + 1
                              - len(self._bits)))
    seen = bool(self._bits[n >> 3] >> (n & 7) & 1)
    self._bits[n >> 3] |= 1 << (n & 7)
    return seen


def _dpr_rows(path: str) -> Iterator[tuple[int, list[str]]]:
  """(line, [id, text, title]) of each passage of a DPR passage file."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"DPR passage file {path} does not exist.")

  def lines(f):
    for number, raw in enumerate(f, start=1):
      try:
        yield raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise CorruptDumpError(f"{path}:{number}: invalid UTF-8 ({e}); the "
                               "file is corrupt or not UTF-8.") from e

  with _open_binary(path) as f:
    reader = csv.reader(lines(f), delimiter="\t")
    line = 1  # where the next row starts (a quoted field may span lines)
    try:
      for number, row in enumerate(reader):
        if not number and tuple(row) != DPR_HEADER:
          raise CorruptDumpError(
              f"{path}:1: the header is {row[:5]}, not the tab-separated "
              f"{list(DPR_HEADER)} of DPR's psgs_w100.tsv; pass a DPR "
              "passage file or another input format.")
        if number and (len(row) != 3 or not row[0].strip() or
                       not row[1].strip()):
          raise CorruptDumpError(
              f"{path}:{line}: expected 3 tab-separated fields (id, text, "
              "title) with a non-empty id and text, got "
              f"{[field[:40] for field in row[:5]]}; fix or remove the line.")
        if number:
          yield line, row
        line = reader.line_num + 1
    except csv.Error as e:
      raise CorruptDumpError(
          f"{path}:{line}: not a DPR passage line ({e}); the file is "
          "corrupt or not DPR's psgs_w100.tsv.") from e


def _uncompressed_name(path: str) -> str:
  return os.path.basename(path).lower().removesuffix(".bz2").removesuffix(
      ".gz")


def is_wikipedia_dump(path: str) -> bool:
  """Whether `path` names a MediaWiki XML export (by its file name)."""
  name = _uncompressed_name(path)
  return name.endswith(".xml") or ".xml-p" in name


def iter_documents(path: str, report: Report, **kwargs) -> Iterator[Document]:
  """Streams documents from a Wikipedia dump or a JSONL file.

  `path` is `*.xml`, `*.xml.bz2`, `*.xml-p<range>.bz2` (a dump) or
  `*.jsonl`, `*.json`, optionally `.gz`/`.bz2` compressed; `kwargs` go to
  `iter_wikipedia_dump` or `iter_jsonl_documents`.
  """
  if is_wikipedia_dump(path):
    return iter_wikipedia_dump(path, report, **kwargs)
  if _uncompressed_name(path).endswith((".jsonl", ".json", ".ndjson")):
    for dump_only in ("allow_truncated", "pool", "window", "keep_lists",
                      "keep_disambiguation", "keep_tables", "keep_captions"):
      kwargs.pop(dump_only, None)
    return iter_jsonl_documents(path, report, **kwargs)
  raise ValueError(
      f"{path}: unknown corpus format; expected a Wikipedia dump "
      "(*-pages-articles*.xml[.bz2]) or JSONL lines {\"title\", \"text\"} "
      "(*.jsonl[.gz]).")


# -----------------------------------------------------------------------------
# Sentence splitting.
# -----------------------------------------------------------------------------

# Abbreviations that are never the end of a sentence: titles before names and
# Latin abbreviations before more text.
_NEVER_FINAL = frozenset({
    "mr", "mrs", "ms", "messrs", "dr", "prof", "st", "mt", "gen", "col", "lt",
    "maj", "capt", "cpt", "sgt", "cmdr", "adm", "gov", "sen", "rep", "rev",
    "hon", "pres", "fr", "msgr", "mme", "mlle", "e.g", "i.e", "cf", "vs",
    "viz", "approx", "ca", "incl", "esp", "al", "pp", "nos", "nr", "ibid",
})
# Abbreviations that are also words or often end a sentence ("... in 300
# BC. The ...", "... Martin Luther King Jr. He ..."): they end one only when
# a typical sentence opener follows.
_MAYBE_FINAL = frozenset({
    "etc", "inc", "ltd", "co", "corp", "plc", "bc", "ad", "bce", "ce", "am",
    "pm", "jr", "sr", "no", "vol", "vols", "fig", "figs", "ed", "eds", "ch",
    "sec", "art", "op", "est", "dept", "univ", "assn", "bros", "lit", "resp",
    "var", "subsp", "sp", "spp", "ft", "jan", "feb", "mar", "apr", "jun",
    "jul", "aug", "sep", "sept", "oct", "nov", "dec",
})
_SENTENCE_OPENERS = frozenset({
    "a", "an", "the", "he", "she", "it", "they", "we", "i", "you", "this",
    "that", "these", "those", "there", "his", "her", "its", "their", "our",
    "in", "on", "at", "after", "before", "during", "when", "while", "as",
    "however", "but", "and", "although", "though", "since", "if", "because",
    "from", "for", "by", "with", "some", "many", "most", "one", "both",
    "each", "all", "other", "another", "such", "then", "thus", "today",
    "later", "also", "several", "following", "despite", "according", "under",
    "until", "what", "who", "which", "where", "why", "how",
})
# A run of terminal punctuation, closing quotes/brackets, then whitespace.
_CANDIDATE = re.compile(r"([.!?…]+)([\"'”’»)\]]*)(?=\s)")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_WORD_BEFORE = re.compile(r"[\w.'’-]*$")
_NEXT_WORD = re.compile(r"\s*[\"'“‘«(\[]*(\w[\w'’-]*)")


def split_sentences(text: str) -> list[tuple[int, int]]:
  """Splits text into sentences by rules.

  A sentence ends at `.`, `!`, `?` or `…` (plus closing quotes or brackets)
  followed by whitespace and a word that does not start in lower case, except
  after an abbreviation ("e.g.", "Dr.", "No."), an initial ("J. R. R.
  Tolkien") or an acronym with inner periods ("U.S."), which end a sentence
  only before a typical sentence opener ("The", "He", "In", ...). Decimals
  never split (no whitespace after the point). A blank line (paragraph break)
  always ends a sentence.

  Args:
    text: plain text.

  Returns:
    `(start, end)` character offsets, in order, trimmed of surrounding
    whitespace; together they cover every non-whitespace character once.
  """
  spans: list[tuple[int, int]] = []
  paragraph_start = 0
  for match in _PARAGRAPH_BREAK.finditer(text):
    _split_paragraph(text, paragraph_start, match.start(), spans)
    paragraph_start = match.end()
  _split_paragraph(text, paragraph_start, len(text), spans)
  return spans


def _split_paragraph(text: str, start: int, end: int,
                     spans: list[tuple[int, int]]) -> None:
  sentence_start = start
  for match in _CANDIDATE.finditer(text, start, end):
    if _is_boundary(text, match, end):
      _append_trimmed(text, sentence_start, match.end(), spans)
      sentence_start = match.end()
  _append_trimmed(text, sentence_start, end, spans)


def _append_trimmed(text, start, end, spans) -> None:
  while start < end and text[start].isspace():
    start += 1
  while end > start and text[end - 1].isspace():
    end -= 1
  if start < end:
    spans.append((start, end))


def _is_boundary(text: str, match: re.Match, end: int) -> bool:
  next_word = _NEXT_WORD.match(text, match.end(), end)
  if next_word is None:
    # Only punctuation or nothing follows: end the sentence here.
    return True
  first = next_word.group(1)
  if first[0].islower():
    return False
  if match.group(1) != ".":
    return True
  # The look-behind window is bounded: searching from 0 would be quadratic.
  word = _WORD_BEFORE.search(
      text, max(0, match.start(1) - 64), match.start(1)).group(0)
  word = word.lstrip("'’-").lower()
  if not word or word[-1:] in "'’-":
    return True
  opener = first.lower() in _SENTENCE_OPENERS
  if word in _NEVER_FINAL:
    return False
  if word in _MAYBE_FINAL:
    return opener
  letters = word.replace(".", "")
  # Initials ("J.", "R.R.") and acronyms with inner periods ("U.S.",
  # "U.S.S.R."): a single letter per dot.
  if "." in word or len(word) == 1:
    if all(len(piece) == 1 for piece in word.split(".")) and letters.isalpha():
      return opener
  return True

"""Tests of realm_jax.data.wikipedia: dump/JSONL readers, cleaning, splitter."""

import bz2
import collections
import csv
import gzip
import json
import multiprocessing
import os
import re
import tracemalloc
from xml.sax import saxutils

import pytest

from realm_jax.data import wikipedia
from realm_jax.data import wikitext as wikitext_lib

_NS10 = "http://www.mediawiki.org/xml/export-0.10/"


def _page(title, text, ns=0, redirect=None, page_id=1):
  redirect_xml = (f'<redirect title="{saxutils.escape(redirect)}" />'
                  if redirect else "")
  text_xml = ("<text />" if text is None else
              f'<text xml:space="preserve">{saxutils.escape(text)}</text>')
  return (f"<page><title>{saxutils.escape(title)}</title><ns>{ns}</ns>"
          f"<id>{page_id}</id>{redirect_xml}<revision><id>7</id>"
          f"<model>wikitext</model>{text_xml}</revision></page>\n")


def _dump(pages, namespace=_NS10):
  xmlns = f' xmlns="{namespace}"' if namespace else ""
  return (f'<mediawiki{xmlns} version="0.10" xml:lang="en"><siteinfo>'
          "<sitename>Wikipedia</sitename></siteinfo>\n" + "".join(pages) +
          "</mediawiki>\n")


def _write_bz2(path, content):
  with bz2.open(path, "wt", encoding="utf-8") as f:
    f.write(content)
  return str(path)


_ARTICLE = ("'''Aardvark''' is a [[mammal]] native to [[Africa]].<ref>Smith "
            "2001.</ref> It eats [[ant|ants]].\n\n== References ==\n* Smith.")


def _filter_pages():
  return [
      _page("Aardvark", _ARTICLE),
      _page("Redirected", "Some text", redirect="Aardvark"),
      _page("Old redirect", "#redirect [[Aardvark]]"),
      _page("Upper redirect", "  #REDIRECT[[Aardvark]]"),
      _page("List of mammals", "Mammals: the aardvark and others."),
      _page("Index of biology articles", "Biology is a science."),
      _page("Outline of zoology", "Zoology is a science."),
      _page("Mercury (disambiguation)", "Mercury may be a planet."),
      _page("Mercury", "'''Mercury''' may refer to:\n{{disambiguation}}"),
      _page("Talk:Aardvark", "Talk page text.", ns=1),
      _page("Category:Mammals", "Category text.", ns=14),
      _page("Blank", None),
      _page("Only markup", "{{Infobox}}\n[[Category:Empty]]"),
      _page("Ant", "An '''ant''' is an insect. Ants live in colonies."),
  ]


def test_dump_filters_and_counts(tmp_path):
  path = _write_bz2(tmp_path / "enwiki-pages-articles.xml.bz2",
                    _dump(_filter_pages()))
  report = wikipedia.Report()
  documents = list(wikipedia.iter_wikipedia_dump(path, report))
  assert [d.title for d in documents] == ["Aardvark", "Ant"]
  assert documents[0].text == (
      "Aardvark is a mammal native to Africa. It eats ants.")
  assert documents[1].text == "An ant is an insect. Ants live in colonies."
  assert report.skipped == {
      "redirect": 3, "list_or_index_page": 3, "disambiguation": 2,
      "non_article_namespace": 2, "empty_article": 2}
  assert report.kept["articles_read"] == 2
  # Examples name the file and the page.
  assert any(path in e and "'Talk:Aardvark'" in e
             for e in report.examples["non_article_namespace"])
  summary = report.summary()
  assert json.loads(json.dumps(summary)) == summary
  # Every skipped article is listed by title, not redirects or other
  # namespaces' pages (not articles).
  assert report.dropped == [
      ("list_or_index_page", "List of mammals"),
      ("list_or_index_page", "Index of biology articles"),
      ("list_or_index_page", "Outline of zoology"),
      ("disambiguation", "Mercury (disambiguation)"),
      ("disambiguation", "Mercury"), ("empty_article", "Blank"),
      ("empty_article", "Only markup")]
  assert json.loads(json.dumps(report.summary(dropped=True)))["dropped"] == [
      list(item) for item in report.dropped]


@pytest.mark.parametrize("option, kept", [
    ("keep_lists", ["List of mammals", "Index of biology articles",
                    "Outline of zoology"]),
    ("keep_disambiguation", ["Mercury (disambiguation)", "Mercury"]),
])
def test_dump_keep_options(tmp_path, option, kept):
  """Each option keeps exactly the pages it names, in dump order."""
  path = _write_bz2(tmp_path / "dump.xml.bz2", _dump(_filter_pages()))
  report = wikipedia.Report()
  documents = list(wikipedia.iter_wikipedia_dump(path, report,
                                                 **{option: True}))
  order = ["Aardvark", "List of mammals", "Index of biology articles",
           "Outline of zoology", "Mercury (disambiguation)", "Mercury",
           "Ant"]
  assert [d.title for d in documents] == [
      t for t in order if t in kept + ["Aardvark", "Ant"]]
  assert sum(report.skipped.values()) == len(_filter_pages()) - len(documents)
  assert all(title not in kept for _, title in report.dropped)


@pytest.mark.parametrize("namespace", [None, _NS10,
                                       "http://www.mediawiki.org/xml/"
                                       "export-0.11/"])
def test_dump_is_namespace_agnostic(tmp_path, namespace):
  path = tmp_path / "dump.xml"
  path.write_text(_dump([_page("Ant", "Ants are insects.")], namespace))
  documents = list(wikipedia.iter_wikipedia_dump(str(path),
                                                 wikipedia.Report()))
  assert documents == [wikipedia.Document("Ant", "Ants are insects.")]


def test_dump_size_limits(tmp_path):
  path = _write_bz2(tmp_path / "dump.xml.bz2", _dump([
      _page("Big", "word " * 100),
      _page("T" * 30, "A short text."),
      _page("Fine", "A short text."),
  ]))
  report = wikipedia.Report()
  documents = list(wikipedia.iter_wikipedia_dump(
      path, report, max_article_chars=200, max_title_chars=20))
  assert [d.title for d in documents] == ["Fine"]
  assert report.skipped == {"enormous_article": 1, "title_too_long": 1}


def test_malformed_page_is_skipped(tmp_path):
  no_title = "<page><ns>0</ns><revision><text>Orphan.</text></revision></page>"
  bad_ns = ("<page><title>Bad</title><ns>zero</ns><revision><text>Text."
            "</text></revision></page>")
  path = _write_bz2(tmp_path / "dump.xml.bz2", _dump(
      [_page("Ant", "Ants."), no_title, bad_ns, _page("Bee", "Bees.")]))
  report = wikipedia.Report()
  documents = list(wikipedia.iter_wikipedia_dump(path, report))
  assert [d.title for d in documents] == ["Ant", "Bee"]
  assert report.skipped == {"malformed_page": 2}
  assert "after 'Ant'" in report.examples["malformed_page"][0]


def test_truncated_xml_raises_naming_the_file(tmp_path):
  content = _dump([_page("Ant", "Ants."), _page("Bee", "Bees."),
                   _page("Cat", "Cats.")])
  path = tmp_path / "dump.xml"
  path.write_text(content[:content.index("<title>Cat") + 12])
  with pytest.raises(wikipedia.CorruptDumpError,
                     match=re.escape(str(path)) + ".*after page 'Bee'"):
    list(wikipedia.iter_wikipedia_dump(str(path), wikipedia.Report()))
  report = wikipedia.Report()
  documents = list(wikipedia.iter_wikipedia_dump(
      str(path), report, allow_truncated=True))
  assert [d.title for d in documents] == ["Ant", "Bee"]
  assert report.skipped["truncated_file"] == 1


def test_truncated_bz2_raises_naming_the_file(tmp_path):
  full = _write_bz2(tmp_path / "full.xml.bz2", _dump(
      [_page(f"Page {i}", f"Text number {i}. " * 50) for i in range(50)]))
  with open(full, "rb") as f:
    data = f.read()
  path = tmp_path / "cut.xml.bz2"
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(wikipedia.CorruptDumpError, match=re.escape(str(path))):
    list(wikipedia.iter_wikipedia_dump(str(path), wikipedia.Report()))


def test_dump_memory_stays_flat(tmp_path):
  """Parsed pages are freed: peak memory does not grow with the dump."""
  path = _write_bz2(tmp_path / "dump.xml.bz2", _dump(
      [_page(f"Page {i}", "word " * 200) for i in range(3000)]))  # ~3 MB
  tracemalloc.start()
  try:
    pages = sum(1 for _ in wikipedia.iter_wikipedia_pages(
        path, wikipedia.Report()))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert pages == 3000
  assert peak < 1_000_000  # ~0.15 MB measured; ~6.7 MB if pages are kept


def test_dump_cleaned_by_a_pool_in_order(tmp_path):
  pages = [_page(f"Page {i}", f"'''Page {i}''' has [[fact|facts]]." if i % 4
                 else "{{only a template}}") for i in range(11)]
  pages[5] = _page("Page 5", _TABLE_AND_IMAGE)
  path = _write_bz2(tmp_path / "dump.xml.bz2", _dump(pages))
  serial_report, pool_report = wikipedia.Report(), wikipedia.Report()
  serial = list(wikipedia.iter_wikipedia_dump(path, serial_report))
  with multiprocessing.get_context("spawn").Pool(2) as pool:
    parallel = list(wikipedia.iter_wikipedia_dump(
        path, pool_report, pool=pool, window=3))
  assert parallel == serial
  assert [d.title for d in serial] == [f"Page {i}" for i in range(11)
                                       if i % 4]
  assert serial[0].text == "Page 1 has facts."
  assert pool_report.summary() == serial_report.summary()
  assert serial_report.skipped == {"empty_article": 3}
  assert serial_report.removed == {"tables": 1, "table_cells": 5,
                                   "captions": 1}
  with multiprocessing.get_context("spawn").Pool(2) as pool:
    kept = list(wikipedia.iter_wikipedia_dump(
        path, wikipedia.Report(), pool=pool, window=3, keep_tables=True,
        keep_captions=True))
  assert kept[3].title == "Page 5"
  assert kept[3].text == wikitext_lib.clean_wikitext(
      _TABLE_AND_IMAGE, keep_tables=True, keep_captions=True)
  assert "Tokyo | 14 million" in kept[3].text


def test_missing_file_raises(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.xml.bz2"):
    list(wikipedia.iter_wikipedia_dump(str(tmp_path / "nope.xml.bz2"),
                                       wikipedia.Report()))


def test_default_dump_is_the_gensim_slice():
  path = wikipedia.default_wikipedia_dump()
  assert os.path.exists(path)
  assert wikipedia.is_wikipedia_dump(path)


# ---------------------------------------------------------------- cleaning --


@pytest.mark.parametrize("wikitext, expected", [
    # Links keep their text; templates, refs, comments go.
    ("{{Infobox person|name=X}}'''Ada''' was a [[mathematician]]"
     "<ref name=a>Cite.</ref><!-- hidden --> from [[London|the city]].",
     "Ada was a mathematician from the city."),
    # Files (with nested links in captions), categories, interlanguage links.
    ("[[File:Ada.jpg|thumb|A [[portrait]] of Ada]]Ada wrote notes."
     "[[Category:Mathematicians]][[fr:Ada Lovelace]][[Image:X.png]]",
     "Ada wrote notes."),
    # Tables and formulas are dropped, HTML tags keep their text.
    ("Before.\n{| class=wikitable\n|-\n| cell || cell\n|}\n"
     "<small>Small</small> and <b>bold</b> and <math>x^2</math> text.",
     "Before.\n\nSmall and bold and text."),
    # Dropped sections, kept sections; headings become paragraph breaks.
    ("Intro text.\n== History ==\nOld times.\n== See also ==\n* [[Other]]\n"
     "=== Sub ===\nstill dropped\n== External links ==\n* [http://x.org X]\n"
     "== Legacy ==\nLater times.",
     "Intro text.\n\nOld times.\n\nLater times."),
    # Whitespace collapses, external link text stays, bare URLs go, entities.
    ("Alpha   beta\tgamma [http://example.org the site] http://bare.org "
     "&amp; &ndash; done.",
     "Alpha beta gamma the site & – done."),
    # Inline templates kept: convert, lang, dates; empty parentheses tidied.
    ("Ada ({{IPA|ada}}) ran {{convert|5|km|mi}} on "
     "{{birth date|1815|12|10}} in {{lang|fr|Paris}}.",
     "Ada ran 5 km on 10 December 1815 in Paris."),
    # List items become paragraphs; markup-only lines disappear.
    ("Items:\n* first item\n* second item\n----\n*",
     "Items:\n\nfirst item\n\nsecond item"),
    # A ref the parser cannot parse is still removed.
    ("Text.<ref>Unclosed ''quote</ref> More.", "Text. More."),
])
def test_clean_wikitext(wikitext, expected):
  assert wikitext_lib.clean_wikitext(wikitext) == expected


_TABLE_AND_IMAGE = (
    "[[File:Map.png|thumb|upright=1.1|A [[map]] of the cities]]"
    "Cities are large.\n{| class=\"wikitable\"\n|+ Largest cities\n|-\n"
    "! City !! Population\n|-\n| [[Tokyo]] || 14 million\n|}\n"
    "[[Image:Icon.svg|20px]] They grow.")


@pytest.mark.parametrize("keep_tables", [False, True])
@pytest.mark.parametrize("keep_captions", [False, True])
def test_clean_wikitext_keeps_tables_and_captions(keep_tables, keep_captions):
  """Each option adds exactly its paragraphs; what is dropped is counted
  (the table caption "|+" counts as a cell)."""
  removed = collections.Counter()
  text = wikitext_lib.clean_wikitext(
      _TABLE_AND_IMAGE, keep_tables=keep_tables, keep_captions=keep_captions,
      removed=removed)
  expected = (["A map of the cities"] if keep_captions else []) + [
      "Cities are large."] + ([
          "Largest cities", "City | Population", "Tokyo | 14 million"]
                              if keep_tables else []) + ["They grow."]
  assert text.split("\n\n") == expected
  assert removed == collections.Counter(
      {} if keep_tables else {"tables": 1, "table_cells": 5}) + (
          collections.Counter() if keep_captions else
          collections.Counter(captions=1))


def test_clean_wikitext_on_real_article():
  """The first article of the embedded dump comes out as plain prose."""
  report = wikipedia.Report()
  first = next(wikipedia.iter_wikipedia_dump(
      wikipedia.default_wikipedia_dump(), report))
  assert first.title == "Anarchism"
  assert first.text.startswith(
      "Anarchism is a political philosophy that advocates self-governed "
      "societies based on voluntary institutions.")
  for markup in ("{{", "}}", "[[", "]]", "<ref", "'''", "==",
                 "Category:", "External links"):
    assert markup not in first.text
  assert "\n\n" in first.text and "\n\n\n" not in first.text


# ------------------------------------------------------------------- JSONL --


def test_jsonl_bad_records_are_counted(tmp_path):
  lines = [
      json.dumps({"title": "Ant", "text": "Ants are insects."}).encode(),
      b"{not json",
      b'{"title": "Bad \xff byte", "text": "x"}',
      json.dumps({"title": "Lone", "text": "a \ud800 b"}).encode(),
      json.dumps(["a", "list"]).encode(),
      json.dumps({"title": "No text"}).encode(),
      json.dumps({"title": "", "text": "Untitled."}).encode(),
      json.dumps({"title": "Empty", "text": "  \n "}).encode(),
      json.dumps({"title": "Huge", "text": "x" * 500}).encode(),
      json.dumps({"title": "L" * 50, "text": "Long title."}).encode(),
      b"",
      json.dumps({"title": "Bee", "text": "Bees make honey.",
                  "id": 7}).encode(),
  ]
  path = tmp_path / "docs.jsonl"
  path.write_bytes(b"\n".join(lines) + b"\n")
  report = wikipedia.Report()
  documents = list(wikipedia.iter_jsonl_documents(
      str(path), report, max_article_chars=100, max_title_chars=40))
  assert documents == [wikipedia.Document("Ant", "Ants are insects."),
                       wikipedia.Document("Bee", "Bees make honey.")]
  assert report.skipped == {
      "bad_json": 1, "invalid_utf8": 2, "bad_record": 2, "empty_title": 1,
      "empty_article": 1, "enormous_article": 1, "title_too_long": 1}
  assert report.examples["bad_json"] == [
      f"{path}:2 (Expecting property name enclosed in double quotes: line 1 "
      "column 2 (char 1))"]
  assert report.examples["invalid_utf8"][0].startswith(f"{path}:3")
  assert report.examples["invalid_utf8"][1].startswith(f"{path}:4")


def test_iter_documents_dispatches(tmp_path):
  jsonl = tmp_path / "docs.jsonl.gz"
  with gzip.open(jsonl, "wt") as f:
    f.write(json.dumps({"title": "Ant", "text": "Ants."}) + "\n")
  dump = _write_bz2(tmp_path / "enwiki-latest-pages-articles1.xml-p10p30.bz2",
                    _dump([_page("Bee", "Bees.")]))
  report = wikipedia.Report()
  assert [d.title for d in wikipedia.iter_documents(str(jsonl), report)] == [
      "Ant"]
  assert [d.title for d in wikipedia.iter_documents(dump, report)] == ["Bee"]
  with pytest.raises(ValueError, match="unknown corpus format"):
    wikipedia.iter_documents(str(tmp_path / "docs.csv"), report)


# --------------------------------------------------------------------- DPR --


def _write_tsv(path, rows, header=("id", "text", "title")):
  with open(path, "w", encoding="utf-8", newline="") as f:
    writer = csv.writer(f, delimiter="\t", lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
  return str(path)


def test_dpr_passages_read_as_csv_wrote_them(tmp_path):
  rows = [("1", 'Aaron ( or ; "Ahärôn") is a prophet, a priest.', "Aaron"),
          ("2", "Line one\nline two, quoted by csv.", "Aaron"),
          ("wiki:3", "Plain text.", "")]
  path = _write_tsv(tmp_path / "psgs_w100.tsv", rows)
  raw = open(path, encoding="utf-8").read()
  assert '""Ahärôn""' in raw  # the csv module's doubled quotes
  assert list(wikipedia.iter_dpr_passages(path)) == [
      (i, title, text) for i, text, title in rows]


@pytest.mark.parametrize("lines, match", [
    (["id\ttitle\ttext", "1\tx\tT"], r"psgs.tsv:1: the header"),
    (["id\ttext\ttitle", "1\tok\tT", '2\t"two\nlines"\tT', "3\tno title"],
     r"psgs.tsv:5: expected 3"),
    (["id\ttext\ttitle", "1\t\tT"], r"psgs.tsv:2: .*non-empty id and text"),
    (["id\ttext\ttitle", "\tText\tT"], r"psgs.tsv:2: "),
    (["id\ttext\ttitle", "1\tok\tT", ""], r"psgs.tsv:3: expected 3"),
])
def test_dpr_malformed_lines_name_file_and_line(tmp_path, lines, match):
  path = tmp_path / "psgs.tsv"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  with pytest.raises(wikipedia.CorruptDumpError, match=match):
    list(wikipedia.iter_dpr_passages(str(path)))


def test_dpr_invalid_utf8_names_the_line(tmp_path):
  path = tmp_path / "psgs.tsv"
  path.write_bytes(b"id\ttext\ttitle\n1\tok\tT\n2\tbad \xff\tT\n")
  with pytest.raises(wikipedia.CorruptDumpError,
                     match=r"psgs.tsv:3: invalid UTF-8"):
    list(wikipedia.iter_dpr_passages(str(path)))


# -------------------------------------------------------- sentence splitter --


def _sentences(text):
  return [text[s:e] for s, e in wikipedia.split_sentences(text)]


@pytest.mark.parametrize("text, expected", [
    ("Plain one. Plain two! Plain three? Four",
     ["Plain one.", "Plain two!", "Plain three?", "Four"]),
    ("Tools, e.g. hammers, are used. Cats, i.e. felines, purr.",
     ["Tools, e.g. hammers, are used.", "Cats, i.e. felines, purr."]),
    ("Dr. Smith met Mr. Jones at St. Paul. They talked.",
     ["Dr. Smith met Mr. Jones at St. Paul.", "They talked."]),
    ("J. R. R. Tolkien wrote it. George W. Bush read it.",
     ["J. R. R. Tolkien wrote it.", "George W. Bush read it."]),
    ("The U.S. Army grew. It moved to the U.S. The end came.",
     ["The U.S. Army grew.", "It moved to the U.S.", "The end came."]),
    ("Pi is 3.14 roughly. It costs $2.50 today.",
     ["Pi is 3.14 roughly.", "It costs $2.50 today."]),
    ('He said "Stop." Then he left. (See the note.) Next one.',
     ['He said "Stop."', "Then he left.", "(See the note.)", "Next one."]),
    ("It was good... Then bad. Is it?! Yes.",
     ["It was good...", "Then bad.", "Is it?!", "Yes."]),
    ("Built c. 1500 by the Romans, etc. The wall fell in 300 BC. It was "
     "rebuilt.",
     ["Built c. 1500 by the Romans, etc.", "The wall fell in 300 BC.",
      "It was rebuilt."]),
    ("See No. 5 and Fig. 3 for details. Done.",
     ["See No. 5 and Fig. 3 for details.", "Done."]),
    # A blank line always splits; a single newline is ordinary whitespace.
    ("Heading without period\n\nA paragraph. Another one\nwrapped here.",
     ["Heading without period", "A paragraph.",
      "Another one\nwrapped here."]),
    ("Yahoo! is a company. lower case after period. stays.",
     ["Yahoo! is a company. lower case after period. stays."]),
    ("   \n\n  ", []),
])
def test_split_sentences(text, expected):
  assert _sentences(text) == expected


def test_split_sentences_covers_every_character():
  text = ("First  sentence here.\tSecond one (with U.S. stuff, e.g. this).\n\n"
          "  Third: über café. Fourth?  \"Fifth.\"  Sixth")
  spans = wikipedia.split_sentences(text)
  covered = [False] * len(text)
  previous_end = 0
  for start, end in spans:
    assert previous_end <= start < end
    assert not text[start].isspace() and not text[end - 1].isspace()
    for i in range(start, end):
      covered[i] = True
    previous_end = end
  assert all(covered[i] or c.isspace() for i, c in enumerate(text))


@pytest.mark.parametrize("ids, line, first", [
    (["1", "1", "2"], 3, 2), (["7", "2", "3", "7"], 5, 2),
    (["wiki:a", "b", "wiki:a"], 4, 2), (["0", "00", "0"], 4, 2)])
def test_dpr_duplicate_passage_ids_name_both_lines(tmp_path, ids, line,
                                                   first):
  """Gold passages are matched by id: a repeated id is an error naming
  the repeat's line and the first one's."""
  path = _write_tsv(tmp_path / "psgs.tsv",
                    [(i, f"Passage {n}.", "T") for n, i in enumerate(ids)])
  with pytest.raises(wikipedia.CorruptDumpError,
                     match=rf"psgs.tsv:{line}: passage id '{ids[line - 2]}' "
                     rf"is also the id of line {first}"):
    list(wikipedia.iter_dpr_passages(path))
  unique = _write_tsv(tmp_path / "ok.tsv", [(str(i), "x", "T")
                                            for i in (5, 1, 900, 0, 64)])
  assert [p[0] for p in wikipedia.iter_dpr_passages(unique)] == [
      "5", "1", "900", "0", "64"]


def test_jsonl_exact_duplicate_articles_are_counted(tmp_path):
  ant = json.dumps({"title": "Ant", "text": "Ants are insects."}).encode()
  bee = json.dumps({"title": "Bee", "text": "Bees make honey."}).encode()
  near = json.dumps({"title": "Ant", "text": "Ants are insects!"}).encode()
  path = tmp_path / "docs.jsonl"
  path.write_bytes(b"\n".join([ant, bee, ant, near, ant]) + b"\n")
  report = wikipedia.Report()
  documents = list(wikipedia.iter_jsonl_documents(str(path), report))
  assert [d.text for d in documents] == [
      "Ants are insects.", "Bees make honey.", "Ants are insects!"]
  assert report.skipped == {"duplicate_article": 2}
  assert report.examples["duplicate_article"][0] == (
      f"{path}:3 ('Ant': the same bytes as line 1)")
  assert report.dropped == [("duplicate_article", "Ant")] * 2

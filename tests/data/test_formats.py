"""realm_jax.data.formats: the corpus and question formats, one table each;
a new format is one entry (issue 68)."""

import json

import pytest

from realm_jax.data import corpus_job, formats


def test_names_and_files_pick_their_formats(tmp_path):
  assert formats.corpus_format_of("enwiki-pages-articles.xml.bz2").name == (
      "wikipedia_xml")
  assert formats.corpus_format_of("docs.JSONL.gz").name == "jsonl"
  assert formats.corpus_format_of("psgs_w100.tsv").name == "dpr_tsv"
  with pytest.raises(ValueError, match="docs.csv: unknown corpus format"):
    formats.corpus_format_of("docs.csv")
  with pytest.raises(ValueError, match="'orqa' is not one of"):
    formats.corpus_format("orqa")  # Chosen by its two files, never by name.
  assert set(formats.INPUT_FORMATS) == {"wikipedia_xml", "jsonl", "dpr_tsv",
                                        "squad"}
  path = tmp_path / "q.jsonl"
  path.write_text(json.dumps({"question": "who?", "answer": ["Ada"]}) + "\n")
  assert [e.answers for e in formats.read_questions(str(path))] == [("Ada",)]
  with pytest.raises(ValueError, match="'csv' is not one of"):
    formats.read_questions(str(path), "csv")


def _read_lines(path, report):
  """Plain text: one document a line, "title: text"."""
  del report
  with open(path, encoding="utf-8") as f:
    for line in f:
      title, _, text = line.partition(": ")
      yield None, title, text.strip()


def test_a_new_corpus_format_is_one_table_entry(tmp_path, monkeypatch):
  """A reader and an entry: the corpus job builds a store from it, the
  same blocks as the same documents given as JSONL."""
  monkeypatch.setitem(formats.CORPUS_FORMATS, "lines", formats.CorpusFormat(
      "lines", _read_lines, formats.CORPUS_FORMATS["jsonl"].pack,
      suffixes=(".lines",)))
  docs = [("Ada Lovelace", "Ada wrote the first program. She was born in "
           "London."), ("Bee", "A bee is an insect that makes honey.")]
  lines = tmp_path / "docs.lines"
  lines.write_text("".join(f"{t}: {x}\n" for t, x in docs))
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"title": t, "text": x}) + "\n"
                           for t, x in docs))
  stores = [corpus_job.build_corpus(
      input_path=str(path), output_dir=str(tmp_path / name),
      max_block_len=16)[0]
            for name, path in (("by_lines", lines), ("by_jsonl", jsonl))]
  assert len(stores[0]) == len(stores[1]) > len(docs)
  assert [stores[0].text(i) for i in range(len(stores[0]))] == [
      stores[1].text(i) for i in range(len(stores[1]))]

"""Tests of realm_jax.data.corpus_job (the corpus job, end to end)."""

import bz2
import csv
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import time
from xml.sax import saxutils

import numpy as np
import pytest

from realm_jax.core import progress
from realm_jax.data import block_store
from realm_jax.data import corpus_job
from realm_jax.data import tokenizer as tokenizer_lib
from realm_jax.data import wikipedia


def _write_jsonl(path, records, extra_lines=()):
  with open(path, "wb") as f:
    for record in records:
      f.write(json.dumps(record).encode() + b"\n")
    for line in extra_lines:
      f.write(line + b"\n")
  return str(path)


_RECORDS = [
    {"title": "Ada Lovelace", "text": "Ada Lovelace was a mathematician. She "
                                      "wrote about the Analytical Engine.\n\n"
                                      "She was born in London in 1815."},
    {"title": "Charles Babbage", "text": "Charles Babbage designed the "
                                         "Difference Engine. " * 12},
    {"title": "Analytical Engine", "text": "The Analytical Engine was a "
                                           "proposed computer."},
]


def test_build_from_jsonl_writes_store_and_report(tmp_path, monkeypatch,
                                                  caplog):
  path = _write_jsonl(tmp_path / "docs.jsonl", _RECORDS,
                      [b"{broken", b'{"title": "X", "text": "\xff"}'])
  monkeypatch.setattr(progress, "_every_seconds", [1e-9])  # Every item.
  with caplog.at_level(logging.INFO):
    store, report = corpus_job.build_corpus(
        input_path=path, output_dir=str(tmp_path / "store"),
        max_block_len=64)
  # Progress in the log (issue 58, `core.progress`): the reader, the Beam
  # workers' shard writes and the store's chunks, each with a last line.
  for line in (rf"reading {re.escape(path)}: 1 documents, [\d.]+ "
               r"documents/s$",
               rf"reading {re.escape(path)}: 3 documents in [\d.]+ s",
               r"corpus: writing shards \(this worker\): \d+ shards, [\d.]+ shards/s",
               r"corpus: storing chunks: (\d+)/\1 chunks in [\d.]+ s"):
    assert re.search(line, caplog.text, re.M), (line, caplog.text)
  assert store.num_documents == 3
  assert [store.title(i) for i in store.document_blocks(0)] == [
      "Ada Lovelace"]
  assert len(store.document_blocks(1)) > 1  # 12 sentences, 64 wordpieces
  assert report.skipped == {"bad_json": 1, "invalid_utf8": 1}
  assert report.kept["blocks"] == len(store)
  on_disk = json.loads((tmp_path / "store" / "report.json").read_text())
  assert on_disk == dict(report.summary(), dropped_list="dropped.jsonl")
  assert store.manifest["source"] == os.path.abspath(path)
  # Same input, same ids and fingerprint.
  again, _ = corpus_job.build_corpus(
      input_path=path, output_dir=str(tmp_path / "again"), max_block_len=64)
  assert again.fingerprint == store.fingerprint
  np.testing.assert_array_equal(again._a["body_ids"], store._a["body_ids"])


def test_build_from_orqa_directory(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  records = [("Ada", "Ada was a mathematician."), ("Ada", "She was born."),
             ("Babbage", "Babbage built engines.")]
  for name, column in (("blocks.tfr", 1), ("titles.tfr", 0)):
    with tf.io.TFRecordWriter(str(tmp_path / name)) as writer:
      for record in records:
        writer.write(record[column].encode())
  # Chunks of one record: Ada's two records stay in one chunk and article.
  store, report = corpus_job.build_corpus(
      input_path=str(tmp_path), output_dir=str(tmp_path / "store"),
      documents_per_chunk=1)
  assert [(store.title(i), store.text(i)) for i in range(len(store))] == (
      records)
  assert store.num_documents == 2 == report.kept["documents"]
  limited, _ = corpus_job.build_corpus(
      input_path=str(tmp_path / "blocks.tfr"), max_documents=2,
      output_dir=str(tmp_path / "limited"))
  assert len(limited) == 2


def test_gensim_slice_first_articles(tmp_path):
  """The real embedded dump, first 10 articles (about 3 s here)."""
  start = time.perf_counter()
  store, report = corpus_job.build_corpus(
      output_dir=str(tmp_path / "store"), max_documents=10)
  seconds = time.perf_counter() - start
  assert store.num_documents == 10
  assert report.kept["documents"] == 10
  assert report.skipped["redirect"] > 0
  assert store.title(0) == "Anarchism"
  assert len(store) > 10 * 5
  inputs = store.retriever_inputs(np.arange(len(store)))
  assert inputs["input_mask"].sum(axis=1).max() <= 288
  assert (inputs["input_mask"].sum(axis=1) > 100).mean() > 0.9
  # Every character of every article is in its blocks.
  documents = itertools.islice(wikipedia.iter_wikipedia_dump(
      wikipedia.default_wikipedia_dump(), wikipedia.Report()), 10)
  for d, document in enumerate(documents):
    texts = [store.text(i) for i in store.document_blocks(d)]
    assert store.title(store.document_blocks(d)[0]) == document.title
    assert re.sub(r"\s", "", "".join(texts)) == re.sub(r"\s", "",
                                                       document.text)
  print(f"10 gensim articles -> {len(store)} blocks in {seconds:.1f} s")


def _tiny_dump(path, n):
  pages = "".join(
      f"<page><title>Page {i}</title><ns>0</ns><revision><text>"
      f"'''Page {i}''' is about [[topic {i}]].{{{{cite}}}} It has "
      f"{i} facts.</text></revision></page>" for i in range(n))
  with bz2.open(path, "wt") as f:
    f.write(f"<mediawiki>{pages}</mediawiki>")
  return str(path)


def test_chunks_and_workers_give_the_same_store(tmp_path):
  """The store and report are the sequential pass's, however the Beam job
  cuts the work and whatever the runner's mode."""
  dump = _tiny_dump(tmp_path / "dump.xml.bz2", 30)
  whole, report = corpus_job.build_corpus(
      input_path=dump, output_dir=str(tmp_path / "whole"))
  chunked, chunked_report = corpus_job.build_corpus(
      input_path=dump, output_dir=str(tmp_path / "chunked"),
      documents_per_chunk=4, pipeline_args=[
          "--direct_num_workers=2", "--direct_running_mode=multi_processing"])
  assert len(whole) == 30
  assert chunked.fingerprint == whole.fingerprint
  assert chunked_report.summary() == report.summary()
  assert json.loads((tmp_path / "chunked" / "report.json").read_text()) == (
      dict(report.summary(), dropped_list="dropped.jsonl"))
  assert whole.text(7) == "Page 7 is about topic 7. It has 7 facts."
  assert [whole.title(whole.document_blocks(d)[0]) for d in (0, 29)] == [
      "Page 0", "Page 29"]
  assert sorted(os.listdir(tmp_path)) == ["chunked", "dump.xml.bz2", "whole"]


def _page(title, text):
  return (f"<page><title>{saxutils.escape(title)}</title><ns>0</ns><revision>"
          f"<text>{saxutils.escape(text)}</text></revision></page>")


_PAGES = [
    ("Mercury", "'''Mercury''' is a planet. It is small."),
    ("List of planets", "The planets: [[Mercury]], [[Venus]]."),
    ("Mercury (disambiguation)", "Mercury may be a planet or a metal."),
    ("Venus", "[[File:Venus.png|thumb|Venus in true colour]]'''Venus''' is "
              "hot.\n{| class=wikitable\n|-\n| Mass || 0.815 Earths\n|}\n"
              "It has clouds."),
] + [(f"Term {i} (disambiguation)", f"Term {i} may mean a thing.")
     for i in range(6)]  # more than report.json's 3 examples


def _articles(store):
  return {store.title(blocks[0]): " ".join(store.text(i) for i in blocks)
          for blocks in map(store.document_blocks,
                            range(store.num_documents))}


def test_dump_filters_are_reported_and_optional(tmp_path):
  """By default (as ORQA) lists, disambiguation pages, tables and captions
  go, each listed or counted; each option flips exactly what it says and
  gives the store another fingerprint."""
  dump = tmp_path / "dump.xml.bz2"
  with bz2.open(dump, "wt") as f:
    f.write("<mediawiki>" + "".join(_page(*p) for p in _PAGES) +
            "</mediawiki>")
  default, report = corpus_job.build_corpus(
      input_path=str(dump), output_dir=str(tmp_path / "default"))
  before = _articles(default)
  assert before == {"Mercury": "Mercury is a planet. It is small.",
                    "Venus": "Venus is hot.\n\nIt has clouds."}
  dropped = [json.loads(line) for line in (
      tmp_path / "default" / "dropped.jsonl").read_text().splitlines()]
  assert dropped == [
      {"title": title, "reason": "list_or_index_page" if "List" in title
       else "disambiguation"} for title, _ in _PAGES
      if "List" in title or "(disambiguation)" in title]
  on_disk = json.loads((tmp_path / "default" / "report.json").read_text())
  assert on_disk == dict(report.summary(), dropped_list="dropped.jsonl")
  assert on_disk["skipped"] == {"disambiguation": 7, "list_or_index_page": 1}
  assert len(on_disk["examples"]["disambiguation"]) == 3
  assert on_disk["removed"] == {"captions": 1, "table_cells": 2, "tables": 1}
  assert on_disk["notes"] == {"captions_removed": 1, "tables_removed": 1}
  venus = "Venus is hot.\n\nIt has clouds."
  fingerprints = {default.fingerprint}
  for option, added, changed in [
      ("keep_lists", {"List of planets": "The planets: Mercury, Venus."}, {}),
      ("keep_disambiguation", {
          "Mercury (disambiguation)": "Mercury may be a planet or a metal.",
          **{f"Term {i} (disambiguation)": f"Term {i} may mean a thing."
             for i in range(6)}}, {}),
      ("keep_tables", {}, {"Venus": venus.replace(
          "\n\nIt", "\n\nMass | 0.815 Earths\n\nIt")}),
      ("keep_captions", {}, {"Venus": "Venus in true colour\n\n" + venus}),
  ]:
    kept, kept_report = corpus_job.build_corpus(
        input_path=str(dump), output_dir=str(tmp_path / option),
        **{option: True})
    assert _articles(kept) == dict(before, **added, **changed), option
    assert kept.manifest["options"] == dict(default.manifest["options"],
                                            **{option: True})
    assert len(kept_report.dropped) == len(dropped) - len(added)
    fingerprints.add(kept.fingerprint)
  assert len(fingerprints) == 5
  assert kept_report.removed == {"tables": 1, "table_cells": 2}


def test_build_from_dpr_passages(tmp_path):
  """One block per passage line, in file order, truncated like ORQA's
  blocks; the passage ids are kept."""
  long_text = " ".join(["Zebras run fast across the plain."] * 40)
  rows = [("10", 'Aaron ( or ; "Aharon") is a prophet, a priest.', "Aaron"),
          ("11", "He was the brother of Moses.", "Aaron"),
          ("7", long_text, "Zebra"),
          ("wiki-9", "Moses led the Israelites.", "Moses")]
  path = tmp_path / "passages.txt"  # any name, with input_format
  with open(path, "w", encoding="utf-8", newline="") as f:
    writer = csv.writer(f, delimiter="\t", lineterminator="\n")
    writer.writerows([("id", "text", "title")] + rows)
  assert '""Aharon""' in path.read_text(encoding="utf-8")
  store, report = corpus_job.build_corpus(
      input_path=str(path), input_format="dpr_tsv", max_block_len=32,
      output_dir=str(tmp_path / "store"), documents_per_chunk=1)
  assert len(store) == len(rows) and store.num_documents == 3
  assert [store.passage_id(i) for i in range(4)] == ["10", "11", "7", "wiki-9"]
  assert [store.title(i) for i in range(4)] == [r[2] for r in rows]
  assert [store.doc_index(i) for i in range(4)] == [0, 0, 1, 2]
  tokenizer = tokenizer_lib.Tokenizer()
  for i, (_, text, title) in enumerate(rows):
    title_ids = tokenizer.tokenize([title])[0]
    np.testing.assert_array_equal(store.title_ids(i), title_ids)
    budget = 32 - 3 - len(title_ids)
    np.testing.assert_array_equal(store.body_ids(i),
                                  tokenizer.tokenize([text])[0][:budget])
    assert text.startswith(store.text(i))
  assert store.text(0) == rows[0][1] and len(store.text(2)) < len(long_text)
  assert report.notes == {"block_truncated": 1}
  assert store.manifest["options"] == {}


def test_build_from_squad_json_keeps_the_paragraph_ids(tmp_path):
  """input_format="squad": each paragraph a document whose blocks carry its
  id; the same blocks as the paragraphs' corpus JSONL."""
  from realm_jax.data import squad  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))), "fixtures", "squad", "tiny_v1.json")
  data = squad.read_squad(path)
  store, _ = corpus_job.build_corpus(
      input_path=path, input_format="squad", max_block_len=24,
      output_dir=str(tmp_path / "store"), documents_per_chunk=2)
  (tmp_path / "p.jsonl").write_text(squad.corpus_lines(data.paragraphs))
  plain, _ = corpus_job.build_corpus(
      input_path=str(tmp_path / "p.jsonl"), max_block_len=24,
      output_dir=str(tmp_path / "plain"))
  assert len(store) == len(plain) > len(data.paragraphs)
  assert store.num_documents == len(data.paragraphs)
  for b in range(len(store)):
    assert store.text(b) == plain.text(b)
    assert store.doc_index(b) == plain.doc_index(b)
  blocks = squad.paragraph_blocks(store, data.paragraphs)
  for p in data.paragraphs:
    assert [store.passage_id(int(b)) for b in blocks[p.id]] == [p.id] * len(
        blocks[p.id])
  assert {store.passage_id(b) for b in range(len(store))} == {
      p.id for p in data.paragraphs}


def test_malformed_dpr_file_fails_naming_the_line(tmp_path):
  path = tmp_path / "psgs_w100.tsv"
  path.write_text("id\ttext\ttitle\n1\tGood.\tA\n2\tNo title\n")
  with pytest.raises(wikipedia.CorruptDumpError, match="psgs_w100.tsv:3"):
    corpus_job.build_corpus(input_path=str(path),
                            output_dir=str(tmp_path / "s"))
  with pytest.raises(ValueError, match="input_format='tsv' is not one of"):
    corpus_job.build_corpus(input_path=str(path), input_format="tsv",
                            output_dir=str(tmp_path / "s"))
  assert sorted(os.listdir(tmp_path)) == ["psgs_w100.tsv"]


def test_corrupt_dump_fails_naming_the_file(tmp_path):
  dump = tmp_path / "dump.xml.bz2"
  dump.write_bytes(bz2.compress(b"<mediawiki><page><title>A</title>" * 3))
  with pytest.raises(wikipedia.CorruptDumpError, match="dump.xml.bz2"):
    corpus_job.build_corpus(input_path=str(dump),
                            output_dir=str(tmp_path / "s"))
  assert sorted(os.listdir(tmp_path)) == ["dump.xml.bz2"]


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="max_block_len=3"):
    corpus_job.build_corpus(output_dir=str(tmp_path / "s"), max_block_len=3)
  with pytest.raises(ValueError, match="max_documents=0"):
    corpus_job.build_corpus(output_dir=str(tmp_path / "s"), max_documents=0)
  empty = _write_jsonl(tmp_path / "empty.jsonl", [], [b"{bad"])
  with pytest.raises(ValueError, match="no blocks"):
    corpus_job.build_corpus(input_path=empty,
                            output_dir=str(tmp_path / "s"))
  assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]


def test_command_line(tmp_path):
  path = _write_jsonl(tmp_path / "docs.jsonl", _RECORDS)
  out = tmp_path / "store"
  command = [sys.executable, "-m", "realm_jax.jobs.corpus",
             "--gin_file=runs/corpus.gin", f"--gin.INPUT_PATH='{path}'",
             f"--gin.OUTPUT_DIR='{out}'", "--gin.CorpusConfig.max_block_len=64",
             "--runner=DirectRunner"]  # a Beam option
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  result = subprocess.run(command, capture_output=True, text=True, env=env,
                          cwd=tmp_path, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  store = block_store.BlockStore.open(str(out))
  assert store.num_documents == 3 and store.max_block_len == 64
  # A second run refuses to overwrite, naming the directory.
  result = subprocess.run(command, capture_output=True, text=True, env=env,
                          cwd=tmp_path, check=False)
  assert result.returncode != 0
  assert "already exists" in result.stderr and str(out) in result.stderr
  # ... and says how to replace it, with a flag that does.
  assert "--gin.CorpusConfig.overwrite=True" in result.stderr
  assert "Traceback" not in result.stderr
  result = subprocess.run(
      [*command[:-1], "--gin.CorpusConfig.overwrite=True",
       "--gin.CorpusConfig.max_block_len=32"], capture_output=True,
      text=True, env=env, cwd=tmp_path, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert block_store.BlockStore.open(str(out)).max_block_len == 32

"""Tests of salient-span annotation and the annotated record format."""

import itertools
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from realm_jax.core import outputs
from realm_jax.data import annotate_job
from realm_jax.data import salient_spans as ss
from realm_jax.data import wikipedia


@pytest.fixture(scope="module")
def nlp():
  return ss.load_nlp()


def span_texts(doc: ss.AnnotatedDocument) -> list[str]:
  data = doc.text.encode("utf-8")
  return [data[s:l].decode("utf-8")
          for s, l in zip(doc.span_byte_starts, doc.span_byte_limits)]


# ---------------------------------------------------------------- dates ----

DATE_CASES = [
    ("He landed on July 20, 1969 at night.", ["July 20, 1969"]),
    ("He landed on 20 July 1969.", ["20 July 1969"]),
    ("On the 20th July, 1969 it was hot.", ["20th July, 1969"]),
    ("It happened in July 1969, twice.", ["July 1969"]),
    ("It happened in 1969.", ["1969"]),
    ("Popular in the 1960s and 1970's.", ["1960s", "1970's"]),
    ("Born on Sept. 3, 2001 in Rome.", ["Sept. 3, 2001"]),
    ("Every year on July 4 and on 14 July.", ["July 4", "14 July"]),
    ("The ISO date 1969-07-20 is clear.", ["1969-07-20"]),
    ("Reigned 1066–1087 in England.", ["1066", "1087"]),
    ("From 1000 to 2099.", ["1000", "2099"]),
]
NOT_DATES = [
    "Pi is about 3.14 and e 2.718.",
    "There were 1,000 soldiers and 12,1969 horses.",
    "A value of 1969.5 was measured.",
    "It costs $1999 or 1999% more.",
    "The years 999 and 2100 are out of range.",
    "Model A1969 and B2000x.",
]


@pytest.mark.parametrize("text,expected", DATE_CASES)
def test_date_regex_finds_dates(text, expected):
  assert [text[s:e] for s, e in ss.find_dates(text)] == expected


@pytest.mark.parametrize("text", NOT_DATES)
def test_date_regex_rejects_numbers(text):
  assert ss.find_dates(text) == []


def test_merge_spans_unions_overlaps_and_keeps_touching_apart():
  merged = ss.merge_spans([(10, 20, "DATE"), (0, 5, "PERSON"),
                           (12, 30, "EVENT"), (5, 8, "GPE"), (0, 3, "ORG")])
  # (0,5) absorbs (0,3); (5,8) only touches it; (10,20)+(12,30) -> EVENT
  # (18 characters beat 10).
  assert merged == [(0, 5, "PERSON"), (5, 8, "GPE"), (10, 30, "EVENT")]
  # Deterministic whatever the input order.
  assert ss.merge_spans(reversed([(10, 20, "DATE"), (12, 30, "EVENT"),
                                  (0, 5, "PERSON"), (5, 8, "GPE"),
                                  (0, 3, "ORG")])) == merged


# ----------------------------------------------------------- annotation ----


def test_spacy_finds_entities_and_regex_finds_dates(nlp):
  text = ("Barack Obama was born in Honolulu on August 4, 1961. "
          "He later moved to the United States capital.")
  doc = ss.annotate_document("Barack Obama", text, nlp)
  found = dict(zip(span_texts(doc), doc.span_types))
  assert found["Barack Obama"] == "PERSON"
  assert found["Honolulu"] == "GPE"
  assert found["August 4, 1961"] == "DATE"
  # The leading article is trimmed off entities.
  assert "United States" in found and "the United States" not in found
  # Two sentences; every span inside one of them.
  assert len(doc.sentence_byte_starts) == 2
  for s, l in zip(doc.span_byte_starts, doc.span_byte_limits):
    assert any(a <= s and l <= b for a, b in
               zip(doc.sentence_byte_starts, doc.sentence_byte_limits))


def test_offsets_are_utf8_bytes(nlp):
  text = ("Der Zürichsee liegt bei Zürich in der Schweiz. "
          "Émile Zola moved to Paris in 1858. Ünïcödé ☃ text follows.")
  doc = ss.annotate_document("Émile", text, nlp)
  data = text.encode("utf-8")
  texts = span_texts(doc)
  assert "Paris" in texts and "1858" in texts
  # Byte offsets differ from character offsets here; decoding proves both
  # edges fall on character boundaries and cover the right text.
  assert text.index("Paris") != data.index(b"Paris")
  for s, l, t in zip(doc.span_byte_starts, doc.span_byte_limits, texts):
    assert data[s:l].decode("utf-8") == t
  sentences = [data[s:l].decode("utf-8") for s, l in
               zip(doc.sentence_byte_starts, doc.sentence_byte_limits)]
  assert sentences[1] == "Émile Zola moved to Paris in 1858."


# -------------------------------------------------------- record format ----


def _doc(title, text, sentences, spans, types=(), uid=""):
  b = text.encode("utf-8")
  def off(sub_list):
    starts, limits = [], []
    for sub in sub_list:
      s = b.index(sub.encode("utf-8"))
      starts.append(s)
      limits.append(s + len(sub.encode("utf-8")))
    return tuple(starts), tuple(limits)
  ss_, sl = off(sentences)
  ps, pl = off(spans)
  return ss.AnnotatedDocument(title, text, ss_, sl, ps, pl, tuple(types), uid)


def test_round_trip_with_non_ascii(tmp_path):
  docs = [
      _doc("Zürich", "Zürich is in Switzerland. It had 1 ☃ in 1999.",
           ["Zürich is in Switzerland.", "It had 1 ☃ in 1999."],
           ["Zürich", "Switzerland", "1999"], ["GPE", "GPE", "DATE"], "7"),
      _doc("Plain", "Nothing here.", ["Nothing here."], []),
  ]
  for name in ("a.tfr.gz", "a.tfr"):
    path = str(tmp_path / name)
    assert ss.write_annotated(path, docs) == 2
    report = ss.AnnotationReport()
    assert list(ss.read_annotated(path, report=report)) == docs
    assert report.documents == 2 and report.spans == 3
    assert not report.skipped
  # The gzip file really is gzip (REALM's released files are).
  with open(tmp_path / "a.tfr.gz", "rb") as f:
    assert f.read(2) == b"\x1f\x8b"
  assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def _raw_record(title, text, ss_, sl, ps, pl):
  def ints(v):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=v))
  feature = {
      "title": tf.train.Feature(bytes_list=tf.train.BytesList(value=[title])),
      "sentence_byte_start": ints(ss_), "sentence_byte_limit": ints(sl),
      "span_byte_start": ints(ps), "span_byte_limit": ints(pl)}
  if text is not None:
    feature["text"] = tf.train.Feature(
        bytes_list=tf.train.BytesList(value=[text]))
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def test_bad_records_are_counted_or_raise(tmp_path):
  text = "Bob met Ann. Zoë left.".encode("utf-8")  # 'ë' is bytes 15-16
  path = str(tmp_path / "bad.tfr.gz")
  with tf.io.TFRecordWriter(path, "GZIP") as w:
    # Record 0 is good.
    w.write(_raw_record(b"T", text, [0, 13], [12, 23], [0, 8], [3, 11]))
    # Record 1: a span past the end, one across the two sentences, one that
    # cuts 'ë' in half, and one good span (Zoë).
    w.write(_raw_record(b"T", text, [0, 13], [12, 23],
                        [20, 8, 13, 13], [40, 15, 16, 17]))
    # Record 2: no text at all.
    w.write(_raw_record(b"T", None, [], [], [], []))
    # Record 3: a sentence outside the text (and its span goes with it).
    w.write(_raw_record(b"T", text, [0, 13], [12, 99], [13], [18]))
  report = ss.AnnotationReport()
  docs = list(ss.read_annotated(path, report=report))
  assert len(docs) == 3
  assert span_texts(docs[0]) == ["Bob", "Ann"]
  assert span_texts(docs[1]) == ["Zoë"]
  assert docs[2].sentence_byte_starts == (0,) and docs[2].span_byte_starts == ()
  assert dict(report.skipped) == {
      "span_outside_text": 1, "span_not_inside_a_sentence": 2,
      "span_not_on_char_boundary": 1, "record_without_text": 1,
      "sentence_outside_text": 1}
  with pytest.raises(ss.InvalidRecordError, match=r"bad\.tfr\.gz: record 1:"):
    list(ss.read_annotated(path, strict=True))


def test_corrupt_file_names_the_file(tmp_path):
  path = tmp_path / "corrupt.tfr.gz"
  path.write_bytes(b"this is not gzip")
  with pytest.raises(ss.InvalidRecordError, match="corrupt.tfr.gz"):
    list(ss.read_annotated(str(path)))
  with pytest.raises(FileNotFoundError, match="nothing-"):
    list(ss.read_annotated(str(tmp_path / "nothing-*.tfr.gz")))


# ------------------------------------------------------------------ job ----

CORPUS = [
    {"title": "Ada Lovelace", "text": "Ada Lovelace was born in London in "
     "1815. She worked with Charles Babbage."},
    {"title": "Alan Turing", "text": "Alan Turing was born on 23 June 1912. "
     "He studied at King's College, Cambridge."},
    {"title": "Grace Hopper", "text": "Grace Hopper joined the United States "
     "Navy in 1943."},
    {"title": "Kraków", "text": "Kraków is a city in Poland. It was the "
     "capital until 1596."},
    {"title": "Empty", "text": "   "},
]


def _write_jsonl(path, docs):
  with open(path, "w", encoding="utf-8") as f:
    for d in docs:
      f.write(json.dumps(d, ensure_ascii=False) + "\n")


def _shards(out, num_shards):
  return [list(ss.read_annotated(ss.shard_path(str(out), i, num_shards)))
          for i in range(num_shards)]


def _expected(documents, nlp, num_shards):
  """What the job must write: document i annotated alone, in shard
  i % num_shards, each shard in document order."""
  docs = [ss.annotate_document(title, text, nlp, uid=str(i))
          for i, (title, text) in enumerate(documents)]
  return [docs[k::num_shards] for k in range(num_shards)]


def test_annotate_corpus_beam_job(tmp_path, nlp):
  corpus = tmp_path / "corpus.jsonl"
  _write_jsonl(corpus, CORPUS)
  out = tmp_path / "out"
  report = annotate_job.annotate_corpus(str(corpus), str(out), num_shards=3)
  names = sorted(os.listdir(out))
  assert names.pop(0) == outputs.MARKER  # Whose output it is (issue 64).
  assert names == ["annotated-00000-of-00003.tfr.gz",
                   "annotated-00001-of-00003.tfr.gz",
                   "annotated-00002-of-00003.tfr.gz", "report.json"]
  # The JSONL reader skips the empty document; the others are dealt
  # round-robin, each annotated as `annotate_document` does it alone.
  kept = [(d["title"], d["text"]) for d in CORPUS[:4]]
  assert _shards(out, 3) == _expected(kept, nlp, 3)
  assert report["documents"] == 4 and report["shard_documents"] == [2, 1, 1]
  assert report["spans"] > 4 and report["reader"]["skipped"] == {
      "empty_article": 1}
  assert report["span_types"]["DATE"] >= 3
  with open(out / "report.json", encoding="utf-8") as f:
    assert json.load(f) == report
  assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]

  with pytest.raises(FileExistsError, match="out"):
    annotate_job.annotate_corpus(str(corpus), str(out), num_shards=3)


def test_annotate_corpus_wikipedia_dump_multiprocess(tmp_path, nlp):
  """A dump's markup is removed on the workers; the output is that of the
  sequential reader, whatever the runner's mode."""
  dump = wikipedia.default_wikipedia_dump()
  out = tmp_path / "out"
  report = annotate_job.annotate_corpus(
      dump, str(out), num_shards=2, max_documents=3, pipeline_args=[
          "--direct_num_workers=2", "--direct_running_mode=multi_processing"])
  documents = list(itertools.islice(
      wikipedia.iter_documents(dump, wikipedia.Report()), 3))
  assert _shards(out, 2) == _expected(
      [(d.title, d.text) for d in documents], nlp, 2)
  assert report["documents"] == 3 and report["reader"]["documents"] == 3


def test_annotate_corpus_bad_input_names_the_file(tmp_path):
  out = tmp_path / "out"
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    annotate_job.annotate_corpus(str(tmp_path / "missing.jsonl"), str(out),
                                 num_shards=1)
  (tmp_path / "corpus.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="corpus.csv: unknown corpus format"):
    annotate_job.annotate_corpus(str(tmp_path / "corpus.csv"), str(out),
                                 num_shards=1)
  # A directory of the user's files is no annotated corpus: refused even
  # with overwrite=True (issue 64), before the pipeline runs.
  out.mkdir()
  (out / "keep.txt").write_text("old")
  bad = tmp_path / "corpus.jsonl.gz"
  bad.write_bytes(b"not gzip data")
  with pytest.raises(outputs.OwnershipError, match=r"out.*holds keep.txt"):
    annotate_job.annotate_corpus(str(bad), str(out), num_shards=2,
                                 overwrite=True)
  assert os.listdir(out) == ["keep.txt"]
  # A corrupt file fails in the pipeline: the error names it, and nothing
  # is left behind (no half-written output).
  with pytest.raises(ValueError, match=r"corpus.jsonl.gz: cannot read"):
    annotate_job.annotate_corpus(str(bad), str(tmp_path / "fresh"),
                                 num_shards=2)
  assert sorted(os.listdir(tmp_path)) == ["corpus.csv", "corpus.jsonl.gz",
                                          "out"]


def test_annotated_document_sentences_with_spans():
  doc = _doc("T", "Bob met Ann. Zoë left.", ["Bob met Ann.", "Zoë left."],
             ["Bob", "Ann", "Zoë"])
  got = [(i, s.decode("utf-8"), [s[a:b].decode("utf-8") for a, b in spans])
         for i, s, spans in doc.sentences_with_spans()]
  assert got == [(0, "Bob met Ann.", ["Bob", "Ann"]), (1, "Zoë left.", ["Zoë"])]
  assert np.all(np.diff(doc.span_byte_starts) > 0)

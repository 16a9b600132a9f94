"""SQuAD-format JSON: questions -> open-QA examples, paragraphs -> corpus.

Reads the SQuAD v1.1 shape (also v2.0's, whose unanswerable questions are
skipped and counted):

    {"data": [{"title": "Super_Bowl_50",
               "paragraphs": [{"context": "...",
                               "qas": [{"id": "...", "question": "...",
                                        "answers": [{"text": "...",
                                                     "answer_start": 177},
                                                    ...]}]}]}]}

Other keys are ignored (and never copied to the outputs). For open-domain
QA (SQuAD-open, as in DrQA, ORQA and REALM), each question becomes a
`qa.QAExample` with ALL its answers (each distinct text once, in order) and
keeps the identity of its gold paragraph (`SquadQuestion.paragraph_id`,
"<raw title>#<paragraph index>"); each paragraph becomes a corpus document
(`SquadParagraph`) whose title is the article's display title (the raw
title with "_" as spaces and %-escapes decoded: "Fresno,_California" ->
"Fresno, California") and whose text is the context as it is.

Written as JSONL, the paragraphs are what the corpus job reads
(`{"title", "text", "id"}`; it ignores "id") and the questions are ORQA
JSONL (`{"question", "answer", "id", "article", "paragraph_id"}`, which
`qa.read_qa_jsonl` reads, ignoring the other keys; `read_questions_jsonl`
keeps them). `paragraph_blocks` finds each paragraph's blocks in a block
store built from any corpus that includes them, for recall of a block from
the gold paragraph.

Malformed input raises `SquadFormatError` naming the file and the field
(e.g. `dev.json: data[3].paragraphs[2].qas[0].answers[1].text: ...`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.parse
from typing import Any, Iterable, Sequence

import numpy as np

from realm_jax.core import io_utils
from realm_jax.data import qa as qa_lib


class SquadFormatError(ValueError):
  """SQuAD-format input that cannot be read; names the file and field."""


@dataclasses.dataclass(frozen=True)
class SquadParagraph:
  """One paragraph: a corpus document.

  Attributes:
    id: "<raw article title>#<paragraph index>": the index among the
      paragraphs of that title (of one article, unless two share it).
    title: the article's display title (`display_title`).
    text: the paragraph's context, as it is.
  """
  id: str
  title: str
  text: str


@dataclasses.dataclass(frozen=True)
class SquadQuestion:
  """One question with its answers and where it was written from.

  Attributes:
    id: the question's SQuAD id.
    example: the open-QA example (question, every distinct answer).
    title: the display title of its article.
    paragraph_id: its gold paragraph's `SquadParagraph.id`.
  """
  id: str
  example: qa_lib.QAExample
  title: str
  paragraph_id: str


@dataclasses.dataclass
class SquadData:
  """What one SQuAD file holds.

  Attributes:
    paragraphs: every paragraph, in file order.
    questions: every answerable question, in file order.
    unanswerable: questions skipped because they have no answer (v2.0's
      `is_impossible`, or an empty answer list with that flag).
  """
  paragraphs: list[SquadParagraph]
  questions: list[SquadQuestion]
  unanswerable: int = 0


def display_title(raw: str) -> str:
  """A SQuAD title as Wikipedia shows it ("Sky_(United_Kingdom)" ->
  "Sky (United Kingdom)"; %-escapes decoded)."""
  return urllib.parse.unquote(raw).replace("_", " ").strip()


def _field(record: Any, key: str, kind: type, where: str, source: str):
  """`record[key]`, checked to be a `kind` (non-empty when a str)."""
  if not isinstance(record, dict):
    raise SquadFormatError(
        f"{source}: {where}: expected a JSON object, got "
        f"{type(record).__name__}.")
  if key not in record:
    raise SquadFormatError(
        f"{source}: {where}.{key}: missing (found keys {sorted(record)}); "
        "is this SQuAD-format JSON?")
  value = record[key]
  if not isinstance(value, kind) or (kind is str and not value.strip()):
    raise SquadFormatError(
        f"{source}: {where}.{key}: expected a non-empty "
        f"{kind.__name__}, got {value!r:.80}.")
  return value


def _answers(qa: dict[str, Any], context: str, where: str, source: str
             ) -> tuple[str, ...]:
  """Every distinct answer text of one question, in order; each must be
  found in its context (SQuAD answers are spans of it), and an
  `answer_start`, when given, must be a position in the context."""
  answers = _field(qa, "answers", list, where, source)
  texts = []
  for i, a in enumerate(answers):
    at = f"{where}.answers[{i}]"
    text = _field(a, "text", str, at, source)
    start = a.get("answer_start")
    if start is not None and (isinstance(start, bool) or not isinstance(
        start, int) or not 0 <= start < len(context)):
      raise SquadFormatError(
          f"{source}: {at}.answer_start: {start!r:.40} is not a position "
          f"in the context (0 to {len(context) - 1}); fix or drop the "
          "answer.")
    if text not in context:
      raise SquadFormatError(
          f"{source}: {at}.text: {text!r:.80} does not occur in the "
          "paragraph's context; a SQuAD answer is a span of it (fix the "
          "answer or its context).")
    texts.append(text)
  return tuple(dict.fromkeys(texts))


def _questions(paragraph: dict[str, Any], paragraph_id: str, title: str,
               where: str, source: str, data: SquadData,
               seen: dict[str, str]) -> None:
  """The questions of one paragraph, appended to `data` (`seen`: where
  each question id occurred first)."""
  context = paragraph["context"]
  for j, qa in enumerate(_field(paragraph, "qas", list, where, source)):
    at = f"{where}.qas[{j}]"
    question = _field(qa, "question", str, at, source)
    qid = _field(qa, "id", str, at, source)
    if qid in seen:
      raise SquadFormatError(
          f"{source}: {at}.id: question id {qid!r:.80} is also the id of "
          f"{seen[qid]}; ids must be unique.")
    seen[qid] = at
    if qa.get("is_impossible") is True:
      data.unanswerable += 1
      continue
    answers = _answers(qa, context, at, source)
    if not answers:
      raise SquadFormatError(
          f"{source}: {at}.answers: empty, and the question is not marked "
          "is_impossible; give it an answer or drop it.")
    data.questions.append(SquadQuestion(
        id=qid, example=qa_lib.QAExample(question=question, answers=answers,
                                         paragraph_id=paragraph_id),
        title=title, paragraph_id=paragraph_id))


def parse_squad(record: Any, source: str) -> SquadData:
  """Reads a parsed SQuAD-format JSON object.

  Args:
    record: the JSON object (its "data" list is read).
    source: the file it came from, for the messages.

  Returns:
    The paragraphs and questions, in file order.

  Raises:
    SquadFormatError: a missing or mistyped field (named), or a duplicate
      question id.
  """
  data = SquadData(paragraphs=[], questions=[])
  articles = _field(record, "data", list, "(top level)", source)
  seen: dict[str, str] = {}
  # Paragraphs counted per raw title: two articles of one title number
  # their paragraphs on, so that every paragraph id is distinct (questions
  # and `paragraph_blocks` key on it).
  numbered: dict[str, int] = {}
  for a, article in enumerate(articles):
    where = f"data[{a}]"
    raw_title = _field(article, "title", str, where, source)
    title = display_title(raw_title)
    for p, paragraph in enumerate(
        _field(article, "paragraphs", list, where, source)):
      at = f"{where}.paragraphs[{p}]"
      paragraph_id = f"{raw_title}#{numbered.get(raw_title, 0)}"
      numbered[raw_title] = numbered.get(raw_title, 0) + 1
      data.paragraphs.append(SquadParagraph(
          id=paragraph_id, title=title,
          text=_field(paragraph, "context", str, at, source)))
      _questions(paragraph, paragraph_id, title, at, source, data, seen)
  return data


def loads_squad(text: str | bytes, source: str) -> SquadData:
  """`parse_squad` of JSON text (e.g. a member read out of an archive).

  Raises:
    SquadFormatError: not JSON, not UTF-8, or malformed (see
      `parse_squad`).
  """
  try:
    record = json.loads(text)
  except UnicodeDecodeError as e:
    raise SquadFormatError(f"{source}: not UTF-8 ({e}).") from None
  except RecursionError:
    raise SquadFormatError(
        f"{source}: its JSON is nested too deeply to read (thousands of "
        "levels; SQuAD needs six): not SQuAD-format JSON.") from None
  except json.JSONDecodeError as e:
    raise SquadFormatError(f"{source}: invalid JSON ({e.msg} at line "
                           f"{e.lineno} column {e.colno}).") from None
  return parse_squad(record, source)


def read_squad(path: io_utils.PathLike) -> SquadData:
  """Reads a SQuAD-format JSON file (local or gs://)."""
  path = os.fspath(path)
  with io_utils.as_path(path).open("rb") as f:
    return loads_squad(f.read(), path)


# ----------------------------------------------------------------- JSONL


def corpus_lines(paragraphs: Iterable[SquadParagraph]) -> str:
  """Corpus-job JSONL: `{"title", "text", "id"}` a line."""
  return "".join(json.dumps({"title": p.title, "text": p.text, "id": p.id},
                            ensure_ascii=False) + "\n" for p in paragraphs)


def question_lines(questions: Iterable[SquadQuestion]) -> str:
  """ORQA JSONL with the gold paragraph: `{"question", "answer", "id",
  "article", "paragraph_id"}` a line."""
  return "".join(json.dumps({
      "question": q.example.question, "answer": list(q.example.answers),
      "id": q.id, "article": q.title, "paragraph_id": q.paragraph_id},
                            ensure_ascii=False) + "\n" for q in questions)


def read_paragraphs_jsonl(path: io_utils.PathLike) -> list[SquadParagraph]:
  """Reads `corpus_lines`' JSONL back.

  Raises:
    SquadFormatError: a line without a string "id", "title" or "text".
  """
  path = os.fspath(path)
  out = []
  for number, line in enumerate(io_utils.read_text(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise SquadFormatError(f"{path}: line {number}: invalid JSON "
                             f"({e.msg}).") from None
    where = f"line {number}"
    out.append(SquadParagraph(*(_field(record, key, str, where, path)
                                for key in ("id", "title", "text"))))
  return out


def read_questions_jsonl(path: io_utils.PathLike) -> list[SquadQuestion]:
  """Reads `question_lines`' JSONL back, strictly.

  Raises:
    qa.QADataError: a line that is not an ORQA QA line (named by number).
    SquadFormatError: a line without "id", "article" or "paragraph_id".
  """
  path = os.fspath(path)
  examples = qa_lib.read_qa_jsonl(path, strict=True)
  out = []
  lines = [line for line in io_utils.read_text(path).splitlines()
           if line.strip()]
  for number, (line, example) in enumerate(zip(lines, examples), start=1):
    record = json.loads(line)
    where = f"line {number}"
    out.append(SquadQuestion(
        id=_field(record, "id", str, where, path), example=example,
        title=_field(record, "article", str, where, path),
        paragraph_id=_field(record, "paragraph_id", str, where, path)))
  return out


# ----------------------------------------------------------------- blocks


def _squeezed(text: str) -> str:
  # Without any whitespace: a long sentence cut between two blocks may be
  # cut where the text has none ("BWV 38" | ", later").
  return "".join(text.split())


def paragraph_blocks(store, paragraphs: Sequence[SquadParagraph]
                     ) -> dict[str, np.ndarray]:
  """The block ids of each paragraph in a block store.

  A store document is a paragraph's when it has the paragraph's title and
  its blocks' texts, joined, are the paragraph's text (whitespace
  ignored: blocks cover every non-whitespace character of a document).
  The store may hold other documents too (e.g. other articles' leads).
  Paragraphs with the same title and text share their blocks.

  Args:
    store: a `block_store.BlockStore`.
    paragraphs: the paragraphs to find.

  Returns:
    {paragraph id: int64 block ids, ascending}.

  Raises:
    ValueError: a paragraph is not in the store (naming how many and the
      first), e.g. the corpus job skipped it or the store was built from
      other data.
  """
  wanted: dict[tuple[str, str], list[str]] = {}
  for p in paragraphs:
    wanted.setdefault((p.title, _squeezed(p.text)), []).append(p.id)
  offsets = store.doc_block_offsets
  found: dict[str, np.ndarray] = {}
  for d in range(store.num_documents):
    lo, hi = int(offsets[d]), int(offsets[d + 1])
    key = (store.title(lo), "".join(_squeezed(store.text(b))
                                    for b in range(lo, hi)))
    for paragraph_id in wanted.get(key, ()):
      found[paragraph_id] = np.arange(lo, hi, dtype=np.int64)
  missing = [p.id for p in paragraphs if p.id not in found]
  if missing:
    raise ValueError(
        f"{len(missing)} of {len(paragraphs)} paragraphs are not in the "
        f"block store {store.path} (first: {missing[0]!r}); build the store "
        "from a corpus that includes them (see its dropped.jsonl for "
        "skipped documents).")
  return found

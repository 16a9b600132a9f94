"""Open-domain QA data: reading, answer matching and gold spans.

Everything fine-tuning and evaluation need to know about QA examples
(REALM's open-domain QA fine-tuning, summarised in BUILD.md):

- `read_qa_jsonl` reads the ORQA JSONL format, one
  `{"question": str, "answer": [str, ...]}` per line (NQ-Open, WebQuestions,
  CuratedTrec resplits). Malformed lines are skipped and counted in a
  `QAReadReport` (file and line number logged), or raise with `strict=True`.
- `normalize_answer` / `exact_match` / `regex_match` reproduce the reference
  evaluation (`language/orqa/utils/eval_utils.py`) exactly, so our numbers
  compare with the published ones:
    * punctuation is `string.punctuation` (ASCII) only, removed AFTER Unicode
      NFD and lower-casing. Unicode punctuation (curly quotes, dashes) and
      combining accents survive: "Zürich" != "Zurich", but the NFC and NFD
      spellings of "Zürich" are equal. This is the reference's (and DrQA's /
      SQuAD's) behaviour; a "fairer" normaliser would make our exact match
      incomparable with the published REALM / ORQA exact-match tables.
    * CuratedTrec: `re.match` of the pattern (IGNORECASE | UNICODE |
      MULTILINE) on the raw, un-normalised prediction: the pattern must match
      at the START of the prediction, not the whole of it ("1990s" is right
      for the pattern "1990"). An invalid pattern scores False, as in the
      reference; `read_qa_jsonl` refuses such patterns up front.
- `has_answer` marks retrieved blocks as positives for the retriever loss;
  `gold_spans` / `gold_spans_batch` find the reader's positive spans as
  occurrences of an answer's wordpieces in a block's wordpieces.

Run `python -m realm_jax.data.qa PATH... [--regex_answers]` to check files
and print their report.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import string
import unicodedata
from typing import Iterable, NamedTuple, Sequence

from absl import logging
import numpy as np

from realm_jax.core import checks

# Malformed lines logged one by one per file; the rest only counted.
_MAX_LOGGED_MALFORMED = 20
# Malformed (file, line, reason) entries kept in a report.
_MAX_REPORTED_MALFORMED = 1000


class QADataError(ValueError):
  """A QA data file or record is unusable (strict mode, missing files)."""


@dataclasses.dataclass(frozen=True)
class QAExample:
  """One open-domain QA example.

  Attributes:
    question: the question text.
    answers: reference answers; regular expressions when `is_regex`.
    is_regex: True for CuratedTrec-style regular-expression answers.
    paragraph_id: the question's gold paragraph (SQuAD's), if known: the
      eval reports gold-paragraph recall when the block store carries
      paragraph ids (a corpus built with `input_format="squad"`).
  """
  question: str
  answers: tuple[str, ...]
  is_regex: bool = False
  paragraph_id: str | None = None

  def __post_init__(self):
    if not isinstance(self.question, str):
      raise TypeError(
          f"QAExample.question must be a str, got {type(self.question)}.")
    if isinstance(self.answers, str) or not isinstance(
        self.answers, (tuple, list)):
      raise TypeError(
          "QAExample.answers must be a tuple of strings (wrap a single answer "
          f"as (answer,)), got {type(self.answers).__name__}.")
    # A list is accepted for convenience; stored as a tuple to stay hashable.
    object.__setattr__(self, "answers", tuple(self.answers))
    if not all(isinstance(a, str) for a in self.answers):
      raise TypeError(
          f"QAExample.answers must all be strings, got {self.answers!r}.")


@dataclasses.dataclass
class QAReadReport:
  """Counts from reading QA JSONL files; may accumulate over several files.

  Attributes:
    files: files read.
    lines: non-blank lines seen.
    blank_lines: blank lines skipped (not an error).
    examples: examples returned.
    malformed: lines skipped as malformed.
    malformed_lines: `(file, line_number, reason)` of the first malformed lines
      (at most 1000); line numbers start at 1.
  """
  files: list[str] = dataclasses.field(default_factory=list)
  lines: int = 0
  blank_lines: int = 0
  examples: int = 0
  malformed: int = 0
  malformed_lines: list[tuple[str, int, str]] = dataclasses.field(
      default_factory=list)


class _Malformed(Exception):
  """Internal: why one JSONL line is not a QA example."""


# The reference's flags; UNICODE is the default for str patterns in Python 3
# but spelled out to make the parity visible.
_ANSWER_FLAGS = re.IGNORECASE | re.UNICODE | re.MULTILINE


@functools.lru_cache(maxsize=65536)
def _compile_answer_pattern(pattern: str) -> re.Pattern[str] | None:
  """Compiled CuratedTrec pattern, or None when it is not a valid regex."""
  try:
    return re.compile(pattern, flags=_ANSWER_FLAGS)
  except re.error:
    return None


def _parse_qa_line(text: str, regex_answers: bool) -> QAExample:
  """Parses one JSONL line; raises _Malformed saying what is wrong."""
  try:
    record = json.loads(text)  # Input questions, not job output.
  except json.JSONDecodeError as e:
    raise _Malformed(f"invalid JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(record, dict):
    raise _Malformed(
        f"expected a JSON object, got {type(record).__name__}")
  for key in ("question", "answer"):
    if key not in record:
      raise _Malformed(
          f"missing key {key!r} (found keys {sorted(record)}); expected "
          '{"question": str, "answer": [str, ...]}')
  question, answers = record["question"], record["answer"]
  if not isinstance(question, str):
    raise _Malformed(
        f"'question' must be a string, got {type(question).__name__}")
  if not question.strip():
    raise _Malformed("'question' is empty")
  if checks.utf8_problem(question):  # E.g. JSON's "\\udcff".
    raise _Malformed(f"'question' is {checks.utf8_problem(question)}")
  if not isinstance(answers, list):
    raise _Malformed(
        f"'answer' must be a list of strings, got {type(answers).__name__}")
  if not answers:
    raise _Malformed("'answer' is an empty list")
  for a in answers:
    if not isinstance(a, str):
      raise _Malformed(
          f"'answer' must hold strings only, got {type(a).__name__} {a!r}")
    if not a.strip():
      raise _Malformed("'answer' holds an empty string")
    if checks.utf8_problem(a):
      raise _Malformed(f"answer '{checks.shown_bytes(a)}' is "
                       f"{checks.utf8_problem(a)}")
    if regex_answers:
      try:
        re.compile(a, flags=_ANSWER_FLAGS)
      except re.error as e:
        raise _Malformed(
            f"answer {a!r} is not a valid regular expression: {e}") from None
  paragraph_id = record.get("paragraph_id")
  if paragraph_id is not None and not isinstance(paragraph_id, str):
    raise _Malformed(f"'paragraph_id' must be a string, got "
                     f"{type(paragraph_id).__name__}")
  return QAExample(question=question, answers=tuple(answers),
                   is_regex=regex_answers, paragraph_id=paragraph_id)


def _open_binary(path: str):
  # Local files through the standard library (no TensorFlow import); remote
  # ones (gs://, ...) through tf.io.gfile, as on a TPU pod.
  if "://" in str(path):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.io.gfile.GFile(str(path), "rb")
  return open(path, "rb")


def _decode_line(raw: bytes, line_number: int) -> tuple[str | None,
                                                       str | None]:
  """(the line's text, None), or (None, why) if it is not UTF-8."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return None, f"invalid UTF-8 at byte {e.start}"
  if line_number == 1:
    # Files saved by some editors start with a byte-order mark.
    text = text.removeprefix("\ufeff")
  return text, None


def _note_malformed(report: QAReadReport, path: str, line_number: int,
                    reason: str, *, log: bool) -> None:
  """Counts a skipped line in `report` (and logs it if `log`)."""
  report.malformed += 1
  if len(report.malformed_lines) < _MAX_REPORTED_MALFORMED:
    report.malformed_lines.append((path, line_number, reason))
  if log:
    logging.warning("%s:%d: skipping malformed QA line: %s", path,
                    line_number, reason)


def read_qa_jsonl(
    path: str,
    report: QAReadReport | None = None,
    *,
    regex_answers: bool = False,
    strict: bool = False,
) -> list[QAExample]:
  """Reads an ORQA JSONL file into QA examples.

  Args:
    path: JSONL file, one `{"question": str, "answer": [str, ...]}` per line.
    report: if given, counts (lines, examples, malformed with line numbers)
      are added to it.
    regex_answers: answers are regular expressions (CuratedTrec); each is
      compiled and an invalid one makes its line malformed.
    strict: raise on the first malformed line instead of skipping it.

  Returns:
    The well-formed examples in file order.

  Raises:
    QADataError: in strict mode, for a malformed line (bad JSON, missing keys,
      wrong types, empty answer list, invalid UTF-8, invalid regex; names
      file and line).
    FileNotFoundError: if the file does not exist.
  """
  report = report if report is not None else QAReadReport()
  path = str(path)
  report.files.append(path)
  examples, malformed_here = [], 0
  with _open_binary(path) as f:
    for line_number, raw in enumerate(f, start=1):
      text, reason = _decode_line(raw, line_number)
      if text is not None and not text.strip():
        report.blank_lines += 1
        continue
      report.lines += 1
      if text is not None:
        try:
          example = _parse_qa_line(text, regex_answers)
        except _Malformed as e:
          reason = str(e)
        else:
          report.examples += 1
          examples.append(example)
          continue
      if strict:
        raise QADataError(
            f"{path}:{line_number}: {reason}. Fix or delete the line, or read "
            "with strict=False to skip malformed lines.")
      malformed_here += 1
      _note_malformed(report, path, line_number, reason,
                      log=malformed_here <= _MAX_LOGGED_MALFORMED)
  if malformed_here:
    logging.warning("%s: skipped %d malformed line(s); see the returned "
                    "QAReadReport for their line numbers.", path,
                    malformed_here)
  return examples


# ---------------------------------------------------------------- evaluation

# str.translate runs in C; the reference's per-character `ch not in exclude`
# loop removes the same set of characters.
_PUNCTUATION_TO_NOTHING = str.maketrans("", "", string.punctuation)
_PUNCTUATION_TO_SPACE = str.maketrans(
    string.punctuation, " " * len(string.punctuation))
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ARTICLE_WORDS = frozenset(("a", "an", "the"))
# ASCII characters that are neither whitespace nor word characters once
# string.punctuation is gone: control codes (\x1c-\x1f count as whitespace).
_ASCII_NON_WORD_NON_SPACE = re.compile(r"[\x00-\x08\x0e-\x1b\x7f]")


def normalize_answer(s: str) -> str:
  """Normalises an answer exactly like the reference ORQA/REALM evaluation.

  Unicode NFD, lower case, remove ASCII punctuation (`string.punctuation`),
  replace the whole words a/an/the by a space, collapse whitespace. Accents
  are not removed (NFD splits them into combining marks that stay).

  Args:
    s: answer or prediction text.

  Returns:
    The normalised text.
  """
  s = unicodedata.normalize("NFD", s).lower().translate(_PUNCTUATION_TO_NOTHING)
  if s.isascii() and not _ASCII_NON_WORD_NON_SPACE.search(s):
    # Fast path, same result (the regex is 2/3 of the cost and blocks are
    # normalised by the thousand in has_answer): with only letters, digits
    # and whitespace left, \b falls exactly on whitespace, so the regex
    # removes whole whitespace-separated tokens.
    return " ".join(w for w in s.split() if w not in _ARTICLE_WORDS)
  return " ".join(_ARTICLES.sub(" ", s).split())


def _as_answer_tuple(answers: str | Iterable[str]) -> tuple[str, ...]:
  # A bare string would otherwise be iterated character by character.
  return (answers,) if isinstance(answers, str) else tuple(answers)


def exact_match(prediction: str, answers: str | Iterable[str]) -> bool:
  """True when the normalised prediction equals a normalised answer.

  Args:
    prediction: predicted answer text.
    answers: reference answers (max over them); a single string is allowed.

  Returns:
    Whether any reference matches; False for no references.
  """
  normalized = normalize_answer(prediction)
  return any(normalized == normalize_answer(a)
             for a in _as_answer_tuple(answers))


def regex_match(prediction: str, patterns: str | Iterable[str]) -> bool:
  """CuratedTrec correctness: a pattern matches at the start of the prediction.

  Like the reference: `re.match` (anchored at the start, not a full match),
  case-insensitive, on the raw prediction; an invalid pattern never matches.

  Args:
    prediction: predicted answer text.
    patterns: reference regular expressions; a single string is allowed.

  Returns:
    Whether any pattern matches.
  """
  return any(p is not None and p.match(prediction) is not None
             for p in map(_compile_answer_pattern, _as_answer_tuple(patterns)))


def is_correct(prediction: str, answers: Iterable[str],
               is_regex: bool = False) -> bool:
  """Exact match, or regex match for CuratedTrec-style answers."""
  return (regex_match if is_regex else exact_match)(prediction, answers)


# ---------------------------------------------------------------- has answer


def _split_normalize(s: str) -> str:
  """NFD, lower case, ASCII punctuation -> space, collapse whitespace."""
  s = unicodedata.normalize("NFD", s).lower()
  return " ".join(s.translate(_PUNCTUATION_TO_SPACE).split())


class _AnswerMatcher:
  """Pre-normalised answers, checked against many block texts."""

  def __init__(self, answers: Iterable[str], is_regex: bool):
    self.is_regex = is_regex
    answers = _as_answer_tuple(answers)
    if is_regex:
      self.patterns = [p for p in map(_compile_answer_pattern, answers)
                       if p is not None]
      return
    # Two views of each answer, padded with spaces so that `in` only matches
    # whole tokens. Deleting punctuation (the evaluation's normalisation)
    # lets "US" find "U.S."; turning it into spaces lets "Obama" find
    # "Obama's" and "art" find "art/science". Empty answers (e.g. "the")
    # would match every block and are dropped.
    self.deleted = [f" {a} " for a in map(normalize_answer, answers) if a]
    self.spaced = [f" {a} " for a in map(_split_normalize, answers) if a]

  def __call__(self, block_text: str) -> bool:
    if self.is_regex:
      return any(p.search(block_text) is not None for p in self.patterns)
    deleted = f" {normalize_answer(block_text)} "
    if any(a in deleted for a in self.deleted):
      return True
    spaced = f" {_split_normalize(block_text)} "
    return any(a in spaced for a in self.spaced)


def has_answer(block_text: str, answers: str | Iterable[str],
               is_regex: bool = False) -> bool:
  """Whether a block contains an answer (a positive for the retriever loss).

  Text answers: the normalised answer occurs in the normalised block on token
  boundaries ("art" is not found in "start"). Two normalisations are tried:
  the evaluation's (punctuation deleted: "US" finds "U.S.") and one with
  punctuation turned into spaces and articles kept ("Obama" finds
  "Obama's"). The reference ORQA op is a raw case-sensitive substring test
  without token boundaries; this is the DrQA/DPR-style stricter test.
  Regex answers: `re.search` anywhere in the raw block, case-insensitive.

  Args:
    block_text: the block's text.
    answers: reference answers (or patterns); a single string is allowed.
    is_regex: answers are regular expressions.

  Returns:
    True when some answer is found.
  """
  return _AnswerMatcher(answers, is_regex)(block_text)


def has_answer_batch(block_texts: Sequence[str],
                     answers: str | Iterable[str],
                     is_regex: bool = False) -> np.ndarray:
  """`has_answer` for many blocks of one question; bool array [num_blocks]."""
  matcher = _AnswerMatcher(answers, is_regex)
  return np.fromiter((matcher(t) for t in block_texts), dtype=bool,
                     count=len(block_texts))


# ---------------------------------------------------------------- gold spans


class GoldSpans(NamedTuple):
  """Reader positives for a batch of blocks.

  Attributes:
    starts: int32 [num_blocks, max_spans], inclusive start positions, -1 pad.
    ends: int32 [num_blocks, max_spans], inclusive end positions, -1 pad.
    has_answer: bool [num_blocks], some answer occurs (before any truncation
      to `max_spans`).
  """
  starts: np.ndarray
  ends: np.ndarray
  has_answer: np.ndarray


def tokenize_answers(tokenizer, answers: Sequence[str]) -> list[np.ndarray]:
  """Wordpiece ids of each answer (one batched tokenizer call).

  Args:
    tokenizer: a `realm_jax.data.tokenizer.Tokenizer`.
    answers: answer strings.

  Returns:
    One int64 array per answer.
  """
  return tokenizer.tokenize(list(answers)) if answers else []


def continuation_piece_mask(tokenizer) -> np.ndarray:
  """bool [vocab_size]: True for '##' continuation wordpieces.

  Pass it to `gold_spans_batch` to refuse spans that end inside a word.
  """
  return np.array([piece.startswith("##") for piece in tokenizer.vocab])


def gold_spans_batch(
    block_token_ids: np.ndarray,
    answer_token_ids: Sequence[Sequence[np.ndarray]],
    *,
    max_span_width: int = 10,
    token_mask: np.ndarray | None = None,
    continuation_mask: np.ndarray | None = None,
    max_spans: int | None = None,
) -> GoldSpans:
  """Every occurrence of an answer's wordpieces in each block, vectorised.

  A gold span is `(start, end)`, end inclusive, where
  `block_token_ids[b, start:end + 1]` equals the wordpieces of one of row b's
  answers and the width `end - start + 1` is at most `max_span_width` (wider
  answers can never be predicted). Spans are sorted by (start, end) and
  deduplicated (two answers with equal wordpieces give one span). With a
  large `max_span_width`, `has_answer` is a token-level has-answer test for
  thousands of stored blocks without detokenising them.

  Args:
    block_token_ids: int [num_blocks, seq_len] wordpiece ids (padding must not
      be a wordpiece of an answer, e.g. [PAD]=0).
    answer_token_ids: for each block row, the wordpiece id arrays of its
      question's answers (`tokenize_answers`); for one question's top-k
      blocks pass `[answer_ids] * k`.
    max_span_width: widest span kept.
    token_mask: optional bool [num_blocks, seq_len]; spans must lie where it
      is True (e.g. the document part of a reader input `[CLS] q [SEP] z
      [SEP]`). Positions stay those of `block_token_ids`.
    continuation_mask: optional bool [vocab_size] (`continuation_piece_mask`);
      when given, a span may not be followed by a '##' piece, so "star" is
      not found in "star ##light". Default: every occurrence, as the
      reference does.
    max_spans: pad/truncate the span axis to this size (static shapes for
      jit); default: the largest count in the batch.

  Returns:
    GoldSpans(starts, ends, has_answer).

  Raises:
    ValueError: on mismatched shapes.
  """
  ids = np.asarray(block_token_ids)
  if ids.ndim != 2:
    raise ValueError(
        f"block_token_ids must be [num_blocks, seq_len], got shape {ids.shape}"
        "; use gold_spans() for one block.")
  num_blocks, seq_len = ids.shape
  if len(answer_token_ids) != num_blocks:
    raise ValueError(
        f"answer_token_ids has {len(answer_token_ids)} rows but there are "
        f"{num_blocks} blocks; pass one answer list per block row "
        "([answer_ids] * num_blocks for blocks of one question).")
  if max_span_width < 1:
    raise ValueError(f"max_span_width must be >= 1, got {max_span_width}.")
  mask_cumsum, followed_by_piece = _span_filters(ids, token_mask,
                                                 continuation_mask)
  by_length = _answers_by_length(answer_token_ids,
                                 min(max_span_width, seq_len))
  rows, starts, widths = _match_spans(ids, by_length, mask_cumsum,
                                      followed_by_piece, max_span_width)
  return _padded_spans(rows, starts, widths, num_blocks, max_spans)


def _span_filters(
    ids: np.ndarray, token_mask: np.ndarray | None,
    continuation_mask: np.ndarray | None,
) -> tuple[np.ndarray | None, np.ndarray | None]:
  """Checks `token_mask`; precomputes what `_match_spans` filters with.

  Returns:
    (mask_cumsum, followed_by_piece): the int64 [num_blocks, seq_len + 1]
    prefix sums of `token_mask` (None without one), and the bool
    [num_blocks, seq_len] positions whose next token continues their word
    (None without `continuation_mask`).

  Raises:
    ValueError: if `token_mask` is not shaped like `ids`.
  """
  num_blocks = ids.shape[0]
  mask_cumsum = followed_by_piece = None
  if token_mask is not None:
    token_mask = np.asarray(token_mask, bool)
    if token_mask.shape != ids.shape:
      raise ValueError(
          f"token_mask has shape {token_mask.shape}, expected {ids.shape}.")
    # Prefix sums give the number of masked-in tokens of any window in O(1).
    mask_cumsum = np.concatenate(
        [np.zeros((num_blocks, 1), np.int64), np.cumsum(token_mask, 1)], 1)
  if continuation_mask is not None:
    continuation_mask = np.asarray(continuation_mask, bool)
    # followed_by_piece[b, i]: token i+1 exists and continues token i's word.
    followed_by_piece = np.zeros(ids.shape, bool)
    followed_by_piece[:, :-1] = continuation_mask[ids[:, 1:]]
    if token_mask is not None:
      followed_by_piece[:, :-1] &= token_mask[:, 1:]
  return mask_cumsum, followed_by_piece


def _answers_by_length(
    answer_token_ids: Sequence[Sequence[np.ndarray]], max_width: int,
) -> dict[int, tuple[list[int], list[np.ndarray]]]:
  """Groups the answers by wordpiece length so each length is one vector op.

  Returns:
    by_length[m] = (block rows, answer ids each [m]) for 1 <= m <= max_width.
  """
  by_length: dict[int, tuple[list[int], list[np.ndarray]]] = {}
  for row, answers in enumerate(answer_token_ids):
    for answer in answers:
      answer = np.asarray(answer).reshape(-1)
      m = answer.shape[0]
      if 1 <= m <= max_width:
        rows, arrays = by_length.setdefault(m, ([], []))
        rows.append(row)
        arrays.append(answer)
  return by_length


def _match_spans(
    ids: np.ndarray, by_length: dict[int, tuple[list[int], list[np.ndarray]]],
    mask_cumsum: np.ndarray | None, followed_by_piece: np.ndarray | None,
    max_span_width: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every occurrence of the answers `by_length` in the rows of `ids`.

  Returns:
    int64 (rows, starts, widths) of the spans, sorted by (row, start,
    width), without duplicates.
  """
  seq_len = ids.shape[1]
  found_rows, found_starts, found_widths = [], [], []
  for m, (rows, arrays) in by_length.items():
    rows = np.asarray(rows)
    answers = np.stack(arrays)  # [n, m]
    num_windows = seq_len - m + 1
    # match[i, s]: answer i equals row rows[i] at positions s..s+m-1. One
    # comparison per answer position keeps memory at [n, num_windows].
    match = np.ones((len(rows), num_windows), bool)
    row_ids = ids[rows]  # [n, seq_len]
    for k in range(m):
      match &= row_ids[:, k:k + num_windows] == answers[:, k:k + 1]
    if mask_cumsum is not None:
      inside = mask_cumsum[rows, m:] - mask_cumsum[rows, :num_windows]
      match &= inside == m
    if followed_by_piece is not None:
      match &= ~followed_by_piece[rows, m - 1:]
    answer_index, start = np.nonzero(match)
    found_rows.append(rows[answer_index])
    found_starts.append(start)
    found_widths.append(np.full(start.shape, m))

  if not found_rows:
    return (np.zeros([0], np.int64),) * 3
  rows = np.concatenate(found_rows)
  starts = np.concatenate(found_starts).astype(np.int64)
  widths = np.concatenate(found_widths).astype(np.int64)
  # One sortable key per (row, start, width): np.unique sorts and dedups.
  key = (rows.astype(np.int64) * seq_len + starts) * (max_span_width + 1)
  key = np.unique(key + widths)
  widths = key % (max_span_width + 1)
  starts = (key // (max_span_width + 1)) % seq_len
  rows = key // (max_span_width + 1) // seq_len
  return rows, starts, widths


def _padded_spans(rows: np.ndarray, starts: np.ndarray, widths: np.ndarray,
                  num_blocks: int, max_spans: int | None) -> GoldSpans:
  """The sorted flat spans as `GoldSpans`, padded or cut to `max_spans`."""
  counts = np.bincount(rows, minlength=num_blocks)
  width = (max_spans if max_spans is not None else
           int(counts.max()) if num_blocks else 0)
  out_starts = np.full((num_blocks, width), -1, np.int32)
  out_ends = np.full((num_blocks, width), -1, np.int32)
  # Rank of each span inside its row (`_match_spans` sorts the rows).
  row_offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rank = np.arange(rows.shape[0]) - row_offsets[rows] if rows.size else rows
  keep = rank < width
  out_starts[rows[keep], rank[keep]] = starts[keep]
  out_ends[rows[keep], rank[keep]] = (starts + widths - 1)[keep]
  return GoldSpans(out_starts, out_ends, counts > 0)


def gold_spans(
    block_token_ids: np.ndarray,
    answer_token_id_lists: Sequence[np.ndarray],
    max_span_width: int = 10,
    *,
    continuation_mask: np.ndarray | None = None,
) -> list[tuple[int, int]]:
  """Gold spans of one block: occurrences of an answer's wordpieces.

  Args:
    block_token_ids: int [seq_len] wordpiece ids of the block.
    answer_token_id_lists: wordpiece ids of each answer (`tokenize_answers`).
    max_span_width: widest span kept.
    continuation_mask: see `gold_spans_batch`.

  Returns:
    Sorted, distinct `(start, end)` pairs, end inclusive.
  """
  ids = np.asarray(block_token_ids).reshape(1, -1)
  result = gold_spans_batch(ids, [answer_token_id_lists],
                            max_span_width=max_span_width,
                            continuation_mask=continuation_mask)
  return [(int(s), int(e)) for s, e in zip(result.starts[0], result.ends[0])
          if s >= 0]


# ---------------------------------------------------------------- main


def _check_job(dry_run: bool, paths: Sequence[str]) -> None:
  """`gin_cli.run`'s job: checks QA JSONL files and prints their report."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not paths:
    raise SystemExit("usage: python -m realm_jax.data.qa FILE.jsonl ... "
                     "[--regex_answers]")
  report = QAReadReport()
  for path in () if dry_run else paths:
    read_qa_jsonl(path, report, regex_answers=flags.FLAGS.regex_answers)
  print(json.dumps(dataclasses.asdict(report), indent=1))


if __name__ == "__main__":
  from absl import flags  # pylint: disable=g-import-not-at-top
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  flags.DEFINE_bool("regex_answers", False,
                    "Answers are regular expressions (CuratedTrec).")
  gin_cli.run(_check_job, positional_args=True, distributed=False)

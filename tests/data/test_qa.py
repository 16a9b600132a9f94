"""Tests for realm_jax.data.qa: reading, matching and gold spans."""

import json
import logging
import random
import re
import string
import unicodedata

import numpy as np
import pytest

from realm_jax.data import qa
from realm_jax.data import tokenizer as tokenizer_lib

# --------------------------------------------------------------- references


def reference_normalize(s):
  """Literal transcription of the ORQA/DrQA normaliser (per-char loop)."""
  s = unicodedata.normalize("NFD", s)
  s = s.lower()
  exclude = set(string.punctuation)
  s = "".join(ch for ch in s if ch not in exclude)
  s = re.sub(r"\b(a|an|the)\b", " ", s)
  return " ".join(s.split())


def brute_force_spans(ids, answers, max_width, mask=None, continuation=None):
  """Every (start, end) where ids[start:end+1] equals an answer."""
  spans = set()
  for answer in answers:
    answer = list(answer)
    m = len(answer)
    if m == 0 or m > max_width:
      continue
    for start in range(len(ids) - m + 1):
      if list(ids[start:start + m]) != answer:
        continue
      if mask is not None and not all(mask[start:start + m]):
        continue
      nxt = start + m
      if (continuation is not None and nxt < len(ids)
          and (mask is None or mask[nxt]) and continuation[ids[nxt]]):
        continue
      spans.add((start, start + m - 1))
  return sorted(spans)


# --------------------------------------------------------------- exact match

NFC_ZURICH = unicodedata.normalize("NFC", "Zürich")
NFD_ZURICH = unicodedata.normalize("NFD", "Zürich")


@pytest.mark.parametrize("prediction, answers, expected", [
    # NFD keeps the combining diaeresis (category Mn, not punctuation): the
    # reference does not strip accents.
    ("Zürich", ["Zurich"], False),
    # ... but composed and decomposed spellings are equal.
    (NFC_ZURICH, [NFD_ZURICH], True),
    (NFD_ZURICH, ["zürich"], True),
    ("The Beatles", ["beatles"], True),
    ("the beatles", ["Beatles!"], True),
    ("U.S.", ["US"], True),
    ("U.S.", ["U S"], False),
    ("  the   Eiffel\tTower \n", ["eiffel tower"], True),
    ("theater", ["ater"], False),
    ("the theater", ["Theater"], True),
    ("a dog", ["dog"], True),
    ("an apple", ["apple"], True),
    ("Anna", ["na"], False),
    ("Athens", ["thens"], False),
    # Punctuation goes before articles: "A-ha" -> "aha" keeps its "a".
    ("A-ha", ["aha"], True),
    # Only ASCII punctuation is removed, as in the reference.
    ("rock 'n' roll", ["rock n roll"], True),
    ("rock \u2019n\u2019 roll", ["rock n roll"], False),
    ("1,000", ["1000"], True),
    ("Paris", ["London", "paris"], True),
    ("Paris", "paris", True),  # A single string is one answer, not letters.
    ("p", "paris", False),
    ("Paris", [], False),
])
def test_exact_match_table(prediction, answers, expected):
  assert qa.exact_match(prediction, answers) is expected


def test_normalize_answer_examples():
  assert qa.normalize_answer("The  Theater of the Absurd!") == (
      "theater of absurd")
  assert qa.normalize_answer("An A a THE the") == ""
  assert qa.normalize_answer(NFC_ZURICH) == "zu\u0308rich"


def test_normalize_answer_matches_reference_transcription():
  rng = random.Random(0)
  alphabet = (list("abcdeht nAET.,'-!?()\"") +
              ["\u00fc", "\u00e9", "\u2019", "\u2013", "\u00a0", "\t",
               "\u0301", "\u0130", "\u00df", "\u201c", "\u212a", "\x00",
               "\x1c", "\x7f", "\x0b", "_"])
  words = ["the", "a", "an", "The", "AN", "theater", "U.S.", "Zürich", "ANNA"]
  ascii_alphabet = [c for c in alphabet if c.isascii()]
  ascii_words = [w for w in words if w.isascii()]
  num_ascii = 0
  for i in range(4000):
    # Half ASCII-only: normalize_answer takes its fast path on most of those.
    chars, vocab = ((ascii_alphabet, ascii_words) if i % 2 else
                    (alphabet, words))
    parts = [rng.choice(vocab) if rng.random() < 0.5 else
             "".join(rng.choice(chars) for _ in range(rng.randint(0, 6)))
             for _ in range(rng.randint(0, 6))]
    s = rng.choice([" ", "", "-", "  "]).join(parts)
    assert qa.normalize_answer(s) == reference_normalize(s), repr(s)
    num_ascii += s.isascii() and not re.search(r"[\x00-\x08\x0e-\x1b\x7f]", s)
  assert num_ascii > 1000


# --------------------------------------------------------------- regex match


@pytest.mark.parametrize("prediction, patterns, expected", [
    ("1990s", ["1990"], True),          # Match at the start is enough.
    ("in 1990", ["1990"], False),       # Not in the middle.
    ("PARIS", ["paris"], True),         # Case-insensitive.
    ("paris", ["PaRiS"], True),
    ("Paris, France", ["paris"], True),
    ("Paris, France", ["paris$"], False),
    ("George Washington", ["(George )?Washington"], True),
    ("Washington", ["(George )?Washington"], True),
    ("the Washington", ["(George )?Washington"], False),  # Not normalised.
    ("Zürich", ["z.rich"], True),
    ("x", ["(", "x"], True),            # Invalid pattern never matches...
    ("(", ["("], False),                # ...as in the reference.
    ("Paris", [], False),
    ("Paris", "par", True),
])
def test_regex_match_table(prediction, patterns, expected):
  assert qa.regex_match(prediction, patterns) is expected


def test_is_correct_dispatch():
  assert qa.is_correct("1990s", ["1990"], is_regex=True)
  assert not qa.is_correct("1990s", ["1990"], is_regex=False)
  assert qa.is_correct("The 1990", ["1990"], is_regex=False)


# --------------------------------------------------------------- has answer


@pytest.mark.parametrize("block, answers, is_regex, expected", [
    ("The art of war is old.", ["art"], False, True),
    ("Let us start now.", ["art"], False, False),     # Token boundary.
    ("Art.", ["art"], False, True),
    ("He painted art/science posters.", ["art"], False, True),
    ("born in the U.S. in 1990", ["US"], False, True),
    ("born in the US in 1990", ["U.S."], False, True),
    ("Obama's presidency began", ["Obama"], False, True),
    ("Obama's presidency began", ["Barack Obama"], False, False),
    ("The Beatles were a band", ["The Beatles"], False, True),
    ("Beatles were a band", ["the Beatles"], False, True),
    ("were a band", ["the"], False, False),           # Empty after norm.
    ("An entry in Zürich", [NFD_ZURICH], False, True),
    ("An entry in Zürich", ["Zurich"], False, False),
    ("theater tickets", ["the"], False, False),
    ("", ["x"], False, False),
    ("No answers here", [], False, False),
    ("He was born in 1990.", ["19[0-9]0"], True, True),  # Search anywhere.
    ("He was born in 1980.", ["19[0-9]1"], True, False),
    ("PARIS is big", ["paris"], True, True),
    ("Let us start", ["(", "art"], True, True),       # Raw regex search.
])
def test_has_answer_table(block, answers, is_regex, expected):
  assert qa.has_answer(block, answers, is_regex=is_regex) is expected


def test_has_answer_batch_equals_scalar():
  blocks = ["The art of war", "start now", "U.S. army", "Obama's plan",
            "nothing", "ART", "the us"]
  answers = ["art", "US", "obama"]
  expected = np.array([qa.has_answer(b, answers) for b in blocks])
  np.testing.assert_array_equal(qa.has_answer_batch(blocks, answers),
                                expected)
  np.testing.assert_array_equal(
      expected, [True, False, True, True, False, True, True])


# --------------------------------------------------------------- gold spans


def test_gold_spans_batch_matches_brute_force():
  rng = np.random.default_rng(0)
  vocab_size, num_blocks, seq_len, max_width = 6, 12, 40, 4
  ids = rng.integers(0, vocab_size, size=(num_blocks, seq_len))
  mask = rng.random((num_blocks, seq_len)) < 0.85
  continuation = np.array([False, False, True, False, True, False])
  answers = []
  for b in range(num_blocks):
    row = []
    for _ in range(rng.integers(0, 5)):
      m = int(rng.integers(1, 7))  # Some wider than max_width.
      if rng.random() < 0.6 and m <= seq_len:
        start = int(rng.integers(0, seq_len - m + 1))
        row.append(ids[b, start:start + m].copy())  # Surely occurs.
      else:
        row.append(rng.integers(0, vocab_size, size=m))
    if row and rng.random() < 0.3:
      row.append(row[0].copy())  # Duplicate answer: spans are deduplicated.
    answers.append(row)

  for kwargs in ({}, {"token_mask": mask},
                 {"continuation_mask": continuation},
                 {"token_mask": mask, "continuation_mask": continuation}):
    result = qa.gold_spans_batch(ids, answers, max_span_width=max_width,
                                 **kwargs)
    total = 0
    for b in range(num_blocks):
      row_mask = kwargs["token_mask"][b] if "token_mask" in kwargs else None
      expected = brute_force_spans(
          ids[b], answers[b], max_width, mask=row_mask,
          continuation=kwargs.get("continuation_mask"))
      got = [(int(s), int(e)) for s, e in zip(result.starts[b],
                                               result.ends[b]) if s >= 0]
      assert got == expected, (b, kwargs)
      assert result.has_answer[b] == bool(expected)
      # Padding is -1 on both arrays, after the real spans.
      assert np.all(result.starts[b, len(got):] == -1)
      assert np.all(result.ends[b, len(got):] == -1)
      total += len(expected)
    assert total > 0
    assert result.starts.shape[1] == max(
        len([s for s in row if s >= 0]) for row in result.starts)


def test_gold_spans_single_block_and_max_spans():
  ids = np.array([5, 1, 2, 1, 2, 3, 1, 2])
  answers = [np.array([1, 2]), np.array([2]), np.array([1, 2, 3, 4])]
  assert qa.gold_spans(ids, answers) == [
      (1, 2), (2, 2), (3, 4), (4, 4), (6, 7), (7, 7)]
  assert qa.gold_spans(ids, answers, max_span_width=1) == [
      (2, 2), (4, 4), (7, 7)]
  assert qa.gold_spans(ids, [np.array([9])]) == []

  result = qa.gold_spans_batch(np.stack([ids, ids]), [answers, []],
                               max_spans=3)
  assert result.starts.shape == (2, 3)
  np.testing.assert_array_equal(result.starts, [[1, 2, 3], [-1, -1, -1]])
  np.testing.assert_array_equal(result.ends, [[2, 2, 4], [-1, -1, -1]])
  np.testing.assert_array_equal(result.has_answer, [True, False])

  with pytest.raises(ValueError, match="one answer list per block row"):
    qa.gold_spans_batch(np.stack([ids, ids]), [answers])


@pytest.fixture(scope="module")
def tokenizer():
  return tokenizer_lib.Tokenizer()


def test_gold_spans_with_real_wordpieces(tokenizer):
  block = ("The art of starting: art in Paris (France) by Starlight, "
           "a star of the U.S. stage.")
  answers = ["art", "Paris", "star", "U.S."]
  block_ids = tokenizer.tokenize([block])[0]
  answer_ids = qa.tokenize_answers(tokenizer, answers)
  spans = qa.gold_spans(block_ids, answer_ids)
  texts = [tokenizer.decode(block_ids[s:e + 1]) for s, e in spans]
  assert texts.count("art") == 2  # Not inside "starting".
  assert "paris" in texts and "u . s ." in texts
  pieces = tokenizer.convert_ids_to_tokens(block_ids)
  assert "##light" in pieces  # "starlight" -> star ##light
  assert texts.count("star") == 2  # "star" of "star ##light" and "star".
  strict = qa.gold_spans(
      block_ids, answer_ids,
      continuation_mask=qa.continuation_piece_mask(tokenizer))
  strict_texts = [tokenizer.decode(block_ids[s:e + 1]) for s, e in strict]
  assert strict_texts.count("star") == 1
  assert sorted(set(spans) - set(strict)) == [
      (pieces.index("##light") - 1, pieces.index("##light") - 1)]


# --------------------------------------------------------------- reading


def _write_lines(path, lines):
  with open(path, "wb") as f:
    for line in lines:
      f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
      f.write(b"\n")


GOOD_1 = json.dumps({"question": "who wrote hamlet", "answer": ["Shakespeare"]})
GOOD_2 = json.dumps({"question": "capital of france?",
                     "answer": ["Paris", "paris, france"], "id": 7})


def test_read_qa_jsonl_skips_and_counts_malformed(tmp_path, caplog):
  path = tmp_path / "qa.jsonl"
  _write_lines(path, [
      "\ufeff" + GOOD_1,                                  # 1 BOM is fine
      '{"question": "no closing brace"',                  # 2 bad JSON
      json.dumps({"question": "q"}),                      # 3 missing answer
      json.dumps({"answer": ["a"]}),                      # 4 missing question
      json.dumps({"question": 5, "answer": ["a"]}),       # 5 wrong type
      json.dumps({"question": "q", "answer": "a"}),       # 6 not a list
      json.dumps({"question": "q", "answer": []}),        # 7 empty list
      json.dumps({"question": "q", "answer": ["a", 3]}),  # 8 non-string
      b'{"question": "caf\xe9", "answer": ["x"]}',        # 9 invalid UTF-8
      "",                                                 # 10 blank
      json.dumps(["question", "answer"]),                 # 11 not an object
      GOOD_2,                                             # 12
  ])
  report = qa.QAReadReport()
  with caplog.at_level(logging.WARNING):
    examples = qa.read_qa_jsonl(str(path), report)
  assert examples == [
      qa.QAExample("who wrote hamlet", ("Shakespeare",)),
      qa.QAExample("capital of france?", ("Paris", "paris, france")),
  ]
  assert report.examples == 2
  assert report.blank_lines == 1
  assert report.lines == 11
  assert report.malformed == 9
  assert [line for _, line, _ in report.malformed_lines] == [
      2, 3, 4, 5, 6, 7, 8, 9, 11]
  reasons = dict((line, reason) for _, line, reason in report.malformed_lines)
  assert "invalid JSON" in reasons[2]
  assert "'answer'" in reasons[3] and "'question'" in reasons[4]
  assert "empty list" in reasons[7]
  assert "UTF-8" in reasons[9]
  assert f"{path}:9" in caplog.text  # File and line number are logged.

  # A report accumulates over files.
  qa.read_qa_jsonl(str(path), report)
  assert report.examples == 4 and report.malformed == 18
  assert report.files == [str(path), str(path)]

  with pytest.raises(qa.QADataError, match=re.escape(f"{path}:2: invalid")):
    qa.read_qa_jsonl(str(path), strict=True)


def test_read_regex_answers(tmp_path):
  path = tmp_path / "CuratedTrec.jsonl"
  _write_lines(path, [
      json.dumps({"question": "when", "answer": ["19[0-9]0s?"]}),
      json.dumps({"question": "bad", "answer": ["ok", "(unclosed"]}),
  ])
  report = qa.QAReadReport()
  examples = qa.read_qa_jsonl(str(path), report, regex_answers=True)
  assert examples == [qa.QAExample("when", ("19[0-9]0s?",), is_regex=True)]
  assert report.malformed_lines[0][1] == 2
  assert "not a valid regular expression" in report.malformed_lines[0][2]
  with pytest.raises(qa.QADataError, match=re.escape(f"{path}:2:")):
    qa.read_qa_jsonl(str(path), regex_answers=True, strict=True)
  # Without regex_answers the same text is a plain answer.
  assert len(qa.read_qa_jsonl(str(path))) == 2


def test_qa_example_checks():
  assert qa.QAExample("q", ["a", "b"]).answers == ("a", "b")
  with pytest.raises(TypeError, match="tuple of strings"):
    qa.QAExample("q", "a")
  with pytest.raises(TypeError, match="strings"):
    qa.QAExample("q", ("a", 1))


def test_a_question_escaping_a_lone_surrogate_is_malformed(tmp_path):
  """Issue 64, H10: JSON can spell text that is not UTF-8 ("\\udcff", what
  Python makes of the byte 0xff); such a question or answer is a
  malformed line naming the file and line, not a crash of the tokenizer
  after the model loaded."""
  path = tmp_path / "qa.jsonl"
  _write_lines(path, [
      GOOD_1,
      b'{"question": "where was mozart\\udcff born", "answer": ["x"]}',
      b'{"question": "who", "answer": ["Salzb\\ud800urg"]}',
      GOOD_2])
  report = qa.QAReadReport()
  assert len(qa.read_qa_jsonl(str(path), report)) == 2
  reasons = dict((line, reason) for _, line, reason in report.malformed_lines)
  assert reasons == {
      2: "'question' is not valid UTF-8 (the byte 0xff at character 17)",
      3: "answer 'Salzb\\ud800urg' is not valid UTF-8 (a lone surrogate "
         "U+D800 at character 6)"}
  with pytest.raises(qa.QADataError, match=re.escape(f"{path}:2: 'question' "
                                                     "is not valid UTF-8")):
    qa.read_qa_jsonl(str(path), strict=True)

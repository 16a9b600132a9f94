"""Tests of realm_jax.data.squad (SQuAD-format JSON -> QA and corpus)."""

import json
import os

import pytest

from realm_jax.data import corpus_job
from realm_jax.data import qa
from realm_jax.data import squad

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                        "fixtures", "squad")


def _fixture(name):
  return os.path.join(FIXTURES, name)


def test_reads_questions_with_all_answers_and_gold_paragraphs():
  data = squad.read_squad(_fixture("tiny_v1.json"))
  assert [p.id for p in data.paragraphs] == [
      "Lake_Vostrel#0", "Lake_Vostrel#1", "Tallin%C3%A9_Fort,_Kessar#0"]
  assert [p.title for p in data.paragraphs] == [
      "Lake Vostrel", "Lake Vostrel", "Tallin\u00e9 Fort, Kessar"]
  assert data.paragraphs[1].text.startswith("The lake drains")
  first = data.questions[0]
  assert first.id == "q-vostrel-1"
  # Every distinct answer, in order; the repeated one once.
  assert first.example == qa.QAExample(
      "Who first mapped Lake Vostrel?",
      ("Ines Marlow", "the surveyor Ines Marlow"),
      paragraph_id="Lake_Vostrel#0")
  assert [q.paragraph_id for q in data.questions] == [
      "Lake_Vostrel#0", "Lake_Vostrel#0", "Lake_Vostrel#1",
      "Tallin%C3%A9_Fort,_Kessar#0"]
  assert data.questions[-1].title == "Tallin\u00e9 Fort, Kessar"
  assert data.unanswerable == 1  # v2.0's is_impossible is skipped


@pytest.mark.parametrize("name, field", [
    ("bad_answer_text.json", "data[0].paragraphs[0].qas[0].answers[1].text"),
    ("missing_context.json", "data[0].paragraphs[0].context"),
    ("truncated.json", "invalid JSON"),
])
def test_malformed_files_name_file_and_field(name, field):
  with pytest.raises(squad.SquadFormatError) as e:
    squad.read_squad(_fixture(name))
  assert name in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("record, message", [
    ({"version": "1.1"}, "(top level).data: missing"),
    ({"data": {"title": "x"}}, "(top level).data: expected a non-empty list"),
    ({"data": [{"title": "", "paragraphs": []}]}, "data[0].title"),
    ({"data": [{"title": "T", "paragraphs": [{"context": "c", "qas": [
        {"id": "a", "question": "q?", "answers": []}]}]}]},
     "data[0].paragraphs[0].qas[0].answers: empty"),
    ({"data": [{"title": "T", "paragraphs": [{"context": "c", "qas": [
        {"id": "a", "question": "q?", "answers": [{"text": "c"}]},
        {"id": "a", "question": "q2?", "answers": [{"text": "c"}]}]}]}]},
     "data[0].paragraphs[0].qas[1].id: question id 'a' is also the id of "
     "data[0].paragraphs[0].qas[0]; ids must be unique"),
    ({"data": [{"title": "T", "paragraphs": [{"context": "Paris is big.",
                                              "qas": [
        {"id": "a", "question": "q?", "answers": [
            {"text": "Paris", "answer_start": 0},
            {"text": "Lyon", "answer_start": 0}]}]}]}]},
     "data[0].paragraphs[0].qas[0].answers[1].text: 'Lyon' does not occur "
     "in the paragraph's context"),
    ({"data": [{"title": "T", "paragraphs": [{"context": "Paris is big.",
                                              "qas": [
        {"id": "a", "question": "q?", "answers": [
            {"text": "Paris", "answer_start": -1}]}]}]}]},
     "data[0].paragraphs[0].qas[0].answers[0].answer_start: -1 is not a "
     "position in the context (0 to 12)"),
])
def test_malformed_records(record, message):
  with pytest.raises(squad.SquadFormatError) as e:
    squad.parse_squad(record, "mem.json")
  assert str(e.value).startswith("mem.json: ")
  assert message in str(e.value)


def test_jsonl_round_trip(tmp_path):
  data = squad.read_squad(_fixture("tiny_v1.json"))
  path = tmp_path / "questions.jsonl"
  path.write_text(squad.question_lines(data.questions), encoding="utf-8")
  # The ORQA reader reads the same file (extra keys ignored).
  assert [e for e in qa.read_qa_jsonl(str(path), strict=True)] == [
      q.example for q in data.questions]
  assert squad.read_questions_jsonl(path) == data.questions
  lines = [json.loads(x) for x in squad.corpus_lines(
      data.paragraphs).splitlines()]
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text(squad.corpus_lines(data.paragraphs), encoding="utf-8")
  assert squad.read_paragraphs_jsonl(corpus) == data.paragraphs
  assert lines[2] == {"title": "Tallin\u00e9 Fort, Kessar",
                      "text": data.paragraphs[2].text,
                      "id": "Tallin%C3%A9_Fort,_Kessar#0"}


def test_read_questions_jsonl_needs_the_gold_paragraph(tmp_path):
  path = tmp_path / "q.jsonl"
  path.write_text('{"question": "q?", "answer": ["a"], "id": "1", '
                  '"article": "T"}\n')
  with pytest.raises(squad.SquadFormatError, match="line 1.paragraph_id"):
    squad.read_questions_jsonl(path)


def test_paragraph_blocks_in_a_store_with_other_documents(tmp_path):
  data = squad.read_squad(_fixture("tiny_v1.json"))
  # One sentence longer than a block, cut where the text has no space
  # ("mapped" | ",by").
  data.paragraphs.append(squad.SquadParagraph("Long#0", "Long", " ".join(
      f"lake{i},river{i},hill{i}" for i in range(12)) + "."))
  other = {"title": "Lake Vostrel", "text": "Lake Vostrel is a lake. " * 30}
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text(json.dumps(other) + "\n" +
                    squad.corpus_lines(data.paragraphs), encoding="utf-8")
  store, _ = corpus_job.build_corpus(input_path=str(corpus),
                                     output_dir=str(tmp_path / "store"),
                                     max_block_len=24)
  blocks = squad.paragraph_blocks(store, data.paragraphs)
  assert set(blocks) == {p.id for p in data.paragraphs}
  first_other = len(store.document_blocks(0))
  assert first_other > 1
  for p in data.paragraphs:
    ids = blocks[p.id]
    assert ids.min() >= first_other  # never the other "Lake Vostrel" doc
    assert "".join(store.text(int(b)) for b in ids).replace(" ", "") == \
        p.text.replace(" ", "")
  assert len(blocks["Lake_Vostrel#0"]) > 1  # 24 wordpieces: split
  missing = squad.SquadParagraph("X#0", "X", "Not in the store.")
  with pytest.raises(ValueError, match="1 of 5 paragraphs .* 'X#0'"):
    squad.paragraph_blocks(store, [*data.paragraphs, missing])


def test_articles_sharing_a_title_get_distinct_paragraph_ids():
  """Questions and `paragraph_blocks` key on paragraph ids: two articles of
  one title number their paragraphs on instead of repeating `T#0`."""
  article = {"title": "T", "paragraphs": [{"context": "Paris is big.",
                                           "qas": []}]}
  data = squad.parse_squad({"data": [article, dict(article, paragraphs=[
      {"context": "Lyon is old.", "qas": [
          {"id": "b", "question": "Which is old?",
           "answers": [{"text": "Lyon", "answer_start": 0}]}]}])]},
                           "mem.json")
  assert [p.id for p in data.paragraphs] == ["T#0", "T#1"]
  assert data.questions[0].paragraph_id == "T#1"


def test_deeply_nested_json_names_the_file(tmp_path):
  path = tmp_path / "deep.json"
  path.write_text("[" * 100000 + "]" * 100000)
  with pytest.raises(squad.SquadFormatError, match=f"{path}: its JSON is "
                     "nested too deeply"):
    squad.read_squad(str(path))

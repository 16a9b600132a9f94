"""Tests for the local-file tfds QA builders (realm_jax.data.tfds_qa)."""

import json

import pytest
import tensorflow_datasets as tfds

from realm_jax.data import tfds_qa


def _write_jsonl(path, rows, extra_lines=()):
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
    for line in extra_lines:
      f.write(line + "\n")


def _examples(builder, split):
  return [(ex["question"].decode(), [a.decode() for a in ex["answer"]])
          for ex in tfds.as_numpy(builder.as_dataset(split=split))]


def test_names_do_not_clash_with_tfds():
  names = tfds.list_builders()
  # tfds's own (downloading) builders are still there, ours beside them.
  assert "natural_questions_open" in names and "web_questions" in names
  for name in ("realm_natural_questions_open", "realm_web_questions",
               "realm_curated_trec"):
    assert name in names
    assert name in tfds_qa.BUILDERS


def test_round_trip_natural_questions_open(tmp_path):
  manual_dir = tmp_path / "manual"
  manual_dir.mkdir()
  train = [{"question": f"who is number {i}", "answer": [f"Person {i}"]}
           for i in range(7)]
  train.append({"question": "where is Zürich", "answer": ["Switzerland",
                                                           "CH"]})
  dev = [{"question": "capital of france", "answer": ["Paris"]}]
  _write_jsonl(manual_dir / "NaturalQuestions.resplit.train.jsonl", train,
               extra_lines=['{"question": "broken"', ""])
  _write_jsonl(manual_dir / "NaturalQuestions.resplit.dev.jsonl", dev)
  # No test file: that split is simply absent.

  data_dir = tmp_path / "tfds"
  builder = tfds_qa.prepare_qa_builder(
      "realm_natural_questions_open", manual_dir=str(manual_dir),
      data_dir=str(data_dir))
  assert set(builder.info.splits) == {"train", "validation"}
  assert builder.info.splits["train"].num_examples == len(train)
  # File order is kept (shuffling disabled) and the malformed line skipped.
  assert _examples(builder, "train") == [
      (r["question"], r["answer"]) for r in train]
  assert _examples(builder, "validation") == [("capital of france",
                                               ["Paris"])]

  # Loading by registered name from the prepared data_dir, without network.
  ds = tfds.load("realm_natural_questions_open", split="validation",
                 data_dir=str(data_dir), download=False)
  (example,) = list(tfds.as_numpy(ds))
  assert example["question"] == b"capital of france"
  assert list(example["answer"]) == [b"Paris"]


def test_curated_trec_skips_invalid_regex(tmp_path):
  manual_dir = tmp_path / "manual"
  manual_dir.mkdir()
  _write_jsonl(manual_dir / "CuratedTrec.resplit.test.jsonl", [
      {"question": "when", "answer": ["19[0-9]0s?"]},
      {"question": "bad", "answer": ["(unclosed"]},
  ])
  builder = tfds_qa.prepare_qa_builder(
      "realm_curated_trec", manual_dir=str(manual_dir),
      data_dir=str(tmp_path / "tfds"))
  assert set(builder.info.splits) == {"test"}
  assert _examples(builder, "test") == [("when", ["19[0-9]0s?"])]


def test_missing_files_name_the_expected_files(tmp_path):
  with pytest.raises(FileNotFoundError,
                     match=r"WebQuestions\.resplit\.train\.jsonl.*"
                     r"WebQuestions\.resplit\.dev\.jsonl"):
    tfds_qa.prepare_qa_builder("realm_web_questions",
                               manual_dir=str(tmp_path),
                               data_dir=str(tmp_path / "tfds"))
  with pytest.raises(ValueError, match="unknown QA builder"):
    tfds_qa.prepare_qa_builder("web_questions", manual_dir=str(tmp_path))

"""benchmarks/real_text.py end to end on a tiny data directory in
fetch_public.py's format (hand-written leads + the SQuAD fixture)."""

import dataclasses
import json
import os

import numpy as np
import pytest

from benchmarks import real_text
from realm_jax.testing import public_data


def test_bm25_and_minilm_rows(tmp_path, capsys):
  data = public_data.write_public_data(tmp_path / "data")
  output = tmp_path / "rows.jsonl"
  real_text.main([f"--data_dir={tmp_path / 'data'}",
                  f"--workdir={tmp_path / 'w'}", f"--output={output}",
                  "--max_block_len=24", "--tasks=squad,cloze"])
  rows = [json.loads(x) for x in output.read_text().splitlines()]
  assert [(r["task"], r["retriever"]) for r in rows] == [
      ("squad", "bm25"), ("cloze", "bm25"), ("squad", "minilm"),
      ("cloze", "minilm")]
  assert capsys.readouterr().out.count('"retriever"') == 4
  real_text.main([f"--table_from={output}"])
  table = capsys.readouterr().out.splitlines()
  assert len(table) == 2 + 4 and table[4].startswith("| squad | minilm | 4 |")
  real_text.main([f"--table_from={output}", f"--workdir={tmp_path / 'w'}",
                  "--paired=minilm"])
  # Every block is retrieved (9 < 100): no difference at 100.
  assert capsys.readouterr().out.splitlines()[-1].endswith(
      "@100 +0.0 +- 0.0")
  cloze = rows[1]
  assert cloze["questions"] == 1
  # BM25 finds the subject's lead (the only block with "Ines Marlow").
  assert cloze["recall@1"] == cloze["gold_recall@1"] == 1.0
  rows = [rows[0], rows[2]]
  for row in rows:
    assert row["questions"] == len(data.questions) == 4
    # The tiny corpus has fewer than 100 blocks: all are retrieved.
    assert row["recall@100"] == row["gold_recall@100"] == 1.0
    for k in (1, 5, 20):
      assert 0 <= row[f"recall@{k}"] <= row["recall@100"]
  predictions = [json.loads(x) for x in (
      tmp_path / "w" / "predictions" / "bm25.jsonl").read_text()
                 .splitlines()]
  assert predictions[0]["question"] == data.questions[0].example.question
  # The leads' index was extended by the SQuAD paragraphs' blocks.
  manifest = json.loads((tmp_path / "w" / "index_minilm_union" / "0" /
                         "manifest.json").read_text())
  vital = json.loads((tmp_path / "w" / "vital" / "manifest.json")
                     .read_text())
  assert manifest["extends"]["rows"] == vital["num_blocks"]
  assert manifest["new_rows"] > 0
  assert np.isclose(rows[0]["recall@1"], np.mean([
      p["retrieved_has_answer"][0] for p in predictions]))


def test_a_trained_checkpoint_is_ranked_through_the_extended_index(
    tmp_path, capsys):
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import Realm  # pylint: disable=g-import-not-at-top
  public_data.write_public_data(tmp_path / "data")
  # The default --gin_file: the vital world's recipe (its paths unset).
  model = real_text._model(  # pylint: disable=protected-access
      "experiments/pretrain_wiki_small_cpu.gin")
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "ckpts"),
                                       async_save=False)
  # Step 3 as ICT saves it (no null score), step 7 as REALM does (a
  # learned one, the recipe's "learned_mean").
  ict_model = dataclasses.replace(model, retriever=dataclasses.replace(
      model.retriever, null_score="embedding"))
  for step, seed, made in ((3, 0, ict_model), (7, 1, model)):
    _, params = functional.init(lambda r, m=made: Realm(m, rngs=r), seed)
    ckpt.save(step, params, {"count": np.zeros((), np.int32)},
              {"index_step": 0}, force=True)
  ckpt.close()
  output = tmp_path / "rows.jsonl"
  common = [f"--data_dir={tmp_path / 'data'}", f"--workdir={tmp_path / 'w'}",
            f"--output={output}", "--max_block_len=24", "--retrievers=bm25"]
  real_text.main(common + [f"--checkpoints=last={tmp_path / 'ckpts'},"
                           f"first={tmp_path / 'ckpts'}@3"])
  rows = [json.loads(x) for x in output.read_text().splitlines()]
  assert [r["retriever"] for r in rows] == ["bm25", "last", "first"]
  # Each checkpoint's own index (its last step by default), extended.
  for name in ("last_7", "first_3"):
    manifest = json.loads((tmp_path / "w" / f"index_{name}_union" / "0" /
                           "manifest.json").read_text())
    assert manifest["new_rows"] > 0
  assert rows[1]["recall@100"] == 1.0  # (all 9 blocks retrieved)
  capsys.readouterr()
  real_text.main([f"--table_from={output}", f"--workdir={tmp_path / 'w'}",
                  "--paired=last,first", "--baseline=bm25",
                  f"--plot={tmp_path / 'recall.png'}"])
  assert (tmp_path / "recall.png").read_bytes()[:4] == b"\x89PNG"
  out = capsys.readouterr().out.splitlines()
  assert out[-2].startswith("last - bm25: @1 ")
  assert out[-1].startswith("first - bm25: @1 ")
  with pytest.raises(SystemExit):  # no such step
    real_text.main(common + [f"--checkpoints=x={tmp_path / 'ckpts'}@5"])
  with pytest.raises(SystemExit):  # names are one word
    real_text.main(common + [f"--checkpoints=a_b={tmp_path / 'ckpts'}"])


def test_the_first_n_leads_make_a_smaller_corpus(tmp_path):
  # The scale curve's BM25 rows: Z = the first --num_documents leads.
  data = public_data.write_public_data(tmp_path / "data")
  output = tmp_path / "rows.jsonl"
  args = [f"--data_dir={tmp_path / 'data'}", f"--workdir={tmp_path / 'w'}",
          f"--output={output}", "--max_block_len=24", "--retrievers=bm25",
          "--tasks=squad,cloze"]
  real_text.main(args + ["--num_documents=1"])
  full = tmp_path / "full.jsonl"
  real_text.main(args[:1] + [f"--workdir={tmp_path / 'w2'}",
                             f"--output={full}"] + args[3:])
  rows = [json.loads(x) for x in output.read_text().splitlines()]
  rows_full = [json.loads(x) for x in full.read_text().splitlines()]
  # Ines Marlow's lead is first: the cloze prompt about her stays.
  assert [r["questions"] for r in rows] == [len(data.questions), 1]
  leads = [json.loads(x) for x in (tmp_path / "w" / "leads.jsonl")
           .read_text().splitlines()]
  assert [x["title"] for x in leads] == ["Ines Marlow"]
  assert 0 < rows_full[0]["blocks"] - rows[0]["blocks"] < rows[0]["blocks"]
  with pytest.raises(ValueError, match="not --num_documents=2"):
    real_text.main(args + ["--num_documents=2"])  # another Z: another workdir
  # No prompt is about the first lead once the order changes.
  (tmp_path / "data2").mkdir()
  for name in os.listdir(tmp_path / "data"):
    text = (tmp_path / "data" / name).read_text()
    if name == "vital_leads.jsonl":
      text = "".join(reversed(text.splitlines(keepends=True)))
    (tmp_path / "data2" / name).write_text(text)
  with pytest.raises(ValueError, match="no prompt is about"):
    real_text.main([f"--data_dir={tmp_path / 'data2'}",
                    f"--workdir={tmp_path / 'w3'}", "--max_block_len=24",
                    "--retrievers=bm25", "--tasks=cloze", "--num_documents=1"])


def test_hybrid_rows_and_fusion_weights_chosen_on_a_dev_set(tmp_path):
  from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
  public_data.write_public_data(tmp_path / "data")
  output = tmp_path / "rows.jsonl"
  common = [f"--data_dir={tmp_path / 'data'}", f"--workdir={tmp_path / 'w'}",
            f"--output={output}", "--max_block_len=24"]
  real_text.main(common + ["--retrievers=bm25,minilm,hybrid",
                           "--dense_weight=0.7", "--bm25_weight=0.3"])
  rows = [json.loads(x) for x in output.read_text().splitlines()]
  assert [r["retriever"] for r in rows] == ["bm25", "minilm", "hybrid"]
  assert rows[2]["fusion"]["dense_weight"] == 0.7
  # The BM25 index of the leads, built beside their store, was extended
  # beside the union's.
  for store in ("vital", "union"):
    manifest = json.loads((tmp_path / "w" / store / "bm25" /
                           "manifest.json").read_text())
    assert manifest["store_fingerprint"] == json.loads(
        (tmp_path / "w" / store / "manifest.json").read_text())["fingerprint"]
  found = {}
  for name in ("bm25", "minilm", "hybrid"):
    found[name] = [json.loads(x) for x in (
        tmp_path / "w" / "predictions" / f"{name}.jsonl").read_text()
                   .splitlines()]

  def ranking(name, rows):
    scores = np.array([r["retrieved_scores"] for r in rows], np.float32)
    ranks = np.tile(np.arange(len(rows[0]["retrieved_ids"])), (len(rows), 1))
    return rankers.Ranking(
        np.array([r["retrieved_ids"] for r in rows]), scores,
        # BM25 finds only the blocks it scores above 0 (BM25Ranker.rank).
        {name: np.where(scores > 0, ranks, -1) if name == "bm25" else ranks})
  want = rankers.fuse([ranking("minilm", found["minilm"]),
                       ranking("bm25", found["bm25"])], (0.7, 0.3), 100)
  assert [r["retrieved_ids"] for r in found["hybrid"]] == [
      [b for b in row if b >= 0] for row in want.ids.tolist()]
  # The weights chosen on a dev set (here the SQuAD fixture as a SQuAD
  # JSON file), asked over the leads + its paragraphs.
  dev = public_data.SQUAD_FIXTURE
  output.unlink()
  real_text.main(common + [f"--tune_fusion={dev}"])
  rows = [json.loads(x) for x in output.read_text().splitlines()]
  assert len(rows) == len(real_text.DEV_WEIGHTS) + 2
  chosen = rows[-1]["chosen"]
  best = max(r["mean_recall"] for r in rows[:-2])
  assert [r["mean_recall"] for r in rows[:-2] if
          r["dense_weight"] == chosen["dense_weight"]] == [best]
  assert all(r["recall@100"] == 1.0 for r in rows[:-1])
  manifest = json.loads((tmp_path / "w" / "index_minilm_devunion" / "0" /
                         "manifest.json").read_text())
  assert manifest["new_rows"] > 0


_DESCRIBED = [
    {"title": "Ines Marlow", "text": "Ines Marlow was a surveyor of the "
     "north. She mapped the Kessar Hills and their lakes.",
     "description": "Surveyor who mapped the northern hills",
     "topic": "People"},
    {"title": "Opal (river)", "text": "The Opal is a cold river that flows "
     "north from the Kessar Hills to the sea.", "description": "river",
     "topic": "Geography"},
    {"title": "Tarrow", "text": "Tarrow is a small river town.",
     "description": "  River", "topic": "Geography"},  # Opal's, but case
    {"title": "Lake Vostrel", "text": "Lake Vostrel is a glacial lake.",
     "description": "Lake Vostrel of the hills", "topic": "Geography"},
    {"title": "Kessar Hills", "text": "The Kessar Hills are a range of "
     "low hills in the north, rich in lakes.",
     "description": "Range of hills in the north", "topic": "Geography"},
]


def test_the_describe_task_needs_the_leads_alone(tmp_path, capsys):
  """Issue 66: a data directory of fetch_public --sets=leads runs the
  describe task over Z alone; SQuAD or the cloze stops at once."""
  data = tmp_path / "data"
  data.mkdir()
  (data / "vital_leads.jsonl").write_text("".join(
      json.dumps(x) + "\n" for x in _DESCRIBED))
  output = tmp_path / "rows.jsonl"
  args = [f"--data_dir={data}", f"--workdir={tmp_path / 'w'}",
          f"--output={output}", "--max_block_len=24", "--retrievers=bm25"]
  real_text.main(args + ["--tasks=describe"])
  row, = [json.loads(x) for x in output.read_text().splitlines()]
  vital = json.loads((tmp_path / "w" / "vital" / "manifest.json")
                     .read_text())
  # Kept: a description no other lead has (case and spacing aside) that
  # does not name its lead.
  assert (row["task"], row["questions"]) == ("describe", 2)
  assert row["blocks"] == vital["num_blocks"]
  assert not (tmp_path / "w" / "union").exists()
  assert row["gold_recall@100"] == row["recall@100"] == 1.0
  predictions = [json.loads(x) for x in (
      tmp_path / "w" / "predictions" / "bm25_describe.jsonl").read_text()
                 .splitlines()]
  assert [(p["question"], p["answers"]) for p in predictions] == [
      ("Surveyor who mapped the northern hills", ["Ines Marlow"]),
      ("Range of hills in the north", ["Kessar Hills"])]
  capsys.readouterr()
  for task, routes in (("squad", ("--squad_dev=PATH (dev-v1.1.json",
                                  "--bigbench_sdist=PATH (bigbench-1.0.0")),
                       ("cloze", ("--bigbench_sdist=PATH",))):
    with pytest.raises(SystemExit) as e:
      real_text.main([f"--data_dir={data}", f"--workdir={tmp_path / task}",
                      f"--tasks=describe,{task}"])
    message = str(e.value)
    assert message.startswith(f"real_text: {data} lacks ")
    assert "\n" not in message and all(r in message for r in routes)
    assert not (tmp_path / task).exists()


def test_question_files_give_answer_recall_only(tmp_path, capsys):
  """The ORQA question sets (fetch_public --nq_open_dev, ...) asked over
  the corpus: answer recall, no gold block; CuratedTrec's are patterns."""
  public_data.write_public_data(tmp_path / "data")
  (tmp_path / "data" / "nq_open_dev.jsonl").write_text(
      json.dumps({"question": "which river flows from the kessar hills",
                  "answer": ["Opal"]}) + "\n")
  (tmp_path / "data" / "curatedtrec_test.jsonl").write_text(
      json.dumps({"question": "what did ines marlow map",
                  "answer": ["Kess?ar Hills"]}) + "\n")
  output = tmp_path / "rows.jsonl"
  real_text.main([f"--data_dir={tmp_path / 'data'}",
                  f"--workdir={tmp_path / 'w'}", f"--output={output}",
                  "--max_block_len=24", "--retrievers=bm25",
                  "--tasks=nq_open,curatedtrec"])
  rows = [json.loads(x) for x in output.read_text().splitlines()]
  assert [(r["task"], r["questions"]) for r in rows] == [
      ("nq_open", 1), ("curatedtrec", 1)]
  for row in rows:
    assert row["recall@100"] == 1.0
    assert not [k for k in row if k.startswith("gold_")]
  capsys.readouterr()
  real_text.main([f"--table_from={output}"])
  assert capsys.readouterr().out.splitlines()[-1].endswith(
      "| 100.0 | - | - | - | - |")

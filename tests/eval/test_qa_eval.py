"""Evaluation: metrics by hand, predictions JSONL, the eval job's ledger."""

import dataclasses
import json
import logging
import os
import re
import string
import subprocess
import sys
import threading

import gin
import jax
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.checkpoint_import import core
from realm_jax.core import checkpoints, parallel
from realm_jax.data import formats
from realm_jax.data import qa as qa_lib
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.eval import qa_eval, qa_model
from realm_jax.index import build, publish
from realm_jax.jobs import qa_eval as qa_eval_job
from realm_jax.model import functional
from realm_jax.testing import timeouts, tiny
from realm_jax.data import qa_inputs

QA_CONFIG = qa_inputs.QAConfig(question_length=16, num_retrieved=6,
                               num_reader_blocks=3, reader_length=48)
QUESTIONS = [
    ("Where was Mozart born?", ["Salzburg"]),
    ("When did the Berlin Wall fall?", ["9 November 1989", "1989"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("Who explored the Amazon?", ["Francisco de Orellana"]),
    ("Where was Einstein born?", ["Ulm"]),
    ("Where was Shakespeare born?", ["Stratford-upon-Avon"]),
]
RECALL_KS = (1, 2, 5, 9)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  store, config, graphdef, params, workdir = tiny.indexed_tiny_corpus(
      tmp_path_factory, "eval")
  index = publish.load_frozen_index(str(workdir / "index"), store, config)
  model = qa_model.QAModel(config, params, index, store, QA_CONFIG,
                           batch_size=4)
  return dict(store=store, config=config, params=params, graphdef=graphdef,
              index=index, model=model, workdir=workdir)


def _normalize(s):
  # Independent of qa.normalize_answer, for the ASCII texts of these tests.
  s = "".join(c for c in s.lower() if c not in string.punctuation)
  return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def _spaced(s):
  return " ".join("".join(" " if c in string.punctuation else c
                          for c in s.lower()).split())


def _contains(text, answer):
  # has_answer's definition: the answer on token boundaries, with
  # punctuation deleted (articles dropped) or turned into spaces.
  return any(f(answer) and f" {f(answer)} " in f" {f(text)} "
             for f in (_normalize, _spaced))


def _result(prediction, answers, flags, reader, is_regex=False, **kw):
  return qa_model.QAResult(
      question="q", prediction=prediction, score=1.0, block_id=0,
      evidence=[], retrieved_ids=list(range(len(flags or []))),
      answers=answers, is_regex=is_regex, retrieved_has_answer=flags,
      reader_has_answer=reader, **kw)


def test_aggregate_metrics_on_a_hand_written_table():
  results = [
      # Normaliser: article and punctuation dropped -> correct.
      _result("the Salzburg.", ["Salzburg"], [False, True, False], True),
      # Extra words -> wrong; a stale `correct` flag is not trusted.
      _result("Salzburg, Austria", ["Salzburg"], [True, False, False], True,
              correct=True),
      # CuratedTrec: the pattern matches at the start -> correct.
      _result("1989 in Berlin", [r"19[0-9]{2}"], [False, False, False],
              False, is_regex=True),
      # ... but not in the middle -> wrong.
      _result("in 1989", ["1989"], [False, False, True], False,
              is_regex=True),
      # Accents are kept by the reference normaliser -> wrong; this result
      # was retrieved only 2 deep.
      _result("Z\u00fcrich", ["Zurich"], [False, False], False),
  ]
  metrics = qa_eval.aggregate_metrics(results, recall_ks=(1, 2, 3, 10))
  assert metrics == {
      "exact_match": 2 / 5,
      "recall@1": 1 / 5,   # Only row 2 has the answer at rank 1.
      "recall@2": 2 / 5,   # + row 1.
      "recall@3": 3 / 5,   # + row 4.
      "recall@10": 3 / 5,
      "reader_oracle": 2 / 5,
      "num_examples": 5,
  }
  with pytest.raises(ValueError, match="no answers"):
    qa_eval.aggregate_metrics([_result("x", None, None, None)])
  with pytest.raises(ValueError, match="at least one"):
    qa_eval.aggregate_metrics([])


def test_evaluate_against_an_independent_computation(setup, tmp_path,
                                                     caplog):
  model, store = setup["model"], setup["store"]
  questions = [q for q, _ in QUESTIONS]
  first = model.predict(questions)
  preds = [r.prediction for r in first]
  assert all(preds), preds
  # Answers built from the model's own predictions make the expected exact
  # match known: rows 0 and 1 match after normalisation, row 2 by a regex
  # at the start, row 3's regex only matches later in the prediction.
  answers = [a for _, a in QUESTIONS]
  answers[0] = answers[0] + ["The " + preds[0].upper() + "!"]
  answers[1] = ["zzz", preds[1] + "."]
  answers[2] = [re.escape(preds[2][:3])]
  answers[3] = [re.escape(preds[3][1:]) + "$"]
  regex = [False, False, True, True, False, False]
  examples = [qa_lib.QAExample(q, tuple(a), x)
              for q, a, x in zip(questions, answers, regex)]
  path = str(tmp_path / "pred.jsonl")
  with caplog.at_level(logging.INFO):
    metrics = qa_eval.evaluate(model, examples, recall_ks=RECALL_KS,
                               predictions_path=path, log_every_seconds=1e-9)
  # Progress in the log (issue 58): after the first batch of 4, done/total,
  # rate and ETA; then the total time.
  assert re.search(r"evaluating: 4/6 questions \(66%\), [\d.]+ "
                   r"questions/s, ETA \S+", caplog.text), caplog.text
  assert re.search(r"evaluating: 6/6 questions in [\d.]+ s, [\d.]+ "
                   r"questions/s$", caplog.text, re.M), caplog.text

  expect_correct = [True, True, True, False] + [
      any(_normalize(preds[i]) == _normalize(a) for a in answers[i])
      for i in (4, 5)]
  assert metrics["exact_match"] == pytest.approx(np.mean(expect_correct))
  assert metrics["num_examples"] == len(QUESTIONS)

  # Retrieval, independently: query tower -> inner products with the index
  # embeddings -> ranks; has-answer by whole-word search in the raw text.
  tok = Tokenizer()
  q = qa_inputs.tokenize_questions(tok, questions, QA_CONFIG.question_length)
  query = np.asarray(functional.bind(setup["graphdef"], setup["params"])
                     .retriever.embed_queries(q["question_ids"],
                                              q["question_mask"]))
  scores = query @ np.asarray(setup["index"].embeddings).T
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  found = []
  for i, row in enumerate(rows):
    ids = row["retrieved_ids"]
    assert sorted(ids) == list(range(len(store)))  # Recall depth 9 = all.
    assert np.all(np.diff(scores[i, ids]) <= 1e-5)  # Best first.
    texts = [store.text(b) for b in ids]
    if regex[i]:
      flags = [any(re.search(a, t, re.I) for a in answers[i]) for t in texts]
    else:
      flags = [any(_contains(t, a) for a in answers[i]) for t in texts]
    assert row["retrieved_has_answer"] == flags, (i, texts)
    found.append(flags)
  for k in RECALL_KS:
    assert metrics[f"recall@{k}"] == pytest.approx(
        np.mean([any(f[:k]) for f in found])), k
  # Reader oracle: an answer's wordpieces inside a top-3 block's reader
  # input (text answers), a pattern in a top-3 block's text (regex).
  oracle = []
  for i, row in enumerate(rows):
    if regex[i]:
      oracle.append(any(found[i][:3]))
      continue
    pieces = [list(p) for p in tok.tokenize(answers[i])]
    room = QA_CONFIG.reader_length - int(q["question_mask"][i].sum()) - 1
    oracle.append(any(
        any(list(body[s:s + len(p)]) == p for p in pieces
            if len(p) <= setup["config"].reader.max_span_width
            for s in range(len(body)))
        for body in (store.body_ids(b)[:room] for b in row["retrieved_ids"][
            :3])))
  assert metrics["reader_oracle"] == pytest.approx(np.mean(oracle))
  assert any(oracle) or not any(any(f[:3]) for f in found)


def test_predictions_jsonl(setup, tmp_path):
  model, store = setup["model"], setup["store"]
  examples = [qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS]
  path = str(tmp_path / "out" / "pred.jsonl")
  qa_eval.evaluate(model, examples, recall_ks=(1, 5), predictions_path=path)
  assert os.listdir(tmp_path / "out") == ["pred.jsonl"]  # No temp left.
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  results = model.predict([q for q, _ in QUESTIONS],
                          answers=[a for _, a in QUESTIONS])
  assert len(rows) == len(QUESTIONS)
  for row, (question, answers), result in zip(rows, QUESTIONS, results):
    assert row["question"] == question and row["answers"] == answers
    assert row["prediction"] == result.prediction
    assert row["correct"] == qa_lib.exact_match(row["prediction"], answers)
    ev = row["evidence"]
    assert [e["rank"] for e in ev] == list(range(5))  # num_evidence = 5.
    assert [e["block_id"] for e in ev] == row["retrieved_ids"][:5]
    for e in ev:
      assert e["title"] == store.title(e["block_id"])
      assert e["text"] == store.text(e["block_id"])
      assert 0.0 <= e["probability"] <= 1.0
      assert e["has_answer"] == qa_lib.has_answer(e["text"], answers)
    assert sum(e["probability"] for e in ev) <= 1.0 + 1e-6
    # The answer is quoted from its block's text.
    assert row["prediction"] in store.text(row["block_id"])


def test_dpr_retrieval_json(setup, tmp_path):
  """DPR's retriever output: every retrieved block, best first, scored by
  the inner product of the query and block embeddings (numpy here)."""
  model, store = setup["model"], setup["store"]
  examples = [qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS]
  path = str(tmp_path / "out" / "dpr.json")
  qa_eval.evaluate(model, examples, recall_ks=(1, 5), dpr_path=path)
  assert os.listdir(tmp_path / "out") == ["dpr.json"]  # No temp left.
  with open(path, encoding="utf-8") as f:
    rows = json.load(f)
  tok = Tokenizer()
  q = qa_inputs.tokenize_questions(tok, [q for q, _ in QUESTIONS],
                                   QA_CONFIG.question_length)
  query = np.asarray(functional.bind(setup["graphdef"], setup["params"])
                     .retriever.embed_queries(q["question_ids"],
                                              q["question_mask"]), np.float64)
  scores = query @ np.asarray(setup["index"].embeddings, np.float64).T
  assert len(rows) == len(QUESTIONS)
  for i, (row, (question, answers)) in enumerate(zip(rows, QUESTIONS)):
    assert set(row) == {"question", "answers", "ctxs"}
    assert row["question"] == question and row["answers"] == answers
    ctxs = row["ctxs"]
    assert len(ctxs) == min(len(store), QA_CONFIG.num_retrieved)
    for c in ctxs:
      assert set(c) == {"id", "title", "text", "score", "has_answer"}
      b = int(c["id"])
      assert c["title"] == store.title(b) and c["text"] == store.text(b)
      assert c["score"] == pytest.approx(scores[i, b], abs=1e-4)
      assert c["has_answer"] == qa_lib.has_answer(c["text"], answers)
    got = [c["score"] for c in ctxs]
    assert got == sorted(got, reverse=True)
    np.testing.assert_allclose(got, np.sort(scores[i])[::-1][:len(ctxs)],
                               atol=1e-4)


def test_dpr_retrieval_cites_dpr_passage_ids(tmp_path):
  """A store built from DPR's psgs_w100.tsv: its contexts carry DPR's
  passage ids, so DPR's scorer can join them with its own files."""
  from realm_jax.data import corpus_job  # pylint: disable=g-import-not-at-top
  path = tmp_path / "psgs_w100.tsv"
  path.write_text("id\ttext\ttitle\n"
                  "17\tAaron was a prophet.\tAaron\n"
                  "wiki-4\tMoses led the Israelites.\tMoses\n",
                  encoding="utf-8")
  store, _ = corpus_job.build_corpus(input_path=str(path),
                                     output_dir=str(tmp_path / "store"),
                                     max_block_len=32)
  result = qa_model.QAResult(
      question="who led the israelites?", prediction="Moses", score=1.0,
      block_id=1, evidence=[], retrieved_ids=[1, 0],
      retrieved_scores=[2.5, 0.5], answers=["Moses"],
      retrieved_has_answer=[True, False])
  out = str(tmp_path / "dpr.json")
  qa_eval.write_dpr_retrieval(out, [result], store)
  with open(out, encoding="utf-8") as f:
    (row,) = json.load(f)
  assert [(c["id"], c["title"], c["score"], c["has_answer"])
          for c in row["ctxs"]] == [("wiki-4", "Moses", 2.5, True),
                                    ("17", "Aaron", 0.5, False)]


def test_data_parallel_mesh_gives_the_same_answers(setup):
  mesh = parallel.make_mesh()  # 8 emulated devices.
  sharded = qa_model.QAModel(setup["config"], setup["params"],
                             setup["index"], setup["store"], QA_CONFIG,
                             batch_size=8, mesh=mesh)
  questions = [q for q, _ in QUESTIONS] * 2  # 12: one full batch + padding.
  a = setup["model"].predict(questions)
  b = sharded.predict(questions)
  assert [r.prediction for r in a] == [r.prediction for r in b]
  assert [r.block_id for r in a] == [r.block_id for r in b]
  np.testing.assert_allclose([r.score for r in a], [r.score for r in b],
                             rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="multiple"):
    qa_model.QAModel(setup["config"], setup["params"], setup["index"],
                     setup["store"], QA_CONFIG, batch_size=4, mesh=mesh)


def test_checkpoint_params_are_fitted_or_refused(setup):
  params = setup["params"]
  no_span_head = {"retriever": params["retriever"], "reader": {
      k: v for k, v in params["reader"].items() if k != "span_head"}}
  # A pre-trained checkpoint: random span head, recall still computable.
  model = setup["model"].with_params(no_span_head, step=3)
  assert model.params_step == 3
  assert len(model.predict(["Where was Mozart born?"])) == 1
  with pytest.raises(core.CheckpointMismatchError, match="query_embedder"):
    setup["model"].with_params({"reader": params["reader"]})


def test_a_job_started_before_a_checkpoint_waits_for_its_configs(tmp_path):
  """The eval job reads the model config and QA sizes from the trainer's
  checkpoint; one started before the first checkpoint waits for it (until
  its timeout) instead of evaluating with the gin files' sizes."""
  ckpt_dir = tmp_path / "checkpoints"
  config = qa_eval.EvalConfig(poll_seconds=0.05, timeout_seconds=0.2)
  assert not qa_eval.has_checkpoint(str(ckpt_dir), config)
  writer = threading.Timer(0.3, lambda: (ckpt_dir / "4").mkdir(parents=True))
  writer.start()
  assert qa_eval.has_checkpoint(str(ckpt_dir), dataclasses.replace(
      config, timeout_seconds=60.0))
  writer.join()


def _save(directory, step, params):
  ckpt = checkpoints.TrainCheckpointer(directory, async_save=False)
  ckpt.save(step, params, {"count": np.zeros((), np.int32)},
            {"index_step": 0}, force=True)
  ckpt.close()


def _shift_span_scores(params, delta):
  # The span head's output bias adds `delta` to every span score, so every
  # prediction keeps its span and its score moves by exactly `delta`.
  params = jax.tree_util.tree_map(np.asarray, params)
  bias = params["reader"]["span_head"]["output"]["bias"]
  params["reader"]["span_head"]["output"]["bias"] = bias + delta
  return params


def test_eval_job_evaluates_each_checkpoint_once_across_restarts(
    setup, tmp_path):
  ckpt_dir, out = str(tmp_path / "checkpoints"), str(tmp_path / "eval")
  examples = [qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS]
  _save(ckpt_dir, 1, setup["params"])
  calls = []
  kwargs = dict(checkpoint_dir=ckpt_dir, output_dir=out, examples=examples,
                model_config=setup["config"], index=setup["index"],
                store=setup["store"], qa_config=QA_CONFIG,
                config=qa_eval.EvalConfig(recall_ks=(1, 5), batch_size=4),
                poll_seconds=0.05,
                on_evaluated=lambda step, m: calls.append(step))
  first = qa_eval.run_eval_job(timeout=0.3, **kwargs)
  assert first.evaluated == [1] and first.stopped == "timeout"
  with open(os.path.join(out, qa_eval.LEDGER)) as f:
    ledger = json.load(f)
  assert list(ledger["steps"]) == ["1"]
  stamp = ledger["steps"]["1"]["evaluated_at"]

  # The trainer goes on, then finishes; the eval job is restarted.
  _save(ckpt_dir, 2, _shift_span_scores(setup["params"], 1.0))
  checkpoints.write_done_marker(ckpt_dir, 2)
  second = qa_eval.run_eval_job(timeout=timeouts.HANG_SECONDS, **kwargs)
  assert second.evaluated == [2] and second.stopped == "done"
  assert calls == [1, 2]  # Step 1 was not evaluated again.
  with open(os.path.join(out, qa_eval.LEDGER)) as f:
    ledger = json.load(f)
  assert sorted(ledger["steps"]) == ["1", "2"]
  assert ledger["steps"]["1"]["evaluated_at"] == stamp
  assert set(second.metrics) == {1, 2}
  with open(os.path.join(out, qa_eval.METRICS_JSONL)) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]
  # Step 2 really was evaluated with step 2's parameters.
  steps = {}
  for step in (1, 2):
    with open(qa_eval.predictions_file(out, step)) as f:
      steps[step] = [json.loads(line) for line in f]
  assert [r["prediction"] for r in steps[1]] == [r["prediction"]
                                                 for r in steps[2]]
  np.testing.assert_allclose([r["score"] + 1.0 for r in steps[1]],
                             [r["score"] for r in steps[2]], atol=1e-4)

  # Restarted after DONE with nothing new: stops at once.
  third = qa_eval.run_eval_job(timeout=timeouts.HANG_SECONDS, **kwargs)
  assert third.evaluated == [] and third.stopped == "done"
  assert calls == [1, 2]
  # A ledger is tied to its evaluation set.
  with pytest.raises(ValueError, match="examples_sha256"):
    qa_eval.run_eval_job(**dict(kwargs, examples=examples[:2]))


def test_eval_cli_one_step(setup, tmp_path):
  # The real command line on a workdir: checkpoints/ and index/ inside.
  workdir = setup["workdir"]
  ckpt_dir = str(workdir / "checkpoints")
  if not os.path.exists(os.path.join(ckpt_dir, "5")):
    _save(ckpt_dir, 5, setup["params"])
  qa_file = tmp_path / "dev.jsonl"
  qa_file.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                             for q, a in QUESTIONS) + "not json\n")
  c, b = setup["config"], setup["config"].retriever.bert
  # models/tiny.gin, resized to the fixture's model.
  bindings = [f"--gin.BertConfig.{f.name}={getattr(b, f.name)!r}"
              for f in dataclasses.fields(b)] + [
              "--gin.RetrieverConfig.projection_size=16",
              "--gin.RetrieverConfig.pooling='mean'",
              "--gin.ReaderConfig.span_hidden_size=8",
              "--gin.ReaderConfig.max_span_width=4",
              "--gin.QAConfig.question_length=16",
              "--gin.QAConfig.num_retrieved=6",
              "--gin.QAConfig.num_reader_blocks=3",
              "--gin.QAConfig.reader_length=48",
              "--gin.EvalConfig.recall_ks=(1,5)",
              "--gin.EvalConfig.batch_size=8"]
  assert c.retriever.projection_size == 16
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.qa_eval",
       "--gin_file=models/tiny.gin", "--gin_file=runs/eval.gin", *bindings,
       f"--gin.WORKDIR='{workdir}'",
       f"--gin.BLOCK_STORE='{setup['store'].path}'",
       f"--gin.QA_FILE='{qa_file}'", "--gin.EvalConfig.step=5",
       f"--gin.EvalConfig.output_dir='{tmp_path / 'ev'}'"],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = json.loads(proc.stdout.strip().splitlines()[-1])
  expected = qa_eval.evaluate(
      setup["model"], [qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS],
      recall_ks=(1, 5))
  assert printed["step"] == 5 and printed["num_examples"] == len(QUESTIONS)
  for key in ("exact_match", "recall@1", "recall@5", "reader_oracle"):
    assert printed[key] == pytest.approx(expected[key]), key
  with open(tmp_path / "ev" / qa_eval.LEDGER) as f:
    assert list(json.load(f)["steps"]) == ["5"]


@pytest.mark.parametrize("files,bindings,message", [
    (["models/tiny.gin"], [],
     r"Set BLOCK_STORE and QA_FILE: --gin.BLOCK_STORE=.*runs/eval.gin"),
    (["models/tiny.gin", "runs/eval.gin"], ["BLOCK_STORE = '/b'"],
     r"Set QA_FILE: --gin.QA_FILE="),
    (["models/tiny.gin", "runs/eval.gin"],
     ["BLOCK_STORE = '/b'", "QA_FILE = '/q'", "INIT_FROM = 'orqa:/c'"],
     r"Set WORKDIR .*, or INDEX_DIR and INIT_FROM"),
])
def test_eval_cli_names_the_macro_of_a_missing_path(files, bindings,
                                                    message):
  gin.clear_config()
  try:
    gin_cli.parse(files, bindings)
    with pytest.raises(SystemExit, match=message):
      qa_eval_job.job(False)
  finally:
    gin.clear_config()


def test_eval_job_closes_its_writer_when_an_evaluation_raises(
    setup, tmp_path, monkeypatch):
  """The summary writer is closed (and the lease released) when an
  evaluation fails, not only after a clean run."""
  ckpt_dir, out = str(tmp_path / "checkpoints"), str(tmp_path / "eval")
  _save(ckpt_dir, 1, setup["params"])
  closed, real_open = [], qa_eval._open_job_outputs

  def open_outputs(*args):
    ledger_path, ledger, writer = real_open(*args)
    real_close = writer.close
    writer.close = lambda: closed.append(1) or real_close()
    return ledger_path, ledger, writer

  monkeypatch.setattr(qa_eval, "_open_job_outputs", open_outputs)

  def fail(step, metrics):
    raise RuntimeError(f"after step {step}")

  kwargs = dict(checkpoint_dir=ckpt_dir, output_dir=out,
                examples=[qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS],
                model_config=setup["config"], index=setup["index"],
                store=setup["store"], qa_config=QA_CONFIG,
                config=qa_eval.EvalConfig(recall_ks=(1, 5), batch_size=4),
                steps=[1])
  with pytest.raises(RuntimeError, match="after step 1"):
    qa_eval.run_eval_job(on_evaluated=fail, **kwargs)
  assert closed == [1]
  # The lease was released: the next run starts (step 1 is in the ledger).
  assert qa_eval.run_eval_job(**kwargs).evaluated == []
  assert closed == [1, 1]


def test_eval_reads_the_configured_rankers_blocks(setup, tmp_path):
  from realm_jax.index import bm25, rankers  # pylint: disable=g-import-not-at-top
  ckpt_dir = str(tmp_path / "checkpoints")
  _save(ckpt_dir, 3, setup["params"])
  examples = [qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS]
  config = qa_eval.EvalConfig(ranker="bm25", bm25_dir=str(tmp_path / "bm25"),
                              recall_ks=(1, 5), batch_size=4)
  metrics, model = qa_eval.evaluate_checkpoint(
      checkpoint_dir=ckpt_dir, step=3, examples=examples,
      output_dir=str(tmp_path / "ev"), model_config=setup["config"],
      index=setup["index"], store=setup["store"], qa_config=QA_CONFIG,
      config=config)
  assert model.ranker_choice == rankers.BM25()
  ids, _ = bm25.BM25Index.from_store(setup["store"]).search(
      [q for q, _ in QUESTIONS], 6)
  with open(qa_eval.predictions_file(str(tmp_path / "ev"), 3,
                                     tag="bm25")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["retrieved_ids"] for r in rows] == ids.tolist()
  assert metrics["ranker"] == "bm25"
  hits = [[any(_contains(setup["store"].text(int(b)), x) for x in a)
           for b in row] for row, (_, a) in zip(ids, QUESTIONS)]
  assert metrics["recall@5"] == pytest.approx(
      np.mean([any(h[:5]) for h in hits]))
  with pytest.raises(ValueError, match="EvalConfig.ranker='BM25' is not a "
                     "ranker; use one of dense, bm25, hybrid"):
    qa_eval.EvalConfig(ranker="BM25")


def test_another_ranker_evaluates_the_same_steps_again(setup, tmp_path):
  """Issue 64, H15: the ledger keys each evaluation by step and ranker
  (and the hybrid's fusion), and each metrics record says which produced
  it: the same run evaluated with another EvalConfig.ranker is evaluated
  again, beside the first, not skipped as already evaluated. A ledger
  entry written before rankers were recorded counts as the dense one."""
  from realm_jax.index import bm25, rankers  # pylint: disable=g-import-not-at-top
  ckpt_dir, out = str(tmp_path / "checkpoints"), str(tmp_path / "eval")
  _save(ckpt_dir, 1, setup["params"])
  examples = [qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS]
  kwargs = dict(checkpoint_dir=ckpt_dir, output_dir=out, examples=examples,
                model_config=setup["config"], index=setup["index"],
                store=setup["store"], qa_config=QA_CONFIG, steps=[1])
  configs = {name: qa_eval.EvalConfig(
      recall_ks=(1, 5), batch_size=4, ranker=name.split("-")[0],
      bm25_dir=str(tmp_path / "bm25"), fusion=rankers.FusionConfig(
          method="rrf" if name.endswith("rrf") else "weighted"))
             for name in ("dense", "bm25", "hybrid", "hybrid-rrf")}
  assert qa_eval.run_eval_job(config=configs["dense"], **kwargs
                              ).evaluated == [1]
  # The ledger of an older version: the entry keyed by its step alone,
  # without a ranker: the dense ranker's.
  ledger_path = os.path.join(out, qa_eval.LEDGER)
  with open(ledger_path) as f:
    ledger = json.load(f)
  ledger["steps"]["1"] = {k: v for k, v in ledger["steps"]["1"].items()
                          if k not in ("step", "ranker")}
  with open(ledger_path, "w") as f:
    json.dump(ledger, f)
  assert qa_eval.run_eval_job(config=configs["dense"], **kwargs
                              ).evaluated == []
  for name in ("bm25", "hybrid", "hybrid-rrf"):
    result = qa_eval.run_eval_job(config=configs[name], **kwargs)
    assert result.evaluated == [1], name
    assert result.metrics[1]["ranker"] == name.split("-")[0]
    assert qa_eval.run_eval_job(config=configs[name], **kwargs
                                ).evaluated == [], name
  tags = {n: qa_eval.ranker_tag(c) for n, c in configs.items()}
  assert len(set(tags.values())) == 4
  with open(ledger_path) as f:
    ledger = json.load(f)
  assert sorted(ledger["steps"]) == sorted(
      qa_eval.ledger_key(1, t) for t in tags.values())
  assert ledger["steps"][qa_eval.ledger_key(1, tags["hybrid-rrf"])][
      "fusion"]["method"] == "rrf"
  with open(os.path.join(out, qa_eval.METRICS_JSONL)) as f:
    rows = [json.loads(line) for line in f]
  assert [r["ranker"] for r in rows] == ["dense", "bm25", "hybrid", "hybrid"]
  assert [r.get("fusion", {}).get("method") for r in rows] == [
      None, None, "weighted", "rrf"]
  # Each ranker's predictions in a file of its own: BM25's are BM25's.
  with open(qa_eval.predictions_file(out, 1, tag="bm25")) as f:
    retrieved = [json.loads(line)["retrieved_ids"] for line in f]
  ids, _ = bm25.BM25Index.from_store(setup["store"]).search(
      [q for q, _ in QUESTIONS], 6)
  assert retrieved == ids.tolist()
  assert len(os.listdir(os.path.join(out, "predictions"))) == 4


def test_squad_json_questions_get_gold_paragraph_recall(setup, tmp_path):
  """The eval reads SQuAD JSON; over a store built from it
  (input_format="squad") it reports gold-paragraph recall."""
  from realm_jax.data import corpus_job, squad  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))), "fixtures", "squad", "tiny_v1.json")
  store, _ = corpus_job.build_corpus(
      input_path=path, input_format="squad", max_block_len=24,
      output_dir=str(tmp_path / "store"))
  config = setup["config"]
  build.build_and_publish(
      retriever_params=setup["params"]["retriever"],
      retriever_config=config.retriever, store=store,
      root=str(tmp_path / "index"), step=0,
      config=build.IndexBuildConfig(searcher="exact"))
  index = publish.load_frozen_index(str(tmp_path / "index"), store, config)
  model = qa_model.QAModel(config, setup["params"], index, store,
                           dataclasses.replace(QA_CONFIG, num_retrieved=4),
                           batch_size=4)
  examples = formats.read_questions(path)
  data = squad.read_squad(path)
  assert [e.paragraph_id for e in examples] == [
      q.paragraph_id for q in data.questions]
  metrics = qa_eval.evaluate(model, examples, recall_ks=(1, 2, 9),
                             predictions_path=str(tmp_path / "p.jsonl"))
  blocks = squad.paragraph_blocks(store, data.paragraphs)
  with open(tmp_path / "p.jsonl") as f:
    rows = [json.loads(line) for line in f]
  for k in (1, 2, 9):
    want = np.mean([np.isin(r["retrieved_ids"][:k],
                            blocks[e.paragraph_id]).any()
                    for r, e in zip(rows, examples)])
    assert metrics[f"gold_recall@{k}"] == pytest.approx(want)
  assert metrics["gold_recall@9"] == 1.0  # every block is retrieved
  # No paragraph ids in the questions (or the store): no gold recall.
  plain = qa_eval.evaluate(model, [dataclasses.replace(
      e, paragraph_id=None) for e in examples], recall_ks=(1,))
  assert "gold_recall@1" not in plain
  # An ORQA JSONL line may name its paragraph too.
  (tmp_path / "q.jsonl").write_text(squad.question_lines(data.questions))
  assert formats.read_questions(str(tmp_path / "q.jsonl")) == examples

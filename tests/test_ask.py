"""Asking questions: answers with evidence and p(z|x), Python API and CLI."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from realm_jax import ask as ask_lib
from realm_jax.core import checkpoints
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.eval import qa_model
from realm_jax.model import functional
from realm_jax.model.realm import Realm
from realm_jax.testing import timeouts, tiny
from realm_jax.data import qa_inputs

QA_CONFIG = qa_inputs.QAConfig(question_length=16, num_retrieved=6,
                               num_reader_blocks=3, reader_length=48)
QUESTIONS = ["Where was Mozart born?", "When did the Berlin Wall fall?",
             "What is the capital of Japan?", "Who explored the Amazon?",
             "Where was Einstein born?", "Where was Shakespeare born?"]
# 10,000 wordpieces; the model reads 14 (question_length 16).
LONG_QUESTION = " ".join([QUESTIONS[0]] * 2000)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  store, config, graphdef, params, workdir = tiny.indexed_tiny_corpus(
      tmp_path_factory, "ask")
  ckpt = checkpoints.TrainCheckpointer(str(workdir / "checkpoints"),
                                       async_save=False)
  ckpt.save(1, params, {"count": np.zeros((), np.int32)}, {"index_step": 0},
            force=True)
  ckpt.close()
  model = qa_model.load_qa_model(model_config=config, store=store,
                                 workdir=str(workdir), qa_config=QA_CONFIG,
                                 batch_size=4)
  return dict(store=store, config=config, params=params, graphdef=graphdef,
              model=model, workdir=workdir)


def _retrieval_logits(setup, question, ids):
  """f(x, z) for the given blocks, computed outside QAModel."""
  if "queries" not in setup:
    q = qa_inputs.tokenize_questions(Tokenizer(), QUESTIONS,
                                     QA_CONFIG.question_length)
    setup["queries"] = np.asarray(
        functional.bind(setup["graphdef"], setup["params"])
        .retriever.embed_queries(q["question_ids"], q["question_mask"]))
  query = setup["queries"][QUESTIONS.index(question)]
  return np.asarray(setup["model"].index.embeddings)[ids] @ query


def test_ask_returns_the_answer_with_its_evidence(setup):
  model, store = setup["model"], setup["store"]
  assert model.params_step == 1 and model.index.step == 0
  for question in QUESTIONS:
    result = ask_lib.ask(question, model, top_k=3)
    assert result.question == question and result.prediction
    probs = np.array([e.probability for e in result.evidence])
    assert np.all(probs >= 0) and np.all(probs <= 1)
    assert probs.sum() <= 1 + 1e-6
    ids = [e.block_id for e in result.evidence]
    assert result.block_id in ids
    # The answer is quoted from the block it came from.
    assert result.prediction in store.text(result.block_id)
    for e in result.evidence:
      assert e.title == store.title(e.block_id)
      assert e.text == store.text(e.block_id)
    # p(z|x): softmax over all K = 6 retrieved blocks, best first.
    logits = _retrieval_logits(setup, question, result.retrieved_ids[:6])
    assert result.retrieved_ids[:3] == ids[:3]
    np.testing.assert_allclose([e.retrieval_logit for e in result.evidence],
                               logits[:3], rtol=1e-4, atol=1e-4)
    p = np.exp(logits - logits.max())
    np.testing.assert_allclose(probs, (p / p.sum())[:3], atol=1e-5)
    assert np.all(np.diff(logits) <= 1e-5)


def test_the_answer_block_is_shown_even_beyond_top_k(setup):
  # Shrinking (and flipping) the query LayerNorm scales the retrieval
  # logits (the frozen index is unchanged): the span scores then decide
  # which of the top 3 blocks answers, often not the first one.
  results = []
  for scale in (-0.01, 0.01, -1.0):
    params = jax.tree_util.tree_map(np.asarray, setup["params"])
    ln = params["retriever"]["query_embedder"]["layer_norm"]
    ln["scale"] = ln["scale"] * scale
    results += setup["model"].with_params(params).predict(QUESTIONS,
                                                          num_evidence=1)
  beyond = [r for r in results if r.block_id != r.retrieved_ids[0]]
  assert beyond, "every answer came from the top block; change the scales"
  for r in results:
    ranks = [e.rank for e in r.evidence]
    assert ranks[0] == 0
    if r in beyond:
      assert len(ranks) == 2 and r.evidence[1].block_id == r.block_id
      assert ranks[1] == r.retrieved_ids.index(r.block_id) > 0
    else:
      assert len(ranks) == 1
    assert sum(e.probability for e in r.evidence) <= 1 + 1e-6


def test_loading_paths_agree(setup):
  ckpt_dir = str(setup["workdir"] / "checkpoints")
  kwargs = dict(model_config=setup["config"], store=setup["store"],
                qa_config=QA_CONFIG, batch_size=4)
  from_init = qa_model.load_qa_model(
      init_from=f"checkpoint:{ckpt_dir}@1",
      index_dir=str(setup["workdir"]), **kwargs)  # A dir holding index/.
  a = setup["model"].predict(QUESTIONS)
  b = from_init.predict(QUESTIONS)
  assert [r.prediction for r in a] == [r.prediction for r in b]
  np.testing.assert_allclose([r.score for r in a], [r.score for r in b],
                             rtol=1e-5)
  with pytest.raises(ValueError, match="No weights"):
    qa_model.load_qa_model(index_dir=str(setup["workdir"] / "index"),
                           **kwargs)
  with pytest.raises(FileNotFoundError):
    qa_model.load_qa_model(checkpoint_dir=ckpt_dir, step=7,
                           index_dir=str(setup["workdir"] / "index"),
                           **kwargs)


def test_format_result(setup):
  result = ask_lib.ask(QUESTIONS[0], setup["model"], top_k=2)
  text = ask_lib.format_result(result, snippet_chars=40)
  assert f"A: {result.prediction}" in text
  for e in result.evidence:
    assert f"p(z|x)={e.probability:.3f}" in text and f"[{e.title}]" in text
  assert "<- predicted span" in text
  assert all(len(line) < 50 for line in text.splitlines()
             if line.startswith("      "))


@pytest.mark.parametrize("question", ["", "   ", "\n\t "])
def test_an_empty_question_is_an_error(setup, question):
  with pytest.raises(ValueError, match="is empty; ask something"):
    setup["model"].ask(question)
  with pytest.raises(ValueError, match="is empty; ask something"):
    ask_lib.ask(question, setup["model"])


def test_a_long_question_is_answered_with_a_warning(setup, caplog):
  """It is cut to the question length, with a warning saying how much
  was kept; a question that fits gets none."""
  model = setup["model"]
  num_pieces = len(Tokenizer().tokenize([LONG_QUESTION])[0])
  assert num_pieces == 10_000
  with caplog.at_level("WARNING"):
    model.ask(QUESTIONS[0])
  assert "was cut" not in caplog.text
  with caplog.at_level("WARNING"):
    result = model.ask(LONG_QUESTION)
  cut = [r.getMessage() for r in caplog.records
         if "was cut" in r.getMessage()]
  assert len(cut) == 1, caplog.text
  assert "14 of its 10000 wordpieces were kept" in cut[0]
  assert "QAConfig.question_length=16" in cut[0]
  # Answered from its first 14 wordpieces: 14 of three times QUESTIONS[0].
  thrice = model.predict([" ".join([QUESTIONS[0]] * 3)])[0]
  assert result.question == LONG_QUESTION
  assert result.retrieved_ids == thrice.retrieved_ids
  assert result.prediction == thrice.prediction


def _cli_bindings(setup) -> list[str]:
  """models/tiny.gin's flags, resized to the fixture's model."""
  b = setup["config"].retriever.bert
  return [f"--gin.BertConfig.{f.name}={getattr(b, f.name)!r}"
          for f in dataclasses.fields(b)] + [
              "--gin.RetrieverConfig.projection_size=16",
              "--gin.RetrieverConfig.pooling='mean'",
              "--gin.ReaderConfig.span_hidden_size=8",
              "--gin.ReaderConfig.max_span_width=4"] + [
                  f"--gin.QAConfig.{f.name}={getattr(QA_CONFIG, f.name)}"
                  for f in dataclasses.fields(QA_CONFIG)]


def test_cli_refuses_an_empty_question(setup):
  """`realm-ask ""` exits non-zero before loading anything."""
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", *_cli_bindings(setup),
       f"--gin.WORKDIR='{setup['workdir']}'",
       f"--gin.BLOCK_STORE='{setup['store'].path}'", QUESTIONS[0], "  "],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0
  assert "Question 2 of 2 is empty ('  '); ask something" in proc.stderr
  assert not proc.stdout.strip()  # Not even the first one was answered.


def test_cli_refuses_a_question_that_is_not_utf8(tmp_path):
  """Issue 64, H10: bytes that are not UTF-8 on the command line (Python
  decodes them with surrogateescape) are refused naming the question and
  the byte, before anything loads (the workdir and store do not exist)."""
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", f"--gin.WORKDIR='{tmp_path / 'none'}'",
       f"--gin.BLOCK_STORE='{tmp_path / 'none'}'", QUESTIONS[0],
       b"Where was Mozart\xff born?"],
      capture_output=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  stderr = proc.stderr.decode("utf-8", "backslashreplace")
  assert proc.returncode == 1, stderr[-3000:]
  assert ("Question 2 of 2 is not valid UTF-8 (the byte 0xff at character "
          "17): 'Where was Mozart\\xff born?'; ask it in UTF-8") in stderr
  assert "Traceback" not in stderr and not proc.stdout.strip()
  # A file of questions (absl's --flagfile: each line that is no flag is
  # one), saved as Latin-1: named with its line, not a UnicodeDecodeError.
  questions = tmp_path / "questions.txt"
  questions.write_bytes(b"# Latin-1\n--top_k=2\nWhere was Mozart born?\n"
                        b"Caf\xe9 de Flore?\n")
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", f"--gin.WORKDIR='{tmp_path / 'none'}'",
       f"--gin.BLOCK_STORE='{tmp_path / 'none'}'",
       f"--flagfile={questions}"],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert (f"Question 2 of --flagfile={questions} (line 4) is not valid UTF-8 "
          "(the byte 0xe9 at character 4): 'Caf\\xe9 de Flore?'; save the "
          "file as UTF-8") in proc.stderr
  assert "Traceback" not in proc.stderr and not proc.stdout.strip()


def test_predict_refuses_a_question_that_is_not_utf8(setup):
  with pytest.raises(ValueError, match=re.escape(
      "Question 2 of 2 is not valid UTF-8 (the byte 0xe9 at character 4): "
      "'caf\\xe9'; ask it in UTF-8.")):
    setup["model"].predict([QUESTIONS[0], "caf\udce9"])
  with pytest.raises(ValueError, match="The question is not valid UTF-8"):
    setup["model"].ask("\ud800 where?")


def test_cli_json(setup):
  bindings = _cli_bindings(setup)
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", *bindings,
       f"--gin.WORKDIR='{setup['workdir']}'",
       f"--gin.BLOCK_STORE='{setup['store'].path}'", "--json", "--top_k=2",
       QUESTIONS[0], QUESTIONS[4], LONG_QUESTION],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines()
          if line.startswith("{")]
  # The long question is answered, with a warning saying what was read.
  long_row = rows.pop()
  assert long_row["question"] == LONG_QUESTION and long_row["prediction"]
  assert "14 of its 10000 wordpieces were kept" in long_row["warning"]
  assert not any("warning" in row for row in rows)
  # The common job convention: --dry_run prints the resolved configs only.
  dry = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--dry_run",
       "--gin.BLOCK_STORE='/nonexistent'", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", *bindings],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert dry.returncode == 0, dry.stderr[-3000:]
  assert "RealmConfig(" in dry.stdout and "QAConfig(" in dry.stdout
  assert "block_store='/nonexistent'" in dry.stdout
  assert [r["question"] for r in rows] == [QUESTIONS[0], QUESTIONS[4]]
  for row in rows:
    want = ask_lib.ask(row["question"], setup["model"], top_k=2)
    assert row["prediction"] == want.prediction
    assert row["block_id"] == want.block_id
    assert [e["block_id"] for e in row["evidence"]] == [
        e.block_id for e in want.evidence]
    np.testing.assert_allclose(
        [e["probability"] for e in row["evidence"]],
        [e.probability for e in want.evidence], atol=1e-5)


def _save_with_configs(directory, params, model_config, task):
  """A checkpoint carrying its configs, as the trainers write them (`task`:
  a config, or a FinetuneConfig's JSON)."""
  from realm_jax.core import dataclass_json  # pylint: disable=g-import-not-at-top
  ckpt = checkpoints.TrainCheckpointer(directory, async_save=False)
  ckpt.save(2, params, {"count": np.zeros((), np.int32)}, {
      "index_step": 0, "task_class": ("FinetuneConfig" if isinstance(
          task, dict) else type(task).__name__),
      "task_config": (task if isinstance(task, dict)
                      else dataclass_json.to_dict(task)),
      "model_config": dataclass_json.to_dict(model_config)}, force=True)
  ckpt.close()


def test_model_config_comes_from_the_checkpoint(setup, tmp_path):
  """ask/eval answer with the run's model config and QA sizes, not the gin
  files'; a command-line binding contradicting the model config fails."""
  from realm_jax.eval import qa_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.training import finetune  # pylint: disable=g-import-not-at-top
  config = setup["config"]
  run = finetune.FinetuneConfig(
      workdir=str(tmp_path), block_store=setup["store"].path,
      train_jsonl="t.jsonl", index_dir=str(setup["workdir"] / "index"),
      num_epochs=1.0, qa=QA_CONFIG)
  ckpt_dir = str(tmp_path / "checkpoints")
  _save_with_configs(ckpt_dir, setup["params"], config, run)
  # What a user's gin files might say: another pooling, ORQA's sizes.
  gin_model = dataclasses.replace(config, retriever=dataclasses.replace(
      config.retriever, pooling="cls"))
  model, qa = qa_eval.checked_run_configs(ckpt_dir, None, gin_model,
                                          qa_inputs.QAConfig(), [])
  assert model == config and qa == QA_CONFIG
  # Eval settings bound on the command line win; agreeing bindings pass.
  model, qa = qa_eval.checked_run_configs(
      ckpt_dir, 2, config, dataclasses.replace(QA_CONFIG, num_retrieved=5),
      ["QAConfig.num_retrieved = 5", "RetrieverConfig.pooling = 'mean'"])
  assert model == config and qa.num_retrieved == 5
  assert qa.question_length == 16
  with pytest.raises(SystemExit, match=(
      r"RetrieverConfig.pooling='cls' on the command line, but checkpoint "
      r".*/2 was trained with RealmConfig.retriever.pooling='mean'.*drop "
      r"the binding")):
    qa_eval.checked_run_configs(ckpt_dir, 2, gin_model, QA_CONFIG,
                                ["realm.RetrieverConfig.pooling = 'cls'"])
  # A checkpoint without configs keeps the gin ones.
  model, qa = qa_eval.checked_run_configs(
      str(setup["workdir"] / "checkpoints"), 1, gin_model, QA_CONFIG,
      ["RetrieverConfig.pooling = 'cls'"])
  assert model == gin_model and qa == QA_CONFIG


def test_old_finetune_checkpoints_answer_with_their_qa_sizes(setup,
                                                             tmp_path):
  """A fine-tuning checkpoint written when FinetuneConfig held the QA sizes
  as flat fields (max_span_width among them) loads with those sizes."""
  from realm_jax.core import dataclass_json  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import qa_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.training import finetune  # pylint: disable=g-import-not-at-top
  new = dataclass_json.to_dict(finetune.FinetuneConfig(
      workdir=str(tmp_path), block_store=setup["store"].path,
      train_jsonl="t.jsonl", index_dir=str(setup["workdir"] / "index"),
      num_epochs=1.0))
  del new["qa"]
  old = dict(new, question_length=16, num_retrieved=6, num_reader_blocks=3,
             reader_length=48, max_span_width=None)
  ckpt_dir = str(tmp_path / "checkpoints")
  _save_with_configs(ckpt_dir, setup["params"], setup["config"], old)
  _, qa = qa_eval.checked_run_configs(ckpt_dir, None, setup["config"],
                                      qa_inputs.QAConfig(), [])
  assert qa == QA_CONFIG
  # Without a qa_config, the answering model takes the checkpoint's.
  model = qa_model.load_qa_model(
      model_config=setup["config"], store=setup["store"],
      checkpoint_dir=ckpt_dir, index_dir=str(setup["workdir"] / "index"),
      batch_size=4)
  assert model.qa_config == QA_CONFIG
  assert model.ask(QUESTIONS[0]).prediction == setup["model"].ask(
      QUESTIONS[0]).prediction


def test_untrained_span_head_is_announced(setup, tmp_path, caplog):
  """Weights without a trained span head (MiniLM, BERT, REALM
  pre-training) load with one WARNING saying how to fine-tune."""
  params = setup["params"]
  no_span_head = {"retriever": params["retriever"], "reader": {
      k: v for k, v in params["reader"].items() if k != "span_head"}}
  # A fine-tuned span head (not the seed-0 initialisation).
  tuned = {"retriever": params["retriever"], "reader": dict(
      params["reader"], span_head=jax.tree.map(lambda x: x + 0.5,
                                               params["reader"]["span_head"]))}
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "pre"),
                                       async_save=False)
  for step, tree in ((3, no_span_head), (4, tuned)):
    ckpt.save(step, tree, {"count": np.zeros((), np.int32)}, {}, force=True)
  ckpt.close()
  kwargs = dict(model_config=setup["config"], store=setup["store"],
                qa_config=QA_CONFIG, batch_size=4,
                index_dir=str(setup["workdir"] / "index"))
  with caplog.at_level("WARNING"):
    trained = qa_model.load_qa_model(
        init_from=f"checkpoint:{tmp_path / 'pre'}@4", **kwargs)
  assert trained.span_head_trained and "span head" not in caplog.text
  with caplog.at_level("WARNING"):
    untrained = qa_model.load_qa_model(
        init_from=f"checkpoint:{tmp_path / 'pre'}@3", **kwargs)
  assert not untrained.span_head_trained
  warnings = [r for r in caplog.records if r.levelname == "WARNING"
              and "span head is not trained" in r.getMessage()]
  assert len(warnings) == 1
  assert "runs/finetune.gin" in warnings[0].getMessage()
  assert "nonsense" in warnings[0].getMessage()
  # Its retriever is the imported one: the same retrieval as the trained.
  a = trained.predict(QUESTIONS[:2])
  b = untrained.predict(QUESTIONS[:2])
  assert [r.retrieved_ids for r in a] == [r.retrieved_ids for r in b]


@pytest.mark.parametrize("meta,trained", [
    ({"task_class": "PretrainConfig"}, False),
    ({"task_class": "FinetuneConfig"}, True),
    ({"task_class": "FinetuneConfig", "span_head_trained": True}, True),
    ({"span_head_trained": False}, False)])
def test_a_checkpoint_says_whether_its_span_head_was_trained(
    setup, tmp_path, caplog, meta, trained):
  """A pre-training checkpoint carries an (untrained) span head: `load`
  reads the checkpoint's own record (fine-tuning writes
  `span_head_trained`; older checkpoints: their task), not the presence
  of the parameters, and warns for an untrained one."""
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "run"),
                                       async_save=False)
  ckpt.save(8, setup["params"], {"count": np.zeros((), np.int32)},
            dict(meta, index_step=0), force=True)
  ckpt.close()
  kwargs = dict(model_config=setup["config"], store=setup["store"],
                qa_config=QA_CONFIG, batch_size=4,
                index_dir=str(setup["workdir"] / "index"))
  for where in (dict(checkpoint_dir=str(tmp_path / "run")),
                dict(init_from=f"checkpoint:{tmp_path / 'run'}@8")):
    caplog.clear()
    with caplog.at_level("WARNING"):
      model = qa_model.load_qa_model(**where, **kwargs)
    assert model.span_head_trained is trained
    assert ("span head is not trained" in caplog.text) is not trained


@pytest.mark.parametrize("task_class,trained", [
    ("PretrainConfig", False), ("FinetuneConfig", True)])
def test_an_export_says_whether_its_span_head_was_trained(
    setup, tmp_path, caplog, task_class, trained):
  """An export of a pre-training checkpoint (which carries an untrained
  span head) answers with the notice, as the checkpoint does: through
  `realm_jax.load` and through `init_from="export:..."`."""
  import realm_jax  # pylint: disable=g-import-not-at-top
  from realm_jax import export  # pylint: disable=g-import-not-at-top
  from realm_jax.core import dataclass_json  # pylint: disable=g-import-not-at-top
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "run" / "checkpoints"),
                                       async_save=False)
  ckpt.save(3, setup["params"], {"count": np.zeros((), np.int32)}, {
      "index_step": 0, "task_class": task_class, "task_config": {},
      "model_config": dataclass_json.to_dict(setup["config"])}, force=True)
  ckpt.close()
  out = export.export_checkpoint(export.ExportConfig(
      workdir=str(tmp_path / "run"), output_dir=str(tmp_path / "export")))
  with open(os.path.join(out, "realm_config.json")) as f:
    assert json.load(f)["span_head_trained"] is trained
  index_dir = str(setup["workdir"] / "index")
  for load in (
      lambda: realm_jax.load(out, block_store=setup["store"].path,
                             index_dir=index_dir, qa_config=QA_CONFIG,
                             batch_size=4),
      lambda: qa_model.load_qa_model(
          init_from=f"export:{out}", model_config=setup["config"],
          store=setup["store"], qa_config=QA_CONFIG, batch_size=4,
          index_dir=index_dir)):
    caplog.clear()
    with caplog.at_level("WARNING"):
      model = load()
    assert model.span_head_trained is trained
    assert ("span head is not trained" in caplog.text) is not trained
  # An export inside the run's checkpoints (by any name) would look like
  # a step: refused.
  os.symlink(tmp_path / "run", tmp_path / "alias")
  from realm_jax.core import io_utils  # pylint: disable=g-import-not-at-top
  with pytest.raises(io_utils.SamePlaceError, match="output_dir="):
    export.export_checkpoint(export.ExportConfig(
        workdir=str(tmp_path / "run"),
        output_dir=str(tmp_path / "alias" / "checkpoints" / "9")))
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["3"]


def _hf_bert(setup, tmp_path_factory) -> str:
  """A Hugging Face BERT directory of the fixture's size (an export's query
  tower), as `init_from="hf_bert:<dir>"` (and `minilm`) import one: BERT
  weights, no span head."""
  if "hf_bert" not in setup:
    from realm_jax import export  # pylint: disable=g-import-not-at-top
    out = export.export_model(setup["params"], setup["config"], str(
        tmp_path_factory.mktemp("hf_bert") / "export"))
    setup["hf_bert"] = os.path.join(out, "retriever")
  return setup["hf_bert"]


@pytest.mark.parametrize("ranker", ["dense", "bm25", "hybrid"])
def test_an_untrained_span_head_is_announced_whatever_the_ranker(
    setup, tmp_path, tmp_path_factory, caplog, ranker):
  """Issue 64, D3: BERT weights with no span head (`hf_bert:`, `minilm`:
  the recipe of docs/recipes.md) and a pre-training checkpoint load with
  `span_head_trained == False` and the WARNING, with every ranker. The
  imported BERT lost it: `initial_params` hands back the fresh span head
  as a copy, which the identity test took for imported weights."""
  import realm_jax  # pylint: disable=g-import-not-at-top
  from realm_jax.core import dataclass_json  # pylint: disable=g-import-not-at-top
  rank = dict(ranker=ranker, bm25_dir=str(tmp_path / "bm25"))
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "pre" / "checkpoints"),
                                       async_save=False)
  ckpt.save(8, setup["params"], {"count": np.zeros((), np.int32)}, {
      "index_step": 0, "task_class": "PretrainConfig",
      "task_config": {"block_store": setup["store"].path},
      "model_config": dataclass_json.to_dict(setup["config"])}, force=True)
  ckpt.close()
  for load in (
      lambda: qa_model.load_qa_model(
          init_from=f"hf_bert:{_hf_bert(setup, tmp_path_factory)}",
          model_config=setup["config"], store=setup["store"],
          index_dir=str(setup["workdir"] / "index"), qa_config=QA_CONFIG,
          batch_size=4, **rank),
      lambda: realm_jax.load(str(tmp_path / "pre"), qa_config=QA_CONFIG,
                             index_dir=str(setup["workdir"] / "index"),
                             batch_size=4, **rank)):
    caplog.clear()
    with caplog.at_level("WARNING"):
      model = load()
    assert model.span_head_trained is False
    assert "span head is not trained" in caplog.text


def test_cli_announces_an_untrained_span_head_with_the_hybrid(
    setup, tmp_path, tmp_path_factory):
  """realm-ask prints its Notice for imported BERT weights (the recipe's
  `INIT_FROM='minilm'`, here `hf_bert:` of the fixture's size) with the
  hybrid ranker too (issue 64, D3)."""
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", *_cli_bindings(setup),
       f"--gin.INIT_FROM='hf_bert:{_hf_bert(setup, tmp_path_factory)}'",
       f"--gin.INDEX_DIR='{setup['workdir'] / 'index'}'",
       f"--gin.BLOCK_STORE='{setup['store'].path}'",
       "--gin.qa_eval.EvalConfig.ranker='hybrid'",
       f"--gin.qa_eval.EvalConfig.bm25_dir='{tmp_path / 'bm25'}'",
       "--top_k=2", QUESTIONS[0]],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith(
      "Notice: the reader's span head is not trained"), proc.stdout[:500]


@pytest.mark.parametrize("questions,error,match", [
    ("Where was Mozart born?", TypeError, "list of questions, got one str"),
    (b"Where was Mozart born?", TypeError, "got one bytes"),
    (["Where was Mozart born?", 7], TypeError,
     "Question 2 of 2 is '7' \\(int\\)"),
    ([None], TypeError, "Question 1 of 1 is 'None'"),
    (["Where was Mozart born?", "  "], ValueError,
     "Question 2 of 2 .* is empty")])
def test_predict_refuses_a_bare_string_and_non_questions(setup, questions,
                                                         error, match):
  """A string is not a list of questions: predict would answer each of
  its characters."""
  with pytest.raises(error, match=match):
    setup["model"].predict(questions)


@pytest.mark.parametrize("answers,match", [
    (["Paris"], r"predict's answers\[0\] takes a list of reference "
     r"answers, got one str \('Paris'\); each question takes a list of "
     r"answers: answers\[0\]=\['Paris'\]"),
    ("Paris", r"got one str \('Paris'\); pass answers=\[\['Paris'\]\]"),
    ([["Paris", 3]], r"answers\[0\]: answer 2 of 2 is '3' \(int\)")])
def test_predict_refuses_a_bare_string_as_answers(setup, answers, match):
  """`answers=["Salzburg"]` would be read as the answers S, a, l, ... and
  a one-letter prediction scored as correct."""
  with pytest.raises(TypeError, match=match):
    setup["model"].predict([QUESTIONS[0]], answers=answers)
  result = setup["model"].predict([QUESTIONS[0]], answers=[("Salzburg",)])
  assert result[0].answers == ["Salzburg"]


def test_steps_and_top_k_that_are_not_there_say_so(setup, tmp_path):
  """`load(step=99)` of a run without step 99, `step=4.0`, a checkpoint
  `@abc`, and `top_k` below 1 or not an int each get a sentence (not
  "carries no model config", a bare int() error, or a silent default)."""
  import realm_jax  # pylint: disable=g-import-not-at-top
  from realm_jax.checkpoint_import import init_from as init_lib  # pylint: disable=g-import-not-at-top
  from realm_jax.core import dataclass_json  # pylint: disable=g-import-not-at-top
  ckpt_dir = str(tmp_path / "run" / "checkpoints")
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, async_save=False)
  ckpt.save(2, setup["params"], {"count": np.zeros((), np.int32)}, {
      "index_step": 0, "model_config": dataclass_json.to_dict(
          setup["config"])}, force=True)
  ckpt.close()
  with pytest.raises(FileNotFoundError, match=rf"step=99: checkpoint "
                     rf"{ckpt_dir}/99 does not exist; the steps there are "
                     r"\[2\]"):
    realm_jax.load(str(tmp_path / "run"), step=99)
  with pytest.raises(TypeError, match=r"step=4.0 \(float\) is not a "
                     "checkpoint step"):
    realm_jax.config_of(str(tmp_path / "run"), step=4.0)
  _, fresh = functional.init(lambda r: Realm(setup["config"], rngs=r), 0)
  with pytest.raises(ValueError, match=r"init_from='checkpoint:.*@abc': "
                     r"'abc' after '@' is not a checkpoint step"):
    init_lib.initial_params(setup["config"], fresh,
                            f"checkpoint:{ckpt_dir}@abc")
  with pytest.raises(FileNotFoundError, match=r"init_from='checkpoint:"
                     r".*@7': checkpoint .*/7 does not exist"):
    init_lib.initial_params(setup["config"], fresh,
                            f"checkpoint:{ckpt_dir}@7")
  model = setup["model"]
  for top_k, error in ((0, ValueError), (-1, ValueError), ("3", TypeError),
                       (2.0, TypeError)):
    with pytest.raises(error, match=r"top_k \(num_evidence\)="):
      model.ask(QUESTIONS[0], top_k=top_k)
  assert len(model.ask(QUESTIONS[0], top_k=2).evidence) == 2


def test_a_damaged_checkpoint_behind_load_names_it_and_the_way_out(
    setup, tmp_path):
  """A truncated array file of the newest checkpoint: `load` says which
  checkpoint does not restore, in the trainer's words, and which older
  step to answer with (not TensorStore's bare error)."""
  ckpt_dir = str(tmp_path / "run")
  ckpt = checkpoints.TrainCheckpointer(ckpt_dir, async_save=False)
  for step in (2, 4):
    ckpt.save(step, setup["params"], {"count": np.zeros((), np.int32)},
              {"index_step": 0}, force=True)
  ckpt.close()
  data = os.path.join(ckpt_dir, "4", "reader", "ocdbt.process_0", "d")
  for name in os.listdir(data):
    with open(os.path.join(data, name), "r+b") as f:
      f.truncate(10)
  with pytest.raises(checkpoints.CheckpointRestoreError, match=(
      rf"(?s)^checkpoint {ckpt_dir}/4 does not restore \(.*\); its files "
      r"are "
      r"damaged: answer with an older step: step=2 ")) as e:
    qa_model.load_qa_model(model_config=setup["config"], store=setup["store"],
                           checkpoint_dir=ckpt_dir, qa_config=QA_CONFIG,
                           index_dir=str(setup["workdir"] / "index"),
                           batch_size=4)
  # Not buried under orbax's and TensorStore's chained tracebacks (a
  # hundred lines of spec dump): the message is the whole report.
  import traceback  # pylint: disable=g-import-not-at-top
  report = "".join(traceback.format_exception(e.value))
  assert "The above exception" not in report and "TensorStore(" not in report


def test_without_an_index_dir_the_run_answers_with_its_own_index(
    setup, tmp_path):
  """A fine-tuning run trained against an index outside its workdir:
  `realm-ask` (load_qa_model with the workdir and no INDEX_DIR) uses that
  index, as `realm_jax.load` does; when it is gone, the error names
  `--gin.INDEX_DIR`."""
  from realm_jax.core import dataclass_json  # pylint: disable=g-import-not-at-top
  from realm_jax.training import finetune  # pylint: disable=g-import-not-at-top
  index_dir = str(setup["workdir"] / "index")
  task = finetune.FinetuneConfig(
      workdir=str(tmp_path / "ft"), block_store=setup["store"].path,
      train_jsonl="q.jsonl", index_dir=index_dir, num_train_steps=5,
      qa=QA_CONFIG)
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "ft" / "checkpoints"),
                                       async_save=False)
  ckpt.save(5, setup["params"], {"count": np.zeros((), np.int32)},
            {"index_step": 0, "task_class": "FinetuneConfig",
             "task_config": dataclass_json.to_dict(task),
             "span_head_trained": True}, force=True)
  ckpt.close()
  kwargs = dict(model_config=setup["config"], store=setup["store"],
                workdir=str(tmp_path / "ft"), batch_size=4)
  model = qa_model.load_qa_model(**kwargs)  # As realm-ask calls it.
  assert model.index.step == 0 and model.qa_config == QA_CONFIG
  assert model.ask(QUESTIONS[0]) == setup["model"].ask(QUESTIONS[0])
  task = dataclasses.replace(task, index_dir=str(tmp_path / "gone"))
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "ft" / "checkpoints"),
                                       async_save=False)
  ckpt.save(6, setup["params"], {"count": np.zeros((), np.int32)},
            {"task_class": "FinetuneConfig",
             "task_config": dataclass_json.to_dict(task)}, force=True)
  ckpt.close()
  with pytest.raises(Exception, match=r"the index the run trained against "
                     r".*--gin.INDEX_DIR.*gone"):
    qa_model.load_qa_model(**kwargs)


def test_a_huge_question_is_cut_on_its_q_line(setup):
  """A 44 KB question is answered, but its `Q:` line shows its start and
  its length, not all of it."""
  result = ask_lib.ask(QUESTIONS[0], setup["model"], top_k=1)
  huge = dataclasses.replace(result, question=LONG_QUESTION[:44000])
  line = ask_lib.format_result(huge).splitlines()[0]
  assert line.startswith("Q: Where was Mozart born? Where was")
  assert line.endswith("... (44000 characters)") and len(line) < 240
  assert ask_lib.format_result(result).splitlines()[0] == (
      f"Q: {QUESTIONS[0]}")


def test_the_reader_reads_the_rankers_blocks(setup, tmp_path):
  """ranker="bm25" / "hybrid": the reader reads the ranker's top K, and each
  evidence block says which ranker found it and at what rank."""
  from realm_jax.index import bm25, rankers  # pylint: disable=g-import-not-at-top
  store, model = setup["store"], setup["model"]
  bm25_dir = str(tmp_path / "bm25")
  kwargs = dict(model_config=setup["config"], store=store,
                workdir=str(setup["workdir"]), qa_config=QA_CONFIG,
                batch_size=4, bm25_dir=bm25_dir)
  by_bm25 = qa_model.load_qa_model(ranker="bm25", **kwargs)
  fusion = rankers.FusionConfig(dense_weight=0.7, bm25_weight=0.3,
                                candidates=6)
  hybrid = qa_model.load_qa_model(ranker=rankers.Hybrid(fusion), **kwargs)
  index = bm25.BM25Index.from_store(store)  # independent of the persisted
  sparse_ids, sparse_scores = index.search(QUESTIONS, 6)
  dense = model.predict(QUESTIONS)
  for i, (a, h) in enumerate(zip(by_bm25.predict(QUESTIONS),
                                 hybrid.predict(QUESTIONS))):
    assert a.retrieved_ids == sparse_ids[i].tolist()
    np.testing.assert_allclose(a.retrieved_scores, sparse_scores[i],
                               rtol=1e-6)
    # BM25 claims the blocks it scored above 0 (a query term in them).
    assert [e.found_by for e in a.evidence] == [
        {"bm25": e.rank + 1} if sparse_scores[i][e.rank] > 0 else {}
        for e in a.evidence]
    # p(z|x) is the retriever's over the ranked blocks.
    logits = _retrieval_logits(setup, QUESTIONS[i], a.retrieved_ids)
    np.testing.assert_allclose([e.retrieval_logit for e in a.evidence],
                               logits[[e.rank for e in a.evidence]],
                               rtol=1e-4, atol=1e-4)
    # The hybrid: the fusion of the dense and the BM25 rankings.
    want = rankers.fuse([
        rankers.Ranking(np.array([dense[i].retrieved_ids]),
                        np.array([dense[i].retrieved_scores], np.float32),
                        {"dense": np.arange(6)[None]}),
        rankers.Ranking(sparse_ids[i:i + 1], sparse_scores[i:i + 1],
                        {"bm25": np.where(sparse_scores[i:i + 1] > 0,
                                          np.arange(6)[None], -1)})],
        (0.7, 0.3), 6)
    assert h.retrieved_ids == want.ids[0].tolist()
    bm25_score = dict(zip(sparse_ids[i].tolist(), sparse_scores[i]))
    for e in h.evidence:
      assert e.found_by and set(e.found_by) <= {"dense", "bm25"}
      for name, rank in e.found_by.items():
        ids = dense[i].retrieved_ids if name == "dense" else sparse_ids[i]
        assert ids[rank - 1] == e.block_id
      # No BM25 rank for a block BM25 scored 0 (issue 64, H11).
      assert ("bm25" in e.found_by) == (bm25_score.get(e.block_id, 0) > 0)
  text = ask_lib.format_result(hybrid.ask(QUESTIONS[0], top_k=3))
  assert "found by " in text
  assert (tmp_path / "bm25" / "manifest.json").exists()
  with pytest.raises(ValueError, match="'sparse' is not a ranker"):
    qa_model.load_qa_model(ranker="sparse", **kwargs)


def test_load_takes_a_ranker(setup, tmp_path):
  import realm_jax  # pylint: disable=g-import-not-at-top
  from realm_jax.index import bm25  # pylint: disable=g-import-not-at-top
  from realm_jax.training import finetune  # pylint: disable=g-import-not-at-top
  run = finetune.FinetuneConfig(
      workdir=str(tmp_path), block_store=setup["store"].path,
      train_jsonl="t.jsonl", index_dir=str(setup["workdir"] / "index"),
      num_epochs=1.0, qa=QA_CONFIG)
  _save_with_configs(str(tmp_path / "checkpoints"), setup["params"],
                     setup["config"], run)
  model = realm_jax.load(str(tmp_path), ranker="bm25",
                         bm25_dir=str(tmp_path / "bm25"), batch_size=4)
  ids, _ = bm25.BM25Index.from_store(setup["store"]).search(QUESTIONS[:1], 6)
  assert model.ask(QUESTIONS[0]).retrieved_ids == ids[0].tolist()


def test_cli_hybrid_shows_which_ranker_found_each_block(setup, tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", *_cli_bindings(setup),
       f"--gin.WORKDIR='{setup['workdir']}'",
       f"--gin.BLOCK_STORE='{setup['store'].path}'",
       "--gin.qa_eval.EvalConfig.ranker='hybrid'",
       f"--gin.qa_eval.EvalConfig.bm25_dir='{tmp_path / 'bm25'}'",
       "--top_k=4", QUESTIONS[0]],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = [line for line in proc.stdout.splitlines() if "found by" in line]
  assert len(found) >= 4
  # Which ranker and weights, and where they came from (issue 70): no
  # calibration beside the index, so the fixed rule.
  assert ("Ranker: hybrid (weighted, dense 0.5, bm25 0.5), from the fixed "
          "rule: no ") in proc.stdout
  assert any("dense #" in line for line in found)
  assert any("bm25 #" in line for line in found)
  bad = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.ask", "--gin_file=models/tiny.gin",
       "--gin_file=runs/eval.gin", *_cli_bindings(setup),
       f"--gin.WORKDIR='{setup['workdir']}'",
       f"--gin.BLOCK_STORE='{setup['store'].path}'",
       "--gin.qa_eval.EvalConfig.ranker='bm52'", QUESTIONS[0]],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS,
      env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
  assert bad.returncode != 0
  assert "'bm52' is not a ranker" in bad.stderr

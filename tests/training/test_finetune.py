"""Open-QA fine-tuning: learning, 8 devices = 1 device, resume, bad index.

Runs the real trainer on the tiny real-text corpus with an exact-search
index published by the index builder's code from the initial retriever.
"""

import dataclasses
import glob
import json
import os

import gin
import jax
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.data import block_store, block_store_writer, blocks, wikipedia
from realm_jax.data import qa as qa_lib
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import build, publish
from realm_jax.model import functional
from realm_jax.model.realm import Realm
from realm_jax.testing import corpus, tiny
from realm_jax.data import qa_inputs
from realm_jax.training import finetune
from realm_jax.core import checkpoints, dataclass_json, parallel

STEPS = 12
QA = [
    ("Where was Mozart born?", ["Salzburg"]),
    ("When was Mozart born?", ["1756"]),
    ("Where did Mozart move in 1781?", ["Vienna"]),
    ("Where was Albert Einstein born?", ["Ulm"]),
    ("When did Einstein receive the Nobel Prize?", ["1921"]),
    ("Where did Einstein work?", ["Princeton"]),
    ("What is the capital of France?", ["Paris"]),
    ("When was the Eiffel Tower built?", ["1889"]),
    ("What is the capital of Germany?", ["Berlin"]),
    ("When did the Berlin Wall fall?", ["9 November 1989", "1989"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("When did Tokyo host the Olympic Games?", ["1964"]),
    ("Which city lies on the Nile?", ["Cairo"]),
    ("Who explored the Amazon?", ["Francisco de Orellana"]),
    ("What did Shakespeare write around 1600?", ["Hamlet"]),
    ("When did Shakespeare die?", ["1616"]),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """Block store, QA file, model, and an index from the initial retriever."""
  root = tmp_path_factory.mktemp("ft")
  store_dir = _write_store(str(root / "blocks"), max_block_len=32)
  qa_path = str(root / "qa.jsonl")
  with open(qa_path, "w") as f:
    for q, a in QA:
      f.write(json.dumps({"question": q, "answer": a}) + "\n")
  _, model = _configs(str(root / "unused"), store_dir, qa_path, "unused")
  store = block_store.BlockStore.open(store_dir)
  _, params = functional.init(lambda r: Realm(model, rngs=r), 0)
  index_root = str(root / "index")
  build.build_and_publish(
      retriever_params=params["retriever"], retriever_config=model.retriever,
      store=store, root=index_root, step=0,
      config=build.IndexBuildConfig(searcher="exact"))
  return {"root": root, "store_dir": store_dir, "store": store,
          "qa": qa_path, "index": index_root, "model": model}


def _write_store(directory, max_block_len):
  """The tiny corpus's block store (make_tiny_corpus without the slow
  salient-span annotation fine-tuning does not need)."""
  tok = Tokenizer()
  docs = [wikipedia.Document(t, x) for t, x in corpus.ARTICLES]
  block_store_writer.write_block_store(
      blocks.pack_blocks(docs, tok, max_block_len=max_block_len), directory,
      tokenizer_vocab_path=tok.vocab_path, source="tiny test corpus",
      max_block_len=max_block_len)
  return directory


def _configs(workdir, store, qa, index, **overrides):
  # Checkpoints only at the end of a call (orbax saves take seconds here).
  values = {"num_train_steps": STEPS, "checkpoint_every": 100, **overrides}
  qa_fields = {f.name for f in dataclasses.fields(qa_inputs.QAConfig)}
  scope = {k: "qa_inputs.QAConfig" if k in qa_fields
           else "finetune.FinetuneConfig" for k in values}
  gin.clear_config()
  try:
    gin_cli.parse(["experiments/finetune_tiny_cpu.gin"], [
        f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{store}'",
        f"TRAIN_JSONL = '{qa}'", f"INDEX_DIR = '{index}'"] + [
            f"{scope[k]}.{k} = {v!r}" for k, v in values.items()])
    return (gin.get_configurable(finetune.FinetuneConfig)(),
            gin.get_configurable(finetune.RealmConfig)())
  finally:
    gin.clear_config()


def _config(setup, workdir, **overrides):
  config, _ = _configs(str(workdir), setup["store_dir"], setup["qa"],
                       setup["index"], **overrides)
  return config


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference_run(setup):
  workdir = str(setup["root"] / "reference")
  history = finetune.train(config=_config(setup, workdir),
                           model=setup["model"])
  return workdir, history


def test_loss_decreases_and_only_the_qa_parts_train(setup, reference_run):
  workdir, history = reference_run
  losses = [h["loss"] for h in history]
  assert [h["step"] for h in history] == list(range(1, STEPS + 1))
  assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3]), losses
  for h in history:
    np.testing.assert_allclose(h["loss"], h["retriever_loss"]
                               + h["reader_loss"], rtol=1e-4, atol=1e-5)
    # K = 8 of the store's 9 blocks: an answer's block may be the one left.
    assert 0.75 <= h["has_positive_in_top_k"] <= 1.0
    assert 0.0 <= h["has_gold_span_in_top_r"] <= 1.0
    assert h["weight"] == 8.0
  assert history[-1]["reader_span_correct"] > history[0][
      "reader_span_correct"]
  assert checkpoints.is_done(checkpoints.checkpoint_dir(workdir))
  # The reader and the query tower moved; the unused MLM head did not.
  _, fresh = functional.init(lambda r: Realm(setup["model"], rngs=r), 0)
  final = checkpoints.restore_items(checkpoints.checkpoint_dir(workdir),
                                    STEPS, ("retriever", "reader"))
  assert not np.allclose(final["reader"]["span_head"]["output"]["kernel"],
                         fresh["reader"]["span_head"]["output"]["kernel"])
  assert not np.allclose(
      final["retriever"]["query_embedder"]["projection"]["kernel"],
      fresh["retriever"]["query_embedder"]["projection"]["kernel"])
  for got, want in zip(jax.tree_util.tree_leaves(final["reader"]["mlm_head"]),
                       jax.tree_util.tree_leaves(fresh["reader"]["mlm_head"])):
    np.testing.assert_array_equal(got, want)


def test_resume_continues_the_same_trajectory(setup, reference_run, tmp_path):
  ref = {h["step"]: h["loss"] for h in reference_run[1]}
  workdir = str(tmp_path / "run")
  config = _config(setup, workdir)
  first = finetune.train(config=config, model=setup["model"], stop_after=5)
  assert [h["step"] for h in first] == [1, 2, 3, 4, 5]
  assert not checkpoints.is_done(checkpoints.checkpoint_dir(workdir))
  second = finetune.train(config=config, model=setup["model"])
  assert [h["step"] for h in second] == list(range(6, STEPS + 1))
  records = _records(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for r in records:
    np.testing.assert_allclose(r["loss"], ref[r["step"]], rtol=1e-4,
                               err_msg=f"step {r['step']}")
  with open(os.path.join(workdir, "history.json")) as f:
    assert [h["step"] for h in json.load(f)] == list(range(1, STEPS + 1))


def _qa_batch(setup, model, n):
  """A QA batch over the frozen index with fixed retrievals (8 of 9)."""
  tok = Tokenizer()
  store = setup["store"]
  index = publish.load_frozen_index(setup["index"], store, model)
  questions = qa_inputs.tokenize_questions(tok, [q for q, _ in QA[:n]], 16)
  rng = np.random.default_rng(0)
  retrieved = np.stack([rng.permutation(len(store))[:8] for _ in range(n)])
  config = qa_inputs.QAConfig(question_length=16, num_retrieved=8,
                              num_reader_blocks=3, reader_length=48)
  batch = qa_inputs.qa_batch(
      questions, retrieved, index.embeddings, store, config,
      answer_ids=[qa_lib.tokenize_answers(tok, a) for _, a in QA[:n]],
      max_span_width=model.reader.max_span_width)
  return {k: batch[k] for k in finetune.DEVICE_FEATURES}


def _np_marginal(logits, positives):
  """-log sum_pos softmax over finite entries; 0 without a positive."""
  logits = logits.reshape(-1).astype(np.float64)
  positives = positives.reshape(-1)
  ok = np.isfinite(logits)
  if not (positives & ok).any():
    return 0.0
  m = logits[ok].max()
  norm = np.log(np.exp(logits[ok] - m).sum()) + m
  pos = np.log(np.exp(logits[positives & ok] - m).sum()) + m
  return norm - pos


def test_eight_devices_equal_one_device_and_numpy(setup):
  model = setup["model"]
  graphdef, params = functional.init(lambda r: Realm(model, rngs=r), 0)
  batch = _qa_batch(setup, model, 16)
  # K = 8 of 9 blocks: most questions have a positive, maybe not all
  # (those must contribute zero).
  assert batch["has_answer"].any(-1).sum() >= 12
  assert batch["gold_spans"].any((1, 2, 3)).sum() >= 4
  loss_fn = finetune.make_loss_fn(graphdef)
  results = []
  for devices in (jax.devices(), jax.devices()[:1]):
    mesh = parallel.make_mesh(devices)
    fn = jax.jit(parallel.data_parallel_value_and_grad(loss_fn, mesh))
    results.append(jax.device_get(fn(params,
                                     parallel.shard_batch(mesh, batch))))
  (loss8, grads8, m8), (loss1, grads1, m1) = results
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  scale = max(np.abs(g).max() for g in jax.tree_util.tree_leaves(grads1))
  for g8, g1 in zip(jax.tree_util.tree_leaves(grads8),
                    jax.tree_util.tree_leaves(grads1)):
    np.testing.assert_allclose(g8, g1, rtol=1e-3, atol=1e-5 * scale)
  for k in m1:
    np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-6)
  # An independent computation from the model's logits.
  retrieval, reader = jax.device_get(jax.jit(
      lambda p, b: functional.bind(graphdef, p).qa_logits(b))(params, batch))
  want_retriever = [_np_marginal(retrieval[i], batch["has_answer"][i])
                    for i in range(16)]
  want_reader = [_np_marginal(reader[i], batch["gold_spans"][i])
                 for i in range(16)]
  np.testing.assert_allclose(m1["retriever_loss"], np.mean(want_retriever),
                             rtol=1e-4)
  np.testing.assert_allclose(m1["reader_loss"], np.mean(want_reader),
                             rtol=1e-4)
  np.testing.assert_allclose(loss1, np.mean(want_retriever)
                             + np.mean(want_reader), rtol=1e-4)
  # The query tower gets gradient; the unused MLM head none.
  assert np.abs(grads1["retriever"]["query_embedder"]["projection"]
                ["kernel"]).max() > 0
  assert all(np.all(g == 0) for g in
             jax.tree_util.tree_leaves(grads1["reader"]["mlm_head"]))


def test_index_of_another_corpus_or_size_is_refused(setup, tmp_path):
  other_store = _write_store(str(tmp_path / "other"), max_block_len=24)
  store = setup["store"]
  other_root = str(tmp_path / "other_index")
  other = block_store.BlockStore.open(other_store)
  build.publish_embeddings(
      embeddings=np.random.default_rng(0).normal(
          size=(len(other), 128)).astype(np.float32),
      store=other, root=other_root, step=0,
      config=build.IndexBuildConfig(searcher="exact"))
  config = _config(setup, tmp_path / "w1", index_dir=other_root)
  with pytest.raises(publish.IndexRejectedError,
                     match="corpus_fingerprint.*block_store"):
    finetune.train(config=config, model=setup["model"])
  narrow_root = str(tmp_path / "narrow_index")
  build.publish_embeddings(
      embeddings=np.random.default_rng(0).normal(
          size=(len(store), 16)).astype(np.float32),
      store=store, root=narrow_root, step=0,
      config=build.IndexBuildConfig(searcher="exact"))
  config = _config(setup, tmp_path / "w2", index_dir=narrow_root)
  with pytest.raises(publish.IndexRejectedError,
                     match=r"dim is 16 .*expects 128.*embedding size 128"):
    finetune.train(config=config, model=setup["model"])
  config = _config(setup, tmp_path / "w3", num_retrieved=len(store) + 1,
                   num_reader_blocks=3)
  with pytest.raises(publish.IndexRejectedError, match="num_retrieved"):
    finetune.train(config=config, model=setup["model"])
  # A workdir holding index/ is accepted for the index root itself.
  assert publish.resolve_index_root(str(setup["root"])) == setup["index"]
  # Nothing was trained or written for a refused index.
  assert not glob.glob(str(tmp_path / "w*" / "checkpoints" / "*"))


def test_config_checks():
  kwargs = dict(workdir="w", train_jsonl="q", index_dir="i", block_store="b")
  with pytest.raises(ValueError, match="exactly one of"):
    finetune.FinetuneConfig(**kwargs)
  with pytest.raises(ValueError, match="exactly one of"):
    finetune.FinetuneConfig(**kwargs, num_train_steps=3, num_epochs=1.0)
  with pytest.raises(ValueError, match="does not divide evenly over 8 dev"):
    # Checked when the run starts (building a config never starts JAX).
    finetune.train(config=finetune.FinetuneConfig(
        **kwargs, num_epochs=1.0, batch_size=12), model=tiny.tiny_realm())
  with pytest.raises(ValueError, match="num_reader_blocks=6 exceeds"):
    qa_inputs.QAConfig(num_retrieved=5, num_reader_blocks=6)
  config = finetune.FinetuneConfig(**kwargs, num_epochs=2.5, batch_size=16)
  assert config.total_steps(100) == 16  # ceil(2.5 * 100 / 16).
  assert config.qa == qa_inputs.QAConfig()  # ORQA's sizes.


def test_configs_of_old_checkpoints_read_their_flat_qa_fields():
  """A FinetuneConfig saved before `qa` held question_length,
  num_retrieved, num_reader_blocks, reader_length and max_span_width as
  its own fields: they load as `qa` (the width is the reader's)."""
  config = finetune.FinetuneConfig(
      workdir="w", train_jsonl="q", index_dir="i", block_store="b",
      num_epochs=1.0, qa=qa_inputs.QAConfig(
          question_length=16, num_retrieved=8, num_reader_blocks=3,
          reader_length=48))
  saved = dataclass_json.to_dict(config)
  assert finetune.config_from_dict(saved, "new") == config
  # What serving reads of it (no training module): the QA sizes alone.
  assert qa_inputs.qa_config_of_task(saved, "new") == config.qa
  old = {k: v for k, v in saved.items() if k != "qa"}
  for max_span_width in (None, 10):
    old.update(saved["qa"], max_span_width=max_span_width)
    assert finetune.config_from_dict(old, "old") == config
    assert qa_inputs.qa_config_of_task(old, "old") == config.qa
  with pytest.raises(ValueError, match=r"new\.qa: unknown QAConfig fields "
                     r"\['depth'\]"):
    qa_inputs.qa_config_of_task(dict(saved, qa=dict(saved["qa"], depth=3)),
                                "new")
  with pytest.raises(ValueError, match="old: unknown FinetuneConfig fields "
                     r"\['num_blocks'\]"):
    finetune.config_from_dict(dict(old, num_blocks=3), "old")


def test_regex_answers_become_literal_strings():
  texts = ["Mozart was born in Salzburg in 1756.",
           "He moved to Vienna in 1781; SALZBURG again."]
  got = finetune.regex_answer_strings([r"salz\w+", r"17[0-9]{2}", "("],
                                      texts)
  assert got == ["salzburg", "1756", "1781"]
  assert finetune.regex_answer_strings([r"\d"], ["1 2 3 4"], limit=2) == [
      "1", "2"]


def test_regex_answers_mark_positives_and_gold_spans(setup):
  tok, store = Tokenizer(), setup["store"]
  mozart = next(i for i in range(len(store)) if store.title(i) == "Mozart")
  paris = next(i for i in range(len(store)) if store.title(i) == "Paris")
  examples = [qa_lib.QAExample("Where was Mozart born?", (r"salz\w+",),
                               is_regex=True)] * 8
  questions = finetune.QuestionSet(examples, tok, question_length=16, seed=0)
  assert questions.answer_ids is None
  q, index = questions.batch(0, 2)
  retrieved = np.array([[paris, mozart], [mozart, paris]])
  answer_ids = finetune.answers_for_batch(questions, index, retrieved, store,
                                          tok)
  want = tok.tokenize(["Salzburg"])[0]
  for ids in answer_ids:
    assert len(ids) == 1 and list(ids[0]) == list(want)
  config = qa_inputs.QAConfig(question_length=16, num_retrieved=2,
                              num_reader_blocks=1, reader_length=48)
  batch = qa_inputs.qa_batch(q, retrieved, np.zeros((len(store), 4)), store,
                             config, answer_ids=answer_ids, max_span_width=10)
  np.testing.assert_array_equal(batch["has_answer"],
                                [[False, True], [True, False]])
  assert not batch["gold_spans"][0].any() and batch["gold_spans"][1].sum() == 1


@pytest.mark.parametrize("name", ["finetune_tiny_cpu.gin", "finetune_nq.gin",
                                  "finetune_webq.gin",
                                  "finetune_curatedtrec.gin"])
def test_experiment_gin_files_build_their_configs(name):
  gin.clear_config()
  try:
    gin_cli.parse([f"experiments/{name}"], [
        "WORKDIR = '/w'", "BLOCK_STORE = '/b'", "TRAIN_JSONL = '/q'",
        "INDEX_DIR = '/i'", "INIT_FROM = 'realm:/e,/b'"])
    config = gin.get_configurable(finetune.FinetuneConfig)()
    model = gin.get_configurable(finetune.RealmConfig)()
  finally:
    gin.clear_config()
  assert config.index_dir == "/i" and model.reader.span_head
  assert config.qa.reader_length - config.qa.question_length <= 288
  if name != "finetune_tiny_cpu.gin":
    assert (config.learning_rate, config.qa.num_retrieved,
            config.qa.num_reader_blocks, config.qa.reader_length) == (
                1e-5, 5000, 5, 320)
    assert config.regex_answers == (name == "finetune_curatedtrec.gin")
    assert model.retriever.bert.hidden_size == 768


def test_checkpoints_carry_their_configs_and_load_from_them(setup,
                                                           reference_run):
  """realm_jax.load rebuilds the answering model from the checkpoint alone
  (model config, block store, index, QA sizes) and answers as a model
  built from the same configs by hand."""
  import realm_jax  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import qa_model  # pylint: disable=g-import-not-at-top
  workdir, _ = reference_run
  saved = realm_jax.config_of(workdir)
  assert saved["task_class"] == "FinetuneConfig"
  config = _config(setup, workdir)
  loaded = realm_jax.load(workdir, batch_size=8)
  # Fine-tuning records that it trained the span head.
  ckpt_dir = os.path.join(workdir, "checkpoints")
  assert checkpoints.read_meta(ckpt_dir, checkpoints.newest_step(
      ckpt_dir))["span_head_trained"] is True
  assert loaded.span_head_trained
  assert loaded.model_config == qa_model.qa_model_config(setup["model"])
  assert loaded.qa_config == config.qa  # K = 8 fits the corpus.
  by_hand = qa_model.load_qa_model(
      model_config=setup["model"], store=setup["store"], workdir=workdir,
      index_dir=setup["index"], batch_size=8, qa_config=config.qa)
  question = QA[0][0]
  a, b = loaded.ask(question), by_hand.predict([question])[0]
  assert (a.prediction, a.block_id) == (b.prediction, b.block_id)
  np.testing.assert_allclose(a.score, b.score, rtol=1e-6)

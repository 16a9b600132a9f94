"""realm-calibrate (issue 70): the choice rule against an independent numpy
computation on hand-made rankings; the file beside the index, read back by
the eval job, `ask`'s model and `realm_jax.load` (an explicit fusion wins
over it); bad inputs."""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys

import gin
import numpy as np
import pytest

from realm_jax import gin_cli
from realm_jax.core import checkpoints, dataclass_json, outputs
from realm_jax.data import qa as qa_lib
from realm_jax.data import qa_inputs
from realm_jax.eval import calibrate, qa_eval, qa_model
from realm_jax.index import bm25 as bm25_lib
from realm_jax.index import calibration, publish, rankers
from realm_jax.jobs import calibrate as calibrate_job
from realm_jax.testing import timeouts, tiny

KS = (1, 5, 20)
DEPTH = 20


def _ranking(name, ids):
  ids = np.asarray(ids, np.int64)
  scores = np.broadcast_to(np.arange(ids.shape[1], 0, -1, dtype=np.float32),
                           ids.shape)
  ranks = np.where(ids >= 0, np.arange(ids.shape[1])[None], -1)
  return rankers.Ranking(ids, scores.copy(), {name: ranks.astype(np.int32)})


def _list(junk_base, answer, rank):
  """DEPTH block ids: junk, with `answer` at `rank` (None: not listed)."""
  row = [junk_base + j for j in range(DEPTH)]
  if rank is not None:
    row[rank] = answer
  return row


def _world(case, n=40):
  """(dense, bm25, flags) of `n` hand-made questions; question q's answer
  is block 100000 + q; each ranker's other blocks are its own junk.

  fusion: both rankers list the answer 3rd: fused, it is 1st.
  tie:    BM25 lists it 1st, but 4th for question 0, which the dense ranker
          lists 1st (else not at all): a fusion gains on one question only.
  bm25:   BM25 lists it 1st, the dense ranker never.
  """
  dense, sparse = [], []
  for q in range(n):
    answer = 100000 + q
    d_rank, s_rank = {"fusion": (2, 2), "tie": (0 if q == 0 else None,
                                                 3 if q == 0 else 0),
                      "bm25": (None, 0)}[case]
    dense.append(_list(1000 * q, answer, d_rank))
    sparse.append(_list(50000 + 1000 * q, answer, s_rank))
  flags = [{100000 + q: True} for q in range(n)]
  return _ranking("dense", dense), _ranking("bm25", sparse), flags


def _recall(ids, q_answers):
  """[Q, len(KS)]: an explicit loop over each top k."""
  return np.array([[float(any(b == a for b in row[:k])) for k in KS]
                   for row, a in zip(ids, q_answers)])


def _expected_choice(recalls):
  """The rule, written out: per-question score = mean over the ks; S the
  better single ranker (bm25 on a tie); F the best fusion whose paired
  per-k difference from S is never below -2 SE; F iff its paired gain
  exceeds 0 and 2 SE."""
  score = {n: r.mean(1) for n, r in recalls.items()}
  s = "dense" if score["dense"].mean() > score["bm25"].mean() else "bm25"
  n = len(score[s])
  best = None
  for name, r in recalls.items():
    if name in ("dense", "bm25"):
      continue
    dk = r - recalls[s]
    if np.any(dk.mean(0) < -2 * dk.std(0, ddof=1) / np.sqrt(n)):
      continue
    d = score[name] - score[s]
    gain, se = d.mean(), d.std(ddof=1) / np.sqrt(n)
    if best is None or gain > best[1]:
      best = (name, gain, se)
  if best and best[1] > 0 and best[1] > 2 * best[2]:
    return best[0], s, best[1], best[2]
  return s, s, (best or (None, 0.0, 0.0))[1], (best or (None, 0.0, 0.0))[2]


@pytest.mark.parametrize("case,winner", [("fusion", "fusion"),
                                         ("tie", "bm25"), ("bm25", "bm25")])
def test_the_rule_against_numpy(case, winner):
  dense, sparse, flags = _world(case)
  config = calibrate.CalibrateConfig(ks=KS, candidates=DEPTH)
  hits = calibrate.candidate_hits(dense, sparse, flags, config)
  answers = [100000 + q for q in range(len(flags))]
  grid = config.grid()
  recalls = {"dense": _recall(dense.ids, answers),
             "bm25": _recall(sparse.ids, answers)}
  for name, f in grid.items():
    fused = rankers.fuse([dense, sparse], (f.dense_weight, f.bm25_weight),
                         DEPTH, method=f.method, rrf_k=f.rrf_k)
    recalls[name] = _recall(fused.ids, answers)
  assert list(hits) == list(recalls)
  for name in recalls:
    np.testing.assert_array_equal(hits[name], recalls[name].astype(bool))
  decision = calibration.decide(hits, KS)
  chosen, single, gain, se = _expected_choice(recalls)
  assert (decision.chosen, decision.best_single) == (chosen, single)
  assert decision.gain == pytest.approx(gain)
  assert decision.se == pytest.approx(se)
  if winner == "fusion":
    assert decision.chosen in grid and gain > 0.3 and se == 0
  else:
    assert decision.chosen == "bm25"
    assert "bm25 ranks alone" in decision.reason
  if case == "tie":  # One question better: a gain within 2 SE.
    assert 0 < decision.gain <= 2 * decision.se
  table = {row["candidate"]: row for row in decision.table}
  for name, r in recalls.items():
    assert [table[name][f"recall@{k}"] for k in KS] == pytest.approx(
        r.mean(0), abs=1e-4)
  record = calibration.record_of(
      decision, grid, index=publish.PublishedIndex(3, {}, np.zeros((1, 1)),
                                                   None),
      store=_Store(), ks=KS, questions=len(flags), source={})
  assert rankers.from_record(record["chosen"], "x") == (
      calibration.candidate_choice(decision.chosen, grid))


class _Store:
  fingerprint = "f" * 64

  def __len__(self):
    return 7


def test_decide_refuses_what_it_cannot_judge():
  dense, sparse, flags = _world("bm25", n=3)
  hits = calibrate.candidate_hits(
      dense, sparse, flags, calibrate.CalibrateConfig(ks=KS,
                                                      candidates=DEPTH))
  with pytest.raises(ValueError, match="needs the hits of"):
    calibration.decide({"dense": hits["dense"]}, KS)
  with pytest.raises(ValueError, match="questions >= 2"):
    calibration.decide({k: v[:1] for k, v in hits.items()}, KS)
  for bad, match in [(dict(held_out=1.0), "held_out"), (dict(ks=()), "ks"),
                     (dict(methods=("max",)), "methods"),
                     (dict(dense_weights=(1.5,)), "dense_weights"),
                     (dict(candidates=10), "candidates"),
                     (dict(questions_format="csv"), "questions_format"),
                     (dict(max_questions=1), "max_questions")]:
    with pytest.raises(ValueError, match=f"CalibrateConfig.{match}"):
      calibrate.CalibrateConfig(**bad)


# -- The file beside the index, on the tiny corpus.

QA_CONFIG = qa_inputs.QAConfig(question_length=16, num_retrieved=6,
                               num_reader_blocks=3, reader_length=48)
QUESTIONS = [
    ("Where was Mozart born?", ["Salzburg"]),
    ("When did the Berlin Wall fall?", ["1989"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("Where was Einstein born?", ["Ulm"]),
    ("Where was Shakespeare born?", ["Stratford-upon-Avon"]),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run whose checkpoint carries its configs, its index, the model."""
  from realm_jax.training import finetune  # pylint: disable=g-import-not-at-top
  store, config, _, params, workdir = tiny.indexed_tiny_corpus(
      tmp_path_factory, "calibrate")
  task = finetune.FinetuneConfig(
      workdir=str(workdir), block_store=store.path, train_jsonl="t.jsonl",
      index_dir=str(workdir / "index"), num_epochs=1.0, qa=QA_CONFIG)
  ckpt = checkpoints.TrainCheckpointer(str(workdir / "checkpoints"),
                                       async_save=False)
  ckpt.save(1, params, {"count": np.zeros((), np.int32)}, {
      "index_step": 0, "task_class": "FinetuneConfig",
      "task_config": dataclass_json.to_dict(task),
      "model_config": dataclass_json.to_dict(config)}, force=True)
  ckpt.close()
  index = publish.load_frozen_index(str(workdir / "index"), store, config)
  model = qa_model.QAModel(config, params, index, store, QA_CONFIG,
                           batch_size=4)
  return dict(store=store, config=config, params=params, workdir=workdir,
              index=index, model=model,
              bm25=str(tmp_path_factory.mktemp("bm25") / "bm25"))


def _root(run, tmp_path):
  """A copy of the run's index root (each test its own calibration)."""
  root = tmp_path / "index"
  shutil.copytree(run["workdir"] / "index", root)
  return str(root)


def _examples():
  return [qa_lib.QAExample(q, tuple(a)) for q, a in QUESTIONS]


def test_the_file_beside_the_index_is_what_eval_ask_and_load_rank_with(
    run, tmp_path, caplog):
  import realm_jax  # pylint: disable=g-import-not-at-top
  root, store, index = _root(run, tmp_path), run["store"], run["index"]
  bm25 = rankers.BM25Ranker.for_store(store, run["bm25"])
  config = calibrate.CalibrateConfig(ks=(1, 2, 5), candidates=6)
  record = calibrate.calibrate(_examples(), dense=run["model"].ranker,
                               bm25=bm25, store=store, index=index,
                               config=config)
  # Each single ranker's recall, computed independently of the job.
  dense_results = run["model"].predict([q for q, _ in QUESTIONS],
                                       answers=[a for _, a in QUESTIONS])
  table = {row["candidate"]: row for row in record["candidates"]}
  assert table["dense"]["recall@2"] == pytest.approx(np.mean(
      [any(r.retrieved_has_answer[:2]) for r in dense_results]), abs=1e-4)
  ids, _ = bm25_lib.BM25Index.from_store(store).search(
      [q for q, _ in QUESTIONS], 6)
  assert table["bm25"]["recall@5"] == pytest.approx(np.mean(
      [any(qa_lib.has_answer(store.text(int(b)), a) for b in row[:5])
       for row, (_, a) in zip(ids, QUESTIONS)]), abs=1e-4)
  assert (record["index_step"], record["corpus_fingerprint"],
          record["questions"]) == (0, store.fingerprint, 5)
  assert record["rule"] == calibration.RULE
  path = calibration.write(root, record)
  assert path == os.path.join(root, calibration.CALIBRATION_FILE)
  assert calibration.read(root)["chosen"] == rankers.from_record(
      record["chosen"], "x")
  # The index root stays the builder's (a legacy layout too).
  assert outputs.check(root, outputs.INDEX_ROOT, "root")
  # Read back: a file choosing BM25 alone (as where MiniLM is weak) ...
  calibration.write(root, dict(record, chosen=rankers.BM25().record()))
  kwargs = dict(model_config=run["config"], store=store, qa_config=QA_CONFIG,
                checkpoint_dir=str(run["workdir"] / "checkpoints"),
                index_dir=root, batch_size=4, bm25_dir=run["bm25"])
  with caplog.at_level(logging.WARNING):
    model = qa_model.load_qa_model(ranker="hybrid", **kwargs)
  assert "ranks with bm25 alone" in caplog.text
  said = model.ranker_choice.record()
  assert (said["ranker"], said["ranker_from"], said["calibration"]) == (
      "bm25", "calibration", path)
  assert model.ask(QUESTIONS[0][0]).retrieved_ids == ids[0].tolist()
  # ... by realm_jax.load too; an explicit fusion wins over the file.
  loaded = realm_jax.load(str(run["workdir"]), index_dir=root,
                          ranker="hybrid", bm25_dir=run["bm25"], batch_size=4)
  assert loaded.ranker_choice.record()["ranker"] == "bm25"
  fusion = rankers.FusionConfig(dense_weight=0.7, bm25_weight=0.3)
  explicit = qa_eval.calibrated(qa_eval.EvalConfig(
      ranker="hybrid", fusion=fusion), root, index, store)
  said = qa_eval.ranker_record(explicit)
  assert (said["ranker"], said["fusion"]["dense_weight"],
          said["ranker_from"]) == ("hybrid", 0.7, "configuration")
  # The eval job: its records say which ranker and where it came from.
  out = str(tmp_path / "eval")
  job = dict(checkpoint_dir=str(run["workdir"] / "checkpoints"),
             examples=_examples(), model_config=run["config"], index=index,
             store=store, qa_config=QA_CONFIG, steps=[1])
  eval_config = qa_eval.EvalConfig(ranker="hybrid", recall_ks=(1, 5),
                                   batch_size=4, bm25_dir=run["bm25"])
  result = qa_eval.run_eval_job(config=eval_config, output_dir=out,
                                index_dir=root, **job)
  metrics = result.metrics[1]
  assert (metrics["ranker"], metrics["ranker_from"]) == ("bm25",
                                                         "calibration")
  with open(os.path.join(out, qa_eval.LEDGER)) as f:
    assert list(json.load(f)["steps"]) == [qa_eval.ledger_key(1, "bm25")]
  # Without the file, the fixed rule; and it says so.
  os.remove(path)
  said = qa_eval.ranker_record(qa_eval.calibrated(eval_config, root, index,
                                                  store))
  assert (said["ranker"], said["ranker_from"],
          said["fusion"]["dense_weight"]) == ("hybrid", "fixed rule", 0.5)
  assert calibration.CALIBRATION_FILE in said["ranker_note"]


def test_a_file_of_another_index_or_a_bad_one(run, tmp_path, caplog):
  root, store, index = _root(run, tmp_path), run["store"], run["index"]
  record = {"format_version": 1, "chosen": {"ranker": "dense"},
            "index_step": 5, "index_revision": 0,
            "corpus_fingerprint": store.fingerprint, "questions": 200}
  calibration.write(root, record)
  with caplog.at_level(logging.WARNING):
    chosen = calibration.resolve("hybrid", root, index=index, store=store)
  assert chosen.source == "fixed rule" and chosen.choice == rankers.Hybrid()
  assert "measured on index step 5" in caplog.text
  # Dense and BM25 by name never read it.
  assert calibration.resolve("bm25", root, index=index) == rankers.BM25()
  path = os.path.join(root, calibration.CALIBRATION_FILE)
  for text, match in [("{", "is not JSON"),
                      (json.dumps(dict(record, index_step=0,
                                       chosen={"ranker": "sparse"})),
                       "field 'chosen'"),
                      (json.dumps(dict(record, index_step="0")),
                       "field 'index_step'"),
                      (json.dumps(dict(record, format_version=9)), "newer")]:
    with open(path, "w") as f:
      f.write(text)
    with pytest.raises(ValueError, match=match) as e:
      calibration.resolve("hybrid", root, index=index, store=store)
    assert path in str(e.value)
  # Only into an index root: never a directory of the user's files.
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("mine")
  with pytest.raises(outputs.OwnershipError, match="notes.txt"):
    calibration.write(str(mine), record)
  assert sorted(os.listdir(mine)) == ["notes.txt"]
  with pytest.raises(ValueError, match="at least 2"):
    calibrate.calibrate(_examples()[:1], dense=run["model"].ranker,
                        bm25=rankers.BM25Ranker.for_store(store, run["bm25"]),
                        store=store, index=index)
  # The held-out questions: by a hash of each, whatever their order.
  examples = _examples()
  mask = calibrate.held_out_mask(examples, 0.5)
  assert calibrate.held_out_mask(examples[::-1], 0.5).tolist() == (
      mask[::-1].tolist())
  assert not calibrate.held_out_mask(examples, 0.0).any()
  assert calibrate.held_out_mask(examples, 0.999999).all()


def _cli_bindings(run):
  b = run["config"].retriever.bert
  return [f"--gin.BertConfig.{f.name}={getattr(b, f.name)!r}"
          for f in dataclasses.fields(b)] + [
              "--gin.RetrieverConfig.projection_size=16",
              "--gin.RetrieverConfig.pooling='mean'",
              "--gin.ReaderConfig.span_hidden_size=8",
              "--gin.ReaderConfig.max_span_width=4"]


def test_the_job_writes_its_choice_beside_the_index(run, tmp_path):
  root = _root(run, tmp_path)
  questions = tmp_path / "mine.jsonl"
  questions.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                               for q, a in QUESTIONS))
  command = [sys.executable, "-m", "realm_jax.jobs.calibrate",
             "--gin_file=models/tiny.gin", "--gin_file=runs/eval.gin",
             *_cli_bindings(run), f"--gin.WORKDIR='{run['workdir']}'",
             f"--gin.INDEX_DIR='{root}'",
             f"--gin.BLOCK_STORE='{run['store'].path}'",
             f"--gin.qa_eval.EvalConfig.bm25_dir='{run['bm25']}'",
             "--gin.calibrate.CalibrateConfig.ks=(1, 2, 5)",
             "--gin.calibrate.CalibrateConfig.candidates=6"]
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  done = subprocess.run(
      command + [f"--gin.CALIBRATION_QUESTIONS='{questions}'"],
      capture_output=True, text=True, timeout=timeouts.HANG_SECONDS, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  line = json.loads(done.stdout.splitlines()[-1])
  written = calibration.read(root)
  assert line["calibration"] == written["path"]
  assert written["chosen"] == rankers.from_record(line["ranker"], "x")
  assert line["decision"]["reason"]
  assert written["questions"] == 5 and written["source"]["weights"][
      "step"] == 1


def test_the_job_asks_for_the_questions_first():
  gin.clear_config()
  try:
    gin_cli.parse(["models/tiny.gin", "runs/eval.gin"],
                  ["BLOCK_STORE = '/nonexistent'"])
    with pytest.raises(SystemExit, match="CALIBRATION_QUESTIONS"):
      calibrate_job.job(False)
  finally:
    gin.clear_config()

"""The learning benchmark's world and its held-out metrics."""

import numpy as np
import pytest

from realm_jax.data import block_store, examples, qa, salient_spans
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.eval import pretrain_eval
from realm_jax.index import embed
from realm_jax.model import functional
from realm_jax.model.bert import BertConfig
from realm_jax.model.realm import Realm, RealmConfig, ReaderConfig
from realm_jax.model.realm import RetrieverConfig
from realm_jax.testing import knowledge_world
from realm_jax.data import qa_inputs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  files = knowledge_world.write_world(
      str(tmp_path_factory.mktemp("world")), num_people=40, num_heldout=10)
  store = block_store.BlockStore.open(files.block_store)
  return files, store, knowledge_world.load_people(files.people)


def test_world_facts_are_single_wordpieces_and_split(world):
  files, store, people = world
  tokenizer = Tokenizer()
  for city, ids in zip(knowledge_world.CITIES,
                       tokenizer.tokenize(list(knowledge_world.CITIES))):
    assert len(ids) == 1, city
  assert len(store) == 40 and sum(p.heldout for p in people) == 10
  gold = knowledge_world.gold_blocks(store, people)
  assert sorted(gold.values()) == list(range(40))
  # Every sentence of an X article has exactly one salient span: the
  # person's city or year, which only their biography states.
  heldout = list(salient_spans.read_annotated([files.heldout]))
  assert {d.title for d in heldout} == {p.article_title for p in people
                                        if p.heldout}
  by_title = {p.article_title: p for p in people}
  for doc in heldout:
    p = by_title[doc.title]
    for _, sentence, spans in doc.sentences_with_spans():
      assert len(spans) == 1
      value = sentence[spans[0][0]:spans[0][1]].decode()
      assert value in (p.city, str(p.year))
      assert value in p.biography


def _tiny_model():
  bert = BertConfig(vocab_size=30522, hidden_size=16, num_layers=1,
                    num_heads=2, intermediate_size=32,
                    max_position_embeddings=128, hidden_dropout=0.0,
                    attention_dropout=0.0)
  return RealmConfig(
      # Mean-pooled random embeddings already match names a little, so
      # recall and hubness are not at their trivial values.
      retriever=RetrieverConfig(bert=bert, projection_size=None,
                                pooling="mean", normalize=True,
                                null_score="learned"),
      reader=ReaderConfig(bert=bert, span_head=False))


def test_metrics_match_an_independent_computation(world):
  files, store, people = world
  model = _tiny_model()
  _, params = functional.init(lambda r: Realm(model, rngs=r), 3)
  queries = examples.read_realm_queries(
      files.heldout, Tokenizer(),
      config=examples.RealmQueryConfig(query_length=32, max_masks=2))
  gold_of = knowledge_world.gold_blocks(store, people)
  gold = np.asarray([gold_of[int(h)] for h in queries["source_doc_hash"]])
  got = pretrain_eval.evaluate(params, model, store, queries, gold,
                               num_candidates=3, reader_length=96,
                               batch_size=16)

  # Retrieval metrics from exact numpy search over independently computed
  # embeddings.
  docs, _ = embed.embed_block_store(params["retriever"], model.retriever,
                                    store)
  graphdef, _ = functional.init(lambda r: Realm(model, rngs=r), 3)
  q_model = functional.bind(graphdef, params)
  q = np.asarray(q_model.retriever.embed_queries(queries["query_ids"],
                                                 queries["query_mask"]))
  scores = q.astype(np.float64) @ docs.astype(np.float64).T
  order = np.argsort(-scores, axis=1)
  rank = np.argmax(order == gold[:, None], axis=1)
  # The two sides embed the queries in different batches, so float32
  # rounding may differ: a query may flip only where two of its top-6
  # scores (the gold block's included) are within rounding of each other.
  top = np.sort(scores, axis=1)[:, ::-1][:, :6]
  eps = 1e-4 * np.abs(scores).max()
  near_tie = (np.abs(np.diff(top, axis=1)) < eps).any(1)
  allowed = near_tie.mean() + 1e-9
  assert abs(got["recall@1"] - np.mean(rank == 0)) <= allowed
  assert abs(got["recall@5"] - np.mean(rank < 5)) <= allowed
  top1 = order[:, 0]
  assert abs(got["hubness"] - np.bincount(top1).max() / len(top1)) <= (
      allowed)
  spread = scores.std(1).mean()  # (no trivial block: X is not in Z here)
  assert spread > 0 and abs(got["score_spread"] - spread) <= 1e-3 * spread
  # span_recall: a plain wordpiece-run test on the top 3 blocks.
  held = []
  for i, blocks in enumerate(order[:, :3]):
    real = queries["mlm_weights"][i] > 0
    span = list(queries["mlm_targets"][i][real][
        np.argsort(queries["mlm_positions"][i][real])])
    bodies = [list(store.body_ids(int(b))) for b in blocks]
    held.append(any(body[s:s + len(span)] == span for body in bodies
                    for s in range(len(body) - len(span) + 1)))
  assert 0 < np.mean(held) < 1, "the check needs both kinds of query"
  assert abs(got["span_recall"] - np.mean(held)) <= allowed
  for key in ("mlm_accuracy_marginal", "mlm_accuracy_null",
              "mlm_accuracy_gold", "null_probability"):
    assert 0.0 <= got[key] <= 1.0
  # The learned null score starts at the retrieved scores' mean: p(null)
  # is at most 1 / (k + 1) (Jensen), and positive.
  assert 0 < got["null_probability"] <= 1 / 4 + 1e-6
  with pytest.raises(ValueError, match="one evidence block per query"):
    pretrain_eval.evaluate(params, model, store, queries, gold[:-1])


def test_real_text_mode_and_qa_recall(world):
  """Without evidence blocks the gold metrics are left out (the others are
  unchanged); qa_recall@k matches exact search + a plain substring test."""
  files, store, people = world
  model = _tiny_model()
  graphdef, params = functional.init(lambda r: Realm(model, rngs=r), 3)
  queries = examples.read_realm_queries(
      files.heldout, Tokenizer(),
      config=examples.RealmQueryConfig(query_length=32, max_masks=2))
  questions = [qa.QAExample(f"where was {p.name} born?", (p.city,))
               for p in people]
  got = pretrain_eval.evaluate(params, model, store, queries, None,
                               num_candidates=3, reader_length=96,
                               batch_size=16, questions=questions,
                               question_length=16, qa_ks=(1, 5))
  assert "recall@1" not in got and "mlm_accuracy_gold" not in got
  assert {"mlm_accuracy_marginal", "hubness", "qa_recall@1",
          "qa_recall@5"} <= got.keys()

  docs, _ = embed.embed_block_store(params["retriever"], model.retriever,
                                    store)
  q = qa_inputs.tokenize_questions(Tokenizer(),
                                   [e.question for e in questions], 16)
  emb = np.asarray(functional.bind(graphdef, params).retriever.embed_queries(
      q["question_ids"], q["question_mask"]))
  scores = emb.astype(np.float64) @ docs.astype(np.float64).T
  order = np.argsort(-scores, axis=1)
  found = np.array([[e.answers[0] in store.text(int(b)) for b in row]
                    for row, e in zip(order, questions)])
  top = np.sort(scores, axis=1)[:, ::-1][:, :6]
  near_tie = (np.abs(np.diff(top, axis=1)) < 1e-4 * np.abs(scores).max()
              ).any(1)
  for k in (1, 5):
    want = np.mean(found[:, :k].any(1))
    assert abs(got[f"qa_recall@{k}"] - want) <= near_tie.mean() + 1e-9
  # Question by question: where the first answer-bearing block ranks, 5
  # (the largest k) where none of the top 5 holds one.
  rank = got["qa_answer_rank"]
  assert len(rank) == len(questions) and all(type(r) is int for r in rank)
  want = np.where(found[:, :5].any(1), np.argmax(found[:, :5], 1), 5)
  assert np.all((np.asarray(rank) == want) | near_tie), (rank, want)
  assert pretrain_eval.recall_at(rank, (1, 5)) == {
      k: got[k] for k in ("qa_recall@1", "qa_recall@5")}
  # Questions tokenized beforehand (a host without tensorflow_text) give
  # the same recall; a tokenization of another length is refused.
  given = pretrain_eval.qa_recall(params, model, store, docs, questions, 16,
                                  (1, 5), 16, question_inputs=q)
  assert given == pretrain_eval.qa_recall(params, model, store, docs,
                                          questions, 16, (1, 5), 16)
  with pytest.raises(ValueError, match=r"question_inputs has shape .*"
                     r"expected \(40, 24\)"):
    pretrain_eval.qa_recall(params, model, store, docs, questions, 24,
                            question_inputs=q)
  # Several people share a birthplace, so a question's answer is often in
  # other biographies too: recall@5 is well above the 5/40 of one block.
  assert got["qa_recall@5"] > got["qa_recall@1"]

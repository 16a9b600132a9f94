"""Open-QA batches: has-answer, gold spans, reader layout, model scores."""

import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.data import qa as qa_lib
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.data import block_store
from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm
from realm_jax.testing import corpus, tiny
from realm_jax.data import qa_inputs

CONFIG = qa_inputs.QAConfig(question_length=16, num_retrieved=6,
                            num_reader_blocks=3, reader_length=48)
MAX_SPAN_WIDTH = 4  # The reader's ReaderConfig.max_span_width.


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  store_dir, _ = corpus.make_tiny_corpus(str(tmp_path_factory.mktemp("c")))
  return block_store.BlockStore.open(store_dir)


def test_batch_layout_has_answer_and_gold_spans(store):
  tok = Tokenizer()
  questions = ["Where was Mozart born?", "When did the Berlin Wall fall?"]
  answers = [["Salzburg"], ["1989", "9 November 1989"]]
  q = qa_inputs.tokenize_questions(tok, questions, CONFIG.question_length)
  rng = np.random.default_rng(0)
  retrieved = np.stack([rng.permutation(len(store))[:6] for _ in range(2)])
  retrieved[1, 5] = -1  # The searcher found fewer than K.
  emb = rng.normal(size=(len(store), 8)).astype(np.float32)
  answer_ids = [qa_lib.tokenize_answers(tok, a) for a in answers]
  batch = qa_inputs.qa_batch(q, retrieved, emb, store, CONFIG,
                             answer_ids=answer_ids,
                             max_span_width=MAX_SPAN_WIDTH)
  with pytest.raises(TypeError, match="needs max_span_width"):
    qa_inputs.qa_batch(q, retrieved, emb, store, CONFIG,
                       answer_ids=answer_ids)
  assert batch["reader_ids"].shape == (2, 3, 48)
  # The layout realm-aot lowers the fine-tuning step on (issue 68).
  layout = qa_inputs.qa_layout(CONFIG, batch=2, embedding_size=8,
                               max_span_width=MAX_SPAN_WIDTH)
  assert {k: (v.shape, np.dtype(v.dtype)) for k, v in batch.items()
          if k in layout} == layout
  assert set(batch) - set(layout) == {"retrieved_ids"}  # Host only.
  assert not batch["retrieved_mask"][1, 5]
  np.testing.assert_array_equal(batch["retrieved_embeddings"][0],
                                emb[retrieved[0]])
  for i in range(2):
    for k in range(6):
      block = retrieved[i, k]
      if block < 0:
        assert not batch["has_answer"][i, k]
        continue
      text = " ".join(tok.decode(store.body_ids(block)).split())
      want = any(tok.decode(a) in text for a in answer_ids[i])
      assert batch["has_answer"][i, k] == want, (i, k, text)
    for r in range(3):
      ids = batch["reader_ids"][i, r]
      s, e = batch["block_start"][i, r], batch["block_end"][i, r]
      body = store.body_ids(retrieved[i, r])
      n = min(len(body), 48 - int(q["question_mask"][i].sum()) - 1)
      np.testing.assert_array_equal(ids[s:e + 1], body[:n])
      assert ids[e + 1] == tok.sep_id
      # Gold spans: exactly the occurrences of an answer inside the body.
      for start in range(48):
        for w in range(MAX_SPAN_WIDTH):
          piece = list(ids[start:start + w + 1])
          want = (s <= start and start + w <= e and any(
              piece == list(a) for a in answer_ids[i]))
          assert batch["gold_spans"][i, r, start, w] == want


def test_qa_logits_and_losses_run_on_the_batch(store):
  tok = Tokenizer()
  cfg = tiny.tiny_realm(vocab_size=30522)
  cfg = type(cfg)(retriever=cfg.retriever, reader=type(cfg.reader)(
      bert=cfg.reader.bert, span_hidden_size=8, max_span_width=4,
      mlm_head=False))
  graphdef, params = functional.init(lambda r: Realm(cfg, rngs=r), 0)
  model = functional.bind(graphdef, params)
  q = qa_inputs.tokenize_questions(tok, ["Where was Mozart born?"], 16)
  retrieved = np.arange(6)[None]
  emb = np.random.default_rng(1).normal(size=(len(store), 16)).astype(
      np.float32)
  batch = qa_inputs.qa_batch(q, retrieved, emb, store, CONFIG,
                             answer_ids=[qa_lib.tokenize_answers(
                                 tok, ["Salzburg"])],
                             max_span_width=cfg.reader.max_span_width)
  retrieval, reader = model.qa_logits(
      {k: jnp.asarray(v) for k, v in batch.items()})
  query = model.retriever.embed_queries(q["question_ids"],
                                        q["question_mask"])
  np.testing.assert_allclose(retrieval[0], emb[:6] @ np.asarray(query[0]),
                             rtol=1e-5, atol=1e-5)
  assert reader.shape == (1, 3, 48, 4)
  finite = np.isfinite(np.asarray(reader))
  assert finite.any() and not finite.all()
  loss = losses.reader_marginal_loss(reader, batch["gold_spans"])
  assert np.isfinite(loss).all()
  preds = qa_inputs.decode_predictions(np.asarray(reader), batch, tok)
  assert preds[0].block_id in retrieved[0, :3]
  assert preds[0].end - preds[0].start < 4

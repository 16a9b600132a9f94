"""Corpus job: documents -> sentences -> blocks of <= 288 wordpieces -> store.

Builds the knowledge corpus Z as a memory-mapped block store (see
`realm_jax.data.blocks`) from one of:
- a Wikipedia `*-pages-articles*.xml(.bz2)` dump (default: the enwiki slice
  inside the gensim wheel);
- a JSONL file of `{"title": str, "text": str}` lines;
- the released ORQA/REALM corpus, `blocks.tfr` + `titles.tfr` (block i =
  record i, so the released `block_emb` rows pair with the store).

  python -m realm_jax.data.corpus_job --output_dir=/data/corpus
  python -m realm_jax.data.corpus_job --num_workers=16 \
      --input_path=enwiki-20181220-pages-articles.xml.bz2 \
      --output_dir=/data/enwiki

The store directory also holds `report.json`: what was kept and skipped, by
reason, with the first examples of each.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import time
from typing import Iterator, Sequence

from absl import app
from absl import flags
from absl import logging

from realm_jax.data import block_store
from realm_jax.data import blocks as blocks_lib
from realm_jax.data import wikipedia
from realm_jax.data.tokenizer import Tokenizer


def _orqa_files(input_path: str,
                titles_path: str | None) -> tuple[str, str] | None:
  """(blocks.tfr, titles.tfr) if `input_path` names the ORQA corpus."""
  if os.path.isdir(input_path):
    blocks_tfr = os.path.join(input_path, "blocks.tfr")
    if not os.path.exists(blocks_tfr):
      raise FileNotFoundError(
          f"{input_path} is a directory without blocks.tfr; pass a dump, a "
          "JSONL file or the directory of the ORQA blocks.tfr/titles.tfr.")
    return blocks_tfr, titles_path or os.path.join(input_path, "titles.tfr")
  if input_path.endswith((".tfr", ".tfrecord", ".tfrecords")):
    return input_path, titles_path or os.path.join(
        os.path.dirname(input_path), "titles.tfr")
  return None


def _log_progress(blocks: Iterator[blocks_lib.Block], log_every: int,
                  start: float) -> Iterator[blocks_lib.Block]:
  """Passes blocks through, logging throughput every `log_every` articles."""
  num_blocks, next_log = 0, log_every
  for block in blocks:
    if block.doc_index >= next_log:
      seconds = max(time.perf_counter() - start, 1e-9)
      logging.info(
          "corpus: %d articles, %d blocks, %.1f articles/s, %.1f blocks/s",
          block.doc_index, num_blocks, block.doc_index / seconds,
          num_blocks / seconds)
      next_log += log_every
    num_blocks += 1
    yield block


def build_corpus(
    *,
    output_dir: str,
    input_path: str | None = None,
    vocab_path: str | None = None,
    max_block_len: int = blocks_lib.DEFAULT_MAX_BLOCK_LEN,
    max_documents: int | None = None,
    orqa_titles_path: str | None = None,
    max_article_chars: int = wikipedia.DEFAULT_MAX_ARTICLE_CHARS,
    max_title_chars: int = wikipedia.DEFAULT_MAX_TITLE_CHARS,
    allow_truncated: bool = False,
    num_workers: int = 1,
    overwrite: bool = False,
    log_every: int = 1000,
) -> tuple[block_store.BlockStore, wikipedia.Report]:
  """Builds a block store from a dump, a JSONL file or the ORQA corpus.

  Args:
    output_dir: the block store directory to create (written to a temp
      directory beside it and renamed when complete; a gs://... directory
      is built in the local cache and uploaded, manifest last).
    input_path: a Wikipedia dump (`*.xml[.bz2]`), a JSONL file, ORQA's
      `blocks.tfr` or a directory holding `blocks.tfr` and `titles.tfr`.
      Default: the enwiki slice shipped with gensim.
    vocab_path: WordPiece vocab.txt; default: BERT uncased.
    max_block_len: wordpieces per retriever input `[CLS] title [SEP] body
      [SEP]`.
    max_documents: stop after this many articles (ORQA: records).
    orqa_titles_path: ORQA `titles.tfr`; default: beside `blocks.tfr`.
    max_article_chars: longer articles are skipped (`enormous_article`).
    max_title_chars: longer titles are skipped (`title_too_long`).
    allow_truncated: keep the pages of a dump read before an XML or
      compression error instead of failing.
    num_workers: processes cleaning wikitext (the slowest step on a dump).
    overwrite: replace an existing store at `output_dir`.
    log_every: log throughput every this many articles.

  Returns:
    (the opened store, the report of kept and skipped records).

  Raises:
    ValueError: for bad arguments, or when no block could be built.
    FileExistsError: if `output_dir` exists and not `overwrite`.
    wikipedia.CorruptDumpError: for a malformed dump or TFRecord file.
  """
  if max_block_len < blocks_lib.NUM_SPECIAL_TOKENS + 2:
    raise ValueError(
        f"max_block_len={max_block_len} leaves no room for a title and a "
        "body; use at least 5 (REALM uses 288).")
  if max_documents is not None and max_documents <= 0:
    raise ValueError(f"max_documents={max_documents} must be positive or "
                     "None (all documents).")
  if num_workers < 1:
    raise ValueError(f"num_workers={num_workers} must be >= 1.")
  input_path = input_path or wikipedia.default_wikipedia_dump()
  tokenizer = Tokenizer(vocab_path)
  report = wikipedia.Report()
  start = time.perf_counter()
  logging.info("corpus: building %s from %s (max_block_len %d)", output_dir,
               input_path, max_block_len)
  with contextlib.ExitStack() as stack:
    orqa = _orqa_files(input_path, orqa_titles_path)
    if orqa:
      records = blocks_lib.read_orqa_blocks(*orqa, report=report)
      if max_documents is not None:
        records = itertools.islice(records, max_documents)
      blocks = blocks_lib.pack_orqa_blocks(
          records, tokenizer, max_block_len=max_block_len, report=report)
    else:
      kwargs = {}
      if wikipedia.is_wikipedia_dump(input_path):
        kwargs["allow_truncated"] = allow_truncated
        if num_workers > 1:
          # spawn, not fork: TensorFlow's threads in this process make fork
          # unsafe, and the workers need only mwparserfromhell.
          pool = stack.enter_context(multiprocessing.get_context(
              "spawn").Pool(num_workers))
          kwargs["pool"] = pool
      documents = wikipedia.iter_documents(
          input_path, report, max_article_chars=max_article_chars,
          max_title_chars=max_title_chars, **kwargs)
      if max_documents is not None:
        documents = itertools.islice(documents, max_documents)
      blocks = blocks_lib.pack_blocks(
          documents, tokenizer, max_block_len=max_block_len, report=report)
    store = block_store.write_block_store(
        _log_progress(blocks, log_every, start), output_dir,
        tokenizer_vocab_path=tokenizer.vocab_path,
        source=os.path.abspath(input_path), max_block_len=max_block_len,
        overwrite=overwrite, report=report)
  seconds = time.perf_counter() - start
  logging.info(
      "corpus: done in %.1f s: %d articles, %d blocks (%.1f articles/s, "
      "%.1f blocks/s), fingerprint %s", seconds, store.num_documents,
      len(store), store.num_documents / seconds, len(store) / seconds,
      store.fingerprint)
  report.log_summary()
  return store, report


# -----------------------------------------------------------------------------
# Command line.
# -----------------------------------------------------------------------------

def _define_flags() -> None:
  """Defines the flags; only when run as a program, so that importing this
  module next to other jobs never clashes on flag names."""
  # pylint: disable=unused-variable
  flags.DEFINE_string(
      "output_dir", None, "Block store directory to create.", required=True)
  flags.DEFINE_string(
      "input_path", None, "Wikipedia dump, JSONL file, or ORQA blocks.tfr (or "
      "its directory). Default: the enwiki slice shipped with gensim.")
  flags.DEFINE_string(
      "vocab_path", None, "WordPiece vocab.txt (default: BERT uncased).")
  flags.DEFINE_integer(
      "max_block_len", blocks_lib.DEFAULT_MAX_BLOCK_LEN,
      "Wordpieces per [CLS] title [SEP] body [SEP].")
  flags.DEFINE_integer(
      "max_documents", None, "Stop after this many articles (ORQA: records).")
  flags.DEFINE_string(
      "orqa_titles_path", None, "ORQA titles.tfr (default: beside blocks.tfr).")
  flags.DEFINE_integer(
      "max_article_chars", wikipedia.DEFAULT_MAX_ARTICLE_CHARS,
      "Skip longer articles.")
  flags.DEFINE_integer(
      "max_title_chars", wikipedia.DEFAULT_MAX_TITLE_CHARS,
      "Skip articles with longer titles.")
  flags.DEFINE_boolean(
      "allow_truncated", False,
      "Keep the pages read before a dump's XML/compression error.")
  flags.DEFINE_integer(
      "num_workers", 1, "Processes cleaning wikitext.")
  flags.DEFINE_boolean(
      "overwrite", False, "Replace an existing store.")
  flags.DEFINE_integer(
      "log_every", 1000, "Log throughput every this many articles.")


def main(argv: Sequence[str]) -> None:
  """Runs `build_corpus` with the command-line flags."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  build_corpus(
      output_dir=f.output_dir, input_path=f.input_path,
      vocab_path=f.vocab_path, max_block_len=f.max_block_len,
      max_documents=f.max_documents, orqa_titles_path=f.orqa_titles_path,
      max_article_chars=f.max_article_chars,
      max_title_chars=f.max_title_chars, allow_truncated=f.allow_truncated,
      num_workers=f.num_workers, overwrite=f.overwrite,
      log_every=f.log_every)


if __name__ == "__main__":
  _define_flags()
  app.run(main)

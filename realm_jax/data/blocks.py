"""Blocks of the knowledge corpus Z: packing sentences, reading ORQA's blocks.

A block is a run of consecutive sentences of one article whose retriever
input `[CLS] title [SEP] body [SEP]` has at most `max_block_len` (288)
wordpieces. `pack_blocks` packs sentences greedily in article order; a
sentence that does not fit in the current block starts a new one, and a
sentence longer than a whole block is cut into block-sized chunks (at word
starts where possible), never dropped. `pack_orqa_blocks` turns the released
ORQA/REALM `blocks.tfr` + `titles.tfr`, or DPR's passages, into blocks
one-for-one (block i = record i, so the released `block_emb` row i pairs
with it).

Blocks are stored, and read back memory-mapped, by `block_store`
(`write_block_store`, `BlockStore`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import unicodedata
from typing import Iterable, Iterator, Sequence

import numpy as np

from realm_jax.data import wikipedia
from realm_jax.data.tokenizer import Tokenizer

DEFAULT_MAX_BLOCK_LEN = 288
# Special tokens around a block: [CLS] title [SEP] body [SEP].
NUM_SPECIAL_TOKENS = 3

def title_hash(title: str) -> int:
  """Stable 63-bit hash (non-negative int64) of an NFC-normalised title.

  Identifies the article a block came from, so that the query's own article
  can be excluded from its retrieval candidates. blake2b rather than
  Python's `hash`, which is salted per process.
  """
  digest = hashlib.blake2b(
      unicodedata.normalize("NFC", title).encode("utf-8"),
      digest_size=8).digest()
  return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclasses.dataclass(frozen=True)
class Block:
  """One block of the knowledge corpus.

  Attributes:
    doc_index: index of its article among the articles of the corpus.
    title: the article title.
    title_ids: wordpieces of the title.
    text: the exact span of the article text the block covers.
    body_ids: wordpieces of `text`.
    sentence_starts: token offset in `body_ids` where each sentence (or
      chunk of a long sentence) starts; the first is 0.
    passage_id: the input's own id of the block (a DPR passage's), or None.
  """
  doc_index: int
  title: str
  title_ids: np.ndarray
  text: str
  body_ids: np.ndarray
  sentence_starts: np.ndarray
  passage_id: str | None = None


# -----------------------------------------------------------------------------
# Tokenizer offsets -> character offsets.
# -----------------------------------------------------------------------------


class _CharOffsets:
  """Maps the tokenizer's byte offsets to character offsets of its input.

  tensorflow_text's BertTokenizer with lower_case reports offsets into its
  NORMALISED text (case-folded NFKC, NFD, accents stripped, control
  characters turned into spaces), not into the input: "Héllo" gives "hello"
  at bytes [0, 5) although "Héllo" is 6 bytes; FastBertTokenizer reports
  offsets into the input. Which convention the tokenizer follows is probed
  once. For normalised offsets, the normalised length of every input
  character (computed with the same TF ops, cached) maps them back:
  normalisation works character by character in practice, and a
  whole-string check catches the rare text where it does not.
  """

  def __init__(self, tokenizer: Tokenizer):
    self._lower_case = tokenizer.lower_case
    self._lengths: dict[str, int] = {}
    # "Ü" is 2 bytes of input but 1 byte ("u") once normalised.
    (_, starts, _), = tokenizer.tokenize_with_offsets(["\u00dc a"])
    self._input_offsets = int(starts[-1]) == 3

  def _normalize(self, texts: Sequence[str]) -> list[bytes]:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_text as tf_text  # pylint: disable=g-import-not-at-top
    x = tf.constant(list(texts), dtype=tf.string)
    if self._lower_case:
      x = tf_text.case_fold_utf8(x)
      x = tf_text.normalize_utf8(x, "NFD")
      x = tf.strings.regex_replace(x, r"\p{Mn}", "")
    x = tf.strings.regex_replace(x, r"\p{Cc}|\p{Cf}", " ")
    return list(x.numpy())

  def char_offsets(self, text: str, byte_offsets: np.ndarray
                   ) -> tuple[np.ndarray, bool]:
    """(char_offsets, exact): the character of `text` (the tokenizer's
    input) holding each of the tokenizer's `byte_offsets`. `exact` is False
    when the character-wise mapping disagrees with the normalised length of
    the whole text (the offsets are then approximate but still monotonic
    and inside the text)."""
    byte_offsets = np.asarray(byte_offsets, np.int64)
    if text.isascii():
      # One byte per character, before and after normalisation.
      return np.minimum(byte_offsets, len(text)), True
    if self._input_offsets:
      code_points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
      lengths = (1 + (code_points >= 0x80) + (code_points >= 0x800) +
                 (code_points >= 0x10000)).astype(np.int64)
      return np.searchsorted(np.cumsum(lengths), byte_offsets,
                             side="right"), True
    missing = sorted({c for c in text if c >= "\x80"} - self._lengths.keys())
    if missing:
      for c, normalized in zip(missing, self._normalize(missing)):
        self._lengths[c] = len(normalized)
    lengths = np.fromiter(
        (1 if c < "\x80" else self._lengths[c] for c in text), np.int64,
        count=len(text))
    ends = np.cumsum(lengths)
    exact = int(ends[-1]) == len(self._normalize([text])[0])
    return np.searchsorted(ends, byte_offsets, side="right"), exact


# -----------------------------------------------------------------------------
# Packing articles into blocks.
# -----------------------------------------------------------------------------


def _continuation_mask(tokenizer: Tokenizer) -> np.ndarray:
  return np.array([piece.startswith("##") for piece in tokenizer.vocab])


def _chunk_bounds(ids: np.ndarray, budget: int,
                  is_continuation: np.ndarray) -> list[int]:
  """Token indices where chunks of at most `budget` tokens start.

  Cuts at the last word start that fits, so words stay whole unless one word
  alone is longer than a block.
  """
  starts, start, n = [0], 0, len(ids)
  while n - start > budget:
    end = start + budget
    word_starts = np.flatnonzero(~is_continuation[ids[start + 1:end + 1]])
    cut = start + 1 + int(word_starts[-1]) if len(word_starts) else end
    starts.append(cut)
    start = cut
  return starts


class _Packer:
  """Greedy packing of one article's sentences into blocks."""

  def __init__(self, tokenizer: Tokenizer, max_block_len: int,
               report: wikipedia.Report):
    self.tokenizer = tokenizer
    self.max_block_len = max_block_len
    self.report = report
    self.is_continuation = _continuation_mask(tokenizer)
    self.char_offsets = _CharOffsets(tokenizer)

  def pack(self, doc_index: int, document: wikipedia.Document,
           title_ids: np.ndarray, sentences: list[tuple[int, int]],
           sentence_ids: list[np.ndarray]) -> list[Block]:
    budget = self.max_block_len - NUM_SPECIAL_TOKENS - len(title_ids)
    blocks: list[Block] = []
    # Pieces of the block being filled: (char_start, char_end, ids).
    pieces: list[tuple[int, int, np.ndarray]] = []
    used = 0

    def flush():
      nonlocal pieces, used
      if pieces:
        lengths = [len(ids) for _, _, ids in pieces]
        starts = np.cumsum([0] + lengths[:-1])[np.array(lengths) > 0]
        blocks.append(Block(
            doc_index=doc_index, title=document.title, title_ids=title_ids,
            text=document.text[pieces[0][0]:pieces[-1][1]],
            body_ids=np.concatenate([ids for _, _, ids in pieces]).astype(
                np.int32),
            sentence_starts=starts.astype(np.int32)))
      pieces, used = [], 0

    for (start, end), ids in zip(sentences, sentence_ids):
      if used + len(ids) <= budget:
        pieces.append((start, end, ids))
        used += len(ids)
        continue
      flush()
      if len(ids) <= budget:
        pieces, used = [(start, end, ids)], len(ids)
        continue
      chunks = self._split_long_sentence(document, start, end, ids, budget)
      for chunk in chunks[:-1]:
        pieces, used = [chunk], len(chunk[2])
        flush()
      # The last chunk stays open so that the next sentences can join it.
      pieces, used = [chunks[-1]], len(chunks[-1][2])
    flush()
    self.report.keep("blocks", len(blocks))
    self.report.keep("sentences", len(sentences))
    self.report.keep("body_tokens", sum(len(b.body_ids) for b in blocks))
    return blocks

  def _split_long_sentence(self, document, start, end, ids, budget):
    """Cuts a sentence longer than a block into block-sized chunks."""
    self.report.note("long_sentence_split", f"'{document.title}'",
                     f"{len(ids)} wordpieces > budget {budget}")
    token_starts = _chunk_bounds(ids, budget, self.is_continuation)
    sentence = document.text[start:end]
    (_, byte_starts, _), = self.tokenizer.tokenize_with_offsets([sentence])
    chars, exact = self.char_offsets.char_offsets(
        sentence, byte_starts[token_starts[1:]])
    if not exact:
      self.report.note("approximate_chunk_offsets", f"'{document.title}'")
    chars = np.minimum(np.maximum.accumulate(chars), len(sentence))
    char_bounds = [start] + [start + int(c) for c in chars] + [end]
    token_bounds = token_starts + [len(ids)]
    chunks = []
    for k in range(len(token_starts)):
      chunk_start, chunk_end = char_bounds[k], char_bounds[k + 1]
      # The whitespace between two chunks belongs to neither.
      while chunk_start < chunk_end and document.text[chunk_start].isspace():
        chunk_start += 1
      while chunk_end > chunk_start and document.text[chunk_end - 1].isspace():
        chunk_end -= 1
      chunks.append((chunk_start, chunk_end,
                     ids[token_bounds[k]:token_bounds[k + 1]]))
    return chunks


def _tokenized(records: Iterable[tuple[str, str]], tokenizer: Tokenizer,
               batch_sentences: int = 8192):
  """(title, text, title_ids, sentences, sentence_ids) of each record: its
  sentences' character spans and wordpieces, tokenized in batches of about
  `batch_sentences` strings (the tokenizer is much faster on batches)."""
  records = iter(records)
  while True:
    batch, num_sentences = [], 0
    for title, text in records:
      batch.append((title, text, wikipedia.split_sentences(text)))
      num_sentences += len(batch[-1][2]) + 1
      if num_sentences >= batch_sentences:
        break
    if not batch:
      return
    texts = []
    for title, text, sentences in batch:
      texts.append(title)
      texts.extend(text[s:e] for s, e in sentences)
    ids = iter(tokenizer.tokenize(texts))
    for title, text, sentences in batch:
      title_ids = next(ids).astype(np.int32)
      yield (title, text, title_ids, sentences,
             list(itertools.islice(ids, len(sentences))))


def pack_blocks(
    documents: Iterable[wikipedia.Document],
    tokenizer: Tokenizer,
    *,
    max_block_len: int = DEFAULT_MAX_BLOCK_LEN,
    report: wikipedia.Report | None = None,
) -> Iterator[Block]:
  """Splits documents into sentences and packs them greedily into blocks.

  Each block satisfies 3 + len(title_ids) + len(body_ids) <= max_block_len
  (wordpieces, special tokens included). The blocks of an article cover all
  of its text, in order. Articles whose title alone leaves no room for a
  body are skipped (`title_leaves_no_room`), as are articles without a
  single wordpiece (`no_tokens`); `report` counts blocks, sentences, skips
  and long sentences split.

  Yields:
    Blocks in corpus order; `doc_index` counts the articles that produced
    blocks, from 0.
  """
  report = report if report is not None else wikipedia.Report()
  packer = _Packer(tokenizer, max_block_len, report)
  doc_index = 0
  for title, text, title_ids, sentences, sentence_ids in _tokenized(
      ((d.title, d.text) for d in documents), tokenizer):
    where = f"'{title}'"
    if NUM_SPECIAL_TOKENS + len(title_ids) >= max_block_len:
      report.skip("title_leaves_no_room", where,
                  f"{len(title_ids)} title wordpieces, max_block_len "
                  f"{max_block_len}", title)
      continue
    if not any(len(x) for x in sentence_ids):
      report.skip("no_tokens", where, title=title)
      continue
    report.keep("documents")
    yield from packer.pack(doc_index, wikipedia.Document(title, text),
                           title_ids, sentences, sentence_ids)
    doc_index += 1


# -----------------------------------------------------------------------------
# The released ORQA / REALM corpus (blocks.tfr + titles.tfr).
# -----------------------------------------------------------------------------


def read_orqa_blocks(
    blocks_tfr: str,
    titles_tfr: str,
    report: wikipedia.Report | None = None,
) -> Iterator[tuple[str, str]]:
  """(title, block_text) of the released TFRecord files, read in lockstep.

  Each record is one UTF-8 string. Record i of both files is block i, so no
  record is ever skipped: invalid UTF-8 is decoded with replacement
  characters and counted (`invalid_utf8_replaced`). Raises
  FileNotFoundError for a missing file, `wikipedia.CorruptDumpError` for a
  corrupt one or files with different numbers of records.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report = report if report is not None else wikipedia.Report()
  for path in (blocks_tfr, titles_tfr):
    if not tf.io.gfile.exists(path):
      raise FileNotFoundError(f"ORQA corpus file {path} does not exist.")

  def records(path):
    dataset = tf.data.TFRecordDataset(path, buffer_size=1 << 22).batch(4096)
    try:
      for batch in dataset.as_numpy_iterator():
        yield from batch
    except tf.errors.DataLossError as e:
      raise wikipedia.CorruptDumpError(
          f"{path}: corrupt or truncated TFRecord file ({e.message}); "
          "re-download it.") from e

  def decode(raw: bytes, where: str) -> str:
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError:
      report.note("invalid_utf8_replaced", where)
      return raw.decode("utf-8", errors="replace")

  missing = object()
  for i, (text, title) in enumerate(itertools.zip_longest(
      records(blocks_tfr), records(titles_tfr), fillvalue=missing)):
    if text is missing or title is missing:
      short = blocks_tfr if text is missing else titles_tfr
      raise wikipedia.CorruptDumpError(
          f"{short} ends at record {i} but {blocks_tfr} and {titles_tfr} "
          "must have one record per block; use the two files of the same "
          "release.")
    yield (decode(title, f"{titles_tfr}: record {i}"),
           decode(text, f"{blocks_tfr}: record {i}"))


def pack_orqa_blocks(
    records: Iterable[tuple[str, str]],
    tokenizer: Tokenizer,
    *,
    max_block_len: int = DEFAULT_MAX_BLOCK_LEN,
    report: wikipedia.Report | None = None,
    first_record: int = 0,
) -> Iterator[Block]:
  """Turns released (title, block_text) records into blocks one-for-one.

  Records are not re-packed, so block i is record i (numbered from
  `first_record` in the report's messages). A body that does not fit is
  truncated to the budget (`block_truncated`; the block text is cut where
  its last kept wordpiece ends) and a title that leaves no room for a body
  is truncated to leave one wordpiece (`title_truncated`). Consecutive
  records with the same title are one article.
  """
  report = report if report is not None else wikipedia.Report()
  char_offsets = _CharOffsets(tokenizer)
  doc_index, last_title, record_index = -1, None, first_record - 1
  for title, text, title_ids, sentences, sentence_ids in _tokenized(
      records, tokenizer):
    record_index += 1
    if title != last_title:
      doc_index, last_title = doc_index + 1, title
      report.keep("documents")
    where = f"record {record_index} '{title[:80]}'"
    if NUM_SPECIAL_TOKENS + len(title_ids) >= max_block_len:
      report.note("title_truncated", where)
      title_ids = title_ids[:max_block_len - NUM_SPECIAL_TOKENS - 1]
    budget = max_block_len - NUM_SPECIAL_TOKENS - len(title_ids)
    lengths = np.array([len(x) for x in sentence_ids], np.int64)
    starts = np.cumsum(np.concatenate([[0], lengths[:-1]])).astype(np.int64)
    body_ids = (np.concatenate(sentence_ids) if sentence_ids else
                np.zeros([0], np.int64)).astype(np.int32)
    if len(body_ids) > budget:
      report.note("block_truncated", where,
                  f"{len(body_ids)} wordpieces > budget {budget}")
      text = _truncate_text(text, sentences, starts, budget, tokenizer,
                            char_offsets, report, where)
      body_ids = body_ids[:budget]
    keep = (lengths > 0) & (starts < len(body_ids))
    report.keep("blocks")
    report.keep("sentences", int(keep.sum()))
    report.keep("body_tokens", len(body_ids))
    yield Block(doc_index=doc_index, title=title, title_ids=title_ids,
                text=text, body_ids=body_ids,
                sentence_starts=starts[keep].astype(np.int32))


def _truncate_text(text, sentences, starts, budget, tokenizer, char_offsets,
                   report, where) -> str:
  """The prefix of `text` covered by its first `budget` wordpieces."""
  k = int(np.searchsorted(starts, budget, side="right")) - 1
  sentence_start, sentence_end = sentences[k]
  keep = budget - int(starts[k])  # tokens kept from sentence k
  if keep == 0:
    return text[:sentences[k - 1][1]] if k else ""
  sentence = text[sentence_start:sentence_end]
  (_, _, limits), = tokenizer.tokenize_with_offsets([sentence])
  chars, exact = char_offsets.char_offsets(sentence, limits[keep - 1:keep] - 1)
  if not exact:
    report.note("approximate_chunk_offsets", where)
  return text[:sentence_start + int(chars[0]) + 1]

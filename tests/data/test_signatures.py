"""Token signatures: exact bits, no false negatives, stored and recomputed."""

import json
import os
import shutil

import numpy as np
import pytest

from realm_jax.data import block_store
from realm_jax.data import qa as qa_lib
from realm_jax.data import signatures
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.testing import corpus
from realm_jax.data import qa_inputs


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
  store_dir, _ = corpus.make_tiny_corpus(str(tmp_path_factory.mktemp("c")))
  return store_dir


def _bits_of(tokens):
  """The signature as a Python set of bit indices (independent of packing)."""
  return {int(p) for p in signatures.bit_positions(np.asarray(tokens))}


def _unpack(signature_row):
  bits = np.unpackbits(signature_row.view(np.uint8), bitorder="little")
  return set(np.nonzero(bits)[0].tolist())


def test_block_signatures_hold_exactly_the_hashed_pieces():
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 300, size=40)
  lengths[3] = 0  # An empty body has an empty signature.
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  flat = rng.integers(0, 30522, size=int(offsets[-1])).astype(np.int32)
  sig = signatures.compute(flat, offsets)
  assert sig.shape == (40, signatures.SIGNATURE_BITS // 64)
  assert sig.dtype == np.uint64
  for i in range(40):
    assert _unpack(sig[i]) == _bits_of(flat[offsets[i]:offsets[i + 1]])
  assert not sig[3].any()
  # Chunking does not change the result.
  old = signatures._CHUNK_BLOCKS
  try:
    signatures._CHUNK_BLOCKS = 7
    np.testing.assert_array_equal(signatures.compute(flat, offsets), sig)
  finally:
    signatures._CHUNK_BLOCKS = old


def test_filter_has_no_false_negatives_and_rejects_most_blocks():
  rng = np.random.default_rng(1)
  n, length = 2000, 288
  flat = rng.integers(1000, 30522, size=n * length).astype(np.int32)
  offsets = np.arange(n + 1) * length
  sig = signatures.compute(flat, offsets)
  bodies = flat.reshape(n, length)
  for trial in range(30):
    width = 1 + trial % 3
    # An answer cut from some block, plus one that is nowhere (ids < 1000).
    source = int(rng.integers(n))
    start = int(rng.integers(length - width))
    present = bodies[source, start:start + width]
    absent = rng.integers(0, 1000, size=width)
    answers = [present, absent]
    maybe = signatures.may_contain(sig, signatures.of_answers(answers))
    exact = qa_lib.gold_spans_batch(bodies, [answers] * n,
                                    max_span_width=length,
                                    max_spans=1).has_answer
    assert exact[source]
    assert np.all(maybe[exact]), "a block with an answer was filtered out"
    # 288 random pieces set a share f = 1 - exp(-288 / 1024) = 0.245 of the
    # bits; one of two w-piece answers passes 1 - (1 - f^w)^2 of the blocks:
    # 43%, 12%, 3% for w = 1, 2, 3.
    assert maybe.mean() < {1: 0.5, 2: 0.16, 3: 0.06}[width], maybe.mean()
  assert not signatures.may_contain(sig, signatures.of_answers([])).any()


def test_store_carries_signatures_outside_the_fingerprint(store_dir, tmp_path):
  store = block_store.BlockStore.open(store_dir)
  entry = store.manifest["signatures"]
  assert entry["file"] == signatures.FILE_NAME
  assert entry["bits"] == signatures.SIGNATURE_BITS
  expected = signatures.compute(store._a["body_ids"], store._a["body_offsets"])
  assert isinstance(store.signatures, np.memmap)
  np.testing.assert_array_equal(store.signatures, expected)

  # A store written before signatures existed: computed in memory, same
  # values, same fingerprint.
  old_dir = str(tmp_path / "old")
  shutil.copytree(store_dir, old_dir)
  os.remove(os.path.join(old_dir, signatures.FILE_NAME))
  with open(os.path.join(old_dir, "manifest.json")) as f:
    manifest = json.load(f)
  del manifest["signatures"]
  with open(os.path.join(old_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f)
  old = block_store.BlockStore.open(old_dir)
  assert old.fingerprint == store.fingerprint
  assert not isinstance(old.signatures, np.memmap)
  np.testing.assert_array_equal(old.signatures, expected)


def test_corrupt_signature_file_is_named(store_dir, tmp_path):
  bad_dir = str(tmp_path / "bad")
  shutil.copytree(store_dir, bad_dir)
  path = os.path.join(bad_dir, signatures.FILE_NAME)
  np.save(path, np.zeros((3, 16), np.uint64))
  with pytest.raises(ValueError, match="body_signatures.npy holds"):
    _ = block_store.BlockStore.open(bad_dir).signatures
  os.remove(path)
  with pytest.raises(ValueError, match="body_signatures.npy.*cannot be read"):
    _ = block_store.BlockStore.open(bad_dir).signatures


def test_prefiltered_has_answer_equals_the_full_scan(store_dir):
  store = block_store.BlockStore.open(store_dir)
  tok = Tokenizer()
  rng = np.random.default_rng(2)
  n = len(store)
  # Answers cut from blocks (1-4 pieces), a word of no block, no answer,
  # and several answers per question.
  answers = []
  for i in range(12):
    body = store.body_ids(int(rng.integers(n)))
    width = 1 + i % 4
    start = int(rng.integers(max(1, len(body) - width)))
    answers.append([body[start:start + width]])
  answers.append(qa_lib.tokenize_answers(tok, ["xylophonist zygote"]))
  answers.append([])
  answers.append(answers[0] + answers[1] + answers[2])
  block_ids = np.stack([rng.permutation(n) for _ in answers])
  got = qa_inputs.has_answer(store, block_ids, answers)
  bodies, _ = store.bodies(block_ids.reshape(-1), store.max_block_len)
  want = qa_lib.gold_spans_batch(
      bodies, [a for a in answers for _ in range(n)],
      max_span_width=store.max_block_len, max_spans=1).has_answer
  np.testing.assert_array_equal(got, want.reshape(got.shape))
  assert got[:12].any(axis=1).all()
  assert not got[12:14].any()

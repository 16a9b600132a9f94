"""Token signatures of blocks: a cheap prefilter for the has-answer test.

Open-QA fine-tuning marks which of each question's K = 5000 retrieved blocks
contain an answer (the retriever loss's positives). Scanning the wordpieces
of all K blocks costs O(K x 288) per question, most of the host's input
time. A block's *signature* is a `SIGNATURE_BITS`-bit set holding one hashed
bit per distinct wordpiece of its body; an answer's signature is the same
over its wordpieces. A block can contain an answer only if every bit of the
answer's signature is set in the block's, so one [K, 16] uint64 comparison
per answer rules out most blocks and the exact wordpiece match
(`qa.gold_spans_batch`) runs only on the candidates. The filter has false
positives (hash collisions, the answer's pieces present but not adjacent)
and never false negatives, so the result is exactly the full scan's.

With 1024 bits and ~150 distinct wordpieces per 288-piece block, a random
single-piece answer passes the filter of ~14% of blocks, a two-piece one
~2%.

Stores written by `block_store_writer.write_block_store` carry the
signatures as
`body_signatures.npy` (uint64 [num_blocks, 16], listed under the manifest's
"signatures" entry, outside the content fingerprint: they are derived from
`body_ids`). Older stores get them computed in memory on first use.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Sequence

from absl import logging
import numpy as np

from realm_jax.core import io_utils

SIGNATURE_BITS = 1024
FILE_NAME = "body_signatures.npy"
_WORDS = SIGNATURE_BITS // 64
_SHIFT = 32 - int(np.log2(SIGNATURE_BITS))
_CHUNK_BLOCKS = 1 << 16


def bit_positions(token_ids: np.ndarray) -> np.ndarray:
  """The signature bit of each wordpiece id (multiplicative hashing)."""
  ids = np.asarray(token_ids).astype(np.uint64)
  return ((ids * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)) >> np.uint64(
      _SHIFT)


def _pack(rows: np.ndarray, positions: np.ndarray, n: int) -> np.ndarray:
  bits = np.zeros((n, SIGNATURE_BITS), bool)
  bits[rows, positions.astype(np.int64)] = True
  return np.packbits(bits, axis=1, bitorder="little").view(np.uint64)


def compute(body_ids: np.ndarray, body_offsets: np.ndarray) -> np.ndarray:
  """Signatures of every block: uint64 [num_blocks, SIGNATURE_BITS // 64].

  Args:
    body_ids: the store's flat body wordpieces.
    body_offsets: int [num_blocks + 1] offsets of each block's body.
  """
  offsets = np.asarray(body_offsets, np.int64)
  num_blocks = len(offsets) - 1
  out = np.zeros((num_blocks, _WORDS), np.uint64)
  for lo in range(0, num_blocks, _CHUNK_BLOCKS):
    hi = min(lo + _CHUNK_BLOCKS, num_blocks)
    tokens = np.asarray(body_ids[offsets[lo]:offsets[hi]])
    rows = np.repeat(np.arange(hi - lo), np.diff(offsets[lo:hi + 1]))
    out[lo:hi] = _pack(rows, bit_positions(tokens), hi - lo)
  return out


def of_answers(answers: Sequence[np.ndarray]) -> np.ndarray:
  """uint64 [len(answers), SIGNATURE_BITS // 64], one row per answer."""
  lengths = [len(np.asarray(a).reshape(-1)) for a in answers]
  tokens = (np.concatenate([np.asarray(a).reshape(-1) for a in answers])
            if answers else np.zeros([0], np.int64))
  rows = np.repeat(np.arange(len(answers)), lengths)
  return _pack(rows, bit_positions(tokens), len(answers))


def may_contain(block_signatures: np.ndarray, answer_signatures: np.ndarray
                ) -> np.ndarray:
  """bool [n]: block i may contain one of the answers (no false negatives).

  Args:
    block_signatures: uint64 [n, W], from `compute` (or a row gather of it).
    answer_signatures: uint64 [A, W], from `of_answers`; no answers -> all
      False.
  """
  blocks = np.asarray(block_signatures)[:, None, :]
  answers = np.asarray(answer_signatures)[None]
  return np.any(np.all((blocks & answers) == answers, axis=-1), axis=-1)


def write(store_dir: str, body_ids: np.ndarray, body_offsets: np.ndarray
          ) -> dict[str, Any]:
  """Writes `body_signatures.npy` into `store_dir`; its manifest entry."""
  signatures = compute(body_ids, body_offsets)
  path = os.path.join(store_dir, FILE_NAME)
  io_utils.save_npy(path, signatures)
  return {"file": FILE_NAME, "bits": SIGNATURE_BITS,
          "shape": list(signatures.shape),
          "sha256": hashlib.sha256(signatures.tobytes()).hexdigest()}


def load(store) -> np.ndarray:
  """The signatures of a `block_store.BlockStore` (memory-mapped when written).

  Raises:
    ValueError: if the manifest lists a signature file that is missing or
      does not match the store.
  """
  entry = store.manifest.get("signatures")
  if entry is not None and entry.get("bits") == SIGNATURE_BITS:
    path = os.path.join(store.local_path, entry["file"])
    try:
      signatures = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
      raise ValueError(
          f"{path} (listed in the manifest of block store {store.path}) "
          f"cannot be read ({e}); rebuild the store with the corpus job."
      ) from e
    if (signatures.dtype != np.uint64 or
        signatures.shape != (len(store), _WORDS)):
      raise ValueError(
          f"{path} holds {signatures.dtype}{list(signatures.shape)}, expected "
          f"uint64[{len(store)}, {_WORDS}] for block store {store.path}; the "
          "store is corrupt; rebuild it with the corpus job.")
    return signatures
  start = time.time()
  signatures = compute(store._a["body_ids"], store._a["body_offsets"])  # pylint: disable=protected-access
  logging.info("block store %s has no token signatures (written before "
               "they existed); computed %d in memory in %.1f s.", store.path,
               len(signatures), time.time() - start)
  return signatures

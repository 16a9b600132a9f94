"""The memory-mapped block store: the corpus Z on disk.

`block_store_writer.write_block_store` streams blocks (`blocks.Block`) into
a directory of `.npy` files that `BlockStore` opens with `mmap_mode="r"`
(this module: reading, the format both share): 13M blocks are
~16 GB of arrays on disk and almost nothing in RAM. Block ids are 0..N-1 in
corpus order; the manifest's `fingerprint` (sha256 over every array and the
corpus job's options) is what index manifests record to refuse embeddings of
another corpus.

Layout of a store directory (`N` blocks, `D` documents, flat arrays with
`*_offsets` of length N+1 or D+1):

  body_ids.npy int32, body_offsets.npy int64          wordpieces of the bodies
  sentence_starts.npy int32, sentence_offsets.npy    token offset of each
                                                      sentence in its body
  text_bytes.npy uint8, text_offsets.npy int64       UTF-8 body text
  doc_index.npy int32 [N], doc_hash.npy int64 [N]    article of each block
  title_ids.npy int32, title_offsets.npy int64       wordpieces of the titles
  title_bytes.npy uint8, title_byte_offsets.npy      UTF-8 titles
  doc_block_offsets.npy int64 [D+1]                  blocks of each article
  body_signatures.npy uint64 [N, 16]                 hashed wordpiece sets
                                                     (`signatures`)
  passage_id_bytes.npy uint8, passage_id_offsets.npy  optional: UTF-8 ids of
                                                     the input's passages
  manifest.json, report.json (counts), dropped.jsonl (every skipped
  article: {"title", "reason"} a line)

A store on remote storage (gs://...) is copied once into the local cache
and mapped from there (`BlockStore.open`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from absl import logging
import numpy as np

from realm_jax.core import io_utils
from realm_jax.data import blocks as blocks_lib
from realm_jax.data import examples as examples_lib
from realm_jax.data import signatures as token_signatures

FORMAT_VERSION = 1
# The arrays of every store. Order matters: the fingerprint hashes the files
# in this order.
ARRAYS = (
    ("body_ids", np.int32), ("body_offsets", np.int64),
    ("sentence_starts", np.int32), ("sentence_offsets", np.int64),
    ("text_bytes", np.uint8), ("text_offsets", np.int64),
    ("doc_index", np.int32), ("doc_hash", np.int64),
    ("title_ids", np.int32), ("title_offsets", np.int64),
    ("title_bytes", np.uint8), ("title_byte_offsets", np.int64),
    ("doc_block_offsets", np.int64),
)
# Written when the blocks have a `passage_id` (DPR's passages).
ID_ARRAYS = (("passage_id_bytes", np.uint8), ("passage_id_offsets", np.int64))


def vocab_special_ids(vocab_path: str) -> dict[str, int]:
  """The vocabulary's size and special token ids, as a manifest holds
  them."""
  with open(vocab_path, encoding="utf-8") as f:
    index = {line.rstrip("\n"): i for i, line in enumerate(f)}
  return {"vocab_size": len(index), "pad_id": index["[PAD]"],
          "unk_id": index["[UNK]"], "cls_id": index["[CLS]"],
          "sep_id": index["[SEP]"], "mask_id": index["[MASK]"]}


class BlockStore:
  """Memory-mapped, read-only view of a block store directory.

  Attributes:
    path: the directory as given (local, or remote such as gs://...).
    local_path: the local directory whose files are mapped: `path`, or its
      copy in the local cache.
    manifest: the parsed manifest.json.
  """

  def __init__(self, path: str, manifest: dict[str, Any],
               arrays: dict[str, np.ndarray], local_path: str | None = None):
    self.path = path
    self.local_path = path if local_path is None else local_path
    self.manifest = manifest
    self._a = arrays
    self._signatures = None

  @classmethod
  def open(cls, path: io_utils.PathLike, *, verify: bool = False,
           cache: bool | None = None,
           cache_dir: io_utils.PathLike | None = None) -> BlockStore:
    """Opens a store written by `block_store_writer.write_block_store`.

    A file that is not on a local disk (gs://...) cannot be memory-mapped,
    so a remote store is first copied, once per host, into the local cache
    directory `<cache_dir>/blocks-<fingerprint>` (default cache:
    `io_utils.cache_root()`, i.e. $REALM_JAX_CACHE_DIR or
    <tempdir>/realm_jax_cache) and the copy is mapped. The fingerprint is
    the store's content hash, so a cached copy is reused until the store
    changes. For speed, copy stores to each host's disk yourself.

    Args:
      path: the store directory (local, or remote).
      verify: also recompute every file's sha256 (reads the whole store).
      cache: copy into the local cache first; default: iff `path` is not
        local (True also helps with a slow network mount).
      cache_dir: the cache directory (default `io_utils.cache_root()`).

    Raises:
      FileNotFoundError: if the directory, manifest or an array is missing.
      ValueError: if the manifest or an array is corrupt or inconsistent.
    """
    source = os.fspath(path)
    if cache is None:
      cache = not io_utils.is_local(source)
    if cache:
      path = _cached_store(source, cache_dir)
    elif not io_utils.is_local(source):
      raise ValueError(f"block store {source} is not on a local disk and "
                       "cannot be memory-mapped; open it with cache=True "
                       "(the default) or copy it to a local disk.")
    path = os.fspath(path)
    manifest = _read_manifest(path)
    files = manifest["files"]
    num_blocks = int(manifest["num_blocks"])
    num_documents = int(manifest["num_documents"])
    arrays = _map_arrays(path, files, verify)
    store = cls(source, manifest, arrays, local_path=path)
    store._check_consistency(num_blocks, num_documents)
    return store

  def _check_consistency(self, num_blocks: int, num_documents: int) -> None:
    a = self._a
    checks = [
        ("body_offsets", num_blocks + 1, "body_ids"),
        ("sentence_offsets", num_blocks + 1, "sentence_starts"),
        ("text_offsets", num_blocks + 1, "text_bytes"),
        ("title_offsets", num_documents + 1, "title_ids"),
        ("title_byte_offsets", num_documents + 1, "title_bytes"),
        ("doc_block_offsets", num_documents + 1, None),
    ]
    if "passage_id_offsets" in a:
      checks.append(("passage_id_offsets", num_blocks + 1, "passage_id_bytes"))
    for offsets, length, flat in checks:
      if len(a[offsets]) != length or (
          flat is not None and int(a[offsets][-1]) != len(a[flat])):
        raise ValueError(
            f"{self.path}: {offsets}.npy does not match "
            f"{flat or 'num_documents'} and the manifest's counts; the store "
            "is corrupt; rebuild it.")
    if len(a["doc_index"]) != num_blocks or len(a["doc_hash"]) != num_blocks:
      raise ValueError(f"{self.path}: doc_index/doc_hash do not have "
                       f"{num_blocks} rows; the store is corrupt.")

  # ---- sizes and identity ----

  def __len__(self) -> int:
    return len(self._a["doc_index"])

  @property
  def num_documents(self) -> int:
    return len(self._a["doc_block_offsets"]) - 1

  @property
  def fingerprint(self) -> str:
    return self.manifest["fingerprint"]

  @property
  def max_block_len(self) -> int:
    return int(self.manifest["max_block_len"])

  @property
  def doc_hash(self) -> np.ndarray:
    """int64 [num_blocks]: `title_hash` of each block's article."""
    return self._a["doc_hash"]

  @property
  def doc_block_offsets(self) -> np.ndarray:
    """int64 [num_documents + 1]: article d's blocks are
    [offsets[d], offsets[d + 1])."""
    return self._a["doc_block_offsets"]

  @property
  def doc_indices(self) -> np.ndarray:
    """int32 [num_blocks]: the article index of each block."""
    return self._a["doc_index"]

  @property
  def signatures(self) -> np.ndarray:
    """uint64 [num_blocks, 16]: token signatures of the bodies (see
    `realm_jax.data.signatures`), memory-mapped or computed once."""
    if self._signatures is None:
      self._signatures = token_signatures.load(self)
    return self._signatures

  def check_vocab(self, vocab_path: str) -> None:
    """Raises ValueError unless the store was tokenized with `vocab_path`."""
    if io_utils.sha256_file(vocab_path) != self.manifest["vocab_sha256"]:
      raise ValueError(
          f"{self.path} was tokenized with another vocabulary than "
          f"{vocab_path}; rebuild the store with this vocab or use the "
          "matching one.")

  def special_ids(self, vocab_path: str | None = None
                  ) -> examples_lib.SpecialIds:
    """[PAD]/[CLS]/[SEP]/[MASK] ids of the vocabulary the store was built with.

    They come from the manifest. A store written before the manifest
    recorded `mask_id` finds [MASK] in its vocabulary instead: the first of
    `vocab_path`, `<store>/vocab.txt` and the default BERT vocabulary whose
    sha256 is the manifest's `vocab_sha256` (never a hard-coded 103: another
    vocabulary puts [MASK] elsewhere).

    Raises:
      ValueError: if the manifest lacks `mask_id` and no candidate
        vocabulary matches the store's.
    """
    m = self.manifest
    mask_id = m.get("mask_id")
    if mask_id is None:
      mask_id = self._mask_id_from_vocab(vocab_path)
    return examples_lib.SpecialIds(
        pad_id=int(m["pad_id"]), cls_id=int(m["cls_id"]),
        sep_id=int(m["sep_id"]), mask_id=int(mask_id))

  def _mask_id_from_vocab(self, vocab_path: str | None) -> int:
    from realm_jax.data import tokenizer  # pylint: disable=g-import-not-at-top
    candidates = [vocab_path, os.path.join(self.local_path, "vocab.txt")]
    try:
      candidates.append(tokenizer.default_vocab_path())
    except FileNotFoundError:
      pass
    for path in candidates:
      if (path and os.path.exists(path) and
          io_utils.sha256_file(path) == self.manifest.get("vocab_sha256")):
        return vocab_special_ids(path)["mask_id"]
    raise ValueError(
        f"{self.path}/manifest.json has no mask_id and none of "
        f"{[c for c in candidates if c]} is the vocabulary the store was "
        "built with (vocab_sha256); pass that vocab.txt as vocab_path or "
        "rebuild the store.")

  def sentence_counts(self, block_ids) -> np.ndarray:
    """Number of sentences of each block, as `examples.sentence_bounds` counts.

    Vectorised over the flat arrays (13M blocks take seconds, not the
    minutes of a Python loop over `sentence_starts`); a leading fragment (a
    sentence begun in the previous block) counts as a sentence; an empty
    body has 0. Returns int64 [n] for `block_ids` int [n].
    """
    body_offsets = self._a["body_offsets"]
    sentence_offsets = self._a["sentence_offsets"]
    sentence_starts = self._a["sentence_starts"]
    block_ids = self._ids(block_ids)
    out = np.zeros(len(block_ids), np.int64)
    chunk = 1 << 20  # bounds the temporaries for a whole-corpus call
    for lo in range(0, len(block_ids), chunk):
      ids = block_ids[lo:lo + chunk]
      lengths = body_offsets[ids + 1] - body_offsets[ids]
      first, last = sentence_offsets[ids], sentence_offsets[ids + 1]
      per_block = (last - first).astype(np.int64)
      owner = np.repeat(np.arange(len(ids)), per_block)
      within = np.arange(per_block.sum()) - np.repeat(
          np.cumsum(per_block) - per_block, per_block)
      starts = sentence_starts[np.repeat(first, per_block) + within]
      # Starts at 0 or at the end of the body open no new sentence.
      inner = (starts > 0) & (starts < lengths[owner])
      out[lo:lo + chunk] = (np.bincount(owner[inner], minlength=len(ids)) +
                            (lengths > 0))
    return out

  # ---- one block ----

  def _block(self, i: int) -> int:
    n = len(self)
    if not -n <= i < n:
      raise IndexError(f"block {i} is out of range for {n} blocks.")
    return int(i) % n

  def _slice(self, flat: str, offsets: str, i: int) -> np.ndarray:
    o = self._a[offsets]
    return self._a[flat][int(o[i]):int(o[i + 1])]

  def doc_index(self, i: int) -> int:
    return int(self._a["doc_index"][self._block(i)])

  def text(self, i: int) -> str:
    return self._slice("text_bytes", "text_offsets",
                       self._block(i)).tobytes().decode("utf-8")

  def title(self, i: int) -> str:
    return self._slice("title_bytes", "title_byte_offsets",
                       self.doc_index(i)).tobytes().decode("utf-8")

  def passage_id(self, i: int) -> str | None:
    """The input's id of block `i` (DPR's passage id), if the store has
    them."""
    if "passage_id_offsets" not in self._a:
      return None
    return self._slice("passage_id_bytes", "passage_id_offsets",
                       self._block(i)).tobytes().decode("utf-8")

  def body_ids(self, i: int) -> np.ndarray:
    return np.array(self._slice("body_ids", "body_offsets", self._block(i)))

  def title_ids(self, i: int) -> np.ndarray:
    return np.array(self._slice("title_ids", "title_offsets",
                                self.doc_index(i)))

  def sentence_starts(self, i: int) -> np.ndarray:
    return np.array(self._slice("sentence_starts", "sentence_offsets",
                                self._block(i)))

  def document_blocks(self, doc_index: int) -> range:
    """Block ids of article `doc_index`."""
    o = self._a["doc_block_offsets"]
    return range(int(o[doc_index]), int(o[doc_index + 1]))

  # ---- batches ----

  def _ids(self, block_ids) -> np.ndarray:
    ids = np.asarray(block_ids, np.int64).reshape(-1)
    n = len(self)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
      raise IndexError(f"block ids must be in [0, {n}); got "
                       f"[{ids.min()}, {ids.max()}].")
    return ids

  def retriever_inputs(self, block_ids,
                       seq_len: int = blocks_lib.DEFAULT_MAX_BLOCK_LEN
                       ) -> dict[str, np.ndarray]:
    """Retriever (document tower) inputs `[CLS] title [SEP] body [SEP]`.

    Segment 0 is `[CLS] title [SEP]`, segment 1 is `body [SEP]`. Built
    with whole-batch numpy gathers (no Python loop over blocks). If
    `seq_len` (>= 3) is shorter than the stored blocks, the body is
    truncated first, then the title.

    Returns:
      {"token_ids", "input_mask", "segment_ids"}: int32 [n, seq_len].
    """
    if seq_len < blocks_lib.NUM_SPECIAL_TOKENS:
      raise ValueError(f"seq_len must be >= 3, got {seq_len}.")
    ids = self._ids(block_ids)
    docs = self._a["doc_index"][ids].astype(np.int64)
    title_starts = self._a["title_offsets"][docs]
    title_lens = self._a["title_offsets"][docs + 1] - title_starts
    body_starts = self._a["body_offsets"][ids]
    body_lens = self._a["body_offsets"][ids + 1] - body_starts
    room = seq_len - blocks_lib.NUM_SPECIAL_TOKENS
    title_lens = np.minimum(title_lens, room)
    body_lens = np.minimum(body_lens, room - title_lens)
    n, sep_id = len(ids), int(self.manifest["sep_id"])
    token_ids = np.full([n, seq_len], self.manifest["pad_id"], np.int32)
    token_ids[:, 0] = int(self.manifest["cls_id"])
    rows = np.arange(n)
    _scatter(token_ids, self._a["title_ids"], title_starts, title_lens, 1)
    token_ids[rows, title_lens + 1] = sep_id
    _scatter(token_ids, self._a["body_ids"], body_starts, body_lens,
             title_lens + 2)
    ends = title_lens + body_lens + blocks_lib.NUM_SPECIAL_TOKENS  # exclusive
    token_ids[rows, ends - 1] = sep_id
    columns = np.arange(seq_len)[None, :]
    input_mask = (columns < ends[:, None]).astype(np.int32)
    segment_ids = ((columns >= (title_lens + 2)[:, None]) &
                   (columns < ends[:, None])).astype(np.int32)
    return {"token_ids": token_ids, "input_mask": input_mask,
            "segment_ids": segment_ids}

  def bodies(self, block_ids, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Body wordpieces (no title, no special tokens), zero-padded.

    For the reader input `[CLS] x [SEP] body [SEP]`; longer bodies are cut
    to `max_len`. Returns (ids int32 [n, max_len], lengths int32 [n]).
    """
    ids = self._ids(block_ids)
    starts = self._a["body_offsets"][ids]
    lengths = np.minimum(self._a["body_offsets"][ids + 1] - starts, max_len)
    flat = self._a["body_ids"]
    if not len(ids) or not len(flat):
      return np.zeros([len(ids), max_len], np.int32), lengths.astype(np.int32)
    # One [n, max_len] window gather, then the tails are zeroed: 2.7x faster
    # than scattering the ragged rows (fine-tuning reads B x K bodies).
    columns = np.arange(max_len)
    window = starts[:, None] + columns
    np.minimum(window, len(flat) - 1, out=window)
    out = np.asarray(flat[window], np.int32)
    out[columns >= lengths[:, None]] = 0
    return out, lengths.astype(np.int32)


# (flat array, its offsets): the variable-length rows of a store.
_RAGGED = (("body_ids", "body_offsets"),
           ("sentence_starts", "sentence_offsets"),
           ("text_bytes", "text_offsets"), ("title_ids", "title_offsets"),
           ("title_bytes", "title_byte_offsets"),
           ("passage_id_bytes", "passage_id_offsets"))


def check_extends(base: BlockStore, union: BlockStore) -> None:
  """Checks that `union` begins with `base`: the same blocks with the same
  ids, articles and tokenizer, then more (e.g. a corpus built from the
  base's input followed by new documents).

  An index of `base` then serves `union`'s first `len(base)` rows, and only
  the rest need embedding (`realm_jax.index.extend`).

  Raises:
    ValueError: naming what differs.
  """
  def refuse(what):
    raise ValueError(
        f"block store {union.path} does not extend {base.path}: {what}. "
        "Build it from the base store's input followed by the new "
        "documents, with the same max_block_len and vocabulary.")

  for key in ("vocab_sha256", "max_block_len", "options"):
    if base.manifest.get(key) != union.manifest.get(key):
      refuse(f"its {key} differs")
  if len(union) < len(base) or union.num_documents < base.num_documents:
    refuse(f"it has {len(union)} blocks of {union.num_documents} articles, "
           f"fewer than {len(base)} of {base.num_documents}")
  a, b = base._a, union._a  # pylint: disable=protected-access
  for flat, offsets in _RAGGED:
    if (flat in a) != (flat in b):
      refuse(f"one of them has no {flat}")
    if flat in a and not (
        np.array_equal(a[offsets], b[offsets][:len(a[offsets])]) and
        np.array_equal(a[flat], b[flat][:len(a[flat])])):
      refuse(f"its first rows' {flat} differ")
  for name, n in (("doc_index", len(base)), ("doc_hash", len(base)),
                  ("doc_block_offsets", base.num_documents + 1)):
    if not np.array_equal(a[name], b[name][:n]):
      refuse(f"its first rows' {name} differ")


def _scatter(out: np.ndarray, flat: np.ndarray, starts: np.ndarray,
             lengths: np.ndarray, columns) -> None:
  """out[r, columns[r] + j] = flat[starts[r] + j] for j < lengths[r]."""
  lengths = np.asarray(lengths, np.int64)
  total = int(lengths.sum())
  if not total:
    return
  rows = np.repeat(np.arange(len(lengths)), lengths)
  within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  columns = np.broadcast_to(np.asarray(columns, np.int64), lengths.shape)
  out[rows, np.repeat(columns, lengths) + within] = flat[
      np.repeat(np.asarray(starts, np.int64), lengths) + within]


def _read_manifest(path: str) -> dict[str, Any]:
  def check(manifest):
    for key in ("num_blocks", "num_documents", "cls_id", "sep_id", "pad_id"):
      int(manifest[key])

  return io_utils.read_manifest(
      path, what="block store", format_version=FORMAT_VERSION,
      fields=("files", "fingerprint"), check=check,
      build="build it with `python -m realm_jax.jobs.corpus "
      "--gin_file=runs/corpus.gin --gin.OUTPUT_DIR=\"'...'\"`")


def _map_arrays(path: str, files: dict[str, dict[str, Any]],
                verify: bool) -> dict[str, np.ndarray]:
  """Memory-maps the store's arrays at `path`, checked against the
  manifest's `files` (see `BlockStore.open`)."""
  arrays = {}
  for name, dtype in ARRAYS + tuple(
      (name, dtype) for name, dtype in ID_ARRAYS if name in files):
    file_path = os.path.join(path, name + ".npy")
    if not os.path.exists(file_path):
      raise FileNotFoundError(f"{file_path} is missing; rebuild the store.")
    try:
      array = np.load(file_path, mmap_mode="r")
    except (ValueError, OSError) as e:
      raise ValueError(f"{file_path} is corrupt ({e}); rebuild the "
                       "store.") from e
    expected = files.get(name, {})
    if (array.dtype != np.dtype(dtype) or array.ndim != 1 or
        list(array.shape) != expected.get("shape")):
      raise ValueError(
          f"{file_path} holds {array.dtype}{list(array.shape)}, the "
          f"manifest says {expected.get('dtype')}{expected.get('shape')}: "
          "the store is corrupt; rebuild it.")
    if verify and _sha256_file_data(file_path) != expected.get("sha256"):
      raise ValueError(f"{file_path}: sha256 differs from the manifest; "
                       "the store is corrupt; rebuild it.")
    arrays[name] = array
  return arrays


def cache_key(manifest: dict[str, Any]) -> str:
  """The cache entry of a store: its content fingerprint and the manifest's
  own hash (its metadata)."""
  text = json.dumps(manifest, sort_keys=True)
  return "blocks-{}-{}".format(
      "".join(c for c in manifest["fingerprint"] if c.isalnum())[:32],
      hashlib.sha256(text.encode()).hexdigest()[:12])


def _cached_store(source: str, cache_dir: io_utils.PathLike | None) -> str:
  """The local cache copy of the store at `source` (see `BlockStore.open`)."""
  local = io_utils.local_copy(source, cache_key(_read_manifest(source)),
                              cache_dir=cache_dir)
  logging.info("block store %s is mapped from its local copy %s", source,
               local)
  return local


def _sha256_file_data(path: str) -> str:
  """sha256 of a .npy file's data (after its header), as the writer hashed."""
  array = np.load(path, mmap_mode="r")
  digest = hashlib.sha256()
  step = 1 << 24
  for start in range(0, len(array), step):
    digest.update(np.ascontiguousarray(array[start:start + step]).tobytes())
  return digest.hexdigest()

"""Writing a block store: blocks streamed into `.npy` files, then published.

`write_block_store` streams blocks (`blocks.Block`) into the arrays that
`block_store.BlockStore` maps (the layout: `block_store`'s docstring),
checking each block; the manifest records every array's sha256 and the
fingerprint over them. A store appears whole or not at all: it is built in
a temporary sibling and renamed (local), or built in the local cache and
uploaded with its manifest last (remote).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterable

from absl import logging
import numpy as np

from realm_jax.core import io_utils
from realm_jax.core import outputs
from realm_jax.data import block_store
from realm_jax.data import blocks as blocks_lib
from realm_jax.data import signatures as token_signatures
from realm_jax.data import wikipedia

_HEADER_BYTES = 128
DROPPED_FILE = "dropped.jsonl"


def _npy_header(dtype, length: int) -> bytes:
  """A .npy v1.0 header of fixed size, so it can be rewritten in place."""
  header = "{'descr': %r, 'fortran_order': False, 'shape': (%d,), }" % (
      np.dtype(dtype).str, length)
  header = header.ljust(_HEADER_BYTES - 10 - 1) + "\n"
  return (b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") +
          header.encode("latin1"))


class _ArrayWriter:
  """Appends to a 1-D .npy file whose length is known only at the end."""

  def __init__(self, path: str, dtype):
    self.path, self.dtype, self.length = path, np.dtype(dtype), 0
    self.sha256 = hashlib.sha256()
    self._file = open(path, "wb", buffering=1 << 20)
    self._file.write(_npy_header(self.dtype, 0))

  def append(self, values) -> None:
    data = np.ascontiguousarray(values, self.dtype)
    raw = data.tobytes()
    self._file.write(raw)
    self.sha256.update(raw)
    self.length += data.size

  def close(self) -> dict[str, Any]:
    self._file.seek(0)
    self._file.write(_npy_header(self.dtype, self.length))
    self._file.close()
    return {"dtype": self.dtype.str, "shape": [self.length],
            "sha256": self.sha256.hexdigest()}

  def abort(self) -> None:
    self._file.close()


def _fingerprint(files: dict[str, dict[str, Any]],
                 options: dict[str, Any] | None) -> str:
  digest = hashlib.sha256()
  for name, _ in block_store.ARRAYS + block_store.ID_ARRAYS:
    if name in files:
      digest.update(f"{name}:{files[name]['dtype']}:{files[name]['sha256']}\n"
                    .encode())
  if options:
    digest.update(f"options:{json.dumps(options, sort_keys=True)}".encode())
  return digest.hexdigest()


def _utf8(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-8"), np.uint8)


def write_block_store(
    blocks: Iterable[blocks_lib.Block],
    out_dir: str,
    *,
    tokenizer_vocab_path: str,
    source: str,
    max_block_len: int = blocks_lib.DEFAULT_MAX_BLOCK_LEN,
    overwrite: bool = False,
    report: wikipedia.Report | None = None,
    extra_manifest: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> block_store.BlockStore:
  """Streams blocks into a block store directory; returns the opened store.

  Nothing is held in memory but the current block. The store is written to
  `out_dir + ".tmp-<pid>"` and renamed to `out_dir` only when complete, so a
  failed or killed write never leaves a store at `out_dir`.

  A remote `out_dir` (gs://...) is built and verified in the local cache
  (`io_utils.cache_root()`), then uploaded with its manifest last: readers
  open only stores that have a manifest, so they never see a partial
  upload. The local copy stays in the cache, where `BlockStore.open` of
  `out_dir` finds it instead of downloading the store again.

  Args:
    blocks: blocks in corpus order, `doc_index` 0, 1, 2, ... (consecutive).
    out_dir: the store directory to create.
    tokenizer_vocab_path: the ids' vocab.txt (its sha256 is in the manifest).
    source: what the corpus was built from (a path), for the manifest.
    max_block_len: the length bound every block must satisfy.
    overwrite: replace an existing store at `out_dir`.
    report: if given, its summary is written to `report.json` in the store
      once `blocks` is exhausted (so it counts the whole build), and the
      skipped articles, `{"title", "reason"}` a line, to `dropped.jsonl`.
    extra_manifest: more JSON-serialisable manifest entries.
    options: how the blocks were made beyond what they hold (the corpus
      job's filters), for the manifest; part of the fingerprint, so stores
      built with other options never share one.
  """
  if not io_utils.is_local(out_dir):
    return _write_remote_store(
        blocks, os.fspath(out_dir), tokenizer_vocab_path=tokenizer_vocab_path,
        source=source, max_block_len=max_block_len, overwrite=overwrite,
        report=report, extra_manifest=extra_manifest, options=options)
  out_dir = os.path.abspath(out_dir)
  tmp_dir = _local_tmp_dir(out_dir, overwrite)
  try:
    manifest = _write_store_files(
        blocks, tmp_dir, out_dir, max_block_len=max_block_len, report=report,
        tokenizer_vocab_path=tokenizer_vocab_path, source=source,
        extra_manifest=extra_manifest, options=options)
    # Refuses to publish what cannot be read back.
    block_store.BlockStore.open(tmp_dir)
    io_utils.replace_local_dir(tmp_dir, out_dir)
  except BaseException:
    io_utils.discard_output_tmp(tmp_dir)
    raise
  logging.info("wrote block store %s: %d blocks of %d articles, fingerprint "
               "%s", out_dir, manifest["num_blocks"],
               manifest["num_documents"], manifest["fingerprint"][:16])
  return block_store.BlockStore.open(out_dir)


def _write_store_files(blocks: Iterable[blocks_lib.Block], tmp_dir: str,
                       out_dir: str, *, max_block_len: int,
                       report: wikipedia.Report | None,
                       **manifest_fields) -> dict[str, Any]:
  """Writes a store's arrays, manifest and report into `tmp_dir`.

  Returns:
    The manifest. On failure the array writers are closed; discarding
    `tmp_dir` is left to the caller.
  """
  writers = _Writers(tmp_dir)
  try:
    num_blocks, num_documents = _write_blocks(blocks, writers, max_block_len)
    if not num_blocks:
      raise ValueError(
          f"no blocks to write to {out_dir}: the input held no usable "
          "article (see the report's skip counts).")
    writers["doc_block_offsets"].append([num_blocks])
    files = {name: writer.close() for name, writer in writers.items()}
  except BaseException:
    for writer in writers.values():
      writer.abort()
    raise
  manifest = _write_manifest(
      tmp_dir, files, num_blocks=num_blocks, num_documents=num_documents,
      max_block_len=max_block_len, **manifest_fields)
  if report is not None:
    _write_report(tmp_dir, report)
  return manifest


def _local_tmp_dir(out_dir: str, overwrite: bool) -> str:
  """Refuses an existing `out_dir` unless `overwrite` (and a link always);
  makes a fresh, empty temporary sibling to build the store in."""
  return outputs.new_output_tmp(out_dir, kind=outputs.BLOCK_STORE,
                                setting=SETTING, overwrite=overwrite,
                                exists=_exists(out_dir))


SETTING = "the block store's directory (the corpus job: --gin.OUTPUT_DIR)"


def _exists(out_dir: str) -> str:
  return (f"{out_dir} already exists; pass overwrite=True (the corpus job: "
          "--gin.CorpusConfig.overwrite=True) to replace it or choose another "
          "output directory.")


class _Writers(dict):
  """The store's `_ArrayWriter`s by array name, all in one directory."""

  def __init__(self, directory: str):
    super().__init__()
    self.directory = directory

  def open(self, arrays) -> None:
    """Opens a writer per `(name, dtype)`; offsets start with a 0."""
    for name, dtype in arrays:
      self[name] = _ArrayWriter(os.path.join(self.directory, name + ".npy"),
                                dtype)
      if name.endswith("offsets"):
        self[name].append([0])

  def append_row(self, flat: str, offsets: str, values) -> None:
    """Appends one ragged row; its end is the flat array's new length."""
    self[flat].append(values)
    self[offsets].append([self[flat].length])


def _write_blocks(blocks: Iterable[blocks_lib.Block], writers: _Writers,
                  max_block_len: int) -> tuple[int, int]:
  """Opens `writers` and streams `blocks` into them, checking each.

  Returns:
    The numbers of blocks and of documents written. The closing entry of
    `doc_block_offsets` is left to the caller.
  """
  writers.open(block_store.ARRAYS)
  num_blocks = num_documents = 0
  for block in blocks:
    n_body = len(block.body_ids)
    special = blocks_lib.NUM_SPECIAL_TOKENS
    if special + len(block.title_ids) + n_body > max_block_len:
      raise ValueError(
          f"block {num_blocks} ('{block.title}') has {len(block.title_ids)} "
          f"title and {n_body} body wordpieces: over max_block_len "
          f"{max_block_len} with the 3 special tokens.")
    if block.doc_index == num_documents:  # the first block of an article
      if num_documents:
        writers["doc_block_offsets"].append([num_blocks])
      writers.append_row("title_ids", "title_offsets", block.title_ids)
      writers.append_row("title_bytes", "title_byte_offsets",
                         _utf8(block.title))
      num_documents += 1
      doc_hash = blocks_lib.title_hash(block.title)
    elif not num_documents:
      raise ValueError(
          f"block 0 ('{block.title}') has doc_index {block.doc_index}: the "
          "first article's blocks have doc_index 0 (articles are numbered "
          "from 0, in order).")
    elif block.doc_index != num_documents - 1:
      raise ValueError(
          f"block {num_blocks} has doc_index {block.doc_index} after "
          f"{num_documents - 1}: blocks must come in article order.")
    if not num_blocks and block.passage_id is not None:
      writers.open(block_store.ID_ARRAYS)
    if (block.passage_id is not None) != ("passage_id_bytes" in writers):
      raise ValueError(f"block {num_blocks} ('{block.title}'): either "
                       "every block has a passage_id or none has.")
    if block.passage_id is not None:
      writers.append_row("passage_id_bytes", "passage_id_offsets",
                         _utf8(block.passage_id))
    writers.append_row("body_ids", "body_offsets", block.body_ids)
    writers.append_row("sentence_starts", "sentence_offsets",
                       block.sentence_starts)
    writers.append_row("text_bytes", "text_offsets", _utf8(block.text))
    writers["doc_index"].append([block.doc_index])
    writers["doc_hash"].append([doc_hash])
    num_blocks += 1
  return num_blocks, num_documents


def _write_manifest(tmp_dir: str, files: dict[str, dict[str, Any]], *,
                    num_blocks: int, num_documents: int, max_block_len: int,
                    tokenizer_vocab_path: str, source: str,
                    extra_manifest: dict[str, Any] | None,
                    options: dict[str, Any] | None) -> dict[str, Any]:
  """Writes the body signatures and `manifest.json`; returns the manifest."""
  signature_entry = token_signatures.write(
      tmp_dir, np.load(os.path.join(tmp_dir, "body_ids.npy"), mmap_mode="r"),
      np.load(os.path.join(tmp_dir, "body_offsets.npy")))
  manifest = {
      "format_version": block_store.FORMAT_VERSION,
      "num_blocks": num_blocks,
      "num_documents": num_documents,
      "max_block_len": max_block_len,
      "vocab_sha256": io_utils.sha256_file(tokenizer_vocab_path),
      **block_store.vocab_special_ids(tokenizer_vocab_path),
      "source": source,
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "fingerprint": _fingerprint(files, options),
      "files": files,
      "signatures": signature_entry,
      "options": options or {},
      **(extra_manifest or {}),
  }
  io_utils.write_json(os.path.join(tmp_dir, "manifest.json"), manifest)
  return manifest


def _write_report(tmp_dir: str, report: wikipedia.Report) -> None:
  """Writes `report.json` (the counts) and `dropped.jsonl` (the skips)."""
  io_utils.write_json(os.path.join(tmp_dir, "report.json"), dict(
      report.summary(), dropped_list=DROPPED_FILE))
  with open(os.path.join(tmp_dir, DROPPED_FILE), "w",
            encoding="utf-8") as f:
    f.writelines(json.dumps({"title": title, "reason": reason}) + "\n"
                 for reason, title in report.dropped)


def _write_remote_store(blocks: Iterable[blocks_lib.Block], out_dir: str, *,
                        overwrite: bool, **kwargs) -> block_store.BlockStore:
  """`write_block_store` to a remote directory (see there)."""
  remote = io_utils.as_path(out_dir)
  outputs.check(out_dir, outputs.BLOCK_STORE, SETTING, overwrite=overwrite,
                exists=_exists(out_dir))
  if remote.exists() and not (remote / "manifest.json").exists():
    logging.warning("%s has no manifest (an interrupted upload?); it will "
                    "be replaced.", out_dir)
  root = io_utils.cache_root()
  os.makedirs(root, exist_ok=True)
  # A fresh directory of this job's own (mkdtemp), the store built inside.
  build_dir = os.path.join(tempfile.mkdtemp(prefix=".build-", dir=root),
                           "store")
  try:
    store = write_block_store(blocks, build_dir, **kwargs)
    logging.info("uploading block store to %s", out_dir)
    if remote.exists():
      # Unpublish the old store first: without its manifest no reader
      # opens it while its files are replaced.
      io_utils.remove(remote / "manifest.json")
      io_utils.remove(remote)
    io_utils.copy_tree(build_dir, remote, skip=("manifest.json",))
    io_utils.copy_file(os.path.join(build_dir, "manifest.json"),
                       remote / "manifest.json")
    cached = os.path.join(root, block_store.cache_key(store.manifest))
    del store  # Unmap before moving.
    if not os.path.exists(cached):
      os.rename(build_dir, cached)  # A new cache entry (local_copy's way).
  except BaseException:
    if not (remote / "manifest.json").exists():
      try:  # A partial upload is invisible to readers; tidy it if we can.
        io_utils.remove(remote)
      except Exception:  # pylint: disable=broad-except
        logging.warning("could not remove the partial upload %s", out_dir)
    raise
  finally:
    shutil.rmtree(os.path.dirname(build_dir))  # Its own mkdtemp above.
  return block_store.BlockStore.open(out_dir, cache_dir=root)

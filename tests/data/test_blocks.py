"""Tests of realm_jax.data.blocks: packing, the block store, ORQA files."""

import dataclasses
import hashlib
import json
import os
import re
import unicodedata

import numpy as np
import pytest

from realm_jax.data import block_store, block_store_writer, blocks
from realm_jax.data import examples
from realm_jax.data import wikipedia
from realm_jax.data.tokenizer import Tokenizer

Document = wikipedia.Document


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer()


def _documents():
  rng = np.random.default_rng(0)
  words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda "
           "mu nu xi omicron pi rho sigma tau upsilon phi chi psi omega "
           "café naïve Zürich résumé").split()

  def sentence(n):
    text = " ".join(rng.choice(words, size=n))
    return text[0].upper() + text[1:] + "."

  documents = []
  for d in range(6):
    paragraphs = [" ".join(sentence(int(rng.integers(3, 25)))
                           for _ in range(int(rng.integers(1, 6))))
                  for _ in range(int(rng.integers(1, 4)))]
    documents.append(Document(f"Article {d}", "\n\n".join(paragraphs)))
  # One sentence far longer than a block, in scripts whose normalised UTF-8
  # length differs from their length in characters (the tokenizer's offsets
  # index its normalised text).
  documents.append(Document("Long", "Short start. " + " ".join(
      ["Élan", "Αθήνα", "Москва", "東京都", "Straße", "ﬁne", "½", "x"] * 30) +
                            ". Short end."))
  return documents


def _squeeze(text):
  return re.sub(r"\s+", "", text)


def _pack(documents, tokenizer, max_block_len, report=None):
  return list(blocks.pack_blocks(documents, tokenizer,
                                 max_block_len=max_block_len, report=report))


@pytest.mark.parametrize("max_block_len", [24, 64, 288])
def test_blocks_fit_and_cover_every_article(tokenizer, max_block_len):
  documents = _documents()
  report = wikipedia.Report()
  packed = _pack(documents, tokenizer, max_block_len, report)
  assert {b.doc_index for b in packed} == set(range(len(documents)))
  for d, document in enumerate(documents):
    mine = [b for b in packed if b.doc_index == d]
    for b in mine:
      assert 3 + len(b.title_ids) + len(b.body_ids) <= max_block_len
      assert b.title == document.title
      assert b.text in document.text  # an exact substring
      # The block's wordpieces are its text's wordpieces.
      np.testing.assert_array_equal(tokenizer.tokenize([b.text])[0],
                                    b.body_ids)
    # Coverage: every non-whitespace character, once, in order.
    assert _squeeze("".join(b.text for b in mine)) == _squeeze(document.text)
  assert report.kept["blocks"] == len(packed)
  assert report.kept["documents"] == len(documents)


def test_packing_is_greedy(tokenizer):
  """Each block is full: the next block's first sentence would not fit."""
  max_block_len = 64
  packed = _pack(_documents()[:6], tokenizer, max_block_len)
  for block, following in zip(packed, packed[1:]):
    if block.doc_index != following.doc_index:
      continue
    budget = max_block_len - 3 - len(block.title_ids)
    starts = list(following.sentence_starts) + [len(following.body_ids)]
    first_sentence = starts[1] - starts[0]
    assert len(block.body_ids) + first_sentence > budget


def test_sentence_starts_match_the_splitter(tokenizer):
  packed = _pack(_documents()[:6], tokenizer, 64)
  for b in packed:
    sentences = [b.text[s:e] for s, e in wikipedia.split_sentences(b.text)]
    lengths = [len(x) for x in tokenizer.tokenize(sentences)]
    np.testing.assert_array_equal(b.sentence_starts,
                                  np.cumsum([0] + lengths[:-1]))


def test_long_sentence_is_split_not_dropped(tokenizer):
  document = _documents()[-1]
  report = wikipedia.Report()
  packed = _pack([document], tokenizer, 48, report)
  assert len(packed) > 5
  all_ids = np.concatenate([b.body_ids for b in packed])
  np.testing.assert_array_equal(all_ids,
                                tokenizer.tokenize([document.text])[0])
  assert report.notes["long_sentence_split"] == 1
  assert "approximate_chunk_offsets" not in report.notes
  # Chunks cut at word starts: no block body starts with a "##" piece.
  for b in packed:
    assert not tokenizer.vocab[b.body_ids[0]].startswith("##")


class _FastTokenizer(Tokenizer):
  """The same vocabulary through tf_text.FastBertTokenizer, whose offsets
  index the input text rather than the normalised text."""

  def tokenize_with_offsets(self, texts):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_text as tf_text  # pylint: disable=g-import-not-at-top
    if not hasattr(self, "_fast"):
      self._fast = tf_text.FastBertTokenizer(
          vocab=self.vocab, token_out_type=tf.int64,
          lower_case_nfd_strip_accents=True, support_detokenization=False)
    ids, starts, limits = self._fast.tokenize_with_offsets(list(texts))
    return [(np.asarray(i, np.int64), np.asarray(s, np.int64),
             np.asarray(l, np.int64)) for i, s, l in
            zip(ids.to_list(), starts.to_list(), limits.to_list())]


def test_chunk_offsets_with_either_offset_convention(tokenizer):
  fast = _FastTokenizer()
  document = _documents()[-1]
  for tok in (tokenizer, fast):
    report = wikipedia.Report()
    packed = _pack([document], tok, 40, report)
    assert report.notes["long_sentence_split"] == 1
    for b in packed:
      np.testing.assert_array_equal(tokenizer.tokenize([b.text])[0],
                                    b.body_ids)
    records = [("Αθήνα", "Η Αθήνα είναι πόλη. " * 20)]
    (orqa,) = blocks.pack_orqa_blocks(records, tok, max_block_len=40)
    np.testing.assert_array_equal(tokenizer.tokenize([orqa.text])[0],
                                  orqa.body_ids)


def test_word_longer_than_a_block_is_split(tokenizer):
  word = "".join(f"x{i}" for i in range(300))  # one word, ~300 wordpieces
  document = Document("Word", f"Before. {word} after.")
  packed = _pack([document], tokenizer, 40)
  np.testing.assert_array_equal(np.concatenate([b.body_ids for b in packed]),
                                tokenizer.tokenize([document.text])[0])
  assert _squeeze("".join(b.text for b in packed)) == _squeeze(document.text)
  for b in packed:
    assert 3 + len(b.title_ids) + len(b.body_ids) <= 40


def test_title_without_room_is_skipped(tokenizer):
  report = wikipedia.Report()
  packed = _pack([Document("one two three four five six", "Body text."),
                  Document("Ok", "Body text.")], tokenizer, 9, report)
  assert [b.title for b in packed] == ["Ok"]
  assert packed[0].doc_index == 0
  assert report.skipped == {"title_leaves_no_room": 1}


def test_title_hash():
  title = "Zürich"
  expected = int.from_bytes(hashlib.blake2b(
      title.encode(), digest_size=8).digest(), "little") & (2**63 - 1)
  assert blocks.title_hash(title) == expected
  assert blocks.title_hash(unicodedata.normalize("NFD", title)) == expected
  assert blocks.title_hash("Zurich") != expected
  assert 0 <= blocks.title_hash("") < 2**63


# ------------------------------------------------------------- block store --


def _write(documents, tokenizer, out_dir, max_block_len=64, **kwargs):
  return block_store_writer.write_block_store(
      blocks.pack_blocks(documents, tokenizer, max_block_len=max_block_len),
      str(out_dir), tokenizer_vocab_path=tokenizer.vocab_path,
      source="test", max_block_len=max_block_len, **kwargs)


def test_store_reads_back_random_blocks(tokenizer, tmp_path):
  documents = _documents()
  packed = _pack(documents, tokenizer, 64)
  store = _write(documents, tokenizer, tmp_path / "store")
  assert len(store) == len(packed)
  assert store.num_documents == len(documents)
  assert store.manifest["num_blocks"] == len(packed)
  assert isinstance(store._a["body_ids"], np.memmap)
  rng = np.random.default_rng(1)
  for i in rng.choice(len(packed), size=20):
    b = packed[i]
    assert store.text(i) == b.text
    assert store.title(i) == b.title
    assert store.doc_index(i) == b.doc_index
    np.testing.assert_array_equal(store.body_ids(i), b.body_ids)
    np.testing.assert_array_equal(store.title_ids(i), b.title_ids)
    np.testing.assert_array_equal(store.sentence_starts(i), b.sentence_starts)
    assert store.doc_hash[i] == blocks.title_hash(b.title)
    assert i in store.document_blocks(b.doc_index)
  with pytest.raises(IndexError):
    store.text(len(packed))


def _naive_retriever_input(store, i, seq_len):
  title, body = list(store.title_ids(i)), list(store.body_ids(i))
  room = seq_len - 3
  title = title[:room]
  body = body[:room - len(title)]
  tokens = [101] + title + [102] + body + [102]
  segments = [0] * (len(title) + 2) + [1] * (len(body) + 1)
  pad = seq_len - len(tokens)
  return tokens + [0] * pad, [1] * len(tokens) + [0] * pad, segments + [0] * pad


@pytest.mark.parametrize("seq_len", [64, 20, 4])
def test_retriever_inputs(tokenizer, tmp_path, seq_len):
  store = _write(_documents(), tokenizer, tmp_path / "store")
  ids = np.array([3, 0, len(store) - 1, 3, 7])
  inputs = store.retriever_inputs(ids, seq_len=seq_len)
  for key in ("token_ids", "input_mask", "segment_ids"):
    assert inputs[key].shape == (5, seq_len) and inputs[key].dtype == np.int32
  for row, i in enumerate(ids):
    tokens, mask, segments = _naive_retriever_input(store, i, seq_len)
    np.testing.assert_array_equal(inputs["token_ids"][row], tokens)
    np.testing.assert_array_equal(inputs["input_mask"][row], mask)
    np.testing.assert_array_equal(inputs["segment_ids"][row], segments)


def test_retriever_inputs_never_exceed_max_len(tokenizer, tmp_path):
  store = _write(_documents(), tokenizer, tmp_path / "store",
                 max_block_len=40)
  inputs = store.retriever_inputs(np.arange(len(store)), seq_len=40)
  lengths = inputs["input_mask"].sum(axis=1)
  assert lengths.max() <= 40
  # Every input ends with [SEP] and was not truncated.
  np.testing.assert_array_equal(
      inputs["token_ids"][np.arange(len(store)), lengths - 1], 102)
  expected = [3 + len(store.title_ids(i)) + len(store.body_ids(i))
              for i in range(len(store))]
  np.testing.assert_array_equal(lengths, expected)


def test_bodies(tokenizer, tmp_path):
  store = _write(_documents(), tokenizer, tmp_path / "store")
  ids, lengths = store.bodies([1, 4], max_len=10)
  assert ids.shape == (2, 10) and ids.dtype == np.int32
  for row, i in enumerate([1, 4]):
    body = store.body_ids(i)[:10]
    assert lengths[row] == len(body)
    np.testing.assert_array_equal(ids[row, :len(body)], body)
    assert not ids[row, len(body):].any()


def test_fingerprint_is_deterministic(tokenizer, tmp_path):
  documents = _documents()
  a = _write(documents, tokenizer, tmp_path / "a")
  b = _write(documents, tokenizer, tmp_path / "b")
  assert a.fingerprint == b.fingerprint
  for name in ("body_ids", "text_bytes", "doc_hash", "sentence_starts"):
    np.testing.assert_array_equal(a._a[name], b._a[name])
  changed = documents[:-1] + [Document("Long", documents[-1].text + " More.")]
  c = _write(changed, tokenizer, tmp_path / "c")
  assert c.fingerprint != a.fingerprint


def test_options_and_passage_ids_are_in_the_fingerprint(tokenizer,
                                                         tmp_path):
  """The same blocks built with other options (the corpus job's filters)
  or ids get another fingerprint; the ids read back per block."""
  documents = _documents()[:3]
  plain = _write(documents, tokenizer, tmp_path / "plain")
  assert plain.passage_id(0) is None and plain.manifest["options"] == {}
  assert _write(documents, tokenizer, tmp_path / "none",
                options={}).fingerprint == plain.fingerprint
  keep = {"keep_lists": False, "keep_tables": False}
  first = _write(documents, tokenizer, tmp_path / "a", options=keep)
  again = _write(documents, tokenizer, tmp_path / "b", options=dict(keep))
  other = _write(documents, tokenizer, tmp_path / "c",
                 options=dict(keep, keep_tables=True))
  assert first.fingerprint == again.fingerprint
  assert len({plain.fingerprint, first.fingerprint, other.fingerprint}) == 3
  assert other.manifest["options"] == dict(keep, keep_tables=True)
  np.testing.assert_array_equal(other._a["body_ids"], plain._a["body_ids"])

  packed = _pack(documents, tokenizer, 64)
  ids = [f"psg-{i}-é" for i in range(len(packed))]
  with_ids = block_store_writer.write_block_store(
      [dataclasses.replace(b, passage_id=i) for b, i in zip(packed, ids)],
      str(tmp_path / "ids"), tokenizer_vocab_path=tokenizer.vocab_path,
      source="test", max_block_len=64)
  assert [with_ids.passage_id(i) for i in range(len(packed))] == ids
  assert with_ids.fingerprint != plain.fingerprint
  np.testing.assert_array_equal(with_ids._a["doc_hash"], plain._a["doc_hash"])
  block_store.BlockStore.open(str(tmp_path / "ids"), verify=True)
  mixed = [dataclasses.replace(packed[0], passage_id="1")] + packed[1:]
  with pytest.raises(ValueError, match="block 1 .*passage_id"):
    block_store_writer.write_block_store(
        mixed, str(tmp_path / "mixed"),
        tokenizer_vocab_path=tokenizer.vocab_path, source="t",
        max_block_len=64)
  assert not (tmp_path / "mixed").exists()


def test_report_lists_every_dropped_article(tokenizer, tmp_path):
  report = wikipedia.Report()
  long_title = "Title " * 30  # no room for a body in 24 wordpieces
  documents = [Document(f"Empty {i}", " ") for i in range(5)] + [
      Document(long_title, "Text."), Document("Kept", "Some text.")]
  store = block_store_writer.write_block_store(
      blocks.pack_blocks(documents, tokenizer, max_block_len=24,
                         report=report),
      str(tmp_path / "store"), tokenizer_vocab_path=tokenizer.vocab_path,
      source="test", max_block_len=24, report=report)
  assert store.num_documents == 1
  lines = (tmp_path / "store" / "dropped.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
      {"title": f"Empty {i}", "reason": "no_tokens"} for i in range(5)] + [
          {"title": long_title, "reason": "title_leaves_no_room"}]
  on_disk = json.loads((tmp_path / "store" / "report.json").read_text())
  assert on_disk == dict(report.summary(), dropped_list="dropped.jsonl")
  assert on_disk["skipped"] == {"no_tokens": 5, "title_leaves_no_room": 1}
  assert len(on_disk["examples"]["no_tokens"]) == 3  # the list is bounded


def test_failed_write_leaves_no_store(tokenizer, tmp_path):
  def failing():
    for i, block in enumerate(blocks.pack_blocks(_documents(), tokenizer,
                                                 max_block_len=64)):
      if i == 5:
        raise RuntimeError("killed")
      yield block

  out = tmp_path / "store"
  with pytest.raises(RuntimeError, match="killed"):
    block_store_writer.write_block_store(
        failing(), str(out), tokenizer_vocab_path=tokenizer.vocab_path,
        source="test", max_block_len=64)
  assert os.listdir(tmp_path) == []
  with pytest.raises(FileNotFoundError, match=re.escape(str(out))):
    block_store.BlockStore.open(str(out))


def test_overwrite_rules(tokenizer, tmp_path):
  out = tmp_path / "store"
  first = _write(_documents()[:2], tokenizer, out)
  with pytest.raises(FileExistsError, match="overwrite"):
    _write(_documents(), tokenizer, out)
  assert block_store.BlockStore.open(str(out)).fingerprint == first.fingerprint
  second = _write(_documents(), tokenizer, out, overwrite=True)
  assert second.fingerprint != first.fingerprint
  assert sorted(os.listdir(tmp_path)) == ["store"]


def test_writer_rejects_bad_blocks(tokenizer, tmp_path):
  too_long = blocks.Block(0, "T", np.array([1]), "x", np.arange(10),
                          np.array([0]))
  with pytest.raises(ValueError, match="over max_block_len 8"):
    block_store_writer.write_block_store(
        [too_long], str(tmp_path / "s"),
        tokenizer_vocab_path=tokenizer.vocab_path, source="t", max_block_len=8)
  with pytest.raises(ValueError, match="no blocks"):
    block_store_writer.write_block_store(
        [], str(tmp_path / "s"), tokenizer_vocab_path=tokenizer.vocab_path,
        source="t")
  # A first block numbered -1 (not 0) was taken for the article's second
  # block and failed with an UnboundLocalError.
  for doc_index in (-1, 1):
    first = blocks.Block(doc_index, "T", np.array([1]), "x", np.arange(3),
                         np.array([0]))
    with pytest.raises(ValueError, match=f"block 0 .*doc_index {doc_index}"
                       ".*numbered from 0"):
      block_store_writer.write_block_store(
          [first], str(tmp_path / "s"),
          tokenizer_vocab_path=tokenizer.vocab_path, source="t")
  assert os.listdir(tmp_path) == []


def test_corrupt_store_errors_name_the_path(tokenizer, tmp_path):
  out = tmp_path / "store"
  _write(_documents()[:3], tokenizer, out)
  manifest_path = out / "manifest.json"
  manifest = manifest_path.read_text()

  manifest_path.write_text(manifest[:40])
  with pytest.raises(ValueError, match=re.escape(str(manifest_path))):
    block_store.BlockStore.open(str(out))
  manifest_path.write_text(manifest)

  body = out / "body_ids.npy"
  data = body.read_bytes()
  body.write_bytes(data[:-8])  # truncated array file
  with pytest.raises(ValueError, match=re.escape(str(body))):
    block_store.BlockStore.open(str(out))
  flipped = bytearray(data)
  flipped[-1] ^= 1
  body.write_bytes(bytes(flipped))
  block_store.BlockStore.open(str(out))  # sizes fine: only verify can tell
  with pytest.raises(ValueError, match="sha256"):
    block_store.BlockStore.open(str(out), verify=True)
  body.write_bytes(data)
  assert len(block_store.BlockStore.open(str(out), verify=True)) > 0

  os.remove(out / "title_ids.npy")
  with pytest.raises(FileNotFoundError, match="title_ids.npy"):
    block_store.BlockStore.open(str(out))
  os.remove(manifest_path)
  with pytest.raises(FileNotFoundError, match="manifest.json"):
    block_store.BlockStore.open(str(out))


def test_manifest_contents(tokenizer, tmp_path):
  store = _write(_documents(), tokenizer, tmp_path / "store")
  manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
  with open(tokenizer.vocab_path, "rb") as f:
    assert manifest["vocab_sha256"] == hashlib.sha256(f.read()).hexdigest()
  assert manifest["max_block_len"] == 64
  assert manifest["num_documents"] == len(_documents())
  assert (manifest["cls_id"], manifest["sep_id"]) == (101, 102)
  assert manifest["fingerprint"] == store.fingerprint
  store.check_vocab(tokenizer.vocab_path)
  other = tmp_path / "vocab.txt"
  other.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
  with pytest.raises(ValueError, match="another vocabulary"):
    store.check_vocab(str(other))


def test_special_ids(tokenizer, tmp_path):
  store = _write(_documents(), tokenizer, tmp_path / "store")
  expected = examples.SpecialIds.from_tokenizer(tokenizer)
  assert store.special_ids() == expected
  # A manifest without mask_id: [MASK] is looked up in the store's vocab.
  del store.manifest["mask_id"]
  assert store.special_ids() == expected
  vocab = tmp_path / "store" / "vocab.txt"
  vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
  store.manifest["vocab_sha256"] = hashlib.sha256(
      vocab.read_bytes()).hexdigest()
  assert store.special_ids().mask_id == 4
  store.manifest["vocab_sha256"] = "0" * 64
  with pytest.raises(ValueError, match="no mask_id.*vocab_path"):
    store.special_ids()


def test_sentence_counts(tokenizer, tmp_path):
  store = _write(_documents(), tokenizer, tmp_path / "store", max_block_len=24)
  ids = np.arange(len(store))
  expected = [len(examples.sentence_bounds(len(store.body_ids(i)),
                                           store.sentence_starts(i)))
              for i in ids]
  counts = store.sentence_counts(ids[::-1])
  assert counts.dtype == np.int64
  np.testing.assert_array_equal(counts, expected[::-1])
  assert max(expected) >= 2 and min(expected) >= 1
  with pytest.raises(IndexError):
    store.sentence_counts([len(store)])


# ------------------------------------------------------------------- ORQA --


def _write_tfr(path, records):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.io.TFRecordWriter(str(path)) as writer:
    for record in records:
      writer.write(record if isinstance(record, bytes) else record.encode())
  return str(path)


def _orqa_records():
  long_text = " ".join(["Zebras run fast."] * 60)
  return [
      ("Zebra", "Zebras are African equids. They have stripes."),
      ("Zebra", "Zebras live in herds."),
      ("Café", "A café serves coffee. Crème brûlée is a dessert."),
      ("Long", long_text),
      ("Αθήνα", "Η Αθήνα είναι πόλη. " * 20),
      ("Empty", ""),
  ]


def test_orqa_round_trip(tokenizer, tmp_path):
  records = _orqa_records()
  blocks_tfr = _write_tfr(tmp_path / "blocks.tfr", [t for _, t in records])
  titles_tfr = _write_tfr(tmp_path / "titles.tfr", [t for t, _ in records])
  assert list(blocks.read_orqa_blocks(blocks_tfr, titles_tfr)) == records
  report = wikipedia.Report()
  packed = list(blocks.pack_orqa_blocks(
      blocks.read_orqa_blocks(blocks_tfr, titles_tfr), tokenizer,
      max_block_len=64, report=report))
  assert len(packed) == len(records)  # block i = record i
  assert [b.doc_index for b in packed] == [0, 0, 1, 2, 3, 4]
  for b, (title, text) in zip(packed, records):
    assert b.title == title
    assert 3 + len(b.title_ids) + len(b.body_ids) <= 64
    assert text.startswith(b.text)
    np.testing.assert_array_equal(tokenizer.tokenize([b.text])[0], b.body_ids)
  assert packed[0].text == records[0][1]
  assert len(packed[3].text) < len(records[3][1])
  assert len(packed[4].text) < len(records[4][1])
  assert report.notes == {"block_truncated": 2}
  store = block_store_writer.write_block_store(
      iter(packed), str(tmp_path / "store"),
      tokenizer_vocab_path=tokenizer.vocab_path, source=blocks_tfr,
      max_block_len=64)
  assert [store.text(i) for i in range(len(store))] == [b.text for b in packed]
  assert store.num_documents == 5


def test_orqa_bad_files(tmp_path):
  blocks_tfr = _write_tfr(tmp_path / "blocks.tfr",
                          ["one", b"bad \xff utf8", "three"])
  titles_tfr = _write_tfr(tmp_path / "titles.tfr", ["A", "B"])
  with pytest.raises(wikipedia.CorruptDumpError,
                     match="titles.tfr ends at record 2"):
    list(blocks.read_orqa_blocks(blocks_tfr, titles_tfr))
  titles_tfr = _write_tfr(tmp_path / "titles.tfr", ["A", "B", "C"])
  report = wikipedia.Report()
  records = list(blocks.read_orqa_blocks(blocks_tfr, titles_tfr, report))
  assert records[1] == ("B", "bad \ufffd utf8")
  assert report.notes == {"invalid_utf8_replaced": 1}
  with pytest.raises(FileNotFoundError, match="missing.tfr"):
    list(blocks.read_orqa_blocks(str(tmp_path / "missing.tfr"), titles_tfr))
  corrupt = tmp_path / "corrupt.tfr"
  corrupt.write_bytes(open(blocks_tfr, "rb").read()[:-3])
  with pytest.raises(wikipedia.CorruptDumpError, match="corrupt.tfr"):
    list(blocks.read_orqa_blocks(str(corrupt), titles_tfr))

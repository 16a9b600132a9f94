"""Tests of the seqio REALM pre-training tasks."""

import collections
import functools
import importlib

import numpy as np
import pytest
import seqio

from realm_jax.data import blocks
from realm_jax.data import examples
from realm_jax.data import salient_spans as ss
from realm_jax.data import tasks
from realm_jax.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.Tokenizer()


# (title, [(sentence, [salient substrings])]); sentences are unique and short.
SALIENT = examples.RealmQueryConfig(masking="salient")
ARTICLES = [
    ("Ada Lovelace", [("Ada Lovelace was born in London in 1815.",
                       ["Ada Lovelace", "London", "1815"]),
                      ("She had no salient span.", []),
                      ("She worked with Charles Babbage.",
                       ["Charles Babbage"])]),
    ("Zürich", [("Zürich lies on Lake Zürich in Switzerland.",
                 ["Zürich", "Lake Zürich", "Switzerland"])]),
    ("Alan Turing", [("Alan Turing was born on 23 June 1912.",
                      ["Alan Turing", "23 June 1912"]),
                     ("He studied at Cambridge.", ["Cambridge"])]),
    ("Grace Hopper", [("Grace Hopper joined the Navy in 1943.",
                       ["Grace Hopper", "Navy", "1943"])]),
    ("Kraków", [("Kraków was the capital of Poland until 1596.",
                 ["Kraków", "Poland", "1596"]),
                ("It has a Supercalifragilisticexpialidocious "
                 "Antidisestablishmentarianism museum.",
                 ["Supercalifragilisticexpialidocious "
                  "Antidisestablishmentarianism"])]),  # > 10 pieces: unused
]


def _annotated(title, sentences) -> ss.AnnotatedDocument:
  text = " ".join(s for s, _ in sentences)
  data = text.encode("utf-8")
  s_starts, s_limits, p_starts, p_limits = [], [], [], []
  offset = 0
  for sentence, subs in sentences:
    sb = sentence.encode("utf-8")
    start = data.index(sb, offset)
    s_starts.append(start)
    s_limits.append(start + len(sb))
    offset = start + len(sb)
    for sub in subs:
      p = start + sb.index(sub.encode("utf-8"))
      p_starts.append(p)
      p_limits.append(p + len(sub.encode("utf-8")))
  return ss.AnnotatedDocument(title, text, tuple(s_starts), tuple(s_limits),
                              tuple(p_starts), tuple(p_limits))


def _expected_queries(tok):
  """(doc_hash, sentence ids) -> the possible masked piece index tuples."""
  expected = {}
  for title, sentences in ARTICLES:
    for sentence, subs in sentences:
      (ids, starts, limits), = tok.tokenize_with_offsets([sentence])
      sb = sentence.encode("utf-8")
      options = set()
      for sub in subs:
        s = sb.index(sub.encode("utf-8"))
        l = s + len(sub.encode("utf-8"))
        pieces = tuple(k for k in range(len(ids))
                       if starts[k] >= s and limits[k] <= l)
        if 1 <= len(pieces) <= 10:
          options.add(pieces)
      if options:
        expected[(blocks.title_hash(title), tuple(ids.tolist()))] = options
  return expected


def _restore(x):
  """Query ids with the targets put back, without [CLS]/[SEP]/padding."""
  ids = x["query_ids"].copy()
  n = int(x["mlm_weights"].sum())
  ids[x["mlm_positions"][:n]] = x["mlm_targets"][:n]
  length = int(x["query_mask"].sum())
  return (int(x["source_doc_hash"]), tuple(ids[1:length - 1].tolist()),
          tuple((x["mlm_positions"][:n] - 1).tolist()))


@pytest.fixture(scope="module")
def annotated_files(tmp_path_factory):
  root = tmp_path_factory.mktemp("annotated")
  docs = [_annotated(t, s) for t, s in ARTICLES]
  ss.write_annotated(str(root / "one-00000-of-00001.tfr.gz"), docs)
  ss.write_annotated(str(root / "two-00000-of-00002.tfr.gz"), docs[0::2])
  ss.write_annotated(str(root / "two-00001-of-00002.tfr.gz"), docs[1::2])
  return root


def _items(task_name, **kwargs):
  ds = seqio.get_mixture_or_task(task_name).get_dataset(
      sequence_length=None, split="train", shuffle=False, seed=0, **kwargs)
  return list(ds.as_numpy_iterator())


def test_pretrain_task_masks_salient_spans(annotated_files, tok):
  tasks.register_pretrain_task(
      name="realm_pretrain_salient", query_config=SALIENT,
      annotated_pattern=str(annotated_files / "one-*.tfr.gz"),
      overwrite=True)
  expected = _expected_queries(tok)
  items = _items("realm_pretrain_salient")
  assert len(items) == len(expected) == 7
  keys = collections.Counter()
  for x in items:
    doc_hash, ids, masked = _restore(x)
    assert masked in expected[(doc_hash, ids)]
    assert x["query_ids"].shape == (96,) and x["mlm_targets"].shape == (10,)
    assert np.all(x["query_ids"][x["mlm_positions"][:len(masked)]] ==
                  tok.mask_id)
    keys[(doc_hash, ids)] += 1
  assert set(keys) == set(expected) and max(keys.values()) == 1
  # The same seed gives the same masks.
  again = _items("realm_pretrain_salient")
  assert [_restore(x) for x in again] == [_restore(x) for x in items]


@pytest.mark.parametrize("pattern", ["one-*.tfr.gz", "two-*.tfr.gz"])
def test_pretrain_sharding_is_disjoint_and_covering(annotated_files, pattern,
                                                    tok):
  # One file: seqio shards the documents; two files: it shards the files.
  tasks.register_pretrain_task(
      name="realm_pretrain_random_spans",
      query_config=examples.RealmQueryConfig(masking="random_spans"),
      annotated_pattern=str(annotated_files / pattern), overwrite=True)
  shards = [collections.Counter(
      _restore(x)[:2] for x in _items(
          "realm_pretrain_random_spans",
          shard_info=seqio.ShardInfo(index=i, num_shards=2)))
            for i in range(2)]
  assert shards[0] and shards[1]
  assert not set(shards[0]) & set(shards[1])
  # Together they hold every query once; the random-span ablation uses the
  # same sentences as the salient task.
  whole = shards[0] + shards[1]
  assert set(whole) == set(_expected_queries(tok))
  assert max(whole.values()) == 1


def test_registration_is_idempotent(annotated_files, tmp_path):
  pattern = str(annotated_files / "one-*.tfr.gz")
  task = functools.partial(tasks.register_pretrain_task,
                           name="realm_pretrain_salient",
                           query_config=SALIENT)
  first = task(annotated_pattern=pattern, overwrite=True)
  assert first.name == "realm_pretrain_salient"
  assert task(annotated_pattern=pattern) is first
  # Importing the module again and registering again does not crash.
  reloaded = importlib.reload(tasks)
  assert reloaded.register_pretrain_task(
      name="realm_pretrain_salient", query_config=SALIENT,
      annotated_pattern=pattern) is first
  assert seqio.get_mixture_or_task("realm_pretrain_salient") is first
  with pytest.raises(ValueError, match="overwrite=True"):
    reloaded.register_pretrain_task(
        name="realm_pretrain_salient", query_config=SALIENT,
        annotated_pattern=str(tmp_path / "other-*"))
  with pytest.raises(ValueError, match="sequence_length"):
    first.get_dataset(sequence_length={"query_ids": 64}, split="train",
                      shuffle=False)

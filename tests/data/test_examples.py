"""Tests of REALM masked queries and ICT pairs."""

import numpy as np
import pytest

from realm_jax.data import blocks
from realm_jax.data import examples as ex
from realm_jax.data import salient_spans as ss
from realm_jax.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.Tokenizer()


def byte_span(sentence: str, sub: str) -> tuple[int, int]:
  data, sub_b = sentence.encode("utf-8"), sub.encode("utf-8")
  start = data.index(sub_b)
  return start, start + len(sub_b)


def pieces_inside(starts, limits, span) -> list[int]:
  """Independent loop version of 'wordpieces fully inside the span'."""
  return [k for k in range(len(starts))
          if starts[k] >= span[0] and limits[k] <= span[1]]


def window_offset(query, ids, masked) -> int:
  """Where in `ids` the query's sentence window starts (found by search)."""
  real = query["query_ids"][1:int(query["query_mask"].sum()) - 1]
  keep = np.ones(len(real), bool)
  keep[np.asarray(masked, int) - 1] = False
  for w0 in range(len(ids) - len(real) + 1):
    if np.array_equal(ids[w0:w0 + len(real)][keep], real[keep]):
      return w0
  raise AssertionError("query window not found in the sentence")


def check_query(query, ids, special, config=ex.RealmQueryConfig()):
  """Invariants every REALM query must satisfy; returns (w0, masked)."""
  n_real = int(query["mlm_weights"].sum())
  positions = query["mlm_positions"][:n_real]
  assert 1 <= n_real <= config.max_masks
  assert np.all(query["mlm_weights"][n_real:] == 0)
  assert np.all(positions < config.mask_limit) and np.all(positions >= 1)
  assert len(set(positions.tolist())) == n_real
  assert query["query_ids"][0] == special.cls_id
  length = int(query["query_mask"].sum())
  assert query["query_ids"][length - 1] == special.sep_id
  assert np.all(query["query_mask"][:length] == 1)
  assert np.all(query["query_mask"][length:] == 0)
  # Exactly the target positions are [MASK].
  is_mask = np.flatnonzero(query["query_ids"] == special.mask_id)
  assert sorted(is_mask.tolist()) == sorted(positions.tolist())
  w0 = window_offset(query, ids, positions)
  # Targets are the original ids at those positions.
  np.testing.assert_array_equal(query["mlm_targets"][:n_real],
                                ids[w0 + positions - 1])
  assert query["query_ids"].dtype == np.int32
  assert query["mlm_weights"].dtype == np.float32
  return w0, (w0 + positions - 1).tolist()


SENTENCES = [
    ("Barack Obama was born in Honolulu in 1961.",
     ["Barack Obama", "Honolulu", "1961"]),
    ("Zürich's Grossmünster was consecrated in 1220 by Friedrich Ühlein.",
     ["Zürich", "Grossmünster", "1220", "Friedrich Ühlein"]),
]


def test_salient_mask_covers_exactly_the_span_pieces(tok):
  special = ex.SpecialIds.from_tokenizer(tok)
  rng = np.random.default_rng(0)
  for sentence, subs in SENTENCES:
    (ids, starts, limits), = tok.tokenize_with_offsets([sentence])
    spans = [byte_span(sentence, s) for s in subs]
    expected = {tuple(pieces_inside(starts, limits, sp)) for sp in spans}
    seen = set()
    for _ in range(40):
      q = ex.realm_query(ids=ids, byte_starts=starts, byte_limits=limits,
                         spans=spans, source_doc_hash=5, rng=rng,
                         special=special)
      w0, masked = check_query(q, ids, special)
      assert w0 == 0  # short sentence: all of it fits
      assert tuple(masked) in expected
      seen.add(tuple(masked))
      assert q["source_doc_hash"] == 5
    assert seen == expected  # every span gets picked eventually


def test_long_sentence_window_keeps_masks_before_94(tok):
  special = ex.SpecialIds.from_tokenizer(tok)
  filler = " ".join(f"word{i}" for i in range(100))  # 2-3 pieces a word
  for sentence, target in [
      (f"Ada Lovelace {filler} ends here.", "Ada Lovelace"),
      (f"{filler} with Charles Babbage.", "Charles Babbage"),
      (f"{filler} in London {filler}", "London")]:
    (ids, starts, limits), = tok.tokenize_with_offsets([sentence])
    assert len(ids) > 150
    span = byte_span(sentence, target)
    q = ex.realm_query(ids=ids, byte_starts=starts, byte_limits=limits,
                       spans=[span], source_doc_hash=0,
                       rng=np.random.default_rng(1), special=special)
    w0, masked = check_query(q, ids, special)
    assert masked == pieces_inside(starts, limits, span)
    assert q["query_mask"].sum() == 96  # the window is full
  # Middle span: centred, so there is context on both sides.
  assert 30 < q["mlm_positions"][0] < 64


def test_sentence_of_exactly_94_pieces_with_span_at_the_end(tok):
  special = ex.SpecialIds.from_tokenizer(tok)
  ids = np.arange(1000, 1094)
  starts = np.arange(94) * 2
  limits = starts + 1
  q = ex.realm_query(ids=ids, byte_starts=starts, byte_limits=limits,
                     spans=[(186, 187)], source_doc_hash=0,
                     rng=np.random.default_rng(0), special=special)
  w0, masked = check_query(q, ids, special)
  assert masked == [93] and w0 == 1 and q["mlm_positions"][0] == 93


def test_unusable_spans_are_skipped(tok):
  special = ex.SpecialIds.from_tokenizer(tok)
  sentence = ("The Supercalifragilisticexpialidocious Antidisestablishment"
              "arianism Floccinaucinihilipilification Society met Obama.")
  (ids, starts, limits), = tok.tokenize_with_offsets([sentence])
  long_span = (4, sentence.index(" Society") + len(" Society"))
  met = byte_span(sentence, "met")
  partial = (met[0] + 1, met[1] - 1)  # inside one piece: none fully inside
  assert len(pieces_inside(starts, limits, long_span)) > 10
  assert pieces_inside(starts, limits, partial) == []
  kwargs = dict(ids=ids, byte_starts=starts, byte_limits=limits,
                source_doc_hash=0, special=special)
  rng = np.random.default_rng(0)
  assert ex.realm_query(spans=[long_span, partial], rng=rng, **kwargs) is None
  assert ex.realm_query(spans=[], rng=rng, **kwargs) is None
  # A usable span next to them is always the one picked.
  good = byte_span(sentence, "Obama")
  for _ in range(10):
    q = ex.realm_query(spans=[long_span, good, partial], rng=rng, **kwargs)
    _, masked = check_query(q, ids, special)
    assert masked == pieces_inside(starts, limits, good)


def test_random_token_and_span_ablations(tok):
  special = ex.SpecialIds.from_tokenizer(tok)
  sentence = " ".join(f"token{i}" for i in range(50))
  (ids, starts, limits), = tok.tokenize_with_offsets([sentence])
  spans = [byte_span(sentence, "token7")]
  rng = np.random.default_rng(3)
  tokens_cfg = ex.RealmQueryConfig(masking="random_tokens")
  spans_cfg = ex.RealmQueryConfig(masking="random_spans")
  lengths = []
  for _ in range(300):
    q = ex.realm_query(ids=ids, byte_starts=starts, byte_limits=limits,
                       spans=spans, source_doc_hash=0, rng=rng,
                       special=special, config=tokens_cfg)
    _, masked = check_query(q, ids, special, tokens_cfg)
    assert len(masked) == 10  # 15% of 93 eligible pieces, capped at 10
    q = ex.realm_query(ids=ids, byte_starts=starts, byte_limits=limits,
                       spans=spans, source_doc_hash=0, rng=rng,
                       special=special, config=spans_cfg)
    _, masked = check_query(q, ids, special, spans_cfg)
    assert masked == list(range(masked[0], masked[0] + len(masked)))
    lengths.append(len(masked))
  # Geo(0.2) truncated to 1..10 has mean ~3.79.
  assert 3.2 < np.mean(lengths) < 4.4 and min(lengths) == 1
  # Short sentence: at least one mask.
  (ids, starts, limits), = tok.tokenize_with_offsets(["Hello there"])
  kwargs = dict(ids=ids, byte_starts=starts, byte_limits=limits,
                source_doc_hash=0, rng=rng, special=special)
  q = ex.realm_query(spans=[(0, 5)], config=tokens_cfg, **kwargs)
  assert q["mlm_weights"].sum() == 1
  # No usable salient span: no query, whatever the masking.
  assert ex.realm_query(spans=[(1, 3)], config=tokens_cfg, **kwargs) is None
  assert ex.realm_query(spans=[], config=spans_cfg, **kwargs) is None


def test_queries_are_deterministic_given_the_seed(tok):
  doc = ss.AnnotatedDocument(
      "Ada Lovelace", "Ada Lovelace was born in London. She met Babbage.",
      (0, 33), (32, 49), (0, 25, 41), (12, 31, 48))
  for masking in ex.MASKING_MODES:
    cfg = ex.RealmQueryConfig(masking=masking)
    a = ex.realm_queries_from_document(doc, tok, np.random.default_rng(7), cfg)
    b = ex.realm_queries_from_document(doc, tok, np.random.default_rng(7), cfg)
    assert len(a) == 2
    for x, y in zip(a, b):
      for k in ex.REALM_QUERY_FEATURES:
        np.testing.assert_array_equal(x[k], y[k])
    assert a[0]["source_doc_hash"] == blocks.title_hash("Ada Lovelace")


def test_config_errors_say_what_to_do():
  with pytest.raises(ValueError, match="masking"):
    ex.RealmQueryConfig(masking="whole_words")
  with pytest.raises(ValueError, match="mask_limit"):
    ex.RealmQueryConfig(mask_limit=96)
  with pytest.raises(ValueError, match="remove_probability"):
    ex.IctConfig(remove_probability=1.5)


# ------------------------------------------------------------------ ICT ----


def test_ict_removal_probability_and_layout():
  special = ex.SpecialIds()
  body = np.arange(1000, 1030)  # sentences [0,8) [8,20) [20,30)
  starts = [0, 8, 20]
  title = np.array([7, 8, 9])
  rng = np.random.default_rng(0)
  removed, picked = 0, set()
  n = 3000
  for _ in range(n):
    p = ex.ict_pair(body_ids=body, sentence_starts=starts, title_ids=title,
                    rng=rng, special=special)
    q = p["query_ids"][p["query_mask"] == 1]
    assert q[0] == special.cls_id and q[-1] == special.sep_id
    sentence = q[1:-1]
    s = int(np.searchsorted(body, sentence[0]))
    picked.add(s)
    np.testing.assert_array_equal(body[s:s + len(sentence)], sentence)
    blk = p["block_ids"][p["block_mask"] == 1]
    np.testing.assert_array_equal(blk[:5], [special.cls_id, 7, 8, 9,
                                            special.sep_id])
    assert blk[-1] == special.sep_id
    rest = np.concatenate([body[:s], body[s + len(sentence):]])
    if p["sentence_removed"]:
      removed += 1
      np.testing.assert_array_equal(blk[5:-1], rest)
    else:
      np.testing.assert_array_equal(blk[5:-1], body)
    seg = p["block_segment_ids"]
    assert np.all(seg[:5] == 0) and np.all(seg[5:len(blk)] == 1)
    assert np.all(seg[len(blk):] == 0)
    assert p["block_ids"].shape == (288,) and p["query_ids"].shape == (64,)
    assert np.all(p["query_segment_ids"] == 0)
  assert picked == {0, 8, 20}
  # Binomial(3000, 0.9): standard deviation 0.0055.
  assert abs(removed / n - 0.9) < 0.025


def test_ict_one_sentence_block_and_truncation():
  special = ex.SpecialIds()
  rng = np.random.default_rng(0)
  body = np.arange(1000, 1100)
  for _ in range(20):
    p = ex.ict_pair(body_ids=body, sentence_starts=[0], title_ids=[5],
                    rng=rng, special=special)
    assert not p["sentence_removed"]  # else the body would be empty
    np.testing.assert_array_equal(p["query_ids"][1:63], body[:62])
    assert p["query_ids"][63] == special.sep_id
  long_body = np.arange(1000, 1400)
  p = ex.ict_pair(body_ids=long_body, sentence_starts=[0, 390],
                  title_ids=[5, 6], rng=np.random.default_rng(1),
                  special=special, config=ex.IctConfig(remove_probability=0))
  assert p["block_mask"].sum() == 288 and p["block_ids"][287] == special.sep_id
  assert ex.ict_pair(body_ids=[], sentence_starts=[], title_ids=[1],
                     rng=rng, special=special) is None

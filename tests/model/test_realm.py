"""Shapes, options and invariants of the BERT, retriever and reader modules."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.model import bert as bert_lib
from realm_jax.model import cpu
from realm_jax.model import functional
from realm_jax.model import realm as realm_lib
from realm_jax.model.bert import Bert, BertConfig
from realm_jax.model.realm import (Embedder, Reader, ReaderConfig, Realm,
                                   Retriever, RetrieverConfig, span_mask)
from realm_jax.testing import reference, tiny
from realm_jax.core import parallel
from realm_jax.training import ict


def test_bert_config_errors_say_what_to_fix():
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    BertConfig(hidden_size=30, num_heads=4)
  with pytest.raises(ValueError, match="dtype"):
    BertConfig(dtype="float16")
  with pytest.raises(ValueError, match="pooling"):
    RetrieverConfig(pooling="max")


def test_bert_padding_does_not_change_real_tokens():
  cfg = tiny.tiny_bert()
  g, params = functional.init(lambda r: Bert(cfg, rngs=r), 0)
  model = functional.bind(g, params)
  ids = jnp.array([[2, 7, 9, 11, 0, 0]])
  mask = jnp.array([[1, 1, 1, 1, 0, 0]])
  h, pooled = model(ids, mask)
  h2, pooled2 = model(ids[:, :4], mask[:, :4])
  np.testing.assert_allclose(h[:, :4], h2, atol=1e-5)
  np.testing.assert_allclose(pooled, pooled2, atol=1e-5)


def test_dropout_is_active_only_with_a_key():
  cfg = tiny.tiny_bert(hidden_dropout=0.5, attention_dropout=0.5)
  g, params = functional.init(lambda r: Bert(cfg, rngs=r), 0)
  model = functional.bind(g, params)
  ids = jnp.array([[2, 7, 9, 11]])
  mask = jnp.ones_like(ids)
  a, _ = model(ids, mask)
  b, _ = model(ids, mask)
  c, _ = model(ids, mask, dropout_rng=jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  assert np.abs(np.asarray(a - c)).max() > 1e-3


def test_cpu_option_errors_list_the_choices():
  with pytest.raises(ValueError, match="'whole_batch', 'per_sequence'"):
    BertConfig(attention_batching="per_example")
  with pytest.raises(ValueError, match=r"\(32, 16\)"):
    BertConfig(dropout_mask_bits=8)
  with pytest.raises(ValueError, match="'whole_batch', 'per_row'"):
    ReaderConfig(span_head_batching="rows")


def test_defaults_are_the_plain_implementations():
  # Accelerators and CPUs trace the same graph unless a config says
  # otherwise (gin_configs/models/cpu.gin).
  assert BertConfig().attention_batching == "whole_batch"
  assert BertConfig().dropout_mask_bits == 32
  assert BertConfig().attention == "xla"
  assert ReaderConfig().span_head_batching == "whole_batch"


def test_for_cpu_sets_every_option_in_every_tower():
  tuned = cpu.for_cpu(tiny.tiny_realm())
  for bert in (tuned.retriever.bert, tuned.reader.bert):
    assert (bert.attention_batching, bert.dropout_mask_bits) == (
        "per_sequence", 16)
  assert tuned.reader.span_head_batching == "per_row"
  # Only the options change.
  assert tuned.reader.span_hidden_size == 8
  assert tuned.retriever.projection_size == 16
  assert cpu.for_cpu(tiny.tiny_bert()) == tuned.reader.bert


def test_per_sequence_attention_only_for_batches_that_miss_the_cache():
  # The index builder's 32 x 288 MiniLM batch goes per sequence, a
  # test-sized batch stays one pass, and the default never loops.
  per_seq = BertConfig(hidden_size=48, num_heads=12,
                       attention_batching="per_sequence")
  assert bert_lib._attends_per_sequence(per_seq, (32, 288, 12, 4))
  assert not bert_lib._attends_per_sequence(per_seq, (8, 64, 12, 4))
  assert not bert_lib._attends_per_sequence(
      BertConfig(hidden_size=48, num_heads=12), (32, 288, 12, 4))


def _assert_close_per_leaf(got, want, rtol):
  """Each leaf within rtol of its own norm: robust to summation order."""
  for path, a in jax.tree_util.tree_leaves_with_path(got):
    b = np.asarray(functools.reduce(lambda t, k: t[k.key], path, want))
    error = np.linalg.norm(np.asarray(a, np.float64) - b)
    assert error <= rtol * np.linalg.norm(b) + 1e-7, (
        jax.tree_util.keystr(path), error, np.linalg.norm(b))


def test_per_sequence_attention_equals_the_whole_batch(monkeypatch):
  # Same outputs and gradients (two leading dims, padding included); the
  # cache threshold is lowered so that this small batch takes the loop.
  monkeypatch.setattr(bert_lib, "_PER_SEQUENCE_MIN_SCORES_BYTES", 0)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(5, 97, (2, 3, 12)), jnp.int32)
  mask = jnp.asarray(np.arange(12)[None, None, :] < rng.integers(
      3, 13, (2, 3, 1)), jnp.int32)
  results = {}
  for batching in ("whole_batch", "per_sequence"):
    cfg = tiny.tiny_bert(attention_dropout=0.2,
                         attention_batching=batching)
    g, params = functional.init(lambda r, c=cfg: Bert(c, rngs=r), 0)

    def loss(p, dropout_rng=None, g=g):
      h, pooled = functional.bind(g, p)(ids, mask, dropout_rng=dropout_rng)
      return jnp.sum(jnp.sin(h) * mask[..., None]) + jnp.sum(pooled ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    dropped = jax.jit(loss)(params, jax.random.key(1))
    assert abs(float(dropped) - float(value)) > 1e-3  # dropout is on
    lowered = jax.jit(loss).lower(params).as_text()
    assert ("stablehlo.while" in lowered) == (batching == "per_sequence")
    results[batching] = (value, grads)
  value, grads = results["per_sequence"]
  want_value, want_grads = results["whole_batch"]
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  _assert_close_per_leaf(grads, want_grads, 1e-5)


@pytest.mark.slow  # The interpreter: ~40 s on 2 loaded cores.
def test_flash_attention_equals_xla_attention_in_tpu_interpret_mode():
  # attention="flash" is jax's Pallas TPU kernel; Pallas's TPU interpret
  # mode runs it on CPU. Same loss and gradients as the default, with
  # padding (the kernel's segment ids) and a length padded to 128, through
  # the jobs' own gradient function (`shard_map` over a one-device mesh,
  # its varying types checked), as the training steps run it.
  from jax.experimental.pallas import tpu as pltpu
  rng = np.random.default_rng(0)
  batch = {"ids": jnp.asarray(rng.integers(5, 97, (2, 12)), jnp.int32),
           "mask": jnp.asarray(np.arange(12)[None, :] < np.array([[12], [5]]),
                               jnp.int32)}
  mesh = parallel.make_mesh(jax.devices()[:1])
  results = {}
  for attention in ("xla", "flash"):
    cfg = tiny.tiny_bert(num_layers=1, num_heads=2, attention=attention)
    g, params = functional.init(lambda r, c=cfg: Bert(c, rngs=r), 0)

    def loss_fn(p, b, rng, g=g):
      del rng
      h, pooled = functional.bind(g, p)(b["ids"], b["mask"])
      loss = jnp.sum(jnp.sin(h) * b["mask"][..., None]) + jnp.sum(pooled ** 2)
      return loss, jnp.float32(1.0), {}

    step = parallel.data_parallel_value_and_grad(loss_fn, mesh)
    with pltpu.force_tpu_interpret_mode():
      results[attention] = jax.jit(step)(params, batch)[:2]
    # The kernels (forward, dK/dV, dQ) are what runs.
    kernels = str(jax.make_jaxpr(step)(params, batch)).count("pallas_call")
    assert bool(kernels) == (attention == "flash")
  value, grads = results["flash"]
  want_value, want_grads = results["xla"]
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  _assert_close_per_leaf(grads, want_grads, 1e-5)


def test_flash_attention_refuses_attention_dropout_and_bad_names():
  with pytest.raises(ValueError, match="'xla', 'flash'"):
    BertConfig(attention="splash")
  cfg = tiny.tiny_bert(attention="flash", attention_dropout=0.1)
  g, params = functional.init(lambda r: Bert(cfg, rngs=r), 0)
  ids = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="attention_dropout = 0.0"):
    functional.bind(g, params)(ids, ids, dropout_rng=jax.random.key(0))


@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_rate_scale_and_keys(rate, bits):
  x = jnp.ones((1001, 999))  # an odd size: one 16-bit half is left over
  apply = jax.jit(lambda k: bert_lib.dropout(x, rate, k, bits))
  y = np.asarray(apply(jax.random.key(3)))
  dropped = np.mean(y == 0)
  # Binomial standard deviation is <= 0.0005 here; allow 5 of them.
  assert abs(dropped - rate) < 0.0025, dropped
  kept = y[y != 0]
  # Scaled by exactly the inverse of the mask's keep probability (16 bits:
  # quantised to 1/65536).
  keep_prob = (1 - rate) if bits == 32 else round(
      (1 - rate) * 65536) / 65536
  np.testing.assert_allclose(kept, np.float32(1 / keep_prob), rtol=1e-6)
  assert abs(np.mean(y) - 1.0) < 0.005
  # Neighbours (with 16 bits, the two halves of one random word) are
  # independent, another key gives another mask, and the same key the same.
  z = (y == 0).reshape(-1).astype(np.float64)
  assert abs(np.corrcoef(z[:-1:2], z[1::2])[0, 1]) < 0.01
  other = np.asarray(bert_lib.dropout(x, rate, jax.random.key(4), bits))
  assert 0.5 * rate < np.mean((y == 0) != (other == 0))
  np.testing.assert_array_equal(apply(jax.random.key(3)), y)
  np.testing.assert_array_equal(
      bert_lib.dropout(x, rate, jax.random.key(3), bits), y)


def test_dropout_mask_bits_change_the_mask_not_the_model():
  # Both are deterministic given the key; without a key both are the
  # identity, so the model's evaluation outputs do not depend on the bits.
  ids = jnp.array([[2, 7, 9, 11, 5, 6]])
  mask = jnp.ones_like(ids)
  outs = {}
  for bits in (32, 16):
    cfg = tiny.tiny_bert(hidden_dropout=0.3, attention_dropout=0.3,
                         dropout_mask_bits=bits)
    g, params = functional.init(lambda r, c=cfg: Bert(c, rngs=r), 0)
    model = functional.bind(g, params)
    key = jax.random.key(5)
    train = [np.asarray(model(ids, mask, dropout_rng=key)[0])
             for _ in range(2)]
    np.testing.assert_array_equal(train[0], train[1])
    outs[bits] = (np.asarray(model(ids, mask)[0]), train[0])
  np.testing.assert_array_equal(outs[32][0], outs[16][0])
  assert np.abs(outs[32][1] - outs[16][1]).max() > 1e-3


@pytest.mark.parametrize("pooling", ["pooler", "cls", "mean"])
@pytest.mark.parametrize("normalize", [False, True])
def test_embedder_pooling_options(pooling, normalize):
  cfg = RetrieverConfig(bert=tiny.tiny_bert(), projection_size=None,
                        pooling=pooling, normalize=normalize)
  g, params = functional.init(lambda r: Embedder(cfg, rngs=r), 0)
  model = functional.bind(g, params)
  ids = jnp.array([[2, 7, 9, 0], [3, 4, 0, 0]])
  mask = (ids > 0).astype(jnp.int32)
  emb = model(ids, mask)
  seq, pooled = functional.bind(g, params).bert(ids, mask)
  if pooling == "pooler":
    want = pooled
  elif pooling == "cls":
    want = seq[:, 0]
  else:
    want = np.stack([seq[0, :3].mean(0), seq[1, :2].mean(0)])
  if normalize:
    want = want / np.linalg.norm(want, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(emb, want, atol=1e-5)


@pytest.mark.parametrize("share", [True, False])
def test_retriever_scores_are_inner_products(share):
  cfg = RetrieverConfig(bert=tiny.tiny_bert(), projection_size=16,
                        share_towers=share)
  g, params = functional.init(lambda r: Retriever(cfg, rngs=r), 0)
  assert ("document_embedder" in params) == (not share)
  model = functional.bind(g, params)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.integers(5, 90, size=(2, 6)))
  d = jnp.asarray(rng.integers(5, 90, size=(2, 3, 8)))
  seg = jnp.zeros_like(d)
  logits = model(q, jnp.ones_like(q), d, jnp.ones_like(d), seg)
  assert logits.shape == (2, 3)
  qe = model.embed_queries(q, jnp.ones_like(q))
  de = model.embed_documents(d, jnp.ones_like(d), seg)
  np.testing.assert_allclose(logits, np.einsum("bd,bcd->bc", qe, de),
                             rtol=1e-5, atol=1e-5)
  # One set of blocks for every query (ICT's in-batch blocks), scaled.
  np.testing.assert_allclose(
      realm_lib.retrieval_logits(qe, de[0], 2.0),
      2.0 * np.einsum("bd,cd->bc", np.asarray(qe, np.float64),
                      np.asarray(de[0], np.float64)), rtol=1e-5, atol=1e-5)
  # Shared towers embed a text identically as query or document.
  same = np.allclose(qe[0], model.embed_documents(q, jnp.ones_like(q))[0],
                     atol=1e-6)
  assert same == share


def test_span_scores_finite_only_inside_document_and_width():
  cfg = ReaderConfig(bert=tiny.tiny_bert(), span_hidden_size=8,
                     max_span_width=3, mlm_head=False)
  g, params = functional.init(lambda r: Reader(cfg, rngs=r), 0)
  model = functional.bind(g, params)
  ids = jnp.asarray(np.random.default_rng(0).integers(5, 90, size=(2, 12)))
  block_start = jnp.array([4, 6])
  block_end = jnp.array([9, 10])  # Inclusive; [SEP] at end + 1.
  scores = np.asarray(model.span_logits(ids, jnp.ones_like(ids),
                                        jnp.zeros_like(ids), block_start,
                                        block_end))
  assert scores.shape == (2, 12, 3)
  for b in range(2):
    for s in range(12):
      for w in range(3):
        inside = block_start[b] <= s and s + w <= block_end[b]
        assert np.isfinite(scores[b, s, w]) == inside, (b, s, w)


def test_span_head_matches_a_direct_formula():
  cfg = ReaderConfig(bert=tiny.tiny_bert(), span_hidden_size=8,
                     max_span_width=4, mlm_head=False)
  g, params = functional.init(lambda r: Reader(cfg, rngs=r), 3)
  head = functional.bind(g, params).span_head
  hidden = np.random.default_rng(1).normal(size=(9, 32)).astype(np.float32)
  scores = np.asarray(head(jnp.asarray(hidden)))
  p = params["span_head"]
  proj = hidden @ np.asarray(p["intermediate"]["kernel"]) + np.asarray(
      p["intermediate"]["bias"])
  start, end = proj[:, :8], proj[:, 8:]
  for s in range(9):
    for w in range(4):
      if s + w >= 9:
        continue
      x = np.maximum(start[s] + end[s + w], 0)
      x = (x - x.mean()) / np.sqrt(x.var() + 1e-3)
      x = x * np.asarray(p["layer_norm"]["scale"]) + np.asarray(
          p["layer_norm"]["bias"])
      want = x @ np.asarray(p["output"]["kernel"])[:, 0] + np.asarray(
          p["output"]["bias"])[0]
      np.testing.assert_allclose(scores[s, w], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batching", ["whole_batch", "per_row"])
def test_span_head_values_and_gradients_match_the_naive_head(batching):
  # The fused head (feature sums, custom VJP) against the head that builds
  # the [..., L, W, H] tensor, with non-trivial LayerNorm and output
  # parameters, two leading dims, and gradients w.r.t. every parameter and
  # the hidden states; the whole batch at once (the default) and rows one
  # at a time (the CPU option).
  cfg = ReaderConfig(bert=tiny.tiny_bert(), span_hidden_size=16,
                     max_span_width=5, mlm_head=False,
                     span_head_batching=batching)
  g, params = functional.init(lambda r: Reader(cfg, rngs=r), 3)
  rng = np.random.default_rng(2)
  head_params = jax.tree_util.tree_map(
      lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32) * 0.5,
      params["span_head"])
  hidden = jnp.asarray(rng.normal(size=(2, 3, 11, 32)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(2, 3, 11, 5)), jnp.float32)

  def fused(p, h):
    model = functional.bind(g, {**params, "span_head": p})
    return model.span_head(h)

  def naive(p, h):
    return reference.naive_span_scores(p, h, 5, 1e-3)

  np.testing.assert_allclose(fused(head_params, hidden),
                             naive(head_params, hidden), rtol=1e-4,
                             atol=1e-4)
  grads = []
  for fn in (fused, naive):
    loss = lambda p, h, fn=fn: jnp.sum(weights * jnp.tanh(fn(p, h)))
    grads.append(jax.jit(jax.grad(loss, argnums=(0, 1)))(head_params,
                                                         hidden))
  for got, want in zip(jax.tree_util.tree_leaves(grads[0]),
                       jax.tree_util.tree_leaves(grads[1])):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_span_mask_function():
  m = np.asarray(span_mask(6, jnp.array(2), jnp.array(4), 2))
  want = np.zeros((6, 2), bool)
  want[2, :] = want[3, :] = True
  want[4, 0] = True
  np.testing.assert_array_equal(m, want)


def test_mlm_logits_tied_to_word_embeddings_at_masked_positions():
  cfg = ReaderConfig(bert=tiny.tiny_bert(), span_head=False)
  g, params = functional.init(lambda r: Reader(cfg, rngs=r), 0)
  model = functional.bind(g, params)
  ids = jnp.asarray(np.random.default_rng(0).integers(5, 90, size=(2, 10)))
  positions = jnp.array([[1, 4], [2, 3]])
  logits = model.mlm_logits(ids, jnp.ones_like(ids), jnp.zeros_like(ids),
                            positions)
  assert logits.shape == (2, 2, 97)
  hidden, _ = model.bert(ids, jnp.ones_like(ids), jnp.zeros_like(ids))
  full = model.mlm_head(hidden, params["bert"]["embeddings"][
      "word_embeddings"]["embedding"])
  np.testing.assert_allclose(logits[0, 1], full[0, 4], rtol=1e-5, atol=1e-5)
  assert "decoder" not in params["mlm_head"]  # Tied: no separate matrix.


def test_bfloat16_compute_runs_and_stays_close():
  rng = np.random.default_rng(0)
  batch = tiny.random_pretraining_batch(rng, batch=2)
  outs = []
  for dtype in ("float32", "bfloat16"):
    cfg = tiny.tiny_realm()
    bert = tiny.tiny_bert(dtype=dtype)
    cfg = type(cfg)(
        retriever=RetrieverConfig(bert=bert, projection_size=16),
        reader=ReaderConfig(bert=bert, span_hidden_size=8, max_span_width=4))
    g, params = functional.init(lambda r, c=cfg: Realm(c, rngs=r), 0)
    rl, ml = functional.bind(g, params).pretraining_logits(batch)
    assert rl.dtype == jnp.float32 and ml.dtype == jnp.float32
    outs.append((np.asarray(rl), np.asarray(ml)))
  np.testing.assert_allclose(outs[0][1], outs[1][1], atol=0.1)
  # Parameters stay float32 whatever the compute dtype.
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))


def test_softmax_dtype_compute_keeps_the_attention_tensors_in_bfloat16():
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(1, 97, (2, 24)), jnp.int32)
  mask = jnp.asarray(np.arange(24)[None, :] < np.array([[24], [17]]),
                     jnp.int32)
  outs, texts = {}, {}
  for dtype in ("float32", "bfloat16"):
    for softmax in bert_lib.SOFTMAX_DTYPES:
      cfg = tiny.tiny_bert(dtype=dtype, softmax_dtype=softmax)
      g, params = functional.init(lambda r, c=cfg: Bert(c, rngs=r), 0)
      fn = jax.jit(lambda p, g=g: functional.bind(g, p)(ids, mask)[0])
      outs[dtype, softmax] = np.asarray(fn(params))
      texts[dtype, softmax] = fn.lower(params).as_text()
  # float32: one program, the same values.
  np.testing.assert_array_equal(outs["float32", "float32"],
                                outs["float32", "compute"])
  # bfloat16: the [2, heads, 24, 24] softmax in bfloat16 instead of
  # float32, and the output as close to float32's as float32 softmax's.
  def exp_dtypes(text):  # of the softmax's exp over [2, heads, 24, 24]
    return set(re.findall(r"stablehlo.exponential %\w+ : "
                          r"tensor<2x4x24x24x(\w+)>", text))
  assert exp_dtypes(texts["bfloat16", "compute"]) == {"bf16"}
  assert exp_dtypes(texts["bfloat16", "float32"]) == {"f32"}
  reference_out = outs["float32", "float32"]
  for softmax in bert_lib.SOFTMAX_DTYPES:
    error = np.abs(outs["bfloat16", softmax] - reference_out).max()
    assert error < 0.1, (softmax, error)  # LayerNorm'd hidden states ~ 1.
  with pytest.raises(ValueError, match="softmax_dtype applies to attention"):
    tiny.tiny_bert(attention="flash", softmax_dtype="compute")
  with pytest.raises(ValueError, match="softmax_dtype must be one of"):
    tiny.tiny_bert(softmax_dtype="bfloat16")


def test_residual_dtype_compute_carries_the_stream_in_bfloat16():
  rng = np.random.default_rng(4)
  ids = jnp.asarray(rng.integers(1, 97, (2, 24)), jnp.int32)
  mask = jnp.asarray(np.arange(24)[None, :] < np.array([[24], [17]]),
                     jnp.int32)
  outs, grads = {}, {}
  for dtype in ("float32", "bfloat16"):
    for residual in bert_lib.RESIDUAL_DTYPES:
      cfg = tiny.tiny_bert(dtype=dtype, residual_dtype=residual)
      g, params = functional.init(lambda r, c=cfg: Bert(c, rngs=r), 0)
      model = lambda p, g=g: functional.bind(g, p)(ids, mask)
      seq, pooled = jax.jit(model)(params)
      # The encoder's outputs are float32 whatever the stream.
      assert seq.dtype == pooled.dtype == jnp.float32
      outs[dtype, residual] = np.asarray(seq)
      grads[dtype, residual] = jax.grad(
          lambda p, m=model: jnp.sum(m(p)[0][..., 0, :] ** 2))(params)
      # What one layer hands the next: the stream's dtype.
      layer = functional.bind(g, params).layer_0
      x = jnp.zeros((2, 24, cfg.hidden_size), cfg.stream_dtype)
      bias = jnp.zeros((2, 1, 1, 24), jnp.float32)
      want = jnp.bfloat16 if (dtype, residual) == ("bfloat16",
                                                   "compute") else jnp.float32
      assert layer(x, bias, None).dtype == want
  # float32: one program, the same values and gradients.
  np.testing.assert_array_equal(outs["float32", "float32"],
                                outs["float32", "compute"])
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         grads["float32", "float32"],
                         grads["float32", "compute"])
  # bfloat16: as close to float32's as the float32 stream is (LayerNorm'd
  # hidden states ~ 1), and gradients of the same direction.
  for residual in bert_lib.RESIDUAL_DTYPES:
    error = np.abs(outs["bfloat16", residual]
                   - outs["float32", "float32"]).max()
    assert error < 0.1, (residual, error)
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(
        grads[k, r])]).astype(np.float64) for k, r in (
            ("float32", "float32"), ("bfloat16", residual)))
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99, residual
  with pytest.raises(ValueError, match="residual_dtype must be one of"):
    tiny.tiny_bert(residual_dtype="bfloat16")


def test_forward_flops_match_the_compilers_count():
  # The model's FLOPs (realm-aot's "model MFU") against XLA's own count of
  # a forward pass on CPU; the formula leaves out the elementwise ops and
  # the embeddings, a few percent at these widths.
  cfg = tiny.tiny_bert(hidden_size=256, intermediate_size=1024, num_heads=4)
  g, params = functional.init(lambda r: Bert(cfg, rngs=r), 0)
  ids = jnp.ones((4, 64), jnp.int32)
  compiled = jax.jit(lambda p: functional.bind(g, p)(ids, ids)[0]).lower(
      params).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert bert_lib.forward_flops(cfg, 4, 64) == pytest.approx(
      cost["flops"], rel=0.1)
  # REALM's step: 3x the forward of its towers and reader, plus the head.
  realm_cfg = tiny.tiny_realm()
  one = dict(batch=2, candidates=3, query_length=8, block_length=16,
             reader_length=24, num_masks=2)
  full = realm_lib.pretraining_flops(realm_cfg, **one)
  bert_cfg = realm_cfg.retriever.bert
  assert full == pytest.approx(3 * (
      bert_lib.forward_flops(bert_cfg, 2, 8)
      + bert_lib.forward_flops(bert_cfg, 6, 16)
      + bert_lib.forward_flops(realm_cfg.reader.bert, 6, 24)
      + 2 * 6 * 2 * bert_cfg.vocab_size * bert_cfg.hidden_size))
  assert realm_lib.pretraining_flops(
      realm_cfg, **one, document_tower=False) == pytest.approx(
          full - 3 * bert_lib.forward_flops(bert_cfg, 6, 16))


def _bert_grads(cfg, params, ids, mask, rng):
  g, _ = functional.init(lambda r: Bert(cfg, rngs=r), 0)

  def loss(p):
    h, pooled = functional.bind(g, p)(ids, mask, dropout_rng=rng)
    return jnp.sum(jnp.sin(h)) + jnp.sum(pooled ** 2)

  fn = jax.jit(jax.value_and_grad(loss))
  return fn(params), fn.lower(params).as_text()


def test_remat_recomputes_each_layer_with_the_same_gradients():
  cfg = tiny.tiny_bert(hidden_dropout=0.2, attention_dropout=0.2,
                       num_layers=4)
  remat_cfg = BertConfig(**{**cfg.__dict__, "remat": True})
  _, params = functional.init(lambda r: Bert(cfg, rngs=r), 0)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1, cfg.vocab_size, size=(4, 32)))
  mask = jnp.ones_like(ids)
  key = jax.random.key(3)  # Dropout on: the recomputation must reuse it.
  (value, grads), plain = _bert_grads(cfg, params, ids, mask, key)
  (value_r, grads_r), remat = _bert_grads(remat_cfg, params, ids, mask, key)
  np.testing.assert_allclose(value_r, value, rtol=1e-6)
  # Recomputing a layer may fuse (and so round) its ops differently (with
  # --xla_cpu_multi_thread_eigen=false a few entries moved by 6e-5
  # relative): compare each gradient as a whole, relative to its size.
  # Measured: <= 1e-6 relative, and ~2e-9 absolute for the attention key
  # biases, whose exact gradient is 0; a recomputation with another dropout
  # mask is off by ~1.7 relative.
  for path, a in jax.tree_util.tree_leaves_with_path(grads_r):
    b = np.asarray(functools.reduce(lambda t, k: t[k.key], path, grads))
    error = np.linalg.norm(np.asarray(a) - b)
    assert error <= 1e-5 * np.linalg.norm(b) + 1e-6, (
        jax.tree_util.keystr(path), error, np.linalg.norm(b))
  # The program handed to XLA recomputes every layer's forward pass behind
  # an optimisation barrier (XLA:CPU removes the barriers again, so on CPU
  # remat saves no memory; GPU and TPU keep them).
  assert plain.count("optimization_barrier") == 0
  assert remat.count("optimization_barrier") >= cfg.num_layers
  assert remat.count("dot_general") > plain.count("dot_general")


def test_score_scale_multiplies_every_retrieval_logit():
  # f(x, z) = score_scale * Embed(x) . Embed(z) wherever the trainer, the
  # QA model and ICT score a block; the parameters and the embeddings (so
  # the index and MIPS's ranking) do not change.
  rng = np.random.default_rng(0)
  batch = {k: jnp.asarray(v) for k, v in tiny.random_pretraining_batch(
      rng, batch=3, candidates=4).items()}
  qa = {"question_ids": batch["query_ids"],
        "question_mask": batch["query_mask"],
        "retrieved_embeddings": jnp.asarray(
            rng.normal(size=(3, 4, 16)), jnp.float32),
        "retrieved_mask": jnp.asarray([[1, 1, 1, 0]] * 3, bool),
        "reader_ids": batch["reader_ids"][:, :2],
        "reader_mask": batch["reader_mask"][:, :2],
        "reader_segment_ids": batch["reader_segment_ids"][:, :2],
        "block_start": jnp.full((3, 2), 13), "block_end": jnp.full((3, 2), 20)}
  ict_batch = {"query_ids": batch["query_ids"],
               "query_mask": batch["query_mask"],
               "query_segment_ids": jnp.zeros_like(batch["query_ids"]),
               "block_ids": batch["candidate_ids"][:, 1],
               "block_mask": batch["candidate_mask"][:, 1],
               "block_segment_ids": batch["candidate_segment_ids"][:, 1],
               "sentence_removed": jnp.zeros(3, jnp.int32)}
  outputs = {}
  for scale in (1.0, 20.0):
    cfg = tiny.tiny_realm(pooling="mean", normalize=True,
                          null_score="learned", score_scale=scale)
    g, params = functional.init(lambda r, c=cfg: Realm(c, rngs=r), 0)
    params["retriever"]["null_score_bias"] = jnp.float32(0.3)
    model = functional.bind(g, params)
    qa_retrieval, qa_reader = model.qa_logits(qa)
    mesh = parallel.make_mesh(jax.devices()[:1])
    ict_loss = jax.jit(parallel.data_parallel_value_and_grad(
        ict.make_loss_fn(ict.retriever_graphdef(cfg)), mesh))(
            params["retriever"], parallel.shard_batch(mesh, ict_batch))[0]
    q = model.retriever.embed_queries(ict_batch["query_ids"],
                                      ict_batch["query_mask"])
    d = model.retriever.embed_documents(ict_batch["block_ids"],
                                        ict_batch["block_mask"],
                                        ict_batch["block_segment_ids"])
    f = scale * np.asarray(q, np.float64) @ np.asarray(d, np.float64).T
    f -= f.max(1, keepdims=True)
    want = -np.mean(np.diagonal(f) - np.log(np.exp(f).sum(1)))
    np.testing.assert_allclose(ict_loss, want, rtol=1e-4)
    outputs[scale] = (model.pretraining_logits(batch)[0], qa_retrieval,
                      qa_reader, ict_loss, model.reader.span_logits(
                          qa["reader_ids"], qa["reader_mask"],
                          qa["reader_segment_ids"], qa["block_start"],
                          qa["block_end"]))
  (pre1, qa1, _, ict1, _), (pre20, qa20, reader20, ict20, spans) = (
      outputs[1.0], outputs[20.0])
  # Real candidates' scores scale; the learned null score follows their
  # (scaled) mean plus its offset.
  np.testing.assert_allclose(pre20[:, 1:], 20 * pre1[:, 1:], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(pre20[:, 0], pre20[:, 1:].mean(1) + 0.3,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(qa20[:, :3], 20 * qa1[:, :3], rtol=1e-5,
                             atol=1e-5)
  assert np.all(np.isneginf(qa20[:, 3]))
  # The reader's joint score adds the scaled retrieval logit.
  finite = np.isfinite(spans)
  np.testing.assert_allclose(
      np.asarray(reader20)[finite],
      np.asarray(spans + qa20[:, :2, None, None])[finite], rtol=1e-5,
      atol=1e-4)
  # Cosines within [-1, 1]: a flat softmax at scale 1, a sharper one at 20.
  assert np.abs(pre1[:, 1:]).max() <= 1 + 1e-5
  p1, p20 = jax.nn.softmax(pre1, -1), jax.nn.softmax(pre20, -1)
  assert float(p20.max() - p20.min()) > float(p1.max() - p1.min())
  assert abs(float(ict20) - float(ict1)) > 1e-2

"""BERT encoder in Flax NNX, used functionally.

Parameters are plain nested dicts of arrays (see `realm_jax.model.functional`),
so a subtree such as the retriever's can be handed to another job. Names
follow the BERT paper and the released checkpoints closely enough that the
importers in `realm_jax.checkpoint_import` map them one to one:

  embeddings/{word_embeddings,position_embeddings,token_type_embeddings}
  embeddings/layer_norm
  layer_{i}/attention/{query,key,value,output,layer_norm}
  layer_{i}/{intermediate,output,layer_norm}
  pooler
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from realm_jax.core import checks

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ATTENTION_BATCHINGS = ("whole_batch", "per_sequence")
ATTENTIONS = ("xla", "flash")
# The Pallas TPU flash-attention kernel tiles keys in multiples of the TPU's
# 128 lanes; shorter or ragged lengths are padded up to one.
_FLASH_LANES = 128
DROPOUT_MASK_BITS = (32, 16)
SOFTMAX_DTYPES = ("float32", "compute")
RESIDUAL_DTYPES = ("float32", "compute")


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class BertConfig:
  """Sizes and numerics of a BERT encoder.

  Attributes:
    vocab_size: wordpiece vocabulary size.
    hidden_size: width of every layer.
    num_layers: number of transformer layers.
    num_heads: attention heads; must divide hidden_size.
    intermediate_size: width of the feed-forward layer.
    max_position_embeddings: longest sequence the position table covers.
    type_vocab_size: number of segment ids.
    hidden_dropout: dropout on embeddings and every residual branch.
    attention_dropout: dropout on attention probabilities.
    layer_norm_eps: LayerNorm epsilon (1e-12 in BERT and REALM).
    gelu_approximate: tanh approximation of GELU (Google BERT, REALM) or the
      exact erf form (Hugging Face "gelu", e.g. MiniLM).
    initializer_range: stddev of the truncated-normal initialiser.
    dtype: compute dtype, "float32" or "bfloat16". Parameters, LayerNorm and
      softmax stay in float32.
    remat: recompute each layer's activations in the backward pass instead
      of keeping them (`nnx.remat`, i.e. `jax.checkpoint`, per layer): the
      same values and gradients, ~1/3 more compute, the activation memory
      of one layer instead of all on GPU and TPU (BERT-base fine-tuning at
      R = 5 x 320, REALM pre-training at large batches). XLA:CPU drops the
      recomputation again, so on CPU it changes nothing.
    attention_batching: "whole_batch" (default): attention over the whole
      batch in one pass, which accelerators fuse. "per_sequence", a CPU
      tuning (gin_configs/models/cpu.gin): one sequence at a time
      (`lax.map`) whenever the batch's float32 scores exceed 16 MiB, so a
      sequence's scores stay in cache through softmax, dropout and the
      context matmul: MiniLM forward 1.17x and its reader training step
      1.14x faster on 2 CPU cores (docs/benchmarks/attention.md). Same
      values without dropout; with dropout each sequence draws its own
      mask, so the random stream differs.
    dropout_mask_bits: random bits per dropout-mask element. 32 (default):
      `jax.random.bernoulli`. 16, a CPU tuning (models/cpu.gin): two
      elements per 32-bit random word, the keep probability quantised to
      1/65536; attention-dropout masks are the largest random draws in
      training, and on 2 CPU cores this made the MiniLM reader's training
      step 1.41x faster (docs/benchmarks/dropout.md). Another random stream
      than 32 bits.
    attention: "xla" (default): `_attend`, the scores and probabilities
      materialised in float32 ([..., heads, L, L]), which XLA fuses
      around. "flash", for TPU only: jax's Pallas TPU flash-attention
      kernel (`jax.experimental.pallas.ops.tpu.flash_attention`, forward
      and backward), which keeps each sequence's scores in the chip's
      on-chip memory instead of writing them to HBM: the largest share of
      the HBM traffic of BERT steps at REALM's lengths
      (docs/benchmarks/tpu_aot.md). The padding mask becomes the kernel's
      segment ids; lengths are padded to a multiple of 128. It has no
      attention dropout: training with it needs attention_dropout = 0.
      It does not run on CPU (tests run it in Pallas's TPU interpret
      mode).
    softmax_dtype: the dtype of the "xla" attention's scores and
      probabilities. "float32" (default): softmax in float32 whatever the
      compute dtype. "compute": in `dtype`, as Flax's attention does by
      default: with bfloat16 the [..., heads, L, L] tensors that a BERT
      step writes to and reads from HBM (scores, probabilities, their
      dropout and their gradients) take half the bytes. With dtype
      float32 the two are the same program.
    residual_dtype: the dtype of the residual stream between layers (each
      LayerNorm's output, what the next layer reads and the backward pass
      keeps). "float32" (default). "compute": the residual add and the
      LayerNorm run in float32 as before, and the LayerNorm's output is
      cast to `dtype`, so that with bfloat16 the [..., L, hidden] tensors
      that cross layers take half the bytes. The encoder's outputs are
      float32 either way. With dtype float32 the two are the same program.
  """

  vocab_size: int = 30522
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  intermediate_size: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  hidden_dropout: float = 0.1
  attention_dropout: float = 0.1
  layer_norm_eps: float = 1e-12
  gelu_approximate: bool = True
  initializer_range: float = 0.02
  dtype: str = "float32"
  remat: bool = False
  attention_batching: str = "whole_batch"
  dropout_mask_bits: int = 32
  attention: str = "xla"
  softmax_dtype: str = "float32"
  residual_dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                 "intermediate_size", "max_position_embeddings",
                 "type_vocab_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"BertConfig.{name} must be positive, got "
                         f"{getattr(self, name)}.")
    if self.hidden_size % self.num_heads:
      raise ValueError(
          f"BertConfig.hidden_size={self.hidden_size} is not divisible by "
          f"num_heads={self.num_heads}; pick a head count that divides it.")
    for name in ("hidden_dropout", "attention_dropout"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"BertConfig.{name} must be in [0, 1), got "
                         f"{getattr(self, name)}.")
    if self.dtype not in _DTYPES:
      raise ValueError(f"BertConfig.dtype must be one of {sorted(_DTYPES)}, "
                       f"got {self.dtype!r}.")
    if self.attention_batching not in ATTENTION_BATCHINGS:
      raise ValueError("BertConfig.attention_batching must be one of "
                       f"{ATTENTION_BATCHINGS}, got "
                       f"{self.attention_batching!r}.")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"BertConfig.attention must be one of {ATTENTIONS}, "
                       f"got {self.attention!r}.")
    if self.softmax_dtype not in SOFTMAX_DTYPES:
      raise ValueError("BertConfig.softmax_dtype must be one of "
                       f"{SOFTMAX_DTYPES}, got {self.softmax_dtype!r}.")
    if self.residual_dtype not in RESIDUAL_DTYPES:
      raise ValueError("BertConfig.residual_dtype must be one of "
                       f"{RESIDUAL_DTYPES}, got {self.residual_dtype!r}.")
    if self.attention == "flash" and self.softmax_dtype != "float32":
      raise ValueError("BertConfig.softmax_dtype applies to attention="
                       "'xla'; the flash kernel keeps its softmax in "
                       "float32. Set softmax_dtype='float32'.")
    if self.dropout_mask_bits not in DROPOUT_MASK_BITS:
      raise ValueError("BertConfig.dropout_mask_bits must be one of "
                       f"{DROPOUT_MASK_BITS}, got {self.dropout_mask_bits!r}.")

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def stream_dtype(self):
    """The residual stream's dtype (`residual_dtype`)."""
    return (jnp.float32 if self.residual_dtype == "float32"
            else self.compute_dtype)

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @classmethod
  def from_hf_config(cls, hf: dict[str, Any], **overrides) -> "BertConfig":
    """Builds a config from a Hugging Face BERT `config.json` dict."""
    act = hf.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
      raise ValueError(f"Unsupported hidden_act {act!r} in the Hugging Face "
                       "config; realm_jax's BERT supports GELU only.")
    if hf.get("position_embedding_type", "absolute") != "absolute":
      raise ValueError("Only absolute position embeddings are supported, the "
                       f"config asks for {hf['position_embedding_type']!r}.")
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        gelu_approximate=act != "gelu",
        initializer_range=hf.get("initializer_range", 0.02),
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def forward_flops(config: BertConfig, sequences: int, length: int) -> float:
  """The model's own FLOPs of one forward pass over `sequences` x `length`
  tokens: every layer's dense matmuls (query, key, value, output and the
  feed-forward pair) and its attention scores and context; 2 per
  multiply-add. Embedding lookups, LayerNorm, softmax and the pooler are
  left out (each under 1% at BERT-base's sizes). A training step is about
  3x this (the backward pass ~2x the forward); rematerialisation's repeat
  is not the model's and is not counted."""
  h, i, tokens = config.hidden_size, config.intermediate_size, (
      sequences * length)
  per_layer = 2 * tokens * (4 * h * h + 2 * h * i) + 4 * tokens * length * h
  return float(config.num_layers * per_layer)


def keep_mask_16bit(rng: jax.Array, keep_prob: float,
                   shape: tuple[int, ...]) -> tuple[jax.Array, float]:
  """A Bernoulli(keep_prob) mask from 16 random bits per element.

  `jax.random.bernoulli` spends a 32-bit random word per element; here each
  word gives two elements (its 16-bit halves, compared with
  round(keep_prob * 2^16)), which halves the random bits drawn for the
  largest draws in training, the attention-dropout masks (layers x heads x
  L^2 per block). The probability is quantised to 1/65536; it is returned
  so that the caller scales by exactly its inverse.

  Returns:
    (bool mask of `shape`, the mask's exact keep probability).
  """
  threshold = min(max(round(keep_prob * 65536), 1), 65536)
  size = math.prod(shape)
  words = jax.random.bits(rng, ((size + 1) // 2,), jnp.uint32)
  halves = (words[:, None] >> jnp.array([0, 16], jnp.uint32)) & 0xFFFF
  keep = halves.reshape(-1)[:size].reshape(shape) < threshold
  return keep, threshold / 65536


def dropout(x: jax.Array, rate: float, rng: jax.Array | None,
            mask_bits: int = 32) -> jax.Array:
  """Inverted dropout; the identity when `rng` is None (evaluation).

  `mask_bits` is `BertConfig.dropout_mask_bits`: 32 draws the mask with
  `jax.random.bernoulli`, 16 with `keep_mask_16bit`.
  """
  if rng is None or rate == 0.0:
    return x
  if mask_bits == 16:
    keep, keep_prob = keep_mask_16bit(rng, 1.0 - rate, x.shape)
  else:
    keep_prob = 1.0 - rate
    keep = jax.random.bernoulli(rng, keep_prob, x.shape)
  return jnp.where(keep, x * (1.0 / keep_prob), jnp.zeros_like(x))


def _fold(rng: jax.Array | None, i: int) -> jax.Array | None:
  return None if rng is None else jax.random.fold_in(rng, i)


def dense(config: BertConfig, in_features: int, out_features: int, *,
          rngs: nnx.Rngs) -> nnx.Linear:
  """A BERT-initialised dense layer computing in the config's dtype."""
  return nnx.Linear(
      in_features, out_features,
      kernel_init=nnx.initializers.truncated_normal(config.initializer_range),
      dtype=config.compute_dtype, param_dtype=jnp.float32, rngs=rngs)


def layer_norm(features: int, eps: float, *, rngs: nnx.Rngs) -> nnx.LayerNorm:
  # Always float32: bfloat16 LayerNorm statistics lose too much precision.
  return nnx.LayerNorm(features, epsilon=eps, dtype=jnp.float32,
                       param_dtype=jnp.float32, rngs=rngs)


class BertEmbeddings(nnx.Module):
  """Word + position + segment embeddings, LayerNorm, dropout."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    init = nnx.initializers.truncated_normal(config.initializer_range)

    def embed(n):
      return nnx.Embed(n, config.hidden_size, embedding_init=init,
                       param_dtype=jnp.float32, rngs=rngs)

    self.word_embeddings = embed(config.vocab_size)
    self.position_embeddings = embed(config.max_position_embeddings)
    self.token_type_embeddings = embed(config.type_vocab_size)
    self.layer_norm = layer_norm(config.hidden_size, config.layer_norm_eps,
                                 rngs=rngs)

  def __call__(self, token_ids, segment_ids, dropout_rng):
    seq_len = token_ids.shape[-1]
    if seq_len > self.config.max_position_embeddings:
      raise ValueError(
          f"Sequence length {seq_len} exceeds max_position_embeddings="
          f"{self.config.max_position_embeddings}.")
    h = (self.word_embeddings(token_ids)
         + self.position_embeddings.embedding[...][:seq_len]
         + self.token_type_embeddings(segment_ids))
    h = self.layer_norm(h).astype(self.config.stream_dtype)
    return dropout(h, self.config.hidden_dropout, dropout_rng,
                   self.config.dropout_mask_bits)


class BertAttention(nnx.Module):
  """Multi-head self-attention with the output projection and residual."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    h = config.hidden_size
    self.query = dense(config, h, h, rngs=rngs)
    self.key = dense(config, h, h, rngs=rngs)
    self.value = dense(config, h, h, rngs=rngs)
    self.output = dense(config, h, h, rngs=rngs)
    self.layer_norm = layer_norm(h, config.layer_norm_eps, rngs=rngs)

  def __call__(self, x, attention_bias, dropout_rng):
    c = self.config
    x_in = x.astype(c.compute_dtype)
    split = lambda t: t.reshape(*t.shape[:-1], c.num_heads, c.head_dim)
    q, k, v = (split(f(x_in)) for f in (self.query, self.key, self.value))
    rng = _fold(dropout_rng, 0)
    with jax.named_scope("attention_scores"):
      if c.attention == "flash":
        context = _attend_flash(q, k, v, attention_bias, rng, c)
      elif _attends_per_sequence(c, q.shape):
        context = _attend_per_sequence(q, k, v, attention_bias, rng, c)
      else:
        context = _attend(q, k, v, attention_bias, rng, c)
    context = context.reshape(*context.shape[:-2], c.hidden_size)
    out = dropout(self.output(context), c.hidden_dropout,
                  _fold(dropout_rng, 1), c.dropout_mask_bits)
    return self.layer_norm(out.astype(jnp.float32) + x).astype(
        c.stream_dtype)


def _attend(q, k, v, attention_bias, dropout_rng, c: BertConfig):
  """Scaled dot-product attention, q/k/v [..., L, heads, d] -> same."""
  # [..., heads, query, key]; softmax in float32 unless
  # softmax_dtype="compute".
  dtype = jnp.float32 if c.softmax_dtype == "float32" else c.compute_dtype
  scores = jnp.einsum("...qhd,...khd->...hqk", q, k,
                      preferred_element_type=dtype)
  scores = (scores / jnp.sqrt(jnp.asarray(c.head_dim, dtype))
            + attention_bias.astype(dtype))
  probs = jax.nn.softmax(scores, axis=-1)
  probs = dropout(probs, c.attention_dropout, dropout_rng,
                  c.dropout_mask_bits)
  return jnp.einsum("...hqk,...khd->...qhd", probs.astype(c.compute_dtype),
                    v)


def _attend_flash(q, k, v, attention_bias, dropout_rng, c: BertConfig):
  """`_attend` by jax's Pallas TPU flash-attention kernel (`attention="flash"`).

  The kernel takes [sequences, heads, L, d] and, for masking, segment ids:
  a query attends to the keys of its own segment. A real token's segment
  is 1 and padding's 0, so a real token attends to exactly the real keys,
  as the additive -1e9 bias of `_attend` makes it (padding positions, whose
  outputs nothing reads, attend to padding instead). Lengths are padded to
  a multiple of 128 (segment 0) and cut back after.
  """
  if dropout_rng is not None and c.attention_dropout > 0.0:
    raise ValueError(
        "BertConfig.attention='flash' has no attention dropout, but this "
        f"step trains with attention_dropout={c.attention_dropout}: set "
        "bert.BertConfig.attention_dropout = 0.0, or attention = 'xla'.")
  if attention_bias.shape[-3:-1] != (1, 1):
    raise ValueError("BertConfig.attention='flash' takes a padding mask "
                     f"over keys ([..., 1, 1, L]), got attention bias "
                     f"{attention_bias.shape}.")
  lead, (length, heads, head_dim) = q.shape[:-3], q.shape[-3:]
  n = math.prod(lead)
  pad = -length % _FLASH_LANES

  def heads_first(t):  # [..., L, h, d] -> [n, h, L + pad, d]
    t = t.reshape(n, length, heads, head_dim).transpose(0, 2, 1, 3)
    return jnp.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0)))

  real = jnp.broadcast_to(attention_bias[..., 0, 0, :] == 0, lead + (length,))
  segments = jnp.pad(real.reshape(n, length).astype(jnp.int32),
                     ((0, 0), (0, pad)))
  context = _flash_kernel(heads_first(q), heads_first(k), heads_first(v),
                          segments)
  context = context[:, :, :length].transpose(0, 2, 1, 3)
  return context.reshape(q.shape).astype(c.compute_dtype)


def _flash_call(q, k, v, segments):
  """The Pallas kernel on [n, heads, L, d], L a multiple of 128."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
  length = q.shape[2]
  # One block per sequence (BERT's L <= 512): its scores fit on chip.
  b = length if length <= 512 else _FLASH_LANES
  blocks = pallas_flash.BlockSizes(
      block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b,
      block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b,
      block_k_dq=b, block_q_dq=b)
  return pallas_flash.flash_attention(
      q, k, v, segment_ids=pallas_flash.SegmentIds(segments, segments),
      sm_scale=1.0 / math.sqrt(q.shape[-1]), block_sizes=blocks)


# The jobs' steps run BERT inside `shard_map` (core/parallel.py), which
# types every value as varying or not over the mesh axes (`check_vma`).
# The Pallas kernel declares its outputs without that type, which
# `pallas_call` refuses under the check. `_flash_kernel` therefore runs the
# kernel, forward and backward, with the check off, on per-device values
# (which is what they are), and types its outputs as varying over the same
# axes as its inputs. The type is the only thing changed: no collective is
# added or removed.


def _varying_axes(x) -> tuple[str, ...]:
  mat = getattr(jax.typeof(x), "mat", None)
  return tuple(sorted(getattr(mat, "varying", ())))


def _as_varying(x, axes: tuple[str, ...]):
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def _unchecked():
  # pylint: disable-next=g-import-not-at-top
  from jax._src import config as jax_config
  return jax_config._check_vma(False)  # pylint: disable=protected-access


def _untyped(*xs):
  """The same values, outside the varying-type check (`x * 1` retyped)."""
  return tuple(x * 1 for x in xs)


@jax.custom_vjp
def _flash_kernel(q, k, v, segments):
  axes = _varying_axes(q)
  with _unchecked():
    out = _flash_call(*_untyped(q, k, v, segments))
  return _as_varying(out, axes)


def _flash_kernel_fwd(q, k, v, segments):
  axes = _varying_axes(q)
  with _unchecked():
    q, k, v, segments = _untyped(q, k, v, segments)
    out, pullback = jax.vjp(lambda *qkv: _flash_call(*qkv, segments), q, k, v)
  return _as_varying(out, axes), pullback


def _flash_kernel_bwd(pullback, g):
  axes = _varying_axes(g)
  with _unchecked():
    grads = pullback(*_untyped(g))
  return tuple(_as_varying(x, axes) for x in grads) + (None,)


_flash_kernel.defvjp(_flash_kernel_fwd, _flash_kernel_bwd)


# Whole-batch attention scores above this size miss a CPU's caches.
_PER_SEQUENCE_MIN_SCORES_BYTES = 16 << 20


def _attends_per_sequence(c: BertConfig, q_shape: tuple[int, ...]) -> bool:
  """Whether `attention_batching="per_sequence"` applies to this batch.

  Only when the batch's float32 scores would not fit in cache: small
  batches (tests, tiny runs) gain nothing from the loop and compile faster
  as one pass.
  """
  num_sequences, length = math.prod(q_shape[:-3]), q_shape[-3]
  scores_bytes = 4 * num_sequences * c.num_heads * length * length
  return (c.attention_batching == "per_sequence"
          and scores_bytes > _PER_SEQUENCE_MIN_SCORES_BYTES)


def _attend_per_sequence(q, k, v, attention_bias, dropout_rng,
                         c: BertConfig):
  """`_attend` one sequence at a time (`lax.map`), a CPU tuning.

  A sequence's [heads, L, L] scores (5 MB for 12 heads of 320 tokens) stay
  in cache through softmax, dropout and the context matmul, where the
  whole batch's would not (see `BertConfig.attention_batching`). Each
  sequence's dropout key is `dropout_rng` folded with its index in the
  batch.
  """
  lead = q.shape[:-3]
  n = math.prod(lead)
  flat = lambda t: t.reshape((n,) + t.shape[-3:])
  bias = jnp.broadcast_to(attention_bias, lead + attention_bias.shape[-3:])

  def one(args):
    qi, ki, vi, bi, i = args
    rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
    return _attend(qi, ki, vi, bi, rng, c)

  context = jax.lax.map(one, (flat(q), flat(k), flat(v), flat(bias),
                              jnp.arange(n)))
  return context.reshape(q.shape)


class BertLayer(nnx.Module):
  """One transformer layer: attention then the GELU feed-forward block."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.attention = BertAttention(config, rngs=rngs)
    self.intermediate = dense(config, config.hidden_size,
                              config.intermediate_size, rngs=rngs)
    self.output = dense(config, config.intermediate_size, config.hidden_size,
                        rngs=rngs)
    self.layer_norm = layer_norm(config.hidden_size, config.layer_norm_eps,
                                 rngs=rngs)

  def __call__(self, x, attention_bias, dropout_rng):
    c = self.config
    with jax.named_scope("attention"):
      x = self.attention(x, attention_bias, _fold(dropout_rng, 0))
    with jax.named_scope("ffn"):
      h = jax.nn.gelu(self.intermediate(x.astype(c.compute_dtype)),
                      approximate=c.gelu_approximate)
      h = dropout(self.output(h), c.hidden_dropout, _fold(dropout_rng, 1),
                  c.dropout_mask_bits)
      return self.layer_norm(h.astype(jnp.float32) + x).astype(
          c.stream_dtype)


@nnx.remat
def _remat_layer(layer: BertLayer, x, attention_bias, dropout_rng):
  return layer(x, attention_bias, dropout_rng)


class Bert(nnx.Module):
  """BERT: embeddings, `num_layers` transformer layers and the tanh pooler."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embeddings = BertEmbeddings(config, rngs=rngs)
    for i in range(config.num_layers):
      setattr(self, f"layer_{i}", BertLayer(config, rngs=rngs))
    self.pooler = dense(config, config.hidden_size, config.hidden_size,
                        rngs=rngs)

  def __call__(
      self,
      token_ids: jax.Array,
      input_mask: jax.Array,
      segment_ids: jax.Array | None = None,
      *,
      dropout_rng: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Encodes a batch.

    Args:
      token_ids: int [..., seq] wordpiece ids.
      input_mask: [..., seq], 1 for real tokens and 0 for padding.
      segment_ids: int [..., seq] segment ids (zeros if None).
      dropout_rng: PRNG key enabling dropout; None for deterministic runs.

    Returns:
      sequence_output: float32 [..., seq, hidden].
      pooled_output: float32 [..., hidden], tanh(Dense(h_[CLS])).
    """
    if segment_ids is None:
      segment_ids = jnp.zeros_like(token_ids)
    # Additive mask over keys, broadcast over heads and queries.
    attention_bias = jnp.where(input_mask[..., None, None, :] > 0, 0.0,
                               -1e9).astype(jnp.float32)
    with jax.named_scope("embeddings"):
      h = self.embeddings(token_ids, segment_ids,
                          _fold(dropout_rng, self.config.num_layers))
    for i in range(self.config.num_layers):
      layer = getattr(self, f"layer_{i}")
      if self.config.remat:
        h = _remat_layer(layer, h, attention_bias, _fold(dropout_rng, i))
      else:
        h = layer(h, attention_bias, _fold(dropout_rng, i))
    pooled = jnp.tanh(self.pooler(h[..., 0, :].astype(
        self.config.compute_dtype)).astype(jnp.float32))
    return h.astype(jnp.float32), pooled

"""REALM's retriever p(z|x) and knowledge-augmented encoder (reader) p(y|z,x).

Retriever: Embed(x) = LayerNorm(Dense_128(pool(BERT(x)))) and
f(x, z) = Embed(x) . Embed(z). The pooling is configurable: REALM's tanh
pooler over [CLS] for the released checkpoints, mean pooling for
sentence-embedding initialisations such as MiniLM (docs/design.md).

Reader: BERT over `[CLS] x [SEP] z_body [SEP]` with
- an MLM head (dense + GELU + LayerNorm, output embeddings tied to the word
  embeddings, plus a bias) evaluated only at the masked positions, and
- a span head: h -> Dense(2 * 256) split into start/end halves;
  score(s, e) = w . LayerNorm_1e-3(ReLU(start[s] + end[e])) + b over spans of
  width 1..max_span_width inside the document tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from realm_jax.core import checks
from realm_jax.model import bert as bert_lib
from realm_jax.model.bert import Bert, BertConfig, dense, layer_norm

POOLINGS = ("pooler", "cls", "mean")
NULL_SCORES = ("embedding", "learned", "learned_mean")
SPAN_HEAD_BATCHINGS = ("whole_batch", "per_row")


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class RetrieverConfig:
  """The dual encoder.

  Attributes:
    bert: the encoder's sizes.
    projection_size: output size of the Dense + LayerNorm projection (128 in
      REALM); None for no projection (the pooled vector is the embedding).
    pooling: "pooler" (REALM: tanh(Dense(h_[CLS]))), "cls" (h_[CLS]) or
      "mean" (mean of the real tokens' hidden states).
    normalize: L2-normalise embeddings (sentence-embedding models).
    share_towers: one BERT for queries and documents (REALM's default);
      False gives separate query and document towers.
    null_score: how the null document (candidate 0 in pre-training) is
      scored. "embedding" (REALM, and what its released checkpoints were
      trained with): f(x, null) = Embed(x) . Embed([CLS] [SEP] [SEP]).
      "learned": f(x, null) = stop_gradient(mean_z f(x, z)) + b over the
      retrieved candidates z, with one learned scalar b (starts at 0), so
      p(null|x) starts near 1 / num_candidates. The embedding of an
      almost empty input is no ordinary document embedding: with mean
      pooling it scored ~100 against ~10 for real blocks at a random
      initialisation, p(null|x) was 1.000 and the retriever's gradient
      underflowed to 0 (see docs/results/learning.md).
      "learned_mean": the same score, with the gradient through the mean.
      With "learned" the loss's gradient has a part along a direction in
      which the loss is flat: raising every retrieved score by c raises
      the null's by c too, so p(z|x) does not change, yet the retrieved
      scores' gradients sum to p(null|x, y) - p(null|x), which is < 0
      whenever the reader gains from the blocks. Adam follows that push
      for ever; it raises f(x, z) for every retrieved z by growing a
      direction shared by all queries and blocks, and the blocks fold
      onto it (docs/results/learning.md, session 26). Here the gradients
      of the k retrieved scores and the null's sum to 0, so no such push.
      The two score every input alike (same export).
    score_scale: f(x, z) = score_scale * Embed(x) . Embed(z) (1 in REALM).
      L2-normalised embeddings give cosine scores in [-1, 1], and a
      softmax over a few candidates of nearly equal cosine is flat:
      MiniLM's p(null|x) was 0.2499 = 1 / 5 to four digits over 4
      candidates, so the retriever's gradient was tiny. Sentence-embedding
      models are tuned with a scaled softmax (20 in sentence-transformers'
      contrastive loss); the same scale gives their posterior its shape
      back. A positive scale never changes which blocks MIPS returns, so
      the index is the same with or without it.
  """

  bert: BertConfig = BertConfig()
  projection_size: int | None = 128
  pooling: str = "pooler"
  normalize: bool = False
  share_towers: bool = True
  null_score: str = "embedding"
  score_scale: float = 1.0

  def __post_init__(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"RetrieverConfig.pooling must be one of {POOLINGS}, "
                       f"got {self.pooling!r}.")
    if self.null_score not in NULL_SCORES:
      raise ValueError(f"RetrieverConfig.null_score must be one of "
                       f"{NULL_SCORES}, got {self.null_score!r}.")
    if self.projection_size is not None and self.projection_size <= 0:
      raise ValueError("RetrieverConfig.projection_size must be positive or "
                       f"None, got {self.projection_size}.")
    if not 0 < self.score_scale < math.inf:
      raise ValueError("RetrieverConfig.score_scale must be positive and "
                       "finite (it multiplies f(x, z)), got "
                       f"{self.score_scale}.")

  @property
  def learned_null(self) -> bool:
    """The null document scored by a learned offset from the retrieved
    scores (no embedding of its own)."""
    return self.null_score in ("learned", "learned_mean")

  @property
  def embedding_size(self) -> int:
    return self.projection_size or self.bert.hidden_size


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class ReaderConfig:
  """The knowledge-augmented encoder.

  Attributes:
    bert: the encoder's sizes.
    mlm_head: build the masked-LM head (pre-training).
    span_head: build the span-extraction head (open-QA fine-tuning).
    span_hidden_size: width of each of the start/end halves (256).
    max_span_width: longest answer span in wordpieces (10).
    span_layer_norm_eps: epsilon of the span head's LayerNorm (1e-3).
    span_head_batching: how `span_feature_sums` walks the batch.
      "whole_batch" (default): one pass, whose elementwise work
      accelerators fuse into the reductions. "per_row", a CPU tuning
      (gin_configs/models/cpu.gin): one reader block at a time
      (`lax.map`), so a block's [L, H] and each width's x stay in cache;
      on 2 CPU cores forward + backward took 0.32 s instead of 0.52 s
      (tiny reader, batch 16; docs/benchmarks/span_head.md). Same values.
  """

  bert: BertConfig = BertConfig()
  mlm_head: bool = True
  span_head: bool = True
  span_hidden_size: int = 256
  max_span_width: int = 10
  span_layer_norm_eps: float = 1e-3
  span_head_batching: str = "whole_batch"

  def __post_init__(self):
    if self.span_head_batching not in SPAN_HEAD_BATCHINGS:
      raise ValueError("ReaderConfig.span_head_batching must be one of "
                       f"{SPAN_HEAD_BATCHINGS}, got "
                       f"{self.span_head_batching!r}.")
    if self.max_span_width <= 0 or self.span_hidden_size <= 0:
      raise ValueError("ReaderConfig.max_span_width and span_hidden_size "
                       "must be positive.")
    if not (self.mlm_head or self.span_head):
      raise ValueError("ReaderConfig needs at least one of mlm_head or "
                       "span_head.")


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class RealmConfig:
  retriever: RetrieverConfig = RetrieverConfig()
  reader: ReaderConfig = ReaderConfig()


def pretraining_flops(config: RealmConfig, *, batch: int, candidates: int,
                      query_length: int, block_length: int,
                      reader_length: int, num_masks: int,
                      document_tower: bool = True) -> float:
  """The model's own FLOPs of one REALM pre-training step (forward and
  backward, 3x the forward): the query tower over `batch` queries, the
  document tower re-embedding `candidates` blocks per query (unless the
  retriever trains query-side only: `document_tower=False`), the reader
  over `candidates` query + block sequences, and the masked-LM head's
  vocabulary projection at `num_masks` positions of each."""
  retriever, reader = config.retriever.bert, config.reader.bert
  sequences = batch * candidates
  forward = (bert_lib.forward_flops(retriever, batch, query_length)
             + bert_lib.forward_flops(reader, sequences, reader_length)
             + 2 * sequences * num_masks * reader.vocab_size
             * reader.hidden_size)
  if document_tower:
    forward += bert_lib.forward_flops(retriever, sequences, block_length)
  return 3 * forward


# ----------------------------------------------------------------------------
# Retriever
# ----------------------------------------------------------------------------


class Embedder(nnx.Module):
  """One retrieval tower: BERT -> pooling -> Dense -> LayerNorm."""

  def __init__(self, config: RetrieverConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.bert = Bert(config.bert, rngs=rngs)
    if config.projection_size:
      self.projection = dense(config.bert, config.bert.hidden_size,
                              config.projection_size, rngs=rngs)
      self.layer_norm = layer_norm(config.projection_size,
                                   config.bert.layer_norm_eps, rngs=rngs)

  def __call__(self, token_ids, input_mask, segment_ids=None, *,
               dropout_rng=None) -> jax.Array:
    """Returns float32 embeddings [..., embedding_size]."""
    c = self.config
    sequence, pooled = self.bert(token_ids, input_mask, segment_ids,
                                 dropout_rng=dropout_rng)
    if c.pooling == "pooler":
      x = pooled
    elif c.pooling == "cls":
      x = sequence[..., 0, :]
    else:
      mask = input_mask[..., None].astype(jnp.float32)
      x = (sequence * mask).sum(-2) / jnp.maximum(mask.sum(-2), 1e-9)
    if c.projection_size:
      x = self.layer_norm(
          self.projection(x.astype(c.bert.compute_dtype)).astype(jnp.float32))
    if c.normalize:
      x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return x


def document_tower_params(retriever_params: dict) -> dict:
  """The retriever's parameters without the learned null score.

  What embedding queries or documents needs, whichever `null_score` the
  checkpoint was trained with (the index builder and the QA jobs read
  checkpoints of runs with either).
  """
  return {k: v for k, v in retriever_params.items()
          if k != "null_score_bias"}


def retrieval_logits(query_embeddings: jax.Array,
                     document_embeddings: jax.Array,
                     score_scale: float = 1.0) -> jax.Array:
  """f(x, z) = score_scale * <query, document>: the one retrieval score of
  every job (pre-training, ICT, QA).

  `document_embeddings` are each query's own candidates [batch,
  candidates, dim], or one set shared by every query [candidates, dim]
  (ICT's in-batch blocks); returns [batch, candidates].
  `RetrieverConfig.score_scale` gives the scale.
  """
  spec = "bd,cd->bc" if document_embeddings.ndim == 2 else "bd,bcd->bc"
  logits = jnp.einsum(spec, query_embeddings, document_embeddings)
  return logits if score_scale == 1 else score_scale * logits


class Retriever(nnx.Module):
  """Dual encoder; the document tower is the query tower unless unshared."""

  def __init__(self, config: RetrieverConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.query_embedder = Embedder(config, rngs=rngs)
    if not config.share_towers:
      self.document_embedder = Embedder(config, rngs=rngs)
    if config.learned_null:
      self.null_score_bias = nnx.Param(jnp.zeros((), jnp.float32))

  def embed_queries(self, token_ids, input_mask, segment_ids=None, *,
                    dropout_rng=None):
    with jax.named_scope("query_tower"):
      return self.query_embedder(token_ids, input_mask, segment_ids,
                                 dropout_rng=dropout_rng)

  def embed_documents(self, token_ids, input_mask, segment_ids=None, *,
                      dropout_rng=None):
    tower = (self.query_embedder if self.config.share_towers
             else self.document_embedder)
    with jax.named_scope("document_tower"):
      return tower(token_ids, input_mask, segment_ids,
                   dropout_rng=dropout_rng)

  def __call__(self, query_ids, query_mask, candidate_ids, candidate_mask,
               candidate_segment_ids, *, null_document: bool = False,
               document_embeddings: jax.Array | None = None,
               dropout_rng=None) -> jax.Array:
    """Scores candidates [batch, candidates, doc_len] for queries [batch,
    q_len]: float32 [batch, candidates].

    With `null_document`, candidate 0 is the null document, scored as
    `config.null_score` says (a learned null score reads no tokens of it).
    `document_embeddings` [batch, candidates, dim] (query-side training,
    a frozen document tower): the candidates' embeddings from the index,
    used instead of re-embedding their tokens (no gradient reaches them);
    the learned null score's slot 0 is ignored.
    """
    q_rng, d_rng = (None, None) if dropout_rng is None else tuple(
        jax.random.split(dropout_rng))
    query = self.embed_queries(query_ids, query_mask, dropout_rng=q_rng)
    learned_null = null_document and self.config.learned_null
    first = 1 if learned_null else 0
    if document_embeddings is not None:
      docs = jax.lax.stop_gradient(document_embeddings[:, first:])
    else:
      docs = self.embed_documents(candidate_ids[:, first:],
                                  candidate_mask[:, first:],
                                  candidate_segment_ids[:, first:],
                                  dropout_rng=d_rng)
    logits = retrieval_logits(query, docs, self.config.score_scale)
    if not learned_null:
      return logits
    # The null document's score follows the retrieved ones; only the
    # offset is learned. "learned": no gradient through their mean, so each
    # real candidate's gradient stays REALM's r(z) (RetrieverConfig).
    mean = jnp.mean(logits, axis=-1)
    if self.config.null_score == "learned":
      mean = jax.lax.stop_gradient(mean)
    null = mean + self.null_score_bias[...]
    return jnp.concatenate([null[:, None], logits], axis=-1)


# ----------------------------------------------------------------------------
# Reader
# ----------------------------------------------------------------------------


class MLMHead(nnx.Module):
  """BERT's masked-LM head with output embeddings tied to the input ones."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.transform = dense(config, config.hidden_size, config.hidden_size,
                           rngs=rngs)
    self.layer_norm = layer_norm(config.hidden_size, config.layer_norm_eps,
                                 rngs=rngs)
    self.output_bias = nnx.Param(jnp.zeros((config.vocab_size,), jnp.float32))

  def __call__(self, hidden, word_embeddings) -> jax.Array:
    c = self.config
    h = jax.nn.gelu(self.transform(hidden.astype(c.compute_dtype)),
                    approximate=c.gelu_approximate)
    h = self.layer_norm(h.astype(jnp.float32))
    logits = jnp.einsum("...h,vh->...v", h.astype(c.compute_dtype),
                        word_embeddings.astype(c.compute_dtype),
                        preferred_element_type=jnp.float32)
    return logits + self.output_bias[...]


def span_mask(seq_len: int, block_start: jax.Array, block_end: jax.Array,
              max_span_width: int) -> jax.Array:
  """Which (start, width) spans lie inside the document tokens.

  Args:
    seq_len: reader sequence length L.
    block_start: int [...], first document token position.
    block_end: int [...], last document token position (inclusive; the final
      [SEP] is excluded by the caller).
    max_span_width: W.

  Returns:
    bool [..., L, W]: span (s, w) covers tokens s..s+w and is valid when
    block_start <= s and s + w <= block_end.
  """
  starts = jnp.arange(seq_len)[:, None]
  ends = starts + jnp.arange(max_span_width)[None, :]
  bs = jnp.asarray(block_start)[..., None, None]
  be = jnp.asarray(block_end)[..., None, None]
  return (starts >= bs) & (ends <= be)


def _shift_up(x: jax.Array, w: int) -> jax.Array:
  """y[..., s, :] = x[..., s + w, :], zeros past the end (axis -2)."""
  if w == 0:
    return x
  pad = [(0, 0)] * (x.ndim - 2) + [(0, w), (0, 0)]
  return jnp.pad(x[..., w:, :], pad)


def _shift_down(x: jax.Array, w: int) -> jax.Array:
  """The adjoint of `_shift_up`: y[..., s + w, :] = x[..., s, :]."""
  if w == 0:
    return x
  pad = [(0, 0)] * (x.ndim - 2) + [(w, 0), (0, 0)]
  return jnp.pad(x[..., :-w, :], pad)


def _span_sums(start, end, weight, max_span_width):
  """`span_feature_sums` of start, end [rows, L, H] in one pass."""
  sums = [], [], []
  for w in range(max_span_width):
    x = jax.nn.relu(start + _shift_up(end, w))
    sums[0].append(jnp.sum(x, axis=-1))
    sums[1].append(jnp.sum(jnp.square(x), axis=-1))
    sums[2].append(jnp.sum(x * weight, axis=-1))
  return tuple(jnp.stack(parts, axis=-1) for parts in sums)


def _span_sums_vjp(start, end, weight, g1, g2, g3, max_span_width):
  """Gradients of `_span_sums` given the sums' cotangents g1, g2, g3."""
  d_start = jnp.zeros_like(start)
  d_end = jnp.zeros_like(end)
  d_weight = jnp.zeros_like(weight)
  for w in range(max_span_width):
    z = start + _shift_up(end, w)
    x = jax.nn.relu(z)
    dx = (g1[..., w, None] + 2.0 * g2[..., w, None] * x
          + g3[..., w, None] * weight)
    dz = jnp.where(z > 0, dx, 0.0)
    d_start += dz
    d_end += _shift_down(dz, w)
    d_weight += jnp.sum(g3[..., w, None] * x,
                        axis=tuple(range(x.ndim - 1)))
  return d_start, d_end, d_weight


def _map_blocks(fn, per_row: bool, *arrays):
  """fn over `arrays` [..., L, H] with their leading dims flattened to rows.

  With `per_row` (`ReaderConfig.span_head_batching="per_row"`) the rows go
  one at a time through `lax.map`, so a row's [L, H] (a few hundred KB)
  and each width's x stay in a CPU's cache; otherwise the whole batch is
  one pass, which accelerators fuse.
  """
  flat = tuple(a.reshape((-1,) + a.shape[-2:]) for a in arrays)
  if not per_row:
    return fn(*flat)
  return jax.lax.map(lambda rows: fn(*rows),
                     tuple(a[:, None] for a in flat))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def span_feature_sums(start: jax.Array, end: jax.Array, weight: jax.Array,
                      max_span_width: int, per_row: bool = False
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Feature sums of every span's hidden vector, without materialising it.

  For the span of width w + 1 starting at s, x = ReLU(start[s] + end[s + w])
  (end is zero past the sequence). Returns (sum_h x_h, sum_h x_h^2,
  sum_h weight_h x_h), each float32 [..., L, W]: all the span head needs
  (LayerNorm's mean and variance, then its dot with the output weights).
  The naive head builds x, a [..., L, W, 256] tensor, and keeps it (and its
  normalised copy) for the backward pass; here each width's x is reduced
  as soon as it is made, and the backward pass recomputes it the same way
  instead of storing it.

  Args:
    start, end: float32 [..., L, H], the two halves of the span projection.
    weight: float32 [H].
    max_span_width: W.
    per_row: one row of the flattened batch at a time (`_map_blocks`).
  """
  return _span_feature_sums_fwd(start, end, weight, max_span_width,
                                per_row)[0]


def _span_feature_sums_fwd(start, end, weight, max_span_width, per_row):
  sums = _map_blocks(
      lambda s, e: _span_sums(s, e, weight, max_span_width), per_row,
      start, end)
  out = tuple(x.reshape(start.shape[:-1] + (max_span_width,)) for x in sums)
  return out, (start, end, weight)


def _span_feature_sums_bwd(max_span_width, per_row, residuals, cotangents):
  start, end, weight = residuals
  d_start, d_end, d_weight = _map_blocks(
      lambda s, e, g1, g2, g3: _span_sums_vjp(
          s, e, weight, g1, g2, g3, max_span_width),
      per_row, start, end, *cotangents)
  # d_weight is one [H] per row with per_row (lax.map), one in all otherwise.
  return (d_start.reshape(start.shape), d_end.reshape(end.shape),
          d_weight.reshape(-1, weight.shape[0]).sum(axis=0))


span_feature_sums.defvjp(_span_feature_sums_fwd, _span_feature_sums_bwd)


class SpanHead(nnx.Module):
  """ORQA/REALM span scorer over (start, width) pairs.

  score(s, w) = Dense_1(LayerNorm(ReLU(start[s] + end[s + w]))). LayerNorm
  followed by a dense layer to one output is linear in x once its mean and
  variance are known, so the score is computed from three feature sums of
  x (`span_feature_sums`) instead of the [..., L, W, H] tensor itself:

    score = (sum_h a_h x_h - mean(x) sum_h a_h) / sqrt(var(x) + eps)
            + sum_h k_h beta_h + b,   a = k * gamma,

  with LayerNorm's scale gamma and bias beta, the output kernel k and bias
  b, and var(x) = mean(x^2) - mean(x)^2 as Flax's LayerNorm computes it.
  The parameters (and their names) are those of the layers it replaces.
  The sums and the normalisation run in float32 whatever the compute dtype.
  """

  def __init__(self, config: ReaderConfig, *, rngs: nnx.Rngs):
    self.config = config
    b = config.bert
    self.intermediate = dense(b, b.hidden_size, 2 * config.span_hidden_size,
                              rngs=rngs)
    self.layer_norm = layer_norm(config.span_hidden_size,
                                 config.span_layer_norm_eps, rngs=rngs)
    self.output = dense(b, config.span_hidden_size, 1, rngs=rngs)

  def __call__(self, hidden: jax.Array) -> jax.Array:
    """Scores every (start, width) span, [..., L, H] -> [..., L, W]."""
    c = self.config
    projected = self.intermediate(hidden.astype(c.bert.compute_dtype))
    start, end = jnp.split(projected.astype(jnp.float32), 2, axis=-1)
    kernel = self.output.kernel[...][:, 0]
    a = kernel * self.layer_norm.scale[...]
    offset = (jnp.dot(kernel, self.layer_norm.bias[...])
              + self.output.bias[...][0])
    sum_x, sum_x2, sum_ax = span_feature_sums(
        start, end, a, c.max_span_width, c.span_head_batching == "per_row")
    n = c.span_hidden_size
    mean = sum_x / n
    var = jnp.maximum(sum_x2 / n - jnp.square(mean), 0.0)
    return ((sum_ax - mean * jnp.sum(a)) * jax.lax.rsqrt(
        var + c.span_layer_norm_eps) + offset)


class Reader(nnx.Module):
  """Knowledge-augmented encoder: BERT + MLM head and/or span head."""

  def __init__(self, config: ReaderConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.bert = Bert(config.bert, rngs=rngs)
    if config.mlm_head:
      self.mlm_head = MLMHead(config.bert, rngs=rngs)
    if config.span_head:
      self.span_head = SpanHead(config, rngs=rngs)

  def mlm_logits(self, token_ids, input_mask, segment_ids, mlm_positions, *,
                 dropout_rng=None) -> jax.Array:
    """MLM logits float32 [..., M, vocab] at the masked positions only
    (`mlm_positions` int [..., M]) of reader inputs int [..., L]."""
    if not self.config.mlm_head:
      raise ValueError("This reader was built without an MLM head "
                       "(ReaderConfig.mlm_head=False).")
    with jax.named_scope("reader"):
      hidden, _ = self.bert(token_ids, input_mask, segment_ids,
                            dropout_rng=dropout_rng)
    with jax.named_scope("mlm_head"):
      at_masks = jnp.take_along_axis(hidden, mlm_positions[..., None],
                                     axis=-2)
      return self.mlm_head(
          at_masks, self.bert.embeddings.word_embeddings.embedding[...])

  def span_logits(self, token_ids, input_mask, segment_ids, block_start,
                  block_end, *, dropout_rng=None) -> jax.Array:
    """Span scores, -inf outside the document or wider than the maximum.

    For reader inputs int [..., L] whose document tokens are block_start ..
    block_end (inclusive), float32 [..., L, max_span_width]; entry (s, w)
    scores tokens s..s+w.
    """
    if not self.config.span_head:
      raise ValueError("This reader was built without a span head "
                       "(ReaderConfig.span_head=False).")
    with jax.named_scope("reader"):
      hidden, _ = self.bert(token_ids, input_mask, segment_ids,
                            dropout_rng=dropout_rng)
    with jax.named_scope("span_head"):
      scores = self.span_head(hidden)
    valid = span_mask(token_ids.shape[-1], block_start, block_end,
                      self.config.max_span_width)
    return jnp.where(valid, scores, -jnp.inf)


# ----------------------------------------------------------------------------
# REALM: retriever + reader
# ----------------------------------------------------------------------------


class Realm(nnx.Module):
  """Both halves of REALM; parameters {"retriever": ..., "reader": ...}."""

  def __init__(self, config: RealmConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.retriever = Retriever(config.retriever, rngs=rngs)
    self.reader = Reader(config.reader, rngs=rngs)

  def pretraining_logits(self, batch: dict[str, jax.Array], *,
                         null_document: bool = True,
                         dropout_rng=None) -> tuple[jax.Array, jax.Array]:
    """Retrieval and MLM logits for a pre-training batch.

    Args:
      batch: query_ids/query_mask [B, Lq]; candidate_ids/candidate_mask/
        candidate_segment_ids [B, C, Ld] (retriever inputs of the candidates,
        null document first); optionally candidate_embeddings [B, C, D]
        (a frozen document tower's, from the index: query-side training);
        reader_ids/reader_mask/reader_segment_ids [B, C, Lr]; mlm_positions
        [B, M] (positions in the reader input).
      null_document: candidate 0 is the null document.

    Returns:
      retrieval_logits [B, C] and mlm_logits [B, C, M, vocab], float32.
    """
    r_rng, m_rng = (None, None) if dropout_rng is None else tuple(
        jax.random.split(dropout_rng))
    logits = self.retriever(
        batch["query_ids"], batch["query_mask"], batch["candidate_ids"],
        batch["candidate_mask"], batch["candidate_segment_ids"],
        null_document=null_document,
        document_embeddings=batch.get("candidate_embeddings"),
        dropout_rng=r_rng)
    num_candidates = batch["reader_ids"].shape[1]
    positions = jnp.broadcast_to(
        batch["mlm_positions"][:, None, :],
        (batch["mlm_positions"].shape[0], num_candidates,
         batch["mlm_positions"].shape[1]))
    mlm = self.reader.mlm_logits(
        batch["reader_ids"], batch["reader_mask"],
        batch["reader_segment_ids"], positions, dropout_rng=m_rng)
    return logits, mlm

  def qa_logits(self, batch: dict[str, jax.Array], *,
                dropout_rng=None) -> tuple[jax.Array, jax.Array]:
    """Open-QA scores against a frozen document index.

    Args:
      batch: question_ids/question_mask [B, Lq]; retrieved_embeddings
        [B, K, D] (frozen, from the index); retrieved_mask [B, K];
        reader_ids/reader_mask/reader_segment_ids [B, R, L] for the top R
        blocks; block_start/block_end [B, R].

    Returns:
      retrieval_logits [B, K] (-inf where retrieved_mask is False) and
      reader_logits [B, R, L, W]: span scores plus the block's retrieval
      logit, -inf for inadmissible spans.
    """
    q_rng, r_rng = (None, None) if dropout_rng is None else tuple(
        jax.random.split(dropout_rng))
    query = self.retriever.embed_queries(
        batch["question_ids"], batch["question_mask"], dropout_rng=q_rng)
    logits = retrieval_logits(query, batch["retrieved_embeddings"],
                              self.retriever.config.score_scale)
    logits = jnp.where(batch["retrieved_mask"], logits, -jnp.inf)
    spans = self.reader.span_logits(
        batch["reader_ids"], batch["reader_mask"],
        batch["reader_segment_ids"], batch["block_start"],
        batch["block_end"], dropout_rng=r_rng)
    num_read = batch["reader_ids"].shape[1]
    return logits, spans + logits[:, :num_read, None, None]

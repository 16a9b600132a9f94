"""What REALM pre-training is for, measured on held-out masked queries.

Given a checkpoint's parameters, the knowledge corpus and masked queries
whose evidence block is known (`gold_block_ids`), it builds the
checkpoint's own index (every block re-embedded, exact search) and reports:

- `recall@1`, `recall@5`: the evidence block is among the top 1 / 5;
- `mlm_accuracy_marginal`: the reader's marginal prediction over the null
  document + top-k (what pre-training optimises) is right, per mask;
- `mlm_accuracy_null`, `mlm_accuracy_gold`: the reader's prediction from
  the null document alone / from the evidence block alone;
- `retrieval_utility`: log p(y|x) - log p(y|null, x), mean per mask;
- `null_probability`: mean p(null|x);
- `evidence`, `evidence_z`: the mass the reader's posterior moves onto
  answer-bearing candidates, and its z-score (`training.gate`'s
  statistics, as the retriever gate measures them); `evidence_blocks`,
  `evidence_blocks_z`: the same among the retrieved blocks alone (the
  posterior and prior renormalised without the null document), which
  is what moves the blocks' ranking;
- `span_recall`: share of queries with a block that holds their masked
  span (`realm_inputs.holds_spans`) among the k candidates read: what an
  ideal reader would reward, with no reader involved;
- `hubness`: share of queries whose top-1 block is the single most common
  top-1 block (1 / num_queries when every query retrieves another block);
- `score_spread`: the std of f(x, z) over the corpus (trivial candidates
  left out), averaged over the queries: how far apart the retriever holds
  the blocks. It falls when the blocks' embeddings fold onto one shared
  direction, as moving a small retriever on real text did (see
  `benchmarks.learning`'s results).

Without known evidence blocks (real text) the recall and gold-document
metrics are left out; given open-domain questions, `qa_recall@k` is the
share of them with an answer-bearing block among the top k (text match,
as `qa_eval` counts it), with the same index; `qa_answer_rank` lists,
question by question, where the first such block ranks (0 = first; the
largest k where none is in the top k), so that two checkpoints can be
compared on the same questions.

Nothing here trains; `benchmarks.learning` runs it on every checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.data import qa as qa_lib
from realm_jax.data.tokenizer import Tokenizer
from realm_jax.index import embed as embed_lib
from realm_jax.model import functional, losses
from realm_jax.model.realm import Realm, RealmConfig
from realm_jax.training import gate as gate_lib
from realm_jax.data import qa_inputs, realm_inputs


@functools.lru_cache(maxsize=8)
def _graphdef(model: RealmConfig):
  graphdef, _ = functional.abstract_init(lambda r: Realm(model, rngs=r))
  return graphdef


@functools.lru_cache(maxsize=8)
def _query_fn(model: RealmConfig):
  # No mesh: plain jit, so a chunk of queries need not fill the devices.
  return embed_lib.make_query_embedder(_graphdef(model), None)


@functools.lru_cache(maxsize=8)
def _reader_fn(model: RealmConfig):
  graphdef = _graphdef(model)

  @jax.jit
  def read(params, batch):
    retrieval_logits, mlm_logits = functional.bind(
        graphdef, params).pretraining_logits(batch, null_document=True)
    log_p_z = jax.nn.log_softmax(retrieval_logits, -1)            # [B, C]
    log_p_y = jax.nn.log_softmax(mlm_logits.astype(jnp.float32), -1)
    token_ll = losses.token_log_likelihoods(mlm_logits,
                                            batch["mlm_targets"])  # [B, C, M]
    marginal_ll = losses.marginal_log_likelihood(retrieval_logits, token_ll)
    marginal = jax.nn.logsumexp(log_p_z[:, :, None, None] + log_p_y, 1)
    targets = batch["mlm_targets"]
    return {
        "correct_marginal": jnp.argmax(marginal, -1) == targets,   # [B, M]
        "correct_each": jnp.argmax(log_p_y, -1) == targets[:, None],
        "utility": marginal_ll - token_ll[:, 0],
        "null_probability": jnp.exp(log_p_z[:, 0]),
        "retrieval_logits": retrieval_logits,
        "token_ll": token_ll,
    }
  return read


def _in_chunks(fn, n: int, size: int):
  parts = [fn(slice(lo, min(n, lo + size))) for lo in range(0, n, size)]
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def evaluate(params: dict[str, Any], model: RealmConfig, store,
             queries: dict[str, np.ndarray],
             gold_block_ids: np.ndarray | None, *,
             num_candidates: int = 7, reader_length: int | None = None,
             batch_size: int = 64,
             questions: Sequence[qa_lib.QAExample] = (),
             question_length: int = 32,
             qa_ks: Sequence[int] = (1, 5, 20),
             trivial_candidates: str = "article",
             block_emb: np.ndarray | None = None,
             question_inputs: dict[str, np.ndarray] | None = None
             ) -> dict[str, Any]:
  """Held-out retrieval and reading metrics of one set of parameters.

  Args:
    params: {"retriever", "reader"} parameters (numpy or jax).
    model: their config; the reader needs an MLM head.
    store: the knowledge corpus (`block_store.BlockStore`).
    queries: stacked REALM queries (`examples.REALM_QUERY_FEATURES`).
    gold_block_ids: int [num_queries], each query's evidence block, or
      None (real text: no recall@k, no gold-document accuracy).
    num_candidates: k retrieved blocks read beside the null document.
    reader_length: reader input length (default: query + block length).
    batch_size: queries per reader call.
    questions: open-domain questions with answers, for `qa_recall@k`.
    question_length: `[CLS] question [SEP]` wordpieces.
    qa_ks: the k of `qa_recall@k`.
    trivial_candidates: the blocks a masked query may not retrieve, as in
      training (`RetrievalConfig.trivial_candidates`).
    block_emb: the blocks' embeddings by these parameters' document tower
      (e.g. a query-side run's index, which never changes); default: the
      corpus is embedded here.
    question_inputs: `questions` already tokenized
      (`qa_inputs.tokenize_questions`), e.g. on a host without
      tensorflow_text; default: tokenized here.

  Returns:
    The metrics listed in the module docstring, as floats
    (`qa_answer_rank`: a list of ints, one per question).

  Raises:
    ValueError: on mismatched sizes or too small a corpus.
  """
  n = len(queries["query_ids"])
  gold = None if gold_block_ids is None else np.asarray(gold_block_ids,
                                                        np.int64)
  if gold is not None and gold.shape != (n,):
    raise ValueError(f"gold_block_ids has shape {gold.shape}; expected "
                     f"({n},), one evidence block per query.")
  if len(store) <= num_candidates:
    raise ValueError(f"{store.path}: {len(store)} blocks, too few for "
                     f"{num_candidates} candidates.")
  queries = _used_mask_slots(queries)
  block_emb = _block_embeddings(params, model, store, block_emb)
  ranking, spread = _ranking(params, model, store, queries, block_emb,
                             trivial_candidates, batch_size)
  metrics = _reading_metrics(params, model, store, queries, ranking,
                             num_candidates, gold, reader_length, batch_size)
  metrics["score_spread"] = spread
  if questions:
    ranks = qa_answer_ranks(params, model, store, block_emb, questions,
                            question_length, max(qa_ks), batch_size,
                            question_inputs)
    metrics.update(recall_at(ranks, qa_ks))
    metrics["qa_answer_rank"] = ranks.tolist()
  return metrics


def _used_mask_slots(queries: dict[str, np.ndarray]
                     ) -> dict[str, np.ndarray]:
  """`queries` without the mask slots no query uses.

  Mask slots are filled from the front; the reader's logits over the
  vocabulary are the cost of each slot kept.
  """
  used = max(1, int((queries["mlm_weights"] > 0).sum(1).max()))
  return {k: v[:, :used] if k.startswith("mlm_") else v
          for k, v in queries.items()}


def _block_embeddings(params: dict[str, Any], model: RealmConfig, store,
                      block_emb: np.ndarray | None) -> np.ndarray:
  """`block_emb`, checked against the store, or the store embedded."""
  if block_emb is None:
    block_emb, _ = embed_lib.embed_block_store(
        params["retriever"], model.retriever, store)
  elif np.shape(block_emb)[0] != len(store):
    raise ValueError(f"block_emb has {np.shape(block_emb)[0]} rows; the "
                     f"store {store.path} has {len(store)} blocks.")
  return block_emb


def _reading_metrics(params, model, store, queries, ranking, num_candidates,
                     gold, reader_length, batch_size) -> dict[str, float]:
  """What the reader makes of the top `num_candidates` blocks (and of the
  gold block, when known), per mask; recall and hubness of `ranking`."""
  n = len(ranking)
  reader_length = reader_length or (queries["query_ids"].shape[1]
                                    + store.max_block_len)
  top1, candidates = ranking[:, 0], ranking[:, :num_candidates]
  read = _reader_fn(model)

  def reader_outputs(s, cands):
    batch = realm_inputs.pretraining_batch(
        {k: v[s] for k, v in queries.items()}, cands[s], store,
        doc_len=store.max_block_len, reader_len=reader_length,
        null_document=True)
    return {k: np.asarray(v) for k, v in read(params, batch).items()}

  retrieved = _in_chunks(lambda s: reader_outputs(s, candidates), n,
                         batch_size)
  weights = queries["mlm_weights"].astype(np.float64)
  masks = weights.sum()

  def per_mask(x):
    return float((np.asarray(x, np.float64) * weights).sum() / masks)

  metrics = {}
  if gold is not None:
    rank_of_gold = np.argmax(ranking == gold[:, None], axis=1)
    with_gold = _in_chunks(lambda s: reader_outputs(s, gold[:, None]), n,
                           batch_size)
    metrics = {"recall@1": float(np.mean(rank_of_gold < 1)),
               "recall@5": float(np.mean(rank_of_gold < 5)),
               "mlm_accuracy_gold": per_mask(with_gold["correct_each"][:, 1])}
  bearing = gate_lib.answer_bearing(queries, candidates, store)
  logits, token_ll = retrieved["retrieval_logits"], retrieved["token_ll"]
  gate_stats = gate_lib.gate_statistics(logits, token_ll, weights, bearing)
  # Among the retrieved blocks only (the null document's share left out):
  # what moves the ranking.
  among_blocks = gate_lib.gate_statistics(logits[:, 1:], token_ll[:, 1:],
                                          weights, bearing[:, 1:])
  return metrics | {
      "span_recall": float(np.mean(bearing[:, 1:].any(1))),
      "evidence": gate_stats["evidence"],
      "evidence_z": gate_stats["evidence_z"],
      "evidence_blocks": among_blocks["evidence"],
      "evidence_blocks_z": among_blocks["evidence_z"],
      "mlm_accuracy_marginal": per_mask(retrieved["correct_marginal"]),
      "mlm_accuracy_null": per_mask(retrieved["correct_each"][:, 0]),
      "retrieval_utility": per_mask(retrieved["utility"]),
      "null_probability": float(np.mean(retrieved["null_probability"])),
      "hubness": float(np.bincount(top1).max() / n)}


def _ranking(params, model, store, queries, block_emb, trivial_candidates,
             batch_size) -> tuple[np.ndarray, float]:
  """Every block for every query, best first, trivial candidates (the
  query's own article or block) last, at -inf; and the mean over queries
  of the std of their other blocks' scores (`score_spread`)."""
  embed_queries = _query_fn(model)
  query_emb = _in_chunks(lambda s: {"e": np.asarray(embed_queries(
      params, queries["query_ids"][s], queries["query_mask"][s]))},
                         len(queries["query_ids"]), batch_size)["e"]
  scores = query_emb.astype(np.float64) @ block_emb.astype(np.float64).T
  trivial = realm_inputs.TrivialCandidates(store, trivial_candidates)
  excluded = (trivial.block_keys[None, :]
              == trivial.query_keys(queries)[:, None])
  scores[excluded] = np.nan  # (left out of the spread, in place)
  spread = float(np.mean(np.nanstd(scores, axis=1)))
  scores[excluded] = -np.inf
  return np.argsort(-scores, axis=1, kind="stable"), spread


def qa_recall(params, model, store, block_emb, questions,
              question_length: int = 32, ks: Sequence[int] = (1, 5, 20),
              batch_size: int = 64,
              question_inputs: dict[str, np.ndarray] | None = None
              ) -> dict[str, float]:
  """Share of questions with an answer in the top k blocks, per k.

  `params`' query tower embeds the questions (tokenized here, or given as
  `question_inputs`, `qa_inputs.tokenize_questions`' output);
  `block_emb` [len(store), D] are the blocks' embeddings (an index's, or
  `embed_block_store`'s). Returns {"qa_recall@k": share} for k in `ks`.
  """
  return recall_at(qa_answer_ranks(params, model, store, block_emb,
                                   questions, question_length, max(ks),
                                   batch_size, question_inputs), ks)


def recall_at(ranks: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
  """{"qa_recall@k": share of `ranks` below k} for k in `ks`."""
  return {f"qa_recall@{k}": float(np.mean(np.asarray(ranks) < k))
          for k in ks}


def qa_answer_ranks(params, model, store, block_emb, questions,
                    question_length: int = 32, depth: int = 20,
                    batch_size: int = 64,
                    question_inputs: dict[str, np.ndarray] | None = None
                    ) -> np.ndarray:
  """Per question, the rank of the first answer-bearing block (0 = the
  top block) among the top `depth`; `depth` where none of them holds an
  answer. Arguments as `qa_recall`'s."""
  tokenizer = Tokenizer()
  store.check_vocab(tokenizer.vocab_path)
  q = question_inputs or qa_inputs.tokenize_questions(
      tokenizer, [e.question for e in questions], question_length)
  if q["question_ids"].shape != (len(questions), question_length):
    raise ValueError(
        f"question_inputs has shape {q['question_ids'].shape}; expected "
        f"({len(questions)}, {question_length}): one row per question.")
  embed_queries = _query_fn(model)
  emb = _in_chunks(lambda s: {"e": np.asarray(embed_queries(
      params, q["question_ids"][s], q["question_mask"][s]))},
                   len(questions), batch_size)["e"]
  scores = emb.astype(np.float64) @ block_emb.astype(np.float64).T
  top = np.argsort(-scores, axis=1, kind="stable")[:, :depth]
  found = np.stack([qa_lib.has_answer_batch(
      [store.text(int(b)) for b in row], e.answers, e.is_regex)
                    for row, e in zip(top, questions)])
  return np.where(found.any(1), np.argmax(found, 1), depth)

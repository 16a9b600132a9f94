"""The REALM pre-training run's settings (`pretrain.PretrainConfig`).

Gin binds it as `pretrain.PretrainConfig` (the trainer module re-exports
it); its checks run when it is built, before any work starts.
"""

from __future__ import annotations

import dataclasses

from realm_jax.core import checks
from realm_jax.index import builder
from realm_jax.training import loop, realm_inputs

INDEX_MODES = ("inline", "builder")
RETRIEVER_TRAINING = ("full", "query_side")
RETRIEVER_GATES = ("steps", "utility", "evidence")
# The gates measured in the run (the others release at a step count).
MEASURED_GATES = ("utility", "evidence")
# The query-side mode's frozen subtree: the document tower.
DOCUMENT_TOWER = ("retriever", "document_embedder")
# Parameters the masked-LM loss never reads (a reader built with the span
# head for later fine-tuning): no weight decay, so they stay as initialised.
UNUSED_BY_PRETRAINING = (("reader", "span_head"),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig(loop.TrainConfig):
  """A REALM pre-training run (`loop.TrainConfig`; REALM's defaults).

  Attributes:
    queries: the pre-training corpus X as a query cache directory (masked
      REALM queries written by `python -m realm_jax.data.query_cache`; its
      shard count a multiple of the host count, at most `batch_size`). The
      cache's manifest says how its queries were made (query_length,
      max_masks, masking: `examples.RealmQueryConfig`); the run reads them
      from there.
    learning_rate: the reader's when the retriever has its own schedule.
    retriever_learning_rate_multiplier: the retriever's peak rate relative
      to `learning_rate` (REALM: 1; 0 freezes the retriever).
    freeze_retriever_steps: reader warm-up: the retriever does not move for
      this many steps (REALM: 0). See `optimizer.realm_optimizer`. With
      a measured `retriever_gate` it is the upper bound: the gate may
      release the retriever earlier (set it to num_train_steps to release
      the retriever only on the gate's evidence).
    retriever_training: "full" (REALM: both towers learn, the index is
      refreshed) or "query_side" (Atlas's cheap variant: the document
      tower and so the index stay fixed; only the query tower and the
      reader learn, the index is built once and never refreshed, and the
      candidates' embeddings come from the index instead of being
      recomputed). Needs RetrieverConfig.share_towers=False; a source with
      one tower initialises both.
    retriever_gate: when the retriever is released. "steps": at
      freeze_retriever_steps. A measured gate: every `gate_every` steps the
      reader is evaluated on the first `gate_num_queries` queries of
      `gate_queries` (candidates from the served index), and the retriever
      is released after `gate_patience` passing evaluations in a row:
      - "utility": the retrieval utility, log p(y|x) - log p(y|null, x)
        nats per mask, is >= `gate_min_utility`: the reader gains from the
        blocks, on average (held-out queries);
      - "evidence": the retriever's own gradient favours answer-bearing
        blocks (those whose text holds the masked span): the posterior
        mass p(z|x, y) - p(z|x) the reader moves onto them is positive at
        a z-score >= `gate_min_evidence_z` over the queries that retrieved
        one (`gate.gate_statistics`; exactly 0 while the reader ignores
        the blocks). Measure it on the training queries
        (`gate_queries = queries`, a slice of ~2,000): that is the signal
        the retriever follows, and it is there before any held-out gain.
      Every evaluation (both statistics) goes to the log and gate.jsonl.
    gate_queries: the gate's query cache, masked like `queries`: for
      "utility", sentences never trained on (held-out articles of X); for
      "evidence", `queries` itself.
    gate_every, gate_num_queries, gate_min_utility, gate_min_evidence_z,
      gate_patience: see
      `retriever_gate`.
    recall_guard_queries: a query cache of held-out sentences (masked like
      `queries`) of articles that are in the block store, e.g. the utility
      gate's: turns the recall guard on ("": off). Every `gate_every` steps
      (full training on an inline index: on refresh steps only,
      `gate.guard_every`) it searches the served index with the current
      query tower and measures the share of these sentences whose own
      block (the block that holds the sentence) is among the top
      `recall_guard_k`: ICT's
      task on held-out sentences, which tracks question recall on real
      text (docs/results/learning.md). The first evaluation, while the
      retriever is still where the run started, is the baseline. Once the
      retriever trains, `recall_guard_patience` evaluations in a row more
      than `recall_guard_max_drop` below the baseline roll the retriever
      back to the run's initial one (`init_from`'s) and freeze it for the
      rest of the run; the gate is not consulted again. Needs X and Z to
      overlap (REALM's Wikipedia); a world whose queries are not in the
      block store has no own blocks, and the guard refuses it.
    recall_guard_questions: instead of sentences, dev questions about the
      block store (ORQA JSONL: question and answers), kept apart from the
      questions a run is evaluated on: turns the recall guard on with
      recall@`recall_guard_k` of a block holding an answer as its measure
      (the first `recall_guard_num_queries` questions). Own-block recall
      is the pre-training task, and REALM can raise it while question
      recall falls (docs/results/learning.md); this measures what the
      retriever is for. At most one of the two may be set.
    recall_guard_num_queries, recall_guard_k, recall_guard_max_drop,
      recall_guard_patience: see `recall_guard_queries`.
    adam_bias_correction: Adam's bias-corrected moments instead of BERT's
      raw ones (REALM: False); see `optimizer.bert_optimizer`.
    num_candidates: retrieved blocks per query k (REALM: 7), plus the null
      document when `null_document`.
    null_document: put the empty document first among the candidates.
    trivial_candidates: REALM's no-trivial-retrieval rule: "article" (no
      block of the sentence's own article) or "block" (only the block that
      holds the sentence, as REALM's reference code). See
      `realm_inputs.TrivialCandidates`.
    reader_length: the reader's input, query + block (REALM: 384 = 96 +
      288); it must exceed the query cache's query_length.
    checkpoint_every: also the inline index refresh period.
    index_mode: "builder" (REALM: a separate job refreshes the index) or
      "inline" (rebuilt in-process after each checkpoint: small CPU runs,
      exactly reproducible restarts).
    index_build: how an inline-mode run builds each index (searcher,
      searcher_config, embedding batch, bfloat16, retention, retries): the
      builder job's `builder.IndexBuildConfig`, bound as
      `builder.IndexBuildConfig.<field>` in gin (runs/pretrain.gin), so one
      binding sets both. A builder-mode run does not read it (the builder
      job builds with its own).
    retrieval: "host" (the served index's searcher on the host, then the
      batch built in numpy from the memory-mapped block store) or "device":
      the served index's embeddings and the block tokens live on the
      devices, sharded by rows, and exact top-k search, the candidates'
      tokens and the batch are computed there (`index/device_search.py`);
      the query embeddings never leave the devices. For corpora that fit in
      device memory (13.35M x 128 bf16 is 3.4 GB, plus ~7.7 GB of uint16
      tokens at 288, over all devices).
    device_index_dtype: "float32" or "bfloat16" block embeddings (retrieval
      "device").
    overlap_input: retrieval "host": the next step's search, candidate
      gathering and batch assembly run on a host thread while the devices
      compute this step. The next step's candidates are then chosen with
      this step's retriever (one update older; the index is hundreds of
      steps older anyway) and, so that a restart replays the run exactly,
      the candidates of the step after a checkpoint are saved in it.
      Retrieval "device" overlaps by itself (asynchronous dispatch).
    rerank_candidates: Atlas-style re-ranking (0: off): the served index
      proposes this many blocks per query (outside its own article), the
      current document tower re-embeds them and the `num_candidates` with
      the highest fresh scores are kept. A stale index then only has to
      put the right block among the proposals, not in the top k. It costs
      a forward pass of the document tower over batch x rerank_candidates
      blocks every step: for refresh intervals much longer than REALM's
      ~500 steps (docs/benchmarks/refresh_cost.md). Retrieval "host"
      without `overlap_input` (the re-embedding needs the step's own
      parameters, which the update step donates).
    index_wait_seconds: builder mode: how long to wait for the first index.
    hubness_warning: warn once when the share of the recent queries whose
      top-1 block is the single most common one exceeds this (judged over
      the last `guard_min_queries` queries or more, pooled over log windows;
      the logged `hubness` metric is the last log window's).
    null_probability_warning: warn once when the mean p(null|x) of the
      logged steps covering the last `guard_min_queries` queries exceeds
      this.
    guard_min_queries: the fewest queries the collapse guards judge: with
      batches of 4, two equal top-1s would read as 50% hubness.
    stale_index_warning: builder mode: warn (once per served index) when it
      is more than this many checkpoint intervals older than the step (the
      builder died, lags, or cannot write); `index_staleness` is logged as
      a metric every `log_every` steps.
    stale_index_error: builder mode: stop with an error past this many
      intervals (0: never).
  """

  queries: str
  num_train_steps: int = 200_000
  batch_size: int = 512
  learning_rate: float = 3e-5
  retriever_learning_rate_multiplier: float = 1.0
  freeze_retriever_steps: int = 0
  retriever_training: str = "full"
  retriever_gate: str = "steps"
  gate_queries: str = ""
  gate_every: int = 50
  gate_num_queries: int = 128
  gate_min_utility: float = 0.1
  gate_min_evidence_z: float = 3.0
  gate_patience: int = 2
  recall_guard_queries: str = ""
  recall_guard_questions: str = ""
  recall_guard_num_queries: int = 1024
  recall_guard_k: int = 5
  recall_guard_max_drop: float = 0.02
  recall_guard_patience: int = 2
  adam_bias_correction: bool = False
  num_candidates: int = 7
  null_document: bool = True
  trivial_candidates: str = "article"
  reader_length: int = 384
  checkpoint_every: int = 500
  index_mode: str = "builder"
  index_build: builder.IndexBuildConfig = builder.IndexBuildConfig()
  retrieval: str = "host"
  device_index_dtype: str = "float32"
  overlap_input: bool = False
  rerank_candidates: int = 0
  index_wait_seconds: float = 600.0
  hubness_warning: float = 0.3
  null_probability_warning: float = 0.9
  guard_min_queries: int = 64
  stale_index_warning: float = 4.0
  stale_index_error: float = 0.0

  def _check_recall_guard(self):
    """Raises ValueError for bad recall guard settings."""
    if self.recall_guard_queries and self.recall_guard_questions:
      raise ValueError(
          "recall_guard_queries and recall_guard_questions are both set "
          f"({self.recall_guard_queries!r}, "
          f"{self.recall_guard_questions!r}): the recall guard measures one "
          "of them; unset the other.")
    if self.recall_guard_queries or self.recall_guard_questions:
      checks.at_least(self, "gate_every", "recall_guard_num_queries",
                      "recall_guard_k", "recall_guard_patience",
                      integer=True)
      if not 0 <= self.recall_guard_max_drop < 1:
        raise ValueError("recall_guard_max_drop must be in [0, 1), got "
                         f"{self.recall_guard_max_drop!r}.")

  def _check_retriever_training(self):
    """The retriever's training: which towers."""
    if self.retriever_training not in RETRIEVER_TRAINING:
      raise ValueError(f"retriever_training={self.retriever_training!r}; "
                       f"use one of {RETRIEVER_TRAINING}.")
    if self.retriever_training == "query_side" and (
        self.rerank_candidates or self.retrieval != "host"):
      raise ValueError(
          "retriever_training='query_side' keeps the index exact for the "
          "whole run: it needs retrieval='host' and rerank_candidates=0.")

  def __post_init__(self):
    super().__post_init__()
    checks.at_least(self, "num_candidates", "guard_min_queries")
    self._check_recall_guard()
    if self.index_mode not in INDEX_MODES:
      raise ValueError(f"index_mode={self.index_mode!r}; use one of "
                       f"{INDEX_MODES}.")
    if self.index_mode == "builder" and self.keep_checkpoints < 5:
      raise ValueError("keep_checkpoints must be >= 5 when an index builder "
                       "reads the checkpoints.")
    if self.retrieval not in ("host", "device"):
      raise ValueError(f"retrieval={self.retrieval!r}; use 'host' or "
                       "'device'.")
    if self.device_index_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"device_index_dtype={self.device_index_dtype!r}; use "
                       "'float32' or 'bfloat16'.")
    if self.rerank_candidates and (
        self.rerank_candidates < self.num_candidates
        or self.retrieval != "host" or self.overlap_input):
      raise ValueError(
          f"rerank_candidates={self.rerank_candidates} needs "
          f">= num_candidates ({self.num_candidates}) proposals, "
          "retrieval='host' and overlap_input=False; set it to 0 to turn "
          "re-ranking off.")
    if self.trivial_candidates not in realm_inputs.TRIVIAL_RULES:
      raise ValueError(
          f"trivial_candidates={self.trivial_candidates!r}; use one of "
          f"{realm_inputs.TRIVIAL_RULES}.")
    self._check_retriever_training()
    if self.retriever_gate not in RETRIEVER_GATES:
      raise ValueError(f"retriever_gate={self.retriever_gate!r}; use one of "
                       f"{RETRIEVER_GATES}.")
    if self.retriever_gate in MEASURED_GATES:
      checks.at_least(self, "gate_every", "gate_num_queries", "gate_patience",
                      integer=True)
      if not self.gate_queries:
        raise ValueError(
            f"retriever_gate={self.retriever_gate!r} measures the reader "
            "on gate_queries: set it to a query cache (for 'utility', built "
            "from articles that are not in `queries` with python -m "
            "realm_jax.data.query_cache; for 'evidence', `queries`), or "
            "use retriever_gate='steps'.")
      if not self.freeze_retriever_steps:
        raise ValueError(
            f"retriever_gate={self.retriever_gate!r} with "
            "freeze_retriever_steps=0 releases "
            "the retriever at step 0; set freeze_retriever_steps to the "
            "latest release (num_train_steps: only on the gate's evidence).")

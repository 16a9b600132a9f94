"""The REALM pre-training run's settings (`pretrain.PretrainConfig`).

Gin binds it as `pretrain.PretrainConfig` (the trainer module re-exports
it and its parts); its checks run when it is built, before any work
starts. Its parts are configs of their own, bound as
`pretrain.<Part>.<field>` in gin (runs/pretrain.gin binds each part to
the run), each read by the component it configures:

  RetrievalConfig          the candidates: k, null document, trivial rule,
                           where the search runs, re-ranking
                           (`training.candidates`)
  RetrieverScheduleConfig  how the retriever learns: towers, rate
                           (`optimizer`)
  GateConfig               when it is released: a step, or the reader's
                           measured evidence (`training.gate`, `optimizer`)
  GuardConfig              collapse and stale-index warnings
                           (`training.collapse`, `index.service`)
  RecallGuardConfig        the recall guard's rollback
                           (`recall_guard.RecallGuard`)
"""

from __future__ import annotations

import dataclasses

from realm_jax.core import checks
from realm_jax.index import build
from realm_jax.data import realm_inputs
from realm_jax.training import loop

INDEX_MODES = ("inline", "builder")
SEARCHES = ("host", "device")
HELD_PRIORS = ("dense", "uniform", "mixture")
RETRIEVER_TRAINING = ("full", "query_side")
GATE_MODES = ("steps", "utility", "evidence")
# What the recall guard counts as found (`RecallGuardConfig.probe`).
RECALL_PROBES = ("answer", "own_block")
# The gates measured in the run (the others release at a step count).
MEASURED_GATES = ("utility", "evidence")
# The query-side mode's frozen subtree: the document tower.
DOCUMENT_TOWER = ("retriever", "document_embedder")
# Parameters the masked-LM loss never reads (a reader built with the span
# head for later fine-tuning): no weight decay, so they stay as initialised.
UNUSED_BY_PRETRAINING = (("reader", "span_head"),)


def _one_of(config, name: str, choices: tuple[str, ...]) -> None:
  value = getattr(config, name)
  if value not in choices:
    raise ValueError(f"{type(config).__name__}.{name}={value!r}; use one of "
                     f"{choices}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks.type_checked
class RetrievalConfig:
  """Each query's candidates (REALM's defaults).

  Attributes:
    num_candidates: retrieved blocks per query k (REALM: 7), plus the null
      document when `null_document`.
    null_document: put the empty document first among the candidates.
    trivial_candidates: REALM's no-trivial-retrieval rule: "article" (no
      block of the sentence's own article) or "block" (only the block that
      holds the sentence, as REALM's reference code). See
      `realm_inputs.TrivialCandidates`.
    search: "host" (the served index's searcher on the host, then the
      batch built in numpy from the memory-mapped block store) or "device":
      the served index's embeddings and the block tokens live on the
      devices, sharded by rows, and exact top-k search, the candidates'
      tokens and the batch are computed there (`index/device_search.py`);
      the query embeddings never leave the devices. For corpora that fit in
      device memory (13.35M x 128 bf16 is 3.4 GB, plus ~7.7 GB of uint16
      tokens at 288, over all devices).
    device_index_dtype: "float32" or "bfloat16" block embeddings (search
      "device").
    overlap_input: search "host": the next step's search, candidate
      gathering and batch assembly run on a host thread while the devices
      compute this step. The next step's candidates are then chosen with
      this step's retriever (one update older; the index is hundreds of
      steps older anyway) and, so that a restart replays the run exactly,
      the candidates of the step after a checkpoint are saved in it.
      Search "device" overlaps by itself (asynchronous dispatch).
    rerank_candidates: Atlas-style re-ranking (0: off): the served index
      proposes this many blocks per query (outside its own article), the
      current document tower re-embeds them and the `num_candidates` with
      the highest fresh scores are kept. A stale index then only has to
      put the right block among the proposals, not in the top k. It costs
      a forward pass of the document tower over batch x rerank_candidates
      blocks every step: for refresh intervals much longer than REALM's
      ~500 steps (docs/benchmarks/refresh_cost.md). Search "host" without
      `overlap_input` (the re-embedding needs the step's own parameters,
      which the update step donates).
    lexical_candidates: m > 0 adds each query's first m BM25 blocks (over
      the same block store, `index.bm25`, built once beside it) that are
      neither trivial nor among its dense candidates: the reader reads k +
      m blocks (plus the null document), all scored by the dense retriever,
      so its gradient reaches BM25's blocks too. A young dense retriever
      rarely finds the evidence; BM25 often does, so the reader can learn
      to read before the retriever is released. 0: REALM's candidates.
      Every search mode: with search "device" BM25's hits (on the host)
      enter the batch as inputs and the union is made on the devices.
    held_prior: the retrieval distribution the reader's marginal uses
      while the gate holds the retriever: "dense" (REALM's p(z|x) from the
      frozen retriever), "uniform" over the candidates (the null
      document included), or "mixture": half REALM's p(z|x), half the
      softmax of the candidates' BM25 scores (`realm_inputs.
      lexical_log_prior`), so that a block BM25 ranks first carries at
      least half of its BM25 weight and a good dense retriever's block at
      least half of its dense weight (uniform over 8 candidates cut the
      gold block's weight 7x where ICT already found it); from the
      release on it is REALM's p(z|x). Only with `lexical_candidates`
      (without them the candidates are the dense retriever's own).
  (The score f(x, z) and its scale are the model's:
  `realm.RetrieverConfig.score_scale`.)
  """

  num_candidates: int = 7
  null_document: bool = True
  trivial_candidates: str = "article"
  search: str = "host"
  device_index_dtype: str = "float32"
  overlap_input: bool = False
  rerank_candidates: int = 0
  lexical_candidates: int = 0
  held_prior: str = "dense"

  def __post_init__(self):
    checks.at_least(self, "num_candidates")
    checks.at_least(self, "rerank_candidates", minimum=0)
    checks.at_least(self, "lexical_candidates", minimum=0)
    _one_of(self, "held_prior", HELD_PRIORS)
    if self.held_prior != "dense" and not self.lexical_candidates:
      raise ValueError(
          f"RetrievalConfig.held_prior={self.held_prior!r} needs "
          "lexical_candidates > 0 (without them the candidates are the "
          "dense retriever's own); set held_prior='dense'.")
    _one_of(self, "search", SEARCHES)
    _one_of(self, "device_index_dtype", ("float32", "bfloat16"))
    _one_of(self, "trivial_candidates", realm_inputs.TRIVIAL_RULES)
    if self.rerank_candidates and self.search == "device":
      raise ValueError(
          f"RetrievalConfig.rerank_candidates={self.rerank_candidates} "
          "excludes search='device' (re-ranking re-embeds proposals on the "
          "host side); set search='host' or rerank_candidates=0.")
    if self.rerank_candidates and self.overlap_input:
      raise ValueError(
          f"RetrievalConfig.rerank_candidates={self.rerank_candidates} "
          "excludes overlap_input=True (the re-embedding needs the step's "
          "own parameters); set one of them off.")
    if 0 < self.rerank_candidates < self.num_candidates:
      raise ValueError(
          f"RetrievalConfig.rerank_candidates={self.rerank_candidates} "
          f"needs >= num_candidates ({self.num_candidates}) proposals; set "
          "it to 0 to turn re-ranking off.")


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks.type_checked
class RetrieverScheduleConfig:
  """How the retriever learns once released (REALM: both towers, at the
  reader's rate; when it is released: `GateConfig`).

  Attributes:
    training: "full" (REALM: both towers learn, the index is refreshed) or
      "query_side" (Atlas's cheap variant: the document tower and so the
      index stay fixed; only the query tower and the reader learn, the
      index is built once and never refreshed, and the candidates'
      embeddings come from the index instead of being recomputed). Needs
      RetrieverConfig.share_towers=False; a source with one tower
      initialises both.
    learning_rate_multiplier: the retriever's peak rate relative to the
      run's `learning_rate`, which is the reader's (REALM: 1; 0 freezes the
      retriever). See `optimizer.realm_optimizer`.
    signal: "reader" (REALM: the retriever learns from the reader's
      likelihoods of its own query's masked tokens) or "permuted", a
      no-information control for experiments: each query's retriever
      gradient is computed from the next query's likelihoods (same form,
      size and candidates, no information about its own query), so a gain
      that survives it does not come from the reader's signal
      (`losses.pretraining_loss`).
  """

  training: str = "full"
  learning_rate_multiplier: float = 1.0
  signal: str = "reader"

  def __post_init__(self):
    _one_of(self, "training", RETRIEVER_TRAINING)
    _one_of(self, "signal", ("reader", "permuted"))
    # Checked here, when the config is built (before a job creates its
    # workdir or index root), under the name the user sets.
    checks.at_least(self, "learning_rate_multiplier", minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks.type_checked
class GateConfig:
  """When the retriever is released (REALM: at step 0), read by
  `gate.RetrieverGate` and the optimiser.

  Until its release the retriever does not move: the reader learns to
  read first (`optimizer.realm_optimizer`).

  Attributes:
    mode: "steps": released at update `latest_release`, whatever the
      reader does (REALM: 0). A measured gate: every `every` steps the
      reader is evaluated on the first `num_queries` queries of `queries`
      (candidates from the served index), and the retriever is released
      once `patience` evaluations in a row are significant *and* the
      reader's measured effect reaches `min_utility` (`gate.gate_decision`):
      - "evidence": significant when the retriever's own gradient favours
        answer-bearing blocks (those whose text holds the masked span):
        the posterior mass p(z|x, y) - p(z|x) the reader moves onto them is
        positive at a z-score >= `min_evidence_z` over the queries that
        retrieved one (`gate.gate_statistics`; exactly 0 while the reader
        ignores the blocks). Measured on the training queries (`queries`
        = the run's, ~2,000 of them; not its dev split): that is the
        signal the retriever follows, and it is there before any
        held-out gain (a held-out evidence gate was backwards,
        docs/results/learning.md, "Negative results");
      - "utility": significant when the retrieval utility is >=
        `min_utility` (held-out queries: articles never trained on).
      Every evaluation (both statistics) goes to the log and gate.jsonl.
    latest_release: the update at which the retriever is released at the
      latest: "steps" releases it there; a measured gate may release it
      earlier. None: only on the gate's evidence (never on a step count).
    queries: the gate's query cache, masked like the run's queries: for
      "evidence", the run's `queries` (its training queries); for
      "utility", sentences never trained on: a cache with a dev split
      (`<cache>/dev`, as the query-cache job writes by default) is read
      there (`query_cache.held_out`), so the run's `queries` will do.
    every: evaluations every this many steps.
    num_queries: the first this many queries of `queries` (fewer if the
      cache has fewer; a multiple of the devices).
    min_utility: the effect floor, in nats per mask: the utility
      log p(y|x) - log p(y|null, x) of the gate's queries must reach it at
      the release. A z-test over a thousand queries is "significant" at a
      ten-thousandth of a nat, and two held-out worlds released on 0.0001
      nats lost their ICT recall (docs/results/learning.md). The rule:
      the retrieved blocks must make the masked tokens at least 0.5% more
      likely (ln 1.005 = 0.005 nats), the smallest effect called reading:
      50x the failures', fixed before any world it was evaluated on.
    min_evidence_z: "evidence": the z-score of a significant evaluation.
    patience: significant evaluations in a row before a release.
  """

  mode: str = "steps"
  latest_release: int | None = 0
  queries: str = checks.path_setting("reads", default="")
  every: int = 50
  num_queries: int = 2048
  min_utility: float = 0.005
  min_evidence_z: float = 3.0
  patience: int = 2

  @property
  def measured(self) -> bool:
    """Whether a gate measured in the run releases the retriever."""
    return self.mode in MEASURED_GATES

  def __post_init__(self):
    _one_of(self, "mode", GATE_MODES)
    if self.latest_release is not None and self.latest_release < 0:
      raise ValueError(f"GateConfig.latest_release={self.latest_release} "
                       "must be >= 0 (or None: only on the gate's evidence).")
    if not self.measured:
      if self.latest_release is None:
        raise ValueError(
            "GateConfig.mode='steps' releases the retriever at "
            "latest_release, which is None: set a step (0: REALM), or a "
            "measured mode ('evidence', 'utility').")
      return
    checks.at_least(self, "every", "num_queries", "patience", integer=True)
    if not self.queries:
      raise ValueError(
          f"GateConfig.mode={self.mode!r} measures the reader on queries: "
          "set it to a query cache (for 'evidence', the run's `queries`; for "
          "'utility', built from articles that are not in `queries` with "
          "python -m realm_jax.jobs.query_cache), or use mode='steps'.")
    if self.latest_release == 0:
      raise ValueError(
          f"GateConfig.mode={self.mode!r} with latest_release=0 releases "
          "the retriever at step 0; set latest_release=None (only on the "
          "gate's evidence) or a later bound.")


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks.type_checked
class GuardConfig:
  """Warnings about a collapsing retriever or a stale index.

  Attributes:
    hubness_warning: warn once when the share of the recent queries whose
      top-1 block is the single most common one exceeds this (judged over
      the last `min_queries` queries or more, pooled over log windows; the
      logged `hubness` metric is the last log window's).
    null_probability_warning: warn once when the mean p(null|x) of the
      logged steps covering the last `min_queries` queries exceeds this.
    min_queries: the fewest queries the collapse guards judge: with
      batches of 4, two equal top-1s would read as 50% hubness.
    stale_index_warning: builder mode: warn (once per served index) when it
      is more than this many refresh intervals older than the step (the
      builder died, lags, or cannot write); `index_staleness` is logged as
      a metric every `log_every` steps.
    stale_index_error: builder mode: stop with an error past this many
      intervals (0: never).
  """

  hubness_warning: float = 0.3
  null_probability_warning: float = 0.9
  min_queries: int = 64
  stale_index_warning: float = 4.0
  stale_index_error: float = 0.0

  def __post_init__(self):
    checks.at_least(self, "min_queries")


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks.type_checked
class RecallGuardConfig:
  """The recall guard (off unless `queries` is set; runs/pretrain.gin
  turns it on).

  Attributes:
    queries: a query cache of masked sentences (masked like the run's
      queries; its dev split `<cache>/dev` is read where it has one, as
      the run's own cache has when the query-cache job wrote it:
      `query_cache.held_out`): turns the recall guard on. Every `every` steps (full
      training on an inline index: on refresh steps only,
      `recall_guard.guard_every`) it searches the served index with the
      current query tower and measures recall@`k` of the first
      `num_queries` sentences, as `probe` counts it. The first evaluation,
      while the retriever is still where the run started, is the
      baseline. Once the retriever trains, `patience` evaluations in a row
      more than `max_drop` below the baseline roll the retriever back to
      the run's initial one (`init_from`'s) and freeze it for the rest of
      the run; the gate is not consulted again.
    probe: what a sentence's recall counts: "answer" (a top-`k` block
      holds the sentence's masked span, the blocks the reader's evidence
      points to; any world) or "own_block" (the block that holds the
      sentence itself: ICT's task, which tracks question recall on real
      text, docs/results/learning.md; needs X within Z, as REALM's
      Wikipedia, and refuses a world whose sentences are not in the
      block store).
    every, num_queries, k, max_drop, patience: see `queries`.
  """

  queries: str = checks.path_setting("reads", default="")
  probe: str = "answer"
  every: int = 50
  num_queries: int = 1024
  k: int = 5
  max_drop: float = 0.02
  patience: int = 2

  @property
  def enabled(self) -> bool:
    return bool(self.queries)

  def __post_init__(self):
    _one_of(self, "probe", RECALL_PROBES)
    if self.enabled:
      checks.at_least(self, "every", "num_queries", "k", "patience",
                      integer=True)
      if not 0 <= self.max_drop < 1:
        raise ValueError("RecallGuardConfig.max_drop must be in [0, 1), "
                         f"got {self.max_drop!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig(loop.TrainConfig):
  """A REALM pre-training run (`loop.TrainConfig`; REALM's defaults).

  Attributes:
    queries: the pre-training corpus X as a query cache directory (masked
      REALM queries written by `python -m realm_jax.jobs.query_cache`; its
      shard count a multiple of the host count, at most `batch_size`). The
      cache's manifest says how its queries were made (query_length,
      max_masks, masking: `examples.RealmQueryConfig`); the run reads them
      from there.
    learning_rate: the reader's (the retriever's: `retriever`).
    adam_bias_correction: Adam's bias-corrected moments instead of BERT's
      raw ones (REALM: False); see `optimizer.bert_optimizer`.
    reader_length: the reader's input, query + block; None: the query
      cache's query_length + the block store's max_block_len, as reader
      preparation derives it (REALM: 384 = 96 + 288). It must exceed the
      query_length.
    index_mode: "builder" (REALM: a separate job refreshes the index from
      the checkpoints) or "inline" (rebuilt in-process after a checkpoint:
      small CPU runs, exactly reproducible restarts).
    refresh_every: the index refresh period in steps, a multiple of
      `checkpoint_every` (None: every checkpoint). An inline-mode run
      rebuilds its index after those checkpoints; a builder-mode run's
      builder indexes the checkpoints it reads, and its staleness is
      measured in these intervals.
    index_wait_seconds: builder mode: how long to wait for the first index.
    index_build: how an inline-mode run builds each index (searcher,
      searcher_config, embedding batch, bfloat16, retention, retries): the
      builder job's `builder.IndexBuildConfig`, bound as
      `builder.IndexBuildConfig.<field>` in gin (runs/pretrain.gin), so one
      binding sets both. A builder-mode run does not read it (the builder
      job builds with its own).
    retrieval: each query's candidates (`RetrievalConfig`).
    retriever: how the retriever learns (`RetrieverScheduleConfig`).
    gate: when it is released (`GateConfig`).
    guards: collapse and staleness warnings (`GuardConfig`).
    recall_guard: the recall guard's rollback (`RecallGuardConfig`).
  Options of two parts that exclude each other are refused here, naming
  both (e.g. query-side training with search "device").
  """

  queries: str = checks.path_setting("reads")
  num_train_steps: int = 200_000
  batch_size: int = 512
  learning_rate: float = 3e-5
  adam_bias_correction: bool = False
  reader_length: int | None = None
  checkpoint_every: int = 500
  index_mode: str = "builder"
  refresh_every: int | None = None
  index_wait_seconds: float = 600.0
  index_build: build.IndexBuildConfig = build.IndexBuildConfig()
  retrieval: RetrievalConfig = RetrievalConfig()
  retriever: RetrieverScheduleConfig = RetrieverScheduleConfig()
  gate: GateConfig = GateConfig()
  guards: GuardConfig = GuardConfig()
  recall_guard: RecallGuardConfig = RecallGuardConfig()

  @property
  def refresh_period(self) -> int:
    """The index refresh period in steps."""
    return self.refresh_every or self.checkpoint_every

  def _check_exclusions(self):
    """Options of two parts that exclude each other."""
    if self.retriever.training == "query_side" and (
        self.retrieval.search != "host" or self.retrieval.rerank_candidates):
      raise ValueError(
          "RetrieverScheduleConfig.training='query_side' keeps the index "
          "exact for the whole run: it excludes RetrievalConfig.search="
          "'device' "
          "and RetrievalConfig.rerank_candidates > 0 (got search="
          f"{self.retrieval.search!r}, rerank_candidates="
          f"{self.retrieval.rerank_candidates}).")
    if self.index_mode == "builder" and self.keep_checkpoints < 5:
      raise ValueError("keep_checkpoints must be >= 5 when an index builder "
                       "reads the checkpoints (index_mode='builder').")
    if self.refresh_every is not None and (
        self.refresh_every < 1 or self.refresh_every % self.checkpoint_every):
      raise ValueError(
          f"PretrainConfig.refresh_every={self.refresh_every} must be a "
          f"positive multiple of checkpoint_every={self.checkpoint_every} "
          "(an index is built from a checkpoint); or None: every "
          "checkpoint.")

  def __post_init__(self):
    super().__post_init__()
    _one_of(self, "index_mode", INDEX_MODES)
    self._check_exclusions()

"""The learning benchmark's conditions: what each one changes in the recipe.

Every pre-training condition runs the recipe (`--gin_file`, by default
experiments/pretrain_world_cpu.gin, which includes runs/pretrain.gin) with
its own gin files and bindings on top:

  init            the retriever at its random initialisation (no training)
  ict             ICT warm start only (the baseline REALM must beat)
  realm           ICT + REALM, this repository's default recipe
                  (runs/pretrain.gin, through
                  experiments/pretrain_world_cpu.gin): the retriever is
                  released by the gate (the reader's evidence for
                  answer-bearing blocks on the training queries, with an
                  effect of at least 0.005 nats; the wiki recipes:
                  held-out utility on dev articles) and rolled back by the
                  recall guard if it then loses recall; the reader reads
                  BM25's first 3 blocks beside the dense ones, weighed by
                  half BM25's distribution while the gate holds
  dense_only      the recipe before issue 65: the dense candidates alone
                  (`lexical_candidates = 0`, REALM's prior throughout)
  realm_fixed600  the recipe with the earlier fixed warm-up: the retriever
                  released at step 600 whatever the reader does, unguarded
  query_side      the recipe, query-side training: unshared towers from
                  the ICT tower, the document tower and the index frozen
                  (built once), the query tower and the reader learn
  realm_original  ICT + REALM as the paper's code runs it
                  (runs/pretrain_original.gin, included after the recipe
                  file): one learning rate for both towers, no reader
                  warm-up, the null document scored by the embedding of
                  `[CLS] [SEP] [SEP]`
  frozen          the recipe with the retriever frozen throughout
  stale30         the recipe with the index rebuilt 30x less often
  stale30_rerank  stale30 with Atlas-style re-ranking: the stale index
                  proposes --rerank blocks, the current retriever picks k
  random_masks    the recipe with random-token masks instead of salient
                  spans (evaluated, like all, on held-out salient spans)
  realm_repeat    `realm` again: the same seed must give the same numbers
  realm_slow      (only when named) the recipe with the retriever at 0.01x
  lexical         (only when named) the recipe's BM25 blocks with the
                  reader's prior uniform over the candidates while the gate
                  holds the retriever (`held_prior = "uniform"`)
  lexical_dense   (only when named) the same with REALM's p(z|x) as the
                  reader's prior throughout (the weighting's ablation)
  lexical_mix     (only when named) the recipe's BM25 settings bound
                  explicitly (`held_prior = "mixture"`: half REALM's
                  p(z|x), half the softmax of the candidates' BM25 scores
                  while held); the name its rows were measured under
  lexical_mix_permuted (only when named) `lexical_mix` as a no-information
                  control: each query's retriever gradient comes from the
                  next query's reader likelihoods
                  (`RetrieverScheduleConfig.signal = "permuted"`)

(The ideal-reader diagnostics, ideal_reader, ideal_shuffled and their
query-side pair, and the reader pre-training and adaptation stages were
retired with their trainer options; docs/results/learning.md keeps their
measurements.)
"""

from __future__ import annotations

CONDITIONS = ("init", "ict", "realm", "query_side", "realm_fixed600",
              "frozen", "stale30", "stale30_rerank", "random_masks",
              "realm_repeat", "realm_original", "dense_only")
# Run only when asked for (--conditions=...).
EXTRA_CONDITIONS = ("realm_slow", "lexical", "lexical_dense", "lexical_mix",
                    "lexical_mix_permuted")


def gin_files(name: str, args) -> list[str]:
  """The gin files of a pre-training condition: the recipe file, then for
  `realm_original` REALM's own settings (runs/pretrain_original.gin)."""
  return args.gin_file + (["runs/pretrain_original.gin"]
                          if name == "realm_original" else [])


def bindings(name: str, args) -> list[str]:
  """Gin bindings of a pre-training condition, on top of its gin files."""
  # A release on a step count, unguarded (as these conditions were
  # measured before the recall guard was the default).
  fixed = ["pretrain.GateConfig.mode = 'steps'",
           "pretrain.RecallGuardConfig.queries = ''"]
  query_side = ["pretrain.RetrieverScheduleConfig.training = 'query_side'",
                "realm.RetrieverConfig.share_towers = False"]
  return {
      "realm": [],
      "realm_repeat": [],
      "realm_fixed600": fixed + ["pretrain.GateConfig.latest_release = 600"],
      "query_side": query_side,
      "realm_original": [],
      "frozen": fixed + ["pretrain.GateConfig.latest_release = 0",
                         "pretrain.RetrieverScheduleConfig."
                         "learning_rate_multiplier = 0.0"],
      "stale30": [f"pretrain.PretrainConfig.checkpoint_every = "
                  f"{30 * args.refresh_every}"],
      "stale30_rerank": [f"pretrain.PretrainConfig.checkpoint_every = "
                         f"{30 * args.refresh_every}",
                         "pretrain.RetrievalConfig.rerank_candidates = "
                         f"{args.rerank}"],
      "random_masks": ["examples.RealmQueryConfig.masking = 'random_tokens'"],
      "dense_only": ["pretrain.RetrievalConfig.lexical_candidates = 0",
                     "pretrain.RetrievalConfig.held_prior = 'dense'"],
      "realm_slow": ["pretrain.RetrieverScheduleConfig."
                     "learning_rate_multiplier = 0.01"],
      "lexical": ["pretrain.RetrievalConfig.lexical_candidates = 3",
                  "pretrain.RetrievalConfig.held_prior = 'uniform'"],
      "lexical_dense": ["pretrain.RetrievalConfig.lexical_candidates = 3"],
      "lexical_mix": ["pretrain.RetrievalConfig.lexical_candidates = 3",
                      "pretrain.RetrievalConfig.held_prior = 'mixture'"],
      "lexical_mix_permuted": [
          "pretrain.RetrievalConfig.lexical_candidates = 3",
          "pretrain.RetrievalConfig.held_prior = 'mixture'",
          "pretrain.RetrieverScheduleConfig.signal = 'permuted'"],
  }[name]

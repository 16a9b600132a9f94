"""A learning benchmark run's rows: each evaluated checkpoint, as it is made.

`Evaluator.report` evaluates one set of parameters with
`realm_jax.eval.pretrain_eval` over the run's evaluation corpus (its own
index of the checkpoint's blocks): the held-out masked queries, the
open-domain questions and (vital) the cloze probe. Each row is printed
and appended to --output at once, so a long run's finished conditions
survive an interruption.
"""

from __future__ import annotations

import json

from benchmarks.learning.prepare import Inputs


class Evaluator:
  """Evaluates checkpoints of a run and keeps (and writes) their rows."""

  def __init__(self, inputs: Inputs, output: str | None):
    self.inputs = inputs
    self._bm25 = None  # BM25's own recall of the held-out gold blocks.
    self.out = open(output, "w", encoding="utf-8") if output else None  # pylint: disable=consider-using-with
    self.rows = []

  def write(self, row: dict) -> None:
    self.rows.append(row)
    if self.out:
      self.out.write(json.dumps(row) + "\n")
      self.out.flush()

  def report(self, condition, step, params, model, seconds=None,
             block_emb=None):
    """One checkpoint's row: held-out masked queries, the questions and
    (vital) the cloze probe, over the evaluation corpus."""
    from realm_jax.eval import pretrain_eval  # pylint: disable=g-import-not-at-top
    from realm_jax.index import embed  # pylint: disable=g-import-not-at-top
    inputs = self.inputs
    if block_emb is None or len(block_emb) != len(inputs.eval_store):
      block_emb, _ = embed.embed_block_store(
          params["retriever"], model.retriever, inputs.eval_store,
          log_every_seconds=1e9)
    common = dict(num_candidates=inputs.recipe.retrieval.num_candidates,
                  reader_length=inputs.reader_length,
                  trivial_candidates=inputs.args.trivial, block_emb=block_emb)
    row = {"condition": condition, "step": step, **pretrain_eval.evaluate(
        params, model, inputs.eval_store, inputs.heldout, inputs.gold,
        questions=inputs.world.questions,
        question_length=inputs.query_config.query_length,
        question_inputs=inputs.question_inputs,
        qa_ks=(1, 5, 20, 100) if inputs.cloze else (1, 5, 20), **common)}
    if inputs.cloze:
      cloze = pretrain_eval.evaluate(params, model, inputs.eval_store,
                                     *inputs.cloze, **common)
      row.update({f"cloze_{k}": cloze[k] for k in (
          "recall@1", "recall@5", "mlm_accuracy_marginal",
          "mlm_accuracy_null", "mlm_accuracy_gold")})
    if inputs.gold is not None:
      # Beside the dense retriever's recall, BM25's (the same for every
      # row): a gain of a lexical condition cannot be BM25's own.
      if self._bm25 is None:
        from realm_jax.training import candidates  # pylint: disable=g-import-not-at-top
        self._bm25 = candidates.bm25_recall(
            inputs.eval_store, inputs.heldout, inputs.gold,
            inputs.args.trivial)
      row.update(self._bm25)
    if seconds is not None:
      row["train_seconds"] = round(seconds, 1)
    line = {k: round(v, 4) if isinstance(v, float) else v
            for k, v in row.items()}
    print(json.dumps({k: v for k, v in line.items()
                      if k != "qa_answer_rank"}), flush=True)
    self.write(line)

  def evaluate_run(self, condition, model, ckpt_dir, seconds, every,
                   first=0, block_emb=None):
    """A row for every `every`th checkpoint of a run from step `first`, and
    for its last (which carries the run's training time)."""
    from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
    ckpt = checkpoints.TrainCheckpointer(ckpt_dir, async_save=False)
    try:
      for step in ckpt.all_steps():
        if step >= first and (step % every == 0
                              or step == ckpt.latest_step()):
          self.report(condition, step, ckpt.restore_params(step), model,
                      seconds if step == ckpt.latest_step() else None,
                      block_emb=block_emb)
    finally:
      ckpt.close()

  def report_init(self):
    """The row of the retriever at its random initialisation (`init`)."""
    from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
    from realm_jax.model.realm import Realm  # pylint: disable=g-import-not-at-top
    _, fresh = functional.init(lambda r: Realm(self.inputs.model, rngs=r),
                               self.inputs.args.seed)
    self.report("init", 0, fresh, self.inputs.model)

  def close(self):
    if self.out:
      self.out.close()

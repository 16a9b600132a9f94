"""Ask REALM a question: the answer span, its score and its evidence.

The command line of the answering model (`realm_jax.eval.qa_model`, where
the model itself lives, shared with the evaluation):

    python -m realm_jax.ask --workdir=W --block_store=B \\
        --gin_file=experiments/eval_tiny_cpu.gin "Where was Mozart born?"
    python -m realm_jax.ask --init_from=orqa:CKPT --index_dir=I \\
        --block_store=B --gin_file=models/bert_base.gin --json "..."

From Python:

    model = qa_model_lib.load_qa_model(model_config=..., store=..., workdir=...)
    result = ask("Where was Mozart born?", model)
    result.prediction, result.score, result.evidence[0].probability
"""

from __future__ import annotations

import json
from typing import Sequence

from realm_jax.eval import qa_eval
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.eval.qa_model import QAModel, QAResult
from realm_jax.model.realm import RealmConfig
from realm_jax.training import qa_inputs


def ask(question: str, qa_model: QAModel, top_k: int = 5) -> QAResult:
  """Answers one question.

  Args:
    question: the question.
    qa_model: the answering model.
    top_k: evidence blocks to return (the block the answer came from is
      always among them).

  Returns:
    The answer, its score and the evidence blocks with p(z|x).
  """
  return qa_model.predict([question], num_evidence=top_k)[0]


def format_result(result: QAResult, snippet_chars: int = 200) -> str:
  """Human-readable answer with its evidence."""
  lines = [f"Q: {result.question}",
           f"A: {result.prediction or '(no answer)'}    score "
           f"{result.score:.3f}, from block {result.block_id}", "Evidence:"]
  for e in result.evidence:
    text = " ".join(e.text.split())
    if len(text) > snippet_chars:
      text = text[:snippet_chars - 3].rstrip() + "..."
    mark = "  <- answer" if e.block_id == result.block_id else ""
    lines.append(f"  #{e.rank + 1} p(z|x)={e.probability:.3f} "
                 f"logit={e.retrieval_logit:.3f} [{e.title}] (block "
                 f"{e.block_id}){mark}")
    lines.append(f"      {text}")
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", None, "A run's workdir (checkpoints/ and "
                      "index/ inside).")
  flags.DEFINE_string("checkpoint_dir", None, "Checkpoint directory.")
  flags.DEFINE_integer("step", -1, "Checkpoint step (default newest).")
  flags.DEFINE_string("init_from", None, "Imported weights, e.g. "
                      "orqa:<ckpt> or hf_realm:<file>.")
  flags.DEFINE_string("index_dir", None, "Published index root.")
  flags.DEFINE_integer("index_step", -1, "Index step (default LATEST).")
  flags.DEFINE_string("block_store", None, "Block store directory.",
                      required=True)
  flags.DEFINE_multi_string("question", [], "A question (or give them as "
                            "positional arguments).")
  flags.DEFINE_integer("top_k", 5, "Evidence blocks per answer.")
  flags.DEFINE_integer("snippet_chars", 200, "Evidence text shown.")
  flags.DEFINE_bool("json", False, "One JSON object per question.")


def _job(dry_run: bool, args: Sequence[str]) -> None:
  """`gin_cli.run`'s job: gin is parsed, the XLA flags are set and the
  distributed runtime is joined when this runs."""
  import gin  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  questions = list(f.question) + list(args)
  model_config = qa_eval.configured(RealmConfig)
  qa_config = qa_eval.configured(qa_inputs.QAConfig)
  if dry_run:
    print(gin.operative_config_str())
    print(model_config)
    print(qa_config)
    return
  if not questions:
    raise SystemExit('Ask something: python -m realm_jax.ask ... "Where was '
                     'Mozart born?"')
  store = block_store.BlockStore.open(f.block_store)
  model = qa_model_lib.load_qa_model(
      model_config=model_config, store=store, workdir=f.workdir,
      checkpoint_dir=f.checkpoint_dir,
      step=None if f.step < 0 else f.step, init_from=f.init_from,
      index_dir=f.index_dir,
      index_step=None if f.index_step < 0 else f.index_step,
      qa_config=qa_config, batch_size=1, num_evidence=f.top_k)
  for result in model.predict(questions, num_evidence=f.top_k):
    if f.json:
      print(json.dumps(result.to_json(), ensure_ascii=False), flush=True)
    else:
      print(format_result(result, f.snippet_chars) + "\n", flush=True)


if __name__ == "__main__":
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  _define_flags()
  gin_cli.run(_job, positional_args=True)

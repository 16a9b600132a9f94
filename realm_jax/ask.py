"""Ask REALM a question: the answer span, its score and its evidence.

The answering model (`realm_jax.eval.qa_model`, where the model itself
lives, shared with the evaluation) asked; its command line, `realm-ask`, is
`realm_jax.jobs.ask`:

    python -m realm_jax.jobs.ask --gin_file=experiments/eval_tiny_cpu.gin \\
        --gin.WORKDIR="'W'" --gin.BLOCK_STORE="'B'" "Where was Mozart born?"
    python -m realm_jax.jobs.ask --gin_file=models/bert_base.gin \\
        --gin_file=runs/eval.gin --gin.INIT_FROM="'orqa:CKPT'" \\
        --gin.INDEX_DIR="'I'" --gin.BLOCK_STORE="'B'" --json "..."

The weights, index and blocks are `qa_eval.EvalConfig`'s (runs/eval.gin),
and so is the ranker whose blocks the reader reads
(`--gin.qa_eval.EvalConfig.ranker="'hybrid'"`: dense, bm25 or hybrid;
each evidence block says which ranker found it, at what rank; the hybrid
with the default fusion ranks as `realm-calibrate`'s file beside the index
says, else by the fixed rule, and the answers say which: a "Ranker:"
line, JSON "ranker");
a checkpoint's own model config and QA sizes are used
(`qa_eval.checked_run_configs`). --json, --top_k and --snippet_chars only
change how answers are shown. Weights whose span head was never trained
(e.g. INIT_FROM='minilm') answer with a notice (JSON: "notice"). An empty
question is an error, and so is one that is not UTF-8 (bytes on the
command line, or a line of a `--flagfile` of questions), before the model
loads; one longer than `QAConfig.question_length` is
answered from its first wordpieces with a warning saying how many were kept
(JSON: "warning").

From Python:

    model = qa_model_lib.load_qa_model(model_config=..., store=..., workdir=...)
    result = ask("Where was Mozart born?", model)
    result.prediction, result.score, result.evidence[0].probability
"""

from __future__ import annotations

from realm_jax.eval.qa_model import QAModel, QAResult


def ask(question: str, qa_model: QAModel, top_k: int = 5) -> QAResult:
  """Answers one question.

  Args:
    question: the question.
    qa_model: the answering model.
    top_k: evidence blocks to return (the block the answer came from is
      always among them).

  Returns:
    The answer, its score and the evidence blocks with p(z|x).

  Raises:
    ValueError: the question is empty or whitespace. One longer than the
      model's question length is answered from its first wordpieces, with
      a warning saying how many were kept (`QAModel.ask`).
  """
  return qa_model.ask(question, top_k=top_k)


def format_result(result: QAResult, snippet_chars: int = 200) -> str:
  """Human-readable answer with its evidence (a question longer than
  `snippet_chars` is shown cut, saying how long it was)."""
  question = " ".join(result.question.split())
  if len(question) > snippet_chars:
    question = (f"{question[:snippet_chars - 3].rstrip()}... "
                f"({len(result.question)} characters)")
  lines = [f"Q: {question}",
           f"A: {result.prediction or '(no answer)'}    score "
           f"{result.score:.3f}, from block {result.block_id}", "Evidence:"]
  for e in result.evidence:
    text = " ".join(e.text.split())
    if len(text) > snippet_chars:
      text = text[:snippet_chars - 3].rstrip() + "..."
    mark = "  <- predicted span" if e.block_id == result.block_id else ""
    found = ", ".join(f"{name} #{rank}" for name, rank in e.found_by.items())
    lines.append(f"  #{e.rank + 1} p(z|x)={e.probability:.3f} "
                 f"logit={e.retrieval_logit:.3f} [{e.title}] (block "
                 f"{e.block_id}{'; found by ' + found if found else ''})"
                 f"{mark}")
    lines.append(f"      {text}")
  return "\n".join(lines)

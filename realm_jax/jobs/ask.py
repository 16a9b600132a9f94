"""`realm-ask`: questions answered on the command line (`ask`), with their
evidence; the questions are the positional arguments (or a `--flagfile`)."""

import json
import sys
from typing import Sequence

from realm_jax import ask as ask_lib
from realm_jax import gin_cli
from realm_jax.core import checkpoints, checks, gin_config
from realm_jax.data import block_store, qa_inputs
from realm_jax.eval import qa_eval
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.model.realm import RealmConfig


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_integer("top_k", 5, "Evidence blocks per answer.")
  flags.DEFINE_integer("snippet_chars", 200, "Evidence text shown.")
  flags.DEFINE_bool("json", False, "One JSON object per question.")


def job(dry_run: bool, questions: Sequence[str]) -> None:
  """`gin_cli.run`'s job: gin is parsed, the XLA flags are set and the
  distributed runtime is joined when this runs."""
  import gin  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  config = gin_config.configured(qa_eval.EvalConfig)
  model_config = gin_config.configured(RealmConfig)
  qa_config = gin_config.configured(qa_inputs.QAConfig)
  if dry_run:
    print(gin.operative_config_str())
    print(config, model_config, qa_config, sep="\n")
    return
  if not questions:
    raise SystemExit('Ask something: python -m realm_jax.jobs.ask ... "Where '
                     'was Mozart born?"')
  # Before the model loads (which takes a while): an empty argument is a
  # mistake (an unset shell variable), never a question; so are bytes that
  # are not UTF-8 (a Latin-1 terminal or file), which nothing could read.
  for i, question in enumerate(questions):
    if not question.strip():
      raise SystemExit(f"Question {i + 1} of {len(questions)} is empty "
                       f"({question!r}); ask something: python -m "
                       'realm_jax.ask ... "Where was Mozart born?"')
    problem = checks.utf8_problem(question)
    if problem:
      raise SystemExit(
          f"Question {i + 1} of {len(questions)} is {problem}: "
          f"'{checks.shown_bytes(question)}'; ask it in UTF-8 (set "
          "the terminal to UTF-8, or convert the file it came from: iconv "
          "-f latin1 -t utf-8).")
  if f.top_k < 1:
    raise SystemExit(f"--top_k={f.top_k}: give how many evidence blocks to "
                     "show with each answer, at least 1.")
  qa_eval.require(config, block_store="BLOCK_STORE")
  checkpoint_dir = config.checkpoint_dir or (
      checkpoints.checkpoint_dir(config.workdir) if config.workdir else None)
  if checkpoint_dir and not config.init_from:
    model_config, qa_config = qa_eval.checked_run_configs(
        checkpoint_dir, config.step, model_config, qa_config,
        gin_cli.command_line_bindings())
  model = qa_model_lib.load_qa_model(
      model_config=model_config,
      store=block_store.BlockStore.open(config.block_store),
      workdir=config.workdir, checkpoint_dir=config.checkpoint_dir,
      step=config.step, init_from=config.init_from,
      index_dir=config.index_dir, index_step=config.index_step,
      qa_config=qa_config, batch_size=1, num_evidence=f.top_k,
      **qa_eval.ranker_kwargs(config))
  notice = (None if model.span_head_trained else
            "Notice: " + qa_model_lib.UNTRAINED_SPAN_HEAD)
  if notice and not f.json:
    print(notice + "\n", flush=True)
  # A question longer than the model reads is answered from its start,
  # with a warning saying how much of it was read.
  try:
    warnings = [model.check_question(q) for q in questions]
  except ValueError as e:  # No wordpieces (e.g. control characters only).
    raise SystemExit(str(e)) from e
  # Which blocks the reader reads, with which weights and from where (the
  # calibration beside the index, the fixed rule, or the configuration).
  ranker = model.ranker_choice.record()
  describe = getattr(model.ranker_choice, "describe", None)
  if not f.json:
    print(f"Ranker: {describe() if describe else ranker['ranker']}\n",
          flush=True)
  for result, warning in zip(
      model.predict(questions, num_evidence=f.top_k), warnings):
    if f.json:
      row = dict(result.to_json(), ranker=ranker,
                 **({"notice": notice} if notice else {}),
                 **({"warning": warning} if warning else {}))
      print(json.dumps(row, ensure_ascii=False), flush=True)
    else:
      if warning:
        print(f"Warning: {warning}", flush=True)
      print(ask_lib.format_result(result, f.snippet_chars) + "\n", flush=True)


def check_flagfiles(argv: Sequence[str]) -> None:
  """Refuses a `--flagfile` (a file of questions: absl reads each line
  that is not a flag or a comment as a positional argument) with a line
  that is not UTF-8, naming the file, the line and the question's number
  there, before absl stops on a UnicodeDecodeError.

  Raises:
    SystemExit: such a line.
  """
  paths, args = [], iter(argv[1:])
  for arg in args:
    if arg == "--":
      break
    if arg.lstrip("-").startswith("flagfile="):
      paths.append(arg.split("=", 1)[1])
    elif arg in ("--flagfile", "-flagfile"):
      paths.append(next(args, ""))
  for path in paths:
    try:
      with open(path, "rb") as f:
        lines = f.read().splitlines()
    except OSError:
      continue  # absl says what is wrong with it.
    number = 0
    for line_number, raw in enumerate(lines, start=1):
      line = raw.strip()
      if not line or line.startswith((b"#", b"//")):
        continue
      question = not line.startswith(b"-")
      number += question
      text = raw.decode("utf-8", "surrogateescape")
      problem = checks.utf8_problem(text)
      if problem:
        raise SystemExit(
            f"{f'Question {number}' if question else 'A flag'} of "
            f"--flagfile={path} (line {line_number}) is {problem}: "
            f"'{checks.shown_bytes(text.strip())}'; save the file as UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8 {path}).")


def main() -> None:
  check_flagfiles(sys.argv)
  _define_flags()
  gin_cli.run(job, positional_args=True, runs_file="runs/eval.gin",
              config_class="realm_jax.eval.qa_eval.EvalConfig")


if __name__ == "__main__":
  main()

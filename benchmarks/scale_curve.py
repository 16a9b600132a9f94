r"""The scale curve of issue 47 (item 6): ICT vs ICT + REALM as Z grows.

    python -m benchmarks.scale_curve \
        --runs=1000=$D/n1k.jsonl,10033=$D/n.jsonl \
        --baselines=1000=$D/bm25_1000.jsonl,10033=$D/bm25.jsonl \
        --plot=$D/scale.png

`--runs`: for each number of leads, the JSON lines of one
`python -m benchmarks.learning --world=vital --num_documents=N` run (its
"ict" condition and one or more REALM conditions, with per-question
ranks).
`--baselines`: the SQuAD rows of `benchmarks/real_text.py
--num_documents=N` over the same blocks (BM25, MiniLM).

Prints one Markdown table: SQuAD-open answer recall@k of each retriever
at each size, each REALM condition's difference from the ICT it started
from on the same questions (+- standard error), the step the utility gate
released the retriever at, and the largest hubness and p(null) of its
training. `--plot` draws recall@5 against the number of leads, and the
paired differences with two standard errors.
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np

from benchmarks.learning.tables import paired_difference

KS = (1, 5, 20, 100)
PAIRED_KS = (5, 20)
BASELINES = ("bm25", "minilm")  # real_text.py's own retrievers


def _spec(text: str) -> dict[int, str]:
  """"N=path,N=path" -> {N: path}."""
  out = {}
  for item in filter(None, text.split(",")):
    n, _, path = item.partition("=")
    if not (n.isdigit() and path):
      raise ValueError(f"{item!r} is not <number of leads>=<jsonl path>.")
    out[int(n)] = path
  return out


def _read(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def run_rows(leads: int, rows: list[dict], path: str) -> list[dict]:
  """One learning benchmark run -> a row per condition (its last ranked
  checkpoint), REALM conditions paired against "ict"."""
  last = {r["condition"]: r for r in rows if "qa_answer_rank" in r}
  summaries = {r["condition"]: r for r in rows if "summary" in r}
  if "ict" not in last:
    raise ValueError(f"{path}: no 'ict' row with per-question ranks "
                     "(qa_answer_rank): not a --world=vital run.")
  base = last["ict"]["qa_answer_rank"]
  out = []
  for name, r in last.items():
    s = summaries.get(name, {})
    out.append({
        "leads": leads, "retriever": name, "step": r["step"],
        **{f"recall@{k}": r[f"qa_recall@{k}"] for k in KS},
        **({} if name == "ict" else {
            f"paired@{k}": paired_difference(r["qa_answer_rank"], base, k)
            for k in PAIRED_KS}),
        "released": s.get("retriever_release_step"),
        "max_hubness": s.get("train_max_hubness"),
        "max_null_probability": s.get("train_max_null_probability")})
  return out


def baseline_rows(leads: int, rows: list[dict]) -> list[dict]:
  """real_text.py's SQuAD rows of BM25 and MiniLM (no "task" field:
  SQuAD; its rows of trained checkpoints are left out)."""
  return [{"leads": leads, "retriever": r["retriever"], "step": None,
           **{f"recall@{k}": r[f"recall@{k}"] for k in KS}}
          for r in rows if r.get("task", "squad") == "squad"
          and r["retriever"] in BASELINES]


def collect(runs: dict[int, str], baselines: dict[int, str]) -> list[dict]:
  """Every row, by number of leads: baselines first."""
  out = []
  for leads in sorted(set(runs) | set(baselines)):
    if leads in baselines:
      out += baseline_rows(leads, _read(baselines[leads]))
    if leads in runs:
      out += run_rows(leads, _read(runs[leads]), runs[leads])
  return out


def _cell(value, fmt: str) -> str:
  return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
  """The Markdown table, in %/points."""
  head = " | ".join(f"@{k}" for k in KS)
  pairs = " | ".join(f"- ICT @{k}" for k in PAIRED_KS)
  lines = [f"| leads | retriever | step | {head} | {pairs} | released at "
           "| max hubness | max p(null) |",
           "|---" * (3 + len(KS) + len(PAIRED_KS) + 3) + "|"]
  for r in rows:
    cells = [f"{100 * r[f'recall@{k}']:.1f}" for k in KS]
    cells += [f"{100 * r[f'paired@{k}'][0]:+.1f} +- "
              f"{100 * r[f'paired@{k}'][1]:.1f}" if f"paired@{k}" in r
              else "-" for k in PAIRED_KS]
    released = r.get("released")
    cells += ["-" if r["retriever"] == "ict" or r["step"] is None
              else "never" if released is None else str(released),
              _cell(r.get("max_hubness"), ".3f"),
              _cell(r.get("max_null_probability"), ".2f")]
    lines.append(f"| {r['leads']} | {r['retriever']} | "
                 f"{_cell(r['step'], 'd')} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _kind(retriever: str) -> str:
  """A line of the plot: a retriever, its seeds together ("realm_seed1")."""
  return re.sub(r"_seed\d+$", "", retriever)


def plot(rows: list[dict], path: str) -> None:
  """recall@5 against the number of leads (left); each REALM run minus its
  ICT at @5 and @20, +- 2 standard errors (right)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  kinds = {}
  for r in rows:
    kinds.setdefault(_kind(r["retriever"]), {}).setdefault(
        r["leads"], []).append(r)
  for kind, by_leads in kinds.items():
    xs = sorted(by_leads)
    left.plot(xs, [np.mean([100 * r["recall@5"] for r in by_leads[x]])
                   for x in xs], marker="o", label=kind,
              ls="--" if kind == "ict" else "-")  # (REALM may hide ICT)
  left.set(xscale="log", yscale="log", xlabel="leads in Z",
           ylabel="answer recall@5 (%), mean of seeds",
           title="SQuAD-open, 10,565 questions")
  left.legend(fontsize=8)
  paired_kinds = [k for k, v in kinds.items()
                  if any(f"paired@{PAIRED_KS[0]}" in r
                         for rs in v.values() for r in rs)]
  for i, (kind, k) in enumerate((kind, k) for kind in paired_kinds
                                for k in PAIRED_KS):
    points = [(r["leads"] * (1 + 0.05 * (i - 1)), *r[f"paired@{k}"])
              for rs in kinds[kind].values() for r in rs]
    x, d, se = map(np.array, zip(*points))
    right.errorbar(x, 100 * d, yerr=200 * se, fmt="os^v"[i % 4],
                   capsize=3, label=f"{kind} @{k}")
  right.axhline(0, color="grey", lw=0.8)
  right.axhline(5, color="red", lw=0.8, ls="--", label="target (b): +5 @5")
  right.set(xscale="log", xlabel="leads in Z",
            ylabel="ICT + REALM - ICT (points)",
            title="paired, each seed, +- 2 standard errors")
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.scale_curve",
      description=__doc__.split("\n")[0])
  parser.add_argument("--runs", required=True,
                      help="N=<benchmarks.learning --world=vital jsonl>,...")
  parser.add_argument("--baselines", default="",
                      help="N=<real_text.py jsonl>,...")
  parser.add_argument("--plot", default=None, help="A PNG here.")
  args = parser.parse_args(argv)
  try:
    rows = collect(_spec(args.runs), _spec(args.baselines))
  except ValueError as e:
    parser.error(str(e))
  print(table(rows))
  if args.plot:
    plot(rows, args.plot)


if __name__ == "__main__":
  main()

"""The curves of a learning benchmark run's rows (`--plot`, a PNG).

One panel per metric against the REALM step (ICT and init as horizontal
lines), then, where the rows have them, the paired difference from ICT
(real text) and the gate's and the recall guard's decisions (summary
rows).
"""

from __future__ import annotations

from benchmarks.learning import tables


def plot(rows, path: str) -> None:
  """Held-out recall, reader accuracy, utility, p(null) and hubness per
  step; and each gated condition's gate decisions (summary rows)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  # The summary rows' logs, by condition (reader_mlm and reader_adaptation:
  # the retired reader stages, in older results).
  logs = {name: {r["condition"]: read(r) for r in rows if r.get(name)}
          for name, read in (
              ("gate", lambda r: r["gate"]),
              ("recall_guard", lambda r: r["recall_guard"]),
              ("reader_adaptation", lambda r: r["reader_adaptation"]["curve"]),
              ("reader_mlm", lambda r: r["reader_mlm"]["curve"]))}
  evals = [r for r in rows if "summary" not in r]
  panels = _panels(rows, evals, logs)
  cols = min(len(panels), 5)
  rows_of_panels = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows_of_panels, cols,
                           figsize=(5 * cols, 4 * rows_of_panels),
                           squeeze=False)
  for ax in axes.flat[len(panels):]:
    ax.set_visible(False)
  axes = axes.flat
  conditions = list(dict.fromkeys(r["condition"] for r in evals))
  for ax, (key, title) in zip(axes, panels):
    if key == "paired":
      _plot_paired(ax, evals, conditions, title)
    elif key in ("gate", "gate_z"):
      _plot_gate(ax, key, title, logs["gate"])
    elif key in ("reader_mlm", "reader_mlm_utility"):
      _plot_reader_mlm(ax, key, title, logs["reader_mlm"])
    elif key in ("adaptation", "adaptation_utility"):
      _plot_adaptation(ax, key, title, logs["reader_adaptation"])
    elif key == "guard":
      _plot_guard(ax, title, logs["recall_guard"], conditions)
    else:
      _plot_metric(ax, key, title, evals, conditions)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def _panels(rows, evals, logs) -> tuple:
  """(key, title) of each panel: the metrics the rows have, then the
  paired difference from ICT and the summary rows' logs, where present."""
  recall = "recall@1" if "recall@1" in rows[0] else "qa_recall@1"
  panels = ((recall, f"held-out {recall}"),) + (
      (("qa_recall@5", "held-out qa_recall@5"),) if recall == "qa_recall@1"
      else ()) + (
      (("span_recall", "held-out span recall (a block holding the masked "
        "span read)"),) if "span_recall" in rows[0] else ()) + (
          ("mlm_accuracy_marginal", "held-out masked-token accuracy"),
          ("retrieval_utility", "held-out retrieval utility (nats)"),
          ("null_probability", "p(null | x)"),
          ("hubness", "hubness")) + (
      (("score_spread", "held-out score spread: std of f(x, z) over Z"),)
      if any("score_spread" in r for r in rows) else ())
  ranked = tables.last_ranked(evals)
  if "ict" in ranked and len(ranked) > 1:  # (as paired_table)
    panels += (("paired", "qa_recall@5 minus ICT's, on the same "
                "questions (+- 1 s.e.)"),)
  for log, more in (
      ("reader_mlm", (("reader_mlm", "reader masked-LM: held-out accuracy"),
                      ("reader_mlm_utility", "reader masked-LM: neighbour "
                       "utility (nats)"))),
      ("gate", (("gate", "gate: utility on its queries (nats)"),
                ("gate_z", "gate: evidence z on its queries"))),
      ("recall_guard", (("guard", "recall guard"),)),
      ("reader_adaptation", (("adaptation", "reader adaptation: held-out "
                              "accuracy"),
                             ("adaptation_utility", "reader adaptation: "
                              "held-out utility (nats)")))):
    if logs[log]:
      panels += more
  return panels


def _plot_metric(ax, key, title, evals, conditions) -> None:
  """One metric per step: a line per condition, ICT's and init's last
  value as horizontal lines."""
  for c in conditions:
    pts = [(r["step"], r[key]) for r in evals
           if r["condition"] == c and key in r]  # (older rows lack some)
    if not pts:
      continue
    if c in ("init", "ict"):
      ax.axhline(pts[-1][1], linestyle="--", linewidth=1, label=c,
                 color="grey" if c == "init" else "black")
    else:
      # One colour per condition in every panel, even where some lack it.
      ax.plot(*zip(*pts), marker="o", markersize=3, label=c,
              color=f"C{conditions.index(c) % 10}")
  ax.set_title(title)
  ax.set_xlabel("REALM step")


def _plot_gate(ax, key, title, gates) -> None:
  """The gate's measured utility ("gate") or evidence z ("gate_z") at
  each of its decisions."""
  for c, decisions in gates.items():
    ax.plot([d["step"] for d in decisions],
            [d["utility" if key == "gate" else "evidence_z"]
             for d in decisions], marker="o", markersize=3, label=c)
  ax.set_title(title)
  ax.set_xlabel("REALM step")


def _plot_guard(ax, title, guards, conditions) -> None:
  """The recall guard's recall on its probes, its baseline (dashed) and
  its rollbacks (red)."""
  for c, decisions in guards.items():
    recall = next(k for k in decisions[0] if k.startswith("recall@"))
    probe = decisions[0].get("probe", "own-block")  # (older logs)
    curves = [x for x in conditions if x not in ("init", "ict")]
    ax.plot([d["step"] for d in decisions],
            [d[recall] for d in decisions], marker="o", markersize=3,
            label=f"{c} ({probe} {recall})",
            color=f"C{curves.index(c)}" if c in curves else None)
    for d in decisions:
      if d["rolled_back"]:
        ax.axvline(d["step"], color="red", linewidth=1)
    ax.axhline(decisions[0]["baseline"], color="grey", linestyle="--",
               linewidth=1)
  ax.set_title(f"{title}: recall on its probes")
  ax.set_xlabel("REALM step")
  ax.legend(fontsize=8)


def _plot_reader_mlm(ax, key, title, pretrained) -> None:
  """The retired reader pre-training stage's curves (older results)."""
  for c, curve in pretrained.items():
    steps = [p["step"] for p in curve]
    for name in (("accuracy_neighbour", "accuracy_other")
                 if key == "reader_mlm" else ("neighbour_utility",)):
      ax.plot(steps, [p[name] for p in curve], marker="o", markersize=3,
              linestyle=":" if name == "accuracy_other" else "-",
              label=f"{c}: {name.replace('accuracy_', 'with ')}")
  ax.set_title(title)
  ax.set_xlabel("masked-LM step (before REALM)")
  ax.legend(fontsize=8)


def _plot_adaptation(ax, key, title, adapted) -> None:
  """The retired reader adaptation stage's curves (older results)."""
  for c, curve in adapted.items():
    steps = [p["step"] for p in curve]
    for doc, style in (("null", ":"), ("random", "--"), ("answer", "-")):
      name = (f"accuracy_{doc}" if key == "adaptation" else
              "utility" if doc == "answer" else "random_utility")
      if doc == "null" and key != "adaptation":
        continue
      ax.plot(steps, [p[name] for p in curve], linestyle=style,
              marker="o", markersize=3, label=f"{c}: {doc}")
  if key == "adaptation_utility":
    ax.axhline(0.0, color="grey", linestyle="--", linewidth=1)
  ax.set_title(title)
  ax.set_xlabel("adaptation step (before REALM)")
  ax.legend(fontsize=8)


def _plot_paired(ax, rows, conditions, title: str, k: int = 5) -> None:
  """Each checkpoint's qa_recall@k minus ICT's last, question by question,
  with one standard error (`tables.paired_difference`)."""
  base = tables.last_ranked(rows)["ict"]["qa_answer_rank"]
  for c in conditions:
    pts = [(r["step"],
            *tables.paired_difference(r["qa_answer_rank"], base, k))
           for r in rows if r["condition"] == c and "qa_answer_rank" in r]
    if c in ("init", "ict") or not pts:
      continue
    steps, d, se = zip(*pts)
    ax.errorbar(steps, d, yerr=se, marker="o", markersize=3, capsize=2,
                label=c, color=f"C{conditions.index(c) % 10}")
  ax.axhline(0.0, color="black", linestyle="--", linewidth=1)
  ax.set_title(title)
  ax.set_xlabel("REALM step")

r"""Zero-shot SQuAD-open over the Vital Articles' leads (issue 47, item 4).

    python benchmarks/data/fetch_public.py --cache_dir=/work/cache \
        --output_dir=/tmp/public_data --squad_dev=/data/dev-v1.1.json
    python benchmarks/real_text.py --data_dir=/tmp/public_data \
        --workdir=/tmp/real_text --output=docs/results/real_text.jsonl
    # The leads alone (fetch_public --sets=leads): the describe task.
    python benchmarks/real_text.py --data_dir=/tmp/public_data \
        --workdir=/tmp/real_text --tasks=describe

Z is the 10,033 leads (`vital_leads.jsonl`) followed by the 2,067 SQuAD
v1.1 dev paragraphs (`squad_dev_paragraphs.jsonl`), each as blocks of at
most `--max_block_len` (128) wordpieces built by the corpus job: the
leads' store `vital/` and the union's `union/`, which begins with the
leads' blocks (`block_store.check_extends`). Every one of the 10,565 dev
questions is asked (none is ever trained on), with these retrievers:

  bm25    BM25 over the union's blocks (`realm_jax.index.bm25`: bm25s,
          k1 0.9, b 0.4, title + text of each block), the leads' index
          built beside their store and extended with the paragraphs.
  minilm  MiniLM-L6 in both towers (models/minilm_l6.gin: mean pooling,
          L2 norm; `init_from="minilm"`), as the demo starts: the index of
          the leads is published by the one-shot builder path
          (`build.build_and_publish`), then the SQuAD paragraphs are
          added without re-embedding the leads (`index.extend`), and the
          questions are searched in the merged index (exact MIPS).
  --checkpoints=name=<dir>[@step]
          a trained retriever (e.g. ICT or REALM from
          `benchmarks.learning --world=vital`), of the model
          `--gin_file` configures, indexed the same way: its leads' index
          extended with the paragraphs, which it never saw in training.

  hybrid  MiniLM and BM25 fused (`realm_jax.index.rankers.HybridRanker`,
          the product's default `FusionConfig` unless --fusion,
          --dense_weight, --bm25_weight say otherwise); --hybrids=<name>
          fuses BM25 with a --checkpoints retriever (rows hybrid-<name>).

Every retriever is one of the product's rankers (`realm_jax.index.rankers`);
this script only builds the stores and indices and scores the rankings.
`--tune_fusion=<SQuAD JSON>` instead sweeps the fusion weights on a dev
set of your own questions (never a benchmark file that carries a canary),
asked over the leads + its own paragraphs. The product's default fusion is
a fixed rule and was not chosen this way.

For each: recall@k (an answer string in the text of a top-k block: the QA
eval's `aggregate_metrics` over its predictions, written to
`<workdir>/predictions/<retriever>.jsonl`) and gold recall@k (a block of
the question's own SQuAD paragraph in the top k), k = 1, 5, 20, 100. One
JSON line per retriever and task on stdout and in `--output` ("seconds":
ranking and scoring the questions; "setup_seconds": indexing).

`--tasks` (comma-separated) chooses what is asked; each needs its files
in --data_dir (`benchmarks/public_sources.py`; a missing one stops the
run at once, naming every route to it, before anything is written):

  squad     SQuAD-open, as above. Needs the SQuAD files (fetch_public
            --squad_dev or --bigbench_sdist); only this task adds the
            SQuAD paragraphs to the corpus: without it Z is the leads.
  cloze     the qa_wikidata prompts about a lead (`wikidata_cloze.jsonl`,
            evaluation only; fetch_public --bigbench_sdist) asked as
            questions: recall@k of a block holding the answer, gold
            recall@k of a block of the subject's lead (the data of the
            cloze probe, issue 47 item 5; the reader's masked-span
            accuracy is not measured here).
  describe  needs the leads alone (issue 66): each lead's Wikidata
            description (`vital_leads.jsonl`'s "description", which the
            corpus does not index) asked as a question, where it names
            one lead only and not the lead's own name: gold recall@k of a
            block of the described lead, recall@k of a block holding its
            name (the title less a "(...)" qualifier).
  nq_open, efficientqa, webq, curatedtrec
            the question files of fetch_public's --nq_open_dev,
            --efficientqa_dev, --webq_test, --curatedtrec_test: answer
            recall@k over the corpus (no gold block; CuratedTrec's answers
            are regular expressions).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from benchmarks import public_sources  # pylint: disable=wrong-import-position
from realm_jax import gin_cli  # pylint: disable=wrong-import-position

KS = (1, 5, 20, 100)
RETRIEVERS = ("bm25", "minilm")
# Each task's data set (`public_sources.SETS`: the files it reads).
TASKS = {"squad": "squad", "cloze": "cloze", "describe": "leads",
         "nq_open": "nq_open", "efficientqa": "efficientqa",
         "webq": "webq", "curatedtrec": "curatedtrec"}


def _first_lines(source: str, out, n: int | None) -> None:
  """Writes the first `n` lines (all: None) of `source` to the file `out`."""
  with open(source, "rb") as f:
    out.writelines(itertools.islice(f, n))


def build_stores(data_dir: str, workdir: str, max_block_len: int,
                 num_documents: int = 0, paragraphs: bool = True):
  """(leads store, union store), built once by the corpus job: Z is the
  first `num_documents` leads (all: 0), the union Z + the SQuAD
  paragraphs; without `paragraphs`, (Z, Z)."""
  from realm_jax.data import block_store, corpus_job  # pylint: disable=g-import-not-at-top
  n = num_documents or None
  leads = os.path.join(workdir, "leads.jsonl")
  union_jsonl = os.path.join(workdir, "union.jsonl")
  jobs = ((leads, ("vital_leads.jsonl",)), (union_jsonl, (
      "vital_leads.jsonl", "squad_dev_paragraphs.jsonl")))
  for path, sources in jobs[:2 if paragraphs else 1]:
    if not os.path.exists(path):
      with open(path + ".tmp", "wb") as out:
        for name in sources:
          _first_lines(os.path.join(data_dir, name), out,
                       n if name == "vital_leads.jsonl" else None)
      os.replace(path + ".tmp", path)
  stores = []
  for name, source in (("vital", leads), ("union", union_jsonl)
                       )[:2 if paragraphs else 1]:
    path = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(path, "manifest.json")):
      corpus_job.build_corpus(input_path=source, output_dir=path,
                              max_block_len=max_block_len)
    stores.append(block_store.BlockStore.open(path))
  if not paragraphs:
    stores.append(stores[0])
  block_store.check_extends(*stores)
  if num_documents and stores[0].num_documents != num_documents:
    raise ValueError(
        f"{workdir} holds the stores of {stores[0].num_documents} leads, "
        f"not --num_documents={num_documents}: use another --workdir.")
  return stores


def _score(name, examples, gold, ids, scores, store, workdir, seconds):
  """The JSON line of one retriever (gold recall where `gold` is not
  None); writes its predictions."""
  from realm_jax.eval import qa_eval, retrieval_eval  # pylint: disable=g-import-not-at-top
  results = retrieval_eval.retrieval_results(examples, ids, scores, store)
  qa_eval.write_predictions(
      os.path.join(workdir, "predictions", f"{name}.jsonl"), results)
  metrics = qa_eval.aggregate_metrics(results, recall_ks=KS)
  row = {"retriever": name.split("_")[0], "questions": len(examples),
         "blocks": len(store),
         **{f"recall@{k}": round(metrics[f"recall@{k}"], 4) for k in KS},
         **({} if gold is None else {
             k: round(v, 4) for k, v in retrieval_eval.gold_recall(
                 results, gold, KS).items()}),
         "seconds": round(seconds, 1)}
  return row


def dense_index(params, model, tag: str, stores, workdir):
  """The published index of a dense retriever over the last of `stores`:
  the leads indexed once (one-shot builder, exact MIPS), then the other
  blocks added without re-embedding the leads (`index.extend`)."""
  from realm_jax.index import build, extend, publish  # pylint: disable=g-import-not-at-top
  config = build.IndexBuildConfig(searcher="exact")
  vital, union = stores
  leads_root = os.path.join(workdir, f"index_{tag}_vital")
  name = os.path.basename(os.fspath(union.path).rstrip("/"))
  union_root = os.path.join(workdir, f"index_{tag}_{name}")
  if publish.read_latest(leads_root) is None:
    build.build_and_publish(retriever_params=params["retriever"],
                            retriever_config=model.retriever, store=vital,
                            root=leads_root, step=0, config=config)
  if union is vital:  # Z alone: nothing to add.
    return publish.load_frozen_index(leads_root, vital, model)
  if publish.read_latest(union_root) is None:
    extend.extend_index(index_root=leads_root, base_store=vital,
                        union_store=union,
                        retriever_params=params["retriever"],
                        retriever_config=model.retriever,
                        output_root=union_root, config=config)
  return publish.load_frozen_index(union_root, union, model)


def bm25_index(stores):
  """BM25 over the last of `stores` (`realm_jax.index.bm25`): the leads'
  index built once beside their store, then extended with the other
  blocks beside the union's; found there on later runs."""
  from realm_jax.index import bm25, extend  # pylint: disable=g-import-not-at-top
  vital, union = stores
  if union is vital:  # Z alone: nothing to add.
    return bm25.for_store(vital)
  bm25.for_store(vital)
  extend.extend_bm25(vital, union)
  return bm25.for_store(union, build=False)


# A training recipe's paths, never read here (only its model is).
_UNUSED_PATHS = ("WORKDIR", "BLOCK_STORE", "QUERIES", "GATE_QUERIES")


def _model(gin_file: str):
  """The `RealmConfig` a model or training gin file configures."""
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  gin_cli.parse([gin_file], [f"{m} = ''" for m in _UNUSED_PATHS])
  return gin.get_configurable(RealmConfig)()


@dataclasses.dataclass(frozen=True)
class Weights:
  """A dense retriever's weights: which, and at which length questions
  are read."""
  tag: str
  params: dict
  model: object
  question_length: int = 32


def minilm_weights() -> Weights:
  """MiniLM-L6 in both towers, as the demo starts."""
  from realm_jax.checkpoint_import import init_from  # pylint: disable=g-import-not-at-top
  from realm_jax.model import functional  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import Realm  # pylint: disable=g-import-not-at-top
  model = _model("models/minilm_l6.gin")
  _, fresh = functional.init(lambda r: Realm(model, rngs=r), 0)
  return Weights("minilm", init_from.initial_params(model, fresh, "minilm"),
                 model)


def checkpoint_weights(name: str, spec: str, gin_file: str,
                       question_length: int) -> Weights:
  """A trained retriever, `spec` = <checkpoints dir>[@<step>] (default its
  last step), of the model `gin_file` configures (e.g. a
  benchmarks.learning --world=vital run's ict or realm checkpoints)."""
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.model import realm  # pylint: disable=g-import-not-at-top
  path, _, step = spec.partition("@")
  ckpt = checkpoints.TrainCheckpointer(path, async_save=False)
  try:
    step = int(step) if step else ckpt.latest_step()
    if step not in ckpt.all_steps():
      raise SystemExit(f"--checkpoints: {path} has no step {step} "
                       f"(it has {ckpt.all_steps()}).")
    params = ckpt.restore_params(step)
  finally:
    ckpt.close()
  # Retrieval reads no null score: an ICT checkpoint has none, a REALM
  # one may have a learned one (`realm.document_tower_params`).
  model = _model(gin_file)
  model = dataclasses.replace(model, retriever=dataclasses.replace(
      model.retriever, null_score="embedding"))
  params = {**params, "retriever": realm.document_tower_params(
      params["retriever"])}
  return Weights(f"{name}_{step}", params, model, question_length)


class Cached:
  """A ranker whose rankings are kept in `<workdir>/rankings/` (ids and
  scores, .npz, keyed by `tag` (the weights and the store), the questions
  and the depth), so a hybrid reuses its components' rankings and a rerun
  its own."""

  def __init__(self, ranker, workdir: str, tag: str):
    self.ranker, self.name, self.tag = ranker, ranker.name, tag
    self.directory = os.path.join(workdir, "rankings")

  def rank(self, questions, depth):
    import hashlib  # pylint: disable=g-import-not-at-top
    from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
    key = hashlib.sha256(json.dumps([list(questions), depth]).encode()
                         ).hexdigest()[:16]
    path = os.path.join(self.directory, f"{self.tag}-{key}.npz")
    if os.path.exists(path):
      with np.load(path, allow_pickle=False) as f:
        ids, scores = f["ids"], f["scores"]
      ranks = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32),
                              ids.shape)
      return rankers.Ranking(ids, scores,
                             {self.name: np.where(ids >= 0, ranks, -1)})
    ranking = self.ranker.rank(questions, depth)
    os.makedirs(self.directory, exist_ok=True)
    with open(path + ".tmp", "wb") as f:
      np.savez(f, ids=ranking.ids, scores=ranking.scores)
    os.replace(path + ".tmp", path)
    return ranking


class Rankers:
  """The product's rankers (`realm_jax.index.rankers`) over the stores,
  each made once: BM25, a dense ranker per weights, hybrids of them (the
  dense rankings cached: `Cached`)."""

  def __init__(self, stores, workdir: str, fusion):
    self.stores, self.workdir, self.fusion = stores, workdir, fusion
    self._made = {}

  def bm25(self):
    from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
    if "bm25" not in self._made:
      self._made["bm25"] = rankers.BM25Ranker(bm25_index(self.stores))
    return self._made["bm25"]

  def dense(self, weights: Weights):
    from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
    if weights.tag not in self._made:
      index = dense_index(weights.params, weights.model, weights.tag,
                          self.stores, self.workdir)
      self._made[weights.tag] = Cached(rankers.DenseRanker.from_params(
          index, weights.params, weights.model,
          question_length=weights.question_length,
          name=weights.tag.split("_")[0]), self.workdir,
          f"{weights.tag}-{self.stores[1].fingerprint[:16]}")
    return self._made[weights.tag]

  def hybrid(self, weights: Weights, fusion=None):
    from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
    return rankers.HybridRanker(self.dense(weights), self.bm25(),
                                fusion or self.fusion)


def squad_task(data_dir: str, union, max_questions: int):
  """(examples, gold blocks): every SQuAD dev question (or the first N),
  gold = the blocks of its paragraph."""
  from realm_jax.data import squad  # pylint: disable=g-import-not-at-top
  questions = squad.read_questions_jsonl(
      os.path.join(data_dir, "squad_dev_questions.jsonl"))
  questions = questions[:max_questions or None]
  blocks = squad.paragraph_blocks(union, squad.read_paragraphs_jsonl(
      os.path.join(data_dir, "squad_dev_paragraphs.jsonl")))
  return ([q.example for q in questions],
          [blocks[q.paragraph_id] for q in questions])


def cloze_task(data_dir: str, stores):
  """(examples, gold blocks) of the qa_wikidata prompts about a lead
  (`wikidata_cloze.jsonl`): the prompt asked as a question, gold = the
  blocks of its subject's lead. Evaluation only."""
  from realm_jax.data import qa  # pylint: disable=g-import-not-at-top
  vital = stores[0]
  leads = _lead_blocks(stores)
  examples, gold = [], []
  with open(os.path.join(data_dir, "wikidata_cloze.jsonl"),
            encoding="utf-8") as f:
    for line in f:
      prompt = json.loads(line)
      if prompt["subject"] in leads:  # (not with --num_documents)
        examples.append(qa.QAExample(prompt["prompt"],
                                     tuple(prompt["answers"])))
        gold.append(leads[prompt["subject"]])
  if not examples:
    raise ValueError(f"{data_dir}/wikidata_cloze.jsonl: no prompt is about "
                     f"one of the first {vital.num_documents} leads.")
  return examples, gold


def _lead_blocks(stores) -> dict:
  """{title: the union's block ids of that lead} for the leads of Z."""
  vital, union = stores
  offsets = union.doc_block_offsets
  return {union.title(int(offsets[d])): np.arange(offsets[d],
                                                  offsets[d + 1])
          for d in range(vital.num_documents)}


def _name(title: str) -> str:
  """A lead's name: its title less a trailing "(...)" qualifier."""
  return re.sub(r"\s*\([^()]*\)$", "", title) or title


def _folded(text: str) -> str:
  """`text` with case and spacing folded."""
  return " ".join(text.lower().split())


def describe_task(data_dir: str, stores, max_questions: int = 0):
  """(examples, gold blocks): each lead of Z whose Wikidata description
  is not empty, is no other lead's (case and spacing aside) and does not
  hold the lead's name, asked as a question; answer = the name, gold = the
  lead's blocks. Needs `vital_leads.jsonl` alone."""
  from realm_jax.data import qa  # pylint: disable=g-import-not-at-top
  with open(os.path.join(data_dir, "vital_leads.jsonl"),
            encoding="utf-8") as f:
    leads = [json.loads(line) for line in f]
  counts = collections.Counter(_folded(x["description"]) for x in leads)
  blocks = _lead_blocks(stores)
  examples, gold = [], []
  for lead in leads:
    text, name = lead["description"].strip(), _name(lead["title"])
    if (text and counts[_folded(text)] == 1 and lead["title"] in blocks
        and not qa.has_answer(text, (name,))):
      examples.append(qa.QAExample(text, (name,)))
      gold.append(blocks[lead["title"]])
  return examples[:max_questions or None], gold[:max_questions or None]


def qa_set_task(data_dir: str, task: str, max_questions: int = 0):
  """(examples, None): the ORQA JSONL questions fetch_public wrote for
  `task` (no gold block: answer recall only)."""
  from realm_jax.data import qa  # pylint: disable=g-import-not-at-top
  path = os.path.join(data_dir, public_sources.SETS[task].outputs[0])
  examples = qa.read_qa_jsonl(path, strict=True,
                              regex_answers=task == "curatedtrec")
  return examples[:max_questions or None], None


def make_task(task: str, data_dir: str, stores, max_questions: int):
  """(examples, gold blocks or None) of one of `TASKS`."""
  if task == "squad":
    return squad_task(data_dir, stores[1], max_questions)
  if task == "cloze":
    return cloze_task(data_dir, stores)
  if task == "describe":
    return describe_task(data_dir, stores, max_questions)
  return qa_set_task(data_dir, task, max_questions)


def table(rows) -> str:
  """A Markdown table of the JSON lines: recall@k / gold recall@k, in %
  ("-" where a task has no gold block)."""
  head = " | ".join(f"@{k}" for k in KS)
  lines = [f"| task | retriever | questions | blocks | answer recall {head} "
           f"| gold recall {head} |", "|---" * (4 + 2 * len(KS)) + "|"]
  for r in rows:
    cells = [f"{100 * r[f'{p}recall@{k}']:.1f}" if f"{p}recall@{k}" in r
             else "-" for p in ("", "gold_") for k in KS]
    lines.append(f"| {r.get('task', 'squad')} | {r['retriever']} | "
                 f"{r['questions']} | {r['blocks']} | {' | '.join(cells)} |")
  return "\n".join(lines)


def plot(rows, path: str) -> None:
  """Answer recall@k against k, one line per retriever, one panel per
  task (a PNG at `path`)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  tasks = list(dict.fromkeys(r.get("task", "squad") for r in rows))
  fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4),
                           squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for r in rows:
      if r.get("task", "squad") == task:
        ax.plot(KS, [100 * r[f"recall@{k}"] for k in KS], marker="o",
                label=r["retriever"])
    ax.set_xscale("log")
    ax.set_xticks(KS, [str(k) for k in KS])
    ax.set_xlabel("k")
    ax.set_ylabel("answer recall@k (%)")
    ax.set_title(f"{task}: {rows[0]['blocks']} blocks")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def paired(workdir: str, name: str, baseline: str = "bm25") -> str:
  """`name` - `baseline` on the same questions: the difference of recall@k
  (from their predictions in `<workdir>/predictions/`) +- its standard
  error (of the mean of the per-question differences), in points."""
  found = {}
  for n in (name, baseline):
    with open(os.path.join(workdir, "predictions", f"{n}.jsonl"),
              encoding="utf-8") as f:
      found[n] = np.array([[any(r["retrieved_has_answer"][:k]) for k in KS]
                           for r in map(json.loads, f)], np.float64)
  if found[name].shape != found[baseline].shape:
    raise ValueError(f"{name} and {baseline} were not run on the same "
                     "questions.")
  diff = found[name] - found[baseline]
  se = diff.std(0, ddof=1) / np.sqrt(len(diff))
  return f"{name} - {baseline}: " + ", ".join(
      f"@{k} {100 * d:+.1f} +- {100 * e:.1f}"
      for k, d, e in zip(KS, diff.mean(0), se))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--table_from", default=None,
                      help="Only print the Markdown table of this JSON "
                      "lines file.")
  parser.add_argument("--paired", default=None,
                      help="With --table_from and --workdir: also print "
                      "these retrievers' (e.g. minilm,realm) recall@k "
                      "minus the baseline's on the same questions, +- "
                      "standard error.")
  parser.add_argument("--plot", default=None,
                      help="With --table_from: a PNG of recall@k per "
                      "retriever.")
  parser.add_argument("--baseline", default="bm25",
                      help="--paired: against this retriever.")
  parser.add_argument("--data_dir", help="fetch_public.py's --output_dir.")
  parser.add_argument("--workdir")
  parser.add_argument("--output", default=None,
                      help="Append the JSON lines here too.")
  parser.add_argument("--retrievers", default=",".join(RETRIEVERS))
  parser.add_argument("--checkpoints", default="",
                      help="Trained retrievers too: name=<checkpoints "
                      "dir>[@step],... (e.g. ict=/w/ict/checkpoints@600).")
  parser.add_argument("--gin_file",
                      default="experiments/pretrain_wiki_small_cpu.gin",
                      help="The model of --checkpoints.")
  parser.add_argument("--question_length", type=int, default=48,
                      help="--checkpoints: [CLS] question [SEP] wordpieces "
                      "(the recipe's query length).")
  parser.add_argument("--max_block_len", type=int, default=128)
  parser.add_argument("--num_documents", type=int, default=0,
                      help="Z = the first N leads only (0: all), as "
                      "benchmarks.learning --num_documents (the scale curve); "
                      "the cloze prompts about other leads are left out.")
  parser.add_argument("--max_questions", type=int, default=0,
                      help="Only the first N questions (0: all).")
  parser.add_argument("--hybrids", default="",
                      help="Also the hybrid of BM25 with each of these "
                      "dense retrievers of --checkpoints (rows "
                      "hybrid-<name>); --retrievers=hybrid is MiniLM's.")
  parser.add_argument("--fusion", default=None,
                      help="The hybrids' fusion: weighted or rrf (default "
                      "the product's, rankers.FusionConfig).")
  parser.add_argument("--dense_weight", type=float, default=None)
  parser.add_argument("--bm25_weight", type=float, default=None)
  parser.add_argument("--tune_fusion", default=None,
                      help="Only choose the fusion weights on this dev "
                      "set (a SQuAD JSON file of your own questions and "
                      "paragraphs; never a benchmark file that carries a "
                      "canary), asked over the leads + its paragraphs.")
  parser.add_argument("--tasks", default="squad",
                      help="Comma-separated, of "
                      f"{', '.join(TASKS)} (see the module's docstring): "
                      "squad is SQuAD-open, cloze the qa_wikidata prompts "
                      "about a lead, describe the leads' Wikidata "
                      "descriptions (needs the leads alone).")
  args = parser.parse_args(argv)
  if args.table_from:
    with open(args.table_from, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    print(table(rows))
    if args.plot:
      plot(rows, args.plot)
    for name in filter(None, (args.paired or "").split(",")):
      print(paired(args.workdir, name, args.baseline))
    return
  if not (args.data_dir and args.workdir):
    parser.error("--data_dir and --workdir are required")
  names = [] if args.tune_fusion else list(dict.fromkeys(
      filter(None, args.tasks.split(","))))
  for task in names:
    if task not in TASKS:
      parser.error(f"--tasks: {task!r} is not one of {', '.join(TASKS)}")
  _require(args.data_dir, ["leads"] + [TASKS[t] for t in names])
  os.makedirs(args.workdir, exist_ok=True)
  stores = build_stores(args.data_dir, args.workdir, args.max_block_len,
                        args.num_documents, paragraphs="squad" in names)
  if args.tune_fusion:
    for row in tune_fusion(args.data_dir, args.workdir, args.max_block_len,
                           args.tune_fusion, stores, args.max_questions):
      _emit(row, args.output)
    return
  tasks = {t: make_task(t, args.data_dir, stores, args.max_questions)
           for t in names}
  fusion = _fusion(args)
  made = Rankers(stores, args.workdir, fusion)
  weights = {}  # dense retrievers' weights, loaded when first ranked
  rankers = {}
  for name in filter(None, args.retrievers.split(",")):
    if name not in RETRIEVERS + ("hybrid",):
      parser.error(f"--retrievers: {name!r} is not one of "
                   f"{RETRIEVERS + ('hybrid',)}")
    if name == "bm25":
      rankers[name] = made.bm25
    else:
      weights.setdefault("minilm", minilm_weights)
      rankers[name] = (
          (lambda: made.dense(_load(weights, "minilm"))) if name == "minilm"
          else (lambda: made.hybrid(_load(weights, "minilm"))))
  for item in filter(None, args.checkpoints.split(",")):
    name, _, spec = item.partition("=")
    if not spec or "_" in name or name in RETRIEVERS + ("hybrid",):
      parser.error(f"--checkpoints: {item!r} is not name=<dir>[@step] with "
                   f"a new name without '_'.")
    weights[name] = (lambda n=name, s=spec: checkpoint_weights(
        n, s, args.gin_file, args.question_length))
    rankers[name] = lambda n=name: made.dense(_load(weights, n))
  for name in filter(None, args.hybrids.split(",")):
    if name not in weights:
      parser.error(f"--hybrids: {name!r} is not a dense retriever of "
                   "--retrievers or --checkpoints.")
    rankers[f"hybrid-{name}"] = lambda n=name: made.hybrid(_load(weights, n))
  for name, make_ranker in rankers.items():
    start = time.time()
    ranker = make_ranker()
    setup = time.time() - start
    for task, (examples, gold) in tasks.items():
      start = time.time()
      ranking = ranker.rank([e.question for e in examples], max(KS))
      row = _score(name if task == "squad" else f"{name}_{task}", examples,
                   gold, ranking.ids, ranking.scores, stores[1],
                   args.workdir, time.time() - start)
      if name.startswith("hybrid"):
        row["fusion"] = dataclasses.asdict(ranker.config)
      _emit({"task": task, **row, "setup_seconds": round(setup, 1)},
            args.output)


def _require(data_dir: str, sets) -> None:
  """Stops at once, before anything is written, when `data_dir` lacks a
  file of `sets`, with one line naming every route to it."""
  message = public_sources.missing_files(data_dir, sets)
  if message:
    raise SystemExit(f"real_text: {message}")


def _load(weights: dict, name: str) -> Weights:
  """`weights[name]`, loaded on first use (a loader until then)."""
  if not isinstance(weights[name], Weights):
    weights[name] = weights[name]()
  return weights[name]


def _fusion(args):
  from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
  default = rankers.FusionConfig()
  return rankers.FusionConfig(
      method=args.fusion or default.method,
      dense_weight=default.dense_weight if args.dense_weight is None
      else args.dense_weight,
      bm25_weight=default.bm25_weight if args.bm25_weight is None
      else args.bm25_weight)


def _emit(row: dict, output: str | None) -> None:
  row = {**row, "load_average": [round(x, 2) for x in os.getloadavg()]}
  print(json.dumps(row), flush=True)
  if output:
    with open(output, "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")


DEV_WEIGHTS = tuple(round(0.1 * i, 1) for i in range(11))


def tune_fusion(data_dir: str, workdir: str, max_block_len: int,
                dev_squad: str, stores, max_questions: int = 0):
  """The hybrid's weights chosen on a dev set of other data: the questions
  of `dev_squad` (a SQuAD JSON file of your own; not a benchmark's)
  asked over the leads + that file's paragraphs (the store `devunion`,
  extending the leads' store; the MiniLM index and BM25 extended to it),
  never the evaluation questions. For each fusion (weighted with dense
  weight w = 0, 0.1, ..., 1 and BM25 weight 1 - w; RRF with equal
  weights) the dev answer recall@k; the chosen one maximises the mean of
  recall@k over k = 1, 5, 20, 100 (the larger dense weight on a tie).

  Yields:
    One row per fusion, then {"chosen": ...}.
  """
  from realm_jax.data import block_store, corpus_job, squad  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import retrieval_eval  # pylint: disable=g-import-not-at-top
  from realm_jax.index import rankers  # pylint: disable=g-import-not-at-top
  data = squad.read_squad(dev_squad)
  vital = stores[0]
  path = os.path.join(workdir, "devunion")
  if not os.path.exists(os.path.join(path, "manifest.json")):
    source = path + ".jsonl"
    with open(source + ".tmp", "w", encoding="utf-8") as out:
      with open(os.path.join(workdir, "leads.jsonl"), encoding="utf-8") as f:
        out.writelines(f)
      out.write(squad.corpus_lines(data.paragraphs))
    os.replace(source + ".tmp", source)
    corpus_job.build_corpus(input_path=source, output_dir=path,
                            max_block_len=max_block_len)
  dev = block_store.BlockStore.open(path)
  block_store.check_extends(vital, dev)
  made = Rankers((vital, dev), workdir, None)
  examples = [q.example for q in data.questions][:max_questions or None]
  questions = [e.question for e in examples]
  start = time.time()
  parts = [made.dense(minilm_weights()).rank(questions, max(KS)),
           made.bm25().rank(questions, max(KS))]
  # An answer in a block: found once per (question, block) of either list.
  flags = [{} for _ in examples]
  for part in parts:
    for f, r in zip(flags, retrieval_eval.retrieval_results(
        examples, part.ids, part.scores, dev)):
      f.update(zip(r.retrieved_ids, r.retrieved_has_answer))
  candidates = [("weighted", w, round(1 - w, 1)) for w in DEV_WEIGHTS] + [
      ("rrf", 1.0, 1.0)]
  rows = []
  for method, dense_w, bm25_w in candidates:
    fused = rankers.fuse(parts, (dense_w, bm25_w), max(KS), method=method)
    hits = np.array([[any(f.get(int(b), False) for b in row[:k])
                      for k in KS] for f, row in zip(flags, fused.ids)])
    recall = hits.mean(0)
    rows.append({"task": "fusion_dev", "dev_set": os.path.basename(
        dev_squad), "questions": len(examples), "blocks": len(dev),
                 "method": method, "dense_weight": dense_w,
                 "bm25_weight": bm25_w,
                 **{f"recall@{k}": round(float(r), 4)
                    for k, r in zip(KS, recall)},
                 "mean_recall": round(float(recall.mean()), 4)})
    yield rows[-1]
  best = max((r for r in rows if r["method"] == "weighted"),
             key=lambda r: (r["mean_recall"], r["dense_weight"]))
  yield {"task": "fusion_dev", "chosen": {
      k: best[k] for k in ("method", "dense_weight", "bm25_weight")},
         "seconds": round(time.time() - start, 1)}


if __name__ == "__main__":
  # Before JAX starts its backends (nothing has imported it yet); not on
  # import, so that a test importing this module leaves its environment.
  gin_cli.add_cpu_xla_flag()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()

"""Does REALM pre-training teach the retriever? Measured on held-out people.

    python -m benchmarks.learning --workdir=/tmp/learning \
        --output=docs/results/learning.jsonl --plot=docs/results/learning.png

A synthetic knowledge world (`realm_jax/testing/knowledge_world.py`): 300
fictional people with random birthplaces and birth years; Z = one biography
block per person; X = separate articles whose sentences name a person with
the city or the year as the only salient span; the X articles of 100
people are never trained on and give the held-out queries. Facts are
random, so only the right biography lets the reader fill a held-out mask.

Every condition (`conditions.py` names and binds them) runs the real jobs
(`ict.train`, `pretrain.train` with an inline exact index rebuilt every
`--refresh_every` steps) on the tiny model of `gin_configs/models/tiny.gin`
with the same seed, and every checkpoint is evaluated by
`realm_jax.eval.pretrain_eval` with its own index.

The world: --people, --heldout, --dev (people whose X articles are
neither trained on nor evaluated: a held-out gate's queries), --templates (a or
b, `knowledge_world.TEMPLATES`), --seed, --shuffle_facts (every
biography states another person's facts: the control world where reading
cannot help).

One JSON line per (condition, step) goes to --output; --plot draws the
curves. On 2 CPU cores the default run takes about 45 minutes.

`--world=wiki` runs it on real text: the gensim enwiki slice (all 96
articles, or `--num_documents`; 5,448 blocks of 128 wordpieces, spaCy
salient spans). X is split by article: every 4th article's sentences are
held out (the masked-token metrics), every 8th of the rest are the gate's
dev queries, the others are trained on. Trivial candidates follow
`--trivial` (default for wiki: "block", REALM's reference rule: only the
block holding the sentence is excluded; X and Z are the same articles, so
"article" would hide every block about the sentence's subject). Real
sentences have no single evidence block, so retrieval is measured on 255
held-out open-domain questions about these articles
(benchmarks/data/wiki_heldout_qa.jsonl, answers checked against the text,
never trained on; `qa_recall@k`: an answer-bearing block in the top k).
Two starts:

  --start=random  the paper's ablation: a small BERT from random weights
                  (experiments/pretrain_wiki_small_cpu.gin), ICT, then
                  gated REALM; conditions ict, realm, query_side.
  --start=minilm  the product path: MiniLM-L6 in both towers
                  (experiments/pretrain_minilm_wiki_gated.gin); its step 0
                  is MiniLM with the MLM head fitted by the reader
                  preparation job (`reader_prep`), the baseline;
                  condition query_side (a MiniLM refresh of 5,448 blocks
                  costs minutes on 2 cores), or realm / frozen.

    python -m benchmarks.learning --world=wiki --start=random \
        --workdir=/tmp/lw_random \
        --output=docs/results/learning_wiki_random.jsonl

`--world=vital` runs it on public text (issue 47): Z = the leads of
Wikipedia's Vital Articles (`--num_documents`: the first N), X = their
sentences split by article as for wiki; from random weights (ICT, then
the gated recipe of `experiments/pretrain_wiki_small_cpu.gin`). Every
checkpoint is evaluated over Z plus the SQuAD v1.1 dev paragraphs (added
after training, never trained on) on the SQuAD dev questions
(`qa_recall@1/5/20/100`, zero-shot: no question is trained on) and on the
cloze probe: the qa_wikidata prompts about a lead, masked
(`cloze_mlm_accuracy_*` with the top k, the null document alone, the gold
lead block). `--data_dir` is the output of
`benchmarks/data/fetch_public.py`; `--pretrain_seed` trains more REALM
seeds from the same ICT (docs/results/real_text.md).

    python -m benchmarks.learning --world=vital --data_dir=/tmp/public \
        --workdir=/tmp/lw_vital --eval_every=300 --output=/tmp/vital.jsonl

The package, in the order a run goes through it:
  cli          the flags (`parse_args`, with each world's defaults) and
               `main`; `__main__` runs it.
  worlds       the worlds: the files a run trains on and is evaluated on.
  conditions   each condition's gin files and bindings over the recipe.
  prepare      the inputs every condition shares (`Inputs`): the parsed
               recipe, the query caches, the held-out queries, the
               questions' wordpieces (kept in the workdir).
  train        the jobs: the ICT warm start, reader preparation (MiniLM)
               and one condition's pre-training.
  evaluate     a checkpoint's row (`Evaluator`), written as it is made.
  tables       Markdown tables of the rows, paired against ICT.
  plots        the curves of the rows.
  worlds_table several runs' rows, one table and plot per world
               (`python -m benchmarks.learning.worlds_table`).
"""

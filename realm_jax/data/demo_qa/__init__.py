"""The demo's open-domain QA set, written about the demo corpus.

`python -m realm_jax.jobs.demo` fine-tunes and evaluates on these questions.
They are trivia questions about the first 16 articles of the gensim enwiki slice
(`corpus_job.build_corpus(max_documents=16)`): Anarchism, Autism, Albedo, A,
Alabama, Achilles, Abraham Lincoln, Aristotle, An American in Paris, Academy
Award for Best Production Design, Academy Awards, Actrius, Animalia (book),
International Atomic Time, Altruism and Ayn Rand. Public QA sets (NQ-Open,
WebQuestions) would have almost no answer in so small a corpus, so the
retriever and reader would get no positives.

Files, in the ORQA JSONL format that `realm_jax.data.qa.read_qa_jsonl` reads
(one `{"question": str, "answer": [str, ...]}` per line):

- `train.jsonl`: 64 questions, spread over all 16 articles.
- `dev.jsonl`: 24 questions about the same articles, asking other facts.

Every answer is a short span (a name, a year, a number) found by
`qa.has_answer` in at least one block of that corpus built at 128 wordpieces,
mostly in blocks of a single article so that retrieval matters;
tests/data/test_demo_qa.py checks this.
"""

import os

SPLITS = ("train", "dev")


def path(split: str) -> str:
  """Path of one split's JSONL file (shipped as package data).

  Args:
    split: "train" or "dev".

  Returns:
    Absolute path of `<split>.jsonl` beside this module.

  Raises:
    ValueError: for an unknown split.
  """
  if split not in SPLITS:
    raise ValueError(f"Unknown demo QA split {split!r}; valid splits: "
                     f"{', '.join(SPLITS)}.")
  # A plain file path (not importlib.resources.as_file) because callers
  # keep it (seqio tasks, FinetuneConfig.train_jsonl) past any context.
  return os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      f"{split}.jsonl")

"""Helpers shared by the tests (tests/ is on sys.path: `import helpers`).

A test never depends on the machine's speed: a wait for something that
will happen (a subprocess, a thread, a published index) is bounded only
by `HANG_SECONDS`, a bound that catches a hang and that no busy machine
reaches (the whole suite takes less). A test of a timeout itself passes
its own, short one.
"""

# 30 minutes: far beyond any one command of the suite on a loaded machine
# (the slowest takes ~11 minutes at load 6-9), yet a hung child still ends
# before CI's own limit.
HANG_SECONDS = 1800


# The public data's files (benchmarks/data/fetch_public.py's output) in
# miniature: hand-written leads, the SQuAD fixture, one cloze prompt.
LEADS = [
    {"title": "Ines Marlow", "text": "Ines Marlow was a surveyor of the "
     "north. She mapped the Kessar Hills and their lakes.",
     "description": "", "topic": "People"},
    {"title": "Opal (river)", "text": "The Opal is a cold river that flows "
     "north from the Kessar Hills to the sea.", "description": "river",
     "topic": "Geography"},
]


def write_public_data(path, leads=LEADS):
  """Writes a data directory in fetch_public.py's format at `path` (a
  pathlib.Path); returns the SQuAD fixture it holds (`squad.SquadData`)."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from realm_jax.data import squad  # pylint: disable=g-import-not-at-top
  data = squad.read_squad(os.path.join(os.path.dirname(
      os.path.abspath(__file__)), "fixtures", "squad", "tiny_v1.json"))
  os.makedirs(path)
  (path / "vital_leads.jsonl").write_text("".join(
      json.dumps(x) + "\n" for x in leads))
  (path / "squad_dev_paragraphs.jsonl").write_text(
      squad.corpus_lines(data.paragraphs))
  (path / "squad_dev_questions.jsonl").write_text(
      squad.question_lines(data.questions))
  (path / "wikidata_cloze.jsonl").write_text(json.dumps(
      {"prompt": "The occupation of Ines Marlow is",
       "answers": ["surveyor"], "subject": "Ines Marlow"}) + "\n")
  return data


def benchmark_module(monkeypatch, name: str):
  """benchmarks/<name>.py imported as a module. Importing a benchmark adds
  to $XLA_FLAGS and sets $TF_CPP_MIN_LOG_LEVEL: both are restored after
  the test (monkeypatch)."""
  import importlib  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  for var in ("XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL"):
    monkeypatch.setenv(var, os.environ.get(var, ""))
  monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "benchmarks"))
  return importlib.import_module(name)

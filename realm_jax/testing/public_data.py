"""The public data's files (benchmarks/data/fetch_public.py's output) in
miniature: hand-written leads, the SQuAD fixture, one cloze prompt."""

import json
import os
import pathlib

from realm_jax.data import squad

# The tests' SQuAD v1.1 fixture, in a source checkout.
SQUAD_FIXTURE = (pathlib.Path(__file__).resolve().parents[2] / "tests"
                 / "fixtures" / "squad" / "tiny_v1.json")

LEADS = [
    {"title": "Ines Marlow", "text": "Ines Marlow was a surveyor of the "
     "north. She mapped the Kessar Hills and their lakes.",
     "description": "", "topic": "People"},
    {"title": "Opal (river)", "text": "The Opal is a cold river that flows "
     "north from the Kessar Hills to the sea.", "description": "river",
     "topic": "Geography"},
]


def write_public_data(path: pathlib.Path, leads=LEADS) -> squad.SquadData:
  """Writes a data directory in fetch_public.py's format at `path`; returns
  the SQuAD fixture it holds."""
  data = squad.read_squad(str(SQUAD_FIXTURE))
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

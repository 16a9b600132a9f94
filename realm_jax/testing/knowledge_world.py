"""A synthetic knowledge world where retrieval is necessary.

Fictional people, each with a birthplace (one of 50 cities) and a birth
year (1800-1999), both drawn at random. The knowledge corpus Z holds one
biography block per person (title = the person's name). The pre-training
corpus X is a separate article per person ("Letters of <name>") whose
sentences name the person with the city OR the year as the only salient
span. People are split: the X articles of `num_heldout` people are never
trained on; their sentences are the held-out queries of the learning
benchmark (`benchmarks/learning.py`).

Because the facts are random, a reader cannot guess them from the query:
without the biography it can only learn the prior (1/50 for a city), and on
held-out people it cannot have memorised them. Masked-token accuracy above
the prior on held-out queries therefore needs the right block, and the
retriever is measured by where it ranks that block (`gold_doc_hash`).

Everything is a pure function of the seed; the files are written with the
real corpus writers (block store, annotated TFRecords).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from realm_jax.data import block_store, blocks, salient_spans, wikipedia
from realm_jax.data.tokenizer import Tokenizer

# Single wordpieces in BERT's uncased vocabulary (checked by the tests).
CITIES = (
    "paris london berlin madrid rome vienna prague warsaw dublin lisbon "
    "athens oslo stockholm helsinki moscow cairo tokyo beijing delhi lima "
    "bogota toronto chicago boston denver sydney melbourne auckland nairobi "
    "lagos istanbul tehran baghdad manila jakarta seoul bangkok havana "
    "santiago geneva zurich munich hamburg milan naples venice florence "
    "seville valencia dresden").split()
YEARS = tuple(range(1800, 2000))
JOBS = ("baker", "carpenter", "teacher", "sailor", "painter", "doctor",
        "farmer", "weaver", "printer", "lawyer", "miner", "singer")
_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m",
           "n", "p", "r", "s", "st", "t", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "n", "r", "l", "s", "k", "th", "m")

# X sentences: exactly one salient span each, {city} or {year}.
CITY_TEMPLATES = (
    "{name} often spoke fondly of {city}.",
    "Late in life {name} returned to {city}, the city of their birth.",
    "In {city} the name of {name} is still remembered.",
    "A small museum about {name} opened in {city}.",
)
YEAR_TEMPLATES = (
    "{name} came into the world in {year}.",
    "The parish records show that {name} was born in {year}.",
    "Every spring friends of {name} celebrate the year {year}.",
)


@dataclasses.dataclass(frozen=True)
class Person:
  name: str
  city: str
  year: int
  job: str
  heldout: bool

  @property
  def biography(self) -> str:
    return (f"{self.name} was born in {self.city} in {self.year}. "
            f"{self.name} worked as a {self.job} for many years. "
            f"Neighbours said that {self.name} was a quiet person.")

  @property
  def article_title(self) -> str:
    return f"Letters of {self.name}"


def _name(rng: np.random.Generator) -> str:
  def word(syllables):
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS)
                   + rng.choice(_CODAS) for _ in range(syllables)).title()
  return f"{word(2)} {word(2)}"


def make_people(num_people: int = 300, num_heldout: int = 100,
                seed: int = 0) -> list[Person]:
  """`num_people` people with distinct names; the last `num_heldout` held out.

  Raises:
    ValueError: if num_heldout is not in [1, num_people).
  """
  if not 1 <= num_heldout < num_people:
    raise ValueError(f"num_heldout={num_heldout} must be in [1, "
                     f"num_people={num_people}).")
  rng = np.random.default_rng([seed, 7])
  names: list[str] = []
  seen = set()
  while len(names) < num_people:
    name = _name(rng)
    if name not in seen:
      seen.add(name)
      names.append(name)
  return [Person(name=n, city=str(rng.choice(CITIES)),
                 year=int(rng.choice(YEARS)), job=str(rng.choice(JOBS)),
                 heldout=i >= num_people - num_heldout)
          for i, n in enumerate(names)]


def article(person: Person) -> salient_spans.AnnotatedDocument:
  """The person's X article, annotated: one salient span per sentence."""
  sentences = []
  for template in CITY_TEMPLATES + YEAR_TEMPLATES:
    fact = "{city}" if "{city}" in template else "{year}"
    value = person.city if fact == "{city}" else str(person.year)
    before, after = template.split(fact)
    sentences.append((before.format(name=person.name), value,
                      after.format(name=person.name)))
  text, sent_starts, sent_limits, span_starts, span_limits = "", [], [], [], []
  for before, value, after in sentences:
    if text:
      text += " "
    start = len(text.encode("utf-8"))
    span_start = start + len(before.encode("utf-8"))
    text += before + value + after
    sent_starts.append(start)
    sent_limits.append(len(text.encode("utf-8")))
    span_starts.append(span_start)
    span_limits.append(span_start + len(value.encode("utf-8")))
  return salient_spans.AnnotatedDocument(
      title=person.article_title, text=text,
      sentence_byte_starts=tuple(sent_starts),
      sentence_byte_limits=tuple(sent_limits),
      span_byte_starts=tuple(span_starts),
      span_byte_limits=tuple(span_limits),
      span_types=tuple("GPE" if "{city}" in t else salient_spans.DATE_TYPE
                       for t in CITY_TEMPLATES + YEAR_TEMPLATES))


@dataclasses.dataclass(frozen=True)
class WorldFiles:
  """Where `write_world` put things."""
  block_store: str   # Z: one biography block per person
  train: str         # X: annotated articles of the training people
  heldout: str       # X: annotated articles of the held-out people
  people: str        # people.json: names, facts, split


def write_world(directory: str, *, num_people: int = 300,
                num_heldout: int = 100, seed: int = 0,
                max_block_len: int = 64) -> WorldFiles:
  """Writes the world's block store and annotated corpora (idempotent).

  Args:
    directory: output directory (created).
    num_people, num_heldout, seed: see `make_people`.
    max_block_len: block length of Z; a biography is ~35 wordpieces.

  Returns:
    The paths.
  """
  os.makedirs(directory, exist_ok=True)
  people = make_people(num_people, num_heldout, seed)
  files = WorldFiles(
      block_store=os.path.join(directory, "blocks"),
      train=os.path.join(directory, "train.tfr.gz"),
      heldout=os.path.join(directory, "heldout.tfr.gz"),
      people=os.path.join(directory, "people.json"))
  if not os.path.exists(files.block_store):
    tokenizer = Tokenizer()
    docs = [wikipedia.Document(p.name, p.biography) for p in people]
    block_store.write_block_store(
        blocks.pack_blocks(docs, tokenizer, max_block_len=max_block_len),
        files.block_store, tokenizer_vocab_path=tokenizer.vocab_path,
        source=f"knowledge world seed {seed}", max_block_len=max_block_len)
  for path, heldout in ((files.train, False), (files.heldout, True)):
    if not os.path.exists(path):
      salient_spans.write_annotated(
          path, [article(p) for p in people if p.heldout == heldout])
  if not os.path.exists(files.people):
    with open(files.people + ".tmp", "w", encoding="utf-8") as f:
      json.dump([dataclasses.asdict(p) for p in people], f)
    os.replace(files.people + ".tmp", files.people)
  return files


def gold_blocks(store: block_store.BlockStore,
                people: list[Person]) -> dict[int, int]:
  """Maps each person's X-article hash to their biography's block id.

  Raises:
    ValueError: if a biography is missing or split over several blocks.
  """
  block_of_doc = {}
  for i, h in enumerate(store.doc_hash):
    if int(h) in block_of_doc:
      raise ValueError(f"{store.path}: a biography spans several blocks; "
                       "use a larger max_block_len.")
    block_of_doc[int(h)] = i
  out = {}
  for p in people:
    bio = blocks.title_hash(p.name)
    if bio not in block_of_doc:
      raise ValueError(f"{store.path}: no biography block for {p.name!r}.")
    out[blocks.title_hash(p.article_title)] = block_of_doc[bio]
  return out


def load_people(path: str) -> list[Person]:
  with open(path, encoding="utf-8") as f:
    return [Person(**p) for p in json.load(f)]

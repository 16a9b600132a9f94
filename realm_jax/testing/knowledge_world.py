"""A synthetic knowledge world where retrieval is necessary.

Fictional people, each with a birthplace (one of 50 cities) and a birth
year (1800-1999), both drawn at random. The knowledge corpus Z holds one
biography block per person (title = the person's name). The pre-training
corpus X is a separate article per person ("Letters of <name>") whose
sentences name the person with the city OR the year as the only salient
span. People are split: the X articles of `num_heldout` people are never
trained on; their sentences are the held-out queries of the learning
benchmark (`benchmarks.learning`).

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

from realm_jax.core import io_utils
from realm_jax.data import block_store, block_store_writer, blocks
from realm_jax.data import salient_spans, wikipedia
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

# X sentences: exactly one salient span each, {city} or {year}. Two
# template sets ("a", the benchmark's; "b", a second set with other wording
# and other biographies) check that a recipe is not tuned to one phrasing.
TEMPLATES = {
    "a": {
        "city": (
            "{name} often spoke fondly of {city}.",
            "Late in life {name} returned to {city}, the city of their "
            "birth.",
            "In {city} the name of {name} is still remembered.",
            "A small museum about {name} opened in {city}.",
        ),
        "year": (
            "{name} came into the world in {year}.",
            "The parish records show that {name} was born in {year}.",
            "Every spring friends of {name} celebrate the year {year}.",
        ),
        "biography": ("{name} was born in {city} in {year}. "
                      "{name} worked as a {job} for many years. "
                      "Neighbours said that {name} was a quiet person."),
    },
    "b": {
        "city": (
            "The hometown of {name} was {city}.",
            "Visitors to {city} can see the old house of {name}.",
            "{name} grew up in the streets of {city}.",
            "Letters from {name} were all posted in {city}.",
            "A statue of {name} stands in the main square of {city}.",
        ),
        "year": (
            "The birth of {name} was recorded in {year}.",
            "Historians date the birth of {name} to {year}.",
            "{name} was a child of the year {year}.",
        ),
        "biography": ("Born {year} in {city}, {name} trained as a {job}. "
                      "Friends of {name} remember a generous host."),
    },
}
CITY_TEMPLATES = TEMPLATES["a"]["city"]
YEAR_TEMPLATES = TEMPLATES["a"]["year"]


@dataclasses.dataclass(frozen=True)
class Person:
  name: str
  city: str
  year: int
  job: str
  heldout: bool
  dev: bool = False       # X article kept apart for run-time decisions
  templates: str = "a"    # key of TEMPLATES
  # The facts the biography states: the person's own, or (an unreadable
  # world, `shuffle_facts`) another person's.
  bio_city: str = ""
  bio_year: int = 0

  @property
  def biography(self) -> str:
    return TEMPLATES[self.templates]["biography"].format(
        name=self.name, city=self.bio_city or self.city,
        year=self.bio_year or self.year, job=self.job)

  @property
  def article_title(self) -> str:
    return f"Letters of {self.name}"


def _name(rng: np.random.Generator) -> str:
  def word(syllables):
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS)
                   + rng.choice(_CODAS) for _ in range(syllables)).title()
  return f"{word(2)} {word(2)}"


def make_people(num_people: int = 300, num_heldout: int = 100,
                seed: int = 0, *, num_dev: int = 0, templates: str = "a",
                shuffle_facts: bool = False) -> list[Person]:
  """`num_people` people with distinct names; the last `num_heldout` held out.

  Args:
    num_people, num_heldout, seed: the world.
    num_dev: the `num_dev` people before the held-out ones are `dev`: their
      X articles are neither trained on nor evaluated (a run's own held-out
      slice, e.g. for the retriever gate).
    templates: "a" or "b" (`TEMPLATES`).
    shuffle_facts: each biography states another person's city and year (a
      fixed derangement): a world where reading the retrieved block does
      not help, for controls.

  Raises:
    ValueError: if num_heldout is not in [1, num_people), or num_dev
      leaves no one to train on, or templates is unknown.
  """
  if not 1 <= num_heldout < num_people:
    raise ValueError(f"num_heldout={num_heldout} must be in [1, "
                     f"num_people={num_people}).")
  if not 0 <= num_dev < num_people - num_heldout:
    raise ValueError(f"num_dev={num_dev} must leave training people "
                     f"(num_people={num_people}, num_heldout={num_heldout}).")
  if templates not in TEMPLATES:
    raise ValueError(f"templates={templates!r}; use one of "
                     f"{sorted(TEMPLATES)}.")
  rng = np.random.default_rng([seed, 7])
  names: list[str] = []
  seen = set()
  while len(names) < num_people:
    name = _name(rng)
    if name not in seen:
      seen.add(name)
      names.append(name)
  people = [Person(name=n, city=str(rng.choice(CITIES)),
                   year=int(rng.choice(YEARS)), job=str(rng.choice(JOBS)),
                   heldout=i >= num_people - num_heldout,
                   dev=num_people - num_heldout - num_dev <= i
                   < num_people - num_heldout, templates=templates)
            for i, n in enumerate(names)]
  if shuffle_facts:  # Person i's biography states person i+1's facts.
    people = [dataclasses.replace(p, bio_city=q.city, bio_year=q.year)
              for p, q in zip(people, people[1:] + people[:1])]
  return people


def article(person: Person) -> salient_spans.AnnotatedDocument:
  """The person's X article, annotated: one salient span per sentence."""
  sentences = []
  city_templates = TEMPLATES[person.templates]["city"]
  year_templates = TEMPLATES[person.templates]["year"]
  for template in city_templates + year_templates:
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
                       for t in city_templates + year_templates))


@dataclasses.dataclass(frozen=True)
class WorldFiles:
  """Where `write_world` put things."""
  block_store: str   # Z: one biography block per person
  train: str         # X: annotated articles of the training people
  heldout: str       # X: annotated articles of the held-out people
  people: str        # people.json: names, facts, split
  dev: str = ""      # X: annotated articles of the dev people (if any)


def write_world(directory: str, *, num_people: int = 300,
                num_heldout: int = 100, seed: int = 0,
                max_block_len: int = 64, num_dev: int = 0,
                templates: str = "a",
                shuffle_facts: bool = False) -> WorldFiles:
  """Writes the world's block store and annotated corpora (idempotent).

  Args:
    directory: output directory (created), one per world.
    num_people, num_heldout, seed, num_dev, templates, shuffle_facts: see
      `make_people`.
    max_block_len: block length of Z; a biography is ~35 wordpieces.

  Returns:
    The paths.
  """
  os.makedirs(directory, exist_ok=True)
  people = make_people(num_people, num_heldout, seed, num_dev=num_dev,
                       templates=templates, shuffle_facts=shuffle_facts)
  files = WorldFiles(
      block_store=os.path.join(directory, "blocks"),
      train=os.path.join(directory, "train.tfr.gz"),
      heldout=os.path.join(directory, "heldout.tfr.gz"),
      people=os.path.join(directory, "people.json"),
      dev=os.path.join(directory, "dev.tfr.gz") if num_dev else "")
  if not os.path.exists(files.block_store):
    tokenizer = Tokenizer()
    docs = [wikipedia.Document(p.name, p.biography) for p in people]
    block_store_writer.write_block_store(
        blocks.pack_blocks(docs, tokenizer, max_block_len=max_block_len),
        files.block_store, tokenizer_vocab_path=tokenizer.vocab_path,
        source=f"knowledge world seed {seed}", max_block_len=max_block_len)
  splits = {files.train: lambda p: not (p.heldout or p.dev),
            files.heldout: lambda p: p.heldout}
  if files.dev:
    splits[files.dev] = lambda p: p.dev
  for path, member in splits.items():
    if not os.path.exists(path):
      salient_spans.write_annotated(path, [article(p) for p in people
                                           if member(p)])
  if not os.path.exists(files.people):
    io_utils.atomic_write_text(files.people, json.dumps(
        [dataclasses.asdict(p) for p in people]))
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
    return [Person(**p) for p in json.load(f)]  # Atomic (replace).


def ict_warm_start(root: str, files: WorldFiles, *, steps: int,
                   batch_size: int | None = None) -> tuple[str, str]:
  """ICT on a written world with experiments/pretrain_world_cpu.gin (in
  `root`/ict), and the training queries as that recipe masks them
  (query_length 32, 2 masks; `root`/queries): what a test's REALM run on
  the world starts from. ICT never scores the null document, so it runs
  with the embedded one and its checkpoints suit either null mode.

  Returns:
    (the query cache, the ICT checkpoint directory).
  """
  # pylint: disable=g-import-not-at-top
  import gin
  from realm_jax import gin_cli
  from realm_jax.core import checkpoints
  from realm_jax.model.realm import RealmConfig
  from realm_jax.testing import corpus
  from realm_jax.training import ict
  # pylint: enable=g-import-not-at-top
  workdir = os.path.join(root, "ict")
  gin.clear_config()
  try:
    gin_cli.parse(["experiments/pretrain_world_cpu.gin"], [
        f"WORKDIR = '{workdir}'", f"BLOCK_STORE = '{files.block_store}'",
        "QUERIES = 'unused'", f"ict.IctTrainConfig.num_train_steps = {steps}",
        "realm.RetrieverConfig.null_score = 'embedding'"] + (
            [f"ict.IctTrainConfig.batch_size = {batch_size}"]
            if batch_size else []))
    ict.train(config=gin.get_configurable(ict.IctTrainConfig)(),
              model=gin.get_configurable(RealmConfig)())
  finally:
    gin.clear_config()
  queries = corpus.make_query_cache(files.train, os.path.join(root, "queries"),
                                    query_length=32, max_masks=2)
  return queries, checkpoints.checkpoint_dir(workdir)

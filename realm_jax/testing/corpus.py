"""A small real-text corpus (block store + annotated records) for tests.

Built with the real jobs' code: spaCy salient spans, WordPiece blocks.
"""

from __future__ import annotations

import os

from realm_jax.data import block_store_writer, blocks, salient_spans, wikipedia
from realm_jax.data.tokenizer import Tokenizer

ARTICLES = [
    ("Paris", "Paris is the capital of France. The Eiffel Tower was built "
              "in 1889 for the World's Fair. The Louvre is in Paris."),
    ("Berlin", "Berlin is the capital of Germany. The Berlin Wall fell on "
               "9 November 1989. Angela Merkel worked in Berlin."),
    ("Tokyo", "Tokyo is the capital of Japan. Tokyo hosted the Olympic "
              "Games in 1964. Mount Fuji is near Tokyo."),
    ("Nile", "The Nile flows through Egypt and Sudan. Cairo lies on the "
             "Nile. The Aswan Dam was completed in 1970."),
    ("Amazon", "The Amazon River flows through Brazil and Peru. Francisco "
               "de Orellana explored the Amazon in 1542."),
    ("Mozart", "Wolfgang Amadeus Mozart was born in Salzburg in 1756. "
               "Mozart moved to Vienna in 1781."),
    ("Einstein", "Albert Einstein was born in Ulm in 1879. Einstein "
                 "received the Nobel Prize in 1921. He worked in Princeton."),
    ("Shakespeare", "William Shakespeare was born in Stratford-upon-Avon. "
                    "Shakespeare wrote Hamlet around 1600. He died in 1616."),
]


# Short articles that span several blocks of 16 wordpieces: the search and
# candidate tests' corpus (`small_blocks`).
SHORT_ARTICLES = {
    "Paris": "Paris is the capital of France. It lies on the Seine. "
             "The city has many museums, including the Louvre.",
    "Berlin": "Berlin is the capital of Germany. The Wall fell in 1989.",
    "Tokyo": "Tokyo is the capital of Japan. It hosted the Olympics in 1964 "
             "and in 2021.",
    "Nile": "The Nile is a river in Africa. It flows north into the "
            "Mediterranean Sea.",
}


def small_blocks(path: str, articles: dict[str, str]):
  """A block store of `articles` (title -> text) in blocks of at most 16
  wordpieces, so that an article spans several blocks."""
  return write_store(path, [wikipedia.Document(t, x)
                            for t, x in articles.items()], max_block_len=16)


def write_store(path: str, docs, max_block_len: int):
  """A block store of `docs` (`wikipedia.Document`s), written at `path`."""
  tok = Tokenizer()
  return block_store_writer.write_block_store(
      blocks.pack_blocks(docs, tok, max_block_len=max_block_len), str(path),
      tokenizer_vocab_path=tok.vocab_path, source="test",
      max_block_len=max_block_len)


def make_tiny_corpus(directory: str, *, max_block_len: int = 32,
                     copies: int = 1) -> tuple[str, str]:
  """Writes `blocks/` and `annotated.tfr.gz` under `directory`.

  Returns:
    (block_store_dir, annotated_path).
  """
  os.makedirs(directory, exist_ok=True)
  tok = Tokenizer()
  docs = [wikipedia.Document(f"{t} {i}" if i else t, x)
          for i in range(copies) for t, x in ARTICLES]
  store_dir = os.path.join(directory, "blocks")
  if not os.path.exists(store_dir):
    block_store_writer.write_block_store(
        blocks.pack_blocks(docs, tok, max_block_len=max_block_len), store_dir,
        tokenizer_vocab_path=tok.vocab_path, source="tiny test corpus",
        max_block_len=max_block_len)
  annotated = os.path.join(directory, "annotated.tfr.gz")
  if not os.path.exists(annotated):
    nlp = salient_spans.load_nlp()
    salient_spans.write_annotated(
        annotated,
        [salient_spans.annotate_document(d.title, d.text, nlp) for d in docs])
  return store_dir, annotated


def make_query_cache(annotated: str, output_dir: str, *, num_shards: int = 1,
                     seed: int = 0, **query_config) -> str:
  """A query cache, built by the real Beam job (DirectRunner) once; an
  existing cache is kept.

  Args:
    annotated: annotated record files (glob or comma-separated).
    output_dir: the cache directory.
    num_shards: cache shards (a multiple of the host count of the run).
    seed: the masking seed.
    **query_config: `examples.RealmQueryConfig` fields (query_length,
      max_masks, masking, ...); the trainer reads them from the manifest.

  Returns:
    `output_dir`.
  """
  from realm_jax.data import examples, query_cache_writer  # pylint: disable=g-import-not-at-top
  if not os.path.exists(output_dir):
    query_cache_writer.build_query_cache(
        annotated, output_dir, seed=seed, num_shards=num_shards,
        query_config=examples.RealmQueryConfig(**query_config))
  return output_dir

"""The input formats: one table for corpora, one for questions.

`CORPUS_FORMATS`: each `CorpusFormat` says how its files are read into
documents (`read`: `(doc_id, title, text)` rows), how a chunk of those
rows becomes blocks (`pack`), which `CorpusConfig` settings its reader
takes, and which file names it claims when `input_format` is not set. A
new corpus format is one reader, one packer (or one of the three here)
and one entry.

  wikipedia_xml  a MediaWiki dump (`*-pages-articles*.xml[.bz2]`): pages
                 as wikitext, the markup removed when packed.
  jsonl          JSON lines {"title", "text"} (`*.jsonl[.gz]`).
  dpr_tsv        DPR's passages (`psgs_w100.tsv`): one passage a block,
                 each keeping its passage id.
  squad          a SQuAD v1.1 JSON file's paragraphs, each a document whose
                 blocks keep its paragraph id (gold-paragraph recall).
  orqa           ORQA's `blocks.tfr` + `titles.tfr` (chosen by the files,
                 not by name): one record a block.

`QUESTION_FORMATS`: the eval's questions, {name: reader}; by the file
name unless named (`EvalConfig.qa_format`):

  orqa_jsonl     ORQA's JSON lines {"question", "answers"} (answers may be
                 regular expressions: CuratedTrec), `qa.read_qa_jsonl`.
  squad_json     a SQuAD v1.1 JSON file (`*.json`), each question keeping
                 its paragraph id (gold-paragraph recall).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterator, Sequence

from realm_jax.data import blocks as blocks_lib
from realm_jax.data import qa as qa_lib
from realm_jax.data import wikipedia

Row = tuple[Any, ...]  # (doc_index, title, text, doc_id)


@dataclasses.dataclass(frozen=True)
class CorpusFormat:
  """One corpus format (module docstring).

  Attributes:
    name: `CorpusConfig.input_format`'s value.
    read: (path, report, **options) -> `(doc_id, title, text)` rows in
      file order (`doc_id`: the passage or paragraph id, or None).
    pack: (rows, tokenizer, max_block_len, report, first_record, context)
      -> blocks; `context` has "input_path", "clean_options" and
      "wikitext".
    options: the `CorpusConfig` settings `read` takes.
    suffixes: the (uncompressed) file names it claims when no format is
      set; () for none.
    whole_titles: a chunk never ends between two rows of one title.
    wikitext: its text is wikitext: the markup is removed when packed, with
      the cleaning options the block store records.
  """
  name: str
  read: Callable[..., Iterator[tuple[Any, str, str]]]
  pack: Callable[..., list[blocks_lib.Block]]
  options: tuple[str, ...] = ()
  suffixes: tuple[str, ...] = ()
  whole_titles: bool = False
  wikitext: bool = False


def _pack_passages(rows: Sequence[Row], tokenizer, *, max_block_len: int,
                   report: wikipedia.Report, first_record: int,
                   context: dict[str, Any]) -> list[blocks_lib.Block]:
  """One record a block (ORQA's, DPR's), each keeping its passage id."""
  del context
  return [dataclasses.replace(block, passage_id=row[3])
          for block, row in zip(blocks_lib.pack_orqa_blocks(
              [row[1:3] for row in rows], tokenizer,
              max_block_len=max_block_len, report=report,
              first_record=first_record), rows)]


def _pack_paragraphs(rows: Sequence[Row], tokenizer, *, max_block_len: int,
                     report: wikipedia.Report, first_record: int,
                     context: dict[str, Any]) -> list[blocks_lib.Block]:
  """Each paragraph a document whose blocks carry its id
  (`BlockStore.passage_id`), so the eval finds a question's gold one."""
  del first_record, context
  blocks, doc_index = [], 0
  for _, title, text, paragraph_id in rows:
    own = list(blocks_lib.pack_blocks(
        [wikipedia.Document(title=title, text=text)], tokenizer,
        max_block_len=max_block_len, report=report))
    blocks += [dataclasses.replace(b, doc_index=doc_index,
                                   passage_id=paragraph_id) for b in own]
    doc_index += bool(own)
  return blocks


def _pack_documents(rows: Sequence[Row], tokenizer, *, max_block_len: int,
                    report: wikipedia.Report, first_record: int,
                    context: dict[str, Any]) -> list[blocks_lib.Block]:
  """Documents packed into blocks; wikitext (`context["wikitext"]`) with
  its markup removed by the job's `context["clean_options"]`."""
  del first_record
  documents = (
      wikipedia.clean_page(title, text, report,
                           f"{context['input_path']}: page '{title}'",
                           **context["clean_options"])
      if context["wikitext"] else wikipedia.Document(title=title, text=text)
      for _, title, text, _ in rows)
  return list(blocks_lib.pack_blocks(
      (d for d in documents if d), tokenizer, max_block_len=max_block_len,
      report=report))


def _read_pages(path: str, report: wikipedia.Report, **options):
  return ((None, d.title, d.text)
          for d in wikipedia.iter_wikipedia_pages(path, report, **options))


def _read_jsonl(path: str, report: wikipedia.Report, **options):
  return ((None, d.title, d.text)
          for d in wikipedia.iter_jsonl_documents(path, report, **options))


def _read_dpr(path: str, report: wikipedia.Report):
  del report
  return wikipedia.iter_dpr_passages(path)


def _read_squad(path: str, report: wikipedia.Report):
  del report
  from realm_jax.data import squad  # pylint: disable=g-import-not-at-top
  return ((p.id, p.title, p.text) for p in squad.read_squad(path).paragraphs)


def _read_orqa(path: str, report: wikipedia.Report, *, orqa_titles: str):
  return ((None, title, text) for title, text in
          blocks_lib.read_orqa_blocks(path, orqa_titles, report))


_SIZES = ("max_article_chars", "max_title_chars")
CORPUS_FORMATS: dict[str, CorpusFormat] = {f.name: f for f in (
    CorpusFormat("wikipedia_xml", _read_pages, _pack_documents,
                 options=_SIZES + ("allow_truncated", "keep_lists",
                                   "keep_disambiguation"), wikitext=True),
    CorpusFormat("jsonl", _read_jsonl, _pack_documents, options=_SIZES,
                 suffixes=(".jsonl", ".json", ".ndjson")),
    CorpusFormat("dpr_tsv", _read_dpr, _pack_passages, suffixes=(".tsv",),
                 whole_titles=True),
    CorpusFormat("squad", _read_squad, _pack_paragraphs),
    CorpusFormat("orqa", _read_orqa, _pack_passages, whole_titles=True),
)}
# What `CorpusConfig.input_format` may name (ORQA's is chosen by its files).
INPUT_FORMATS = tuple(name for name in CORPUS_FORMATS if name != "orqa")


def corpus_format(name: str) -> CorpusFormat:
  """The format `name`; an unknown name is a ValueError listing them."""
  if name not in CORPUS_FORMATS or name == "orqa":
    raise ValueError(f"input_format={name!r} is not one of {INPUT_FORMATS} "
                     "(or None: by the file name).")
  return CORPUS_FORMATS[name]


def corpus_format_of(input_path: str) -> CorpusFormat:
  """The format `input_path`'s name says (a dump by
  `wikipedia.is_wikipedia_dump`, else by suffix, .gz/.bz2 aside)."""
  if wikipedia.is_wikipedia_dump(input_path):
    return CORPUS_FORMATS["wikipedia_xml"]
  name = os.path.basename(input_path).lower()
  for suffix in (".bz2", ".gz"):
    name = name.removesuffix(suffix)
  for f in CORPUS_FORMATS.values():
    if f.suffixes and name.endswith(f.suffixes):
      return f
  raise ValueError(
      f"{input_path}: unknown corpus format; expected a Wikipedia dump "
      "(*-pages-articles*.xml[.bz2]), JSONL lines {\"title\", \"text\"} "
      "(*.jsonl[.gz]) or DPR's passages (psgs_w100.tsv), or set "
      "input_format.")


def _read_squad_questions(path: str, *, regex_answers: bool = False
                          ) -> list[qa_lib.QAExample]:
  if regex_answers:
    raise ValueError(f"{path}: SQuAD's answers are spans, not regular "
                     "expressions; unset regex_answers.")
  from realm_jax.data import squad  # pylint: disable=g-import-not-at-top
  return [q.example for q in squad.read_squad(path).questions]


QUESTION_FORMATS: dict[str, Callable[..., list[qa_lib.QAExample]]] = {
    "orqa_jsonl": qa_lib.read_qa_jsonl,
    "squad_json": _read_squad_questions,
}


def read_questions(path: str, question_format: str | None = None, *,
                   regex_answers: bool = False) -> list[qa_lib.QAExample]:
  """The questions of `path` in `question_format` (None: a `*.json` file is
  SQuAD's, any other ORQA's JSON lines)."""
  if question_format is None:
    question_format = ("squad_json" if os.fspath(path).endswith(".json")
                       else "orqa_jsonl")
  if question_format not in QUESTION_FORMATS:
    raise ValueError(f"question format {question_format!r} is not one of "
                     f"{tuple(QUESTION_FORMATS)} (or None: by the file "
                     "name).")
  return QUESTION_FORMATS[question_format](path, regex_answers=regex_answers)

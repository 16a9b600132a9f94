"""`realm-corpus`: the corpus job (`data.corpus_job.build_corpus`), a Beam
pipeline; flags that neither absl nor gin take are Beam options."""

import dataclasses
from typing import Sequence

from realm_jax import gin_cli
from realm_jax.data import corpus_job


def work(config: corpus_job.CorpusConfig,
         pipeline_args: Sequence[str]) -> None:
  corpus_job.build_corpus(pipeline_args=pipeline_args,
                          **dataclasses.asdict(config))


def main() -> None:
  gin_cli.run_data_job(work, "realm_jax.data.corpus_job", "CorpusConfig",
                       "runs/corpus.gin")


if __name__ == "__main__":
  main()

"""`realm-annotate`: salient-span annotation
(`data.annotate_job.annotate_corpus`), a Beam pipeline; flags that neither
absl nor gin take are Beam options."""

import dataclasses
import json
from typing import Sequence

from realm_jax import gin_cli
from realm_jax.data import annotate_job


def work(config: annotate_job.AnnotateConfig,
         pipeline_args: Sequence[str]) -> None:
  report = annotate_job.annotate_corpus(pipeline_args=pipeline_args,
                                        **dataclasses.asdict(config))
  print(json.dumps({k: report[k] for k in (
      "documents", "sentences", "spans", "num_shards", "annotation_seconds")}))


def main() -> None:
  gin_cli.run_data_job(work, "realm_jax.data.annotate_job", "AnnotateConfig",
                       "runs/annotate.gin")


if __name__ == "__main__":
  main()

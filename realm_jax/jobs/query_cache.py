"""`realm-query-cache`: the pre-training query cache
(`data.query_cache_writer.build_query_cache`), a Beam pipeline; flags that
neither absl nor gin take are Beam options."""

import json
from typing import Sequence

from realm_jax import gin_cli
from realm_jax.data import query_cache, query_cache_writer


def work(config: query_cache.QueryCacheConfig,
         pipeline_args: Sequence[str]) -> None:
  manifest = query_cache_writer.build_query_cache(
      config.annotated, config.output_dir, query_config=config.query_config,
      seed=config.seed, num_shards=config.num_shards,
      vocab_path=config.vocab_path, pipeline_args=pipeline_args,
      overwrite=config.overwrite, dev_share=config.dev_share)
  print(json.dumps({**{k: manifest[k] for k in ("num_shards", "num_queries",
                                                "build_seconds")},
                    "dev_queries": manifest.get("dev", {}).get(
                        "num_queries", 0)}))


def main() -> None:
  gin_cli.run_data_job(work, "realm_jax.data.query_cache",
                       "QueryCacheConfig", "runs/query_cache.gin", defaults=[
                           # An experiment file included for its query
                           # settings also names the trainer's paths.
                           f"{m} = ''" for m in ("WORKDIR", "BLOCK_STORE",
                                                 "QUERIES")])


if __name__ == "__main__":
  main()

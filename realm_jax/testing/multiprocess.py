"""One process of a multi-process (multi-host) run on localhost, for tests.

    python -m realm_jax.testing.multiprocess --coordinator=127.0.0.1:PORT \\
        --num_processes=2 --process_id=I -- <pretrain gin bindings...>

Joins `jax.distributed` with an explicit coordinator, then runs REALM
pre-training from `experiments/pretrain_tiny_cpu.gin` with the given
bindings, exactly as a pod host would run `realm_jax.training.pretrain`.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator", required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("bindings", nargs="*")
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  # CPU collectives across processes go through gloo.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from realm_jax.core import distributed  # pylint: disable=g-import-not-at-top
  distributed.maybe_initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes,
                               process_id=args.process_id)
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
  gin_cli.parse(["experiments/pretrain_tiny_cpu.gin"], args.bindings)
  pretrain.train(config=gin.get_configurable(pretrain.PretrainConfig)(),
                 model=gin.get_configurable(pretrain.RealmConfig)())
  print(f"process {jax.process_index()} of {jax.process_count()} done with "
        f"{jax.device_count()} devices", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])

"""`python -m benchmarks.learning`: the learning benchmark (see `cli`)."""

import os

from realm_jax import gin_cli

# Before JAX starts its backends (nothing here has imported it yet).
gin_cli.add_cpu_xla_flag()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.learning import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

if __name__ == "__main__":
  cli.main()

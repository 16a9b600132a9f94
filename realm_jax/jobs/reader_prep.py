"""`realm-reader-prep`: reader preparation (`training.reader_prep.train`)."""

from realm_jax import gin_cli


def main() -> None:
  gin_cli.run(gin_cli.training_job("realm_jax.training.reader_prep",
                                   "ReaderPrepConfig"))


if __name__ == "__main__":
  main()

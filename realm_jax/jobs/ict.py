"""`realm-ict`: ICT warm start of the retriever (`training.ict.train`)."""

from realm_jax import gin_cli


def main() -> None:
  gin_cli.run(gin_cli.training_job("realm_jax.training.ict",
                                   "IctTrainConfig"))


if __name__ == "__main__":
  main()

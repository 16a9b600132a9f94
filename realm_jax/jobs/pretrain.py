"""`realm-pretrain`: REALM pre-training (`training.pretrain.train`)."""

from realm_jax import gin_cli


def main() -> None:
  gin_cli.run(gin_cli.training_job("realm_jax.training.pretrain",
                                   "PretrainConfig"))


if __name__ == "__main__":
  main()

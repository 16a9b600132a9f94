"""`realm-finetune`: open-QA fine-tuning (`training.finetune.train`)."""

from realm_jax import gin_cli


def main() -> None:
  gin_cli.run(gin_cli.training_job("realm_jax.training.finetune",
                                   "FinetuneConfig"))


if __name__ == "__main__":
  main()

"""`realm-export`: a run's checkpoint exported as Hugging Face /
sentence-transformers files (`export.export_checkpoint`)."""

from realm_jax import export, gin_cli
from realm_jax.core import gin_config


def job(dry_run: bool) -> None:
  import gin  # pylint: disable=g-import-not-at-top
  config = gin_config.configured(export.ExportConfig)
  if dry_run:
    print(gin.operative_config_str(), config)
  else:
    export.export_checkpoint(config)


def main() -> None:
  gin_cli.run(job, runs_file="runs/export.gin",
              config_class="realm_jax.export.ExportConfig")


if __name__ == "__main__":
  main()

"""`realm-index-builder`: the index builder (`index.builder`) beside a
trainer, or one-shot from a checkpoint or imported weights."""

from realm_jax import gin_cli
from realm_jax.core import checkpoints, gin_config, io_utils
from realm_jax.core import lease as lease_lib
from realm_jax.data import block_store
from realm_jax.index import builder


def job(dry_run: bool) -> None:
  import gin  # pylint: disable=g-import-not-at-top
  config = gin_config.configured(builder.BuilderConfig)
  if dry_run:
    print(gin.operative_config_str())
    print(config)
    return
  for name in ("workdir", "block_store"):
    if not getattr(config, name):
      raise SystemExit(
          f"BuilderConfig.{name} is not set: include runs/index_builder.gin "
          f"and pass --gin.{name.upper()}=\"'...'\".")
  store = block_store.BlockStore.open(config.block_store)
  root = checkpoints.index_root(config.workdir)
  try:
    builder.check_places(root, config.workdir, store, config.init_from or "")
  except io_utils.SamePlaceError as e:
    raise SystemExit(str(e)) from None
  with lease_lib.job_lease(root, "index builder"):
    builder.run_modes(config, store, root)


def main() -> None:
  gin_cli.run(job, runs_file="runs/index_builder.gin",
              config_class="realm_jax.index.builder.BuilderConfig")


if __name__ == "__main__":
  main()

"""`realm-index-extend`: a published index extended to new blocks
(`index.extend.extend_index`; its config and retriever: `index.extend_job`)."""

import os

from realm_jax import gin_cli
from realm_jax.core import checkpoints, gin_config
from realm_jax.core import lease as lease_lib
from realm_jax.data import block_store
from realm_jax.index import build, extend, extend_job, publish
from realm_jax.model.realm import RealmConfig

_MACROS = {"index_dir": "INDEX_DIR", "block_store": "BLOCK_STORE",
           "union_store": "UNION_STORE", "output_dir": "OUTPUT_DIR"}


def _open_store(config: extend_job.ExtendConfig,
                name: str) -> block_store.BlockStore:
  """The store `config.<name>` names, or a SystemExit naming the field and
  the path."""
  path = getattr(config, name)
  try:
    return block_store.BlockStore.open(path)
  except FileNotFoundError as e:
    raise SystemExit(
        f"ExtendConfig.{name}={path!r} is no block store ({e}); pass "
        f"--gin.{_MACROS[name]}=\"'...'\" the directory realm-corpus "
        "wrote.") from None


def _run_checkpoints(index_root: str, step: int | None) -> str:
  """`checkpoint:<run>/checkpoints@<step>` for the run whose `index/` is
  `index_root`: where the index builder took index `step` from."""
  if step is None:
    step = publish.read_latest(index_root)
    if step is None:
      raise SystemExit(f"{index_root} holds no published index (no LATEST); "
                       "pass --gin.INDEX_DIR=\"'...'\" an index root.")
  ckpt_dir = checkpoints.checkpoint_dir(os.path.dirname(
      os.path.normpath(index_root)))
  if step not in checkpoints.finalized_steps(ckpt_dir):
    raise SystemExit(
        f"ExtendConfig.init_from is not set and {ckpt_dir} holds no "
        f"checkpoint {step} (the index builder's source of index {step}); "
        "name the retriever the index was built from: "
        "--gin.INIT_FROM=\"'checkpoint:<dir>@<step>'\", \"'minilm'\", ...")
  return f"checkpoint:{ckpt_dir}@{step}"


def job(dry_run: bool) -> None:
  import gin  # pylint: disable=g-import-not-at-top
  config = gin_config.configured(extend_job.ExtendConfig)
  if dry_run:
    print(gin.operative_config_str())
    print(config)
    return
  for name, macro in _MACROS.items():
    if not getattr(config, name):
      raise SystemExit(f"ExtendConfig.{name} is not set: pass "
                       f"--gin.{macro}=\"'...'\" (runs/index_extend.gin).")
  base, union = _open_store(config, "block_store"), _open_store(
      config, "union_store")
  index_root = publish.resolve_index_root(config.index_dir)
  init_from = config.init_from or _run_checkpoints(index_root, config.step)
  # The checkpoint the retriever is read from is an input too: checked with
  # the others before anything is restored or written.
  inputs = {"init_from": build.init_from_source(init_from)}
  try:
    extend.check_output(config.output_dir, index_root=index_root,
                        base_store=base, union_store=union, inputs=inputs)
    retriever_config, params = extend_job.retriever(
        init_from, gin_config.configured(RealmConfig))
    path = extend.extend_index(
        index_root=index_root, base_store=base, union_store=union,
        retriever_params=params, retriever_config=retriever_config,
        output_root=config.output_dir, step=config.step,
        config=config.index_build, inputs=inputs)
  except (ValueError, lease_lib.LeaseHeldError, OSError) as e:
    # Inputs that do not fit (another store, other parameters, the same
    # place, a root another job publishes to): named, nothing written.
    raise SystemExit(f"{type(e).__name__}: {e}") from None
  print(f"published {path}: {len(union) - len(base)} new blocks over "
        f"{len(base)}")


def main() -> None:
  gin_cli.run(job, runs_file="runs/index_extend.gin",
              config_class="realm_jax.index.extend_job.ExtendConfig")


if __name__ == "__main__":
  main()

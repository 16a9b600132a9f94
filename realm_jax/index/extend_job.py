"""The extend job: a published index extended to new blocks, as a command.

`index.extend.extend_index` as a gin-configured job (runs/index_extend.gin,
`realm-index-extend`): a corpus that grew after training (a block store
that begins with the index's own blocks, `block_store.check_extends`) is
served by the trained retriever without rebuilding the whole index. Only
the new blocks are embedded, with the retriever the index was built from
(checked against its manifest's `params_sha256`), and the merged index is
published under another index root, with the same guards as the builder:
the output root must be apart from every input (`io_utils.check_apart`),
the job holds its lease, and publication is atomic (LATEST switches last).

    realm-index-extend --gin.INDEX_DIR="'W/index'" \\
        --gin.BLOCK_STORE="'B'" --gin.UNION_STORE="'B+new'" \\
        --gin.OUTPUT_DIR="'W/index_extended'"

The retriever: by default the checkpoint of the index's step in the run
the index belongs to (`<INDEX_DIR>/../checkpoints`, where the index builder
takes it), with the config that checkpoint carries. An index published
from imported weights names them: `--gin.INIT_FROM="'minilm'"` (with
`--gin_file=models/minilm_l6.gin`), `realm:<embedder ckpt>`, `orqa:<ckpt>`,
`checkpoint:<dir>[@N]`, ... as `BuilderConfig.init_from` takes them.

It is a job of its own rather than a mode of the index builder: the
builder's every path is about one workdir (its checkpoints in, its
`index/` out, under its lease), while an extension reads one index and two
stores and writes another root, which must be apart from that workdir's
index.
"""

from __future__ import annotations

import dataclasses
import os

from realm_jax.core import checkpoints, checks, gin_config
from realm_jax.core import lease as lease_lib
from realm_jax.data import block_store
from realm_jax.index import build, extend, publish
from realm_jax.model.realm import RealmConfig


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class ExtendConfig:
  """The extend job (runs/index_extend.gin).

  Attributes:
    index_dir: the published index root to extend (e.g. `<WORKDIR>/index`;
      a directory holding such an `index/` is accepted too).
    block_store: the block store that index serves.
    union_store: a block store that begins with `block_store`'s blocks
      (e.g. a corpus built from the same input followed by new documents).
    output_dir: the index root the extended index is published to (apart
      from `index_dir` and the stores; the base index stays as it is).
    step: the base index's step (None: the one LATEST names); the extended
      index is published under the same step.
    init_from: the retriever the index was built from, as
      `BuilderConfig.init_from` names it; None: checkpoint `step` of the
      run the index belongs to (`<index root>/../checkpoints`).
    index_build: how the searcher is built and published (as the
      builder's: `builder.IndexBuildConfig.<field>` in gin).
  """
  index_dir: str | None = checks.path_setting("reads", default=None)
  block_store: str | None = checks.path_setting("reads", default=None)
  union_store: str | None = checks.path_setting("reads", default=None)
  output_dir: str | None = checks.path_setting(
      "writes", "extended_index_root", default=None)
  step: int | None = None
  init_from: str | None = checks.path_setting("reads", default=None)
  index_build: build.IndexBuildConfig = build.IndexBuildConfig()

  def __post_init__(self):
    if (self.init_from or "").startswith(("block_emb:", "scratch")):
      raise ValueError(
          f"ExtendConfig.init_from={self.init_from!r} has no document tower "
          "to embed the new blocks with; name the retriever the index was "
          "built from, or rebuild the whole index over the union store "
          "with the index builder.")


_MACROS = {"index_dir": "INDEX_DIR", "block_store": "BLOCK_STORE",
           "union_store": "UNION_STORE", "output_dir": "OUTPUT_DIR"}


def _open_store(config: ExtendConfig, name: str) -> block_store.BlockStore:
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


def retriever(init_from: str, model: RealmConfig):
  """(retriever config, parameters) named by `init_from`: a realm_jax
  checkpoint is restored as the index builder restores it (its retriever
  alone, with the config it carries), so the parameters' checksum is the
  one the builder published; other weights as the builder imports them."""
  kind, _, source = init_from.partition(":")
  if kind != "checkpoint":
    return build.imported_retriever(init_from, model)
  what = f"ExtendConfig.init_from={init_from!r}"
  directory, step = checkpoints.parse_step_suffix(source, what)
  step = checkpoints.existing_step(directory, step, name=what)
  return build.checkpoint_retriever(directory, step, model.retriever)


def _job(dry_run: bool) -> None:
  import gin  # pylint: disable=g-import-not-at-top
  # The registered class lives in the imported module, not in __main__.
  from realm_jax.index import extend_job as module  # pylint: disable=g-import-not-at-top
  config = gin_config.configured(module.ExtendConfig)
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
    retriever_config, params = retriever(init_from,
                                         gin_config.configured(RealmConfig))
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


if __name__ == "__main__":
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  gin_cli.run(_job, runs_file="runs/index_extend.gin",
              config_class="realm_jax.index.extend_job.ExtendConfig")

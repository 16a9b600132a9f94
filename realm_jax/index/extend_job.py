"""The extend job: a published index extended to new blocks, as a command.

`index.extend.extend_index` as a gin-configured job (runs/index_extend.gin,
`realm-index-extend`: `realm_jax.jobs.index_extend`): a corpus that grew
after training (a block store that begins with the index's own blocks, `block_store.check_extends`) is
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

from realm_jax.core import checkpoints, checks
from realm_jax.index import build
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

"""`realm_jax.load`: a trained REALM in three lines.

    import realm_jax
    model = realm_jax.load("/tmp/realm_demo/finetune")
    print(model.ask("who wrote atlas shrugged?").prediction)

`load` takes a fine-tuning run's workdir (or its checkpoints/ directory)
and reads everything from the checkpoint: the model config, the run's
config (block store, index, question and reader lengths), and the weights.
It also takes an export (`python -m realm_jax.jobs.export`), which carries the
model config but no corpus: give `block_store` and `index_dir` then.
"""

from __future__ import annotations

from typing import Any

from realm_jax.checkpoint_import import exported
from realm_jax.core import checkpoints, io_utils
from realm_jax.data import block_store as block_store_lib
from realm_jax.eval import qa_model as qa_model_lib
from realm_jax.eval.qa_model import QAModel
from realm_jax.index import calibration, publish
from realm_jax.data import qa_inputs


def checkpoint_directory(path: str) -> str:
  """`path`'s checkpoints/ if it is a workdir, else `path` itself."""
  inside = checkpoints.checkpoint_dir(path)
  return inside if io_utils.as_path(inside).exists() else path


def load(path: str, *, block_store: str | None = None,
         index_dir: str | None = None, step: int | None = None,
         qa_config: qa_inputs.QAConfig | None = None,
         **kwargs) -> QAModel:
  """A ready answering model from a run, a checkpoint directory or an export.

  Args:
    path: a fine-tuning workdir, its checkpoints/ directory, or an export.
    block_store: the knowledge corpus (default: the run's).
    index_dir: its published index (default: the one the run trained
      against).
    step: checkpoint step (default: the newest).
    qa_config: question/reader lengths, K and R (default: the run's).
    **kwargs: more `QAModel` arguments (batch_size, num_evidence, mesh,
      ranker). `ranker="hybrid"` ranks as `realm-calibrate`'s file beside
      the index says when there is one for this index, else by the fixed
      rule; `model.ranker_choice.record()` says which ranker, weights and
      where they came from (`realm_jax.index.calibration`).

  Returns:
    The `QAModel` (`model.ask(question)` answers).
  """
  if io_utils.as_path(path).joinpath(exported.CONFIG_FILE).exists():
    model_config, params = exported.load_exported(path)
    if exported.span_head_trained(path) is False:
      params = qa_model_lib.without_span_head(params)
    if not (block_store and index_dir):
      raise ValueError(f"{path} is an export, which holds no corpus: give "
                       "block_store= and index_dir= (an index of that store "
                       "built with this retriever).")
    store = block_store_lib.BlockStore.open(block_store)
    index = publish.load_frozen_index(index_dir, store, model_config)
    root = publish.resolve_index_root(index_dir)
    kwargs["ranker"] = calibration.resolve(kwargs.get("ranker", "dense"),
                                           root, index=index, store=store)
    model = QAModel(model_config, params, index, store,
                    qa_config or qa_inputs.QAConfig(), **kwargs)
    model.index_root = root
    return model
  directory = checkpoint_directory(path)
  step = checkpoints.existing_step(directory, step)
  model_config, _, task = qa_model_lib.run_configs(directory, step)
  where = f"{directory}/{step}/meta"
  block_store = block_store or task.get("block_store")
  if not block_store:
    raise ValueError(f"{where} names no block store; give block_store=.")
  return qa_model_lib.load_qa_model(
      model_config=model_config,
      store=block_store_lib.BlockStore.open(block_store),
      checkpoint_dir=directory, step=step, index_dir=index_dir,
      qa_config=qa_config, **kwargs)


def config_of(path: str, step: int | None = None) -> dict[str, Any]:
  """The configs a checkpoint carries: {"model_config", "task_class",
  "task_config", "operative_config"} (JSON; nothing is executed)."""
  directory = checkpoint_directory(path)
  step = checkpoints.existing_step(directory, step)
  meta = qa_model_lib.configs_of(directory, step)
  return {k: meta[k] for k in ("model_config", "task_class", "task_config",
                               "operative_config") if k in meta}


run_configs = qa_model_lib.run_configs

__all__ = ["load", "config_of", "run_configs"]

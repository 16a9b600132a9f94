"""Orbax checkpoints of a REALM run, readable piecewise by side jobs.

A checkpoint step holds separate items so the index builder can restore the
retriever alone, without reading the reader or the optimizer state:

  <workdir>/checkpoints/<step>/{retriever, reader, opt_state, meta}

`meta` is JSON (step, config summary, seeds). The trainer writes a `DONE`
marker beside the steps when it finishes; side jobs stop on it. Directories
may be local or `gs://` (orbax and `realm_jax.core.io_utils` take both).

The layout of a run's workdir lives here too (`checkpoint_dir`,
`index_root`), so the side jobs (index builder, eval, ask) agree with the
trainer on where things are without importing one another.
"""

from __future__ import annotations

import json
from typing import Any

import orbax.checkpoint as ocp

from realm_jax.core import io_utils

DONE_MARKER = "DONE"
PARAM_ITEMS = ("retriever", "reader")


def checkpoint_dir(workdir: io_utils.PathLike) -> str:
  return io_utils.join(workdir, "checkpoints")


def index_root(workdir: io_utils.PathLike) -> str:
  """Where the index builder publishes a run's indices."""
  return io_utils.join(workdir, "index")


def finalized_steps(directory: io_utils.PathLike) -> list[int]:
  """Steps orbax has finished writing, ascending.

  Locally orbax renames a temp dir into place; on GCS it writes the step
  directory in place and marks it complete with a commit file, so the
  check is orbax's own.
  """
  path = io_utils.as_path(directory)
  if not path.is_dir():
    return []
  return sorted(int(p.name) for p in path.iterdir()
                if p.name.isdigit() and ocp.step.is_path_finalized(p))


def newest_step(directory: io_utils.PathLike) -> int:
  """The newest finalized step.

  Raises:
    FileNotFoundError: there is none.
  """
  steps = finalized_steps(directory)
  if not steps:
    raise FileNotFoundError(f"No checkpoint steps under {directory}.")
  return steps[-1]


def read_meta(directory: io_utils.PathLike, step: int) -> dict[str, Any]:
  """The JSON `meta` item of checkpoint `step` ({} if unreadable).

  Read as a plain file, without orbax: side jobs want one field of it
  (fine-tuning records there the `index_step` it was trained against).
  """
  try:
    return json.loads(io_utils.read_text(io_utils.join(
        directory, str(step), "meta", "metadata")))
  except Exception:  # pylint: disable=broad-except
    # Missing or unreadable on any filesystem (gs:// raises tf.errors).
    return {}


class TrainCheckpointer:
  """Saves and restores {retriever, reader, opt_state, meta} with orbax.

  Keeps `keep` newest steps (>= 5: the index builder reads them while the
  trainer goes on).
  """

  def __init__(self, directory: io_utils.PathLike, *, keep: int = 5,
               async_save: bool = True):
    if keep < 1:
      raise ValueError(f"keep={keep} must be >= 1 (use >= 5 when an index "
                       "builder reads the checkpoints).")
    self.directory = io_utils.absolute(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True,
            enable_async_checkpointing=async_save))

  def save(self, step: int, params: dict[str, Any], opt_state: Any,
           meta: dict[str, Any] | None = None, *, force: bool = False) -> bool:
    missing = [k for k in PARAM_ITEMS if k not in params]
    if missing:
      raise ValueError(f"params lacks {missing}; REALM checkpoints hold "
                       f"{PARAM_ITEMS}.")
    return self._manager.save(
        step,
        args=ocp.args.Composite(
            retriever=ocp.args.StandardSave(params["retriever"]),
            reader=ocp.args.StandardSave(params["reader"]),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(dict(meta or {}, step=int(step)))),
        force=force)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, step: int, abstract_params: dict[str, Any],
              abstract_opt_state: Any) -> tuple[dict, Any, dict]:
    """Restores everything of `step` into the given structures/shardings."""
    out = self._manager.restore(
        step,
        args=ocp.args.Composite(
            retriever=ocp.args.StandardRestore(abstract_params["retriever"]),
            reader=ocp.args.StandardRestore(abstract_params["reader"]),
            opt_state=ocp.args.StandardRestore(abstract_opt_state),
            meta=ocp.args.JsonRestore()))
    return ({"retriever": out.retriever, "reader": out.reader},
            out.opt_state, dict(out.meta))

  def restore_params(self, step: int) -> dict[str, Any]:
    """{retriever, reader} of `step` on this process's first device."""
    return restore_items(self.directory, step, PARAM_ITEMS)

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def _item_handlers():
  return {"retriever": ocp.StandardCheckpointHandler(),
          "reader": ocp.StandardCheckpointHandler(),
          "opt_state": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler()}


def restore_items(directory: io_utils.PathLike, step: int,
                  names: tuple[str, ...],
                  abstract: dict[str, Any] | None = None) -> dict[str, Any]:
  """Restores some items of checkpoint `step`, whatever topology saved it.

  Args:
    directory: the checkpoint directory.
    step: the step to read.
    names: items to read (e.g. ("retriever",) for the index builder).
    abstract: optional {name: tree of jax.ShapeDtypeStruct with shardings};
      default: the saved shapes on this process's first device (side jobs
      usually run on other devices than the trainer that saved).
  """
  import jax  # pylint: disable=g-import-not-at-top
  manager = ocp.CheckpointManager(
      io_utils.absolute(directory),
      options=ocp.CheckpointManagerOptions(read_only=True, create=False),
      item_handlers=_item_handlers())
  try:
    if step not in manager.all_steps():
      raise FileNotFoundError(f"No checkpoint step {step} under {directory} "
                              f"(steps: {list(manager.all_steps())}).")
    abstract = dict(abstract or {})
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    metadata = manager.item_metadata(step)
    for name in names:
      if name not in abstract:
        abstract[name] = jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                           sharding=device),
            metadata[name])
    out = manager.restore(step, args=ocp.args.Composite(**{
        name: ocp.args.StandardRestore(abstract[name]) for name in names}))
    return {name: out[name] for name in names}
  finally:
    manager.close()


def restore_retriever(directory: io_utils.PathLike, step: int,
                      abstract: Any | None = None) -> Any:
  """Restores only the retriever parameters of checkpoint `step`."""
  return restore_items(directory, step, ("retriever",),
                       None if abstract is None else
                       {"retriever": abstract})["retriever"]


def write_done_marker(directory: io_utils.PathLike, final_step: int) -> None:
  """Tells side jobs the run is over (an atomic write)."""
  io_utils.atomic_write_text(io_utils.join(directory, DONE_MARKER),
                             json.dumps({"final_step": int(final_step)}))


def is_done(directory: io_utils.PathLike) -> bool:
  return io_utils.as_path(directory).joinpath(DONE_MARKER).exists()

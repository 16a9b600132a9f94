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

import asyncio
import contextlib
import json
import numbers
import os
import sys
import threading
import time
from typing import Any

from absl import logging
import orbax.checkpoint as ocp

from realm_jax.core import io_utils

DONE_MARKER = "DONE"
PARAM_ITEMS = ("retriever", "reader")
# After a failed save, how long the interpreter may take to wind down once
# the main thread is done before the process is ended (see
# `_exit_when_main_thread_ends`).
EXIT_GRACE_SECONDS = 10.0


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written; the run must stop."""


class CheckpointRestoreError(RuntimeError):
  """There are checkpoints, and none of them restores."""


def _exit_when_main_thread_ends(code: int, grace_seconds: float) -> None:
  """Ends the process with `code` once the main thread is done.

  A save that fails in orbax's background leaves orbax's non-daemon
  threads waiting (up to orbax's 300 s coordination timeout per wait, and
  chained) for signals the failed save never sends, and the interpreter
  waits for every non-daemon thread before it exits: the job would hang
  after it reported the error. This daemon thread waits for the main
  thread to finish (its exception printed), gives other threads
  `grace_seconds` to end, then ends the process.
  """

  def watch():
    threading.main_thread().join()
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
      if not any(t.is_alive() and not t.daemon
                 for t in threading.enumerate()
                 if t is not threading.current_thread()):
        return  # Nothing holds the interpreter: it exits on its own.
      time.sleep(0.1)
    sys.stderr.write("A checkpoint save failed; orbax's threads still "
                     f"wait after {grace_seconds:.0f} s: exiting with "
                     f"status {code}.\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access

  threading.Thread(target=watch, daemon=True,
                   name="exit-after-failed-checkpoint").start()


class _DrainingEventLoop(asyncio.SelectorEventLoop):
  """An event loop that finishes its tasks before it closes.

  Orbax runs each restore in a fresh loop and closes it as soon as the
  restore's `asyncio.gather` raises; the other arrays' reads are still in
  flight then. When TensorStore completes one, its callback finds the
  loop closed: a `RuntimeError: Event loop is closed` traceback on stderr
  per read, and an `Exception ignored in <coroutine ...>` with a spec dump
  per unfinished coroutine, dozens in all after the one clear error. This
  loop cancels what is left and waits for it to end first, as
  `asyncio.run` does.
  """

  def close(self) -> None:
    if not self.is_closed() and not self.is_running():
      pending = [t for t in asyncio.all_tasks(self) if not t.done()]
      for task in pending:
        task.cancel()
      if pending:
        # Their errors are the failed restore's, already on their way up.
        self.run_until_complete(
            asyncio.gather(*pending, return_exceptions=True))
    super().close()

  def call_soon_threadsafe(self, callback, *args, context=None):
    # A read whose task was cancelled above can still complete later, in
    # TensorStore's own threads: its result has nowhere to go, and asyncio
    # would raise (and TensorStore print) "Event loop is closed" for it.
    try:
      return super().call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
      if self.is_closed():
        return None
      raise


class _DrainingPolicy(asyncio.AbstractEventLoopPolicy):
  """`base`, except that new loops are `_DrainingEventLoop`s (the loops
  threads have set stay theirs)."""

  def __init__(self, base: asyncio.AbstractEventLoopPolicy):
    self._base = base

  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _DrainingEventLoop()

  def get_event_loop(self) -> asyncio.AbstractEventLoop:
    return self._base.get_event_loop()

  def set_event_loop(self, loop) -> None:
    self._base.set_event_loop(loop)

  def get_child_watcher(self):
    return self._base.get_child_watcher()

  def set_child_watcher(self, watcher) -> None:
    self._base.set_child_watcher(watcher)


_policy_lock = threading.Lock()


@contextlib.contextmanager
def _reads_finished_before_close():
  """Orbax's restores in this block run in `_DrainingEventLoop`s.

  Orbax makes its loops with `asyncio.new_event_loop()`, which asks the
  process's event loop policy: that policy is wrapped for the block (and
  put back after); loops made meanwhile by other threads only drain too,
  and the loops threads have set are untouched.
  """
  with _policy_lock:
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy(previous))
    try:
      yield
    finally:
      asyncio.set_event_loop_policy(previous)


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


def existing_step(directory: io_utils.PathLike, step: Any = None, *,
                  name: str = "step") -> int:
  """`step` of checkpoint directory `directory`, checked to exist (None:
  the newest).

  Args:
    directory: a checkpoint directory.
    step: what the caller asked for.
    name: how the caller sets it, for the messages: a field name
      ("step": "step=99: ..."), or the whole setting
      ("init_from='checkpoint:D@4'").

  Raises:
    TypeError: `step` is not an int (4.0, "4", True).
    FileNotFoundError: no such step (the message lists the steps there).
  """
  if step is None:
    return newest_step(directory)
  if isinstance(step, bool) or not isinstance(step, numbers.Integral):
    raise TypeError(f"{name}={step!r} ({type(step).__name__}) is not a "
                    "checkpoint step; give an int, or None for the newest.")
  steps = finalized_steps(directory)
  if int(step) not in steps:
    label = f"{name}={int(step)}" if name.isidentifier() else name
    raise FileNotFoundError(
        f"{label}: checkpoint {directory}/{int(step)} does not "
        f"exist; the steps there are {steps or 'none'} (give one of them, "
        "or None for the newest).")
  return int(step)


def parse_step_suffix(spec: str, what: str) -> tuple[str, int | None]:
  """`<dir>[@step]` -> (dir, step or None).

  Raises:
    ValueError: the part after `@` is not a step number, naming `what`.
  """
  directory, at, step = spec.rpartition("@") if "@" in spec else (
      spec, "", "")
  if not at:
    return spec, None
  if not (step.isascii() and step.isdigit()):
    raise ValueError(
        f"{what}: {step!r} after '@' is not a checkpoint step; write "
        "<directory>@<step>, e.g. @4, or leave '@' out for the newest.")
  return directory, int(step)


def read_meta(directory: io_utils.PathLike, step: int) -> dict[str, Any]:
  """The JSON `meta` item of checkpoint `step` ({} if unreadable).

  Read as a plain file, without orbax: side jobs want one field of it
  (fine-tuning records there the `index_step` it was trained against).
  """
  try:
    text = io_utils.read_text(io_utils.join(directory, str(step), "meta",
                                            "metadata"))
    return json.loads(text)  # Orbax's JSON; unreadable: {}.
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
    # Orbax would write (and prune old steps) through a planted link.
    io_utils.check_own_dir(self.directory, "the checkpoint directory")
    self._failure: str | None = None
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True,
            enable_async_checkpointing=async_save))

  def save(self, step: int, params: dict[str, Any], opt_state: Any,
           meta: dict[str, Any] | None = None, *, force: bool = False) -> bool:
    """Starts saving checkpoint `step` (finished in the background).

    Raises:
      CheckpointSaveError: this save, or an earlier one still finishing,
        failed; the message names the directory and orbax's error (with
        the path it could not write). The process then exits non-zero
        once its main thread is done, even though orbax's threads hang.
    """
    missing = [k for k in PARAM_ITEMS if k not in params]
    if missing:
      raise ValueError(f"params lacks {missing}; REALM checkpoints hold "
                       f"{PARAM_ITEMS}.")
    try:
      return self._manager.save(
          step,
          args=ocp.args.Composite(
              retriever=ocp.args.StandardSave(params["retriever"]),
              reader=ocp.args.StandardSave(params["reader"]),
              opt_state=ocp.args.StandardSave(opt_state),
              meta=ocp.args.JsonSave(dict(meta or {}, step=int(step)))),
          force=force)
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_failed(e) from e

  def _save_failed(self, error: Exception) -> CheckpointSaveError:
    """Reports a failed save once, arms the exit, returns the error."""
    if self._failure is None:
      self._failure = (
          f"Saving a checkpoint to {self.directory} failed: "
          f"{type(error).__name__}: {error}. "
          "Check that the directory is writable and has space; the run "
          "stops here and resumes from the newest checkpoint written.")
      logging.error("%s", self._failure)
      _exit_when_main_thread_ends(1, EXIT_GRACE_SECONDS)
    return CheckpointSaveError(self._failure)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, step: int, abstract_params: dict[str, Any],
              abstract_opt_state: Any) -> tuple[dict, Any, dict]:
    """Restores everything of `step` into the given structures/shardings."""
    with _reads_finished_before_close():
      out = self._manager.restore(
          step,
          args=ocp.args.Composite(
              retriever=ocp.args.StandardRestore(
                  abstract_params["retriever"]),
              reader=ocp.args.StandardRestore(abstract_params["reader"]),
              opt_state=ocp.args.StandardRestore(abstract_opt_state),
              meta=ocp.args.JsonRestore()))
    return ({"retriever": out.retriever, "reader": out.reader},
            out.opt_state, dict(out.meta))

  def restore_newest(self, abstract_params: dict[str, Any],
                     abstract_opt_state: Any
                     ) -> tuple[int, dict, Any, dict] | None:
    """The newest checkpoint that restores: (step, params, opt_state, meta).

    A checkpoint that does not restore (a truncated array file, an emptied
    meta) is skipped with a warning naming its directory. Once an older one
    restored, the broken newer ones are moved aside to
    `<step>.unrestorable-<unix time>` beside the steps, never deleted (for
    inspection; orbax and the side jobs ignore such names), so the resumed
    run does not save its new steps next to them. When none restores,
    nothing is moved: a config that no longer fits the checkpoints fails
    every step alike, and its checkpoints must stay where they are.

    Returns:
      None when there is no checkpoint at all.

    Raises:
      CheckpointRestoreError: none restores; names every step's directory
        and its error.
    """
    import jax  # pylint: disable=g-import-not-at-top
    broken = []
    for step in sorted(self.all_steps(), reverse=True):
      path = io_utils.join(self.directory, str(step))
      try:
        params, opt_state, meta = self.restore(step, abstract_params,
                                               abstract_opt_state)
      except Exception as e:  # pylint: disable=broad-except
        # Orbax and TensorStore raise many kinds (ValueError, JSON errors,
        # OUT_OF_RANGE / DATA_LOSS statuses): any failure is this step's.
        failure = f"{type(e).__name__}: {_brief(e)}"
        logging.warning("checkpoint %s does not restore (%s); trying an "
                        "older one.", path, failure)
        logging.debug("checkpoint restore failed", exc_info=e)
        # The message only: the error would keep orbax's frames alive.
        broken.append((step, path, failure))
        continue
      if broken:
        if jax.process_index() == 0:
          for bad, bad_path, _ in broken:
            aside = io_utils.move_aside(
                bad_path, f"{bad}.unrestorable-{int(time.time())}")
            logging.warning("moved the unrestorable checkpoint %s aside to "
                            "%s (kept for inspection; delete it when done)",
                            bad_path, aside)
        self._manager.reload()
      return step, params, opt_state, meta
    if not broken:
      return None
    raise CheckpointRestoreError(
        f"No checkpoint under {self.directory} restores: " + "; ".join(
            f"{path}: {failure}" for _, path, failure in broken)
        + ". If the config changed since they were written, restore it; "
        "if the files are damaged, move the step directories out of "
        f"{self.directory} to start over (or to resume from a copy).")

  def restore_params(self, step: int) -> dict[str, Any]:
    """{retriever, reader} of `step` on this process's first device."""
    return restore_items(self.directory, step, PARAM_ITEMS)

  def wait_until_finished(self) -> None:
    """Waits for the background saves (CheckpointSaveError if one failed)."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_failed(e) from e

  def close(self) -> None:
    """Finishes the saves; after a failed one, only logs further errors (the
    first is the one to report, and is already on its way up)."""
    try:
      self._manager.close()
    except Exception as e:  # pylint: disable=broad-except
      if self._failure is None:
        raise self._save_failed(e) from e
      logging.warning("closing %s after a failed save: %r", self.directory,
                      e)


def _item_handlers():
  return {"retriever": ocp.StandardCheckpointHandler(),
          "reader": ocp.StandardCheckpointHandler(),
          "opt_state": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler()}


def restore_items(directory: io_utils.PathLike, step: int,
                  names: tuple[str, ...],
                  abstract: dict[str, Any] | None = None, *,
                  way_out: str = "read an older step ({older})"
                  ) -> dict[str, Any]:
  """Restores some items of checkpoint `step`, whatever topology saved it.

  Args:
    directory: the checkpoint directory.
    step: the step to read.
    names: items to read (e.g. ("retriever",) for the index builder).
    abstract: optional {name: tree of jax.ShapeDtypeStruct with shardings};
      default: the saved shapes on this process's first device (side jobs
      usually run on other devices than the trainer that saved).
    way_out: what the caller can do about a checkpoint that does not
      restore; `{older}` becomes the newest older step.

  Raises:
    FileNotFoundError: there is no step `step`.
    CheckpointRestoreError: it does not restore (damaged files), in the
      trainer's words (`checkpoint <dir>/<step> does not restore (...)`)
      and `way_out`.
  """
  manager = ocp.CheckpointManager(
      io_utils.absolute(directory),
      options=ocp.CheckpointManagerOptions(read_only=True, create=False),
      item_handlers=_item_handlers())
  try:
    steps = list(manager.all_steps())
    if step not in steps:
      raise FileNotFoundError(f"No checkpoint step {step} under {directory} "
                              f"(steps: {steps}).")
    try:
      return _restore_from(manager, step, names, abstract)
    except FileNotFoundError:
      raise  # Deleted meanwhile (a trainer's retention), not damaged.
    except Exception as e:  # pylint: disable=broad-except
      # Orbax and TensorStore raise many kinds (see `restore_newest`).
      older = max((s for s in steps if s < step), default=None)
      failure = (
          f"checkpoint {io_utils.join(directory, str(step))} does not "
          f"restore ({type(e).__name__}: {_brief(e)}); its files are "
          "damaged: "
          + (way_out.format(older=older) if older is not None else
             "there is no older step to read instead."))
      logging.debug("checkpoint restore failed", exc_info=e)
  finally:
    manager.close()
  # Raised out of the handler, alone: the message says it all, and
  # orbax's and TensorStore's chained tracebacks (a spec dump of a hundred
  # lines) would bury it. The original is in the debug log.
  raise CheckpointRestoreError(failure)


def _brief(error: Exception) -> str:
  """`error`'s message without TensorStore's spec dump (dozens of lines)."""
  return str(error).split(" See full TensorStore details")[0]


def _restore_from(manager, step: int, names: tuple[str, ...],
                  abstract: dict[str, Any] | None) -> dict[str, Any]:
  """`restore_items` with an open read-only manager."""
  import jax  # pylint: disable=g-import-not-at-top
  abstract = dict(abstract or {})
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  metadata = manager.item_metadata(step)
  for name in names:
    if name not in abstract:
      abstract[name] = jax.tree_util.tree_map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                         sharding=device),
          metadata[name])
  with _reads_finished_before_close():
    out = manager.restore(step, args=ocp.args.Composite(**{
        name: ocp.args.StandardRestore(abstract[name]) for name in names}))
  return {name: out[name] for name in names}


def restore_retriever(directory: io_utils.PathLike, step: int,
                      abstract: Any | None = None, **kwargs) -> Any:
  """Restores only the retriever parameters of checkpoint `step`
  (`kwargs`: `restore_items`'s `way_out`)."""
  return restore_items(directory, step, ("retriever",),
                       None if abstract is None else
                       {"retriever": abstract}, **kwargs)["retriever"]


def write_done_marker(directory: io_utils.PathLike, final_step: int) -> None:
  """Tells side jobs the run is over (an atomic write)."""
  io_utils.atomic_write_text(io_utils.join(directory, DONE_MARKER),
                             json.dumps({"final_step": int(final_step)}))


def clear_done_marker(directory: io_utils.PathLike) -> None:
  """Removes DONE (one unlink, atomic), for a run that trains on."""
  path = io_utils.as_path(directory).joinpath(DONE_MARKER)
  if path.exists():
    logging.info("%s: removing the DONE of the finished run this one "
                 "continues", path)
    path.unlink(missing_ok=True)


def done_step(directory: io_utils.PathLike) -> int | None:
  """The final step DONE records, or None without a (readable) DONE."""
  try:
    text = io_utils.read_text(io_utils.join(directory, DONE_MARKER))
    return int(json.loads(text)["final_step"])  # Atomic; torn: None.
  except Exception:  # pylint: disable=broad-except
    # Missing, or torn, on any filesystem (gs:// raises tf.errors).
    return None


def is_done(directory: io_utils.PathLike) -> bool:
  return io_utils.as_path(directory).joinpath(DONE_MARKER).exists()

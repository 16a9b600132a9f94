"""The training loop every trainer shares (ICT, REALM pre-training, QA).

A trainer is a config, an input, a loss and a short `train`:

    with loop.Run(config, model, job="ict trainer", ...) as run:
      state = run.init_or_restore(fresh, tx, initial_params)
      history = run.loop(state, train_step, make_batch, meta=...)

`Run` owns everything around the step, so the trainers cannot drift apart:
the workdir and its exclusive lease (`core.lease`), the operative config,
TensorBoard/JSON metrics with progress and ETA, orbax checkpoints
(restored with abstract replicated shardings), preemption with one stop
decision for all hosts, the checkpoint cadence, the `DONE` marker,
`history.json` across restarts and the exit barrier. Trainer-specific work
plugs in as small hooks (`Hooks`): a host-synchronised index swap before a
step, an inline index refresh after a checkpoint, extra metrics and checks
at a log step.

Workdir paths may be local or `gs://`: files go through `core.io_utils`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import time
from typing import Any, Callable, Mapping, Sequence

from absl import logging
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from realm_jax.core import checkpoints, checks, dataclass_json, distributed
from realm_jax.core import io_utils
from realm_jax.core import parallel
from realm_jax.core import lease as lease_lib
from realm_jax.core import preemption as preemption_lib
from realm_jax.core import records
from realm_jax.training import optimizer as optimizer_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
@checks.type_checked
class TrainConfig:
  """What every trainer's config has (each trainer sets its own defaults).

  Attributes:
    workdir: checkpoints/, summaries/, metrics.jsonl, the operative config.
    block_store: the knowledge corpus Z (a block store directory).
    init_from: initial weights when the workdir has no checkpoint (see
      `realm_jax.checkpoint_import.init_from`).
    num_train_steps: total steps.
    batch_size: the global batch; must divide by the device count.
    learning_rate: peak learning rate.
    warmup_steps: None = BERT's rule, min(10000, max(100, steps / 10)).
    checkpoint_every: checkpoint period in steps.
    keep_checkpoints: orbax retention (>= 5 when another job polls them).
    log_every: metrics period in steps.
    seed: everything random derives from it.
  """

  workdir: str = checks.path_setting("home")
  block_store: str = checks.path_setting("reads")
  init_from: str | None = checks.path_setting("reads", default=None)
  num_train_steps: int | None = None
  batch_size: int
  learning_rate: float
  warmup_steps: int | None = None
  checkpoint_every: int = 1000
  keep_checkpoints: int = 5
  log_every: int = 100
  seed: int = 0

  def __post_init__(self):
    checks.at_least(self, "num_train_steps", optional=True)
    checks.at_least(self, "batch_size", "checkpoint_every",
                    "keep_checkpoints", "log_every")
    checks.at_least(self, "warmup_steps", minimum=0, optional=True)
    if self.learning_rate <= 0:
      raise ValueError(f"{type(self).__name__}.learning_rate="
                       f"{self.learning_rate} must be > 0.")

  def schedule(self, num_train_steps: int | None = None) -> dict[str, Any]:
    """The learning rate schedule's arguments."""
    return dict(learning_rate=self.learning_rate,
                num_train_steps=num_train_steps or self.num_train_steps,
                warmup_steps=self.warmup_steps)


@flax.struct.dataclass
class TrainState:
  """What one step changes: the step count, the trained params, Adam."""

  step: jax.Array
  params: Any
  opt_state: Any


def start_run(workdir: io_utils.PathLike, operative_config: str, *,
              is_chief: bool):
  """Creates the workdir, saves the operative gin config, returns a writer.

  Only process 0 writes the config and TensorBoard summaries; the others
  get a logging-only writer.
  """
  io_utils.makedirs(workdir)
  if is_chief and operative_config:
    io_utils.atomic_write_text(io_utils.join(workdir, "operative_config.gin"),
                               operative_config)
  if importlib.util.find_spec("tensorflow") is None:
    if is_chief:
      logging.warning(
          "TensorFlow is not installed here: no TensorBoard summaries in "
          "%s; the metrics go to the log and metrics.jsonl.",
          io_utils.join(workdir, "summaries"))
    return LoggingWriter()
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  summaries = io_utils.join(workdir, "summaries")
  # Event files are never written through a planted link.
  io_utils.check_no_links(summaries, workdir)
  # TensorBoard's writer opens gs:// itself (tf.io.gfile).
  return metric_writers.create_default_writer(summaries,
                                              just_logging=not is_chief)


class LoggingWriter:
  """The metric writer where TensorBoard's (clu's, through TensorFlow) cannot
  run, e.g. an accelerator host without TensorFlow: scalars to the log."""

  def write_scalars(self, step: int, scalars) -> None:
    logging.info("[%d] %s", step, ", ".join(
        f"{k}={float(v):.6g}" for k, v in sorted(scalars.items())))

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


def make_train_step(loss_fn: parallel.LossFn, optimizer, mesh,
                    grad_norm_groups: tuple[str, ...] = ()):
  """A jitted `train_step(state, batch, rng) -> (state, metrics)`.

  `state` is a `TrainState`; it is donated. The optimizer update runs on
  the replicated gradients outside `shard_map`, so every device applies the
  same update to its replica. Metrics hold the loss, the global gradient
  norm and `grad_norm_<group>` for each top-level key of the params named
  in `grad_norm_groups`.
  """
  grad_fn = parallel.data_parallel_value_and_grad(loss_fn, mesh)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def train_step(state: TrainState, batch, rng):
    step_rng = jax.random.fold_in(rng, state.step)
    loss, grads, metrics = grad_fn(state.params, batch, step_rng)
    with jax.named_scope("optimizer"):
      updates, opt_state = optimizer.update(grads, state.opt_state,
                                            state.params)
      params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    for group in grad_norm_groups:
      metrics[f"grad_norm_{group}"] = optax.tree.norm(grads[group])
    return TrainState(state.step + 1, params, opt_state), metrics

  return train_step


@dataclasses.dataclass
class Hooks:
  """Trainer-specific work at fixed points of `Run.loop`.

  Attributes:
    before_step: `(step) -> None`, before the batch of `step` is built
      (pre-training swaps in a fresh index here, on every host at the same
      step).
    after_checkpoint: `(step, state) -> None`, after checkpoint `step` was
      saved (pre-training's inline index refresh).
    log_metrics: `(step, metrics) -> metrics`, at a log step: adds metrics
      and runs checks (collapse warnings); its return is what is logged.
    checkpoint_meta: `(step) -> dict`, more meta for checkpoint `step`
      (pre-training's prefetched candidates), called on every host.
    update_state: `(step, state) -> state`, before the batch of `step` is
      built, after `before_step`: a decision measured in the run that
      changes the train state (pre-training's retriever gate releases the
      retriever here). Must return the same state on every host.
  """

  before_step: Callable[[int], None] | None = None
  after_checkpoint: Callable[[int, TrainState], None] | None = None
  log_metrics: Callable[[int, dict[str, float]], dict[str, float]] | None = (
      None)
  checkpoint_meta: Callable[[int], Mapping[str, Any]] | None = None
  update_state: Callable[[int, TrainState], TrainState] | None = None


def _abstract(tree, sharding):
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
      tree)


def progress(steps: int, seconds: float, step: int, total: int,
             batch_size: int) -> dict[str, float]:
  """Rates over the last `steps` steps (in `seconds`) and the ETA at `step`.

  The ETA assumes the remaining `total - step` steps run at the same rate.
  """
  seconds_per_step = seconds / steps
  steps_per_sec = steps / max(seconds, 1e-9)
  return dict(seconds_per_step=seconds_per_step, steps_per_sec=steps_per_sec,
              examples_per_second=batch_size * steps_per_sec,
              eta_seconds=(total - step) * seconds_per_step)


def format_eta(seconds: float) -> str:
  """A duration for the log line: "1h02m", "4m05s" or "12s"."""
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Run:
  """A training job's workdir, checkpoints and loop; a context manager.

  Entering takes an exclusive lease on the workdir (and on each of
  `lease_paths`, e.g. the index directory an inline-index trainer
  publishes to), so a second job on the same workdir is refused with
  `LeaseHeldError` before it reads anything; only process 0 holds it.
  The run writes to the workdir from `init_or_restore` on, so a trainer
  checks its inputs in between and a refused input leaves nothing behind.
  """

  def __init__(self, config: TrainConfig, model: Any, *, job: str,
               operative_config: str = "",
               lease_paths: Sequence[tuple[str, str]] = ()):
    """Args:
      config: the run (workdir, retention, cadences, batch, seed, schedule).
      model: the RealmConfig. Every checkpoint's meta carries both configs
        as JSON with the operative config, so `realm_jax.load` and the QA
        jobs rebuild the model from the checkpoint alone.
      job: names the job in logs and in the lease ("ict trainer").
      operative_config: gin's operative config, saved in the workdir.
      lease_paths: (directory, holder description) leased besides workdir.
    """
    # Checked here, not by the config: building a config must not start JAX
    # (gin parsing, dry runs, tests).
    distributed.check_divisible("batch_size", config.batch_size,
                                jax.device_count(), by_what="devices")
    self._configs = {"task_class": type(config).__name__,
                     "task_config": dataclass_json.to_dict(config),
                     "model_config": dataclass_json.to_dict(model),
                     "operative_config": operative_config}
    self.config, self.workdir, self.job = config, config.workdir, job
    self.is_chief = distributed.is_chief()
    self._operative_config = operative_config
    self._leases = [(self.workdir, job)] + list(lease_paths)
    self._stack = contextlib.ExitStack()
    self.mesh = parallel.make_mesh()
    self.replicated = parallel.replicated(self.mesh)

  def __enter__(self) -> "Run":
    with contextlib.ExitStack() as stack:
      for path, holder in self._leases:
        stack.enter_context(lease_lib.job_lease(path, holder))
      self._stack = stack.pop_all()
    return self

  def __exit__(self, *exc) -> None:
    self._stack.close()

  def _start(self) -> None:
    """Writes to the workdir only once the trainer's inputs checked out."""
    self.writer = start_run(self.workdir, self._operative_config,
                            is_chief=self.is_chief)
    self.ckpt = checkpoints.TrainCheckpointer(
        checkpoints.checkpoint_dir(self.workdir),
        keep=self.config.keep_checkpoints)
    self._stack.callback(self.ckpt.close)

  # -- State ------------------------------------------------------------------

  def init_or_restore(self, fresh, tx: optax.GradientTransformation,
                      initial_params: Callable[[], Any], *,
                      trained: Callable[[Any], Any] = lambda p: p
                      ) -> tuple[TrainState, Any, dict[str, Any]]:
    """The newest checkpoint's state, else a fresh one from `initial_params`.

    Args:
      fresh: freshly initialised parameters of the whole model: the shapes
        (and dtypes) a checkpoint is restored into.
      tx: the optimizer.
      initial_params: `() -> params` of the whole model for a run without
        a checkpoint (init_from, warm starts); called only then.
      trained: the subtree of the params the optimizer trains (ICT trains
        the retriever only; the rest is carried and saved unchanged).

    Returns:
      (state, params of the whole model, checkpoint meta or {}); state and
      params replicated over the mesh.
    """
    self._start()
    # The newest checkpoint that restores: a broken newer one (a truncated
    # file) is named in a warning and moved aside.
    restored = self.ckpt.restore_newest(
        _abstract(fresh, self.replicated),
        _abstract(jax.eval_shape(tx.init, trained(fresh)), self.replicated))
    if restored is not None:
      start, params, opt_state, meta = restored
      logging.info("%s: resumed from %s step %d", self.job,
                   self.ckpt.directory, start)
    else:
      params = jax.device_put(initial_params(), self.replicated)
      opt_state = jax.device_put(tx.init(trained(params)), self.replicated)
      start, meta = 0, {}
    step = jax.device_put(jnp.asarray(start, jnp.int32), self.replicated)
    return TrainState(step, trained(params), opt_state), params, meta

  def save(self, step: int, params, opt_state, meta: Mapping[str, Any]
           ) -> None:
    """Checkpoint `step` (asynchronous; `params` holds retriever + reader)."""
    self.ckpt.save(step, params, opt_state, {**self._configs, **meta},
                   force=True)

  # -- The loop ---------------------------------------------------------------

  def loop(self, state: TrainState, train_step, make_batch: Callable[
      [int, TrainState], Mapping[str, jax.Array]], *,
           meta: Mapping[str, Any],
           saved_params: Callable[[TrainState], Any] = lambda s: s.params,
           num_train_steps: int | None = None, seed: int | None = None,
           log_line: tuple[str, Sequence[str]] = ("loss %.4f", ("loss",)),
           hooks: Hooks = Hooks(), stop_after: int | None = None,
           clock: Callable[[], float] = time.monotonic
           ) -> list[dict[str, float]]:
    """Trains from `state.step` to `num_train_steps` (or a stop request).

    The cadences (checkpoint_every: the last step and a stop request
    checkpoint too; log_every: and the last step), the global batch (for
    examples/s) and the logged learning rate schedule come from the config.

    Args:
      state: the replicated train state to start from.
      train_step: `(state, batch, rng) -> (state, metrics)`.
      make_batch: `(step, state) -> device batch` of step `step` (a pure
        function of the step, so a restarted run replays the same batches).
      meta: saved in every checkpoint's meta beside the configs.
      saved_params: `state -> params` of the whole model, as checkpointed.
      num_train_steps: the run's total steps; None: the config's.
      seed: dropout keys derive from it (and the step); None: the config's.
      log_line: (format, metric names) of the one log line per logged
        step, after "step N/TOTAL:"; s/step, steps/s, examples/s and the
        ETA follow.
      hooks: trainer-specific work, see `Hooks`.
      stop_after: return after this many steps of this call (tests).
      clock: seconds, for the rates and the ETA (tests inject one).

    Returns:
      The metrics logged by this call, one dict per logged step.
    """
    c = self.config
    total = num_train_steps or c.num_train_steps
    learning_rate = optimizer_lib.learning_rate_schedule(**c.schedule(total))
    start = int(jax.device_get(state.step))
    end = total if stop_after is None else min(total, start + stop_after)
    metrics_path = io_utils.join(self.workdir, "metrics.jsonl")
    self._begin_steps(start, total, metrics_path)
    preempted = preemption_lib.Preemption()
    history = []
    base_rng = jax.random.key(c.seed if seed is None else seed)
    step, t_last, since_log = start, clock(), 0
    try:
      while step < end:
        if hooks.before_step:
          hooks.before_step(step)
        if hooks.update_state:
          state = hooks.update_state(step, state)
        state, metrics = train_step(state, make_batch(step, state), base_rng)
        step += 1
        since_log += 1
        if step % c.log_every == 0 or step == end:
          now = clock()
          self._log_step(step, total, metrics, steps=since_log,
                         seconds=now - t_last, learning_rate=learning_rate,
                         hooks=hooks, log_line=log_line, history=history,
                         metrics_path=metrics_path)
          t_last, since_log = now, 0
        stop = _stop_requested(preempted)
        if step % c.checkpoint_every == 0 or step == end or stop:
          self._checkpoint(step, state, meta, saved_params, hooks)
        if stop:
          logging.warning("Stop requested (SIGTERM or Ctrl-C): checkpointed "
                          "step %d, exiting.", step)
          break
    finally:
      preempted.close()
    self._end_steps(start, step, total, history)
    return history

  def _begin_steps(self, start: int, total: int, metrics_path: str) -> None:
    """Tidies the workdir (process 0) before `loop` trains from `start`."""
    if self.is_chief:
      # A run killed after logging steps past its last checkpoint logs them
      # again from that checkpoint on: their first lines go.
      records.keep_records(metrics_path, lambda r: r["step"] <= start)
      if start < total:
        # Continuing a finished run (more steps): side jobs must not take
        # the last run's DONE for this one's, so it goes before any step.
        checkpoints.clear_done_marker(self.ckpt.directory)

  def _log_step(self, step: int, total: int, metrics, *, steps: int,
                seconds: float, learning_rate, hooks: Hooks,
                log_line: tuple[str, Sequence[str]],
                history: list[dict[str, float]], metrics_path: str) -> None:
    """Logs `step`'s metrics, with the rates over the last `steps` steps
    (in `seconds`), to the summary writer, `history`, metrics.jsonl (process
    0) and the log line."""
    metrics = {k: float(v)
               for k, v in parallel.host_copy(metrics).items()}
    metrics.update(progress(steps, seconds, step, total,
                            self.config.batch_size),
                   learning_rate=float(learning_rate(step - 1)))
    if hooks.log_metrics:
      metrics = hooks.log_metrics(step, metrics)
    self.writer.write_scalars(step, metrics)
    history.append(dict(metrics, step=step))
    if self.is_chief:
      io_utils.append_jsonl(metrics_path, dict(metrics, step=step))
    fmt, names = log_line
    logging.info("step %d/%d: " + fmt + ", %.3f s/step, %.2f steps/s, "
                 "%.1f examples/s, eta %s", step, total,
                 *[metrics[n] for n in names],
                 metrics["seconds_per_step"], metrics["steps_per_sec"],
                 metrics["examples_per_second"],
                 format_eta(metrics["eta_seconds"]))

  def _checkpoint(self, step: int, state: TrainState,
                  meta: Mapping[str, Any],
                  saved_params: Callable[[TrainState], Any],
                  hooks: Hooks) -> None:
    """Saves checkpoint `step` with the hooks' meta; runs their
    `after_checkpoint`."""
    self.save(step, saved_params(state), state.opt_state, {
        **meta, **(hooks.checkpoint_meta(step)
                   if hooks.checkpoint_meta else {})})
    if hooks.after_checkpoint:
      hooks.after_checkpoint(step, state)

  def _end_steps(self, start: int, step: int, total: int,
                 history: list[dict[str, float]]) -> None:
    """After `loop` trained from `start` to `step`: waits for the last
    checkpoint, marks a finished run DONE, writes history.json (process 0)
    and meets the other hosts."""
    self.ckpt.wait_until_finished()
    if step >= total and self.is_chief:
      checkpoints.write_done_marker(self.ckpt.directory, step)
    self.writer.flush()
    if self.is_chief:
      self._write_history(start, history)
    distributed.barrier(f"{self.job}: exit")

  def _write_history(self, start: int, history: list[dict[str, float]]
                     ) -> None:
    """history.json holds the whole run: earlier calls' entries are kept.

    They come from metrics.jsonl (the same records, appended as they are
    logged), since an earlier call killed before its end never wrote
    history.json.
    """
    path = io_utils.join(self.workdir, "history.json")
    io_utils.check_own_file(path)  # Rewritten whole: never a link or FIFO.
    earlier = [h for h in records.read_records(
        io_utils.join(self.workdir, "metrics.jsonl")) if h["step"] <= start]
    io_utils.write_json(path, earlier + history)


def _stop_requested(preempted: preemption_lib.Preemption) -> bool:
  """Whether to stop after this step. Process 0 decides, so every host
  stops after the same step."""
  return bool(distributed.broadcast_from_chief(
      np.int32(preempted.requested))) if jax.process_count() > 1 else (
          preempted.requested)

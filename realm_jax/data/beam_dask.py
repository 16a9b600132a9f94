"""The data jobs on a Dask cluster: `--runner=dask`.

The Beam jobs (`corpus_job`, `annotate_job`, `query_cache`) take
`--runner=dask` (or `DaskRunner`; `beam_utils.pipeline` maps both to
`DaskRunner` below, by its class path, which works as a `--runner` too):

  --dask_client_address=tcp://HOST:8786  run on that Dask scheduler's
                          workers (Beam's own `DaskOptions`; also
                          `--dask_scheduler_file`, `--dask_connection_timeout`)
  --dask_workers=N        without an address: a local cluster of N worker
                          processes (1 thread each; default: one per core)
                          on 127.0.0.1, started for the job and stopped
                          after it
  --dask_npartitions=P    how many partitions a fan-out makes (below);
                          default 2 per worker thread of the cluster

The workers must import realm_jax (the same install as the launching
process) and see the job's paths: a local cluster shares the disk; a remote
one needs `OUTPUT_DIR` and the inputs on shared storage (gs://...), as
Dataflow does.

`DaskRunner` is Beam's `apache_beam.runners.dask.dask_runner.DaskRunner`
(Beam 2.77, a Dask Bag per PCollection) with what the jobs need of a
distributed runner and it lacks:
  * Work is spread over the workers. Beam's translation keeps a bag's
    partition count through `Reshuffle` (a no-op there) and `GroupByKey`,
    and `Create` puts up to 128 elements in one partition, so a job that
    starts from one element (the corpus and annotation jobs read their
    input in one sequential pass) or a few (the query cache: one element
    per annotated file) ran on one worker. Here `Create`, `Reshuffle` and
    `GroupByKey` make at least `--dask_npartitions` partitions and place
    partition i on the i-th worker thread, round-robin (a loose
    restriction, `_placed`): Dask otherwise runs a fan-out where its input
    lies, on the worker that read it.
  * Every branch runs, and once: Beam computes only the bag of the last
    transform visited, silently dropping the others (a pipeline with two
    sinks wrote one). Here all leaves are computed together, so what they
    share runs once.
  * Outputs of `DoFn.finish_bundle` are kept (Beam's collects a bundle's
    outputs before calling it).
  * The client is closed and a cluster started for the job is stopped
    (Beam's leaves its client, and the `LocalCluster` it starts when given
    no address, running after the pipeline).
  * What Beam's translation would run wrong is refused, naming the
    transform (NotImplementedError): `beam.io.Read` sources (translated to
    nothing), DoFns with several outputs (`with_outputs`: every consumer
    would get all of them), stateful or splittable DoFns, grouping in
    windows other than the global one, unbounded (streaming) input.
Side inputs work (each is computed where it is read). Metrics are not
collected (`result.metrics()` raises, as in Beam's).

Needs dask and distributed (`pip install -e ".[dask]" -c constraints.txt`;
the test extra has them).
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.options import pipeline_options
from apache_beam.runners import runner as runner_lib

from realm_jax.core import logs

try:
  from dask import bag as db  # pylint: disable=g-import-not-at-top
  import distributed  # pylint: disable=g-import-not-at-top
  from apache_beam.runners.dask import dask_runner as beam_dask  # pylint: disable=g-import-not-at-top
  from apache_beam.runners.dask import overrides as beam_overrides  # pylint: disable=g-import-not-at-top
  from apache_beam.runners.dask import transform_evaluator as beam_ops  # pylint: disable=g-import-not-at-top
  _MISSING = None
except ImportError as e:  # Without the `dask` extra: refused when used.
  _MISSING = e

# What `--runner=dask` becomes (`beam_utils.dask_runner_named`).
RUNNER = f"{__name__}.DaskRunner"
_INSTALL = ("the Dask runner needs dask and distributed: pip install -e "
            "\".[dask]\" -c constraints.txt")


class RealmDaskOptions(pipeline_options.PipelineOptions):
  """This runner's options beside Beam's `DaskOptions`."""

  @classmethod
  def _add_argparse_args(cls, parser) -> None:
    parser.add_argument(
        "--dask_workers", type=int, default=None,
        help="--runner=dask without --dask_client_address: the worker "
        "processes (1 thread each) of the local Dask cluster started for "
        "the job (default: one per core).")


def check_installed() -> None:
  """Raises ImportError, saying what to install, without dask."""
  if _MISSING is not None:
    raise ImportError(f"{_INSTALL} ({_MISSING}).") from _MISSING


def quiet_distributed() -> None:
  """distributed logs every worker, connection and client at INFO, to its
  own handler, from import on; where realm_jax hides library records
  (`core.logs`, verbosity 0) only its warnings and errors show (memory
  pressure, restarted workers)."""
  if logs.libraries_quiet():
    logging.getLogger("distributed").setLevel(logging.WARNING)


def local_cluster(n_workers: int):
  """A `distributed.LocalCluster` of `n_workers` processes of 1 thread,
  every server (scheduler, workers, their HTTP endpoints) on 127.0.0.1 at a
  free port. The caller closes it."""
  check_installed()
  quiet_distributed()
  # The workers' own distributed logs as `quiet_distributed` says: dask
  # reads its logging config from the environment on import, so the
  # variable must be there when the worker processes start.
  variable, before = "DASK_LOGGING__DISTRIBUTED", os.environ.get(
      "DASK_LOGGING__DISTRIBUTED")
  if logs.libraries_quiet() and before is None:
    os.environ[variable] = "warning"
  try:
    return distributed.LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True,
        host="127.0.0.1", dashboard_address="127.0.0.1:0",
        silence_logs=logging.WARNING)
  finally:
    if before is None:
      os.environ.pop(variable, None)


class DaskPipelineResult(runner_lib.PipelineResult):
  """A finished run (`DaskRunner.run_pipeline` returns when it is done)."""

  def __init__(self):
    super().__init__(runner_lib.PipelineState.DONE)

  def wait_until_finish(self, duration=None) -> str:
    del duration
    return self._state

  def cancel(self) -> str:
    return self._state

  def metrics(self):
    raise NotImplementedError("the Dask runner collects no metrics.")


if _MISSING is None:

  def _apply_dofn_to_bundle(items, fn, label, window_fn, side_inputs, args,
                            kwargs):
    """Beam's `apply_dofn_to_bundle` (a partition is a bundle), keeping
    `finish_bundle`'s outputs, with its own receivers and context (Beam's
    are shared by every partition of the step)."""
    receivers = beam_ops.OneReceiver()
    invoker = beam_ops.DoFnInvoker.create_invoker(
        beam_ops.DoFnSignature(fn),
        beam_ops._OutputHandler(  # pylint: disable=protected-access
            window_fn=window_fn, main_receivers=receivers[None],
            tagged_receivers=receivers, per_element_output_counter=None,
            output_batch_converter=None, process_yields_batches=False,
            process_batch_yields_elements=False),
        context=beam_ops.DoFnContext(label, state=None),
        side_inputs=side_inputs, input_args=list(args), input_kwargs=kwargs,
        user_state_context=None,
        bundle_finalizer_param=beam_ops.DoFn.BundleFinalizerParam())
    invoker.invoke_setup()
    invoker.invoke_start_bundle()
    for item in items:
      invoker.invoke_process(item)
    invoker.invoke_finish_bundle()
    invoker.invoke_teardown()
    return [v.value for v in receivers.values]

  class _ParDo(beam_ops.ParDo):
    """Beam's ParDo op with `_apply_dofn_to_bundle`."""

    def apply(self, input_bag, side_inputs=None):
      transform = self.transform
      args, kwargs = transform.raw_side_inputs
      main_input = next(iter(self.applied.main_inputs.values()))
      window_fn = (main_input.windowing.windowfn
                   if hasattr(main_input, "windowing") else None)
      return input_bag.map(beam_ops.get_windowed_value,
                           window_fn).map_partitions(
                               _apply_dofn_to_bundle, transform.fn,
                               transform.label, window_fn, side_inputs,
                               list(args), kwargs)

  class _Create(beam_ops.DaskBagOp):
    """`beam.Create`: its elements in up to `fan_out` partitions (Beam's
    puts up to 128 in each), or as `--dask_npartitions` /
    `--dask_partition_size` say, placed round-robin on the workers."""

    def apply(self, input_bag, side_inputs=None):
      assert input_bag is None, "Create has no input"
      items = list(self.transform.values)
      size = self.bag_kwargs.get("partition_size")
      with _placed(self.bag_kwargs["workers"]):
        if size:
          return db.from_sequence(items, partition_size=size)
        return db.from_sequence(items, npartitions=max(1, min(
            len(items), self.bag_kwargs["fan_out"])))

  class _Reshuffle(beam_ops.DaskBagOp):
    """`beam.Reshuffle`: its input in at least `fan_out` partitions, placed
    round-robin on the workers (a no-op in Beam's translation: a
    one-partition input stayed on one worker)."""

    def apply(self, input_bag, side_inputs=None):
      bag = _spread(input_bag, self.bag_kwargs["fan_out"])
      with _placed(self.bag_kwargs["workers"]):
        return bag.map_partitions(_identity)

  class _GroupByKey(beam_ops.DaskBagOp):
    """`GroupByKeyOnly`: grouped into at least `fan_out` partitions by a
    task shuffle (Beam's keeps the input's count: one, after a read), the
    groups' partitions placed round-robin on the workers."""

    def apply(self, input_bag, side_inputs=None):
      grouped = _spread(input_bag, self.bag_kwargs["fan_out"]).groupby(
          _first, shuffle="tasks")
      with _placed(self.bag_kwargs["workers"]):
        return grouped.map(_without_windows)

  _TRANSLATIONS = {
      **beam_ops.TRANSLATIONS,
      beam.ParDo: _ParDo,
      beam_overrides._Create: _Create,  # pylint: disable=protected-access
      beam_overrides._Reshuffle: _Reshuffle,  # pylint: disable=protected-access
      beam_overrides._GroupByKeyOnly: _GroupByKey,  # pylint: disable=protected-access
  }

  class DaskRunner(beam_dask.DaskRunner):
    """Beam's DaskRunner, fixed and completed as the module says."""

    def run_pipeline(self, pipeline, options):
      dask_options = options.view_as(beam_dask.DaskOptions).get_all_options(
          drop_default=True, current_only=True)
      bag_kwargs = beam_dask.DaskOptions._extract_bag_kwargs(dask_options)  # pylint: disable=protected-access
      workers = options.view_as(RealmDaskOptions).dask_workers
      if options.view_as(pipeline_options.StandardOptions).streaming:
        raise NotImplementedError("the Dask runner runs bounded (batch) "
                                  "pipelines only.")
      quiet_distributed()
      cluster = None
      if not (dask_options.get("address") or
              dask_options.get("scheduler_file")):
        cluster = local_cluster(workers or os.cpu_count() or 1)
        dask_options["address"] = cluster.scheduler_address
      try:
        with distributed.Client(**dask_options) as client:
          # Each worker once per thread: partition i goes to the i-th.
          bag_kwargs["workers"] = [
              address for address, n in sorted(client.nthreads().items())
              for _ in range(n)]
          threads = len(bag_kwargs["workers"])
          bag_kwargs["fan_out"] = (bag_kwargs.get("npartitions") or
                                   2 * max(threads, 1))
          logging.info(
              "Dask runner: scheduler %s (%s), %d worker threads, %d "
              "partitions a fan-out", client.scheduler.address,
              "a local cluster started for this job" if cluster else
              "given", threads, bag_kwargs["fan_out"])
          pipeline.replace_all(beam_overrides.dask_overrides())
          visitor = _BagVisitor(bag_kwargs)
          pipeline.visit(visitor)
          # One compute of all the leaves, so that what they share runs
          # once (`dask.optimize` of each leaf, or of all then computed,
          # runs it once per leaf). Not optimized: Dask's fusion would drop
          # the placements (`_placed`) and undo the fan-outs.
          futures = client.compute([bag.map_partitions(_drain)
                                    for bag in visitor.leaves()],
                                   optimize_graph=False)
          try:
            for _ in distributed.as_completed(futures, with_results=True):
              pass  # with_results: a failed task raises its error here
          except BaseException:
            client.cancel(futures)
            raise
      finally:
        if cluster is not None:
          cluster.close()
      return DaskPipelineResult()

  class _BagVisitor(beam_dask.PipelineVisitor):
    """Beam's `DaskBagVisitor` with `_TRANSLATIONS`, checks of what the
    translation cannot run, and the pipeline's leaves."""

    def __init__(self, bag_kwargs: dict[str, Any]):
      self.bag_kwargs = bag_kwargs
      self.bags: dict[Any, Any] = collections.OrderedDict()
      self.consumed: set[int] = set()

    def visit_transform(self, transform_node) -> None:
      _check_supported(transform_node)
      op_class = _TRANSLATIONS.get(transform_node.transform.__class__,
                                   beam_ops.NoOp)
      op = op_class(transform_node, bag_kwargs=self.bag_kwargs)
      kwargs = {"input_bag": None, "side_inputs": None}
      inputs = list(transform_node.inputs)
      if inputs:
        bag_inputs = []
        for input_value in inputs:
          self.consumed.add(id(input_value))
          if isinstance(input_value, pvalue.PBegin):
            bag_inputs.append(None)
          producer = input_value.producer
          if producer in self.bags:
            bag_inputs.append(self.bags[producer])
        if len(bag_inputs) == 1 and not isinstance(op, beam_ops.Flatten):
          kwargs["input_bag"] = bag_inputs[0]
        else:
          kwargs["input_bag"] = bag_inputs
      side_inputs = list(transform_node.side_inputs)
      if side_inputs:
        bag_side_inputs = []
        for si in side_inputs:
          self.consumed.add(id(si.pvalue))
          bag_side_inputs.append(beam_dask.SideInputMap(
              type(si), si._view_options(),  # pylint: disable=protected-access
              beam_ops.DaskBagWindowedIterator(
                  self.bags.get(si.pvalue.producer),
                  si._window_mapping_fn)))  # pylint: disable=protected-access
        kwargs["side_inputs"] = bag_side_inputs
      self.bags[transform_node] = op.apply(**kwargs)

    def leaves(self) -> list[Any]:
      """The bags no transform reads: computing them runs the pipeline."""
      found, seen = [], set()
      for node, bag in self.bags.items():
        if bag is None or isinstance(bag, list) or bag.name in seen:
          continue
        if any(id(p) in self.consumed for p in node.outputs.values()):
          continue
        seen.add(bag.name)
        found.append(bag)
      return found


def _first(item):
  return item[0]


def _without_windows(item):
  """A group (key, [windowed (key, value)]) as Beam's GroupByKeyOnly gives
  it: (key, [value])."""
  k, v = item
  return k, [beam_ops.defenestrate(elm[1]) for elm in v]


def _identity(partition) -> list[Any]:
  return list(partition)


def _placed(workers: list[str]):
  """Annotates the bag layers made inside: partition i goes to
  `workers[i % len(workers)]`, a loose restriction (the scheduler may move
  it to another worker, e.g. when that one is gone). Without it Dask runs
  a fan-out where its input lies: all on the worker that read the input."""
  import dask  # pylint: disable=g-import-not-at-top
  return dask.annotate(
      workers=lambda key: [workers[(key[1] if isinstance(key, tuple) else 0)
                                   % len(workers)]],
      allow_other_workers=True)


def _drain(partition) -> list[int]:
  """A leaf partition's size: what comes back to the launching process."""
  return [sum(1 for _ in partition)]


def _spread(bag, fan_out: int):
  """`bag` in at least `fan_out` partitions."""
  return bag if bag.npartitions >= fan_out else bag.repartition(
      npartitions=fan_out)


def _check_supported(node) -> None:
  """Raises NotImplementedError for what Beam's Dask translation would run
  wrong, naming the transform."""
  from apache_beam.runners.common import DoFnSignature  # pylint: disable=g-import-not-at-top
  from apache_beam.transforms import window  # pylint: disable=g-import-not-at-top
  transform, label = node.transform, node.full_label

  def refuse(what):
    raise NotImplementedError(
        f"{label}: {what} is not supported by the Dask runner "
        f"(realm_jax.data.beam_dask); run this pipeline on another runner.")

  if isinstance(transform, beam_overrides._Read):  # pylint: disable=protected-access
    refuse("a beam.io.Read source (Beam's Dask translation reads nothing)")
  if isinstance(transform, beam_overrides._GroupAlsoByWindow):  # pylint: disable=protected-access
    if not isinstance(transform.windowing.windowfn, window.GlobalWindows):
      refuse("grouping in windows other than the global window")
    return
  if any(not p.is_bounded for p in node.outputs.values()
         if isinstance(p, pvalue.PCollection)):
    refuse("an unbounded PCollection")
  if isinstance(transform, beam.ParDo):
    if len(node.outputs) > 1:
      refuse("a DoFn with several outputs (with_outputs)")
    signature = DoFnSignature(transform.fn)
    if signature.is_stateful_dofn():
      refuse("a stateful DoFn")
    if signature.is_splittable_dofn():
      refuse("a splittable DoFn")

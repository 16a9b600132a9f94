"""realm-aot's steps: each job's step as its trainer builds it (the same
mesh, shardings and step function), on `jax.ShapeDtypeStruct`s."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.aot import (INT32_MAX, JOBS, MAX_BYTES_PER_CHIP, AotConfig,
                           Topology, host_bounds, parse_topology, topology)
from realm_jax.core import parallel
from realm_jax.data import qa_inputs, realm_inputs
from realm_jax.index import build as build_lib
from realm_jax.index import device_search, embed
from realm_jax.model import bert as bert_lib
from realm_jax.model import functional
from realm_jax.model import realm as realm_lib
from realm_jax.model.realm import Realm, RealmConfig, Retriever
from realm_jax.training import finetune, ict, loop, pretrain
from realm_jax.training import optimizer as optimizer_lib


@dataclasses.dataclass
class Step:
  """A job's step ready to lower.

  Attributes:
    job: one of `JOBS`.
    fn: the jitted step.
    args: its arguments, `jax.ShapeDtypeStruct`s with shardings.
    kwargs: static keyword arguments (the search's k).
    global_batch: examples per step over the step's mesh.
    batch_arg: index in `args` of the argument split over the data axis
      (the batch; the search's index rows).
    mesh_devices: devices of the step's mesh.
    notes: what the step is, for the report.
    examples_per_step_total: examples per step over the whole pod (the
      embed step runs on every host at once: global_batch x hosts).
    model_flops: the model's own FLOPs of one step over the step's mesh
      (`bert.forward_flops`: 3x the forward for a train step), beside the
      compiler's count, which includes rematerialisation's repeats.
  """
  job: str
  fn: Callable[..., Any]
  args: tuple[Any, ...]
  global_batch: int
  batch_arg: int
  mesh_devices: int
  notes: str
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  examples_per_step_total: int | None = None
  model_flops: float | None = None


def _abstract(tree, sharding):
  """`tree`'s leaves as ShapeDtypeStructs placed by `sharding`."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
      tree)


def _batch(mesh, shapes: dict[str, tuple[tuple[int, ...], Any]],
           sizes: str):
  """A batch dict of ShapeDtypeStructs split over the data axis.

  Raises:
    ValueError: an array would be past `MAX_BYTES_PER_CHIP` per device
      (`sizes` names the fields that set the shapes, for the message).
  """
  for name, (shape, dtype) in shapes.items():
    per_chip = math.prod(shape) // mesh.size * np.dtype(dtype).itemsize
    if per_chip > MAX_BYTES_PER_CHIP:
      raise ValueError(
          f"The step's {name} would be {list(shape)}, {per_chip / 2**50:,.0f}"
          f" PiB on each of its {mesh.size} chips, past the "
          f"{MAX_BYTES_PER_CHIP / 2**50:.0f} PiB realm-aot compiles for one "
          "array (no chip holds a ten-thousandth of it; the compiler's byte "
          f"counts overflow near 2**62): lower {sizes}.")
  sharding = parallel.data_sharded(mesh)
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
          for name, (shape, dtype) in shapes.items()}


def _rng(mesh):
  key = jax.eval_shape(lambda: jax.random.key(0))
  return jax.ShapeDtypeStruct(key.shape, key.dtype,
                              sharding=parallel.replicated(mesh))


def _check_batch(what: str, batch: int, devices: int) -> None:
  if batch > INT32_MAX:
    raise ValueError(
        f"{what} must be <= {INT32_MAX:,} (2**31 - 1: the step counts its "
        f"examples in int32), got {batch!r}.")
  if batch % devices:
    raise ValueError(
        f"{what}={batch} does not divide over the {devices} devices of the "
        f"topology: make it a multiple of {devices} (the jobs refuse it "
        "too).")


def _train_state(params, tx, mesh) -> loop.TrainState:
  """The job's TrainState as ShapeDtypeStructs, replicated (`loop.Run`)."""
  replicated = parallel.replicated(mesh)
  return loop.TrainState(
      jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
      _abstract(params, replicated),
      _abstract(jax.eval_shape(tx.init, params), replicated))


def pretrain_step(config: pretrain.PretrainConfig, model: RealmConfig,
                  aot: AotConfig, mesh) -> Step:
  """REALM pre-training's step: `pretrain.train`'s `loop.make_train_step`
  of `pretrain.make_loss_fn`, with `pretrain.make_optimizer`."""
  _check_batch("PretrainConfig.batch_size", config.batch_size, mesh.size)
  graphdef, params = functional.abstract_init(lambda r: Realm(model, rngs=r))
  tx = pretrain.make_optimizer(config)
  step = loop.make_train_step(
      pretrain.make_loss_fn(graphdef, config.retrieval.null_document), tx,
      mesh, grad_norm_groups=("retriever", "reader"))
  r = config.retrieval
  # BM25's blocks (`lexical_candidates`) are read and scored like the
  # dense ones: k + m candidates, plus the null document.
  b, c = config.batch_size, (r.num_candidates + r.lexical_candidates
                             + int(r.null_document))
  lq, ld, m = aot.query_length, aot.block_length, aot.num_masks
  # The reader's length as pre-training derives it (query + block).
  lr = realm_inputs.reader_length(
      config.reader_length, lq, ld, field="PretrainConfig.reader_length",
      queries="(realm-aot: AotConfig.query_length)")
  shapes = realm_inputs.pretraining_layout(
      batch=b, candidates=c, query_length=lq, block_length=ld,
      reader_length=lr, num_masks=m, held_prior=r.held_prior,
      embedding_size=(model.retriever.embedding_size
                      if config.retriever.training == "query_side" else None))
  return Step("pretrain", step, (_train_state(params, tx, mesh),
                                 _batch(mesh, shapes, (
                                     "PretrainConfig.batch_size, "
                                     "RetrievalConfig.num_candidates or "
                                     "AotConfig's query_length, "
                                     "block_length and num_masks")),
                                 _rng(mesh)),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              model_flops=realm_lib.pretraining_flops(
                  model, batch=b, candidates=c, query_length=lq,
                  block_length=ld, reader_length=lr, num_masks=m,
                  document_tower=config.retriever.training != "query_side"),
              notes=f"batch {b} x {c} candidates, query {lq}, blocks {ld}, "
              f"reader {lr}, {m} masks")


def ict_step(config: ict.IctTrainConfig, model: RealmConfig, aot: AotConfig,
             mesh) -> Step:
  """ICT's step: `ict.train`'s train step over the retriever's params."""
  del aot
  _check_batch("IctTrainConfig.batch_size", config.batch_size, mesh.size)
  _, params = functional.abstract_init(lambda r: Realm(model, rngs=r))
  tx = optimizer_lib.bert_optimizer(**config.schedule())
  step = loop.make_train_step(ict.make_loss_fn(ict.retriever_graphdef(model)),
                              tx, mesh)
  b, lq, lb = (config.batch_size, config.pairs.query_length,
               config.pairs.block_length)
  i32 = jnp.int32
  shapes = {"query_ids": ((b, lq), i32), "query_mask": ((b, lq), i32),
            "query_segment_ids": ((b, lq), i32),
            "block_ids": ((b, lb), i32), "block_mask": ((b, lb), i32),
            "block_segment_ids": ((b, lb), i32),
            "sentence_removed": ((b,), i32)}
  return Step("ict", step, (_train_state(params["retriever"], tx, mesh),
                            _batch(mesh, shapes, (
                                "IctTrainConfig.batch_size or IctConfig's "
                                "query_length and block_length")),
                            _rng(mesh)),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              model_flops=3 * (
                  bert_lib.forward_flops(model.retriever.bert, b, lq)
                  + bert_lib.forward_flops(model.retriever.bert, b, lb)),
              notes=f"batch {b} (in-batch negatives), query {lq}, "
              f"blocks {lb}")


def finetune_step(config: finetune.FinetuneConfig, model: RealmConfig,
                  aot: AotConfig, mesh) -> Step:
  """Open-QA fine-tuning's step (`finetune._step_functions`)."""
  _check_batch("FinetuneConfig.batch_size", config.batch_size, mesh.size)
  if not model.reader.span_head:
    raise ValueError("Fine-tuning needs the reader's span head; set "
                     "ReaderConfig.span_head = True.")
  tx, step, _ = finetune._step_functions(  # pylint: disable=protected-access
      model, mesh, **config.schedule(config.total_steps(aot.num_questions)))
  _, params = functional.abstract_init(lambda r: Realm(model, rngs=r))
  qa, b = config.qa, config.batch_size
  shapes = qa_inputs.qa_layout(
      qa, batch=b, embedding_size=model.retriever.embedding_size,
      max_span_width=model.reader.max_span_width)
  assert set(shapes) == set(finetune.DEVICE_FEATURES), shapes
  return Step("finetune", step, (_train_state(params, tx, mesh),
                                 _batch(mesh, shapes, (
                                     "FinetuneConfig.batch_size or "
                                     "QAConfig's sizes")),
                                 _rng(mesh)),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              model_flops=3 * (
                  bert_lib.forward_flops(model.retriever.bert, b,
                                         qa.question_length)
                  + bert_lib.forward_flops(model.reader.bert,
                                           b * qa.num_reader_blocks,
                                           qa.reader_length)),
              notes=f"batch {b}, K {qa.num_retrieved} retrieved, R "
              f"{qa.num_reader_blocks} read, question {qa.question_length}, "
              f"reader {qa.reader_length}")


def embed_step(build: build_lib.IndexBuildConfig, model: RealmConfig,
               aot: AotConfig, topo: Topology) -> Step:
  """The index builder's document tower (`embed.make_embed_fn`) over ONE
  host's chips, as `embed.embed_block_store` runs it on every host (each
  embeds its own share of the rows)."""
  retriever = model.retriever
  if build.bfloat16:
    retriever = dataclasses.replace(retriever, bert=dataclasses.replace(
        retriever.bert, dtype="bfloat16"))
  # One host's chips, compiled as a slice of their own: each host embeds
  # its share with no traffic between hosts, and libtpu refuses a program
  # on part of a slice whose ICI routing is limited (v5e:8x8).
  chip, dims = parse_topology(topo.name)
  host = topology(f"{chip.generation}:"
                  + "x".join(map(str, host_bounds(dims)[:len(dims)])))
  mesh = parallel.make_mesh(host.devices)
  fn = embed.make_embed_fn(retriever, mesh)
  _, params = functional.abstract_init(lambda r: Retriever(
      dataclasses.replace(retriever, null_score="embedding"), rngs=r))
  b, length = build.batch_size_per_device * mesh.size, aot.block_length
  _check_batch(f"IndexBuildConfig.batch_size_per_device x {mesh.size} chips",
               b, mesh.size)
  ids = _batch(mesh, {"x": ((b, length), jnp.int32)}, (
      "IndexBuildConfig.batch_size_per_device or AotConfig.block_length"))[
          "x"]
  return Step("embed", fn, (_abstract(params, parallel.replicated(mesh)),
                            ids, ids, ids),
              global_batch=b, batch_arg=1, mesh_devices=mesh.size,
              examples_per_step_total=b * topo.hosts,
              model_flops=bert_lib.forward_flops(retriever.bert, b, length),
              notes=f"{b} blocks of {length} per host "
              f"({build.batch_size_per_device} per chip), "
              f"{'bfloat16' if build.bfloat16 else 'float32'}, "
              f"{topo.hosts} host(s) in parallel")


def search_step(model: RealmConfig, aot: AotConfig, mesh) -> Step:
  """Exact top-k over a `DeviceIndex` row-sharded over the data axis
  (`device_search.search`, as pre-training's device search holds it)."""
  n, d = aot.num_blocks, model.retriever.embedding_size
  rows = -(-n // mesh.size) * mesh.size
  sharded = parallel.data_sharded(mesh)
  dtype = jnp.bfloat16 if aot.search_dtype == "bfloat16" else jnp.float32
  tokens = jnp.uint16 if model.retriever.bert.vocab_size <= 1 << 16 else (
      jnp.int32)
  index = device_search.DeviceIndex(
      embeddings=jax.ShapeDtypeStruct((rows, d), dtype, sharding=sharded),
      tokens=jax.ShapeDtypeStruct((rows, aot.block_length), tokens,
                                  sharding=sharded),
      lengths=jax.ShapeDtypeStruct((rows, 2), jnp.int32, sharding=sharded),
      doc_hash=jax.ShapeDtypeStruct((rows, 2), jnp.int32, sharding=sharded),
      num_rows=n, cls_id=101, sep_id=102, pad_id=0, mesh=mesh)
  queries = jax.ShapeDtypeStruct((aot.search_queries, d), jnp.float32,
                                 sharding=parallel.replicated(mesh))
  return Step("search", device_search.search, (index, queries),
              kwargs={"k": aot.search_k}, global_batch=aot.search_queries,
              batch_arg=0, mesh_devices=mesh.size,
              model_flops=2.0 * aot.search_queries * n * d,
              notes=f"{aot.search_queries} queries, top {aot.search_k} of "
              f"{n:,} x {d} {aot.search_dtype} rows")

def _check_compiler_can(topo: Topology, model: RealmConfig,
                        jobs: Sequence[str]) -> None:
  """Refuses what crashes the TPU compiler instead of compiling it.

  libtpu 0.0.42.1 dies (SIGSEGV) compiling a v4 train step whose BERT has
  both `remat` and bfloat16 (v5e compiles it; either switch alone compiles
  on v4; seen with the tiny and the BERT-base REALM step).
  """
  berts = (model.retriever.bert, model.reader.bert)
  if topo.chip.generation == "v4" and any(
      b.remat and b.dtype == "bfloat16" for b in berts) and set(jobs) & {
          "pretrain", "ict", "finetune"}:
    raise ValueError(
        "libtpu 0.0.42.1 crashes compiling a v4 train step with both "
        "bert.BertConfig.remat = True and dtype = 'bfloat16': keep one of "
        "them (--gin.bert.BertConfig.remat=False or "
        "--gin.bert.BertConfig.dtype=\"'float32'\").")


def build_steps(aot: AotConfig, topo: Topology, configs: dict[str, Any],
                model: RealmConfig) -> list[tuple[Step, int | None]]:
  """(step, num_train_steps) of each of `aot.jobs` (the configs' jobs if
  empty); `configs` maps a job to its config (PretrainConfig, ...)."""
  jobs = aot.jobs or tuple(configs)
  if not jobs:
    raise ValueError(
        "No job to compile: pass a job's gin file (PretrainConfig, "
        "IctTrainConfig, FinetuneConfig or the index builder's), or set "
        f"AotConfig.jobs to some of {JOBS}.")
  mesh = parallel.make_mesh(topo.devices)
  _check_compiler_can(topo, model, jobs)
  steps = []
  for job in jobs:
    config = configs.get(job)
    if job in ("pretrain", "ict", "finetune") and config is None:
      raise ValueError(f"AotConfig.jobs has {job!r} but no gin file binds "
                       f"its config; pass the job's gin file.")
    if job == "pretrain":
      steps.append((pretrain_step(config, model, aot, mesh),
                    config.num_train_steps))
    elif job == "ict":
      steps.append((ict_step(config, model, aot, mesh),
                    config.num_train_steps))
    elif job == "finetune":
      steps.append((finetune_step(config, model, aot, mesh),
                    config.total_steps(aot.num_questions)))
    elif job == "embed":
      steps.append((embed_step(config or build_lib.IndexBuildConfig(),
                               model, aot, topo), None))
    else:
      steps.append((search_step(model, aot, mesh), None))
  return steps


r"""Corpus embedding throughput against the machine's matmul peak and PyTorch.

One run measures, side by side, and prints one JSON line per measurement:

  numpy_matmul     float32 GFLOP/s numpy reaches on the model's own matmul
                   shapes (batch 32 x seq 288): the attention projections
                   [B*L, h] x [h, h], the feed-forward [B*L, h] x [h, i] and
                   [B*L, i] x [i, h], and the batched attention matmuls
                   [B*H, L, d] x [B*H, d, L] (scores) and
                   [B*H, L, L] x [B*H, L, d] (context).
  numpy_peak       per model, the reference rates: the time-weighted
                   harmonic combination of those rates over the model's FLOP
                   mix (= the GFLOP/s numpy would reach running the matmuls
                   back to back), over the dense layers only ("dense", ~90%
                   of the FLOPs; the issue's target) and over all matmuls
                   ("all", numpy's slow small batched attention matmuls
                   included), and the best single shape ("max").
  realm_jax        blocks/s of the retriever's document tower
                   (`realm_jax.index.embed.make_embed_fn`, the step that
                   `embed_block_store` runs, fed by `BlockStore.
                   retriever_inputs` on real blocks of the gensim Wikipedia
                   slice), achieved GFLOP/s and % of the numpy peaks, for
                   MiniLM-L6-H384 (real weights, mean pooling + L2 norm) and
                   BERT-base (random weights, pooler + 128-d projection), in
                   float32 and bfloat16, per XLA_FLAGS setting (each in its
                   own process: XLA reads the flags once at start-up), on 1
                   CPU device and (MiniLM float32) 2 emulated devices.
  embed_block_store  the public job end to end over the whole small store
                   (compile included), as a cross-check of the loop above.
  torch            PyTorch `transformers.BertModel` on the same inputs and
                   shapes, float32 and bfloat16 autocast, run by another
                   interpreter (`--torch_python`) that has torch installed;
                   plus torch's own matmul GFLOP/s on the dense shapes.
  check            embedding agreement: realm_jax vs torch (MiniLM float32,
                   same weights), realm_jax bfloat16 vs float32.
  comparison       realm_jax vs torch blocks/s per model and dtype.

FLOP count (multiply-add = 2 FLOPs), per forward pass of B blocks of L
tokens, hidden h, feed-forward i, layers N:
  N * [2*B*L*(4*h*h + 2*h*i)    # Q, K, V, output projections; FFN in + out
       + 2*2*B*L*L*h]           # attention scores Q.K^T and context P.V
  + 2*B*h*h (pooler, if used) + 2*B*h*p (projection to p, if used).
Embedding gathers, LayerNorm, softmax, GELU and pooling adds are not counted
(XLA's own cost analysis, also reported, is 0.4% (BERT-base) to 3% (MiniLM)
higher for them). Padding positions are counted: the model computes them.

The workers' `cpu_util` is process CPU seconds / wall seconds over the timed
batches: ~2.0 means both cores worked; ~1.0 means one thread did.

  python benchmarks/embedding.py --torch_python=/tmp/torchenv/bin/python \
      [--num_batches=5] [--num_batches_base=3] [--max_load=0.8 \
      --max_wait_s=600]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

BATCH = 32
SEQ_LEN = 288
XLA_FLAG_SETTINGS = {
    "default": "",
    "ynn_fusion_off": "--xla_cpu_experimental_ynn_fusion_type=",
}
# Sizes of the two benchmark towers; projection: output Dense size or None.
MODELS = {
    "minilm_l6_h384": dict(hidden=384, intermediate=1536, layers=6, heads=12,
                           pooler=False, projection=None),
    "bert_base": dict(hidden=768, intermediate=3072, layers=12, heads=12,
                      pooler=True, projection=128),
}
DTYPES = ("float32", "bfloat16")


def _emit(record: dict[str, Any]) -> None:
  print(json.dumps({"benchmark": "embedding", **record}), flush=True)


def _load1() -> float:
  return round(os.getloadavg()[0], 2)


def forward_flops(*, batch: int, seq_len: int, hidden: int,
                  intermediate: int, layers: int, pooler: bool,
                  projection: int | None, **unused) -> int:
  """Analytic matmul FLOPs of one BERT document-tower forward pass."""
  del unused
  tokens = batch * seq_len
  per_layer = (2 * tokens * (4 * hidden * hidden + 2 * hidden * intermediate)
               + 2 * 2 * batch * seq_len * seq_len * hidden)
  total = layers * per_layer
  if pooler:
    total += 2 * batch * hidden * hidden
  if projection:
    total += 2 * batch * hidden * projection
  return total


def matmul_shapes(model: str) -> dict[str, tuple[tuple[int, ...],
                                                 tuple[int, ...], int]]:
  """name -> (a shape, b shape, times per layer) of one layer's matmuls."""
  m = MODELS[model]
  h, i, heads = m["hidden"], m["intermediate"], m["heads"]
  t, d, bh = BATCH * SEQ_LEN, h // heads, BATCH * heads
  return {
      "proj_hxh": ((t, h), (h, h), 4),
      "ffn_in_hxi": ((t, h), (h, i), 1),
      "ffn_out_ixh": ((t, i), (i, h), 1),
      "attn_scores": ((bh, SEQ_LEN, d), (bh, d, SEQ_LEN), 1),
      "attn_context": ((bh, SEQ_LEN, SEQ_LEN), (bh, SEQ_LEN, d), 1),
  }


def _shape_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
  return 2 * int(np.prod(a)) * b[-1]


def _time_calls(fn, *, min_reps: int, min_seconds: float
                ) -> tuple[float, float, int]:
  """Median seconds per call, CPU utilisation, reps (after one warm-up)."""
  fn()
  times = []
  cpu0, start = time.process_time(), time.perf_counter()
  while len(times) < min_reps or time.perf_counter() - start < min_seconds:
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  cpu = (time.process_time() - cpu0) / (time.perf_counter() - start)
  return statistics.median(times), cpu, len(times)


# ----------------------------------------------------------------------------
# numpy matmul peak (this process; no JAX or TensorFlow loaded).
# ----------------------------------------------------------------------------


def numpy_peaks(min_seconds: float) -> dict[str, dict[str, float]]:
  """Measures every shape; returns per-model reference rates (GFLOP/s).

  "dense": time-weighted harmonic combination over the dense layers
  (projections and feed-forward, ~90% of the FLOPs): the rate numpy would
  reach running them back to back. "all": the same over every matmul,
  numpy's batched attention matmuls included. "max": best single shape of
  the run.
  """
  rng = np.random.default_rng(0)
  rates: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
  cpu_rates: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
  peaks = {}
  for model in MODELS:
    flops = {"dense": 0.0, "all": 0.0}
    seconds = {"dense": 0.0, "all": 0.0}
    cpu_seconds = {"dense": 0.0, "all": 0.0}
    for name, (a_shape, b_shape, per_layer) in matmul_shapes(model).items():
      key = (a_shape, b_shape)
      if key not in rates:
        a = rng.standard_normal(a_shape, np.float32)
        b = rng.standard_normal(b_shape, np.float32)
        out = np.empty(a_shape[:-1] + b_shape[-1:], np.float32)
        load = _load1()
        median, cpu, reps = _time_calls(lambda: np.matmul(a, b, out=out),
                                        min_reps=3, min_seconds=min_seconds)
        rates[key] = _shape_flops(a_shape, b_shape) / median / 1e9
        cpu_rates[key] = rates[key] / cpu
        _emit({"kind": "numpy_matmul", "model": model, "op": name,
               "a": list(a_shape), "b": list(b_shape), "dtype": "float32",
               "gflops": round(rates[key], 1),
               "gflops_per_cpu_s": round(cpu_rates[key], 1),
               "median_s": round(median, 5),
               "reps": reps, "cpu_util": round(cpu, 2), "load_1m": load})
      layer_flops = _shape_flops(a_shape, b_shape) * per_layer
      for part in ("dense", "all") if not name.startswith("attn") else (
          "all",):
        flops[part] += layer_flops
        seconds[part] += layer_flops / rates[key]
        cpu_seconds[part] += layer_flops / cpu_rates[key]
    peaks[model] = {part: flops[part] / seconds[part] for part in flops}
    peaks[model].update({part + "_cpu": flops[part] / cpu_seconds[part]
                         for part in flops})
    peaks[model]["dense_flop_share"] = flops["dense"] / flops["all"]
  for model in MODELS:
    peaks[model]["max"] = max(rates.values())
    peaks[model]["max_cpu"] = max(cpu_rates.values())
    _emit({"kind": "numpy_peak", "model": model,
           **{f"gflops_{part}": round(peaks[model][part], 1)
              for part in ("dense", "all", "max")},
           **{f"gflops_per_cpu_s_{part}": round(peaks[model][part + "_cpu"],
                                                1)
              for part in ("dense", "all", "max")},
           "dense_flop_share": round(peaks[model]["dense_flop_share"], 3),
           "numpy": np.__version__})
  return peaks


# ----------------------------------------------------------------------------
# JAX worker (a subprocess per XLA_FLAGS / device-count setting).
# ----------------------------------------------------------------------------


def _retriever(model: str, dtype: str):
  """(RetrieverConfig, params) of a benchmark model's retriever."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from realm_jax.checkpoint_import import importers
  from realm_jax.data import tokenizer
  from realm_jax.model import bert as bert_lib
  from realm_jax.model import cpu
  from realm_jax.model import functional
  from realm_jax.model import realm

  if model == "minilm_l6_h384":
    bert_config, imported = importers.load_hf_bert(
        tokenizer.default_model_dir())
    config = realm.RetrieverConfig(bert=bert_config, projection_size=None,
                                   pooling="mean", normalize=True)
    params = {"query_embedder": {"bert": imported["bert"]}}
    _, expected = functional.abstract_init(
        lambda r: realm.Retriever(config, rngs=r))
    if (jax.tree_util.tree_structure(expected)
        != jax.tree_util.tree_structure(params)):
      raise ValueError("MiniLM parameter tree does not match the Retriever.")
  else:
    config = realm.RetrieverConfig(bert=bert_lib.BertConfig(),
                                   projection_size=128, pooling="pooler")
    _, params = functional.init(lambda r: realm.Retriever(config, rngs=r))
  # As embed_block_store(bfloat16=True) does: compute dtype only. The CPU
  # options too, as a CPU index builder with models/cpu.gin runs.
  config = cpu.for_cpu(dataclasses.replace(
      config, bert=dataclasses.replace(config.bert, dtype=dtype)))
  return config, params


def jax_worker(spec: dict[str, Any]) -> None:
  """Times the document tower for each (model, dtype) of `spec`."""
  import jax  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store
  from realm_jax.index import embed as embed_lib
  from realm_jax.core import parallel

  devices = jax.local_devices()[:spec["devices"]]
  if len(devices) != spec["devices"]:
    raise RuntimeError(f"wanted {spec['devices']} devices, have {devices}")
  mesh = parallel.make_mesh(devices)
  sharding = parallel.data_sharded(mesh)
  store = block_store.BlockStore.open(spec["block_store"])
  common = {"xla_flags": os.environ.get("XLA_FLAGS", ""),
            "devices": len(devices), "batch": BATCH, "seq_len": SEQ_LEN,
            "jax": jax.__version__}

  def inputs(step):
    ids = np.arange(step * BATCH, (step + 1) * BATCH) % len(store)
    feats = store.retriever_inputs(ids, SEQ_LEN)
    return [jax.device_put(feats[k], sharding)
            for k in ("token_ids", "input_mask", "segment_ids")]

  for model, dtype in spec["configs"]:
    config, params = _retriever(model, dtype)
    params = jax.device_put(params, parallel.replicated(mesh))
    embed = embed_lib.make_embed_fn(config, mesh)
    try:
      cost = embed.lower(params, *inputs(0)).cost_analysis()
      xla_flops = float(cost["flops"]) if cost and "flops" in cost else None
    except Exception:  # pylint: disable=broad-except
      xla_flops = None
    num_batches = spec["num_batches"][model]
    t0 = time.perf_counter()
    first = np.asarray(embed(params, *inputs(0)))
    first_s = time.perf_counter() - t0
    for step in range(1, spec["warmup_batches"]):
      np.asarray(embed(params, *inputs(step)))
    times = []
    load = _load1()
    cpu0, start = time.process_time(), time.perf_counter()
    for step in range(num_batches):
      t0 = time.perf_counter()
      # The whole step of embed_block_store: gather the blocks' inputs,
      # place them, run, copy the embeddings back.
      np.asarray(embed(params, *inputs(spec["warmup_batches"] + step)))
      times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / (time.perf_counter() - start)
    if spec.get("save_dir"):  # For the agreement checks.
      np.save(os.path.join(spec["save_dir"], f"jax_{model}_{dtype}.npy"),
              first)
    median = statistics.median(times)
    print(json.dumps({
        "kind": "realm_jax", "model": model, "dtype": dtype, **common,
        "blocks_per_s": round(BATCH / median, 2),
        "median_batch_s": round(median, 3),
        "batch_s": [round(t, 3) for t in times],
        "first_batch_s_incl_compile": round(first_s, 2),
        "flops_per_batch": forward_flops(batch=BATCH, seq_len=SEQ_LEN,
                                         **MODELS[model]),
        "xla_cost_analysis_flops": xla_flops,
        "cpu_util": round(cpu, 2), "load_1m_before": load}), flush=True)
    if spec.get("end_to_end") and model == "minilm_l6_h384" and (
        dtype == "float32"):
      load = _load1()
      emb, stats = embed_lib.embed_block_store(
          params, config, store, batch_size_per_device=BATCH // len(devices),
          seq_len=SEQ_LEN, devices=devices, log_every_seconds=1e9)
      print(json.dumps({
          "kind": "embed_block_store", "model": model, "dtype": dtype,
          **common, "rows": stats.rows,
          "blocks_per_s_incl_compile": round(stats.blocks_per_second, 2),
          "max_abs_diff_vs_loop": float(np.abs(emb[:BATCH] - first).max()),
          "load_1m_before": load}), flush=True)


# ----------------------------------------------------------------------------
# Torch worker (runs under --torch_python; needs only numpy, torch and
# transformers, so it must not import absl or realm_jax).
# ----------------------------------------------------------------------------


def torch_worker(spec: dict[str, Any]) -> None:
  """Times transformers' BertModel on the saved inputs."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(spec["threads"])
  data = np.load(spec["inputs"])
  batches = [{k: torch.from_numpy(data[k][i].astype(np.int64))
              for k in ("token_ids", "input_mask", "segment_ids")}
             for i in range(data["token_ids"].shape[0])]
  common = {"torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "batch": BATCH,
            "seq_len": SEQ_LEN}

  # torch's own matmul rates on the dense shapes, float32 and bfloat16.
  for model in MODELS:
    for name, (a_shape, b_shape, _) in matmul_shapes(model).items():
      if name.startswith("attn"):
        continue
      for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(a_shape, dtype=dtype)
        b = torch.randn(b_shape, dtype=dtype)
        seconds, cpu, reps = _time_calls(lambda: torch.matmul(a, b),
                                         min_reps=3, min_seconds=0.5)
        print(json.dumps({
            "kind": "torch_matmul", "model": model, "op": name,
            "dtype": str(dtype).replace("torch.", ""), **common,
            "gflops": round(_shape_flops(a_shape, b_shape) / seconds / 1e9,
                            1), "cpu_util": round(cpu, 2)}), flush=True)

  for model, dtype in spec["configs"]:
    m = MODELS[model]
    if model == "minilm_l6_h384":
      bert = transformers.BertModel.from_pretrained(spec["minilm_dir"],
                                                    add_pooling_layer=False)
      head = None
    else:
      torch.manual_seed(0)
      # gelu_new = tanh approximation, as realm_jax's BERT-base default.
      bert = transformers.BertModel(transformers.BertConfig(
          hidden_act="gelu_new"), add_pooling_layer=True)
      head = torch.nn.Sequential(torch.nn.Linear(768, m["projection"]),
                                 torch.nn.LayerNorm(m["projection"],
                                                    eps=1e-12))
    bert.eval()

    def run(batch):
      with torch.inference_mode(), torch.autocast(
          "cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        out = bert(input_ids=batch["token_ids"],
                   attention_mask=batch["input_mask"],
                   token_type_ids=batch["segment_ids"])
        if head is None:  # Mean pooling over real tokens + L2 norm.
          mask = batch["input_mask"][..., None].float()
          x = (out.last_hidden_state.float() * mask).sum(1) / mask.sum(1)
          x = torch.nn.functional.normalize(x, dim=-1)
        else:
          x = head(out.pooler_output).float()
      return x.numpy()

    first = run(batches[0])
    for step in range(1, spec["warmup_batches"]):
      run(batches[step % len(batches)])
    times = []
    cpu0, start = time.process_time(), time.perf_counter()
    for step in range(spec["num_batches"][model]):
      t0 = time.perf_counter()
      run(batches[(spec["warmup_batches"] + step) % len(batches)])
      times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / (time.perf_counter() - start)
    np.save(os.path.join(spec["save_dir"], f"torch_{model}_{dtype}.npy"),
            first)
    median = statistics.median(times)
    print(json.dumps({
        "kind": "torch", "model": model, "dtype": dtype, **common,
        "autocast": dtype == "bfloat16",
        # pylint: disable-next=protected-access
        "attn_implementation": bert.config._attn_implementation,
        "blocks_per_s": round(BATCH / median, 2),
        "median_batch_s": round(median, 3),
        "batch_s": [round(t, 3) for t in times],
        "flops_per_batch": forward_flops(batch=BATCH, seq_len=SEQ_LEN, **m),
        "cpu_util": round(cpu, 2), "load_1m_before": _load1()}), flush=True)


# ----------------------------------------------------------------------------
# Orchestration.
# ----------------------------------------------------------------------------


def _run_worker(argv: list[str], env_xla_flags: str | None, log_path: str
                ) -> list[dict[str, Any]]:
  """Runs a worker; returns its JSON records (stderr goes to `log_path`)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("XLA_FLAGS", None)
  if env_xla_flags:
    env["XLA_FLAGS"] = env_xla_flags
  with open(log_path, "w") as log:
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=log,
                          text=True, check=False)
  records = [json.loads(line) for line in proc.stdout.splitlines()
             if line.startswith("{")]
  if proc.returncode:
    with open(log_path) as log:
      tail = log.read()[-3000:]
    records.append({"kind": "worker_failed", "argv": argv[2:],
                    "returncode": proc.returncode, "stderr_tail": tail})
  return records


def _wait_for_load(max_load: float, max_wait_s: float) -> tuple[float, float]:
  start = time.time()
  while _load1() > max_load and time.time() - start < max_wait_s:
    time.sleep(15)
  return _load1(), time.time() - start


def run_benchmark(*, models: Sequence[str], torch_python: str | None,
                  num_batches: int,
                  num_batches_base: int, warmup_batches: int,
                  max_documents: int, block_store_dir: str | None,
                  two_devices: bool, end_to_end: bool,
                  numpy_min_seconds: float, max_load: float,
                  max_wait_s: float) -> None:
  """Runs every measurement and prints the JSON lines."""
  from realm_jax.data import block_store  # pylint: disable=g-import-not-at-top
  from realm_jax.data import corpus_job
  from realm_jax.data import tokenizer

  load, waited = _wait_for_load(max_load, max_wait_s)
  work = tempfile.mkdtemp(prefix="embedding_bench_")
  if block_store_dir and os.path.exists(block_store_dir):
    store = block_store.BlockStore.open(block_store_dir)
  else:
    store, _ = corpus_job.build_corpus(
        output_dir=block_store_dir or os.path.join(work, "store"),
        max_documents=max_documents)
  n_batches = {"minilm_l6_h384": num_batches, "bert_base": num_batches_base}
  most = warmup_batches + max(n_batches.values())
  ids = np.arange(most * BATCH) % len(store)
  feats = store.retriever_inputs(ids, SEQ_LEN)
  np.savez(os.path.join(work, "inputs.npz"),
           **{k: v.reshape(most, BATCH, SEQ_LEN) for k, v in feats.items()})
  _emit({"kind": "setup", "cpu_count": os.cpu_count(), "load_1m": load,
         "waited_for_load_s": round(waited, 1),
         "load_avg": [round(x, 2) for x in os.getloadavg()],
         "blocks_in_store": len(store), "store_documents":
         store.num_documents, "real_tokens_per_block": round(float(
             feats["input_mask"].sum(1).mean()), 1),
         "python": sys.version.split()[0],
         "env_XLA_FLAGS": os.environ.get("XLA_FLAGS")})

  peaks = numpy_peaks(numpy_min_seconds)

  def annotate(record):
    if record.get("kind") in ("realm_jax", "torch"):
      gflops = record["flops_per_batch"] / record["median_batch_s"] / 1e9
      p = peaks[record["model"]]
      record["gflops"] = round(gflops, 1)
      for part in ("dense", "all", "max"):
        record[f"pct_numpy_{part}"] = round(100 * gflops / p[part], 1)
      # Contention-robust view: work per CPU-second this process received,
      # against numpy's per CPU-second rate.
      record["gflops_per_cpu_s"] = round(gflops / record["cpu_util"], 1)
      record["pct_numpy_dense_per_cpu_s"] = round(
          100 * gflops / record["cpu_util"] / p["dense_cpu"], 1)
    _emit(record)
    return record

  spec = {"block_store": store.path, "num_batches": n_batches,
          "warmup_batches": warmup_batches, "save_dir": work}
  runs = [(name, flags, 1, [(m, d) for m in models for d in DTYPES])
          for name, flags in XLA_FLAG_SETTINGS.items()]
  if two_devices and "minilm_l6_h384" in models:
    runs += [(name, flags, 2, [("minilm_l6_h384", "float32")])
             for name, flags in XLA_FLAG_SETTINGS.items()]
  results = []
  for name, flags, devices, configs in runs:
    xla_flags = flags
    if devices > 1:
      xla_flags = (flags + " --xla_force_host_platform_device_count="
                   f"{devices}").strip()
    worker_spec = dict(spec, devices=devices, configs=configs,
                       end_to_end=end_to_end and devices == 1
                       and name == "ynn_fusion_off")
    if devices > 1:
      worker_spec["save_dir"] = None
    spec_path = os.path.join(work, f"jax_{name}_{devices}.json")
    with open(spec_path, "w") as f:
      json.dump(worker_spec, f)
    argv = [sys.executable, os.path.abspath(__file__),
            f"--jax_worker={spec_path}"]
    for record in _run_worker(
        argv, xla_flags, os.path.join(work, f"jax_{name}_{devices}.log")):
      record["xla_flags_setting"] = name
      results.append(annotate(record))

  torch_results = []
  if torch_python and os.path.exists(torch_python):
    spec_path = os.path.join(work, "torch.json")
    with open(spec_path, "w") as f:
      json.dump(dict(spec, inputs=os.path.join(work, "inputs.npz"),
                     threads=os.cpu_count() or 1,
                     minilm_dir=tokenizer.default_model_dir(),
                     configs=[(m, d) for m in models for d in DTYPES]), f)
    argv = [torch_python, os.path.abspath(__file__),
            f"--torch_worker={spec_path}"]
    for record in _run_worker(
        argv, None, os.path.join(work, "torch.log")):
      torch_results.append(annotate(record))
  else:
    _emit({"kind": "torch", "skipped": True,
           "reason": f"--torch_python={torch_python!r} does not exist"})

  # Agreement checks.
  def load(name):
    path = os.path.join(work, name + ".npy")
    return np.load(path) if os.path.exists(path) else None

  for a, b in (("jax_minilm_l6_h384_float32", "torch_minilm_l6_h384_float32"),
               ("jax_minilm_l6_h384_bfloat16", "jax_minilm_l6_h384_float32"),
               ("jax_bert_base_bfloat16", "jax_bert_base_float32")):
    x, y = load(a), load(b)
    if x is not None and y is not None:
      cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1)
                               * np.linalg.norm(y, axis=-1))
      _emit({"kind": "check", "a": a, "b": b,
             "max_abs_diff": float(np.abs(x - y).max()),
             "min_cosine": float(cos.min())})

  for model in models:
    for dtype in DTYPES:
      mine = {r["xla_flags_setting"]: r for r in results
              if r.get("kind") == "realm_jax" and r["model"] == model
              and r["dtype"] == dtype and r["devices"] == 1}
      theirs = [r for r in torch_results if r.get("kind") == "torch"
                and r["model"] == model and r["dtype"] == dtype]
      if not mine:
        continue
      best = max(mine.values(), key=lambda r: r["blocks_per_s"])
      record = {"kind": "comparison", "model": model, "dtype": dtype,
                "realm_jax_blocks_per_s": {k: v["blocks_per_s"]
                                           for k, v in mine.items()},
                "best_xla_flags_setting": best["xla_flags_setting"],
                "best_pct_numpy_dense": best["pct_numpy_dense"],
                "meets_50pct_of_numpy_dense": best["pct_numpy_dense"] >= 50}
      if theirs:
        record["torch_blocks_per_s"] = theirs[0]["blocks_per_s"]
        record["realm_jax_best_over_torch"] = round(
            best["blocks_per_s"] / theirs[0]["blocks_per_s"], 2)
        record["not_slower_than_torch"] = (
            best["blocks_per_s"] >= theirs[0]["blocks_per_s"])
        record["realm_jax_best_over_torch_per_cpu_s"] = round(
            best["blocks_per_s"] / best["cpu_util"]
            / (theirs[0]["blocks_per_s"] / theirs[0]["cpu_util"]), 2)
      _emit(record)
  _emit({"kind": "done", "load_avg_end": [round(x, 2)
                                          for x in os.getloadavg()],
         "work_dir": work})


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("torch_python", "/tmp/torchenv/bin/python",
                      "Interpreter with torch + transformers; the torch part "
                      "is skipped (with a JSON line) if it does not exist.")
  flags.DEFINE_multi_enum("models", list(MODELS), list(MODELS),
                          "Models to run.")
  flags.DEFINE_integer("num_batches", 5, "Timed batches, MiniLM.")
  flags.DEFINE_integer("num_batches_base", 3, "Timed batches, BERT-base.")
  flags.DEFINE_integer("warmup_batches", 1,
                       "Untimed batches first (the first one compiles).")
  flags.DEFINE_integer("max_documents", 8,
                       "Articles of the gensim slice to block (8 -> ~320 "
                       "blocks); batches cycle over the store.")
  flags.DEFINE_string("block_store_dir", None,
                      "Reuse (or build into) this block store directory.")
  flags.DEFINE_bool("two_devices", True,
                    "Also MiniLM float32 on 2 emulated CPU devices.")
  flags.DEFINE_bool("end_to_end", True,
                    "Also run embed_block_store over the whole store.")
  flags.DEFINE_float("numpy_min_seconds", 1.0, "Time per numpy shape.")
  flags.DEFINE_float("max_load", 0.8,
                     "Wait for the 1-minute load average to drop below this "
                     "(other processes share the cores) ...")
  flags.DEFINE_float("max_wait_s", 0.0, "... for at most this long.")


def main(argv: Sequence[str]) -> None:
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  run_benchmark(models=f.models, torch_python=f.torch_python,
                num_batches=f.num_batches,
                num_batches_base=f.num_batches_base,
                warmup_batches=f.warmup_batches,
                max_documents=f.max_documents,
                block_store_dir=f.block_store_dir, two_devices=f.two_devices,
                end_to_end=f.end_to_end,
                numpy_min_seconds=f.numpy_min_seconds, max_load=f.max_load,
                max_wait_s=f.max_wait_s)


if __name__ == "__main__":
  # Workers take one argument and skip absl: the torch interpreter has none.
  if len(sys.argv) == 2 and sys.argv[1].startswith("--torch_worker="):
    with open(sys.argv[1].split("=", 1)[1]) as spec_file:
      torch_worker(json.load(spec_file))
  elif len(sys.argv) == 2 and sys.argv[1].startswith("--jax_worker="):
    with open(sys.argv[1].split("=", 1)[1]) as spec_file:
      jax_worker(json.load(spec_file))
  else:
    from absl import app  # pylint: disable=g-import-not-at-top
    _define_flags()
    app.run(main)

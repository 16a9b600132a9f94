"""realm-aot: every job's real step compiled by the TPU compiler (libtpu)
for single- and multi-host pod slices, on this CPU host.

Each step is the job's own (`realm_jax.aot` builds it with the trainer's
functions) at tiny sizes; each is checked to fit, to have FLOPs the
compiler counts, and to have its batch split by the data axis over every
device of the step's mesh (read from the compiled input shardings). The v4
slices compile the same steps again and are marked slow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from realm_jax import aot
from realm_jax.jobs import aot as aot_job
from realm_jax.aot import report as aot_report
from realm_jax.aot import steps as aot_steps
from realm_jax.data import examples
from realm_jax.index import build
from realm_jax.testing import timeouts, tiny
from realm_jax.data import qa_inputs
from realm_jax.training import finetune, ict, pretrain

pytest.importorskip("libtpu")

ROOT = pathlib.Path(__file__).resolve().parents[1]
_PATHS = dict(workdir="unused", block_store="unused")
_NUM_BLOCKS = 1000


def _configs():
  return {
      "pretrain": pretrain.PretrainConfig(
          **_PATHS, queries="unused", batch_size=16, num_train_steps=10,
          learning_rate=1e-3, reader_length=28),
      "ict": ict.IctTrainConfig(
          **_PATHS, batch_size=16, num_train_steps=10,
          pairs=examples.IctConfig(query_length=8, block_length=16)),
      "finetune": finetune.FinetuneConfig(
          **_PATHS, train_jsonl="unused", index_dir="unused", batch_size=16,
          num_train_steps=10, num_epochs=None,
          qa=qa_inputs.QAConfig(question_length=8, num_retrieved=8,
                                num_reader_blocks=2, reader_length=24)),
      "embed": build.IndexBuildConfig(batch_size_per_device=2),
  }


def _compile_all(name: str) -> dict[str, aot_report.Report]:
  config = aot.AotConfig(topology=name, jobs=aot.JOBS, query_length=12,
                         num_masks=3, block_length=16,
                         num_blocks=_NUM_BLOCKS, search_queries=16,
                         search_k=5)
  topo = aot.topology(name)
  model = tiny.tiny_realm(vocab_size=97)
  return {step.job: aot_report.compile_step(step, topo, num_train_steps=n,
                                            num_blocks=_NUM_BLOCKS)
          for step, n in aot_steps.build_steps(config, topo, _configs(),
                                               model)}


# (topology, chips, hosts): one single-host and one multi-host slice each.
# One test per slice compiles every job once (a module fixture would be
# compiled again by each xdist worker that runs one of its tests).
TOPOLOGIES = [
    pytest.param("v5e:2x2", 4, 1, id="v5e:2x2"),
    pytest.param("v5e:4x4", 16, 4, id="v5e:4x4"),
    pytest.param("v4:2x2x1", 4, 1, id="v4:2x2x1", marks=pytest.mark.slow),
    pytest.param("v4:2x2x2", 8, 2, id="v4:2x2x2", marks=pytest.mark.slow),
]


def _check(r: aot_report.Report, name: str, chips: int, hosts: int) -> None:
  """A step that fits, counts FLOPs and splits its batch over every device
  of its mesh."""
  assert (r.topology, r.chips, r.hosts) == (name, chips, hosts)
  assert r.fits, aot_report.format_report(r)
  assert 0 < r.hbm_per_chip_bytes <= r.hbm_capacity_bytes
  assert r.flops_per_chip > 0 and r.bytes_accessed_per_chip > 0
  assert r.estimated_step_seconds > 0 and 0 < r.estimated_mfu <= 1
  # The model's own FLOPs beside the compiler's: the same roofline time.
  assert r.model_flops_per_chip > 0
  assert r.estimated_model_mfu == pytest.approx(
      r.model_flops_per_chip / aot.topology(name).chip.peak_bf16_flops
      / r.estimated_step_seconds)
  # The index builder embeds on each host's own chips; the others use all.
  devices = chips // hosts if r.job == "embed" else chips
  assert r.mesh_devices == devices
  # Every device holds its own 1/devices of the split rows: none replicated.
  assert r.split_rows_per_device * devices == r.split_rows, r
  assert r.split_rows_per_device < r.split_rows
  line = json.loads(r.json_line())
  for field in ("job", "topology", "chips", "hosts", "global_batch", "fits",
                "hbm_per_chip_bytes", "hbm_capacity_bytes", "flops_per_chip",
                "estimated_step_seconds", "estimated_mfu"):
    assert line[field] is not None, field


@pytest.mark.parametrize("name,chips,hosts", TOPOLOGIES)
def test_every_jobs_step_fits_counts_flops_and_splits_the_batch(
    name, chips, hosts):
  reports = _compile_all(name)
  assert sorted(reports) == sorted(aot.JOBS)
  for job in aot.JOBS:
    try:
      _check(reports[job], name, chips, hosts)
    except AssertionError as e:
      raise AssertionError(f"{job} on {name}: {e}") from e
  # The run length and the refresh time follow from the step's estimate.
  train = reports["pretrain"]
  assert train.estimated_days == pytest.approx(
      10 * train.estimated_step_seconds / 86400)
  # Every host embeds its share at once: blocks/s over the pod.
  e = reports["embed"]
  assert e.examples_per_second == pytest.approx(
      e.global_batch * hosts / e.estimated_step_seconds)
  steps = -(-_NUM_BLOCKS // (e.global_batch * hosts))
  assert e.estimated_refresh_seconds == pytest.approx(
      steps * e.estimated_step_seconds)


def test_a_step_that_does_not_fit_is_refused_with_what_to_change():
  # 65536 queries against 250k rows per chip: 65 GB of float32 scores.
  config = aot.AotConfig(topology="v5e:2x2", jobs=("search",),
                         num_blocks=1_000_000, search_queries=65536)
  topo = aot.topology("v5e:2x2")
  (step, _), = aot_steps.build_steps(config, topo, {},
                                     tiny.tiny_realm(vocab_size=97))
  r = aot_report.compile_step(step, topo)
  assert not r.fits and r.hbm_per_chip_bytes is None
  assert r.error.startswith("RESOURCE_EXHAUSTED")
  assert "search_queries" in r.advice and "bfloat16" in r.advice
  text = aot_report.format_report(r)
  assert "does NOT fit" in text and "to fit, change:" in text


def test_writes_the_serialized_executable(tmp_path):
  config = aot.AotConfig(topology="v5e:2x2", jobs=("search",),
                         num_blocks=_NUM_BLOCKS, search_queries=16,
                         search_k=5)
  topo = aot.topology("v5e:2x2")
  (step, _), = aot_steps.build_steps(config, topo, {},
                                     tiny.tiny_realm(vocab_size=97))
  r = aot_report.compile_step(step, topo,
                              serialize_dir=str(tmp_path / "xla"))
  assert r.fits
  assert r.executable == str(tmp_path / "xla" / "search_v5e_2x2.xla")
  assert os.path.getsize(r.executable) > 1000
  hlo = (tmp_path / "xla" / "search_v5e_2x2.hlo.txt").read_text()
  assert "HloModule" in hlo and "all-gather" in hlo  # The top-k's merge.


def test_training_advice_names_batch_remat_dtype_and_sharding():
  topo = aot.topology("v5e:2x2")
  text = aot_report.advice("pretrain", topo, 512)
  for what in ("pretrain.PretrainConfig.batch_size", "128 examples per chip",
               "BertConfig.remat=True", "BertConfig.dtype", "replicated"):
    assert what in text, what


@pytest.mark.parametrize("name,message", [
    ("v6:2x2", "generation v4, v5e or v5p"),
    ("v5e:2x2x2", "2 positive dimensions"),
    ("v4:4x4", "3 positive dimensions"),
    ("", "not a TPU topology name"),
])
def test_bad_topology_names_the_field_and_the_form(name, message):
  with pytest.raises(ValueError, match=message) as e:
    aot.AotConfig(topology=name)
  assert "AotConfig.topology" in str(e.value)


@pytest.mark.parametrize("name,bounds,fix", [
    ("v5e:3x3", "2x2x1", "v5e:4x4"),
    ("v5e:1x3", "1x2x1", "v5e:1x4"),
    ("v4:3x2x2", "2x2x1", "v4:4x2x2"),
    ("v5p:2x3x3", "2x2x1", "v5p:2x4x3"),
])
def test_topology_not_divisible_into_hosts_names_it_and_the_host_bounds(
    name, bounds, fix):
  # Refused by the config, before libtpu's JaxRuntimeError (INVALID_ARGUMENT
  # ... not divisible by the given (or default) chips_per_host_bounds).
  with pytest.raises(ValueError, match="does not divide into hosts") as e:
    aot.AotConfig(topology=name)
  for what in (f"AotConfig.topology={name!r}", f"host bounds of {bounds} "
               "chips", f"e.g. '{fix}'"):
    assert what in str(e.value), what
  aot.parse_topology(fix)  # The suggestion is itself accepted.


def test_topology_whose_third_dimension_is_odd_divides_into_hosts():
  assert aot.parse_topology("v4:2x2x3")[1] == (2, 2, 3)


@pytest.mark.parametrize("name", ["v5e:32x32", "v5e:99999999999999999999x2",
                                  "v4:32x32x32"])
def test_topology_larger_than_a_pod_is_refused(name):
  with pytest.raises(ValueError, match=r"more than a whole v\w+ pod") as e:
    aot.AotConfig(topology=name)
  assert f"AotConfig.topology={name!r}" in str(e.value)


@pytest.mark.parametrize("field", ["query_length", "num_masks",
                                   "block_length", "num_blocks",
                                   "search_queries", "search_k",
                                   "num_questions"])
@pytest.mark.parametrize("value", [2**31, 2**63, 10**30])
def test_numbers_that_overflow_are_refused_naming_the_field(field, value):
  # Before: numpy's OverflowError (num_blocks), MLIR's TypeError for a
  # shape past int64 (search_queries), top_k's ValueError (search_k).
  with pytest.raises(ValueError, match=(
      rf"^AotConfig\.{field} must be <= 2,147,483,647 \(2\*\*31 - 1: .*"
      rf"int32\), got {value}\.$")):
    aot.AotConfig(topology="v5e:2x2", jobs=("search",), **{field: value})


@pytest.mark.parametrize("sizes,fields", [
    (dict(search_queries=2**31 - 1, num_blocks=2**31 - 1),
     "search_queries x num_blocks"),
    (dict(block_length=2**31 - 1, num_blocks=2**31 - 1),
     "block_length x num_blocks"),
])
def test_search_arrays_no_chip_could_hold_are_refused_naming_the_fields(
    sizes, fields):
  # Before: libtpu aborted the process (SIGABRT in its heap simulator) or
  # compiled for minutes; a report said nothing of the fields.
  with pytest.raises(ValueError, match=rf"^AotConfig\.{fields} is too "
                     r"large: each of the 4 chips of v5e:2x2 .* PiB"):
    aot.AotConfig(topology="v5e:2x2", jobs=("search",), **sizes)
  # Other jobs do not build the search's arrays.
  aot.AotConfig(topology="v5e:2x2", jobs=("ict",), **sizes)


def test_search_k_past_the_blocks_is_refused():
  with pytest.raises(ValueError, match=r"AotConfig\.search_k=5,000 must be "
                     r"<= num_blocks=1,000"):
    aot.AotConfig(topology="v5e:2x2", jobs=("search",), num_blocks=1000)


def test_a_batch_that_overflows_is_refused_naming_the_field():
  config = aot.AotConfig(topology="v5e:2x2", jobs=("pretrain",))
  configs = {"pretrain": pretrain.PretrainConfig(
      **_PATHS, queries="unused", batch_size=10**30, learning_rate=1e-3)}
  with pytest.raises(ValueError, match=r"^PretrainConfig\.batch_size must "
                     r"be <= 2,147,483,647"):
    aot_steps.build_steps(config, aot.topology("v5e:2x2"), configs,
                          tiny.tiny_realm(vocab_size=97))
  # A batch within int32 whose product with the lengths no chip holds.
  config = aot.AotConfig(topology="v5e:2x2", jobs=("ict",))
  configs = {"ict": ict.IctTrainConfig(
      **_PATHS, batch_size=2**30, pairs=examples.IctConfig(
          query_length=8, block_length=2**21))}
  with pytest.raises(ValueError, match=r"block_ids would be \[1073741824, "
                     r"2097152\], 2 PiB on each of its 4 chips.*lower "
                     r"IctTrainConfig\.batch_size"):
    aot_steps.build_steps(config, aot.topology("v5e:2x2"), configs,
                          tiny.tiny_realm(vocab_size=97))


def test_batch_that_does_not_divide_is_refused():
  config = aot.AotConfig(topology="v5e:4x4", jobs=("pretrain",))
  configs = {"pretrain": pretrain.PretrainConfig(
      **_PATHS, queries="unused", batch_size=8, learning_rate=1e-3)}
  with pytest.raises(ValueError, match=r"PretrainConfig.batch_size=8 does "
                     r"not divide over the 16 devices"):
    aot_steps.build_steps(config, aot.topology("v5e:4x4"), configs,
                          tiny.tiny_realm(vocab_size=97))


def test_v4_train_step_with_remat_and_bfloat16_is_refused_not_crashed():
  # libtpu 0.0.42.1 segfaults compiling it (v5e compiles it).
  bert = tiny.tiny_bert(remat=True, dtype="bfloat16")
  model = tiny.tiny_realm(vocab_size=97)
  model = dataclasses.replace(
      model, retriever=dataclasses.replace(model.retriever, bert=bert),
      reader=dataclasses.replace(model.reader, bert=bert))
  config = aot.AotConfig(topology="v4:2x2x1", jobs=("ict",))
  with pytest.raises(ValueError, match="keep one of them"):
    aot_steps.build_steps(config, aot.topology("v4:2x2x1"),
                          {"ict": _configs()["ict"]}, model)


def test_pretrain_step_with_flash_attention_compiles_for_tpu(tmp_path):
  # BertConfig.attention="flash": jax's Pallas TPU kernel, forward and
  # backward, inside the step's shard_map, compiled by libtpu.
  bert = tiny.tiny_bert(attention="flash")
  model = tiny.tiny_realm(vocab_size=97)
  model = dataclasses.replace(
      model, retriever=dataclasses.replace(model.retriever, bert=bert),
      reader=dataclasses.replace(model.reader, bert=bert))
  config = aot.AotConfig(topology="v5e:2x2", jobs=("pretrain",),
                         query_length=12, num_masks=3, block_length=16)
  topo = aot.topology("v5e:2x2")
  (step, n), = aot_steps.build_steps(
      config, topo, {"pretrain": _configs()["pretrain"]}, model)
  r = aot_report.compile_step(step, topo, num_train_steps=n,
                              serialize_dir=str(tmp_path))
  _check(r, "v5e:2x2", 4, 1)
  hlo = (tmp_path / "pretrain_v5e_2x2.hlo.txt").read_text()
  assert "tpu_custom_call" in hlo


def _realm_aot(*args: str, env=None) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.aot", *args], capture_output=True,
      text=True, timeout=timeouts.HANG_SECONDS, cwd=ROOT, env=env, check=False)


def test_cli_compiles_a_job_recipe_and_prints_a_json_line():
  # The tiny ICT recipe as the ICT job reads it; its paths need no value.
  env = dict(os.environ)
  env.pop("JAX_PLATFORMS", None)  # realm-aot sets it itself.
  result = _realm_aot("--gin_file=experiments/ict_tiny_cpu.gin",
                      "--gin.TOPOLOGY='v5e:2x2'",
                      "--gin.examples.IctConfig.block_length=32", env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [json.loads(l) for l in result.stdout.splitlines()
           if l.startswith("{")]
  assert [(l["job"], l["topology"], l["chips"], l["global_batch"],
           l["fits"]) for l in lines] == [("ict", "v5e:2x2", 4, 16, True)]
  assert "estimated step time" in result.stdout


def test_cli_reports_the_training_steps_one_refresh_lasts(tmp_path):
  # A pre-training recipe with its refresh: the builder's embedding recipe,
  # on its own slice (2 hosts here), compiled by a child realm-aot.
  recipe = tmp_path / "embed.gin"
  recipe.write_text("include 'models/tiny.gin'\n"
                    "include 'runs/index_builder.gin'\n"
                    "include 'runs/aot.gin'\n"
                    "TOPOLOGY = 'v5e:2x4'\n"
                    "builder.IndexBuildConfig.batch_size_per_device = 2\n")
  result = _realm_aot("--gin_file=experiments/pretrain_tiny_cpu.gin",
                      "--gin.TOPOLOGY='v5e:2x2'",
                      f"--gin.aot.AotConfig.refresh_recipe='{recipe}'")
  assert result.returncode == 0, result.stderr[-3000:]
  [line] = [json.loads(l) for l in result.stdout.splitlines()
            if l.startswith("{")]
  assert line["job"] == "pretrain" and line["refresh_topology"] == "v5e:2x4"
  assert line["estimated_steps_per_refresh"] == pytest.approx(
      line["estimated_refresh_seconds"] / line["estimated_step_seconds"])
  assert "training steps per index refresh" in result.stdout
  # A recipe that is not the builder's is refused, naming the field.
  result = _realm_aot("--gin_file=experiments/pretrain_tiny_cpu.gin",
                      "--gin.TOPOLOGY='v5e:2x2'",
                      "--gin.aot.AotConfig.refresh_recipe="
                      "'experiments/ict_tiny_cpu.gin'")
  assert result.returncode == 1
  assert "AotConfig.refresh_recipe='experiments/ict_tiny_cpu.gin' did not " \
      "give an embed step" in result.stderr, result.stderr[-2000:]


def test_cli_exits_1_naming_the_fix_when_a_step_does_not_fit():
  result = _realm_aot("--gin_file=models/tiny.gin", "--gin.TOPOLOGY='v5e:2x2'",
                      "--gin.aot.AotConfig.jobs=('search',)",
                      "--gin.aot.AotConfig.num_blocks=1000000",
                      "--gin.aot.AotConfig.search_queries=65536")
  assert result.returncode == 1, result.stdout[-2000:]
  assert "Does not fit: search on v5e:2x2" in result.stderr
  assert "search_queries" in result.stderr


@pytest.mark.parametrize("binding,message", [
    ("--gin.TOPOLOGY='v5e:3x3'",
     "realm-aot: AotConfig.topology='v5e:3x3' does not divide into hosts"),
    (f"--gin.aot.AotConfig.num_blocks={10**30}",
     "realm-aot: AotConfig.num_blocks must be <= 2,147,483,647"),
])
def test_cli_refuses_a_bad_aot_config_in_one_line(binding, message):
  # Before: a JaxRuntimeError's traceback (the topology), an OverflowError's
  # from inside jax (num_blocks).
  result = _realm_aot("--gin_file=models/tiny.gin", "--gin.TOPOLOGY='v5e:2x2'",
                      "--gin.aot.AotConfig.jobs=('search',)", binding)
  assert result.returncode == 1, result.stdout[-2000:]
  assert result.stderr.splitlines()[-1].startswith(message), result.stderr
  assert "Traceback" not in result.stderr


def test_cli_dry_run_needs_no_paths_and_no_compiler_work():
  result = _realm_aot("--gin_file=experiments/pretrain_tiny_cpu.gin",
                      "--gin.TOPOLOGY='v4:4x4x4'", "--dry_run")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "AotConfig(topology='v4:4x4x4'" in result.stdout
  assert "workdir='unused-by-realm-aot'" in result.stdout


# `realm-aot` as its console script runs it (`realm_jax.cli`), with Ctrl-C
# as a terminal leaves it: a runner started in the background passes
# SIGINT ignored, which realm-aot keeps.
_REALM_AOT_WITH_CTRL_C = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv[0] = "realm-aot"
runpy.run_module("realm_jax.jobs.aot", run_name="__main__", alter_sys=True)
"""


def test_cli_ctrl_c_stops_the_compile_at_once_without_a_traceback():
  # The tiny pre-training step takes the compiler ~20 s on two idle cores
  # (no compilation cache: a cached step would not be compiled); Ctrl-C as
  # it starts ends realm-aot at once, not after it.
  env = dict(os.environ)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  proc = subprocess.Popen(
      [sys.executable, "-c", _REALM_AOT_WITH_CTRL_C,
       "--gin_file=experiments/pretrain_tiny_cpu.gin",
       "--gin.TOPOLOGY='v5e:2x2'"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  watchdog = threading.Timer(timeouts.HANG_SECONDS, proc.kill)
  watchdog.start()
  try:
    before = []
    for line in proc.stderr:  # Up to the compile's log line.
      before.append(line)
      if "Compiling the pretrain step for v5e:2x2" in line:
        break
    else:
      pytest.fail("realm-aot ended before it compiled: "
                  + "".join(before)[-3000:])
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=timeouts.HANG_SECONDS)
    seconds = time.monotonic() - interrupted
  finally:
    watchdog.cancel()
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == aot_job.INTERRUPTED_EXIT_STATUS, err[-3000:]
  assert err.splitlines()[-1] == aot_job.INTERRUPTED_MESSAGE
  assert err.count(aot_job.INTERRUPTED_MESSAGE) == 1
  assert "Traceback" not in err and "KeyboardInterrupt" not in err
  assert not out.strip()  # No report: the compile never finished.
  assert seconds < 5, seconds


def test_the_pretrain_step_with_bm25_candidates_compiles_wider():
  """Issue 65: `lexical_candidates` widens the compiled batch (k + m
  candidates and the null document) and `held_prior` adds its [B] weight
  ("mixture": and BM25's [B, C] log-prior); the step fits and costs more
  FLOPs than REALM's."""
  config = aot.AotConfig(topology="v5e:2x2", jobs=("pretrain",),
                         query_length=12, num_masks=3, block_length=16)
  topo = aot.topology("v5e:2x2")
  model = tiny.tiny_realm(vocab_size=97)
  reports = []
  for retrieval in (pretrain.RetrievalConfig(),
                    pretrain.RetrievalConfig(lexical_candidates=3,
                                             held_prior="mixture")):
    configs = _configs()
    configs["pretrain"] = dataclasses.replace(configs["pretrain"],
                                              retrieval=retrieval)
    (step, n), = aot_steps.build_steps(config, topo, configs, model)
    if retrieval.held_prior == "mixture":
      assert step.args[step.batch_arg]["lexical_log_prior"].shape == (
          configs["pretrain"].batch_size, 7 + 3 + 1)
    assert f"x {retrieval.num_candidates + retrieval.lexical_candidates + 1}"\
        f" candidates" in step.notes
    reports.append(aot_report.compile_step(step, topo, num_train_steps=n))
  realm, lexical = reports
  _check(lexical, "v5e:2x2", 4, 1)
  assert lexical.flops_per_chip > realm.flops_per_chip

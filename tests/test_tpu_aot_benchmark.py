"""benchmarks/tpu_aot.py: the staleness it derives from realm-aot's lines,
its table, where the bytes go in an optimized HLO module, and the compile
it ends when it is stopped."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import tpu_aot

ROOT = pathlib.Path(__file__).resolve().parents[1]


_HLO = """\
HloModule jit_step

%fused_computation (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %n = f32[4,8]{1,0} negate(%p)
}

ENTRY %main (a: f32[4,8], b: bf16[16]) -> (f32[4,8], bf16[16]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  %fusion.1 = f32[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/neg"}
  %all-reduce.2 = bf16[16]{0} all-reduce(%b), replica_groups={}, to_apply=%add
  ROOT %tuple = (f32[4,8]{1,0}, bf16[16]{0}) tuple(%fusion.1, %all-reduce.2)
}
"""


def test_hlo_traffic_counts_operand_and_result_bytes():
  found = tpu_aot.hlo_traffic(_HLO)
  # fusion: reads and writes 4 x 8 float32; all-reduce: 16 bf16 each way;
  # the parameters and the tuple move nothing.
  assert found["total_bytes"] == 2 * 128 + 2 * 32
  assert found["by_op"] == [["fusion:kLoop", 1, 256], ["all-reduce", 1, 64]]
  assert found["top"][0] == [256, "fusion:kLoop", "fusion.1",
                             "jit(step)/neg"]


_SCOPED = """\
HloModule jit_train_step

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %f.1 = f32[4,8]{1,0} fusion(%a), kind=kLoop, calls=%c, metadata={op_name="jit(train_step)/shard_map/jvp(reader)/attention/attention_scores/exp"}
  %f.2 = f32[4,8]{1,0} fusion(%f.1), kind=kLoop, calls=%c, metadata={op_name="jit(train_step)/shard_map/transpose(jvp(reader))/attention/attention_scores/mul"}
  %f.3 = f32[4,8]{1,0} fusion(%f.2), kind=kOutput, calls=%c, metadata={op_name="jit(train_step)/shard_map/transpose(jvp(document_tower))/ffn/dot_general"}
  %f.4 = f32[4,8]{1,0} fusion(%f.3), kind=kLoop, calls=%c, metadata={op_name="jit(train_step)/optimizer/mul"}
  %all-reduce.5 = f32[4,8]{1,0} all-reduce(%f.4), replica_groups={}, to_apply=%add
  ROOT %n = f32[4,8]{1,0} negate(%all-reduce.5)
}
"""


def test_hlo_traffic_splits_the_bytes_by_the_models_named_scopes():
  found = tpu_aot.hlo_traffic(_SCOPED)
  assert found["total_bytes"] == 6 * 256
  assert sorted(found["by_scope"]) == sorted([
      ["reader", "attention_scores", "forward", 1, 256],
      ["reader", "attention_scores", "backward", 1, 256],
      ["document_tower", "ffn", "backward", 1, 256],
      ["optimizer", "", "forward", 1, 256],
      ["collectives", "all-reduce", "", 1, 256],
      ["other", "", "forward", 1, 256]])


def _line(job, topology, seconds, fits=True, **extra):
  return dict(job=job, topology=topology, fits=fits,
              estimated_step_seconds=seconds, chips=16, hosts=4,
              hbm_per_chip_bytes=2e9, hbm_capacity_bytes=16 * 2**30,
              flops_per_chip=1e12, bytes_accessed_per_chip=1e11,
              bound="memory", estimated_mfu=0.4, examples_per_second=10.0,
              **extra)


def test_staleness_and_table_read_the_refresh_realm_aot_reports():
  lines = [_line("pretrain", "v5e:8x8", 0.4, estimated_model_mfu=0.3,
                 refresh_recipe="pods/embed.gin", refresh_topology="v5e:4x4",
                 estimated_refresh_seconds=600.0,
                 estimated_steps_per_refresh=1500.0),
           _line("embed", "v5e:4x4", 0.2, estimated_refresh_seconds=600.0),
           _line("pretrain", "v4:4x4x4", 0.3),
           _line("pretrain", "v4:4x4x4", 0.3, fits=False, error="x")]
  (row,) = tpu_aot.staleness(lines)
  assert row["pretrain"] == "v5e:8x8" and row["embed"] == "v5e:4x4"
  assert row["staleness_steps"] == 1500.0 and row["refresh_minutes"] == 10
  table = tpu_aot.table(lines)
  assert ("| v5e:8x8 (16, 4) | yes | 2.00 GB of 16 GiB | 1.00 / 100.0 | "
          "0.400 s | memory | 40% / 30% | 10 | 1,500 steps per refresh "
          "(v5e:4x4) |") in table
  assert "| 40% / ? | 10 | 10.0 min |" in table
  assert "| no | x |" in table


# The benchmark with a stand-in for realm-aot: `sys.executable` (what it
# runs `-m realm_jax.jobs.aot` with) is a script that writes its pid and sleeps,
# as a compile of 20 minutes would. The signal is as a terminal leaves it
# (a test runner started with `nohup` passes SIGHUP ignored, which the
# benchmark keeps).
_BENCHMARK = """
import signal, sys
from benchmarks import tpu_aot
signal.signal(int(sys.argv[3]), signal.SIG_DFL)
sys.executable = sys.argv[1]
sys.argv = ["tpu_aot.py", "--recipes=pretrain_bert_base_v5e_8x8",
            "--output=" + sys.argv[2]]
tpu_aot.main()
"""


def _gone(pid: int) -> bool:
  """Whether process `pid` has ended (a zombie has)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except FileNotFoundError:
    return True


@pytest.mark.parametrize("signum,status", [
    pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
    pytest.param(signal.SIGHUP, 129, id="SIGHUP"),
])
def test_a_stop_signal_ends_the_compile_in_flight(tmp_path, signum, status):
  pid_file = tmp_path / "child.pid"
  fake = tmp_path / "fake_python"
  fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}.tmp\n"
                  f"mv {pid_file}.tmp {pid_file}\nexec sleep 600\n")
  fake.chmod(0o755)
  bench = subprocess.Popen(
      [sys.executable, "-c", _BENCHMARK, str(fake), str(tmp_path / "o"),
       str(int(signum))],
      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  child = None
  try:
    deadline = time.monotonic() + 60
    while not pid_file.exists():
      assert bench.poll() is None, bench.stderr.read().decode()[-2000:]
      assert time.monotonic() < deadline, "the stand-in never started"
      time.sleep(0.05)
    child = int(pid_file.read_text())
    bench.send_signal(signum)
    bench.wait(timeout=60)
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert _gone(child), f"{signum.name} left the compile running"
    assert bench.returncode == status
  finally:
    for pid in (child,) if child and not _gone(child) else ():
      os.kill(pid, signal.SIGKILL)
    if bench.poll() is None:
      bench.kill()
      bench.wait()

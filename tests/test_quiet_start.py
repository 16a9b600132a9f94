"""Issue 68: a job on a CPU host starts quietly: no libtpu probe and its
error lines before the job's own first line (`gin_cli.platform_when_unset`)."""

import os
import subprocess
import sys

import pytest

# What libtpu and a CUDA probe print when JAX looks for accelerators that
# this host does not have.
NOISE = ("Failed to find host bounds", "unexpected worker hostname",
         "cuInit")
# A job through the jobs' prelude (`gin_cli.run`) whose body starts JAX's
# backends; `distributed` False skips the platform choice (the control).
_JOB = """
import sys
from realm_jax import gin_cli
import jax
def job(dry_run):
  del dry_run
  print("platforms:", sorted({{d.platform for d in jax.devices()}}), flush=True)
sys.argv = ["job"]
gin_cli.run(job, distributed={distributed}, runs_file="")
"""


def _start(distributed: bool) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  return subprocess.run([sys.executable, "-c",
                         _JOB.format(distributed=distributed)],
                        env=env, capture_output=True, text=True, timeout=300,
                        check=True)


def _host_has_accelerator() -> bool:
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  return bool(hardware_utils.num_available_tpu_chips_and_device_id()[0] or
              hardware_utils.has_visible_nvidia_gpu() or
              hardware_utils.num_available_amd_gpus())


def test_a_job_on_a_cpu_host_prints_no_accelerator_probe():
  if _host_has_accelerator():
    pytest.skip("this host has an accelerator: JAX's own choice stands.")
  run = _start(distributed=True)
  assert "platforms: ['cpu']" in run.stdout
  assert not [n for n in NOISE if n in run.stderr], run.stderr[-2000:]


@pytest.mark.slow
def test_without_the_choice_the_probe_is_heard():
  """The control: the same job without `platform_when_unset` prints the
  probe's lines (where libtpu is installed, as with the test extra)."""
  pytest.importorskip("libtpu")
  if _host_has_accelerator():
    pytest.skip("this host has an accelerator.")
  run = _start(distributed=False)
  assert [n for n in NOISE if n in run.stderr], run.stderr[-2000:]

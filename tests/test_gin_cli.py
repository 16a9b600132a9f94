"""Tests of realm_jax.gin_cli.run's options for the data jobs."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_JOB = (
    "import sys\n"
    "from realm_jax import gin_cli\n"
    "def job(dry_run, args):\n"
    "  import gin\n"
    "  print('ARGS', args, dry_run, gin.query_parameter('X/macro.value'),\n"
    "        'jax' in sys.modules)\n"
    "sys.argv = ['job'] + sys.argv[1:]\n"
    "gin_cli.run(job, pipeline_args=True, distributed=False,\n"
    "            defaults=['X = 1', 'Y = 1'])\n")


def _run(args, **env):
  return subprocess.run(
      [sys.executable, *args], capture_output=True, text=True, cwd=REPO,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env), timeout=600,
      check=False)


def test_data_jobs_keep_beam_options_and_do_not_join_jax():
  # A pod host's launcher asks every process to join the JAX runtime; a
  # data job must not (it would wait for the trainer's processes).
  result = _run(["-c", _JOB, "--gin.X=2", "--runner=DirectRunner",
                 "--project=p", "extra", "--dry_run"],
                REALM_JAX_DISTRIBUTED="1")
  assert result.returncode == 0, result.stderr[-2000:]
  # The command line's bindings win over `defaults`; JAX is not imported.
  assert "ARGS ['--runner=DirectRunner', '--project=p', 'extra'] True 2 " \
         "False" in result.stdout


def test_data_job_without_its_gin_file_says_which():
  result = _run(["-m", "realm_jax.data.corpus_job", "--gin.OUTPUT_DIR='x'"])
  assert result.returncode != 0
  assert "pass --gin_file=runs/corpus.gin and set its paths" in result.stderr

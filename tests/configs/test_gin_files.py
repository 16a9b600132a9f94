"""Every gin file parses and builds what it says."""

import glob
import os

import gin
import pytest

from realm_jax import gin_cli
from realm_jax.eval import qa_eval
from realm_jax.index import builder
from realm_jax.model import realm
from realm_jax.training import finetune, ict, pretrain, qa_inputs

GIN_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "gin_configs")
GIN_FILES = sorted(glob.glob(os.path.join(GIN_DIR, "**", "*.gin"),
                             recursive=True))

EXPECTED_MODELS = {  # file -> (hidden, layers, heads, embedding size)
    "tiny.gin": (32, 2, 4, 128),
    "minilm_l6.gin": (384, 6, 12, 384),
    "bert_base.gin": (768, 12, 12, 128),
    "bert_large.gin": (1024, 24, 16, 128),
}


def test_there_are_gin_files():
  assert {os.path.basename(f) for f in GIN_FILES} >= set(EXPECTED_MODELS)


# Macros that run files leave %gin.REQUIRED for the user to set.
REQUIRED = ["WORKDIR = '/tmp/w'", "BLOCK_STORE = '/tmp/b'",
            "ANNOTATED = '/tmp/a'", "TRAIN_JSONL = '/tmp/q.jsonl'",
            "INDEX_DIR = '/tmp/i'", "INIT_FROM = 'scratch'"]


@pytest.mark.parametrize("path", GIN_FILES, ids=os.path.basename)
def test_gin_file_parses(path):
  gin.clear_config()
  try:
    gin_cli.parse([path], REQUIRED)
    name = os.path.basename(path)
    if name.startswith("finetune"):
      config = gin.get_configurable(finetune.FinetuneConfig)()
      assert config.workdir == "/tmp/w"
    elif name.startswith("eval") or "/runs/eval" in path:
      config = gin.get_configurable(qa_eval.EvalConfig)()
      assert config.recall_ks
      qa = gin.get_configurable(qa_inputs.QAConfig)()
      if name == "eval_tiny_cpu.gin":  # Must be fine-tuning's sizes.
        gin.clear_config()
        gin_cli.parse(["experiments/finetune_tiny_cpu.gin"], REQUIRED)
        ft = gin.get_configurable(finetune.FinetuneConfig)()
        assert (qa.question_length, qa.reader_length,
                qa.num_reader_blocks) == (ft.question_length,
                                          ft.reader_length,
                                          ft.num_reader_blocks)
        gin.clear_config()
        gin_cli.parse([path], REQUIRED)
    elif name.startswith("ict") or "/runs/ict" in path:
      config = gin.get_configurable(ict.IctTrainConfig)()
      assert config.workdir == "/tmp/w"
    elif "/experiments/" in path or "/runs/pretrain" in path:
      config = gin.get_configurable(pretrain.PretrainConfig)()
      assert config.workdir == "/tmp/w"
    if "/experiments/" in path:
      gin.get_configurable(realm.RealmConfig)()
    if "/runs/index_builder" in path:
      assert gin.get_configurable(builder.BuilderConfig)().keep >= 1
    if name in EXPECTED_MODELS:
      config = gin.get_configurable(realm.RealmConfig)()
      b = config.retriever.bert
      assert (b.hidden_size, b.num_layers, b.num_heads,
              config.retriever.embedding_size) == EXPECTED_MODELS[name]
      assert config.reader.bert == b
  finally:
    gin.clear_config()


def test_default_xla_flags_adds_the_cpu_flag_once_and_respects_the_user(
    monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  gin_cli.default_xla_flags()
  gin_cli.default_xla_flags()
  assert os.environ["XLA_FLAGS"].split() == [
      "--xla_force_host_platform_device_count=8", gin_cli.CPU_XLA_FLAG]
  monkeypatch.setenv("XLA_FLAGS",
                     "--xla_cpu_experimental_ynn_fusion_type=dot")
  gin_cli.default_xla_flags()
  assert os.environ["XLA_FLAGS"] == (
      "--xla_cpu_experimental_ynn_fusion_type=dot")
  monkeypatch.delenv("XLA_FLAGS")
  gin_cli.default_xla_flags()
  assert os.environ["XLA_FLAGS"] == gin_cli.CPU_XLA_FLAG


def test_importing_the_jobs_does_not_start_jax():
  """The flags only take effect if no job module starts JAX on import."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = (
      "import realm_jax.training.pretrain, realm_jax.training.ict, "
      "realm_jax.training.finetune, realm_jax.index.builder, "
      "realm_jax.eval.qa_eval, realm_jax.ask, realm_jax.demo\n"
      "from jax._src import xla_bridge\n"
      "assert not xla_bridge.backends_are_initialized()\n"
      "import os; print(os.environ['XLA_FLAGS'])\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True, timeout=300)
  assert gin_cli.CPU_XLA_FLAG in out.stdout  # realm_jax.demo sets it.


def test_parse_does_not_log_gin_search_path_probes(caplog):
  gin.clear_config()
  try:
    with caplog.at_level("INFO"):
      gin_cli.parse(["experiments/eval_tiny_cpu.gin"], REQUIRED)
  finally:
    gin.clear_config()
  assert not [r for r in caplog.records if "Path not found" in r.getMessage()]
  with pytest.raises(IOError, match="nonexistent.gin"):
    gin_cli.parse(["experiments/nonexistent.gin"], [])
  gin.clear_config()

"""Every gin file parses and builds what it says."""

import dataclasses
import glob
import os

import gin
import pytest

from realm_jax import aot
from realm_jax import gin_cli
from realm_jax.eval import qa_eval
from realm_jax.index import build, builder, extend_job
from realm_jax.model import cpu as model_cpu
from realm_jax.model import realm
from realm_jax.data import qa_inputs, realm_inputs
from realm_jax.testing import timeouts
from realm_jax.training import finetune, ict, pretrain, reader_prep

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
            "QUERIES = '/tmp/a'", "TRAIN_JSONL = '/tmp/q.jsonl'",
            "INDEX_DIR = '/tmp/i'", "INIT_FROM = 'scratch'",
            "OUTPUT_DIR = '/tmp/o'", "ANNOTATED = '/tmp/a/*'",
            "GATE_QUERIES = '/tmp/g'", "TOPOLOGY = 'v5e:2x2'",
            "UNION_STORE = '/tmp/u'"]


@pytest.mark.parametrize("path", GIN_FILES, ids=os.path.basename)
def test_gin_file_parses(path):
  gin.clear_config()
  try:
    # A pod recipe binds its TOPOLOGY itself (pods/shared/: what they share).
    pod = "/pods/" in path and "/pods/shared/" not in path
    # The extend job refuses init_from='scratch' (no trained document
    # tower); its default (None) is the run's checkpoint.
    extend = ["INIT_FROM = None"] if "/runs/index_extend" in path else []
    gin_cli.parse([path], [b for b in REQUIRED
                           if not (pod and b.startswith("TOPOLOGY"))] + extend)
    name = os.path.basename(path)
    if pod:
      _check_pod_recipe(name)
    elif name.startswith(("finetune", "demo_finetune")):
      config = gin.get_configurable(finetune.FinetuneConfig)()
      assert config.workdir == "/tmp/w"
    elif name.startswith("eval") or "/runs/eval" in path:
      config = gin.get_configurable(qa_eval.EvalConfig)()
      assert config.recall_ks
      # Imported weights' QA sizes (a fine-tuning checkpoint carries its
      # own): they build.
      gin.get_configurable(qa_inputs.QAConfig)()
    elif name.startswith("ict") or "/runs/ict" in path:
      config = gin.get_configurable(ict.IctTrainConfig)()
      assert config.workdir == "/tmp/w"
    elif "/runs/reader_prep" in path:
      config = gin.get_configurable(reader_prep.ReaderPrepConfig)()
      assert config.workdir == "/tmp/w"
    elif "/experiments/" in path or "/runs/pretrain" in path:
      config = gin.get_configurable(pretrain.PretrainConfig)()
      assert config.workdir == "/tmp/w"
    if name.startswith(("pretrain_minilm_wiki", "demo_pretrain")):
      # MiniLM recipes prepare the reader (its own job) from MiniLM.
      prep = gin.get_configurable(reader_prep.ReaderPrepConfig)()
      assert prep.init_from == "scratch" and prep.num_train_steps >= 50
    if "/experiments/" in path:
      gin.get_configurable(realm.RealmConfig)()
    if "/runs/index_builder" in path:
      assert gin.get_configurable(builder.BuilderConfig)().index_build.keep >= 1
    if "/runs/index_extend" in path:
      config = gin.get_configurable(extend_job.ExtendConfig)()
      assert (config.union_store, config.index_build.keep) == ("/tmp/u", 3)
    if name in EXPECTED_MODELS:
      config = gin.get_configurable(realm.RealmConfig)()
      b = config.retriever.bert
      assert (b.hidden_size, b.num_layers, b.num_heads,
              config.retriever.embedding_size) == EXPECTED_MODELS[name]
      assert config.reader.bert == b
  finally:
    gin.clear_config()


def _check_pod_recipe(name: str) -> None:
  """A gin_configs/pods/ recipe: the topology its name says, BERT-base, and
  the paper's sizes for the job it names."""
  topology = gin.get_configurable(aot.AotConfig)().topology
  gen, dims = name[:-len(".gin")].split("_")[-2:]
  assert topology == f"{gen}:{dims}", name
  model = gin.get_configurable(realm.RealmConfig)()
  assert model.retriever.bert.hidden_size == 768
  if name.startswith("pretrain_"):
    config = gin.get_configurable(pretrain.PretrainConfig)()
    aot_config = gin.get_configurable(aot.AotConfig)()
    reader_length = realm_inputs.reader_length(
        config.reader_length, aot_config.query_length,
        aot_config.block_length, field="reader_length", queries="-")
    assert (config.batch_size, config.retrieval.num_candidates,
            reader_length) == (512, 7, 384)
  elif name.startswith("ict_"):
    assert gin.get_configurable(ict.IctTrainConfig)().batch_size == 4096
  elif name.startswith("finetune_"):
    qa = gin.get_configurable(finetune.FinetuneConfig)().qa
    assert (qa.num_retrieved, qa.num_reader_blocks) == (5000, 5)
  elif name.startswith("embed_"):
    assert gin.get_configurable(builder.BuilderConfig)()
  else:
    assert gin.get_configurable(aot.AotConfig)().jobs == ("search",)


def test_one_binding_sets_how_the_trainer_and_the_builder_build_an_index():
  """How an index is built is declared once, builder.IndexBuildConfig: the
  inline trainer's (PretrainConfig.index_build) and the builder job's
  (BuilderConfig.index_build) are bound to it, so one binding sets both,
  and neither job config declares a copy of its fields."""
  gin.clear_config()
  try:
    gin_cli.parse(["runs/index_builder.gin",
                   "experiments/pretrain_tiny_cpu.gin"], REQUIRED + [
                       "builder.IndexBuildConfig.batch_size_per_device = 2",
                       "builder.IndexBuildConfig.bfloat16 = True"])
    trainer = gin.get_configurable(pretrain.PretrainConfig)().index_build
    job = gin.get_configurable(builder.BuilderConfig)().index_build
  finally:
    gin.clear_config()
  assert trainer == job == build.IndexBuildConfig(
      searcher="exact", batch_size_per_device=2, bfloat16=True)
  build_fields = {f.name for f in dataclasses.fields(build.IndexBuildConfig)}
  for cls in (pretrain.PretrainConfig, builder.BuilderConfig):
    names = {f.name for f in dataclasses.fields(cls)}
    assert not (build_fields | {"searcher_kind"}) & names, cls


def test_add_cpu_xla_flag_adds_the_flag_once_and_respects_the_user(
    monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  gin_cli.add_cpu_xla_flag()
  gin_cli.add_cpu_xla_flag()
  assert os.environ["XLA_FLAGS"].split() == [
      "--xla_force_host_platform_device_count=8", gin_cli.CPU_XLA_FLAG]
  monkeypatch.setenv("XLA_FLAGS",
                     "--xla_cpu_experimental_ynn_fusion_type=dot")
  gin_cli.add_cpu_xla_flag()
  assert os.environ["XLA_FLAGS"] == (
      "--xla_cpu_experimental_ynn_fusion_type=dot")
  monkeypatch.delenv("XLA_FLAGS")
  gin_cli.add_cpu_xla_flag()
  assert os.environ["XLA_FLAGS"] == gin_cli.CPU_XLA_FLAG


@pytest.mark.parametrize("platforms, added", [
    ("cuda", False), ("tpu", False), ("cuda,cpu", True), ("cpu", True),
    ("", True)])
def test_the_cpu_flag_stays_off_where_jax_platforms_names_no_cpu(
    monkeypatch, platforms, added):
  """An accelerator host's jaxlib may not know the experimental CPU flag,
  and XLA stops at unknown flags."""
  monkeypatch.setenv("JAX_PLATFORMS", platforms)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  gin_cli.add_cpu_xla_flag()
  assert (gin_cli.CPU_XLA_FLAG in os.environ["XLA_FLAGS"]) == added


# Experiments that run on CPU; the others (and runs/*) size accelerator runs.
CPU_EXPERIMENTS = {"eval_tiny_cpu.gin", "finetune_tiny_cpu.gin",
                   "ict_tiny_cpu.gin", "pretrain_tiny_cpu.gin",
                   "pretrain_world_cpu.gin", "pretrain_minilm_wiki.gin",
                   "pretrain_wiki_small_cpu.gin",
                   "pretrain_minilm_wiki_gated.gin",
                   "demo_pretrain.gin", "demo_finetune.gin"}
RUN_AND_EXPERIMENT_FILES = [
    f for f in GIN_FILES if "/runs/" in f or "/experiments/" in f]


def test_every_cpu_experiment_exists():
  names = {os.path.basename(f) for f in GIN_FILES if "/experiments/" in f}
  assert CPU_EXPERIMENTS <= names
  assert {n for n in names if "_cpu" in n} <= CPU_EXPERIMENTS


@pytest.mark.parametrize("path", RUN_AND_EXPERIMENT_FILES,
                         ids=os.path.basename)
def test_cpu_tuning_only_in_cpu_experiments(path, monkeypatch):
  """CPU files turn on every CPU option and the XLA flag; others none."""
  cpu = os.path.basename(path) in CPU_EXPERIMENTS
  # runs/* files are included after a model file; they set no model.
  files = [path] if "/experiments/" in path else ["models/bert_base.gin",
                                                  path]
  gin.clear_config()
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  try:
    gin_cli.parse(files, REQUIRED)
    model = gin.get_configurable(realm.RealmConfig)()
    options = {
        bert.attention_batching for bert in (model.retriever.bert,
                                             model.reader.bert)} | {
        bert.dropout_mask_bits for bert in (model.retriever.bert,
                                            model.reader.bert)} | {
        model.reader.span_head_batching}
    assert options == ({"per_sequence", 16, "per_row"} if cpu
                       else {"whole_batch", 32})
    # cpu.gin and realm_jax.model.cpu (for Python entry points) agree.
    assert (model_cpu.for_cpu(model) == model) == cpu
    assert gin_cli.gin_asks_for_cpu_xla_flag() == cpu
    gin_cli.apply_gin_xla_flags()
    assert (gin_cli.CPU_XLA_FLAG in os.environ.get("XLA_FLAGS", "")) == cpu
  finally:
    gin.clear_config()


def test_run_sets_the_gin_xla_flag_before_jax_starts(tmp_path):
  """`gin_cli.run` parses gin, then sets the flag, before any backend."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = (
      "import os, sys\n"
      "from realm_jax import gin_cli\n"
      "def job(dry_run):\n"
      "  from jax._src import xla_bridge\n"
      "  assert not xla_bridge.backends_are_initialized()\n"
      "  print('XLA_FLAGS=' + os.environ.get('XLA_FLAGS', ''))\n"
      "sys.argv = ['job'] + sys.argv[1:]\n"
      "gin_cli.run(job)\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  flags = {}
  for name in ("experiments/ict_tiny_cpu.gin", "runs/ict.gin"):
    out = subprocess.run(
        [sys.executable, "-c", code, f"--gin_file={name}",
         f"--gin.WORKDIR='{tmp_path}'", "--gin.BLOCK_STORE='/tmp/b'"],
        env=env, check=True, capture_output=True, text=True,
        timeout=timeouts.HANG_SECONDS)
    flags[name] = [line for line in out.stdout.splitlines()
                   if line.startswith("XLA_FLAGS=")][0]
  assert gin_cli.CPU_XLA_FLAG in flags["experiments/ict_tiny_cpu.gin"]
  assert gin_cli.CPU_XLA_FLAG not in flags["runs/ict.gin"]


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
                       capture_output=True, text=True,
                       timeout=timeouts.HANG_SECONDS)
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


def test_the_default_recipe_is_gated_and_guarded():
  """runs/pretrain.gin: the retriever released only on the reader's
  measured evidence with an effect (no step count), and the recall guard
  on; runs/pretrain_original.gin: REALM's own settings, neither."""
  def configured(run_file):
    gin.clear_config()
    try:
      gin_cli.parse(["models/tiny.gin", run_file], REQUIRED)
      return (gin.get_configurable(pretrain.PretrainConfig)(),
              gin.get_configurable(realm.RealmConfig)())
    finally:
      gin.clear_config()

  config, model = configured("runs/pretrain.gin")
  assert config.gate == pretrain.GateConfig(
      mode="evidence", latest_release=None, queries="/tmp/a", every=50,
      num_queries=2048, min_evidence_z=3.0, min_utility=0.005, patience=2)
  assert config.recall_guard.enabled
  assert (config.recall_guard.queries, config.recall_guard.probe) == (
      "/tmp/a", "answer")
  assert config.retriever.learning_rate_multiplier == 0.1
  assert model.retriever.null_score == "learned_mean"
  original, model = configured("runs/pretrain_original.gin")
  assert (original.gate.mode, original.gate.latest_release) == ("steps", 0)
  assert not original.recall_guard.enabled
  assert original.retriever.learning_rate_multiplier == 1.0
  assert not original.adam_bias_correction
  assert model.retriever.null_score == "embedding"


def _statements(path):
  from gin import config_parser  # pylint: disable=g-import-not-at-top
  with open(path, encoding="utf-8") as f:
    return list(config_parser.ConfigParser(
        f.read(), gin.config.ParserDelegate(skip_unknown=True)))


def _bound(path) -> dict:
  """(scope, selector, argument) -> str(value) as the file and its
  includes leave them, in gin's order (a later binding wins)."""
  from gin import config_parser  # pylint: disable=g-import-not-at-top
  bound = {}
  for statement in _statements(path):
    if isinstance(statement, config_parser.IncludeStatement):
      bound.update(_bound(os.path.join(GIN_DIR, statement.filename)))
    elif isinstance(statement, config_parser.BindingStatement):
      bound[statement.scope, statement.selector, statement.arg_name] = str(
          statement.value)
  return bound


@pytest.mark.parametrize("path", GIN_FILES, ids=os.path.basename)
def test_no_gin_file_repeats_a_value_its_includes_bind(path):
  from gin import config_parser  # pylint: disable=g-import-not-at-top
  included, repeats = {}, []
  for statement in _statements(path):
    if isinstance(statement, config_parser.IncludeStatement):
      included.update(_bound(os.path.join(GIN_DIR, statement.filename)))
    elif isinstance(statement, config_parser.BindingStatement):
      key = statement.scope, statement.selector, statement.arg_name
      if included.get(key, object()) == str(statement.value):
        repeats.append(".".join(k for k in key if k))
  assert not repeats, f"{path} binds again what its includes bind: {repeats}"

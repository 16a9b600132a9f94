"""The inputs every condition of a learning benchmark run shares.

`Inputs` parses the recipe once (the reader's length, the gate's warm-up)
and builds what no condition changes, kept in --workdir so that a rerun
(or a run on an accelerator host without TensorFlow) reads them back: the
dev queries' cache, the held-out queries, the questions' wordpieces and
the cloze probe. `Inputs.queries_for` builds a condition's training query
cache, masked its way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from benchmarks.learning import conditions
from benchmarks.learning.worlds import World


def configs(gin_files, bindings):
  """Parses `gin_files` and `bindings` afresh; returns (gin, the RealmConfig
  they bind)."""
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  from realm_jax.model.realm import RealmConfig  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  gin_cli.parse(gin_files, bindings)
  return gin, gin.get_configurable(RealmConfig)()


def _kept(path: str, make):
  """`make()`'s arrays, kept at `path` (.npz, no pickles): a run there
  needs no tensorflow_text, e.g. on an accelerator host."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if os.path.exists(path):
    with np.load(path, allow_pickle=False) as f:
      return {k: f[k] for k in f.files}
  arrays = make()
  np.savez(path + ".tmp.npz", **arrays)
  os.replace(path + ".tmp.npz", path)
  return arrays


def _sha(path: str, *settings) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read() + repr(settings).encode()).hexdigest()[:12]


class Inputs:
  """The world, the recipe as parsed, and the inputs built from them.

  Attributes:
    args / world: the flags (`cli.parse_args`) and the `World`.
    suffix: appended to every run directory of a thinned run or of another
      pre-training seed (the inputs and ICT of the workdir are shared).
    base: the gin bindings every job of the run gets (macros, steps,
      seed, trivial candidates, --gin).
    model / recipe / query_config: the RealmConfig, PretrainConfig and
      RealmQueryConfig the recipe binds (without its condition's changes).
    reader_length: the reader's length as the trainer derives it.
    warmup: the fixed warm-up's length (gate mode "steps"), else 0.
    heldout / gold: the held-out masked queries and their evidence blocks
      (None: real text).
    question_inputs: the questions' wordpieces, or None.
    cloze: (the cloze probe's masked queries, their gold blocks), or None.
  """

  def __init__(self, args, world: World):
    from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
    from realm_jax.data import block_store, examples, query_cache_writer  # pylint: disable=g-import-not-at-top
    from realm_jax.data import realm_inputs  # pylint: disable=g-import-not-at-top
    from realm_jax.training import pretrain  # pylint: disable=g-import-not-at-top
    self.args, self.world = args, world
    self.suffix = (f"_every{args.train_articles_every}"
                   if args.train_articles_every > 1 else "") + (
                       f"_seed{args.pretrain_seed}"
                       if args.pretrain_seed != args.seed else "")
    self.store = block_store.BlockStore.open(world.store_dir)
    self.eval_store = block_store.BlockStore.open(world.eval_store_dir)
    self.base = [
        f"WORKDIR = '{args.workdir}'",
        f"BLOCK_STORE = '{world.store_dir}'",
        f"QUERIES = '{os.path.join(args.workdir, 'queries_salient')}'",
        f"GATE_QUERIES = '{os.path.join(args.workdir, 'queries_dev')}'",
        f"pretrain.PretrainConfig.num_train_steps = {args.steps}",
        f"pretrain.PretrainConfig.checkpoint_every = {args.refresh_every}",
        f"pretrain.PretrainConfig.seed = {args.pretrain_seed}",
        f"pretrain.RetrievalConfig.trivial_candidates = '{args.trivial}'"
    ] + list(args.gin)
    gin, self.model = configs(args.gin_file, [
        b for b in self.base if ".num_train_steps" not in b])
    self.recipe = gin.get_configurable(pretrain.PretrainConfig)()
    self.query_config = gin_config.configured(examples.RealmQueryConfig)
    self.reader_length = realm_inputs.reader_length(
        self.recipe.reader_length, self.query_config.query_length,
        self.store.max_block_len, field="PretrainConfig.reader_length",
        queries="(the benchmark's)")
    if self._needs_dev() and not world.dev_x:
      raise SystemExit("the recipe's gate or recall guard needs --dev "
                       "people.")
    self.warmup = (self.recipe.gate.latest_release
                   if self.recipe.gate.mode == "steps" else 0)
    if self._needs_dev():
      dev_cache = os.path.join(args.workdir, "queries_dev")
      if not os.path.exists(dev_cache):
        query_cache_writer.build_query_cache(
            world.dev_x, dev_cache, query_config=self.query_config,
            seed=args.seed, num_shards=1)
    salient = dataclasses.replace(self.query_config, masking="salient")
    self.heldout = _kept(os.path.join(args.workdir, "heldout_queries_" + _sha(
        world.heldout_x, salient, args.seed, args.max_heldout) + ".npz"),
                         lambda: self._read_queries(
                             world.heldout_x, salient, args.max_heldout))
    self.gold = (None if world.gold_blocks is None
                 else world.gold_blocks(self.heldout))
    self.question_inputs = None
    if world.questions:
      self.question_inputs = _kept(os.path.join(
          args.workdir, "question_inputs_" + _sha(
              world.questions_path, self.query_config.query_length,
              len(world.questions)) + ".npz"), self._tokenize_questions)
    self.cloze = self._cloze_queries(salient) if world.cloze else None

  def _needs_dev(self) -> bool:
    """Whether the gate or the recall guard reads a dev split's queries."""
    recipe = self.recipe
    return ((recipe.gate.measured and recipe.gate.queries != recipe.queries)
            or recipe.recall_guard.queries not in ("", recipe.queries))

  def _read_queries(self, path, config, max_queries=0):
    import numpy as np  # pylint: disable=g-import-not-at-top
    from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
    from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    queries = examples.read_realm_queries(path, Tokenizer(), config=config,
                                          seed=self.args.seed)
    if max_queries:
      keep = np.sort(np.random.default_rng(self.args.seed).permutation(
          len(queries["query_ids"]))[:max_queries])
      queries = {k: v[keep] for k, v in queries.items()}
    return queries

  def _tokenize_questions(self):
    from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    from realm_jax.data import qa_inputs  # pylint: disable=g-import-not-at-top
    return qa_inputs.tokenize_questions(
        Tokenizer(), [e.question for e in self.world.questions],
        self.query_config.query_length)

  def _cloze_queries(self, salient):
    """The cloze probe's prompts masked as the held-out queries are, and
    each one's gold block."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    path, gold_of = self.world.cloze
    queries = _kept(os.path.join(self.args.workdir, "cloze_queries_" + _sha(
        path, salient) + ".npz"), lambda: self._read_queries(path, salient))
    cloze = queries, np.asarray(
        [gold_of[int(h)] for h in queries["source_doc_hash"]])
    print(f"cloze probe: {len(cloze[1])} prompts (answers of at most "
          f"{salient.max_masks} wordpieces)", flush=True)
    return cloze

  def queries_for(self, config) -> str:
    """The training sentences masked the condition's way (built once)."""
    from realm_jax.data import query_cache_writer  # pylint: disable=g-import-not-at-top
    thinned = (f"_every{self.args.train_articles_every}"
               if self.args.train_articles_every > 1 else "")
    path = os.path.join(self.args.workdir,
                        f"queries_{config.masking}{thinned}")
    if not os.path.exists(path):
      query_cache_writer.build_query_cache(
          self.world.train_x, path, query_config=config,
          seed=self.args.seed, num_shards=1)
    return path

  def condition_configs(self, condition: str, *extra: str):
    """(gin, RealmConfig) of a pre-training condition: its gin files, the
    run's bindings, `extra`, then the condition's own bindings."""
    return configs(conditions.gin_files(condition, self.args),
                   self.base + list(extra)
                   + conditions.bindings(condition, self.args))

  def prepare_conditions(self) -> None:
    """Every condition's query cache; nothing trained (--prepare_only)."""
    from realm_jax.core import gin_config  # pylint: disable=g-import-not-at-top
    from realm_jax.data import examples  # pylint: disable=g-import-not-at-top
    for condition in self.args.conditions:
      if condition not in ("init", "ict"):
        self.condition_configs(condition)
        self.queries_for(gin_config.configured(examples.RealmQueryConfig))

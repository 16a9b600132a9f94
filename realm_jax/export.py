"""Export a trained REALM as Hugging Face / sentence-transformers files.

    python -m realm_jax.jobs.export --gin.WORKDIR="'/tmp/run'" \\
        --gin.OUTPUT_DIR="'/tmp/realm_export'" [--gin.STEP=1000]

Reads the newest (or STEP's) checkpoint of WORKDIR with the model config it
carries, and writes the layout of `realm_jax.checkpoint_import.exported`:
the retriever's query tower as a sentence-transformers model (a Hugging
Face BertModel + its pooling, projection and normalisation modules), the
reader as a Hugging Face BertForMaskedLM plus its span head, the vocabulary
and `realm_config.json`. `init_from="export:<dir>"` (and `realm_jax.load`)
read it back; the round trip is exact.

From Python: `export_model(params, realm_config, output_dir)`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import numpy as np

from realm_jax.checkpoint_import import core, exported, importers
from realm_jax.core import checks, dataclass_json, io_utils
from realm_jax.core import outputs
from realm_jax.data import tokenizer as tokenizer_lib
from realm_jax.model.bert import BertConfig
from realm_jax.model.realm import RealmConfig, RetrieverConfig


def hf_bert_config(config: BertConfig, **extra) -> dict[str, Any]:
  """A Hugging Face BertConfig dict (config.json) for `config`."""
  return dict(
      architectures=extra.pop("architectures", ["BertModel"]),
      model_type="bert", vocab_size=config.vocab_size,
      hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads,
      intermediate_size=config.intermediate_size,
      hidden_act="gelu_new" if config.gelu_approximate else "gelu",
      hidden_dropout_prob=config.hidden_dropout,
      attention_probs_dropout_prob=config.attention_dropout,
      max_position_embeddings=config.max_position_embeddings,
      type_vocab_size=config.type_vocab_size,
      initializer_range=config.initializer_range,
      layer_norm_eps=config.layer_norm_eps,
      position_embedding_type="absolute", pad_token_id=0, **extra)


def _named(params: dict[str, Any], rules: dict[core.Path, core.Rule]
           ) -> dict[str, np.ndarray]:
  """Our leaves under their source names (the rules' transforms are their
  own inverses: identity or a transpose)."""
  flat = core.flatten(params)
  missing = [p for p in rules if p not in flat and not rules[p].optional]
  if missing:
    raise ValueError(f"Parameters {missing[:5]} are missing; is the config "
                     "the one these parameters were trained with?")
  return {rule.names[0]: np.ascontiguousarray(
      rule.transform(np.asarray(flat[path], np.float32)))
          for path, rule in rules.items() if path in flat}


def _save(path: str, arrays: dict[str, np.ndarray]) -> None:
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(path), exist_ok=True)
  save_file(arrays, path, metadata={"format": "pt"})
  # safetensors writes its files owner-only (0600) whatever the umask.
  io_utils.honour_umask(path, directory=False)


def _write_json(path: str, value: Any) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write("\n")


def _write_tower(directory: str, params: dict[str, Any],
                 config: RetrieverConfig, vocab_path: str,
                 max_seq_length: int) -> None:
  """One retrieval tower as a sentence-transformers model."""
  bert = config.bert
  _save(os.path.join(directory, "model.safetensors"), _named(
      params, importers.bert_rules(bert.num_layers, "hf", "", ("bert",))))
  _write_json(os.path.join(directory, "config.json"), hf_bert_config(bert))
  shutil.copyfile(vocab_path, os.path.join(directory, "vocab.txt"))
  _write_json(os.path.join(directory, "tokenizer_config.json"), dict(
      tokenizer_class="BertTokenizer", do_lower_case=True,
      model_max_length=max_seq_length))
  _write_json(os.path.join(directory, "sentence_bert_config.json"),
              dict(max_seq_length=max_seq_length, do_lower_case=False))
  dirs = exported.st_module_dirs(config)
  h = bert.hidden_size
  modules = [dict(idx=0, name="0", path="",
                  type="sentence_transformers.models.Transformer")]
  _write_json(os.path.join(directory, dirs["pooling"], "config.json"), dict(
      word_embedding_dimension=h,
      pooling_mode_cls_token=config.pooling in ("cls", "pooler"),
      pooling_mode_mean_tokens=config.pooling == "mean",
      pooling_mode_max_tokens=False, pooling_mode_mean_sqrt_len_tokens=False))
  types = {"pooling": "Pooling", "pooler": "Dense", "projection": "Dense",
           "layer_norm": "LayerNorm", "normalize": "Normalize"}
  if "pooler" in dirs:  # BERT's pooler: dense + tanh on [CLS].
    pooler = params["bert"]["pooler"]
    _save(os.path.join(directory, dirs["pooler"], "model.safetensors"), {
        "linear.weight": np.ascontiguousarray(np.asarray(
            pooler["kernel"], np.float32).T),
        "linear.bias": np.asarray(pooler["bias"], np.float32)})
    _write_json(os.path.join(directory, dirs["pooler"], "config.json"), dict(
        in_features=h, out_features=h, bias=True,
        activation_function="torch.nn.modules.activation.Tanh"))
  if config.projection_size:
    p = config.projection_size
    _save(os.path.join(directory, dirs["projection"], "model.safetensors"),
          _named(params, importers.module_rules(exported.PROJECTION, "hf", "")))
    _write_json(os.path.join(directory, dirs["projection"], "config.json"),
                dict(in_features=h, out_features=p, bias=True,
                     activation_function="torch.nn.modules.linear.Identity"))
    _save(os.path.join(directory, dirs["layer_norm"], "model.safetensors"),
          _named(params, importers.module_rules(exported.LAYER_NORM, "hf", "")))
    _write_json(os.path.join(directory, dirs["layer_norm"], "config.json"),
                dict(dimension=p))
  for i, (role, sub) in enumerate(dirs.items(), start=1):
    modules.append(dict(idx=i, name=sub.split("_", 1)[0], path=sub,
                        type=f"sentence_transformers.models.{types[role]}"))
  _write_json(os.path.join(directory, "modules.json"), modules)


def _write_export(tmp: str, params: dict[str, Any], config: RealmConfig,
                  vocab_path: str, max_seq_length: int,
                  run_configs: dict[str, Any] | None) -> None:
  """`export_model`'s files, into the fresh directory `tmp`."""
  retriever = params["retriever"]
  _write_tower(os.path.join(tmp, "retriever"), retriever["query_embedder"],
               config.retriever, vocab_path, max_seq_length)
  if "document_embedder" in retriever:
    _write_tower(os.path.join(tmp, "document_retriever"),
                 retriever["document_embedder"], config.retriever,
                 vocab_path, max_seq_length)
  if "null_score_bias" in retriever:
    _save(os.path.join(tmp, "retriever", exported.NULL_SCORE_FILE), {
        "null_score_bias": np.asarray(retriever["null_score_bias"],
                                      np.float32)})
  reader_dir = os.path.join(tmp, "reader")
  reader = params["reader"]
  _save(os.path.join(reader_dir, "model.safetensors"),
        _named(reader, exported.reader_rules(config.reader)))
  _write_json(os.path.join(reader_dir, "config.json"), hf_bert_config(
      config.reader.bert, architectures=["BertForMaskedLM"]))
  shutil.copyfile(vocab_path, os.path.join(reader_dir, "vocab.txt"))
  if config.reader.span_head:
    _save(os.path.join(reader_dir, exported.SPAN_HEAD_FILE),
          _named(reader, exported.span_rules()))
  _write_json(os.path.join(tmp, exported.CONFIG_FILE), dict(
      run_configs or {}, model=dataclass_json.to_dict(config),
      retriever_pooling=config.retriever.pooling,
      retriever_normalize=config.retriever.normalize))


def export_model(params: dict[str, Any], config: RealmConfig,
                 output_dir: str, *, vocab_path: str | None = None,
                 max_seq_length: int = 512,
                 run_configs: dict[str, Any] | None = None,
                 setting: str = "output_dir") -> str:
  """Writes `params` of `config` as an export directory (atomically).

  Args:
    params: {"retriever": ..., "reader": ...} (host arrays or jax arrays).
    config: the RealmConfig they belong to.
    output_dir: created; must not exist.
    vocab_path: the vocabulary (default: the BERT uncased one).
    max_seq_length: the retriever's sentence-transformers max_seq_length.
    run_configs: extra JSON for realm_config.json (e.g. the task config
      and the operative gin of the run).
    setting: how the caller names `output_dir`, for errors.

  Returns:
    output_dir.
  """
  vocab_path = vocab_path or tokenizer_lib.default_vocab_path()
  # realm_config.json last: a reader opens it first (`load_exported`).
  with outputs.output_dir(output_dir, kind=outputs.EXPORT, setting=setting,
                          exists=_exists(output_dir),
                          last=(exported.CONFIG_FILE,)) as tmp:
    _write_export(tmp, params, config, vocab_path, max_seq_length,
                  run_configs)
  return output_dir


def _exists(output_dir: str) -> str:
  return (f"{output_dir} exists; choose a new output directory (exports are "
          "never overwritten).")


_SETTING = "ExportConfig.output_dir (--gin.OUTPUT_DIR)"


@dataclasses.dataclass(frozen=True)
@checks.type_checked
class ExportConfig:
  """What `python -m realm_jax.jobs.export` writes (runs/export.gin binds it).

  Attributes:
    workdir: a run's workdir or its checkpoints/ directory; the checkpoint
      carries the model config.
    output_dir: the export directory to create.
    step: checkpoint step (default: the newest).
    vocab_path: the vocabulary to ship (default: BERT uncased).
  """
  workdir: str = checks.path_setting("reads")
  output_dir: str = checks.path_setting("writes", "export")
  step: int | None = None
  vocab_path: str | None = checks.path_setting("reads", default=None)


def export_checkpoint(config: ExportConfig) -> str:
  """Exports checkpoint `step` of `workdir` with the configs it carries."""
  from realm_jax import api  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.eval import qa_model  # pylint: disable=g-import-not-at-top
  directory = api.checkpoint_directory(config.workdir)
  # Inside the checkpoints (by any name) an export would look like a step.
  io_utils.check_apart(config.output_dir, "output_dir",
                       {"the checkpoints of workdir": directory})
  outputs.check(config.output_dir, outputs.EXPORT, _SETTING, overwrite=False,
                exists=_exists(config.output_dir))
  saved = api.config_of(config.workdir, config.step)
  step = (checkpoints.newest_step(directory) if config.step is None
          else config.step)
  model = dataclass_json.from_dict(RealmConfig, saved["model_config"],
                                   f"{directory}/{step}/meta:model_config")
  params = checkpoints.restore_items(directory, step, checkpoints.PARAM_ITEMS)
  # A pre-training checkpoint carries an untrained span head: the export
  # says so, and whatever loads it answers with the notice.
  trained = qa_model.span_head_trained(checkpoints.read_meta(directory, step))
  out = export_model(params, model, config.output_dir, setting=_SETTING,
                     vocab_path=config.vocab_path, run_configs=dict(
                         saved, source=f"{directory}/{step}",
                         **({} if trained is None else
                            {"span_head_trained": trained})))
  print(f"exported step {step} of {directory} to {out}")
  return out


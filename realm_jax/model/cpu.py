"""CPU tuning of model configs, for entry points that build them in Python.

Gin jobs get the same options from gin_configs/models/cpu.gin
(tests/configs/test_gin_files.py keeps the two equal). The defaults are the
plain implementations, which accelerators fuse; each option here was faster
on 2 CPU cores (see the fields' docstrings and BUILD.md, "CPU performance").
"""

from __future__ import annotations

import dataclasses

from realm_jax.model.bert import BertConfig
from realm_jax.model.realm import RealmConfig, ReaderConfig, RetrieverConfig

BERT_OPTIONS = {"attention_batching": "per_sequence", "dropout_mask_bits": 16}
READER_OPTIONS = {"span_head_batching": "per_row"}

_Config = BertConfig | RetrieverConfig | ReaderConfig | RealmConfig


def for_cpu(config: _Config) -> _Config:
  """`config` (any of the model configs) with every CPU option set."""
  if isinstance(config, BertConfig):
    return dataclasses.replace(config, **BERT_OPTIONS)
  if isinstance(config, RealmConfig):
    return RealmConfig(retriever=for_cpu(config.retriever),
                       reader=for_cpu(config.reader))
  extra = READER_OPTIONS if isinstance(config, ReaderConfig) else {}
  return dataclasses.replace(config, bert=for_cpu(config.bert), **extra)

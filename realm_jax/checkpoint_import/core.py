"""Strict, name-mapped loading of foreign checkpoints into parameter dicts.

A *source* is a read-only map from variable names to arrays: a TensorFlow
checkpoint (TF1 `bert/...` names or TF2 object paths), or a safetensors file.
A *mapping* says, for every leaf of our parameter tree, which source name it
comes from and how to transform it (e.g. transpose a PyTorch Linear weight).
Loading is strict: every leaf must be found with the right shape and every
source variable must be used or explicitly ignored, else one error lists
all missing, unexpected and wrongly shaped names.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

Path = tuple[str, ...]
Transform = Callable[[np.ndarray], np.ndarray]


def identity(x: np.ndarray) -> np.ndarray:
  return x


def transpose(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x.T)


@dataclasses.dataclass(frozen=True)
class Rule:
  """Where one parameter comes from.

  Attributes:
    names: candidate source names, first found wins (aliases such as the
      old `LayerNorm.gamma` spelling of `LayerNorm.weight`).
    transform: applied to the source array before the shape check.
    optional: a parameter the model never reads in this role (the reader's
      pooler); zeros when absent instead of a "missing" error.
  """

  names: tuple[str, ...]
  transform: Transform = identity
  optional: bool = False


class CheckpointMismatchError(ValueError):
  """The checkpoint does not match the model: missing/unexpected/shape."""

  def __init__(self, path: str, missing: Sequence[str],
               unexpected: Sequence[str], wrong_shape: Sequence[str]):
    self.missing, self.unexpected = list(missing), list(unexpected)
    self.wrong_shape = list(wrong_shape)

    def block(title, items):
      if not items:
        return ""
      shown = "\n    ".join(items[:50])
      more = f"\n    ... and {len(items) - 50} more" if len(items) > 50 else ""
      return f"\n  {title} ({len(items)}):\n    {shown}{more}"

    super().__init__(
        f"Checkpoint {path} does not match the model."
        + block("missing from the checkpoint", self.missing)
        + block("unexpected in the checkpoint", self.unexpected)
        + block("wrong shape", self.wrong_shape)
        + "\n  Check that the model config (sizes, heads, projection, "
        "heads present) matches the checkpoint, or pass ignore patterns / "
        "strict=False for variables you knowingly leave out.")


class Source:
  """Read-only named arrays from a checkpoint file."""

  path: str

  def shapes(self) -> dict[str, tuple[int, ...]]:
    raise NotImplementedError

  def get(self, name: str) -> np.ndarray:
    raise NotImplementedError

  def __contains__(self, name: str) -> bool:
    return name in self.shapes()


class TFCheckpointSource(Source):
  """A TensorFlow checkpoint (`model.ckpt-N` prefix, or a directory)."""

  def __init__(self, path: str):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    resolved = path
    if tf.io.gfile.isdir(path):
      resolved = tf.train.latest_checkpoint(path)
      if resolved is None:
        raise FileNotFoundError(
            f"{path} is a directory without a TensorFlow `checkpoint` index "
            "file; pass the checkpoint prefix (e.g. .../model.ckpt-100000).")
    try:
      self._reader = tf.train.load_checkpoint(resolved)
    except Exception as e:  # TF raises several types for unreadable files.
      raise FileNotFoundError(
          f"Cannot read a TensorFlow checkpoint at {path}: {e}") from e
    self.path = resolved
    self._shapes = {k: tuple(v) for k, v in
                    self._reader.get_variable_to_shape_map().items()}

  def shapes(self):
    return self._shapes

  def get(self, name):
    return np.asarray(self._reader.get_tensor(name))


class SafetensorsSource(Source):
  """A safetensors file, read lazily tensor by tensor (no torch needed)."""

  def __init__(self, path: str):
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    if not os.path.exists(path):
      raise FileNotFoundError(f"No safetensors file at {path}.")
    try:
      self._file = safe_open(path, framework="numpy")
    except Exception as e:
      raise ValueError(f"{path} is not a readable safetensors file: {e}") from e
    self.path = path
    self._shapes = {k: tuple(self._file.get_slice(k).get_shape())
                    for k in self._file.keys()}

  def shapes(self):
    return self._shapes

  def get(self, name):
    return self._file.get_tensor(name)


def flatten(tree: Mapping[str, Any], prefix: Path = ()) -> dict[Path, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(flatten(value, prefix + (str(key),)))
    else:
      out[prefix + (str(key),)] = value
  return out


def unflatten(flat: Mapping[Path, Any]) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


# Variables a checkpoint may carry that no realm_jax model ever uses.
ALWAYS_IGNORED = (
    r"(^|.*/)global_step$",
    r".*/adam_[mv]$", r".*/Adam(_1)?$", r".*/Momentum$",  # Optimizer slots.
    r"^_CHECKPOINTABLE_OBJECT_GRAPH$",
    r"(^|.*\.)position_ids$",  # Hugging Face buffer.
)


def load(
    source: Source,
    expected: Mapping[str, Any],
    rules: Mapping[Path, Rule],
    *,
    ignore: Iterable[str] = (),
    strict: bool = True,
) -> dict[str, Any]:
  """Loads the parameters `expected` describes from `source`.

  Args:
    source: the checkpoint.
    expected: parameter tree whose leaves have `.shape` (arrays or
      `jax.ShapeDtypeStruct`); it fixes which leaves must be loaded.
    rules: one Rule per leaf path of `expected`.
    ignore: regexes of source names that may stay unused (other heads, the
      other tower, ...), on top of ALWAYS_IGNORED.
    strict: raise on any mismatch (default); with False, leaves that cannot
      be loaded are left out of the result and unused names are allowed.

  Returns:
    A tree like `expected` with float32 numpy arrays (with strict=False, only
    the leaves that were found).

  Raises:
    CheckpointMismatchError: listing missing, unexpected and wrongly shaped
      names (strict mode); wrong shapes always raise.
  """
  shapes = source.shapes()
  patterns = [re.compile(p) for p in (*ALWAYS_IGNORED, *ignore)]
  used: set[str] = set()
  missing, wrong_shape = [], []
  loaded: dict[Path, np.ndarray] = {}
  for path, leaf in flatten(expected).items():
    rule = rules.get(path)
    if rule is None:
      raise KeyError(f"No import rule for parameter {'/'.join(path)}; this "
                     "is a bug in realm_jax's name mapping.")
    name = next((n for n in rule.names if n in shapes), None)
    if name is None and rule.optional:
      loaded[path] = np.zeros(leaf.shape, np.float32)
      continue
    if name is None:
      missing.append(f"{rule.names[0]}  (for {'/'.join(path)})")
      continue
    used.add(name)
    array = rule.transform(source.get(name))
    if tuple(array.shape) != tuple(leaf.shape):
      wrong_shape.append(f"{name}: checkpoint {tuple(array.shape)} vs model "
                         f"{tuple(leaf.shape)} (for {'/'.join(path)})")
      continue
    loaded[path] = np.asarray(array, np.float32)
  unexpected = sorted(
      n for n in shapes
      if n not in used and not any(p.fullmatch(n) for p in patterns))
  if wrong_shape or (strict and (missing or unexpected)):
    raise CheckpointMismatchError(source.path, missing,
                                  unexpected if strict else [], wrong_shape)
  return unflatten(loaded)


def write_tf_checkpoint(prefix: str, arrays: Mapping[str, np.ndarray]) -> str:
  """Writes arrays as a TF (V2) checkpoint with exactly these variable names.

  Useful to convert weights for TF tools and to test the importers with the
  released checkpoints' names.

  Returns:
    The checkpoint prefix, readable with `tf.train.load_checkpoint`.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  names = sorted(arrays)
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  tf.raw_ops.SaveV2(
      prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
      tensors=[tf.constant(np.asarray(arrays[n])) for n in names])
  return prefix

"""NNX modules used functionally: parameters are plain nested dicts.

`nnx.split` happens once, when a model is created; step functions take the
parameter dict and rebuild the module with `bind` inside the traced function
(a trace-time cost only). Plain dicts are what orbax saves, what the
checkpoint importers produce and what the index builder receives for the
retriever's subtree.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
from flax import nnx

M = TypeVar("M", bound=nnx.Module)
Params = dict[str, Any]


def _check_only_params(module: nnx.Module) -> None:
  _, _, rest = nnx.split(module, nnx.Param, ...)
  if jax.tree_util.tree_leaves(nnx.to_pure_dict(rest)):
    raise TypeError(f"{type(module).__name__} holds non-parameter state; "
                    "realm_jax modules must keep only nnx.Param variables.")


def init(make_module: Callable[[nnx.Rngs], M],
         seed: int | jax.Array = 0) -> tuple[nnx.GraphDef[M], Params]:
  """`(graphdef, params)` of `make_module(nnx.Rngs(seed))`; params is a
  nested dict of float32 arrays."""
  module = make_module(nnx.Rngs(seed))
  _check_only_params(module)
  graphdef, state = nnx.split(module, nnx.Param)
  return graphdef, nnx.to_pure_dict(state)


def abstract_init(
    make_module: Callable[[nnx.Rngs], M]
) -> tuple[nnx.GraphDef[M], Params]:
  """Like `init` but with `jax.ShapeDtypeStruct` leaves and no computation."""
  module = nnx.eval_shape(lambda: make_module(nnx.Rngs(0)))
  graphdef, state = nnx.split(module, nnx.Param)
  return graphdef, nnx.to_pure_dict(state)


def bind(graphdef: nnx.GraphDef[M], params: Params) -> M:
  """Rebuilds the module from its graph definition and a parameter dict."""
  return nnx.merge(graphdef, nnx.State(params))

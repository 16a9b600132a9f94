"""realm_jax: REALM (retrieval-augmented language model pre-training) in
JAX/Flax."""

__version__ = "0.1.0"

# Library INFO/WARNING records (orbax, JAX, Beam, TensorFlow) stay hidden
# unless a job runs with --verbosity=1 (realm_jax/core/logs.py).
from realm_jax.core import logs as _logs  # pylint: disable=wrong-import-position

_logs.quiet_libraries()


def __getattr__(name):
  """`realm_jax.load` and `realm_jax.config_of`, imported on first use
  (they pull JAX, TensorFlow and the model in)."""
  if name in ("load", "config_of"):
    from realm_jax import api  # pylint: disable=g-import-not-at-top
    return getattr(api, name)
  raise AttributeError(f"module 'realm_jax' has no attribute {name!r}")

"""The base layer: io, multi-host helpers, meshes, checkpoints, leases.

Everything else in realm_jax may import it; it imports nothing of realm_jax
above it.
"""

"""realm_jax: REALM retrieval-augmented pre-training in JAX/Flax.

The metadata is in pyproject.toml. This file only maps the repository's
top-level gin_configs/ into the package (realm_jax/gin_configs in a wheel),
so that an installed realm_jax finds its gin files.
"""

import setuptools

setuptools.setup(
    packages=setuptools.find_packages(include=["realm_jax", "realm_jax.*"])
    + ["realm_jax.gin_configs"],
    package_dir={"realm_jax.gin_configs": "gin_configs"},
    package_data={
        "realm_jax.gin_configs": ["*/*.gin", "*/*/*.gin"],
        # Read at run time: the demo's QA set, the BERT vocabulary.
        "realm_jax.data.demo_qa": ["*.jsonl"],
        "realm_jax.data": ["vocab/*.txt"],
    },
)

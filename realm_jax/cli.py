"""Console scripts (pyproject.toml): `realm-pretrain ARGS` runs
`python -m realm_jax.training.pretrain ARGS`, and so on for every job.
`--help` exits 0 in each (`gin_cli.define_help_flags`), the demo's too."""

from __future__ import annotations

import runpy

# pyproject.toml's `realm_jax.cli:<name>` -> the module it runs.
SCRIPTS = {
    "demo": "realm_jax.demo",
    "corpus": "realm_jax.data.corpus_job",
    "annotate": "realm_jax.data.annotate_job",
    "query_cache": "realm_jax.data.query_cache",
    "ict": "realm_jax.training.ict",
    "reader_prep": "realm_jax.training.reader_prep",
    "pretrain": "realm_jax.training.pretrain",
    "finetune": "realm_jax.training.finetune",
    "index_builder": "realm_jax.index.builder",
    "index_extend": "realm_jax.index.extend_job",
    "qa_eval": "realm_jax.eval.qa_eval",
    "calibrate": "realm_jax.eval.calibrate",
    "ask": "realm_jax.ask",
    "export": "realm_jax.export",
    "aot": "realm_jax.aot",
}


def _entry(module: str):
  def run() -> None:
    from realm_jax import gin_cli  # pylint: disable=g-import-not-at-top
    gin_cli.define_help_flags()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  run.__doc__ = f"`python -m {module}`."
  return run


# The entry points: `demo = _entry("realm_jax.demo")`, and so on.
globals().update({name: _entry(module) for name, module in SCRIPTS.items()})

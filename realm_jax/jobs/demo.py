"""`realm-demo`: REALM end to end on the embedded Wikipedia slice
(`realm_jax.demo`, which says what it runs)."""

from typing import Sequence

from realm_jax import demo  # First: it sets the XLA flags before JAX starts.
from realm_jax import gin_cli

__doc__ = demo.__doc__  # What --help says: the stages and the usage line.


def _run(argv: Sequence[str]) -> None:
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  gin_cli.platform_when_unset()
  from realm_jax.core import logs  # pylint: disable=g-import-not-at-top
  logs.quiet_libraries(f.verbosity)
  if not f["verbosity"].present:
    # The demo reports each stage and step as JSON; the jobs' own INFO
    # lines come back with --verbosity=0 (and the libraries' with 1).
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    absl_logging.set_verbosity(absl_logging.WARNING)
  config = demo.DemoConfig(workdir=f.workdir, num_documents=f.num_documents,
                           train_steps=f.train_steps,
                           finetune_steps=f.finetune_steps)
  if f.dry_run:
    for stage in demo.stages(config):
      task, model, operative = demo.stage_configs(config, stage)
      print(f"# ---- {stage} ----\n{operative}\n{task}\n{model}\n")
    return
  demo.run_demo(config)


def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", demo.DemoConfig.workdir, "Where outputs go.")
  flags.DEFINE_integer("num_documents", demo.DemoConfig.num_documents,
                       "Wikipedia articles in the demo corpus.")
  flags.DEFINE_integer("train_steps", None, "REALM pre-training steps "
                       f"(default: {demo.PRETRAIN_GIN}'s).")
  flags.DEFINE_integer("finetune_steps", None, "Open-QA fine-tuning steps "
                       f"(default: {demo.FINETUNE_GIN}'s).")
  flags.DEFINE_bool("dry_run", False, "Print the stages' resolved configs "
                    "and exit.")
  gin_cli.define_help_flags()  # --help exits 0
  app.run(_run)


if __name__ == "__main__":
  main()

"""The jobs: one module per console script (pyproject.toml), named as the
script (`realm-index-builder` runs `realm_jax.jobs.index_builder` as
`__main__`), each only its command line (flags, `gin_cli.run`) over the
library. This directory is the job list: `realm_jax.cli.SCRIPTS` reads it
(docs/design.md, "Jobs")."""

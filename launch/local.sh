#!/usr/bin/env bash
# REALM pre-training on one machine: the trainer and the index builder as two
# processes sharing a workdir (the builder polls the trainer's checkpoints,
# the trainer swaps in each index the builder publishes).
#
# Usage:
#   launch/local.sh WORKDIR BLOCK_STORE ANNOTATED [MODEL_GIN] [-- GIN_BINDING...]
#   DRY_RUN=1 launch/local.sh ...     # print the two commands only
#
# MODEL_GIN defaults to models/tiny.gin (any file under gin_configs/ or a
# path). Extra arguments after `--` are gin bindings for the trainer, e.g.
#   launch/local.sh /tmp/run /tmp/blocks '/tmp/ann/*.tfr.gz' \
#       models/minilm_l6.gin -- "INIT_FROM='minilm'" \
#       "pretrain.PretrainConfig.num_train_steps=1000"
# Logs: WORKDIR/logs/{trainer,builder}.log. Ctrl-C stops both.
set -euo pipefail

if [ $# -lt 3 ]; then
  sed -n '2,16p' "$0"
  exit 2
fi
workdir=$1 block_store=$2 annotated=$3
shift 3
model_gin=models/tiny.gin
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  model_gin=$1
  shift
fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
python=${PYTHON:-python}

trainer=("$python" -m realm_jax.training.pretrain
  "--gin_file=$model_gin" --gin_file=runs/pretrain.gin
  "--gin.WORKDIR='$workdir'" "--gin.BLOCK_STORE='$block_store'"
  "--gin.ANNOTATED='$annotated'"
  "--gin.pretrain.PretrainConfig.index_mode='builder'")
for binding in "$@"; do
  trainer+=("--gin_bindings=$binding")
done
builder=("$python" -m realm_jax.index.builder
  "--workdir=$workdir" "--block_store=$block_store"
  "--gin_file=$model_gin" --gin_file=runs/index_builder.gin)

if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${builder[@]}"; echo '&'
  printf '%q ' "${trainer[@]}"; echo
  exit 0
fi

mkdir -p "$workdir/logs"
"${builder[@]}" > "$workdir/logs/builder.log" 2>&1 &
builder_pid=$!
trap 'kill $builder_pid 2>/dev/null || true' EXIT INT TERM
echo "index builder: pid $builder_pid, log $workdir/logs/builder.log"
echo "trainer: log $workdir/logs/trainer.log"
"${trainer[@]}" 2>&1 | tee "$workdir/logs/trainer.log"
# The trainer wrote its DONE marker; the builder finishes its last index.
wait "$builder_pid"

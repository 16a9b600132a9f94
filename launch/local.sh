#!/usr/bin/env bash
# REALM pre-training on one machine: the trainer and the index builder as two
# processes sharing a workdir (the builder polls the trainer's checkpoints,
# the trainer swaps in each index the builder publishes).
#
# Usage:
#   launch/local.sh WORKDIR BLOCK_STORE QUERIES [MODEL_GIN] [-- GIN_BINDING...]
#   DRY_RUN=1 launch/local.sh ...     # print the two commands only
#
# MODEL_GIN defaults to models/tiny.gin (any file under gin_configs/ or a
# path). QUERIES is a query cache (python -m realm_jax.jobs.query_cache).
# Extra arguments after `--` are gin bindings for the trainer, e.g.
#   launch/local.sh /tmp/run /tmp/blocks /tmp/queries \
#       models/minilm_l6.gin -- "INIT_FROM='minilm'" \
#       "pretrain.PretrainConfig.num_train_steps=1000"
# Logs: WORKDIR/logs/{trainer,builder}.log. SIGTERM or Ctrl-C stops both
# cleanly (the trainer checkpoints, the builder indexes that checkpoint);
# if either dies, the other is stopped and its status is the launcher's.
set -euo pipefail

if [ $# -lt 3 ]; then
  sed -n '2,19p' "$0"
  exit 2
fi
workdir=$1 block_store=$2 queries=$3
shift 3
model_gin=models/tiny.gin
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  model_gin=$1
  shift
fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
python=${PYTHON:-python}

trainer=("$python" -m realm_jax.jobs.pretrain
  "--gin_file=$model_gin" --gin_file=runs/pretrain.gin
  "--gin.WORKDIR='$workdir'" "--gin.BLOCK_STORE='$block_store'"
  "--gin.QUERIES='$queries'"
  "--gin.pretrain.PretrainConfig.index_mode='builder'")
for binding in "$@"; do
  trainer+=("--gin_bindings=$binding")
done
builder=("$python" -m realm_jax.jobs.index_builder
  "--gin_file=$model_gin" --gin_file=runs/index_builder.gin
  "--gin.WORKDIR='$workdir'" "--gin.BLOCK_STORE='$block_store'")

if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${builder[@]}"; echo '&'
  printf '%q ' "${trainer[@]}"; echo
  exit 0
fi

mkdir -p "$workdir/logs"
"${builder[@]}" > "$workdir/logs/builder.log" 2>&1 &
builder_pid=$!
"${trainer[@]}" > >(tee "$workdir/logs/trainer.log") 2>&1 &
trainer_pid=$!
echo "index builder: pid $builder_pid, log $workdir/logs/builder.log"
echo "trainer: pid $trainer_pid, log $workdir/logs/trainer.log"

# SIGTERM or Ctrl-C: the trainer checkpoints and exits, then the builder
# publishes that last checkpoint and exits. A child that dies ends the run:
# the other one is stopped the same way, and the launcher exits with the
# status of the first child that failed (else 0).
stop_trainer() {
  echo "launcher: stopping the trainer (it checkpoints first)" >&2
  kill -TERM "$trainer_pid" 2>/dev/null || true
}
trap stop_trainer TERM INT
alive() { kill -0 "$1" 2>/dev/null; }
while alive "$trainer_pid" && alive "$builder_pid"; do
  wait -n "$trainer_pid" "$builder_pid" || true  # a trap also wakes it
done
trap '' TERM INT
if alive "$trainer_pid"; then   # The builder exited first.
  wait "$builder_pid" && status=0 || status=$?
  if [ "$status" -eq 0 ] && [ -f "$workdir/checkpoints/DONE" ]; then
    # It saw the run DONE (its lease released) and indexed the last
    # checkpoint: the trainer is only exiting. Its status is the run's.
    wait "$trainer_pid" && status=0 || status=$?
    exit "$status"
  fi
  echo "launcher: the index builder exited with status $status;" \
       "stopping the trainer" >&2
  kill -TERM "$trainer_pid" 2>/dev/null || true
  wait "$trainer_pid" || true
  [ "$status" -ne 0 ] || status=1  # The run is incomplete either way.
  exit "$status"
fi
wait "$trainer_pid" && status=0 || status=$?
# The trainer is gone (done, stopped or failed): the builder indexes the
# last checkpoint it has not indexed yet, then exits. A finished run's
# builder sees DONE and exits by itself: a SIGTERM then could land while it
# exits (its handlers already restored) and kill it (status 143), so it is
# sent only if the builder is not done within BUILDER_FINISH_SECONDS.
if [ "$status" -eq 0 ] && [ -f "$workdir/checkpoints/DONE" ]; then
  trap 'kill -TERM "$builder_pid" 2>/dev/null || true' TERM INT
  waited=0
  while alive "$builder_pid" &&
      [ "$waited" -lt "${BUILDER_FINISH_SECONDS:-1800}" ]; do
    sleep 1
    waited=$((waited + 1))
  done
  trap '' TERM INT
fi
kill -TERM "$builder_pid" 2>/dev/null || true
wait "$builder_pid" && builder_status=0 || builder_status=$?
# The newest checkpoint step, and the step of the published index.
newest=$(ls "$workdir/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' |
         sort -n | tail -n 1 || true)
# (LATEST names `<step>` or a re-publication `<step>.<n>`.)
latest=$(cut -d. -f1 2>/dev/null < "$workdir/index/LATEST" | tr -cd '0-9' ||
         true)
if [ "$status" -eq 0 ] && [ "$builder_status" -ne 0 ] &&
    [ -n "$newest" ] && [ "$latest" = "$newest" ]; then
  # Stopped while exiting, after its work was done: the run is complete.
  echo "launcher: the index builder exited with status $builder_status" \
       "after publishing the last checkpoint's index ($latest)" >&2
  builder_status=0
fi
[ "$status" -ne 0 ] || status=$builder_status
exit "$status"

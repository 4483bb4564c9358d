#!/usr/bin/env bash
# The foundation issue's GPU checks in one command: the default run and moe_1b in bf16
# (eager and compiled). Records land in benchmarks/results/<gpu>-<date>/; where $OUT is set
# (the lent machine) they are packed into $OUT/runs.tgz after every run. Needs a CUDA GPU
# and hydra-core + omegaconf (see _gpu_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/_gpu_env.sh
export PACK=${PACK:-runs}
run() {  # name, overrides...
  local name=$1; shift
  "$PY" -m moe_exp.run logger=none hydra.run.dir="$res/$name" "$@" 2>&1 | tee "$res/$name.log" \
    || echo "== $name failed"
  pack
}
run default "$@"
run moe_1b_bf16 model=moe_1b precision=bf16 train.micro_batch_size=4 "$@"
run moe_1b_bf16_compile model=moe_1b precision=bf16 train.micro_batch_size=4 \
  train.compile=default "$@"
echo "records: $res/*/metrics.json"

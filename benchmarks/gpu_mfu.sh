#!/usr/bin/env bash
# MFU of `model=moe_1b precision=bf16` on one GPU with the best settings, in one command:
#
#   bash benchmarks/gpu_mfu.sh [extra overrides ...]
#   MFU_RUNS="mbs8_eager mbs16_compile" bash benchmarks/gpu_mfu.sh   # some of the runs
#
# Runs moe_1b in bf16 with grouped_mm dispatch, eager and torch.compile'd, over micro-batch
# sizes (an OOM is a row, not a stop), writes every record under
# benchmarks/results/<gpu>-<date>/mfu/<run>/metrics.json and prints a table with the best
# MFU. MFU = analytic model FLOPs/s / the dense bf16 peak of the hardware profile
# (H100/H200 SXM: 989e12); the FLOPs agree with FlopCounterMode (moe_exp.flop_check).
#
# Needs a CUDA GPU, torch >= 2.11, and hydra-core + omegaconf (+ antlr4-python3-runtime).
# Where they are missing (the lent H100/H200 image has neither), put them in .whl/ first:
#   python3 -m pip wheel --no-deps -w .whl hydra-core==1.3.8 omegaconf==2.3.1 \
#       antlr4-python3-runtime==4.9.3      # (pip wheel builds antlr4's: it is an sdist)
# and _gpu_env.sh installs them into /tmp/site. W&B is not needed (logger=none). Where $OUT
# is set (the lent machine), the records are packed into $OUT/$PACK.tgz after every run.
set -euo pipefail
cd "$(dirname "$0")/.."
# MFU_RUNS picks some of the runs (the lent GPU allows 10 minutes a command: split them
# over calls, e.g. MFU_RUNS="mbs8_eager mbs4_compile" then MFU_RUNS="mbs8_compile
# mbs16_compile"); the table at the end reads every record of the day's dir on this machine.
RUNS=${MFU_RUNS:-mbs8_eager mbs4_compile mbs8_compile mbs16_compile}
for name in $RUNS; do  # all checked before the first run
  if ! [[ $name =~ ^mbs[0-9]+_(eager|compile)$ ]]; then
    echo "error: MFU_RUNS: '$name' is not mbs<N>_eager or mbs<N>_compile" >&2
    exit 2
  fi
done
export PACK=${PACK:-mfu}
source benchmarks/_gpu_env.sh
out=$res/mfu
mkdir -p "$out"
common=(logger=none model=moe_1b precision=bf16 model.dispatch=grouped
        train.steps=30 train.warmup_steps=5)

run() {  # name, overrides... (the whole output in <name>.log; a failure is a row)
  local name=$1; shift
  echo "== $name"
  "$PY" -m moe_exp.run "${common[@]}" "$@" hydra.run.dir="$out/$name" "${EXTRA[@]}" \
    2>&1 | tee "$out/$name.log" | grep -iE "tokens/s|step time|breakdown|MFU|peak memory|error" \
    || true
  pack
}
EXTRA=("$@")
# runs with extra overrides get their own dirs: model.routing=balanced -> mbs8_eager-model.routing-balanced
tag=$( ((${#EXTRA[@]})) && printf -- '-%s' "${EXTRA[@]}" | tr -c 'A-Za-z0-9_.\n-' '-' || true)

for name in $RUNS; do
  mbs=${name#mbs}; mbs=${mbs%%_*}
  mode=$([[ $name == *_eager ]] && echo off || echo default)
  run "$name$tag" "train.micro_batch_size=$mbs" "train.compile=$mode"
done

"$PY" benchmarks/mfu_table.py "$out"

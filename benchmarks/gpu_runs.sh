#!/usr/bin/env bash
# The foundation issue's GPU checks in one command: the default run and moe_1b in bf16.
# Records land in benchmarks/results/<device>-<date>/; commit them with the device name.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
  'error: no CUDA GPU visible (these are the GPU figures)')"
dev=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
out=benchmarks/results/${dev}-$(date +%Y-%m-%d)
mkdir -p "$out"
"$PY" -m moe_exp.run logger=none hydra.run.dir="$out/default" "$@"
"$PY" -m moe_exp.run logger=none model=moe_1b precision=bf16 train.micro_batch_size=4 \
  hydra.run.dir="$out/moe_1b_bf16" "$@"
"$PY" -m moe_exp.run logger=none model=moe_1b precision=bf16 train.micro_batch_size=4 \
  train.compile=default hydra.run.dir="$out/moe_1b_bf16_compile" "$@"
echo "records: $out/*/metrics.json"

#!/usr/bin/env bash
# Every GPU figure of issue 5 in one command (goals 1, 2, 4), records under
# benchmarks/results/<gpu>-<date>/:
#   moe_layer.json    MoE layer fwd+bwd: grouped_mm vs the naive loop (tiny, small, moe_1b)
#   compile_step.json whole train step, compiled vs eager (tiny_moe, small_moe, moe_1b)
#   optimizer_step.json AdamW vs Muon step (small_moe, moe_1b)
#   row_moves.json    the dispatch's row moves: autograd indexing vs gather_rows
#   mfu/              moe_1b bf16 MFU (benchmarks/gpu_mfu.sh)
# Same requirements as gpu_mfu.sh (hydra-core/omegaconf wheels in .whl/ where missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
  'error: no CUDA GPU visible (these are the GPU figures)')"
if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null && compgen -G ".whl/*" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --target /tmp/site .whl/*
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
dev=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
out=benchmarks/results/${dev}-$(date +%Y-%m-%d)
mkdir -p "$out"
"$PY" benchmarks/moe_layer.py --json "$out/moe_layer.json"
"$PY" benchmarks/compile_step.py --json "$out/compile_step.json"
"$PY" benchmarks/optimizer_step.py --json "$out/optimizer_step.json"
"$PY" benchmarks/row_moves.py --json "$out/row_moves.json"
bash benchmarks/gpu_mfu.sh "$@"

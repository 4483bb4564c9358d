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
# (H100/H200 SXM: 989e12); the FLOPs agree with FlopCounterMode (moe_exp.bench.flop_check).
#
# Needs a CUDA GPU, torch >= 2.11, and hydra-core + omegaconf (+ antlr4-python3-runtime).
# Where they are missing (the lent H100/H200 image has neither), put them in .whl/ first:
#   python3 -m pip download --no-deps -d .whl hydra-core==1.3.2 omegaconf==2.3.0 \
#       antlr4-python3-runtime==4.9.3      # antlr4 4.9.3 is an sdist: no --only-binary
# and this script installs them into /tmp/site. W&B is not needed (logger=none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  if compgen -G ".whl/*" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --target /tmp/site .whl/*
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "error: hydra-core and omegaconf are not installed and .whl/ is empty (see the" \
         "header of $0)" >&2
    exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')"

dev=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
out=benchmarks/results/${dev}-$(date +%Y-%m-%d)/mfu
mkdir -p "$out"
common=(logger=none model=moe_1b precision=bf16 model.dispatch=grouped
        train.steps=30 train.warmup_steps=5)

run() {  # name, overrides...
  local name=$1; shift
  echo "== $name"
  "$PY" -m moe_exp.run "${common[@]}" "$@" hydra.run.dir="$out/$name" "${EXTRA[@]}" \
    2>&1 | grep -E "tokens/s|step time|breakdown|MFU|peak memory|error" || true
}
EXTRA=("$@")

# MFU_RUNS picks some of the runs (the lent GPU allows 10 minutes a command: split them
# over calls, e.g. MFU_RUNS="mbs8_eager mbs4_compile" then MFU_RUNS="mbs8_compile
# mbs16_compile"); the table below reads every record of the day's dir.
RUNS=${MFU_RUNS:-mbs8_eager mbs4_compile mbs8_compile mbs16_compile}
for name in $RUNS; do  # all checked before the first run
  if ! [[ $name =~ ^mbs[0-9]+_(eager|compile)$ ]]; then
    echo "error: MFU_RUNS: '$name' is not mbs<N>_eager or mbs<N>_compile" >&2
    exit 2
  fi
done
for name in $RUNS; do
  mbs=${name#mbs}; mbs=${mbs%%_*}
  mode=$([[ $name == *_eager ]] && echo off || echo default)
  run "$name" "train.micro_batch_size=$mbs" "train.compile=$mode"
done

"$PY" - "$out" <<'EOF'
import json, sys
from pathlib import Path

rows = []
for f in sorted(Path(sys.argv[1]).glob("*/metrics.json")):
    r = json.loads(f.read_text())
    rows.append((f.parent.name, r))
print(f"\n{'run':18} {'status':8} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
      f"{'peak GiB':>9} {'data %':>7}")
for name, r in rows:
    ok = r["status"] == "ok"
    f = lambda k, fmt: format(r[k], fmt) if ok and r.get(k) is not None else "—"  # noqa: E731
    mfu = f"{100 * r['mfu']:.1f}%" if ok and r.get("mfu") is not None else "—"
    share = f"{100 * r['data_share']:.2f}" if ok and r.get("data_share") is not None else "—"
    print(f"{name:18} {r['status']:8} {f('step_time_ms', '.1f'):>9} "
          f"{f('tokens_per_s', ',.0f'):>10} {f('tflops_per_device', '.1f'):>8} {mfu:>6} "
          f"{f('peak_mem_gib', '.1f'):>9} {share:>7}")
best = max((r for _, r in rows if r["status"] == "ok" and r.get("mfu") is not None),
           key=lambda r: r["mfu"], default=None)
if best:
    print(f"\nbest MFU {100 * best['mfu']:.1f}% (goal >= 50%): micro_batch_size="
          f"{best['micro_batch_size']} compile={best['compile']} on {best['device_name']}, "
          f"torch {best['torch_version']}")
print(f"records: {sys.argv[1]}/*/metrics.json")
EOF

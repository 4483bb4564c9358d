#!/usr/bin/env bash
# Every GPU figure of issue 5 (goals 1, 2, 4), by stage: each stage fits one 10-minute
# call of the lent machine, and they run in the order given (default: all, in this order):
#
#   bash benchmarks/gpu_bench.sh [STAGE ...]
#
#   check    the gpu tests (tests/test_gpu.py; the grouped dispatch's first)  74 s
#   layer    moe_layer.py: grouped_mm vs the naive loop (goal 1), then at moe_1b with a
#            skewed router (--skew 2)                                         70 s
#   mfu      gpu_mfu.sh: moe_1b bf16 MFU (goal 4; MFU_RUNS picks runs)   40-80 s a run
#   compile  compile_step.py: whole step compiled vs eager (goal 2)          67 s
#   optim    optimizer_step.py (AdamW vs Muon), row_moves.py                 24 s
#   det      ab_runs.py: hardware.deterministic's cost at moe_1b             46 s
#   attention  attention.py at moe_1b bf16 (flash, efficient, cudnn, math, flex, auto),
#            then ab_runs.py: hardware.cudnn_benchmark off vs on (seed 002)   79 s
#   tune     task=tune_batch at moe_1b bf16, checkpointing none and full (H100: 121 s)
#   plan     task=calibrate (its calibration.json is what hardware.calibration ships),
#            then plan_rows.py --rows gpu: issue 50's rows, each planned with it
#
# (times measured on an H200, 2026-11-26, tune on an H100; the machine's start adds a
# minute or two.) Each stage's JSON is written after every row and its printout goes to <stage>.txt beside it
# (mfu: mfu-<MFU_RUNS>.txt), all under benchmarks/results/<gpu>-<date>/. A failing stage
# does not stop the next; the exit code says whether any failed. Where $OUT is set (the
# lent machine), the results dir is packed into $OUT/results-<stages>.tgz after every stage
# and every minute. Needs a CUDA GPU and hydra-core + omegaconf (see _gpu_env.sh).
# Pass GIT_SHA=<commit> (the device's copy has no .git): it goes into provenance-<pack>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=(check layer mfu compile optim det attention tune plan)
for s in "$@"; do  # all checked before any work
  [[ " ${STAGES[*]} " == *" $s "* ]] || {
    echo "error: stage '$s' is not one of: ${STAGES[*]}" >&2; exit 2; }
done
(($#)) || set -- "${STAGES[@]}"
# (gpu_mfu.sh packs into the same file; a split mfu stage's calls get different names, and
# so do their printouts and provenance: each call's pack holds that call's files only)
mfu=$([[ " $* " == *" mfu "* && -n ${MFU_RUNS:-} ]] && echo "-${MFU_RUNS//[^A-Za-z0-9_]/-}")
export PACK=results-$(IFS=-; echo "$*")$mfu
set -e
source benchmarks/_gpu_env.sh
set +e

stage() {  # NAME: the stage's commands
  case $1 in
    check) "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py ;;
    layer) "$PY" benchmarks/moe_layer.py --json "$res/moe_layer.json" &&
           "$PY" benchmarks/moe_layer.py --shapes 1b --skew 2 --json "$res/moe_layer_skew2.json" ;;
    mfu) bash benchmarks/gpu_mfu.sh ;;
    compile) "$PY" benchmarks/compile_step.py --json "$res/compile_step.json" ;;
    optim) "$PY" benchmarks/optimizer_step.py --json "$res/optimizer_step.json" &&
           "$PY" benchmarks/row_moves.py --json "$res/row_moves.json" ;;
    det) "$PY" benchmarks/ab_runs.py --rounds 2 --variant "off:" \
           --variant "det:hardware.deterministic=true" --json "$res/deterministic.json" -- \
           logger=none model=moe_1b precision=bf16 train.micro_batch_size=4 \
           train.steps=20 train.warmup_steps=3 ;;
    attention) "$PY" benchmarks/attention.py --dtype bf16 --json "$res/attention.json" \
           --kernels auto,flash,efficient,cudnn,math,flex model=moe_1b train.seq_len=2048 \
           train.micro_batch_size=2 &&
         "$PY" benchmarks/ab_runs.py --rounds 2 --variant "off:hardware.cudnn_benchmark=false" \
           --variant "on:hardware.cudnn_benchmark=true" --json "$res/cudnn_benchmark.json" -- \
           logger=none model=moe_1b precision=bf16 train.micro_batch_size=4 \
           train.steps=20 train.warmup_steps=3 ;;
    tune) "$PY" -m moe_exp.run -m task=tune_batch tune.goal=largest logger=none model=moe_1b \
           precision=bf16 train.steps=3 train.warmup_steps=2 tune.multiple=8 \
           tune.max_micro_batch=256 train.activation_checkpointing=none,full hydra.sweep.dir="$res/tune_batch_moe_1b" ;;
    plan) "$PY" -m moe_exp.run task=calibrate logger=none hydra.run.dir="$res/calibrate" &&
          "$PY" benchmarks/plan_rows.py --rows gpu --steps 6 --only "${PLAN_ROWS:-0,4,5,6,7,1,3,2}" \
            --calibration "$res/calibrate/calibration.json" --json "$res/plan_rows.json" ;;
  esac
}

if [[ -n ${OUT:-} ]]; then  # and every minute: a stage cut off at the call's limit keeps
  ( while sleep 60; do pack >/dev/null; done ) 2>/dev/null &  # what it has written (its
  packer=$!  # errors, and the "Terminated" of its sleep when stopped, left out)
  trap 'pkill -P $packer 2>/dev/null; kill $packer 2>/dev/null; rm -f "$OUT"/part-*.tmp' EXIT
fi
failed=()
for s in "$@"; do
  echo "== $s ($(date +%T))"
  stage "$s" 2>&1 | tee "$res/$s$([[ $s == mfu ]] && echo "$mfu").txt"
  rc=${PIPESTATUS[0]}
  ((rc == 0)) || { failed+=("$s"); echo "== $s failed (exit $rc)"; }
  pack
done
((${#failed[@]} == 0)) || { echo "failed stages: ${failed[*]}" >&2; exit 1; }

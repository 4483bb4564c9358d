# Sourced by the GPU scripts (gpu_bench.sh, gpu_mfu.sh) from the repo root. Sets PY, puts
# hydra-core / omegaconf on the path (installed from .whl/ into /tmp/site where missing: the
# lent H100/H200 image has neither, and .whl/ is git-ignored, so a device call must name it
# in `carry`), checks for a CUDA GPU, and sets res=benchmarks/results/<gpu>-<date>.
# pack: where $OUT is set (the lent machine's return folder), the day's results go there as
# $OUT/$PACK.tgz (that folder comes back; the machine's disk does not).
PY=${PYTHON:-python3}
[[ -d /tmp/site/hydra ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  if compgen -G ".whl/*" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "error: hydra-core and omegaconf are not installed and .whl/ is empty: download" \
         "their wheels into .whl/ (python3 -m pip wheel --no-deps -w .whl hydra-core==1.3.8" \
         "omegaconf==2.3.1 antlr4-python3-runtime==4.9.3: pip wheel builds antlr4's, which" \
         "is a source archive only) and carry .whl" >&2
    exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
  'error: no CUDA GPU visible (these are the GPU figures)')"
res=benchmarks/results/$("$PY" -c "import torch; print(torch.cuda.get_device_name(0)\
.replace(' ', '_'))")-$(date +%Y-%m-%d)
mkdir -p "$res"

pack() {
  [[ -n ${OUT:-} ]] || return 0
  tar czf "$OUT/${PACK:-results}.tgz" "$res" && echo "packed $res into \$OUT/${PACK:-results}.tgz"
}

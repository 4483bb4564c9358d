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
# one torch import: the CUDA check, the GPU's name (the results dir) and what ran
info=$("$PY" -c "import sys, torch
if not torch.cuda.is_available(): sys.exit('error: no CUDA GPU visible (these are the GPU figures)')
print(torch.cuda.get_device_name(0).replace(' ', '_'), 'torch', torch.__version__, 'python',
      sys.version.split()[0])") || exit 1
res=benchmarks/results/${info%% *}-$(date +%Y-%m-%d)
mkdir -p "$res"
# what produced these results (the device's copy has no .git: pass GIT_SHA=<commit>); one
# file per pack, so the packs of several calls unpack side by side
echo "$(date '+%F %T') $0 $* | commit ${GIT_SHA:-$(git rev-parse HEAD 2>/dev/null ||
  echo unknown)} | ${info#* } ${info%% *}" >> "$res/provenance${PACK:+-$PACK}.txt"

pack() {  # never fails: a pack that cannot be made must not stop the measuring
  [[ -n ${OUT:-} ]] || return 0
  local part=$OUT/part-$BASHPID.tmp rc=0
  # to a temporary name, then renamed: a call killed mid-tar keeps the last whole pack;
  # tar's exit 1 (a log still being written while read) still makes a whole archive
  tar czf "$part" "$res" || rc=$?
  if ((rc <= 1)) && mv -f "$part" "$OUT/${PACK:-results}.tgz"; then
    echo "packed $res into \$OUT/${PACK:-results}.tgz"
  else
    rm -f "$part"; echo "could not pack $res (tar exit $rc)" >&2
  fi
  return 0
}

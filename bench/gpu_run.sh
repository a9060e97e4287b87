#!/usr/bin/env bash
# The first GPU run, as one call whose stages take at most 5 minutes on one H100 (the lent machine:
# about 15 minutes of device time in all, start-up included, at most 10 minutes a command, 8 result
# files), so that a second call can still run what failed or did not run.
#
#   bash bench/gpu_run.sh              # on the GPU machine, from the repository root; results in $OUT
#   bash bench/gpu_run.sh --only pytest,checks-full   # a second call: those stages only (preflight first)
#   bash bench/gpu_run.sh --simulate   # anywhere: the same stages on the strict simulated CUDA runtime
#   bash bench/gpu_run.sh [--simulate] --dry-run   # the stages and their time limits; runs nothing
#
# It runs the python3 it finds (on the lent machine: the image's own torch, not this project's pin)
# with this checkout on PYTHONPATH. Stages run in the order of what they prove, each under its own
# timeout (SIGINT first, so that a Python stage still writes what it has), appending to
# $OUT/run.log as it goes, so a call cut short keeps every finished stage:
#   0 preflight     imports (torch, numpy, numba with this numpy, psutil, cgdp), torch.cuda.init():
#                   a failure here ends the call at once, with one line saying what is missing
#   1 checks-quick  stream-ordering checks, their controls and fault injection, quick set
#                   (bench/gpu_checks.py --quick)
#   2 pytest        tests/test_cuda.py on the GPU (Trainer and DataParallel, two replicas on cuda:0,
#                   SGD and Adam against autograd on the GPU's own kernels)
#   3 measure       bandwidth, ResNet-152 on one GPU, cgdp and typical, phases and exposed_comm,
#                   and a chunk sweep (bench/gpu_all.py)
#   4 overlap       copy/compute overlap and D2H/H2D bandwidth of pinned copies (GPU only)
#   5 replicas      two replicas on the one GPU (share_devices=True), checked against autograd
#   6 integrations  Lightning and Accelerate through cgdp with accelerator="gpu", two replicas on the GPU,
#                   each against the framework on one device (bench/gpu_integrations.py; skipped if absent)
#   7 checks-full   every check of bench/gpu_checks.py, with the time that remains
#   8 summary       $OUT/summary.txt
# Files back (at most 8): run.log, summary.txt, q/gpu_checks.json, a/gpu.json, a/gpu.md,
# b/gpu.json, f/gpu_checks.json, f/gpu_checks.md.
set -u
MODE=gpu DRY= ONLY=
STAGES="checks-quick pytest measure overlap replicas integrations checks-full"
usage="usage: bash bench/gpu_run.sh [--simulate] [--dry-run] [--only STAGE[,STAGE...]] (stages: ${STAGES// /, })"
while [ $# -gt 0 ]; do
  case "$1" in
    --simulate) MODE=sim ;;
    --dry-run) DRY=1 ;;
    --only) shift; ONLY=",${1:-},";;
    --only=*) ONLY=",${1#--only=},";;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$ONLY" ]; then
  for n in ${ONLY//,/ }; do
    case " $STAGES " in *" $n "*) ;; *) echo "--only: unknown stage '$n'; $usage" >&2; exit 2 ;; esac
  done
fi
# wanted STAGE: whether this call runs it
wanted() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]; }
OUT=${OUT:-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
L=$OUT/run.log
T0=$(date +%s)
if [ "$MODE" = sim ]; then
  BUDGET=195  # the stages' limits together; with the kill graces and the summary: 4 minutes
  SIM=--simulate
  # stage limits (s): preflight checks-quick pytest measure overlap replicas integrations; checks-full: the rest
  LIMITS=(15 30 40 45 0 25 20)
  PYTEST=(-k "page_locked or two_replicas_on_one_gpu or equivalence_on_cuda and 1-sgd-cgdp")
  MEASURE=(--quick --models mlp --parts bandwidth,networks,sweep)
  REPLICAS=(--quick --models mlp --parts replicas --replicas 2)
else
  BUDGET=300  # the stages' limits together: 5 minutes (with the kill graces and the summary: 6)
  SIM=
  LIMITS=(20 50 55 70 20 40 25)
  PYTEST=()
  MEASURE=(--parts bandwidth,networks,sweep --models resnet152 --steps 8 --warmup 2 --sweep 4,16,64 --sweep-iters 5)
  REPLICAS=(--parts replicas --replicas 2 --models resnet152 --steps 4 --warmup 1)
fi
NAMES=(preflight checks-quick pytest measure overlap replicas integrations)
if [ -n "$DRY" ]; then
  total=0 used=0
  for i in 0 1 2 3 4 5 6; do
    total=$((total + LIMITS[i]))
    if [ "$i" = 0 ] || wanted "${NAMES[$i]}"; then echo "stage ${NAMES[$i]} ${LIMITS[$i]}s"; used=$((used + LIMITS[i])); fi
  done
  if wanted checks-full; then
    echo "stage checks-full $((BUDGET - used))s (at least: it takes what the stages before it left)"; used=$BUDGET
  fi
  echo "budget ${BUDGET}s, at most $((BUDGET + 8 * 5 + 10))s with each stage's kill grace and the summary"
  exit 0
fi
mkdir -p "$OUT"

stage() { echo "=== $1 t=$(( $(date +%s) - T0 ))s" | tee -a "$L"; }
# skip STAGE: true (and says so) when --only leaves the stage out
skip() { if wanted "$1"; then return 1; fi; echo "rc=skipped (not in --only)" | tee -a "$L"; }
# run LIMIT CMD...: the command under its own timeout (SIGINT, then SIGKILL 5 s later)
run() {
  local t=$1; shift
  if [ "$t" -le 5 ]; then echo "rc=skipped (no time left)" | tee -a "$L"; return; fi
  timeout -s INT -k 5 "$t" "$@" >>"$L" 2>&1
  echo "rc=$?" | tee -a "$L"
}

stage preflight
run "${LIMITS[0]}" $PY - "$MODE" <<'P'
import importlib, os, sys
mode = sys.argv[1]
try:
    for name in ("numpy", "torch", "numba", "psutil"):
        m = importlib.import_module(name)
        print(f"[preflight] {name} {getattr(m, '__version__', '?')}")
    import numba, numpy as np, torch
    assert numba.njit(lambda a: a.sum())(np.ones(4, np.float32)) == 4, "numba computes a wrong sum"
    import cgdp
    assert os.path.dirname(os.path.dirname(os.path.abspath(cgdp.__file__))) == os.getcwd(), \
        f"cgdp comes from {cgdp.__file__}, not this checkout"
    if mode == "gpu":
        torch.cuda.init()
        assert torch.cuda.is_available(), "torch sees no GPU"
        print(f"[preflight] {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, "
              f"{torch.cuda.device_count()} GPU(s), python {sys.version.split()[0]}")
except Exception as exc:  # one line that says what is missing
    print(f"[preflight] FAILED: {type(exc).__name__}: {exc}")
    sys.exit(1)
print("[preflight] ok")
P
if ! tail -1 "$L" | grep -q "^rc=0$"; then
  grep "preflight\]" "$L" | tail -1
  echo "gpu_run.sh: the preflight failed (above); nothing else was run" | tee -a "$L" "$OUT/summary.txt"
  exit 1
fi

stage checks-quick
skip checks-quick || run "${LIMITS[1]}" $PY bench/gpu_checks.py --quick $SIM --out "$OUT/q"
# tests/test_cuda.py uses the GPU when there is one, else one simulated GPU (then three of its tests)
stage pytest
skip pytest || run "${LIMITS[2]}" $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py "${PYTEST[@]}"
stage measure
skip measure || run "${LIMITS[3]}" $PY bench/gpu_all.py "${MEASURE[@]}" $SIM --out "$OUT/a"

stage overlap
if [ "$MODE" = sim ]; then
  echo "rc=skipped (raw torch.cuda copies and GEMMs: a GPU only)" | tee -a "$L"
elif ! skip overlap; then
  run "${LIMITS[4]}" $PY - <<'P'
import time
import torch
n = 64 << 20
d = torch.empty(n, device="cuda"); e = torch.empty_like(d)
h = torch.empty(n, pin_memory=True); k = torch.empty(n, pin_memory=True)
a = torch.randn(8192, 8192, device="cuda")
s, t = torch.cuda.Stream(), torch.cuda.Stream()
def mm():
    for _ in range(10):
        a @ a
def cp():
    for _ in range(20):
        with torch.cuda.stream(s):
            h.copy_(d, non_blocking=True)
        with torch.cuda.stream(t):
            e.copy_(k, non_blocking=True)
def timed(f):
    torch.cuda.synchronize(); z = time.perf_counter(); f(); torch.cuda.synchronize()
    return time.perf_counter() - z
mm(); cp()
g, c, b = timed(mm), timed(cp), timed(lambda: (cp(), mm()))
print(f"[overlap] gemm {g*1e3:.0f} ms, copies {c*1e3:.0f} ms ({20*n*4/c/1e9:.1f} GB/s each way), "
      f"both {b*1e3:.0f} ms (perfect overlap: {max(g, c)*1e3:.0f} ms)")
P
fi

stage replicas
skip replicas || run "${LIMITS[5]}" $PY bench/gpu_all.py "${REPLICAS[@]}" $SIM --out "$OUT/b"
stage integrations
skip integrations || run "${LIMITS[6]}" $PY bench/gpu_integrations.py $SIM
left=$(( BUDGET - $(date +%s) + T0 ))
stage checks-full
skip checks-full || run "$left" $PY bench/gpu_checks.py $SIM --out "$OUT/f"

stage summary
rm -f "$OUT"/q/*.md "$OUT"/b/*.md  # at most 8 files come back
{
  echo "gpu_run.sh ($MODE${ONLY:+, only ${ONLY:1:-1}}) in $(( $(date +%s) - T0 )) s"
  grep -hE "^===|^rc=|as they must|FAIL|overlap\]|preflight\]|integrations\]|passed|failed|error" "$L" | tail -60
  $PY - "$OUT" <<'P' 2>&1
import json, os, sys
out = sys.argv[1]
def load(p):
    try:
        with open(os.path.join(out, p)) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        print(f"{p}: none ({exc.__class__.__name__})")
a, b = load("a/gpu.json"), load("b/gpu.json")
if a:
    print("bandwidth GB/s:", a.get("bandwidth", {}).get("gbps"))
    for n in a.get("networks", []):
        for m, e in n.get("modes", {}).items():
            print(n.get("model"), "rel.err", n.get("check_rel_err"), m, "step", round(e.get("step_ms", 0), 1), "ms",
                  {k[:-2]: round(v, 1) for k, v in e.get("phases_ms", {}).items()})
    print("chunk sweep ms:", {k: round(v.get("median_ms", 0), 1) for k, v in a.get("chunk_sweep", {}).get("sizes", {}).items()})
if b:
    print("replicas:", b.get("replicas"))
P
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"

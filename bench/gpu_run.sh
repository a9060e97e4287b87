#!/usr/bin/env bash
# The first GPU run, as one call of at most 7 minutes on one H100 (the lent machine: about 15
# minutes of device time in all, start-up included, at most 10 minutes a command, 8 result files).
#
#   bash bench/gpu_run.sh              # on the GPU machine, from the repository root; results in $OUT
#   bash bench/gpu_run.sh --simulate   # anywhere: the same stages on the strict simulated CUDA runtime
#   bash bench/gpu_run.sh [--simulate] --dry-run   # the stages and their time limits; runs nothing
#
# Stages run in the order of what they prove, each under its own timeout (SIGINT first, so that a
# Python stage still writes what it has), appending to $OUT/run.log as it goes, so a call cut short
# keeps every finished stage:
#   1 checks-quick  stream-ordering checks and fault injection, quick set (bench/gpu_checks.py --quick)
#   2 overlap       copy/compute overlap and D2H/H2D bandwidth of pinned copies (GPU only)
#   3 measure       bandwidth, ResNet-152 on one GPU, cgdp and typical, phases and exposed_comm,
#                   and a chunk sweep (bench/gpu_all.py)
#   4 replicas      two replicas on the one GPU (share_devices=True), checked against autograd
#   5 pytest        tests/test_cuda.py on the GPU (Trainer and DataParallel, two replicas on cuda:0)
#   6 checks-full   every check of bench/gpu_checks.py, with the time that remains
#   7 summary       $OUT/summary.txt
# Files back (at most 8): run.log, summary.txt, q/gpu_checks.json, a/gpu.json, a/gpu.md,
# b/gpu.json, f/gpu_checks.json, f/gpu_checks.md.
set -u
MODE=gpu DRY=
for a in "$@"; do
  case "$a" in
    --simulate) MODE=sim ;;
    --dry-run) DRY=1 ;;
    *) echo "usage: bash bench/gpu_run.sh [--simulate] [--dry-run]" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
L=$OUT/run.log
T0=$(date +%s)
if [ "$MODE" = sim ]; then
  BUDGET=200  # the stages' limits together; with the kill grace and the summary: 4 minutes
  SIM=--simulate
  # stage limits (s): checks-quick overlap measure replicas pytest; checks-full takes the rest
  LIMITS=(35 0 45 30 45)
  PYTEST=(-k "page_locked or two_replicas_on_one_gpu or equivalence_on_cuda and 1-sgd-cgdp")
  MEASURE=(--quick --models mlp --parts bandwidth,networks,sweep)
  REPLICAS=(--quick --models mlp --parts replicas --replicas 2)
else
  BUDGET=380  # the stages' limits together; with the kill grace and the summary: 7 minutes
  SIM=
  LIMITS=(80 30 120 60 60)
  PYTEST=()
  MEASURE=(--parts bandwidth,networks,sweep --models resnet152 --steps 10 --warmup 3 --sweep 4,16,64 --sweep-iters 8)
  REPLICAS=(--parts replicas --replicas 2 --models resnet152 --steps 5 --warmup 2)
fi
if [ -n "$DRY" ]; then
  total=0
  for n in checks-quick:${LIMITS[0]} overlap:${LIMITS[1]} measure:${LIMITS[2]} replicas:${LIMITS[3]} pytest:${LIMITS[4]}; do
    echo "stage ${n%%:*} ${n##*:}s"; total=$((total + ${n##*:}))
  done
  echo "stage checks-full $((BUDGET - total))s (at least: it takes what the stages before it left)"
  echo "budget ${BUDGET}s, at most $((BUDGET + 6 * 5 + 10))s with each stage's kill grace and the summary"
  exit 0
fi
mkdir -p "$OUT"

stage() { echo "=== $1 t=$(( $(date +%s) - T0 ))s" | tee -a "$L"; }
# run LIMIT CMD...: the command under its own timeout (SIGINT, then SIGKILL 5 s later)
run() {
  local t=$1; shift
  if [ "$t" -le 5 ]; then echo "rc=skipped (no time left)" | tee -a "$L"; return; fi
  timeout -s INT -k 5 "$t" "$@" >>"$L" 2>&1
  echo "rc=$?" | tee -a "$L"
}

stage checks-quick; run "${LIMITS[0]}" $PY bench/gpu_checks.py --quick $SIM --out "$OUT/q"

stage overlap
if [ "$MODE" = sim ]; then
  echo "rc=skipped (raw torch.cuda copies and GEMMs: a GPU only)" | tee -a "$L"
else
  run "${LIMITS[1]}" $PY - <<'P'
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

stage measure; run "${LIMITS[2]}" $PY bench/gpu_all.py "${MEASURE[@]}" $SIM --out "$OUT/a"
stage replicas; run "${LIMITS[3]}" $PY bench/gpu_all.py "${REPLICAS[@]}" $SIM --out "$OUT/b"
# tests/test_cuda.py uses the GPU when there is one, else one simulated GPU (then three of its tests)
stage pytest; run "${LIMITS[4]}" $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py "${PYTEST[@]}"
left=$(( BUDGET - $(date +%s) + T0 ))
stage checks-full; run "$left" $PY bench/gpu_checks.py $SIM --out "$OUT/f"

stage summary
rm -f "$OUT"/q/*.md "$OUT"/b/*.md  # at most 8 files come back
{
  echo "gpu_run.sh ($MODE) in $(( $(date +%s) - T0 )) s"
  grep -hE "^===|^rc=|as they must|FAIL|overlap\]|passed|failed|error" "$L" | tail -60
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

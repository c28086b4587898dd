#!/usr/bin/env bash
# The one command for the GPU machine: te_norm_grad.py (does Transformer Engine add the gradient of
# its returned gathered LayerNorm output? seconds; "not available" without TE), run.sh (one
# Qwen3-8B layer per strategy), te_lora.py (regather's LoRA on a real TE base: input gradient vs
# fp64, recompute's bytes; "not available" without TE), then kernels.sh (wgrad kernels, extension
# build, comm-stream overlap trace), each time-boxed, every result in $OUT as at most 8 files,
# never stopping at a failed step.
#
#   OUT=DIR benchmarks/gpu/device_run.sh            # on the GPU machine (README.md: the device call)
#   DRY_RUN=1 OUT=DIR benchmarks/gpu/device_run.sh  # on CPU: the same steps' dry runs, same bundle
#
# Environment:
#   BUDGET_S  whole run, default 330 s (5.5 min), so that one device call of timeout_s=360 and an
#             immediate rerun fit into a 15-minute device budget with the machine's start
#   TE_S      te_norm_grad.py's share, default 60 s (it takes seconds; TE's import is the most)
#   RUN_S     run.sh's share, default 110 s; kernels.sh gets what is left minus 15 s for bundling
#   TE_LORA_S te_lora.py's share, default 60 s (after run.sh: it needs the megatron-core run.sh installs)
#   STEPS     default "te run te_lora kernels"; e.g. STEPS=kernels to rerun one step
#   DRY_RUN   1: te_norm_grad.py --cpu-dry-run, run.sh --dry-run, te_lora.py --cpu-dry-run and
#             kernels.sh --cpu-dry-run (tiny shapes on CPU; budgets default to 900 s, 120 s, 420 s and
#             120 s there)
#   PYTHON    default python3
# Each step runs under `timeout` (its budget + 20 s, then SIGKILL 10 s later), so the whole run
# ends by BUDGET_S + about 30 s whatever a step does.
#
# Files in $OUT (7):
#   summary.txt        one line per step: name, exit code, seconds, budget; the lines
#                      "te_norm_grad: <verdict>" and "te_lora: <verdict>"; then the environment
#   device_run.log     every step's console output and ext_build.log, one after the other
#   layer_bench.json   layer_bench.md   kernels.json   kernels.md   (when the step wrote them; the
#                      TE checks' results are folded into kernels.json (keys te_norm_grad,
#                      te_lora) and kernels.md, which they create when kernels.sh wrote none)
#   results.tar.gz     everything every step wrote (te/te_norm_grad.json, overlap_trace.json, ...)
# Exit status: 0 when every step exited 0, else 1 (the summary says which).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu}
DRY_RUN=${DRY_RUN:-0}
if [ "$DRY_RUN" = 1 ]; then  # CPU: tiny shapes, but a shared 2-core machine can be slow
  BUDGET_S=${BUDGET_S:-900}; RUN_S=${RUN_S:-420}; TE_S=${TE_S:-120}; TE_LORA_S=${TE_LORA_S:-120}
else
  BUDGET_S=${BUDGET_S:-330}; RUN_S=${RUN_S:-110}; TE_S=${TE_S:-60}; TE_LORA_S=${TE_LORA_S:-60}
fi
STEPS=${STEPS:-te run te_lora kernels}
DEPS=${DEPS:-${TMPDIR:-/tmp}/regather-gpu-deps}  # where run.sh installs megatron-core (offline_deps.sh)
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/regather-device-XXXXXX")
SUMMARY=$OUT/summary.txt
LOG=$OUT/device_run.log
t0=$(date +%s)
: >"$LOG"
{
  echo "# benchmarks/gpu/device_run.sh  $(date -u +%FT%TZ)  DRY_RUN=$DRY_RUN BUDGET_S=$BUDGET_S RUN_S=$RUN_S STEPS=$STEPS"
  echo "# step  exit  seconds  budget_s"
} >"$SUMMARY"

elapsed() { echo $(( $(date +%s) - t0 )); }
FAILED=0

# step NAME BUDGET CMD...: run CMD with OUT=$STAGE/NAME under timeout, log and record it
step() {
  local name=$1 budget=$2 start rc
  shift 2
  mkdir -p "$STAGE/$name"
  start=$(date +%s)
  echo "===== $name: $* (budget ${budget} s, at +$(elapsed) s)" >>"$LOG"
  OUT="$STAGE/$name" BUDGET_S="$budget" timeout --kill-after=10 "$(( budget + 20 ))" "$@" \
    >"$STAGE/$name.console" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || FAILED=$(( FAILED + 1 ))
  cat "$STAGE/$name.console" >>"$LOG"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "===== $name: stopped by timeout (rc $rc)" >>"$LOG"
  printf '%-8s %4s %7s %8s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$budget" >>"$SUMMARY"
  echo "===== $name: exit $rc after $(( $(date +%s) - start )) s" >>"$LOG"
  return 0
}

SRC_PATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
for s in $STEPS; do
  case $s in
    te)
      if [ "$DRY_RUN" = 1 ]; then args=(--cpu-dry-run); else args=(); fi
      step te "$TE_S" env PYTHONPATH="$SRC_PATH" "$PYTHON" benchmarks/gpu/te_norm_grad.py ${args[@]+"${args[@]}"}
      ;;
    run)
      if [ "$DRY_RUN" = 1 ]; then args=(--dry-run --rounds 1); else args=(); fi
      step run "$RUN_S" bash benchmarks/gpu/run.sh ${args[@]+"${args[@]}"}
      ;;
    te_lora)
      if [ "$DRY_RUN" = 1 ]; then args=(--cpu-dry-run); else args=(); fi
      step te_lora "$TE_LORA_S" env PYTHONPATH="$SRC_PATH:$DEPS" "$PYTHON" benchmarks/gpu/te_lora.py \
        ${args[@]+"${args[@]}"}
      ;;
    kernels)
      left=$(( BUDGET_S - $(elapsed) - 15 ))
      [ "$left" -lt 90 ] && left=90
      if [ "$DRY_RUN" = 1 ]; then args=(--cpu-dry-run); else args=(); fi
      step kernels "$left" bash benchmarks/gpu/kernels.sh ${args[@]+"${args[@]}"}
      ;;
    *)
      echo "device_run.sh: unknown step '$s' (known: te run te_lora kernels)" >>"$LOG"
      printf '%-8s %4s %7s %8s\n' "$s" "-" 0 0 >>"$SUMMARY"
      FAILED=$(( FAILED + 1 ))
      ;;
  esac
done

if [ -f "$STAGE/kernels/ext_build.log" ]; then
  { echo "===== kernels: ext_build.log"; cat "$STAGE/kernels/ext_build.log"; } >>"$LOG"
fi
for f in run/layer_bench.json run/layer_bench.md kernels/kernels.json kernels/kernels.md; do
  [ -f "$STAGE/$f" ] && cp "$STAGE/$f" "$OUT/"
done
# the TE checks' verdicts: into summary.txt, kernels.json and kernels.md (no 8th file)
fold() {  # fold NAME: $STAGE/<step>/NAME.json under key NAME, its .md appended; or say why not
  local dir=$1 name=$2
  if [ -f "$STAGE/$dir/$name.json" ]; then
    "$PYTHON" - "$STAGE/$dir/$name.json" "$OUT/kernels.json" "$name" >>"$SUMMARY" 2>>"$LOG" <<'PY' \
      || echo "$name: its result could not be folded into kernels.json (device_run.log)" >>"$SUMMARY"
import json, os, sys
result, into, key = sys.argv[1:4]
report = json.load(open(result))
merged = json.load(open(into)) if os.path.exists(into) else {}
merged[key] = report
with open(into, "w") as f:
    json.dump(merged, f, indent=1)
print(f"{key}:", report["verdict"])
PY
    { [ -s "$OUT/kernels.md" ] && echo; cat "$STAGE/$dir/$name.md"; } >>"$OUT/kernels.md"
  elif [[ " $STEPS " == *" $dir "* ]]; then
    echo "$name: no result (the $dir step wrote none; device_run.log)" >>"$SUMMARY"
  fi
}
fold te te_norm_grad
fold te_lora te_lora

# the machine, once (cheap; after the steps so it never eats into their budgets)
{
  echo "# environment"
  echo "host: $(uname -srm)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no .git here')"
  "$PYTHON" - <<'PY' 2>&1
import sys
print("python:", sys.version.split()[0], sys.executable)
try:
    import torch
    print("torch:", torch.__version__, "cuda", torch.version.cuda,
          "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
except Exception as exc:  # noqa: BLE001
    print("torch: not importable:", exc)
try:
    import triton
    print("triton:", triton.__version__)
except Exception as exc:  # noqa: BLE001
    print("triton: not importable:", exc)
PY
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} >>"$SUMMARY" 2>&1

tar -czf "$OUT/results.tar.gz" -C "$STAGE" . 2>>"$LOG"
rm -rf "$STAGE"
echo "total $(elapsed) s" >>"$SUMMARY"
cat "$SUMMARY"
echo "device_run.sh: files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
[ "$FAILED" -eq 0 ]

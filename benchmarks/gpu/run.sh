#!/usr/bin/env bash
# Per-strategy memory and time of one Qwen3-8B transformer layer with LoRA (issue 3, "## GPU").
#
#   benchmarks/gpu/run.sh [extra args for layer_bench.py]     # on the GPU machine
#   benchmarks/gpu/run.sh --dry-run                           # tiny shapes on CPU, same code path
#
# Made for one H200 with torch + triton and no megatron-core and no network;
# finishes in well under 8 minutes (BUDGET_S, default 420 s). Steps:
#   1. megatron-core 0.16.1, numpy, packaging>=24.2: whichever does not import is
#      installed offline (--no-index --no-deps) from benchmarks/gpu/wheels/ into
#      $TMPDIR/regather-gpu-deps (offline_deps.sh). The wheels are not in git:
#      benchmarks/gpu/fetch_wheels.sh downloads them, the device call carries them.
#      A dry run where megatron-core imports (the dev venv) needs no wheels;
#   2. benchmarks/gpu/layer_bench.py: Qwen3-8B layer shapes (h=4096, ffn=12288,
#      32 heads / 8 kv, s=8192, b=1, bf16), TP=2 emulated as rank 0 of a fake
#      process group; per strategy the bytes retained after forward, the peak
#      of forward+backward, CUDA-event median times and the ratio to gather.
#      Every strategy also runs as its "-recompute" variant (LoRA(recompute_adapter_inputs=True):
#      regather-recompute, lowrank-recompute, gather-recompute — on gather only fc2 recomputes),
#      timed against gather and against the same strategy without recompute (paired per round);
#      each result lists the adapters' decisions (which input is recomputed, from what).
#      The variants regather-classic (regather with the classic output path: LoRA's full-width
#      output, scale and sum) and gather-lean (the gather path with lean_transients=True) put the
#      output path of issue 45 side by side: peak and paired time in the same run;
#   3. time left (LONG_S, default 60 s, when at least 40 s remain): the same layer at long context
#      per CP rank, s=16384 (128k tokens at CP8: the linears see s/cp tokens; the local spec's
#      attention has no CP), fewer variants and rounds, into $OUT/long/ (max_memory_allocated per
#      strategy: the peak users see).
# Results: layer_bench.json, layer_bench.md, layer_bench.log in $OUT, or in
# benchmarks/results/gpu/ when OUT is unset; the long-context pass in long/.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$ROOT/benchmarks/results/gpu}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
BUDGET_S=${BUDGET_S:-420}
t0=$(date +%s)

. "$ROOT/benchmarks/gpu/offline_deps.sh"
# shellcheck disable=SC2046  # word splitting of the missing specs is intended
offline_install $(missing megatron.core:megatron-core==0.16.1 numpy:numpy "packaging>=24.2:packaging") || exit 2
"$PY" -W ignore -c 'import torch, megatron.core as m; print("torch", torch.__version__, "cuda", torch.version.cuda, "megatron-core", m.__version__)'

LEFT=$(( BUDGET_S - ($(date +%s) - t0) )); [ "$LEFT" -lt 30 ] && LEFT=30  # the install counts too
timeout "$LEFT" "$PY" benchmarks/gpu/layer_bench.py --out "$OUT_DIR" "$@" 2>&1 \
  | grep --line-buffered -v -e "UserWarning" -e "warnings.warn" | tee "$OUT_DIR/layer_bench.log"
rc=${PIPESTATUS[0]}
LEFT=$(( BUDGET_S - ($(date +%s) - t0) ))
if [ "$rc" -eq 0 ] && [ "$LEFT" -ge 40 ]; then
  LONG_S=${LONG_S:-60}; [ "$LONG_S" -gt "$LEFT" ] && LONG_S=$LEFT
  mkdir -p "$OUT_DIR/long"
  if [[ " $* " == *" --dry-run "* ]]; then LONG_ARGS=(--seq 128); else LONG_ARGS=(--seq 16384); fi
  timeout "$LONG_S" "$PY" benchmarks/gpu/layer_bench.py --out "$OUT_DIR/long" "$@" "${LONG_ARGS[@]}" \
    --strategies gather,gather-lean,regather-classic,regather,regather-recompute,lowrank --warmup 1 --rounds 3 \
    2>&1 | grep --line-buffered -v -e "UserWarning" -e "warnings.warn" | tee "$OUT_DIR/long/layer_bench.log"
  echo "run.sh: long-context pass exit ${PIPESTATUS[0]}"
fi
echo "run.sh: exit $rc after $(( $(date +%s) - t0 )) s; results in $OUT_DIR"
exit "$rc"

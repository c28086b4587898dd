#!/usr/bin/env bash
# Per-strategy memory and time of one Qwen3-8B transformer layer with LoRA (issue 3, "## GPU").
#
#   benchmarks/gpu/run.sh [extra args for layer_bench.py]     # on the GPU machine
#   benchmarks/gpu/run.sh --dry-run                           # tiny shapes on CPU, same code path
#
# Made for one H200 with torch + triton and no megatron-core and no network;
# finishes in well under 8 minutes (BUDGET_S, default 420 s). Steps:
#   1. megatron-core 0.16.1: if not importable, install the wheel carried in
#      benchmarks/gpu/wheels/ (cp311 and cp312, 2.6 MB each) with --no-deps
#      into $TMPDIR/regather-gpu-deps (needs numpy and packaging, which torch setups have);
#   2. benchmarks/gpu/layer_bench.py: Qwen3-8B layer shapes (h=4096, ffn=12288,
#      32 heads / 8 kv, s=8192, b=1, bf16), TP=2 emulated as rank 0 of a fake
#      process group; per strategy the bytes retained after forward, the peak
#      of forward+backward, CUDA-event median times and the ratio to gather.
# Results: layer_bench.json, layer_bench.md, layer_bench.log in $OUT, or in
# benchmarks/results/gpu/ when OUT is unset.
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

if ! "$PY" -c 'import megatron.core' >/dev/null 2>&1; then
  tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls "$ROOT"/benchmarks/gpu/wheels/megatron_core-0.16.1-"$tag"-*.whl 2>/dev/null | head -1)
  if [ -z "$wheel" ]; then
    echo "run.sh: no megatron-core wheel for $tag in benchmarks/gpu/wheels" >&2
    exit 2
  fi
  DEPS=${TMPDIR:-/tmp}/regather-gpu-deps
  "$PY" -m pip install -q --no-deps --target "$DEPS" "$wheel" || exit 2
  export PYTHONPATH="$PYTHONPATH:$DEPS"
  "$PY" -c 'import numpy, packaging' || { echo "run.sh: megatron-core needs numpy and packaging" >&2; exit 2; }
fi
"$PY" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "cuda", torch.version.cuda, "megatron-core", m.__version__)'

timeout "$BUDGET_S" "$PY" benchmarks/gpu/layer_bench.py --out "$OUT_DIR" "$@" 2>&1 \
  | grep -v -e "UserWarning" -e "warnings.warn" | tee "$OUT_DIR/layer_bench.log"
rc=${PIPESTATUS[0]}
echo "run.sh: exit $rc after $(( $(date +%s) - t0 )) s; results in $OUT_DIR"
exit "$rc"

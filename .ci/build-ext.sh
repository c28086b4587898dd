#!/usr/bin/env bash
# Build the CUDA extension regather._wgrad_ext (csrc/, setup.py with REGATHER_BUILD_EXT=1) against the torch
# of VENV_DIR and this machine's CUDA toolkit, out of the source tree, for Hopper (TORCH_CUDA_ARCH_LIST,
# default 9.0). It compiles and links here; it runs only on a GPU (tests/unit/ops/test_wgrad_ext_build.py
# checks the shared object's symbols and imports it as far as a machine without a GPU driver allows).
#
#   .ci/build-ext.sh VENV_DIR OUT_DIR        e.g. .ci/build-ext.sh .venv-torch214 build/ext-torch214
#
# VENV_DIR: a CUDA build of torch (torch.version.cuda set) and setuptools>=77. OUT_DIR: git-ignored; gets
# lib/regather/_wgrad_ext*.so, tmp/ (objects) and build.json (what it was built with, read by the test).
# The toolkit: csrc/cuda_toolkit.py's rule, the one setup.py uses ($CUDA_HOME if set, an error if it is not
# one; else the first of /usr/local/cuda and the folder above nvcc's on PATH with bin/nvcc and
# include/cuda_runtime_api.h: torch's own guess, the folder above the first nvcc on PATH, is /usr/local
# here, where /usr/local/bin/nvcc is a wrapper script). Where it lacks the CUDA math libraries' headers (cuBLAS,
# cuSPARSE, ...: an nvcc + cudart toolkit like this machine's), setup.py takes them from the nvidia
# wheels torch installed (nvidia/cu13/include).
# Exit status: 0 built (or up to date: OUT_DIR/.stamp holds a sha256 of the sources, setup.py, VENV_DIR's
# torch, nvcc's version and the arch list); 3 SKIP: no CUDA toolkit or no CUDA torch (a "SKIP:" line says
# which); anything else: a failure.
# One translation unit (wgrad_ext.cpp, compiled by the host C++ compiler with the toolkit's headers; there
# is no .cu file, so nvcc itself compiles nothing): MAX_JOBS, default 2, cannot split it.
# Measured here (2026-12-07, 2 cores shared with other agents, g++ 12, torch 2.14.1): 41 s, 23 s of CPU.
set -euo pipefail
SKIP_STATUS=3

[ $# -eq 2 ] || { echo "usage: $0 VENV_DIR OUT_DIR" >&2; exit 2; }
cd "$(dirname "$0")/.."
PY=$1/bin/python
OUT=$2
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-2}

[ -x "$PY" ] || { echo "$0: no Python in $1" >&2; exit 2; }
rc=0
why_file=$(mktemp)
cuda_home=$("$PY" csrc/cuda_toolkit.py 2>"$why_file") || rc=$?  # exit 3: none found; 2: CUDA_HOME is not one
why=$(cat "$why_file"); rm -f "$why_file"
case $rc in
    0) ;;
    3) echo "SKIP: $why: regather._wgrad_ext is not built"; exit $SKIP_STATUS ;;
    *) echo "$0: $why" >&2; exit 2 ;;
esac
export CUDA_HOME=$cuda_home
torch_cuda=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "")')
case "$torch_cuda" in
    *" ") echo "SKIP: torch ${torch_cuda% } in $1 has no CUDA: regather._wgrad_ext is not built"; exit $SKIP_STATUS ;;
esac
nvcc_version=$("$cuda_home/bin/nvcc" --version | tail -1)

want=$( { cat csrc/* setup.py; echo "$torch_cuda"; echo "$nvcc_version"; echo "$TORCH_CUDA_ARCH_LIST"; } | sha256sum | cut -d' ' -f1)
if [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$want" ] && ls "$OUT"/lib/regather/_wgrad_ext*.so >/dev/null 2>&1; then
    echo "$OUT: up to date ($(cut -c1-12 "$OUT/.stamp"))"
    exit 0
fi

start=$(date +%s)
echo "building regather._wgrad_ext into $OUT: torch $torch_cuda, $cuda_home ($nvcc_version), arch $TORCH_CUDA_ARCH_LIST"
rm -rf "$OUT"
mkdir -p "$OUT"
REGATHER_BUILD_EXT=1 "$PY" setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/tmp" \
    2> >(grep -v "No CUDA runtime is found, using CUDA_HOME" >&2)
so=$(ls "$OUT"/lib/regather/_wgrad_ext*.so)
seconds=$(( $(date +%s) - start ))
"$PY" - "$OUT/build.json" "$so" "$cuda_home" "$nvcc_version" "$seconds" <<'PYEOF'
import json
import os
import sys

import torch

out, so, cuda_home, nvcc, seconds = sys.argv[1:]
record = {"so": os.path.abspath(so), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
          "cuda_home": cuda_home, "nvcc": nvcc, "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"],
          "seconds": int(seconds)}
with open(out, "w") as f:
    json.dump(record, f, indent=1)
PYEOF
echo "$want" > "$OUT/.stamp"
echo "$OUT: built in $seconds s: $so ($(du -h "$so" | cut -f1))"

#!/usr/bin/env bash
# Build the torch 2.14 tier's environment (Python 3.11): torch 2.14.1+cu130 and triton 3.8.0 with the CUDA
# library wheels torch declares, and the 3.11 development stack (requirements-dev.txt, megatron-core 0.16.1,
# torchtitan 0.3.0), every package pinned in requirements-torch214.txt or requirements-dev.txt.
#
#   .ci/venv-torch214.sh VENV_DIR            e.g. .ci/venv-torch214.sh .venv-torch214
#
# regather itself is not installed: the tier runs with PYTHONPATH=src (like make test-compat), so one
# environment serves any checkout.
# Python 3.11: $PYTHON311 if set, else python3.11 on PATH, else pyenv's newest 3.11.x.
# Exit status: 0 built (or already up to date); 3 SKIP: no Python 3.11 here (a "SKIP:" line says so);
# anything else non-zero: a failure.
# Idempotent: VENV_DIR/.regather-torch214.stamp holds a sha256 of both pin files, the interpreter's version
# and BUILD_REVISION (bump it when the steps below change); when it matches, nothing is done. Otherwise
# VENV_DIR (only ever a virtual environment or a new folder) is removed and built again.
#
# Where each package comes from (every one --no-deps, fully pinned: pip resolves nothing):
#   [torch] + [cuda]  torch, triton and the CUDA wheels, 2.9 GB of wheels, --no-index from the local wheel
#                     folders (REGATHER_WHEEL_DIRS, default /opt/wheels /opt/pypi/files /opt/pypi-more/files,
#                     the folders pip is configured with here); from the package index where none exists
#   everything else   the indexes pip is configured with: 68 wheels, 113 MB (pip, setuptools, cuda-bindings,
#                     the dev stack and its closure); 42 of them, 74 MB, are not in the local folders and
#                     are downloaded from PyPI
# Measured here (2026-12-07, 2 cores shared with four other agents): 178 s at load 4 (99 s the local wheels,
# 56 s the rest), 296 s at load 9; 5.9 GB.
# Transformer Engine is never installed; the check at the end fails if it finds it.
set -euo pipefail
SKIP_STATUS=3
BUILD_REVISION=2  # not bumped for --no-compile: the same packages, only no .pyc written ahead

[ $# -eq 1 ] || { echo "usage: $0 VENV_DIR" >&2; exit 2; }
cd "$(dirname "$0")/.."
VENV=$1
PINS=requirements-torch214.txt
DEV=requirements-dev.txt
STAMP=$VENV/.regather-torch214.stamp

. .ci/common.sh

PY=$(find_python 3.11) || { echo "SKIP: no Python 3.11 (set PYTHON311, or put python3.11 on PATH): the torch 2.14 tier needs it"; exit $SKIP_STATUS; }

want=$( { cat "$PINS" "$DEV"; "$PY" -VV; echo "build revision $BUILD_REVISION"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "$VENV: up to date ($(cut -c1-12 "$STAMP"))"
    exit 0
fi

section() {  # the pins under "# [name]" in $PINS, up to the next section
    awk -v want="$1" '/^# \[[a-z-]+\]/ { s = $2; gsub(/[][]/, "", s); next }
                      s == want && /^[A-Za-z0-9]/ { print $1 }' "$PINS"
}
norm() { tr 'A-Z_.' 'a-z--'; }  # a distribution name as pip compares it
dev_pins=$(grep -E '^[A-Za-z0-9]' "$DEV" | awk '{ print $1 }' | grep -v -E '^triton==')

# one pin per package across both files; a package in both must have the same version
dups=$( { section torch; section cuda; section cuda-index; section bootstrap; section no-deps; section closure; echo "$dev_pins"; } \
        | awk -F'==' '{ print $1 }' | norm | sort | uniq -d)
if [ -n "$dups" ]; then
    echo "$0: pinned twice (in $PINS and $DEV, or twice in $PINS): $(echo $dups)" >&2
    exit 2
fi

local_wheels
if [ ${#LOCAL_WHEELS[@]} -eq 0 ]; then  # the same pinned wheels from the package index: ~2.9 GB to download
    echo "no local wheel folder (REGATHER_WHEEL_DIRS): torch and the CUDA wheels come from the package index"
fi

case "$(realpath -m "$VENV")" in
    / | "$(realpath .)" | "$(realpath -m "$HOME")") echo "refusing to use $VENV as the environment folder" >&2; exit 2 ;;
esac
if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
    echo "$VENV exists and is not a virtual environment: not removing it" >&2
    exit 2
fi

start=$(date +%s)
echo "building $VENV with $PY ($("$PY" -V 2>&1)) from $PINS and $DEV"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -q)
export PIP_NO_INPUT=1
quiet() {  # stderr without pip's line per package its configured file:// indexes lack
    "$@" 2> >(grep -v "^WARNING: Location 'file://.*' is ignored: it is neither a file nor a directory" >&2)
}
# shellcheck disable=SC2046
quiet "${PIP[@]}" install --no-compile --no-deps $(section bootstrap)
t=$(date +%s)
# shellcheck disable=SC2046
"${PIP[@]}" install --no-compile --no-deps "${LOCAL_WHEELS[@]}" $(section torch) $(section cuda)
echo "  torch, triton and the CUDA wheels: $(( $(date +%s) - t )) s"
t=$(date +%s)
# shellcheck disable=SC2046,SC2086
quiet "${PIP[@]}" install --no-compile --no-deps $(section cuda-index) $(section no-deps) $(section closure) $dev_pins
echo "  the rest: $(( $(date +%s) - t )) s"

# the closure is complete: every installed package's requirements are installed (torchtitan's declared
# datasets, tensorboard, wandb, ... aside: installed --no-deps on purpose, as in .venv)
if ! problems=$("$VENV/bin/python" -m pip check 2>&1); then
    problems=$(echo "$problems" | grep -v -E '^torchtitan [0-9.]+ requires ' || true)
    if [ -n "$problems" ]; then
        echo "$0: the pins are not a closed set (add the missing package to [closure] in $PINS):" >&2
        echo "$problems" >&2
        exit 1
    fi
fi

"$VENV/bin/python" - "$PINS" <<'PYEOF'
import importlib.metadata as md
import importlib.util
import sys

assert importlib.util.find_spec("transformer_engine") is None, "transformer_engine must not be installed"
import torch
import torch.distributed as dist

pins = dict(line.split()[0].split("==") for line in open(sys.argv[1]) if line[:1].isalnum())
got = {name: md.version(name) for name in pins}
wrong = {n: (got[n], v) for n, v in pins.items() if got[n].split("+")[0] != v}
assert not wrong, f"installed != pinned: {wrong}"
assert torch.__version__ == "2.14.1+cu130", torch.__version__
assert dist.is_gloo_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, available: "
      f"{torch.cuda.is_available()}), triton {got['triton']}, torchtitan {got['torchtitan']}, "
      f"megatron-core {got['megatron-core']}, {len(list(md.distributions()))} distributions")
PYEOF
echo "$want" > "$STAMP"
echo "$VENV: built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"

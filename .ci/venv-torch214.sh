#!/usr/bin/env bash
# Build the torch 2.14 tier's environment (Python 3.11): torch and triton from requirements-torch214.txt,
# everything else pinned as in the 3.11 development stack (requirements-dev.txt, megatron-core 0.16.1 and
# torchtitan 0.3.0 with --no-deps, as the Makefile installs them for .venv).
#
#   .ci/venv-torch214.sh VENV_DIR            e.g. .ci/venv-torch214.sh .venv-torch214
#
# regather itself is not installed: the tier runs with PYTHONPATH=src (like make test-compat), so one
# environment serves any checkout. Idempotent: VENV_DIR/.regather-torch214.stamp holds a sha256 of the pins,
# the interpreter's version and BUILD_REVISION; when it matches, nothing is done. Otherwise VENV_DIR (only
# ever a virtual environment or a new folder) is removed and built again.
# Measured here (2 cores, everything from the local package folders but cuda-bindings): about 3 minutes, 5.6 GB.
set -euo pipefail
BUILD_REVISION=1

[ $# -eq 1 ] || { echo "usage: $0 VENV_DIR" >&2; exit 2; }
cd "$(dirname "$0")/.."
VENV=$1
PINS=requirements-torch214.txt
DEV=requirements-dev.txt
STAMP=$VENV/.regather-torch214.stamp
PY=${PYTHON311:-$(command -v python3.11 || command -v python3)}
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "$0: needs Python 3.11 (torch 2.14.1's local wheel is cp311); set PYTHON311" >&2; exit 2; }

want=$( { cat "$PINS" "$DEV"; "$PY" -VV; echo "build revision $BUILD_REVISION"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "$VENV: up to date ($(cut -c1-12 "$STAMP"))"
    exit 0
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
"${PIP[@]}" install --upgrade pip 'setuptools>=77'
pins=$(grep -E '^[A-Za-z0-9]' "$PINS")
# torch with the CUDA libraries it declares (resolved by pip, from the local folders where they lie)
# shellcheck disable=SC2086
"${PIP[@]}" install $pins
constraints=$VENV/constraints.txt
echo "$pins" > "$constraints"
# the development stack without its own torch/triton pins; the constraints hold torch and triton
grep -v -E '^(torch|triton)==' "$DEV" > "$VENV/requirements-dev.txt"
"${PIP[@]}" install -c "$constraints" -r "$VENV/requirements-dev.txt"
"${PIP[@]}" install --no-deps megatron-core==0.16.1 torchtitan==0.3.0 spmd_types==0.2.3

"$VENV/bin/python" - "$PINS" <<'PYEOF'
import importlib.metadata as md
import importlib.util
import sys

assert importlib.util.find_spec("transformer_engine") is None, "transformer_engine must not be installed"
import torch
import torch.distributed as dist

pins = dict(line.strip().split("==") for line in open(sys.argv[1]) if line[:1].isalnum())
got = {name: md.version(name) for name in pins}
assert all(got[n].split("+")[0] == v for n, v in pins.items()), (got, pins)
assert dist.is_gloo_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, available: "
      f"{torch.cuda.is_available()}), triton {got['triton']}, torchtitan {md.version('torchtitan')}, "
      f"megatron-core {md.version('megatron-core')}")
PYEOF
echo "$want" > "$STAMP"
echo "$VENV: built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"

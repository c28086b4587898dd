#!/usr/bin/env bash
# Build the Python 3.12 environment of the recipe tier and of make test-compat (tests/*/recipes: the real Megatron Bridge 0.6.2
# and megatron-core 0.19.2, installed as packages, on CPU) from the pins in requirements-py312.txt.
#
#   .ci/venv312.sh VENV_DIR            e.g. .ci/venv312.sh .venv312
#
# Python 3.12: $PYTHON312 if set, else python3.12 on PATH, else pyenv's newest 3.12.x.
# Exit status: 0 built (or already up to date); 3 SKIP: no Python 3.12 here (a "SKIP:" line says so;
# callers treat 3 as "tier skipped", anything else non-zero as a failure).
# Idempotent: VENV_DIR/.regather-py312.stamp holds a sha256 of the pins (requirements-py312.txt), the
# interpreter's version and BUILD_REVISION (bump it when the build steps below change); when it
# matches, nothing is done. Otherwise VENV_DIR (only ever a virtual environment or a new folder) is
# removed and built again.
#
# How (design.md §10): PyPI's one cp312 Linux wheel of torch 2.13.0 is the CUDA 13.0 build; it
# runs on CPU once the CUDA library wheels it links are there. Those come --no-deps --no-index from
# the local wheel folders (REGATHER_WHEEL_DIRS, default: /opt/wheels /opt/pypi/files
# /opt/pypi-more/files, the folders pip is configured with here; from the index where none exists);
# everything else comes --no-deps
# from the index, fully pinned, so pip never resolves torch's requirements (no second torch, no
# second CUDA set). Transformer Engine is never installed; the script fails if it finds it.
set -euo pipefail
SKIP_STATUS=3
BUILD_REVISION=1  # not bumped for --no-compile: the same packages, only no .pyc written ahead

usage() { echo "usage: $0 VENV_DIR" >&2; exit 2; }
[ $# -eq 1 ] || usage
cd "$(dirname "$0")/.."
VENV=$1
REQS=requirements-py312.txt
STAMP=$VENV/.regather-py312.stamp

. .ci/common.sh

PY312=$(find_python 3.12) || { echo "SKIP: no Python 3.12 (set PYTHON312, or put python3.12 on PATH, or install it with pyenv): the recipe tier needs it"; exit $SKIP_STATUS; }

want=$( { cat "$REQS"; "$PY312" -VV; echo "build revision $BUILD_REVISION"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "$VENV: up to date ($(cut -c1-12 "$STAMP"))"
    exit 0
fi

section() {  # the pins under "# [name]" in $REQS, up to the next section
    awk -v want="$1" '/^# \[[a-z-]+\]/ { s = $2; gsub(/[][]/, "", s); next }
                      s == want && /^[A-Za-z0-9]/ { print $1 }' "$REQS"
}

local_wheels
if [ ${#LOCAL_WHEELS[@]} -eq 0 ]; then  # the same pinned wheels from the package index: ~3 GB to download
    echo "no local wheel folder (REGATHER_WHEEL_DIRS): the CUDA library wheels come from the package index"
fi

case "$(realpath -m "$VENV")" in
    / | "$(realpath .)" | "$(realpath -m "$HOME")") echo "refusing to use $VENV as the environment folder" >&2; exit 2 ;;
esac
if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
    echo "$VENV exists and is not a virtual environment: not removing it" >&2
    exit 2
fi

start=$(date +%s)
echo "building $VENV with $PY312 ($("$PY312" -V 2>&1)) from $REQS"
rm -rf "$VENV"
"$PY312" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)
export PIP_NO_INPUT=1
# shellcheck disable=SC2046
"${PIP[@]}" install -q --no-compile --no-deps $(section torch)
# shellcheck disable=SC2046
"${PIP[@]}" install -q --no-compile --no-deps "${LOCAL_WHEELS[@]}" $(section cuda)
# shellcheck disable=SC2046
"${PIP[@]}" install -q --no-compile --no-deps $(section torch-users) $(section pure)

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

assert importlib.util.find_spec("transformer_engine") is None, "transformer_engine must not be installed"
import torch
import torch.distributed as dist

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert dist.is_gloo_available()
versions = {p: md.version(p) for p in ("megatron-core", "megatron-bridge", "transformers", "triton")}
assert versions["megatron-core"] == "0.19.2" and versions["megatron-bridge"] == "0.6.2", versions
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA available: {torch.cuda.is_available()}), "
      + ", ".join(f"{k} {v}" for k, v in versions.items()))
EOF
echo "$want" > "$STAMP"
echo "$VENV: built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"

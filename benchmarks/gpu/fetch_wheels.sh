#!/usr/bin/env bash
# Download, on a machine with network, the wheels the GPU machine needs: it has Python 3.12,
# torch 2.11 and triton 3.6 but no megatron-core and no network (docs/design.md §6).
#
#   benchmarks/gpu/fetch_wheels.sh [DIR]        # default DIR: benchmarks/gpu/wheels (git-ignored)
#
# Fetches cp312 manylinux x86_64 wheels, each with --no-deps (the list below is complete):
#   megatron-core==0.16.1   what layer_bench.py (run.sh) builds its layer from
#   numpy, packaging        megatron-core's only run-time needs on that path (the machine has them;
#                           run.sh installs them only when they do not import)
#   setuptools>=77          `pip install -e .` of this repo (kernels.sh's extension build) needs it
#                           for the SPDX license string; installed only when the machine's is older
# Pins follow requirements-dev.txt where it has them. About 20 MB in all; the device call
# carries DIR (benchmarks/gpu/README.md). Idempotent: pip skips files already there.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-benchmarks/gpu/wheels}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
WHEELS=(megatron-core==0.16.1 numpy==2.4.6 packaging==26.4 setuptools==84.2.1)
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$DEST" "${WHEELS[@]}"
# one file per package: two versions of one stop `pip install --no-index` from choosing
for name in megatron_core numpy packaging setuptools; do
  n=$(ls "$DEST"/"$name"-*.whl 2>/dev/null | wc -l)
  if [ "$n" -ne 1 ]; then
    echo "fetch_wheels.sh: expected one $name wheel in $DEST, found $n" >&2
    exit 1
  fi
done
ls -l "$DEST"/*.whl
du -sh "$DEST"

# Sourced by run.sh and kernels.sh: install missing Python packages on the GPU machine, which has
# no network, from the wheels that benchmarks/gpu/fetch_wheels.sh downloaded (carried with the
# device call), into $DEPS, which goes onto PYTHONPATH. Needs PY and ROOT set.
#
#   offline_install $(missing megatron.core:megatron-core==0.16.1 numpy:numpy)
#
# WHEELS (default benchmarks/gpu/wheels) is where the wheels are; nothing is fetched.
WHEELS=${WHEELS:-$ROOT/benchmarks/gpu/wheels}
DEPS=${DEPS:-${TMPDIR:-/tmp}/regather-gpu-deps}

offline_install() {
  [ "$#" -gt 0 ] || return 0
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "offline_deps: $* missing and no wheels in $WHEELS: run benchmarks/gpu/fetch_wheels.sh" \
         "on a machine with network and carry that folder (benchmarks/gpu/README.md)" >&2
    return 2
  fi
  echo "offline_deps: installing $* from $WHEELS into $DEPS"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps \
    --no-compile --upgrade --target "$DEPS" "$@" || return 2
  case ":${PYTHONPATH:-}:" in
    *":$DEPS:"*) ;;
    *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$DEPS" ;;  # still ahead of site-packages
  esac
}

# Print, space-separated, the SPEC of each MODULE[>=VERSION]:SPEC argument whose module does not
# import (or is older than VERSION), all checked in one Python process:
#   missing megatron.core:megatron-core==0.16.1 numpy:numpy "packaging>=24.2:packaging"
missing() {
  "$PY" - "$@" <<'PY' 2>/dev/null
import importlib, sys
out = []
for arg in sys.argv[1:]:
    want, spec = arg.split(":", 1)
    mod, _, version = want.partition(">=")
    try:
        m = importlib.import_module(mod)
        if version:
            from packaging.version import Version
            if Version(m.__version__) < Version(version):
                raise ImportError(f"{mod} {m.__version__} < {version}")
    except Exception:
        out.append(spec)
print(" ".join(out))
PY
}

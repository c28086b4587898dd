# Sourced by the .ci/venv*.sh scripts.
# find_python X.Y prints the first interpreter that runs and is Python X.Y — $PYTHONXY, then
# pythonX.Y on PATH, then pyenv's X.Y.* newest first (a pyenv shim on PATH may not run) — or returns 1.
# local_wheels sets LOCAL_WHEELS to pip's arguments for the local wheel folders (--no-index
# --find-links ...), empty where none exists (the same pinned wheels then come from the index).

is_python() {  # is_python PATH X.Y
    [ -n "$1" ] && [ -x "$1" ] &&
        "$1" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$2')" >/dev/null 2>&1
}

find_python() {  # find_python X.Y
    local c var="PYTHON${1/./}"
    local candidates=("${!var:-}" "$(command -v "python$1" || true)")
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=($(ls -d "$(pyenv root)"/versions/"$1".*/bin/python 2>/dev/null | sort -rV || true))
    fi
    for c in "${candidates[@]}"; do
        is_python "$c" "$1" && { echo "$c"; return 0; }
    done
    return 1
}

local_wheels() {
    local d dirs=()
    for d in ${REGATHER_WHEEL_DIRS:-/opt/wheels /opt/pypi/files /opt/pypi-more/files}; do
        [ -d "$d" ] && dirs+=(--find-links "$d")
    done
    LOCAL_WHEELS=()
    if [ ${#dirs[@]} -gt 0 ]; then LOCAL_WHEELS=(--no-index "${dirs[@]}"); fi
}

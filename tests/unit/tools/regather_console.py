"""The installed ``regather`` console script, for the tests that meet the command as a user does
(tests/unit/tools/test_cli.py, tests/distributed/tools/test_bench_repeat.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def script() -> str | None:
    """The ``regather`` script beside this interpreter, or None where regather is not installed (a
    ``PYTHONPATH=src`` tier has no console script)."""
    try:
        metadata.distribution("regather")
    except metadata.PackageNotFoundError:
        return None
    beside = Path(sys.executable).parent / "regather"
    return str(beside) if beside.exists() else shutil.which("regather")


NOT_INSTALLED = "regather is not installed in this environment (a PYTHONPATH=src tier): no console script"


def regather(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``regather *argv`` as a user would; its exit status, stdout and stderr."""
    found = script()
    if found is None:
        raise RuntimeError(NOT_INSTALLED)
    return subprocess.run([found, *argv], capture_output=True, text=True, timeout=timeout)

"""Which CUDA toolkit the extension ``regather._wgrad_ext`` builds with: one rule, for setup.py and .ci/build-ext.sh.

``$CUDA_HOME`` when it is set (and then that toolkit or an error, never another); otherwise the first of
``/usr/local/cuda`` and the folder above the first ``nvcc`` on ``PATH`` that is a toolkit: ``bin/nvcc`` and
``include/cuda_runtime_api.h``. torch's own guess (``torch.utils.cpp_extension.CUDA_HOME``: ``$CUDA_HOME``,
``$CUDA_PATH``, the folder above the first ``nvcc`` on ``PATH``, then ``/usr/local/cuda``) takes an ``nvcc``
wrapper script in ``/usr/local/bin`` for a toolkit in ``/usr/local``, which holds no CUDA headers, and the
compile fails on ``crt/host_defines.h``; setup.py therefore hands torch the toolkit found here.

Standalone (the standard library only): setup.py loads it by path; ``.ci/build-ext.sh`` runs it,
``python csrc/cuda_toolkit.py``: prints the toolkit's folder (exit 0), or says why none on stderr (exit 3: none
found; exit 2: ``$CUDA_HOME`` is not a toolkit).
"""

from __future__ import annotations

import os
import shutil
import sys

NOT_FOUND, NOT_A_TOOLKIT = 3, 2  # the command's exit statuses


class NoToolkit(Exception):
    """No CUDA toolkit by the rule (module doc); ``status``: the command's exit status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def is_toolkit(folder: str | None) -> bool:
    """``folder`` has ``bin/nvcc`` (executable) and ``include/cuda_runtime_api.h``."""
    return bool(folder) and os.access(os.path.join(folder, "bin", "nvcc"), os.X_OK) and os.path.isfile(
        os.path.join(folder, "include", "cuda_runtime_api.h"))


def candidates(environ=None) -> list[str]:
    """Where the rule looks when ``CUDA_HOME`` is unset, in order."""
    environ = os.environ if environ is None else environ
    found = ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    if nvcc:
        found.append(os.path.dirname(os.path.dirname(nvcc)))
    return found


def find_cuda_home(environ=None) -> str:
    """The CUDA toolkit's folder by the rule (module doc), or :class:`NoToolkit` saying why none."""
    environ = os.environ if environ is None else environ
    asked = environ.get("CUDA_HOME")
    if asked:
        if is_toolkit(asked):
            return asked
        raise NoToolkit(f"CUDA_HOME={asked} is not a CUDA toolkit (no bin/nvcc or include/cuda_runtime_api.h): "
                        "set CUDA_HOME to the toolkit's folder", NOT_A_TOOLKIT)
    looked = candidates(environ)
    for folder in looked:
        if is_toolkit(folder):
            return folder
    raise NoToolkit(f"no CUDA toolkit found: none of {', '.join(looked)} has bin/nvcc and include/cuda_runtime_api.h "
                    "(/usr/local/cuda, then the folder above the first nvcc on PATH); set CUDA_HOME to the "
                    "toolkit's folder", NOT_FOUND)


def main() -> int:
    try:
        print(find_cuda_home())
    except NoToolkit as exc:
        print(exc, file=sys.stderr)
        return exc.status
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Optional build of the CUDA extension ``regather._wgrad_ext`` (``csrc/``).

All package metadata lives in ``pyproject.toml``; this file only adds
``ext_modules`` when asked to, so a plain (CPU) ``pip install -e .`` never
imports torch here and never compiles anything.

Build the extension (needs a CUDA build of torch and nvcc / CUDA_HOME; torch
must be importable, hence no build isolation)::

    REGATHER_BUILD_EXT=1 pip install --no-build-isolation --no-deps -e .

``TORCH_CUDA_ARCH_LIST`` (e.g. ``"9.0"``) selects the targets as usual. If
``REGATHER_BUILD_EXT=1`` is set but torch has no CUDA or no CUDA toolkit is
found, the build stops with an error saying which (an explicit request should
not silently produce a package without the extension).
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

_TRUTHY = {"1", "true", "yes", "on"}


def _cublas_link_args(cuda_home: str) -> tuple[list[str], list[str], list[str]]:
    """(library_dirs, libraries, extra_link_args) for libcublas.

    Prefer the toolkit's ``lib64/libcublas.so``; otherwise the pip wheel's
    (``nvidia/cublas/lib`` or ``nvidia/cu13/lib``), which ships only the
    versioned ``libcublas.so.N`` and so needs ``-l:`` with the exact name.
    """
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        d = os.path.join(cuda_home, sub)
        if os.path.exists(os.path.join(d, "libcublas.so")):
            return [d], ["cublas"], []
    try:
        import nvidia  # the CUDA wheels torch depends on

        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        for pattern in ("cublas/lib/libcublas.so*", "cu*/lib/libcublas.so*"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                d, name = os.path.split(hits[0])
                return [d], [], [f"-l:{name}", f"-Wl,-rpath,{d}"]
    return [], ["cublas"], []  # let the linker search its default paths


def _ext_modules() -> tuple[list, dict]:
    if os.environ.get("REGATHER_BUILD_EXT", "").strip().lower() not in _TRUTHY:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        sys.exit(
            f"REGATHER_BUILD_EXT=1 but torch is not importable ({exc}); "
            "install a CUDA torch first and build with --no-build-isolation"
        )
    if torch.version.cuda is None:
        sys.exit(f"REGATHER_BUILD_EXT=1 but torch {torch.__version__} has no CUDA support")
    if CUDA_HOME is None:
        sys.exit("REGATHER_BUILD_EXT=1 but no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")
    lib_dirs, libs, link_args = _cublas_link_args(CUDA_HOME)
    ext = CUDAExtension(
        name="regather._wgrad_ext",
        sources=["csrc/wgrad_ext.cpp"],
        library_dirs=lib_dirs,
        libraries=libs,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
        extra_link_args=link_args,
    )
    return [ext], {"build_ext": BuildExtension}


_ext, _cmdclass = _ext_modules()
setup(ext_modules=_ext, cmdclass=_cmdclass)

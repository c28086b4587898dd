"""Optional build of the CUDA extension ``regather._wgrad_ext`` (``csrc/``).

All package metadata lives in ``pyproject.toml``; this file only adds
``ext_modules`` when asked to, so a plain (CPU) ``pip install -e .`` never
imports torch here and never compiles anything.

Build the extension (needs a CUDA build of torch and a CUDA toolkit; torch
must be importable, hence no build isolation)::

    REGATHER_BUILD_EXT=1 pip install --no-build-isolation -e .

The toolkit is found by one rule, ``csrc/cuda_toolkit.py`` (``.ci/build-ext.sh``
uses the same): ``$CUDA_HOME`` if set, else the first of ``/usr/local/cuda`` and
the folder above the first ``nvcc`` on ``PATH`` with ``bin/nvcc`` and
``include/cuda_runtime_api.h``; torch is handed that toolkit (its own guess takes
an ``nvcc`` wrapper script's folder for one). ``TORCH_CUDA_ARCH_LIST`` (e.g.
``"9.0"``) selects the targets as usual. If ``REGATHER_BUILD_EXT=1`` is set but
torch has no CUDA or no CUDA toolkit is found, the build stops with an error
saying which (an explicit request should not silently produce a package without
the extension).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from setuptools import setup

_TRUTHY = {"1", "true", "yes", "on"}


def _nvidia_wheel_roots() -> list[str]:
    """The folders of the ``nvidia`` namespace package (the CUDA library wheels torch depends on)."""
    try:
        import nvidia

        return list(nvidia.__path__)
    except ImportError:
        return []


# Headers torch's ATen/cuda headers include (CUDAContextLight.h: cuBLAS, cuBLASLt, cuSPARSE, cuSOLVER)
# and the extension includes (cublas_v2.h): a toolkit without the CUDA math libraries (nvcc + cudart
# only, as on a machine that takes those libraries from pip wheels) lacks them.
_LIBRARY_HEADERS = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")


def _wheel_include_args(cuda_home: str) -> list[str]:
    """``-idirafter`` flags for the CUDA wheels' header folders, when the toolkit lacks a header.

    ``-idirafter``: searched after every ``-I`` folder (the toolkit's own ``include`` among them),
    so a header the toolkit has is always the toolkit's; the wheels fill in only what is missing.
    """
    include = os.path.join(cuda_home, "include")
    missing = [h for h in _LIBRARY_HEADERS if not os.path.exists(os.path.join(include, h))]
    if not missing:
        return []
    dirs = []
    for root in _nvidia_wheel_roots():
        for header in missing:  # nvidia/cu13/include (CUDA 13 wheels), nvidia/<library>/include (CUDA 12)
            for hit in sorted(glob.glob(os.path.join(root, "*", "include", header))):
                if os.path.dirname(hit) not in dirs:
                    dirs.append(os.path.dirname(hit))
    found = {h for h in missing for d in dirs if os.path.exists(os.path.join(d, h))}
    if len(found) < len(missing):
        sys.exit(
            f"REGATHER_BUILD_EXT=1 but {sorted(set(missing) - found)} are neither in {include} "
            "(CUDA_HOME) nor in the nvidia CUDA wheels: install the CUDA math libraries' headers"
        )
    return [f"-idirafter{d}" for d in dirs]


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
    for root in _nvidia_wheel_roots():
        for pattern in ("cublas/lib/libcublas.so*", "cu*/lib/libcublas.so*"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                d, name = os.path.split(hits[0])
                return [d], [], [f"-l:{name}", f"-Wl,-rpath,{d}"]
    return [], ["cublas"], []  # let the linker search its default paths


def _cuda_home() -> str:
    """The toolkit by ``csrc/cuda_toolkit.py``'s rule (loaded by path: setup.py imports no package), or exit."""
    spec = importlib.util.spec_from_file_location(
        "regather_cuda_toolkit", os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cuda_toolkit.py"))
    rule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rule)
    try:
        return rule.find_cuda_home()
    except rule.NoToolkit as exc:
        sys.exit(f"REGATHER_BUILD_EXT=1 but {exc}")


def _ext_modules() -> tuple[list, dict]:
    if os.environ.get("REGATHER_BUILD_EXT", "").strip().lower() not in _TRUTHY:
        return [], {}
    cuda_home = _cuda_home()
    os.environ["CUDA_HOME"] = cuda_home  # torch reads it when cpp_extension is first imported
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        sys.exit(
            f"REGATHER_BUILD_EXT=1 but torch is not importable ({exc}); "
            "install a CUDA torch first and build with --no-build-isolation"
        )
    if torch.version.cuda is None:
        sys.exit(f"REGATHER_BUILD_EXT=1 but torch {torch.__version__} has no CUDA support")
    cpp_extension.CUDA_HOME = cuda_home  # imported before with another guess: the rule's toolkit all the same
    BuildExtension, CUDAExtension = cpp_extension.BuildExtension, cpp_extension.CUDAExtension
    lib_dirs, libs, link_args = _cublas_link_args(cuda_home)
    ext = CUDAExtension(
        name="regather._wgrad_ext",
        sources=["csrc/wgrad_ext.cpp"],
        library_dirs=lib_dirs,
        libraries=libs,
        extra_compile_args={"cxx": ["-O3", *_wheel_include_args(cuda_home)], "nvcc": ["-O3"]},
        extra_link_args=link_args,
    )
    return [ext], {"build_ext": BuildExtension}


_ext, _cmdclass = _ext_modules()
setup(ext_modules=_ext, cmdclass=_cmdclass)

"""Triton kernels compiled ahead of time for a stated GPU target, on a machine without a GPU.

A launch ``kernel[grid](*args, **meta)`` does three things: it asks Triton's active driver for the
device, stream and target; it specializes the arguments (dtypes, each pointer's 16-byte alignment,
each integer's divisibility by 16 or being 1) and compiles that specialization for the target —
Triton source to TTIR, TTGIR, LLVM IR, PTX, and ``ptxas`` to a cubin; then it loads the cubin and
launches it. ``JITFunction.warmup(*args, grid=..., **meta)`` is the same call without the last
step. :func:`compile_launches` runs it under a driver that knows only the target
(:class:`TargetOnly`), so every step up to the cubin runs as on that GPU, from the same arguments;
nothing is loaded. Meta tensors stand in for the GPU's: a specialization reads a tensor's dtype and
``data_ptr() % 16`` only, and a meta view's ``data_ptr()`` is its byte offset, as a CUDA view's
is the allocator's base (at least 256-byte aligned) plus that offset.

Read from triton 3.6.0 and 3.8.0 (the same in both): ``triton.runtime.driver.set_active`` and the
driver's ``_active`` (the driver to restore, ``None`` before first use), the three driver methods a
warmup calls (:class:`TargetOnly`), ``JITFunction.warmup`` returning the ``CompiledKernel`` whose
``metadata`` (``target``, ``shared``, ``num_warps``, ``name``) and ``asm`` (``ptx``, ``cubin``) are
read below. A Triton version that moves one of them fails here, in the test, naming it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

__all__ = ["SM90", "SM90_MAX_SHARED", "Compiled", "TargetOnly", "compile_launches", "compiling_for"]

#: Hopper, as the GPU machine's H100 / H200 report it (compute capability 9.0, 32-thread warps)
SM90 = ("cuda", 90, 32)
#: the most shared memory one block may use on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KiB):
#: a launch asking more fails with triton's OutOfResources before it runs
SM90_MAX_SHARED = 232448


class TargetOnly:
    """A Triton driver that knows its target and nothing else: what a compile asks of a driver."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def compiling_for(backend: str, arch: int, warp_size: int):
    """Triton's active driver replaced by :class:`TargetOnly` for ``GPUTarget(backend, arch, warp_size)``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    previous = driver._active
    driver.set_active(TargetOnly(GPUTarget(backend, arch, warp_size)))
    try:
        yield
    finally:
        driver.set_active(previous)


@dataclass(frozen=True)
class Compiled:
    """One launch compiled: what it was, and what Triton made of it."""

    launch: Any  # the launch (regather.ops.wgrad_triton.Launch)
    arch: int
    shared: int  # bytes of shared memory one block uses
    num_warps: int
    name: str
    ptx: str
    cubin: bytes


def compile_launches(launches, kernels: dict[str, Any], target: tuple = SM90) -> list[Compiled]:
    """Compile each launch (``kernels[launch.kernel]`` with ``launch.args`` / ``launch.meta``) for
    ``target`` without running it. Launches that specialize alike are compiled once (the kernel's
    own cache); a compile error is raised as Triton raises it, naming the launch."""
    out = []
    with compiling_for(*target):
        for launch in launches:
            try:
                kernel = kernels[launch.kernel].warmup(*launch.args, grid=launch.grid, **launch.meta)
            except Exception as exc:
                raise RuntimeError(f"{launch.kernel} {launch.meta} did not compile for {target}: {exc}") from exc
            md = kernel.metadata
            out.append(Compiled(launch, md.target.arch, md.shared, md.num_warps, md.name,
                                kernel.asm["ptx"], kernel.asm["cubin"]))
    return out

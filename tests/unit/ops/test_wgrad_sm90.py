"""The Triton kernels compiled for Hopper (sm_90) here, without a GPU: every launch the GPU scripts make.

benchmarks/gpu/bench_wgrad.py (timed shapes, correctness edge cases, config sweep) and overlap.py launch
``regather.ops.wgrad_triton``'s two kernels on an H100 / H200; a Triton source error, an op the
target does not support, or a configuration asking more shared memory than a Hopper block has would
cost that rare GPU run. Here each launch is planned from the scripts' own constants by the code that
launches it (``plan_launches``, meta tensors in place of CUDA ones) and compiled for
``GPUTarget("cuda", 90, 32)`` through Triton's own launch path up to the cubin
(:mod:`tests.harness.triton_aot`); nothing runs. Skips without triton or its CUDA backend, and under
``TRITON_INTERPRET=1`` (Triton's interpreter compiles nothing).

Runs on both stacks: triton 3.6.0 (``make test``; the GPU machine's Triton, benchmarks/gpu/README.md)
and triton 3.8.0 (``make test-torch214``; what torch 2.14 installs).
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import struct

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends import backends as _triton_backends  # noqa: E402

if "nvidia" not in _triton_backends:
    pytest.skip(f"triton {triton.__version__} has no CUDA backend", allow_module_level=True)
_knobs = getattr(triton, "knobs", None)  # triton >= 3.4 reads TRITON_INTERPRET through its knobs
if _knobs.runtime.interpret if _knobs is not None else os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("TRITON_INTERPRET is set: Triton interprets kernels on the CPU and compiles none (a jit "
                "function's warmup returns None), and this test checks what Triton's sm_90 compiler makes",
                allow_module_level=True)

from tests.harness.triton_aot import SM90, SM90_MAX_SHARED, compile_launches  # noqa: E402

from regather.ops.wgrad_triton import Launch, choose_config, jit_kernels, plan_launches  # noqa: E402

# about 60 compiles in a row, ~30 s of CPU on this machine's 2 cores; a loaded machine must not fail it
pytestmark = pytest.mark.timeout(900)

#: SMs of the GPU machine's H100 (SXM) and H200: the count choose_config sizes split-K with there
HOPPER_SMS = 132
_GPU_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "gpu")
_EM_CUDA = 190  # ELF e_machine of a cubin


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """Compile here, not from a cache another run filled."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"regather_gpu_{name}", os.path.join(_GPU_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _plan(main_grad, grad_output, input, **overrides) -> list[Launch]:
    """What ``wgrad_accumulate_triton(main_grad, grad_output, input, **overrides)`` launches on a Hopper GPU."""
    K, M = grad_output.shape
    config = choose_config(K, M, input.shape[1], input.dtype, num_sms=HOPPER_SMS, **overrides)
    return plan_launches(main_grad, grad_output, input, config, interpret=False)


def gpu_script_launches() -> list[Launch]:
    """Every Triton launch of bench_wgrad.py (default arguments) and overlap.py on one H100 / H200."""
    bench, overlap = _script("bench_wgrad"), _script("overlap")
    fp32 = torch.float32
    launches = []
    for r, h, K in itertools.product(bench.RANKS, bench.HIDDEN, bench.TOKENS):  # timed, bf16
        launches += _plan(_meta(r, h, dtype=fp32), _meta(K, r), _meta(K, h))
    K = max(bench.TOKENS)
    for (r, h), candidate in itertools.product(itertools.product(bench.RANKS, bench.HIDDEN), bench.SWEEP):
        launches += _plan(_meta(r, h, dtype=fp32), _meta(K, r), _meta(K, h),
                          **bench.sweep_overrides(K, r, h, candidate, HOPPER_SMS))
    # the edge cases go through wgrad_accumulate_(..., backend="triton"), which flattens to [K, M] / [K, N]
    for (K, M, N, _lead, _note), dtype in itertools.product(bench.EDGE_CASES, bench.EDGE_DTYPES):
        main_grad = _meta(M * N + bench.EDGE_OFFSET, dtype=fp32)[bench.EDGE_OFFSET:].view(M, N)
        launches += _plan(main_grad, _meta(K, M, dtype=dtype), _meta(K, N, dtype=dtype))
    # overlap.py's dA: main_grad [r/t, h] fp32 += mid_grad[:, :r/t]ᵀ @ x_full, bf16, K = s*b
    p = {k: v.default for k, v in inspect.signature(overlap.profile_comm_overlap).parameters.items()}
    K, M, h = p["s"] * p["b"], max(1, p["r"] // p["t"]), p["h"]
    launches += _plan(_meta(M, h, dtype=fp32), _meta(K, M), _meta(K, h))
    return launches


def _elf_arch(cubin: bytes) -> tuple[int, int]:
    """(e_machine, SM) of a 64-bit CUDA ELF. The SM is in e_flags: its low byte in CUDA's ELF ABI
    version 7 (ptxas 12.8 / 12.9 of triton 3.6 / 3.8: e_flags 0x5a0d5a for sm_90a), its second byte
    in version 8 (ptxas 13.4 of triton 3.9: 0x9005a04) — read from those cubins."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2, cubin[:8]
    abi_version, flags = cubin[8], struct.unpack_from("<I", cubin, 0x30)[0]
    return struct.unpack_from("<H", cubin, 0x12)[0], (flags >> 8 if abi_version >= 8 else flags) & 0xFF


def test_every_triton_launch_of_the_gpu_scripts_compiles_for_sm90():
    launches = gpu_script_launches()
    compiled = compile_launches(launches, jit_kernels(False, cached=False), SM90)
    assert len(compiled) == len(launches)
    # what was covered: both kernels, every input dtype, both epilogues (into main_grad / the workspace)
    splitk = [c.launch for c in compiled if c.launch.kernel == "wgrad_splitk"]
    assert {c.launch.kernel for c in compiled} == {"wgrad_splitk", "splitk_reduce"}
    assert {launch.args[0].dtype for launch in splitk} == {torch.float32, torch.float16, torch.bfloat16}
    assert {launch.meta["ACCUMULATE"] for launch in splitk} == {True, False}
    assert {launch.meta["num_warps"] for launch in splitk} == {4, 8}
    too_big = []
    for c in compiled:
        assert c.arch == 90 and _elf_arch(c.cubin) == (_EM_CUDA, 90), (c.launch.meta, _elf_arch(c.cubin))
        assert ".target sm_90a" in c.ptx and f".entry {c.name}(" in c.ptx, c.name
        assert c.num_warps == c.launch.meta["num_warps"]
        if c.shared > SM90_MAX_SHARED:
            too_big.append((c.launch.kernel, c.launch.meta, c.shared))
    assert not too_big, f"these launches need more shared memory than an sm_90 block has ({SM90_MAX_SHARED} B): {too_big}"


def _typo(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.full((BLOCK,), 1.0, tl.float32).to(tl.floatt32))


def test_the_compile_fails_where_a_hopper_launch_would():
    """The check can fail: a source error raises, and a tile too large for a Hopper block is seen."""
    with pytest.raises(RuntimeError, match="did not compile for") as info:
        compile_launches([Launch("typo", (1,), (_meta(64, dtype=torch.float32),), dict(BLOCK=64))],
                         {"typo": triton.jit(_typo)})
    assert "floatt32" in str(info.value.__cause__)

    big = _plan(_meta(64, 4096, dtype=torch.float32), _meta(8192, 64), _meta(8192, 4096),
                block_n=256, block_k=128, num_stages=4, split_k=1)
    (compiled,) = compile_launches(big, jit_kernels(False, cached=False))
    assert compiled.shared > SM90_MAX_SHARED, compiled.shared  # triton would raise OutOfResources at launch

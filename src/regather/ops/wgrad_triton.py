"""Split-K Triton kernel for ``main_grad += grad_output^T @ input`` (fp32 accumulate).

The LoRA-A weight gradient of a column-parallel adapter is a *tall-skinny*
product: the reduction dimension ``K = s*b`` (tokens) is long, the output is
small.

=============  ===========  ======================  ==========================
tensor         shape        dtype                   role
=============  ===========  ======================  ==========================
``main_grad``  ``[M, N]``   fp32                    accumulated in place
``grad_out``   ``[K, M]``   bf16 / fp16 / fp32      ``dmid``: M = LoRA rank r
``input``      ``[K, N]``   same as ``grad_out``    ``x_full``: N = hidden h
=============  ===========  ======================  ==========================

Equation (``S`` = number of K splits, ``K_s`` the rows of split ``s``)::

    P_s[m, n]       = sum_{k in K_s} float32(grad_out[k, m]) * float32(input[k, n])
    main_grad[m, n] = main_grad[m, n] + (P_0 + P_1 + ... + P_{S-1})[m, n]

Every product of two bf16/fp16 values is exact in fp32 and all sums are fp32,
so the only rounding is fp32 summation; no full-size fp32 copy of either input
is made (tiles are loaded in their own dtype and fed to ``tl.dot`` with an fp32
accumulator).

Why split-K: with M = 4..64 and N <= 8192 the output has at most
``ceil(M/BM) * ceil(N/BN)`` tiles -- 64 tiles for M=64, N=8192, BN=128 -- which
is fewer programs than an H100/H200 has SMs (132), and each of them would walk
all of K (tens of thousands of rows) alone. Splitting K into ``S`` chunks gives
``tiles * S`` independent programs, enough to fill the machine, and the
operation is memory-bound (arithmetic intensity about ``2*M*N / (2*(M+N))``
flop/byte, i.e. < 64 for bf16), so occupancy is what matters.

How the partials are combined: a *two-stage deterministic reduction*, not
atomics. Stage 1 writes each split's fp32 tile into a workspace ``[S, M, N]``;
stage 2 sums the ``S`` partials in a fixed order and adds them to
``main_grad``. Reasons: (1) results are bit-reproducible run to run, which the
project's strategy-parity checks rely on (gather vs regather are compared with
``rtol=0, atol=0`` and both call this kernel); fp32 ``atomic_add`` ordering is
not deterministic. (2) The workspace is small because M is small:
``S*M*N*4`` bytes (e.g. 8*64*8192*4 = 16 MiB) against ``K*(M+N)*2`` bytes of
input read (541 MB at K=32768, N=8192). With ``S == 1`` stage 1 adds straight
into ``main_grad`` and no workspace is allocated.

Interpreter note: under ``TRITON_INTERPRET=1`` bf16 arithmetic is silently
wrong unless values are converted with ``.to(tl.float32)`` right after
``tl.load``; the kernel does so when ``UPCAST`` is set, which the launcher sets
whenever the interpreter is active (and for fp32 inputs, where it is a no-op).
The kernels call no ``@triton.jit`` helper from triton's standard library (such
as ``tl.cdiv`` or ``tl.zeros``; ``tl.full`` and other builtins are fine): those
are wrapped once, when ``triton.language`` is imported,
so they would stay compiled-mode functions if triton was imported before
``TRITON_INTERPRET=1`` was set; our own kernels are wrapped per mode (below).
On a GPU bf16/fp16 tiles go to ``tl.dot`` unconverted (tensor cores, fp32
accumulator); fp32 inputs use ``input_precision="ieee"`` (no TF32), matching
PyTorch's default for fp32 matmul.

``wgrad_accumulate_ref`` below is the plain-PyTorch reference (it upcasts the
full inputs -- fine for a reference, not for the kernel).

Triton is imported lazily: importing this module does not import triton, and
kernels are JIT-wrapped on first use, separately for interpreter and compiled
mode (``triton.jit`` picks its mode from ``TRITON_INTERPRET`` at wrap time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Launch",
    "WgradConfig",
    "choose_config",
    "jit_kernels",
    "plan_launches",
    "wgrad_accumulate_ref",
    "wgrad_accumulate_triton",
]


def wgrad_accumulate_ref(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """Reference: ``main_grad += grad_output^T @ input`` in ``main_grad``'s dtype.

    ``grad_output: [K, M]``, ``input: [K, N]``, ``main_grad: [M, N]``. Upcasts
    the whole inputs to ``main_grad.dtype`` (a full-size copy), then one
    ``addmm_``. Pass an fp64 ``main_grad`` for an fp64 reference.
    """
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), input.to(main_grad.dtype))


@dataclass(frozen=True)
class WgradConfig:
    """Launch configuration of the split-K kernel.

    Each of the ``split_k`` programs along grid axis 1 walks ``k_iters``
    blocks of ``block_k`` rows, so ``split_k * k_iters * block_k >= K``.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_iters: int
    num_warps: int = 4
    num_stages: int = 3


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


def choose_config(
    K: int,
    M: int,
    N: int,
    dtype: torch.dtype,
    *,
    num_sms: int,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_k_iters: int = 8,
) -> WgradConfig:
    """Heuristic launch configuration; any field can be forced.

    Defaults: ``block_m`` = next power of two >= M within 16..64 (a rank-64
    LoRA is one M tile), ``block_n`` = 128, ``block_k`` = 64 (32 for fp32).
    The split count aims at about ``2 * num_sms`` programs; the per-program
    trip count ``k_iters`` is then rounded up to a power of two (and kept
    >= ``min_k_iters`` so each program's epilogue stays amortised), which
    bounds the number of compiled variants over all K; ``split_k`` is
    recomputed from it so that no split is empty. A forced ``split_k`` is
    honoured exactly (``k_iters = ceil(K blocks / split_k)``, not rounded).
    """
    bm = block_m or min(64, max(16, _next_pow2(M)))
    bn = block_n or 128
    bk = block_k or (32 if dtype == torch.float32 else 64)
    tiles = math.ceil(M / bm) * math.ceil(N / bn)
    k_blocks = max(1, math.ceil(K / bk))
    if split_k is None:
        want = max(1, math.ceil(2 * num_sms / tiles))
        k_iters = _next_pow2(max(math.ceil(k_blocks / want), min(min_k_iters, k_blocks)))
    else:
        k_iters = math.ceil(k_blocks / max(1, min(split_k, k_blocks)))
    split = math.ceil(k_blocks / k_iters)
    return WgradConfig(
        block_m=bm,
        block_n=bn,
        block_k=bk,
        split_k=split,
        k_iters=k_iters,
        num_warps=num_warps or 4,
        num_stages=num_stages or (3 if dtype == torch.float32 else 4),
    )


# --------------------------------------------------------------------------
# Kernels (plain functions; wrapped with triton.jit lazily in jit_kernels()).
# `tl` is bound in this module's globals by jit_kernels() before the first wrap;
# the `tl.constexpr` annotations are strings until then (PEP 563).
# --------------------------------------------------------------------------

tl: Any = None


def _wgrad_splitk_kernel(
    go_ptr,
    x_ptr,
    out_ptr,
    K,
    M,
    N,
    stride_gk,
    stride_gm,
    stride_xk,
    stride_xn,
    stride_os,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program = one [BLOCK_M, BLOCK_N] output tile x one K split.

    A split covers ``K_ITERS * BLOCK_K`` rows; rows >= K are masked out. The
    trip count is a compile-time constant (from a small power-of-two set, see
    ``choose_config``) rather than a runtime bound: it bounds recompiles, and
    the triton 3.6 interpreter cannot iterate over a runtime bound with
    numpy >= 2.4 (``int()`` of a 1-element array).

    ACCUMULATE: out[m, n] += P (out is main_grad, used when split_k == 1);
    otherwise out[split, m, n] = P (workspace, reduced by _splitk_reduce_kernel).
    """
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N  # not tl.cdiv: see "Interpreter note"
    pid_m = pid_mn // num_pid_n
    pid_n = pid_mn % num_pid_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # int64: k_start * stride_xk can pass 2**31 for long sequences at h=8192.
    k_start = (pid_k * (K_ITERS * BLOCK_K)).to(tl.int64)

    # A = grad_out^T tile [BLOCK_M, BLOCK_K]; B = input tile [BLOCK_K, BLOCK_N].
    a_ptrs = go_ptr + offs_m[:, None] * stride_gm + (k_start + offs_k)[None, :] * stride_gk
    b_ptrs = x_ptr + (k_start + offs_k)[:, None] * stride_xk + offs_n[None, :] * stride_xn

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for i in range(0, K_ITERS):
        mask_k = (k_start + i * BLOCK_K + offs_k) < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # interpreter: bf16 maths is wrong unless converted right here
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_gk
        b_ptrs += BLOCK_K * stride_xk

    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        old = tl.load(o_ptrs, mask=mask, other=0.0)
        tl.store(o_ptrs, old + acc, mask=mask)
    else:
        o_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, acc, mask=mask)


def _splitk_reduce_kernel(
    ws_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[m, n] += sum_s ws[s, m, n], s in increasing order (deterministic).

    ``ws`` is a contiguous ``[SPLIT_K, M, N]`` fp32 workspace; one program
    handles ``BLOCK`` consecutive elements of the flattened ``M*N`` output.
    """
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    o_ptrs = out_ptr + m * stride_om + n * stride_on
    old = tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, old + acc, mask=mask)


_KERNELS = {"wgrad_splitk": _wgrad_splitk_kernel, "splitk_reduce": _splitk_reduce_kernel}
_JITTED: dict[bool, dict[str, Any]] = {}


def jit_kernels(interpret: bool, *, cached: bool = True) -> dict[str, Any]:
    """The kernels by name, ``triton.jit``-wrapped for the interpreter or for a GPU.

    Cached per mode; ``cached=False`` wraps them afresh (a wrapper keeps a compiled kernel per
    device and target: an ahead-of-time compile for another target must not share it)."""
    if cached and interpret in _JITTED:
        return _JITTED[interpret]
    import triton
    import triton.language as _tl

    global tl  # the kernels resolve `tl` from this module's globals
    tl = _tl
    # PEP 563 keeps annotations as strings; the interpreter recognises
    # constexpr parameters only by the real type, so substitute it.
    for fn in _KERNELS.values():
        fn.__annotations__ = {k: (_tl.constexpr if v == "tl.constexpr" else v) for k, v in fn.__annotations__.items()}
    jitted = {name: triton.jit(fn) for name, fn in _KERNELS.items()}
    if cached:
        _JITTED[interpret] = jitted
    return jitted


def _interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: only the shape of the grid matters


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``jit_kernels(...)[kernel][grid](*args, **meta)``."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple
    meta: dict  # the constexpr arguments and the launch options (num_warps, num_stages)


def plan_launches(
    main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor, config: WgradConfig, *, interpret: bool
) -> list[Launch]:
    """The launches ``wgrad_accumulate_triton`` makes for these tensors and this configuration.

    Allocates the split-K workspace on ``main_grad``'s device (meta tensors work: what a launch
    compiles depends on the dtypes, the pointers' alignment and the integers' divisibility only).
    """
    K, M = grad_output.shape
    N = input.shape[1]
    if K == 0 or M == 0 or N == 0:
        return []
    upcast = interpret or input.dtype == torch.float32
    precision = "ieee" if input.dtype == torch.float32 else "tf32"
    tiles = triton_cdiv(M, config.block_m) * triton_cdiv(N, config.block_n)
    split = config.split_k
    if split == 1:
        out, stride_os = main_grad, 0
    else:
        out = torch.empty((split, M, N), dtype=torch.float32, device=main_grad.device)
        stride_os = out.stride(0)
    args = (grad_output, input, out, K, M, N, grad_output.stride(0), grad_output.stride(1), input.stride(0),
            input.stride(1), stride_os, out.stride(-2), out.stride(-1))
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, K_ITERS=config.k_iters,
                ACCUMULATE=split == 1, UPCAST=upcast, DOT_PRECISION=precision,
                num_warps=config.num_warps, num_stages=config.num_stages)
    launches = [Launch("wgrad_splitk", (tiles, split), args, meta)]
    if split > 1:
        block = 1024
        launches.append(Launch(
            "splitk_reduce", (triton_cdiv(M * N, block),),
            (out, main_grad, M, N, main_grad.stride(0), main_grad.stride(1)),
            dict(SPLIT_K=split, BLOCK=block, num_warps=4)))
    return launches


def wgrad_accumulate_triton(
    main_grad: torch.Tensor,
    grad_output: torch.Tensor,
    input: torch.Tensor,
    *,
    config: WgradConfig | None = None,
    **overrides: int,
) -> WgradConfig:
    """``main_grad[M, N] += grad_output[K, M]^T @ input[K, N]`` via Triton.

    Inputs must already be validated and 2-D (see ``regather.ops.wgrad``);
    any strides are accepted. ``config`` or keyword overrides (``block_m``,
    ``block_n``, ``block_k``, ``split_k``, ``num_warps``, ``num_stages``)
    replace the heuristic. Returns the configuration used.
    """
    K, M = grad_output.shape
    N = input.shape[1]
    if config is None:
        config = choose_config(K, M, N, input.dtype, num_sms=_num_sms(input.device), **overrides)
    interpret = _interpreting()
    launches = plan_launches(main_grad, grad_output, input, config, interpret=interpret)
    if not launches:
        return config
    kernels = jit_kernels(interpret)
    with _device_guard(main_grad.device):
        for launch in launches:
            kernels[launch.kernel][launch.grid](*launch.args, **launch.meta)
    return config


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _NullGuard:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _device_guard(device: torch.device) -> Any:
    """Launch on ``device`` (Triton launches on the *current* CUDA device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return _NullGuard()

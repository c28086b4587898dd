"""Fused weight-gradient accumulation into an fp32 ``main_grad``: entry point + dispatch.

``wgrad_accumulate_(main_grad, grad_output, input)`` computes, in place::

    main_grad[M, N] += grad_output[K, M]^T @ input[K, N]      (fp32 accumulation)

=================  =================  ====================  =====================================
argument           shape              dtype                 notes
=================  =================  ====================  =====================================
``main_grad``      ``[M, N]``         fp32 (bf16 / fp16)    updated in place; ``stride(-1) == 1``
``grad_output``    ``[..., M]``       bf16 / fp16 / fp32    leading dims flattened to K
``input``          ``[..., N]``       same as grad_output   same leading dims (or same K)
=================  =================  ====================  =====================================

For LoRA-A under TP+SP: ``M = r/t`` (rank shard), ``N = h``, ``K = s*b``.

A bf16 / fp16 ``main_grad`` (megatron DDP with ``grad_reduce_in_fp32=False``)
is accepted too: the product is accumulated in fp32 by the chosen backend into
an ``M x N`` fp32 temporary (zero-initialised, ``r*h`` elements: small), which is
added to ``main_grad`` once -- one rounding to the low-precision dtype, as
apex's ``wgrad_gemm_accum_fp16`` (a GEMM with fp16 C and ``beta = 1``) does.

Backends, picked per device type in this order (``wgrad_backend``):

``"extension"``  ``regather._wgrad_ext`` (``csrc/``): one cuBLAS ``GemmEx`` with fp32 C
                 and ``beta = 1`` -- what Megatron/apex's fused wgrad does. CUDA only;
                 built only with ``REGATHER_BUILD_EXT=1`` (see ``setup.py``).
``"triton"``     split-K Triton kernel (``wgrad_triton.py``). CUDA, or CPU under
                 ``TRITON_INTERPRET=1`` *when explicitly requested* (slow; for tests).
``"torch"``      ``wgrad_accumulate_torch`` below. Always available; the default on CPU.
                 CUDA: ``torch.mm(..., out_dtype=float32)`` + ``add_`` where torch has it;
                 else (and on CPU) ``addmm_`` on fp32 upcasts of K-chunks of the inputs.

No backend makes a full-size fp32 copy of the inputs: the chunked torch path
copies one K-chunk at a time (at most ``_TORCH_CHUNK_BYTES`` of fp32
temporaries); fp32 inputs are used as they are.

Selection: a ``backend=`` argument, else env ``REGATHER_WGRAD_BACKEND``
(``auto`` | ``extension`` | ``triton`` | ``torch``), else ``auto``. A requested
backend that cannot run falls back along extension > triton > torch. Each
distinct decision is logged once (logger ``regather.ops``) with its reason:
INFO when automatic, WARNING when a requested backend was not available.
Optional imports (triton, the extension) happen on first use only, so
``import regather.ops`` works without either.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

import torch

__all__ = ["BACKENDS", "wgrad_accumulate_", "wgrad_accumulate_torch", "wgrad_backend"]

logger = logging.getLogger("regather.ops")

BACKENDS = ("extension", "triton", "torch")
ENV_BACKEND = "REGATHER_WGRAD_BACKEND"
_REQUESTS = ("auto",) + BACKENDS
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_CHUNK_BYTES = 64 << 20  # fp32 temporaries per chunk on the torch path
_EXT_MODULE = "regather._wgrad_ext"

_lock = threading.Lock()
_probes: dict[str, tuple[Any, str]] = {}  # name -> (module or None, reason)
_decisions: dict[tuple[str, str, str], tuple[str, str]] = {}  # key -> (backend, reason)


# ----------------------------------------------------------------------------
# optional components, imported lazily
# ----------------------------------------------------------------------------


def _probe(name: str) -> tuple[Any, str]:
    """Import an optional component once; returns (module or None, reason)."""
    with _lock:
        if name not in _probes:
            module_name = {"triton": "triton", "extension": _EXT_MODULE}[name]
            try:
                _probes[name] = (importlib.import_module(module_name), "")
            except ModuleNotFoundError as exc:
                if exc.name != module_name:  # present, but something it imports is missing
                    _probes[name] = (None, f"{module_name} failed to import: {exc}")
                elif name == "triton":
                    _probes[name] = (None, "triton not installed")
                else:
                    _probes[name] = (None, f"{module_name} not built (pip install with REGATHER_BUILD_EXT=1)")
            except Exception as exc:  # e.g. a .so that fails to load: must not break training
                _probes[name] = (None, f"{module_name} failed to import: {exc!r}")
        return _probes[name]


def _triton_interpreting() -> bool:
    triton, _ = _probe("triton")
    return triton is not None and bool(triton.knobs.runtime.interpret)


def _reset_backend_cache() -> None:
    """Forget probes and decisions (tests; or after installing a backend)."""
    with _lock:
        _probes.clear()
        _decisions.clear()


# ----------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------


def _requested(backend: str | None) -> str:
    req = backend if backend is not None else (os.environ.get(ENV_BACKEND) or "auto")
    req = req.strip().lower()
    if req not in _REQUESTS:
        src = "backend argument" if backend is not None else f"env {ENV_BACKEND}"
        raise ValueError(f"wgrad: unknown backend {req!r} from {src}; expected one of {_REQUESTS}")
    return req


def _decide(device_type: str, req: str) -> tuple[str, str]:
    """(backend, reason) for a device type and a request; no caching, no logging."""
    if device_type == "cpu":
        if req == "triton":
            if _probe("triton")[0] is None:
                return "torch", "CPU tensor; " + _probe("triton")[1]
            if not _triton_interpreting():
                return "torch", "CPU tensor and TRITON_INTERPRET is not set (Triton runs on CPU only in its interpreter)"
            return "triton", "requested; CPU tensor under TRITON_INTERPRET=1 (interpreter, slow)"
        if req == "extension":
            return "torch", "CPU tensor; the extension is CUDA-only"
        return "torch", "requested" if req == "torch" else "CPU tensor"
    if device_type != "cuda":
        return "torch", f"{device_type} tensor: no fused kernel for this device"

    order = {"auto": BACKENDS, "extension": BACKENDS, "triton": BACKENDS[1:], "torch": BACKENDS[2:]}[req]
    missing = []
    for name in order[:-1]:  # the last one is torch, always available
        module, why = _probe(name)
        if module is not None:
            break
        missing.append(why)
    else:
        name = "torch"
    if missing:
        return name, "; ".join(missing)
    return name, "requested" if req == name else "preferred backend available"


def _as_device(device: Any) -> torch.device:
    if isinstance(device, torch.Tensor):
        return device.device
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def wgrad_backend(device: Any, backend: str | None = None) -> str:
    """Name of the implementation ``wgrad_accumulate_`` uses on ``device``.

    ``device``: a ``torch.device``, a string (``"cuda:0"``), a CUDA index or a
    tensor. ``backend`` overrides env ``REGATHER_WGRAD_BACKEND``. Returns one
    of ``"extension"``, ``"triton"``, ``"torch"``; the first time a given
    (device type, request) is resolved, the choice and its reason are logged.
    """
    dev = _as_device(device)
    req = _requested(backend)
    key = (dev.type, req, os.environ.get("TRITON_INTERPRET", ""))
    hit = _decisions.get(key)
    if hit is not None:
        return hit[0]
    choice, reason = _decide(dev.type, req)
    with _lock:
        if key in _decisions:
            return _decisions[key][0]
        _decisions[key] = (choice, reason)
    level = logging.WARNING if req not in ("auto", choice) else logging.INFO
    logger.log(level, "wgrad on %s: %s backend (%s)", dev.type, choice, reason)
    return choice


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------


def _validate(main_grad: Any, grad_output: Any, input: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Check arguments; return ``grad_output`` as ``[K, M]`` and ``input`` as ``[K, N]``."""
    for name, t in (("main_grad", main_grad), ("grad_output", grad_output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"wgrad: {name} must be a torch.Tensor, got {type(t).__name__}")
    if main_grad.dim() != 2:
        raise ValueError(f"wgrad: main_grad must be 2-D [M, N], got shape {tuple(main_grad.shape)}")
    if main_grad.dtype not in _MAIN_GRAD_DTYPES:
        raise ValueError(f"wgrad: main_grad must be float32, bfloat16 or float16, got {main_grad.dtype}")
    M, N = main_grad.shape
    if grad_output.dim() < 2 or input.dim() < 2:
        raise ValueError(
            f"wgrad: grad_output and input need >= 2 dims ([..., M], [..., N]); "
            f"got shapes {tuple(grad_output.shape)} and {tuple(input.shape)}"
        )
    if grad_output.shape[-1] != M or input.shape[-1] != N:
        raise ValueError(
            f"wgrad: shape mismatch: main_grad {tuple(main_grad.shape)} needs grad_output [..., {M}] and "
            f"input [..., {N}]; got grad_output {tuple(grad_output.shape)}, input {tuple(input.shape)}"
        )
    lead_g, lead_x = tuple(grad_output.shape[:-1]), tuple(input.shape[:-1])
    # Same leading dims, or one side already flat with the same K. Equal
    # products alone are not enough: [s, b] against [b, s] would pair the wrong rows.
    one_flat = (len(lead_g) == 1 or len(lead_x) == 1) and _prod(lead_g) == _prod(lead_x)
    if not (lead_g == lead_x or one_flat):
        raise ValueError(
            f"wgrad: leading dims of grad_output {tuple(grad_output.shape)} and input {tuple(input.shape)} "
            f"must match (or one side be flattened to the same K); got K={_prod(lead_g)} vs {_prod(lead_x)}"
        )
    if grad_output.dtype != input.dtype or input.dtype not in _INPUT_DTYPES:
        raise ValueError(
            f"wgrad: grad_output and input must share a dtype in (bfloat16, float16, float32); "
            f"got grad_output {grad_output.dtype}, input {input.dtype}"
        )
    if not (main_grad.device == grad_output.device == input.device):
        raise ValueError(
            f"wgrad: all tensors must be on one device; got main_grad {main_grad.device}, "
            f"grad_output {grad_output.device}, input {input.device}"
        )
    if (N > 1 and main_grad.stride(-1) != 1) or (M > 1 and main_grad.stride(0) < N):
        raise ValueError(
            f"wgrad: main_grad must be row-major without overlap (stride(-1) == 1, stride(0) >= N); "
            f"got strides {tuple(main_grad.stride())} for shape {tuple(main_grad.shape)}"
        )
    K = _prod(lead_g)
    return grad_output.reshape(K, M), input.reshape(K, N)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# ----------------------------------------------------------------------------
# implementations
# ----------------------------------------------------------------------------


_mm_out_dtype_ok = True  # torch.mm(..., out_dtype=float32) usable on CUDA (probed on first use)


@torch.no_grad()
def wgrad_accumulate_torch(
    main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor, *, chunk_rows: int | None = None
) -> None:
    """Plain-PyTorch fallback: ``main_grad += grad_output^T @ input`` in fp32.

    ``grad_output: [K, M]``, ``input: [K, N]`` (2-D, validated).

    - fp32 inputs: one ``addmm_``, no copy.
    - bf16/fp16 on CUDA: ``torch.mm(grad_output.t(), input, out_dtype=float32)``
      (cuBLAS, fp32 accumulation and output; newer torch) then ``add_``: one
      ``M x N`` fp32 temporary, no copy of the inputs.
    - otherwise (CPU, or a torch without ``out_dtype``): each chunk of
      ``chunk_rows`` rows of K is upcast to fp32 and ``addmm_``-ed -- PyTorch has
      no mixed-dtype ``addmm_`` there -- so the fp32 temporaries are bounded by
      ``_TORCH_CHUNK_BYTES`` rather than being a full ``K x (M + N)`` fp32 copy.

    Products of bf16/fp16 values are exact in fp32, so all variants differ from
    the kernels only in fp32 summation order.
    """
    global _mm_out_dtype_ok
    K, M = grad_output.shape
    N = input.shape[1]
    if K == 0 or M == 0 or N == 0:
        return
    if input.dtype == torch.float32:
        main_grad.addmm_(grad_output.t(), input)
        return
    if main_grad.device.type == "cuda" and _mm_out_dtype_ok and chunk_rows is None:
        try:
            prod = torch.mm(grad_output.t(), input, out_dtype=torch.float32)
        except torch.cuda.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError) as exc:
            _mm_out_dtype_ok = False
            logger.info("wgrad torch path: torch.mm(out_dtype=float32) unavailable (%s); upcasting K-chunks", exc)
        else:
            main_grad.add_(prod)
            return
    rows = chunk_rows or max(1, _TORCH_CHUNK_BYTES // (4 * (M + N)))
    for k0 in range(0, K, rows):
        main_grad.addmm_(grad_output[k0 : k0 + rows].t().float(), input[k0 : k0 + rows].float())


def _wgrad_extension(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    ext, _ = _probe("extension")
    go = grad_output if grad_output.stride(-1) == 1 else grad_output.contiguous()
    x = input if input.stride(-1) == 1 else input.contiguous()
    ext.wgrad_gemm_accum_fp32(x, go, main_grad)


def _wgrad_triton(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    from regather.ops.wgrad_triton import wgrad_accumulate_triton

    wgrad_accumulate_triton(main_grad, grad_output, input)


_IMPLS = {"extension": _wgrad_extension, "triton": _wgrad_triton, "torch": wgrad_accumulate_torch}


def wgrad_accumulate_(
    main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor, *, backend: str | None = None
) -> None:
    """``main_grad[M, N] += grad_output[..., M]^T @ input[..., N]`` in fp32, in place.

    ``main_grad`` is fp32, or bf16 / fp16: then the fp32 product is formed in an
    ``[M, N]`` fp32 temporary and added once (a single rounding).

    Validates shapes, dtypes and devices first (``ValueError`` naming the
    offending values; ``main_grad`` is untouched on error), flattens the
    leading dims to K, then runs the backend ``wgrad_backend`` picks for the
    device (``backend=`` forces one, with fallback). Gradient-free: call it
    from an autograd backward or under ``torch.no_grad()``.
    """
    go2d, x2d = _validate(main_grad, grad_output, input)
    choice = wgrad_backend(main_grad.device, backend)
    if go2d.shape[0] == 0 or main_grad.numel() == 0:
        return
    if main_grad.dtype != torch.float32:
        with torch.no_grad():
            acc = torch.zeros(main_grad.shape, dtype=torch.float32, device=main_grad.device)
            _IMPLS[choice](acc, go2d, x2d)
            main_grad.add_(acc)  # fp32 math, one rounding to main_grad's dtype
        return
    _IMPLS[choice](main_grad, go2d, x2d)

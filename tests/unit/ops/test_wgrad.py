"""wgrad_accumulate_: the Triton kernel (interpreter), the torch path, dispatch, validation.

Triton tests run the kernel under ``TRITON_INTERPRET=1`` set with monkeypatch, in
process: ``regather.ops.wgrad_triton`` wraps its kernels with ``triton.jit`` lazily
and per mode, triton reads the variable at wrap and launch time, and the kernels
use no triton-stdlib ``@jit`` helper (those are fixed when ``triton.language`` is
first imported) -- so it works whatever imported triton earlier in the same
pytest-xdist worker. They skip when triton is not installed. Shapes are tiny:
the interpreter runs every program in numpy.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from regather.ops import wgrad as wg
from regather.ops import wgrad_accumulate_, wgrad_backend
from regather.ops.wgrad import wgrad_accumulate_torch
from regather.ops.wgrad_triton import choose_config, wgrad_accumulate_ref

EPS32 = torch.finfo(torch.float32).eps
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _clean_dispatch(monkeypatch):
    monkeypatch.delenv(wg.ENV_BACKEND, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    wg._reset_backend_cache()
    yield
    wg._reset_backend_cache()


@pytest.fixture
def interpret(monkeypatch):
    """Triton in interpreter mode (skips when triton is missing)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # before the first `import triton`, where possible
    pytest.importorskip("triton")


def _inputs(K, M, N, dtype, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(K, M, generator=g).to(dtype)
    x = torch.randn(K, N, generator=g).to(dtype)
    mg = torch.randn(M, N, generator=g)  # non-zero: we accumulate into it
    if lead is not None:
        go, x = go.reshape(*lead, M), x.reshape(*lead, N)
    return mg, go, x


def _assert_accurate(out, mg0, go, x, calls):
    """Error bound against an fp64 reference, flash-attention style.

    The kernel and the PyTorch fp32 path form the *same exact products*
    (bf16/fp16 x bf16/fp16 is exact in fp32; fp32 inputs are used as they are)
    and both sum in fp32; they differ only in summation order and blocking.
    So the kernel's error vs fp64 must stay within a small multiple (4x) of
    the PyTorch path's own error; the floor ``8 * eps32 * scale`` covers a
    baseline that happens to be almost exact. A stated absolute bound,
    ``1e-5 * max|ref|``, must also hold (fp32 sums of a few hundred terms).
    """
    go2, x2 = go.reshape(-1, go.shape[-1]), x.reshape(-1, x.shape[-1])
    ref = mg0.double()
    base = mg0.clone()
    for _ in range(calls):
        wgrad_accumulate_ref(ref, go2, x2)  # fp64 reference
        wgrad_accumulate_torch(base, go2, x2)  # same-precision PyTorch path
    scale = ref.abs().max().item()
    err = (out.double() - ref).abs().max().item()
    err_base = (base.double() - ref).abs().max().item()
    assert err <= 4 * err_base + 8 * EPS32 * scale, (err, err_base, scale)
    assert err <= 1e-5 * scale, (err, scale)
    if go.dtype != torch.float32:
        # Megatron's unfused path rounds the product to bf16/fp16 before the fp32
        # add; the fused kernel must be at least as accurate.
        unfused = mg0.double()
        for _ in range(calls):
            unfused += (go2.t() @ x2).double()
        assert err <= (unfused - ref).abs().max().item()


# ---------------------------------------------------------------- triton kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split_k", [1, 3])
def test_triton_matches_reference(interpret, dtype, split_k):
    from regather.ops.wgrad_triton import wgrad_accumulate_triton

    # 203 rows, 20 x 70 output: none is a multiple of the 16 x 32 x 32 blocks;
    # M=20 > block_m gives two M tiles, N=70 three N tiles.
    mg0, go, x = _inputs(203, 20, 70, dtype, seed=split_k)
    out = mg0.clone()
    for _ in range(2):  # accumulate twice into a non-zero main_grad
        cfg = wgrad_accumulate_triton(out, go, x, block_m=16, block_n=32, block_k=32, split_k=split_k)
    assert cfg.split_k == split_k
    _assert_accurate(out, mg0, go, x, calls=2)


def test_triton_strided_inputs_and_determinism(interpret):
    from regather.ops.wgrad_triton import wgrad_accumulate_triton

    g = torch.Generator().manual_seed(7)
    go = torch.randn(6, 150, generator=g).to(torch.bfloat16).t()  # [150, 6], stride (1, 150)
    x = torch.randn(150, 90, generator=g).to(torch.bfloat16)[:, ::2]  # [150, 45], stride (90, 2)
    mg0 = torch.randn(6, 45, generator=g)
    outs = []
    for _ in range(2):
        out = mg0.clone()
        wgrad_accumulate_triton(out, go, x, block_m=16, block_n=16, block_k=16, split_k=4)
        outs.append(out)
    _assert_accurate(outs[0], mg0, go, x, calls=1)
    # two-stage reduction: bit-identical run to run
    assert torch.equal(outs[0], outs[1])


def test_triton_through_entry_point(interpret):
    # 3-D [s, b, *] inputs, heuristic config, explicit backend request on CPU
    mg0, go, x = _inputs(48, 8, 40, torch.bfloat16, seed=3, lead=(12, 4))
    out = mg0.clone()
    assert wgrad_backend("cpu", "triton") == "triton"
    wgrad_accumulate_(out, go, x, backend="triton")
    _assert_accurate(out, mg0, go, x, calls=1)


def test_triton_via_env_request(interpret, monkeypatch):
    monkeypatch.setenv(wg.ENV_BACKEND, "triton")
    assert wgrad_backend("cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert wgrad_backend("cpu") == "torch"  # triton on CPU needs the interpreter


def test_triton_interpreter_after_early_triton_import():
    """TRITON_INTERPRET set *after* triton was imported (as under pytest-xdist,
    where another test may import it first) still runs our kernels interpreted."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import os, torch, triton, triton.language  # imported before the variable is set
        os.environ["TRITON_INTERPRET"] = "1"
        from regather.ops.wgrad_triton import wgrad_accumulate_ref, wgrad_accumulate_triton
        g = torch.Generator().manual_seed(0)
        go = torch.randn(70, 5, generator=g).bfloat16()
        x = torch.randn(70, 40, generator=g).bfloat16()
        mg, ref = torch.zeros(5, 40), torch.zeros(5, 40, dtype=torch.float64)
        wgrad_accumulate_triton(mg, go, x, split_k=2, block_n=16, block_k=16)
        wgrad_accumulate_ref(ref, go, x)
        err = (mg.double() - ref).abs().max().item()
        assert err < 1e-5 * ref.abs().max().item(), err
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize(
    "K,M,N,dtype",
    [(8192, 8, 4096, torch.bfloat16), (32768, 64, 8192, torch.bfloat16), (100, 4, 10, torch.float32), (1, 1, 1, torch.float16)],
)
def test_choose_config_covers_k(K, M, N, dtype):
    cfg = choose_config(K, M, N, dtype, num_sms=132)
    rows = cfg.split_k * cfg.k_iters * cfg.block_k
    assert rows >= K > (cfg.split_k - 1) * cfg.k_iters * cfg.block_k  # no empty split
    assert cfg.k_iters & (cfg.k_iters - 1) == 0  # power of two: bounded recompiles
    assert cfg.block_m >= min(M, 64) and cfg.block_m >= 16
    forced = choose_config(K, M, N, dtype, num_sms=132, split_k=1)
    assert forced.split_k == 1 and forced.k_iters * forced.block_k >= K


# ---------------------------------------------------------------- torch path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path(dtype):
    mg0, go, x = _inputs(300, 7, 33, dtype, lead=(30, 10))
    out = mg0.clone()
    wgrad_accumulate_(out, go, x)
    wgrad_accumulate_(out, go, x)
    _assert_accurate(out, mg0, go, x, calls=2)


def test_torch_path_chunks_match_single_product():
    mg0, go, x = _inputs(257, 5, 19, torch.bfloat16)
    a = mg0.clone()
    wgrad_accumulate_torch(a, go, x, chunk_rows=64)  # 5 chunks, last one partial
    # the same exact products summed in another order (per chunk, then into main_grad) than the one
    # product (one chunk) of the default path: held against the fp64 sum within a multiple of that
    # path's own error (an element-wise rtol=1e-6, atol=1e-5 of it measured at 0.17 of its bound)
    _assert_accurate(a, mg0, go, x, calls=1)


def test_fp32_torch_path_is_addmm():
    mg0, go, x = _inputs(64, 4, 16, torch.float32)
    out, ref = mg0.clone(), mg0.clone()
    wgrad_accumulate_(out, go, x)
    ref.addmm_(go.t(), x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("mg_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_low_precision_main_grad(mg_dtype, dtype):
    """megatron with grad_reduce_in_fp32=False: main_grad in the param dtype.

    The product is summed in fp32 and rounded once into main_grad, so the
    result equals ``(main_grad.float() + fp32 product).to(mg_dtype)`` exactly
    (the product taken from an fp32 main_grad of zeros through the same path).
    """
    mg0, go, x = _inputs(300, 7, 33, dtype, lead=(30, 10))
    mg0 = mg0.to(mg_dtype)
    out = mg0.clone()
    wgrad_accumulate_(out, go, x)
    prod = torch.zeros(7, 33)
    wgrad_accumulate_(prod, go, x)
    assert out.dtype == mg_dtype
    assert torch.equal(out, (mg0.float() + prod).to(mg_dtype))
    # and it is accurate: within one rounding (plus fp32 summation) of the fp64 value
    ref = mg0.double() + go.reshape(-1, 7).double().t() @ x.reshape(-1, 33).double()
    ulp = torch.finfo(mg_dtype).eps * ref.abs().clamp_min(1.0)
    assert ((out.double() - ref).abs() <= ulp).all()


def test_low_precision_main_grad_empty_k_and_errors():
    mg = torch.ones(3, 4, dtype=torch.bfloat16)
    wgrad_accumulate_(mg, torch.empty(0, 3, dtype=torch.bfloat16), torch.empty(0, 4, dtype=torch.bfloat16))
    assert torch.equal(mg, torch.ones(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K=8 vs 9"):
        wgrad_accumulate_(mg, torch.zeros(8, 3, dtype=_BF), torch.zeros(9, 4, dtype=_BF))


def test_weight_grad_fuses_into_bf16_main_grad():
    """strategies.wgrad.weight_grad with fusion on and a bf16 main_grad (no fp32 requirement)."""
    from regather.core.wgrad import weight_grad

    w = torch.nn.Parameter(torch.zeros(4, 6, dtype=_BF))
    w.main_grad = torch.zeros(4, 6, dtype=_BF)
    w.grad_added_to_main_grad = False
    go, x = torch.randn(10, 4).to(_BF), torch.randn(10, 6).to(_BF)
    placeholder = weight_grad(w, go, x, fuse=True)
    assert w.grad_added_to_main_grad
    # megatron's convention under DDP: a placeholder of the weight's shape, never None
    assert placeholder is not None and placeholder.shape == w.shape and placeholder.dtype == w.dtype
    expect = (go.float().t() @ x.float()).to(_BF)
    torch.testing.assert_close(w.main_grad, expect, rtol=0, atol=0)


def test_main_grad_placeholder_follows_megatron():
    """tensor_parallel/layers.py under gradient_accumulation_fusion: None without DDP's flag,
    an empty tensor with it, zeros with ``zero_out_wgrad``; the flag is set."""
    from regather.core.wgrad import main_grad_placeholder, weight_grad

    w = torch.nn.Parameter(torch.zeros(4, 6))
    w.main_grad = torch.zeros(4, 6)
    go, x = torch.randn(10, 4), torch.randn(10, 6)
    assert weight_grad(w, go, x, fuse=True) is None  # no DDP: .grad stays None
    torch.testing.assert_close(w.main_grad, go.t() @ x, rtol=0, atol=0)
    w.grad_added_to_main_grad = False
    got = main_grad_placeholder(w)
    assert got.shape == (4, 6) and w.grad_added_to_main_grad
    w.zero_out_wgrad = True
    assert torch.equal(main_grad_placeholder(w), torch.zeros(4, 6))


def test_empty_k_is_noop():
    mg0 = torch.randn(3, 4)
    out = mg0.clone()
    wgrad_accumulate_(out, torch.empty(0, 3, dtype=torch.bfloat16), torch.empty(0, 4, dtype=torch.bfloat16))
    assert torch.equal(out, mg0)


def test_flat_input_with_3d_grad_output():
    mg0, go, x = _inputs(24, 4, 8, torch.float16)
    out = mg0.clone()
    wgrad_accumulate_(out, go.reshape(6, 4, 4), x)  # x already [K, N]
    _assert_accurate(out, mg0, go, x, calls=1)


# ---------------------------------------------------------------- dispatch


def test_cpu_default_is_torch_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="regather.ops")
    mg0, go, x = _inputs(16, 4, 8, torch.bfloat16)
    for _ in range(3):
        assert wgrad_backend("cpu") == "torch"
        wgrad_accumulate_(mg0, go, x)
    records = [r for r in caplog.records if r.name == "regather.ops"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "torch" in records[0].getMessage() and "CPU tensor" in records[0].getMessage()
    assert records[0].levelno == logging.INFO


def test_requested_but_unavailable_warns_once(caplog):
    caplog.set_level(logging.INFO, logger="regather.ops")
    for _ in range(2):
        assert wgrad_backend(torch.device("cpu"), "extension") == "torch"
    records = [r for r in caplog.records if r.name == "regather.ops"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "CUDA-only" in records[0].getMessage()


def test_triton_not_installed(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="regather.ops")
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert wgrad_backend("cpu", "triton") == "torch"
    assert "triton not installed" in caplog.records[-1].getMessage()
    # CUDA decision without a GPU: pure logic, nothing is launched
    assert wg._decide("cuda", "auto") == (
        "torch",
        f"{wg._probe('extension')[1]}; triton not installed",
    )


def test_cuda_preference_order(monkeypatch):
    fake = object()
    monkeypatch.setattr(wg, "_probes", {"extension": (fake, ""), "triton": (fake, "")})
    assert wg._decide("cuda", "auto")[0] == "extension"
    assert wg._decide("cuda", "triton")[0] == "triton"
    assert wg._decide("cuda", "torch")[0] == "torch"
    monkeypatch.setattr(wg, "_probes", {"extension": (None, "not built"), "triton": (fake, "")})
    assert wg._decide("cuda", "auto") == ("triton", "not built")
    assert wg._decide("cuda", "extension") == ("triton", "not built")
    assert wg._decide("mps", "auto")[0] == "torch"


def test_unknown_backend_rejected(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'cublas'"):
        wgrad_backend("cpu", "cublas")
    monkeypatch.setenv(wg.ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match="REGATHER_WGRAD_BACKEND"):
        wgrad_backend("cpu")


def test_import_without_optional_backends():
    """`import regather.ops` and the CPU path work with triton and the extension absent.

    Absent as Python defines it: ``None`` in ``sys.modules`` makes ``import`` raise
    ModuleNotFoundError and ``importlib.util.find_spec`` return None (torch 2.14's ``import torch``
    asks ``find_spec("triton")`` and expects None, not an exception, from a missing module)."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = sys.modules["regather._wgrad_ext"] = None
        import torch
        import regather.ops as ops
        from regather.ops import wgrad
        mg = torch.zeros(2, 3)
        ops.wgrad_accumulate_(mg, torch.ones(4, 2, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16))
        assert torch.equal(mg, torch.full((2, 3), 4.0)), mg
        assert ops.wgrad_backend("cpu") == "torch"
        assert wgrad._decide("cuda", "auto")[0] == "torch"
        assert sys.modules["triton"] is None and not [m for m in sys.modules if m.startswith("triton.")]
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


# ---------------------------------------------------------------- validation

_BF = torch.bfloat16


@pytest.mark.parametrize(
    "mg,go,x,match",
    [
        (torch.zeros(4), torch.zeros(8, 4, dtype=_BF), torch.zeros(8, 4, dtype=_BF), r"main_grad must be 2-D \[M, N\], got shape \(4,\)"),
        (torch.zeros(4, 6, dtype=torch.float64), torch.zeros(8, 4, dtype=_BF), torch.zeros(8, 6, dtype=_BF), "main_grad must be float32, bfloat16 or float16, got torch.float64"),
        (torch.zeros(4, 6), torch.zeros(8, 5, dtype=_BF), torch.zeros(8, 6, dtype=_BF), r"grad_output \(8, 5\), input \(8, 6\)"),
        (torch.zeros(4, 6), torch.zeros(8, 4, dtype=_BF), torch.zeros(8, 7, dtype=_BF), r"needs grad_output \[\.\.\., 4\] and input \[\.\.\., 6\]"),
        (torch.zeros(4, 6), torch.zeros(8, 4, dtype=_BF), torch.zeros(9, 6, dtype=_BF), "K=8 vs 9"),
        (torch.zeros(4, 6), torch.zeros(2, 3, 4, dtype=_BF), torch.zeros(3, 2, 6, dtype=_BF), r"leading dims .* \(2, 3, 4\) and input \(3, 2, 6\)"),
        (torch.zeros(4, 6), torch.zeros(8, 4, dtype=_BF), torch.zeros(8, 6, dtype=torch.float16), "got grad_output torch.bfloat16, input torch.float16"),
        (torch.zeros(4, 6), torch.zeros(8, 4, dtype=torch.float64), torch.zeros(8, 6, dtype=torch.float64), "float64"),
        (torch.zeros(4, 6), torch.zeros(4, dtype=_BF), torch.zeros(8, 6, dtype=_BF), ">= 2 dims"),
        (torch.zeros(6, 4).t(), torch.zeros(8, 4, dtype=_BF), torch.zeros(8, 6, dtype=_BF), r"row-major .* strides \(1, 4\)"),
        (torch.zeros(4, 6), torch.zeros(8, 4, dtype=_BF), torch.zeros(8, 6, dtype=_BF, device="meta"), "one device; got main_grad cpu, grad_output cpu, input meta"),
        ([[0.0]], torch.zeros(8, 4, dtype=_BF), torch.zeros(8, 6, dtype=_BF), "main_grad must be a torch.Tensor, got list"),
    ],
)
def test_validation_errors(mg, go, x, match):
    before = mg.clone() if isinstance(mg, torch.Tensor) else None
    with pytest.raises(ValueError, match=match):
        wgrad_accumulate_(mg, go, x)
    if before is not None:
        assert torch.equal(mg, before)  # untouched

"""The CUDA extension ``regather._wgrad_ext`` as .ci/build-ext.sh built it (make test-torch214).

What a machine without a GPU can check of it: the shared object is an x86-64 ELF exporting the module's
init and ``wgrad_gemm_accum_fp32``, it calls cuBLAS's ``cublasGemmEx`` from the CUDA major torch was
built with and links torch's CUDA libraries; and in a fresh interpreter it imports whole — loading
libcudart and libcublas needs no driver, and nothing at import calls CUDA — registers the function
with apex's argument order, makes ``wgrad_backend("cuda")`` pick it, and rejects a CPU tensor in its
first check. That is as far as it goes without a driver: the next step needs a CUDA tensor, and
allocating one raises "Found no NVIDIA driver". Where a GPU is present the last step runs the GEMM
against an fp64 reference instead.

Skips when the extension was not built (REGATHER_EXT_BUILD, default ``build/ext-torch214``, has no
``build.json``) or was built against another torch than this process runs (the ABI is torch's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_BUILD = os.environ.get("REGATHER_EXT_BUILD", os.path.join(_ROOT, "build", "ext-torch214"))


@pytest.fixture(scope="module")
def built() -> dict:
    path = os.path.join(_BUILD, "build.json")
    if not os.path.exists(path):
        pytest.skip(f"regather._wgrad_ext not built ({path} missing): make test-torch214 builds it (.ci/build-ext.sh)")
    with open(path) as f:
        record = json.load(f)
    if record["torch"] != torch.__version__:
        pytest.skip(f"regather._wgrad_ext in {_BUILD} was built against torch {record['torch']}, "
                    f"this is torch {torch.__version__}")
    return record


def _binutil(name: str, *args: str) -> str:
    if shutil.which(name) is None:
        pytest.skip(f"{name} (binutils) not on PATH")
    return subprocess.run([name, *args], capture_output=True, text=True, check=True).stdout


def test_the_shared_object_exports_the_module_and_calls_cublas(built):
    so = built["so"]
    assert built["arch_list"] == "9.0" and built["torch_cuda"] == torch.version.cuda, built
    with open(so, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and head[4] == 2 and int.from_bytes(head[18:20], "little") == 62  # ELF64, x86-64
    defined = _binutil("nm", "-D", "--defined-only", "-C", so)
    assert " T PyInit__wgrad_ext" in defined
    assert " T wgrad_gemm_accum_fp32(at::Tensor const&, at::Tensor const&, at::Tensor&)" in defined
    cuda_major = torch.version.cuda.split(".")[0]
    undefined = _binutil("nm", "-D", "--undefined-only", so)
    assert f"cublasGemmEx@libcublas.so.{cuda_major}" in undefined
    assert "getCurrentCUDABlasHandle" in undefined  # torch's handle: its stream, workspace and math mode
    needed = {line.split("[")[1].rstrip("]") for line in _binutil("readelf", "-d", so).splitlines() if "(NEEDED)" in line}
    assert {f"libcublas.so.{cuda_major}", "libtorch_cuda.so", "libc10_cuda.so", "libtorch_python.so"} <= needed, needed


_IMPORT = textwrap.dedent(
    """
    import importlib.util, json, sys
    import torch
    spec = importlib.util.spec_from_file_location("regather._wgrad_ext", sys.argv[1])
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    sys.modules["regather._wgrad_ext"] = ext
    from regather.ops import wgrad
    out = {"doc": ext.__doc__, "signature": ext.wgrad_gemm_accum_fp32.__doc__.splitlines()[0],
           "dispatch": wgrad._decide("cuda", "auto"), "gpu": torch.cuda.is_available()}
    try:
        ext.wgrad_gemm_accum_fp32(torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(2, 3))
    except RuntimeError as exc:
        out["cpu_call"] = str(exc).splitlines()[0]
    if out["gpu"]:  # the GEMM itself: bf16 inputs, fp32 main_grad, against fp64
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1000, 136, device="cuda", generator=g).bfloat16()
        go = torch.randn(1000, 24, device="cuda", generator=g).bfloat16()
        mg = torch.randn(24, 136, device="cuda", generator=g)
        ref = mg.double() + go.double().t() @ x.double()
        fp32 = mg.addmm(go.t().float(), x.float())  # torch's fp32 path: the error the bound scales
        ext.wgrad_gemm_accum_fp32(x, go, mg)
        torch.cuda.synchronize()
        out["err"], out["err_fp32"] = ((t.double() - ref).abs().max().item() for t in (mg, fp32))
        out["scale"] = ref.abs().max().item()
    else:
        try:
            torch.empty(1, device="cuda")
        except RuntimeError as exc:
            out["cuda_tensor"] = str(exc).splitlines()[0]
    print(json.dumps(out))
    """
)


def test_it_imports_without_a_gpu_driver_as_far_as_its_first_check(built):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(_ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _IMPORT, built["so"]], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["doc"].startswith("regather fused weight-gradient accumulation")
    assert out["signature"] == (
        "wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None")
    assert out["dispatch"] == ["extension", "preferred backend available"]
    assert out["cpu_call"] == "wgrad_gemm_accum_fp32: input must be a CUDA tensor, got cpu"
    if out["gpu"]:
        # exact bf16 products summed in fp32, as torch's fp32 path: the bound of test_wgrad and bench_wgrad
        eps = torch.finfo(torch.float32).eps
        assert out["err"] <= 4 * out["err_fp32"] + 8 * eps * out["scale"], out
    else:
        assert out["cuda_tensor"].startswith("Found no NVIDIA driver"), out

"""benchmarks/gpu/overlap.py on CPU: the trace analysis and the backward sequence's maths.

The GPU part (streams, profiler trace) runs only in benchmarks/gpu/kernels.sh.
"""

import importlib.util
import os

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "gpu", "overlap.py")


@pytest.fixture(scope="module")
def overlap():
    spec = importlib.util.spec_from_file_location("regather_bench_overlap", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ev(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlap_fraction_from_intervals(overlap):
    trace = {"traceEvents": [
        _ev("sm90_xmma_gemm_bf16", 0, 50, 7), _ev("sm90_xmma_gemm_bf16", 60, 40, 7),   # compute: [0,50] [60,100]
        _ev("Memcpy DtoD", 30, 40, 22, "gpu_memcpy"),                                   # comm: [30,70]
        _ev("ncclDevKernel_AllGather", 90, 20, 22),                                     # comm: [90,110]
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},          # host: ignored
    ]}
    res = overlap.overlap_from_trace(trace)
    assert res["status"] == "ok" and (res["compute_stream"], res["comm_stream"]) == (7, 22)
    assert res["compute_busy_us"] == 90 and res["comm_busy_us"] == 60
    assert res["concurrent_us"] == 20 + 10 + 10  # [30,50] + [60,70] + [90,100]
    assert res["overlap_fraction"] == pytest.approx(40 / 60, abs=1e-4)


def test_serial_and_degenerate_traces(overlap):
    serial = {"traceEvents": [_ev("gemm", 0, 10, 7), _ev("Memcpy DtoD", 10, 5, 9, "gpu_memcpy")]}
    assert overlap.overlap_from_trace(serial)["overlap_fraction"] == 0.0
    assert overlap.overlap_from_trace({"traceEvents": [_ev("gemm", 0, 10, 7)]})["status"] == "single_stream"
    assert overlap.overlap_from_trace({"traceEvents": []})["status"] == "no_device_events"
    assert overlap.overlap_from_trace({"traceEvents": [_ev("copy", 0, 1, 3)]})["status"] == "no_gemm_kernels"


def test_backward_step_maths_on_cpu(overlap):
    case = overlap._Case(s=8, b=2, h=12, o=10, r=4, t=2, dtype=torch.float32, device="cpu")
    dx = overlap.backward_step(case, overlap=False)
    x_full = torch.cat([case.x_local, case.peer])
    mid_i = (case.dy @ case.B)[:, : case.A.shape[0]]
    torch.testing.assert_close(case.x_full, x_full)
    torch.testing.assert_close(dx, mid_i @ case.A + case.dy @ case.W)
    torch.testing.assert_close(case.main_grad, mid_i.t() @ x_full, rtol=1e-5, atol=1e-5)


def test_dry_run_reports_without_cuda(overlap, tmp_path):
    res = overlap.profile_comm_overlap(str(tmp_path), dry_run=True)
    assert res["status"] == "dry_run" and res["ran_on_gpu"] is False
    assert res["synthetic_analysis"]["overlapped"] is True
    assert not os.listdir(tmp_path)  # no trace written

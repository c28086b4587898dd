"""Single-GPU trace: does regather's backward gather overlap the dgrad GEMMs? (issue 4 §3)

One H200, one process: NCCL cannot run two ranks on one GPU, and a 1-rank
all-gather moves nothing between GPUs. What *can* be shown honestly on one GPU
is the stream mechanics regather relies on: the gather is issued through
``regather.core.comm._launch`` -- the same code path the regather backward uses --
on the dedicated ``regather.core.comm.comm_stream``, after a ``wait_stream`` on the
compute stream, and the compute stream waits on its event only right before
LoRA-A's weight gradient. Meanwhile the compute stream runs the backward's
dgrad GEMMs in the early-regather order (docs/design.md §4)::

    comm stream     [ gather x_local -> x_full (scratch) .................. ]
    compute stream  [ B dgrad ][ A dgrad ][ base dgrad (big) ] wait [ dA (wgrad_accumulate_) ]

The gather is stood in for by one of (``--overlap-comm``):

``copy`` (default)  device-to-device copies of the bytes a rank of ``t`` receives
                    (``s*b*h*(t-1)/t`` elements) plus its own shard into the scratch
                    buffer. It reads and writes HBM, so it *competes* with the GEMMs
                    for memory bandwidth -- a pessimistic stand-in for NVLink traffic.
``nccl``            ``all_gather_into_tensor`` over a 1-rank NCCL group
                    (``init_method=file://``, world size 1), launched on the comm
                    stream: the real NCCL launch path, but with one rank it is a copy.

Outputs (in ``out_dir``): ``overlap_trace.json`` (chrome trace, open in
chrome://tracing or Perfetto) and the returned dict: per-stream busy time from
the trace's kernel/memcpy events, the time both streams were busy at once, the
overlap fraction (of the comm stream's busy time), and CUDA-event wall times of
the same sequence overlapped vs serialised on one stream.

``dry_run=True`` (CPU): tiny shapes, the same sequence without streams or a
trace, and the trace analysis run on a synthetic trace -- it checks the code,
not the hardware. Nothing here has run on a GPU yet (see benchmarks/gpu/README.md).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable

import torch

GEMM_HINTS = ("gemm", "cutlass", "sm90", "sm80", "nvjet", "cublas", "xmma", "matmul", "splitk", "wgrad")


# ----------------------------------------------------------------------------
# trace analysis (pure Python: unit-tested on CPU)
# ----------------------------------------------------------------------------


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def device_events(trace: dict) -> list[dict]:
    """Kernel and memcpy/memset events of a chrome trace (``ts``/``dur`` in µs, ``args.stream``)."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    keep = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = str(e.get("cat", "")).lower()
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in e.get("args", {}):
            keep.append(e)
    return keep


def overlap_from_trace(trace: dict, comm_stream: int | None = None) -> dict:
    """How long the communication stream was busy while the compute stream was.

    The compute stream is the one that ran the GEMM kernels (names matching
    ``GEMM_HINTS``) for the longest; the comm stream is ``comm_stream`` if given,
    else the busiest other stream. Returns busy times (µs), their intersection
    and ``overlap_fraction = intersection / comm busy``; ``status`` says why
    when the trace cannot answer (one stream only, no GEMMs, no events).
    """
    events = device_events(trace)
    if not events:
        return {"status": "no_device_events"}
    by_stream: dict[int, list[tuple[float, float]]] = {}
    gemm_time: dict[int, float] = {}
    names: dict[int, set[str]] = {}
    for e in events:
        s = int(e["args"]["stream"])
        ts, dur = float(e["ts"]), float(e["dur"])
        by_stream.setdefault(s, []).append((ts, ts + dur))
        names.setdefault(s, set()).add(str(e.get("name", ""))[:80])
        if any(h in str(e.get("name", "")).lower() for h in GEMM_HINTS):
            gemm_time[s] = gemm_time.get(s, 0.0) + dur
    if not gemm_time:
        return {"status": "no_gemm_kernels", "streams": sorted(by_stream)}
    compute = max(gemm_time, key=gemm_time.get)
    others = [s for s in by_stream if s != compute]
    if comm_stream is None:
        if not others:
            return {"status": "single_stream", "streams": [compute]}
        comm_stream = max(others, key=lambda s: _length(_union(by_stream[s])))
    if comm_stream not in by_stream:
        return {"status": "comm_stream_idle", "streams": sorted(by_stream)}
    comp_u, comm_u = _union(by_stream[compute]), _union(by_stream[comm_stream])
    both = _intersection(comp_u, comm_u)
    comm_busy = _length(comm_u)
    return {
        "status": "ok",
        "compute_stream": compute,
        "comm_stream": comm_stream,
        "compute_busy_us": round(_length(comp_u), 2),
        "comm_busy_us": round(comm_busy, 2),
        "concurrent_us": round(both, 2),
        "overlap_fraction": round(both / comm_busy, 4) if comm_busy else 0.0,
        "overlapped": both > 0,
        "comm_kernels": sorted(names[comm_stream])[:8],
    }


# ----------------------------------------------------------------------------
# the backward sequence
# ----------------------------------------------------------------------------


class _Case:
    """Tensors of one regather backward for a column-parallel base (per rank, ``t`` ranks).

    ======== ================= ==========================================
    x_local  ``[s/t*b, h]``    saved adapter input
    peer     ``[s/t*b*(t-1), h]`` stand-in for what the other ranks send
    x_full   ``[s*b, h]``      scratch the gather fills
    dy       ``[s*b, o/t]``    output gradient of base and adapter
    W        ``[o/t, h]``      frozen base weight (its dgrad is the big GEMM)
    A, B     ``[r/t, h]``, ``[o/t, r]`` LoRA weights
    ======== ================= ==========================================
    """

    def __init__(self, s, b, h, o, r, t, dtype, device):
        g = torch.Generator(device="cpu").manual_seed(0)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        K, k_local = s * b, s * b // t
        self.t = t
        self.x_local = rnd(k_local, h)
        self.peer = rnd(K - k_local, h)
        self.x_full = torch.empty(K, h, device=device, dtype=dtype)
        self.dy = rnd(K, o // t)
        self.W = rnd(o // t, h) * 0.02
        self.A = rnd(max(1, r // t), h) * 0.02
        self.B = rnd(o // t, r) * 0.02
        self.main_grad = torch.zeros(self.A.shape, device=device, dtype=torch.float32)
        self.k_local = k_local


def _gather_op(case: _Case, mode: str, group):
    def op(async_op: bool):
        if mode == "nccl":
            torch.distributed.all_gather_into_tensor(case.x_full[: case.k_local], case.x_local, group=group)
        else:
            case.x_full[: case.k_local].copy_(case.x_local)
        case.x_full[case.k_local:].copy_(case.peer)  # the bytes a rank would receive
        return None

    return op


def backward_step(case: _Case, mode: str = "copy", group=None, overlap: bool = True) -> torch.Tensor:
    """One regather backward in early-regather order; returns the input gradient ``[s*b, h]``."""
    from regather.core import comm
    from regather.ops import wgrad_accumulate_

    cuda = case.x_local.is_cuda
    mid_grad = case.dy @ case.B                                    # B dgrad          [s*b, r]
    mid_grad_i = mid_grad[:, : case.A.shape[0]].contiguous()       # this rank's r/t columns
    op = _gather_op(case, mode, group)
    if cuda and overlap:
        pending = comm._launch(op, case.x_full, (case.x_local, case.peer), async_op=True)
    else:
        op(False)
        pending = None
    dx = mid_grad_i @ case.A                                       # A dgrad          [s*b, h]
    dx += case.dy @ case.W                                         # base dgrad (big) [s*b, h]
    x_full = pending.wait() if pending is not None else case.x_full
    wgrad_accumulate_(case.main_grad, mid_grad_i, x_full)          # dA after the wait
    return dx


def _cuda_time(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _nccl_group(tmpdir: str):
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmpdir}/rdzv", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    return dist.group.WORLD


def profile_comm_overlap(out_dir: str, *, mode: str = "copy", s: int = 8192, b: int = 1, h: int = 4096,
                         o: int = 6144, r: int = 16, t: int = 2, reps: int = 5, dry_run: bool = False) -> dict:
    """Record the trace and report overlap (see the module docstring). Never raises: errors are reported."""
    info = {"mode": mode, "shape": dict(s=s, b=b, h=h, o=o, r=r, t=t), "ran_on_gpu": False}
    try:
        if dry_run or not torch.cuda.is_available():
            s, h, o, r = 16, 32, 48, 4
            info["shape"] = dict(s=s, b=b, h=h, o=o, r=r, t=t)
            case = _Case(s, b, h, o, r, t, torch.float32, "cpu")
            dx = backward_step(case, "copy", overlap=False)
            synthetic = {"traceEvents": [
                {"ph": "X", "cat": "kernel", "name": "sm90_gemm_bf16", "ts": 0, "dur": 100, "args": {"stream": 7}},
                {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 40, "dur": 80, "args": {"stream": 21}},
            ]}
            info.update(status="dry_run", dx_shape=list(dx.shape), dA_norm=float(case.main_grad.norm()),
                        synthetic_analysis=overlap_from_trace(synthetic),
                        note="CPU dry run: code path only, no streams, no trace; nothing measured")
            return info
        dev = torch.device("cuda", torch.cuda.current_device())
        with tempfile.TemporaryDirectory() as tmp:
            group = _nccl_group(tmp) if mode == "nccl" else None
            case = _Case(s, b, h, o, r, t, torch.bfloat16, dev)
            for _ in range(3):  # warm-up: cuBLAS handles, NCCL communicator, allocator
                backward_step(case, mode, group)
            torch.cuda.synchronize()
            info["overlapped_us"] = round(_cuda_time(lambda: backward_step(case, mode, group), reps), 2)
            info["serial_us"] = round(_cuda_time(lambda: backward_step(case, mode, group, overlap=False), reps), 2)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    backward_step(case, mode, group)
                torch.cuda.synchronize()
            path = os.path.join(out_dir, "overlap_trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            info.update(overlap_from_trace(trace))
            info.update(ran_on_gpu=True, trace=path, gpu=torch.cuda.get_device_name(dev),
                        comm_stream_is_separate=True)
            if mode == "nccl":
                torch.distributed.destroy_process_group()
        info["note"] = ("single GPU: the gather is a stand-in (" + mode + "); the result shows stream "
                        "concurrency of regather's launch path, not NVLink bandwidth")
        return info
    except Exception as exc:  # a benchmark step must not sink the kernel results
        import traceback

        info.update(status="error", error=repr(exc), traceback=traceback.format_exc()[-2000:])
        return info


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="regather comm-stream overlap trace on one GPU")
    ap.add_argument("--out", default=".")
    ap.add_argument("--mode", choices=("copy", "nccl"), default="copy")
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    res = profile_comm_overlap(args.out, mode=args.mode, dry_run=args.cpu_dry_run)
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))

"""GPU check + benchmark of ``regather.ops.wgrad_accumulate_`` (run by ``kernels.sh``).

Operation: ``main_grad[r, h] (fp32) += grad_output[K, r]^T @ input[K, h]`` (bf16).

For every shape in r x h x K it

1. checks each implementation against an fp64 reference (same bound as
   ``tests/unit/ops/test_wgrad.py``: error <= 4 x the PyTorch fp32-path error
   + 8 eps32 max|ref|), and that repeated runs are bit-identical;
2. times each implementation with CUDA events, one event pair per run, the L2
   flushed before every run, and reports the median (plus min / p90).

Implementations timed:

=====================  =======================================================
``torch_unfused``      ``main_grad += (go.t() @ x).float()`` -- Megatron's path
                       without gradient-accumulation fusion (bf16 product)
``torch_addmm_upcast`` ``main_grad.addmm_(go.t().float(), x.float())`` -- full
                       fp32 copies of the inputs
``torch_mm_out_dtype`` ``main_grad += torch.mm(go.t(), x, out_dtype=float32)``
                       (skipped if this torch lacks it)
``regather_torch``     ``wgrad_accumulate_(..., backend="torch")``
``triton``             split-K Triton kernel (heuristic config)
``extension``          ``regather._wgrad_ext`` (cuBLAS GemmEx, fp32 C, beta=1),
                       if it was built
=====================  =======================================================

Writes ``kernels.json`` and ``kernels.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch

EPS32 = torch.finfo(torch.float32).eps
DEV = "cuda"  # "cpu" with --cpu-dry-run (tiny shapes, Triton interpreter, wall-clock timer)

# What this script launches (tests/unit/ops/test_wgrad_sm90.py compiles every Triton launch of these
# for sm_90 ahead of time, from the same constants):
RANKS, HIDDEN, TOKENS = (8, 16, 64), (4096, 8192), (8192, 32768)  # timed shapes (bf16), --ranks/--hidden/--tokens
# correctness edge cases through the public entry point: (K, M, N, leading dims, note), in EDGE_DTYPES,
# main_grad a view EDGE_OFFSET elements into a flat buffer (as in Megatron's grad buffer)
EDGE_CASES = (
    (1000, 5, 1000, None, "not multiples of any block"),
    (4096, 64, 4097, (64, 64), "3-D input, odd N"),
    (3, 16, 256, None, "K smaller than one block"),
    (50000, 8, 136, None, "long K, narrow N"),
)
EDGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EDGE_OFFSET = 37
# the Triton config sweep at max(TOKENS): (block_n, block_k, num_warps, num_stages, split_k multiple)
SWEEP = (
    (128, 64, 4, 4, 1),
    (128, 64, 4, 4, 2),
    (128, 64, 8, 3, 1),
    (256, 64, 8, 3, 1),
    (64, 64, 4, 4, 2),
    (128, 128, 8, 3, 1),
    (256, 32, 8, 4, 2),
)


def sweep_overrides(K: int, r: int, h: int, candidate: tuple, sms: int) -> dict:
    """The keyword overrides of ``wgrad_accumulate_triton`` for one SWEEP candidate at one shape."""
    from regather.ops.wgrad_triton import choose_config

    bn, bk, warps, stages, split_mult = candidate
    base = choose_config(K, r, h, torch.bfloat16, num_sms=sms, block_n=bn, block_k=bk)
    return dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=max(1, base.split_k * split_mult))


def sync(empty_cache: bool = False) -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()
        if empty_cache:
            torch.cuda.empty_cache()


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 4


# ----------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------


def hardware() -> dict:
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        info = {
            "gpu": props.name,
            "sm_count": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
        }
    else:
        info = {"gpu": "none (CPU dry run)", "sm_count": 0, "gpu_memory_gib": 0, "compute_capability": "-"}
    info |= {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        q = "name,driver_version,clocks.max.sm,clocks.max.mem"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        info["nvidia_smi"] = out.stdout.strip()
    except Exception as exc:  # informational only
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


# ----------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------

_L2_FLUSH: torch.Tensor | None = None


def time_cuda(fn: Callable[[], None], warmup: int, reps: int) -> dict:
    """Median / min / p90 in microseconds; one CUDA event pair per run, L2 flushed before each."""
    global _L2_FLUSH
    if DEV != "cuda":  # dry run: wall clock, no flush
        for _ in range(warmup):
            fn()
        us = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            us.append((time.perf_counter() - t) * 1e6)
        us.sort()
        return {"median_us": statistics.median(us), "min_us": us[0], "p90_us": us[-1], "reps": reps}
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(256 * 2**20, dtype=torch.int8, device=DEV)
    for _ in range(warmup):
        fn()
    sync()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        _L2_FLUSH.zero_()
        s.record()
        fn()
        e.record()
    sync()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return {
        "median_us": statistics.median(us),
        "min_us": us[0],
        "p90_us": us[min(len(us) - 1, int(0.9 * len(us)))],
        "reps": reps,
    }


# ----------------------------------------------------------------------------
# implementations
# ----------------------------------------------------------------------------


def implementations(ext) -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]]:
    from regather.ops import wgrad_accumulate_
    from regather.ops.wgrad_triton import wgrad_accumulate_triton

    impls = {
        "torch_unfused": lambda mg, go, x: mg.add_((go.t() @ x).float()),
        "torch_addmm_upcast": lambda mg, go, x: mg.addmm_(go.t().float(), x.float()),
    }
    try:
        a = torch.zeros(4, 2, dtype=torch.bfloat16, device=DEV)
        torch.mm(a.t(), a, out_dtype=torch.float32)
        impls["torch_mm_out_dtype"] = lambda mg, go, x: mg.add_(torch.mm(go.t(), x, out_dtype=torch.float32))
    except Exception:
        pass
    impls["regather_torch"] = lambda mg, go, x: wgrad_accumulate_(mg, go, x, backend="torch")
    impls["triton"] = lambda mg, go, x: wgrad_accumulate_triton(mg, go, x)
    if ext is not None:
        impls["extension"] = lambda mg, go, x: ext.wgrad_gemm_accum_fp32(x, go, mg)
    return impls


def errors(impl, mg0, go, x, ref, scale) -> float:
    out = mg0.clone()
    impl(out, go, x)
    sync()
    return (out.double() - ref).abs().max().item() / scale


# ----------------------------------------------------------------------------
# correctness edge cases (small, all dtypes, through the public entry point)
# ----------------------------------------------------------------------------


def edge_cases(backends: list[str]) -> list[dict]:
    from regather.ops import wgrad_accumulate_
    from regather.ops.wgrad import wgrad_accumulate_torch

    results = []
    g = torch.Generator(device=DEV).manual_seed(1)
    cases = EDGE_CASES
    if DEV != "cuda":  # dry run: the interpreter is slow
        cases = [(K // 40 + 1, M, N // 40 + 3, None, note) for K, M, N, _, note in cases]
    for (K, M, N, lead, note), dtype in itertools.product(cases, EDGE_DTYPES):
        go = torch.randn(K, M, device=DEV, generator=g).to(dtype)
        x = torch.randn(K, N, device=DEV, generator=g).to(dtype)
        # main_grad as a view into a larger flat buffer (Megatron's grad buffer)
        buf = torch.randn(M * N + EDGE_OFFSET, device=DEV, generator=g)
        mg0 = buf[EDGE_OFFSET:].view(M, N).clone()
        ref = mg0.double() + 2 * (go.double().t() @ x.double())
        base = mg0.clone()
        wgrad_accumulate_torch(base, go, x, chunk_rows=1024)
        wgrad_accumulate_torch(base, go, x, chunk_rows=1024)
        scale = ref.abs().max().item()
        err_base = (base.double() - ref).abs().max().item()
        bound = 4 * err_base + 8 * EPS32 * scale
        g3, x3 = (go.reshape(*lead, M), x.reshape(*lead, N)) if lead else (go, x)
        for backend in backends:
            buf2 = torch.zeros_like(buf)
            mg = buf2[EDGE_OFFSET:].view(M, N)
            mg.copy_(mg0)
            row = {"K": K, "M": M, "N": N, "dtype": str(dtype).split(".")[-1], "backend": backend, "note": note}
            try:
                wgrad_accumulate_(mg, g3, x3, backend=backend)
                wgrad_accumulate_(mg, g3, x3, backend=backend)
                sync()
                err = (mg.double() - ref).abs().max().item()
                untouched = torch.equal(buf2[:EDGE_OFFSET], torch.zeros_like(buf2[:EDGE_OFFSET]))
                row.update(err=err, bound=bound, ok=bool(err <= bound and untouched), outside_untouched=untouched)
            except Exception as exc:
                row.update(ok=False, error=repr(exc))
            results.append(row)
    return results


# ----------------------------------------------------------------------------
# comm-stream overlap trace (benchmarks/gpu/overlap.py)
# ----------------------------------------------------------------------------


def profile_comm_overlap(out_dir: str, mode: str = "copy") -> dict:
    """Trace regather's backward gather on the comm stream against the dgrad GEMMs.

    See ``overlap.py`` beside this file: one GPU, the gather stood in for by a
    device copy (``copy``) or a 1-rank NCCL all-gather (``nccl``), launched
    through ``regather.core.comm``; chrome trace ``overlap_trace.json`` in ``out_dir``
    and the overlap fraction computed from its kernel timestamps. Under
    ``--cpu-dry-run`` it runs the code path on CPU without a trace.
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from overlap import profile_comm_overlap as run

    return run(out_dir, mode=mode, dry_run=DEV != "cuda")


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------


def load_extension(log: list[str]):
    try:
        import regather._wgrad_ext as ext

        log.append(f"extension loaded from {ext.__file__}")
        return ext
    except Exception as exc:
        log.append(f"extension not importable: {exc!r}")
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--command", default=" ".join(sys.argv))
    ap.add_argument("--ext-build", default="not attempted")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--hidden", default=",".join(map(str, HIDDEN)))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep-seconds", type=float, default=120.0, help="time budget for the Triton config sweep")
    ap.add_argument("--budget-seconds", type=float, default=420.0, help="whole-run budget; the sweep stops before it")
    ap.add_argument("--overlap-trace", action="store_true", help="record the comm-stream overlap trace (overlap.py)")
    ap.add_argument("--overlap-mode", choices=("copy", "nccl"), default="copy",
                    help="stand-in for the gather on one GPU: device copy or 1-rank NCCL all-gather")
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="exercise this script without a GPU: CPU tensors, tiny shapes, Triton interpreter",
    )
    args = ap.parse_args()
    if args.cpu_dry_run:
        global DEV
        DEV = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
        args.ranks, args.hidden, args.tokens, args.warmup, args.reps = "4", "40", "100", 1, 2
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    if DEV == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2

    log: list[str] = []
    ext = load_extension(log)
    from regather.ops import wgrad_backend
    from regather.ops.wgrad_triton import choose_config, wgrad_accumulate_triton

    result = {
        "command": args.command,
        "hardware": hardware(),
        "extension_build": args.ext_build,
        "dispatch": {DEV: wgrad_backend(DEV)},
        "log": log,
        "shapes": [],
        "edge_cases": [],
        "sweep": [],
    }
    print(json.dumps(result["hardware"]), flush=True)
    print("dispatch:", result["dispatch"], "|", "; ".join(log), flush=True)

    backends = ["torch", "triton"] + (["extension"] if ext is not None else [])
    result["edge_cases"] = edge_cases(backends)
    n_bad = sum(not r["ok"] for r in result["edge_cases"])
    print(f"edge cases: {len(result['edge_cases']) - n_bad}/{len(result['edge_cases'])} ok", flush=True)

    impls = implementations(ext)
    sms = num_sms()
    ranks = [int(v) for v in args.ranks.split(",")]
    hiddens = [int(v) for v in args.hidden.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    g = torch.Generator(device=DEV).manual_seed(0)
    for r, h, K in itertools.product(ranks, hiddens, tokens):
        go = torch.randn(K, r, device=DEV, generator=g).bfloat16()
        x = torch.randn(K, h, device=DEV, generator=g).bfloat16()
        mg0 = torch.randn(r, h, device=DEV, generator=g)
        ref = mg0.double() + go.double().t() @ x.double()
        scale = ref.abs().max().item()
        row = {"r": r, "h": h, "K": K, "dtype": "bfloat16", "impls": {}}
        row["triton_config"] = choose_config(K, r, h, torch.bfloat16, num_sms=sms).__dict__
        bytes_moved = K * (r + h) * 2 + 2 * r * h * 4
        flops = 2 * K * r * h
        errs = {}
        for name, fn in impls.items():
            entry: dict = {}
            try:
                errs[name] = entry["rel_err"] = errors(fn, mg0, go, x, ref, scale)
                if name in ("triton", "extension", "regather_torch"):
                    a, b = mg0.clone(), mg0.clone()
                    fn(a, go, x)
                    fn(b, go, x)
                    entry["deterministic"] = bool(torch.equal(a, b))
                mg = mg0.clone()
                entry.update(time_cuda(lambda fn=fn, mg=mg, go=go, x=x: fn(mg, go, x), args.warmup, args.reps))
                entry["GBps"] = bytes_moved / (entry["median_us"] * 1e-6) / 1e9
                entry["TFLOPs"] = flops / (entry["median_us"] * 1e-6) / 1e12
            except Exception as exc:
                entry["error"] = repr(exc)
                traceback.print_exc()
            row["impls"][name] = entry
        # pass/fail: fused paths vs the fp32 torch path (same bound as the unit tests)
        base = errs.get("torch_addmm_upcast")
        for name in ("triton", "extension", "regather_torch", "torch_mm_out_dtype"):
            if name in errs and base is not None:
                row["impls"][name]["accurate"] = bool(errs[name] <= 4 * base + 8 * EPS32)
        ref_t = row["impls"]["torch_unfused"].get("median_us")
        for entry in row["impls"].values():
            if ref_t and entry.get("median_us"):
                entry["speedup_vs_unfused"] = ref_t / entry["median_us"]
        result["shapes"].append(row)
        print(
            f"r={r:3d} h={h:5d} K={K:6d} "
            + " ".join(f"{n}={e.get('median_us', float('nan')):8.1f}us" for n, e in row["impls"].items()),
            flush=True,
        )
        del go, x, mg0, ref
        sync(empty_cache=True)

    result["overlap_trace"] = profile_comm_overlap(args.out, args.overlap_mode) if args.overlap_trace else {"status": "skipped"}
    write_outputs(result, args.out, t_start)  # now, in case the sweep is cut short

    # small Triton config sweep, time-boxed (guides the heuristic in choose_config)
    sweep_deadline = min(time.time() + args.sweep_seconds, t_start + args.budget_seconds - 20)
    for r, h, K in itertools.product(ranks, hiddens, [max(tokens)]):
        if time.time() > sweep_deadline:
            result["sweep_truncated"] = True
            break
        go = torch.randn(K, r, device=DEV, generator=g).bfloat16()
        x = torch.randn(K, h, device=DEV, generator=g).bfloat16()
        mg = torch.zeros(r, h, device=DEV)
        for c in SWEEP:
            if time.time() > sweep_deadline:
                result["sweep_truncated"] = True
                break
            kw = sweep_overrides(K, r, h, c, sms)
            entry = {"r": r, "h": h, "K": K, **kw}
            try:
                entry.update(time_cuda(lambda kw=kw, mg=mg, go=go, x=x: wgrad_accumulate_triton(mg, go, x, **kw), 3, 15))
            except Exception as exc:
                entry["error"] = repr(exc)
            result["sweep"].append(entry)
        del go, x, mg
        sync(empty_cache=True)

    write_outputs(result, args.out, t_start)
    print(markdown(result), flush=True)
    ok = n_bad == 0 and all(
        e.get("accurate", True) and e.get("deterministic", True) and "error" not in e
        for row in result["shapes"]
        for e in row["impls"].values()
    )
    return 0 if ok else 1


def write_outputs(result: dict, out: str, t_start: float) -> None:
    result["wall_s"] = time.time() - t_start
    with open(os.path.join(out, "kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "kernels.md"), "w") as f:
        f.write(markdown(result))


def markdown(res: dict) -> str:
    hw = res["hardware"]
    lines = [
        "# wgrad kernels: `main_grad[r, h] (fp32) += grad_output[K, r]^T @ input[K, h]` (bf16)",
        "",
        f"- Hardware: {hw['gpu']} ({hw['sm_count']} SMs, {hw['gpu_memory_gib']} GiB, cc {hw['compute_capability']}); "
        f"nvidia-smi: {hw.get('nvidia_smi')}",
        f"- Software: torch {hw['torch']} (CUDA {hw['torch_cuda']}), triton {hw['triton']}, Python {hw['python']}",
        f"- Command: `{res['command']}`",
        f"- Extension build: {res['extension_build']}; dispatch: **{res['dispatch']}**; "
        + "; ".join(res["log"]),
        "- Time: median of per-run CUDA-event times (L2 flushed before each run); rel_err = max|out - ref_fp64| / max|ref|.",
        "",
    ]
    names: list[str] = []
    for row in res["shapes"]:
        for n in row["impls"]:
            if n not in names:
                names.append(n)
    lines.append("| r | h | K | " + " | ".join(f"{n} µs" for n in names) + " | best fused vs unfused | triton split_k |")
    lines.append("|" + "---|" * (3 + len(names) + 2))
    for row in res["shapes"]:
        cells = []
        for n in names:
            e = row["impls"].get(n, {})
            cells.append("err" if "error" in e else (f"{e['median_us']:.1f}" if "median_us" in e else "-"))
        fused = [row["impls"][n].get("speedup_vs_unfused") for n in ("triton", "extension") if n in row["impls"]]
        fused = [v for v in fused if v]
        best = f"{max(fused):.2f}x" if fused else "-"
        lines.append(
            f"| {row['r']} | {row['h']} | {row['K']} | " + " | ".join(cells) + f" | {best} | {row['triton_config']['split_k']} |"
        )
    lines += ["", "Accuracy (rel_err):", ""]
    lines.append("| r | h | K | " + " | ".join(names) + " |")
    lines.append("|" + "---|" * (3 + len(names)))
    for row in res["shapes"]:
        cells = [
            f"{row['impls'].get(n, {}).get('rel_err', float('nan')):.2e}"
            + ("" if row["impls"].get(n, {}).get("accurate", True) else " FAIL")
            for n in names
        ]
        lines.append(f"| {row['r']} | {row['h']} | {row['K']} | " + " | ".join(cells) + " |")
    bad = [r for r in res["edge_cases"] if not r["ok"]]
    lines += ["", f"Edge cases (public entry point, fp32/fp16/bf16, backends torch/triton/extension): "
              f"{len(res['edge_cases']) - len(bad)}/{len(res['edge_cases'])} ok"]
    for r in bad:
        lines.append(f"- FAIL {r}")
    if res["sweep"]:
        lines += ["", "Triton sweep (best per shape):", ""]
        best: dict = {}
        for e in res["sweep"]:
            key = (e["r"], e["h"], e["K"])
            if "median_us" in e and (key not in best or e["median_us"] < best[key]["median_us"]):
                best[key] = e
        for key, e in best.items():
            cfg = {k: e[k] for k in ("block_n", "block_k", "num_warps", "num_stages", "split_k")}
            lines.append(f"- r={key[0]} h={key[1]} K={key[2]}: {e['median_us']:.1f} µs with {cfg}")
        if res.get("sweep_truncated"):
            lines.append("- (sweep truncated by its time budget)")
    lines += ["", f"Comm-overlap trace: {res['overlap_trace']}", "", f"Wall time: {res['wall_s']:.0f} s", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

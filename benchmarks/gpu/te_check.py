"""What the Transformer Engine checks (te_norm_grad.py, te_lora.py) share: a one-rank process group,
fp32 CUDA matmuls as TF32 or IEEE, and the command line that runs a check and writes its report.

Each check is a script run on the GPU machine (device_run.sh) with torch only on the path besides TE
and megatron-core; they import it as ``benchmarks.gpu.te_check`` (the repository root is on their path).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def one_rank_group(backend: str, rendezvous: Path):
    """A real one-rank process group (this process is rank 0 of a world of 1)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    return dist.new_group(ranks=[0], backend=backend)


def te_on_gpu(report: dict, rendezvous: Path):
    """On the GPU, Transformer Engine importable: TE's version and the device name into ``report``,
    device 0 current; returns a one-rank NCCL group."""
    import transformer_engine

    report["te_version"] = getattr(transformer_engine, "__version__", "unknown")
    report["device"] = torch.cuda.get_device_name(0)
    torch.cuda.set_device(0)
    return one_rank_group("nccl", rendezvous)


@contextlib.contextmanager
def cuda_matmul_tf32(enabled: bool):
    """fp32 CUDA matmuls as TF32 (or IEEE fp32) inside, restored after; the torch >= 2.9 flag where it
    exists (torch refuses a mix of it and the legacy ``allow_tf32``)."""
    matmul = torch.backends.cuda.matmul
    name, value = (("fp32_precision", "tf32" if enabled else "ieee") if hasattr(matmul, "fp32_precision")
                   else ("allow_tf32", enabled))
    saved = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def run_check(name: str, description: str, dry_run_help: str, check: Callable[[bool, Path], dict],
              markdown: Callable[[dict], str], on_error: dict, argv: list[str] | None = None) -> dict | None:
    """Parse ``--out`` / ``--cpu-dry-run``, run ``check(cpu_dry_run, rendezvous)`` and write
    ``<name>.json`` and ``<name>.md`` into ``--out`` (default ``$OUT`` or ``out/<name>``). An exception
    becomes the verdict (``error: ...``, with ``on_error``'s fields; the traceback on stderr) and the
    return value is None; otherwise the report."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", f"out/{name}")))
    p.add_argument("--cpu-dry-run", action="store_true", help=dry_run_help)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch.distributed as dist

    failed = False
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        try:
            report = check(args.cpu_dry_run, Path(tmp) / "rendezvous")
        except Exception as exc:  # recorded as the verdict, the traceback on stderr
            traceback.print_exc()
            report, failed = {"verdict": f"error: {type(exc).__name__}: {exc}", **on_error}, True
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / f"{name}.md").write_text(markdown(report))
    print(f"{name}: {report['verdict']}")
    return None if failed else report

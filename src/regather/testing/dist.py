"""Launch a function on N gloo ranks from a test, with a hard deadline.

Each rank is a fresh ``spawn`` process with its own ``file://`` rendezvous, so
tests running in parallel under pytest-xdist never share a port. The parent
waits for every rank; if one raises, the others are killed and the parent
raises that rank's traceback; if the deadline passes, all are killed and the
parent raises ``TimeoutError``. A failing rank therefore fails the test, never
hangs it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _rank_main(fn, rank, world_size, init_file, out_dir, pg_timeout_s, args, kwargs):
    import torch
    import torch.distributed as dist

    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Apex.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args, **kwargs)
        payload = ("ok", value)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        payload = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(result_path + ".tmp", result_path)
    if payload[0] == "ok":
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0 if payload[0] == "ok" else 1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn`` must be importable (module level). Returns the per-rank results.
    ``timeout`` bounds the whole run; ``pg_timeout`` (default: ``timeout``)
    bounds each collective, so a rank stuck in a collective errors out too.
    """
    ctx = mp.get_context("spawn")
    pg_timeout = pg_timeout or timeout
    with tempfile.TemporaryDirectory(prefix="regather-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, init_file, tmp, pg_timeout, args, kwargs),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        try:
            while len(results) < world_size:
                for r in range(world_size):
                    path = os.path.join(tmp, f"rank{r}.pkl")
                    if r in results or not os.path.exists(path):
                        if r not in results and not procs[r].is_alive() and not os.path.exists(path):
                            raise RankFailed(f"rank {r} exited with code {procs[r].exitcode} "
                                             "without reporting a result")
                        continue
                    with open(path, "rb") as f:
                        status, value = pickle.load(f)
                    if status == "error":
                        raise RankFailed(value)
                    results[r] = value
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
                time.sleep(0.02)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        return [results[r] for r in range(world_size)]

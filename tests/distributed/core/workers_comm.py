import torch
import torch.distributed as dist

from regather.core import comm


def exercise_comm(rank, world_size):
    group = dist.group.WORLD
    out = {}
    x = torch.arange(6, dtype=torch.float32).view(3, 2) + 10 * rank
    out["gather_sync"] = comm.all_gather_seq(x, group)
    pending = comm.all_gather_seq(x, group, async_op=True)
    out["gather_async"] = pending.wait()
    full = torch.ones(4, 3) * (rank + 1)
    out["scatter_sync"] = comm.reduce_scatter_seq(full, group)
    out["scatter_async"] = comm.reduce_scatter_seq(full, group, async_op=True).wait()
    y = torch.full((5,), float(rank + 1))
    comm.all_reduce_(y, group, async_op=True).wait()
    out["all_reduce"] = y
    errors = []
    for call in (lambda: comm.all_gather_seq(x, group, out=torch.empty(5, 2)),
                 lambda: comm.reduce_scatter_seq(torch.ones(3, 2), group),
                 lambda: comm.all_reduce_(torch.ones(4, 4).t(), group)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out

"""Bytes as the allocator sees them: what a region allocated and left alive at its end.

:class:`~regather.core.accounting.SavedBytes` counts what autograd's saved-tensor hooks see; it is
blind inside an activation checkpoint (the checkpoint's own hooks replace the saved tensors, and
selective checkpointing caches op outputs in its dispatch mode) and inside a compiled graph (AOT
autograd saves activations itself). The allocator sees all of them. :class:`AllocatedBytes` reads
the profiler's memory events of the region (``profile_memory=True``, the device of the tensors)
and keeps, by address, every block allocated inside it and not freed before it ends: frees of
blocks allocated before the region (a previous step's garbage) are not subtracted.

A block freed by another thread after the region ends (a gloo work object released late) would
still count: with ``settle_collectives=True`` (every rank of the default group entering the region
alike) the region ends at a barrier, which waits for the collectives in flight, so their blocks are
freed inside it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def _allocations(events, device: str, out: list) -> list:
    for e in events:
        f = e.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation" and f.device.type == device:
            out.append((e.start_time_ns, f.ptr, f.alloc_size))
        _allocations(e.children, device, out)
    return out


class AllocatedBytes:
    """``with AllocatedBytes() as a: ...`` then ``a.alive``: bytes allocated on ``device`` inside
    the block and still alive when it ended."""

    def __init__(self, device: str = "cpu", settle_collectives: bool = False):
        self.device = device
        self.settle_collectives = settle_collectives
        self.alive = 0
        self._prof = None

    def __enter__(self) -> AllocatedBytes:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.settle_collectives and exc[0] is None and dist.is_initialized():
            dist.barrier()
        self._prof.__exit__(*exc)
        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        live: dict = {}
        for _, ptr, size in sorted(_allocations(tree, self.device, [])):
            if size > 0:
                live[ptr] = size
            else:
                live.pop(ptr, None)
        self.alive = sum(live.values())
        self._prof = None

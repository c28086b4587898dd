"""Bytes as the allocator sees them: what a region allocated and left alive at its end.

:class:`~regather.core.accounting.SavedBytes` counts what autograd's saved-tensor hooks see; it is
blind inside an activation checkpoint (the checkpoint's own hooks replace the saved tensors, and
selective checkpointing caches op outputs in its dispatch mode) and inside a compiled graph (AOT
autograd saves activations itself). The allocator sees all of them. :class:`AllocatedBytes` reads
the profiler's memory events of the region (``profile_memory=True``, the device of the tensors)
and keeps, by address, every block allocated inside it and not freed before it ends: frees of
blocks allocated before the region (a previous step's garbage) are not subtracted.

**Collectives and the profiler's blind threads.** The profiler records memory events only on the
thread that profiles. A gloo collective runs on one of its process group's worker threads, and its
work object holds the collective's tensors (input, output, the output's chunks) until that worker,
after finishing it, drops the work. When the calling thread has already dropped its own references
(the gathered input of a frozen linear, used once), the worker frees the block unseen, and the block
counts as alive; when the calling thread drops last, the free is seen. Which thread drops last is a
race: ``regather bench --torchtitan`` run four times gave one variant +0, +32, +62 or -32 KiB (the
frozen model's count off by a gathered input). A barrier at the end does not help: gloo's barrier
holds the works still in progress, and its own worker drops them.

With ``settle_collectives=True`` (every rank of each process group used entering the region alike)
the region ends by draining each process group used, and the default one, with :data:`DRAIN_ROUNDS`
all-reduces of a tensor allocated before the region (a worker drops a finished work before it takes
the next). With ``hold_collective_tensors=True`` too, the calling thread holds every tensor a
collective reads or writes inside the region (a dispatch mode on ``c10d`` and ``_c10d_functional``
ops; ``DTensor`` runs first, so the mode sees the plain tensors) and drops its holds after the
drain, so every collective block is freed, or kept by its real owner, on the profiling thread. Measured on two gloo ranks, a region of six all-gathers
whose outputs die inside it (``tests/distributed/core/workers_allocated.py``): regions with phantom bytes
83 and 77 of 120 (rank 0, rank 1) as before, 73 and 68 when only draining, 0 and 1 holding and
draining. A worker descheduled across the drains can still hold its last work; the count is then too
high, never too low, so ``regather bench`` takes the smallest of a few steps' counts. Holding is off by
default: around ``torch.compile``'d code a dispatch mode makes Dynamo refuse the frames ("non-infra
torch dispatch mode present"), so only code that runs eagerly may ask for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from regather.core.unwrap import wrapper_types

#: Synchronous all-reduces per process group at the end of a settled region: one per gloo worker
#: thread (two per group); a worker drops a finished work before it takes the next one.
DRAIN_ROUNDS = 2
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def _allocations(events, device: str, out: list) -> list:
    for e in events:
        f = e.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation" and f.device.type == device:
            out.append((e.start_time_ns, f.ptr, f.alloc_size))
        _allocations(e.children, device, out)
    return out


class _HoldCollectiveTensors(TorchDispatchMode):
    """Keeps every tensor a collective op reads or writes (so the calling thread drops it, not a
    gloo worker) and the process groups the collectives ran on."""

    def __init__(self):
        super().__init__()
        self.held: list[torch.Tensor] = []
        self.groups: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, wrapper_types()) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            for leaf in tree_leaves((args, kwargs, out)):
                if isinstance(leaf, torch.Tensor):
                    self.held.append(leaf)
                elif isinstance(leaf, dist.ProcessGroup):
                    self.groups.setdefault(leaf.group_name, leaf)
                elif isinstance(leaf, str) and func.namespace == "_c10d_functional":
                    self._add_group_named(leaf)
        return out

    def _add_group_named(self, name: str) -> None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        if name not in self.groups:
            try:
                self.groups[name] = _resolve_process_group(name)
            except (RuntimeError, ValueError, KeyError):  # a string argument that names no group
                pass


class AllocatedBytes:
    """``with AllocatedBytes() as a: ...`` then ``a.alive``: bytes allocated on ``device`` inside
    the block and still alive when it ended. ``settle_collectives``: see the module doc."""

    def __init__(self, device: str = "cpu", settle_collectives: bool = False, hold_collective_tensors: bool = False):
        self.device = device
        self.settle_collectives = settle_collectives
        self.hold_collective_tensors = hold_collective_tensors
        self.alive = 0
        self._prof = None
        self._hold: _HoldCollectiveTensors | None = None
        self._drain: torch.Tensor | None = None

    def _settling(self) -> bool:
        return self.settle_collectives and dist.is_available() and dist.is_initialized()

    def __enter__(self) -> AllocatedBytes:
        if self._settling():
            self._drain = torch.zeros(1, device=self.device)  # before the region: never counted
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        if self._drain is not None and self.hold_collective_tensors:
            self._hold = _HoldCollectiveTensors()
            self._hold.__enter__()
        return self

    def _settle(self, hold: _HoldCollectiveTensors | None) -> None:
        groups = dict(hold.groups) if hold is not None else {}
        default = dist.distributed_c10d._get_default_group()
        groups.setdefault(default.group_name, default)
        for name in sorted(groups):  # the same order on every rank
            for _ in range(DRAIN_ROUNDS):
                dist.all_reduce(self._drain, group=groups[name])
        if hold is not None:
            hold.held.clear()  # on this thread: every free is seen

    def __exit__(self, *exc) -> None:
        hold, self._hold = self._hold, None
        try:
            if hold is not None:
                hold.__exit__(*exc)
            if self._drain is not None and exc[0] is None:
                self._settle(hold)
        finally:
            self._prof.__exit__(*exc)
        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        live: dict = {}
        for _, ptr, size in sorted(_allocations(tree, self.device, [])):
            if size > 0:
                live[ptr] = size
            else:
                live.pop(ptr, None)
        self.alive = sum(live.values())
        self._prof = self._drain = None

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

**The peak** (``peak``: what ``torch.cuda.max_memory_allocated`` shows, less the level at the region's
start). The events in order give the live bytes at every moment: an allocation adds, the free of a block
allocated inside the region subtracts. The free of an older block is not counted: on CPU the allocator
reports it only for blocks made while some profiler ran, and what frees it there is mostly the garbage
collector running inside the region (another step's tensors), so counting it would make two equal steps
differ; the peak is then the most bytes the region itself had alive at once (an upper bound of the
allocator's rise, exact where the region frees nothing older).
Holding a collective's tensors to the end would raise the peak (they would outlive their use), and a
free a gloo worker makes unseen would keep it high to the end. ``settle_each_collective=True`` does
neither: right after each collective the calling thread drains that collective's process group (the
rounds above), so its worker has dropped the work before the region goes on and every block is freed,
on the profiling thread, when its last real owner drops it. The drains serialise the collectives (no
overlap inside a measured region: lifetimes as without overlap, never shorter). A worker descheduled
between finishing a work and dropping it, across both drains, still frees that work's blocks unseen (rare:
measured here about one region in ten under load); the count is then too high, never too low, so the
tools take the smallest of a few steps.
``mark(name)`` and the region's end run Python's garbage collector first: a tensor held by a reference
cycle (a functional collective's wrappers) would otherwise be alive until the collector happened to run,
inside a later region or not. The objects alive when the region starts are frozen (``gc.freeze``) until
it ends, so these collections scan only what the region made: with megatron imported a full collection
takes about 0.2 s, a region's a few milliseconds. The region's end thaws everything (``gc.unfreeze``
cannot tell a program's own frozen objects from the region's): a program that froze objects before, a
pre-fork freeze say, has them back in the oldest generation. CPython 3.12 starts with a few hundred
objects frozen, so "freeze only where nothing is frozen yet" froze nothing there and each region paid the
full collections again (the peak tests took 60 s instead of 4 s per spawn on 3.12). ``mark(name)``
records a moment (a marker allocation of a size nothing else has), so one region can give both what a forward leaves alive (:meth:`alive_at`) and the step's peak. On CUDA the
allocator keeps a peak of its own: ``device="cuda"`` reads ``torch.cuda.max_memory_allocated`` for ``peak``.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from regather.core.unwrap import wrapper_types

#: Synchronous all-reduces per process group at the end of a settled region: one per gloo worker
#: thread (two per group); a worker drops a finished work before it takes the next one.
DRAIN_ROUNDS = 2
#: settle_each_collective: a pause after a collective finished, before its drains (a loaded machine may
#: not schedule the worker that has to drop the finished work in the drains' few hundred microseconds)
SETTLE_PAUSE_S = 0.002
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def _allocations(events, device: str, out: list) -> list:
    for e in events:
        f = e.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation" and f.device.type == device:
            out.append((e.start_time_ns, f.ptr, f.alloc_size))
        _allocations(e.children, device, out)
    return out


def _unboxed(leaf):
    """A ``c10d`` op's process group and work reach a dispatch mode as TorchScript objects: the
    Python ``ProcessGroup`` / ``Work`` they box (anything else as it is)."""
    if type(leaf).__name__ == "ScriptObject":
        kind = leaf._type().qualified_name().rsplit(".", 1)[-1]
        cls = {"ProcessGroup": dist.ProcessGroup, "Work": dist.Work}.get(kind)
        return cls.unbox(leaf) if cls is not None else leaf
    return leaf


class _HoldCollectiveTensors(TorchDispatchMode):
    """Keeps every tensor a collective op reads or writes (so the calling thread drops it, not a
    gloo worker) and the process groups the collectives ran on. With ``settle`` (a function of a
    ``{name: group}`` dict) it holds nothing and settles each collective instead: a ``c10d`` op's works
    are waited for and its groups drained; a functional collective's group is drained once its
    ``wait_tensor`` returned (its work is not among the op's values)."""

    def __init__(self, settle=None):
        super().__init__()
        self.held: list[torch.Tensor] = []
        self.groups: dict[str, object] = {}
        self._settle = settle

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, wrapper_types()) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", None)
        if namespace not in _COLLECTIVE_NAMESPACES:
            return out
        used, works, groups = [], [], {}
        for leaf in map(_unboxed, tree_leaves((args, kwargs, out))):
            if isinstance(leaf, torch.Tensor):
                used.append(leaf)
            elif isinstance(leaf, dist.Work):
                works.append(leaf)
            elif isinstance(leaf, dist.ProcessGroup):
                groups[leaf.group_name] = leaf
            elif isinstance(leaf, str) and namespace == "_c10d_functional":
                groups.update(self._group_named(leaf))
        self.groups.update(groups)
        if self._settle is None:
            self.held.extend(used)
            return out
        del used
        if namespace == "c10d":
            for work in works:  # finished before the drains: a drain cannot overtake it on another worker
                work.wait()
            time.sleep(SETTLE_PAUSE_S)  # the worker that ran it drops it right after; let it be scheduled
            self._settle(groups)  # inside __torch_dispatch__ this mode is off: the drains pass it by
        elif func.__name__.startswith("wait_tensor"):
            self._settle(self.groups)
        return out

    @staticmethod
    def _group_named(name: str) -> dict:
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            return {name: _resolve_process_group(name)}
        except (RuntimeError, ValueError, KeyError):  # a string argument that names no group
            return {}


_MARK_BYTES = 4093  # a marker's size (odd, prime): no tensor of the region allocates exactly this


class AllocatedBytes:
    """``with AllocatedBytes() as a: ...`` then ``a.alive``: bytes allocated on ``device`` inside
    the block and still alive when it ended; ``a.peak``: the most bytes alive at any moment of the
    block over its start. ``settle_collectives``, ``hold_collective_tensors``,
    ``settle_each_collective``: see the module doc (the last makes ``peak`` exact under gloo)."""

    def __init__(self, device: str = "cpu", settle_collectives: bool = False, hold_collective_tensors: bool = False,
                 settle_each_collective: bool = False):
        if hold_collective_tensors and settle_each_collective:
            raise ValueError("AllocatedBytes: hold_collective_tensors and settle_each_collective exclude each "
                             "other (holding raises the peak, settling each makes holding unneeded)")
        self.device = device
        self.settle_collectives = settle_collectives or settle_each_collective
        self.hold_collective_tensors = hold_collective_tensors
        self.settle_each_collective = settle_each_collective
        self.alive = 0
        self.peak = 0
        self._marks: dict[str, int] = {}
        self._alive_at: dict[str, int] = {}
        self._prof = None
        self._hold: _HoldCollectiveTensors | None = None
        self._drain: torch.Tensor | None = None
        self._cuda_start = 0

    def _settling(self) -> bool:
        return self.settle_collectives and dist.is_available() and dist.is_initialized()

    def __enter__(self) -> AllocatedBytes:
        if self._settling():
            self._drain = torch.zeros(1, device=self.device)  # before the region: never counted
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        # what exists now is not the region's: the collections below scan only what it made (fast)
        gc.freeze()
        if self._drain is not None and (self.hold_collective_tensors or self.settle_each_collective):
            self._hold = _HoldCollectiveTensors(self._drain_groups if self.settle_each_collective else None)
            self._hold.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Record this moment as ``name``: :meth:`alive_at` gives what the region had allocated and not
        freed by then."""
        if name in self._marks:
            raise ValueError(f"AllocatedBytes: mark {name!r} recorded twice")
        gc.collect()  # garbage in reference cycles (a functional collective's wrappers) is not what is alive
        marker = torch.empty(_MARK_BYTES + len(self._marks), dtype=torch.uint8, device=self.device)
        self._marks[name] = marker.numel()
        del marker

    def alive_at(self, name: str) -> int:
        """Bytes allocated inside the region before mark ``name`` and alive at it."""
        if name not in self._alive_at:
            raise KeyError(f"AllocatedBytes: no mark {name!r} (marks: {sorted(self._alive_at)})")
        return self._alive_at[name]

    def _drain_groups(self, groups: dict) -> None:
        for name in sorted(groups):  # the same order on every rank
            for _ in range(DRAIN_ROUNDS):
                dist.all_reduce(self._drain, group=groups[name])

    def _settle(self, hold: _HoldCollectiveTensors | None) -> None:
        default = dist.distributed_c10d._get_default_group()
        self._drain_groups({**(hold.groups if hold is not None else {}), default.group_name: default})
        if hold is not None:
            hold.held.clear()  # on this thread: every free is seen

    def __exit__(self, *exc) -> None:
        hold, self._hold = self._hold, None
        if exc[0] is None:
            gc.collect()  # as in mark(): what a cycle holds until the collector runs is garbage, freed here
        try:
            if hold is not None:
                hold.__exit__(*exc)
            if self._drain is not None and exc[0] is None:
                self._settle(hold)
        finally:
            self._prof.__exit__(*exc)
            gc.unfreeze()  # frozen at __enter__
        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        self._count(sorted(_allocations(tree, self.device, [])))
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._cuda_start
        self._prof = self._drain = None

    def _count(self, events: list) -> None:
        """``alive``, ``peak`` and the marks' counts from the region's events in order."""
        sizes = {size: name for name, size in self._marks.items()}
        live: dict = {}
        level = peak = 0
        markers: set = set()
        for _, ptr, size in events:
            if size > 0 and ptr in live:  # an address handed out again: its block was freed unseen (module doc)
                level -= live.pop(ptr)
            if size > 0 and size in sizes:  # a marker: its moment, not its bytes
                self._alive_at[sizes.pop(size)] = sum(live.values())
                markers.add(ptr)
                continue
            if size < 0 and ptr in markers:
                markers.discard(ptr)
                continue
            if size > 0:
                live[ptr] = size
                level += size
                peak = max(peak, level)
            elif ptr in live:  # a block of the region freed; an older one's free is not counted (module doc)
                level -= live.pop(ptr)
        missing = sorted(set(self._marks) - set(self._alive_at))
        if missing:
            raise RuntimeError(f"AllocatedBytes: the profiler recorded no event for mark(s) {missing}")
        self.alive = sum(live.values())
        self.peak = peak

"""Allocator bytes alive after a region that calls gloo collectives, without gloo's timing in them.

:class:`regather.core.allocated.AllocatedBytes` counts the blocks allocated inside a region and not
freed inside it. The profiler records the frees of the calling thread only. A gloo collective's work
object holds the tensors it was given (and views of them) until gloo's worker thread drops it, after
the call has returned; when that drop is the last reference, the block is freed on the worker
thread and the count sees it alive for good — a ``[s/t, b, r]`` product here, a gathered ``[s, b, h]``
there, at random (measured: one forward in two on the tiny GPT at TP2 + SP, 2 busy cores). NCCL
frees nothing that way.

:func:`settled_allocated` holds a reference to every tensor a ``c10d`` op receives inside the region
(a ``TorchDispatchMode``: it sees the ops ``torch.distributed`` dispatches, and changes nothing they
compute), lets gloo's threads finish with a few barriers, then drops those references on the calling
thread, inside the profile: the last reference is then the caller's, and its free is recorded.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from regather.core.allocated import AllocatedBytes

SETTLE_BARRIERS = 3


class _HeldCollectiveArgs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            stack = list(args) + list(kwargs.values())
            while stack:
                a = stack.pop()
                if isinstance(a, torch.Tensor):
                    self.held.append(a)
                elif isinstance(a, (list, tuple)):
                    stack.extend(a)
        return func(*args, **kwargs)


@contextlib.contextmanager
def settled_allocated():
    """``with settled_allocated() as region: ...`` then ``region.alive`` (module doc); every rank of
    the default group must enter it alike."""
    region = AllocatedBytes()
    with region:
        mode = _HeldCollectiveArgs()
        with mode:
            yield region
        if dist.is_initialized():
            for _ in range(1 + SETTLE_BARRIERS):
                dist.barrier()
        mode.held.clear()

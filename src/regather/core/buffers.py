"""Scratch buffers for gathered activations, keyed by (purpose, dtype, device).

Lifetime rules (the pool enforces the first two, the callers the rest):

1. A buffer is *leased* by exactly one operation from :meth:`ScratchPool.acquire`
   to :meth:`Lease.release`. While leased it is never handed out again; a
   second request with the same key gets another buffer (allocated if needed).
   So two collectives in flight never share memory.
2. A released buffer goes back to its key's free list and keeps its storage
   (like megatron's global memory buffer): the pool's footprint is one buffer
   per concurrently leased operation, sized to the largest request.
3. Release only after the collective writing into the buffer was waited on and
   the last kernel reading it was *enqueued* on the compute stream. Every later
   writer is a collective on the communication stream, which first waits on the
   compute stream (see :mod:`regather.core.comm`), so stream order protects readers.
4. Never keep a view of a leased buffer past its release; copy what must
   survive (regather never needs to: it saves the sequence-local shard).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

import torch


class Lease:
    """A buffer on loan; ``tensor`` is a view of the requested shape."""

    __slots__ = ("_key", "_pool", "_released", "_storage", "tensor")

    def __init__(self, pool, key, storage, shape):
        self._pool, self._key, self._storage = pool, key, storage
        self.tensor = storage[: math.prod(shape)].view(shape)
        self._released = False

    def release(self) -> None:
        if self._released:
            raise RuntimeError(f"scratch buffer {self._key} released twice")
        self._released = True
        self.tensor = None
        self._pool._give_back(self._key, self._storage)


class ScratchPool:
    """Free lists of 1-D buffers; see the module docstring for the lifetime rules."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._leased: dict[tuple, int] = defaultdict(int)
        self._lock = threading.Lock()
        self.allocations = 0  # how many buffers were ever created

    def acquire(self, purpose: str, shape, dtype: torch.dtype, device) -> Lease:
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        key = (purpose, dtype, torch.device(device))
        with self._lock:
            free = self._free[key]
            fits = [b for b in free if b.numel() >= numel]
            if fits:
                storage = min(fits, key=torch.Tensor.numel)
                free.remove(storage)
            else:
                if free:  # too small for this request: let the allocator reclaim it
                    free.remove(min(free, key=torch.Tensor.numel))
                storage = torch.empty(numel, dtype=dtype, device=device)
                self.allocations += 1
            self._leased[key] += 1
        return Lease(self, key, storage, shape)

    def _give_back(self, key, storage) -> None:
        with self._lock:
            self._leased[key] -= 1
            self._free[key].append(storage)

    def in_flight(self, purpose: str | None = None) -> int:
        """Number of leased buffers (for one purpose, or all)."""
        with self._lock:
            return sum(n for k, n in self._leased.items() if purpose is None or k[0] == purpose)

    def reserved_bytes(self) -> int:
        """Bytes held in free lists (leased buffers are counted by their users)."""
        with self._lock:
            return sum(b.numel() * b.element_size() for bs in self._free.values() for b in bs)

    def clear(self) -> None:
        """Drop every free buffer (leased ones are returned to an empty pool later)."""
        with self._lock:
            self._free.clear()


_DEFAULT_POOL = ScratchPool()


def default_pool() -> ScratchPool:
    return _DEFAULT_POOL

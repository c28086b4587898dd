"""One sequence all-gather of ``x_local`` for several LoRA-A's that read the same input.

``CanonicalLoRA`` puts three adapters on ``linear_qkv`` (q, k, v) and two on ``linear_fc1``
(gate, up). Under regather each would gather the shard in forward, save it, and gather it
again in backward. A :class:`SharedGather`, made by the wrapper for one forward, lets them
share both gathers; each adapter's GEMMs stay its own, so the results are those of separate
adapters bit for bit:

============================ ====================== =====================================
per forward of the wrapper   separate adapters (n)  with a SharedGather
============================ ====================== =====================================
saved for backward           ``x_local`` (one        the same (one storage)
                             storage: same tensor)
forward all-gathers of x     n                      1 (scratch, freed after the last GEMM)
backward all-gathers of x    n                      1 (started by the first member that needs
                                                    it, freed after the last member's ``dA``)
input recomputes (recompute) n                      1
============================ ====================== =====================================

Lifetimes are counted per member; after the last one the share resets, so a second backward
(``retain_graph``) gathers again. Interleaved micro-batches each have their own share.

A caller that knows its members in advance gives their number (``CanonicalLoRA``: the adapters
of one wrapper that decide regather). One that learns them during the forward — PyTorch-native
tensor parallelism gathers once per module for adapters that decide one by one — opens an
empty share per forward (:meth:`SharedGather.open`), which each member joins
(:meth:`SharedGather.join`) before its forward reads it.
"""

from __future__ import annotations

from regather.core import comm
from regather.core.buffers import ScratchPool

FORWARD_SCRATCH = "regather.forward.x_full"
BACKWARD_SCRATCH = "regather.backward.x_full"


def full_shape(x_local, t: int, seq_dim: int = 0):
    """The shape of ``x_local`` gathered over ``t`` ranks on sequence dim ``seq_dim``."""
    seq_dim = seq_dim % x_local.dim()
    return tuple(x_local.shape[:seq_dim]) + (x_local.shape[seq_dim] * t,) + tuple(x_local.shape[seq_dim + 1:])


class SharedGather:
    """The forward and backward gathers of ``members`` LoRA-A's on one input."""

    def __init__(self, members: int, group, pool: ScratchPool, seq_dim: int = 0):
        if members < 1:
            raise ValueError(f"a shared gather needs at least one member, got {members}")
        self.members, self.group, self.pool, self.seq_dim = members, group, pool, seq_dim
        self._fwd_lease, self._fwd_left = None, members
        self._lease = self._pending = self._full = self._x = None
        self._left = members

    @classmethod
    def open(cls, group, pool: ScratchPool, seq_dim: int = 0) -> SharedGather:
        """A share for one forward with no member yet; members :meth:`join` as they run."""
        share = cls(1, group, pool, seq_dim)
        share.members = share._fwd_left = share._left = 0
        return share

    def join(self) -> None:
        """One more member (before the backward of this forward starts)."""
        if self._pending is not None or self._full is not None:
            raise RuntimeError("a member joined a shared gather whose backward gather has started")
        self.members += 1
        self._fwd_left += 1
        self._left += 1

    # -- forward ---------------------------------------------------------------------------
    def forward_full(self, x_local):
        """``all_gather(x_local)`` into a scratch buffer, once for all members."""
        if self._fwd_lease is None:
            t = comm.world_size(self.group)
            self._fwd_lease = self.pool.acquire(FORWARD_SCRATCH, full_shape(x_local, t, self.seq_dim), x_local.dtype,
                                                x_local.device)
            comm.all_gather_seq(x_local, self.group, out=self._fwd_lease.tensor, dim=self.seq_dim)
        return self._fwd_lease.tensor

    def forward_done(self) -> None:
        """A member's forward GEMM has read the scratch; the last one frees it."""
        self._fwd_left -= 1
        if self._fwd_left == 0:
            self._fwd_lease.release()
            self._fwd_lease, self._fwd_left = None, self.members

    # -- backward --------------------------------------------------------------------------
    def start(self, source, saved) -> None:
        """Start the backward gather (no-op once started): load the shard (kept or recomputed)."""
        if self._pending is not None or self._full is not None:
            return
        x = self._x = source.load(saved)  # alive until the gather has read it
        t = comm.world_size(self.group)
        self._lease = self.pool.acquire(BACKWARD_SCRATCH, full_shape(x, t, self.seq_dim), x.dtype, x.device)
        self._pending = comm.all_gather_seq(x, self.group, out=self._lease.tensor, async_op=True, dim=self.seq_dim)

    def wait(self, observer=None):
        """The gathered input (waits once; through ``observer.wait(pending)`` when one is given,
        :attr:`regather.core.strategies.regather.RegatherSlot.observer`)."""
        if self._full is None:
            self._full = self._pending.wait() if observer is None else observer.wait(self._pending)
            self._pending = self._x = None
        return self._full

    def done(self) -> None:
        """A member's ``dA`` has read the gathered input; the last one frees it."""
        self._left -= 1
        if self._left == 0:
            self._lease.release()
            self._lease = self._full = None
            self._left = self.members

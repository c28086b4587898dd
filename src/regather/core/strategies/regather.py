"""The regather strategy: save the sequence-local shard, gather it again in backward.

Column-parallel base under sequence parallelism, per rank (``t`` TP size):

=========== ================== ===================== ==========================
tensor      shape              forward               backward
=========== ================== ===================== ==========================
x_local     ``[s/t, b, h]``    input; **saved**      gathered again into scratch
x_full      ``[s, b, h]``      scratch, freed        scratch, freed after dA
A_i         ``[r/t, h]``       weight                weight
mid_i       ``[s, b, r/t]``    ``x_full A_i^T``      ``dmid_i`` arrives
dX_full     ``[s, b, h]``      —                     ``dmid_i A_i`` (partial)
dX_local    ``[s/t, b, h]``    —                     reduce-scatter of dX_full
=========== ================== ===================== ==========================

Equations (identical GEMMs to :mod:`regather.core.strategies.gather`, so the
results are bit-identical):

    mid_i    = all_gather(x_local) A_i^T
    dX_local = reduce_scatter(dmid_i A_i)
    dA_i     = dmid_i^T all_gather(x_local)

Why ``x_local`` and not ``x_full`` is saved: the frozen base layer needs no
input in backward, so ``x_full`` was kept only for ``dA_i``. Keeping the shard
costs ``s*b*h/t`` elements instead of ``s*b*h``; the price is one more
all-gather in backward (``s*b*h*(t-1)/t`` elements received per rank).

Backward order, chosen so the gather overlaps compute:

1. start the async all-gather of ``x_local`` into a scratch buffer;
2. ``dX_full = dmid_i A_i`` while it runs;
3. start the async reduce-scatter of ``dX_full``;
4. wait for the gather, ``dA_i = dmid_i^T x_full`` (into ``main_grad`` when
   fused), release the scratch buffer;
5. wait for the reduce-scatter, return ``dX_local``.

Early re-gather (:class:`RegatherSlot`, the default; ``early=False`` keeps the
order above). Each forward gets its own slot; two hooks move the work so the
gather overlaps more than LoRA-A's skinny dgrad:

* **early start** — a tensor hook on the adapter *output* fires when its
  gradient arrives, before LoRA-B's dgrad, the ``dmid`` all-reduce and LoRA-A's
  dgrad run, and issues the async all-gather of ``x_local`` into a pool lease;
* **deferred dA** — a junction (:mod:`regather.core.peak.junction`), an identity on
  the input of the wrapped layer (``LoRALinear``) or of the adapter, takes LoRA-A as a second
  input. Its backward runs only once everything that read that input has
  produced its input gradient (the frozen base layer's dgrad and
  reduce-scatter included); there it waits for the gather and computes ``dA``.
  LoRA-A's gradient edge therefore comes from this node: autograd runs the
  parameter's grad-accumulator (megatron DDP's grad-ready hook) only after
  ``dA`` reached ``.grad`` / ``main_grad``.

Order with both: hook issues gather → B dgrad → all-reduce dmid → A dgrad →
reduce-scatter → base dgrad (+ its reduce-scatter) → wait gather → dA →
release → grad-ready hooks. GEMMs and their operands are unchanged, so the
results stay bit-identical to the gather path. Deferral is used only when the
input requires grad (otherwise nothing would call the anchor's backward); then
``dA`` is computed in LoRA-A's backward as before. Cost: the backward scratch
``x_full`` (``s*b*h``) is alive during the base dgrad instead of after it —
transient, one per adapter in flight, never carried across layers.

The slot holds what the forward saved for ``x_local`` (the same tensors as
``save_for_backward``, so no new memory) and checks their version counters before
gathering, as autograd does for saved tensors. Micro-batches may interleave
(fwd1 fwd2 bwd2 bwd1): each forward's hook, Functions and lease are its own.

Where ``x_local`` comes from is the path's *source*
(:mod:`regather.core.recompute.sources`): kept as is, or recomputed from what its
producer (the LayerNorm) already keeps — then the slot recomputes it just before the
gather, when the gather would start anyway (early: at the output-gradient hook), and
holds the recomputed shard only until ``dA`` has read the gathered copy.
"""

from __future__ import annotations

import torch

from regather.core import comm
from regather.core.buffers import ScratchPool, default_pool
from regather.core.recompute.sources import KEEP
from regather.core.strategies.shared_gather import BACKWARD_SCRATCH, FORWARD_SCRATCH, SharedGather, full_shape
from regather.core.wgrad import weight_grad


class RegatherSlot:
    """The backward state of one regather forward: its gather, lease and deferred ``dA``."""

    __slots__ = (
        "defer",
        "early",
        "full",
        "fuse",
        "grad_mid",
        "group",
        "lease",
        "pending",
        "pool",
        "saved",
        "seq_dim",
        "share",
        "source",
        "versions",
        "weight",
        "x_local",
    )
    #: What backward waits on the re-gather through: None (``pending.wait()``), or an observer
    #: whose ``wait(pending)`` returns ``pending.wait()`` and measures it. Set only by a measuring
    #: tool for the span it measures (``regather.tools.bench.clocks.regather_waits``).
    observer = None

    def __init__(self, group, pool: ScratchPool, early: bool, defer: bool, share: SharedGather | None = None,
                 seq_dim: int = 0):
        self.group, self.pool, self.early, self.defer, self.share = group, pool, early, defer, share
        self.seq_dim = seq_dim
        self.source, self.saved, self.versions, self.x_local = KEEP, None, None, None
        self.lease = self.pending = self.full = None
        self.grad_mid = self.weight = self.fuse = None

    def bind(self, source, saved) -> None:
        """Called by the forward: what was saved for the shard, and how to load it."""
        self.source, self.saved = source, tuple(saved)
        self.versions = tuple(None if t is None else t._version for t in self.saved)

    def on_output_grad(self, grad):
        """Tensor hook on the adapter output: start the gather now."""
        if self.saved is not None:
            self.start_gather()
        return None

    def start_gather(self) -> None:
        if self.pending is not None:
            return
        for t, version in zip(self.saved, self.versions):
            if t is not None and t._version != version:
                raise RuntimeError(
                    f"regather: the adapter input was modified in place after forward "
                    f"(version {version} -> {t._version}); it is needed for LoRA-A's gradient"
                )
        if self.share is not None:  # CanonicalLoRA: one gather for the adapters on this input
            self.share.start(self.source, self.saved)
            self.pending = self.share
            return
        x = self.x_local = self.source.load(self.saved)  # alive until the gather has read it
        t = comm.world_size(self.group)
        self.lease = self.pool.acquire(BACKWARD_SCRATCH, full_shape(x, t, self.seq_dim), x.dtype, x.device)
        self.pending = comm.all_gather_seq(x, self.group, out=self.lease.tensor, async_op=True, dim=self.seq_dim)

    def gathered(self) -> torch.Tensor:
        """The re-gathered input, waited for (the gather started if it was not): for another reader before
        ``dA`` (DoRA's magnitude gradient, :mod:`regather.core.peak.rebuild`). It stays until ``dA`` has
        read it, as the early start keeps it."""
        self.start_gather()
        if self.share is not None:
            return self.share.wait(self.observer)
        if self.full is None:
            self.full = self.pending.wait() if self.observer is None else self.observer.wait(self.pending)
        return self.full

    def weight_grad(self, weight, grad_mid, fuse):
        """Wait for the gather, ``dA = dmid^T x_full``, release the scratch buffer."""
        self.start_gather()
        if self.share is not None:
            grad_w = weight_grad(weight, grad_mid, self.share.wait(self.observer), fuse)
            self.share.done()
            self.pending = None
            return grad_w
        x_full = self.gathered()
        grad_w = weight_grad(weight, grad_mid, x_full, fuse)
        self.lease.release()  # the GEMM above was the last reader
        self.lease = self.pending = self.x_local = self.full = None
        return grad_w

    @classmethod
    def for_backward(cls, slot, group, pool, source, saved, need_w: bool, share=None, seq_dim: int = 0) -> RegatherSlot:
        """The forward's slot (a fresh plain one if it had none), its gather started if dA is needed."""
        if slot is None:  # plain regather: the gather starts here
            slot = cls(group, pool, early=False, defer=False, share=share, seq_dim=seq_dim)
            if saved is not None:
                slot.bind(source, saved)
        if need_w:
            slot.start_gather()  # no-op when the output hook already did
        return slot

    def weight_grad_or_defer(self, weight, grad_mid, fuse):
        """``dA`` now, or ``None`` after handing ``dmid`` to the junction that defers it."""
        if self.defer:
            self.grad_mid, self.weight, self.fuse = grad_mid, weight, fuse
            return None
        return self.weight_grad(weight, grad_mid, fuse)

    def finish_deferred(self):
        if self.grad_mid is None:
            return None
        grad_mid, self.grad_mid = self.grad_mid, None
        return self.weight_grad(self.weight, grad_mid, self.fuse)


class RegatherLinearA(torch.autograd.Function):
    """LoRA-A under SP that saves ``x_local`` and re-gathers it in backward."""

    @staticmethod
    def forward(ctx, x_local, weight, group, fuse, pool, slot, source, share, seq_dim):
        if share is not None:  # the gather is shared with the other adapters on this input
            mid = torch.matmul(share.forward_full(x_local), weight.t())
            share.forward_done()
        else:
            t = comm.world_size(group)
            lease = pool.acquire(FORWARD_SCRATCH, full_shape(x_local, t, seq_dim), x_local.dtype, x_local.device)
            x_full = comm.all_gather_seq(x_local, group, out=lease.tensor, dim=seq_dim)
            mid = torch.matmul(x_full, weight.t())
            lease.release()  # the GEMM above is the last reader (rule 3 in regather.core.buffers)
        _save_shard(ctx, x_local, source, slot)
        ctx.weight = weight  # a parameter: no new memory (see LinearWithWgrad on why not saved)
        ctx.group, ctx.fuse, ctx.pool, ctx.share, ctx.seq_dim = group, fuse, pool, share, seq_dim
        return mid

    @staticmethod
    def backward(ctx, grad_mid):
        weight = ctx.weight
        need_w = ctx.needs_input_grad[1]
        slot = _slot_for_backward(ctx, need_w)
        scatter = None
        if ctx.needs_input_grad[0]:
            grad_full = grad_mid.matmul(weight)
            scatter = comm.reduce_scatter_seq(grad_full, ctx.group, async_op=True, dim=ctx.seq_dim)
        grad_w = slot.weight_grad_or_defer(weight, grad_mid, ctx.fuse) if need_w else None
        grad_x = scatter.wait() if scatter is not None else None
        return grad_x, grad_w, None, None, None, None, None, None, None


def _save_shard(ctx, x_local, source, slot) -> None:
    """Save what ``source`` keeps for ``x_local``; the early slot holds the same tensors."""
    saved = source.save(x_local)
    ctx.save_for_backward(*saved)
    ctx.source, ctx.slot = source.handle(), slot
    if slot is not None:
        slot.bind(ctx.source, saved)


def _slot_for_backward(ctx, need_w: bool) -> RegatherSlot:
    saved = ctx.saved_tensors if (ctx.slot is None and need_w) else None
    return RegatherSlot.for_backward(ctx.slot, ctx.group, ctx.pool, ctx.source, saved, need_w,
                                     getattr(ctx, "share", None), ctx.seq_dim)


class RegatherSharedLinearA(torch.autograd.Function):
    """Regather LoRA-A fed an ``x_full`` gathered once for the base layer and the adapter.

    ``mid_i = x_full A_i^T`` (the same GEMM as :class:`RegatherLinearA`); saves ``x_local``
    only. Backward returns the *partial* ``dX_full = dmid_i A_i`` for ``x_full``: the
    shared gather's backward sums it with the base layer's and reduce-scatters once.
    ``dA`` re-gathers ``x_local`` exactly as above (slot: early / deferred).
    """

    @staticmethod
    def forward(ctx, x_full, x_local, weight, group, fuse, pool, slot, source, seq_dim):
        mid = torch.matmul(x_full, weight.t())
        _save_shard(ctx, x_local, source, slot)
        ctx.weight = weight
        ctx.group, ctx.fuse, ctx.pool, ctx.seq_dim = group, fuse, pool, seq_dim
        return mid

    @staticmethod
    def backward(ctx, grad_mid):
        weight = ctx.weight
        need_w = ctx.needs_input_grad[2]
        slot = _slot_for_backward(ctx, need_w)
        grad_full = grad_mid.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = slot.weight_grad_or_defer(weight, grad_mid, ctx.fuse) if need_w else None
        return grad_full, None, grad_w, None, None, None, None, None, None


def new_slot(x: torch.Tensor, group, pool: ScratchPool | None, early: bool, share=None, seq_dim: int = 0) -> RegatherSlot:
    """A slot for one forward; ``dA`` is deferred only when ``x`` requires grad."""
    return RegatherSlot(group, pool or default_pool(), early=early, defer=early and x.requires_grad, share=share,
                        seq_dim=seq_dim)


def regather_linear_a(
    x_local: torch.Tensor, weight: torch.Tensor, group, fuse: bool, pool: ScratchPool | None = None,
    slot: RegatherSlot | None = None, source=KEEP, share: SharedGather | None = None, seq_dim: int = 0,
) -> torch.Tensor:
    """LoRA-A on the sequence shard ``x_local`` (sequence dim ``seq_dim``), keeping the shard."""
    return RegatherLinearA.apply(x_local, weight, group, fuse, pool or default_pool(), slot, source, share, seq_dim)


def regather_shared_linear_a(
    x_full: torch.Tensor, x_local: torch.Tensor, weight: torch.Tensor, group, fuse: bool,
    pool: ScratchPool | None = None, slot: RegatherSlot | None = None, source=KEEP, seq_dim: int = 0,
) -> torch.Tensor:
    return RegatherSharedLinearA.apply(x_full, x_local, weight, group, fuse, pool or default_pool(), slot,
                                       source, seq_dim)

"""Rank bodies for the early re-gather tests (adapter level and a real megatron-core GPT)."""

from __future__ import annotations

import torch
from workers_adapter import _inputs as column_inputs
from workers_adapter import make_adapter

from regather import Strategy
from regather.core.buffers import ScratchPool
from regather.core.strategies.regather import BACKWARD_SCRATCH
from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

S, B, H, OUT, R = 16, 2, 32, 48, 8
VARIANTS = {  # name -> (strategy, early_regather)
    "gather": (Strategy.GATHER, True),
    "plain": (Strategy.REGATHER, False),
    "early": (Strategy.REGATHER, True),
}


class SpyPool(ScratchPool):
    """Records, for every backward lease, the buffers leased at the same time."""

    def __init__(self):
        super().__init__()
        self.max_backward_in_flight = 0
        self.live: dict[int, int] = {}
        self.overlapping_ptrs: list[tuple[int, ...]] = []

    def acquire(self, purpose, shape, dtype, device):
        lease = super().acquire(purpose, shape, dtype, device)
        if purpose == BACKWARD_SCRATCH:
            self.max_backward_in_flight = max(self.max_backward_in_flight, self.in_flight(purpose))
            self.live[id(lease._storage)] = lease.tensor.data_ptr()
            self.overlapping_ptrs.append(tuple(self.live.values()))
        return lease

    def _give_back(self, key, storage):
        self.live.pop(id(storage), None)
        super()._give_back(key, storage)


def _inputs(rank, t, n, dtype, seed=11):
    return column_inputs(rank, t, S, B, H, OUT, dtype, True, n, seed)


def _adapter(variant, dtype, fuse, pool=None):
    strategy, early = VARIANTS[variant]
    a = make_adapter(strategy, h=H, o=OUT, r=R, dtype=dtype, fuse=fuse, early_regather=early, pool=pool)
    for w in a.parameters():
        if fuse:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False
    return a


def _grad(w, fuse):
    return (w.main_grad if fuse else w.grad).clone()


def micro_batches(rank, t, variant, *, dtype, fuse, order, x_grad=True):
    """Two micro-batches accumulated in ``order`` ("f1 f2 b2 b1", "f1 f2 b1 b2", "joint", "seq").

    Also records what megatron DDP's grad-ready hook (on LoRA-A's grad accumulator) would
    see when it fires, and the scratch buffers leased at the same time.
    """
    pool = SpyPool()
    adapter = _adapter(variant, dtype, fuse, pool)
    a = adapter.linear_in.weight
    seen = []  # main_grad / grad of A at each grad-ready hook
    grad_none_at_hook = []  # megatron DDP's hook asserts a.grad is not None (overlap_grad_reduce)
    acc = a.expand_as(a).grad_fn.next_functions[0][0]

    def ready(*_):
        seen.append(_grad(a, fuse) if (fuse or a.grad is not None) else None)
        grad_none_at_hook.append(a.grad is None)
        if fuse:
            a.grad = None  # as DDP's hook does once main_grad holds the product

    acc.register_hook(ready)
    data = _inputs(rank, t, 2, dtype)
    xs = [x.requires_grad_(x_grad) for x, _ in data]
    ys, outs = {}, {}

    def fwd(i):
        ys[i] = adapter(xs[i])
        outs[i] = ys[i].detach()

    after = []  # the same, right after each backward call returned

    def bwd(i):
        ys[i].backward(data[i][1])
        after.append(_grad(a, fuse))

    if order == "seq":
        fwd(0), bwd(0), fwd(1), bwd(1)
    elif order == "joint":  # both backward gathers in flight at once: plan both (anchors) first,
        # so that both adapter chains run in backward before either deferred dA
        planned = [adapter.plan(x) for x in xs]
        for i, (xa, plan) in enumerate(planned):
            ys[i] = adapter(xa, plan=plan)
            outs[i] = ys[i].detach()
        torch.autograd.backward([ys[0], ys[1]], [data[0][1], data[1][1]])
        after.append(_grad(a, fuse))
    else:
        steps = order.split()
        for s in steps:
            (fwd if s[0] == "f" else bwd)(int(s[1]) - 1)
    return {
        "out": [outs[0], outs[1]],
        "dx": [x.grad for x in xs],
        "dA": _grad(a, fuse), "dB": _grad(adapter.linear_out.weight, fuse),
        "grad_none_at_hook": grad_none_at_hook,
        "hook_seen": seen, "after_backward": after,
        "max_in_flight": pool.max_backward_in_flight,
        "overlapping_ptrs": pool.overlapping_ptrs,
        "leased_after": pool.in_flight(),
    }


def adapter_suite(rank, t):
    enable_megatron_cpu()
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        for fuse in (False, True):
            for order in ("seq", "f1 f2 b2 b1", "f1 f2 b1 b2", "joint"):
                for variant in VARIANTS:
                    res[(str(dtype).split(".")[-1], fuse, order, variant)] = micro_batches(
                        rank, t, variant, dtype=dtype, fuse=fuse, order=order)
    for variant in VARIANTS:  # input without grad: early gather, no deferral
        res[("float32", True, "no_x_grad", variant)] = micro_batches(
            rank, t, variant, dtype=torch.float32, fuse=True, order="seq", x_grad=False)
    return res


def gpt_suite(rank, t, steps=2):
    """A real megatron-core GPT (local spec, TP=2+SP): LoRA losses and grads per variant,
    unshared and with one sequence gather for base + adapter (``share_sequence_gather``)."""
    from regather import LoRA
    from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes, SavedBytes
    from regather.megatron.dense.model import decisions
    from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch, gpt_loss

    enable_megatron_cpu()
    shape = TinyGPT()
    res = {}
    for share in (False, True):
        for variant, (strategy, early) in VARIANTS.items():
            model = build_gpt(shape, tp=t)
            # lean on every variant, gather too: the row-parallel targets' lean LoRA-B weight gradient is
            # another summation order than the classic gather path's (docs/design.md §3.7)
            LoRA(dim=8, alpha=16, lora_B_init_method="normal", sequence_parallel_input_strategy=strategy.value,
                 early_regather=early, share_sequence_gather=share, lean_transients=True)(model)
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            losses, grads, comm, saved = [], None, None, None
            for step in range(steps):
                for _, p in params:
                    p.grad = None
                batch = gpt_batch(shape, 2, seed=step)
                with CollectiveBytes() as fwd, SavedBytes.for_model(model) as sv:
                    loss = gpt_loss(model, batch)
                with CollectiveBytes() as bwd:
                    loss.backward()
                if step == 0:
                    comm = {"forward": fwd.snapshot(), "backward": bwd.snapshot()}
                    saved = {"adapter_input": sv.of(ADAPTER_INPUT), "total": sv.total}
                losses.append(loss.detach())
                grads = {n: p.grad.clone() for n, p in params}
                with torch.no_grad():
                    for _, p in params:
                        p.sub_(0.05 * p.grad)
            name = variant + ("_shared" if share else "")
            res[name] = {"losses": losses, "grads": grads, "comm": comm, "saved": saved,
                         "used": sorted({d.used.value for d in decisions(model).values()})}
    res["shape"] = (shape.seq_length, 2, shape.hidden_size, shape.num_layers)
    return res


def early_suite(rank, t):
    return {"adapter": adapter_suite(rank, t), "gpt": gpt_suite(rank, t)}

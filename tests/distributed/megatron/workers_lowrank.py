"""Rank bodies for the low-rank strategy tests: one spawn runs many cases, the parent compares."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from workers_adapter import make_adapter

from regather import Strategy
from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes, SavedBytes
from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

S, B, H, OUT, R = 16, 2, 32, 48, 8
LR = 0.05


def _full_inputs(steps, dtype, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(S, B, H, generator=g).to(dtype), torch.randn(S, B, OUT, generator=g).to(dtype))
            for _ in range(steps)]


def _gather0(t: torch.Tensor) -> torch.Tensor:
    """All-gather a tensor's dim-0 shards (rank order)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out, 0)


def _grads(adapter, fuse):
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    if fuse:
        return a.main_grad.clone(), b.main_grad.clone()
    return a.grad.clone(), b.grad.clone()


def _zero(adapter, fuse):
    for w in adapter.parameters():
        w.grad = None
        if fuse:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False


def _full_a(adapter, grad: torch.Tensor) -> torch.Tensor:
    """A gradient (or weight) in the full [r, h] layout whatever the adapter's layout."""
    return grad if adapter.replicated_a else _gather0(grad)


def train_steps(rank, t, strategy, *, dtype, fuse, steps=3, config=None, **kw):
    """SGD ``steps`` times; per step: output, dx, full dA, this rank's dB (fp32 copies)."""
    adapter = make_adapter(strategy, h=H, o=OUT, r=R, dtype=dtype, fuse=fuse, config=config, **kw)
    rows = []
    for x_full, dy_full in _full_inputs(steps, dtype):
        _zero(adapter, fuse)
        x = x_full.chunk(t, 0)[rank].clone().requires_grad_()
        y = adapter(x)
        y.backward(dy_full.chunk(t, 2)[rank])
        da, db = _grads(adapter, fuse)
        rows.append({"out": y.detach().float(), "dx": x.grad.float(), "dA": _full_a(adapter, da).float(),
                     "dB": db.float(), "decision": adapter.last_decision.used.value})
        with torch.no_grad():
            for w, g in zip((adapter.linear_in.weight, adapter.linear_out.weight), (da, db)):
                w.sub_(LR * g.to(w.dtype))
    return rows


def fp64_reference(rank, t, *, dtype=torch.float32, steps=3):
    """TP=1 in fp64 from the master weights and inputs ``train_steps`` holds in ``dtype``; per step
    this rank's output and input-gradient shards, the full dA and this rank's dB shard. Each SGD
    step stores the weights in ``dtype`` again, as the runs do."""
    adapter = make_adapter(Strategy.GATHER, h=H, o=OUT, r=R, dtype=dtype)
    a = _gather0(adapter.linear_in.weight.detach()).double().requires_grad_()
    b = _gather0(adapter.linear_out.weight.detach()).double().requires_grad_()
    rows = []
    for x_full, dy_full in _full_inputs(steps, dtype):
        a.grad = b.grad = None
        x = x_full.double().requires_grad_()
        y = (x @ a.t()) @ b.t() * adapter.scale
        y.backward(dy_full.double())
        rows.append({"out": y.detach().chunk(t, 2)[rank], "dx": x.grad.chunk(t, 0)[rank].clone(),
                     "dA": a.grad.clone(), "dB": b.grad.chunk(t, 0)[rank].clone()})
        with torch.no_grad():
            for w in (a, b):
                w.copy_((w - LR * w.grad).to(dtype).double())
    return rows


def finalize_model_grads_case(rank, t, *, fuse, micro_batches=2):
    """dA left to megatron's finalize_model_grads (its TP all-reduce of sequence_parallel params)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=t)
    config = SimpleNamespace(sequence_parallel=True, qk_layernorm=False)
    out = {}
    for mode in ("backward", "finalize_model_grads"):
        adapter = make_adapter(Strategy.LOWRANK, h=H, o=OUT, r=R, dtype=torch.float32, fuse=fuse,
                               config=config, lowrank_grad_allreduce=mode)
        _zero(adapter, fuse)
        for x_full, dy_full in _full_inputs(micro_batches, torch.float32):
            x = x_full.chunk(t, 0)[rank].clone().requires_grad_()
            adapter(x).backward(dy_full.chunk(t, 2)[rank])
        before = _grads(adapter, fuse)[0]
        chunk = torch.nn.Module()
        chunk.module = adapter
        chunk.ddp_config = DistributedDataParallelConfig()
        _allreduce_non_tensor_model_parallel_grads([chunk], config, parallel_state.get_tensor_model_parallel_group())
        out[mode] = {"before": before, "after": _grads(adapter, fuse)[0],
                     "tagged": adapter.linear_in.weight.sequence_parallel}
    # the full dA summed over the micro-batches in fp64 from the same weights (both modes' init)
    a = adapter.linear_in.weight.detach().double().requires_grad_()  # replicated: the full [r, h]
    b = _gather0(adapter.linear_out.weight.detach()).double()
    for x_full, dy_full in _full_inputs(micro_batches, torch.float32):
        ((x_full.double() @ a.t()) @ b.t() * adapter.scale).backward(dy_full.double())
    out["fp64"] = a.grad
    parallel_state.destroy_model_parallel()
    return out


def fallback_cases(rank, t):
    """Ineligible forwards of a low-rank adapter run the gather path on A[rank rows]."""
    res = {}
    x_full, dy_full = _full_inputs(1, torch.float32)[0]
    x, dy = x_full.chunk(t, 0)[rank].clone(), dy_full.chunk(t, 2)[rank]
    for strategy in (Strategy.GATHER, Strategy.LOWRANK):
        adapter = make_adapter(strategy, h=H, o=OUT, r=R, dtype=torch.float32)
        adapter.eval()
        with torch.no_grad():
            eval_out = adapter(x)
        adapter.train()
        with torch.no_grad():
            nograd_out = adapter(x)
        res[strategy.value] = {"eval": eval_out, "no_grad": nograd_out,
                               "decision": adapter.last_decision}
        # forced fallback in training (full recompute is ineligible), with and without fusion
        for fuse in (False, True):
            forced = make_adapter(strategy, h=H, o=OUT, r=R, dtype=torch.float32, fuse=fuse,
                                  config=SimpleNamespace(recompute_granularity="full", sequence_parallel=True))
            _zero(forced, fuse)
            xg = x.clone().requires_grad_()
            y = forced(xg)
            y.backward(dy)
            da, db = _grads(forced, fuse)
            res[strategy.value][f"forced{int(fuse)}"] = {
                "out": y.detach(), "dx": xg.grad, "dA_full": _full_a(forced, da), "dB": db,
                "decision": forced.last_decision,
                "flag": getattr(forced.linear_in.weight, "grad_added_to_main_grad", None),
                # megatron's convention (the flag exists, as under DDP): a placeholder of A's shape
                "grad_shape": None if forced.linear_in.weight.grad is None else tuple(forced.linear_in.weight.grad.shape),
                "a_shape": tuple(forced.linear_in.weight.shape),
            }
    return res


def state_dict_cases(rank, t):
    """Every (saved strategy, loaded strategy) pair: same function after loading."""
    strategies = (Strategy.GATHER, Strategy.REGATHER, Strategy.LOWRANK)
    x_full, _ = _full_inputs(1, torch.float32)[0]
    x = x_full.chunk(t, 0)[rank].clone()
    res = {}
    for src in strategies:
        a = make_adapter(src, h=H, o=OUT, r=R, dtype=torch.float32, seed=7)
        with torch.no_grad():  # move away from the init (same full perturbation in every layout)
            da = torch.randn(R, H, generator=torch.Generator().manual_seed(99)) * 0.1
            db = torch.randn(OUT, R, generator=torch.Generator().manual_seed(98)) * 0.1
            a.linear_in.weight.add_(da if a.replicated_a else da.chunk(t, 0)[rank])
            a.linear_out.weight.add_(db.chunk(t, 0)[rank])
        sd = a.state_dict()
        a.eval()
        with torch.no_grad():
            ref = a(x)
            # the same function in fp64: column-parallel LoRA-B, so this rank's output features
            a_full = _full_a(a, a.linear_in.weight.detach()).double()
            ref64 = (_gather0(x).double() @ a_full.t()) @ a.linear_out.weight.detach().double().t() * a.scale
        for dst in strategies:
            b = make_adapter(dst, h=H, o=OUT, r=R, dtype=torch.float32, seed=1234)
            b.load_state_dict(sd)
            b.eval()
            with torch.no_grad():
                got_eval = b(x)
            b.train()
            got_train = b(x.clone().requires_grad_()).detach()
            res[(src.value, dst.value)] = {"ref": ref, "ref64": ref64, "eval": got_eval, "train": got_train,
                                           "sd_shape": tuple(sd["linear_in.weight"].shape),
                                           "used": b.last_decision.used.value}
    # run-time switch: gather -> lowrank -> gather keeps the weights
    a = make_adapter(Strategy.GATHER, h=H, o=OUT, r=R, dtype=torch.float32)
    before = a.linear_in.weight.detach().clone()
    a.strategy = Strategy.LOWRANK
    full_shape = tuple(a.linear_in.weight.shape)
    a.strategy = Strategy.GATHER
    res["switch"] = {"full_shape": full_shape, "same": torch.equal(before, a.linear_in.weight.detach())}
    return res


def bytes_case(rank, t):
    out = {}
    x_full, dy_full = _full_inputs(1, torch.float32)[0]
    for strategy in (Strategy.GATHER, Strategy.LOWRANK):
        adapter = make_adapter(strategy, h=H, o=OUT, r=R, dtype=torch.float32)
        x = x_full.chunk(t, 0)[rank].clone().requires_grad_()
        with CollectiveBytes() as fwd, SavedBytes.for_model(adapter) as saved:
            y = adapter(x)
        with CollectiveBytes() as bwd:
            y.backward(dy_full.chunk(t, 2)[rank])
        out[strategy.value] = {"forward": fwd.snapshot(), "backward": bwd.snapshot(),
                               "saved": saved.of(ADAPTER_INPUT)}
    return out


def lowrank_suite(rank, t):
    """Everything adapter-level for the low-rank strategy in one spawn."""
    enable_megatron_cpu()
    res = {"parity": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for fuse in (False, True):
            key = (str(dtype).split(".")[-1], fuse)
            res["parity"][key] = {s.value: train_steps(rank, t, s, dtype=dtype, fuse=fuse)
                                  for s in (Strategy.GATHER, Strategy.LOWRANK)}
    res["reference"] = {str(dtype).split(".")[-1]: fp64_reference(rank, t, dtype=dtype)
                        for dtype in (torch.float32, torch.bfloat16)}
    res["finalize"] = {fuse: finalize_model_grads_case(rank, t, fuse=fuse) for fuse in (False, True)}
    res["fallback"] = fallback_cases(rank, t)
    res["state_dict"] = state_dict_cases(rank, t)
    res["bytes"] = bytes_case(rank, t)
    return res

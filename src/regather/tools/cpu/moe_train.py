"""LoRA variants of the tiny MoE GPT trained side by side, measured (``regather bench --moe``).

:func:`compare_moe` runs on every rank of an initialised gloo default group (``TP x EP x ETP``,
world ``max(tp, ep * etp)``; DP = world / tp takes its own rows of each global batch and reduces
gradients as megatron's DDP does). One model per variant (:func:`variant_options`), each built
by :func:`regather.tools.cpu.moe_models.build_moe_gpt` and loaded with the same full weights
(:class:`~regather.tools.cpu.moe_models.GlobalLayout` + ``full_weights``: megatron initialises
experts per EP rank, docs/design.md §9), so every variant starts from identical weights and sees
the same batches. Step ``i`` runs each variant once, in an order rotated by ``i`` (as
:func:`regather.tools.cpu.train.compare_strategies`), after a barrier.

Measured per variant, on this rank: LoRA-A input bytes per adapter (the first forward,
:class:`~regather.tools.cpu.train.AdapterSavedBytes`) and the retained total; collective bytes by
kind of *every* step (the first one also checks each MoE layer's route once under the expert
recompute; with DP > 1 the step's DDP-like gradient reduction is in it); the tokens routed to
this rank's local experts per MoE layer and forward; step times; losses (the DP mean); the last
step's LoRA-gradient difference against the other variants named in ``parity``; decisions; each
MoE layer's re-dispatch counts (``ExpertInputs.resends``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from regather.megatron.lora import DEFAULT_TARGETS
from regather.megatron.moe.inputs import expert_inputs_of
from regather.tools.cpu.moe_models import TinyMoE

REDISPATCH = "-recompute-redispatch"
_REDISPATCH_OPTS = {"recompute_adapter_inputs": True, "redispatch_expert_inputs": True}


@dataclass(frozen=True)
class MoERun:
    """One layout and model, and how every variant on it trains."""

    shape: TinyMoE = field(default_factory=TinyMoE)
    tp: int = 2
    ep: int = 2
    etp: int = 1
    dtype: str = "float32"
    micro_batch: int = 2  # per data-parallel rank (megatron's micro-batch size)
    steps: int = 3
    lr: float = 1e-3
    lora_dim: int = 8
    lora_alpha: int = 16
    targets: tuple = DEFAULT_TARGETS
    share_expert_adapters: bool = True
    input_requires_grad: bool = False
    seed: int = 1234

    @property
    def world(self) -> int:
        return max(self.tp, self.ep * self.etp)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def variant_options(name: str) -> tuple[str, dict]:
    """``(strategy, LoRA overrides)`` of a variant: a strategy, one of
    :data:`regather.tools.cpu.train.VARIANTS` (``regather-recompute``, ...), or
    ``<strategy>-recompute-redispatch`` (per-expert LoRA-A inputs dispatched again in backward)."""
    from regather.tools.cpu.train import VARIANTS, requestable_strategies

    if name.endswith(REDISPATCH):
        strategy, opts = name[: -len(REDISPATCH)], dict(_REDISPATCH_OPTS)
    else:
        strategy, opts = VARIANTS.get(name, (name, {}))
    if strategy not in requestable_strategies(variants=False):
        raise ValueError(f"unknown MoE variant {name!r}; known: {', '.join(moe_variants())}")
    return strategy, dict(opts)


def moe_variants() -> list[str]:
    """Every variant this build can train on a MoE model."""
    from regather.tools.cpu.train import requestable_strategies

    return requestable_strategies() + [s + REDISPATCH for s in requestable_strategies(variants=False)]


def base_variant(name: str) -> str:
    """The same strategy without any option (``regather-recompute-redispatch`` -> ``regather``)."""
    return variant_options(name)[0]


def lora_for(run: MoERun, name: str):
    from regather.core.strategies import Strategy
    from regather.megatron.lora import LoRA
    from regather.tools.cpu.train import lora_asking

    strategy, opts = variant_options(name)
    kwargs = dict(target_modules=list(run.targets), dim=run.lora_dim, alpha=run.lora_alpha,
                  share_expert_adapters=run.share_expert_adapters, **opts)
    if strategy in ("gather", "regather"):
        return LoRA(sequence_parallel_input_regather=strategy == "regather", **kwargs)
    return lora_asking(Strategy.parse(strategy), kwargs)


def build(run: MoERun, name: str):
    """The LoRA-wrapped MoE GPT of variant ``name`` holding the run's full weights (parallel
    state already initialised), and its layout map."""
    from regather.tools.cpu.moe_models import GlobalLayout, build_moe_gpt, full_weights
    from regather.tools.cpu.train import require_decoder_input_grad

    model = build_moe_gpt(run.shape, run.tp, run.ep, run.etp, run.torch_dtype, seed=run.seed, init_parallel=False)
    model = lora_for(run, name)(model, training=True)
    if run.input_requires_grad:
        require_decoder_input_grad(model)
    layout = GlobalLayout(model, run.shape)
    layout.load(model, full_weights(layout.global_shapes(), seed=run.seed))
    return model, layout


def build_frozen(run: MoERun):
    """The same MoE GPT with the run's full weights, no LoRA, every weight frozen, its decoder input requiring grad
    (the baseline of "over the frozen model", as :func:`regather.tools.cpu.train.frozen_gpt`)."""
    from regather.tools.cpu.moe_models import GlobalLayout, build_moe_gpt, full_weights
    from regather.tools.cpu.train import require_decoder_input_grad

    model = build_moe_gpt(run.shape, run.tp, run.ep, run.etp, run.torch_dtype, seed=run.seed, init_parallel=False)
    layout = GlobalLayout(model, run.shape)
    layout.load(model, full_weights(layout.global_shapes(), seed=run.seed))
    for p in model.parameters():
        p.requires_grad_(False)
    require_decoder_input_grad(model)
    return model


def allocated_at_init(run: MoERun, variants: Sequence[str], batch) -> dict:
    """Each variant's allocator bytes of one step (:func:`regather.tools.cpu.train.step_bytes`: kept after the
    forward, the step's peak, every collective settled) and its LoRA weights' gradient bytes, on a fresh model of the
    run's weights (LoRA-B zero: every model routes the batch as the frozen one does, so the expert activations are
    the same and LoRA's bytes over the frozen model are LoRA's own), and the frozen model's under ``"frozen"``."""
    from regather.tools.cpu.train import step_bytes

    out = {}
    for name in variants:
        model, _ = build(run, name)
        out[name] = step_bytes(model, batch)
        out[name]["lora_grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()
                                           if p.requires_grad)
        del model
    out["frozen"] = step_bytes(build_frozen(run), batch)
    return out


def batches(run: MoERun):
    """This DP rank's rows of each step's global batch (``micro_batch x DP`` rows)."""
    from megatron.core import parallel_state as ps

    from regather.tools.cpu.models import gpt_batch

    dp, rank, b = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), run.micro_batch
    for step in range(run.steps):
        tokens, labels, pos, mask = gpt_batch(run.shape, b * dp, seed=step)
        rows = slice(rank * b, (rank + 1) * b)
        yield tokens[rows], labels[rows], pos[rows], mask


def adapter_kind(path: str) -> str:
    """``linear_qkv``, ``linear_fc1`` (a dense MLP), ``shared_experts.linear_fc1``,
    ``experts.linear_fc1`` (every expert of every MoE layer), ..."""
    linear = path.rsplit(".", 1)[1]
    if ".shared_experts." in path:
        return f"shared_experts.{linear}"
    if ".experts." in path:
        return f"experts.{linear}"
    return linear


def record_routed(model, store: dict) -> list:
    """Record, per MoE layer and forward, the tokens routed to each local expert of this rank:
    ``store[layer path]`` gets one list per forward; returns the hook handles."""
    handles = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            def hook(mod, args, out, _n=name):
                store.setdefault(_n, []).append([int(n) for n in args[1].tolist()])
            handles.append(module.register_forward_hook(hook))
    return handles


def reduce_like_ddp(params: dict) -> None:
    """megatron DDP's reduction: dense grads over DP, expert ones (``allreduce=False``) over
    expert DP, each scaled by 1 / DP. Nothing to do at DP = expert DP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp, edp = ps.get_data_parallel_world_size(), ps.get_expert_data_parallel_world_size()
    if dp == 1 and edp == 1:
        return
    for p in params.values():
        if p.grad is None:
            continue
        dense = getattr(p, "allreduce", True)
        group = ps.get_data_parallel_group() if dense else ps.get_expert_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
        p.grad /= dp


def _dp_mean(value: float) -> float:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.item() / dp


def grad_gap(grads: dict, ref: dict) -> tuple[float, float]:
    """Largest |grad - ref| over every LoRA gradient of this rank, and the largest |ref|
    (:func:`regather.tools.cpu.train.grad_gap` at this rank's TP coordinates)."""
    from megatron.core import parallel_state as ps

    from regather.tools.cpu import train

    return train.grad_gap(grads, ref, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())


def compare_moe(rank: int, world_size: int, run: MoERun, variants: Sequence[str], parity: dict,
                progress: Callable[[str, int, float], None] | None = None, peak: bool = False) -> dict:
    """Train every variant side by side; ``{variant: measurements}`` for this rank (module doc).
    ``parity``: ``{variant: [variants to compare its losses and last gradients with]}``. With ``peak``, after
    training, each variant's allocator bytes on the first batch under ``"allocated"`` and the frozen model's under
    ``out["frozen"]["allocated"]`` (:func:`allocated_at_init`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes
    from regather.megatron.dense.model import adapters
    from regather.tools.cpu.models import gpt_loss
    from regather.tools.cpu.moe_models import init_moe_parallel
    from regather.tools.cpu.train import AdapterSavedBytes

    init_moe_parallel(run.tp, run.ep, run.etp, run.seed)
    models, opts, named, out = {}, {}, {}, {}
    for name in variants:
        models[name], _ = build(run, name)
        named[name] = {n: p for n, p in models[name].named_parameters() if p.requires_grad}
        opts[name] = torch.optim.Adam(named[name].values(), lr=run.lr)
        out[name] = {"loss": [], "step_time": [], "comm_steps": [], "routed": {}}
        record_routed(models[name], out[name]["routed"])
    last_grads = {}
    for step, batch in enumerate(batches(run)):
        k = step % len(variants)
        for name in list(variants[k:]) + list(variants[:k]):
            model, opt, res = models[name], opts[name], out[name]
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            with CollectiveBytes() as comm:
                t0 = time.perf_counter()
                if step == 0:
                    with AdapterSavedBytes(model) as saved:
                        loss = gpt_loss(model, batch)
                        loss.backward()
                else:
                    loss = gpt_loss(model, batch)
                    loss.backward()
                reduce_like_ddp(named[name])
                opt.step()
                loss_value = loss.item()
                dt = time.perf_counter() - t0
            res["comm_steps"].append(comm.snapshot())
            res["step_time"].append(dt)
            res["loss"].append(_dp_mean(loss_value))
            if step == 0:
                res["saved_bytes"] = saved.total
                res["saved_adapter_input_bytes"] = saved.of(ADAPTER_INPUT)
                res["adapter_input_by_kind"] = _by_kind(saved.by_adapter)
            if step == run.steps - 1:
                last_grads[name] = {n: p.grad.detach().float().clone() for n, p in named[name].items()}
            if progress is not None:
                progress(name, step, dt)
    if peak:
        allocated = allocated_at_init(run, variants, next(iter(batches(run))))
        for name in variants:
            out[name]["allocated"] = allocated[name]
        out["frozen"] = {"allocated": allocated["frozen"]}
    for name in variants:
        res = out[name]
        res["parity"] = {other: dict(zip(("max_abs_grad_diff", "max_abs_grad"),
                                         grad_gap(last_grads[name], last_grads[other])))
                         for other in parity.get(name, ())}
        res["decisions"] = {path: str(a.last_decision) for path, a in adapters(models[name]).items()}
        res["resends"] = {n: dict(expert_inputs_of(m).resends) for n, m in models[name].named_modules()
                          if expert_inputs_of(m) is not None}
        res["coords"] = {"tp": ps.get_tensor_model_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
                         "etp": ps.get_expert_tensor_parallel_rank(), "dp": ps.get_data_parallel_rank()}
    return out


def _by_kind(by_adapter: dict) -> dict:
    out: dict = {}
    for path, n in by_adapter.items():
        out[adapter_kind(path)] = out.get(adapter_kind(path), 0) + int(n)
    return out

"""Rank bodies for the MoE tests: a tiny megatron-core MoE GPT (megatron's MoELayer, router,
token dispatcher, SequentialMLP or TEGroupedMLP experts) trained with LoRA on gloo ranks.

Every model of a case starts from the same full weights (``GlobalLayout`` + ``full_weights``,
one tensor per global parameter name: megatron initialises experts per EP rank, so layouts do
not share an init by seed), sees the same batches (DP rank ``d`` takes rows ``d`` of the global
batch) and trains with SGD. Gradients are reduced as megatron's DDP reduces them (dense
parameters over DP, expert parameters — ``allreduce=False`` — over expert DP, both scaled by
1/DP), so a layout with DP > 1 computes the global batch's gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from regather.megatron.moe.inputs import expert_inputs_of
from regather.tools.cpu.moe_models import GlobalLayout, TinyMoE, build_moe_gpt, full_weights
from regather.tools.cpu.moe_train import record_routed, reduce_like_ddp

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# variant -> (strategy, LoRA overrides); the "-rc" ones with recompute_adapter_inputs
VARIANTS = {
    "gather": ("gather", {}),
    "regather": ("regather", {}),
    "regather-plain": ("regather", {"early_regather": False}),
    "lowrank": ("lowrank", {}),
    "gather-rc": ("gather", {"recompute_adapter_inputs": True}),
    "regather-rc": ("regather", {"recompute_adapter_inputs": True}),
    "lowrank-rc": ("lowrank", {"recompute_adapter_inputs": True}),
    # per-expert LoRA-A inputs dispatched again in backward (a shared grouped LoRA-A runs before the
    # dispatch under every -rc variant: the flag changes nothing there)
    "gather-rc-rd": ("gather", {"recompute_adapter_inputs": True, "redispatch_expert_inputs": True}),
    "regather-rc-rd": ("regather", {"recompute_adapter_inputs": True, "redispatch_expert_inputs": True}),
    "lowrank-rc-rd": ("lowrank", {"recompute_adapter_inputs": True, "redispatch_expert_inputs": True}),
    # CanonicalLoRA (q/k/v and gate/up adapters; Bridge's canonical targets)
    "canonical-gather": ("gather", {}),
    "canonical-regather": ("regather", {}),
    "canonical-regather-rc": ("regather", {"recompute_adapter_inputs": True}),
}


@dataclass(frozen=True)
class Case:
    """One MoE setup: a layout (TP x EP x ETP), the model, and the variants trained on it."""

    tp: int = 2
    ep: int = 2
    etp: int = 1
    shape: TinyMoE = field(default_factory=TinyMoE)
    dtype: str = "float32"
    share: bool = True  # share_expert_adapters (grouped experts)
    variants: tuple = tuple(v for v in VARIANTS if not v.startswith("canonical-"))  # LoRA's
    steps: int = 2
    batch: int = 2  # global micro-batch (split over DP)
    lr: float = 0.05
    dim: int = 8
    model: tuple = ()  # megatron TransformerConfig overrides, as (name, value) pairs
    # "step": forward + backward per step; "interleaved": two micro-batches per step, both forwards
    # first (the dispatcher and the producers overwrite their per-forward state in between), then
    # the backwards in reverse order: each recomputed input is rebuilt from its own forward's tensors.
    # "retain": one forward, two backward calls (retain_graph=True) on a plain function of the logits
    # (megatron's vocab-parallel cross entropy modifies its saved softmax in its backward, so its
    # loss cannot backpropagate twice): every rebuilt input is rebuilt again, the second backward
    # adds exactly the first's gradients.
    schedule: str = "step"
    targets: tuple = TARGETS
    # test-only fault: on this rank, the route check of each MoE layer sees wrong rows
    # (regather.megatron.moe.dispatch.Route's last step perturbed without autograd)
    fault_rank: int | None = None
    # variants also trained in float64 from the same weights and batches, under "fp64": the
    # references of results that are other summation orders (tests.harness.numerics)
    fp64: tuple = ()
    # LoRA(lean_transients=...) of every variant, the gather reference included, so that the variants
    # are compared like for like: lean (regather.core.peak) reduce-scatters a row adapter's mid and sums
    # its LoRA-B weight gradient per sequence shard, another order than the classic gather path's
    # (docs/design.md §3.7); None: each strategy's default
    lean: bool | None = True

    @property
    def world(self) -> int:
        return max(self.tp, self.ep * self.etp)

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)

    def reference(self) -> Case:
        """The same model, weights and batches on one rank: TP = EP = ETP = 1."""
        return replace(self, tp=1, ep=1, etp=1, variants=self.variants[:1])


def _lora(case: Case, variant: str):
    from regather import CanonicalLoRA, LoRA

    strategy, overrides = VARIANTS[variant]
    kwargs = dict(target_modules=list(case.targets), dim=case.dim, alpha=2 * case.dim, lora_B_init_method="xavier",
                  share_expert_adapters=case.share, lean_transients=case.lean, **overrides)
    if variant.startswith("canonical-"):
        del kwargs["target_modules"]  # CanonicalLoRA's default: every projection
        return CanonicalLoRA(sequence_parallel_input_strategy=strategy, **kwargs)
    if strategy == "lowrank":
        return LoRA(sequence_parallel_input_strategy="lowrank", **kwargs)
    return LoRA(sequence_parallel_input_regather=strategy == "regather", **kwargs)


def build(case: Case, variant: str, init_parallel: bool = True, wrap=None):
    """The LoRA-wrapped MoE GPT of ``case`` holding the case's full weights, and its layout map.
    ``wrap(case, variant)``: the transform to apply instead of :func:`_lora`'s (Bridge's LoRA)."""
    model = build_moe_gpt(case.shape, case.tp, case.ep, case.etp, case.torch_dtype, init_parallel=init_parallel,
                          **dict(case.model))
    torch.manual_seed(99)
    model = (wrap or _lora)(case, variant)(model, training=True)
    layout = GlobalLayout(model, case.shape)
    layout.load(model, full_weights(layout.global_shapes()))
    return model, layout


def batches(case: Case):
    """This DP rank's rows of each step's global batch (a list of micro-batches per step)."""
    from megatron.core import parallel_state as ps

    from regather.tools.cpu.models import gpt_batch

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = case.batch // dp
    n = 2 if case.schedule == "interleaved" else 1
    for step in range(case.steps):
        step_batches = []
        for m in range(n):
            tokens, labels, pos, mask = gpt_batch(case.shape, case.batch, seed=step * n + m)
            rows = slice(rank * per, (rank + 1) * per)
            step_batches.append((tokens[rows], labels[rows], pos[rows], mask))
        yield step_batches


def _step(model, micro_batches: list, first=None, schedule: str = "step", out: dict | None = None):
    """One step's forwards and backwards; ``first``: a context around the first forward (the
    counting). Returns the loss (the micro-batches' mean). ``schedule="retain"``: two backward
    calls of one forward, the gradients after the first go to ``out["retain_first"]``."""
    import contextlib

    from regather.tools.cpu.models import gpt_loss

    if schedule == "retain":
        tokens, _, position_ids, mask = micro_batches[0]
        with first if first is not None else contextlib.nullcontext():
            logits = model(tokens, position_ids, mask)
            loss = logits.to(torch.promote_types(logits.dtype, torch.float32)).square().mean()
        loss.backward(retain_graph=True)
        if out is not None:
            out.setdefault("retain_first", {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                            if p.grad is not None})
        loss.backward()
        return loss
    with first if first is not None else contextlib.nullcontext():
        losses = [gpt_loss(model, micro_batches[0])]
        if len(micro_batches) == 1:
            losses[0].backward()
            return losses[0]
    losses += [gpt_loss(model, mb) for mb in micro_batches[1:]]
    for loss in reversed(losses):
        loss.backward()
    return sum(losses) / len(losses)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []
        self.fallbacks = []  # (level, what, reason, adapter paths) of each fallback record

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))
        if hasattr(record, "regather_adapters"):
            self.fallbacks.append((record.levelname, record.regather_what, record.regather_reason,
                                   list(record.regather_adapters)))


def train(case: Case, variant: str, init_parallel: bool = True, wrap=None) -> dict:
    """Train ``variant`` for ``case.steps`` SGD steps; what the tests compare and count."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes
    from regather.megatron.dense.model import adapters, decisions
    from regather.tools.cpu.train import AdapterSavedBytes

    logs = _Records()
    logger = logging.getLogger("regather")
    logger.addHandler(logs)
    old_level, logger.level = logger.level, logging.INFO
    try:
        model, layout = build(case, variant, init_parallel, wrap)
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD(named.values(), lr=case.lr)
        routed: dict = {}
        handles = record_routed(model, routed)
        out = {"loss": [], "before": {p: str(d) for p, d in decisions(model).items()}}
        for step, micro_batches in enumerate(batches(case)):
            opt.zero_grad(set_to_none=True)
            with CollectiveBytes() as comm:  # each step's collectives (reduce_like_ddp's apart)
                if step == 0:
                    saved = AdapterSavedBytes(model)
                    loss = _step(model, micro_batches, first=saved, schedule=case.schedule, out=out)
                    out["saved_total"], out["saved_adapter_input"] = saved.total, saved.of(ADAPTER_INPUT)
                    out["saved_by_adapter"] = dict(saved.by_adapter)
                    out["saved_by_label"] = saved.by_label()
                else:
                    loss = _step(model, micro_batches, schedule=case.schedule)
            out.setdefault("comm_steps", []).append(comm.snapshot())
            reduce_like_ddp(named)
            if step == 0:
                out["first_grads"] = layout.scatter({n: p.grad.detach().to(torch.promote_types(p.dtype, torch.float32))
                                                     .clone() for n, p in named.items()})
                if "retain_first" in out:  # the same global names
                    out["retain_first"] = {g: t for g, (_, t) in layout.scatter(out["retain_first"]).items()}
            if step == case.steps - 1:
                out["grads"] = {n: p.grad.detach().clone() for n, p in named.items()}
            opt.step()
            value = torch.tensor([loss.item()], dtype=torch.float64)
            dist.all_reduce(value, group=ps.get_data_parallel_group())
            out["loss"].append(value.item() / ps.get_data_parallel_world_size())
        for h in handles:
            h.remove()
        out["decisions"] = {p: str(a.last_decision) for p, a in adapters(model).items()}
        out["adapter_types"] = {p: type(a).__name__ for p, a in adapters(model).items()}
        out["adapter_dims"] = {p: a.dim for p, a in adapters(model).items()}
        out["allreduce"] = {n: getattr(p, "allreduce", True) for n, p in named.items()}
        out["routed"] = routed
        out["resends"] = {n: {k: v for k, v in expert_inputs_of(m).resends.items() if not k.endswith("_s")}
                          for n, m in model.named_modules() if expert_inputs_of(m) is not None}
        out["ep_rank"], out["etp_rank"] = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
        out["tp_rank"], out["dp_rank"] = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
        out["param_names"] = sorted(n for n, _ in model.named_parameters())
        out["final"] = {n: p.detach().clone() for n, p in named.items()}
    finally:
        logger.removeHandler(logs)
        logger.level = old_level
    out["logs"], out["fallbacks"] = logs.records, logs.fallbacks
    return out


def case_worker(rank: int, world_size: int, group: tuple, cases: dict) -> dict:
    """Every variant of every case in ``group`` (their layouts all use ``world_size`` ranks)."""
    out = {}
    for name in group:
        case = cases[name]
        with _fault(case, rank):
            out[name] = {v: train(case, v) for v in case.variants}
            if case.fp64:
                out[name]["fp64"] = {v: train(replace(case, dtype="float64"), v) for v in case.fp64}
    return out


class _fault:
    """``case.fault_rank``: perturb the rows a route replay returns without autograd on that rank."""

    def __init__(self, case: Case, rank: int):
        self.active = case.fault_rank == rank

    def __enter__(self):
        from regather.megatron.moe import dispatch

        self.original = dispatch.Route._finish
        if self.active:
            def finish(route, rows, _original=self.original):
                out = _original(route, rows)
                return out if torch.is_grad_enabled() else out + 1
            dispatch.Route._finish = finish

    def __exit__(self, *exc):
        from regather.megatron.moe import dispatch

        dispatch.Route._finish = self.original


def reference_worker(rank: int, world_size: int, group: tuple, cases: dict, fp64: bool = False) -> dict:
    """Each case of ``group`` on one rank (TP = EP = ETP = 1): the gather path's results (the case's
    first variant's transform: ``LoRA``, or ``CanonicalLoRA`` for canonical cases); with ``fp64``, also
    the same run in float64 under "fp64" (the reference of the layouts' other summation orders,
    tests.harness.numerics)."""
    out = {}
    for name in group:
        case, variant = cases[name].reference(), cases[name].variants[0]
        out[name] = train(case, variant)
        if fp64:
            out[name]["fp64"] = train(replace(case, dtype="float64"), variant)
    return out

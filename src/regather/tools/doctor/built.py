"""``regather doctor --build``: the tiny megatron-core GPT built on CPU gloo ranks, its adapters asked.

The GPT is built on ``tp`` ranks, LoRA is applied, :func:`regather.decisions` is read and, with
recompute, one training step runs so each adapter's per-forward checks (``last_decision``) show
too. Two megatron checkpoints cannot run on CPU (selective ``mlp``: endless recursion on gloo;
selective ``layernorm``: needs TE); the step runs without them and the affected adapters'
recompute sentence comes from the rules (:mod:`regather.tools.doctor.rules`), marked
``recompute_reason_from_rules``.
"""

from __future__ import annotations

import dataclasses

from regather.megatron.reasons import ELIGIBLE_BASES
from regather.tools.doctor.rules import analytic_decisions, requested_strategy
from regather.tools.doctor.setup import Setup


def cpu_cannot_run(setup: Setup, name: str) -> str | None:
    """Why ``--build``'s CPU step cannot show this adapter's per-forward recompute reason."""
    modules = setup.recompute_modules if setup.recompute_granularity == "selective" else ()
    if name == "linear_fc2" and "mlp" in modules:
        return "megatron's selective 'mlp' checkpoint recurses without end on CPU/gloo"
    if name in ELIGIBLE_BASES and "layernorm" in modules:
        return "megatron's selective 'layernorm' checkpoint needs Transformer Engine"
    return None


def build_rank(rank, world_size, setup: Setup):
    """Rank body for ``--build``: the tiny GPT with LoRA; ``regather.decisions`` before a step,
    then one training step (forward + backward), whose per-forward producer checks can still
    make an adapter keep its input (each adapter's ``last_decision`` says why)."""
    import torch
    import torch.nn.functional as F

    from regather.core.strategies import Strategy
    from regather.megatron.dense.model import adapters, decisions
    from regather.megatron.lora import LoRA
    from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch, gpt_loss
    from regather.tools.cpu.train import require_decoder_input_grad

    overrides = {}
    if setup.recompute_granularity:
        overrides["recompute_granularity"] = setup.recompute_granularity
        if setup.recompute_granularity == "full":
            overrides.update(recompute_method=setup.recompute_method or "uniform", recompute_num_layers=1)
        elif setup.recompute_modules:
            overrides["recompute_modules"] = list(setup.recompute_modules)
    if setup.activation == "swiglu":
        overrides.update(gated_linear_unit=True, activation_func=F.silu)
    if not setup.add_bias_linear:
        overrides["add_bias_linear"] = False
    shape = TinyGPT(layers=setup.layers, hidden=setup.hidden, heads=setup.heads, ffn=setup.ffn, seq=setup.seq)
    model = build_gpt(shape, setup.tp, setup.sp, torch.float32, **overrides)
    # features a CPU build cannot turn on; eligibility reads them from the shared config
    model.config.cuda_graph_impl = "local" if setup.cuda_graphs else getattr(model.config, "cuda_graph_impl", "none")
    model.config.cpu_offloading = setup.cpu_offloading
    requested = requested_strategy(setup)
    kwargs = dict(target_modules=list(setup.targets), dim=setup.lora_rank, alpha=2 * setup.lora_rank)
    if setup.recompute_adapter_inputs:
        kwargs["recompute_adapter_inputs"] = True
    fields = {f.name for f in dataclasses.fields(LoRA)}
    if requested != Strategy.GATHER and "sequence_parallel_input_strategy" in fields:
        kwargs["sequence_parallel_input_strategy"] = requested.value
    else:
        kwargs["sequence_parallel_input_regather"] = requested == Strategy.REGATHER
    model = LoRA(**kwargs)(model, training=True)
    # full recompute: megatron's reentrant checkpoint runs its backward only for an input that
    # requires grad, which Bridge arranges for PEFT (maybe_enable_recompute_inputs_grad)
    if setup.input_requires_grad or setup.recompute_granularity == "full":
        require_decoder_input_grad(model)
    before = decisions(model)
    ruled = {}
    if setup.recompute_adapter_inputs and not setup.cuda_graphs and not setup.cpu_offloading:
        for layer in model.decoder.layers:  # checkpoints the CPU cannot run (see cpu_cannot_run)
            if cpu_cannot_run(setup, "linear_fc2"):
                layer.recompute_mlp = False
            if cpu_cannot_run(setup, "linear_qkv"):
                layer.recompute_input_layernorm = layer.recompute_pre_mlp_layernorm = False
        gpt_loss(model, gpt_batch(shape, setup.micro_batch, seed=0)).backward()
        rules = analytic_decisions(setup)
        ruled = {p: cpu_cannot_run(setup, p.rsplit(".", 1)[-1]) for p in before}
    out = {}
    for path, adapter in adapters(model).items():
        d = before[path]
        seen = adapter.last_decision
        if ruled.get(path) and d.recompute is not None:  # what the step could not show: the rules' sentence
            d = dataclasses.replace(d, recompute=rules[path]["recompute"], recompute_reason=rules[path]["recompute_reason"])
        elif d.recompute is not None and seen is not None and seen.recompute is None and seen.recompute_reason:
            d = dataclasses.replace(d, recompute=None, recompute_reason=seen.recompute_reason)
        out[path] = {"requested": d.requested.value, "used": d.used.value, "reason": d.reason,
                     "recompute": d.recompute, "recompute_reason": d.recompute_reason}
        if ruled.get(path) and d.recompute_reason:
            out[path]["recompute_reason_from_rules"] = ruled[path]
    return out


def built_decisions(setup: Setup, timeout: float = 180.0) -> dict[str, dict]:
    """Build the GPT on ``setup.tp`` gloo ranks (CPU) and list rank 0's decisions."""
    from regather.tools.cpu.dist import run_ranks

    return run_ranks(build_rank, setup.tp, setup, timeout=timeout)[0]

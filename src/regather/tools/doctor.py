"""``regather doctor``: the reference's failure-diagnosis table as a command.

For an environment (``os.environ`` by default) and a model/run configuration
it reports findings, each with its fix:

==================== ======== ==================================================
code                 level    when
==================== ======== ==================================================
alloc-conf           warning  ``PYTORCH_CUDA_ALLOC_CONF`` lacks ``expandable_segments:True``
nccl-ub              error    expandable segments with NCCL user-buffer registration
                              (``--use-nccl-ub`` / config ``nccl_ub``)
cuda-graph-register  error    CUDA graphs + expandable segments, ``NCCL_GRAPH_REGISTER`` not ``0``
cpu-offload-pp       error    CPU offloading with pipeline parallelism > 1
full-recompute-      warning  full activation recompute, PP=1, frozen embeddings: megatron's
frozen-input                  reentrant checkpoint never runs its backward (no LoRA gradients)
regather-off         warning  LoRA + SP keeps full gathered LoRA-A inputs (strategy gather)
                              while adapters could re-gather
regather-no-effect   info     re-gather asked, but SP is off or TP is 1
adapter              info /   every LoRA adapter's decision (strategy used and why; with
                     warning  ``--recompute-adapter-inputs`` whether its input is recomputed and
                              from what, or why it is kept); a fallback that is not by design
                              is a warning
redispatch-available info     per-expert expert fc1 adapters keep the dispatched tokens under
                              recompute only because ``redispatch_expert_inputs`` is off: the
                              bytes re-dispatch would free, and what it would send
saving               info     estimated LoRA-A input memory saved per GPU (re-gather, and the
                              inputs recompute rebuilds, expert adapters included)
==================== ======== ==================================================

Everything is a pure function of an env mapping and a :class:`Setup`, so each
finding is testable without GPUs. Adapter decisions come from the same
:func:`regather.megatron.dense.eligibility.unsupported_reason` every adapter runs; the recompute
part from :func:`recompute_part`, which writes the sentences the adapters and their
producers give (``regather.megatron.dense.producers``) in the order they check them — including the
per-forward one for layer 0 (frozen embeddings: ``input_layernorm`` keeps nothing, so
layer 0's ``linear_qkv`` keeps its input), :func:`regather.tools.estimate.producer_inputs_need_grad`.
With ``--build`` the tiny megatron-core GPT is built on ``tp`` CPU gloo ranks, LoRA
is applied, :func:`regather.decisions` is read and, with recompute, one training step
runs so each adapter's per-forward checks (``last_decision``) show too. Two megatron
checkpoints cannot run on CPU (selective ``mlp``: endless recursion on gloo; selective
``layernorm``: needs TE); the step runs without them and the affected adapters' recompute
sentence comes from the rules, marked ``recompute_reason_from_rules``.

MoE (``--moe``): expert fc1's recompute outcome is the adapters' (:mod:`regather.megatron.moe.inputs`),
in their order — a per-expert LoRA-A (SequentialMLP, or grouped experts with
``share_expert_adapters=False``) without ``redispatch_expert_inputs`` gets no producer, then
megatron's checkpoint, then the MoE layer's configuration (:func:`regather.megatron.moe.inputs.static_reason`
on a stand-in layer: the flex dispatcher, offloading, ...), then a router whose input needs no
gradient (:func:`regather.tools.estimate.expert_fc1_source`).

The saving uses :func:`regather.tools.estimate.adapter_input_bytes` (``s*b*h*e`` on
the gather path against ``s*b*h*e/t`` when re-gathering, i.e.
``s*b*h*e*(t-1)/t`` per adapter and micro-batch in flight), counted only for
the adapters whose decision is not the gather path; plus, per recomputing adapter,
its ``x_local`` (qkv/fc1) or its input ``s*b*ffn/t*e`` (fc2); plus, per MoE layer whose
expert fc1 / fc2 adapters recompute, :func:`regather.tools.estimate.expert_inputs`' exact bytes
(``R*h*e`` / ``R*(moe_ffn/ETP)*e``, ``R = T*k*ETP`` routed rows: the mean over the EP x ETP group).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import SimpleNamespace

ALL_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
LEVELS = ("info", "warning", "error")


@dataclass(frozen=True)
class Finding:
    code: str
    level: str  # info | warning | error
    message: str
    fix: str | None = None

    def __str__(self) -> str:
        text = f"[{self.level.upper():7}] {self.code}: {self.message}"
        return text + (f"\n          fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class Setup:
    """The run configuration doctor reasons about (megatron / Bridge names where they exist)."""

    # model (defaults: the tiny test GPT)
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 128
    moe: bool = False
    experts: str = "sequential"  # MoE: "sequential" (SequentialMLP) or "grouped" (TEGroupedMLP)
    # MoE sizes and layout (defaults: the tiny test MoE, regather.testing.moe_models.TinyMoE)
    num_experts: int = 4
    moe_ffn: int = 64
    topk: int = 2
    ep: int = 1
    etp: int = 1
    dispatcher: str = "alltoall"  # moe_token_dispatcher_type: "alltoall", "allgather" or "flex"
    share_expert_adapters: bool = True  # grouped experts only: SequentialMLP has one adapter per expert
    redispatch_expert_inputs: bool = False  # LoRA(redispatch_expert_inputs=True)
    # parallelism and batch
    tp: int = 2
    pp: int = 1
    sp: bool = True
    seq: int = 32
    micro_batch: int = 2
    in_flight: int = 1
    dtype: str = "bfloat16"
    # LoRA
    strategy: str = "regather"
    targets: tuple = ALL_TARGETS
    lora_rank: int = 8
    # features that change eligibility or the allocator
    use_nccl_ub: bool = False
    cuda_graphs: bool = False
    cpu_offloading: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_modules: tuple = ()
    # LoRA(recompute_adapter_inputs=True), and what decides which producers keep a tensor
    recompute_adapter_inputs: bool = False
    input_requires_grad: bool = False  # the decoder input requires grad (Bridge / HF hooks)
    activation: str = "gelu"  # the MLP's: "gelu" or "swiglu" (silu, gated)
    add_bias_linear: bool = True  # megatron's default (the tiny test GPT has biases)


# -- environment / configuration findings --------------------------------------------


def alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """``PYTORCH_CUDA_ALLOC_CONF`` (or torch's newer ``PYTORCH_ALLOC_CONF``) as a dict."""
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    out = {}
    for item in raw.split(","):
        if ":" in item:
            k, v = item.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def expandable_segments(env: Mapping[str, str]) -> bool:
    return alloc_conf(env).get("expandable_segments", "").lower() in ("true", "1")


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def nccl_ub_enabled(env: Mapping[str, str], setup: Setup) -> bool:
    """``--use-nccl-ub`` / config ``nccl_ub``, or the env spelling ``REGATHER_NCCL_UB``/``NCCL_UB``."""
    return setup.use_nccl_ub or _truthy(env.get("NCCL_UB", "")) or _truthy(env.get("REGATHER_NCCL_UB", ""))


def env_findings(env: Mapping[str, str], setup: Setup) -> list[Finding]:
    """The allocator / NCCL / offloading rows of the failure-diagnosis table."""
    out = []
    expandable = expandable_segments(env)
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF")
    ub = nccl_ub_enabled(env, setup)
    if not expandable and not ub:
        out.append(Finding(
            "alloc-conf", "warning",
            f"PYTORCH_CUDA_ALLOC_CONF={raw!r} does not set expandable_segments:True: OOM on one rank "
            "despite headroom on others is usually allocator fragmentation",
            "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (zero throughput cost)",
        ))
    if expandable and ub:
        out.append(Finding(
            "nccl-ub", "error",
            f"PYTORCH_CUDA_ALLOC_CONF={raw!r} enables expandable segments together with NCCL user-buffer "
            "registration (--use-nccl-ub / nccl_ub=True): the two are incompatible (RuntimeError)",
            "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF, or disable --use-nccl-ub",
        ))
    graph_register = env.get("NCCL_GRAPH_REGISTER")
    if setup.cuda_graphs and expandable and graph_register != "0":
        out.append(Finding(
            "cuda-graph-register", "error",
            f"CUDA graphs with expandable segments need NCCL_GRAPH_REGISTER=0 "
            f"(it is {graph_register!r}); MCore's CudaGraphManager enforces it on pre-Blackwell GPUs",
            "export NCCL_GRAPH_REGISTER=0",
        ))
    if setup.recompute_granularity == "full" and setup.pp == 1 and not setup.input_requires_grad:
        out.append(Finding(
            "full-recompute-frozen-input", "warning",
            "full activation recompute with frozen embeddings at PP=1: megatron's reentrant checkpoint "
            "runs its backward only for an input that requires grad, so the LoRA weights inside get no "
            "gradient unless the recipe makes the decoder input require grad (Megatron Bridge's PEFT does: "
            "maybe_enable_recompute_inputs_grad; then pass --input-requires-grad)",
            "make the decoder input require grad (HF: enable_input_require_grads; megatron: a forward "
            "pre-hook on the TransformerBlock returning hidden_states.detach().requires_grad_(True))",
        ))
    if setup.cpu_offloading and setup.pp > 1:
        out.append(Finding(
            "cpu-offload-pp", "error",
            f"CPU offloading (cpu_offloading=True) with pipeline_model_parallel_size={setup.pp}: "
            "megatron-core raises 'Currently there is no support for Pipeline parallelism with CPU offloading'",
            "set cpu_offloading=False, or pipeline_model_parallel_size=1",
        ))
    return out


# -- adapter decisions -----------------------------------------------------------------


def _config_namespace(setup: Setup):
    """The TransformerConfig attributes eligibility reads."""
    return SimpleNamespace(
        cpu_offloading=setup.cpu_offloading,
        cpu_offloading_activations=True,
        fine_grained_activation_offloading=False,
        cuda_graph_impl="local" if setup.cuda_graphs else "none",
        recompute_granularity=setup.recompute_granularity,
        recompute_method=setup.recompute_method,
        recompute_modules=list(setup.recompute_modules),
    )


def _requested(setup: Setup):
    from regather.core.strategies import Strategy

    return Strategy.parse(setup.strategy)


def analytic_decisions(setup: Setup) -> dict[str, dict]:
    """``{path: {"requested", "used", "reason", "recompute", "recompute_reason"}}`` for every
    adapter, from the eligibility rules and, with ``recompute_adapter_inputs``, the producer
    rules (:func:`recompute_part`); the last two are None when recompute is not asked."""
    from regather.core.strategies import Strategy
    from regather.megatron.dense.eligibility import AdapterFacts, RunState, unsupported_reason
    from regather.tools.estimate import producer_inputs_need_grad

    requested = _requested(setup)
    config = _config_namespace(setup)
    state = RunState(training=True, grad_enabled=True, in_recompute=False, lora_a_trainable=True)
    layers = setup.layers // max(setup.pp, 1)
    needs_grad = producer_inputs_need_grad(setup.targets, layers, setup.input_requires_grad)
    out = {}
    for layer in range(layers):
        for name in setup.targets:
            module = "self_attention" if name in ("linear_qkv", "linear_proj") else "mlp"
            facts = AdapterFacts(
                base_name=name, column_parallel=name in COLUMN_PARALLEL,
                sequence_parallel=setup.sp and setup.tp > 1, tp_size=setup.tp,
                is_expert=setup.moe and module == "mlp",
            )
            reason = None if requested == Strategy.GATHER else unsupported_reason(facts, config, state)
            used = Strategy.GATHER if reason else requested
            recompute, why = recompute_part(setup, name, used.value, needs_grad[layer].get(name, False))
            out[f"decoder.layers.{layer}.{module}.{name}"] = {
                "requested": requested.value, "used": used.value, "reason": reason,
                "recompute": recompute, "recompute_reason": why}
    return out


NORM_OF = {"linear_qkv": "input_layernorm", "linear_fc1": "pre_mlp_layernorm"}
_NOTHING_KEPT = "it keeps nothing for its backward (neither its input nor its weights need a gradient)"


def activation_name(setup: Setup) -> str:
    """The producer name an MLP activation has in ``regather.decisions`` (regather.megatron.dense.producers)."""
    return "the MLP activation (silu, gated)" if setup.activation == "swiglu" else "the MLP activation (gelu)"


def recompute_part(setup: Setup, name: str, used: str, producer_input_needs_grad: bool
                   ) -> tuple[str | None, str | None]:
    """``(producer, None)`` when the adapter on ``name`` recomputes its input, ``(None, reason)``
    when it keeps it — the sentences :meth:`ParallelLinearAdapter.decide` and the producers'
    per-forward checks give (``regather.megatron.dense.producers``), in the same order; ``(None, None)`` when
    recompute is not asked."""
    if not setup.recompute_adapter_inputs:
        return None, None
    if setup.moe and name in ("linear_fc1", "linear_fc2"):  # the dispatched path decides first
        return _expert_recompute_part(setup, name, producer_input_needs_grad)
    sp = setup.sp and setup.tp > 1
    if name in COLUMN_PARALLEL and (not sp or used == "gather"):
        path = "gather" if sp else "replicated"
        return None, (f"the {path} path keeps its input as it is (recompute of a column-parallel "
                      "adapter's input needs regather or lowrank)")
    if name == "linear_proj":
        return None, "linear_proj has no recomputable producer (only linear_qkv, linear_fc1 and linear_fc2 do)"
    if name == "linear_fc2" and setup.cpu_offloading:
        return None, "CPU activation offloading is on (cpu_offloading=True)"
    modules = list(setup.recompute_modules)
    from regather.megatron.dense.eligibility import IN_CHECKPOINT, checkpointed_by_config

    if checkpointed_by_config(setup, name):  # the Setup has the config's two recompute fields
        return None, IN_CHECKPOINT
    if name == "linear_fc2":
        producer = activation_name(setup)
    else:
        producer = NORM_OF[name]
        if setup.recompute_granularity == "selective" and "layernorm" in modules:
            return None, f"selective recompute covers 'layernorm' (recompute_modules={modules})"
    if not producer_input_needs_grad:
        return None, f"{producer}: {_NOTHING_KEPT}"
    return producer, None


def shares_expert_lora(setup: Setup) -> bool:
    """One LoRA pair for a MoE layer's local experts: grouped experts with ``share_expert_adapters``
    (Bridge's default); SequentialMLP experts have one each."""
    return setup.experts == "grouped" and setup.share_expert_adapters


def _expert_recompute_part(setup: Setup, name: str, needs_grad: bool) -> tuple[str | None, str | None]:
    """An expert adapter's recompute outcome: fc1 from the router's input (:func:`_expert_fc1_part`);
    fc2 rebuilds its input from the experts' activation x probs (regather.megatron.moe.producers)."""
    from regather.megatron.dense.eligibility import IN_CHECKPOINT, checkpointed_by_config
    from regather.megatron.moe.producers import MOE_ACT_RECOMPUTED, grouped_name

    if name == "linear_fc1":
        return _expert_fc1_part(setup, needs_grad)
    modules = list(setup.recompute_modules) if setup.recompute_granularity == "selective" else []
    if checkpointed_by_config(setup, name, expert=True):  # full, or selective 'moe' ('mlp' skips MoE layers)
        return None, IN_CHECKPOINT
    if setup.cpu_offloading:
        return None, "CPU activation offloading is on (cpu_offloading=True)"
    producer = activation_name(setup)
    if setup.experts == "grouped":
        if "moe_act" in modules:
            return None, MOE_ACT_RECOMPUTED
        producer = grouped_name(producer)
    if not needs_grad:
        return None, f"{producer}: {_NOTHING_KEPT}"
    return producer, None


def _expert_fc1_part(setup: Setup, router_input_needs_grad: bool) -> tuple[str | None, str | None]:
    """Expert fc1 in the adapter's order (``ParallelLinearAdapter._recompute_unsupported``): a
    per-expert LoRA-A without the re-dispatch opt-in has no producer (``REDISPATCH_OPT_IN``), then
    megatron's checkpoint (full, or selective ``moe``: ``IN_CHECKPOINT``, as for fc2), then
    the MoE layer's configuration (:func:`moe_static_reason`), then the router's input: it keeps
    nothing unless it requires grad (the pre-MLP norm's input does)."""
    from regather.megatron.dense.eligibility import IN_CHECKPOINT, checkpointed_by_config
    from regather.megatron.moe.inputs import REDISPATCH_OPT_IN
    from regather.tools.estimate import expert_fc1_source

    producer, why = expert_fc1_source(shares_expert_lora(setup), setup.redispatch_expert_inputs,
                                      router_input_needs_grad)
    if why == REDISPATCH_OPT_IN:
        return None, why
    if checkpointed_by_config(setup, "linear_fc1", expert=True):
        return None, IN_CHECKPOINT
    static = moe_static_reason(setup)
    if static:
        return None, static
    return producer, why


DISPATCHERS = ("alltoall", "allgather", "flex")


def moe_static_reason(setup: Setup) -> str | None:
    """:func:`regather.megatron.moe.inputs.static_reason` for this setup: why no expert fc1 input of a MoE
    layer can come from the router's input, from the configuration alone (or None). It runs on a
    stand-in layer — the setup's config attributes, and an instance of megatron's dispatcher class
    for ``setup.dispatcher`` made without ``__init__`` (only its class is read)."""
    import warnings

    from regather.megatron.moe.inputs import static_reason

    if setup.dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher {setup.dispatcher!r}: expected one of {DISPATCHERS}")
    with warnings.catch_warnings():  # megatron warns about missing TE / Apex on import
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import token_dispatcher as td
    kind = {"alltoall": td.MoEAlltoAllTokenDispatcher, "allgather": td.MoEAllGatherTokenDispatcher,
            "flex": getattr(td, "MoEFlexTokenDispatcher", None)}[setup.dispatcher]
    dispatcher = object.__new__(kind) if kind is not None else type("MoEFlexTokenDispatcher", (), {})()
    config = SimpleNamespace(**vars(_config_namespace(setup)), moe_token_dispatcher_type=setup.dispatcher)
    return static_reason(SimpleNamespace(config=config, experts=SimpleNamespace(), token_dispatcher=dispatcher))


def _cpu_cannot_run(setup: Setup, name: str) -> str | None:
    """Why ``--build``'s CPU step cannot show this adapter's per-forward recompute reason."""
    modules = setup.recompute_modules if setup.recompute_granularity == "selective" else ()
    if name == "linear_fc2" and "mlp" in modules:
        return "megatron's selective 'mlp' checkpoint recurses without end on CPU/gloo"
    if name in COLUMN_PARALLEL and "layernorm" in modules:
        return "megatron's selective 'layernorm' checkpoint needs Transformer Engine"
    return None


def _build_rank(rank, world_size, setup: Setup):
    """Rank body for ``--build``: the tiny GPT with LoRA; ``regather.decisions`` before a step,
    then one training step (forward + backward), whose per-forward producer checks can still
    make an adapter keep its input (each adapter's ``last_decision`` says why)."""
    import torch
    import torch.nn.functional as F

    from regather.core.strategies import Strategy
    from regather.megatron.dense.model import adapters, decisions
    from regather.megatron.lora import LoRA
    from regather.testing.models import TinyGPT, build_gpt, gpt_batch, gpt_loss
    from regather.testing.train import require_decoder_input_grad

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
    shape = TinyGPT(num_layers=setup.layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
                    ffn_hidden_size=setup.ffn, seq_length=setup.seq)
    model = build_gpt(shape, setup.tp, setup.sp, torch.float32, **overrides)
    # features a CPU build cannot turn on; eligibility reads them from the shared config
    model.config.cuda_graph_impl = "local" if setup.cuda_graphs else getattr(model.config, "cuda_graph_impl", "none")
    model.config.cpu_offloading = setup.cpu_offloading
    requested = _requested(setup)
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
        for layer in model.decoder.layers:  # checkpoints the CPU cannot run (see _cpu_cannot_run)
            if _cpu_cannot_run(setup, "linear_fc2"):
                layer.recompute_mlp = False
            if _cpu_cannot_run(setup, "linear_qkv"):
                layer.recompute_input_layernorm = layer.recompute_pre_mlp_layernorm = False
        gpt_loss(model, gpt_batch(shape, setup.micro_batch, seed=0)).backward()
        rules = analytic_decisions(setup)
        ruled = {p: _cpu_cannot_run(setup, p.rsplit(".", 1)[-1]) for p in before}
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
    from regather.testing.dist import run_ranks

    return run_ranks(_build_rank, setup.tp, setup, timeout=timeout)[0]


_BY_DESIGN = ("base layer", "module is in eval mode", "autograd is disabled", "running inside")
# reasons to keep an input under recompute_adapter_inputs that point at something to change
_UNEXPECTED_KEPT = ("dropout is applied", "the adapter input is not", "CPU activation", "selective recompute",
                    "no producer attached")


def _natural(path: str):
    """Sort key that puts layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def describe(d: Mapping) -> str:
    """A decision dict as ``str(regather.megatron.dense.adapter.Decision)`` writes it."""
    text = d["used"]
    if d["used"] != d["requested"]:
        text += f" (asked {d['requested']}: {d['reason']})"
    if d.get("recompute"):
        text += f", input recomputed from {d['recompute']}"
    elif d.get("recompute_reason"):
        text += f", input kept (recompute asked: {d['recompute_reason']})"
    return text


def adapter_findings(setup: Setup, decisions: Mapping[str, Mapping]) -> list[Finding]:
    out = []
    for path in sorted(decisions, key=_natural):
        d = decisions[path]
        kept = d.get("recompute_reason")
        if d["reason"] is None and kept is None:
            out.append(Finding("adapter", "info", f"{path}: {describe(d)}"))
            continue
        expected = d["reason"] is None or d["reason"].startswith(_BY_DESIGN) or "expert" in d["reason"]
        fix = None if expected else _fix_for_reason(d["reason"])
        if kept is not None:
            kept_expected = not kept.startswith(_UNEXPECTED_KEPT) and "bit for bit" not in kept
            expected = expected and kept_expected
            fix = fix or _fix_for_kept(kept)
        if d["reason"] is None:
            message = f"{path}: {describe(d)}"
        else:
            message = f"{path}: asked {d['requested']}, uses {d['used']}: {d['reason']}" + (
                f"; input kept (recompute asked: {kept})" if kept else
                f"; input recomputed from {d['recompute']}" if d.get("recompute") else "")
        if d.get("recompute_reason_from_rules"):
            message += f" [from the rules: {d['recompute_reason_from_rules']}]"
        out.append(Finding("adapter", "info" if expected else "warning", message, fix))
    column = [p for p in decisions if p.rsplit(".", 1)[-1] in COLUMN_PARALLEL]
    if setup.strategy == "gather" and setup.sp and setup.tp > 1 and column and not setup.moe:
        out.append(Finding(
            "regather-off", "warning",
            f"LoRA + SP keeps the full gathered LoRA-A input of {len(column)} column-parallel adapter(s) "
            "until backward (strategy 'gather')",
            "LoRA(sequence_parallel_input_regather=True) (or strategy='regather'); check the fallbacks below",
        ))
    if setup.strategy != "gather" and (not setup.sp or setup.tp <= 1):
        out.append(Finding(
            "regather-no-effect", "info",
            f"strategy {setup.strategy!r} has no effect with sequence_parallel={setup.sp}, TP={setup.tp}",
            None,
        ))
    return out


def _fix_for_reason(reason: str) -> str | None:
    if "recompute" in reason:
        return "drop 'mlp' from recompute_modules, or use selective recompute of core_attn instead of full"
    if "CUDA graphs" in reason:
        return "CUDA graphs capture the adapter's collectives; re-gather runs only without them"
    if "offloading" in reason:
        return "turn CPU activation offloading off for re-gather to apply"
    if "frozen" in reason:
        return "make LoRA-A trainable"
    return None


def _fix_for_kept(reason: str) -> str | None:
    if "redispatch_expert_inputs=True" in reason:
        return "LoRA(redispatch_expert_inputs=True) (--redispatch-expert-inputs): see the redispatch-available finding"
    if _NOTHING_KEPT in reason:
        return ("recomputable only when the decoder input requires grad (Bridge's "
                "maybe_enable_recompute_inputs_grad with activation recompute, HF's enable_input_require_grads; "
                "--input-requires-grad shows it)")
    if reason.startswith("selective recompute covers 'layernorm'"):
        return "drop 'layernorm' from recompute_modules: the norm's input is then kept and the adapter recomputes from it"
    if "dropout_position='pre'" in reason:
        return "dropout_position='post' (or dropout=0) lets the adapter input be recomputed"
    return None


def per_adapter_saving(setup: Setup, target: str = "linear_qkv") -> tuple[int, str]:
    """Bytes one re-gathering adapter saves per GPU (all micro-batches in flight), and how it was computed."""
    try:
        from regather.tools import estimate as est
    except ImportError:
        est = None
    t, e = setup.tp, _dtype_bytes(setup.dtype)
    if est is not None:
        model = est.Model("doctor", hidden=setup.hidden, layers=1, heads=setup.heads, ffn=setup.ffn)
        run = est.Run(tp=t, sp=setup.sp, seq=setup.seq, micro_batch=setup.micro_batch,
                      in_flight=setup.in_flight, dtype=setup.dtype, targets=(target,))
        saved = est.adapter_input_bytes(model, run, "gather")[target] - est.adapter_input_bytes(
            model, run, "regather")[target]
        return saved, "regather.tools.estimate.adapter_input_bytes (gather minus regather)"
    saved = setup.seq * setup.micro_batch * setup.hidden * e * (t - 1) // t * setup.in_flight
    return saved, "s*b*h*e*(t-1)/t per adapter and micro-batch in flight (regather.tools.estimate not available)"


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}[dtype]


def _bytes_of(setup: Setup, target: str, strategy: str) -> int:
    """One adapter's kept input bytes per GPU (all micro-batches in flight) under ``strategy``."""
    from regather.tools import estimate as est

    model = est.Model("doctor", hidden=setup.hidden, layers=1, heads=setup.heads, ffn=setup.ffn)
    run = est.Run(tp=setup.tp, sp=setup.sp, seq=setup.seq, micro_batch=setup.micro_batch,
                  in_flight=setup.in_flight, dtype=setup.dtype, targets=(target,))
    return est.adapter_input_bytes(model, run, strategy).get(target, 0)


def _is_expert(setup: Setup, path: str) -> bool:
    """An expert linear's adapter (a MoE layer's fc1/fc2, not a shared expert's)."""
    return setup.moe and path.rsplit(".", 1)[-1] in ("linear_fc1", "linear_fc2") and ".shared_experts." not in path


def _moe_layer(path: str) -> str:
    """The MoE layer an expert adapter's path belongs to (SequentialMLP's experts share it)."""
    return re.sub(r"\.local_experts\.\d+", "", path).rsplit(".", 1)[0]


def _expert_estimate(setup: Setup):
    """``(Model, Run)`` for :mod:`regather.tools.estimate` from this setup (a flex dispatcher: the alltoall
    one, for bytes, which do not depend on it)."""
    from regather.tools import estimate as est

    model = est.Model("doctor", hidden=setup.hidden, layers=setup.layers, heads=setup.heads,
                      experts=setup.num_experts, moe_ffn=setup.moe_ffn, topk=setup.topk)
    run = est.Run(tp=setup.tp, sp=setup.sp, seq=setup.seq, micro_batch=setup.micro_batch, in_flight=setup.in_flight,
                  pp=setup.pp, dtype=setup.dtype, lora_rank=setup.lora_rank, targets=tuple(setup.targets),
                  input_requires_grad=setup.input_requires_grad, ep=setup.ep, etp=setup.etp,
                  expert_lora="shared" if shares_expert_lora(setup) else "per-expert",
                  redispatch=setup.redispatch_expert_inputs,
                  dispatcher=setup.dispatcher if setup.dispatcher in est.DISPATCHERS else "alltoall")
    return model, run


def expert_layer_bytes(setup: Setup) -> dict[str, int]:
    """One MoE layer's expert adapter inputs per GPU, by linear, all micro-batches in flight
    (:func:`regather.tools.estimate.expert_inputs` on the gather path: fc1 ``R*h*e``, fc2
    ``R*(moe_ffn/ETP)*e``, ``R = T*k*ETP`` routed rows, the EP x ETP group's mean)."""
    from regather.tools import estimate as est

    model, run = _expert_estimate(setup)
    (row,) = est.expert_inputs(dataclasses.replace(model, layers=1), dataclasses.replace(run, pp=1), "gather")
    return {a.target.split(".", 1)[1]: a.kept_bytes * setup.in_flight for a in row}


def _recomputing_expert_layers(setup: Setup, decisions: Mapping[str, Mapping], name: str) -> set:
    return {_moe_layer(p) for p, d in decisions.items()
            if d.get("recompute") and _is_expert(setup, p) and p.endswith(name)}


def _expert_saving(setup: Setup, decisions: Mapping[str, Mapping]) -> tuple[int, str]:
    """Bytes the recomputing expert adapters free, per MoE layer and linear, and how."""
    from regather.tools.estimate import routed_rows

    layers = {n: len(_recomputing_expert_layers(setup, decisions, n)) for n in ("linear_fc1", "linear_fc2")}
    if not any(layers.values()):
        return 0, ""
    try:
        per, rows = expert_layer_bytes(setup), routed_rows(*_expert_estimate(setup))
    except ValueError as exc:  # a layout estimate refuses: say so instead of guessing
        return 0, (f"; expert fc1 inputs recomputed in {layers['linear_fc1']} MoE layer(s) and fc2 inputs in "
                   f"{layers['linear_fc2']}, not counted: {exc}")
    total = sum(n * per.get(name, 0) for name, n in layers.items())
    return total, (f" + {layers['linear_fc1']} MoE layer(s) of expert fc1 inputs x {per.get('linear_fc1', 0):,} bytes "
                   f"(R*h*e) + {layers['linear_fc2']} of expert fc2 inputs x {per.get('linear_fc2', 0):,} bytes "
                   f"(R*moe_ffn/ETP*e), R = T*k*ETP = {rows} routed rows per GPU (mean over the EP x ETP group)")


def saving_finding(setup: Setup, decisions: Mapping[str, Mapping]) -> Finding:
    """Re-gathering adapters save x_full - x_local each; with recompute_adapter_inputs, a
    recomputing qkv/fc1 adapter saves its x_local too (x_full in all), a recomputing fc2
    adapter its input ``s*b*ffn/t*e``, and each MoE layer whose expert adapters recompute its
    expert inputs (:func:`expert_layer_bytes`) — regather.tools.estimate's bytes."""
    local = [p for p, d in decisions.items() if d["used"] != "gather"]
    per, how = per_adapter_saving(setup)
    total = per * len(local)
    text = (f"estimated LoRA-A input memory saved per GPU: {{total}} = {len(local)} re-gathering adapter(s) x "
            f"{per:,} bytes")
    recomputing = [p for p, d in decisions.items() if d.get("recompute") and not _is_expert(setup, p)]
    col = [p for p in recomputing if p.rsplit(".", 1)[-1] in COLUMN_PARALLEL]
    fc2 = [p for p in recomputing if p.rsplit(".", 1)[-1] == "linear_fc2"]
    if setup.recompute_adapter_inputs:
        x_local = _bytes_of(setup, "linear_qkv", "regather")
        fc2_in = _bytes_of(setup, "linear_fc2", "gather")
        total += len(col) * x_local + len(fc2) * fc2_in
        kept = sum(1 for d in decisions.values() if d.get("recompute_reason"))
        text += (f" + {len(col)} recomputed qkv/fc1 input(s) x {x_local:,} bytes (x_local) + {len(fc2)} recomputed "
                 f"fc2 input(s) x {fc2_in:,} bytes (s*b*ffn/t*e)")
        experts, expert_text = _expert_saving(setup, decisions)
        total += experts
        text += f"{expert_text}; {kept} adapter(s) keep their input"
    text = text.replace("{total}", f"{total:,} bytes ({total / 2**30:.3f} GiB)")
    return Finding(
        "saving", "info",
        f"{text} [{how}; s={setup.seq}, b={setup.micro_batch}, h={setup.hidden}, ffn={setup.ffn}, t={setup.tp}, "
        f"{setup.dtype}, {setup.in_flight} micro-batch(es) in flight]",
    )


def redispatch_finding(setup: Setup, decisions: Mapping[str, Mapping]) -> Finding | None:
    """Per-expert expert fc1 adapters that keep the dispatched tokens under recompute only because
    ``LoRA(redispatch_expert_inputs=True)`` is off (with it on, the rules recompute them): what
    re-dispatch frees (:func:`expert_layer_bytes`, fc1) and sends — one more dispatch of the
    tokens per MoE layer in backward (:func:`regather.tools.estimate.redispatch_comm`)."""
    if not (setup.moe and setup.recompute_adapter_inputs) or setup.redispatch_expert_inputs:
        return None
    from regather.megatron.moe.inputs import REDISPATCH_OPT_IN
    from regather.tools.estimate import redispatch_comm

    blocked = [p for p, d in decisions.items() if d.get("recompute_reason") == REDISPATCH_OPT_IN]
    if not blocked:
        return None
    opted_in = dataclasses.replace(setup, redispatch_expert_inputs=True)
    layers = _recomputing_expert_layers(opted_in, {p: d for p, d in analytic_decisions(opted_in).items()
                                                   if p in blocked}, "linear_fc1")
    if not layers:
        return None
    head = (f"{len(blocked)} per-expert linear_fc1 adapter(s) in {len(layers)} MoE layer(s) keep the dispatched "
            "tokens under recompute_adapter_inputs only because re-dispatch is off")
    try:
        freed = len(layers) * expert_layer_bytes(setup)["linear_fc1"]
        sends = [(kind, len(layers) * n) for kind, n, _ in redispatch_comm(*_expert_estimate(opted_in)) if n]
    except ValueError as exc:
        message = f"{head} (bytes not estimated: {exc})"
    else:
        cost = ", ".join(f"{kind} {n:,}" for kind, n in sends) or "nothing crosses ranks at EP = ETP = 1"
        message = (f"{head}: re-dispatch would free {freed:,} bytes per GPU ({len(layers)} x R*h*e, all "
                   f"micro-batches in flight) for one more dispatch of the tokens per MoE layer in backward, "
                   f"{sum(n for _, n in sends):,} bytes received per GPU and micro-batch ({cost}; "
                   "regather.tools.estimate, mean over the EP x ETP group)")
    return Finding("redispatch-available", "info", message,
                   "LoRA(redispatch_expert_inputs=True) (doctor: --redispatch-expert-inputs); grouped experts with "
                   "share_expert_adapters=True need no re-dispatch (their shared LoRA-A runs before the dispatch)")


def diagnose(env: Mapping[str, str], setup: Setup, decisions: Mapping[str, Mapping] | None = None
             ) -> list[Finding]:
    """Every finding for ``env`` and ``setup`` (decisions: analytic unless given)."""
    if decisions is None:
        decisions = analytic_decisions(setup)
    redispatch = redispatch_finding(setup, decisions)
    return (env_findings(env, setup) + adapter_findings(setup, decisions) + ([redispatch] if redispatch else [])
            + [saving_finding(setup, decisions)])


# -- command line ----------------------------------------------------------------------


def _csv(value: str) -> tuple:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="diagnose allocator/NCCL/offload settings and every LoRA adapter's strategy",
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Setup()
    for flag in ("hidden", "layers", "heads", "ffn", "tp", "pp", "seq", "micro-batch", "in-flight", "lora-rank",
                 "num-experts", "moe-ffn", "topk", "ep", "etp"):
        p.add_argument(f"--{flag}", type=int, default=getattr(d, flag.replace("-", "_")))
    p.add_argument("--moe", action="store_true", help="the MLPs are experts (fc1/fc2 never re-gather)")
    p.add_argument("--experts", choices=["sequential", "grouped"], default=d.experts,
                   help="with --moe: SequentialMLP or TEGroupedMLP experts (moe_grouped_gemm)")
    p.add_argument("--dispatcher", choices=DISPATCHERS, default=d.dispatcher, help="moe_token_dispatcher_type")
    p.add_argument("--no-share-expert-adapters", dest="share_expert_adapters", action="store_false",
                   help="grouped experts: one LoRA pair per expert (share_expert_adapters=False)")
    p.add_argument("--redispatch-expert-inputs", action="store_true",
                   help="LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs dispatched again in backward")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--strategy", default=d.strategy, help="gather | regather | lowrank")
    p.add_argument("--targets", type=_csv, default=",".join(ALL_TARGETS))
    p.add_argument("--use-nccl-ub", action="store_true", help="NCCL user-buffer registration (nccl_ub)")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--cpu-offloading", action="store_true")
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    p.add_argument("--recompute-modules", type=_csv, default=())
    p.add_argument("--recompute-adapter-inputs", action="store_true",
                   help="LoRA(recompute_adapter_inputs=True): which adapter inputs are rebuilt in backward, from what")
    p.add_argument("--input-requires-grad", action="store_true",
                   help="the decoder input requires grad (Bridge's maybe_enable_recompute_inputs_grad, HF's "
                        "enable_input_require_grads): layer 0's producers then keep their input")
    p.add_argument("--activation", choices=["gelu", "swiglu"], default=d.activation, help="the MLP's activation")
    p.add_argument("--no-bias", dest="add_bias_linear", action="store_false",
                   help="add_bias_linear=False (Qwen/Llama-style linears without bias)")
    p.add_argument("--build", action="store_true",
                   help="build the GPT on --tp CPU gloo ranks and ask its adapters (regather.decisions, then "
                        "each adapter's decision in one training step for the recompute checks)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def setup_from_args(args) -> Setup:
    return Setup(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, moe=args.moe,
                 experts=args.experts, num_experts=args.num_experts, moe_ffn=args.moe_ffn, topk=args.topk,
                 ep=args.ep, etp=args.etp, dispatcher=args.dispatcher,
                 share_expert_adapters=args.share_expert_adapters,
                 redispatch_expert_inputs=args.redispatch_expert_inputs,
                 tp=args.tp, pp=args.pp, sp=args.sp, seq=args.seq, micro_batch=args.micro_batch,
                 in_flight=args.in_flight, dtype=args.dtype, strategy=args.strategy, targets=tuple(args.targets),
                 lora_rank=args.lora_rank, use_nccl_ub=args.use_nccl_ub, cuda_graphs=args.cuda_graphs,
                 cpu_offloading=args.cpu_offloading, recompute_granularity=args.recompute_granularity,
                 recompute_method=args.recompute_method, recompute_modules=tuple(args.recompute_modules),
                 recompute_adapter_inputs=args.recompute_adapter_inputs,
                 input_requires_grad=args.input_requires_grad, activation=args.activation,
                 add_bias_linear=args.add_bias_linear)


def main(args, env: Mapping[str, str] | None = None) -> int:
    from regather.core.strategies import Strategy

    setup = setup_from_args(args)
    Strategy.parse(setup.strategy)  # a clear error for an unknown strategy
    env = os.environ if env is None else env
    decisions = built_decisions(setup) if args.build else None
    findings = diagnose(env, setup, decisions)
    if args.json:
        print(json.dumps({"setup": asdict(setup), "findings": [asdict(f) for f in findings]}, indent=1))
    else:
        print(f"regather doctor: TP={setup.tp} PP={setup.pp} SP={'on' if setup.sp else 'off'} "
              f"strategy={setup.strategy}{' + recompute_adapter_inputs' if setup.recompute_adapter_inputs else ''} "
              f"({'built model' if args.build else 'eligibility rules'})")
        for f in findings:
            print(f)
    return 1 if any(f.level == "error" for f in findings) else 0

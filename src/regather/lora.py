"""``regather.LoRA``: the PEFT entry point, with Megatron Bridge's field names.

Usage::

    peft = LoRA(dim=16, alpha=32, sequence_parallel_input_regather=True)
    model = peft(model, training=True)      # a megatron-core GPTModel

Every linear whose attribute name is in ``target_modules`` (or whose dotted
path matches a wildcard entry such as ``*.layers.0.*.linear_qkv``) and matches
nothing in ``exclude_modules`` is replaced by a :class:`LoRALinear` holding the
frozen base (``to_wrap``) and a :class:`~regather.adapter.ParallelLinearAdapter`
(``adapter``). All base parameters are frozen; only adapter weights train.
The configuration and the matches are validated before the model is touched.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from regather import checkpoint, debug, experts, fallback_log, te
from regather.adapter import ACTIVATIONS, DROPOUT_POSITIONS, INIT_METHODS, Decision, ParallelLinearAdapter
from regather.strategies import Strategy

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoRALinear(nn.Module):
    """A frozen megatron linear plus its adapter: ``(base(x) + adapter(x), bias)``.

    Checkpoints use Megatron Bridge's keys (:mod:`regather.checkpoint`): the base layer's
    entries under the wrapper's own path (``linear_qkv.weight``, as in the frozen model's
    checkpoint), the adapter's under ``adapter.``; ``sharded_state_dict`` declares both for
    megatron's ``dist_checkpointing``.
    """

    _regather_wrapper = True  # how regather.checkpoint recognises a wrapper without importing this module

    def __init__(self, to_wrap: nn.Module, adapter: ParallelLinearAdapter):
        super().__init__()
        self.to_wrap = to_wrap
        self.adapter = adapter
        self._register_state_dict_hook(checkpoint.flatten_base_keys)
        self._register_load_state_dict_pre_hook(checkpoint.nest_base_keys)
        self._te_layernorm = te.fuses_layernorm(to_wrap)  # LoRA reads TE's LayerNorm output
        # One sequence all-gather (forward) and one reduce-scatter (backward) for base + adapter
        # on a frozen megatron ColumnParallelLinear; see _shared_gather_forward. Off by default:
        # it changes the summation order of the input gradient (dX_base + dX_adapter, then one
        # reduce-scatter) against the unshared path; gather and regather stay bit-identical
        # to each other when both share.
        self.share_sequence_gather = False
        self._adapter_enabled = True

    def delta_weight(self, delta_of) -> torch.Tensor:
        """The adapter's merged weight delta in the base's layout (:mod:`regather.merge`)."""
        return delta_of(self.adapter)

    def named_adapters(self, path: str) -> dict[str, ParallelLinearAdapter]:
        """This wrapper's adapters by the name :func:`adapters` lists them under."""
        return {path: self.adapter}

    def enable_adapter_layers(self) -> None:
        """Megatron Bridge's PEFT protocol (``PEFT.enable_adapter_layers`` / ``disable_adapter``)."""
        self._adapter_enabled = True

    def disable_adapter_layers(self) -> None:
        """Run the frozen base alone (e.g. reference outputs under Bridge's ``peft.disable_adapter``)."""
        self._adapter_enabled = False

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if not self._adapter_enabled:
            return self.to_wrap(x, *args, **kwargs)
        # plan() first: with early re-gather it anchors x so LoRA-A's dA runs after the
        # base layer's dgrad too (regather.strategies.regather); otherwise x is unchanged.
        x, plan = self.adapter.plan(x)
        if self._te_layernorm:  # x is pre-norm: the adapter gets TE's LayerNorm output (regather.te)
            return te.lora_forward(self.to_wrap, self.adapter, x, plan, *args, **kwargs)
        if self.share_sequence_gather and self._can_share(plan):
            return self._shared_gather_forward(x, plan, *args, **kwargs)
        out, bias = self.to_wrap(x, *args, **kwargs)
        return out + self.adapter(x, plan=plan), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron ``dist_checkpointing``: the base layer's shards, then the adapter's."""
        return checkpoint.lora_linear_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _can_share(self, plan) -> bool:
        base = self.to_wrap
        if experts.is_grouped_linear(base):
            return False
        return (type(base).__name__ == "ColumnParallelLinear" and self.adapter.shares_input_gather(plan)
                and base.weight is not None and not base.weight.requires_grad
                and getattr(base, "sequence_parallel", False) and not getattr(base, "gather_output", False)
                and not getattr(base, "explicit_expert_comm", False)
                and not getattr(base.config, "defer_embedding_wgrad_compute", False))

    def _shared_gather_forward(self, x, plan, *args, **kwargs):
        """Gather ``x`` once; the frozen base runs on it with its own SP communication off
        (megatron's frozen-weight path then keeps no input: it saves only the weight) and the
        adapter reads the same tensor. Backward: both partial input gradients meet at the
        gather, whose backward reduce-scatters their sum once.

        ========================= ============================ ===========================
        per eligible adapter      unshared                     shared
        ========================= ============================ ===========================
        forward all-gather of x   2 (base + adapter)           1
        backward reduce-scatter   2                            1
        saved for backward        unchanged (x_full on gather, x_local on regather)
        ========================= ============================ ===========================
        """
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        base = self.to_wrap
        x_full = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=base.tp_group)
        saved = base.sequence_parallel, base.allreduce_dgrad, base.disable_grad_reduce
        base.sequence_parallel, base.allreduce_dgrad, base.disable_grad_reduce = False, False, True
        try:  # input used as is, no dgrad reduction: the shared gather's backward does it
            out, bias = base(x_full, *args, **kwargs)
        finally:
            base.sequence_parallel, base.allreduce_dgrad, base.disable_grad_reduce = saved
        return out + self.adapter(x, plan=plan, x_full=x_full), bias


class GroupedLoRALinear(LoRALinear):
    """A frozen TE grouped expert linear plus its adapter: ``base(x, m_splits) + adapter(x)``.

    The adapter is shared by the local experts (a :class:`~regather.adapter.ParallelLinearAdapter`
    on every row) or holds one pair per expert (:class:`~regather.experts.GroupedExpertAdapter`,
    which reads ``m_splits``). Checkpoint keys are Bridge's (``…experts.linear_fc1.adapter.…``).
    """

    def forward(self, x: torch.Tensor, m_splits, *args, **kwargs):
        if not self._adapter_enabled:
            return self.to_wrap(x, m_splits, *args, **kwargs)
        x, plan = self.adapter.plan(x)
        out, bias = self.to_wrap(x, m_splits, *args, **kwargs)
        return out + self.adapter(x, plan=plan, m_splits=m_splits), bias


@dataclass
class LoRA:
    """LoRA for megatron-core models (field names and defaults of Megatron Bridge)."""

    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    exclude_modules: list[str] = field(default_factory=list)
    dim: int = 32
    alpha: int = 32
    dropout: float = 0.0
    dropout_position: str = "pre"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    a2a_experts: bool = False
    activation: str = "identity"
    sequence_parallel_input_regather: bool = False
    # "gather" | "regather" | "lowrank"; None follows sequence_parallel_input_regather.
    sequence_parallel_input_strategy: Optional[str] = None
    # regather only: start the backward gather when the adapter's output gradient arrives and
    # compute dA after the base layer's dgrad (bit-identical; False = plain regather).
    early_regather: bool = True
    # lowrank only: where the TP-partial dA of the replicated LoRA-A is summed —
    # "backward" (inside the library) or "finalize_model_grads" (megatron-core's, via the
    # parameter's sequence_parallel tag; needs config.sequence_parallel=True).
    lowrank_grad_allreduce: str = "backward"
    # gather the input of a frozen ColumnParallelLinear once for base and adapter
    # (LoRALinear.share_sequence_gather); opt-in, see there.
    share_sequence_gather: bool = False
    # save what each adapter input's producer already keeps (the norm's input, fc1's output
    # before the activation) and recompute the input in backward: qkv/fc1 with regather or
    # lowrank, fc2 with every strategy (regather.producers); bit-identical, 0 new bytes.
    recompute_adapter_inputs: bool = False
    # MoE (Bridge's fields): grouped expert linears share one adapter over their local experts
    # (False: one per expert); normalize_moe_lora gives expert adapters dim // moe_router_topk.
    share_expert_adapters: bool = True
    normalize_moe_lora: bool = False
    # with recompute_adapter_inputs: a per-expert LoRA-A on expert linear_fc1 (SequentialMLP, or
    # share_expert_adapters=False) rebuilds its input by dispatching the router's input again in
    # backward (one more dispatch of the tokens per MoE layer; regather.expert_inputs). A shared
    # expert LoRA-A needs no opt-in: it runs before the dispatch.
    redispatch_expert_inputs: bool = False

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim <= 0:
            raise ValueError(f"LoRA(dim={self.dim!r}): dim must be a positive integer")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA(dropout={self.dropout!r}): dropout must be in [0, 1)")
        if self.dropout_position not in DROPOUT_POSITIONS:
            raise ValueError(f"LoRA(dropout_position={self.dropout_position!r}): "
                             f"expected one of {DROPOUT_POSITIONS}")
        for name in ("lora_A_init_method", "lora_B_init_method"):
            if getattr(self, name) not in INIT_METHODS:
                raise ValueError(f"LoRA({name}={getattr(self, name)!r}): expected one of {INIT_METHODS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"LoRA(activation={self.activation!r}): expected one of {tuple(ACTIVATIONS)}")
        if isinstance(self.target_modules, str) or isinstance(self.exclude_modules, str):
            raise TypeError("LoRA target_modules / exclude_modules must be lists of names, not a string")
        if self.sequence_parallel_input_strategy is not None:
            chosen = Strategy.parse(self.sequence_parallel_input_strategy)
            if self.sequence_parallel_input_regather and chosen != Strategy.REGATHER:
                raise ValueError(
                    f"LoRA(sequence_parallel_input_regather=True, sequence_parallel_input_strategy="
                    f"{self.sequence_parallel_input_strategy!r}) disagree: set only one of them"
                )
        if self.redispatch_expert_inputs and not self.recompute_adapter_inputs:
            raise ValueError("LoRA(redispatch_expert_inputs=True) rebuilds expert inputs in backward: it needs "
                             "recompute_adapter_inputs=True (got recompute_adapter_inputs=False)")
        if self.lowrank_grad_allreduce not in ("backward", "finalize_model_grads"):
            raise ValueError(f"LoRA(lowrank_grad_allreduce={self.lowrank_grad_allreduce!r}): "
                             "expected 'backward' or 'finalize_model_grads'")

    @property
    def strategy(self) -> Strategy:
        if self.sequence_parallel_input_strategy is not None:
            return Strategy.parse(self.sequence_parallel_input_strategy)
        return Strategy.REGATHER if self.sequence_parallel_input_regather else Strategy.GATHER

    # -- matching ----------------------------------------------------------------
    @staticmethod
    def _matches(pattern: str, name: str, path: str) -> bool:
        if any(c in pattern for c in "*?["):
            return fnmatch.fnmatchcase(path, pattern)
        return pattern == name or pattern == path

    def _selected(self, model: nn.Module, targets=None, shown=None) -> list[tuple[str, nn.Module]]:
        """The linears ``targets`` (default ``target_modules``) select, validated before any change;
        ``shown`` maps a target to the name(s) to report when it matches nothing."""
        target_list = list(self.target_modules if targets is None else targets)
        hits: dict[str, list[str]] = {p: [] for p in target_list}
        chosen = []
        for path, module in model.named_modules():
            if isinstance(module, (LoRALinear, ParallelLinearAdapter)) or not path:
                continue
            if ".to_wrap" in path or ".adapter" in path:
                continue
            name = path.rsplit(".", 1)[-1]
            targets = [p for p in target_list if self._matches(p, name, path)]
            if not targets:
                continue
            for p in targets:
                hits[p].append(path)
            if any(self._matches(p, name, path) for p in self.exclude_modules):
                continue
            if not _is_parallel_linear(module):
                raise TypeError(f"LoRA target {path!r} is a {type(module).__name__}, "
                                "not a megatron column- or row-parallel linear")
            chosen.append((path, module))
        missing = [m for p, paths in hits.items() if not paths for m in (shown or {}).get(p, [p])]
        if missing:
            raise ValueError(f"{type(self).__name__} target_modules {missing} match no module of "
                             f"{type(model).__name__}")
        return chosen

    # -- applying ----------------------------------------------------------------
    def __call__(self, model: nn.Module, training: bool = True) -> nn.Module:
        """Freeze ``model``, wrap every selected linear, return the model (modified in place)."""
        selected = self._selected(model)  # raises before any change
        adapters = [(path, self._make_adapter(path, module)) for path, module in selected]
        for p in model.parameters():
            p.requires_grad_(False)
        for (path, module), (_, adapter) in zip(selected, adapters):
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, attr, self.wrap(module, adapter))
        if self.recompute_adapter_inputs:  # after every wrap: producers hook the final modules
            attach_producers(model)
        finish_wrapping(model)
        model.train(training)
        return model

    def wrap(self, module: nn.Module, adapter: ParallelLinearAdapter) -> LoRALinear:
        """The wrapper of ``module`` and its ``adapter`` (grouped expert linears take ``m_splits``)."""
        wrapped = (GroupedLoRALinear if experts.is_grouped_linear(module) else LoRALinear)(module, adapter)
        wrapped.share_sequence_gather = self.share_sequence_gather
        return wrapped

    def _make_adapter(self, path: str, base: nn.Module, out_features: Optional[int] = None,
                      qualified_name: Optional[str] = None) -> ParallelLinearAdapter:
        """The adapter for the linear ``base`` at ``path`` (``out_features``: a part of its output,
        for ``CanonicalLoRA``'s q/k/v and gate/up adapters)."""
        column = _is_column_parallel(base)
        config = getattr(base, "config", None)
        group = _tp_group(base)
        t = _group_size(group)
        grouped = experts.is_grouped_linear(base)
        is_expert = experts.is_expert_linear(path, base)
        if grouped:
            in_features, full_out = experts.grouped_sizes(base, column, t)
            weight = base.weight0
        else:
            in_features, full_out = te.linear_sizes(base, column, t)
            weight = base.weight
        out_features = full_out if out_features is None else out_features
        dim = experts.expert_dim(config, self.dim, self.normalize_moe_lora, column, t) if is_expert else self.dim
        kwargs = dict(
            column_parallel=column,
            base_name=path.rsplit(".", 1)[-1],
            config=config,
            tp_group=group,
            sequence_parallel=bool(getattr(base, "sequence_parallel", False)),
            explicit_comm=experts.explicit_comm(base),
            alpha=self.alpha,
            dropout=self.dropout,
            dropout_position=self.dropout_position,
            lora_A_init_method=self.lora_A_init_method,
            lora_B_init_method=self.lora_B_init_method,
            activation=self.activation,
            a2a_experts=self.a2a_experts,
            strategy=self.strategy,
            early_regather=self.early_regather,
            lowrank_grad_allreduce=self.lowrank_grad_allreduce,
            recompute_inputs=self.recompute_adapter_inputs,
            params_dtype=weight.dtype,
            device=weight.device,
        )
        if grouped and not self.share_expert_adapters:
            adapter = experts.GroupedExpertAdapter(in_features, out_features, dim,
                                                   num_local_experts=base.num_gemms, **kwargs)
        else:
            ep_group = experts.grouped_ep_group(base) if grouped else None
            adapter = ParallelLinearAdapter(in_features, out_features, dim, is_expert=is_expert,
                                            ep_group=ep_group, **kwargs)
            if grouped:  # one adapter, declared in each local expert's checkpoint slot (Bridge's keys)
                adapter.expert_slots = experts.expert_slots(base)
        adapter.qualified_name = qualified_name or path
        adapter.redispatch_inputs = self.redispatch_expert_inputs
        return adapter


def attach_producers(model: nn.Module) -> None:
    """Find each recomputing adapter's producer in ``model`` (or the reason there is none)."""
    from regather.expert_inputs import expert_producer
    from regather.producers import find_producer

    for path, wrapper in model.named_modules():
        if not isinstance(wrapper, LoRALinear):
            continue
        for adapter in wrapper.named_adapters(path).values():  # one producer hook per adapter
            if adapter.recompute_inputs:
                if adapter.facts.is_expert and adapter.column_parallel:  # an expert fc1: the router's input
                    found = expert_producer(model, path, adapter)
                else:
                    found = find_producer(model, path, wrapper)
                if isinstance(found, str):
                    adapter.producer, adapter.producer_reason = None, found
                else:
                    adapter.producer, adapter.producer_reason = found, None


def finish_wrapping(model: nn.Module) -> None:
    """After every wrap: the sequence-length check, and one fallback log for the model's adapters
    (each distinct reason logged once with a count, :mod:`regather.fallback_log`)."""
    _install_sequence_check(model)
    fallback_log.attach(model, adapters(model).values())


def adapters(model: nn.Module) -> dict[str, ParallelLinearAdapter]:
    """Every LoRA adapter of ``model``, by the path of the linear it wraps (``CanonicalLoRA``'s
    q/k/v and gate/up adapters by their Bridge target names: ``…self_attention.linear_q``)."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, LoRALinear):
            out.update(m.named_adapters(path))
    return out


def decisions(model: nn.Module) -> dict[str, Decision]:
    """What each adapter would do if called now (strategy used and the reason)."""
    return {path: a.decide() for path, a in adapters(model).items()}


def set_strategy(model: nn.Module, strategy: Strategy | str) -> None:
    """Switch every adapter of ``model`` to ``strategy`` (numerics unchanged for regather)."""
    strategy = Strategy.parse(strategy)
    for a in adapters(model).values():
        a.strategy = strategy
        a._logged = False


def _is_column_parallel(module: nn.Module) -> bool:
    if te.is_te_linear(module) and getattr(module, "parallel_mode", None) in ("column", "row"):
        return module.parallel_mode == "column"  # TE's own record (TEColumn..., TELayerNormColumn...)
    return "ColumnParallel" in type(module).__name__ or "LayerNormColumn" in type(module).__name__


def _group_size(group) -> int:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def _is_parallel_linear(module: nn.Module) -> bool:
    name = type(module).__name__
    return ("ColumnParallel" in name or "RowParallel" in name) and (
        hasattr(module, "weight") or experts.is_grouped_linear(module))


def _tp_group(base: nn.Module):
    group = experts.tp_group_of(base)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _install_sequence_check(model: nn.Module) -> None:
    """Name the sizes when a sequence cannot be split over the TP ranks (SP on)."""
    config = getattr(model, "config", None)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if not getattr(config, "sequence_parallel", False) or tp <= 1 or getattr(model, "_regather_seq_check", None):
        return

    def check(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("input_ids")
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[1] % tp:
            raise ValueError(
                f"sequence length {tokens.shape[1]} is not divisible by the tensor-parallel size {tp} "
                "(sequence parallelism splits the sequence across the TP ranks)"
            )

    model._regather_seq_check = model.register_forward_pre_hook(check, with_kwargs=True)


def install_shape_checks(model: torch.nn.Module) -> list:
    """Check every LoRA-wrapped linear's input across its TP group before the base layer runs.

    Returns the hook handles (``handle.remove()`` turns a check off).
    """
    handles = []
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):  # CanonicalLoRA's wrappers hold several adapters, one group
            group = next(iter(module.named_adapters(path).values())).tp_group

            def hook(mod, args, _group=group, _path=path):
                if args and isinstance(args[0], torch.Tensor):
                    debug.check_same_shape(args[0], _group, f"LoRA linear {_path!r}")

            handles.append(module.register_forward_pre_hook(hook))
    return handles

"""``regather.LoRA``: the PEFT entry point, with Megatron Bridge's field names.

Usage::

    peft = LoRA(dim=16, alpha=32, sequence_parallel_input_regather=True)
    model = peft(model, training=True)      # a megatron-core GPTModel

Every linear whose attribute name is in ``target_modules`` (or whose dotted
path matches a wildcard entry such as ``*.layers.0.*.linear_qkv``) and matches
nothing in ``exclude_modules`` is replaced by a :class:`LoRALinear` holding the
frozen base (``to_wrap``) and a :class:`~regather.megatron.dense.adapter.ParallelLinearAdapter`
(``adapter``; an expert linear gets a :mod:`regather.megatron.moe` adapter). All base parameters
are frozen; only adapter weights train. The configuration and the matches are validated before
the model is touched.

This module composes the dense front end (:mod:`regather.megatron.dense`) and its MoE part
(:mod:`regather.megatron.moe`); neither imports it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from regather.core.strategies import Strategy
from regather.megatron.dense import te
from regather.megatron.dense.adapter import ACTIVATIONS, DROPOUT_POSITIONS, INIT_METHODS, ParallelLinearAdapter
from regather.megatron.dense.linears import explicit_comm, group_size, is_column_parallel, is_parallel_linear, tp_group
from regather.megatron.dense.model import finish_wrapping
from regather.megatron.dense.producers import find_producer
from regather.megatron.dense.wrapper import LoRALinear
from regather.megatron.moe import experts
from regather.megatron.moe.adapters import ExpertAdapter, GroupedExpertAdapter
from regather.megatron.moe.producers import expert_producer_for
from regather.megatron.moe.wrapper import GroupedLoRALinear
from regather.megatron.reasons import ALL_TARGETS

DEFAULT_TARGETS = ALL_TARGETS


def adaptable_linear(module: nn.Module) -> bool:
    """A linear ``LoRA`` can adapt: a megatron column- or row-parallel linear, or a TE grouped
    expert linear."""
    return is_parallel_linear(module) or experts.is_grouped_linear(module)


@dataclass
class LoRA:
    """LoRA for megatron-core models: ``LoRA(...)(model)`` adapts a ``GPTModel`` in place.

    Megatron Bridge's fields, with its names and defaults (``megatron.bridge.peft.lora.LoRA``):

    - ``target_modules``: the linears to adapt, by attribute name (``linear_qkv``, ``linear_proj``,
      ``linear_fc1``, ``linear_fc2``: all four by default) or by a wildcard over the dotted path
      (``"*.layers.0.*.linear_qkv"``). A name that matches nothing is an error, before any change.
    - ``exclude_modules``: names or wildcards left out of what ``target_modules`` selects.
    - ``dim`` (32): the LoRA rank. ``alpha`` (32): the update is scaled by ``alpha / dim``.
    - ``dropout`` (0.0, in [0, 1)) and ``dropout_position`` (``"pre"``: on LoRA-A's input; ``"post"``: on
      LoRA-B's output).
    - ``lora_A_init_method`` (``"xavier"``) and ``lora_B_init_method`` (``"zero"``): ``xavier``, ``normal``,
      ``kaiming`` or ``zero``.
    - ``sequence_parallel_input_regather`` (False): under sequence parallelism, a column-parallel adapter
      (``linear_qkv``, a dense ``linear_fc1``) keeps only its sequence shard for LoRA-A's gradient and
      gathers it again in backward, instead of keeping the gathered input (the "regather" strategy).
    - ``share_expert_adapters`` (True): grouped MoE expert linears share one adapter over the local
      experts (False: one per expert; SequentialMLP experts always have one each).
    - ``normalize_moe_lora`` (False): expert adapters get ``dim // moe_router_topk``.

    regather's additions (Bridge has none of them; ``regather.bridge.LoRA`` carries them behind Bridge's
    protocol):

    - ``sequence_parallel_input_strategy`` (None): ``"gather"``, ``"regather"`` or ``"lowrank"`` (LoRA-A
      replicated over TP, its input kept as the shard, its rank-r output gathered); None follows
      ``sequence_parallel_input_regather``, and the two must not disagree.
    - ``early_regather`` (True): regather starts the backward gather when the adapter's output gradient
      arrives and computes dA after the base layer's dgrad (bit-identical; False: plain regather).
    - ``lowrank_grad_allreduce`` (``"backward"``): where lowrank sums its TP-partial dA — inside the library,
      or ``"finalize_model_grads"`` (megatron-core's, through the parameter's ``sequence_parallel`` tag).
    - ``share_sequence_gather`` (False): gather a frozen ColumnParallelLinear's input once for the base and
      the adapter (``LoRALinear.share_sequence_gather``).
    - ``recompute_adapter_inputs`` (False): save nothing new for LoRA-A and rebuild its input in backward
      from what its producer keeps (the norm's input for qkv / fc1 under regather or lowrank, the
      activation's input for fc2 with every strategy); bit-identical. Each adapter's decision says which
      inputs are rebuilt, from what, and why one is kept (``regather.decisions(model)``).
    - ``redispatch_expert_inputs`` (False, needs ``recompute_adapter_inputs``): a per-expert LoRA-A on an
      expert ``linear_fc1`` rebuilds its input by dispatching the router's input again in backward.
    - ``lean_transients`` (None: on for every strategy but ``"gather"``): no full-width LoRA buffer at any
      moment — LoRA's output added into the base's in place, in row chunks, its scale on the rank-r side;
      a row-parallel adapter's LoRA-B on its own sequence shard; LoRA-A's input gradient added into the
      base's in place (docs/design.md §3.7). True makes the gather path lean too; False keeps the classic
      output path (Megatron Bridge's, bit for bit). Bit-identical to the classic path where ``alpha / dim``
      is a power of two, except a row-parallel adapter's LoRA-B weight gradient under SP (another
      summation order).
    - ``activation`` (``"identity"``): between LoRA-A and LoRA-B (``relu``, ``gelu``, ``silu``, ``swish``; as
      Bridge's adapter's); anything but identity keeps the gather path.
    - ``a2a_experts`` (False): Bridge's adapter's ``a2a_experimental``; such an adapter keeps the gather path.

    Bridge fields regather's ``LoRA`` does not take: ``a2a_experimental`` (here ``a2a_experts``), ``lora_dtype``
    and ``experts_shared_outer_loras``; ``regather.bridge.LoRA`` takes all three (``a2a_experimental`` as
    ``a2a_experts``, the other two for the modules Bridge adapts itself). The configuration and the matches are
    validated before the model is touched.
    """

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
    sequence_parallel_input_strategy: str | None = None
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
    # lowrank, fc2 with every strategy (regather.megatron.dense.producers); bit-identical, 0 new bytes.
    recompute_adapter_inputs: bool = False
    # MoE (Bridge's fields): grouped expert linears share one adapter over their local experts
    # (False: one per expert); normalize_moe_lora gives expert adapters dim // moe_router_topk.
    share_expert_adapters: bool = True
    normalize_moe_lora: bool = False
    # with recompute_adapter_inputs: a per-expert LoRA-A on expert linear_fc1 (SequentialMLP, or
    # share_expert_adapters=False) rebuilds its input by dispatching the router's input again in
    # backward (one more dispatch of the tokens per MoE layer; regather.megatron.moe.inputs). A shared
    # expert LoRA-A needs no opt-in: it runs before the dispatch.
    redispatch_expert_inputs: bool = False
    # add LoRA's output into the base's in place, in row chunks, its scale on the rank-r side; a
    # row-parallel adapter's LoRA-B on its sequence shard; LoRA-A's input gradient added into the base's
    # in place (regather.core.peak): no full-width LoRA buffer at any moment. None: on for every strategy
    # but the classic gather (which stays Megatron Bridge's bit for bit); True / False: as set.
    lean_transients: bool | None = None

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
        if self.lean_transients not in (None, True, False):
            raise ValueError(f"LoRA(lean_transients={self.lean_transients!r}): expected None, True or False")
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
            if not adaptable_linear(module):
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
        adapters = [(path, self.make_adapter(path, module)) for path, module in selected]
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

    def make_adapter(self, path: str, base: nn.Module, out_features: int | None = None,
                     qualified_name: str | None = None) -> ParallelLinearAdapter:
        """The adapter for the linear ``base`` at ``path`` (``out_features``: a part of its output,
        for ``CanonicalLoRA``'s q/k/v and gate/up adapters)."""
        column = is_column_parallel(base)
        config = getattr(base, "config", None)
        group = tp_group(base)
        t = group_size(group)
        grouped = experts.is_grouped_linear(base)
        is_expert = experts.is_expert_linear(path, base)
        if grouped:
            in_features, full_out = experts.grouped_sizes(base, column, t)
            weight = base.weight0
        else:
            in_features, full_out = te.linear_sizes(base, column, t)
            weight = base.weight
        out_features = full_out if out_features is None else out_features
        # the LoRA rank (Bridge's dim; an expert's under normalize_moe_lora)
        rank = experts.expert_dim(config, self.dim, self.normalize_moe_lora, column, t) if is_expert else self.dim
        kwargs = dict(
            column_parallel=column,
            base_name=path.rsplit(".", 1)[-1],
            config=config,
            tp_group=group,
            sequence_parallel=bool(getattr(base, "sequence_parallel", False)),
            explicit_comm=explicit_comm(base),
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
            lean_transients=self.lean_transients,
            params_dtype=weight.dtype,
            device=weight.device,
        )
        if grouped and not self.share_expert_adapters:
            adapter = GroupedExpertAdapter(in_features, out_features, rank, num_local_experts=base.num_gemms, **kwargs)
        elif is_expert:  # a grouped linear's one adapter is declared in each local expert's slot (Bridge's keys)
            adapter = ExpertAdapter(in_features, out_features, rank,
                                    ep_group=experts.grouped_ep_group(base) if grouped else None,
                                    expert_slots=experts.expert_slots(base) if grouped else None, **kwargs)
        else:
            adapter = self.dense_adapter(in_features, out_features, rank, **kwargs)
        adapter.qualified_name = qualified_name or path
        adapter.redispatch_inputs = self.redispatch_expert_inputs
        return adapter

    def dense_adapter(self, in_features: int, out_features: int, rank: int, **kwargs) -> ParallelLinearAdapter:
        """The adapter of a dense (non-expert) linear (``DoRA`` makes its own)."""
        return ParallelLinearAdapter(in_features, out_features, rank, **kwargs)


def attach_producers(model: nn.Module) -> None:
    """Find each recomputing adapter's producer in ``model`` (or the reason there is none): an
    expert adapter's from the MoE layer (:mod:`regather.megatron.moe.producers`), the others'
    from the dense rules (:mod:`regather.megatron.dense.producers`)."""
    for path, wrapper in model.named_modules():
        if not isinstance(wrapper, LoRALinear):
            continue
        for adapter in wrapper.named_adapters(path).values():  # one producer hook per adapter
            if adapter.recompute_inputs:
                found = expert_producer_for(model, path, adapter)
                if found is None:
                    found = find_producer(model, path, wrapper)
                if isinstance(found, str):
                    adapter.producer, adapter.producer_reason = None, found
                else:
                    adapter.producer, adapter.producer_reason = found, None

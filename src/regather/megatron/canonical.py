"""``regather.CanonicalLoRA``: one adapter per q, k, v and per gate, up (Hugging Face's layout).

``LoRA`` puts one adapter on megatron's fused ``linear_qkv`` and ``linear_fc1`` (one LoRA-A
for q, k and v). ``CanonicalLoRA`` has Megatron Bridge's field names and targets —
``linear_q``, ``linear_k``, ``linear_v``, ``linear_proj``, ``linear_fc1_up``,
``linear_fc1_gate``, ``linear_fc2`` — and gives each projection its own LoRA-A and LoRA-B, as
a PEFT adapter trained on a Hugging Face model has them. The adapters' outputs are placed in
megatron's fused layout on every TP rank:

=============== =============================== ==============================================
wrapped linear  adapters (state-dict names)     output placement per TP rank
=============== =============================== ==============================================
``linear_qkv``  ``adapter.adapter_q``,          interleaved by query group: for each of the
                ``adapter_k``, ``adapter_v``    rank's ``ng/t`` groups, its ``np/ng`` query heads,
                                                one key head, one value head (``head_dim`` each)
``linear_fc1``  ``adapter.adapter_gate``,       ``[gate_i; up_i]`` (``ffn/t`` each), as megatron's
                ``adapter.adapter_up``          gated fc1 weight
=============== =============================== ==============================================

A projection left out of ``target_modules`` contributes zeros. Under regather all adapters
on one input share **one** saved shard and **one** forward and one backward gather
(:class:`~regather.core.strategies.shared_gather.SharedGather`; their GEMMs are their own, so the
results are those of separate adapters bit for bit); under lowrank they share the saved shard
(no gather of ``x`` exists); with ``recompute_adapter_inputs`` they save nothing new. The
gather path gathers and keeps ``x_full`` per adapter, exactly as Bridge's ``CanonicalLoRA``
does. Eligibility, decisions and fallbacks are per adapter, as for ``LoRA``; decisions list
them as ``…self_attention.linear_q`` etc.

Checkpoints: Bridge's keys (``…linear_qkv.adapter.adapter_q.linear_in.weight``); every
adapter's weights are TP-split on axis 0/1 as in :mod:`regather.megatron.dense.checkpoint`. The gate and up
adapters' LoRA-B are plain ``[ffn, r]`` tensors split over TP (each holds one half only, so
megatron's gate/up SwiGLU factory — which regather's fused fc1 adapter uses — does not apply).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from regather.core.buffers import default_pool
from regather.core.strategies import Strategy
from regather.core.strategies.shared_gather import SharedGather
from regather.megatron.dense import te
from regather.megatron.dense.adapter import ParallelLinearAdapter
from regather.megatron.dense.adapter.forward import LEAN_OUTPUT_NOT_DENSE
from regather.megatron.dense.linears import group_size, tp_group
from regather.megatron.dense.model import finish_wrapping
from regather.megatron.dense.wrapper import LoRALinear
from regather.megatron.lora import LoRA, attach_producers
from regather.megatron.moe import experts
from regather.megatron.reasons import CANONICAL_TARGETS

# target name -> (the fused megatron linear it lives in, the adapter's key in the wrapper)
COMPONENTS = {
    "linear_q": ("linear_qkv", "adapter_q"),
    "linear_k": ("linear_qkv", "adapter_k"),
    "linear_v": ("linear_qkv", "adapter_v"),
    "linear_fc1_gate": ("linear_fc1", "adapter_gate"),
    "linear_fc1_up": ("linear_fc1", "adapter_up"),
}
ORDER = {"linear_qkv": ("adapter_q", "adapter_k", "adapter_v"), "linear_fc1": ("adapter_gate", "adapter_up")}
_TARGET_OF = {key: target for target, (_, key) in COMPONENTS.items()}


class AdapterDict(nn.ModuleDict):
    """The adapters of one split wrapper, with ``sharded_state_dict`` (megatron dist_checkpointing)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        out = {}
        for key, adapter in self.items():
            out.update(adapter.sharded_state_dict(f"{prefix}{key}.", sharded_offsets, metadata))
        return out


class LoRALinearSplit(LoRALinear):
    """A frozen ``linear_qkv`` / ``linear_fc1`` with one adapter per projection (see module doc)."""

    def __init__(self, to_wrap: nn.Module, adapters: dict[str, ParallelLinearAdapter], fused: str):
        super().__init__(to_wrap, AdapterDict(adapters))
        self.fused = fused  # "linear_qkv" | "linear_fc1"
        self.te_layernorm = te.fuses_layernorm(to_wrap)
        config = getattr(to_wrap, "config", None)
        self._qkv = _qkv_layout(config, self._tp_size()) if fused == "linear_qkv" else None

    def _tp_size(self) -> int:
        return next(iter(self.adapter.values())).tp_size

    def named_adapters(self, path: str) -> dict[str, ParallelLinearAdapter]:
        parent = path.rpartition(".")[0]
        return {(f"{parent}." if parent else "") + _TARGET_OF[k]: a for k, a in self.adapter.items()}

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if not self.adapter_enabled:
            return self.to_wrap(x, *args, **kwargs)
        members = list(self.adapter.values())
        share = self._shared_gather(members)
        plans, parts = [], None
        for adapter in members:  # each anchors x in turn: every deferred dA waits for the base dgrad
            x, plan = adapter.plan(x, share, reads_base_input=not self.te_layernorm, parts=parts)
            parts = parts if parts is not None else plan.junction  # one sum of the members' input gradients
            plans.append(plan)
        if self.te_layernorm:
            return te.lora_forward_many(self.to_wrap, list(zip(members, plans)), x,
                                        lambda out, ln_out: self._add(out, ln_out, plans), *args, **kwargs)
        out, bias = self.to_wrap(x, *args, **kwargs)
        return self._add(out, x, plans), bias

    def _add(self, out: torch.Tensor, x: torch.Tensor, plans: list) -> torch.Tensor:
        """The base's output with every adapter's added: each into its own columns of it, in place, when
        every plan is lean (:meth:`blocks`), else placed side by side and added (the classic sum)."""
        members = list(self.adapter.items())
        if all(p.lean for p in plans):
            if out.is_contiguous():
                for (key, adapter), plan in zip(members, plans):
                    out = adapter(x, plan=plan, base_out=out, out_blocks=self.blocks(key))
                return out
            members[0][1].log_lean_fallback(LEAN_OUTPUT_NOT_DENSE)
        return out + self._combine_list([a(x, plan=p) for (_, a), p in zip(members, plans)])

    def blocks(self, key: str) -> tuple:
        """Where adapter ``key``'s output columns lie in the fused output: ``((output columns, its
        LoRA-B rows), ...)`` — one block for gate / up, one per query group for q, k and v."""
        widths = self._widths()
        if self.fused == "linear_fc1":
            start = 0 if key == "adapter_gate" else widths["adapter_gate"]
            return ((slice(start, start + widths[key]), slice(0, widths[key])),)
        groups, per_group, head_dim = self._qkv
        stride = (per_group + 2) * head_dim
        offset, width = {"adapter_q": (0, per_group * head_dim), "adapter_k": (per_group * head_dim, head_dim),
                         "adapter_v": ((per_group + 1) * head_dim, head_dim)}[key]
        return tuple((slice(g * stride + offset, g * stride + offset + width), slice(g * width, (g + 1) * width))
                     for g in range(groups))

    def _shared_gather(self, members) -> SharedGather | None:
        n = sum(a.decide().used == Strategy.REGATHER for a in members)
        if n < 2:
            return None
        first = members[0]
        return SharedGather(n, first.tp_group, first.pool or default_pool())

    def _combine_list(self, outs: list) -> torch.Tensor:
        return self.place(dict(zip(self.adapter.keys(), outs)))

    def place(self, parts: dict) -> torch.Tensor:
        """Each adapter's output ``[..., o_k/t]`` into the fused layout ``[..., o/t]`` (zeros for the
        projections without an adapter). Also used on weight deltas (rows last)."""
        ref = next(iter(parts.values()))
        lead, dtype, device = ref.shape[:-1], ref.dtype, ref.device
        widths = self._widths()
        full = [parts[k] if k in parts else torch.zeros(*lead, widths[k], dtype=dtype, device=device)
                for k in ORDER[self.fused]]
        if self.fused == "linear_fc1":
            return torch.cat(full, dim=-1)
        groups, per_group, head_dim = self._qkv
        q, k, v = (t.reshape(*lead, groups, -1, head_dim) for t in full)
        if q.shape[-2] != per_group:
            raise ValueError(f"linear_q adapter output has {q.shape[-2]} heads per query group, expected {per_group}")
        return torch.cat((q, k, v), dim=-2).reshape(*lead, -1)

    def _widths(self) -> dict:
        """Local output width of each projection (also for the ones without an adapter)."""
        base_out = self.to_wrap.weight.shape[0]  # this rank's rows
        if self.fused == "linear_fc1":
            return {"adapter_gate": base_out // 2, "adapter_up": base_out // 2}
        groups, per_group, head_dim = self._qkv
        return {"adapter_q": groups * per_group * head_dim, "adapter_k": groups * head_dim,
                "adapter_v": groups * head_dim}

    def delta_weight(self, delta_of) -> torch.Tensor:
        """The merged ``scale * B @ A`` in the fused layout (``delta_of(adapter)`` per adapter)."""
        parts = {k: delta_of(a).t() for k, a in self.adapter.items()}  # [h, o_k/t]: rows last
        return self.place(parts).t()


def _qkv_layout(config, t: int) -> tuple[int, int, int]:
    """(query groups on this rank, query heads per group, head dim) of megatron's fused qkv."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ValueError("CanonicalLoRA on linear_qkv needs the base layer's config.num_attention_heads")
    groups = getattr(config, "num_query_groups", None) or heads
    head_dim = getattr(config, "kv_channels", None) or config.hidden_size // heads
    if heads % groups or groups % t:
        raise ValueError(f"CanonicalLoRA: num_attention_heads={heads}, num_query_groups={groups} and TP={t} "
                         "do not split into whole query groups per rank")
    return groups // t, heads // groups, head_dim


@dataclass
class CanonicalLoRA(LoRA):
    """LoRA with separate q/k/v and gate/up adapters (Megatron Bridge's ``CanonicalLoRA`` fields)."""

    target_modules: list[str] = field(default_factory=lambda: list(CANONICAL_TARGETS))

    def __post_init__(self):
        super().__post_init__()
        fused = [t for t in self.target_modules if t.endswith(("linear_qkv", "linear_fc1"))]
        if fused:
            raise ValueError(f"CanonicalLoRA target_modules {fused}: name the projections instead "
                             "(linear_q, linear_k, linear_v; linear_fc1_up, linear_fc1_gate), or use LoRA "
                             "for one adapter on the fused linear")

    def _translated(self) -> tuple[dict, dict]:
        """fused-linear pattern -> adapter keys, and each pattern -> the targets it came from."""
        keys: dict[str, set] = {}
        shown: dict[str, list] = {}
        for target in self.target_modules:
            name = target.rsplit(".", 1)[-1]
            base, key = None, None
            for comp, (fused, comp_key) in COMPONENTS.items():
                if name == comp or target.endswith(comp):
                    base, key = target[: len(target) - len(comp)] + fused, comp_key
                    break
            pattern = base or target
            keys.setdefault(pattern, set())
            if key:
                keys[pattern].add(key)
            shown.setdefault(pattern, []).append(target)
        return keys, shown

    def __call__(self, model: nn.Module, training: bool = True) -> nn.Module:
        keys, shown = self._translated()
        selected = self._selected(model, targets=list(keys), shown=shown)  # raises before any change
        wanted = {path: set().union(*(k for p, k in keys.items() if self._matches(p, name, path)))
                  for path, module in selected if (name := path.rsplit(".", 1)[-1]) in ORDER}
        for path, module in selected:  # before any adapter is built (they draw their init from the RNG)
            if path.endswith("linear_fc1") and wanted.get(path) and not experts.is_grouped_linear(module):
                _require_gated(path, module, wanted[path])
        built = []
        for path, module in selected:
            name = path.rsplit(".", 1)[-1]
            # a grouped expert fc1 holds every local expert's gate and up: one adapter on the whole
            # linear, as Bridge's CanonicalLoRA does ("unsupported canonical linear_fc1 as unfused")
            if name not in ORDER or experts.is_grouped_linear(module):
                built.append((path, module, self.make_adapter(path, module)))
                continue
            built.append((path, module, self._split_adapters(path, module, name, wanted[path])))
        for p in model.parameters():
            p.requires_grad_(False)
        for path, module, adapter in built:
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            wrapped = LoRALinearSplit(module, adapter, attr) if isinstance(adapter, dict) else self.wrap(module, adapter)
            setattr(parent, attr, wrapped)
        if self.recompute_adapter_inputs:
            attach_producers(model)
        finish_wrapping(model)
        model.train(training)
        return model

    def _split_adapters(self, path: str, base: nn.Module, fused: str, wanted: set) -> dict:
        t = _tp_size_of(base)
        rows = base.weight.shape[0] * t  # the fused output size, all ranks
        if fused == "linear_fc1":
            sizes = {"adapter_gate": rows // 2, "adapter_up": rows // 2}
        else:
            groups, per_group, head_dim = _qkv_layout(getattr(base, "config", None), t)
            kv = groups * t * head_dim
            sizes = {"adapter_q": kv * per_group, "adapter_k": kv, "adapter_v": kv}
        parent = path.rpartition(".")[0]
        out = {}
        for key in ORDER[fused]:
            if key in wanted:
                name = (f"{parent}." if parent else "") + _TARGET_OF[key]
                out[key] = self.make_adapter(path, base, out_features=sizes[key], qualified_name=name)
                out[key].gate_up_fused = False  # one half of fc1 only: no SwiGLU checkpoint factory
        return out


def _require_gated(path: str, base: nn.Module, wanted: set) -> None:
    """linear_fc1_gate / linear_fc1_up exist only on a gated fc1 (``[gate_i; up_i]`` per rank). A
    non-gated fc1's rank i holds rows ``[i*ffn/t, (i+1)*ffn/t)`` of one projection: placing two
    "halves" per rank there would compute a function that changes with the TP size."""
    config = getattr(base, "config", None)
    if getattr(config, "gated_linear_unit", False):
        return
    names = sorted(_TARGET_OF[k] for k in wanted)
    raise ValueError(
        f"CanonicalLoRA targets {names} at {path!r}: this linear_fc1 is not gated "
        f"(config.gated_linear_unit={getattr(config, 'gated_linear_unit', None)!r}), so it has no gate/up halves. "
        "Leave linear_fc1_up / linear_fc1_gate out of target_modules, and put one adapter on the whole "
        "linear_fc1 with regather.LoRA(target_modules=[..., 'linear_fc1'])")


def _tp_size_of(base: nn.Module) -> int:
    return group_size(tp_group(base))

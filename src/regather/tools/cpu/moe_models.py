"""Tiny real megatron-core mixture-of-experts GPTs for tests and benchmarks (CPU, gloo).

:func:`build_moe_gpt` builds a ``GPTModel`` whose MoE layers are megatron's own
``MoELayer`` (router, token dispatcher, experts, optional shared expert) from megatron's
own spec builders:

============== ===================================================== ============================
``experts``    expert module                                         expert linears
============== ===================================================== ============================
``sequential`` ``SequentialMLP`` (``get_gpt_layer_local_spec``)      megatron ``Column/Row``
                                                                     ``ParallelLinear`` per expert
``grouped``    ``TEGroupedMLP`` (the TE spec's expert structure,     :mod:`regather.tools.cpu.\
               ``get_moe_module_spec_for_backend``)                  fake_te_grouped` stand-ins
============== ===================================================== ============================

Layouts differ in how megatron initialises experts (per EP rank, docs/design.md §9), so a
cross-layout comparison loads the *same full weights* into each layout:
:func:`full_weights` makes one tensor per global parameter name from the name alone, and
:class:`GlobalLayout` maps every local parameter to its global name and slice (TP over the
dense or the expert-TP group along ``partition_dim``, gated ``linear_fc1`` halves
interleaved as megatron shards them, local expert ``i`` to global expert
``ep_rank * n_local + i``). The same map reassembles per-rank gradients into full tensors.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import torch

from regather.megatron.reasons import REPLAYED_DISPATCHERS
from regather.tools.cpu.models import MEGATRON_NAMES, TinyGPT, accepts_megatron_names, keep_fp64_cross_entropy

# megatron's dispatchers the CPU harness builds (the flex one needs DeepEP, a GPU): those whose
# route regather replays
DISPATCHERS = REPLAYED_DISPATCHERS


@accepts_megatron_names({**MEGATRON_NAMES, "moe_ffn_hidden_size": "moe_ffn", "shared_expert_size": "shared_expert_ffn"})
@dataclass(frozen=True)
class TinyMoE(TinyGPT):
    """Shape of a small MoE GPT (every ``moe_layer_freq``-th layer MoE; ``ffn``: the dense layers):
    :class:`TinyGPT` with the tiny test MoE's experts. Megatron's names are accepted too
    (``moe_ffn_hidden_size``, ``shared_expert_size``: megatron's
    ``moe_shared_expert_intermediate_size``, 0 for none)."""

    num_experts: int = 4
    moe_ffn: int = 64
    topk: int = 2
    gated: bool = False  # SwiGLU experts (and dense MLPs)

    def __post_init__(self):
        super().__post_init__()
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"TinyMoE(dispatcher={self.dispatcher!r}): expected one of {DISPATCHERS}")


def init_moe_parallel(tp: int, ep: int, etp: int | None = None, seed: int = 1234, pp: int = 1) -> None:
    """megatron's parallel state with expert parallelism, on the existing default group."""
    from megatron.core import parallel_state, tensor_parallel

    from regather.tools.cpu.moe_cpu import enable_moe_cpu

    enable_moe_cpu()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=tp if etp is None else etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def moe_config(shape: TinyMoE, tp: int, ep: int, etp: int | None, dtype=torch.float32, **overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, ffn_hidden_size=shape.ffn,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if etp is None else etp,
        num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn,
        moe_router_topk=shape.topk, moe_token_dispatcher_type=shape.dispatcher,
        moe_grouped_gemm=shape.experts == "grouped", moe_layer_freq=shape.layer_pattern,
        moe_shared_expert_intermediate_size=shape.shared_expert_ffn or None,
        moe_router_load_balancing_type="aux_loss",
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, add_bias_linear=False,
    )
    if shape.head_dim is not None:
        kwargs["kv_channels"] = shape.head_dim
    if shape.gated:
        kwargs.update(gated_linear_unit=True, activation_func=F.silu)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_layer_spec(shape: TinyMoE, config):
    """The decoder block spec from megatron's ``get_gpt_decoder_block_spec`` (local spec; MoE
    layers where ``moe_layer_freq`` says); grouped experts become ``TEGroupedMLP`` on the TE
    grouped-linear stand-ins."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if shape.experts == "grouped":
        from regather.tools.cpu.fake_te_grouped import grouped_moe_spec

        block.layer_specs = [grouped_moe_spec(s, shape.num_experts) for s in block.layer_specs]
    return block


def build_moe_gpt(shape: TinyMoE, tp: int, ep: int, etp: int | None = None, dtype=torch.float32,
                  seed: int = 1234, init_parallel: bool = True, pre_process: bool = True,
                  post_process: bool = True, **overrides):
    """A megatron-core MoE ``GPTModel`` on the current ranks (TP x EP x ETP, SP on with TP > 1)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    if init_parallel:
        init_moe_parallel(tp, ep, etp, seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    if dtype == torch.float64:
        keep_fp64_cross_entropy()
    torch.manual_seed(seed)
    config = moe_config(shape, tp, ep, etp, dtype, **overrides)
    model = GPTModel(config=config, transformer_layer_spec=moe_layer_spec(shape, config),
                     vocab_size=shape.vocab, max_sequence_length=shape.seq,
                     pre_process=pre_process, post_process=post_process, parallel_output=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if dtype != torch.float32:
        model = model.to(dtype)
    return model


# -- the same full weights in every layout ------------------------------------------------------

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_GROUPED_WEIGHT = re.compile(r"\.experts\.linear_fc([12])\.(to_wrap\.)?weight(\d+)$")


@dataclass(frozen=True)
class Placement:
    """Where a local parameter sits in its full tensor ``full[global_name]`` (``global_shape``):
    rows ``rows`` along ``dim`` (TP; a gated fc1's gate and up halves each contribute their
    share), and along ``expert_axis`` the block ``expert_block`` (a grouped per-expert adapter)."""

    global_name: str
    global_shape: tuple
    dim: int | None = None
    rows: torch.Tensor | None = None
    expert_axis: int | None = None
    expert_block: slice | None = None

    def _narrow(self, full: torch.Tensor) -> torch.Tensor:
        if self.expert_axis is None:
            return full
        s = self.expert_block
        return full.narrow(self.expert_axis, s.start, s.stop - s.start)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        out = self._narrow(full)
        return out if self.dim is None else out.index_select(self.dim, self.rows)

    def put(self, full: torch.Tensor, local: torch.Tensor) -> None:
        view = self._narrow(full)
        if self.dim is None:
            view.copy_(local)
        else:
            view.index_copy_(self.dim, self.rows, local.to(view.dtype))


class GlobalLayout:
    """Map each parameter of a (LoRA-wrapped) MoE GPT on this rank to its full tensor."""

    def __init__(self, model: torch.nn.Module, shape: TinyMoE):
        from megatron.core import parallel_state as ps

        self.ep, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.etp, self.etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.n_local = shape.num_experts // self.ep
        self.shape = shape
        self.placements = {name: self._place(name, p) for name, p in model.named_parameters()}

    def _expert_name(self, name: str) -> tuple[str, bool]:
        m = _LOCAL_EXPERT.search(name)
        if m:
            g = self.ep_rank * self.n_local + int(m.group(1))
            return name[:m.start()] + f".local_experts.{g}." + name[m.end():], True
        m = _GROUPED_WEIGHT.search(name)
        if m:
            g = self.ep_rank * self.n_local + int(m.group(3))
            return name[:m.start()] + f".experts.linear_fc{m.group(1)}.{m.group(2) or ''}weight{g}", True
        return name, ".experts." in name

    def _gated(self, name: str) -> bool:
        """A gated fc1 weight or its LoRA-B: megatron shards gate and up halves apart."""
        return self.shape.gated and (re.search(r"linear_fc1\.(to_wrap\.)?weight\d*$", name) is not None
                                     or name.endswith("linear_fc1.adapter.linear_out.weight"))

    def _place(self, name: str, p: torch.Tensor) -> Placement:
        global_name, expert = self._expert_name(name)
        t, rank = (self.etp, self.etp_rank) if expert else (self.tp, self.tp_rank)
        shape = list(p.shape)
        axis = getattr(p, "expert_axis", None)  # a grouped per-expert adapter [E_local, ...]
        block = None
        if axis is not None:
            block = slice(self.ep_rank * shape[axis], (self.ep_rank + 1) * shape[axis])
            shape[axis] *= self.ep
        dim, split = getattr(p, "partition_dim", -1), getattr(p, "tensor_model_parallel", False)
        grouped = _GROUPED_WEIGHT.search(name)
        if grouped and not split:  # TE tags no TP attributes once megatron hid expert TP from it
            dim, split = (0 if grouped.group(1) == "1" else 1), True
        if not (split and t > 1 and dim >= 0):
            return Placement(global_name, tuple(shape), expert_axis=axis, expert_block=block)
        n = shape[dim]
        shape[dim] = n * t
        if self._gated(name):
            half, full_half = n // 2, n * t // 2
            own = torch.arange(rank * half, (rank + 1) * half)
            rows = torch.cat([own, full_half + own])
        else:
            rows = torch.arange(rank * n, (rank + 1) * n)
        return Placement(global_name, tuple(shape), dim, rows, axis, block)

    def global_shapes(self) -> dict:
        return {p.global_name: p.global_shape for p in self.placements.values()}

    def load(self, model: torch.nn.Module, full: dict) -> None:
        """Copy every parameter's slice of ``full`` (global name -> tensor) into ``model``."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                place = self.placements[name]
                p.copy_(place.take(full[place.global_name]).to(p.dtype))

    def scatter(self, tensors: dict) -> dict:
        """``{global name: (placement, local tensor)}`` for :func:`assemble` in the parent."""
        return {self.placements[n].global_name: (self.placements[n], t) for n, t in tensors.items()}


def assemble(per_rank: list) -> dict:
    """Full tensors from every rank's :meth:`GlobalLayout.scatter` output (replicas agree)."""
    out = {}
    for parts in per_rank:
        for name, (place, local) in parts.items():
            full = out.setdefault(name, torch.zeros(place.global_shape, dtype=torch.float64))
            place.put(full, local.double())
    return out


def full_weights(names_shapes: dict, seed: int = 0) -> dict:
    """One deterministic tensor per global parameter name (from the name and ``seed`` alone)."""
    out = {}
    for name, shape in names_shapes.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        if "norm" in name and name.endswith("weight"):
            t = 1 + 0.1 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        elif ".adapter." in name:
            t = 0.1 * t
        else:
            t = 0.05 * t
        out[name] = t.float()
    return out

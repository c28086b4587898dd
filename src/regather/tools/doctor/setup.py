"""What ``regather doctor`` reasons about: a :class:`Setup` (the run's shapes and its features) and a :class:`Finding`."""

from __future__ import annotations

from dataclasses import dataclass

from regather.megatron.reasons import ALL_TARGETS
from regather.tools.shapes import ModelShape, RunShape, experts_share_lora

LEVELS = ("info", "warning", "error")
#: ``--num-experts`` with ``--moe``: the tiny test MoE's (regather.tools.cpu.moe_models.TinyMoE).
MOE_EXPERTS = 4


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
class Setup(ModelShape, RunShape):
    """The run configuration doctor reasons about: the model and run shapes (the tiny test GPT,
    dense unless ``num_experts``; MoE sizes: the tiny test MoE's) and the features megatron / Bridge
    name, with their names."""

    moe_ffn: int = 64
    topk: int = 2
    dtype: str = "bfloat16"
    targets: tuple = ALL_TARGETS
    # LoRA
    strategy: str = "regather"
    # features that change eligibility or the allocator
    use_nccl_ub: bool = False
    cuda_graphs: bool = False
    cpu_offloading: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple = ()
    # context parallel size: each CP rank's linears see seq/cp tokens per sample
    cp: int = 1
    # the GPU's memory in GiB, beside the per-GPU total
    gpu_memory: float = 80
    # LoRA(recompute_adapter_inputs=True), and what decides which producers keep a tensor
    recompute_adapter_inputs: bool = False
    activation: str = "gelu"  # the MLP's: "gelu" or "swiglu" (silu, gated)
    qk_norm: bool = False  # per-head q / k norms (a preset's: Qwen3's qk_layernorm)
    add_bias_linear: bool = True  # megatron's default (the tiny test GPT has biases)
    # the LoRA is Megatron Bridge's own (not regather's), and the Transformer Engine version (te_gradient)
    bridge_lora: bool = False
    te_version: str | None = None
    # the PEFT: "lora" or "dora" (regather.DoRA / Bridge's DoRA with bridge_lora), and DoRA's
    # recompute_dora_output (regather.tools.doctor.dora)
    peft: str = "lora"
    recompute_dora_output: bool = False
    # what the base linears keep (regather.tools.estimate.spec): "local" (megatron's local spec, what
    # --build builds) or "te" (Transformer Engine, what Bridge's recipes run: the command's default)
    spec: str = "local"
    # the attention keeps its output for its backward (TE's fused attention, flash-attention)
    attention_keeps_output: bool = False
    model_name: str = "tiny GPT"  # for the report: a preset's name, or the tiny test GPT


def shares_expert_lora(setup: Setup) -> bool:
    """One LoRA pair for a MoE layer's local experts: grouped experts with ``share_expert_adapters``
    (Bridge's default); SequentialMLP experts have one each."""
    return experts_share_lora(setup, setup)

"""What one training run through megatron's machinery is: the strategy, the topology, megatron's options, the sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

from regather.megatron.reasons import ALL_TARGETS
from regather.tools.cpu.models import TinyGPT
from regather.tools.cpu.moe_models import TinyMoE

# name -> (LoRA strategy, LoRA field overrides); None: megatron's own trainable linears.
STRATEGIES: dict[str, tuple[str, dict] | None] = {
    "gather": ("gather", {}),
    "regather": ("regather", {}),
    "regather-plain": ("regather", {"early_regather": False}),
    "lowrank": ("lowrank", {"lowrank_grad_allreduce": "backward"}),
    "lowrank-finalize": ("lowrank", {"lowrank_grad_allreduce": "finalize_model_grads"}),
    "gather-shared": ("gather", {"share_sequence_gather": True}),
    "regather-shared": ("regather", {"share_sequence_gather": True}),
    # control: no adapters; the base linears of the LoRA targets train (megatron's own
    # wgrad / main_grad / dummy-grad path), everything else frozen
    "megatron": None,
}


@dataclass
class DDPOptions:
    """The ``DistributedDataParallelConfig`` fields a run varies (the rest: megatron's defaults)."""

    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None  # elements; only used with overlap_grad_reduce

    @property
    def align_param_gather(self) -> bool:
        # Megatron-LM: --align-param-gather (default on) with overlap_param_gather
        return self.overlap_param_gather


@dataclass
class TrainSpec:
    """One training run: topology, megatron options, strategy, sizes."""

    strategy: str = "gather"
    tp: int = 2
    pp: int = 1
    vpp: int | None = None
    ddp: DDPOptions = field(default_factory=DDPOptions)
    gradient_accumulation_fusion: bool = False
    shape: TinyGPT | TinyMoE = field(default_factory=TinyGPT)  # a TinyMoE: megatron's MoE layers
    ep: int = 1  # expert model parallel (MoE shapes)
    etp: int | None = None  # expert tensor parallel (None: megatron's default, ``tp``)
    micro_batch: int = 2
    num_microbatches: int = 4
    steps: int = 3
    lr: float = 1e-3
    clip_grad: float = 1.0
    lora_dim: int = 8
    lora_alpha: int = 16
    lora_B_init_method: str = "normal"  # non-zero B: LoRA-A gets a gradient from step 0
    targets: tuple = ALL_TARGETS
    # LoRA(lean_transients=...) of every strategy, gather included, so that runs are compared like for
    # like: a lean row-parallel adapter (linear_proj, linear_fc2) sums LoRA-B's weight gradient per
    # sequence shard, another order than the classic gather path's (docs/design.md §3.7)
    lean_transients: bool | None = True
    batch_p2p_comm: bool | None = None  # None: off with a virtual pipeline (gloo, §8)
    seed: int = 1234
    timeout_minutes: float = 1.0  # megatron's process groups (a stage waiting on a failed peer)

    def __post_init__(self):
        moe = isinstance(self.shape, TinyMoE)
        if not moe and (self.ep != 1 or self.etp is not None):
            raise ValueError(f"TrainSpec(ep={self.ep}, etp={self.etp}): expert parallelism needs a TinyMoE shape, "
                             f"got {type(self.shape).__name__}")
        if moe and self.vpp is not None:
            raise ValueError(f"TrainSpec(vpp={self.vpp}): the MoE builder here has no virtual pipeline stages")

    @property
    def p2p_batched(self) -> bool:
        return self.batch_p2p_comm if self.batch_p2p_comm is not None else self.vpp is None

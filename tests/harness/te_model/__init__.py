"""A model of Transformer Engine that runs on CPU: megatron's TE linears on autograd Functions that
save, free, copy and return what TE's own do, and add the gradients TE's own add — for TE <= 2.3,
2.4 - 2.7 and 2.8 - 2.20 (read at every tag and in PyPI's 2.19.0 / 2.20.2), selectable per test
(:mod:`.behaviour`).

TE cannot be installed on a CPU machine (its wheel builds against CUDA). The model follows TE's
source line by line where LoRA depends on it (the line numbers are in each module's docstring);
its kernels are torch's.

- :mod:`.behaviour`         — the three behaviours, :func:`~.behaviour.te_behaviour`, TE's ``clear_tensor_data``
- :mod:`.layernorm_linear`  — ``_LayerNormLinear`` (the fused norm + column-parallel GEMM)
- :mod:`.linear`            — ``_Linear`` (column / row parallel, no norm)
- :mod:`.distributed_weight` — a distributed weight (GTP, TE 2.19+) on one rank
- :mod:`.modules`           — megatron's ``TELayerNormColumnParallelLinear``, ``TEColumnParallelLinear``,
  ``TERowParallelLinear`` over them
- :mod:`.spec`              — megatron's TE GPT layer spec on them, the tiny GPT, one linear alone
- :mod:`.attention`         — megatron's ``TEDotProductAttention`` over TE's ``DotProductAttention``
  (FusedAttention, context parallelism, THD); :mod:`.context_parallel` its ``p2p`` / ``all_gather``
  Functions; :mod:`.attention_kernels` the per-tile kernels and TE's THD helpers
"""

from tests.harness.te_model.attention import TEDotProductAttention
from tests.harness.te_model.behaviour import (
    BEHAVIOURS,
    TE_2_3,
    TE_2_4,
    TE_2_8,
    Behaviour,
    active,
    behaviour_named,
    clear_tensor_data,
    te_behaviour,
)
from tests.harness.te_model.distributed_weight import DistributedWeight
from tests.harness.te_model.modules import TEColumnParallelLinear, TELayerNormColumnParallelLinear, TERowParallelLinear
from tests.harness.te_model.spec import Holder, build_te_gpt, te_config, te_layer_spec, te_linear

__all__ = [
    "BEHAVIOURS",
    "TE_2_3",
    "TE_2_4",
    "TE_2_8",
    "Behaviour",
    "DistributedWeight",
    "Holder",
    "TEColumnParallelLinear",
    "TEDotProductAttention",
    "TELayerNormColumnParallelLinear",
    "TERowParallelLinear",
    "active",
    "behaviour_named",
    "build_te_gpt",
    "clear_tensor_data",
    "te_behaviour",
    "te_config",
    "te_layer_spec",
    "te_linear",
]

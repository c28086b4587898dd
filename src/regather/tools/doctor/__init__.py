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
te-ln-grad           error /  Megatron Bridge's own LoRA (``--bridge-lora``) asks Transformer Engine
                     warning  for its gathered LayerNorm output under SP, and TE >= 2.4 drops its
                              gradient (warning: TE version unknown; :mod:`.te_gradient`)
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
finding is testable without GPUs. One module per concern:

- :mod:`.setup`       — :class:`Setup` (the shapes of :mod:`regather.tools.shapes` and the features
  megatron / Bridge name) and :class:`Finding`
- :mod:`.environment` — the allocator / NCCL / offloading rows
- :mod:`.rules`       — every adapter's decision from the eligibility and producer rules
- :mod:`.built`       — ``--build``: the tiny GPT built on CPU gloo ranks, its adapters asked
- :mod:`.savings`     — the bytes each adapter's decision keeps against the gather path (estimate's, per
  adapter), and what re-dispatch would free
- :mod:`.te_gradient` — the Transformer Engine rule: a gathered LayerNorm output's lost gradient
- :mod:`.findings`    — the adapter findings and their fixes; :func:`diagnose`
- :mod:`.summary`     — what the run saves per adapter kind and why the rest does not, beside estimate's figure
- :mod:`.cli`         — ``regather doctor``
"""

from regather.tools.doctor.built import build_rank, built_decisions, cpu_cannot_run
from regather.tools.doctor.environment import alloc_conf, env_findings, expandable_segments, nccl_ub_enabled
from regather.tools.doctor.findings import adapter_findings, describe, diagnose
from regather.tools.doctor.rules import (
    activation_name,
    analytic_decisions,
    config_namespace,
    moe_static_reason,
    recompute_part,
    requested_strategy,
)
from regather.tools.doctor.savings import (
    dense_bytes,
    expert_estimate,
    expert_layer_bytes,
    is_expert,
    redispatch_finding,
    saving_finding,
    savings,
)
from regather.tools.doctor.setup import LEVELS, MOE_EXPERTS, Finding, Setup, shares_expert_lora
from regather.tools.doctor.summary import summary

__all__ = [
    "LEVELS",
    "MOE_EXPERTS",
    "Finding",
    "Setup",
    "activation_name",
    "adapter_findings",
    "alloc_conf",
    "analytic_decisions",
    "build_rank",
    "built_decisions",
    "config_namespace",
    "cpu_cannot_run",
    "dense_bytes",
    "describe",
    "diagnose",
    "env_findings",
    "expandable_segments",
    "expert_estimate",
    "expert_layer_bytes",
    "is_expert",
    "moe_static_reason",
    "nccl_ub_enabled",
    "recompute_part",
    "redispatch_finding",
    "requested_strategy",
    "saving_finding",
    "savings",
    "shares_expert_lora",
    "summary",
]

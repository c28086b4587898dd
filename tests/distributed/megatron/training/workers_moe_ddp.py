"""Rank worker for test_moe_ddp.py: a tiny megatron-core MoE GPT (megatron's MoELayer, router,
alltoall dispatcher, SequentialMLP experts) trained through megatron's own DDP, distributed
optimizer, ``get_forward_backward_func`` and ``finalize_model_grads``
(``tests.harness.megatron_train``) at TP2+SP x DP2 with EP2 x ETP1 on 4 gloo ranks: the
dense parameters reduce over DP (2 ranks), the expert ones over expert DP (2 ranks), each
group's grads in its own DDP buffers; and at TP2+SP x PP2 with EP2 in each stage under megatron's
1F1B schedule.

Every run of a case starts from the same seed in the same layout (megatron initialises experts
per EP rank, identically for every strategy here), so each strategy is compared with the case's
gather run as in the dense integration matrix.
"""

from __future__ import annotations

import time
from dataclasses import replace

from integration_cases import RECOMPUTE_TWIN  # noqa: F401 - registers the "-rc" strategies
from tests.harness.megatron_train import STRATEGIES, DDPOptions, TrainSpec, teardown_parallel, train_agreed, warm_up

from regather.tools.cpu.moe_models import TinyMoE

# per-expert LoRA-A inputs dispatched again in backward (issue 16)
STRATEGIES.setdefault("regather-rc-rd", ("regather", {"recompute_adapter_inputs": True,
                                                       "redispatch_expert_inputs": True}))

WORLD, TP, EP, ETP = 4, 2, 2, 1
BUCKET = 600  # elements: the LoRA parameters span several buckets of both the dense and the expert buffers
CASES = {
    # what Megatron-LM users run: overlapped grad reduce into the distributed optimizer
    "distopt_overlap": (DDPOptions(overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=BUCKET),
                        ("gather", "regather", "regather-plain", "regather-rc", "lowrank", "megatron")),
    # synchronous all-reduce, plain optimizer: the same first-step gradients as the case above
    "sync": (DDPOptions(), ("gather", "regather-rc")),
    # TP2 x PP2 (one MoE layer per stage, EP2 inside each stage), megatron's 1F1B schedule: up to two
    # micro-batches in flight per stage, so every rebuilt expert input comes from its own forward's
    # routing and the router's input of that forward
    "pp2_1f1b": (DDPOptions(overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=BUCKET),
                 ("gather", "regather-rc", "regather-rc-rd")),
}
SPEC = {"pp2_1f1b": dict(pp=2, num_microbatches=4)}  # TrainSpec fields a case changes


def spec_for(case: str, strategy: str) -> TrainSpec:
    ddp, _ = CASES[case]
    fields = {**dict(steps=2, num_microbatches=3, lr=1e-5, timeout_minutes=0.5), **SPEC.get(case, {})}
    return TrainSpec(strategy=strategy, tp=TP, ep=EP, etp=ETP, ddp=replace(ddp), shape=TinyMoE(), **fields)


def run_case(rank: int, world_size: int, cases, *_args) -> dict:
    """Every run of ``cases`` on this rank: ``{(case, strategy): {"result", "error", "seconds"}}``."""
    warm_up()
    runs = {}
    for case in cases:
        for strategy in CASES[case][1]:
            t0 = time.perf_counter()
            result, error = train_agreed(spec_for(case, strategy))
            runs[(case, strategy)] = {"result": result, "error": error, "seconds": time.perf_counter() - t0}
    teardown_parallel()
    return runs

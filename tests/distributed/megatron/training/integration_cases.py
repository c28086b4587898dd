"""The integration matrix, and the rank worker that trains it (one spawn per case or pair of cases).

A *case* is one megatron setup (DDP options, gradient-accumulation fusion) on one
topology; it trains one model per strategy, the reference first, in the same process
group (fresh parallel state and models for each run), through megatron's DDP,
``get_megatron_optimizer``, ``get_forward_backward_func`` and ``finalize_model_grads``
(``tests.harness.megatron_train``). Every item of the matrix is covered at least once
per topology where it applies:

=================  ==========  ===========  ======  =============  =========================
case               overlap     distributed  fusion  param gather   strategies
                   grad reduce optimizer            overlapped
=================  ==========  ===========  ======  =============  =========================
``sync``           off         off          off     -              all + control
``overlap_fused``  on, small   on           on      off            gather, regather, lowrank
                   buckets                                         (both modes), control
``fused``          off         off          on      -              gather, regather, lowrank
``param_gather``   on          on           off     on             gather, regather, plain,
                                                                   lowrank, both shared
``param_sync``     on          on           off     off (twin)     gather, lowrank,
                                                                   gather-shared
=================  ==========  ===========  ======  =============  =========================

Every LoRA run is lean (``TrainSpec.lean_transients``), the gather reference too, so that the
comparisons stay bit for bit with the row-parallel targets (docs/design.md §3.7).

"rc": ``LoRA(recompute_adapter_inputs=True)`` variants (issue 9), registered here into
``megatron_train.STRATEGIES``: ``regather-rc``, ``regather-plain-rc``, ``lowrank-rc``,
``lowrank-finalize-rc`` and ``gather-rc`` (on the gather path only linear_fc2 recomputes). Each is
compared like the others with the case's gather run (bit-exact, or lowrank's tolerance) and, where
the case has it, bit-exact with the same strategy without recompute (``RECOMPUTE_TWIN``):
``sync`` adds regather-rc, lowrank-rc, gather-rc; ``overlap_fused`` adds regather-rc and
lowrank-finalize-rc; ``fused`` regather-plain-rc; ``param_gather`` regather-rc.

"all": gather, regather (early re-gather), regather-plain (``early_regather=False``),
lowrank with ``lowrank_grad_allreduce="backward"`` and ``="finalize_model_grads"``,
gather-shared and regather-shared (``share_sequence_gather=True``). ``fused`` (TP=2 only,
the cheap topology) isolates fusion from overlapped grad reduce; ``param_gather`` /
``param_sync`` need DP=2 (TP=2 x DP=2). "control" is megatron's own trainable linears
(no adapters): it proves the harness (DDP hooks, fusion stand-in, schedules) apart from
the adapters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from tests.harness.megatron_train import (
    STRATEGIES,
    DDPOptions,
    TrainSpec,
    teardown_parallel,
    train_agreed,
    warm_up,
)

from regather.tools.cpu.models import TinyGPT

# recompute_adapter_inputs variants: the strategy's entry plus the flag (imported in every rank too)
RECOMPUTE_TWIN = {"regather-rc": "regather", "regather-plain-rc": "regather-plain", "lowrank-rc": "lowrank",
                  "lowrank-finalize-rc": "lowrank-finalize", "gather-rc": "gather"}
for _rc, _twin in RECOMPUTE_TWIN.items():
    _strategy, _fields = STRATEGIES[_twin]
    STRATEGIES.setdefault(_rc, (_strategy, {**_fields, "recompute_adapter_inputs": True}))

STEPS, MICRO_BATCHES = 3, 4
BUCKET = 600  # elements: the LoRA parameters of each chunk span several DDP buckets
ALL = ["gather", "regather", "regather-plain", "lowrank", "lowrank-finalize", "gather-shared",
       "regather-shared"]
CONTROL = "megatron"
# each strategy is compared with this run of the same case (the same GEMMs, or a stated tolerance)
REFERENCE = {"regather-shared": "gather-shared"}
# Runs that are not the same GEMMs as their reference get a stated tolerance instead of
# bit-exactness (fp32, norm-relative per tensor): lowrank replicates LoRA-A and sums dA / dmid
# over TP in another order; the shared gather sums the base's and the adapter's input
# gradients before one reduce-scatter instead of after two. ``REL_FIRST`` holds for the first
# step (same parameters, so summation order alone: measured <= 7.2e-7 in the 4-layer VPP
# model); later steps start from parameters that already differ by that much and read other
# batches, so their floor is higher (measured up to 1.43e-6 at step 3, VPP, lr 1e-5):
# ``REL_LATER`` keeps a 2x margin above it. A real error (a missing TP sum, a stale weight)
# is O(1e-2 .. 1) relative.
ROUNDING = ("lowrank", "lowrank-finalize", "gather-shared", "lowrank-rc", "lowrank-finalize-rc")
REL_FIRST, REL_LATER = 1e-6, 3e-6


def tolerance(strategy: str, step: int):
    """None (bit-identical) or the norm-relative tolerance of ``strategy`` at ``step``."""
    if strategy not in ROUNDING:
        return None
    return REL_FIRST if step == 0 else REL_LATER


def reference_of(strategy: str) -> str:
    return REFERENCE.get(strategy, "gather")


@dataclass(frozen=True)
class Topology:
    world: int
    tp: int
    pp: int = 1
    vpp: int | None = None
    num_layers: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


TOPOLOGIES = {
    "tp2": Topology(world=2, tp=2),
    "tp2_dp2": Topology(world=4, tp=2),
    "tp2_pp2": Topology(world=4, tp=2, pp=2, num_layers=2),
    "tp2_pp2_vpp2": Topology(world=4, tp=2, pp=2, vpp=2, num_layers=4),  # one layer per chunk
}


@dataclass(frozen=True)
class Case:
    ddp: DDPOptions
    fusion: bool
    strategies: tuple


CASES = {
    "sync": Case(DDPOptions(), False, (CONTROL, *ALL, "regather-rc", "lowrank-rc", "gather-rc")),
    "overlap_fused": Case(DDPOptions(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                     bucket_size=BUCKET), True,
                          (CONTROL, "gather", "regather", "lowrank", "lowrank-finalize", "regather-rc",
                           "lowrank-finalize-rc")),
    "fused": Case(DDPOptions(), True, ("gather", "regather", "lowrank", "regather-plain-rc")),
    "param_gather": Case(DDPOptions(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                    overlap_param_gather=True, bucket_size=BUCKET), False,
                         ("gather", "regather", "regather-plain", "lowrank", "gather-shared",
                          "regather-shared", "regather-rc")),
    "param_sync": Case(DDPOptions(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                  bucket_size=BUCKET), False, ("gather", "lowrank", "gather-shared")),
}
# the run of ``param_sync`` whose used weights a ``param_gather`` run must reproduce exactly
SYNC_TWIN = {"regather": "gather", "regather-plain": "gather", "regather-shared": "gather-shared",
             "regather-rc": "gather"}


def cases_for(topology: str) -> list[str]:
    names = ["sync", "overlap_fused"]
    if topology == "tp2":
        names.append("fused")
    if TOPOLOGIES[topology].dp > 1:
        names += ["param_gather", "param_sync"]
    return names


def runs_for(topology: str) -> list[tuple[str, str]]:
    return [(case, s) for case in cases_for(topology) for s in CASES[case].strategies]


def spec_for(topology: str, case: str, strategy: str) -> TrainSpec:
    topo, c = TOPOLOGIES[topology], CASES[case]
    return TrainSpec(strategy=strategy, tp=topo.tp, pp=topo.pp, vpp=topo.vpp, ddp=replace(c.ddp),
                     gradient_accumulation_fusion=c.fusion, shape=TinyGPT(num_layers=topo.num_layers),
                     steps=STEPS, num_microbatches=MICRO_BATCHES,
                     # A small lr keeps the tolerance about summation order: Adam turns any tiny
                     # difference in a near-zero gradient entry into an lr-sized parameter
                     # difference, which the next steps then carry; at 1e-4 that lifted the
                     # shared gather to 1.03e-6 by step 3, at 1e-5 every step stays near the
                     # first step's ~4e-7. Bit-exact comparisons do not depend on it.
                     lr=1e-5, timeout_minutes=0.5)


def run_cases(rank: int, world_size: int, cases: list[str], topology: str) -> dict:
    """Rank worker: every run of ``cases`` of the topology's matrix, in order.

    Returns ``{"runs": {(case, strategy): {"result", "error", "seconds"}}}``. A failed run is
    recorded, not raised, and all ranks agree on it (``train_agreed``); when a case's
    ``gather`` run failed, its remaining LoRA runs are skipped (nothing to compare them with,
    and under PP each would wait out megatron's group timeout again).
    """
    warm_up()
    runs: dict = {}
    unknown = sorted(set(cases) - set(cases_for(topology)))
    if unknown:
        raise ValueError(f"cases {unknown} are not in {topology}'s matrix {cases_for(topology)}")
    for case in cases:
        gather_failed = None
        for strategy in CASES[case].strategies:
            if gather_failed is not None and strategy != CONTROL:
                runs[(case, strategy)] = {"result": None, "seconds": 0.0,
                                          "error": f"skipped: the case's gather run failed:\n{gather_failed}"}
                continue
            t0 = time.perf_counter()
            result, error = train_agreed(spec_for(topology, case, strategy))
            runs[(case, strategy)] = {"result": result, "error": error,
                                      "seconds": time.perf_counter() - t0}
            if strategy == "gather" and error is not None:
                gather_failed = error
    teardown_parallel()
    return {"runs": runs}

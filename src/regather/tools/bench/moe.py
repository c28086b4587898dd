"""``regather bench --moe``: the variants on megatron-core's own MoE layers, counted and timed.

The tiny MoE GPT of :mod:`regather.tools.cpu.moe_models` (megatron's ``MoELayer``, router, alltoall /
allgather token dispatcher, ``SequentialMLP`` or ``TEGroupedMLP`` experts on the TE stand-ins) on
``max(tp, ep * etp)`` gloo ranks; every variant trained side by side by
:func:`regather.tools.cpu.moe_train.compare_moe` (same full weights, same batches, steps
interleaved with the order rotated each step). :func:`summarise` turns the per-rank results into
one row per variant:

- LoRA-A input bytes of the first forward per adapter kind, per rank and their **mean over the
  ranks** (expert rows depend on each rank's routing; their mean over the expert-parallel group
  does not: it is what ``regather estimate`` models), the retained total, and the rows routed to
  each rank's local experts per MoE layer and forward;
- collective bytes by kind per step, mean over the ranks and over the steps after the first (the
  first also checks each MoE layer's route once under the expert recompute: reported apart), and
  the extra against gather and against the variant's own strategy;
- step-time medians (slowest rank per step) and paired ratios, as the dense bench
  (:func:`regather.tools.bench.runner.step_time_ratios`);
- parity against gather and against the strategy without options: max |Δloss| over the steps,
  max |Δgrad| of the last step's LoRA gradients over every rank (absolute and relative to the
  reference's largest entry);
- the decisions summary and, per MoE layer, the early / late re-dispatch counts;
- LoRA's kept and peak bytes over the frozen model (the allocator's, every collective settled, per rank and their
  mean), measured on fresh models of the run's weights (LoRA-B zero: every model routes as the frozen one does).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

from regather.megatron.reasons import REPLAYED_DISPATCHERS
from regather.tools.bench.runner import (
    BenchSpec,
    decision_counts,
    progress_printer,
    recompute_counts,
    step_time_ratios,
    target_problems,
)
from regather.tools.shapes import ModelShape, shape_fields

DISPATCHERS = REPLAYED_DISPATCHERS  # the variants compare routes regather replays
DEFAULT_VARIANTS = ("gather", "regather", "regather-recompute", "regather-recompute-redispatch", "lowrank",
                    "lowrank-recompute")


@dataclass(frozen=True)
class MoEBenchSpec(BenchSpec):
    """What ``regather bench --moe`` runs: the dense bench's spec with the tiny test MoE's experts
    (``ffn``: dense layers and ``--moe-layer-freq``) and an expert-parallel layout."""

    ep: int = 2
    num_experts: int = 4
    topk: int = 2
    moe_ffn: int = 64

    @property
    def world(self) -> int:
        return max(self.tp, self.ep * self.etp)

    def problems(self) -> list[str]:
        """Every reason this spec cannot run (empty: it can)."""
        from regather.tools.cpu.moe_train import variant_options

        out = []
        if self.dispatcher not in DISPATCHERS:
            out.append(f"--dispatcher {self.dispatcher}: the CPU bench runs {' or '.join(DISPATCHERS)} (the flex "
                       "dispatcher needs DeepEP on GPUs, and regather cannot replay its route)")
        if not self.share_expert_adapters and self.experts != "grouped":
            out.append("--expert-lora per-expert needs --experts grouped (SequentialMLP experts always have an adapter "
                       "each)")
        if min(self.tp, self.ep, self.etp) < 1:
            out.append("--tp, --ep and --etp must be at least 1")
        elif self.world % self.tp or self.world % (self.ep * self.etp):
            out.append(f"--tp {self.tp} and --ep x --etp = {self.ep * self.etp} must divide one another "
                       f"(the ranks: max of the two = {self.world})")
        if self.num_experts % max(self.ep, 1):
            out.append(f"--num-experts {self.num_experts} is not a multiple of --ep {self.ep}")
        if not 1 <= self.topk <= self.num_experts:
            out.append(f"--topk {self.topk} must be between 1 and --num-experts {self.num_experts}")
        for what, size, by in (("--moe-ffn", self.moe_ffn, self.etp), ("--heads", self.heads, self.tp),
                               ("--ffn", self.ffn, self.tp), ("--seq", self.seq, self.tp),
                               ("--shared-expert-ffn", self.shared_expert_ffn, self.tp),
                               ("--kv-heads", self.kv_heads or self.heads, self.tp)):
            if by >= 1 and size % by:
                out.append(f"{what} {size} is not divisible by {'--etp' if what == '--moe-ffn' else '--tp'} {by}")
        if self.hidden % self.heads:
            out.append(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if self.canonical:
            out.append("--canonical is not measured on MoE models by this bench")
        else:
            out += target_problems(self.targets, hint=False)
        if self.steps < 2 or self.steps <= self.warmup:
            out.append(f"--steps {self.steps} must be at least 2 and exceed --warmup {self.warmup} (the per-step "
                       "communication leaves out the first step)")
        for name in self.strategies:
            try:
                variant_options(name)
            except ValueError as exc:
                out.append(str(exc))
        return out

    def run_config(self):
        from regather.tools.cpu.moe_models import TinyMoE
        from regather.tools.cpu.moe_train import MoERun

        shape = TinyMoE(**shape_fields(ModelShape, self), seq=self.seq)
        return MoERun(shape=shape, tp=self.tp, ep=self.ep, etp=self.etp, dtype=self.dtype,
                      micro_batch=self.micro_batch, steps=self.steps, lr=self.lr, lora_dim=self.lora_rank,
                      lora_alpha=self.lora_alpha, targets=tuple(self.targets),
                      share_expert_adapters=self.share_expert_adapters, input_requires_grad=self.input_requires_grad,
                      seed=self.seed)

    @property
    def shared_a(self) -> bool:
        """Grouped experts with one LoRA-A for the local experts: it runs before the dispatch under
        every ``-recompute`` variant (``-redispatch`` changes nothing there)."""
        return self.experts == "grouped" and self.share_expert_adapters


def default_variants(spec: MoEBenchSpec) -> tuple:
    from regather.tools.cpu.moe_train import moe_variants

    known = moe_variants()
    return tuple(v for v in DEFAULT_VARIANTS if v in known and not (spec.shared_a and v.endswith("-redispatch")))


def parity_pairs(variants) -> dict:
    """``{variant: [gather, its strategy without options, gather-lean for a lean variant]}`` (those run)."""
    from regather.tools.cpu.moe_train import base_variant
    from regather.tools.cpu.train import lean_output

    out = {}
    for v in variants:
        base = base_variant(v)
        out[v] = ["gather"] + ([base] if base != v and base != "gather" and base in variants else [])
        if lean_output(_strategy_variant(v)) and "gather-lean" in variants and v != "gather-lean":
            out[v].append("gather-lean")
    return out


def _strategy_variant(name: str) -> str:
    """The dense variant a MoE variant's output path follows (``regather-recompute-redispatch``: ``regather-recompute``)."""
    from regather.tools.cpu.moe_train import REDISPATCH

    return name[: -len(REDISPATCH)] + "-recompute" if name.endswith(REDISPATCH) else name


def moe_rank(rank: int, world_size: int, spec: MoEBenchSpec) -> dict:
    """One rank of the benchmark (module level so ``spawn`` can import it)."""
    import logging

    from regather.tools.bench.clocks import redispatch_times
    from regather.tools.cpu.moe_train import compare_moe

    logging.getLogger("regather").setLevel(logging.ERROR)  # expected fallbacks are in the report
    progress = progress_printer(rank, spec.strategies, spec.steps, spec.quiet)
    with redispatch_times():  # wait_s / flight_s in each layer's re-dispatch counts
        results = compare_moe(rank, world_size, spec.run_config(), list(spec.strategies),
                              parity_pairs(spec.strategies), progress=progress, peak=True)
    if rank != 0:  # decisions are the same on every rank: rank 0's enter the report
        for name in spec.strategies:
            results[name].pop("decisions", None)
    return results


def run(spec: MoEBenchSpec) -> dict:
    """Spawn ``spec.world`` gloo ranks, run the benchmark, return the summary dict."""
    from regather.tools.cpu.dist import run_ranks

    if not spec.strategies:
        spec = replace(spec, strategies=default_variants(spec))
    if "gather" not in spec.strategies:
        spec = replace(spec, strategies=("gather",) + tuple(spec.strategies))  # every ratio and parity: vs gather
    problems = spec.problems()
    if problems:
        raise ValueError("regather bench --moe: " + "; ".join(problems))
    t0 = time.perf_counter()
    per_rank = run_ranks(moe_rank, spec.world, spec, timeout=spec.timeout)
    summary = summarise(per_rank, spec)
    summary["backend"] = "gloo"
    summary["wall_seconds"] = time.perf_counter() - t0
    return summary


# -- summary -------------------------------------------------------------------------------------


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _mean_dicts(dicts) -> dict:
    """Key by key mean of ``dicts`` (a missing key counts 0)."""
    dicts = list(dicts)
    keys = sorted({k for d in dicts for k in d})
    return {k: _mean(d.get(k, 0) for d in dicts) for k in keys}


def _minus(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b))}


def _row(results: list, spec: MoEBenchSpec) -> dict:
    """One variant's measurements over the ranks (``results``: that variant's dict on each rank)."""
    steps = range(1, spec.steps)
    by_kind = [r["adapter_input_by_kind"] for r in results]
    slowest = [max(r["step_time"][i] for r in results) for i in range(spec.steps)]
    timed = slowest[spec.warmup:] or slowest
    comm_steps = [[{k: int(v) for k, v in s.items()} for s in r["comm_steps"]] for r in results]
    first_routed = [{layer: sum(fwd[0]) for layer, fwd in r["routed"].items()} for r in results]
    return {
        "saved_bytes_mean": _mean(r["saved_bytes"] for r in results),
        "saved_bytes_per_rank": [r["saved_bytes"] for r in results],
        "adapter_input_bytes_mean": _mean(r["saved_adapter_input_bytes"] for r in results),
        "adapter_input_bytes_per_rank": [r["saved_adapter_input_bytes"] for r in results],
        "adapter_input_by_kind_mean": _mean_dicts(by_kind),
        "adapter_input_by_kind_per_rank": by_kind,
        "routed_rows_first_forward_mean": _mean_dicts(first_routed),
        "routed_rows_first_forward_per_rank": first_routed,
        "tokens_per_local_expert_per_rank": [r["routed"] for r in results],
        "comm_bytes_first_step_mean": _mean_dicts(c[0] for c in comm_steps),
        "comm_bytes_per_step_mean": _mean_dicts(c[i] for c in comm_steps for i in steps),
        "comm_bytes_per_rank_and_step": comm_steps,
        "step_times": slowest,
        "median_step_time": statistics.median(timed),
        "loss": results[0]["loss"],
        "redispatches": results[0]["resends"],
        "redispatches_per_rank": [r["resends"] for r in results],
        "parity_per_rank": [r["parity"] for r in results],
        "rank_coords": [r["coords"] for r in results],
        "decisions": results[0]["decisions"],
        "adapters_by_strategy": decision_counts(results[0]["decisions"]),
        "adapter_inputs": recompute_counts(results[0]["decisions"]),
    }


def _compare(row: dict, ref: dict, ref_name: str, what: str, warmup: int) -> None:
    """``row`` against ``ref``: comm extra, step-time ratios, loss and gradient differences."""
    row[f"comm_bytes_extra_vs_{what}"] = _minus(row["comm_bytes_per_step_mean"], ref["comm_bytes_per_step_mean"])
    row[f"comm_bytes_first_step_extra_vs_{what}"] = _minus(row["comm_bytes_first_step_mean"],
                                                          ref["comm_bytes_first_step_mean"])
    step_time_ratios(row, ref, what, warmup)
    diffs = [abs(a - b) for a, b in zip(row["loss"], ref["loss"])]
    suffix = "" if what == "gather" else f"_vs_{what}"
    row[f"max_abs_loss_diff{suffix}"] = max(diffs)
    row[f"losses_equal_to_{what}"] = max(diffs) == 0.0
    row[f"first_loss_equal_to_{what}"] = row["loss"][0] == ref["loss"][0]
    routed, ref_routed = row["tokens_per_local_expert_per_rank"], ref["tokens_per_local_expert_per_rank"]
    differs = [i for i in range(len(row["loss"]))
               if any(f[i] != rf[i] for r, rr in zip(routed, ref_routed) for f, rf in zip(r.values(), rr.values()))]
    row[f"first_step_routing_differs_from_{what}"] = differs[0] if differs else None  # (0-based; None: never)
    gaps = [p[ref_name] for p in row["parity_per_rank"]]
    worst, scale = max(g["max_abs_grad_diff"] for g in gaps), max(g["max_abs_grad"] for g in gaps)
    row[f"max_abs_grad_diff{suffix}"] = worst
    row[f"max_rel_grad_diff{suffix}"] = worst / scale if scale else 0.0


def dispatch_bytes(row: dict, spec: MoEBenchSpec, width: int, reverse: bool = False) -> float | None:
    """What one more dispatch of ``width``-wide rows per MoE layer and forward sends per step
    (``reverse``: its reverse, in backward), mean over ranks and the steps after the first, by the
    accounting's formula (output bytes x (g-1)/g) and ``row``'s routing: alltoall at expert TP 1 is
    one all-to-all whose output is the rows routed to the rank (reverse: the ``k`` rows of each local
    token); allgather one all-gather of the local tokens over expert TP x EP (reverse: its
    reduce-scatter). None for alltoall at expert TP > 1 (uneven expert-TP gathers)."""
    elt = 2 if spec.dtype == "bfloat16" else 4
    tokens = spec.seq * spec.micro_batch // spec.tp
    per_rank = []
    for routed in row["tokens_per_local_expert_per_rank"]:
        for step in range(1, spec.steps):
            if spec.dispatcher == "alltoall":
                if spec.etp > 1:
                    return None
                g = spec.ep
                rows = [tokens * spec.topk if reverse else sum(f[step]) for f in routed.values()]
                per_rank.append(sum(n * width * elt * (g - 1) // g for n in rows))
            else:
                g = spec.ep * spec.etp
                per_rank.append(len(routed) * (tokens * g * width * elt * (g - 1) // g))
    return _mean(per_rank)


def summarise(per_rank: list, spec: MoEBenchSpec) -> dict:
    from regather.tools.bench.runner import over_frozen
    from regather.tools.cpu.moe_train import base_variant, variant_options
    from regather.tools.cpu.train import lean_output

    rows = {name: _row([r[name] for r in per_rank], spec) for name in spec.strategies}
    for name, row in rows.items():
        row["options"] = variant_options(name)[1]
        row["allocated_per_rank"] = [over_frozen(r[name]["allocated"], r["frozen"]["allocated"]) for r in per_rank]
        row["allocated"] = _mean_dicts(row["allocated_per_rank"])
        _compare(row, rows["gather"], "gather", "gather", spec.warmup)
        if lean_output(_strategy_variant(name)) and "gather-lean" in rows and name != "gather-lean":
            _compare(row, rows["gather-lean"], "gather-lean", "same_output_path", spec.warmup)
        base = base_variant(name)
        if base != name and base in rows:
            row["variant_of"] = base
            _compare(row, rows[base], base, "base", spec.warmup)
    gather = rows["gather"]
    one = {"h_wide": dispatch_bytes(gather, spec, spec.hidden)}
    if spec.shared_a:
        fwd, back = dispatch_bytes(gather, spec, spec.lora_rank), dispatch_bytes(gather, spec, spec.lora_rank, True)
        one["rank_r_both_ways"] = None if fwd is None else fwd + back
    return {"mode": "moe", "spec": asdict(spec), "world": spec.world, "strategies": rows,
            "dispatch_bytes_per_step_mean": one,
            "frozen": {"allocated_per_rank": [dict(r["frozen"]["allocated"]) for r in per_rank]}}

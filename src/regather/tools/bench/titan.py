"""``regather bench --torchtitan``: regather's torchtitan front end against torchtitan's own LoRA, counted
and timed on a real torchtitan 0.3.0 llama3 model (its sharding config, TP + SP, ``partial_dtensor``).

``spec.tp`` gloo ranks; every variant of :mod:`regather.tools.cpu.torchtitan_train` (``torchtitan`` =
torchtitan's ``LoRAConverter``, the baseline, and regather's ``gather``, ``regather``,
``regather-plain``, ``lowrank`` and the ``-recompute`` variants) trained side by side by
:func:`regather.tools.cpu.torchtitan_train.compare_titan` (same parameter values, same batches, steps
interleaved with the order rotated each step). :func:`summarise` turns the per-rank results into one
row per variant:

- what the first forward keeps (rank 0; the ranks are checked to agree): LoRA-A's input per adapter
  kind (``adapter_input:<kind>``, torchtitan's labelled as regather's are; ``w1`` and ``w3`` read one
  storage, counted under ``w1``, which runs first), all of them, LoRA's bytes over the frozen model
  (counted in the same run) and the retained total;
- collective bytes of the first step by phase (forward, backward, optimizer) and kind, and the extra
  against torchtitan's LoRA;
- step times (slowest rank per step, median after warm-up) and their ratios against torchtitan's
  LoRA and against the variant's own strategy (median ratio and paired: median of per-step ratios);
- parity against torchtitan's LoRA: max |Δloss| over the steps, max |Δgrad| over the last step's
  trainable gradients (full tensors), and whether both are bit-identical;
- the adapters' decisions.
"""

from __future__ import annotations

import importlib.metadata
import statistics
import time
from dataclasses import asdict, dataclass, replace

from regather.tools.bench.runner import (
    BenchSpec,
    decision_counts,
    progress_printer,
    recompute_counts,
    step_time_ratios,
)
from regather.torchtitan.reasons import TARGETS

#: torchtitan's llama3 linears, the adapter kinds (every one adapted by default)
TITAN_TARGETS = TARGETS
PHASES = ("forward", "backward", "optimizer")
#: --ac: torchtitan's activation checkpointing policies (none, SelectiveAC, FullAC; default configs)
AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class TitanBenchSpec(BenchSpec):
    """What ``regather bench --torchtitan`` runs: the dense bench's shapes on torchtitan's llama3
    (``hidden`` = its ``dim``, ``kv_heads`` = its ``n_kv_heads``), its linears as targets, torchtitan's
    AdamW learning rate."""

    targets: tuple = TITAN_TARGETS
    lr: float = 8e-4
    ac: str = "none"
    compile: bool = False

    def problems(self) -> list[str]:
        """Every reason this spec cannot run (empty: it can)."""
        from regather.torchtitan.options import variant_fields

        out = []
        unknown = [t for t in self.targets if t not in TITAN_TARGETS]
        if unknown or not self.targets:
            out.append(f"--targets {','.join(self.targets)}: torchtitan's llama3 linears are {','.join(TITAN_TARGETS)}")
        if self.tp < 2:
            out.append(f"--tp {self.tp}: sequence parallelism needs at least 2 ranks")
        for what, size in (("--heads", self.heads), ("--kv-heads", self.kv_heads or self.heads), ("--ffn", self.ffn),
                           ("--seq", self.seq)):
            if self.tp >= 1 and size % self.tp:
                out.append(f"{what} {size} is not divisible by --tp {self.tp}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            out.append(f"--hidden {self.hidden} / --heads {self.heads} must be an even head dimension (rope)")
        if self.heads % (self.kv_heads or self.heads):
            out.append(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        if self.ac not in AC_MODES:
            out.append(f"--ac {self.ac}: expected one of {', '.join(AC_MODES)}")
        if self.compile and self.ac != "none":
            out.append(f"--compile with --ac {self.ac}: torchtitan's own compiled blocks fail with activation "
                       "checkpointing on CPU (docs/torchtitan.md)")
        if self.canonical or self.moe:
            out.append("--canonical and MoE models are not measured by the torchtitan bench")
        if self.steps <= self.warmup:
            out.append(f"--steps ({self.steps}) must exceed --warmup ({self.warmup})")
        for name in self.strategies:
            try:
                variant_fields(name)
            except ValueError as exc:
                out.append(str(exc))
        return out

    def run_config(self):
        from regather.tools.cpu.torchtitan_models import TinyLlama3
        from regather.tools.cpu.torchtitan_train import TitanRun

        shape = TinyLlama3(hidden=self.hidden, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
                           ffn=self.ffn, vocab=self.vocab, seq=self.seq, micro_batch=self.micro_batch)
        return TitanRun(shape=shape, tp=self.tp, dtype=self.dtype, lora_rank=self.lora_rank,
                        lora_alpha=float(self.lora_alpha), targets=tuple(self.targets), steps=self.steps, lr=self.lr,
                        seed=self.seed, ac=self.ac, compile=self.compile)


def titan_rank(rank: int, world_size: int, spec: TitanBenchSpec) -> dict:
    """One rank of the benchmark (module level so ``spawn`` can import it)."""
    import logging

    from regather.tools.cpu.torchtitan_train import compare_titan

    logging.getLogger("regather").setLevel(logging.ERROR)  # expected fallbacks are in the report
    progress = progress_printer(rank, spec.strategies, spec.steps, spec.quiet)
    results = compare_titan(rank, world_size, spec.run_config(), list(spec.strategies), progress=progress)
    if rank != 0:  # gradients are full tensors, the same on every rank: rank 0's enter the report
        for res in results.values():
            res.pop("grads", None)
    return results


def run(spec: TitanBenchSpec) -> dict:
    """Spawn ``spec.tp`` gloo ranks, run the benchmark, return the summary dict."""
    from regather.tools.cpu.dist import run_ranks
    from regather.tools.cpu.torchtitan_models import missing
    from regather.torchtitan.options import BASELINE, VARIANTS

    why = missing()
    if why:
        raise RuntimeError(f"regather bench --torchtitan: {why}")
    if not spec.strategies:
        spec = replace(spec, strategies=VARIANTS)
    if BASELINE not in spec.strategies:  # every ratio and parity: against torchtitan's LoRA
        spec = replace(spec, strategies=(BASELINE,) + tuple(spec.strategies))
    problems = spec.problems()
    if problems:
        raise ValueError("regather bench --torchtitan: " + "; ".join(problems))
    t0 = time.perf_counter()
    per_rank = run_ranks(titan_rank, spec.tp, spec, timeout=spec.timeout)
    summary = summarise(per_rank, spec)
    summary["backend"] = "gloo"
    summary["wall_seconds"] = time.perf_counter() - t0
    summary["torchtitan"] = importlib.metadata.version("torchtitan")
    return summary


# -- summary -------------------------------------------------------------------------------------


def by_kind(labels: dict) -> dict:
    """LoRA-A input bytes per adapter kind from a ``saved_bytes_by_label``."""
    from regather.core.accounting import ADAPTER_INPUT  # torch: imported where used, not by the command's parser

    prefix = ADAPTER_INPUT + ":"
    return {k[len(prefix):]: int(v) for k, v in sorted(labels.items()) if k.startswith(prefix)}


def _total(comm: dict) -> dict:
    """Bytes per kind over the phases."""
    out: dict = {}
    for phase in comm.values():
        for kind, n in phase.items():
            out[kind] = out.get(kind, 0) + int(n)
    return dict(sorted(out.items()))


def _minus(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}


def _row(results: list, frozen: int | None, frozen_allocated: int, spec: TitanBenchSpec,
         frozen_step: dict | None = None) -> dict:
    """One variant's measurements (``results``: its dict on each rank; ``frozen_step``: the frozen model's allocator
    bytes of one step, None under --compile)."""
    from regather.tools.bench.runner import over_frozen

    r0 = results[0]
    step = r0.get("step_bytes")
    counted = r0["saved_bytes"] is not None  # None under --compile: the allocator's bytes alone
    kinds = by_kind(r0["saved_bytes_by_label"])
    slowest = [max(r["step_time"][i] for r in results) for i in range(spec.steps)]
    comm = {phase: {k: int(v) for k, v in sorted(r0["comm_bytes"].get(phase, {}).items())} for phase in PHASES}
    return {
        "saved_bytes": int(r0["saved_bytes"]) if counted else None,
        "saved_bytes_same_on_all_ranks": all(r["saved_bytes"] == r0["saved_bytes"] for r in results),
        "saved_bytes_by_label": r0["saved_bytes_by_label"],
        "adapter_input_by_kind": kinds,
        "adapter_input_bytes": sum(kinds.values()) if counted else None,
        "lora_bytes_over_frozen": int(r0["saved_bytes"]) - frozen if counted else None,
        "allocated_bytes": int(r0["allocated_bytes"]),
        "allocated_over_frozen": int(r0["allocated_bytes"]) - frozen_allocated,
        # LoRA's kept and peak over the frozen model, the allocator's of one step (every collective settled), rank 0
        "allocated": over_frozen(step, frozen_step) if step and frozen_step else None,
        "comm_bytes": comm,
        "comm_calls": r0["comm_calls"],
        "comm_bytes_total": _total(comm),
        "comm_bytes_same_on_all_ranks": all(r["comm_bytes"] == r0["comm_bytes"] for r in results),
        "step_times": slowest,
        "median_step_time": statistics.median(slowest[spec.warmup:] or slowest),
        "loss": r0["loss"],
        "decisions": r0["decisions"],
        "adapters_by_strategy": decision_counts(r0["decisions"]),
        "adapter_inputs": recompute_counts(r0["decisions"]),
    }


def _parity(row: dict, ref: dict, grads: dict, ref_grads: dict) -> None:
    diffs = [abs(a - b) for a, b in zip(row["loss"], ref["loss"])]
    row["max_abs_loss_diff"] = max(diffs)
    worst = scale = 0.0
    exact = sorted(grads) == sorted(ref_grads)
    for n, g in ref_grads.items():
        got = grads.get(n)
        if got is None or g is None:
            exact = exact and got is None and g is None
            continue
        exact = exact and bool((got == g).all())
        worst = max(worst, (got - g).abs().max().item())
        scale = max(scale, g.abs().max().item())
    row["max_abs_grad_diff"] = worst
    row["max_rel_grad_diff"] = worst / scale if scale else 0.0
    row["bit_identical_to_torchtitan"] = exact and max(diffs) == 0.0


def summarise(per_rank: list, spec: TitanBenchSpec) -> dict:
    from regather.torchtitan.options import BASELINE, base_variant

    frozen = per_rank[0]["frozen"]["saved_bytes"]  # None under --compile (the allocator's bytes alone)
    frozen_allocated = int(per_rank[0]["frozen"]["allocated_bytes"])
    frozen_step = per_rank[0]["frozen"].get("step_bytes")
    rows = {name: _row([r[name] for r in per_rank], frozen, frozen_allocated, spec, frozen_step)
            for name in spec.strategies}
    ref, ref_grads = rows[BASELINE], per_rank[0][BASELINE]["grads"]
    for name, row in rows.items():
        _parity(row, ref, per_rank[0][name]["grads"], ref_grads)
        row["comm_bytes_extra_vs_torchtitan"] = _minus(row["comm_bytes_total"], ref["comm_bytes_total"])
        step_time_ratios(row, ref, "torchtitan", spec.warmup)
        base = base_variant(name)
        if base != name and base in rows:
            row["variant_of"] = base
            step_time_ratios(row, rows[base], "base", spec.warmup)
    return {"mode": "torchtitan", "spec": asdict(spec), "baseline": BASELINE,
            "frozen": {"saved_bytes": frozen, "saved_bytes_by_label": per_rank[0]["frozen"]["saved_bytes_by_label"],
                       "allocated_bytes": frozen_allocated, "step_bytes": frozen_step,
                       "same_on_all_ranks": all(r["frozen"]["saved_bytes"] == frozen for r in per_rank)},
            "strategies": rows}

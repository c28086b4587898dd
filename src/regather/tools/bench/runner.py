"""Run the benchmark: spawn the ranks, train every strategy side by side, summarise.

The ranks come from :func:`regather.tools.cpu.dist.run_ranks` (gloo). When at
least ``tp`` CUDA devices are visible, each rank switches to NCCL on its own
device before building the model (:func:`_use_nccl`); that path has not run on
a multi-GPU machine yet. The measurement itself is
:func:`regather.tools.cpu.train.compare_strategies`; this module turns the
per-rank results into one summary per strategy (:func:`summarise`).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from regather.megatron.reasons import ALL_TARGETS as DEFAULT_TARGETS  # LoRA's default targets (megatron.lora)
from regather.tools.shapes import ModelShape, RunShape, shape_fields, tp_problems


@dataclass(frozen=True)
class BenchSpec(ModelShape, RunShape):
    """What ``regather bench`` runs: the model and run shapes (the tiny default GPT unless sizes are
    given) and how long to measure."""

    seq: int = 64
    targets: tuple = DEFAULT_TARGETS
    lora_alpha: int = 16
    steps: int = 8
    warmup: int = 2
    strategies: tuple = ()
    lr: float = 1e-3
    seed: int = 1234
    timeout: float = 3600.0
    quiet: bool = False
    # regather.CanonicalLoRA on a gated SwiGLU GPT (its targets are CANONICAL_TARGETS): the
    # q/k/v and gate/up adapter inputs are reported beside Bridge's CanonicalLoRA (canonical_inputs)
    canonical: bool = False
    # "dora": regather.DoRA on the same GPT (its pre-magnitude output rebuilt in backward with
    # recompute_dora_output); the kept output is reported apart (saved_dora_output_bytes)
    peft: str = "lora"
    recompute_dora_output: bool = False

    def problems(self) -> list[str]:
        """Every reason this spec cannot run (empty: it can)."""
        out = tp_problems(self, self.tp, self.seq, self.sp) + target_problems(self.targets, self.canonical)
        if self.peft not in ("lora", "dora") or (self.peft == "dora" and self.canonical):
            out.append(f"--peft {self.peft}: expected lora or dora (dora without --canonical)")
        if self.recompute_dora_output and self.peft != "dora":
            out.append("--recompute-dora-output needs --peft dora")
        if self.steps <= self.warmup:
            out.append(f"--steps ({self.steps}) must exceed --warmup ({self.warmup})")
        return out

    def run_config(self):
        from regather.tools.cpu.models import TinyGPT
        from regather.tools.cpu.train import RunConfig

        shape = TinyGPT(**shape_fields(ModelShape, self), seq=self.seq)
        return RunConfig(strategy="gather", tp=self.tp, sequence_parallel=self.sp, shape=shape,
                         micro_batch=self.micro_batch, steps=self.steps, lr=self.lr, dtype=self.dtype,
                         lora_dim=self.lora_rank, lora_alpha=self.lora_alpha, targets=tuple(self.targets),
                         lora_B_init_method="normal", seed=self.seed, warmup=self.warmup,
                         input_requires_grad=self.input_requires_grad, swiglu=self.canonical,
                         canonical=self.canonical, peft=self.peft, recompute_dora_output=self.recompute_dora_output)


def target_problems(targets, canonical: bool = False, hint: bool = True) -> list[str]:
    """What ``LoRA`` (``CanonicalLoRA`` with ``canonical``) would refuse in ``targets`` on bench's GPT,
    found before any rank starts; CanonicalLoRA's own rule says why a fused linear is refused.
    ``hint``: name ``--canonical``'s targets beside (not where the model has no canonical run)."""
    from regather.megatron.canonical import CANONICAL_TARGETS, CanonicalLoRA

    if canonical:
        try:
            CanonicalLoRA(target_modules=list(targets))
        except ValueError as exc:
            return [f"--canonical --targets: {exc}"]
    known = CANONICAL_TARGETS if canonical else DEFAULT_TARGETS
    unknown = [t for t in targets if t not in known]
    if not unknown:
        return []
    other = "" if canonical or not hint else f" ({', '.join(CANONICAL_TARGETS)}: with --canonical)"
    return [f"--targets {unknown}: not a linear of this GPT; expected some of {', '.join(known)}{other}"]


def available_strategies() -> list[str]:
    """Every strategy the installed package implements and ``LoRA`` can ask for, gather first."""
    from regather.tools.cpu.train import requestable_strategies

    return requestable_strategies()


def _use_nccl(rank: int, world_size: int, init_file: str):
    """Replace the gloo default group by an NCCL one on ``cuda:rank``; return the device."""
    import datetime

    import torch
    import torch.distributed as dist

    from regather.tools.cpu.megatron_cpu import patch_torch_norm

    patch_torch_norm()  # without apex/TE the local spec's torch norm refuses SP (docs/design.md §6)
    torch.cuda.set_device(rank)
    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=10))
    return torch.device("cuda", rank)


def progress_printer(rank: int, strategies, steps: int, quiet: bool, stream=None):
    """Rank 0's progress on stderr (a ``progress(name, step, seconds)`` callback), or None: one line
    rewritten in place on a terminal; elsewhere (a log, a pipe) a line per tenth of the steps done."""
    if rank != 0 or quiet:
        return None
    stream = stream or sys.stderr
    tty = stream.isatty()
    start = time.perf_counter()
    total = steps * len(strategies)
    width = max(map(len, strategies))
    done = [0]

    def progress(name: str, step: int, seconds: float) -> None:
        done[0] += 1
        line = (f"[{done[0]:>4}/{total}] step {step + 1}/{steps} {name:<{width}} {seconds * 1e3:9.1f} ms"
                f"  (elapsed {time.perf_counter() - start:6.1f} s)")
        if tty:
            print("\r" + line, end="\n" if done[0] == total else "", file=stream, flush=True)
        elif done[0] * 10 // total > (done[0] - 1) * 10 // total:
            print(line, file=stream, flush=True)

    return progress


def bench_rank(rank: int, world_size: int, spec: BenchSpec, nccl_init_file: str | None = None) -> dict:
    """One rank of the benchmark (module level so ``spawn`` can import it)."""
    import logging

    from regather.tools.cpu.train import compare_strategies

    logging.getLogger("regather").setLevel(logging.ERROR)  # expected fallbacks are in the report
    device = _use_nccl(rank, world_size, nccl_init_file) if nccl_init_file else None
    progress = progress_printer(rank, spec.strategies, spec.steps, spec.quiet)
    results = compare_strategies(rank, world_size, spec.run_config(), list(spec.strategies),
                                 device=device, progress=progress, peak=True)
    if rank != 0:  # only rank 0's gradients and losses enter the report
        for name in spec.strategies:
            results[name].pop("grads", None)
    return results


def run(spec: BenchSpec) -> dict:
    """Spawn ``spec.tp`` ranks, run the benchmark, return the summary dict."""
    import torch

    from regather.tools.cpu.dist import run_ranks

    if not spec.strategies:
        spec = replace(spec, strategies=tuple(available_strategies()))
    if "gather" not in spec.strategies:
        spec = replace(spec, strategies=("gather",) + tuple(spec.strategies))  # every ratio is against gather
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= spec.tp
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="regather-bench-") as tmp:
        init_file = os.path.join(tmp, "nccl-rendezvous") if use_nccl else None
        per_rank = run_ranks(bench_rank, spec.tp, spec, init_file, timeout=spec.timeout)
    wall = time.perf_counter() - t0
    summary = summarise(per_rank, spec)
    summary["backend"] = "nccl" if use_nccl else "gloo"
    summary["wall_seconds"] = wall
    return summary


# -- summary -------------------------------------------------------------------------


def grad_difference(grads: dict, ref: dict, rank: int, tp: int) -> tuple[float, float]:
    """Largest absolute difference over all LoRA gradients, and it relative to max |ref|."""
    from regather.tools.cpu.train import grad_gap

    worst, scale = grad_gap(grads, ref, rank, tp)
    return worst, (worst / scale if scale else 0.0)


def decision_counts(decisions: dict) -> dict:
    """How many adapters ran each strategy (the reasons are in ``decisions``)."""
    counts: dict[str, int] = {}
    for d in decisions.values():
        used = re.split(r"[ ,]", d, maxsplit=1)[0]  # "regather, input recomputed from ..."
        counts[used] = counts.get(used, 0) + 1
    return counts


def recompute_counts(decisions: dict) -> dict:
    """With recompute asked: how many adapters rebuild their input (by producer), how many keep it."""
    counts: dict[str, int] = {}
    for d in decisions.values():
        if ", input recomputed from " in d:
            key = "recomputed from " + d.split(", input recomputed from ", 1)[1]
        elif ", input kept (recompute asked: " in d:
            key = "kept"
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts


def summarise(per_rank: list, spec: BenchSpec) -> dict:
    """Rank 0's bytes, losses and gradients; step times are the slowest rank's per step."""
    from regather.tools.cpu.train import lean_output, recompute_clock

    rank0 = per_rank[0]
    ref = rank0["gather"]
    rows = {}
    for name in spec.strategies:
        res = rank0[name]
        # the gather path with the same output path: bit-identical wherever the GEMMs are the same (§3.7)
        path_ref = "gather-lean" if lean_output(name) and "gather-lean" in rank0 else "gather"
        slowest = [max(r[name]["step_time"][i] for r in per_rank) for i in range(spec.steps)]
        timed = slowest[spec.warmup:] or slowest
        comm = {k: int(v) for k, v in sorted(res["comm_bytes"].items())}
        ref_comm = ref["comm_bytes"]
        extra = {k: int(comm.get(k, 0) - ref_comm.get(k, 0)) for k in sorted(set(comm) | set(ref_comm))}
        grad_abs, grad_rel = grad_difference(res["grads"], ref["grads"], 0, spec.tp)
        path_abs, _ = grad_difference(res["grads"], rank0[path_ref]["grads"], 0, spec.tp)
        rows[name] = {
            "saved_bytes": int(res["saved_bytes"]),
            "saved_adapter_input_bytes": int(res["saved_adapter_input_bytes"]),
            "saved_bytes_by_label": res.get("saved_bytes_by_label", {}),
            "saved_dora_output_bytes": sum(n for k, n in res.get("saved_bytes_by_label", {}).items()
                                           if k.startswith("dora_output")),
            "comm_bytes": comm,
            "comm_bytes_total": sum(comm.values()),
            "comm_bytes_extra_vs_gather": extra,
            "comm_bytes_same_on_all_ranks": all(r[name]["comm_bytes"] == res["comm_bytes"] for r in per_rank),
            "step_times": slowest,
            "median_step_time": statistics.median(timed),
            "loss": res["loss"],
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(res["loss"], ref["loss"])),
            "max_abs_grad_diff": grad_abs,
            "max_rel_grad_diff": grad_rel,
            "same_output_path_as": path_ref,
            "max_abs_grad_diff_same_output_path": path_abs,
            **recompute_clock([r[name] for r in per_rank], spec.steps, spec.warmup),
            "allocated": over_frozen(res["allocated"], rank0["frozen"]["allocated"]),
            "adapters_by_strategy": decision_counts(res["decisions"]),
            "adapter_inputs": recompute_counts(res["decisions"]),
            "decisions": res["decisions"],
        }
    from regather.tools.cpu.train import base_strategy

    for name, row in rows.items():
        step_time_ratios(row, rows["gather"], "gather", spec.warmup)
        base = base_strategy(name)  # a variant against the strategy it varies (regather-recompute: regather)
        if base != name and base in rows:
            row["variant_of"] = base
            step_time_ratios(row, rows[base], "base", spec.warmup)
    out = {"spec": asdict(spec), "strategies": rows, "frozen": {"allocated": dict(rank0["frozen"]["allocated"])}}
    lean_vs_classic(out, spec.warmup)
    if spec.canonical:
        out["canonical_inputs"] = canonical_inputs(rows, spec)
    return out


# the fused linears whose input CanonicalLoRA's q/k/v and gate/up adapters read, and how many
# adapters (targets) each can hold
_SPLIT = {"linear_qkv": ("linear_q", "linear_k", "linear_v"), "linear_fc1": ("linear_fc1_gate", "linear_fc1_up")}


def canonical_inputs(rows: dict, spec: BenchSpec) -> dict:
    """What the q/k/v and gate/up adapters keep for LoRA-A, per strategy (measured: the
    ``adapter_input:linear_qkv`` / ``…:linear_fc1`` bytes), beside Megatron Bridge's
    ``CanonicalLoRA``, whose every such adapter gathers and keeps its own ``x_full = s*b*h``
    (on the gather path regather keeps exactly Bridge's bytes: tests/distributed/megatron/bridge/test_bridge_canonical.py)."""
    from regather.core.accounting import ADAPTER_INPUT

    elt = 2 if spec.dtype == "bfloat16" else 4
    x_full = spec.seq * spec.micro_batch * spec.hidden * elt
    adapters = sum(1 for names in _SPLIT.values() for n in names if n in spec.targets)
    out = {"x_full_bytes": x_full, "x_local_bytes": x_full // spec.tp, "layers": spec.layers,
           "adapters_per_layer": adapters, "bridge_bytes": spec.layers * adapters * x_full, "strategies": {}}
    for name, row in rows.items():
        labels = row["saved_bytes_by_label"]
        out["strategies"][name] = sum(int(labels.get(f"{ADAPTER_INPUT}:{base}", 0)) for base in _SPLIT)
    return out


def over_frozen(allocated: dict, frozen: dict) -> dict:
    """A model's allocator bytes of one step (:func:`regather.tools.cpu.train.step_bytes`, rank 0) and LoRA's share:
    ``kept_over_frozen`` / ``peak_over_frozen``, the same figures less the frozen model's (no LoRA, the decoder
    input requiring grad), and ``lora_grad_bytes`` (the LoRA weights' gradients, made in that backward)."""
    return {"kept": int(allocated["kept"]), "peak": int(allocated["peak"]),
            "kept_over_frozen": int(allocated["kept"]) - int(frozen["kept"]),
            "peak_over_frozen": int(allocated["peak"]) - int(frozen["peak"]),
            "lora_grad_bytes": int(allocated["lora_grad_bytes"])}


#: the lean output path's time against the classic one, when both ran: (lean variant, classic variant)
LEAN_PAIRS = (("regather", "regather-classic"), ("gather-lean", "gather"))


def lean_vs_classic(summary: dict, warmup: int) -> None:
    """``summary["lean_vs_classic"]``: for each pair of :data:`LEAN_PAIRS` that ran, the lean variant's step time
    against the classic one's (median ratio and paired ratio, the same run): what ``lean_transients`` costs."""
    rows, out = summary["strategies"], {}
    for lean, classic in LEAN_PAIRS:
        if lean in rows and classic in rows:
            pair = {"step_times": rows[lean]["step_times"], "median_step_time": rows[lean]["median_step_time"]}
            step_time_ratios(pair, rows[classic], "classic", warmup)
            out[lean] = {"classic": classic, "ratio": pair["step_time_ratio_vs_classic"],
                         "paired_ratio": pair["paired_step_time_ratio_vs_classic"]}
    if out:
        summary["lean_vs_classic"] = out


def step_time_ratios(row: dict, ref: dict, what: str, warmup: int) -> None:
    """Median-step ratio and paired ratio (median of per-step ratios: the same step index of
    both ran in the same rotated round) of ``row`` against ``ref``."""
    row[f"step_time_ratio_vs_{what}"] = row["median_step_time"] / ref["median_step_time"]
    pairs = [a / b for a, b in zip(row["step_times"], ref["step_times"])][warmup:]
    row[f"paired_step_time_ratio_vs_{what}"] = statistics.median(pairs) if pairs else 1.0

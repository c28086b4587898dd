"""Present a ``regather bench --moe`` summary: terminal tables, markdown, JSON (no chart).

Two tables: what each variant's LoRA-A inputs keep after the first forward, per adapter kind (mean
over the ranks), and per step what it sends, how long it takes and how far it is from gather and
from its own strategy. Below them the rows routed to each rank, the bytes of one more dispatch,
the decisions and the re-dispatch counts.
"""

from __future__ import annotations

import shlex

from regather.megatron.reasons import ALL_TARGETS, EXPERT_TARGETS
from regather.tools.bench import report
from regather.tools.cmdline import wrapped

KIND_ORDER = ALL_TARGETS + ("shared_experts.linear_fc1", "shared_experts.linear_fc2") + EXPERT_TARGETS


def per_expert(spec: dict) -> bool:
    """One LoRA pair per local expert asked (``--expert-lora per-expert``): ``share_expert_adapters`` off, or, in
    a bench.json written before the shapes were shared, ``per_expert``."""
    return spec.get("per_expert", not spec.get("share_expert_adapters", True))


def command_line(spec: dict, out: str | None = None) -> str:
    """The full ``regather bench --moe`` command that reproduces ``spec``."""
    opts = ["--moe", "--ep", spec["ep"], "--etp", spec["etp"], "--experts", spec["experts"],
            "--dispatcher", spec["dispatcher"], "--num-experts", spec["num_experts"], "--topk", spec["topk"],
            "--moe-ffn", spec["moe_ffn"]]
    if per_expert(spec):
        opts += ["--expert-lora", "per-expert"]
    if spec.get("shared_expert_ffn"):
        opts += ["--shared-expert-ffn", spec["shared_expert_ffn"]]
    if spec.get("moe_layer_freq", 1) != 1:
        opts += ["--moe-layer-freq", spec["moe_layer_freq"]]
    if out:
        opts += ["--out", out]
    return report.command_line(spec) + " " + " ".join(shlex.quote(str(o)) for o in opts)


#: what each column means (docs/design.md §7), the report's legend
COLUMNS = [
    ("LoRA-A inputs by adapter kind", "unique storages LoRA-A saved in the first forward (saved-tensor hooks), every "
                                      "layer's adapters of that kind summed, mean over the ranks: expert rows depend "
                                      "on each rank's routing, their mean over the expert-parallel group does not (it "
                                      "is what regather estimate models)"),
    ("retained", "every unique storage autograd saved in the first forward, parameters excluded, mean over the ranks"),
    ("LoRA kept, LoRA peak", "the allocator's bytes of one step (regather.core.allocated.AllocatedBytes, every "
                             "collective settled, the smallest of 2 steps) over the frozen model's (the same MoE GPT "
                             "without LoRA, decoder input requiring grad), mean over the ranks: kept = alive at the end "
                             "of the forward, peak = the most alive at once over forward + backward, LoRA's weight "
                             "gradients included; on fresh models of the run's weights (LoRA-B zero: every model "
                             "routes the batch as the frozen one does); measured on CPU"),
    ("comm", "bytes received per rank in one step under ring algorithms, every collective (megatron-core's dispatch "
             "included), mean over the ranks and the steps after the first (the first also checks each MoE layer's "
             "route once under the expert recompute: comm_bytes_first_step_mean in bench.json)"),
    ("extra vs gather / vs its strategy", "the variant's comm minus gather's / minus its strategy's without options, "
                                          "by kind"),
    ("median step ms", "the slowest rank's step time, median of the steps after the warm-up"),
    ("x gather, x its strategy", "median step time / the other's, and paired: the median of per-step ratios (the "
                                 "variants' steps interleave in one process group, order rotated each step)"),
    ("max Δloss, max Δgrad", "against gather / its strategy: the largest |loss difference| over the steps, the largest "
                             "|LoRA gradient difference| over every rank's last step; rel: divided by the "
                             "reference's largest |gradient| (bench.json: also against gather-lean for a lean "
                             "variant, *_vs_same_output_path: the lean row adapter's LoRA-B weight gradient is another "
                             "order, docs/design.md 3.7)"),
    ("re-dispatches", "rank 0's, by when they started (early: when the experts' output gradient arrived), their time "
                      "in flight per step and how much of it backward waited for"),
]
SAME_START = ("Every variant starts from the same full weights (GlobalLayout + full_weights) and sees the same "
              "batches.")


def _unit(summary: dict) -> tuple[str, float]:
    biggest = max(r["saved_bytes_mean"] for r in summary["strategies"].values())
    return ("MiB", 2.0**20) if biggest >= 8 * 2**20 else ("KiB", 1024.0)


def _signed(parts: dict, scale: float) -> str:
    cells = [f"{k.replace('_', '-')} {n / scale:+,.3f}" for k, n in parts.items() if n]
    return ", ".join(cells) or "0"


def kinds(summary: dict) -> list[str]:
    seen = {k for r in summary["strategies"].values() for k in r["adapter_input_by_kind_mean"]}
    return [k for k in KIND_ORDER if k in seen] + sorted(seen - set(KIND_ORDER))


def bytes_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    unit, scale = _unit(summary)
    ks = kinds(summary)
    head = ["variant"] + [k.replace("experts.", "expert ").replace("shared_expert ", "shared expert ") for k in ks] \
        + [f"all LoRA-A inputs {unit}", f"retained {unit}", f"LoRA kept {unit}", f"LoRA peak {unit}"]
    rows = []
    for name, r in report.ordered(summary):
        by = r["adapter_input_by_kind_mean"]
        a = r.get("allocated")  # absent in a summary from before they were measured
        rows.append([name] + [report.scaled(by.get(k, 0), scale) for k in ks]
                    + [report.scaled(r["adapter_input_bytes_mean"], scale), report.scaled(r["saved_bytes_mean"], scale)]
                    + ([report.scaled(a["kept_over_frozen"], scale), report.scaled(a["peak_over_frozen"], scale)]
                       if a else ["-", "-"]))
    return head, rows


def _resends(r: dict, steps: int) -> str:
    """Re-dispatches by when they started (early: when the experts' output gradient arrived, so the
    experts' backward overlaps them), their time from start to arrival and the part of it backward
    waited for, per step (rank 0)."""
    total: dict = {}
    for counts in (r.get("redispatches") or {}).values():
        for when, n in counts.items():
            total[when] = total.get(when, 0) + n
    if not total:
        return "-"
    flight, wait = total.get("flight_s", 0.0), total.get("wait_s", 0.0)
    hidden = f", {1 - wait / flight:.0%} hidden" if flight > 0 else ""
    return (f"{total.get('early', 0)} early / {total.get('late', 0)} late, in flight "
            f"{flight / steps * 1e3:.2f} ms/step, waited {wait / steps * 1e3:.2f}{hidden}")


def comm_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    unit, scale = _unit(summary)
    head = ["variant", f"comm {unit}/step", "extra vs gather", "extra vs its strategy"]
    rows = []
    for name, r in report.ordered(summary):
        base = r.get("variant_of")
        rows.append([name, report.scaled(sum(r["comm_bytes_per_step_mean"].values()), scale),
                     _signed(r["comm_bytes_extra_vs_gather"], scale) if name != "gather" else "-",
                     f"{_signed(r['comm_bytes_extra_vs_base'], scale)} (vs {base})" if base else "-"])
    return head, rows


def time_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "median step ms", "x gather (median / paired)", "x its strategy (median / paired)",
            "max Δloss vs gather", "max Δgrad vs gather (rel)", "vs its strategy: Δloss, Δgrad (rel)",
            "re-dispatches (rank 0)"]
    rows = []
    for name, r in report.ordered(summary):
        base = r.get("variant_of")
        rows.append([
            name,
            f"{r['median_step_time'] * 1e3:.1f}",
            report.ratio_cell(r, "gather"),
            report.ratio_cell(r, "base"),
            f"{r['max_abs_loss_diff']:.1e}",
            f"{r['max_abs_grad_diff']:.1e} ({r['max_rel_grad_diff']:.1e})",
            (f"{r['max_abs_loss_diff_vs_base']:.1e}, {r['max_abs_grad_diff_vs_base']:.1e} "
             f"({r['max_rel_grad_diff_vs_base']:.1e})") if base else "-",
            _resends(r, summary["spec"]["steps"]),
        ])
    return head, rows


def notes(summary: dict) -> list[str]:
    """Routing, the bytes of one more dispatch, the first step's extra, the decisions."""
    unit, scale = _unit(summary)
    rows = summary["strategies"]
    g = rows["gather"]
    out = ["rows routed to each rank's local experts in the first forward (per MoE layer): " + "; ".join(
        f"rank {i}: " + ", ".join(str(n) for n in per.values())
        for i, per in enumerate(g["routed_rows_first_forward_per_rank"]))]
    d = summary.get("dispatch_bytes_per_step_mean") or {}
    if d.get("h_wide") is not None:
        out.append(f"one more h-wide dispatch of the tokens per MoE layer and forward (accounting formula, gather's "
                   f"routing): {report.scaled(d['h_wide'], scale, 3)} {unit}/step")
    if d.get("rank_r_both_ways") is not None:
        out.append(f"rank-r rows along the route and back (shared LoRA-A before the dispatch): "
                   f"{report.scaled(d['rank_r_both_ways'], scale, 3)} {unit}/step")
    for name, r in report.ordered(summary):
        first = r.get("comm_bytes_first_step_extra_vs_base") if r.get("variant_of") else None
        if first and any(first.values()):
            out.append(f"{name}: first step vs {r['variant_of']} (with the one-time route check per MoE layer): "
                       f"{_signed(first, scale)} {unit}")
    for name, r in report.ordered(summary):
        step = r.get("first_step_routing_differs_from_gather")
        if step is not None:
            out.append(f"{name}: routing differs from gather's from step {step + 1} on (another summation order "
                       "moves near-tied router scores); its Δloss and Δgrad include the other routing")
    for name, r in report.ordered(summary):
        text = " + ".join(f"{n} {s}" for s, n in r["adapters_by_strategy"].items())
        inputs = r.get("adapter_inputs") or {}
        if inputs:
            text += "; inputs " + ", ".join(f"{k}: {n}" for k, n in inputs.items())
        out.append(f"{name}: adapters {text}")
    return out


def text_table(summary: dict) -> str:
    unit, _ = _unit(summary)
    ranks = summary["world"]
    lines = report.opening(summary, "regather bench --moe", ranks, spec_line(summary["spec"], ranks), COLUMNS,
                           [SAME_START])
    lines += [f"LoRA-A input bytes of the first forward by adapter kind, {unit}, mean over the {ranks} ranks:"]
    lines += report.text_rows(*bytes_rows(summary))
    lines += ["", f"communication per step, {unit}, mean over the ranks and the steps after the first:"]
    lines += report.text_rows(*comm_rows(summary))
    lines += ["", "step time (slowest rank) and parity (max over ranks and steps):"]
    lines += report.text_rows(*time_rows(summary))
    return "\n".join(lines + [""] + wrapped(notes(summary)))


def spec_line(spec: dict, world: int) -> str:
    experts = spec["experts"] + (", one LoRA pair per local expert" if per_expert(spec) else
                                 ", one LoRA-A shared by the local experts" if spec["experts"] == "grouped" else "")
    extra = (f", shared expert ffn {spec['shared_expert_ffn']}" if spec.get("shared_expert_ffn") else "") + \
        (f", MoE every {spec['moe_layer_freq']} layers (dense ffn {spec['ffn']})" if spec.get("moe_layer_freq", 1) > 1
         else "")
    return (f"MoE GPT {spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads, vocab {spec['vocab']}, "
            f"{spec['num_experts']} experts ({experts}), moe ffn {spec['moe_ffn']}, top-{spec['topk']}, "
            f"{spec['dispatcher']} dispatcher{extra}; TP={spec['tp']} + SP x EP={spec['ep']} x ETP={spec['etp']} "
            f"({world} ranks), seq {spec['seq']}, micro-batch {spec['micro_batch']} per DP rank, {spec['dtype']}, "
            f"LoRA rank {spec['lora_rank']} on {', '.join(spec['targets'])}; {spec['steps']} steps (Adam), first "
            f"{spec['warmup']} not timed"
            + ("; decoder input requires grad" if spec.get("input_requires_grad") else ""))


def markdown(summary: dict) -> str:
    spec, unit = summary["spec"], _unit(summary)[0]
    lines = report.header(summary, "regather bench --moe", summary["world"], spec_line(spec, summary["world"]))
    lines += report.markdown_legend(COLUMNS, [SAME_START])
    lines += [f"LoRA-A input bytes of the first forward by adapter kind ({unit}, mean over the ranks; per rank in "
              "bench.json: `adapter_input_by_kind_per_rank`):", ""]
    lines += report.markdown_rows(*bytes_rows(summary))
    lines += ["", f"Communication per step ({unit}, mean over the ranks and over the steps after the first):", ""]
    lines += report.markdown_rows(*comm_rows(summary))
    lines += ["", "Step time (slowest rank per step) and parity:", ""]
    lines += report.markdown_rows(*time_rows(summary))
    lines += [""] + [f"- {n}" for n in notes(summary)] + [""]
    if summary["backend"] == "gloo":
        lines.append(report.CPU_TIMES)
    return "\n".join(lines) + "\n"


def write(summary: dict, out_dir: str) -> list[str]:
    return report.write(summary, out_dir, markdown_of=markdown, chart_of=None)

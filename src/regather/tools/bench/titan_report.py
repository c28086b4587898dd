"""Present a ``regather bench --torchtitan`` summary: terminal tables, markdown, JSON (no chart).

Three tables: what each variant's first forward keeps per adapter kind beside torchtitan's LoRA and
the frozen model; what its first step sends, by phase, and the extra against torchtitan's LoRA; its
step time against torchtitan's LoRA and against its own strategy, and its parity with torchtitan's.
Below them every variant's decisions.
"""

from __future__ import annotations

from regather.tools.bench import report
from regather.tools.bench.titan import PHASES, TITAN_TARGETS
from regather.tools.cmdline import wrapped


def command_line(spec: dict, out: str | None = None) -> str:
    """The full ``regather bench --torchtitan`` command that reproduces ``spec``."""
    rest = report.command_line(spec, out)[len("regather bench "):]
    extra = ([f"--ac {spec['ac']}"] if spec.get("ac", "none") != "none" else []) + (["--compile"] if spec.get("compile") else [])
    return " ".join(["regather bench --torchtitan", *extra, rest])


#: what the first-step tables say under --compile, where only the allocator counts
NOT_COUNTED = ("not counted under --compile: the collective counter's dispatch mode and the saved-tensor hooks "
               "would make Dynamo recompile the blocks; bytes are the allocator's")


#: what each column means (docs/design.md §7), the report's legend
COLUMNS = [
    ("wqkv ... w3, all LoRA-A inputs", "what the adapters of that kind saved for LoRA-A in the first forward, every "
                                       "layer summed (saved-tensor hooks; torchtitan's LoRALinear labels nothing: its "
                                       "LoRA-A calls are labelled for the count, numerics unchanged; w1 and w3 read "
                                       "one storage, counted under w1; wo's input is the attention's own saved output, "
                                       "counted there)"),
    ("LoRA over frozen", "retained minus the frozen model's (no adapter, same run): the LoRA-A inputs plus the rank-r "
                         "tensors LoRA-B keeps"),
    ("retained", "unique storages autograd saved in the first forward, parameters excluded, rank 0 (every rank's "
                 "equal)"),
    ("LoRA over frozen, allocator", "what the forward leaves alive by the allocator's count, over the frozen model's "
                                    "(regather.core.allocated.AllocatedBytes, the smallest of a few steps): the figure "
                                    "that counts under --ac and --compile, where saved-tensor hooks see neither what "
                                    "a checkpoint caches nor what a compiled graph saves"),
    ("LoRA peak over frozen", "the most alive at once over one forward + backward by the allocator's count (every "
                              "collective settled, the smallest of 2 steps after training, LoRA's weight gradients "
                              "included), over the frozen model's; not under --compile (compiled blocks refuse the "
                              "count's dispatch mode); torchtitan's front end runs the classic output path"),
    ("forward / backward / optimizer / step", "bytes received per rank under ring algorithms by phase of the first "
                                              "step, every collective (DTensor's redistributions included); extra: "
                                              "minus torchtitan's LoRA, by kind"),
    ("median step ms", "the slowest rank's step time, median of the steps after the warm-up"),
    ("x torchtitan, x its strategy", "median step time / the other's, and paired: the median of per-step ratios (the "
                                     "variants' steps interleave in one process group, order rotated each step)"),
    ("max Δloss, max Δgrad", "against torchtitan's LoRA: the largest |loss difference| over the steps, the largest "
                             "|gradient difference| of the last step's trainable gradients (full tensors); rel: "
                             "divided by torchtitan's largest |gradient|"),
]
SAME_START = "Every variant starts from the same parameter values (each from its name) and sees the same batches."


def counted(summary: dict) -> list[str]:
    """Which bytes count for this run: under --ac the hooks are blind inside the checkpointed blocks."""
    ac = summary["spec"].get("ac", "none")
    if ac == "none" or _compiled(summary):
        return []
    return [f"--ac {ac}: the saved-tensor hooks see nothing a checkpointed block keeps, so the hook columns (LoRA-A "
            "inputs, LoRA over frozen, retained) count only what is saved outside the blocks; the allocator column "
            "is the figure that counts."]


def _compiled(summary: dict) -> bool:
    return bool(summary["spec"].get("compile"))


def _unit(summary: dict) -> tuple[str, float]:
    key = "allocated_bytes" if _compiled(summary) else "saved_bytes"
    biggest = max(r[key] for r in summary["strategies"].values())
    return ("MiB", 2.0**20) if biggest >= 8 * 2**20 else ("KiB", 1024.0)


def _signed(parts: dict, scale: float) -> str:
    return ", ".join(f"{k.replace('_', '-')} {n / scale:+,.2f}" for k, n in parts.items() if n) or "0"


def kinds(summary: dict) -> list[str]:
    seen = {k for r in summary["strategies"].values() for k in r["adapter_input_by_kind"]}
    targets = [t for t in TITAN_TARGETS if t in summary["spec"]["targets"]]
    return targets + sorted(seen - set(targets))


def bytes_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    unit, scale = _unit(summary)
    if _compiled(summary):
        rows = [["frozen (no LoRA)", report.scaled(0, scale)]]
        rows += [[name, report.scaled(r["allocated_over_frozen"], scale)] for name, r in report.ordered(summary)]
        return ["variant", f"LoRA over frozen, allocator {unit}"], rows
    ks = kinds(summary)
    head = ["variant"] + ks + [f"all LoRA-A inputs {unit}", f"LoRA over frozen {unit}", f"retained {unit}"]
    frozen = summary["frozen"]["saved_bytes"]
    rows = [["frozen (no LoRA)"] + ["-"] * len(ks) + ["-", report.scaled(0, scale), report.scaled(frozen, scale)]]
    for name, r in report.ordered(summary):
        by = r["adapter_input_by_kind"]
        rows.append([name] + [report.scaled(by.get(k, 0), scale) for k in ks]
                    + [report.scaled(r["adapter_input_bytes"], scale), report.scaled(r["lora_bytes_over_frozen"], scale),
                       report.scaled(r["saved_bytes"], scale)])
    if "allocated_bytes" in summary["frozen"]:  # summaries before --ac / --compile have no allocator column
        head.append(f"LoRA over frozen, allocator {unit}")
        rows[0].append(report.scaled(0, scale))
        for row, (_, r) in zip(rows[1:], report.ordered(summary)):
            row.append(report.scaled(r["allocated_over_frozen"], scale))
    if summary["frozen"].get("step_bytes"):  # summaries before issue 45 have no peak column
        head.append(f"LoRA peak over frozen {unit}")
        rows[0].append(report.scaled(0, scale))
        for row, (_, r) in zip(rows[1:], report.ordered(summary)):
            row.append(report.scaled(r["allocated"]["peak_over_frozen"], scale) if r.get("allocated") else "-")
    return head, rows


def comm_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    unit, scale = _unit(summary)
    head = ["variant"] + [f"{p} {unit}" for p in PHASES] + [f"step {unit}", f"extra vs torchtitan ({unit})"]
    rows = []
    for name, r in report.ordered(summary):
        phases = [report.scaled(sum(r["comm_bytes"][p].values()), scale) for p in PHASES]
        rows.append([name] + phases + [report.scaled(sum(r["comm_bytes_total"].values()), scale),
                                       _signed(r["comm_bytes_extra_vs_torchtitan"], scale)
                                       if name != summary["baseline"] else "-"])
    return head, rows


def time_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "median step ms", "x torchtitan (median / paired)", "x its strategy (median / paired)",
            "max Δloss", "max Δgrad (rel)", "vs torchtitan's LoRA"]
    rows = []
    for name, r in report.ordered(summary):
        same = "(reference)" if name == summary["baseline"] else \
            "bit-identical" if r["bit_identical_to_torchtitan"] else "differs (summation order)"
        rows.append([name, f"{r['median_step_time'] * 1e3:.1f}", report.ratio_cell(r, "torchtitan"),
                     f"{report.ratio_cell(r, 'base')} vs {r['variant_of']}" if r.get("variant_of") else "-",
                     f"{r['max_abs_loss_diff']:.1e}", f"{r['max_abs_grad_diff']:.1e} ({r['max_rel_grad_diff']:.1e})",
                     same])
    return head, rows


def notes(summary: dict) -> list[str]:
    """The decisions of every variant's adapters."""
    out = []
    for name, r in report.ordered(summary):
        if not r["decisions"]:
            out.append(f"{name}: torchtitan's LoRALinear (no decisions; its LoRA-A labelled for the count)")
            continue
        text = " + ".join(f"{n} {s}" for s, n in r["adapters_by_strategy"].items())
        inputs = r.get("adapter_inputs") or {}
        if inputs:
            text += "; inputs " + ", ".join(f"{k}: {n}" for k, n in inputs.items())
        out.append(f"{name}: adapters {text}")
    return out


def text_table(summary: dict) -> str:
    unit, _ = _unit(summary)
    what = "the allocator's bytes" if _compiled(summary) else f"LoRA-A inputs by adapter kind: {', '.join(kinds(summary))}"
    lines = report.opening(summary, "regather bench --torchtitan", summary["spec"]["tp"], spec_line(summary["spec"]),
                           COLUMNS, [SAME_START] + counted(summary))
    lines += [f"saved in the first forward per rank, {unit} ({what}):"]
    lines += report.text_rows(*bytes_rows(summary))
    lines += ["", f"communication of the first step per rank, {unit}:"]
    lines += wrapped([NOT_COUNTED]) if _compiled(summary) else report.text_rows(*comm_rows(summary))
    lines += ["", "step time (slowest rank) and parity with torchtitan's LoRA:"]
    lines += report.text_rows(*time_rows(summary))
    return "\n".join(lines + [""] + wrapped(notes(summary)))


def spec_line(spec: dict) -> str:
    kv = f" ({spec['kv_heads']} kv)" if spec.get("kv_heads") else ""
    return (f"torchtitan llama3, {spec['layers']} layers, dim {spec['hidden']}, {spec['heads']} heads{kv}, "
            f"ffn {spec['ffn']}, vocab {spec['vocab']}; its sharding config, TP={spec['tp']} + SP, partial_dtensor; "
            f"seq {spec['seq']}, batch {spec['micro_batch']}, {spec['dtype']}, LoRA rank {spec['lora_rank']} alpha "
            f"{spec['lora_alpha']} on {', '.join(spec['targets'])}; {spec['steps']} steps (torchtitan's "
            f"clip_grad_norm_ and AdamW, lr {spec['lr']}), first {spec['warmup']} not timed{_settings(spec)}")


def _settings(spec: dict) -> str:
    ac = {"selective": "torchtitan's SelectiveAC", "full": "torchtitan's FullAC"}.get(spec.get("ac", "none"))
    done = ([ac] if ac else []) + (["apply_compile (each block, fullgraph, inductor)"] if spec.get("compile") else [])
    return "; " + ", ".join(done) if done else ""


def header(summary: dict) -> list[str]:
    lines = report.header(summary, "regather bench --torchtitan", summary["spec"]["tp"], spec_line(summary["spec"]))
    software = next(i for i, line in enumerate(lines) if line.startswith("- software:"))
    env = summary["env"]
    lines[software] = (f"- software: Python {env['python']}, torch {env['torch']}, torchtitan "
                       f"{summary.get('torchtitan', 'unknown')}, regather {env.get('git', 'unknown')}")
    return lines


def markdown(summary: dict) -> str:
    unit = _unit(summary)[0]
    lines = header(summary) + report.markdown_legend(COLUMNS, [SAME_START] + counted(summary))
    what = "the allocator's bytes alive at the end of the forward" if _compiled(summary) else "LoRA-A inputs by adapter kind"
    lines += [f"Saved in the first forward, per rank ({unit}; {what}):", ""]
    lines += report.markdown_rows(*bytes_rows(summary))
    lines += ["", f"Communication of the first step, per rank ({unit}):", ""]
    lines += [NOT_COUNTED] if _compiled(summary) else report.markdown_rows(*comm_rows(summary))
    lines += ["", "Step time (slowest rank per step) and parity with torchtitan's LoRA:", ""]
    lines += report.markdown_rows(*time_rows(summary))
    lines += [""] + [f"- {n}" for n in notes(summary)] + [""]
    if summary["backend"] == "gloo":
        lines.append(report.CPU_TIMES)
    return "\n".join(lines) + "\n"


def write(summary: dict, out_dir: str) -> list[str]:
    return report.write(summary, out_dir, markdown_of=markdown, chart_of=None)

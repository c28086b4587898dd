"""Present a benchmark summary: terminal table, markdown, JSON, PNG chart.

Every output opens with what ran, on what and how (:func:`opening`: the model and run, "measured on
CPU" or GPU, the hardware, the torch and megatron-core versions, the exact command) and what each column
means (:data:`COLUMNS`, :func:`legend`), before the tables.
"""

from __future__ import annotations

import json
import os
import platform
import shlex

from regather.tools.cmdline import WIDTH, wrapped

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def environment() -> dict:
    """Hardware and software the run used."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:  # the installed distribution's version: importing megatron.core would print its warnings
        megatron = version("megatron-core")
    except PackageNotFoundError:
        megatron = "not installed"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "git": _git_revision(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron,
        "platform": platform.platform(),
    }


def _git_revision() -> str:
    """The checkout's commit, with ``+dirty`` when src/ has uncommitted changes."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=os.path.dirname(here),
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("+dirty" if dirty else "")


def command_line(spec: dict, out: str | None = None) -> str:
    """The full ``regather bench`` command that reproduces ``spec`` (every option explicit)."""
    opts = ["--hidden", spec["hidden"], "--layers", spec["layers"], "--heads", spec["heads"]]
    if spec.get("kv_heads"):
        opts += ["--kv-heads", spec["kv_heads"]]
    opts += ["--ffn", spec["ffn"], "--vocab", spec["vocab"], "--tp", spec["tp"], "--seq", spec["seq"],
             "--micro-batch", spec["micro_batch"], "--dtype", spec["dtype"], "--lora-rank", spec["lora_rank"],
             "--lora-alpha", spec["lora_alpha"], "--targets", ",".join(spec["targets"]),
             "--steps", spec["steps"], "--warmup", spec["warmup"], "--strategies", ",".join(spec["strategies"])]
    if spec.get("input_requires_grad"):
        opts += ["--input-requires-grad"]
    if spec.get("canonical"):
        opts += ["--canonical"]
    if spec.get("peft", "lora") != "lora":
        opts += ["--peft", spec["peft"]] + (["--recompute-dora-output"] if spec.get("recompute_dora_output") else [])
    if out:
        opts += ["--out", out]
    return "regather bench " + " ".join(shlex.quote(str(o)) for o in opts)


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _comm(row: dict, key: str) -> str:
    parts = [f"{k.replace('_', '-')} {_mb(v)}" for k, v in row[key].items() if v]
    return ", ".join(parts) or "0"


def ordered(summary: dict) -> list[tuple[str, dict]]:
    """``(name, row)`` in the order the run listed the strategies (gather first)."""
    rows_ = summary["strategies"]
    names = [n for n in summary["spec"].get("strategies", ()) if n in rows_]
    return [(n, rows_[n]) for n in names + [n for n in rows_ if n not in names]]


def rows(summary: dict) -> list[list[str]]:
    """One list of cells per strategy (shared by the terminal and markdown tables)."""
    out = []
    for name, r in ordered(summary):
        out.append([
            name,
            _mb(r["saved_bytes"]),
            _mb(r["saved_adapter_input_bytes"]),
            *allocated_cells(r),
            _mb(r["comm_bytes_total"]),
            _comm(r, "comm_bytes_extra_vs_gather") if name != "gather" else "-",
            f"{r['median_step_time'] * 1e3:.1f}",
            f"{r['step_time_ratio_vs_gather']:.3f}",
            f"{r['paired_step_time_ratio_vs_gather']:.3f}",
            (f"{r['step_time_ratio_vs_base']:.3f} / {r['paired_step_time_ratio_vs_base']:.3f} vs {r['variant_of']}"
             if r.get("variant_of") else "-"),
            f"{r['max_abs_loss_diff']:.1e}",
            f"{r['max_abs_grad_diff']:.1e} ({r['max_rel_grad_diff']:.1e})",
            _adapters(r),
        ])
    return out


def _adapters(r: dict) -> str:
    text = " + ".join(f"{n} {d}" for d, n in r["adapters_by_strategy"].items())
    inputs = r.get("adapter_inputs") or {}
    if inputs:
        done = sum(n for k, n in inputs.items() if k != "kept")
        text += f"; inputs: {done} recomputed, {inputs.get('kept', 0)} kept"
    return text


def allocated_cells(r: dict) -> list[str]:
    """LoRA's kept and peak bytes over the frozen model, the allocator's (``-`` in a summary from before they were
    measured)."""
    a = r.get("allocated")
    return [_mb(a["kept_over_frozen"]), _mb(a["peak_over_frozen"])] if a else ["-", "-"]


HEADER = ["strategy", "retained MiB", "adapter-input MiB", "LoRA kept MiB", "LoRA peak MiB", "comm MiB/step",
          "extra comm vs gather (MiB)",
          "median step ms", "x gather", "x gather (paired)", "x variant's strategy (median / paired)",
          "max Δloss", "max Δgrad (rel)", "adapters"]

#: what each column of the dense bench means (docs/design.md §7), its report's legend
COLUMNS = [
    ("retained", "unique storages autograd saved for backward in the first forward, parameters excluded "
                 "(counted by saved-tensor hooks), rank 0"),
    ("adapter-input", "the part of retained that LoRA-A saved"),
    ("LoRA kept, LoRA peak", "the allocator's bytes (regather.core.allocated.AllocatedBytes, every collective "
                             "settled; the smallest of 2 steps after training, rank 0) over the frozen model's (the "
                             "same GPT without LoRA, decoder input requiring grad): kept = alive at the end of the "
                             "forward, peak = the most alive at once over forward + backward, LoRA's weight "
                             "gradients included; measured on CPU"),
    ("comm", "bytes received per rank in one training step under ring algorithms, every collective (megatron-core's "
             "own included); extra: minus gather's, by kind"),
    ("median step ms", "the slowest rank's step time, median of the steps after the warm-up"),
    ("x gather", "median step time / gather's, measured in the same process group, the strategies' steps "
                 "interleaved; paired: the median of the per-step ratios"),
    ("x variant's strategy", "a variant (regather-plain, regather-classic, ...-recompute) against the strategy it "
                             "varies, median / paired; regather-classic: regather with the classic output path "
                             "(lean_transients=False), gather-lean: gather with the lean one (lean_transients=True)"),
    ("max Δloss, max Δgrad", "against gather: the largest |loss difference| over the steps, the largest |LoRA "
                             "gradient difference| of the last step (rank 0); rel: divided by the largest |gradient|. "
                             "The lean output path changes LoRA-B's weight gradient on row-parallel bases under SP by "
                             "rounding (docs/design.md 3.7): bench.json's max_abs_grad_diff_same_output_path is against "
                             "gather-lean for a lean variant"),
]
#: the sentence every CPU report carries
CPU_TIMES = "CPU times show relative cost only; absolute times need a GPU."


def measured_on(summary: dict) -> str:
    """``"CPU (gloo)"`` or ``"GPU (nccl)"``: what the figures were measured on."""
    return "GPU (nccl)" if summary.get("backend") == "nccl" else f"CPU ({summary.get('backend', 'gloo')})"


def opening(summary: dict, title: str, ranks: int, spec_line: str, columns: list, notes: list[str] = ()) -> list[str]:
    """The terminal report's first lines: what ran (the model and run, the command), on what (the hardware
    and software, measured on CPU or GPU), what each column means (``columns``: ``(name, meaning)``), and
    ``notes`` on how the figures were obtained."""
    env = summary.get("env", {})
    hw = f"{env.get('cpu_count', '?')} x {env.get('cpu', 'unknown CPU')}" + (f", GPU {env['gpu']}" if env.get("gpu")
                                                                               else "")
    lines = [f"{title}: {spec_line}",
             f"measured on {measured_on(summary)}: {ranks} ranks on {hw}; Python {env.get('python', '?')}, torch "
             f"{env.get('torch', '?')}, {software(summary)}, regather {env.get('git', 'unknown')}"
             + (f"; {summary['wall_seconds']:.0f} s wall" if "wall_seconds" in summary else ""),
             f"command: {summary.get('command', '(not recorded)')}",
             "columns:"]
    lines += [f"  {name}: {meaning}" for name, meaning in columns]
    lines += list(notes)
    if summary.get("backend", "gloo") == "gloo":
        lines.append(CPU_TIMES)
    return wrapped(lines) + [""]


def software(summary: dict) -> str:
    """The framework the run measured, with its version."""
    if summary.get("mode") == "torchtitan":
        return f"torchtitan {summary.get('torchtitan', 'unknown')}"
    return f"megatron-core {summary.get('env', {}).get('megatron_core', '?')}"


def markdown_legend(columns: list, notes: list[str] = ()) -> list[str]:
    """What each column means, as markdown (after the header, before the tables)."""
    return (["What each column means (docs/design.md §7):", ""] + [f"- *{name}*: {meaning}" for name, meaning in columns]
            + ([""] + list(notes) if notes else []) + [""])


def scaled(n: float, scale: float, digits: int = 2) -> str:
    """``n / scale`` with thousands separators and ``digits`` decimals (a table cell)."""
    return f"{n / scale:,.{digits}f}"


def ratio_cell(r: dict, what: str) -> str:
    """``median / paired`` step-time ratio of a summary row against ``what`` ("-" where absent)."""
    if f"step_time_ratio_vs_{what}" not in r:
        return "-"
    return f"{r[f'step_time_ratio_vs_{what}']:.3f} / {r[f'paired_step_time_ratio_vs_{what}']:.3f}"


#: Columns the terminal output fits in; bench.md (``--out``) and bench.json carry every table whole.


def text_rows(head: list[str], rows: list[list[str]], width: int = WIDTH) -> list[str]:
    """An aligned terminal table: first column left, the others right, a dashed rule under the head.
    Columns that would run past ``width`` continue in a table below, which repeats the first column."""
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    blocks, used = [[0]], widths[0]
    for i in range(1, len(head)):
        if used + 2 + widths[i] > width and len(blocks[-1]) > 1:
            blocks.append([0])
            used = widths[0]
        blocks[-1].append(i)
        used += 2 + widths[i]

    def line(cells, cols):
        return "  ".join(cells[i].ljust(widths[i]) if i == 0 else cells[i].rjust(widths[i]) for i in cols)

    out: list[str] = []
    for cols in blocks:
        out += ([""] if out else []) + [line(head, cols), "  ".join("-" * widths[i] for i in cols)]
        out += [line(r, cols) for r in rows]
    return out


def markdown_rows(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: first column left, the others right-aligned."""
    return (["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def text_table(summary: dict) -> str:
    cells = rows(summary)
    lines = opening(summary, "regather bench", summary["spec"]["tp"], _spec_line(summary["spec"]), COLUMNS)
    lines += text_rows(HEADER[:-1], [r[:-1] for r in cells])  # adapters: listed below
    lines += ["", "adapters running each strategy:"] + wrapped([f"{r[0]}: {r[-1]}" for r in cells])
    if summary.get("canonical_inputs"):
        lines += [""] + wrapped(canonical_lines(summary))
    timed = recompute_lines(summary)
    if timed:
        lines += [""] + wrapped([RECOMPUTE_TIME + ":"] + [f"  {t}" for t in timed])
    lean = lean_lines(summary)
    if lean:
        lines += [""] + wrapped([LEAN_TIME + ":"] + [f"  {t}" for t in lean])
    if summary["spec"].get("peft") == "dora":
        lines += ["", "DoRA's kept pre-magnitude output z per rank (saved_dora_output_bytes): " + ", ".join(
            f"{name} {_mb(row['saved_dora_output_bytes'])} MiB" for name, row in summary["strategies"].items())]
    return "\n".join(lines)


#: what the lean-against-classic lines are
LEAN_TIME = ("the lean output path against the classic (lean_transients, docs/design.md 3.7): step time ratio, median "
             "/ paired, in the same run")


def lean_lines(summary: dict) -> list[str]:
    """Per lean variant whose classic twin ran, its step time against the twin's."""
    return [f"{n} / {r['classic']}: {r['ratio']:.3f} / {r['paired_ratio']:.3f}"
            for n, r in summary.get("lean_vs_classic", {}).items()]


#: what the recompute lines are
RECOMPUTE_TIME = ("time inside the producers' recomputes (the norm / activation rerun in backward; clocked around "
                  "each call, slowest rank per step, median after warm-up)")


def recompute_lines(summary: dict) -> list[str]:
    """Per variant with producers, the time its recomputes took per step and their share of the step."""
    return [f"{n}: {r['median_recompute_time'] * 1e3:.2f} ms per step, {r['recompute_share_of_step'] * 100:.2f} % "
            "of the step" for n, r in ordered(summary) if "median_recompute_time" in r]


def canonical_lines(summary: dict) -> list[str]:
    """CanonicalLoRA's q/k/v and gate/up adapter inputs per strategy beside Bridge's figure."""
    c = summary["canonical_inputs"]
    x_full, layers, n = c["x_full_bytes"], c["layers"], c["adapters_per_layer"]
    out = [f"CanonicalLoRA, LoRA-A inputs of the {n} q/k/v + gate/up adapters a layer, {layers} layers, per rank "
           f"(x_full = s*b*h = {_mb(x_full)} MiB, x_local = x_full/{summary['spec']['tp']}):",
           f"  Megatron Bridge CanonicalLoRA: {n} x_full a layer (each adapter gathers and keeps its own) = "
           f"{_mb(c['bridge_bytes'])} MiB"]
    for name, nbytes in c["strategies"].items():
        out.append(f"  {name}: {_mb(nbytes)} MiB = {nbytes / (x_full * layers):.2f} x_full a layer "
                   f"({nbytes / c['bridge_bytes']:.1%} of Bridge's)" if c["bridge_bytes"] else f"  {name}: {nbytes} B")
    return out


def _spec_line(spec: dict) -> str:
    kv = f" ({spec['kv_heads']} kv)" if spec.get("kv_heads") else ""
    return (f"GPT {spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads{kv}, ffn {spec['ffn']}, "
            f"vocab {spec['vocab']}; TP={spec['tp']} + SP, seq {spec['seq']}, micro-batch {spec['micro_batch']}, "
            f"{spec['dtype']}, LoRA rank {spec['lora_rank']} on {', '.join(spec['targets'])}; "
            f"{spec['steps']} steps, first {spec['warmup']} not timed"
            + ("; decoder input requires grad" if spec.get("input_requires_grad") else "")
            + ("; CanonicalLoRA, gated SwiGLU MLP" if spec.get("canonical") else "")
            + ("; DoRA" + (", output rebuilt" if spec.get("recompute_dora_output") else "")
               if spec.get("peft") == "dora" else ""))


def header(summary: dict, title: str, ranks: int, spec_line: str) -> list[str]:
    """The report's first lines: the command, hardware, software, model and wall time."""
    env = summary["env"]
    hw = f"{env['cpu_count']} x {env['cpu']}" + (f", GPU {env['gpu']}" if env.get("gpu") else "")
    return [
        f"# {title}",
        "",
        f"- command: `{summary['command']}`",
        f"- measured on {measured_on(summary)}: {hw}, {ranks} ranks",
        f"- software: Python {env['python']}, torch {env['torch']}, megatron-core {env['megatron_core']}, "
        f"regather {env.get('git', 'unknown')}",
        f"- model/run: {spec_line}",
        f"- wall time: {summary['wall_seconds']:.0f} s",
        "",
    ]


def markdown(summary: dict) -> str:
    spec = summary["spec"]
    lines = header(summary, "regather bench", spec["tp"], _spec_line(spec)) + markdown_legend(COLUMNS) + [
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" if i == 0 or i == len(HEADER) - 1 else "---:" for i in range(len(HEADER))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows(summary)]
    if summary.get("canonical_inputs"):
        head, *body = canonical_lines(summary)
        lines += ["", head, ""] + [f"- {line.strip()}" for line in body] + [
            "", "On the gather path regather's CanonicalLoRA keeps exactly the bytes of Bridge's (counted by",
            "storage in tests/distributed/megatron/bridge/test_bridge_canonical.py); regather and lowrank keep one x_local per",
            "fused linear, shared by its adapters; with recompute, the norm's input, which the norm keeps anyway."]
    timed = recompute_lines(summary)
    if timed:
        lines += ["", RECOMPUTE_TIME[0].upper() + RECOMPUTE_TIME[1:] + ":", ""] + [f"- {t}" for t in timed] + [""]
    lean = lean_lines(summary)
    if lean:
        lines += ["", LEAN_TIME[0].upper() + LEAN_TIME[1:] + ":", ""] + [f"- {t}" for t in lean] + [""]
    if summary["backend"] == "gloo":
        lines.append(CPU_TIMES)
    return "\n".join(lines) + "\n"


def chart(summary: dict, path: str) -> None:
    """Three panels: adapter-input vs other retained bytes, comm bytes by kind, step-time ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in ordered(summary)]
    rs = [r for _, r in ordered(summary)]
    fig, axes = plt.subplots(1, 3, figsize=(13 + max(0, len(names) - 4), 4.5))
    adapter = [r["saved_adapter_input_bytes"] / 2**20 for r in rs]
    other = [(r["saved_bytes"] - r["saved_adapter_input_bytes"]) / 2**20 for r in rs]
    axes[0].bar(names, other, label="other saved tensors", color="#bbbbbb")
    axes[0].bar(names, adapter, bottom=other, label="LoRA-A input", color="#d62728")
    axes[0].set_ylabel("MiB retained at end of forward")
    axes[0].legend(fontsize=8)
    bottom = [0.0] * len(rs)
    for kind in KINDS:
        vals = [r["comm_bytes"].get(kind, 0) / 2**20 for r in rs]
        if any(vals):
            axes[1].bar(names, vals, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, vals)]
    axes[1].set_ylabel("MiB received per rank per step")
    axes[1].legend(fontsize=8)
    ratios = [r["step_time_ratio_vs_gather"] for r in rs]
    axes[2].bar(names, ratios, color="#1f77b4")
    axes[2].axhline(1.0, color="k", lw=0.8)
    axes[2].set_ylabel("median step time / gather")
    axes[2].set_ylim(0, max(ratios) * 1.15)
    for ax in axes:  # variant names are long
        ax.tick_params(axis="x", labelrotation=30 if len(names) > 4 else 0, labelsize=8)
    spec, env = summary["spec"], summary["env"]
    fig.suptitle(f"regather bench: h={spec['hidden']} L={spec['layers']} TP={spec['tp']} s={spec['seq']} "
                 f"b={spec['micro_batch']} {spec['dtype']} r={spec['lora_rank']} "
                 f"({summary['backend']}, {env['cpu_count']} CPUs{', ' + env['gpu'] if env.get('gpu') else ''})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(summary: dict, out_dir: str, markdown_of=markdown, chart_of=chart) -> list[str]:
    """Write ``bench.json``, ``bench.md`` and (with ``chart_of``) ``bench.png`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("bench.json", "bench.md", "bench.png")]
    with open(paths[0], "w") as f:
        json.dump(summary, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown_of(summary))
    if chart_of is None:
        return paths[:2]
    chart_of(summary, paths[2])
    return paths

"""``regather demo``: a short LoRA fine-tune, gather vs regather vs regather + recompute.

A real megatron-core ``GPTModel`` (local spec) with LoRA on linear_qkv,
linear_proj, linear_fc1 and linear_fc2 learns the byte-level text shipped in
``regather/data/tiny_corpus.txt`` with TP=2 and sequence parallelism on two CPU
ranks (gloo). Three runs train from the same weights on the same batches in one
process group, alternating step by step, so their step times compare fairly:
the gather path (with the lean output path regather runs, ``LoRA(lean_transients=True)``: the classic one differs
in LoRA-B's weight gradient on row-parallel targets by rounding), regather, and regather with
``recompute_adapter_inputs=True``
(qkv/fc1/fc2 inputs rebuilt in backward from what their producer keeps). The demo
prints every loss (they must be identical), every adapter's decision in the
recompute run (which input is recomputed, from what, and why one is kept), the
retained activation bytes by adapter and the collective bytes of one step, and
the step times with the time the recompute itself took, clocked around each rerun
(the step-time ratios on 2 CPU ranks at toy sizes are noise, not a cost: the report
says so). It exits non-zero if the losses differ.
"""

from __future__ import annotations

import textwrap
from importlib import resources

from regather.megatron.reasons import ELIGIBLE_BASES
from regather.tools.estimate.vocabulary import add_command
from regather.tools.shapes import tp_problems

#: the gather path with the lean output path (LoRA(lean_transients=True)), which regather runs by default: the
#: three runs do the same GEMMs, so their losses are identical (Bridge's classic output path differs from them in
#: LoRA-B's weight gradient on row-parallel targets under SP by rounding, docs/design.md 3.7)
STRATEGIES = ("gather-lean", "regather", "regather-recompute")
WIDTH = 120  # the report's lines wrap here
LABELS = {"gather-lean": "gather", "regather": "regather", "regather-recompute": "+recompute"}
LABEL = 40  # the bytes table's first column
DESCRIPTION = (
    "A short LoRA fine-tune of a real megatron-core GPTModel on the text shipped with regather, TP + sequence "
    "parallelism on CPU gloo ranks: gather, regather and regather + recompute_adapter_inputs trained from the same "
    "weights on the same batches, steps interleaved. Prints every loss (identical on every path, or the exit status "
    "is 1), every adapter's decision, the bytes LoRA-A keeps and the collectives' bytes, counted, and the step times "
    "with the time the recompute itself took.")


def load_corpus():
    """The corpus as a uint8 tensor (torch imported here: the command's parser and refusals load no torch)."""
    import torch

    data = resources.files("regather").joinpath("data/tiny_corpus.txt").read_bytes()
    return torch.tensor(list(data), dtype=torch.uint8)


def _rank_main(rank, world_size, cfg, tokens):
    from regather.tools.cpu.train import compare_strategies

    def progress(name, step, seconds):
        if rank == 0 and name == STRATEGIES[-1] and (step + 1) % 10 == 0:
            print(f"  step {step + 1:3d}/{cfg.steps} done", flush=True)

    return compare_strategies(rank, world_size, cfg, STRATEGIES, tokens=tokens, progress=progress)


def _labelled(result: dict, *names: str) -> int:
    """Saved LoRA-A input bytes of the adapters on these base layers (all layers)."""
    labels = result["saved_bytes_by_label"]
    return sum(labels.get(f"adapter_input:{name}", 0) for name in names)


def _eligible(result: dict) -> int:
    """Saved LoRA-A input bytes of the re-gather-eligible adapters (linear_qkv and linear_fc1)."""
    return _labelled(result, *ELIGIBLE_BASES)


def _fmt_bytes(n: int) -> str:
    return f"{n:,}"


def _kept_inputs(decisions: dict) -> dict:
    """Adapters that asked for recompute but keep their input, with the reason."""
    marker = ", input kept (recompute asked: "
    return {p: d.split(marker, 1)[1][:-1] for p, d in decisions.items() if marker in d}


def _say(text: str = "", indent: int | None = None) -> None:
    """A line of the report; one longer than 120 columns wraps, its continuations indented (``indent``,
    else four more than the line's own)."""
    for line in text.split("\n"):
        if len(line) <= WIDTH:
            print(line)
            continue
        lead = len(line) - len(line.lstrip())
        print(textwrap.fill(line, WIDTH, subsequent_indent=" " * (lead + 4 if indent is None else indent),
                            break_long_words=False, break_on_hyphens=False))


def run(args) -> int:
    from regather.tools.cpu.dist import run_ranks
    from regather.tools.cpu.models import TinyGPT
    from regather.tools.cpu.train import RunConfig, recompute_clock

    shape = TinyGPT(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=4 * args.hidden, vocab=256,
                    seq=args.seq)
    problems = tp_problems(shape, args.tp, args.seq, ffn_flag="the MLP width (4 x --hidden)")
    if args.steps <= args.warmup:
        problems.append(f"--steps {args.steps} must exceed the --warmup {args.warmup} steps the times leave out")
    if problems:
        raise SystemExit("regather demo: " + "; ".join(problems))
    cfg = RunConfig(tp=args.tp, shape=shape, micro_batch=args.micro_batch, steps=args.steps,
                    lr=args.lr, lora_dim=args.lora_rank, lora_alpha=2 * args.lora_rank, warmup=args.warmup)
    tokens = load_corpus()
    _say(f"regather demo: LoRA (rank {args.lora_rank}) fine-tune of a megatron-core GPTModel "
          f"({args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, fp32)")
    _say(f"TP={args.tp} + sequence parallel on {args.tp} CPU ranks (gloo); text: tiny_corpus.txt "
          f"({len(tokens):,} bytes, byte-level tokens); {args.steps} steps per run, interleaved:")
    _say("  gather      LoRA(lean_transients=True)  (the gather path with regather's lean output path)")
    _say("  regather    LoRA(sequence_parallel_input_regather=True)")
    _say("  +recompute  LoRA(sequence_parallel_input_regather=True, recompute_adapter_inputs=True)\n")
    try:
        results = run_ranks(_rank_main, args.tp, cfg, tokens, timeout=args.timeout)
    except TimeoutError as exc:  # --timeout is the user's limit: one line, as for any other refusal
        raise SystemExit(f"regather demo: {str(exc).splitlines()[0]} (--timeout {args.timeout:g} is the "
                         "seconds the run is expected to take: raise it)") from None
    r0 = results[0]
    runs = [r0[name] for name in STRATEGIES]
    g, rg, rc = runs

    _say(f"{'step':>4}  {'loss (gather)':>14}  {'loss (regather)':>15}  {'loss (+recompute)':>17}  same")
    identical = True
    for i, losses in enumerate(zip(*(r["loss"] for r in runs))):
        same = all(x == losses[0] for x in losses)
        identical &= same
        _say(f"{i + 1:>4}  {losses[0]:>14.6f}  {losses[1]:>15.6f}  {losses[2]:>17.6f}  {'yes' if same else 'NO'}")
    for rank_result in results[1:]:  # every rank must agree, not just rank 0
        identical &= all(rank_result[name]["loss"] == rank_result[STRATEGIES[0]]["loss"] for name in STRATEGIES)

    _say("\nAdapter decisions (+recompute run, rank 0):")
    width = max(len(p) for p in rc["decisions"])
    for path, decision in sorted(rc["decisions"].items()):
        _say(f"  {path:<{width}}  {decision}", indent=width + 4)

    _say("\nOne step, per rank, measured on CPU (bytes counted: saved-tensor hooks at the end of forward; collectives "
         "wrapped, bytes received). Each row is the same adapters in every run; the ratio columns divide a run's "
         "bytes by gather's:")
    # adapters grouped by what the +recompute run does with their input (bytes measured per adapter)
    kept = _kept_inputs(rc["decisions"])
    recomputed = sorted(p for p, d in rc["decisions"].items() if ", input recomputed from " in d)
    col_rc = [p for p in recomputed if p.endswith(("linear_qkv", "linear_fc1"))]
    col_kept = [p for p in sorted(kept) if p.endswith(("linear_qkv", "linear_fc1"))]

    def per(paths):
        return [sum(r["saved_adapter_input_bytes_by_adapter"][p] for p in paths) for r in runs]

    rows = [
        ("retained activations, total", [r["saved_bytes"] for r in runs]),
        ("  of which LoRA-A inputs", [r["saved_adapter_input_bytes"] for r in runs]),
        ("    qkv + fc1 (column-parallel)", [_eligible(r) for r in runs]),
        (f"      the {len(col_rc)} that +recompute rebuilds", per(col_rc)),
    ]
    if col_kept:
        rows.append((f"      the {len(col_kept)} that +recompute keeps", per(col_kept)))
    rows += [
        ("    fc2 (row-parallel)", [_labelled(r, "linear_fc2") for r in runs]),
        ("    proj (row-parallel)", [_labelled(r, "linear_proj") for r in runs]),
    ]
    for kind in sorted(set().union(*(r["comm_bytes"] for r in runs))):
        rows.append((f"{kind} bytes", [r["comm_bytes"].get(kind, 0) for r in runs]))
    head = "".join(f" {LABELS[n]:>12}" for n in STRATEGIES)
    _say(f"  {'':<{LABEL}}{head} {'regather/gather':>16} {'+recompute/gather':>18}")
    for label, vals in rows:
        ratios = [f"{v / vals[0]:.3f}" if vals[0] else "-" for v in vals[1:]]
        _say(f"  {label:<{LABEL}}" + "".join(f" {_fmt_bytes(v):>12}" for v in vals)
             + f" {ratios[0]:>16} {ratios[1]:>18}")
    times = [r["median_step_time"] for r in runs]
    clock = recompute_clock([res["regather-recompute"] for res in results], args.steps, args.warmup)
    _say(f"  {'median step time (ms)':<{LABEL}}" + "".join(f" {t * 1e3:>12.2f}" for t in times))
    if clock:
        _say(f"  {'  of which rebuilding inputs (ms)':<{LABEL}}" + f" {'-':>12} {'-':>12}"
             f" {clock['median_recompute_time'] * 1e3:>12.2f}")

    _say(f"\nLoRA-A inputs of the eligible adapters (qkv, fc1): {_fmt_bytes(_eligible(rg))} bytes "
         f"instead of {_fmt_bytes(_eligible(g))}, cut by a factor {_eligible(g) / _eligible(rg):g} "
         f"(TP={args.tp}); the row-parallel adapters keep their TP-split input on both paths.")
    new_bytes = sum(rc["saved_adapter_input_bytes_by_adapter"][p] for p in recomputed)
    fc2_rc = [p for p in recomputed if p.endswith("linear_fc2")]
    _say(f"recompute_adapter_inputs=True: {len(recomputed)} adapters rebuild their input in backward from "
         f"what its producer keeps ({len(col_rc)} qkv/fc1 from their norm, {len(fc2_rc)} fc2 from the MLP "
         f"activation) and save {_fmt_bytes(new_bytes)} new bytes for it; retained total "
         f"{_fmt_bytes(rc['saved_bytes'])} instead of {_fmt_bytes(g['saved_bytes'])} (gather), "
         f"down by {_fmt_bytes(g['saved_bytes'] - rc['saved_bytes'])} = exactly the LoRA-A input bytes "
         f"no longer kept ({_fmt_bytes(g['saved_adapter_input_bytes'] - rc['saved_adapter_input_bytes'])}).")
    for path, why in sorted(kept.items()):
        if not path.endswith("linear_proj"):
            _say(f"  keeps its input: {path}: {why}")
    if any(p.endswith("linear_proj") for p in kept):
        _say("  keeps its input: every linear_proj (no recomputable producer: the attention output)")
    if any(p.endswith("layers.0.self_attention.linear_qkv") for p in kept):
        _say("  (layer 0's linear_qkv reads the frozen embeddings' output, which needs no gradient, so its "
             "input_layernorm saves nothing to recompute from; with an input that requires grad — Bridge's "
             "maybe_enable_recompute_inputs_grad, HF's enable_input_require_grads — it recomputes too)")
    rebuilt = (f"the +recompute run spent {clock['median_recompute_time'] * 1e3:.2f} ms a step rebuilding its "
               f"inputs, {clock['recompute_share_of_step'] * 100:.1f} % of its step (clocked around each rerun of "
               f"a norm or an activation)" if clock else "no adapter rebuilt its input")
    _say(f"Time (medians of steps {args.warmup + 1}-{args.steps}): {rebuilt}. The step times themselves are not a "
         f"cost: on {args.tp} CPU ranks at these toy sizes they move from run to run with the machine's load (the paths "
         "run the same GEMMs; regather adds one all-gather in backward). docs/benchmarks.md measures the recompute at "
         "0.44 % of a step at h=512, s=1024 on CPU; absolute times need a GPU.")
    _say(f"Losses identical on every rank: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


def register(subparsers) -> None:
    p = add_command(subparsers, "demo", help="short LoRA fine-tune on 2 CPU ranks: gather vs regather vs "
                    "regather + recompute_adapter_inputs", description=DESCRIPTION)
    p.set_defaults(func=run)

"""``regather estimate``'s peak: what LoRA keeps and LoRA's peak over the frozen model, per strategy (modelled).

**Kept** — what LoRA makes the model keep after the forward, per GPU (all micro-batches in flight): each
adapter's LoRA-A input (:mod:`regather.tools.estimate.dense`, :mod:`~regather.tools.estimate.experts`: the
bytes ``regather bench`` counts) and the rank-``r`` tensor LoRA-B keeps for its weight gradient, ``mid [s, b, r]``
— on its own sequence shard ``[s/t, b, r]`` for a lean row adapter under SP. ``s`` is the sequence this GPU's
linears see: ``seq/cp`` under context parallelism. Inside megatron's activation checkpoint (full recompute, or
selective ``mlp`` / ``moe``) nothing is kept after the forward; in the checkpointed layer's backward its recomputed
forward keeps what the gather path keeps there (an adapter in a checkpoint takes the gather path).

**Peak over the frozen model** — the most LoRA adds, at one moment, to what the same model without LoRA has alive
(an upper bound of ``max_memory_allocated`` with LoRA less without): what LoRA keeps at the moment the most of it is
alive — after the forward (every micro-batch in flight); under full recompute one checkpoint group's recomputed
forward (``recompute_num_layers`` layers for ``uniform``, one for ``block``), or what the layers outside it keep if
that is more — plus the largest transient one adapter makes. The LoRA weights' gradients are not in it: megatron's
DDP allocates them (``main_grad``) with the model (:mod:`regather.tools.estimate.memory` counts them). An adapter's
transient, per micro-batch (docs/design.md §3.7's buffers; ``T = s*b`` rows, ``e`` bytes; a column base's output
``W = T*o/t*e``; a row base's output ``[T/t, h]`` under SP and input gradient ``W_in = T*h_in/t*e``; ``x_full =
T*h*e``; ``rr = T*r*e``; ``chunk(n)``: ``n`` cut by :mod:`regather.core.peak.chunks`' rule, at most 8 chunks, none
under 16 MiB):

=================== ====================================================== ==========================================
adapter             classic output path (the gather path: Bridge 0.6.2)    lean (every other strategy, the default)
=================== ====================================================== ==========================================
column (qkv, fc1)   forward ``2 W`` (LoRA-B's output, its scaled copy,    forward ``chunk(W) + rr``; backward as
                    the sum); backward ``W + rr`` (``scale * dY``), then   the classic's second term
                    ``rr`` + regather's re-gathered ``x_full`` + a
                    recomputed input + the input gradient's
row (proj, fc2)     forward LoRA-B's output gathered ``[T, h]`` + its      ``B`` gathered (``h*r*e``) + ``rr`` +
                    scaled shard; backward ``2 W_in`` (LoRA-A's input      ``max(chunk(out), chunk(W_in) +``
                    gradient and autograd's sum) + ``rr`` + a recomputed   ``recomputed input)``
                    input
expert fc1 / fc2    ``2 W`` (``W = R*o*e``, ``R`` routed rows)             ``chunk(W) + R*r*e`` (per-expert grouped
                                                                           adapters: ``W``, not chunked)
=================== ====================================================== ==========================================

The column adapter's input-gradient term: on the TE spec TE adds LoRA's ``ln_out`` gradient into its own dgrad inside
its Function (``[T/t, h]`` under SP, ``x_full`` without: inherent, every strategy); on the local spec without SP or at
TP 1 LoRA-A's input gradient ``x_full`` and autograd's sum (``2 x_full``; lean: a chunk of it, added in place);
under SP none beyond the frozen model's own. Every figure is **modelled**: the buffers are read in regather's code
and measured on CPU in docs/design.md §3.7 (there, at or below these terms); none is measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from regather.core.peak.chunks import MAX_CHUNKS, MIN_CHUNK_BYTES
from regather.tools.estimate.config import (
    AdapterInput,
    Model,
    Run,
    checkpoint_group,
    checkpointed_layers,
    eligible_per_layer,
    lean_output,
    split_strategy,
)
from regather.tools.estimate.dense import ROW_TARGETS, adapter_inputs
from regather.tools.estimate.experts import expert_inputs, routed_rows
from regather.tools.estimate.spec import TE, replicated

MODELLED = "modelled"
#: how the peak figures are obtained, for the reports
PEAK_HOW = ("modelled: LoRA's kept bytes at the moment the most are alive + the largest transient one adapter makes "
            "(docs/design.md 3.7's buffers; measured on CPU at or below these terms); LoRA's weight gradients are "
            "with the model's static memory (megatron's main_grad buffers)")


def chunk(nbytes: int, rows: int) -> int:
    """The largest row chunk of a full-width tensor of ``nbytes`` over ``rows`` rows under
    :mod:`regather.core.peak.chunks`' rule with its default minimum (16 MiB)."""
    if rows <= 1 or nbytes <= 0:
        return nbytes
    n = max(1, min(MAX_CHUNKS, rows, nbytes // MIN_CHUNK_BYTES))
    return -(-rows // n) * nbytes // rows


@dataclass(frozen=True)
class Transient:
    """One adapter's largest transient, per micro-batch: its bytes and which buffers make it."""

    target: str
    nbytes: int
    what: str


def _dims(model: Model, run: Run) -> dict:
    t, e, b = run.tp, run.e, run.micro_batch
    T = run.local_seq * b
    tsp = T // t if run.sp and t > 1 else T
    d = model.head_dim or model.hidden // model.heads
    kv = model.kv_heads or model.heads
    return {"T": T, "Tsp": tsp, "e": e, "t": t, "h": model.hidden, "r": run.lora_rank,
            "out": {"linear_qkv": (model.heads + 2 * kv) * d // t,
                    "linear_fc1": model.ffn * (2 if model.gated_mlp else 1) // t},
            "in": {"linear_proj": model.heads * d // t, "linear_fc2": model.ffn // t}}


def _column(model: Model, run: Run, a: AdapterInput, lean: bool, regather: bool, checkpoint: bool) -> Transient:
    g = _dims(model, run)
    T, e, h = g["T"], g["e"], g["h"]
    W, rr, x_full = T * g["out"][a.target] * e, T * g["r"] * e, T * h * e
    regathered = x_full if regather and not checkpoint and not replicated(run) else 0
    rebuilt = 0 if checkpoint or not a.recomputed_from else (x_full if replicated(run) else g["Tsp"] * h * e)
    if run.spec == TE:
        grad, grad_what = g["Tsp"] * h * e, "TE's ln_out gradient (added inside TE's Function)"
    elif replicated(run):
        grad = chunk(x_full, T) if lean else 2 * x_full
        grad_what = "LoRA-A's input gradient" + (" chunk" if lean else " and autograd's sum")
    else:
        grad, grad_what = 0, ""
    back = rr + regathered + rebuilt + grad
    parts = ["dmid"] + (["the re-gathered x_full"] if regathered else []) + (
        ["the recomputed input"] if rebuilt else []) + ([grad_what] if grad else [])
    backward = Transient(a.target, back, "backward: " + " + ".join(parts))
    if lean:
        forward = Transient(a.target, chunk(W, T) + rr, "forward: one chunk of LoRA-B's output + mid")
    else:
        forward = max(Transient(a.target, 2 * W, "forward: LoRA-B's output, its scaled copy and the sum"),
                      Transient(a.target, W + rr, "backward: scale * dY"), key=lambda x: x.nbytes)
    return max(forward, backward, key=lambda x: x.nbytes)


def _row(model: Model, run: Run, a: AdapterInput, lean: bool, checkpoint: bool) -> Transient:
    g = _dims(model, run)
    T, e, h, r = g["T"], g["e"], g["h"], g["r"]
    rr, w_in, out = T * r * e, T * g["in"][a.target] * e, g["Tsp"] * h * e
    rebuilt = 0 if checkpoint or not a.recomputed_from else w_in
    if lean:
        gathered_b = h * r * e if run.tp > 1 else 0
        if chunk(out, g["Tsp"]) >= chunk(w_in, T) + rebuilt:
            return Transient(a.target, gathered_b + rr + chunk(out, g["Tsp"]),
                             "forward: LoRA-B gathered + mid + one chunk of its output")
        return Transient(a.target, gathered_b + rr + chunk(w_in, T) + rebuilt,
                         "backward: LoRA-B gathered + dmid + one chunk of LoRA-A's input gradient"
                         + (" + the recomputed input" if rebuilt else ""))
    forward = Transient(a.target, T * h * e + out, "forward: LoRA-B's output gathered over its columns + its scaled "
                                                   "shard")
    backward = Transient(a.target, 2 * w_in + rr + rebuilt, "backward: LoRA-A's input gradient and autograd's sum "
                                                            "+ dmid" + (" + the recomputed input" if rebuilt else ""))
    return max(forward, backward, key=lambda x: x.nbytes)


def _expert(model: Model, run: Run, a: AdapterInput, lean: bool, checkpoint: bool) -> Transient:
    R, e, r = routed_rows(model, run), run.e, run.lora_rank
    o = model.moe_ffn * (2 if model.gated_mlp else 1) // run.etp if a.target == "experts.linear_fc1" else model.hidden
    W = R * o * e
    per_expert = model.experts == "grouped" and not run.share_expert_adapters
    if lean:
        out = W if per_expert else chunk(W, R)
        text = "its output added in place, per-expert blocks (not chunked)" if per_expert else "one chunk of its output"
        return Transient(a.target, out + R * r * e, f"forward: {text} + mid")
    return Transient(a.target, 2 * W, "forward: LoRA-B's output, its scaled copy and the sum")


def transients(model: Model, run: Run, strategy: str, lean: bool | None = None) -> list[Transient]:
    """Per adapter of this GPU, its largest transient (per micro-batch), the output path ``lean`` (None: the
    strategy's own, :func:`~regather.tools.estimate.config.lean_output`)."""
    lean = lean_output(strategy) if lean is None else lean
    regathers = eligible_per_layer(model, run) if split_strategy(strategy)[0] == "regather" else []
    out = []
    for row in adapter_inputs(model, run, strategy):
        for a in row:
            inside = a.checkpointed_bytes is not None
            if a.target in ROW_TARGETS:
                out.append(_row(model, run, a, lean, inside))
            else:
                out.append(_column(model, run, a, lean, a.target in regathers, inside))
    for row in expert_inputs(model, run, strategy):
        out += [_expert(model, run, a, lean, a.checkpointed_bytes is not None) for a in row]
    return out


def _kept_after_forward(rows: list[list[AdapterInput]]) -> int:
    return sum(a.kept_bytes + a.mid_bytes for row in rows for a in row)


def _checkpoint_alive(model: Model, run: Run, rows: list[list[AdapterInput]]) -> int:
    """The most a checkpointed stretch's recomputed forward keeps at once (per micro-batch): a group of
    ``recompute_num_layers`` layers under uniform full recompute, one layer otherwise."""
    per_layer = [sum(a.checkpointed_bytes or 0 for a in row) for row in rows]
    if not any(per_layer):
        return 0
    n = max(1, checkpoint_group(model, run))
    return max(sum(per_layer[i:i + n]) for i in range(0, len(per_layer), n))


def _rows(model: Model, run: Run, strategy: str) -> list[list[AdapterInput]]:
    dense, experts = adapter_inputs(model, run, strategy), expert_inputs(model, run, strategy)
    return [d + (experts[i] if i < len(experts) else []) for i, d in enumerate(dense)] if experts else dense


def peak(model: Model, run: Run, strategy: str, lean: bool | None = None) -> dict:
    """LoRA's bytes per GPU for ``strategy`` (``lean``: the output path, None: the strategy's own):

    - ``kept``: after the forward, every micro-batch in flight (LoRA-A inputs and LoRA-B's ``mid``);
    - ``alive``: the most of it alive at one moment (under full recompute a checkpoint group's recomputed forward);
    - ``transient``: the largest one adapter makes (``{"target", "bytes", "what"}``);
    - ``peak_over_frozen``: ``alive + transient`` — what LoRA adds to the step's peak (module doc)."""
    lean = lean_output(strategy) if lean is None else lean
    if lean != lean_output(strategy):  # the other output path: its row adapters keep mid whole or on their shard
        from regather.tools.estimate import dense

        rows = [[replace(a, mid_bytes=0 if a.checkpointed_bytes is not None else
                         a.mid_bytes if a.target.startswith("experts.") else dense.mid_bytes(model, run, a.target, lean))
                 for a in row] for row in _rows(model, run, strategy)]
    else:
        rows = _rows(model, run, strategy)
    one = _kept_after_forward(rows)
    inside = _checkpoint_alive(model, run, rows)
    full = any(checkpointed_layers(model, run))
    alive = one * (run.in_flight - 1) + (max(one, inside) if full else one + inside)
    top = max(transients(model, run, strategy, lean), key=lambda x: x.nbytes, default=Transient("", 0, "none"))
    return {"kept": one * run.in_flight, "alive": alive, "checkpoint_alive": inside, "lean": lean,
            "transient": {"target": top.target, "bytes": top.nbytes, "what": top.what},
            "peak_over_frozen": alive + top.nbytes}

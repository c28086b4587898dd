"""``regather estimate --spec te|local``: what the base linears keep on each layer spec.

``--spec te`` (the command's default) is what Megatron Bridge's PEFT recipes run
(``transformer_impl="transformer_engine"``); ``--spec local`` is megatron-core's local spec, the one
``regather bench`` and the tests run on CPU (and :class:`~regather.tools.estimate.config.Run`'s
default, so that bench and estimate agree byte for byte). Read in Transformer Engine v2.17.1 (the
commit Bridge's r0.6 branch pins: ``pytorch/module/layernorm_linear.py``, ``linear.py``) and Bridge
0.6.2 (``peft/utils.py``, ``peft/lora.py``). Adapter-input bytes are bytes over the frozen model
(what LoRA makes the model keep), per adapter and micro-batch (``x_full = s*b*h*e``, ``t`` TP):

=================== ================================== =====================================
adapter             local spec                         TE spec
=================== ================================== =====================================
qkv / fc1, SP on    gather ``x_full``; regather /      gather ``x_full + x_full/t``: LoRA-A's
                    lowrank ``x_full/t`` (the shard)   gathered copy and the shard TE keeps
                                                       (``return_layernorm_output``);
                                                       regather / lowrank ``x_full/t``: the
                                                       shard TE keeps *is* LoRA-A's input
qkv / fc1, SP off   ``x_full`` on every strategy       ``x_full``, every strategy: the
or TP = 1                                              ``ln_out`` TE keeps only because LoRA
                                                       asked for it (Bridge sets
                                                       ``return_layernorm_output=True``)
linear_proj         ``s*b*heads*d/t*e`` (unfused       0: fused attention saves ``O`` and
                    attention; 0 with ``--attention    hands ``linear_proj`` a view of it
                    fused``)                           (``--attention unfused``: as local)
linear_fc2          ``s*b*ffn/t*e``                    the same: the SwiGLU saves its input,
                                                       TE's ``Linear`` with a frozen weight
                                                       saves none
expert fc1 / fc2    :mod:`.experts`                    the same (not read separately for TE)
=================== ================================== =====================================

Why TE keeps ``ln_out``: ``_LayerNormLinear.forward`` clears it only ``if not
weight.requires_grad and not return_layernorm_output``, and what it saves is always the local
``ln_out`` (the sequence shard under SP), never the gathered copy that Bridge's gather path
(``return_layernorm_output_gathered = not sequence_parallel_input_regather``) hands to LoRA-A.
So under SP regather frees the whole gathered input on TE (``x_full`` per eligible adapter) and
half of it on the local spec at TP 2, whose norm keeps no output.

**Recompute** (``-recompute``, ``LoRA(recompute_adapter_inputs=True)``): the implemented
behaviour (:mod:`regather.tools.estimate.dense`): qkv / fc1 inputs rebuilt from the norm's input —
on the re-gather path under SP and on the replicated path (TP = 1, SP off) — fc2's from the
activation's input, each where its producer keeps a tensor. On the TE spec the adapters also release
the copy of ``ln_out`` TE keeps for them (docs/design.md §3.5.1) where the run's rule allows it
(:func:`te_release_reason`: :func:`regather.megatron.dense.te_rule.release_reason`, the function the
run calls, for ``Run.te_version``; none given: :data:`regather.megatron.dense.te_rule.NEWEST_READ`,
what ``pip install transformer_engine`` installs); where it refuses (a TE version outside the range
read, 2.21 on) qkv / fc1 keep their input, TE's ``ln_out``, with the rule's reason. The gather path
under SP keeps its gathered copy and TE's shard as without recompute.

**How each TE figure is obtained** (:data:`HOW_OBTAINED`, printed with the report): "TE model on
CPU" — the rule is measured, allocator bytes over the frozen model, on a model of Transformer Engine
that runs on CPU (TE's autograd Functions as read in its source, TE <= 2.3, 2.4 - 2.7 and 2.8 - 2.20;
tests/distributed/megatron/test_te_routing.py): what qkv / fc1 / fc2 keep with and without
recompute. "modelled" — read in TE's source only: ``linear_proj`` beside TE's fused attention (the
TE model has none) and the expert linears. None of it is measured on a GPU yet.
"""

from __future__ import annotations

from regather.megatron.dense import te_rule
from regather.megatron.reasons import NORM_OF, TE_FUSED_NORM
from regather.tools.estimate.config import Model, Run

TE, LOCAL = "te", "local"  # config.SPECS

TE_MODEL = "TE model on CPU"
MODELLED = "modelled"
#: how each TE-spec rule was obtained (module doc)
HOW_OBTAINED = {
    "linear_qkv": TE_MODEL, "linear_fc1": TE_MODEL, "linear_fc2": TE_MODEL, "recompute": TE_MODEL,
    "linear_proj": MODELLED, "experts": MODELLED,
}
TE_RECOMPUTE = ("qkv / fc1 rebuilt from the norm's input TE keeps, TE's copy of ln_out released "
                "(docs/design.md 3.5.1); fc2 from the activation's input")


#: the Transformer Engine version a run that names none is estimated for: the newest read
TE_VERSION_DEFAULT = te_rule.NEWEST_READ


def te_version(run: Run) -> str:
    """The Transformer Engine version the TE spec is estimated for: the run's, else the newest read."""
    return run.te_version or TE_VERSION_DEFAULT


def te_release_reason(run: Run) -> str | None:
    """Why this run's TE ``linear_qkv`` / ``linear_fc1`` adapters cannot release the ``ln_out`` TE keeps
    for them (so they keep their input), or None: the run's own rule for :func:`te_version` (None on
    the local spec, where there is nothing to release)."""
    return te_rule.release_reason(te_rule.ReleaseFacts(version=te_version(run))) if run.spec == TE else None


def norm_producer(name: str, run: Run) -> str:
    """The producer a qkv / fc1 adapter's input is rebuilt from, as ``regather.decisions`` names it:
    the base's own fused norm on the TE spec, the layer's norm module on the local spec."""
    return TE_FUSED_NORM if run.spec == TE else NORM_OF[name]


def replicated(run: Run) -> bool:
    """qkv / fc1 see the whole sequence on every rank (TP = 1, or SP off): no re-gather exists."""
    return not (run.sp and run.tp > 1)


def te_shard_beside(model: Model, run: Run, gathered: bool) -> int:
    """Bytes TE's ``LayerNormLinear`` keeps *beside* LoRA-A's input for a qkv / fc1 adapter: its
    local ``ln_out`` shard where LoRA-A holds the gathered copy (the gather path under SP on the TE
    spec), else 0 (on TE LoRA-A's input is then the very tensor TE keeps; the local spec keeps none)."""
    if run.spec != TE or not gathered or replicated(run):
        return 0
    return run.local_seq * run.micro_batch * model.hidden * run.e // run.tp


def recompute_line(run: Run) -> str:
    """What ``-recompute`` does on the TE spec for this run's TE version (:func:`te_release_reason`)."""
    version = te_version(run) + ("" if run.te_version else ", the newest read, assumed")
    why = te_release_reason(run)
    if why is None:
        return f"(TE {version}) {TE_RECOMPUTE}"
    return f"(TE {version}) qkv / fc1 keep their input: {why}; fc2 from the activation's input"


def spec_lines(run: Run) -> list[str]:
    """The TE report's header lines: what each adapter's bytes are on this spec."""
    if run.spec != TE:
        return []
    where = "the shard TE keeps under SP (the gather path's gathered copy comes on top)" if not replicated(run) \
        else "the ln_out TE keeps only because LoRA asked for it"
    proj = (f"0 new bytes: fused attention saves its output O [{MODELLED}: the TE model has no fused attention]"
            if run.attention_keeps_output else "new bytes: unfused attention saves the probabilities and V "
            "[as on the local spec]")
    return [
        "spec: te (Transformer Engine, transformer_impl=\"transformer_engine\", what Bridge's PEFT recipes run; "
        "--spec local: megatron's local spec)",
        f"  linear_qkv, linear_fc1: Bridge sets return_layernorm_output, so TE's LayerNormLinear keeps ln_out; "
        f"LoRA-A's input is {where} [{TE_MODEL}]",
        f"  linear_proj: {proj}",
        f"  linear_fc2: new bytes (TE's Linear with a frozen weight keeps no input) [{TE_MODEL}]",
        f"  -recompute on this spec: {recompute_line(run)} [{TE_MODEL}]",
        f"  how obtained: [{TE_MODEL}] measured on a model of Transformer Engine that runs on CPU (allocator "
        f"bytes, TE <= 2.3, 2.4 - 2.7 and 2.8 - 2.20); [{MODELLED}] read in TE's source only; none measured on a "
        "GPU yet",
    ]

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

**Recompute** (``-recompute``, ``LoRA(recompute_adapter_inputs=True)``): on the local spec the
implemented behaviour (:mod:`regather.tools.estimate.dense`): qkv / fc1 inputs rebuilt from
the norm's input and statistics — on the re-gather path under SP and on the replicated path
(TP = 1, SP off) — fc2's from the activation's input, each where its producer keeps a tensor.
On the TE spec the same rule is *modelled*: LoRA-A takes the norm output without TE keeping it
(docs/design.md, the TE section), which awaits GPU verification; the gather path under SP keeps
its gathered copy and TE's shard as without recompute.
"""

from __future__ import annotations

from regather.tools.estimate.config import Model, Run

TE, LOCAL = "te", "local"  # config.SPECS

TE_RECOMPUTE = ("modelled as on the local spec (LoRA-A takes the norm output without TE keeping it); "
                "awaits GPU verification")


def replicated(run: Run) -> bool:
    """qkv / fc1 see the whole sequence on every rank (TP = 1, or SP off): no re-gather exists."""
    return not (run.sp and run.tp > 1)


def te_shard_beside(model: Model, run: Run, gathered: bool) -> int:
    """Bytes TE's ``LayerNormLinear`` keeps *beside* LoRA-A's input for a qkv / fc1 adapter: its
    local ``ln_out`` shard where LoRA-A holds the gathered copy (the gather path under SP on the TE
    spec), else 0 (on TE LoRA-A's input is then the very tensor TE keeps; the local spec keeps none)."""
    if run.spec != TE or not gathered or replicated(run):
        return 0
    return run.seq * run.micro_batch * model.hidden * run.e // run.tp


def spec_lines(run: Run) -> list[str]:
    """The TE report's header lines: what each adapter's bytes are on this spec."""
    if run.spec != TE:
        return []
    where = "the shard TE keeps under SP (the gather path's gathered copy comes on top)" if not replicated(run) \
        else "the ln_out TE keeps only because LoRA asked for it"
    proj = ("0 new bytes: fused attention saves its output O" if run.attention_keeps_output
            else "new bytes: unfused attention saves the probabilities and V")
    return [
        "spec: te (Transformer Engine, transformer_impl=\"transformer_engine\", what Bridge's PEFT recipes run; "
        "--spec local: megatron's local spec)",
        f"  linear_qkv, linear_fc1: Bridge sets return_layernorm_output, so TE's LayerNormLinear keeps ln_out; "
        f"LoRA-A's input is {where}",
        f"  linear_proj: {proj}; linear_fc2: new bytes (TE's Linear with a frozen weight keeps no input)",
        f"  -recompute on this spec: {TE_RECOMPUTE}",
    ]

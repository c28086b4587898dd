"""When Transformer Engine's saved LayerNorm output may be released: one rule, for the run and the tools.

:mod:`regather.megatron.dense.te_release` frees the ``ln_out`` that TE's ``_LayerNormLinear`` keeps
only because LoRA asked for it (``return_layernorm_output=True``), where every adapter on the base
rebuilds its input. That is safe only where TE's backward never reads the saved ``ln_out`` and
nothing else holds or moves it. Each fact is read in TE's own source, at every tag v2.3 - v2.18 and
in PyPI's 2.19.0 and 2.20.2 wheels (docs/design.md §3.5.1, "Transformer Engine versions read",
has the table of lines; "2.20.2:N" below). :func:`release_reason` is the rule; it reads a
:class:`ReleaseFacts`, gathered from the module where the run decides (:func:`facts_of`, on every
forward: the producer's ``static_reason``) or from a described run (``regather doctor`` /
``regather estimate``), so the three cannot disagree.

Refused, with the reason, on every version:

- any weight TE names (``weight_names``) trainable: the weight gradient reads ``ln_out``
  (``ln_out_needs_gather = weight.requires_grad and ...`` 2.20.2:473-474, the wgrad block 946);
- a distributed weight (GTP, ``is_distributed_weight``, 2.19+): TE swaps it for a gathered copy
  and tests ``requires_grad`` on the copy (2.20.2:327-330, 427, 474, 539), which regather cannot see;
- fp8 / fp4 (the saved ``ln_out`` is a quantized copy), ``NVTE_BACKWARD_OVERRIDE`` (the
  ``dequantized`` override casts the saved ``ln_out`` in backward, 2.20.2:768-772);
- TE's debug mode (``TEDebugState.debug_enabled``, nvdlfw_inspect): the debug quantizer may save
  the original ``ln_out`` inside its own tensor (``debug_quantization.py``, 2.20.2:629-640);
- TE's own FSDP (``fsdp_group``): with a frozen weight TE does not scatter ``ln_out``
  (2.20.2:502) but its backward gathers it and fails on the missing shape
  (``distributed.py`` 2.20.2:2196, v2.3:1468 an assert), released or not: not a run to change;
- CPU offload (megatron's ``cpu_offloading``, TE's offload enabled now, or any saved-tensor hook
  active: TE's offload is hook-based, ``cpu_offload.py`` 2.20.2:883-885, and marks ``ln_out``
  2.20.2:490; megatron's fine-grained activation offloading pops what its hook stored,
  ``fine_grained_activation_offload.py`` 0.16.1:356-358): reading TE's saved tensors in forward runs
  the unpack hook, and a release would empty the tensor queued for offload;
- a Transformer Engine version outside the range read, or none readable.

Refused on TE 2.3 only: userbuffers (``ub_bulk_dgrad`` copies the saved ``ln_out`` into its buffer
whatever the weight, v2.3:578); from 2.4 that copy sits under ``ln_out_needs_gather``
(2.20.2:773-779), false with a frozen weight.

Transformer Engine is never imported: its state is read from the modules already imported
(``sys.modules``), as :func:`regather.megatron.dense.te.installed_version` reads the version.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from regather.core.saved_hooks import saved_tensors_hook_reason

#: ``(major, minor)`` of the first and last Transformer Engine versions read (every tag v2.3 - v2.18,
#: PyPI's 2.19.0 and 2.20.2: the only 2.19 / 2.20 releases there); docs/design.md §3.5.1
VERSIONS_READ = ((2, 3), (2, 20))
#: the newest version read, what ``pip install transformer_engine`` installs (2026-12)
NEWEST_READ = "2.20.2"
#: the versions whose backward copies the saved ``ln_out`` into userbuffers with a frozen weight
UB_READS_LN_OUT = ((2, 3),)
UB_FLAGS = ("ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad", "ub_overlap_rs_dgrad",
            "ub_overlap_ag", "ub_overlap_rs", "ub_bulk_wgrad", "ub_bulk_dgrad")
#: megatron's fine-grained offload modules whose context wraps a LayerNorm-fused base's forward, by target
#: (megatron-core 0.16.1 / 0.19.2 attention.py: ``off_interface(self.offload_qkv_linear, ..., "qkv_linear")``
#: around ``linear_qkv``; ``mlp_norm`` wraps ``pre_mlp_layernorm``, an IdentityOp on the TE spec)
OFFLOAD_MODULES = {"linear_qkv": ("qkv_linear",), "linear_fc1": ()}
_TE_OFFLOAD = "transformer_engine.pytorch.cpu_offload"
_TE_DEBUG = "transformer_engine.debug.pytorch.debug_state"


def version_tuple(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``"2.18.0+e7c550c5"`` -> ``(2, 18)``), or None."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_reason(version: str | None) -> str | None:
    """Why TE ``version`` is not one whose backward was read, or None."""
    lo, hi = VERSIONS_READ
    span = f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"
    if version is None:
        return "the installed Transformer Engine's version cannot be read (transformer_engine.__version__)"
    found = version_tuple(version)
    if found is None or not lo <= found <= hi:
        return (f"Transformer Engine {version} is outside the versions read ({span}): whether its backward "
                "reads the LayerNorm output it keeps is not known")
    return None


@dataclass(frozen=True)
class ReleaseFacts:
    """What :func:`release_reason` reads (the module doc's list). From a module: :func:`facts_of`;
    a described run gives what it knows (``version``, ``cpu_offloading``) and leaves the rest."""

    version: str | None
    trainable: tuple[str, ...] = ()  # the TE weights (weight_names) that require grad
    distributed: tuple[str, ...] = ()  # the TE weights that are distributed (GTP)
    fp8: str | None = None  # "fp8" / "fp4" when on
    backward_override: str | None = None  # NVTE_BACKWARD_OVERRIDE
    debug: bool = False  # TE's debug mode (TEDebugState.debug_enabled)
    fsdp: bool = False  # TE's own FSDP (fsdp_group)
    cpu_offloading: bool = False  # megatron's config.cpu_offloading
    te_offload: bool = False  # TE's CPU offload enabled now (is_cpu_offload_enabled())
    saved_tensor_hook: str | None = None  # why a saved-tensor hook active now forbids reading TE's node
    fine_grained: tuple[str, ...] = ()  # megatron's fine-grained offload modules covering the base
    userbuffers: tuple[str, ...] = ()  # the userbuffers flags set (or tp_comm_overlap)


#: how every refusal of :func:`release_reason` starts: the adapter's input is TE's own ``ln_out``, which stays
KEPT = "TE's ln_out is kept"


def release_reason(facts: ReleaseFacts) -> str | None:
    """Why TE's saved ``ln_out`` cannot be released in a run with ``facts`` (``"TE's ln_out is kept: <why>"``),
    or None (the module doc)."""
    why = _configured(facts) or _moment(facts) or version_reason(facts.version)
    if why is None and facts.userbuffers and version_tuple(facts.version) in UB_READS_LN_OUT:
        why = (f"userbuffers ({', '.join(facts.userbuffers)}) on Transformer Engine {facts.version}: its "
               "backward copies the LayerNorm output it keeps into its buffer (ub_bulk_dgrad)")
    return None if why is None else f"{KEPT}: {why}"


def _configured(facts: ReleaseFacts) -> str | None:
    """The reasons a module and its configuration give, on every version."""
    if facts.trainable:
        return (f"the TE base's weight {', '.join(map(repr, facts.trainable))} is trainable: TE's backward "
                "reads its LayerNorm output for the weight gradient")
    if facts.distributed:
        return (f"the TE base's weight {', '.join(map(repr, facts.distributed))} is a distributed weight (GTP): "
                "TE tests requires_grad on the gathered copy it makes in forward, which regather cannot see")
    if facts.fp8:
        return (f"{facts.fp8} is on: TE saves a quantized copy of the LayerNorm output, and an fp8 recipe's "
                "backward_override reads it in backward")
    if facts.backward_override:
        return f"NVTE_BACKWARD_OVERRIDE={facts.backward_override!r}: TE's backward reads the LayerNorm output it keeps"
    if facts.fsdp:
        return ("TE's own FSDP (fsdp_group): with a frozen weight TE does not scatter the LayerNorm output it "
                "keeps, and its backward fails gathering it (released or not)")
    if facts.cpu_offloading:
        return "CPU offload (cpu_offloading=True) offloads the LayerNorm output TE keeps"
    if facts.fine_grained:
        return (f"megatron's fine-grained activation offloading covers the TE base (offload_modules "
                f"{list(facts.fine_grained)}): it offloads the LayerNorm output TE keeps")
    return None


def _moment(facts: ReleaseFacts) -> str | None:
    """The reasons only the moment knows: TE's debug mode, TE's CPU offload, a saved-tensor hook."""
    if facts.debug:
        return ("Transformer Engine's debug mode is on (TEDebugState.debug_enabled): its debug quantizer may "
                "save the LayerNorm output inside its own tensor")
    if facts.te_offload:
        return ("Transformer Engine's CPU offload is enabled (is_cpu_offload_enabled()): it offloads the "
                "LayerNorm output it keeps")
    return facts.saved_tensor_hook


def runtime_facts() -> dict:
    """The facts only the moment knows (TE's offload, TE's debug mode, saved-tensor hooks), read from
    the TE modules already imported and from torch."""
    offload = sys.modules.get(_TE_OFFLOAD)
    enabled = getattr(offload, "is_cpu_offload_enabled", None)
    debug_state = getattr(sys.modules.get(_TE_DEBUG), "TEDebugState", None)
    return {"te_offload": bool(enabled()) if callable(enabled) else False,
            "debug": bool(getattr(debug_state, "debug_enabled", False)),
            "saved_tensor_hook": saved_tensors_hook_reason()}


def runtime_reason() -> str | None:
    """:func:`release_reason` of what only the moment knows (:func:`runtime_facts`): checked before
    TE's saved tensors are read or released."""
    return _moment(ReleaseFacts(version=None, **runtime_facts()))


def facts_of(base, version: str | None, target: str | None = None) -> ReleaseFacts:
    """The facts of a ``TELayerNormColumnParallelLinear`` ``base`` now (its module, its megatron config,
    the environment, TE's state), TE ``version`` installed; ``target``: the base's name in its layer
    (``linear_qkv`` / ``linear_fc1``; None: every fine-grained offload module that could cover it)."""
    config = getattr(base, "config", None)
    names = list(getattr(base, "weight_names", None) or ["weight"])
    weights = [(n, getattr(base, n, None)) for n in names]
    fp8 = [name for name in ("fp8", "fp4") if getattr(config, name, None)] + (["fp8"] if getattr(base, "fp8", False)
                                                                             else [])
    ub = [flag for flag in UB_FLAGS if getattr(base, flag, False)]
    if not ub and getattr(config, "tp_comm_overlap", False):
        ub = ["tp_comm_overlap"]
    offloaded = ()
    if getattr(config, "fine_grained_activation_offloading", False):
        covering = OFFLOAD_MODULES.get(target, ("qkv_linear", "attn_norm", "mlp_norm"))
        offloaded = tuple(m for m in (getattr(config, "offload_modules", None) or []) if m in covering)
    return ReleaseFacts(
        version=version,
        trainable=tuple(n for n, w in weights if w is not None and w.requires_grad),
        distributed=tuple(n for n, w in weights if getattr(w, "is_distributed_weight", False)),
        fp8=fp8[0] if fp8 else None,
        backward_override=os.environ.get("NVTE_BACKWARD_OVERRIDE") or None,
        fsdp=getattr(base, "fsdp_group", None) is not None,
        cpu_offloading=bool(getattr(config, "cpu_offloading", False)),
        fine_grained=offloaded,
        userbuffers=tuple(ub),
        **runtime_facts(),
    )


def unsupported_reason(base, version: str | None, target: str | None = None) -> str | None:
    """Why TE's saved ``ln_out`` cannot be released for ``base`` now, or None: :func:`release_reason`
    of :func:`facts_of`."""
    return release_reason(facts_of(base, version, target))

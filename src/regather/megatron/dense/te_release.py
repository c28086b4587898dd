"""Releasing the LayerNorm output Transformer Engine keeps only because LoRA asked for it.

LoRA reads ``TELayerNormColumnParallelLinear``'s norm output (``return_layernorm_output=True``,
:mod:`regather.megatron.dense.te`), and TE then keeps ``ln_out`` for its backward although the weight
is frozen: ``_LayerNormLinear.forward`` frees it only ``if not weight.requires_grad and not
return_layernorm_output`` (v2.18:409-411). With ``recompute_adapter_inputs`` the adapter saves the
norm's *input* instead (TE keeps it: ``inputmat``) and rebuilds ``ln_out`` in backward, so TE's copy
is read by nobody: this module frees it (docs/design.md §3.5.1, design A).

**Which tensor.** TE returns ``ln_out.view(inp_shape)`` — another tensor object than the ``ln_out``
it saved (v2.18:593-600); TE's own ``clear_tensor_data`` swaps ``.data`` of the object it is given,
so calling it on the returned view would free nothing (the saved object still holds the storage).
The saved object is reached through TE's autograd node: :func:`saved_layernorm_output` walks from the
returned tensor's ``grad_fn`` to the node whose saved tensors hold one on the returned tensor's
storage (``ctx.saved_tensors`` unpacks to the saved object itself), and :func:`release` swaps *its*
``.data`` for an empty tensor, as ``clear_tensor_data`` would (a tensor marked ``_do_not_clear`` is
left alone). The storage is then freed when the returned view dies (at the end of the wrapper's
forward), unless an adapter kept that view itself (then it is the adapter's saved input, as before).
After the swap the node is read again: its tensor must be empty, else a saved-tensor hook handed out
a copy and nothing was released (logged once).

**When.** Only where TE's backward never reads the saved ``ln_out`` (read in TE v2.3 - v2.18, main):
every use sits under ``if ctx.requires_wgrad`` (the weight is frozen), except
``backward_override="dequantized"`` (fp8 recipes), TE's own FSDP (``fsdp_group`` gathers it),
CPU offload (marks it), and userbuffers (``ub_bulk_dgrad`` copies it); an fp8 ``ln_out`` is a
quantized copy, not the returned tensor. :func:`unsupported_reason` refuses each of those, and a
Transformer Engine version outside the range read, with the reason — through the producer's
``static_reason`` (:class:`regather.megatron.dense.producers.TELayerNormProducer`), so the adapter
keeps its input and ``regather.decisions`` says why, as for every other producer.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from regather.core.recompute.graph import saved_tensors, storage_key

logger = logging.getLogger("regather")

#: the Transformer Engine versions whose ``layernorm_linear.py`` was read (docs/design.md §3.5.1)
VERSIONS_READ = ((2, 3), (2, 18))
_UB_FLAGS = ("ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad", "ub_overlap_rs_dgrad",
             "ub_overlap_ag", "ub_overlap_rs", "ub_bulk_wgrad", "ub_bulk_dgrad")
_VIEW_NODES = 4  # view / reshape nodes between the returned tensor and TE's node, at most


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


def unsupported_reason(base, version: str | None) -> str | None:
    """Why TE's saved ``ln_out`` cannot be released for ``base`` (a ``TELayerNormColumnParallelLinear``
    with TE ``version`` installed), or None. From the module and its megatron config (module doc)."""
    config = getattr(base, "config", None)
    weight = getattr(base, "weight", None)
    if weight is not None and weight.requires_grad:
        return "the TE base's weight is trainable: TE's backward reads its LayerNorm output for the weight gradient"
    fp8 = [name for name in ("fp8", "fp4") if getattr(config, name, None)] + (["fp8"] if getattr(base, "fp8", False)
                                                                             else [])
    if fp8:
        return (f"{fp8[0]} is on: TE saves a quantized copy of the LayerNorm output, and an fp8 recipe's "
                "backward_override reads it in backward")
    override = os.environ.get("NVTE_BACKWARD_OVERRIDE")
    if override:
        return f"NVTE_BACKWARD_OVERRIDE={override!r}: TE's backward reads the LayerNorm output it keeps"
    if getattr(base, "fsdp_group", None) is not None:
        return "TE's own FSDP (fsdp_group) gathers the LayerNorm output it keeps in backward"
    if getattr(config, "cpu_offloading", False):
        return "CPU offload (cpu_offloading=True) marks the LayerNorm output TE keeps for offload"
    ub = [flag for flag in _UB_FLAGS if getattr(base, flag, False)]
    if ub or getattr(config, "tp_comm_overlap", False):
        return (f"userbuffers ({', '.join(ub) or 'tp_comm_overlap'}): TE's backward may copy the LayerNorm "
                "output it keeps into its buffer")
    return version_reason(version)


def saved_layernorm_output(ln_out: torch.Tensor):
    """``(node, tensor)``: TE's autograd node and the tensor object it saved on ``ln_out``'s storage
    (``ln_out``: the LayerNorm output TE returned), or why they cannot be found."""
    if ln_out.grad_fn is None:
        return "the LayerNorm output TE returned has no autograd node (nothing is saved for backward)"
    want = storage_key(ln_out)
    node = ln_out.grad_fn
    for _ in range(_VIEW_NODES + 1):
        if node is None:
            break
        try:
            saved = saved_tensors(node)
        except RuntimeError as exc:
            return f"TE's saved tensors cannot be read ({exc})"
        found = [t for t in saved if storage_key(t) == want and t.numel() > 0]
        if found:
            return node, found[0]
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        node = nexts[0] if len(nexts) == 1 else None
    return ("TE's autograd node saved no tensor on the storage of the LayerNorm output it returned (a copy: "
            "fp8, or a saved-tensor hook)")


def release(ln_out: torch.Tensor) -> str | None:
    """Free TE's saved copy of ``ln_out`` (module doc); None when done, else why not."""
    found = saved_layernorm_output(ln_out)
    if isinstance(found, str):
        return found
    node, saved = found
    if hasattr(saved, "_do_not_clear"):
        return "TE marked the LayerNorm output it keeps _do_not_clear (CPU offload's double buffering)"
    saved.data = torch.empty(0, dtype=saved.dtype, device=saved.device)  # TE's clear_tensor_data
    if any(storage_key(t) == storage_key(ln_out) for t in saved_tensors(node)):
        return "a saved-tensor hook handed out another tensor object than TE's saved one: nothing was released"
    return None


_warned: set[str] = set()


def release_or_log(ln_out: torch.Tensor, name: str) -> bool:
    """:func:`release`, logging the first failure per base (``name``); whether it released."""
    why = release(ln_out)
    if why is not None and name not in _warned:
        _warned.add(name)
        logger.warning("LoRA on %s: Transformer Engine keeps its LayerNorm output although the adapter "
                       "recomputes it: %s", name, why)
    return why is None

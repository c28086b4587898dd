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

**When.** Only where :func:`regather.megatron.dense.te_rule.release_reason` allows it: TE's backward
never reads the saved ``ln_out`` with a frozen weight, and nothing else holds or moves it (every
TE version read, 2.3 - 2.20; the refusals and their reasons are that module's). The rule runs through
the producer's ``static_reason`` (:class:`regather.megatron.dense.producers.TELayerNormProducer`) on
every forward, so the adapter keeps its input and ``regather.decisions`` says why, as for every
other producer; :func:`release` checks again what only the moment knows (a saved-tensor hook, TE's
offload, TE's debug mode) before it reads TE's node.
"""

from __future__ import annotations

import logging

import torch

from regather.core.recompute.graph import saved_tensors, storage_key
from regather.megatron.dense.te_rule import runtime_reason

logger = logging.getLogger("regather")

_VIEW_NODES = 4  # view / reshape nodes between the returned tensor and TE's node, at most


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
    why = runtime_reason()  # before TE's node is read: its unpack hooks would run
    if why is not None:
        return why
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

"""Which Transformer Engine the model stands for, and TE's ``clear_tensor_data``.

Three behaviours, read in TE's own source (``transformer_engine/pytorch/module/layernorm_linear.py``,
"LL"; ``transformer_engine/pytorch/utils.py``; every tag v2.3 - v2.18 of
github.com/NVIDIA/TransformerEngine and PyPI's 2.19.0 / 2.20.2 wheels, whose LL is byte-identical;
docs/design.md §3.5.1 has the line of every fact per version). They differ in four places only:

=========================== ========================= ========================= ===========================
                            :data:`TE_2_3` (<= 2.3)   :data:`TE_2_4` (2.4-2.7)  :data:`TE_2_8` (2.8-2.20)
=========================== ========================= ========================= ===========================
gradient of a returned      added to the dgrad        dropped: commit ce0b46c4d (first in v2.4) removed it;
*gathered* ``ln_out`` (SP)  *before* the sequence     the only read of ``grad_outputs[1]`` is the local
                            reduce-scatter (v2.3:695) one's (v2.4:897-898, 2.20.2:1134-1135)
``ln_out`` with a frozen    set to None, *then* ``clear_tensor_data`` on   ``clear_tensor_data(ln_out,
weight, not returned        the Nones: a no-op, the storage goes with the  ln_out_total)``, then None
                            last reference (v2.3:333-336, v2.4:356-358,    (93a67af81: v2.8:362-364,
                            v2.7:355-357)                                  2.20.2:427-429)
gathered ``ln_out_total``,  not cleared (dies with the forward)            ``clear_tensor_data`` unless
local ``ln_out`` returned                                                  it aliases ``ln_out``
                                                                           (v2.8:365, 2.20.2:430-435)
backward, after the weight  ``clear_tensor_data(ln_out_total)`` unless     ``ln_out`` unless returned
gradient                    ``ln_out`` was returned (v2.3:786-789,         (or, SP, only the gathered
                            v2.7:893-896)                                  one was); the gathered
                                                                           total (v2.8:904-913,
                                                                           2.20.2:1093-1102)
=========================== ========================= ========================= ===========================

Everything else the model does is common to all three (and named by line in :mod:`.layernorm_linear`
and :mod:`.linear`): what is saved, the returned view, the local ``ln_out``'s gradient, the backward's
free of ``mu`` / ``rsigma`` (v2.3:842-843, 2.20.2:1164-1165), the casts to the activation dtype and
``prepare_forward``'s ``.contiguous()``. A distributed weight (GTP) exists from 2.19 only
(:mod:`.distributed_weight`).

TE cannot be installed on a CPU machine, so regather learns the installed TE's version through
:func:`regather.megatron.dense.te.installed_version` (what ``transformer_engine.__version__`` says on
a GPU machine): :func:`te_behaviour` answers there with the behaviour's version while it is active,
as an installed TE would. Nothing else of regather is replaced.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Behaviour:
    """What one range of TE versions does (module doc)."""

    name: str
    version: str  # the TE version it stands for (what regather reads as the installed one)
    adds_gathered_ln_out_grad: bool  # v2.3:695-696
    clears_ln_out: bool  # v2.8+: clear_tensor_data before setting None (v2.3-v2.7: after, a no-op)
    clears_gathered_total: bool  # v2.8:365 (2.20.2:430-435)
    frees_after_wgrad: str  # "total" (v2.3-v2.7: ln_out_total unless returned) or "ln_out" (v2.8+)

    def __str__(self) -> str:
        return self.name


TE_2_3 = Behaviour("te<=2.3", "2.3.0", adds_gathered_ln_out_grad=True, clears_ln_out=False,
                   clears_gathered_total=False, frees_after_wgrad="total")
TE_2_4 = Behaviour("te2.4-2.7", "2.7.0", adds_gathered_ln_out_grad=False, clears_ln_out=False,
                   clears_gathered_total=False, frees_after_wgrad="total")
TE_2_8 = Behaviour("te2.8-2.20", "2.20.2", adds_gathered_ln_out_grad=False, clears_ln_out=True,
                   clears_gathered_total=True, frees_after_wgrad="ln_out")
BEHAVIOURS = {b.name: b for b in (TE_2_3, TE_2_4, TE_2_8)}

_ACTIVE: list[Behaviour] = [TE_2_8]  # the one a module built without an explicit behaviour runs


def active() -> Behaviour:
    """The behaviour modules built now (without an explicit one) run."""
    return _ACTIVE[-1]


def behaviour_named(name: str | Behaviour) -> Behaviour:
    if isinstance(name, Behaviour):
        return name
    try:
        return BEHAVIOURS[name]
    except KeyError:
        raise ValueError(f"unknown TE behaviour {name!r}; expected one of {sorted(BEHAVIOURS)}") from None


@contextlib.contextmanager
def te_behaviour(behaviour: str | Behaviour):
    """Modules built inside run ``behaviour``; regather reads its version as the installed TE's."""
    from regather.megatron.dense import te

    behaviour = behaviour_named(behaviour)
    saved = te.installed_version
    _ACTIVE.append(behaviour)
    te.installed_version = lambda: behaviour.version  # what transformer_engine.__version__ would say
    try:
        yield behaviour
    finally:
        te.installed_version = saved
        _ACTIVE.pop()


def clear_tensor_data(*tensors) -> None:
    """TE's ``clear_tensor_data`` (``pytorch/utils.py``, v2.18:56-77, 2.20.2:128-149): skip a tensor marked
    ``_do_not_clear`` (CPU offload's double buffering), ``.clear()`` a quantized storage, else swap
    ``.data`` for an empty tensor. The swap frees the storage only if no *other* tensor object (a
    view, the returned ``ln_out``) still refers to it; it never touches those others."""
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "_do_not_clear"):
            continue
        if hasattr(t, "clear") and not isinstance(t, torch.Tensor):
            t.clear()
        else:
            t.data = torch.empty(0, device=t.device)  # TE: _empty_tensor(), an fp32 tensor with no data

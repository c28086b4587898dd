"""Which Transformer Engine the model stands for, and TE's ``clear_tensor_data``.

Two behaviours, read in TE's own source (``transformer_engine/pytorch/module/layernorm_linear.py``,
"LL"; ``transformer_engine/pytorch/utils.py``; tags v2.3, v2.4, v2.7, v2.8, v2.18 of
github.com/NVIDIA/TransformerEngine). They differ in two places only:

============================== ======================================= =======================================
                               :data:`TE_2_3` (TE <= 2.3)               :data:`TE_2_18` (TE >= 2.4, read at 2.18)
============================== ======================================= =======================================
gradient of a returned         added to the dgrad *before* the          dropped: the only read of
*gathered* ``ln_out`` (SP)     sequence reduce-scatter (v2.3:695-696)   ``grad_outputs[1]`` is the non-gathered
                                                                        one (v2.18:1105-1106); commit ce0b46c4d
                                                                        (first in v2.4) removed v2.3's
gradient of a returned         added after the reduce-scatter / all-reduce (v2.3:812-813, v2.18:1105-1106)
*local* ``ln_out``
``ln_out`` with a frozen       set to None, *then* ``clear_tensor_data``  ``clear_tensor_data(ln_out,
weight, not returned           on the Nones: a no-op, the storage goes    ln_out_total)``, then None
                               when the last reference does (v2.3:333-336, (v2.18:409-411; fixed in 93a67af81,
                               the same through v2.7:355-357)             v2.8:362-364)
gathered ``ln_out_total``,     not cleared (dies with the forward)       ``clear_tensor_data`` unless it aliases
local ``ln_out`` returned                                               ``ln_out`` (v2.18:412-417, since v2.8)
============================== ======================================= =======================================

Everything else the model does is common to both (and named by line in
:mod:`.layernorm_linear` and :mod:`.linear`).

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
    clears_gathered_total: bool  # v2.18:412-417 (v2.8+)

    def __str__(self) -> str:
        return self.name


TE_2_3 = Behaviour("te<=2.3", "2.3.0", adds_gathered_ln_out_grad=True, clears_ln_out=False,
                   clears_gathered_total=False)
TE_2_18 = Behaviour("te>=2.4", "2.18.0", adds_gathered_ln_out_grad=False, clears_ln_out=True,
                    clears_gathered_total=True)
BEHAVIOURS = {b.name: b for b in (TE_2_3, TE_2_18)}

_ACTIVE: list[Behaviour] = [TE_2_18]  # the one a module built without an explicit behaviour runs


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
    """TE's ``clear_tensor_data`` (``pytorch/utils.py``, v2.18:56-77): skip a tensor marked
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

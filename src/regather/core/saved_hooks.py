"""The ``saved_tensors_hooks`` active now, and whether a producer's saved tensors may be read under them.

Reading what an autograd node saved runs the innermost ``saved_tensors_hooks`` pair's unpack hook (torch
packs and unpacks with the innermost pair alone). An offload hook may reload the tensor, hand out another
object, or pop what it stored (megatron's fine-grained activation offloading): a producer's saved tensors
are then neither read in forward nor released. regather's own byte count hands back what it was given
and is marked transparent (:func:`transparent_pack_hook`). Torch only.
"""

from __future__ import annotations

#: the attribute that marks a pack hook as transparent (:func:`transparent_pack_hook`)
_TRANSPARENT = "regather_transparent"


def transparent_pack_hook(pack):
    """Mark ``pack`` as a ``saved_tensors_hooks`` pack function that returns the very tensor object it
    was given, paired with an unpack that returns what it gets (regather's byte counting,
    :class:`regather.core.accounting.SavedBytes`): reading saved tensors under it changes nothing, so
    :func:`saved_tensors_hook_reason` lets it pass. Returns ``pack``."""
    setattr(getattr(pack, "__func__", pack), _TRANSPARENT, True)
    return pack


def saved_tensors_hook_reason() -> str | None:
    """Why the tensors autograd saves now may not be read in forward, or None: a ``saved_tensors_hooks``
    context is active and its pack hook is not marked transparent (module doc)."""
    top = top_saved_tensors_hook()
    fn = getattr(top, "__func__", top)
    if top is None or getattr(fn, _TRANSPARENT, False):
        return None
    name = f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return (f"a saved-tensor hook is active ({name}): reading what autograd saved in forward would run its "
            "unpack hook (an offload hook moves, copies or pops the tensor)")


def top_saved_tensors_hook():
    """The pack hook of the innermost ``saved_tensors_hooks`` context, if torch exposes it."""
    import torch  # here: te_rule imports this module into the ``regather`` command, whose parsing loads no torch

    getter = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if getter is None:
        return None
    try:
        hooks = getter(False)
    except (TypeError, RuntimeError):
        return None
    return hooks[0] if hooks else None

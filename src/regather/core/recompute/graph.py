"""The autograd graph between a producer's input and its output: what it saves, and checks.

An adapter may save, instead of its input, a tensor the op producing that input already saves
for its own backward (:mod:`regather.core.recompute.sources`). Whether that tensor exists is
read off the autograd graph, never assumed:

- :func:`kept_between` walks the graph from the producer's output down to its input's node
  (parameters aside) and finds, among the tensors the nodes saved, one on the storage of the
  tensor to rebuild from (:class:`Meta`: storage and view geometry) — then saving it adds no
  bytes, and the output depends on nothing else;
- :func:`same_tensor` / :func:`modified_in_place`: the adapter input is the producer's output
  of this forward, unmodified;
- :func:`global_hooks_reason`: process-wide module hooks run before a producer's own hooks and
  may change what it sees, so nothing is trusted while one is registered.

Storages are compared on the plain tensors under ``DTensor`` / ``AsyncCollectiveTensor``
(:func:`regather.core.unwrap.plain`): under PyTorch-native tensor parallelism the graph saves
DTensors, and a rebuilt tensor is this rank's local one.

Torch only: front ends find their producers (:mod:`regather.megatron.dense.producers`,
:mod:`regather.torchtitan.producers`) and use these checks.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from regather.core.recompute.reasons import NOTHING_KEPT, SOURCE_NOT_KEPT
from regather.core.recompute.sources import Kept
from regather.core.saved_hooks import saved_tensors_hook_reason
from regather.core.unwrap import plain


class Meta:
    """Where a tensor lives (storage, view geometry): enough to find it again among the tensors
    an autograd node saved, without holding the tensor (autograd keeps its storage, not the
    Python object). A wrapped tensor (``DTensor``) is described by its local tensor."""

    __slots__ = ("_ref", "dtype", "offset", "shape", "storage", "stride")

    def __init__(self, t: torch.Tensor):
        t = plain(t)
        self.storage, self.dtype = storage_key(t), t.dtype
        self.shape, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        self._ref = StorageWeakRef(t.untyped_storage())

    def alive(self) -> bool:
        """The storage still exists. Once it is freed (nothing saved it: an unfused bias add
        consumed fc1's output), a tensor allocated later at the same address is another storage,
        not an alias: the address alone would match it."""
        return not self._ref.expired()

    def rebuild(self, alias: torch.Tensor) -> torch.Tensor:
        """The tensor itself (its local tensor when it was wrapped), as a view of ``alias`` (a saved
        tensor on the same storage)."""
        return plain(alias).detach().as_strided(self.shape, self.stride, self.offset)


def storage_key(t: torch.Tensor) -> tuple:
    """``(data_ptr, nbytes)`` of ``t``'s storage (of its local tensor when it is wrapped)."""
    s = plain(t).untyped_storage()
    return (s.data_ptr(), s.nbytes())


def saved_tensors(node) -> list:
    """The tensors an autograd node saved for its backward (C++ nodes and Python Functions)."""
    out = []
    values = [getattr(node, n, None) for n in dir(node) if n.startswith("_saved_")]
    if hasattr(node, "saved_tensors"):  # a Python autograd.Function's ctx
        values.append(node.saved_tensors)
    for v in values:
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def kept_between(output: torch.Tensor, meta: Meta, stop, limit: int = 32, pick=None,
                 extra: tuple | None = None) -> tuple | Kept:
    """``(tensor,)``: the tensor described by ``meta``, rebuilt from one the autograd graph of
    ``output`` saved, when ``output`` is computed from it alone (graph nodes down to ``stop`` —
    its own node — and parameters); otherwise ``Kept(what fails)``. ``pick(saved)`` may choose
    another saved tensor instead (returning it, or None).

    ``extra=(meta, node)`` names a second input ``output`` is computed from (an expert MLP's
    per-token scale, ``node`` its ``grad_fn`` or None): the walk stops at ``node`` as well, the
    tensor must be among the saved ones too, and both come back as ``(tensor, extra tensor)``."""
    found = _walk(output, meta, stop, limit, pick, extra)
    return Kept(found) if isinstance(found, str) else found


def _walk(output, meta, stop, limit, pick, extra) -> tuple | str:
    root = output.grad_fn
    if root is None:
        return NOTHING_KEPT
    extra_meta, extra_stop = extra if extra is not None else (None, None)
    seen, frontier, alias, reached = set(), [root], None, stop is None
    extra_alias = None
    while frontier:
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node is stop:
            reached = True
            continue
        if extra_stop is not None and node is extra_stop:
            continue
        if type(node).__name__ == "AccumulateGrad":  # a trainable leaf: a parameter of the producer
            continue
        if len(seen) > limit:
            return f"its autograd graph is larger than {limit} nodes (not an elementwise producer)"
        if alias is None or (extra_meta is not None and extra_alias is None):
            try:
                saved = saved_tensors(node)
            except RuntimeError as exc:  # e.g. modified in place since it was saved
                return f"its saved tensors cannot be read ({exc})"
            if alias is None:
                alias = find_saved(saved, meta)
                if alias is None and pick is not None:
                    alias = pick(saved)
            if extra_meta is not None and extra_alias is None:
                extra_alias = find_saved(saved, extra_meta)
        frontier.extend(fn for fn, _ in node.next_functions)
    if not reached:
        return "the adapter input does not come from it alone"
    if alias is None:
        return SOURCE_NOT_KEPT
    if extra_meta is None:
        return (alias,)
    if extra_alias is None:
        return "it does not keep the per-token scale (saving that would add bytes)"
    return alias, extra_alias


def find_saved(saved: list, meta: Meta) -> torch.Tensor | None:
    """``meta``'s tensor, as a view of a saved tensor on its storage (same dtype), or None."""
    if not meta.alive():
        return None
    return next((meta.rebuild(t) for t in saved if storage_key(t) == meta.storage and plain(t).dtype == meta.dtype),
                None)


def same_tensor(x: torch.Tensor, out: torch.Tensor) -> bool:
    """``x`` is ``out`` or a full view of it (early re-gather's anchor passes ``out.view_as(out)``)."""
    if x is out:
        return True
    return (x._base is out or (out._base is not None and x._base is out._base)) and x.shape == out.shape \
        and x.stride() == out.stride() and x.storage_offset() == out.storage_offset()


def modified_in_place(out: torch.Tensor, version: int, name: str) -> str | None:
    """Why ``out`` (recorded at ``version``) can no longer be trusted, or None."""
    if out._version != version:
        return f"{name}'s output was modified in place before the adapter read it"
    return None


def global_hooks_reason() -> str | None:
    """Why no producer can be trusted while process-wide module hooks exist (they run before the
    producers' own hooks and may replace or modify a module's input or output), or None."""
    from torch.nn.modules import module as torch_module

    names = [n for n in ("_global_forward_pre_hooks", "_global_forward_hooks")
             if getattr(torch_module, n, None)]
    if not names:
        return None
    return (f"a global module hook is registered ({', '.join('torch.nn.modules.module.' + n for n in names)}): "
            "it runs before the producer's own check and may change the adapter input unseen")


def reason_now(producer) -> str | None:
    """What keeps ``producer`` from being used, known without a forward (module hooks, a saved-tensor
    hook under which its saved tensors cannot be read, configuration)."""
    return global_hooks_reason() or saved_tensors_hook_reason() or producer.static_reason()

"""Where bytes are counted: saved activations and collective traffic (docs/design.md §7).

- :class:`SavedBytes` — a ``saved_tensors_hooks`` context: the unique storages
  autograd saves for backward during the forward it wraps (parameters
  excluded), with a separate total per *label*. Code marks what it saves with
  :func:`label` (the adapters mark LoRA-A's input as ``"adapter_input:<base>"``,
  e.g. ``"adapter_input:linear_qkv"``; ``of("adapter_input")`` sums them all).
  A ``DTensor`` or ``AsyncCollectiveTensor`` counts as its local tensor's storage
  (:func:`regather.core.unwrap.plain`). :meth:`SavedBytes.for_model` excludes the
  parameters and buffers the model holds *when a tensor is saved*: FSDP2 swaps
  unsharded parameters in per block and frees them after, so addresses taken once
  would later match activations allocated where a freed parameter was.
- :class:`CollectiveBytes` — wraps the ``torch.distributed`` collectives
  (and every alias megatron-core or regather took of them at import) and counts
  per kind the bytes each rank *receives* under the usual ring algorithms.
  With ``functional=True`` it also counts the functional collectives
  (``torch.ops._c10d_functional.*``) that ``DTensor`` redistributions issue
  without calling ``torch.distributed``'s Python functions, in a
  ``TorchDispatchMode`` (no module hooks, so no change to the run's numerics):

  ===================== =====================================
  kind                  bytes received per rank
  ===================== =====================================
  all_gather            ``out_bytes * (t-1)/t``
  reduce_scatter        ``in_bytes * (t-1)/t``
  all_reduce            ``2 * bytes * (t-1)/t``
  broadcast             ``bytes`` (non-source ranks)
  ===================== =====================================

  The functional collectives count on the thread that entered the block (and in the backward
  autograd runs for it); the wrapped functions on every thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from regather.core.saved_hooks import transparent_pack_hook
from regather.core.unwrap import plain, wrapper_types

ADAPTER_INPUT = "adapter_input"
_LABEL = threading.local()
_NESTED = threading.local()  # depth of counted collective calls on this thread


@contextlib.contextmanager
def label(name: str):
    """Attribute tensors saved inside this block to ``name`` (cheap when nothing counts)."""
    prev = getattr(_LABEL, "name", None)
    _LABEL.name = name
    try:
        yield
    finally:
        _LABEL.name = prev


def _storage_key(t: torch.Tensor):
    t = plain(t)
    s = t.untyped_storage()
    return (t.device, s.data_ptr()), s.nbytes()


class SavedBytes:
    """Count the unique storages saved for backward inside the ``with`` block.

    ``exclude``: tensors whose storages are never counted (taken at construction);
    ``model``: a module whose parameters and buffers *at the time a tensor is saved* are never
    counted (:meth:`for_model`). ``nn.Parameter`` objects are never counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), model: torch.nn.Module | None = None):
        self._exclude = {_storage_key(p)[0] for p in exclude}
        self._model = model
        # key -> (label, bytes, a weak reference to the storage). A storage saved and freed inside
        # the block (a branch of the graph nothing kept) leaves its address to later allocations:
        # a storage saved there later is another storage and counts on its own (the freed one's
        # entry moves aside), instead of passing for the first one
        self._seen: dict[tuple, tuple[str, int, StorageWeakRef]] = {}
        self._freed = 0  # entries moved aside
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> SavedBytes:
        return cls(model=model)

    def _alive(self) -> set:
        """Storages of the model's parameters and buffers now."""
        if self._model is None:
            return set()
        return {_storage_key(p)[0] for p in list(self._model.parameters()) + list(self._model.buffers())}

    @transparent_pack_hook  # returns what it is given: producers may read saved tensors under it
    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and plain(t).device.type != "meta":
            key, nbytes = _storage_key(t)
            seen = self._seen.get(key)
            if (key not in self._exclude and (seen is None or seen[2].expired())
                    and key not in self._alive()):
                if seen is not None:  # the freed storage that held this address keeps its entry
                    self._freed += 1
                    self._seen[("freed", self._freed)] = self._seen.pop(key)
                name = getattr(_LABEL, "name", None) or "other"
                self._seen[key] = (name, nbytes, StorageWeakRef(plain(t).untyped_storage()))
                self.counted(name, nbytes)
        return t

    def counted(self, name: str, nbytes: int) -> None:
        """Called for each new storage counted, with its label (for subclasses that attribute it)."""

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(n for _, n, _ in self._seen.values())

    def by_label(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, n, _ in self._seen.values():
            out[name] += n
        return dict(out)

    def of(self, name: str) -> int:
        """Bytes under ``name`` and its sub-labels (``name:anything``)."""
        return sum(n for label_, n in self.by_label().items()
                   if label_ == name or label_.startswith(name + ":"))


def _arg(args, kwargs, pos: int, name: str):
    """Argument ``name`` of a call, given by position ``pos`` or by keyword (FSDP2 passes
    ``output=`` / ``input=``)."""
    return kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)


def _group_size(kwargs, args, pos) -> int:
    return dist.get_world_size(_arg(args, kwargs, pos, "group"))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ring(pos: int, name: str, group_pos: int, factor: int = 1):
    """bytes received per rank: ``factor * bytes(argument) * (t-1)/t``."""
    def size(a, k):
        x, t = _arg(a, k, pos, name), _group_size(k, a, group_pos)
        n = sum(_bytes(y) for y in x) if isinstance(x, (list, tuple)) else _bytes(x)
        return factor * n * (t - 1) // t
    return size


# name -> (kind, function(args, kwargs) -> bytes received per rank)
_COUNTED = {
    "all_gather_single": ("all_gather", _ring(0, "output_tensor", 2)),
    "reduce_scatter_single": ("reduce_scatter", _ring(1, "input", 3)),
    "all_gather_into_tensor": ("all_gather", _ring(0, "output_tensor", 2)),
    "_all_gather_base": ("all_gather", _ring(0, "output_tensor", 2)),
    "all_gather": ("all_gather", _ring(0, "tensor_list", 2)),
    "reduce_scatter_tensor": ("reduce_scatter", _ring(1, "input", 3)),
    "_reduce_scatter_base": ("reduce_scatter", _ring(1, "input", 3)),
    "all_reduce": ("all_reduce", _ring(0, "tensor", 2, factor=2)),
    "broadcast": ("broadcast", lambda a, k: _bytes(_arg(a, k, 0, "tensor"))),
    "all_to_all_single": ("all_to_all", _ring(0, "output", 4)),
}


def _named_group_size(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def _listed(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _gathered(a) -> int:    # (input(s), group_size, group_name): every rank's input but this one's
    return sum(_bytes(t) for t in _listed(a[0])) * (a[1] - 1)


def _scattered(a) -> int:   # (input(s), reduce_op, group_size, group_name)
    return sum(_bytes(t) for t in _listed(a[0])) * (a[2] - 1) // a[2]


def _reduced(a) -> int:     # (input(s), reduce_op, group_name)
    t = _named_group_size(a[2])
    return 2 * sum(_bytes(x) for x in _listed(a[0])) * (t - 1) // t


def _to_all(a) -> int:      # (input, output_split_sizes, input_split_sizes, group_name)
    t = _named_group_size(a[3])
    return _bytes(a[0]) * (t - 1) // t


# torch.ops._c10d_functional op name -> (kind, function(args) -> bytes received per rank)
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", _gathered),
    "all_gather_into_tensor_out": ("all_gather", _gathered),
    "all_gather_into_tensor_coalesced": ("all_gather", _gathered),
    "reduce_scatter_tensor": ("reduce_scatter", _scattered),
    "reduce_scatter_tensor_out": ("reduce_scatter", _scattered),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _scattered),
    "all_reduce": ("all_reduce", _reduced),
    "all_reduce_": ("all_reduce", _reduced),
    "all_reduce_coalesced": ("all_reduce", _reduced),
    "all_reduce_coalesced_": ("all_reduce", _reduced),
    "all_to_all_single": ("all_to_all", _to_all),
    "broadcast": ("broadcast", lambda a: _bytes(a[0])),
    "broadcast_": ("broadcast", lambda a: _bytes(a[0])),
}


class _FunctionalCollectives(TorchDispatchMode):
    """Counts ``torch.ops._c10d_functional.*`` into a :class:`CollectiveBytes`. ``DTensor`` (and an
    ``AsyncCollectiveTensor``) runs first (``NotImplemented``), so the mode sees the collectives it
    turns into, on plain tensors; every op runs unchanged."""

    def __init__(self, counter: CollectiveBytes):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, wrapper_types()) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "_c10d_functional" and self.counter.active:
            counted = _FUNCTIONAL.get(func._schema.name.split("::")[-1])
            if counted is not None:
                self.counter.add(counted[0], counted[1](args))
        return func(*args, **kwargs)


class CollectiveBytes:
    """Count collective bytes per kind while the ``with`` block runs (all threads); with
    ``functional=True`` also the functional collectives of ``DTensor`` (see the module doc)."""

    def __init__(self, modules_prefixes=("megatron", "regather", "torch.distributed"), functional: bool = False):
        self._prefixes = modules_prefixes
        self._lock = threading.Lock()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._patched: list[tuple[object, str, object]] = []
        self._mode = _FunctionalCollectives(self) if functional else None
        self.active = True

    def add(self, kind: str, nbytes: int) -> None:
        """Count one collective of ``kind`` receiving ``nbytes`` on this rank."""
        with self._lock:
            self.bytes[kind] += nbytes
            self.calls[kind] += 1

    def _wrap(self, fn, kind, size_of):
        def counted(*args, **kwargs):
            # a collective counts once: torch's deprecated names call the new ones
            # (all_gather_into_tensor -> all_gather_single), which are wrapped too
            outer = not getattr(_NESTED, "depth", 0)
            if self.active and outer:
                self.add(kind, size_of(args, kwargs))
            _NESTED.depth = getattr(_NESTED, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                _NESTED.depth -= 1

        counted.__wrapped__ = fn
        return counted

    def __enter__(self):
        originals = {getattr(dist, name): name for name in _COUNTED if hasattr(dist, name)}
        wrappers = {fn: self._wrap(fn, *_COUNTED[name]) for fn, name in originals.items()}
        targets = [dist] + [m for n, m in list(sys.modules.items())
                            if m is not None and n.startswith(self._prefixes)]
        for mod in targets:
            for attr, value in list(vars(mod).items()):
                try:
                    wrapped = wrappers.get(value)
                except Exception:  # unhashable; or a placeholder whose __hash__ raises (Bridge's
                    continue       # UnavailableMeta stand-ins for missing optional packages)
                if wrapped is not None:
                    self._patched.append((mod, attr, value))
                    setattr(mod, attr, wrapped)
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
        for mod, attr, value in reversed(self._patched):
            setattr(mod, attr, value)
        self._patched.clear()

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.bytes)

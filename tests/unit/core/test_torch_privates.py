"""Every private torch name ``regather.core`` touches exists, with the meaning it is used for, in the
torch versions it was read from: an upgrade that moves one fails here, naming it, instead of somewhere
in a compiled backward (or, worse, silently: ``moment`` falls back when a hook getter is missing, and
``accounting`` counts only the functional collectives it knows by name).

Read from torch 2.13.0 (the 3.11 stack) and 2.14.1+cu130 (``make test-torch214``); none moved between
them. What they do under ``torch.compile`` (the partitioner honouring ``node.meta["recompute"]``, the
traced gather staying in backward) is tested by behaviour: tests/unit/core/test_compiled_recompute.py
and tests/distributed/torchtitan/test_titan_ac_compile.py.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed._functional_collectives as funcol

from regather.core import accounting
from regather.core.recompute import compiled

READ_FROM = ("2.13.0", "2.14.1")


def test_this_torch_is_one_the_names_were_read_from():
    assert torch.__version__.split("+")[0] in READ_FROM, (
        f"torch {torch.__version__}: read the names below again (test_torch_privates.py) and add it to READ_FROM")


def test_inductor_joint_graph_pass_hook():
    """``core.recompute.compiled``: its pass goes into Inductor's ``joint_custom_post_pass`` as a
    ``CustomGraphPass`` (``__call__(graph)`` and a ``uuid`` for Inductor's cache)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    assert hasattr(inductor_config, "joint_custom_post_pass")
    assert {"__call__", "uuid"} <= CustomGraphPass.__abstractmethods__
    assert get_hash_for_files((compiled.__file__,))  # bytes that change with the file
    assert compiled._pass_class()()  # instantiable: both abstract methods implemented


def test_op_overloads_carry_the_tags_the_pass_reads():
    """``compiled._cheap``: an ``OpOverload`` with ``torch.Tag.pointwise`` or ``is_view``."""
    mul, view = torch.ops.aten.mul.Tensor, torch.ops.aten.view.default
    assert isinstance(mul, torch._ops.OpOverload) and torch.Tag.pointwise in mul.tags and not mul.is_view
    assert isinstance(view, torch._ops.OpOverload) and view.is_view


def test_functional_collectives_used_by_the_traced_paths_and_counted_by_accounting():
    """``core.strategies.traced`` (all_gather_tensor, its autograd form, wait_tensor), ``core.unwrap``
    (AsyncCollectiveTensor) and every op ``accounting`` counts by name in ``torch.ops._c10d_functional``."""
    for name in ("all_gather_tensor", "all_gather_tensor_autograd", "wait_tensor", "AsyncCollectiveTensor"):
        assert hasattr(funcol, name), name
    assert list(inspect.signature(funcol.all_gather_tensor).parameters)[:3] == ["self", "gather_dim", "group"]
    missing = [name for name in accounting._FUNCTIONAL if not hasattr(torch.ops._c10d_functional, name)]
    assert not missing, f"torch.ops._c10d_functional lacks {missing}: accounting would not count them"


def test_autograd_state_that_moment_reads():
    """``core.moment`` and ``core.saved_hooks``: the running graph task (-1 outside a backward) and the
    innermost saved-tensors hooks (``None`` when none is set; the pack hook of the innermost context)."""
    assert torch._C._current_graph_task_id() == -1
    getter = torch._C._autograd._top_saved_tensors_default_hooks
    assert not getter(False)

    def pack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert getter(False)[0] is pack


def test_use_counts_for_a_gradient_changed_in_place():
    """``core.peak.magnitude.exclusive``: ``Tensor._use_count()`` counts the tensor objects sharing one
    TensorImpl (a view holds its base's), ``torch._C._storage_Use_Count`` the references to a storage (the
    Python storage object asked for it holds one)."""
    t = torch.randn(3)
    assert t._use_count() == 1
    view = t.view(3)
    assert t._use_count() == 2
    del view
    storage = t.untyped_storage()
    assert torch._C._storage_Use_Count(storage._cdata) == 2
    alias = t.detach()
    assert torch._C._storage_Use_Count(storage._cdata) == 3 and t._use_count() == 1
    del alias

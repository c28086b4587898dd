"""The adapter's halves read each other only through their contracts
(:mod:`regather.megatron.dense.adapter.contract`): every ``self.<name>`` in the decision half and in
the forward half is defined by that half or named by the contract it may use; the decision half
calls nothing of the forward half; a real adapter satisfies both contracts. In-process."""

import ast
import inspect

import regather.megatron.dense.adapter.decisions as decisions
import regather.megatron.dense.adapter.forward as forward
from regather.megatron.dense.adapter import ParallelLinearAdapter
from regather.megatron.dense.adapter.contract import AdapterDecider, AdapterModule


def _names(cls) -> set[str]:
    """The names a Protocol declares: annotated attributes and methods."""
    out = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "typing":
            continue
        out |= set(getattr(klass, "__annotations__", {})) | {n for n in vars(klass) if not n.startswith("_")}
    return out


def _reads_and_defines(module, cls_name: str) -> tuple[set[str], set[str]]:
    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reads = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            else:
                reads.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
            defined.add(node.target.attr)
    return reads, defined


def test_decision_half_reads_only_the_module_contract():
    reads, defined = _reads_and_defines(decisions, "AdapterDecisions")
    outside = reads - defined - _names(AdapterModule) - {"qualified_name"}  # getattr'd, set by the wrapper
    assert outside == set(), outside


def test_forward_half_reads_only_its_contracts():
    reads, defined = _reads_and_defines(forward, "AdapterForward")
    assert reads - defined - _names(AdapterDecider) == set()


def test_a_real_adapter_satisfies_both_contracts():
    adapter = ParallelLinearAdapter(16, 24, 4, column_parallel=True, base_name="linear_qkv")
    assert isinstance(adapter, AdapterModule) and isinstance(adapter, AdapterDecider)
    missing = [n for n in _names(AdapterDecider) if not hasattr(adapter, n)]
    assert missing == []

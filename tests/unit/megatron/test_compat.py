"""regather.megatron.compat names megatron-core internals that exist: each one is found in the
pinned megatron-core's own source (read as text: no Transformer Engine needed), in the module the
table names, and the pinned version is one the table was read from. In-process."""

import importlib.metadata
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from regather.megatron import compat

VERSION = importlib.metadata.version("megatron-core")


def _source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def test_pinned_version_is_one_the_table_was_read_from():
    assert VERSION in compat.READ_FROM


@pytest.mark.parametrize("internal", compat.INTERNALS, ids=lambda i: f"{i.module.rsplit('.', 1)[-1]}.{i.name}")
def test_each_internal_is_in_the_pinned_source(internal):
    if VERSION not in internal.versions:
        assert internal.source not in _source(internal.module)  # read with a default where absent
        return
    assert internal.source in _source(internal.module)


def test_local_input_flips_the_flags_for_one_call_and_restores_them():
    base = SimpleNamespace(sequence_parallel=True, allreduce_dgrad=True, disable_grad_reduce=False)
    with compat.local_input(base):
        assert (base.sequence_parallel, base.allreduce_dgrad, base.disable_grad_reduce) == (False, False, True)
    assert (base.sequence_parallel, base.allreduce_dgrad, base.disable_grad_reduce) == (True, True, False)
    with pytest.raises(RuntimeError), compat.local_input(base):
        raise RuntimeError("the base failed")
    assert base.sequence_parallel and base.allreduce_dgrad and not base.disable_grad_reduce


def test_private_reads_with_a_default():
    assert compat.private(SimpleNamespace(), compat.FUSED_GROUPED_MLP, False) is False
    assert compat.private(SimpleNamespace(_tp_group="g"), compat.TE_TP_GROUP) == "g"

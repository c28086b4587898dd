"""Shared by every test folder.

``tests/unit/`` holds the tests that run in this process, ``tests/distributed/`` those that spawn
gloo ranks (marker ``distributed``); inside each, the area folders mirror the package (``core``,
``ops``, ``megatron`` with ``moe``, ``training`` and ``bridge``, ``hf``, ``tools``, ``torchtitan``,
``recipes``, ``testing``, ``benchmarks``). A test's rank bodies live in ``workers_*.py`` beside it
and are imported by name — also by spawned ranks, which inherit the parent's ``sys.path`` — so every
area folder is put on the path here, and one folder may use another's bodies (names are unique
across folders). ``tests/unit`` and ``tests/distributed`` themselves never go on the path: their
``megatron`` folders would join megatron-core's ``megatron`` namespace package.

The test harness (fakes, stand-ins, Bridge loaders, test-only training runs: ``tests/harness``, not
in the wheel) is the package ``tests.harness``: the repository root goes on the path for it (first,
as pytest puts it for the package ``tests``), and ``tests/harness`` itself is not a path entry, so
its modules have only that one name. What the ``regather`` command needs at run time (the rank
launcher, the CPU run-time patches, the tiny models, the measured loops) is product code:
:mod:`regather.tools.cpu`.
"""

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent
_TOPS = {_HERE / "unit", _HERE / "distributed"}
_HARNESS = _HERE / "harness"
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))
for _folder in sorted(p for p in _HERE.rglob("*") if p.is_dir() and p.name != "__pycache__"
                      and not p.name.startswith(".") and p not in _TOPS and _HARNESS not in (p, *p.parents)):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def pytest_configure(config):
    config.addinivalue_line("markers", "megatron: reaches megatron by import (tests.harness.tiers): make test-compat "
                                       "runs it again on megatron-core 0.19.2")
    config.addinivalue_line("markers", "torch_version_sensitive: make test-torch214 runs it again on torch 2.14 "
                                       "(tests.harness.tiers.TORCH_TIER, with the reason)")


def pytest_collection_modifyitems(config, items):
    """The markers ``megatron`` and ``torch_version_sensitive``, by the rules of :mod:`tests.harness.tiers`
    (which CI tier runs a test again on another stack); then the files in the order pytest-xdist should start
    them, the longest first (:mod:`tests.harness.schedule`)."""
    from tests.harness import schedule, tiers

    tiers.mark(items)
    schedule.order(items)


@pytest.fixture
def single_rank_group(tmp_path):
    """A real one-rank gloo group (megatron mappings need a group even at TP=1)."""
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()

"""regather.core.allocated.AllocatedBytes and Python's collector: what a reference cycle made in the region
holds is garbage at a mark; the region freezes what existed before it, whatever was frozen already, and
thaws everything at its end."""

import gc

import torch

from regather.core.allocated import AllocatedBytes

N = 1 << 16  # one fp32 block of 256 KiB


def _cycle_holding_a_block() -> None:
    a: dict = {"t": torch.empty(N)}
    a["self"] = a  # dropped here: only the collector frees the block


def test_a_cycle_made_in_the_region_is_garbage_at_a_mark():
    with AllocatedBytes() as region:
        _cycle_holding_a_block()
        region.mark("after")
        kept = torch.empty(N)
    assert region.alive_at("after") == 0 and region.alive == region.peak == N * 4
    del kept
    assert gc.get_freeze_count() == 0  # on CPython 3.12 too, which starts with objects frozen


def test_a_programs_own_freeze_still_scans_only_the_region_and_is_thawed_at_its_end():
    """CPython 3.12 starts with objects frozen: the region freezes what exists whatever is frozen already (a
    rule "only where nothing is frozen" made every region there run full collections), and its end thaws
    everything, as ``gc.unfreeze`` does (the module doc says so)."""
    gc.collect()
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        with AllocatedBytes() as region:
            during = gc.get_freeze_count()
            _cycle_holding_a_block()
            region.mark("after")
        assert during > 0 and region.alive_at("after") == 0  # the region's collection still finds the cycle
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()

"""regather.core.allocated.AllocatedBytes and Python's collector: what a reference cycle made in the region
holds is garbage at a mark; the region freezes what existed before it only where nothing is frozen yet, and
leaves a program's own freeze as it found it."""

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
    assert gc.get_freeze_count() == 0


def test_a_programs_own_freeze_is_left_as_it_was():
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with AllocatedBytes() as region:
            _cycle_holding_a_block()
            region.mark("after")
        assert gc.get_freeze_count() == frozen  # nothing thawed, nothing added
        assert region.alive_at("after") == 0  # the full collection still finds the cycle
    finally:
        gc.unfreeze()


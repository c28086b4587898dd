"""regather.core.allocated.AllocatedBytes on two gloo ranks: a settled region counts the blocks that
outlive it, whichever thread drops a collective's tensors last (the module doc says why that races)."""

import pytest
from workers_allocated import SHAPE, settled_regions

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PAIRS = 8


def test_settled_regions_count_what_outlives_them():
    for rank, r in enumerate(run_ranks(settled_regions, 2, PAIRS, timeout=120)):
        # the smaller of two settled regions: a worker descheduled across the drains can only add bytes
        assert r["dying"] == [0] * PAIRS, (rank, r)
        kept = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * 4  # one gathered output, fp32
        assert r["kept"] == [kept] * PAIRS, (rank, r)
        print(f"rank {rank}: unsettled regions with phantom bytes: {r['unsettled_with_phantoms']} of {PAIRS}")


def test_settling_each_collective_gives_the_exact_peak():
    from workers_allocated import peak_regions

    shard = SHAPE[0] * SHAPE[1] * SHAPE[2] * 4
    gathered = 2 * shard
    for rank, r in enumerate(run_ranks(peak_regions, 2, 4, timeout=120)):
        # the shard, the kept output, then a later one with its double, every time; beyond the tensors
        # only bookkeeping of a few bytes (20 here: scalars torch allocates in the region), never a block
        for peak, at_mark, alive in r["settled"]:
            assert 0 <= peak - (shard + 3 * gathered) < 256 and at_mark == gathered and alive == 0, (rank, r)
        assert len(set(r["settled"])) == 1, (rank, r)  # the same every time: nothing left to a race
        # held to the end, every output outlives its use: what settle_each_collective avoids
        assert all(p > 3 * gathered for p in r["held"]), (rank, r)

"""Rank bodies for test_allocated.py: regions of gloo all-gathers whose outputs die inside them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from regather.core.allocated import AllocatedBytes

GATHERS = 6          # all-gathers a region runs (each kind)
SHAPE = (64, 2, 64)  # one rank's shard, fp32: 32 KiB; the gathered output 64 KiB


def _gathers(keep: list) -> None:
    """Functional (DTensor's kind) and ``c10d`` all-gathers of a shard made inside the region; every
    output dies inside it except those appended to ``keep``."""
    x = torch.randn(*SHAPE)
    for i in range(GATHERS):
        y = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, dist.group.WORLD))
        (y * 2).sum()
        w = torch.empty(SHAPE[0] * dist.get_world_size(), *SHAPE[1:])
        dist.all_gather_into_tensor(w, x)
        if i == 0:
            keep.append(w)


def settled_regions(rank, world_size, pairs: int) -> dict:
    """``pairs`` pairs of settled regions: the smaller count of each pair, with and without an
    output kept past the region; and, for the record, how many unsettled regions had phantom bytes."""
    out = {"dying": [], "kept": [], "unsettled_with_phantoms": 0}
    for _ in range(pairs):
        for what in ("dying", "kept"):
            counts = []
            for _ in range(2):
                keep: list = []
                with AllocatedBytes(settle_collectives=True, hold_collective_tensors=True) as a:
                    _gathers(keep if what == "kept" else [])
                counts.append(a.alive)
                del keep
            out[what].append(min(counts))
        with AllocatedBytes() as a:
            _gathers([])
        out["unsettled_with_phantoms"] += a.alive > 0
    return out


def _peak_region(keep: list, functional: bool) -> None:
    """Gathered outputs: the first kept, each later one alive with its double then dropped; the peak
    is the shard and three gathered outputs, ``keep`` one gathered output."""
    x = torch.randn(*SHAPE)
    for i in range(GATHERS):
        if functional:
            y = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, dist.group.WORLD))
        else:
            y = torch.empty(SHAPE[0] * dist.get_world_size(), *SHAPE[1:])
            work = dist.all_gather_into_tensor(y, x, async_op=bool(i % 2))
            if work is not None:
                work.wait()
            del work  # a work holds its tensors
        if i == 0:
            keep.append(y)
            continue
        z = y * 2
        del y, z


def peak_regions(rank, world_size, repeats: int) -> dict:
    """``settle_each_collective``: every sample of the peak, and what is alive at a mark, for c10d (sync
    and async) and functional all-gathers; with the collective tensors held to the end instead, the peak
    is higher (every output held)."""
    out = {"settled": {False: [], True: []}, "held": []}
    for _ in range(repeats):
        for functional in (False, True):
            keep: list = []
            with AllocatedBytes(settle_each_collective=True) as a:
                _peak_region(keep, functional)
                a.mark("end")
                keep.clear()
            out["settled"][functional].append((a.peak, a.alive_at("end"), a.alive))
        with AllocatedBytes(settle_collectives=True, hold_collective_tensors=True) as a:
            _peak_region([], False)
        out["held"].append(a.peak)
    return out

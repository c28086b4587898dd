"""A large test matrix run a group at a time: one :func:`~regather.tools.cpu.dist.run_ranks` spawn
per group of items, started by the first test that asks for one of its items.

Why: a test that asks a module-scoped fixture for one big spawn pays for the whole spawn inside
its own pytest-timeout. The recompute matrix in one spawn (153 runs) took 152 s here inside
``make test`` on 2 cores, and outlived the 585 s its first test had on the busier CI machine
(CI, 2026-12-03: 418 errors). Split into groups, each test pays for one group only; the total
work grows by one start-up per group.

A group whose spawn failed fails every test that asks for one of its items, with the same
message, without being run again (a hung spawn would otherwise cost its stall window once per
test).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from regather.tools.cpu.dist import run_ranks


class SpawnFailed(RuntimeError):
    """The spawn of an item's group raised (or raised before, for a later item of the group)."""


def group_by_cost(costs: Mapping[Hashable, float], budget: float) -> list[list]:
    """Consecutive items (in ``costs``' order) packed into groups of total cost <= ``budget``;
    an item that costs more than the budget alone is a group of its own."""
    if budget <= 0:
        raise ValueError(f"budget={budget!r} must be > 0")
    groups: list[list] = []
    total = 0.0
    for item, cost in costs.items():
        if cost < 0:
            raise ValueError(f"cost of {item!r} is {cost!r}, must be >= 0")
        if not groups or total + cost > budget:
            groups.append([])
            total = 0.0
        groups[-1].append(item)
        total += cost
    return groups


class SpawnGroups:
    """``fn(rank, world_size, group, *args, **kwargs)`` on ``world_size`` ranks, once per group.

    ``groups``: the items, each in exactly one group (a list of lists). ``ranks(item)`` returns
    the per-rank results of the item's group (what ``fn`` returned on each rank), running the
    group's spawn on first use; ``timeout`` and the other launcher options are ``run_ranks``'.
    """

    def __init__(self, fn: Callable[..., Any], world_size: int, groups: Iterable[Iterable[Hashable]],
                 *args: Any, timeout: float, **kwargs: Any):
        self.groups = [tuple(g) for g in groups]
        self.group_of: dict = {}
        for i, group in enumerate(self.groups):
            if not group:
                raise ValueError(f"group {i} is empty")
            for item in group:
                if item in self.group_of:
                    raise ValueError(f"{item!r} is in group {self.group_of[item]} and in group {i}")
                self.group_of[item] = i
        self._fn, self._world, self._args, self._kwargs = fn, world_size, args, kwargs
        self._timeout = timeout
        self._done: dict[int, list] = {}
        self._failed: dict[int, str] = {}

    def ranks(self, item: Hashable) -> list:
        """Per-rank results of the spawn that ran ``item``'s group (run now if not yet)."""
        try:
            i = self.group_of[item]
        except KeyError:
            raise KeyError(f"{item!r} is in no group (items: {', '.join(sorted(map(repr, self.group_of)))})") from None
        if i in self._failed:
            raise SpawnFailed(f"the spawn of group {i} {list(self.groups[i])} failed earlier: {self._failed[i]}")
        if i not in self._done:
            try:
                self._done[i] = run_ranks(self._fn, self._world, self.groups[i], *self._args,
                                          timeout=self._timeout, **self._kwargs)
            except Exception as exc:
                self._failed[i] = f"{type(exc).__name__}: {exc}"
                raise SpawnFailed(f"the spawn of group {i} {list(self.groups[i])} failed: {self._failed[i]}") from exc
        return self._done[i]

    def run_all(self) -> dict[int, list]:
        """Every group's per-rank results (running the ones not run yet), by group index."""
        for group in self.groups:
            self.ranks(group[0])
        return dict(self._done)

"""tests.harness.spawn_groups: groups packed by cost, one spawn per group on first use, a failed
group reported to every later item without running again."""

import os

import pytest
from tests.harness.spawn_groups import SpawnFailed, SpawnGroups, group_by_cost

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def record_group(rank, world_size, group, log_dir, fail_on=None):
    """Leaves one file per (spawn, rank) in ``log_dir``; raises when ``fail_on`` is in the group."""
    with open(os.path.join(log_dir, f"{'-'.join(group)}.{rank}.{os.getpid()}"), "w"):
        pass
    if fail_on in group:
        raise ValueError(f"injected failure for {fail_on}")
    return {"rank": rank, "group": list(group)}


def test_group_by_cost_packs_in_order_within_the_budget():
    assert group_by_cost({"a": 12, "b": 7, "c": 12, "d": 5, "e": 40, "f": 1}, 30) == [
        ["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert group_by_cost({}, 30) == []
    with pytest.raises(ValueError, match=r"budget=0 must be > 0"):
        group_by_cost({"a": 1}, 0)
    with pytest.raises(ValueError, match=r"cost of 'a' is -1, must be >= 0"):
        group_by_cost({"a": -1}, 5)


def test_bad_groups_are_named_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match=r"'x' is in group 0 and in group 1"):
        SpawnGroups(record_group, 1, [["x"], ["x"]], str(tmp_path), timeout=60)
    with pytest.raises(ValueError, match=r"group 1 is empty"):
        SpawnGroups(record_group, 1, [["x"], []], str(tmp_path), timeout=60)
    assert os.listdir(tmp_path) == []


def test_each_group_runs_once_on_first_use(tmp_path):
    spawns = SpawnGroups(record_group, 2, [["a", "b"], ["c"]], str(tmp_path), timeout=60)
    assert os.listdir(tmp_path) == []  # nothing runs before an item is asked for
    first = spawns.ranks("b")
    assert first == [{"rank": 0, "group": ["a", "b"]}, {"rank": 1, "group": ["a", "b"]}]
    assert spawns.ranks("a") is first  # the same spawn's results, not a second spawn
    assert sorted(n.rsplit(".", 1)[0] for n in os.listdir(tmp_path)) == ["a-b.0", "a-b.1"]
    assert sorted(spawns.run_all()) == [0, 1]
    assert sorted(n.rsplit(".", 1)[0] for n in os.listdir(tmp_path)) == ["a-b.0", "a-b.1", "c.0", "c.1"]
    with pytest.raises(KeyError, match=r"'z'.* is in no group"):
        spawns.ranks("z")


def test_a_failed_group_fails_its_later_items_without_running_again(tmp_path):
    spawns = SpawnGroups(record_group, 2, [["a", "b"], ["c"]], str(tmp_path), fail_on="a", timeout=60)
    with pytest.raises(SpawnFailed, match=r"the spawn of group 0 \['a', 'b'\] failed: RankFailed: .*"
                                          r"injected failure for a"):
        spawns.ranks("a")
    runs = sorted(os.listdir(tmp_path))
    with pytest.raises(SpawnFailed, match=r"group 0 \['a', 'b'\] failed earlier: RankFailed: .*injected failure"):
        spawns.ranks("b")
    assert sorted(os.listdir(tmp_path)) == runs  # not run again
    assert spawns.ranks("c")[1] == {"rank": 1, "group": ["c"]}  # the other group is unaffected

"""regather.tools.cpu.dist.run_ranks: a raising or dying rank fails fast, a hung run (no rank uses
CPU) raises TimeoutError within the stall window with the ranks' stacks, a slow but busy run
passes, a busy-forever run stops at the hard ceiling, before pytest-timeout's alarm."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from regather.tools.cpu import dist as launcher
from regather.tools.cpu.dist import RankFailed, run_ranks

# pytest-timeout marks are backstops sized for a machine at load 100+ (start-up alone took up to
# 90 s there); every bound that the tests assert is measured from the event it is about.
pytestmark = [pytest.mark.distributed]
NEVER = 3600.0  # a limit that must not be the one that fires


# -- workers (module level: the spawned ranks import them) --------------------------------------


def _note_pid(pid_dir):
    """Leave ``<pid>.pid`` in ``pid_dir``: the file's mtime says when the rank got there."""
    if pid_dir:
        with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w"):
            pass


def _since_last_note(pid_dir):
    return time.time() - max(os.stat(os.path.join(pid_dir, n)).st_mtime for n in os.listdir(pid_dir))


def raise_on_rank_1(rank, world_size):
    x = torch.ones(2)
    dist.all_reduce(x)
    if rank == 1:
        raise ValueError(f"injected failure on rank 1 at t={time.time():.3f}")
    dist.all_reduce(x)  # rank 1 never joins
    return "unreachable"


def exit_on_rank_1(rank, world_size, pid_dir):
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        _note_pid(pid_dir)
        os._exit(7)
    dist.all_reduce(torch.ones(2))
    return "unreachable"


def sleeping_partner(rank, world_size, pid_dir=None):
    """Rank 1 sleeps forever, rank 0 waits for it in all_reduce: nobody computes."""
    dist.all_reduce(torch.ones(2))
    _note_pid(pid_dir)
    if rank == 1:
        time.sleep(NEVER)
    dist.all_reduce(torch.ones(2))
    return "unreachable"


def deadlocked_recv(rank, world_size, pid_dir):
    """Each rank waits to receive from the other: a deadlock inside gloo."""
    dist.all_reduce(torch.ones(2))
    _note_pid(pid_dir)
    x = torch.zeros(2)
    dist.recv(x, src=1 - rank)
    return "unreachable"


def _spin(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def busy_then_reduce(rank, world_size, busy_s):
    """Rank 0 computes for ``busy_s`` s of wall time while rank 1 waits for it in all_reduce."""
    dist.all_reduce(torch.ones(2))
    if rank == 0:
        _spin(busy_s)
    x = torch.full((2,), float(rank + 1))
    dist.all_reduce(x)
    return x.tolist()


def spin_forever(rank, world_size):
    dist.all_reduce(torch.ones(2))
    if rank == 0:
        _spin(NEVER)
    dist.all_reduce(torch.ones(2))
    return "unreachable"


def _assert_gone(pid_dir):
    pids = [int(n.split(".")[0]) for n in os.listdir(pid_dir)]
    assert len(pids) == 2, pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- fail fast ----------------------------------------------------------------------------------


# Bounds are measured from the moment the rank failed or hung, not from the start: starting
# two ranks (spawn, import torch) took 2 to 53 s on the shared 2-core machine.


@pytest.mark.timeout(300)
def test_a_raising_rank_fails_fast_with_its_traceback():
    with pytest.raises(RankFailed) as info:
        run_ranks(raise_on_rank_1, 2, timeout=NEVER, stall_timeout=NEVER)
    msg = str(info.value)
    assert msg.startswith("rank 1: ValueError: injected failure on rank 1 at t="), msg
    assert "Traceback" in msg and "raise_on_rank_1" in msg, msg
    raised_at = float(msg.split("at t=")[1].split()[0])
    assert time.time() - raised_at < 30, f"{time.time() - raised_at:.0f} s to report a raising rank"


@pytest.mark.timeout(300)
def test_a_rank_that_exits_without_a_result_fails_fast(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_ranks(exit_on_rank_1, 2, str(tmp_path), timeout=NEVER, stall_timeout=NEVER)
    # the cause first, even when rank 0's "Connection reset by peer" was written before the
    # parent saw rank 1 gone
    assert str(info.value).startswith("rank 1 exited with code 7 without reporting a result"), str(info.value)
    assert _since_last_note(tmp_path) < 30


# -- hangs --------------------------------------------------------------------------------------

STALL = 5.0


@pytest.mark.timeout(300)
def test_a_hung_pair_raises_timeout_within_the_stall_window_with_stacks(tmp_path):
    with pytest.raises(TimeoutError) as info:
        run_ranks(sleeping_partner, 2, str(tmp_path), timeout=NEVER, stall_timeout=STALL)
    hung_for = _since_last_note(tmp_path)
    msg = str(info.value)
    assert "no rank made progress for" in msg and "ranks [0, 1] unfinished" in msg, msg
    # faulthandler's dump of each rank: rank 1 sleeps in the worker, rank 0 waits in all_reduce
    assert "--- rank 0" in msg and "--- rank 1" in msg, msg
    assert msg.count("in sleeping_partner") == 2, msg
    assert "in all_reduce" in msg, msg
    assert hung_for < STALL + 30, f"TimeoutError {hung_for:.0f} s after the ranks hung"
    _assert_gone(tmp_path)


@pytest.mark.timeout(300)
def test_a_deadlock_inside_gloo_raises_timeout(tmp_path):
    with pytest.raises(TimeoutError, match="no rank made progress") as info:
        run_ranks(deadlocked_recv, 2, str(tmp_path), timeout=NEVER, stall_timeout=STALL)
    assert "in recv" in str(info.value)
    assert _since_last_note(tmp_path) < STALL + 30


@pytest.mark.timeout(300)
def test_a_slow_but_busy_rank_is_not_a_hang():
    """Rank 0 computes for 3.5 stall windows while rank 1 sleeps in all_reduce: the run passes."""
    stall = 3.0
    assert run_ranks(busy_then_reduce, 2, 3.5 * stall, timeout=NEVER, stall_timeout=stall) == [[3.0, 3.0]] * 2


@pytest.mark.timeout(300)
def test_a_rank_spinning_forever_stops_at_the_hard_ceiling(monkeypatch):
    monkeypatch.setenv("REGATHER_TEST_TIMEOUT_SCALE", "1")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(spin_forever, 2, timeout=8, stall_timeout=NEVER)
    msg = str(info.value)
    assert "hard ceiling of 8 s" in msg and "REGATHER_TEST_TIMEOUT_SCALE=1" in msg, msg
    assert "--- rank 0" in msg and "--- rank 1" in msg, msg  # stacks, once the ranks are past start-up
    assert time.monotonic() - t0 < 8 + 30  # the ceiling runs from the start, on the parent's clock


@pytest.mark.timeout(40)
def test_the_ceiling_fires_before_pytest_timeout():
    """Nothing but pytest-timeout's own alarm (40 s) would stop this run: the launcher stops it
    first, with the ranks' stacks in its TimeoutError, instead of pytest failing it without them.
    (The stacks' content is checked by the stall tests: here the ranks may still be starting,
    ~20 s on a 2-core machine at load 12.)"""
    if launcher._alarm_left() <= 0:
        pytest.skip("pytest-timeout is not using its signal method here")
    with pytest.raises(TimeoutError, match="before the pending SIGALRM") as info:
        run_ranks(sleeping_partner, 2, timeout=NEVER, stall_timeout=NEVER)
    assert "--- rank 0" in str(info.value) and "--- rank 1" in str(info.value)


def test_ceiling_arithmetic():
    assert launcher._ceiling(120, 3, 0)[0] == 360
    assert launcher._ceiling(120, 3, 100)[0] == 100 - launcher.ALARM_MARGIN_S
    assert launcher._ceiling(10, 3, 100)[0] == 30  # the alarm is further off than the ceiling
    assert launcher._ceiling(120, 3, 10)[0] == 5  # an alarm closer than the margin: half of it


def test_bad_scale_is_named(monkeypatch):
    monkeypatch.setenv("REGATHER_TEST_TIMEOUT_SCALE", "lots")
    with pytest.raises(ValueError, match="REGATHER_TEST_TIMEOUT_SCALE='lots'"):
        run_ranks(busy_then_reduce, 2, 0.0)


@pytest.mark.timeout(300)
def test_ranks_die_with_the_launching_process(tmp_path):
    """A test process killed from outside (pytest-timeout's thread method, a crash) leaves no ranks."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_dist_launcher import sleeping_partner
        from regather.tools.cpu.dist import run_ranks
        run_ranks(sleeping_partner, 2, {str(tmp_path)!r}, timeout=3600, stall_timeout=3600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        end = time.monotonic() + 240  # start-up: 2 s quiet, over 90 s at load 126 on 2 cores
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < end:
            time.sleep(0.2)
        assert len(os.listdir(tmp_path)) == 2, "ranks did not start"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    pids = [int(n.split(".")[0]) for n in os.listdir(tmp_path)]
    end = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < end:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.2)
    assert not alive, f"ranks {alive} outlived their launcher"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, just not reaped
    except OSError:
        return False

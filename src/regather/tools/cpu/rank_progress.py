"""Is a rank working? Sampled from ``/proc``, for the launcher's stall check (:mod:`.dist`).

"Progress" is a thread that runs or wants to run. A rank blocked in a gloo
collective, or in the ``file://`` rendezvous, waiting for a partner *sleeps*.
Measured here (torch 2.13 CPU, 2 ranks, one sleeping, the other in all_reduce /
barrier / all_gather / async ``wait()`` / recv): the waiting rank's main thread
uses no CPU; each gloo process group's ``gloo_tcp_loop`` thread wakes ~90 times
a second for ~12 us (0.1-0.2 % of a core; with megatron's ~30 groups a rank has
~65 such threads) and goes back to sleep by itself: ~88 voluntary context
switches a second and 0.5 nonvoluntary ones (preempted) at load 25 on 2 cores,
although it then waited 31 % of the time in the run queue; a rank polling the
rendezvous file uses 0.6 % of a core in its main thread. A thread that computes
uses a core, or, on a loaded machine, is preempted at the end of each time
slice: 1379 nonvoluntary switches a second and none voluntary at load 25, while
its CPU share can fall to 1.5 % (seen at load 64). So every ``SAMPLE_S`` the
parent reads each thread of each rank (``/proc/<pid>/task/<tid>/schedstat``
and ``status``; threads that came or went, reaped children and live child
processes count as one more thread, by CPU time), and calls the run hung when,
over the last ``stall_timeout`` seconds, no thread of any unfinished rank
*worked*: used more than ``IDLE_CPU_FRACTION`` (2 %) of a core, or was
preempted more than ``PREEMPTS_PER_S`` (1) times a second in more than
``PREEMPT_SHARE`` (20 %) of its switches. Without ``/proc`` the check is off.
A slow run that keeps computing is never stopped by it; a rank spinning
forever is caught only by the hard ceiling.

:func:`collect_stacks` asks each unfinished rank for the Python stacks of all its threads
(``SIGUSR1``, which the launcher's ranks route to ``faulthandler``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import NamedTuple

#: A thread works in a window when it used more than this share of a core ...
IDLE_CPU_FRACTION = 0.02
#: ... or was preempted (a nonvoluntary context switch: it wanted to keep running) more than this
#: many times per second, and in more than ``PREEMPT_SHARE`` of its context switches. A thread
#: that sleeps between short wake-ups switches voluntarily, however loaded the machine.
PREEMPTS_PER_S = 1.0
PREEMPT_SHARE = 0.2
STACK_CHARS = 6000


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Cpu(NamedTuple):
    total: float  # CPU-s: all threads (exited ones too), reaped children, live descendants
    threads: dict  # tid -> (CPU-s, voluntary, nonvoluntary context switches) of each live thread


def stat_ticks(path: str, with_children: bool) -> int:
    with open(path) as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return sum(int(x) for x in fields[11:15 if with_children else 13])  # utime stime [cutime cstime]


def thread_times(task: str) -> tuple[float, int, int]:
    try:
        with open(f"{task}/schedstat") as f:
            cpu = int(f.read().split()[0]) / 1e9  # ns on a CPU, finer than stat's ticks
    except (OSError, ValueError, IndexError):
        cpu = stat_ticks(f"{task}/stat", False) / CLK_TCK
    vol = invol = 0
    try:
        with open(f"{task}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol = int(line.split()[1])
    except OSError:
        pass
    return cpu, vol, invol


def cpu_snapshot(pid: int) -> Cpu | None:
    """Per-thread and total CPU times of ``pid``; ``None`` when unreadable (no /proc, exited)."""
    try:
        total = stat_ticks(f"/proc/{pid}/stat", True)
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, ValueError):
        return None
    threads = {}
    for tid in tids:
        try:
            threads[int(tid)] = thread_times(f"/proc/{pid}/task/{tid}")
        except (OSError, ValueError):
            pass  # a thread that just exited
    # Live descendants, as whole processes: those started from main threads (reading every
    # thread's ``children`` costs more than the stats; children of other threads count once reaped).
    todo, seen = [pid], set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        try:
            if c != pid:
                total += stat_ticks(f"/proc/{c}/stat", True)
            with open(f"/proc/{c}/task/{c}/children") as f:
                todo.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return Cpu(total / CLK_TCK, threads)


def cpu_used(old: Cpu, new: Cpu, window: float) -> tuple[bool, float, float, float]:
    """(a thread worked, busiest thread's CPU-s, most preemptions per second of a thread,
    CPU-s of the whole rank) between two snapshots ``window`` seconds apart."""
    common = old.threads.keys() & new.threads.keys()
    cpu_limit = IDLE_CPU_FRACTION * window
    worked, busiest, preempts, cpu_sum = False, 0.0, 0.0, 0.0
    for t in common:
        (c0, v0, i0), (c1, v1, i1) = old.threads[t], new.threads[t]
        cpu, vol, invol = c1 - c0, v1 - v0, i1 - i0
        cpu_sum += cpu
        busiest, preempts = max(busiest, cpu), max(preempts, invol / window)
        if cpu > cpu_limit or (invol > PREEMPTS_PER_S * window and invol > PREEMPT_SHARE * (vol + invol)):
            worked = True
    rest = (new.total - old.total) - cpu_sum  # threads that came or went, children (CPU only)
    busiest = max(busiest, rest)
    return worked or rest > cpu_limit, busiest, preempts, new.total - old.total


def collect_stacks(procs, ranks, tmp: str, wait_s: float = 3.0) -> dict[int, str]:
    """SIGUSR1 each rank (faulthandler dumps every thread's stack), return the dumps."""
    paths = {r: os.path.join(tmp, f"rank{r}.stacks") for r in ranks}
    signalled = []
    for r in ranks:
        if procs[r].is_alive() and os.path.exists(paths[r]):  # exists: the handler is registered
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
                signalled.append(r)
            except OSError:
                pass
    out: dict[int, str] = {}
    sizes: dict[int, int] = {}
    end = time.monotonic() + wait_s
    while signalled and time.monotonic() < end:
        time.sleep(0.1)
        for r in list(signalled):
            size = os.path.getsize(paths[r])
            if size > 0 and sizes.get(r) == size:  # written and no longer growing
                signalled.remove(r)
            sizes[r] = size
    for r in ranks:
        try:
            with open(paths[r]) as f:
                text = f.read()
        except OSError:
            text = ""
        if len(text) > STACK_CHARS:
            text = text[:STACK_CHARS] + f"\n... ({len(text) - STACK_CHARS} more characters)"
        if not text:
            text = ("(no stack: the rank did not answer SIGUSR1)" if os.path.exists(paths[r]) else
                    "(no stack: the rank was still starting: spawn, imports, unpickling its arguments)")
        out[r] = text
    return out


def format_stacks(procs, stacks: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} (pid {procs[r].pid}) Python stacks, most recent call first ---\n{s.rstrip()}\n"
                   for r, s in sorted(stacks.items()))


def window(samples, unfinished):
    """(some thread worked, busiest thread's CPU-s, most preemptions/s of a thread, all CPU-s,
    seconds) of ``unfinished`` from the oldest kept sample to the newest, or None where a
    snapshot is missing."""
    if len(samples) < 2:
        return None
    (t0, old), (t1, new) = samples[0], samples[-1]
    if t1 <= t0 or any(old[r] is None or new[r] is None for r in unfinished):
        return None  # no /proc, or a rank just exited (the next poll reports it)
    used = [cpu_used(old[r], new[r], t1 - t0) for r in unfinished]
    return (any(u[0] for u in used), max(u[1] for u in used), max(u[2] for u in used),
            sum(u[3] for u in used), t1 - t0)


def stalled(samples, unfinished, now: float, stall: float):
    """:func:`window` when no thread of the unfinished ranks worked over the last ``stall``
    seconds, else None."""
    while len(samples) >= 2 and samples[1][0] <= now - stall:
        samples.popleft()  # keep exactly one sample at least ``stall`` old
    if samples[0][0] > now - stall or not unfinished:
        return None
    w = window(samples, unfinished)
    if w is not None and not w[0]:
        return w
    return None

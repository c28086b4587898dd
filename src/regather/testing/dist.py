"""Launch a function on N gloo ranks from a test: fail fast, give slowness room, catch hangs.

Each rank is a fresh ``spawn`` process with its own ``file://`` rendezvous, so
tests running in parallel under pytest-xdist never share a port. The parent
polls the ranks and stops them all when

1. a rank raises (``RankFailed`` with that rank's traceback) or exits without
   a result (``RankFailed`` with its exit code) — within a fraction of a second;
2. **no unfinished rank makes progress** for ``stall_timeout`` seconds
   (default 60 s, env ``REGATHER_STALL_TIMEOUT``) — ``TimeoutError``;
3. the **hard ceiling** ``timeout * REGATHER_TEST_TIMEOUT_SCALE`` (default
   scale 3) passes — ``TimeoutError``. Under pytest-timeout (its ``signal``
   method arms ``ITIMER_REAL``), the ceiling is cut to end ``ALARM_MARGIN_S``
   before that alarm, so the launcher's own error, with the rank stacks, comes
   before pytest-timeout fails the test.

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

On a stall or at the ceiling the parent signals each unfinished rank with
SIGUSR1, where ``faulthandler`` writes the Python stack of every thread to a
file, and puts those stacks into the ``TimeoutError`` message before killing
the ranks. The same stacks go to stderr when something outside (pytest-timeout,
Ctrl-C) interrupts the parent. Ranks die with their parent (``PR_SET_PDEATHSIG``),
so a killed test process leaves no ranks behind.

``pg_timeout`` (each collective's timeout) defaults to the hard ceiling plus
30 s, so a rank waiting for a slow partner never errors on it: stall detection
covers hangs.
"""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.multiprocessing as mp

#: Seconds without progress after which a run counts as hung (env REGATHER_STALL_TIMEOUT).
STALL_TIMEOUT_S = 60.0
#: ``timeout`` is multiplied by this to get the hard ceiling (env REGATHER_TEST_TIMEOUT_SCALE).
TIMEOUT_SCALE = 3.0
#: A thread works in a window when it used more than this share of a core ...
IDLE_CPU_FRACTION = 0.02
#: ... or was preempted (a nonvoluntary context switch: it wanted to keep running) more than this
#: many times per second, and in more than ``PREEMPT_SHARE`` of its context switches. A thread
#: that sleeps between short wake-ups switches voluntarily, however loaded the machine.
PREEMPTS_PER_S = 1.0
PREEMPT_SHARE = 0.2
#: How often CPU time is sampled, in seconds (at most; a tenth of a short stall window).
SAMPLE_S = 2.0
#: The ceiling ends this many seconds before a pending SIGALRM (pytest-timeout's signal method).
ALARM_MARGIN_S = 15.0
_POLL_S = 0.02
_STACK_CHARS = 6000


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries its traceback or exit code."""


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        out = float(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number") from exc
    if out <= 0:
        raise ValueError(f"{name}={value!r} must be > 0")
    return out


# -- in the rank --------------------------------------------------------------------------------

_stack_file = None  # kept open for faulthandler for the life of the rank


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this rank when the launching process dies (Linux; no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except Exception:
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _enable_stack_dump(out_dir: str, rank: int) -> None:
    global _stack_file
    import faulthandler

    if not hasattr(faulthandler, "register"):
        return
    _stack_file = open(os.path.join(out_dir, f"rank{rank}.stacks"), "w")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)


def _rank_main(fn, rank, world_size, init_file, out_dir, pg_timeout_s, parent_pid, args, kwargs):
    _die_with_parent(parent_pid)
    _enable_stack_dump(out_dir, rank)
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Apex.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args, **kwargs)
        payload = ("ok", value)
    except BaseException as exc:
        payload = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(result_path + ".tmp", result_path)
    if payload[0] == "ok":
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    os._exit(0 if payload[0] == "ok" else 1)


# -- in the parent ------------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class _Cpu(NamedTuple):
    total: float  # CPU-s: all threads (exited ones too), reaped children, live descendants
    threads: dict  # tid -> (CPU-s, voluntary, nonvoluntary context switches) of each live thread


def _stat_ticks(path: str, with_children: bool) -> int:
    with open(path) as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return sum(int(x) for x in fields[11:15 if with_children else 13])  # utime stime [cutime cstime]


def _thread_times(task: str) -> tuple[float, int, int]:
    try:
        with open(f"{task}/schedstat") as f:
            cpu = int(f.read().split()[0]) / 1e9  # ns on a CPU, finer than stat's ticks
    except (OSError, ValueError, IndexError):
        cpu = _stat_ticks(f"{task}/stat", False) / _CLK_TCK
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


def _cpu_snapshot(pid: int) -> _Cpu | None:
    """Per-thread and total CPU times of ``pid``; ``None`` when unreadable (no /proc, exited)."""
    try:
        total = _stat_ticks(f"/proc/{pid}/stat", True)
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, ValueError):
        return None
    threads = {}
    for tid in tids:
        try:
            threads[int(tid)] = _thread_times(f"/proc/{pid}/task/{tid}")
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
                total += _stat_ticks(f"/proc/{c}/stat", True)
            with open(f"/proc/{c}/task/{c}/children") as f:
                todo.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return _Cpu(total / _CLK_TCK, threads)


def _used(old: _Cpu, new: _Cpu, window: float) -> tuple[bool, float, float, float]:
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


def _alarm_left() -> float:
    """Seconds until a pending SIGALRM (pytest-timeout's ``signal`` method), 0 when none."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "getitimer"):
        return 0.0
    return signal.getitimer(signal.ITIMER_REAL)[0]


def _ceiling(timeout: float, scale: float, alarm_left: float) -> tuple[float, str]:
    """Hard ceiling in seconds from now, and how it was set."""
    ceiling = timeout * scale
    how = f"timeout={timeout:g} s x REGATHER_TEST_TIMEOUT_SCALE={scale:g}"
    if alarm_left > 0:
        cut = max(alarm_left - ALARM_MARGIN_S, alarm_left / 2)
        if cut < ceiling:
            return cut, f"{ALARM_MARGIN_S:g} s before the pending SIGALRM (pytest-timeout) in {alarm_left:.0f} s"
    return ceiling, how


def _collect_stacks(procs, ranks, tmp: str, wait_s: float = 3.0) -> dict[int, str]:
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
        if len(text) > _STACK_CHARS:
            text = text[:_STACK_CHARS] + f"\n... ({len(text) - _STACK_CHARS} more characters)"
        if not text:
            text = ("(no stack: the rank did not answer SIGUSR1)" if os.path.exists(paths[r]) else
                    "(no stack: the rank was still starting: spawn, imports, unpickling its arguments)")
        out[r] = text
    return out


def _format_stacks(procs, stacks: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} (pid {procs[r].pid}) Python stacks, most recent call first ---\n{s.rstrip()}\n"
                   for r, s in sorted(stacks.items()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float | None = None,
    stall_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn`` must be importable (module level). Returns the per-rank results.

    - ``timeout``: the wall-clock time the caller expects the run to need on a
      quiet machine. The hard ceiling is ``timeout * REGATHER_TEST_TIMEOUT_SCALE``
      (default 3), cut to end ``ALARM_MARGIN_S`` before a pending pytest-timeout
      alarm. It only stops ranks that keep using CPU (a busy loop, or a run that
      is far slower than expected); hung ranks are stopped by the stall check.
    - ``stall_timeout``: seconds without progress (no thread of an unfinished
      rank on a CPU or waiting for one, see the module docstring) after which
      the run is hung (default ``REGATHER_STALL_TIMEOUT`` or 60 s).
    - ``pg_timeout``: each collective's timeout in the ranks (default: the hard
      ceiling + 30 s, so that a slow partner never trips it).

    Raises ``RankFailed`` when a rank raises or dies, ``TimeoutError`` (with the
    unfinished ranks' Python stacks) on a stall or at the ceiling.
    """
    scale = _env_float("REGATHER_TEST_TIMEOUT_SCALE", TIMEOUT_SCALE)
    stall = stall_timeout if stall_timeout is not None else _env_float("REGATHER_STALL_TIMEOUT", STALL_TIMEOUT_S)
    ceiling_s, ceiling_how = _ceiling(timeout, scale, _alarm_left())
    pg_timeout = pg_timeout or (timeout * scale + 30.0)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="regather-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, init_file, tmp, pg_timeout, os.getpid(), args, kwargs),
                daemon=False,
            )
            for r in range(world_size)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        deadline = start + ceiling_s
        results: dict[int, Any] = {}
        samples: collections.deque = collections.deque()  # (time, [_Cpu or None per rank])
        next_sample = start
        done = False
        try:
            while len(results) < world_size:
                failed = False
                for r in range(world_size):
                    if r in results:
                        continue
                    path = os.path.join(tmp, f"rank{r}.pkl")
                    if os.path.exists(path):
                        with open(path, "rb") as f:
                            status, value = pickle.load(f)
                        if status == "error":
                            failed = True
                            break
                        results[r] = value
                    elif not procs[r].is_alive() and not os.path.exists(path):
                        failed = True
                        break
                if failed:
                    raise RankFailed(_root_cause(procs, tmp, set(results)))
                if len(results) == world_size:
                    break
                now = time.monotonic()
                unfinished = sorted(set(range(world_size)) - set(results))
                if now > deadline:
                    w = _window(samples, unfinished)
                    if w is None:
                        how = ""
                    elif w[0]:
                        how = (f"; still working ({w[3]:.1f} CPU-s in the last {w[4]:.0f} s): a busy loop "
                               f"or a run far slower than expected")
                    else:
                        how = f"; idle lately, but for less than the {stall:g} s stall window"
                    stacks = _collect_stacks(procs, unfinished, tmp)
                    raise TimeoutError(
                        f"ranks {unfinished} did not finish within the hard ceiling of {ceiling_s:.0f} s "
                        f"({ceiling_how}){how}" + _format_stacks(procs, stacks))
                if now >= next_sample:
                    next_sample = now + min(SAMPLE_S, max(0.2, stall / 10))
                    samples.append((now, [_cpu_snapshot(p.pid) for p in procs]))
                    stalled = _stalled(samples, unfinished, now, stall)
                    if stalled is not None:
                        _, busiest, preempts, used, window = stalled
                        stacks = _collect_stacks(procs, unfinished, tmp)
                        raise TimeoutError(
                            f"no rank made progress for {window:.0f} s: ranks {unfinished} unfinished; "
                            f"their busiest thread used {busiest:.2f} CPU-s in that time and none was "
                            f"preempted more than {preempts:.1f} times a second (a working thread uses "
                            f"more than {IDLE_CPU_FRACTION:.0%} of a core, or is preempted more than "
                            f"{PREEMPTS_PER_S:g}/s), all their threads used {used:.2f} CPU-s; hung after "
                            f"{now - start:.0f} s (stall_timeout={stall:g} s)" + _format_stacks(procs, stacks))
                time.sleep(_POLL_S)
            done = True
        except (RankFailed, TimeoutError):
            raise
        except BaseException:
            # Interrupted from outside (pytest-timeout's alarm, Ctrl-C): leave the stacks behind.
            unfinished = [r for r in range(world_size) if r not in results and procs[r].is_alive()]
            if unfinished:
                try:
                    stacks = _collect_stacks(procs, unfinished, tmp, wait_s=2.0)
                    print(f"regather.testing.dist: interrupted after {time.monotonic() - start:.0f} s; "
                          f"ranks {unfinished} unfinished" + _format_stacks(procs, stacks),
                          file=sys.stderr, flush=True)
                except BaseException:
                    pass
            raise
        finally:
            for p in procs:
                if done:
                    p.join(timeout=5)  # finished ranks only tear down their process group
                if p.is_alive():
                    p.kill()
                p.join()
        return [results[r] for r in range(world_size)]


def _root_cause(procs, tmp: str, finished: set, grace_s: float = 0.5) -> str:
    """The failure to report first, once a rank failed, and the others' first lines.

    When one rank fails, its partners usually fail too (a gloo "Connection reset by peer" once
    its sockets close), sometimes before the parent has seen the first failure. A rank that
    died without a result (os._exit, a signal, a crash) never does so because of a partner, so
    it comes first; otherwise the rank whose error was written first.
    """
    time.sleep(grace_s)  # let the partners' consequent failures land, then pick the cause
    dead, errors = [], []
    for r, p in enumerate(procs):
        if r in finished:
            continue
        path = os.path.join(tmp, f"rank{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append((os.stat(path).st_mtime_ns, r, value))
        elif not p.is_alive() and not os.path.exists(path):
            dead.append((r, f"rank {r} exited with code {p.exitcode} without reporting a result"))
    errors.sort()
    reports = [msg for _, msg in dead] + [msg for _, _, msg in errors]
    if not reports:  # cannot happen: the caller saw a failure and results are never removed
        return "a rank failed, but no failure report was found"
    first, rest = reports[0], reports[1:]
    if rest:
        first += "\nthen:\n" + "\n".join("  " + m.splitlines()[0][:300] for m in rest)
    return first


def _window(samples, unfinished):
    """(some thread worked, busiest thread's CPU-s, most preemptions/s of a thread, all CPU-s,
    seconds) of ``unfinished`` from the oldest kept sample to the newest, or None where a
    snapshot is missing."""
    if len(samples) < 2:
        return None
    (t0, old), (t1, new) = samples[0], samples[-1]
    if t1 <= t0 or any(old[r] is None or new[r] is None for r in unfinished):
        return None  # no /proc, or a rank just exited (the next poll reports it)
    used = [_used(old[r], new[r], t1 - t0) for r in unfinished]
    return (any(u[0] for u in used), max(u[1] for u in used), max(u[2] for u in used),
            sum(u[3] for u in used), t1 - t0)


def _stalled(samples, unfinished, now: float, stall: float):
    """``_window`` when no thread of the unfinished ranks worked over the last ``stall``
    seconds, else None."""
    while len(samples) >= 2 and samples[1][0] <= now - stall:
        samples.popleft()  # keep exactly one sample at least ``stall`` old
    if samples[0][0] > now - stall or not unfinished:
        return None
    w = _window(samples, unfinished)
    if w is not None and not w[0]:
        return w
    return None

"""Launch a function on N gloo ranks from a test: fail fast, give slowness room, catch hangs.

Each rank is a new process with its own ``file://`` rendezvous, so tests running in parallel
under pytest-xdist never share a port. By default ranks are forked from a *forkserver* that has
imported torch and megatron-core once (``PRELOAD``): a rank starts in a fraction of a second
instead of the ~5 s of CPU those imports cost a fresh interpreter — most of a two-rank test's
cost on a 2-core machine. The server is a fresh interpreter (started with the test process's
``sys.path`` and environment); each rank gets the test process's environment as it is at the
call, so a rank sees what a ``spawn`` rank would, except modules the server preloaded, which
were imported once at its start. ``REGATHER_START_METHOD=spawn`` restores fresh interpreters.
The parent polls the ranks and stops them all when

1. a rank raises (``RankFailed`` with that rank's traceback) or exits without
   a result (``RankFailed`` with its exit code) — within a fraction of a second;
2. **no unfinished rank makes progress** for ``stall_timeout`` seconds
   (default 60 s, env ``REGATHER_STALL_TIMEOUT``) — ``TimeoutError``;
3. the **hard ceiling** ``timeout * REGATHER_TEST_TIMEOUT_SCALE`` (default
   scale 3) passes — ``TimeoutError``. Under pytest-timeout (its ``signal``
   method arms ``ITIMER_REAL``), the ceiling is cut to end ``ALARM_MARGIN_S``
   before that alarm, so the launcher's own error, with the rank stacks, comes
   before pytest-timeout fails the test.

"Progress" — a thread of a rank that computes or wants to — is sampled from ``/proc`` by
:mod:`regather.tools.cpu.rank_progress`, which also collects the ranks' stacks.

On a stall or at the ceiling the parent signals each unfinished rank with
SIGUSR1, where ``faulthandler`` writes the Python stack of every thread to a
file, and puts those stacks into the ``TimeoutError`` message before killing
the ranks. The same stacks go to stderr when something outside (pytest-timeout,
Ctrl-C) interrupts the parent. Ranks die with the test process that launched them
(``PR_SET_PDEATHSIG`` for a spawned rank; a forked rank watches the launcher), so a killed test
process leaves no ranks behind. A launch whose every failure is in ``init_process_group`` (nothing
of the function ran) is started once more with a new rendezvous, saying so on stderr.

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
from typing import Any

import torch.multiprocessing as mp

from regather.tools.cpu import rank_progress

#: What the forkserver imports once for every rank it forks (a module missing here is skipped).
PRELOAD = (
    "regather.tools.cpu.quiet",  # first: its warning filters before megatron's import-time warnings
    "torch", "torch.distributed", "torch.multiprocessing",
    "megatron.core", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
    "megatron.core.models.gpt", "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.moe.moe_layer", "megatron.core.distributed", "megatron.core.optimizer",
    "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
    "regather.megatron.lora", "regather.tools.cpu.models",
)
START_METHODS = ("forkserver", "spawn")
#: Seconds without progress after which a run counts as hung (env REGATHER_STALL_TIMEOUT).
STALL_TIMEOUT_S = 60.0
#: ``timeout`` is multiplied by this to get the hard ceiling (env REGATHER_TEST_TIMEOUT_SCALE).
TIMEOUT_SCALE = 3.0
#: How often CPU time is sampled, in seconds (at most; a tenth of a short stall window).
SAMPLE_S = 2.0
#: The ceiling ends this many seconds before a pending SIGALRM (pytest-timeout's signal method).
ALARM_MARGIN_S = 15.0
_POLL_S = 0.02


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries its traceback or exit code."""


class _RendezvousFailed(RankFailed):
    """Every failure was in ``init_process_group``: no rank ran the function."""


#: A rank's report when ``init_process_group`` raised (gloo's full-mesh connect between short-lived
#: processes on a loaded machine has failed with "Connection closed by peer" in both ranks): the
#: ranks are started once more, with a new rendezvous, since nothing of the function ran.
INIT_ERROR = "init_error"
RENDEZVOUS_ATTEMPTS = 2


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


def die_with_parent(parent_pid: int, status: int = 0) -> None:
    """Have the kernel SIGKILL this process when its parent exits (``PR_SET_PDEATHSIG``, Linux);
    exit with ``status`` at once if the parent ``parent_pid`` is already gone (it died before the
    call took effect)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except Exception:
            pass
    if os.getppid() != parent_pid:
        os._exit(status)


def _die_with_launcher(launcher_pid: int) -> None:
    """End this rank when the process that launched it dies (a test process killed from outside
    must leave no ranks behind). A spawned rank is the launcher's child: the kernel kills it
    (``PR_SET_PDEATHSIG``, Linux). A forked rank's parent is the forkserver, which lives as long as
    any process it forked does — so a daemon thread checks the launcher once a second instead (it
    sleeps in between: the stall check does not count it as work)."""
    if os.getppid() == launcher_pid:
        die_with_parent(launcher_pid, status=1)
        return
    if not _pid_alive(launcher_pid):
        os._exit(1)

    def watch():
        while _pid_alive(launcher_pid):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="regather-launcher-watch", daemon=True).start()


def _pid_alive(pid: int) -> bool:
    """``pid`` runs (a zombie — dead, not reaped yet — does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the pid exists at all
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _enable_stack_dump(out_dir: str, rank: int) -> None:
    global _stack_file
    import faulthandler

    if not hasattr(faulthandler, "register"):
        return
    _stack_file = open(os.path.join(out_dir, f"rank{rank}.stacks"), "w")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)


def _rank_main(fn, rank, world_size, init_file, out_dir, pg_timeout_s, launcher_pid, environ, args, kwargs):
    _die_with_launcher(launcher_pid)
    os.environ.clear()  # the test process's environment at the call (a forkserver has its own)
    os.environ.update(environ)
    _enable_stack_dump(out_dir, rank)
    import warnings

    import torch
    import torch.distributed as dist

    from regather.tools.cpu.quiet import quiet_rank

    quiet_rank()
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)
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
        # gloo's connectFullMesh returns on one rank before its partner has read the handshake: a fn
        # without collectives let rank 0 finish and close its sockets under rank 1's init (seen once in
        # make test, "Connection closed by peer"). Every rank connected before fn runs; a failure here
        # is still an init failure, retried with a new rendezvous.
        dist.barrier()
    except BaseException as exc:  # nothing of fn ran: the parent may start the ranks again
        payload = (INIT_ERROR, f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    else:
        try:
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


def start_method() -> str:
    """How ranks start: ``REGATHER_START_METHOD`` (``forkserver`` or ``spawn``), by default the
    forkserver where the platform has one."""
    method = os.environ.get("REGATHER_START_METHOD", "").strip()
    if not method:
        return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method not in START_METHODS:
        raise ValueError(f"REGATHER_START_METHOD={method!r}: expected one of {START_METHODS}")
    return method


def _context():
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # used when the server starts (first rank)
    return ctx

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
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout, pg_timeout, stall_timeout)
        except _RendezvousFailed as exc:
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise RankFailed(str(exc)) from None
            print(f"regather.tools.cpu.dist: init_process_group failed in every rank that reported "
                  f"({str(exc).splitlines()[0][:200]}); starting the ranks again with a new rendezvous",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _run_once(fn, world_size, args, kwargs, timeout, pg_timeout, stall_timeout) -> list[Any]:
    """One launch of the ranks (see :func:`run_ranks`)."""
    scale = _env_float("REGATHER_TEST_TIMEOUT_SCALE", TIMEOUT_SCALE)
    stall = stall_timeout if stall_timeout is not None else _env_float("REGATHER_STALL_TIMEOUT", STALL_TIMEOUT_S)
    ceiling_s, ceiling_how = _ceiling(timeout, scale, _alarm_left())
    pg_timeout = pg_timeout or (timeout * scale + 30.0)
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="regather-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, init_file, tmp, pg_timeout, os.getpid(), dict(os.environ), args, kwargs),
                daemon=False,
            )
            for r in range(world_size)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        deadline = start + ceiling_s
        results: dict[int, Any] = {}
        samples: collections.deque = collections.deque()  # (time, [rank_progress.Cpu or None per rank])
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
                        if status in ("error", INIT_ERROR):
                            failed = True
                            break
                        results[r] = value
                    elif not procs[r].is_alive() and not os.path.exists(path):
                        failed = True
                        break
                if failed:
                    cause, only_init = _root_cause(procs, tmp, set(results))
                    raise (_RendezvousFailed if only_init else RankFailed)(cause)
                if len(results) == world_size:
                    break
                now = time.monotonic()
                unfinished = sorted(set(range(world_size)) - set(results))
                if now > deadline:
                    w = rank_progress.window(samples, unfinished)
                    if w is None:
                        how = ""
                    elif w[0]:
                        how = (f"; still working ({w[3]:.1f} CPU-s in the last {w[4]:.0f} s): a busy loop "
                               f"or a run far slower than expected")
                    else:
                        how = f"; idle lately, but for less than the {stall:g} s stall window"
                    stacks = rank_progress.collect_stacks(procs, unfinished, tmp)
                    raise TimeoutError(
                        f"ranks {unfinished} did not finish within the hard ceiling of {ceiling_s:.0f} s "
                        f"({ceiling_how}){how}" + rank_progress.format_stacks(procs, stacks))
                if now >= next_sample:
                    next_sample = now + min(SAMPLE_S, max(0.2, stall / 10))
                    samples.append((now, [rank_progress.cpu_snapshot(p.pid) for p in procs]))
                    stalled = rank_progress.stalled(samples, unfinished, now, stall)
                    if stalled is not None:
                        _, busiest, preempts, used, window = stalled
                        stacks = rank_progress.collect_stacks(procs, unfinished, tmp)
                        raise TimeoutError(
                            f"no rank made progress for {window:.0f} s: ranks {unfinished} unfinished; "
                            f"their busiest thread used {busiest:.2f} CPU-s in that time and none was "
                            f"preempted more than {preempts:.1f} times a second (a working thread uses "
                            f"more than {rank_progress.IDLE_CPU_FRACTION:.0%} of a core, or is preempted more than "
                            f"{rank_progress.PREEMPTS_PER_S:g}/s), all their threads used {used:.2f} CPU-s; hung after "
                            f"{now - start:.0f} s (stall_timeout={stall:g} s)" + rank_progress.format_stacks(procs, stacks))
                time.sleep(_POLL_S)
            done = True
        except (RankFailed, TimeoutError):
            raise
        except BaseException:
            # Interrupted from outside (pytest-timeout's alarm, Ctrl-C): leave the stacks behind.
            unfinished = [r for r in range(world_size) if r not in results and procs[r].is_alive()]
            if unfinished:
                try:
                    stacks = rank_progress.collect_stacks(procs, unfinished, tmp, wait_s=2.0)
                    print(f"regather.tools.cpu.dist: interrupted after {time.monotonic() - start:.0f} s; "
                          f"ranks {unfinished} unfinished" + rank_progress.format_stacks(procs, stacks),
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


def _root_cause(procs, tmp: str, finished: set, grace_s: float = 0.5) -> tuple[str, bool]:
    """The failure to report first, once a rank failed, and the others' first lines; and whether
    every failure was in ``init_process_group`` (no rank ran the function).

    When one rank fails, its partners usually fail too (a gloo "Connection reset by peer" once
    its sockets close), sometimes before the parent has seen the first failure. A rank that
    died without a result (os._exit, a signal, a crash) never does so because of a partner, so
    it comes first; otherwise the rank whose error was written first.
    """
    time.sleep(grace_s)  # let the partners' consequent failures land, then pick the cause
    dead, errors, statuses = [], [], []
    for r, p in enumerate(procs):
        if r in finished:
            continue
        path = os.path.join(tmp, f"rank{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status in ("error", INIT_ERROR):
                errors.append((os.stat(path).st_mtime_ns, r, value))
                statuses.append(status)
        elif not p.is_alive() and not os.path.exists(path):
            dead.append((r, f"rank {r} exited with code {p.exitcode} without reporting a result"))
    errors.sort()
    reports = [msg for _, msg in dead] + [msg for _, _, msg in errors]
    if not reports:  # cannot happen: the caller saw a failure and results are never removed
        return "a rank failed, but no failure report was found", False
    first, rest = reports[0], reports[1:]
    if rest:
        first += "\nthen:\n" + "\n".join("  " + m.splitlines()[0][:300] for m in rest)
    only_init = not dead and not finished and all(st == INIT_ERROR for st in statuses)
    return first, only_init

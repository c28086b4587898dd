"""tests.harness.megatron_ckpt: the CPU enablement of megatron's dist_checkpointing.

One subprocess (a fresh interpreter: the patches are process-wide) checks what the module
promises: psutil missing -> ImportError up front (megatron's save would hang); the patches are
idempotent; ``torch.cuda.synchronize`` becomes a no-op inside dist_checkpointing only; and the
write-results Manager megatron starts during a save no longer outlives a process that ends with
``os._exit`` (it used to keep the parent's stdout open forever). The save itself, end to end,
is tested in tests/distributed/megatron/training/test_dist_checkpoint.py.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the patches are off with CUDA")]

CHILD = r"""
import json, os, sys
import torch
from tests.harness import megatron_ckpt

out = {}
real_psutil = sys.modules.pop("psutil", None)
sys.modules["psutil"] = None  # as if it were not installed
try:
    megatron_ckpt.enable_dist_checkpointing_cpu()
    out["no_psutil"] = None
except ImportError as exc:
    out["no_psutil"] = str(exc)
del sys.modules["psutil"]
if real_psutil is not None:
    sys.modules["psutil"] = real_psutil

out["enabled"] = [megatron_ckpt.enable_dist_checkpointing_cpu(), megatron_ckpt.enable_dist_checkpointing_cpu()]
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
fa.torch.cuda.synchronize()  # raises on a CPU build unless patched
out["proxy_keeps_torch"] = fa.torch.Tensor is torch.Tensor and fa.torch.cuda.is_available is torch.cuda.is_available
try:
    torch.cuda.synchronize()
    out["global_sync_untouched"] = False
except (AssertionError, RuntimeError):
    out["global_sync_untouched"] = True
get = getattr(fa, "get_write_results_queue", None) or fa._get_write_results_queue
q = get()
out["same_queue"] = get() is q
q.put("ok")
out["queue_works"] = q.get() == "ok"
out["manager_pid"] = q._manager._process.pid
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # as gloo test ranks end: no atexit, so no Manager shutdown
"""


def _result(stdout: str):
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")
def test_enable_dist_checkpointing_cpu():
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired as exc:  # e.g. a leftover process holding the child's stdout
        out = _result(exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or "")
        if out:
            os.kill(out["manager_pid"], 9)  # ours: started by the child
        pytest.fail(f"the child's output did not end within 120 s; its result: {out}")
    out = _result(proc.stdout)
    assert proc.returncode == 0 and out, proc.stderr[-3000:]
    assert out["no_psutil"] and "psutil" in out["no_psutil"] and "hang" in out["no_psutil"]
    assert out["enabled"] == [True, True]
    assert out["proxy_keeps_torch"] and out["global_sync_untouched"]
    assert out["same_queue"] and out["queue_works"]
    # capture_output returned, so nothing holds the child's stdout any more; the Manager is gone
    # (SIGKILLed when its parent exited; give the kernel a moment to reap it)
    pid, deadline = out["manager_pid"], time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"megatron's write-results Manager (pid {pid}) outlived its process"

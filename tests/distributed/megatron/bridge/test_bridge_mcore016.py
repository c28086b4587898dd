"""Bridge 0.6.2's PEFT code with the pinned megatron-core 0.16.1 (not the 0.19.2 that
``make test-bridge`` puts on the path): a subprocess without the 0.19.2 directory, where
``tests.harness.bridge_env`` adds the ``HybridStack`` stand-in (0.16.1 has no
``megatron.core.models.hybrid``). Same parity as test_bridge_parity, reduced."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from tests.harness.bridge_env import INSTALL_HINT, bridge_available

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(600)]

HERE = os.path.dirname(os.path.abspath(__file__))


def _without_megatron_core(paths):
    """PYTHONPATH entries that do not provide megatron.core (drops the 0.19.2 overlay)."""
    return [p for p in paths if p and not os.path.isfile(os.path.join(p, "megatron", "core", "__init__.py"))]


def test_bridge_peft_on_megatron_core_0_16_1():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(_without_megatron_core(env.get("PYTHONPATH", "").split(os.pathsep)))
    code = textwrap.dedent(f"""
        import json, sys, warnings
        warnings.filterwarnings("ignore")
        sys.path.insert(0, {HERE!r})
        import workers_bridge as W
        from regather.tools.cpu.dist import run_ranks
        print("RESULT", json.dumps(run_ranks(W.mcore016_worker, W.TP, timeout=200)))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    for res in json.loads(line[len("RESULT "):]):
        assert res["version"].startswith("0.16.1"), res["version"]
        assert "megatron.core.models.hybrid.hybrid_block.HybridStack stand-in" in res["shims"]
        assert res["n_grads"] == 16
        assert res["max_diff"] == dict.fromkeys(res["max_diff"], 0.0), res["max_diff"]
        saved = res["saved"]
        assert saved["regather/gather"] == saved["bridge/gather"] and saved["regather/regather"] == saved["bridge/regather"]
        calls = res["reduce_scatter_calls"]
        assert calls["bridge/regather"] - calls["regather/regather"] == 1
        assert calls["bridge/gather"] == calls["regather/gather"]

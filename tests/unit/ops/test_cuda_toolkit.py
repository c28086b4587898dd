"""Which CUDA toolkit the extension builds with: ``csrc/cuda_toolkit.py``'s rule, shared by setup.py and
.ci/build-ext.sh, on toolkit-shaped folders made here (``bin/nvcc``, ``include/cuda_runtime_api.h``).

The case it exists for: an ``nvcc`` first on ``PATH`` that is a wrapper script outside the toolkit (this
machine's ``/usr/local/bin/nvcc`` runs ``/usr/local/cuda-13.0/bin/nvcc``); torch's guess takes the folder
above it for the toolkit and the compile fails on ``crt/host_defines.h``. setup.py stops before torch is
imported when the rule finds none, naming ``CUDA_HOME``. The build itself: .ci/build-ext.sh
(tests/unit/ops/test_wgrad_ext_build.py) and docs/install.md's command.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _rule():
    spec = importlib.util.spec_from_file_location("cuda_toolkit_rule", os.path.join(_ROOT, "csrc", "cuda_toolkit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toolkit(folder, headers: bool = True):
    (folder / "bin").mkdir(parents=True)
    nvcc = folder / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    if headers:
        (folder / "include").mkdir()
        (folder / "include" / "cuda_runtime_api.h").write_text("")
    return str(folder)


def test_cuda_home_is_taken_when_it_is_a_toolkit_and_refused_when_not(tmp_path):
    rule = _rule()
    good = _toolkit(tmp_path / "cuda")
    assert rule.find_cuda_home({"CUDA_HOME": good, "PATH": ""}) == good
    wrapper_only = _toolkit(tmp_path / "local", headers=False)  # nvcc, no headers: the wrapper's folder
    with pytest.raises(rule.NoToolkit, match=f"CUDA_HOME={wrapper_only} is not a CUDA toolkit") as exc:
        rule.find_cuda_home({"CUDA_HOME": wrapper_only, "PATH": ""})
    assert exc.value.status == rule.NOT_A_TOOLKIT


def test_an_nvcc_wrapper_outside_the_toolkit_is_not_taken_for_one(tmp_path):
    """Unset CUDA_HOME: /usr/local/cuda first, then the folder above the first nvcc on PATH — taken only
    where it has the toolkit's headers (not a wrapper's folder)."""
    rule = _rule()
    wrapper = _toolkit(tmp_path / "local", headers=False)
    env = {"PATH": os.path.join(wrapper, "bin")}
    assert rule.candidates(env) == ["/usr/local/cuda", wrapper]
    if rule.is_toolkit("/usr/local/cuda"):
        assert rule.find_cuda_home(env) == "/usr/local/cuda"
    else:
        with pytest.raises(rule.NoToolkit, match="set CUDA_HOME") as exc:
            rule.find_cuda_home(env)
        assert exc.value.status == rule.NOT_FOUND
    real = _toolkit(tmp_path / "cuda-13")
    assert rule.find_cuda_home({"PATH": os.path.join(real, "bin")}) in ("/usr/local/cuda", real)


def test_setup_py_stops_naming_cuda_home_before_importing_torch(tmp_path):
    """``REGATHER_BUILD_EXT=1`` with no toolkit by the rule: setup.py exits with the rule's sentence
    (one build command, ``python setup.py --name``, runs setup.py as pip's backend does)."""
    env = {**os.environ, "REGATHER_BUILD_EXT": "1", "CUDA_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "setup.py", "--name"], cwd=_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert f"REGATHER_BUILD_EXT=1 but CUDA_HOME={tmp_path} is not a CUDA toolkit" in done.stderr
    assert "set CUDA_HOME to the toolkit's folder" in done.stderr

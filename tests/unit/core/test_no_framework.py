"""The core imports torch only: every module of regather.core and regather.ops, imported in a fresh
interpreter, loads no front end and no framework (megatron-core, Transformer Engine, torchtitan,
Megatron Bridge, transformers); ``import regather`` loads no front end either."""

import pkgutil
import subprocess
import sys

import regather.core
import regather.ops

FRAMEWORKS = ("megatron", "transformer_engine", "torchtitan", "transformers", "peft")


def _modules(package) -> list[str]:
    return [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def _loaded_after(imports: list[str]) -> list[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in imports)
            + "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.split()


def test_core_and_ops_load_no_framework():
    loaded = _loaded_after(_modules(regather.core) + _modules(regather.ops))
    bad = [m for m in loaded if m.split(".")[0] in FRAMEWORKS or m.startswith(("regather.megatron",
                                                                               "regather.torchtitan",
                                                                               "regather.tools",
                                                                               "regather.hf"))]
    assert bad == []


def test_import_regather_is_lazy():
    loaded = _loaded_after(["regather"])
    assert not [m for m in loaded if m.startswith(("regather.", "megatron"))], loaded

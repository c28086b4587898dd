"""The shape of the package and of the test harness (tests/harness), checked (the layering itself
is import-linter's, `make lint`).

- no private name crosses a module: nothing imports ``_name`` from another module, reads
  ``module._name`` of another regather module, or calls a ``_method`` that only classes of another
  module define (``self`` / ``cls`` / ``super()`` aside);
- no module over ``MAX_LINES`` lines: a module is one concept;
- the core's tests import no framework, as the core itself (tests/unit/core/test_no_framework.py).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "regather"
HARNESS = ROOT / "tests" / "harness"
PACKAGES = ("regather", "tests.harness")
MAX_LINES = 500
FRAMEWORKS = ("megatron", "transformer_engine", "torchtitan", "transformers", "peft")
#: what the core's tests may import beside the core: modules that import torch (and triton) only
LIGHT = ("regather.tools.cpu.dist", "tests.harness.numerics", "tests.harness.triton_aot")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent if SRC in path.parents else ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.fixture(scope="module")
def modules() -> dict[str, tuple[Path, ast.Module]]:
    paths = sorted([*SRC.rglob("*.py"), *HARNESS.rglob("*.py")])
    return {_module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in paths}


def _private_methods_by_module(modules) -> dict[str, set[str]]:
    """Private method names each module's classes define."""
    out = defaultdict(set)
    for name, (_, tree) in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                        out[name].add(item.name)
    return out


def test_no_private_name_crosses_a_module(modules):
    defined = _private_methods_by_module(modules)
    problems = []
    for name, (path, tree) in modules.items():
        aliases = {}  # local name -> regather module it refers to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGES):
                for a in node.names:
                    if _private(a.name):
                        problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {a.name} from {node.module}")
                    full = f"{node.module}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(PACKAGES) and a.asname:
                        aliases[a.asname] = a.name
        mine = defined.get(name, set())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases and aliases[base.id] != name:
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {base.id}.{node.attr} of {aliases[base.id]}")
                continue
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            owners = {m for m, names in defined.items() if node.attr in names}
            if owners and name not in owners and node.attr not in mine:
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr} (defined in {sorted(owners)})")
    assert problems == []


def test_no_module_is_over_the_limit(modules):
    sizes = {name: len(path.read_text().splitlines()) for name, (path, _) in modules.items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_core_tests_import_no_framework():
    bad = []
    folders = [ROOT / "tests" / kind / area for kind in ("unit", "distributed") for area in ("core", "ops")]
    assert any(f.is_dir() for f in folders)
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for n in names:
                    # the rank launcher and the fp64 comparison rule import torch only; the rest of the
                    # CPU runtime (regather.tools.cpu) and of the harness builds megatron models
                    if n in LIGHT:
                        continue
                    if n.split(".")[0] in FRAMEWORKS or n.startswith((
                            "regather.megatron", "regather.torchtitan", "regather.hf", "regather.tools", "tests.harness")):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {n}")
    assert bad == []

"""The rules that decide which CI tier runs a test again (tests.harness.tiers, docs/testing.md "What each tier
proves"): a test that a new stack can change cannot be left out of that stack's tier.

- torch 2.14: every test file whose own code uses torch's moving surface (private names, torch.compile, DTensor,
  FSDP2, functional collectives, Triton, torchtitan) is in ``TORCH_TIER`` or says why not; every regather module
  that uses it is reached by a test in ``TORCH_TIER``; every entry names a test that exists.
- megatron-core 0.19.2: the import closure (tests.harness.imports) follows every way the suite reaches a module —
  checked here on small files of each kind, and against what a fresh interpreter really loads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from tests.harness import imports, tiers

ROOT = imports.ROOT


def _listed(rel: str, table) -> bool:
    """``rel`` (a test file) is covered by an entry of ``table``: the file, a folder above it, or a case in it."""
    return any(rel == key.partition("::")[0] or rel.startswith(key.rstrip("/") + "/") for key in table)


def _tier_files() -> list:
    out = []
    for key in tiers.TORCH_TIER:
        path = ROOT / key.partition("::")[0]
        out.extend(sorted(path.rglob("test_*.py")) if path.is_dir() else [path])
    return out


def test_every_test_on_torchs_moving_surface_runs_on_torch_2_14():
    missing = {}
    for path in imports.test_files():
        rel = path.relative_to(ROOT).as_posix()
        surface = tiers.own_surface(path)
        if surface and not _listed(rel, tiers.TORCH_TIER) and not _listed(rel, tiers.NOT_ON_TORCH214):
            missing[rel] = surface[:3]
    assert missing == {}, f"add these to tests.harness.tiers.TORCH_TIER (or NOT_ON_TORCH214, with the reason): {missing}"


def test_every_regather_module_on_torchs_moving_surface_is_reached_by_the_torch_2_14_tier():
    reached = set()
    for path in _tier_files():
        reached |= imports.closure(path)[0]
    missing = {}
    for name, path in imports.local_modules().items():
        if name.startswith("regather") and name not in reached:
            surface = tiers.torch_surface(n for n in imports.direct(path)[1] if not imports.resolve(n))
            if surface:
                missing[name] = surface[:3]
    assert missing == {}, f"no test of make test-torch214 imports these: add one to TORCH_TIER: {missing}"


def test_every_entry_names_a_test_that_exists():
    for key in [*tiers.TORCH_TIER, *tiers.NOT_ON_TORCH214]:
        file, _, case = key.partition("::")
        assert (ROOT / file).exists(), key
        if case:
            assert f"def {case.split('[')[0]}(" in (ROOT / file).read_text(), key
    assert all(reason for reason in [*tiers.TORCH_TIER.values(), *tiers.NOT_ON_TORCH214.values()])


def test_torch_tier_reason_matches_folders_files_and_cases():
    assert tiers.torch_tier_reason("tests/unit/core/test_buffers.py::test_x")
    assert tiers.torch_tier_reason("tests/unit/tools/test_quiet.py::test_y[a]")
    assert not tiers.torch_tier_reason("tests/unit/tools/test_estimate.py::test_z")
    assert not tiers.torch_tier_reason("tests/unit/corex/test_a.py::test_b")  # a folder is a folder, not a prefix
    case = next(key for key in tiers.TORCH_TIER if "::" in key)
    assert tiers.torch_tier_reason(case)
    assert not tiers.torch_tier_reason(case.replace("[compile]", "[eager]"))


EXAMPLES = {  # a file's code -> whether its closure reaches megatron
    "from regather.core import strategies\nimport torch\n": False,
    "import regather\nimport regather.tools.cpu.dist\n": False,
    "def f():\n    import megatron.core\n": True,  # an import inside a function counts
    "from regather import LoRA\n": True,  # a name the package hands out lazily: regather.megatron.lora
    "import regather\n\ndef f(model):\n    return regather.LoRA()(model)\n": True,
    "import importlib\nimportlib.import_module('regather.megatron.lora')\n": True,
    "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'regather', 'demo'])\n": True,  # the command
    "import subprocess, sys\nCODE = '''\nimport megatron.core\n'''\nsubprocess.run([sys.executable, '-c', CODE])\n":
        True,  # code run in a fresh interpreter
    "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import regather'])\n": False,
}


@pytest.mark.parametrize("code,reaches", list(EXAMPLES.items()), ids=range(len(EXAMPLES)))
def test_the_closure_follows_every_way_a_test_imports(code, reaches, tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text(code)
    _, external = imports.closure(path)
    assert any(n.split(".")[0] == "megatron" for n in external) == reaches, sorted(external)


def test_a_file_the_closure_finds_megatron_free_loads_no_megatron():
    """What the static closure says of tests/distributed/core, a fresh interpreter confirms: importing each test
    file and its rank bodies loads no megatron module (the closure also counts what a function would import)."""
    files = [p for p in imports.test_files() if p.relative_to(ROOT).as_posix().startswith("tests/distributed/core/")]
    assert files and not any(tiers.reaches_megatron(p) for p in files)
    names = sorted({m for p in files for m in imports.closure(p, through_src=False)[0]
                    if not m.startswith(("regather", "tests"))} | {f"tests.distributed.core.{p.stem}" for p in files})
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests' / 'distributed' / 'core')!r}]
        for name in {names!r}:
            __import__(name)
        print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout[-2000:]


def test_compat_runs_what_reaches_megatron_and_nothing_else():
    compat = tiers.compat_files()
    assert "tests/distributed/megatron/test_canonical.py" in compat and "tests/distributed/tools/test_demo.py" in compat
    assert not [f for f in compat if f.startswith(("tests/distributed/core/", *tiers.COMPAT_IGNORED))]
    assert all(tiers.reaches_megatron(ROOT / f) for f in compat)
    for f, why in tiers.COMPAT_NOT_RUN.items():  # an exception names a file that exists, with its reason
        assert (ROOT / f).exists() and f not in compat and why, f

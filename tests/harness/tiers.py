"""Which CI tier runs which test, and why the others need not run it again (docs/testing.md, "What each
tier proves").

``make test`` runs every test on the pinned stack (Python 3.11, torch 2.13.0, megatron-core 0.16.1). Two
tiers run a part of it again on another stack, the part whose outcome that stack can change:

- ``make test-compat`` (megatron-core 0.19.2): the files under ``tests/distributed`` whose import closure
  (:mod:`tests.harness.imports`: the test, its rank bodies, the harness and regather's modules, every
  import followed, function-level ones too) reaches ``megatron``. A file that reaches no megatron module
  runs the same code whatever megatron-core is installed: it is not run again. The marker ``megatron``.
- ``make test-torch214`` (torch 2.14.1, triton 3.8.0, torchtitan's spmd_types backend): the tests listed in
  :data:`TORCH_TIER`, each with its reason: what touches the part of torch that moves between releases —
  private names, ``torch.compile`` (Dynamo, AOTAutograd, Inductor), DTensor, FSDP2, functional
  collectives, dispatch modes, Triton, torchtitan and spmd_types (:data:`TORCH_SURFACE`). The marker
  ``torch_version_sensitive``. tests/unit/testing/test_tiers.py keeps the list whole: every test file
  whose own code (with its ``workers_*`` helpers) uses that surface is listed, and every regather module
  that uses it is reached by a listed test. The rest calls torch only through public, stable operators and
  regather.core (tested here): the same bytes and results on 2.14 as on 2.13.

``python -m tests.harness.tiers compat|torch214`` prints the tier's test paths (node ids for single
cases) for the Makefile; the markers let ``pytest -m`` select the same from a wider path.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

from tests.harness import imports

ROOT = imports.ROOT

#: torch's version-sensitive surface: a dotted name used that starts with one of these, or any torch name
#: with a private part (``torch._C``, ``torch.distributed.distributed_c10d._world``, ...).
TORCH_SURFACE = (
    "torch.compile", "torch.compiler", "torch.fx", "torch.export", "torch.library",
    "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed._functional_collectives",
    "triton", "torchtitan", "spmd_types",
)
_PRIVATE = re.compile(r"(^|\.)_[A-Za-z]")

#: What make test-torch214 runs: a folder, a file or a single case, and why it can differ on torch 2.14.
TORCH_TIER = {
    "tests/unit/core": "regather.core touches torch only: the autograd graph task and the saved-tensor hooks "
                       "it reads by private name (test_torch_privates), dispatch modes for the byte accounting, "
                       "torch.compile's partitioner and Inductor's joint-graph pass (test_compiled_recompute)",
    "tests/distributed/core": "the core's collectives on gloo: functional collectives, DTensor placements, the "
                              "allocator's bytes around a collective",
    "tests/unit/ops": "Triton 3.8 (torch 2.14's) and the CUDA extension built against torch 2.14: the wgrad kernels "
                      "under the interpreter, compiled for sm_90, the extension's build and import",
    "tests/unit/torchtitan": "the torch and torchtitan private names the torchtitan front end reads",
    "tests/distributed/torchtitan": "torchtitan 0.3.0 on its default backend spmd_types (needs torch 2.14), "
                                    "DTensor, FSDP2, activation checkpointing and torch.compile (Inductor, aot_eager)",
    "tests/distributed/hf/test_titan_peft_hf.py": "torchtitan's models (DTensor state dicts) to and from PEFT",
    "tests/distributed/tools/test_bench_titan.py::test_ac_and_compile_end_to_end_lora_adds_its_rank_r_tensors_alone"
    "[compile]": "regather bench --torchtitan --compile end to end",
    "tests/unit/tools/test_quiet.py": "torch 2.14's deprecated is_opaque_value log line, filtered by name",
    "tests/unit/megatron/test_adapter.py": "megatron's adapter inside torch.utils.checkpoint (both passes, "
                                           "core.moment's graph task)",
    "tests/unit/megatron/test_te.py": "the TE base layer's release of ln_out through saved-tensor hooks "
                                      "(core.saved_hooks), its bytes on the allocator",
}

#: Test files whose own code uses that surface but that the torch 2.14 tier does not run, each with why.
NOT_ON_TORCH214 = {
    "tests/distributed/megatron/training/test_release.py": "reads torch's process-group table "
                                                           "(distributed_c10d._world) only to count the groups "
                                                           "megatron keeps; the release is megatron-core's, no "
                                                           "regather code reads the name",
    "tests/distributed/recipes": "Python 3.12 with Megatron Bridge only (make test-recipes); Dynamo is turned "
                                 "off and on by Bridge's recipes, not by regather",
}

#: make test-compat's scope: tests/distributed without the tiers of their own (Bridge, the recipes) and the
#: launcher's tests (regather.tools.cpu.dist: torch only).
COMPAT_FOLDERS = ("tests/distributed",)
COMPAT_IGNORED = ("tests/distributed/megatron/bridge", "tests/distributed/recipes", "tests/distributed/testing",
                  "tests/distributed/torchtitan")
#: Files the import closure counts as reaching megatron that run no megatron-core code, each with why
COMPAT_NOT_RUN = {
    "tests/distributed/tools/test_bench_titan.py": "regather bench --torchtitan builds torchtitan's models only; the "
    "closure reaches megatron through the command's other subcommands, which the file never runs",
}


def torch_surface(names) -> list[str]:
    """The names of ``names`` on torch's version-sensitive surface (``torch.ops.*`` operators aside)."""
    return sorted(n for n in names if n.startswith(TORCH_SURFACE)
                  or (n.startswith("torch.") and not n.startswith("torch.ops.") and _PRIVATE.search(n)))


def own_surface(path: Path) -> list[str]:
    """The surface names the test file itself and its helpers beside the tests (``workers_*``, ...) use:
    not the harness's nor regather's (regather's are checked module by module)."""
    mods = imports.local_modules()
    names = set(imports.direct(path)[1])
    for name in imports.direct(path)[0]:
        for module in imports.resolve(name):
            if not module.startswith(("regather", "tests")):
                names |= imports.direct(mods[module])[1]
    return torch_surface(n for n in names if not imports.resolve(n))


def _rel(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


def torch_tier_reason(nodeid: str) -> str | None:
    """Why ``nodeid`` (``tests/...py::name[param]``) runs on torch 2.14, or None."""
    file = nodeid.partition("::")[0]
    for key, reason in TORCH_TIER.items():
        key_file, _, key_case = key.partition("::")
        if key_case:
            hit = nodeid == key
        elif key_file.endswith(".py"):
            hit = file == key_file
        else:
            hit = file.startswith(key_file + "/")
        if hit:
            return reason
    return None


@functools.cache
def reaches_megatron(path: Path) -> bool:
    """The file's import closure reaches a megatron module (megatron-core or Megatron Bridge)."""
    _, external = imports.closure(path.resolve())
    return any(name.split(".")[0] == "megatron" for name in external)


def compat_files() -> list[str]:
    out = []
    for path in imports.test_files():
        rel = _rel(path)
        if (rel.startswith(COMPAT_FOLDERS) and not rel.startswith(COMPAT_IGNORED) and rel not in COMPAT_NOT_RUN
                and reaches_megatron(path)):
            out.append(rel)
    return out


def mark(items) -> None:
    """Add the tier markers to collected pytest items (tests/conftest.py)."""
    import pytest

    for item in items:
        path = Path(str(item.path))
        try:
            rel = _rel(path)
        except ValueError:  # outside the repository
            continue
        if torch_tier_reason(f"{rel}::{item.nodeid.partition('::')[2]}"):
            item.add_marker(pytest.mark.torch_version_sensitive)
        if rel.startswith("tests/") and reaches_megatron(path):
            item.add_marker(pytest.mark.megatron)


def main(argv: list[str]) -> int:
    if argv == ["compat"]:
        print("\n".join(compat_files()))
    elif argv == ["torch214"]:
        print("\n".join(TORCH_TIER))
    else:
        print("usage: python -m tests.harness.tiers compat|torch214", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

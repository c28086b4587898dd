"""Import Megatron Bridge's PEFT code on a CPU-only Python 3.11 machine (tests only).

``megatron-bridge==0.6.2`` is a pure-Python wheel that declares Python 3.12 and a
GPU stack (Transformer Engine, the HF model zoo, ...). Its PEFT package
(``megatron.bridge.peft``) runs on 3.11 and CPU once it is placed on
``PYTHONPATH`` beside megatron-core (``make test-bridge`` installs it into
``.venv-compat/bridge`` with ``pip install --no-deps --ignore-requires-python
--target``) and the import-level shims below are in place. None of them
touches what the PEFT code computes; each one only gets an import through:

1. ``megatron.bridge`` is registered as a bare package over the installed
   directory, so its real ``__init__`` does not run: that one imports the whole
   model zoo (``megatron.bridge.models``, diffusion models, ``transformers``...),
   none of which ``megatron.bridge.peft`` needs.
2. ``megatron.bridge.utils.common_utils`` is a stand-in with ``print_rank_0``
   and ``get_rank_safe`` (all that PEFT and the utils it imports use): the real
   module imports ``megatron.training``, whose config code does
   ``from typing import override`` (Python 3.12 only).
3. A stand-in ``transformer_engine`` module exists only while
   ``peft/lora_layers.py`` is imported: that file imports
   ``transformer_engine.pytorch`` at module level and evaluates
   ``te.ops.Sequential`` in annotations of ``TEFusedLoRALinear`` (the TE op
   fuser path, used only with TE and TP=1). It is removed right after, so
   nothing else ever sees it.
4. Bridge's TE flags are set to False (``peft.utils.HAVE_TE`` and the
   ``HAVE_TE_*`` flags of ``peft.module_matcher``): megatron-core's TE extension
   defines ``MagicMock`` stand-ins for the TE classes when TE is missing, so
   Bridge's ``safe_import_from`` finds them and Bridge believes TE is there; its
   ``isinstance(m, TEColumnParallelLinear)`` checks would then raise.
5. megatron-core 0.16.1 only: a stand-in ``megatron.core.models.hybrid.hybrid_block``
   with an empty ``HybridStack`` class. ``PEFT.__call__`` imports it
   (``peft/recompute.py``) to patch recompute blocks; 0.16.1 has no such module
   (megatron-core has it from 0.18 on; then the stand-in is not installed). No model is an
   instance of the stand-in, so the recompute patch sees only TransformerBlocks.

:func:`bridge_sees_te_model` adds one, for the Transformer Engine tests only, while its block runs:

7. Bridge's TE names in ``peft.utils`` (``HAVE_TE``, ``TELayerNormColumnParallelLinear``,
   ``TEColumnParallelLinear``, ``TERowParallelLinear`` and the ``TECL`` / ``TERL`` tuples built
   from them at import; ``TELinear`` and the grouped classes as classes nothing is an instance of)
   bound to the classes of :mod:`tests.harness.te_model`, and its ``version("transformer-engine")``
   answering the modelled TE version: what Bridge reads on a GPU machine with that TE installed.
   Bridge's own code then runs its TE branch of ``get_adapter_attributes_from_linear`` unchanged.

:func:`import_bridge_checkpointing` adds one more, for the checkpoint tests only:

6. ``megatron.bridge.training.checkpointing`` holding only the three functions that
   ``peft/utils.py``'s ``load_peft_adapter_checkpoint`` imports from it
   (``apply_peft_adapter_filter_to_state_dict``, its helper ``_is_model_section``,
   ``_generate_model_state_dict``), compiled from the installed ``checkpointing.py``'s own
   source: the real module imports the whole training stack (``modelopt``, Bridge's
   ``ConfigContainer`` and model zoo, ``megatron.training``). They are Bridge's code,
   unchanged, run against the test's models.

The re-gather path itself (``LoRA(sequence_parallel_input_regather=True)``,
megatron's sequence-parallel linear for LoRA-A) needs nothing beyond
:func:`regather.tools.cpu.megatron_cpu.enable_megatron_cpu` (docs/design.md §6, §8).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

INSTALL_HINT = (
    "Megatron Bridge is not importable: run `make test-bridge` (installs megatron-bridge==0.6.2 into "
    ".venv-compat/bridge) or put such a directory first on PYTHONPATH"
)

_SHIMS: list[str] = []  # what import_bridge_peft() installed, in order (for tests and reports)


def bridge_available() -> bool:
    """Whether a Megatron Bridge install can be found (without importing it)."""
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False


def installed_shims() -> list[str]:
    """Names of the shims installed so far in this process."""
    return list(_SHIMS)


def import_bridge_peft() -> types.ModuleType:
    """Install the shims (once) and import ``megatron.bridge.peft.lora``; return it.

    Raises ImportError with :data:`INSTALL_HINT` when no Bridge is on the path.
    """
    if "megatron.bridge.peft.lora" in sys.modules:
        return sys.modules["megatron.bridge.peft.lora"]
    # megatron-core first, without any TE stand-in around: its own TE detection must see
    # that TE is missing (with a stand-in present it would try to use it).
    import megatron.core  # noqa: F401

    _bare_bridge_package()
    _common_utils_stub()
    _hybrid_stack_stub()
    utils = importlib.import_module("megatron.bridge.peft.utils")
    matcher = importlib.import_module("megatron.bridge.peft.module_matcher")
    _te_flags_off(utils, matcher)
    _import_lora_layers_with_te_stand_in()
    return importlib.import_module("megatron.bridge.peft.lora")


def _bare_bridge_package() -> None:
    if "megatron.bridge" in sys.modules:
        return
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(INSTALL_HINT)
    pkg = types.ModuleType("megatron.bridge", "Megatron Bridge (bare: tests.harness.bridge_env, shim 1)")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = spec.origin
    pkg.__spec__ = spec
    pkg.__package__ = "megatron.bridge"
    sys.modules["megatron.bridge"] = pkg
    import megatron

    megatron.bridge = pkg
    _SHIMS.append("bare megatron.bridge package")


def _common_utils_stub() -> None:
    name = "megatron.bridge.utils.common_utils"
    if name in sys.modules:
        return
    utils_pkg = importlib.import_module("megatron.bridge.utils")  # the real (empty) package
    stub = types.ModuleType(name, "stand-in: the real one imports megatron.training (Python 3.12)")

    def get_rank_safe() -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def print_rank_0(message, *args, **kwargs) -> None:
        if get_rank_safe() == 0:
            print(message, flush=True)

    stub.get_rank_safe, stub.print_rank_0 = get_rank_safe, print_rank_0
    sys.modules[name] = stub
    utils_pkg.common_utils = stub
    _SHIMS.append("megatron.bridge.utils.common_utils stand-in")


def _hybrid_stack_stub() -> None:
    try:
        importlib.import_module("megatron.core.models.hybrid.hybrid_block")
        return
    except ImportError:
        pass
    import megatron.core.models as models

    hybrid = types.ModuleType("megatron.core.models.hybrid", "stand-in (megatron-core < 0.19)")
    hybrid.__path__ = []
    block = types.ModuleType("megatron.core.models.hybrid.hybrid_block", "stand-in (megatron-core < 0.19)")

    class HybridStack:  # never instantiated: nothing in a GPT model is one
        pass

    block.HybridStack = HybridStack
    hybrid.hybrid_block = block
    sys.modules[hybrid.__name__], sys.modules[block.__name__] = hybrid, block
    models.hybrid = hybrid
    _SHIMS.append("megatron.core.models.hybrid.hybrid_block.HybridStack stand-in")


def _te_flags_off(utils: types.ModuleType, matcher: types.ModuleType) -> None:
    utils.HAVE_TE = False
    for flag in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
        if hasattr(matcher, flag):
            setattr(matcher, flag, False)
    _SHIMS.append("Bridge HAVE_TE flags False")


@contextlib.contextmanager
def te_stand_in(who: str):
    """A stand-in ``transformer_engine`` in ``sys.modules`` while the block runs, removed after it:
    Bridge's ``peft/lora_layers.py`` imports TE unconditionally and only names
    ``transformer_engine.pytorch.ops.Sequential`` at import; building one raises, naming ``who``."""

    class NoTE:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"Transformer Engine stand-in ({who}): TE is not installed")

    te = types.ModuleType("transformer_engine", "stand-in while megatron.bridge.peft.lora_layers runs")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_pytorch.ops = types.SimpleNamespace(Sequential=NoTE)
    te.pytorch = te_pytorch
    sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = te, te_pytorch
    try:
        yield
    finally:
        del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]


def _import_lora_layers_with_te_stand_in() -> None:
    name = "megatron.bridge.peft.lora_layers"
    if name in sys.modules:
        return
    if "transformer_engine" in sys.modules:  # a real (or other) TE: nothing to stand in for
        importlib.import_module(name)
        return

    with te_stand_in("tests.harness.bridge_env"):
        importlib.import_module(name)
    _SHIMS.append("transformer_engine stand-in while importing peft.lora_layers")


@contextlib.contextmanager
def bridge_sees_te_model(te_version: str):
    """Shim 7 (module doc) while the block runs; restored after it."""
    import importlib.metadata

    from tests.harness import te_model

    import_bridge_peft()
    utils = sys.modules["megatron.bridge.peft.utils"]

    class NotInThisModel:  # TE's TELinear (duplicated) and grouped linears: none in the TE model's GPT
        pass

    def version(dist: str) -> str:
        return te_version if dist == "transformer-engine" else importlib.metadata.version(dist)

    col, ln_col, row = te_model.TEColumnParallelLinear, te_model.TELayerNormColumnParallelLinear, te_model.TERowParallelLinear
    bound = {"HAVE_TE": True, "TEColumnParallelLinear": col, "TELayerNormColumnParallelLinear": ln_col,
             "TERowParallelLinear": row, "TELinear": NotInThisModel, "TEColumnParallelGroupedLinear": NotInThisModel,
             "TERowParallelGroupedLinear": NotInThisModel, "TECL": (col, ln_col, NotInThisModel),
             "TERL": (row, NotInThisModel), "version": version}
    saved = {name: getattr(utils, name) for name in bound}
    for name, value in bound.items():
        setattr(utils, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(utils, name, value)


_CHECKPOINTING_FUNCTIONS = ("_is_model_section", "apply_peft_adapter_filter_to_state_dict",
                            "_generate_model_state_dict")


def import_bridge_checkpointing() -> types.ModuleType:
    """Shim 6 (see the module doc): ``megatron.bridge.training.checkpointing`` with Bridge's
    own adapter-filter and model-state-dict functions; returns it."""
    import ast
    from typing import Any, Optional

    name = "megatron.bridge.training.checkpointing"
    if name in sys.modules:
        return sys.modules[name]
    import_bridge_peft()
    spec = importlib.util.find_spec("megatron.bridge.training")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(INSTALL_HINT)
    source_path = f"{next(iter(spec.submodule_search_locations))}/checkpointing.py"
    with open(source_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), source_path)
    wanted = [node for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name in _CHECKPOINTING_FUNCTIONS]
    if sorted(n.name for n in wanted) != sorted(_CHECKPOINTING_FUNCTIONS):
        raise ImportError(f"{source_path} does not define {_CHECKPOINTING_FUNCTIONS}")
    from megatron.bridge.peft.base import PEFT
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import MegatronModule

    training = types.ModuleType("megatron.bridge.training", "bare package (tests.harness.bridge_env, shim 6)")
    training.__path__ = list(spec.submodule_search_locations)
    module = types.ModuleType(name, "Bridge's adapter-filter functions only (tests.harness.bridge_env, shim 6)")
    module.__file__ = source_path
    # the names their annotations use, evaluated when the functions are defined
    module.__dict__.update(Any=Any, Optional=Optional, PEFT=PEFT, MegatronModule=MegatronModule,
                           ShardedStateDict=ShardedStateDict, ProcessGroupCollection=ProcessGroupCollection)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), source_path, "exec"), module.__dict__)
    training.checkpointing = module
    sys.modules.setdefault(training.__name__, training)
    sys.modules[name] = module
    sys.modules["megatron.bridge"].training = sys.modules[training.__name__]
    _SHIMS.append("megatron.bridge.training.checkpointing: Bridge's filter functions only")
    return module

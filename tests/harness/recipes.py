"""Megatron Bridge 0.6.2's PEFT recipes, as users run them, on a CPU-only Python 3.12 machine
with no hub access (the Python 3.12 tier, tests/*/recipes; issue 27). Tests only.

The real ``megatron-bridge==0.6.2`` and ``megatron-core==0.19.2`` are installed as packages
(``.ci/venv312.sh``); nothing of Bridge is patched or copied. What it takes to run a recipe
there, each shim with its reason (measured with torch 2.13.0+cu130 on CPU, 2026-12-06):

1. **Transformer Engine while ``peft/lora_layers.py`` executes, and only then**
   (:func:`import_bridge`). ``import megatron.bridge`` imports the model zoo, which imports
   ``megatron/bridge/peft/lora_layers.py``, which does ``import transformer_engine.pytorch as
   te`` unconditionally and evaluates ``te.ops.Sequential`` in annotations of its TE op-fuser
   class (used only with TE at TP=1). A stand-in module is put in ``sys.modules`` for exactly
   the duration of that one module's body (a meta-path finder wraps that module's loader; the
   modules it imports afterwards are imported before the stand-in appears). Present any longer,
   it would make megatron-core's and Bridge's own TE detection believe TE is installed
   (``megatron.core.utils.get_te_version`` then fails on the missing distribution while the
   model zoo is imported).
2. **Bridge's TE flags off** (:func:`import_bridge`). megatron-core's TE extension defines
   ``MagicMock`` stand-ins for the TE classes when TE is missing, so Bridge's
   ``safe_import_from`` finds them and ``megatron.bridge.peft.utils.HAVE_TE`` (and the
   ``HAVE_TE_*`` flags of ``peft.module_matcher``) come out True on a machine without TE;
   its ``isinstance(m, TEColumnParallelLinear)`` checks in ``LoRA.transform`` would then
   raise. The flags are set to what they mean: False.
3. **The published ``config.json`` in an offline HF cache** (:func:`prepare_offline_hub`).
   Each recipe calls ``AutoBridge.from_hf_pretrained(<hub id>, revision=...)``; with the
   model's ``config.json`` laid into ``$HF_HUB_CACHE/models--<org>--<name>/snapshots/<rev>/``
   (and ``refs/main`` where the recipe names no revision) and ``HF_HUB_OFFLINE=1``, that is
   all it reads. Set before ``huggingface_hub`` is imported (it reads the variables once).
4. **megatron's sliding-window mask on CPU** (:func:`enable_recipe_cpu`). The local spec's
   ``FusedScaleMaskSoftmax`` builds the mask of a sliding-window layer (GPT-OSS) with
   ``megatron.core.transformer.utils.get_sliding_window_causal_mask``, which allocates on
   ``device="cuda"``. The same mask is built on the scores' device.
5. **No ``torch.compile`` on CPU** (:func:`enable_recipe_cpu`). megatron-core 0.19.2's
   ``jit_fuser`` is ``torch.compile``: GPT-OSS's ``quick_gelu`` and its fused
   ``weighted_bias_quick_geglu`` (the clamped gated activation) are compiled by Inductor on
   first call (measured here: about 3 s each, a C++ toolchain needed) and again for new token
   counts per expert. TorchDynamo is disabled (what ``TORCHDYNAMO_DISABLE=1`` does), so they
   run eagerly: the same operations, on every side alike.
6. **What needs TE or a GPU** (:func:`without_gpu_kernels`, :func:`shrink_provider`): Llama's
   fused RoPE (``apply_rope_fusion=False``: ``validate()`` asks for TE >= 1.4), the
   MoE recipes' fused permutation (``moe_permute_fusion=False``; with it, ``validate()`` raises
   without TE) and ``flex`` dispatcher (DeepEP; ``validate()`` queries the GPU; ``alltoall``
   instead, what the recipes set before ``apply_flex_dispatcher_backend``); for the model,
   Transformer Engine itself (``transformer_impl="local"`` and Bridge's own
   ``local_layer_spec``) and grouped-GEMM experts (``moe_grouped_gemm=False``: megatron's
   ``SequentialMLP``).
   Plus megatron-core's CPU shims (:func:`regather.tools.cpu.megatron_cpu.enable_megatron_cpu`,
   :func:`regather.tools.cpu.moe_cpu.enable_moe_cpu`; docs/design.md §6, §9).

``finetune()`` itself cannot run on CPU (``initialize_megatron`` asserts CUDA, the dataset
helpers are compiled with ``make``, ``training/setup.py`` makes CUDA tensors): the tests take
the recipe's ``ConfigContainer`` and its model provider, and apply PEFT with Bridge's own
``megatron.bridge.training.setup._apply_peft_transformation`` (what ``finetune()`` calls).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import shutil
import sys
import types

import torch

from tests.harness.bridge_env import te_stand_in

BRIDGE_VERSION = "0.6.2"
MCORE_VERSION = "0.19.2"
INSTALL_HINT = (
    "the recipe tier needs Python 3.12 with megatron-bridge==0.6.2 and megatron-core==0.19.2 installed: "
    "run `.ci/venv312.sh .venv312` and `.venv312/bin/python -m pytest tests/unit/recipes tests/distributed/recipes` (make test-recipes)"
)
#: commit hash laid into ``refs/main`` for a recipe that names no revision (any 40-hex string will do)
MAIN_REVISION = "0" * 40


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One Bridge 0.6.2 PEFT recipe and the model it reads from the hub."""

    name: str  # the folder of its config.json under tests/distributed/recipes/data
    module: str
    function: str
    hub_id: str
    revision: str | None  # None: the recipe reads "main"
    gpus: int  # the recipe's own world size (its function name says it)
    moe: bool

    def config(self, peft_scheme="lora"):
        """The recipe's ``ConfigContainer``, as a user gets it."""
        import_bridge()
        return getattr(importlib.import_module(self.module), self.function)(peft_scheme=peft_scheme)


RECIPES = {
    r.name: r
    for r in (
        Recipe("qwen3_8b", "megatron.bridge.recipes.qwen.h100.qwen3", "qwen3_8b_peft_1gpu_h100_bf16_config",
               "Qwen/Qwen3-8B", "b968826d9c46dd6066d109eabc6255188de91218", 1, False),
        Recipe("qwen3_30b_a3b", "megatron.bridge.recipes.qwen.h100.qwen3_moe",
               "qwen3_30b_a3b_peft_4gpu_h100_bf16_config", "Qwen/Qwen3-30B-A3B",
               "ad44e777bcd18fa416d9da3bd8f70d33ebb85d39", 4, True),
        Recipe("gpt_oss_20b", "megatron.bridge.recipes.gpt_oss.h100.gpt_oss", "gpt_oss_20b_peft_1gpu_h100_bf16_config",
               "openai/gpt-oss-20b", None, 1, True),
        # TP 8 with sequence parallelism off, as Bridge's large dense PEFT recipes ship (issue 33)
        Recipe("llama3_70b", "megatron.bridge.recipes.llama.h100.llama3", "llama3_70b_peft_8gpu_h100_bf16_config",
               "meta-llama/Meta-Llama-3-70B", None, 8, False),
    )
}


def recipes_available() -> bool:
    """Python 3.12 with the pinned Bridge and megatron-core installed (checked without importing them)."""
    if sys.version_info < (3, 12):
        return False
    try:
        versions = importlib.metadata.version("megatron-bridge"), importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return False
    return versions == (BRIDGE_VERSION, MCORE_VERSION)


# -- 3. the offline hub -------------------------------------------------------------------------


def prepare_offline_hub(cache_dir: str, data_dir: str) -> dict:
    """Lay each recipe's ``data_dir/<name>/config.json`` into an HF cache at ``cache_dir`` at the
    revision the recipe asks for, and point this process (and the ranks it spawns) at it, offline.
    Returns the environment variables set."""
    for recipe in RECIPES.values():
        repo = os.path.join(cache_dir, "models--" + recipe.hub_id.replace("/", "--"))
        revision = recipe.revision or MAIN_REVISION
        snapshot = os.path.join(repo, "snapshots", revision)
        os.makedirs(snapshot, exist_ok=True)
        shutil.copyfile(os.path.join(data_dir, recipe.name, "config.json"), os.path.join(snapshot, "config.json"))
        if recipe.revision is None:
            os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
            with open(os.path.join(repo, "refs", "main"), "w") as f:
                f.write(revision)
    env = {"HF_HUB_CACHE": cache_dir, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None and os.path.realpath(getattr(hub, "HF_HUB_CACHE", "")) != os.path.realpath(cache_dir):
        raise RuntimeError("huggingface_hub was imported before prepare_offline_hub(): it read HF_HUB_CACHE "
                           "already; call prepare_offline_hub() first (e.g. in conftest.py)")
    os.environ.update(env)
    return env


# -- 1. and 2. importing Bridge -------------------------------------------------------------------

_LORA_LAYERS = "megatron.bridge.peft.lora_layers"
# what lora_layers.py imports after TE: imported before the stand-in exists, so that nothing
# but lora_layers' own body runs while it does
_LORA_LAYERS_DEPS = ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
                     "megatron.bridge.peft.lora_merge")
_SHIMS: list[str] = []


class _LoraLayersLoader(importlib.abc.Loader):
    """Runs lora_layers.py's body with a stand-in ``transformer_engine`` in ``sys.modules``."""

    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        for name in _LORA_LAYERS_DEPS:
            importlib.import_module(name)
        with te_stand_in("tests.harness.recipes"):
            self.real.exec_module(module)
        _SHIMS.append("transformer_engine stand-in while peft/lora_layers.py executed")


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoraLayersLoader(spec.loader)
        return spec


def import_bridge() -> types.ModuleType:
    """``import megatron.bridge`` (the real package, model zoo and all) with shims 1 and 2; returns
    ``megatron.bridge.peft.lora``. Raises ImportError where a real Transformer Engine is installed
    beside it (nothing here is meant to stand in front of one)."""
    if "megatron.bridge.peft.lora" in sys.modules and "megatron.bridge" in sys.modules:
        return sys.modules["megatron.bridge.peft.lora"]
    try:
        importlib.metadata.version("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise ImportError("tests.harness.recipes is for machines without Transformer Engine")
    import megatron.core  # noqa: F401 - its TE detection runs first, with no stand-in around

    finder = _LoraLayersFinder()
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module("megatron.bridge")
    finally:
        sys.meta_path.remove(finder)
    utils = importlib.import_module("megatron.bridge.peft.utils")
    matcher = importlib.import_module("megatron.bridge.peft.module_matcher")
    utils.HAVE_TE = False
    for flag in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
        if hasattr(matcher, flag):
            setattr(matcher, flag, False)
    _SHIMS.append("Bridge HAVE_TE flags False")
    return importlib.import_module("megatron.bridge.peft.lora")


def installed_shims() -> list[str]:
    return list(_SHIMS)


# -- 4., 5., 6. running the recipe's model on CPU -----------------------------------------------

_CPU_ENABLED = False


def enable_recipe_cpu() -> None:
    """megatron-core's CPU shims (dense and MoE) plus shims 4 and 5 (idempotent)."""
    global _CPU_ENABLED
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu
    from regather.tools.cpu.moe_cpu import enable_moe_cpu

    enable_megatron_cpu()
    enable_moe_cpu()
    if _CPU_ENABLED or torch.cuda.is_available():
        return
    import torch._dynamo as dynamo

    dynamo.config.disable = True  # shim 5
    from megatron.core.fusions import fused_softmax

    def get_sliding_window_causal_mask(sq, skv, window_size, device="cpu"):  # shim 4: megatron's, on CPU
        m = torch.ones(sq, skv, dtype=torch.bool, device=device)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
        return ~ml

    fused_softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    _SHIMS.append("sliding-window mask on CPU; TorchDynamo disabled")
    _CPU_ENABLED = True


def init_parallel(tp: int, ep: int = 1, seed: int = 1234) -> None:
    """megatron's parallel state over the default (gloo) group: TP ``tp`` + SP, EP ``ep``, ETP 1."""
    from megatron.core import parallel_state, tensor_parallel

    enable_recipe_cpu()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def without_gpu_kernels(model_cfg) -> dict:
    """Shim 6, on a recipe's model config: the kernel choices that need Transformer Engine or a GPU
    replaced by megatron's portable ones, nothing else: ``apply_rope_fusion`` (TE >= 1.4, or
    ``validate()`` raises; Llama's provider turns it on), ``moe_permute_fusion`` (TE; without TE
    ``validate()`` raises "fused permutation is not available") and the ``flex`` dispatcher
    (DeepEP; ``validate()`` reads ``torch.cuda.get_device_properties``) becomes ``alltoall``, the
    dispatcher the MoE recipes set before ``apply_flex_dispatcher_backend``. Returns what changed."""
    changed = {}
    if getattr(model_cfg, "apply_rope_fusion", False):  # Llama's provider sets it; validate() wants TE >= 1.4
        changed["apply_rope_fusion"] = (True, False)
        model_cfg.apply_rope_fusion = False
    if getattr(model_cfg, "moe_permute_fusion", False):
        changed["moe_permute_fusion"] = (True, False)
        model_cfg.moe_permute_fusion = False
    if getattr(model_cfg, "moe_token_dispatcher_type", None) == "flex":
        changed["moe_token_dispatcher_type"] = ("flex", "alltoall")
        model_cfg.moe_token_dispatcher_type = "alltoall"
    return changed


@dataclasses.dataclass(frozen=True)
class Shrink:
    """The recipe's model made small: widths, depth and expert count only. Every architecture
    switch the provider carries (GQA, QK-norm, SwiGLU, biases, attention sinks, sliding window,
    YaRN, clamped gated activation, router settings) stays as the recipe set it."""

    num_layers: int = 2
    hidden_size: int = 64
    kv_channels: int = 8
    num_query_groups: int = 2  # divisible by TP 2; heads keep the published heads-per-group ratio
    ffn_hidden_size: int = 128
    moe_ffn_hidden_size: int = 32
    num_experts: int = 4
    topk: int = 2
    vocab_size: int = 256
    seq_length: int = 64  # raised above the sliding window where there is one


def shrink_provider(provider, tp: int, ep: int = 1, shape: Shrink = Shrink(), sequence_parallel: bool | None = None):
    """Return the recipe's provider shrunk (``shape``) and set up for CPU: TP ``tp``, SP on when
    ``tp > 1`` unless ``sequence_parallel`` says otherwise, EP ``ep``, ETP 1, fp32, local spec
    (shim 6). Modifies and returns ``provider``."""
    sp = tp > 1 if sequence_parallel is None else bool(sequence_parallel and tp > 1)
    from megatron.bridge.models.gpt_provider import local_layer_spec

    heads_per_group = provider.num_attention_heads // (provider.num_query_groups or provider.num_attention_heads)
    seq = shape.seq_length
    if provider.window_size is not None:
        seq = max(seq, provider.window_size[0] + 1 + 64)  # longer than the window, so that its mask matters
    changes = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, kv_channels=shape.kv_channels,
        num_query_groups=shape.num_query_groups, num_attention_heads=shape.num_query_groups * heads_per_group,
        ffn_hidden_size=shape.ffn_hidden_size, vocab_size=shape.vocab_size, seq_length=seq,
        tensor_model_parallel_size=tp, sequence_parallel=sp, pipeline_model_parallel_size=1,
        context_parallel_size=1, pipeline_dtype=None, virtual_pipeline_model_parallel_size=None,
        params_dtype=torch.float32, bf16=False, fp16=False, transformer_impl="local",
        transformer_layer_spec=local_layer_spec, use_transformer_engine_full_layer_spec=False,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    if provider.num_moe_experts:
        if provider.moe_ffn_hidden_size == provider.ffn_hidden_size:  # GPT-OSS: experts as wide as the model
            changes["moe_ffn_hidden_size"] = shape.hidden_size
        else:
            changes["moe_ffn_hidden_size"] = shape.moe_ffn_hidden_size
        changes.update(num_moe_experts=shape.num_experts, moe_router_topk=shape.topk,
                       expert_model_parallel_size=ep, expert_tensor_parallel_size=1, moe_grouped_gemm=False,
                       moe_router_fusion=False)
        without_gpu_kernels(provider)
    for name, value in changes.items():
        if not hasattr(provider, name):
            raise AttributeError(f"{type(provider).__name__} has no attribute {name!r}")
        setattr(provider, name, value)
    provider.finalize()
    return provider


def build_model(provider, seed: int = 1234):
    """The provider's model (``provider.provide()``) on the current megatron parallel state; the same
    weights on every call with the same ``seed``."""
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return provider.provide()


def apply_peft(peft, model) -> list:
    """Bridge's own ``_apply_peft_transformation`` (what ``finetune()``'s pre-wrap hook calls):
    ``peft(model, training=True)`` then ``peft.set_params_to_save``. Returns the model chunks."""
    from megatron.bridge.training.setup import _apply_peft_transformation

    return _apply_peft_transformation(peft, [model])


def token_batch(vocab_size: int, micro_batch: int, seq_length: int, seed: int = 0):
    """Deterministic tokens, labels, position ids and a causal mask, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_length + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(seq_length).unsqueeze(0).expand_as(inputs)
    mask = torch.tril(torch.ones(seq_length, seq_length, dtype=torch.bool)).logical_not().view(1, 1, seq_length,
                                                                                             seq_length)
    return inputs, labels, position_ids, mask

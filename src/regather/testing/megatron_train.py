"""Train a LoRA GPT through megatron-core's own training machinery, on CPU ranks.

``regather.testing.train`` drives the model with a hand-written loop. A user's
Megatron-LM / Megatron Bridge run does not: it wraps every model chunk in
megatron's ``DistributedDataParallel``, builds the optimizer with
``get_megatron_optimizer``, runs micro-batches through
``get_forward_backward_func()`` (no pipelining, 1F1B, interleaved) and reduces
gradients in ``finalize_model_grads``. :func:`train` does exactly that, with the
hooks Megatron-LM's ``training.py`` installs (``no_sync_func``,
``grad_sync_func``, ``param_sync_func``, ``finalize_model_grads_func``,
``grad_scale_func``, forward pre-hooks off for the first step with
``overlap_param_gather``), and returns what a test compares: per-step losses,
fp32 ``main_grad`` s, parameters, and the LoRA weights each adapter's forward
actually read.

:func:`enable_megatron_training_cpu` applies the run-time patches this needs on
a machine without CUDA (design.md §8), on top of
:func:`regather.testing.enable_megatron_cpu` (§6). Each patch is idempotent,
scoped to the megatron modules that need it, and skipped when CUDA is there:

1. **``device="cuda"`` tensor factories** (``torch.zeros(..., device="cuda")``
   for token counters in the schedules, grad-norm / overflow buffers in
   ``clip_grads``, ``optimizer``, ``grad_scaler``, ``utils``, a warm-up tensor in
   ``param_and_grad_buffer``): the module-global ``torch`` of those megatron
   modules is replaced by a proxy whose factories put "cuda" tensors on the CPU.
2. **``torch.cuda.synchronize()``** after batched p2p (``p2p_communication``),
   in DDP's buffer offload: the same proxy's ``torch.cuda`` makes it a no-op
   (CPU work is synchronous; gloo's async ops are waited on explicitly); and
   **``torch.cuda.current_stream()``**, which megatron-core 0.19's
   ``start_grad_sync`` reads on every bucket (to wait on CUDA-graph wgrad events):
   the proxy returns torch's CPU stream stand-in, whose waits are no-ops.
3. **``Tensor.type()`` compared with ``"torch.cuda.FloatTensor"``** (the
   optimizers sort parameters into fp32 / fp16 groups this way and raise
   ``TypeError`` otherwise; ``clip_grads`` asserts it): ``Tensor.type()`` with
   no argument returns the ``torch.cuda.*`` name for a CPU tensor, but only when
   called from one of those megatron modules (checked on the caller's frame).
4. **``fused_weight_gradient_mlp_cuda``** (apex's fused wgrad extension):
   megatron's linears refuse ``gradient_accumulation_fusion=True`` without it.
   A torch stand-in (:data:`FUSED_WGRAD_STANDIN`) with apex's two entry points
   ``wgrad_gemm_accum_fp32(input, grad_output, main_grad)`` and
   ``wgrad_gemm_accum_fp16(...)`` (``main_grad += grad_output^T @ input``) is
   put into ``sys.modules`` and into megatron's ``tensor_parallel.layers``.

Facts this harness relies on (megatron-core 0.16.1 and 0.19.2, gloo):
gloo's batched ``isend/irecv`` mixed up tensors with a virtual pipeline, so
``batch_p2p_comm`` is off there (design.md §8); megatron's DDP turns bucketing off
on pipeline stages > 0 and for model chunks > 0 (as Megatron-LM asks).

Running many configurations in one process group: :func:`setup_parallel` builds fresh
megatron state per run and destroys the previous run's groups (:func:`teardown_parallel`;
megatron's ``destroy_model_parallel`` alone leaks them with their gloo threads);
:func:`train_agreed` makes every rank agree that a run failed, so the next run starts
together. With the distributed optimizer only a rank's shard of ``main_grad`` is reduced;
:func:`reduced_main_grads` all-gathers the shards into full copies to compare.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from regather.testing.models import TinyGPT, gpt_batch, init_model_parallel
from regather.testing.moe_models import TinyMoE

# -- CPU patches ----------------------------------------------------------------------

# megatron modules whose module-global ``torch`` becomes the CPU proxy (patches 1, 2)
# and whose Tensor.type() calls see torch.cuda.* names (patch 3).
_TRAINING_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.utils",
)
_ENABLED = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


def _on_cpu(factory: Callable) -> Callable:
    def make(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    make.__name__ = factory.__name__
    return make


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron's training modules see it on CPU: no-op synchronize, and
    torch's CPU stream stand-in (``wait_event`` / ``wait_stream`` are no-ops) as the current
    / default stream."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def current_stream(device=None):
        return torch.cpu.current_stream()

    @staticmethod
    def default_stream(device=None):
        return torch.cpu.current_stream()

    @staticmethod
    def current_device():
        return "cpu"


class _CpuTorch(types.ModuleType):
    """``torch`` for megatron's training modules on CPU: "cuda" factories land on the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
                  "zeros_like", "ones_like", "empty_like", "full_like")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in self._FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))
        self._regather_cpu_proxy = True

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_training_modules() -> None:
    import importlib

    proxy = _CpuTorch()
    for name in _TRAINING_MODULES:
        module = importlib.import_module(name)
        if getattr(getattr(module, "torch", None), "_regather_cpu_proxy", False):
            continue
        module.torch = proxy


def _patch_tensor_type() -> None:
    orig = torch.Tensor.type
    if getattr(orig, "_regather_cpu", False):
        return
    modules = frozenset(_TRAINING_MODULES)

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            if sys._getframe(1).f_globals.get("__name__") in modules:
                return orig(self).replace("torch.", "torch.cuda.", 1)
        return orig(self, dtype, non_blocking, **kwargs)

    type_._regather_cpu = True
    type_.__doc__ = orig.__doc__
    torch.Tensor.type = type_


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex: ``main_grad (fp32) += grad_output^T @ input`` (one GEMM with beta = 1)."""
    main_grad.addmm_(_rows(grad_output).t().float(), _rows(input).float())


def _wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex: ``main_grad (fp16/bf16) += grad_output^T @ input``, fp32 product, one rounding."""
    acc = main_grad.float().addmm_(_rows(grad_output).t().float(), _rows(input).float())
    main_grad.copy_(acc)


FUSED_WGRAD_STANDIN = types.ModuleType("fused_weight_gradient_mlp_cuda")
FUSED_WGRAD_STANDIN.__doc__ = "regather.testing stand-in for apex's fused wgrad CUDA extension (torch, CPU)."
FUSED_WGRAD_STANDIN.wgrad_gemm_accum_fp32 = _wgrad_gemm_accum_fp32
FUSED_WGRAD_STANDIN.wgrad_gemm_accum_fp16 = _wgrad_gemm_accum_fp16
FUSED_WGRAD_STANDIN.regather_standin = True


def _install_fused_wgrad_standin() -> None:
    from megatron.core.tensor_parallel import layers

    real = sys.modules.get("fused_weight_gradient_mlp_cuda")
    if real is not None and not getattr(real, "regather_standin", False):
        return  # the real extension is there: use it
    sys.modules["fused_weight_gradient_mlp_cuda"] = FUSED_WGRAD_STANDIN
    layers.fused_weight_gradient_mlp_cuda = FUSED_WGRAD_STANDIN
    layers._grad_accum_fusion_available = True


def enable_megatron_training_cpu() -> bool:
    """Apply §6's and §8's CPU patches once. Returns True when they are (or were) applied;
    False (and nothing patched) when CUDA is available."""
    global _ENABLED
    from regather.testing.megatron_cpu import enable_megatron_cpu

    if not enable_megatron_cpu():
        return False
    if not _ENABLED:
        _patch_training_modules()
        _patch_tensor_type()
        _install_fused_wgrad_standin()
        _ENABLED = True
    return True


# -- what to train --------------------------------------------------------------------

# name -> (LoRA strategy, LoRA field overrides); None: megatron's own trainable linears.
STRATEGIES: dict[str, tuple[str, dict] | None] = {
    "gather": ("gather", {}),
    "regather": ("regather", {}),
    "regather-plain": ("regather", {"early_regather": False}),
    "lowrank": ("lowrank", {"lowrank_grad_allreduce": "backward"}),
    "lowrank-finalize": ("lowrank", {"lowrank_grad_allreduce": "finalize_model_grads"}),
    "gather-shared": ("gather", {"share_sequence_gather": True}),
    "regather-shared": ("regather", {"share_sequence_gather": True}),
    # control: no adapters; the base linears of the LoRA targets train (megatron's own
    # wgrad / main_grad / dummy-grad path), everything else frozen
    "megatron": None,
}


@dataclass
class DDPOptions:
    """The ``DistributedDataParallelConfig`` fields a run varies (the rest: megatron's defaults)."""

    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None  # elements; only used with overlap_grad_reduce

    @property
    def align_param_gather(self) -> bool:
        # Megatron-LM: --align-param-gather (default on) with overlap_param_gather
        return self.overlap_param_gather


@dataclass
class TrainSpec:
    """One training run: topology, megatron options, strategy, sizes."""

    strategy: str = "gather"
    tp: int = 2
    pp: int = 1
    vpp: int | None = None
    ddp: DDPOptions = field(default_factory=DDPOptions)
    gradient_accumulation_fusion: bool = False
    shape: TinyGPT | TinyMoE = field(default_factory=TinyGPT)  # a TinyMoE: megatron's MoE layers
    ep: int = 1  # expert model parallel (MoE shapes)
    etp: int | None = None  # expert tensor parallel (None: megatron's default, ``tp``)
    micro_batch: int = 2
    num_microbatches: int = 4
    steps: int = 3
    lr: float = 1e-3
    clip_grad: float = 1.0
    lora_dim: int = 8
    lora_alpha: int = 16
    lora_B_init_method: str = "normal"  # non-zero B: LoRA-A gets a gradient from step 0
    targets: tuple = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    batch_p2p_comm: bool | None = None  # None: off with a virtual pipeline (gloo, §8)
    seed: int = 1234
    timeout_minutes: float = 1.0  # megatron's process groups (a stage waiting on a failed peer)

    def __post_init__(self):
        moe = isinstance(self.shape, TinyMoE)
        if not moe and (self.ep != 1 or self.etp is not None):
            raise ValueError(f"TrainSpec(ep={self.ep}, etp={self.etp}): expert parallelism needs a TinyMoE shape, "
                             f"got {type(self.shape).__name__}")
        if moe and self.vpp is not None:
            raise ValueError(f"TrainSpec(vpp={self.vpp}): the MoE builder here has no virtual pipeline stages")

    @property
    def p2p_batched(self) -> bool:
        return self.batch_p2p_comm if self.batch_p2p_comm is not None else self.vpp is None


_GROUPS: list = []  # the process groups the last setup_parallel created (this rank)


def _process_groups() -> list:
    import torch.distributed as dist

    return list(getattr(dist.distributed_c10d._world, "pg_map", {}))


def teardown_parallel() -> None:
    """Drop megatron's parallel state and destroy the process groups :func:`setup_parallel`
    created. megatron's ``destroy_model_parallel`` only forgets its groups; each gloo group
    keeps its threads (about three, each waking 100 times a second) until destroyed, so a
    rank that rebuilt its state for every run would pile up thousands of them. A group is only
    gone once nothing holds it: see :func:`release_training` for what held the runs' groups."""
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    # ... which in 0.16.1 forgets to reset _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO): the
    # last run's two groups stay alive. Every group it still names is stale now.
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    # RotaryEmbedding.forward is an lru_cache (32 entries) on the method: each entry keeps its
    # RotaryEmbedding, and with it the run's cp_group, alive (one group, three threads, per run).
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    while _GROUPS:
        group = _GROUPS.pop()
        try:
            dist.destroy_process_group(group)
        except Exception:
            pass
    gc.collect()  # the last run's model, DDP and optimizer hold its groups in reference cycles


def setup_parallel(spec: TrainSpec) -> None:
    """Fresh megatron parallel state for ``spec``: the previous groups destroyed, new ones."""
    enable_megatron_training_cpu()
    teardown_parallel()
    before = set(_process_groups())
    init_model_parallel(spec.tp, spec.seed, pp=spec.pp, vpp=spec.vpp, timeout_minutes=spec.timeout_minutes,
                        ep=spec.ep, etp=spec.etp)
    _GROUPS.extend(g for g in _process_groups() if g not in before)


def lora_config(spec: TrainSpec):
    """The ``regather.LoRA`` for ``spec.strategy`` (built as ``regather.testing.train.lora_for``)."""
    from regather.testing.train import RunConfig, lora_for

    base, overrides = STRATEGIES[spec.strategy]
    cfg = RunConfig(strategy=base, tp=spec.tp, lora_dim=spec.lora_dim, lora_alpha=spec.lora_alpha,
                    targets=tuple(spec.targets), lora_B_init_method=spec.lora_B_init_method, seed=spec.seed)
    return dataclasses.replace(lora_for(cfg), **overrides)


def build_model_chunks(spec: TrainSpec) -> list:
    """This rank's model chunks (one per virtual stage), LoRA applied, as ``get_model`` builds them."""
    from megatron.core import parallel_state

    from regather.testing.models import build_gpt

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks_per_stage = spec.vpp or 1
    overrides = dict(pipeline_dtype=torch.float32, batch_p2p_comm=spec.p2p_batched)
    if spec.pp > 1:
        overrides.update(pipeline_model_parallel_size=spec.pp,
                         virtual_pipeline_model_parallel_size=spec.vpp)
    chunks = []
    if isinstance(spec.shape, TinyMoE):  # one chunk per stage (TrainSpec checks)
        from regather.testing.moe_models import build_moe_gpt

        model = build_moe_gpt(spec.shape, spec.tp, spec.ep, spec.etp, torch.float32, seed=spec.seed,
                              init_parallel=False, gradient_accumulation_fusion=spec.gradient_accumulation_fusion,
                              pre_process=pp_rank == 0, post_process=pp_rank == spec.pp - 1, **overrides)
        return [_adapt(model, spec, stage=pp_rank)]
    for vp in range(chunks_per_stage):
        model = build_gpt(
            spec.shape, spec.tp, True, torch.float32, seed=spec.seed,
            gradient_accumulation_fusion=spec.gradient_accumulation_fusion,
            pre_process=pp_rank == 0 and vp == 0,
            post_process=pp_rank == spec.pp - 1 and vp == chunks_per_stage - 1,
            vp_stage=vp if spec.vpp else None,
            init_parallel=False,
            **overrides,
        )
        chunks.append(_adapt(model, spec, stage=vp * spec.pp + pp_rank))
    return chunks


def _adapt(model, spec: TrainSpec, stage: int):
    """LoRA on ``model`` (or the control's trainable base linears); the adapter init is the same
    on every TP/DP rank, different per pipeline chunk."""
    torch.manual_seed(spec.seed + 1 + 100 * stage)
    if STRATEGIES[spec.strategy] is None:
        _megatron_control(model, spec.targets)
        return model
    return lora_config(spec)(model, training=True)


def _megatron_control(model, targets) -> None:
    """Freeze everything but the weights of the target linears (megatron's own layers train)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in targets:
            module.weight.requires_grad_(True)
    model.train()


def wrap_ddp(chunks: list, spec: TrainSpec) -> list:
    """``DistributedDataParallel`` per chunk; bucketing off for chunks > 0 (Megatron-LM's get_model)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    wrapped = []
    for i, chunk in enumerate(chunks):
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=spec.ddp.overlap_grad_reduce,
            use_distributed_optimizer=spec.ddp.use_distributed_optimizer,
            overlap_param_gather=spec.ddp.overlap_param_gather,
            align_param_gather=spec.ddp.align_param_gather,
            bucket_size=spec.ddp.bucket_size,
        )
        wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=i > 0))
    return wrapped


def build_optimizer(model: list, spec: TrainSpec):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=spec.lr, clip_grad=spec.clip_grad, params_dtype=torch.float32,
        bf16=False, fp16=False,
        use_distributed_optimizer=spec.ddp.use_distributed_optimizer,
        overlap_param_gather=spec.ddp.overlap_param_gather,
    )
    return get_megatron_optimizer(config, model)


def install_training_hooks(model: list, optimizer, spec: TrainSpec):
    """What Megatron-LM's ``training.py`` sets on the model config before training."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    single = len(model) == 1
    if spec.ddp.overlap_grad_reduce:
        config.no_sync_func = [m.no_sync for m in model]
        config.grad_sync_func = [m.start_grad_sync for m in model]  # align_grad_reduce (default on)
        if single:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    if spec.ddp.overlap_param_gather and spec.ddp.align_param_gather:
        config.param_sync_func = [m.start_param_sync for m in model]
        if single:
            config.param_sync_func = config.param_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    return config


def step_batches(spec: TrainSpec, step: int, dp_rank: int) -> list:
    """The micro-batches of one step: different per DP replica, the same on its TP/PP ranks."""
    return [gpt_batch(spec.shape, spec.micro_batch, seed=10_000 * step + 100 * i + dp_rank)
            for i in range(spec.num_microbatches)]


def _forward_step(data_iterator, model):
    tokens, labels, position_ids, mask = next(data_iterator)
    output = model(tokens, position_ids, mask, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _trainable(model: list) -> dict:
    return {f"chunk{i}.{n}": p for i, m in enumerate(model) for n, p in _unwrap(m).named_parameters()
            if p.requires_grad}


def _sharded_views(model: list) -> dict:
    """name -> function giving a tensor in the Bridge (rank-sharded) layout.

    A low-rank adapter's LoRA-A is replicated ``[r, h]``; its TP rank's rows are what the
    gather path holds as ``[r/t, h]``, so results are recorded in that layout to compare."""
    from regather.core.strategies.lowrank import shard_rows
    from regather.megatron.dense.model import adapters

    views = {}
    for i, chunk in enumerate(model):
        for path, adapter in adapters(_unwrap(chunk)).items():
            if adapter.replicated_a:
                rows = shard_rows(adapter.dim, adapter.tp_rank, adapter.tp_size)
                views[f"chunk{i}.{path}.adapter.linear_in.weight"] = lambda t, rows=rows: t[rows]
    return views


def _snapshot(tensors: dict, views: dict) -> dict:
    return {n: views.get(n, _same)(t.detach()).clone() for n, t in tensors.items()}


def _same(t):
    return t


def reduced_main_grads(model: list, named: dict) -> dict:
    """name -> the DP-reduced gradient, full size, after ``finalize_model_grads``.

    Without the distributed optimizer that is ``main_grad`` itself (all-reduced). With it,
    megatron reduce-scatters each bucket: a rank's ``main_grad`` is reduced only inside its
    own shard of the bucket and holds its local partial sum elsewhere, so the shards are
    all-gathered over the bucket's DP group (into copies; training state untouched) to give
    every rank the full reduced gradient, comparable across runs whose bucket layouts differ.
    """
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    grads = {n: p.main_grad for n, p in named.items()}
    by_param = {id(p): n for n, p in named.items()}
    for chunk in model:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                full = torch.empty_like(bucket.grad_data)
                local = shard_buffer(bucket.grad_data, size)[rank].contiguous()
                dist.all_gather_into_tensor(full, local, group=group.intra_distributed_optimizer_instance_group)
                base = bucket.grad_data.data_ptr()
                for param in bucket.params:
                    offset = (param.main_grad.data_ptr() - base) // param.main_grad.element_size()
                    grads[by_param[id(param)]] = full[offset:offset + param.numel()].view(param.shape)
    return grads


def _record_used_weights(model: list, store: dict) -> list:
    """Forward hooks on every adapter: the LoRA weights its forward read, per call."""
    from regather.core.strategies.lowrank import shard_rows
    from regather.megatron.dense.model import adapters

    handles = []
    for i, chunk in enumerate(model):
        for path, adapter in adapters(_unwrap(chunk)).items():
            key = f"chunk{i}.{path}"

            def hook(module, args, output, key=key):
                a = module.linear_in.weight.detach()
                if module.replicated_a:  # Bridge layout, as the gather path holds it
                    a = a[shard_rows(module.dim, module.tp_rank, module.tp_size)]
                store.setdefault(key, []).append((a.clone(), module.linear_out.weight.detach().clone()))

            handles.append(adapter.register_forward_hook(hook))
    return handles


def _coords() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
            "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank()}


def train(spec: TrainSpec) -> dict:
    """Run ``spec.steps`` training steps of ``spec.num_microbatches`` micro-batches on this rank.

    Expects an initialised default group and :func:`setup_parallel` done. Returns
    ``coords`` (tp/pp/dp rank), ``initial_param``, ``loss`` (per step, per micro-batch; last stage only),
    ``main_grad`` (per step, after ``finalize_model_grads``: :func:`reduced_main_grads`), ``param`` (per step, after
    ``optimizer.step()``), ``used`` (per step, per adapter: the ``(A, B)`` its forward
    read; ``used_consistent``: the same on every micro-batch of the step), ``final_param``
    (after a last synchronous param sync), ``decisions``, ``grad_norm``, ``schedule`` (the
    forward-backward function's name), ``buckets`` (DDP buckets per chunk) and ``layers``
    (global layer numbers per chunk).
    """
    chunks = build_model_chunks(spec)
    model = wrap_ddp(chunks, spec)
    optimizer = build_optimizer(model, spec)
    config = install_training_hooks(model, optimizer, spec)
    try:
        return _train_steps(spec, model, optimizer, config)
    finally:
        release_training(model, config)


def release_training(model: list, config) -> None:
    """Undo :func:`install_training_hooks` and drop DDP's grad accumulators, so that the run's
    model, optimizer and process groups can be freed once the run's objects go out of scope.

    Otherwise they never are, in a process that trains many runs: each DDP param hook (on the
    param's ``AccumulateGrad`` node, which autograd holds in C++, out of the garbage collector's
    sight) closes over its DDP; the distributed optimizer keeps views of the params, whose graph
    holds those nodes; the model config holds the optimizer (``grad_scale_func``). Measured on
    megatron-core 0.16.1 and 0.19.2, TP=2, overlapped grad reduce + distributed optimizer: each
    run left its ~19 gloo groups alive, three threads each (one waking ~100 times a second),
    until a rank had 1,000+ threads."""
    for name in ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
                 "finalize_model_grads_func"):
        setattr(config, name, None)
    for m in model:
        getattr(m, "grad_accs", []).clear()


def _train_steps(spec: TrainSpec, model: list, optimizer, config) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from regather.megatron.dense.model import adapters

    named = _trainable(model)
    views = _sharded_views(model)
    coords = _coords()
    out: dict[str, Any] = {"coords": coords, "loss": [], "main_grad": [], "param": [], "used": [],
                           "used_consistent": [], "grad_norm": []}
    out["initial_param"] = _snapshot(named, views)
    used: dict = {}
    handles = _record_used_weights(model, used)
    # Megatron-LM (training.py, train()): with the distributed optimizer and overlapped param
    # gather, the forward pre-hooks (and param_sync_func) are off for the first step and on after.
    prehooks = spec.ddp.use_distributed_optimizer and spec.ddp.overlap_param_gather
    param_sync_func = config.param_sync_func
    if prehooks:
        for m in model:
            m.disable_forward_pre_hook(param_sync=False)
        config.param_sync_func = None
    forward_backward = get_forward_backward_func()
    out["schedule"] = forward_backward.__name__
    out["buckets"] = [sum(len(buffer.buckets) for buffer in m.buffers) for m in model]
    # which trainable parameters DDP put in its expert-parallel buffers (reduced over expert DP)
    by_param = {id(p): n for n, p in named.items()}
    out["expert_buffer_params"] = sorted(by_param[id(p)] for i, m in enumerate(model)
                                         for buffer in getattr(m, "expert_parallel_buffers", [])
                                         for p in buffer.params if id(p) in by_param)
    out["layers"] = [[layer.layer_number for layer in _unwrap(m).decoder.layers] for m in model]
    for step in range(spec.steps):
        batches = step_batches(spec, step, coords["dp"])
        iters = [iter(batches) for _ in model]
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        used.clear()
        reduced = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iters if len(model) > 1 else iters[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=spec.num_microbatches,
            seq_length=spec.shape.seq_length,
            micro_batch_size=spec.micro_batch,
            forward_only=False,
        )
        out["loss"].append([r["loss"].item() for r in reduced] if coords["last_stage"] else None)
        out["main_grad"].append(_snapshot(reduced_main_grads(model, named), views))
        update_ok, grad_norm, _ = optimizer.step()
        if not update_ok:
            raise RuntimeError(f"step {step}: megatron's optimizer skipped the update")
        out["grad_norm"].append(float(grad_norm) if grad_norm is not None else None)
        out["param"].append(_snapshot(named, views))
        out["used"].append({k: v[0] for k, v in used.items()})
        out["used_consistent"].append({k: all(torch.equal(a, v[0][0]) and torch.equal(b, v[0][1]) for a, b in v)
                                       for k, v in used.items()})
        if prehooks and step == 0:
            for m in model:
                m.enable_forward_pre_hook()
            config.param_sync_func = param_sync_func
    if prehooks:  # Megatron-LM before eval / checkpointing: hooks off, params synchronised
        for m in model:
            m.disable_forward_pre_hook(param_sync=True)
    out["final_param"] = _snapshot(named, views)
    for h in handles:
        h.remove()
    out["decisions"] = {f"chunk{i}.{path}": str(a.last_decision)
                        for i, m in enumerate(model) for path, a in adapters(_unwrap(m)).items()}
    return out


def warm_up() -> None:
    """Apply the patches and import what training touches, then line the ranks up.

    Megatron's groups get a short timeout (``TrainSpec.timeout_minutes``); first-time imports
    (seconds each on a busy machine, and uneven across ranks) happen here, under the default
    group's timeout, not inside the first collective of a run."""
    import torch.distributed as dist
    from megatron.core import distributed, optimizer  # noqa: F401
    from megatron.core.pipeline_parallel import p2p_communication, schedules  # noqa: F401

    import regather.megatron.lora  # noqa: F401

    enable_megatron_training_cpu()
    dist.barrier()


def train_agreed(spec: TrainSpec) -> tuple[dict | None, str | None]:
    """:func:`setup_parallel` + :func:`train` on this rank, a failure caught and agreed on.

    Returns ``(result, None)``, or ``(None, traceback)`` when the run failed on any rank (a
    rank that did not fail itself says so). A run that fails on some ranks only (one pipeline
    stage raises while its peer waits in a p2p receive) leaves the peers blocked until
    megatron's group timeout (``spec.timeout_minutes``); the closing all-reduce on the
    default group lines every rank up again, and the next run builds new groups.
    """
    import torch.distributed as dist

    result, error = None, None
    try:
        setup_parallel(spec)
        result = train(spec)
    except Exception:
        error = f"rank {dist.get_rank()}: {traceback.format_exc()}"
    failed = torch.tensor([0 if error is None else 1])
    dist.all_reduce(failed)
    if failed.item() and error is None:
        result, error = None, f"rank {dist.get_rank()}: the run failed on {failed.item()} other rank(s)"
    return result, error

"""What a training run builds, as Megatron-LM does: fresh parallel state, the model chunks with LoRA,
``DistributedDataParallel``, ``get_megatron_optimizer`` and the hooks ``training.py`` installs.

Running many configurations in one process group: :func:`setup_parallel` builds fresh
megatron state per run and destroys the previous run's groups (:func:`teardown_parallel`;
megatron's ``destroy_model_parallel`` alone leaks them with their gloo threads);
:func:`train_agreed` makes every rank agree that a run failed, so the next run starts
together. :func:`release_training` undoes what would keep a finished run alive.
"""

from __future__ import annotations

import dataclasses
import traceback

import torch

from regather.tools.cpu.models import init_model_parallel
from regather.tools.cpu.moe_models import TinyMoE
from tests.harness.megatron_train.cpu import enable_megatron_training_cpu
from tests.harness.megatron_train.loop import run_steps
from tests.harness.megatron_train.spec import STRATEGIES, TrainSpec

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
    """The ``regather.LoRA`` for ``spec.strategy`` (built as ``regather.tools.cpu.train.lora_for``)."""
    from regather.tools.cpu.train import RunConfig, lora_for

    base, overrides = STRATEGIES[spec.strategy]
    cfg = RunConfig(strategy=base, tp=spec.tp, lora_dim=spec.lora_dim, lora_alpha=spec.lora_alpha,
                    targets=tuple(spec.targets), lora_B_init_method=spec.lora_B_init_method, seed=spec.seed,
                    lean_transients=spec.lean_transients)
    return dataclasses.replace(lora_for(cfg), **overrides)


def build_model_chunks(spec: TrainSpec) -> list:
    """This rank's model chunks (one per virtual stage), LoRA applied, as ``get_model`` builds them."""
    from megatron.core import parallel_state

    from regather.tools.cpu.models import build_gpt

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks_per_stage = spec.vpp or 1
    overrides = dict(pipeline_dtype=torch.float32, batch_p2p_comm=spec.p2p_batched)
    if spec.pp > 1:
        overrides.update(pipeline_model_parallel_size=spec.pp,
                         virtual_pipeline_model_parallel_size=spec.vpp)
    chunks = []
    if isinstance(spec.shape, TinyMoE):  # one chunk per stage (TrainSpec checks)
        from regather.tools.cpu.moe_models import build_moe_gpt

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
        return run_steps(spec, model, optimizer, config)
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

"""``regather doctor``'s environment findings: the allocator, NCCL and offloading rows of the failure-diagnosis table."""

from __future__ import annotations

from collections.abc import Mapping

from regather.tools.doctor.setup import Finding, Setup


def alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """``PYTORCH_CUDA_ALLOC_CONF`` (or torch's newer ``PYTORCH_ALLOC_CONF``) as a dict."""
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    out = {}
    for item in raw.split(","):
        if ":" in item:
            k, v = item.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def expandable_segments(env: Mapping[str, str]) -> bool:
    return alloc_conf(env).get("expandable_segments", "").lower() in ("true", "1")


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def nccl_ub_enabled(env: Mapping[str, str], setup: Setup) -> bool:
    """``--use-nccl-ub`` / config ``nccl_ub``, or the env spelling ``REGATHER_NCCL_UB``/``NCCL_UB``."""
    return setup.use_nccl_ub or _truthy(env.get("NCCL_UB", "")) or _truthy(env.get("REGATHER_NCCL_UB", ""))


def env_findings(env: Mapping[str, str], setup: Setup) -> list[Finding]:
    """The allocator / NCCL / offloading rows of the failure-diagnosis table."""
    out = []
    expandable = expandable_segments(env)
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF")
    ub = nccl_ub_enabled(env, setup)
    if not expandable and not ub:
        out.append(Finding(
            "alloc-conf", "warning",
            f"PYTORCH_CUDA_ALLOC_CONF={raw!r} does not set expandable_segments:True: OOM on one rank "
            "despite headroom on others is usually allocator fragmentation",
            "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (zero throughput cost)",
        ))
    if expandable and ub:
        out.append(Finding(
            "nccl-ub", "error",
            f"PYTORCH_CUDA_ALLOC_CONF={raw!r} enables expandable segments together with NCCL user-buffer "
            "registration (--use-nccl-ub / nccl_ub=True): the two are incompatible (RuntimeError)",
            "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF, or disable --use-nccl-ub",
        ))
    graph_register = env.get("NCCL_GRAPH_REGISTER")
    if setup.cuda_graphs and expandable and graph_register != "0":
        out.append(Finding(
            "cuda-graph-register", "error",
            f"CUDA graphs with expandable segments need NCCL_GRAPH_REGISTER=0 "
            f"(it is {graph_register!r}); MCore's CudaGraphManager enforces it on pre-Blackwell GPUs",
            "export NCCL_GRAPH_REGISTER=0",
        ))
    if setup.recompute_granularity == "full" and setup.pp == 1 and not setup.input_requires_grad:
        out.append(Finding(
            "full-recompute-frozen-input", "warning",
            "full activation recompute with frozen embeddings at PP=1: megatron's reentrant checkpoint "
            "runs its backward only for an input that requires grad, so the LoRA weights inside get no "
            "gradient unless the recipe makes the decoder input require grad (Megatron Bridge's PEFT does: "
            "maybe_enable_recompute_inputs_grad; then pass --input-requires-grad)",
            "make the decoder input require grad (HF: enable_input_require_grads; megatron: a forward "
            "pre-hook on the TransformerBlock returning hidden_states.detach().requires_grad_(True))",
        ))
    if setup.cpu_offloading and setup.pp > 1:
        out.append(Finding(
            "cpu-offload-pp", "error",
            f"CPU offloading (cpu_offloading=True) with pipeline_model_parallel_size={setup.pp}: "
            "megatron-core raises 'Currently there is no support for Pipeline parallelism with CPU offloading'",
            "set cpu_offloading=False, or pipeline_model_parallel_size=1",
        ))
    return out

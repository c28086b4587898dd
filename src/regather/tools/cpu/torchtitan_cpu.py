"""Run torchtitan 0.3.0 on a CPU-only torch (gloo): the smallest shims, each with its reason.

:func:`enable_torchtitan_cpu` installs them once per process, before a model is built:

================================================ ============================================== =====
shim                                             why                                            where
================================================ ============================================== =====
stub ``torchtitan.distributed.minimal_async_ep.  ``minimal_async_ep/api.py`` imports its Triton ``_stub_ep_kernels``
kernels`` (only when ``triton`` is missing)      MoE all-to-all kernels unconditionally; every
                                                 model reaches it (``config_utils`` ->
                                                 ``token_dispatcher``). The stubs raise if called
``parallel_dims.device_type = "cpu"``            ``tools/utils.py`` picks ``"cuda"`` on a CPU-only ``_cpu_meshes``
                                                 torch; ``ParallelDims.build_mesh`` passes it to
                                                 ``init_device_mesh``
``FlexAttention.forward`` -> causal SDPA         FlexAttention is ``torch.compile(flex_attention)`` ``_causal_sdpa``
                                                 with no CPU backward; with one document per row
                                                 its block-causal mask is the causal mask
================================================ ============================================== =====

One more, only for FSDP2 with ``dp_shard > 1`` on gloo: :func:`sum_reduction_for_gloo` (gloo has
no ``ReduceOp.PREMUL_SUM``, FSDP2's default gradient divide; summing and dividing by 2 is exact).

Not shims, but what a CPU harness does instead of torchtitan's ``Trainer`` (whose import needs
torchdata, tensorboard and datasets): call the model's sharding function
(``set_llama3_sharding_config``) instead of ``update_from_config``, pick the SPMD backend
(``set_spmd_backend``), hand the batch over as ``post_dataloading_process`` does and run forward and
backward in the trainer's ``train_context`` (:mod:`regather.tools.cpu.torchtitan_models`).
"""

from __future__ import annotations

import importlib.util
import sys
import types

_KERNELS = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
            "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
            "reduce_topk_slots_kernel", "topk_scores_grad_kernel")
_done = False


def _stub_ep_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(name)

    def missing(*args, **kwargs):
        raise NotImplementedError("torchtitan's minimal_async_ep Triton kernels are not available on CPU "
                                  "(regather.tools.cpu.torchtitan_cpu stub)")

    for kernel in _KERNELS:
        setattr(module, kernel, missing)
    sys.modules[name] = module


def _cpu_meshes() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


def _causal_sdpa() -> None:
    import torch.nn.functional as F
    from torchtitan.models.common.attention import FlexAttention

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, score_mod=None, scale=None,
                enable_gqa=False, out_transform=None, **kwargs):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("the CPU FlexAttention shim runs causal SDPA only (no score_mod, "
                                      "no out_transform)")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    FlexAttention.forward = forward


def enable_torchtitan_cpu() -> None:
    """Install the shims (idempotent); call before building a torchtitan model."""
    global _done
    if _done:
        return
    _stub_ep_kernels()
    _cpu_meshes()
    _causal_sdpa()
    _done = True


def sum_reduction_for_gloo(model) -> None:
    """FSDP2 on gloo with ``dp_shard > 1``: reduce gradients with SUM (then divide) instead of
    ``PREMUL_SUM``, which gloo refuses. Call after ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)

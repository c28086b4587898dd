"""Run megatron-core's MoE layers and token dispatchers on CPU ranks (gloo): for ``regather bench
--moe`` and the tests.

Beside :func:`regather.tools.cpu.megatron_cpu.enable_megatron_cpu` (docs/design.md §6), megatron's MoE code
needs three more run-time shims on a machine without CUDA (docs/design.md §9, measured on both
pinned versions). Neither changes what a layer computes:

1. **The alltoall dispatcher's device-to-host copies.** ``MoEAlltoAllTokenDispatcher``
   creates a class-wide ``torch.cuda.Stream()`` in ``__init__`` (RuntimeError without
   CUDA) and, in ``_maybe_dtoh_and_synchronize``, copies the split sizes to the host on it
   with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which returns a CPU tensor
   unchanged: ``all_to_all_single`` then gets tensors as split sizes (TypeError). On CUDA
   those split sizes arrive as numpy arrays. The shim puts a placeholder in the class
   attribute (so no stream is made) and replaces ``_maybe_dtoh_and_synchronize`` with its
   CPU form: at the dispatcher's copy point the same three split-size fields become numpy
   arrays, exactly what the CUDA path hands to the collective; there is nothing to
   synchronise on the host.
2. **Uneven first-dimension collectives over expert TP.** With EP > 1 and expert TP > 1 the
   alltoall dispatcher gathers the tokens of the expert-TP ranks, which differ in number, with
   megatron's ``_gather_along_first_dim(..., output_split_sizes)`` (``torch.distributed.
   all_gather`` into a list of uneven tensors) and reduce-scatters them back with
   ``_reduce_scatter_along_first_dim(..., input_split_sizes)``. NCCL takes uneven sizes; gloo
   raises ("invalid tensor size"). On a gloo group the shim runs the same collectives on blocks
   padded to the largest size (``all_gather_into_tensor`` / ``reduce_scatter_tensor``) and keeps
   each rank's rows: the same values, the padding never read. Even sizes and NCCL groups go
   to megatron's own code.
3. **megatron-core 0.16.1's router GEMM.** ``moe_utils`` imports ``te_general_gemm`` from
   Transformer Engine and, without TE, leaves the name undefined; the router's gating
   (``router_gating_linear``) reads it (NameError). The shim defines it as ``None``, the
   value 0.19.2 itself sets without TE, so the gating runs its torch GEMM.

The shims are idempotent and do nothing when CUDA is available.
"""

from __future__ import annotations

import torch

_ENABLED = False
_STREAM_PLACEHOLDER = "regather.tools.cpu.moe_cpu: no CUDA stream on CPU"
_NUMPY_SPLITS = ("input_splits", "output_splits", "output_splits_tp")


def enable_moe_cpu() -> bool:
    """Apply the MoE CPU shims once (after :func:`enable_megatron_cpu`). True when applied."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    _patch_alltoall_dispatcher()
    _patch_uneven_collectives()
    _define_te_general_gemm()
    _ENABLED = True
    return True


def _patch_alltoall_dispatcher() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _STREAM_PLACEHOLDER

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in _NUMPY_SPLITS:  # as_numpy=True in megatron's CUDA path
                value = getattr(self, name, None)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    _maybe_dtoh_and_synchronize._regather_cpu = True
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize


def _uneven(group, sizes) -> bool:
    import torch.distributed as dist

    return sizes is not None and len({int(n) for n in sizes}) > 1 and dist.get_backend(group) == "gloo"


def _padded_blocks(t: torch.Tensor, sizes, width: int) -> torch.Tensor:
    out = t.new_zeros((len(sizes) * width,) + tuple(t.shape[1:]))
    start = 0
    for i, n in enumerate(sizes):
        out[i * width:i * width + n] = t[start:start + n]
        start += n
    return out


def _patch_uneven_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "_regather_cpu", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not _uneven(group, output_split_sizes):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        width = max(sizes)
        mine = _padded_blocks(input_.contiguous(), [input_.shape[0]], width)
        blocks = input_.new_empty((len(sizes) * width,) + tuple(input_.shape[1:]))
        dist.all_gather_into_tensor(blocks, mine, group=group)
        return torch.cat([blocks[i * width:i * width + n] for i, n in enumerate(sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not _uneven(group, input_split_sizes):
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        width = max(sizes)
        out = input_.new_empty((width,) + tuple(input_.shape[1:]))
        dist.reduce_scatter_tensor(out, _padded_blocks(input_.contiguous(), sizes, width), group=group)
        return out[:sizes[group.rank()]].clone()

    _gather_along_first_dim._regather_cpu = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


def _define_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

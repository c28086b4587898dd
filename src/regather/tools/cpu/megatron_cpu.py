"""Run megatron-core's tensor + sequence parallel GPT on CPU ranks (gloo).

megatron-core assumes CUDA in four places that matter for a small TP + CP + SP GPT
(docs/design.md §6). :func:`enable_megatron_cpu` patches them at run time:

1. ``torch.cuda.current_device()`` returns ``"cpu"``: megatron allocates its
   communication outputs and scratch buffers with ``device=current_device()``.
2. The model-parallel RNG tracker keeps CPU generator states instead of CUDA
   ones (dropout always forks the tracker, even at p=0), and activation
   recompute saves/restores the CPU generator where it would use the CUDA one.
3. ``WrappedTorchNorm`` (the local spec's LayerNorm) refuses sequence
   parallelism. We build it with SP off and tag its parameters
   ``sequence_parallel=True``; their gradients are TP-partial, and
   :func:`allreduce_sequence_parallel_grads` sums them over the TP group as
   megatron's ``finalize_model_grads`` does.
4. Context parallelism: ``get_pos_emb_on_this_cp_rank`` (``rope_utils.py``, 0.16.1 and
   0.19.2:48-70) builds its chunk index in pinned memory and moves it with ``.cuda()``; the CPU one
   builds it on CPU and selects the same chunks (``r`` and ``2·cp − 1 − r``).

The patches are idempotent and do nothing when CUDA is available.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

_ENABLED = False


def enable_megatron_cpu() -> bool:
    """Apply the CPU patches once. Returns True when they are (or were) applied."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    _patch_current_device()
    _patch_rng_tracker()
    patch_torch_norm()
    _patch_cp_rotary()
    _ENABLED = True
    return True


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    # Activation checkpointing (recompute) saves and restores the "CUDA" generator state
    # through these two helpers (0.16 and 0.19); on CPU that generator is the CPU one.
    mrandom._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # model_parallel_cuda_manual_seed seeds the CUDA default generator first.
    _orig_seed = mrandom.model_parallel_cuda_manual_seed

    def model_parallel_cuda_manual_seed(seed, *args, **kwargs):
        torch.manual_seed(seed)
        return _orig_seed(seed, *args, **kwargs)

    mrandom.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


def _patch_cp_rotary() -> None:
    """Patch 4: the rotary embedding's context-parallel chunks selected on CPU (module doc)."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def patch_torch_norm() -> None:
    """Patch 3: ``WrappedTorchNorm`` built with SP off, its parameters tagged ``sequence_parallel``.
    Idempotent; a GPU run without apex / TE needs it too (:func:`enable_megatron_cpu` does nothing there)."""
    from megatron.core.transformer import torch_norm

    orig_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(orig_new, "_regather_cpu", False):
        return

    def __new__(cls, config, hidden_size, *args, **kwargs):
        sp = config.sequence_parallel
        if sp:
            config = dataclasses.replace(config, sequence_parallel=False)
        norm = orig_new(cls, config, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    __new__._regather_cpu = True
    torch_norm.WrappedTorchNorm.__new__ = __new__


def allreduce_sequence_parallel_grads(model: torch.nn.Module, group=None) -> None:
    """Sum the TP-partial gradients of parameters tagged ``sequence_parallel``.

    megatron's ``finalize_model_grads`` does this for DDP-wrapped models; plain
    training loops on CPU call this after backward. Reads ``.grad`` or, when the
    parameter has one, ``.main_grad``.
    """
    from megatron.core import parallel_state

    group = group or parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return
    for p in model.parameters():
        if not (p.requires_grad and getattr(p, "sequence_parallel", False)):
            continue
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is not None:
            torch.distributed.all_reduce(grad, group=group)

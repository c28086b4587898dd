"""The adapter's weights: initialisation, the holders megatron's DDP and checkpoints expect,
and the LoRA-A layout a state dict is written and read in.

- :func:`init_weight_` — Megatron Bridge's LoRA initialisers, on a full (unsharded) master
  weight, so every TP size starts from the same adapter;
- :class:`ShardedWeight` — owns one weight shard and is *called* to read it (see there);
- :func:`save_sharded_lora_a` / :func:`load_lora_a` — state-dict hooks: a checkpoint always holds
  the sharded (Bridge) layout ``A_i [r/t, h]``; a replicated low-rank LoRA-A writes its rank's
  rows and, on load, all-gathers the shards (a collective for ``t > 1``); a full ``[r, h]`` tensor
  loads into every layout;
- :func:`validate` — the constructor's argument checks, before anything is built.
"""

from __future__ import annotations

import math

import torch
from torch import nn

INIT_METHODS = ("xavier", "normal", "kaiming", "zero")
DROPOUT_POSITIONS = ("pre", "post")
LORA_A_KEY = "linear_in.weight"


def init_weight_(weight: torch.Tensor, method: str) -> torch.Tensor:
    """Bridge's LoRA initialisers, applied to a full (unsharded) master weight."""
    if method == "xavier":
        return nn.init.xavier_normal_(weight)
    if method == "normal":
        return nn.init.normal_(weight, mean=0.0, std=0.2)
    if method == "kaiming":
        return nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if method == "zero":
        return nn.init.zeros_(weight)
    raise ValueError(f"unknown init method {method!r}; expected one of {', '.join(INIT_METHODS)}")


class ShardedWeight(nn.Module):
    """Owns one LoRA weight shard (``linear_in`` / ``linear_out``), the way megatron's
    linears own theirs.

    * The parameter is tagged as megatron tags tensor-parallel parameters.
    * The adapter reads it by *calling* the module (``self.linear_in()``), never as a bare
      attribute: megatron DDP with ``overlap_param_gather`` finishes a bucket's parameter
      all-gather in forward pre-hooks registered on every module, for the parameters the
      module owns directly (``module.parameters(recurse=False)``,
      ``DistributedDataParallel._make_forward_pre_hook``). A holder that is never called
      would be read before its all-gather finished, and DP replicas would diverge.
    * ``_extra_state`` (``None``) as megatron's ``ColumnParallelLinear`` /
      ``RowParallelLinear`` write it, so state dicts of Megatron Bridge's adapters (whose
      ``linear_in`` / ``linear_out`` are megatron linears) load with ``strict=True``.
      A state dict without it (regather 0.1) loads too: the value is always ``None``.
    """

    def __init__(self, master: torch.Tensor, partition_dim: int, rank: int, tp: int):
        super().__init__()
        shard = master.chunk(tp, dim=partition_dim)[rank].contiguous()
        self.weight = nn.Parameter(shard)
        self.weight.tensor_model_parallel = tp > 1
        self.weight.partition_dim = partition_dim
        self.weight.partition_stride = 1
        self._register_load_state_dict_pre_hook(_default_extra_state)

    def forward(self) -> nn.Parameter:
        return self.weight

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state) -> None:
        """Ignored, as in megatron's linears."""


def _default_extra_state(state_dict, prefix, *args):
    state_dict.setdefault(prefix + "_extra_state", None)


def save_sharded_lora_a(module, state_dict, prefix, local_metadata):
    """``state_dict`` hook: write a replicated LoRA-A as this rank's rows (the Bridge layout)."""
    key = prefix + LORA_A_KEY
    if module.replicated_a and key in state_dict:
        state_dict[key] = state_dict[key][module.lora_a_rows()].clone()
    return state_dict


def load_lora_a(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """``load_state_dict`` pre-hook: convert a stored LoRA-A (rank shard or full ``[r, h]``) to
    this adapter's layout."""
    key = prefix + LORA_A_KEY
    if key not in state_dict or not module.column_parallel or module.tp_size == 1:
        return
    stored, r, t = state_dict[key], module.rank, module.tp_size
    if stored.dim() != 2 or stored.shape[0] not in (r, r // t):
        return  # let load_state_dict report the size mismatch
    if module.replicated_a and stored.shape[0] == r // t:
        state_dict[key] = module.full_lora_a(stored.to(module.linear_in.weight.device))
    elif not module.replicated_a and stored.shape[0] == r and r != r // t:
        state_dict[key] = stored[module.lora_a_rows()].clone()


def group_size_rank(group) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` without an initialised process group."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        if group is not None:
            raise RuntimeError("a TP group was given but torch.distributed is not initialised")
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def validate(in_features, out_features, dim, dropout, dropout_position, column_parallel, tp,
             a_init, b_init, activation, activations) -> None:
    """The adapter's arguments, checked before anything is built (``activations``: the names
    the forward accepts)."""
    if not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"LoRA dim must be a positive integer, got {dim!r}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if dropout_position not in DROPOUT_POSITIONS:
        raise ValueError(f"dropout_position must be one of {DROPOUT_POSITIONS}, got {dropout_position!r}")
    for name, method in (("lora_A_init_method", a_init), ("lora_B_init_method", b_init)):
        if method not in INIT_METHODS:
            raise ValueError(f"{name} must be one of {INIT_METHODS}, got {method!r}")
    if activation not in activations:
        raise ValueError(f"adapter activation must be one of {tuple(activations)}, got {activation!r}")
    if column_parallel and dim % tp:
        raise ValueError(f"LoRA dim {dim} is not divisible by the tensor-parallel size {tp} "
                         "(LoRA-A of a column-parallel base is sharded over the rank)")
    if not column_parallel and in_features % tp:
        raise ValueError(f"in_features {in_features} is not divisible by the tensor-parallel size {tp}")
    if out_features % tp:
        raise ValueError(f"out_features {out_features} is not divisible by the tensor-parallel size {tp}")

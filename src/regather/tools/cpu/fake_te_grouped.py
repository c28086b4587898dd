"""CPU stand-ins for megatron's Transformer Engine grouped expert linears (``regather bench --moe
--experts grouped`` and the tests).

megatron builds grouped experts (``moe_grouped_gemm=True``, the TE spec) as ``TEGroupedMLP``
whose ``linear_fc1`` / ``linear_fc2`` are ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` (``megatron.core.extensions.transformer_engine``, defined only
when TE imports). TE cannot be installed on CPU, so these classes carry what megatron's
wrappers expose (megatron-core 0.16.1 and 0.19.2) and nothing else:

- constructor ``(num_gemms, input_size, output_size, *, config, init_method, bias,
  skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection[, name])`` (``name``: 0.19); ``forward(x, m_splits)``
  returning ``(out, None)`` (``(out, bias)`` with ``skip_bias_add``), one GEMM per local
  expert over its ``m_splits[i]`` consecutive rows;
- ``weight0 .. weight{n-1}`` (``bias{i}``), ``num_gemms``, ``use_bias``, ``te_return_bias``,
  ``config``, ``_pg_collection``, ``_tp_group`` (the expert-TP group);
- with ``explicit_expert_comm`` (expert TP > 1 or EP > 1) TE is made agnostic of model
  parallelism exactly as megatron does it: ``in_features`` / ``out_features`` are this
  rank's (the split dimension divided by expert TP), ``parallel_mode=None``, ``tp_size=1``,
  ``tp_group=None``, and no TP attributes on the weights (TE sets them only for
  ``parallel_mode`` column/row; 0.19.2 adds them back afterwards, which nothing here reads);
  the token dispatcher does every collective;
- ``allreduce = not (is_expert and expert_parallel)`` on every parameter (expert DDP
  buffers), ``sharded_state_dict`` with megatron's grouped keys (``weight{i}`` declared
  as global expert ``ep_rank * n + i``, the TP axis of its kind, replica ids along expert DP).

Weights are initialised from megatron's ``init_method`` on the CPU master weight and split,
as megatron's CPU initialisation does. Frozen weights keep no input for backward (torch's
``matmul`` saves its input only for the weight's gradient), as TE's grouped GEMM.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def _merge_extra_states(module, state_dict, prefix, *unused) -> None:
    """megatron's ``TEGroupedLinear`` load pre-hook: a distributed checkpoint holds one
    ``_extra_state{i}`` per GEMM (its ``sharded_state_dict`` declares them), the module one
    ``_extra_state``; megatron pops ``_extra_state1 ..`` and merges their fp8 metadata into it (none
    on CPU: popped only, as megatron does when ``_extra_state`` carries nothing)."""
    for i in range(1, module.num_gemms):
        state_dict.pop(f"{prefix}_extra_state{i}", None)


class TEGroupedLinear(nn.Module):
    """Stand-in for megatron's ``TEGroupedLinear`` (see the module doc)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode, config,
                 init_method, bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__()
        from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection

        if not is_expert:
            raise AssertionError("TEGroupedLinear only supports expert parallelism")
        self.config = config
        self.num_gemms = num_gemms
        self.te_return_bias = skip_bias_add and bias
        self.use_bias = bias
        self.expert_parallel = config.expert_model_parallel_size > 1
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        tp_size = self._tp_group.size()
        tp_rank = self._tp_group.rank()
        self.explicit_expert_comm = is_expert and (tp_size > 1 or self.expert_parallel)
        full_in, full_out = input_size, output_size
        split_dim = 0 if parallel_mode == "column" else 1
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size //= tp_size
            elif parallel_mode == "row":
                input_size //= tp_size
            parallel_mode, self.tp_size, self.tp_group = None, 1, None
        else:
            self.tp_size, self.tp_group = tp_size, self._tp_group
        self.parallel_mode = parallel_mode
        self.in_features, self.out_features = input_size, output_size
        self.sequence_parallel = config.sequence_parallel
        for i in range(num_gemms):
            master = torch.empty(full_out, full_in, dtype=torch.float32)
            init_method(master)
            shard = master.chunk(tp_size, dim=split_dim)[tp_rank] if tp_size > 1 else master
            w = nn.Parameter(shard.to(config.params_dtype).contiguous())
            if parallel_mode in ("column", "row"):  # TE tags TP weights only in these modes
                w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, split_dim, 1
            setattr(self, f"weight{i}", w)
            if bias:
                setattr(self, f"bias{i}", nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)))
        for p in self.parameters():
            p.allreduce = not (is_expert and self.expert_parallel)
        self._register_load_state_dict_pre_hook(_merge_extra_states, with_module=True)

    def forward(self, x: torch.Tensor, m_splits):
        splits = [int(m) for m in (m_splits.tolist() if torch.is_tensor(m_splits) else m_splits)]
        if sum(splits) != x.shape[0] or len(splits) != self.num_gemms:
            raise ValueError(f"m_splits {splits} do not split {x.shape[0]} rows into {self.num_gemms} GEMMs")
        outs = []
        for i, part in enumerate(torch.split(x, splits)):
            y = torch.matmul(part, getattr(self, f"weight{i}").t())
            if self.use_bias and not self.te_return_bias:
                y = y + getattr(self, f"bias{i}")
            outs.append(y)
        out = torch.cat(outs) if outs else x.new_empty(0, self.out_features)
        if self.te_return_bias:
            return out, torch.stack([getattr(self, f"bias{i}") for i in range(self.num_gemms)])
        return out, None

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        """TE's fp8 metadata: none on CPU."""

    def backward_dw(self) -> None:
        """megatron's delayed wgrad hook: nothing is delayed here."""

    def _tp_axis(self) -> int:
        raise NotImplementedError

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron's ``TEGroupedLinear._sharded_state_dict_grouped``: ``weight{i}`` as global
        expert ``ep_rank * n + i`` (an expert axis before the weight's), split on this kind's TP
        axis over the expert-TP group, replica ids along expert DP."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        ep = self._pg_collection.ep
        n_global, offset = ep.size() * self.num_gemms, ep.rank() * self.num_gemms
        out = {}
        for i in range(self.num_gemms):
            local = {f"{i}.weight": getattr(self, f"weight{i}"), f"{i}._extra_state": None}
            axes = {f"{i}.weight": self._tp_axis()}
            if self.use_bias:
                local[f"{i}.bias"] = getattr(self, f"bias{i}")
                if self._tp_axis() == 0:  # column: bias split like the output rows; row: replicated
                    axes[f"{i}.bias"] = 0
            expert_offset = (len(sharded_offsets), offset + i, n_global)
            sub = make_sharded_tensors_for_checkpoint(local, "", axes, (*sharded_offsets, expert_offset),
                                                      tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        edp = self._pg_collection.expt_dp.rank()
        for value in out.values():
            value.replica_id = (*value.replica_id[:2], edp)
        return out


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """Stand-in for megatron's ``TEColumnParallelGroupedLinear`` (expert ``linear_fc1``)."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection)

    def _tp_axis(self) -> int:
        return 0


class TERowParallelGroupedLinear(TEGroupedLinear):
    """Stand-in for megatron's ``TERowParallelGroupedLinear`` (expert ``linear_fc2``)."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection)

    def _tp_axis(self) -> int:
        return 1


def _builds(spec, cls) -> bool:
    """A megatron spec entry that builds ``cls``: a ``ModuleSpec`` (0.16) or a ``partial`` (0.19)."""
    return getattr(spec, "module", None) is cls or getattr(spec, "func", None) is cls


def grouped_moe_spec(layer_spec, num_experts: int):
    """A copy of a local-spec MoE layer spec whose experts are ``TEGroupedMLP`` on the stand-ins:
    megatron's own ``get_moe_module_spec_for_backend`` (the TE spec's MoE structure) with a
    backend that hands out the stand-in grouped linears. Other layers are returned unchanged."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not _builds(layer_spec.submodules.mlp, MoELayer):
        return layer_spec

    class GroupedStandIns(LocalSpecProvider):
        def grouped_mlp_modules(self, *args):
            local = super().grouped_mlp_modules(*args)  # the version's form: (cls, subs) or a partial
            subs = MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear)
            if isinstance(local, tuple):
                return TEGroupedMLP, subs
            return type(local)(TEGroupedMLP, submodules=subs)

    spec = copy.deepcopy(layer_spec)
    spec.submodules.mlp = get_moe_module_spec_for_backend(backend=GroupedStandIns(), num_experts=num_experts,
                                                          moe_grouped_gemm=True)
    return spec

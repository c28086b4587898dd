"""megatron-core's Transformer Engine linears (``megatron.core.extensions.transformer_engine``,
0.16.1 and 0.19.2) over the model's autograd Functions: the classes the adapters meet.

- the class names and megatron's constructors (``input_size, output_size, *, config, init_method,
  gather_output / input_is_parallel, bias, skip_bias_add, is_expert, ..., tp_comm_buffer_name,
  tp_group[, stride, name]``), megatron's ``te_return_bias`` and return forms (``(out, None)``, or
  TE's tuple with ``te_return_bias``), megatron's ``_tp_group``;
- TE's attributes: per-rank ``in_features`` / ``out_features``, ``parallel_mode``, ``tp_size``,
  ``tp_group``, ``sequence_parallel = tp_size > 1 and config.sequence_parallel``, ``return_bias``,
  ``use_bias`` / ``apply_bias``, ``eps``, ``normalization``, ``zero_centered_gamma``,
  ``layer_norm_weight`` / ``layer_norm_bias`` (ones / zeros; zeros with zero-centered gamma),
  ``return_layernorm_output`` / ``return_layernorm_output_gathered`` (read on every forward),
  ``fsdp_group`` (None), the userbuffers flags (all False), ``fp8`` (False);
- ``weight_names`` (``["weight"]``: TE's list of the weights its forward concatenates, LL 2.20.2:1486-1506);
- TE's ``prepare_forward`` (``module/base.py``): the activation dtype (torch's autocast dtype under
  autocast — the CPU one stands for TE's GPU autocast here — else the input's, which must match the
  parameters', 2.20.2:1482-1499) and ``inp.contiguous()`` of a non-contiguous input (1639-1640);
- TE's module forward (``LayerNormLinear.forward``, 2.20.2:1675-1836): the autograd Function under
  grad, its ``forward`` with no ``ctx`` without; ``(out, ln_out)`` / ``(out, bias, ln_out)``.

Weights are initialised as megatron does with ``use_cpu_initialization`` (the full master weight,
split), so models of different TP sizes start from the same parameters. Settings the model does not
implement (fp8, userbuffers, delayed wgrad, gradient-accumulation fusion) raise at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.harness.te_model import comm
from tests.harness.te_model.behaviour import Behaviour, active
from tests.harness.te_model.layernorm_linear import LayerNormLinearFunction, LNLinearArgs
from tests.harness.te_model.linear import LinearArgs, LinearFunction


def _refuse_unmodelled(config, what: str) -> None:
    for flag in ("fp8", "tp_comm_overlap", "delay_wgrad_compute", "gradient_accumulation_fusion"):
        if getattr(config, flag, None):
            raise NotImplementedError(f"TE model ({what}): config.{flag}={getattr(config, flag)!r} is not modelled")


def _tp(tp_group):
    """megatron's TP group when none is given (``get_tensor_model_parallel_group_if_none``)."""
    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    return tp_group


def _rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


class _TEBase(nn.Module):
    """What every TE module has (TE's ``TransformerEngineBaseModule`` attributes the adapters read)."""

    def _setup(self, config, tp_group, parallel_mode, input_size, output_size, bias, skip_bias_add,
               behaviour: Behaviour | None):
        _refuse_unmodelled(config, type(self).__name__)
        self.config = config
        self._tp_group = tp_group = _tp(tp_group)
        self.tp_group = tp_group
        self.tp_size = comm.size(tp_group)
        self.tp_rank = _rank(tp_group)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = self.tp_size > 1 and bool(config.sequence_parallel)
        self.te_return_bias = bool(skip_bias_add and bias)
        self.return_bias = self.te_return_bias
        self.use_bias = bool(bias)
        self.apply_bias = self.use_bias and not self.return_bias
        self.fsdp_group = None
        self.fp8 = False
        for flag in ("ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad", "ub_overlap_rs_dgrad",
                     "ub_bulk_wgrad", "ub_bulk_dgrad"):
            setattr(self, flag, False)
        self.behaviour = behaviour or active()
        self.weight_names = ["weight"]
        t = self.tp_size
        self.in_features = input_size // t if parallel_mode == "row" else input_size
        self.out_features = output_size // t if parallel_mode == "column" else output_size

    def _init_weight(self, input_size, output_size, init_method, stride=1):
        dtype = self.config.params_dtype
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype))
        if getattr(self.config, "use_cpu_initialization", False):
            from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

            axis = 0 if self.parallel_mode == "column" else 1
            per = self.out_features if axis == 0 else self.in_features
            _initialize_affine_weight_cpu(self.weight, output_size, input_size, per, axis, init_method=init_method,
                                          stride=stride, return_master_weight=False, rank=self.tp_rank,
                                          world_size=self.tp_size, skip_set_tensor_parallel_attributes=True)
        else:
            init_method(self.weight)
        size = self.out_features if self.parallel_mode == "column" else output_size
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype)) if self.use_bias else None

    def prepare_forward(self, inp: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """TE's ``prepare_forward`` as far as the model goes: ``(input, activation dtype)`` (module doc)."""
        if torch.is_autocast_enabled("cpu"):  # TE: torch.is_autocast_enabled() (its GPU autocast)
            dtype = torch.get_autocast_dtype("cpu")
        else:
            dtype = inp.dtype
            wrong = [(n, p.dtype) for n, p in self.named_parameters() if p.dtype != dtype]
            if wrong:
                raise TypeError("Data types for parameters must match when outside of autocasted region. "
                                f"Found input dtype: {dtype} and {wrong[0][0]!r} dtype: {wrong[0][1]}")
        if not inp.is_contiguous():
            inp = inp.contiguous()
        return inp, dtype

    def _megatron_return(self, out):
        """megatron's wrapper: TE's tuple with ``te_return_bias``, else ``(out, None)``."""
        return out if self.te_return_bias else (out, None)


class TELayerNormColumnParallelLinear(_TEBase):
    """megatron's ``TELayerNormColumnParallelLinear`` on :class:`LayerNormLinearFunction`."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool,
                 bias: bool, skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, stride: int = 1, name: str | None = None,
                 behaviour: Behaviour | None = None):
        super().__init__()
        if gather_output or is_expert or skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers do not support gather_output / is_expert / "
                             "skip_weight_param_allocation (megatron's TELayerNormColumnParallelLinear)")
        self._setup(config, tp_group, "column", input_size, output_size, bias, skip_bias_add, behaviour)
        self.eps = config.layernorm_epsilon
        self.normalization = config.normalization
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.return_layernorm_output = False
        self.return_layernorm_output_gathered = False
        dtype = config.params_dtype
        gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = nn.Parameter(gamma(input_size, dtype=dtype))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(input_size, dtype=dtype))
                                if self.normalization != "RMSNorm" else None)
        self._init_weight(input_size, output_size, init_method, stride)

    def forward(self, x):
        grad = torch.is_grad_enabled()
        x, dtype = self.prepare_forward(x)
        args = LNLinearArgs(
            eps=self.eps, tp_group=self.tp_group, tp_size=self.tp_size, sequence_parallel=self.sequence_parallel,
            parallel_mode=self.parallel_mode, return_layernorm_output=self.return_layernorm_output,
            return_layernorm_output_gathered=self.return_layernorm_output_gathered, is_grad_enabled=grad,
            zero_centered_gamma=self.zero_centered_gamma, normalization=self.normalization,
            behaviour=self.behaviour, activation_dtype=dtype)
        bias = self.bias if self.apply_bias else None
        fn = LayerNormLinearFunction.apply if grad else (lambda *a: LayerNormLinearFunction.forward(None, *a))
        out, ln_out = fn(x, self.layer_norm_weight, self.layer_norm_bias, self.weight, bias, args)
        if self.return_bias:  # TE's LayerNormLinear.forward, 2.20.2:1830-1836
            te_out = (out, self.bias, ln_out) if self.return_layernorm_output else (out, self.bias)
        else:
            te_out = (out, ln_out) if self.return_layernorm_output else out
        return self._megatron_return(te_out)


class _TELinear(_TEBase):
    def forward(self, x):
        grad = torch.is_grad_enabled()
        x, dtype = self.prepare_forward(x)
        args = LinearArgs(tp_group=self.tp_group, tp_size=self.tp_size, sequence_parallel=self.sequence_parallel,
                          parallel_mode=self.parallel_mode, is_grad_enabled=grad, activation_dtype=dtype)
        bias = self.bias if self.apply_bias else None
        out = (LinearFunction.apply if grad else (lambda *a: LinearFunction.forward(None, *a)))(x, self.weight, bias,
                                                                                              args)
        return self._megatron_return((out, self.bias) if self.return_bias else out)


class TEColumnParallelLinear(_TELinear):
    """megatron's ``TEColumnParallelLinear`` (input: a LayerNorm output, sequence shard under SP)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, stride: int = 1, name: str | None = None,
                 behaviour: Behaviour | None = None):
        super().__init__()
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        self._setup(config, tp_group, "column", input_size, output_size, bias, skip_bias_add, behaviour)
        self._init_weight(input_size, output_size, init_method, stride)


class TERowParallelLinear(_TELinear):
    """megatron's ``TERowParallelLinear`` (input split over hidden; output reduce-scattered under SP)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 tp_group=None, name: str | None = None, behaviour: Behaviour | None = None):
        super().__init__()
        if not input_is_parallel:
            raise ValueError("Transformer Engine linear layers do not support input_is_parallel = False")
        self._setup(config, tp_group, "row", input_size, output_size, bias, skip_bias_add, behaviour)
        self._init_weight(input_size, output_size, init_method)

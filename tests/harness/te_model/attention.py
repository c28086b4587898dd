"""megatron's ``TEDotProductAttention`` over a model of TE's ``DotProductAttention`` (FusedAttention
backend, high precision): the core attention of megatron's TE spec, with context parallelism.

- **megatron's wrapper** (``megatron/core/extensions/transformer_engine.py``, 0.16.1:1140-1434, the same
  in 0.19.2 but for the packed fields it drops): the constructor megatron's ``SelfAttention`` calls
  (``config, layer_number, attn_mask_type, attention_type, ..., cp_comm_type, pg_collection``); with
  ``context_parallel_size > 1`` the CP group, its global ranks, a CP stream and ``cp_comm_type`` (None:
  ``"p2p"``) go to TE (0.16.1:1228-1253). On CPU there is no stream: ``cp_stream`` is None. ``forward``
  passes the fields of ``packed_seq_params`` TE takes (0.16.1:1290-1307, 1345-1377; 0.19.2 also drops
  ``total_tokens``, ``seq_idx``, ``tokens_per_sample``) and turns ``causal`` into ``padding_causal`` for THD
  (0.16.1:1397-1404).
- **TE's module** (``dot_product_attention.py`` v2.18): sbhd's ``max_seqlen`` is the local length times
  ``cp`` (v2.18:1449-1475); THD's padded offsets default to ``cu_seqlens`` (``backends.py``
  v2.18:2117-2120); with CP, q / k / v are made contiguous and ``attn_forward_func_with_cp`` runs
  (``backends.py`` v2.18:2151-2198, :mod:`.context_parallel`); without, ``FusedAttnFunc``
  (:class:`FusedAttnFunc`), whose ``get_qkv_layout`` makes megatron's q / k / v contiguous (``v`` is a
  strided view of the fused QKV output: no layout matches, ``utils.py`` v2.18:2440-2443). Either way
  the output handed back is ``out.view(..., h·d)`` (``backends.py`` v2.18:2254): **a view of the tensor
  TE saved** for its backward, so ``linear_proj``'s input shares that storage.

Not modelled, refused with the value: dropout in training, an attention bias, a sliding window, fp8,
THD with padding between sequences (``cu_seqlens_padded != cu_seqlens``), bshd.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tests.harness.te_model import comm
from tests.harness.te_model.attention_kernels import segment_ids, tile_backward, tile_forward, tile_mask
from tests.harness.te_model.context_parallel import CPArgs, attn_forward_func_with_cp


class FusedAttnFunc(torch.autograd.Function):
    """``backends.py`` ``FusedAttnFunc`` (v2.18:1304-1937), F16: saves ``q, k, v, out`` and the
    statistics (v2.18:1550, 1572-1581), recomputes the probabilities in backward."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, mask):
        out, lse = tile_forward(q, k, v, scale, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.mask = scale, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = tile_backward(q, k, v, out, dout.view(out.shape), lse, ctx.scale, ctx.mask)
        return dq, dk, dv, None, None


def _groups(pg_collection):
    if pg_collection is not None:
        return pg_collection.tp, pg_collection.cp
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_group(check_initialized=False),
            parallel_state.get_context_parallel_group(check_initialized=False))


class TEDotProductAttention(nn.Module):
    """megatron's ``TEDotProductAttention`` on the model (module doc)."""

    cp_stream = None  # megatron: a torch.cuda.Stream shared by every instance; no streams on CPU

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, num_splits: int | None = None,
                 cp_comm_type: str | None = "p2p", pg_collection=None):
        super().__init__()
        from megatron.core.packed_seq_params import PackedSeqParams

        self.config = config
        for flag in ("fp8", "fp8_dot_product_attention", "qk_clip", "log_max_attention_logit"):
            if getattr(config, flag, None):
                raise NotImplementedError(f"TE model (TEDotProductAttention): config.{flag}="
                                          f"{getattr(config, flag)!r} is not modelled")
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError(f"TE model: window_size={config.window_size!r} is not modelled")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"TE model: softmax_type={config.softmax_type!r} is not modelled")
        self.te_forward_mask_type = True
        self.qkv_format = "sbhd"
        self.num_splits = num_splits
        tp_group, cp_group = _groups(pg_collection)
        self._tp_group = tp_group
        self.attention_type = attention_type
        self.attn_mask_type = attn_mask_type.name
        self.layer_number = layer_number
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.num_attention_heads = config.num_attention_heads
        self.num_gqa_groups = config.num_query_groups
        self.hidden_size_per_attention_head = config.kv_channels if k_channels is None else k_channels
        self.cp_group = self.cp_global_ranks = None
        self.cp_comm_type = "p2p"
        if config.context_parallel_size > 1:  # 0.16.1:1228-1253
            import torch.distributed as dist

            self.set_context_parallel_group(cp_group, dist.get_process_group_ranks(cp_group),
                                            TEDotProductAttention.cp_stream,
                                            "p2p" if cp_comm_type is None else cp_comm_type)
        self.kept_packed_seq_params = {f.name for f in dataclasses.fields(PackedSeqParams)}
        self.kept_packed_seq_params -= {"total_tokens", "seq_idx", "tokens_per_sample"}  # 0.19.2: Mamba / MoE only

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """TE's ``DotProductAttention.set_context_parallel_group`` (v2.18:565-604)."""
        self.cp_group, self.cp_global_ranks, self.cp_stream = cp_group, cp_global_ranks, cp_stream
        self.cp_comm_type = cp_comm_type

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        """megatron's ``forward`` (0.16.1:1333-1434), then TE's (module doc)."""
        import torch.distributed as dist

        if packed_seq_params is not None:
            if packed_seq_params.cp_group is not None:
                self.set_context_parallel_group(packed_seq_params.cp_group,
                                                dist.get_process_group_ranks(packed_seq_params.cp_group),
                                                TEDotProductAttention.cp_stream, self.cp_comm_type)
            elif packed_seq_params.local_cp_size is not None:
                if packed_seq_params.local_cp_size != 1:
                    raise ValueError(f"local_cp_size={packed_seq_params.local_cp_size} must be 1 without a cp_group")
                self.set_context_parallel_group(None, None, None, self.cp_comm_type)
        packed = ({k: getattr(packed_seq_params, k) for k in self.kept_packed_seq_params - {"cp_group", "local_cp_size"}}
                  if packed_seq_params is not None else {})
        qkv_format = packed.get("qkv_format") or self.qkv_format
        if attention_bias is not None:
            raise NotImplementedError("TE model: an attention bias is not modelled")
        mask_type = attn_mask_type.name
        if qkv_format == "thd":  # 0.16.1:1397-1404
            mask_type = {"causal": "padding_causal", "no_mask": "padding"}.get(mask_type, mask_type)
        return self._te_forward(query, key, value, qkv_format, mask_type, packed)

    def _te_forward(self, q, k, v, qkv_format: str, mask_type: str, packed: dict):
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError(f"TE model: attention dropout {self.attention_dropout} in training is not modelled")
        if qkv_format not in ("sbhd", "thd"):
            raise NotImplementedError(f"TE model: qkv_format={qkv_format!r} is not modelled ('sbhd', 'thd')")
        cp = comm.size(self.cp_group) if self.cp_group is not None else 1
        causal = "causal" in mask_type
        cu = cu_padded = None
        if qkv_format == "thd":
            cu, cu_padded = self._thd_offsets(q, packed, cp)
        q, k, v = (x.contiguous() for x in (q, k, v))
        if qkv_format == "thd":  # the model runs THD as one batch row: [t, h, d] -> [t, 1, h, d]
            q, k, v = (x.unsqueeze(1) for x in (q, k, v))
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        if cp > 1:
            args = CPArgs(self.cp_group, tuple(self.cp_global_ranks), scale, causal, qkv_format, cu_padded)
            out = attn_forward_func_with_cp(q, k, v, args, self.cp_comm_type)
        else:
            seg = segment_ids(cu) if cu is not None else None
            out = FusedAttnFunc.apply(q, k, v, scale, tile_mask(q.shape[0], k.shape[0], causal, seg, seg))
        if qkv_format == "thd":
            out = out.squeeze(1)
        return out.view(*out.shape[:-2], -1)  # backends.py v2.18:2254

    @staticmethod
    def _thd_offsets(q, packed: dict, cp: int):
        cu, cu_kv = packed.get("cu_seqlens_q"), packed.get("cu_seqlens_kv")
        if cu is None or cu_kv is None:
            raise ValueError("TE: cu_seqlens_q and cu_seqlens_kv can not be None when qkv_format = thd")
        if cu.dtype != torch.int32 or cu.dim() != 1 or not torch.equal(cu, cu_kv):
            raise ValueError(f"TE model: THD self-attention needs one int32 cu_seqlens [n + 1] for q and kv "
                             f"(got {cu.dtype} {tuple(cu.shape)}, equal: {torch.equal(cu, cu_kv)})")
        if packed.get("pad_between_seqs"):
            raise NotImplementedError("TE model: pad_between_seqs=True is not modelled")
        padded = packed.get("cu_seqlens_q_padded")
        padded = cu if padded is None else padded
        if not torch.equal(padded, cu):
            raise NotImplementedError(f"TE model: padding between sequences (cu_seqlens {cu.tolist()}, "
                                      f"cu_seqlens_padded {padded.tolist()}) is not modelled")
        if int(padded[-1]) != q.shape[0] * cp:
            raise ValueError(f"THD: {q.shape[0]} tokens on this rank x cp {cp} != cu_seqlens_padded[-1] "
                             f"{int(padded[-1])}")
        return cu, padded

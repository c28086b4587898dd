"""Send rows the way megatron's token dispatcher sent this forward's tokens.

An expert ``linear_fc1`` reads the *dispatched* tokens: the MoE layer's input ``x [T, h]`` (``T``
local tokens, the router's input) permuted by expert, exchanged over the expert-parallel group
and gathered over expert TP. Any tensor with one row per local token can take the same route —
LoRA-A's rank-``r`` output (a shared LoRA-A commutes with the route, so it is computed before
it: :mod:`regather.core.strategies.predispatched`), or ``x`` itself again in backward (per-expert
LoRA-A: :mod:`regather.megatron.moe.inputs`). :class:`Route` captures one forward's routing from the
dispatcher and replays it with the dispatcher's own operations:

============= ========================================== =====================================
dispatcher    the route of a row block ``[T, w]``        what :class:`Route` holds
============= ========================================== =====================================
``alltoall``  permute by expert (``index_select`` on the the permutation indices, the EP and
              dispatcher's mapping) -> all-to-all over   expert-TP split sizes, the chunk
              EP -> all-gather over expert TP -> sort    sizes and order of the local experts
              chunks by local expert
``allgather`` all-gather over expert TP x EP -> permute  the permutation indices
              the rows of the local experts
============= ========================================== =====================================

Two ways to send, one route:

- :func:`send` — differentiable, in forward: megatron's own autograd collectives
  (``all_to_all``, ``gather_from_sequence_parallel_region``), so backward returns the rows'
  gradient through the reverse route (all-to-all back, reduce-scatter over expert TP — which sums
  expert-TP partial gradients — and the permutation's ``index_add``).
- :meth:`Route.start` / :meth:`Resend.wait` — in backward, no autograd: the exchange is issued
  asynchronously (:func:`regather.core.comm.all_to_all_rows` / ``all_gather_seq``, on the
  communication stream on CUDA) so it overlaps with whatever runs until the rows are needed.

Bytes: the unfused permutation is ``index_select`` with the dispatcher's own index tensor, which
megatron's permute already saved for its backward — sending rows in forward saves no new tensor;
the exchange and the chunk sort save none. Megatron's fused permute (``moe_permute_fusion``, TE)
recomputes its own row map instead (a few bytes per token and expert).

Routing is per forward: the dispatcher overwrites its split sizes and maps in every forward, so a
:class:`Route` keeps references to the forward's own (the dispatcher assigns new tensors, it does
not write into the old ones): the permutation indices, which megatron's permute saved for its own
backward (no new bytes), and the split sizes; the routing map only under the fused permute, which
reruns on it. Refused, with the reason (:func:`unsupported_reason`): the flex
dispatcher (DeepEP / HybridEP fuse permutation and exchange: nothing to replay), capacity
drop-and-pad, routing-map padding for quantization, and any other dispatcher class.
"""

from __future__ import annotations

import math

import torch

from regather.core import comm


def unsupported_reason(dispatcher, config) -> str | None:
    """Why this forward's routing cannot be replayed on other rows, or None."""
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    kind = type(dispatcher)
    if kind not in (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher):
        name = getattr(config, "moe_token_dispatcher_type", kind.__name__)
        return (f"the {name!r} token dispatcher ({kind.__name__}) fuses permutation and exchange "
                "(DeepEP / HybridEP): its route cannot be replayed on other rows")
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        return "capacity drop-and-pad (moe_pad_expert_input_to_capacity=True) pads each expert's tokens"
    if getattr(config, "moe_router_padding_for_quantization", False):
        return "the routing map is padded for quantization (moe_router_padding_for_quantization=True)"
    return None


class Route:
    """One forward's routing of ``T`` local rows to this rank's experts (see the module doc)."""

    def __init__(self, dispatcher, config):
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        d = dispatcher
        self.alltoall = isinstance(d, MoEAlltoAllTokenDispatcher)
        self.fused = bool(getattr(config, "moe_permute_fusion", False))
        # what a route holds until backward (re-dispatch): the permutation indices (megatron's permute
        # saved them for its backward: no new bytes) and split sizes; the routing map ([T, experts],
        # which nothing else keeps) only for the fused permute, which needs it
        self.mapping = d.reversed_local_input_permutation_mapping
        self.etp_group, self.etp = d.tp_group, d.tp_size
        if self.alltoall:
            self.routing_map = d.routing_map if self.fused else None
            self.num_out_tokens = d.num_out_tokens
            self.ep_group, self.ep = d.ep_group, d.ep_size
            self.in_splits, self.out_splits = d.input_splits, d.output_splits
            self.out_splits_etp = d.output_splits_tp
            self.n_local = d.num_local_experts
            self.chunks = d.num_global_tokens_per_local_expert
            self.chunk_order = d.sort_input_by_local_experts
        else:
            self.routing_map = d.local_map if self.fused else None
            self.num_out_tokens = None
            self.gather_group, self.ep = d.tp_ep_group, d.ep_size
        self.rows_in = math.prod(d.hidden_shape[:-1])  # T: the layer input [s/t, b, h] as rows

    # -- the three steps ------------------------------------------------------------------
    def _permute(self, rows: torch.Tensor) -> torch.Tensor:
        """The dispatcher's permutation: megatron's unfused ``permute`` is exactly this
        ``index_select`` on the indices it returned; the fused one is rerun on the same map."""
        if not self.fused:
            return rows.index_select(0, self.mapping)
        from megatron.core.transformer.moe.moe_utils import permute

        num_out = self.num_out_tokens if self.num_out_tokens is not None else int(self.routing_map.sum())
        return permute(rows, self.routing_map, num_out_tokens=num_out, fused=True)[0]

    def _finish(self, rows: torch.Tensor) -> torch.Tensor:
        """What follows the exchange: alltoall's gather over expert TP and chunk sort (autograd
        ops, so :func:`send` differentiates through them); allgather's permutation."""
        if not self.alltoall:
            return self._permute(rows)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

        if self.etp > 1:
            sizes = None if self.out_splits_etp is None else self.out_splits_etp.tolist()
            rows = gather_from_sequence_parallel_region(rows, group=self.etp_group, output_split_sizes=sizes)
        if self.n_local > 1:
            rows, _ = sort_chunks_by_idxs(rows, self.chunks.ravel(), self.chunk_order, fused=self.fused)
        return rows

    def _exchange_grad(self, rows: torch.Tensor) -> torch.Tensor:
        """The exchange through megatron's autograd collectives (backward: the reverse)."""
        from megatron.core.tensor_parallel.mappings import all_to_all, gather_from_sequence_parallel_region

        if self.alltoall:
            return all_to_all(self.ep_group, self._permute(rows), self.out_splits, self.in_splits)
        if self.etp > 1 or self.ep > 1:
            return gather_from_sequence_parallel_region(rows, group=self.gather_group)
        return rows

    # -- sending ----------------------------------------------------------------------------
    def start(self, rows: torch.Tensor) -> Resend:
        """Send ``rows`` again, no autograd: the exchange is issued asynchronously now, the rest
        runs in :meth:`Resend.wait`."""
        with torch.no_grad():
            if self.alltoall:
                if self.ep > 1:
                    pending = comm.all_to_all_rows(self._permute(rows), self.out_splits, self.in_splits,
                                                   self.ep_group, async_op=True)
                else:
                    pending = comm.Pending(self._permute(rows))
            elif self.etp > 1 or self.ep > 1:
                pending = comm.all_gather_seq(rows, self.gather_group, async_op=True)
            else:
                pending = comm.Pending(rows)
        return Resend(self, pending)

    def send(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [T, w]`` dispatched like this forward's tokens, differentiably (:func:`send`)."""
        return send(self, rows)

    def check_rows(self, rows: torch.Tensor) -> str | None:
        """Why ``rows`` cannot take this route (not one row per local token), or None."""
        if rows.dim() != 2 or rows.shape[0] != self.rows_in:
            return f"rows {tuple(rows.shape)} are not one per local token ({self.rows_in})"
        return None


class Resend:
    """Rows on their way along a :class:`Route` (backward); :meth:`wait` returns them dispatched."""

    __slots__ = ("pending", "route")

    def __init__(self, route: Route, pending):
        self.route, self.pending = route, pending

    def wait(self) -> torch.Tensor:
        rows = self.pending.wait()
        with torch.no_grad():
            return self.route._finish(rows)


def send(route: Route, rows: torch.Tensor) -> torch.Tensor:
    """``rows [T, w]`` dispatched like this forward's tokens, differentiably (see module doc)."""
    return route._finish(route._exchange_grad(rows))

"""Where bytes are sent: sequence-dimension collectives over the TP group.

Every collective regather issues goes through this module (one implementation
each, sync and async):

===================== ============================ ==============================
function              input (per rank)             output (per rank)
===================== ============================ ==============================
all_gather_seq        ``[s/t, ...]``               ``[s, ...]``
reduce_scatter_seq    ``[s, ...]`` (partial sums)  ``[s/t, ...]`` (summed shard)
all_reduce\\_          ``[...]`` (partial sums)     same tensor, summed in place
all_to_all_rows       ``[sum(in_splits), ...]``    ``[sum(out_splits), ...]``: block
                                                   ``i`` of the input to rank ``i``
===================== ============================ ==============================

With ``async_op=True`` each returns a :class:`Pending`; ``Pending.wait()``
returns the output once the *current* stream may read it.

CUDA: async collectives run on one dedicated communication stream per device.
Before launching, that stream waits on the compute stream (so it reads inputs
the compute stream produced); after launching, an event is recorded on it, and
``wait()`` makes the compute stream wait on that event. The host never blocks
and no device-wide synchronisation happens. The ``Pending`` keeps input and
output tensors referenced until ``wait()``: after that the compute stream is
ordered behind the collective, so the caching allocator may reuse the memory
(this is why we need no ``record_stream``).

CPU (gloo): ``async_op=True`` hands the collective to gloo's worker thread;
``wait()`` blocks the caller until it is done. The overlap with compute is real.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

_COMM_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def comm_stream(device: torch.device) -> "torch.cuda.Stream":
    """The communication stream of a CUDA device (created on first use)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _COMM_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)
        _COMM_STREAMS[device] = stream
    return stream


class Pending:
    """An issued asynchronous collective; ``wait()`` returns its output."""

    __slots__ = ("output", "_work", "_event", "_keepalive")

    def __init__(self, output: torch.Tensor, work=None, event=None, keepalive=()):
        self.output = output
        self._work = work
        self._event = event
        self._keepalive = keepalive

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            torch.cuda.current_stream(self.output.device).wait_event(self._event)
            self._event = None
        self._keepalive = ()
        return self.output

    @property
    def done(self) -> bool:
        return self._work is None and self._event is None


def _launch(op: Callable[[bool], object], output: torch.Tensor, inputs: tuple, async_op: bool):
    if not async_op:
        op(False)
        return output
    if output.device.type == "cuda":
        stream = comm_stream(output.device)
        stream.wait_stream(torch.cuda.current_stream(output.device))
        with torch.cuda.stream(stream):
            op(False)
            event = torch.cuda.Event()
            event.record(stream)
        return Pending(output, event=event, keepalive=inputs + (output,))
    return Pending(output, work=op(True), keepalive=inputs + (output,))


def world_size(group) -> int:
    return dist.get_world_size(group)


def all_gather_seq(
    inp: torch.Tensor,
    group,
    out: Optional[torch.Tensor] = None,
    async_op: bool = False,
):
    """Gather ``inp`` ``[s/t, ...]`` from every rank into ``[s, ...]`` (rank order).

    ``out`` may be a scratch buffer; it must not be read until the returned
    ``Pending`` is waited on.
    """
    t = world_size(group)
    inp = inp.contiguous()
    shape = (inp.shape[0] * t,) + tuple(inp.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=inp.dtype, device=inp.device)
    elif tuple(out.shape) != shape or out.dtype != inp.dtype:
        raise ValueError(
            f"all_gather_seq: output buffer {tuple(out.shape)} {out.dtype} does not match "
            f"input {tuple(inp.shape)} {inp.dtype} gathered over {t} ranks {shape}"
        )
    if t == 1:
        out.copy_(inp)
        return Pending(out) if async_op else out

    def op(a):
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=a)

    return _launch(op, out, (inp,), async_op)


def all_gather_dim(inp: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``inp`` along ``dim`` (rank order); synchronous.

    For weights and small metadata (state dicts, export, merge, debug checks);
    activations use :func:`all_gather_seq`. Works without an initialised
    process group (returns ``inp``).
    """
    if not dist.is_available() or not dist.is_initialized() or world_size(group) == 1:
        return inp
    dim = dim % inp.dim()
    gathered = all_gather_seq(inp.movedim(dim, 0), group)
    return gathered.movedim(0, dim).contiguous()


def reduce_scatter_seq(
    inp: torch.Tensor,
    group,
    out: Optional[torch.Tensor] = None,
    async_op: bool = False,
):
    """Sum ``inp`` ``[s, ...]`` over the ranks and keep this rank's ``[s/t, ...]`` shard."""
    t = world_size(group)
    if inp.shape[0] % t:
        raise ValueError(
            f"reduce_scatter_seq: first dimension {inp.shape[0]} is not divisible by "
            f"the group size {t}"
        )
    inp = inp.contiguous()
    shape = (inp.shape[0] // t,) + tuple(inp.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=inp.dtype, device=inp.device)
    if t == 1:
        out.copy_(inp)
        return Pending(out) if async_op else out

    def op(a):
        return dist.reduce_scatter_tensor(out, inp, group=group, async_op=a)

    return _launch(op, out, (inp,), async_op)


def all_reduce_(tensor: torch.Tensor, group, async_op: bool = False):
    """Sum ``tensor`` over the ranks, in place."""
    if not tensor.is_contiguous():
        raise ValueError("all_reduce_: the tensor must be contiguous (it is reduced in place)")
    if world_size(group) == 1:
        return Pending(tensor) if async_op else tensor

    def op(a):
        return dist.all_reduce(tensor, group=group, async_op=a)

    return _launch(op, tensor, (), async_op)


def all_to_all_rows(inp: torch.Tensor, out_splits, in_splits, group, async_op: bool = False):
    """Send row block ``i`` of ``inp`` (``in_splits[i]`` rows) to rank ``i``; receive ``out_splits[j]``
    rows from rank ``j``, in rank order (``torch.distributed.all_to_all_single``, as megatron's
    token dispatcher sends tokens; used to send them again, :mod:`regather.expert_dispatch`)."""
    out_splits = [int(n) for n in out_splits]
    in_splits = [int(n) for n in in_splits]
    if sum(in_splits) != inp.shape[0]:
        raise ValueError(f"all_to_all_rows: input splits {in_splits} do not add up to {inp.shape[0]} rows")
    inp = inp.contiguous()
    out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:]))
    if world_size(group) == 1:
        out.copy_(inp)
        return Pending(out) if async_op else out

    def op(a):
        return dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=group, async_op=a)

    return _launch(op, out, (inp,), async_op)

"""Where bytes are sent: sequence-dimension collectives over the TP group.

Every collective regather issues goes through this module (one implementation
each, sync and async). The sequence dimension is an argument (``dim``, default 0):
megatron-core lays activations out ``[s, b, h]`` (dim 0), PyTorch-native tensor parallelism
``[b, s, h]`` (dim 1).

===================== ============================ ==============================
function              input (per rank)             output (per rank)
===================== ============================ ==============================
all_gather_seq        ``s/t`` long on ``dim``      ``s`` long on ``dim`` (rank order)
reduce_scatter_seq    ``s`` long (partial sums)    ``s/t`` long (this rank's summed block)
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

Another ``dim`` than 0 with a leading extent above 1 (``[b, s/t, h]`` with ``b > 1``) moves
rank blocks as ``torch.distributed.tensor`` does: the collective runs on dim 0 of a
temporary and one copy puts the blocks in place (``cat`` of the rank chunks along ``dim``);
where every extent before ``dim`` is 1 the layouts coincide and no copy is made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_COMM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
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

    __slots__ = ("_event", "_finish", "_keepalive", "_work", "output")

    def __init__(self, output: torch.Tensor, work=None, event=None, keepalive=(), finish=None):
        self.output = output
        self._work = work
        self._event = event
        self._keepalive = keepalive
        self._finish = finish  # run once the collective is done (e.g. blocks copied into place)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            torch.cuda.current_stream(self.output.device).wait_event(self._event)
            self._event = None
        self._keepalive = ()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self.output = finish()
        return self.output

    @property
    def done(self) -> bool:
        return self._work is None and self._event is None


def _launch(op: Callable[[bool], object], output: torch.Tensor, inputs: tuple, async_op: bool, finish=None):
    """Run ``op`` (sync), or launch it and return a :class:`Pending`; ``finish()`` (on the
    compute stream, after the collective) returns the result, ``output`` when None."""
    if not async_op:
        op(False)
        return output if finish is None else finish()
    if output.device.type == "cuda":
        stream = comm_stream(output.device)
        stream.wait_stream(torch.cuda.current_stream(output.device))
        with torch.cuda.stream(stream):
            op(False)
            event = torch.cuda.Event()
            event.record(stream)
        return Pending(output, event=event, keepalive=inputs + (output,), finish=finish)
    return Pending(output, work=op(True), keepalive=inputs + (output,), finish=finish)


def _direct(shape, dim: int) -> bool:
    """Blocks along ``dim`` are contiguous row blocks: every extent before ``dim`` is 1."""
    return all(n == 1 for n in shape[:dim])


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` (contiguous, extents before ``dim`` all 1) as rows ``[n, ...]`` of its dim ``dim``."""
    return x.view(tuple(x.shape[dim:]))


def _seq_dim(inp: torch.Tensor, dim: int, what: str) -> int:
    if not -inp.dim() <= dim < inp.dim():
        raise ValueError(f"{what}: sequence dim {dim} is out of range for a {inp.dim()}-D input {tuple(inp.shape)}")
    return dim % inp.dim()


def _all_gather_into(out, inp, group, async_op):
    """``all_gather_single`` (torch >= 2.13, where ``all_gather_into_tensor`` is deprecated), looked
    up on ``torch.distributed`` at each call so the byte accounting's wrapper sees it."""
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(out, inp, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def _reduce_scatter_into(out, inp, group, async_op):
    """``reduce_scatter_single`` (torch >= 2.13) or ``reduce_scatter_tensor``, as :func:`_all_gather_into`."""
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(out, inp, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


def world_size(group) -> int:
    """The size of ``group`` (1 for the default group of a process without one)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_gather_seq(
    inp: torch.Tensor,
    group,
    out: torch.Tensor | None = None,
    async_op: bool = False,
    dim: int = 0,
):
    """Gather ``inp`` (``s/t`` long on ``dim``) from every rank into ``s`` long on ``dim``, in rank
    order.

    ``out`` may be a scratch buffer; it must not be read until the returned ``Pending`` is
    waited on.
    """
    t = world_size(group)
    dim = _seq_dim(inp, dim, "all_gather_seq")
    inp = inp.contiguous()
    shape = tuple(inp.shape[:dim]) + (inp.shape[dim] * t,) + tuple(inp.shape[dim + 1:])
    if out is None:
        out = torch.empty(shape, dtype=inp.dtype, device=inp.device)
    elif tuple(out.shape) != shape or out.dtype != inp.dtype:
        raise ValueError(
            f"all_gather_seq: output buffer {tuple(out.shape)} {out.dtype} does not match "
            f"input {tuple(inp.shape)} {inp.dtype} gathered over {t} ranks on dim {dim} {shape}"
        )
    if t == 1:
        out.copy_(inp)
        return Pending(out) if async_op else out
    if _direct(inp.shape, dim):  # the blocks are row blocks of [n, ...] and of [t * n, ...]
        rows_in, rows_out = _rows(inp, dim), _rows(out, dim)

        def op(a):
            return _all_gather_into(rows_out, rows_in, group=group, async_op=a)

        return _launch(op, out, (inp,), async_op)
    # rank blocks are not row blocks: gather them stacked, then one copy puts them in place
    # (the concatenated form [t * n0, ...]: gloo takes no stacked [t, ...] output)
    stacked = torch.empty((t * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)

    def op(a):
        return _all_gather_into(stacked, inp, group=group, async_op=a)

    def finish():
        split = tuple(inp.shape[:dim]) + (t,) + tuple(inp.shape[dim:])
        out.view(split).copy_(stacked.view((t,) + tuple(inp.shape)).movedim(0, dim))
        return out

    return _launch(op, stacked, (inp, out), async_op, finish)


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
    out: torch.Tensor | None = None,
    async_op: bool = False,
    dim: int = 0,
):
    """Sum ``inp`` (``s`` long on ``dim``) over the ranks and keep this rank's ``s/t`` block."""
    t = world_size(group)
    dim = _seq_dim(inp, dim, "reduce_scatter_seq")
    if inp.shape[dim] % t:
        raise ValueError(
            f"reduce_scatter_seq: dimension {dim} of {tuple(inp.shape)} ({inp.shape[dim]}) is not "
            f"divisible by the group size {t}"
        )
    n = inp.shape[dim] // t
    shape = tuple(inp.shape[:dim]) + (n,) + tuple(inp.shape[dim + 1:])
    direct = _direct(inp.shape, dim)
    if direct:
        inp = inp.contiguous()
    else:  # rank blocks one after another on dim 0 (one copy), as the collective reads them
        blocks = inp.reshape(tuple(inp.shape[:dim]) + (t, n) + tuple(inp.shape[dim + 1:])).movedim(dim, 0)
        inp = blocks.contiguous().view((t * shape[0],) + shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=inp.dtype, device=inp.device)
    if t == 1:
        out.copy_(inp.view(shape))
        return Pending(out) if async_op else out
    rows_out = _rows(out, dim) if direct else out
    rows_in = _rows(inp, dim) if direct else inp

    def op(a):
        return _reduce_scatter_into(rows_out, rows_in, group=group, async_op=a)

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
    token dispatcher sends tokens; used to send them again, :mod:`regather.megatron.moe.dispatch`)."""
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

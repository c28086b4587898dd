"""``recompute_adapter_inputs`` under ``torch.compile``: a saved adapter input is rebuilt by the
partitioner, not saved, when pointwise ops alone lead to it from what the backward reads anyway.

In a traced forward no hook sees a producer, so the eager rebuild (:mod:`.producers`) cannot run:
what a compiled block saves is AOT autograd's min-cut partitioner's choice
(``torch/_functorch/partitioners.py``). Left alone it saves a LoRA-A input — a norm's output shard,
``w2``'s ``silu(w1 x) * w3 x`` — because the backward GEMM ``dA = dmidᵀ x`` must materialise it
(``ban_recompute_materialized_backward``), although one pointwise step leads to it from tensors
the frozen model's backward keeps (the norm's input and ``rsqrt``; the multiply's operands).

A traced path reads every saved LoRA-A input back in backward through :func:`after`, which names
the adapter (a *ticket*, :func:`ticket`). :class:`TagAdapterInputs`, a joint-graph pass of
Inductor (``torch._inductor.config.joint_custom_post_pass``: after Inductor's own joint passes,
before the partition), walks from each read's input towards the forward's inputs:

================================================= ============================================
node on the way                                   what the pass does
================================================= ============================================
read by a backward node anyway (a norm's input,   a leaf: there in backward whatever the
``rsqrt``, ``silu(w1 x)``, ``w3 x``), or a graph  partition (saved, or rebuilt by the
input (a parameter)                               partitioner)
pointwise or a view, read by the forward only     tagged ``MUST_RECOMPUTE`` (torch.utils.checkpoint's
                                                  policy tag, which the partitioner honours)
anything else (a GEMM, a reduction, a collective) the input is kept: nothing tagged for it
================================================= ============================================

The partitioner then recomputes the tagged nodes in backward from leaves the backward reads
anyway: no new saved bytes. Only nodes leading to an ``after`` read with a ticket are touched; a
graph without one is left as it is. What the pass found per ticket is in :data:`OUTCOMES`.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

MAX_CHAIN = 64  # nodes tagged per input before it is kept (a norm is a handful)
NO_TICKET = -1  # an ``after`` read whose input is not to be rebuilt


@torch.library.custom_op("regather::after", mutates_args=())
def after(x: torch.Tensor, dep: torch.Tensor, ticket: int) -> torch.Tensor:
    """A copy of ``x`` that a traced graph computes after ``dep`` (``dep``'s data is not read);
    ``ticket`` names the adapter whose input ``x`` is (:data:`NO_TICKET`: keep it as saved)."""
    return x.clone()


@after.register_fake
def _after_fake(x: torch.Tensor, dep: torch.Tensor, ticket: int) -> torch.Tensor:
    return torch.empty_like(x)


_names: list[str] = []
#: ticket -> the number of nodes tagged to rebuild its input, or why it is kept (this process)
OUTCOMES: dict[int, int | str] = {}


def ticket(name: str) -> int:
    """A new ticket for the input of the adapter ``name`` (one per adapter object: two models in
    one process never share an outcome)."""
    _names.append(name)
    return len(_names) - 1


def outcome(ticket_: int) -> int | str | None:
    """What the last compiled graph with ``ticket_`` did with its input: the nodes tagged, the
    reason it is kept, or None before any compilation."""
    return OUTCOMES.get(ticket_)


def _backward_nodes(graph: torch.fx.Graph) -> set:
    """The nodes of a joint graph that depend on a tangent (the backward's)."""
    frontier = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    seen: set = set(frontier)
    while frontier:
        for user in frontier.pop().users:
            if user not in seen:
                seen.add(user)
                frontier.append(user)
    return seen


def _cheap(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (torch.Tag.pointwise in target.tags or target.is_view)


def rebuild_chain(x: torch.fx.Node, backward: set) -> list[torch.fx.Node] | str:
    """The forward nodes to recompute so that ``x`` is rebuilt in backward, or why it is kept."""
    chain, stack, seen = [], [x], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr"):
            continue
        if node is not x and any(user in backward for user in node.users):
            continue  # the backward reads it anyway
        if node.op != "call_function" or not _cheap(node):
            return f"{node.name} ({node.target}) is neither pointwise nor read by the backward"
        if len(chain) == MAX_CHAIN:
            return f"more than {MAX_CHAIN} pointwise nodes from what the backward reads"
        chain.append(node)
        stack.extend(node.all_input_nodes)
    return chain


def tag_adapter_inputs(graph: torch.fx.Graph) -> None:
    """Tag, for each ``regather::after`` read with a ticket, the pointwise nodes that rebuild its input."""
    from torch.utils.checkpoint import CheckpointPolicy

    reads = [n for n in graph.find_nodes(op="call_function", target=torch.ops.regather.after.default)
             if n.args[2] != NO_TICKET]
    if not reads:
        return
    backward = _backward_nodes(graph)
    for read in reads:
        x, ticket_ = read.args[0], read.args[2]
        found = rebuild_chain(x, backward)
        if isinstance(found, str):
            if OUTCOMES.get(ticket_) != found:
                name = _names[ticket_] if ticket_ < len(_names) else f"ticket {ticket_}"
                logger.info("regather: %s: its compiled input is kept: %s", name, found)
            OUTCOMES[ticket_] = found
            continue
        for node in found:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        OUTCOMES[ticket_] = len(found)


@functools.cache
def _pass_class() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class TagAdapterInputs(CustomGraphPass):
        """:func:`tag_adapter_inputs` as an Inductor joint-graph pass (with the uuid its cache keys on)."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            tag_adapter_inputs(graph)

        def uuid(self):
            return get_hash_for_files((__file__,))

    return TagAdapterInputs


def install() -> bool:
    """Add the pass to Inductor's ``joint_custom_post_pass`` beside any pass already there (once
    per process); True when added now."""
    import torch._inductor.config as inductor_config

    cls = _pass_class()
    current = inductor_config.joint_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
    if any(isinstance(p, cls) for p in passes):
        return False
    inductor_config.joint_custom_post_pass = [*passes, cls()]
    logger.info("regather: recompute_adapter_inputs under torch.compile: %s added to "
                "torch._inductor.config.joint_custom_post_pass", cls.__name__)
    return True

"""Every megatron-core internal regather touches, named once, with the versions it was read from.

regather reads megatron's modules through their public classes where it can; the names below are
not part of megatron-core's API — private attributes, a linear's communication flags flipped for
one call, a dispatcher's per-forward state, the functions a module's forward calls by name.
Each :class:`Internal` says where megatron-core defines it (a module and the source text that
sets or defines it there), in which versions it was read (:data:`READ_FROM`), and what regather
does with it; ``tests/unit/megatron/test_compat.py`` finds each one in the pinned megatron-core's
source. A name megatron-core renames breaks that test, not a training run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: The megatron-core versions the names below were read from (0.16.1 is pinned in the venv).
READ_FROM = ("0.16.1", "0.19.2")


@dataclass(frozen=True)
class Internal:
    """One megatron-core internal: ``name``, defined in ``module`` by ``source`` text, and the
    versions that have it (all of :data:`READ_FROM` unless said)."""

    name: str
    module: str
    source: str
    use: str
    versions: tuple[str, ...] = READ_FROM


_TE = "megatron.core.extensions.transformer_engine"
_LAYERS = "megatron.core.tensor_parallel.layers"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_MLP = "megatron.core.transformer.mlp"

TE_TP_GROUP = Internal("_tp_group", _TE, "self._tp_group =",
                       "a TE linear's TP group (TE's own tp_group is None once megatron hid expert TP from TE)")
PG_COLLECTION = Internal("_pg_collection", _TE, "self._pg_collection =",
                         "a TE grouped linear's process groups: its expert-parallel group")
FUSED_GROUPED_MLP = Internal("_with_fused_impl", "megatron.core.transformer.moe.experts", "_with_fused_impl",
                             "TE's fused grouped MLP runs linear_fc1 inside one op: refused (absent before it)",
                             versions=("0.19.2",))
IS_CHECKPOINTING = Internal("is_checkpointing", "megatron.core.tensor_parallel.random", "def is_checkpointing",
                            "megatron's activation checkpoint is running: adapters take the gather path")
#: ColumnParallelLinear's communication flags, read by its forward: LoRALinear's shared gather
#: turns its sequence gather and dgrad reduction off for one call (:func:`local_input`).
SP_COMM_FLAGS = tuple(Internal(flag, _LAYERS, f"self.{flag} =", "flipped for one forward by the shared gather")
                      for flag in ("sequence_parallel", "allreduce_dgrad", "disable_grad_reduce"))
#: The token dispatchers' per-forward state a route is replayed from (:mod:`regather.megatron.moe.dispatch`).
DISPATCHER_STATE = tuple(Internal(attr, _DISPATCHER, f"self.{attr}", "read to replay this forward's route")
                         for attr in ("reversed_local_input_permutation_mapping", "routing_map", "num_out_tokens",
                                      "input_splits", "output_splits", "output_splits_tp",
                                      "num_global_tokens_per_local_expert", "sort_input_by_local_experts",
                                      "local_map", "tp_ep_group", "hidden_shape"))
#: The functions megatron's MLP forward calls from its module's namespace, called the same way
#: on the same inputs to rebuild an activation bit for bit (:func:`regather.megatron.dense.producers.mlp_activation`).
MLP_FUNCTIONS = tuple(Internal(fn, _MLP, fn, "the MLP activation, recomputed as the MLP runs it")
                      for fn in ("bias_gelu_impl", "bias_geglu_impl", "bias_swiglu_impl", "weighted_bias_swiglu_impl",
                                 "weighted_bias_quick_geglu_impl", "quick_gelu", "HAVE_TE"))

INTERNALS = (TE_TP_GROUP, PG_COLLECTION, FUSED_GROUPED_MLP, IS_CHECKPOINTING, *SP_COMM_FLAGS, *DISPATCHER_STATE,
             *MLP_FUNCTIONS)


def private(obj, internal: Internal, default=None):
    """``obj``'s value of the private ``internal`` (``default`` where this version has none)."""
    return getattr(obj, internal.name, default)


def is_checkpointing() -> bool:
    """megatron's activation checkpoint is running (False without megatron-core)."""
    try:
        from megatron.core.tensor_parallel.random import is_checkpointing as running
    except ImportError:  # megatron-core is optional for the unit-level API
        return False
    return bool(running())


@contextmanager
def local_input(base) -> Iterator[None]:
    """``base`` (a ColumnParallelLinear) uses its input as it is for one call: no sequence gather, no
    dgrad reduction (the caller's shared gather does both); its flags are put back after."""
    names = [f.name for f in SP_COMM_FLAGS]
    saved = [getattr(base, n) for n in names]
    for name, value in zip(names, (False, False, True)):
        setattr(base, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(base, name, value)

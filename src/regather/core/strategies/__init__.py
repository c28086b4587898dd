"""The LoRA-A paths, one module each; the adapter looks one up per forward (:mod:`.paths`).

Where bytes are saved, sent and recomputed:

- :mod:`~regather.core.strategies.gather`       — keep the gathered input (classic path)
- :mod:`~regather.core.strategies.pregathered`  — LoRA-A on an input the base layer already gathered
- :mod:`~regather.core.strategies.regather`     — keep the local shard, gather again in backward
- :mod:`~regather.core.strategies.traced`       — regather inside ``torch.compile``: one autograd Function,
  the backward gather through functional collectives
- :mod:`~regather.core.strategies.lowrank`      — replicated LoRA-A on the local shard, gather rank-r output
- :mod:`~regather.core.strategies.local`        — inputs that need no sequence gather (row-parallel, SP off)
- :mod:`~regather.core.strategies.shared_gather` — one gather of a shard for the LoRA-A's that read it
- :mod:`~regather.core.strategies.shared_anchor` — early re-gather's anchor for the N adapters fed by
  one gathered input (PyTorch-native TP gathers once per module)
- :mod:`~regather.core.recompute.sources`  — what a path saves for ``dA``: the input (kept), or what
  its producer keeps, recomputed in backward (producers found by :mod:`regather.megatron.dense.producers`)
- :mod:`~regather.core.wgrad` (in core, beside :mod:`regather.core.peak`) — the shared weight-gradient GEMM
- :mod:`~regather.core.strategies.paths`  — the path interface, the table of every path and the lookup
"""

from enum import Enum


class Strategy(str, Enum):
    GATHER = "gather"
    REGATHER = "regather"
    LOWRANK = "lowrank"

    @classmethod
    def parse(cls, value) -> "Strategy":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(repr(s.value) for s in cls)
            raise ValueError(f"unknown strategy {value!r}; expected one of {names}") from None

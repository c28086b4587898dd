"""The strategies for a column-parallel LoRA-A under sequence parallelism.

- :mod:`~regather.strategies.gather`   — keep the gathered input (classic path)
- :mod:`~regather.strategies.regather` — keep the local shard, gather again in backward
- :mod:`~regather.strategies.lowrank`  — replicated LoRA-A on the local shard, gather rank-r output
- :mod:`~regather.strategies.wgrad`    — the shared weight-gradient GEMM / main_grad fusion
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

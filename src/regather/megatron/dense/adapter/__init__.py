"""A LoRA adapter beside a megatron tensor-parallel linear (:class:`ParallelLinearAdapter`).

- :mod:`.module`    — the class: constructor, LoRA-A layout (sharded or replicated), strategy switch
- :mod:`.forward`   — one forward: plan (decide, anchor early re-gather), run the LoRA-A path
- :mod:`.decisions` — which strategy runs and whether the input is rebuilt, and the fallback log
- :mod:`.weights`   — initialisers, weight holders, state-dict layout hooks, argument checks
"""

from regather.core.decision import Decision
from regather.megatron.dense.adapter.forward import ACTIVATIONS, Plan, partial_output
from regather.megatron.dense.adapter.module import ParallelLinearAdapter
from regather.megatron.dense.adapter.weights import DROPOUT_POSITIONS, INIT_METHODS, init_weight_

__all__ = [
           "ACTIVATIONS",
           "DROPOUT_POSITIONS",
           "INIT_METHODS",
           "Decision",
           "ParallelLinearAdapter",
           "Plan",
           "init_weight_",
           "partial_output",
]

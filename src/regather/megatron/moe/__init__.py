"""The Megatron front end's mixture-of-experts part: adapters on expert linears, and their inputs
rebuilt at zero new bytes. It extends :mod:`regather.megatron.dense` and is never imported by it.

- :mod:`.experts`    — which linears are experts; sizes, EP group, expert slots, Bridge's rank rule
- :mod:`.adapters`   — :class:`~.adapters.ExpertAdapter` (per expert, or shared by a grouped
  linear's experts over EP) and :class:`~.adapters.GroupedExpertAdapter` (per expert, grouped)
- :mod:`.wrapper`    — ``GroupedLoRALinear`` (a TE grouped linear and its adapter, ``m_splits``)
- :mod:`.dispatch`   — one forward's token route, replayed on other rows
- :mod:`.inputs`     — expert fc1 inputs from the router's input (pre-dispatched LoRA-A, re-dispatch)
- :mod:`.producers`  — expert fc2 inputs from the experts' activation; which producer an expert adapter has
- :mod:`.checkpoint` — Bridge's distributed-checkpoint entries of expert adapters
"""

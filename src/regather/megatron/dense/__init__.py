"""The dense part of the Megatron front end: one adapter beside one megatron parallel linear.

- :mod:`.adapter`     — ``ParallelLinearAdapter`` (layout, forward, decisions, weights)
- :mod:`.wrapper`     — ``LoRALinear``: the frozen linear and its adapter
- :mod:`.model`       — a wrapped model's adapters and decisions, model-level checks
- :mod:`.eligibility` — when a LoRA-A may skip keeping its gathered input (docs/design.md §5)
- :mod:`.producers`   — which op made an adapter's input, and how to make it again
- :mod:`.linears`     — what is read off a megatron parallel linear
- :mod:`.te`          — Transformer Engine bases (recognised by name; TE is never imported)
- :mod:`.checkpoint`  — Megatron Bridge's state-dict keys and distributed-checkpoint shards
"""

"""Adapter inputs rebuilt in backward from what their producer already keeps (zero new bytes).

- :mod:`.sources`   — what a LoRA-A path saves for ``dA``: the input (:data:`~.sources.KEEP`)
  or what its producer keeps (:class:`~.sources.Recomputed`); the :class:`~.sources.Producer`
  protocol
- :mod:`.graph`     — the autograd-graph checks that prove the saved tensor is already kept
- :mod:`.producers` — a producer module watched by a forward hook, and a norm producer
"""

"""The step's peak: LoRA without a full-width buffer of its own at any moment (docs/design.md §3.7).

Where LoRA's transient bytes go, one module each:

- :mod:`~regather.core.peak.chunks`   — how full-width work is cut into row chunks (at most 8, none under 16 MiB)
- :mod:`~regather.core.peak.output`   — LoRA-B's output added into the base's output in place, the scale on
  the rank-``r`` side (and the reference expression it replaces)
- :mod:`~regather.core.peak.row`      — a row-parallel base's LoRA-B on this rank's sequence shard, its weight
  gathered instead of its output
- :mod:`~regather.core.peak.junction` — LoRA-A's input gradient added into the base's in place, on the
  wrapper's input (also where regather's deferred ``dA`` runs)

The front ends decide per forward whether an adapter's output is lean (``lean_transients``); the counting
is :class:`regather.core.allocated.AllocatedBytes` (``peak``).
"""

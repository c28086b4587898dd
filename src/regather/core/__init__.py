"""The framework-free core: torch only, never megatron-core, Transformer Engine or torchtitan.

Front ends (:mod:`regather.megatron`, :mod:`regather.torchtitan`) hand it plain tensors, a
``torch.distributed`` process group and the sequence dimension of their activation layout.

- :mod:`.strategies` — the LoRA-A paths: where bytes are saved (gather, regather, lowrank,
  local, pregathered, predispatched, shared gather)
- :mod:`.wgrad`      — the one weight-gradient GEMM (``main_grad`` fusion, megatron's placeholder)
- :mod:`.peak`       — where transient bytes go: LoRA's output and input gradient added in place, in chunks
- :mod:`.recompute`  — inputs rebuilt from what their producer keeps (sources, graph checks)
- :mod:`.comm`, :mod:`.mappings` — where bytes are sent: collectives over a sequence dim, and
  their differentiable pairs
- :mod:`.buffers`    — scratch buffers for gathered activations
- :mod:`.accounting`, :mod:`.allocated` — where bytes are counted: saved tensors and collective traffic
  (DTensor's functional collectives included); the allocator's bytes, kept and the step's peak
- :mod:`.unwrap`     — the plain tensor under ``DTensor`` / ``AsyncCollectiveTensor`` (storage checks)
- :mod:`.decision`, :mod:`.fallback_log` — what an adapter decided and why, logged once per reason
- :mod:`.debug`      — opt-in cross-rank shape checks
- :mod:`.frontends`  — the front ends of this process, registered on import (``regather.decisions``)
"""

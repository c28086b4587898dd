"""The Megatron front end: LoRA on megatron-core's tensor-parallel linears (and Megatron Bridge).

- :mod:`.lora`, :mod:`.canonical`, :mod:`.bridge` — the PEFT entry points (``regather.LoRA``,
  ``regather.CanonicalLoRA``, ``regather.bridge.LoRA``); :mod:`.merge` — merge and unmerge
- :mod:`.dense` — the adapter beside a megatron parallel linear, its wrapper, eligibility rules,
  input producers, Transformer Engine bases, checkpoints
- :mod:`.moe`   — mixture-of-experts: expert adapters and their inputs (depends on :mod:`.dense`)
- :mod:`.reasons` — the decision sentences shared with ``regather estimate`` / ``doctor``

megatron-core is imported inside the functions that need it, so importing this package needs
only torch. The framework-free building blocks are :mod:`regather.core`. Importing it registers
the front end (:mod:`regather.core.frontends`): ``regather.adapters`` / ``decisions`` /
``set_strategy`` then ask :mod:`.dense.model`.
"""

from regather.core import frontends


def _model():
    from regather.megatron.dense import model

    return model


frontends.register("megatron", _model)

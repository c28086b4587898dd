"""``regather.bridge.LoRA``: the Megatron Bridge drop-in, under its public name.

The code is :mod:`regather.megatron.bridge`; importing this module needs Megatron Bridge.
"""

from regather.megatron.bridge import BridgeLoRA, LoRA

__all__ = ["BridgeLoRA", "LoRA"]

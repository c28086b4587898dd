"""``regather.bridge.LoRA`` and ``regather.bridge.DoRA``: the Megatron Bridge drop-ins, under their public names.

The code is :mod:`regather.megatron.bridge`; importing this module needs Megatron Bridge.
"""

from regather.megatron.bridge import BridgeDoRA, BridgeLoRA, DoRA, LoRA

__all__ = ["BridgeDoRA", "BridgeLoRA", "DoRA", "LoRA"]

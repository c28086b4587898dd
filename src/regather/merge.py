"""``regather.merge``: merge LoRA adapters into the base weights, under its public name.

The code is :mod:`regather.megatron.merge`.
"""

from regather.megatron.merge import delta_weight, merge, merged, unmerge

__all__ = ["delta_weight", "merge", "merged", "unmerge"]

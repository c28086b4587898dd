"""regather's fields on a torchtitan LoRA, named as in ``regather.LoRA``, checked before any change.

=================================== ========= ==============================================
field                               default   meaning
=================================== ========= ==============================================
``sequence_parallel_input_regather`` ``False``  ``True``: the regather strategy (shorthand)
``sequence_parallel_input_strategy`` ``None``   ``"gather"`` | ``"regather"`` | ``"lowrank"``;
                                              ``None`` follows the flag above
``early_regather``                   ``True``   regather: start the backward gather when the
                                              output gradient arrives, compute ``dA`` after
                                              the gathering module's dgrad (bit-identical)
``recompute_adapter_inputs``         ``False``  save what each adapter input's producer keeps
                                              (the norm's input, the SwiGLU operands) and
                                              rebuild the input in backward
=================================== ========= ==============================================

A bad value raises ``ValueError`` naming the field (``owner(field=value): ...``) when the config
is made, before a model is touched; so do torchtitan's own ``rank`` / ``alpha`` /
``target_modules`` when they cannot build an adapter.

The tools (``regather bench --torchtitan``, ``regather estimate --front-end torchtitan``) name what
they compare by :func:`variant_fields`: ``torchtitan`` (torchtitan's own ``LoRAConverter``, the
baseline), ``<strategy>`` (``gather``, ``regather``, ``lowrank``) and the options as suffixes in this
order, ``-plain`` (``early_regather=False``) and ``-recompute`` (``recompute_adapter_inputs=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

from regather.core.strategies import Strategy


@dataclass(frozen=True)
class Options:
    """What an adapter runs: the strategy asked for and the two switches."""

    strategy: Strategy = Strategy.GATHER
    early_regather: bool = True
    recompute_adapter_inputs: bool = False


def _flag(owner: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}({name}={value!r}): expected True or False")
    return value


def options(owner: str, *, sequence_parallel_input_regather=False, sequence_parallel_input_strategy=None,
            early_regather=True, recompute_adapter_inputs=False) -> Options:
    """The :class:`Options` of regather's fields, or a ``ValueError`` naming the bad one."""
    regather = _flag(owner, "sequence_parallel_input_regather", sequence_parallel_input_regather)
    strategy = Strategy.REGATHER if regather else Strategy.GATHER
    if sequence_parallel_input_strategy is not None:
        try:
            chosen = Strategy.parse(sequence_parallel_input_strategy)
        except ValueError as exc:
            raise ValueError(f"{owner}(sequence_parallel_input_strategy={sequence_parallel_input_strategy!r}): "
                             f"{exc}") from None
        if regather and chosen != Strategy.REGATHER:
            raise ValueError(f"{owner}(sequence_parallel_input_regather=True, sequence_parallel_input_strategy="
                             f"{sequence_parallel_input_strategy!r}) disagree: set only one of them")
        strategy = chosen
    return Options(strategy, _flag(owner, "early_regather", early_regather),
                   _flag(owner, "recompute_adapter_inputs", recompute_adapter_inputs))


def check_lora(owner: str, rank, alpha, target_modules) -> None:
    """torchtitan's LoRA fields: a positive integer rank, a real alpha, a list of names or None."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ValueError(f"{owner}(rank={rank!r}): LoRA rank must be a positive integer")
    if rank <= 0:  # torchtitan's own check and wording (LoRAConverter.__init__)
        raise ValueError(f"{owner}(rank={rank!r}): LoRA rank must be positive, got {rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{owner}(alpha={alpha!r}): alpha must be a number")
    if target_modules is not None and (isinstance(target_modules, str)
                                       or not all(isinstance(t, str) for t in target_modules)):
        raise ValueError(f"{owner}(target_modules={target_modules!r}): expected a list of module names "
                         "(the last segment of a module's path, e.g. ['wqkv', 'w1']) or None")


BASELINE = "torchtitan"
STRATEGIES = ("gather", "regather", "lowrank")
_SUFFIXES = {"plain": ("early_regather", False), "recompute": ("recompute_adapter_inputs", True)}
#: every variant the tools compare by default, the baseline first
VARIANTS = (BASELINE, "gather", "regather", "regather-plain", "lowrank", "gather-recompute", "regather-recompute",
            "lowrank-recompute")


def variant_fields(name: str) -> dict | None:
    """regather's converter fields a variant name asks for (None: torchtitan's own converter), or a
    ``ValueError`` naming it."""
    if name == BASELINE:
        return None
    strategy, *suffixes = name.split("-")
    known = [s for s in _SUFFIXES if s in suffixes]
    if strategy not in STRATEGIES or suffixes != known:
        raise ValueError(f"unknown torchtitan variant {name!r}: expected {BASELINE} or <strategy>[-plain][-recompute] "
                         f"with a strategy of {', '.join(STRATEGIES)}")
    if "plain" in suffixes and strategy != "regather":
        raise ValueError(f"torchtitan variant {name!r}: -plain (early_regather=False) is regather's option")
    return dict([("sequence_parallel_input_strategy", strategy)] + [_SUFFIXES[s] for s in suffixes])


def base_variant(name: str) -> str:
    """The variant without options (``regather-recompute`` -> ``regather``)."""
    return name if name == BASELINE else name.split("-")[0]

"""The model and layout options ``regather estimate`` and ``regather doctor`` share: ``--recipe`` (a
Megatron Bridge PEFT recipe's LoRA, or a shipped layout whole), which options were given on the command
line, and ``--attention``'s default per spec. Both commands describe a run with the same presets
(:data:`~regather.tools.estimate.config.PRESETS`) and layouts (:data:`~regather.tools.estimate.config.LAYOUTS`)."""

from __future__ import annotations

import argparse

from regather.megatron.reasons import ALL_TARGETS
from regather.tools.estimate.config import BRIDGE_VERSION, LAYOUTS, PRESETS, RECIPES

# a named --recipe's layout fields, as the command line names them
LAYOUT_FLAGS = {"tp": "--tp", "sp": "--no-sp", "seq": "--seq", "micro_batch": "--micro-batch"}
# options a named --recipe fixes to these values (its recipes run PP 1, EP 1)
LAYOUT_FIXED = {"pp": ("--pp", 1), "ep": ("--ep", 1), "etp": ("--etp", 1)}


class Given(argparse.Action):
    """Stores the value (``const`` for a flag, ``nargs=0``) and records that the option was on the
    command line (``--recipe`` gives the targets and rank only where they were not, and a named
    layout refuses a layout option that contradicts it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.given = frozenset(getattr(namespace, "given", ())) | {self.dest}


def given(args) -> frozenset:
    """The destinations of the :class:`Given` options on the command line."""
    return frozenset(getattr(args, "given", ()))


def recipe_lora(recipe) -> str:
    targets = "all four targets" if set(recipe.targets) == set(ALL_TARGETS) else ",".join(recipe.targets)
    return f"{targets}, dim {recipe.dim}"


def layout_text(layout) -> str:
    return (f"{PRESETS[layout.preset].name} TP{layout.tp}, SP {'on' if layout.sp else 'off'}, seq {layout.seq}, "
            f"micro-batch {layout.micro_batch} ({layout.source})")


def recipe_help(then: str) -> str:
    """``--recipe``'s help; ``then``: what the command does with it besides."""
    return (f"alone: LoRA targets and dim of the preset's Megatron Bridge {BRIDGE_VERSION} PEFT recipe ("
            + "; ".join(f"{k}: {recipe_lora(r)}" for k, r in sorted(RECIPES.items()))
            + "), the layout the command line's. With a LAYOUT, also its model and layout: "
            + "; ".join(f"{k}: {layout_text(v)}" for k, v in LAYOUTS.items())
            + " (a --model, --tp, --no-sp, --seq, --micro-batch, --pp, --ep or --etp that contradicts it is "
              "refused). --targets and --lora-rank still override" + (f". {then}" if then else ""))


def apply_layout(args, command: str = "estimate") -> None:
    """``--recipe LAYOUT``: sets the preset and the layout on ``args``; exits naming the values where
    an option given on the command line contradicts the layout (before anything is computed)."""
    name = getattr(args, "recipe", False)
    if not isinstance(name, str):
        return
    layout, on_line = LAYOUTS[name], given(args)
    wrong = [f"--model {args.model} (it is {layout.preset})"] if "model" in on_line and args.model != layout.preset \
        else []
    for field, flag in LAYOUT_FLAGS.items():
        if field in on_line and getattr(args, field) != getattr(layout, field):
            shown = "" if field == "sp" else f" {getattr(args, field)}"
            wrong.append(f"{flag}{shown} (it runs {field.replace('_', '-')} {getattr(layout, field)})")
    wrong += [f"{flag} {getattr(args, field)} (it runs {value})" for field, (flag, value) in LAYOUT_FIXED.items()
              if getattr(args, field) != value]
    if wrong:
        raise SystemExit(f"regather {command} --recipe {name}: {', '.join(wrong)}; leave them out or drop the layout")
    args.model, args.tp, args.sp, args.seq, args.micro_batch = (layout.preset, layout.tp, layout.sp, layout.seq,
                                                                 layout.micro_batch)


def recipe_targets(args, targets: tuple, rank: int) -> tuple[tuple, int]:
    """With ``--recipe``, the preset's recipe targets and dim where ``--targets`` / ``--lora-rank`` were
    not given; else ``targets`` and ``rank`` as they are."""
    recipe = RECIPES.get(args.model) if getattr(args, "recipe", False) else None
    if recipe is None:
        return targets, rank
    on_line = given(args)
    return (targets if "targets" in on_line else recipe.targets), (rank if "lora_rank" in on_line else recipe.dim)


def attention(args) -> str:
    """``--attention`` as given, else the spec's: TE's fused attention, or megatron's unfused local one."""
    chosen = getattr(args, "attention", None)
    return chosen or ("fused" if getattr(args, "spec", "local") == "te" else "unfused")

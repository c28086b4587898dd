"""The model and run options ``regather estimate`` and ``regather doctor`` share, read after parsing: the
model a command line describes (a preset or the tiny GPT, with the sizes given: :func:`sized`), ``--recipe``
(a Megatron Bridge PEFT recipe's LoRA, or a shipped layout whole), the contradictions refused before
anything is computed (:func:`refuse_contradictions`), and ``--attention``'s default per spec. Both commands
describe a run with the same presets (:data:`~regather.tools.estimate.config.PRESETS`) and layouts
(:data:`~regather.tools.estimate.config.LAYOUTS`); their flags are :mod:`regather.tools.estimate.vocabulary`'s."""

from __future__ import annotations

from regather.megatron.reasons import ALL_TARGETS
from regather.tools.cmdline import given
from regather.tools.estimate.config import LAYOUTS, PRESETS, RECIPES

# a named --recipe's layout fields, as the command line names them
LAYOUT_FLAGS = {"tp": "--tp", "sp": "--no-sp", "seq": "--seq", "micro_batch": "--micro-batch"}
# options a named --recipe fixes to these values (its recipes run PP 1, EP 1)
LAYOUT_FIXED = {"pp": ("--pp", 1), "ep": ("--ep", 1), "etp": ("--etp", 1), "cp": ("--cp", 1)}
#: the sizes a command line may give (flag destinations, also ModelShape's fields)
SIZES = ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "num_experts", "moe_ffn", "topk")
#: the tiny GPT made MoE (--moe, or --num-experts on --model tiny): the test MoE's experts
#: (regather.tools.cpu.moe_models.TinyMoE, what bench --moe builds)
TINY_MOE = {"num_experts": 4, "moe_ffn": 64, "topk": 2}
#: the run where the command line says nothing: a preset's (estimate's long-standing defaults), the tiny GPT's
PRESET_RUN = {"seq": 8192, "micro_batch": 1, "lora_rank": 16}
TINY_RUN = {"seq": 32, "micro_batch": 2, "lora_rank": 8}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def recipe_lora(recipe) -> str:
    targets = "all four targets" if set(recipe.targets) == set(ALL_TARGETS) else ",".join(recipe.targets)
    return f"{targets}, dim {recipe.dim}"


def layout_text(layout) -> str:
    return (f"{PRESETS[layout.preset].name} TP{layout.tp}, SP {'on' if layout.sp else 'off'}, seq {layout.seq}, "
            f"micro-batch {layout.micro_batch} ({layout.source})")


def sized(args, base, base_name: str, command: str, tiny: bool = False) -> tuple[dict, str]:
    """The sizes the command line gives over ``base`` (a preset's shape, or the tiny GPT's) and the
    model's name; exits naming the values where they cannot make a model.

    The user's sizes win, and what follows from them is derived, not inherited: given ``--hidden`` or
    ``--heads``, a head is hidden/heads wide unless ``--head-dim`` says otherwise; given ``--heads``,
    each head is its own query group unless ``--kv-heads`` says otherwise. A dense model given
    ``--num-experts`` takes the test MoE's expert sizes on the tiny GPT and needs ``--moe-ffn`` and
    ``--topk`` on a preset. The name is the preset's only when the model is the preset; with sizes,
    ``"<preset> (custom)"`` where ``--model`` named it, else ``"custom"`` and the preset's sizes it keeps."""
    on_line = {d: getattr(args, d) for d in SIZES if getattr(args, d, None) is not None}
    sizes = dict(on_line)
    if ("hidden" in sizes or "heads" in sizes) and "head_dim" not in sizes:
        sizes["head_dim"] = None
    if "heads" in sizes and "kv_heads" not in sizes:
        sizes["kv_heads"] = None
    final = {d: sizes.get(d, getattr(base, d)) for d in SIZES}
    moe = final["num_experts"] > 0
    if moe and not base.num_experts:
        missing = [d for d in ("topk", "moe_ffn") if d not in sizes]
        if tiny:
            sizes.update({d: TINY_MOE[d] for d in missing})
        elif missing:  # a dense preset made MoE: its routing and expert size are not the preset's to give
            raise SystemExit(f"regather {command}: --num-experts {final['num_experts']} on the dense {base_name} "
                             f"needs {' and '.join(_flag(d) for d in missing)} too (a MoE preset: "
                             + ", ".join(k for k, m in sorted(PRESETS.items()) if m.num_experts) + ")")
    elif not moe and any(d in on_line for d in ("moe_ffn", "topk")):
        shown = " / ".join(_flag(d) for d in ("moe_ffn", "topk") if d in on_line)
        raise SystemExit(f"regather {command}: {shown} describe experts and this model has none: add "
                         "--num-experts (or --moe, or a MoE preset)")
    if not moe and not final["ffn"]:
        raise SystemExit(f"regather {command}: a dense model needs its MLP: --ffn {final['ffn']} with no experts "
                         + ("(--num-experts 0 made it dense: give --ffn)" if base.num_experts else ""))
    heads, kv = final["heads"], final["kv_heads"]
    if kv and heads % kv:
        raise SystemExit(f"regather {command}: --kv-heads {kv} does not divide --heads {heads} (each query group "
                         "serves the same number of heads)")
    if final["head_dim"] is None and final["hidden"] % heads:
        raise SystemExit(f"regather {command}: --hidden {final['hidden']} is not divisible by --heads {heads} "
                         "(give --head-dim for heads of another width)")
    if not on_line:
        return sizes, base_name
    if "model" in given(args):
        return sizes, f"{base_name} (custom)"
    kept = [d for d in ("hidden", "layers", "heads", "kv_heads", "head_dim") if d not in sizes and getattr(base, d)]
    kept += [d for d in ("ffn",) if d not in sizes and base.ffn and not (moe and not final["ffn"])]
    kept += [d for d in ("num_experts", "moe_ffn", "topk") if moe and d not in sizes and getattr(base, d)]
    return sizes, "custom" + (f" ({base_name}'s {', '.join(d.replace('_', '-') for d in kept)})" if kept else "")


def apply_layout(args, command: str = "estimate") -> None:
    """``--recipe LAYOUT``: sets the preset and the layout on ``args``; exits naming the values where
    an option given on the command line contradicts the layout (before anything is computed)."""
    name = getattr(args, "recipe", False)
    if not isinstance(name, str):
        return
    layout, on_line = LAYOUTS[name], given(args)
    wrong = [f"--model {args.model} (it is {layout.preset})"] if "model" in on_line and args.model != layout.preset \
        else []
    wrong += [f"{_flag(d)} {getattr(args, d)} (it is {PRESETS[layout.preset].name}'s)" for d in SIZES
              if getattr(args, d, None) is not None]
    for field, flag in LAYOUT_FLAGS.items():
        if field in on_line and getattr(args, field) != getattr(layout, field):
            shown = "" if field == "sp" else f" {getattr(args, field)}"
            wrong.append(f"{flag}{shown} (it runs {field.replace('_', '-')} {getattr(layout, field)})")
    wrong += [f"{flag} {getattr(args, field)} (it runs {value})" for field, (flag, value) in LAYOUT_FIXED.items()
              if getattr(args, field, value) != value]
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


def refuse_recipe(args, key: str, command: str) -> None:
    """A bare ``--recipe`` takes the preset's recipe LoRA: exits where no recipe is known for the model, or
    where sizes given without ``--model`` make a model that is no preset's."""
    if getattr(args, "recipe", False) is not True:
        return
    if key not in RECIPES:
        raise SystemExit(f"regather {command} --recipe: no Megatron Bridge PEFT recipe is known for {key}; recipes: "
                         + ", ".join(sorted(RECIPES)))
    if "model" not in given(args) and any(getattr(args, d, None) is not None for d in SIZES):
        raise SystemExit(f"regather {command} --recipe: the recipe is {PRESETS[key].name}'s and these sizes make "
                         f"another model; name the preset (--model {key}) to keep its recipe, or drop --recipe")


def refuse_contradictions(args, moe: bool, name: str, command: str) -> None:
    """Exits naming the options where the command line contradicts itself or the model (``moe``: it has
    experts; ``name``: how the refusal calls it), before anything is computed."""
    on_line, wrong = given(args), []
    dense_only = [_flag(d) + ("" if d in ("experts", "redispatch_expert_inputs") else f" {getattr(args, d)}")
                  for d, default in (("experts", None), ("expert_lora", "shared"), ("dispatcher", "alltoall"),
                                     ("redispatch_expert_inputs", False), ("ep", 1), ("etp", 1))
                  if d in on_line and getattr(args, d) != default]
    if dense_only and not moe:
        wrong.append(f"{', '.join(dense_only)}: {name} has no experts")
    if moe and getattr(args, "expert_lora", "shared") == "per-expert" and getattr(args, "experts", None) == "sequential":
        wrong.append("--expert-lora per-expert needs --experts grouped (SequentialMLP experts always have an "
                     "adapter each)")
    if not getattr(args, "first_stage", True) and args.pp == 1:
        wrong.append("--later-stage needs --pp > 1 (with one pipeline stage this GPU holds the first layer)")
    if getattr(args, "in_flight", 1) > 1 and args.pp == 1:
        wrong.append(f"--in-flight {args.in_flight} needs --pp > 1 (without pipeline parallelism one "
                     "micro-batch's activations are alive at a time)")
    if wrong:
        raise SystemExit(f"regather {command}: " + "; ".join(wrong))


#: full recompute where the command line names no method / layer count: as Bridge's recipes set it
#: (qwen3 / qwen3_moe recipes: recompute_method "uniform", recompute_num_layers 1)
BRIDGE_FULL_RECOMPUTE = ("uniform", 1)


def recompute(args, command: str) -> dict:
    """megatron's activation recompute of the command line, as ``Run`` / ``Setup`` fields: ``--recompute-granularity
    full`` without ``--recompute-method`` / ``--recompute-num-layers`` takes Bridge's (uniform, 1 layer); exits naming
    the values where megatron's ``TransformerConfig`` would refuse them."""
    g = getattr(args, "recompute_granularity", None)
    method, n = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None)
    modules = tuple(getattr(args, "recompute_modules", ()) or ())
    wrong = []
    if g != "full" and (method or n):
        shown = " ".join(f for f, v in (("--recompute-method", method), ("--recompute-num-layers", n)) if v)
        wrong.append(f"{shown} needs --recompute-granularity full (megatron refuses a method or layer count "
                     + ("with selective recompute)" if g else "without recompute)"))
    if modules and g != "selective":
        wrong.append(f"--recompute-modules {','.join(modules)} needs --recompute-granularity selective")
    if wrong:
        raise SystemExit(f"regather {command}: " + "; ".join(wrong))
    if g == "full":
        method, n = method or BRIDGE_FULL_RECOMPUTE[0], n or BRIDGE_FULL_RECOMPUTE[1]
    return {"recompute_granularity": g, "recompute_method": method, "recompute_num_layers": n,
            "recompute_modules": modules}


def refuse_cp(args, spec: str, command: str) -> None:
    """``--cp`` > 1 on megatron's local spec with its unfused attention: megatron runs context parallelism through
    Transformer Engine's attention only; exits naming the values."""
    cp = getattr(args, "cp", 1)
    if cp > 1 and spec == "local" and attention(args) == "unfused":
        raise SystemExit(f"regather {command}: --cp {cp} with --spec local's unfused attention: megatron's local "
                         "DotProductAttention asserts context_parallel_size == 1 (context parallelism runs through "
                         "Transformer Engine's attention: --spec te, or --attention fused)")


def attention(args) -> str:
    """``--attention`` as given, else the spec's: TE's fused attention, or megatron's unfused local one."""
    chosen = getattr(args, "attention", None)
    return chosen or ("fused" if getattr(args, "spec", "local") == "te" else "unfused")

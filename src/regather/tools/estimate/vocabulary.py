"""The ``regather`` commands' argument vocabulary: every flag of ``demo``, ``bench``, ``estimate`` and
``doctor`` defined once — its names, meaning, accepted values and the commands that take it.

A flag two commands share is the same flag in both: the same spelling, the same meaning, the same
accepted values (a value one command cannot use is refused by that command after parsing, with the
reason, not by a narrower ``choices``). What differs between commands is only the default
(:attr:`Flag.default`, :attr:`Flag.defaults`, or the ``defaults`` a command passes: ``bench`` takes
its dataclass's) and a note on what the flag does there (:attr:`Flag.notes`). A command's parser is
:func:`add_flags` of this table, so a flag added here (``FLAGS.append(Flag(("--cp",), "context
parallel size", ("estimate", "doctor", "bench"), type=positive, default=1, group="run"))``) is on
every command it names, with one help text; ``tests/unit/tools/test_cli.py`` checks that every
flag's help says what it does and what it defaults to.

It sits in estimate's layer because it names estimate's presets, layouts and specs
(:mod:`regather.tools.estimate.config`); every command above imports it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from regather.megatron.reasons import ALL_TARGETS, CANONICAL_TARGETS, DISPATCHERS
from regather.tools.cmdline import HelpFormatter, names, non_negative, positive, positive_number, seconds
from regather.tools.estimate.config import ATTENTION, BRIDGE_VERSION, EXPERT_LORA, LAYOUTS, PRESETS, RECIPES, SPECS
from regather.tools.estimate.dora import DORA_OUTPUTS, PEFTS
from regather.tools.estimate.options import layout_text, recipe_lora
from regather.tools.shapes import DTYPE_BYTES, EXPERT_KINDS
from regather.torchtitan.options import VARIANTS as TITAN_VARIANTS
from regather.torchtitan.reasons import TARGETS as TITAN_TARGETS

TINY = "tiny"  # --model tiny: the test GPT (regather.tools.shapes.ModelShape's sizes)
MODELS = tuple(sorted(PRESETS)) + (TINY,)
FRONT_ENDS = ("megatron", "torchtitan")
#: every target name a front end knows: megatron's, CanonicalLoRA's, torchtitan's
TARGET_NAMES = tuple(dict.fromkeys(ALL_TARGETS + CANONICAL_TARGETS + TITAN_TARGETS))
#: the variant grammar: <strategy>[-plain][-recompute][-redispatch], or torchtitan's own LoRA
STRATEGY_NAMES = ("gather", "regather", "lowrank")
SUFFIXES = ("plain", "recompute", "redispatch")
#: named in the refusal of an unknown strategy
KNOWN_STRATEGIES = ("gather", "regather", "lowrank", "gather-recompute", "regather-recompute", "lowrank-recompute",
                    "regather-plain", "regather-classic", "gather-lean", "regather-recompute-redispatch",
                    "lowrank-recompute-redispatch", "torchtitan")
COMMANDS = ("demo", "bench", "estimate", "doctor")
#: argument groups, in the order --help lists them
GROUPS = {"model": "model", "experts": "mixture of experts", "run": "run", "lora": "LoRA",
          "features": "features that change eligibility or the allocator", "measure": "measurement",
          "output": "output"}
#: megatron-core's TransformerConfig.recompute_modules choices
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def targets(value: str) -> tuple:
    """``--targets``: a comma list of target names some front end has (the command refuses, after
    parsing, a name its model has not)."""
    return names(value, TARGET_NAMES, "targets")


def _variant_ok(name: str) -> bool:
    if name == "torchtitan":
        return True
    strategy, *suffixes = name.split("-")
    return (strategy in STRATEGY_NAMES and suffixes == [s for s in SUFFIXES if s in suffixes]
            and ("plain" not in suffixes or strategy == "regather")  # early_regather is regather's
            and ("redispatch" not in suffixes or "recompute" in suffixes))  # re-dispatch rebuilds a recompute's input


def strategies(value: str) -> tuple:
    """``--strategies``: strategies and variants (``<strategy>[-plain][-recompute][-redispatch]``,
    ``torchtitan``); which of them a command runs is its own to say, after parsing."""
    listed = tuple(n.strip() for n in value.split(",") if n.strip())
    return names(value, KNOWN_STRATEGIES + tuple(n for n in listed if _variant_ok(n) and n not in KNOWN_STRATEGIES),
                 "strategies")


def expert_kind(value: str) -> str:
    """``--experts``: how the experts are built (a count is ``--num-experts``)."""
    if value in EXPERT_KINDS:
        return value
    hint = f" (the number of experts is --num-experts {value})" if value.isdigit() else ""
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(EXPERT_KINDS)}){hint}")


def recompute_modules(value: str) -> tuple:
    return names(value, RECOMPUTE_MODULES, "recompute modules")


def te_version(value: str) -> str:
    """``--te-version``: a version TE could have (``2.18``, ``2.18.0``, ``2.4.0.dev0+abc``)."""
    from regather.megatron.dense.te_rule import version_tuple

    if version_tuple(value) is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a Transformer Engine version such as 2.18 or 2.18.0")
    return value


def recipe_help() -> str:
    return (f"alone: the LoRA targets and dim of the preset's Megatron Bridge {BRIDGE_VERSION} PEFT recipe ("
            + "; ".join(f"{k}: {recipe_lora(r)}" for k, r in sorted(RECIPES.items()))
            + "), the layout the command line's. With a LAYOUT, also its model and layout: "
            + "; ".join(f"{k}: {layout_text(v)}" for k, v in LAYOUTS.items())
            + " (a --model, --tp, --no-sp, --seq, --micro-batch, --pp, --ep or --etp that contradicts it is "
              "refused, and so are custom sizes). --targets and --lora-rank still override")


_UNSET = object()


@dataclass(frozen=True)
class Flag:
    """One flag: its spellings, what it means, the commands that take it, what it accepts.

    ``switch``: a flag without a value that stores this (``True``; ``False`` for ``--no-…``); ``unset``:
    what a default of ``None`` means, for every command or per command (the help says it)."""

    names: tuple
    help: str
    commands: tuple
    group: str
    type: Callable | None = None
    choices: tuple | None = None
    default: Any = None
    defaults: Mapping[str, Any] = field(default_factory=dict)  # per command, over ``default``
    unset: str | Mapping[str, str] = ""
    notes: Mapping[str, str] = field(default_factory=dict)  # per command: what it adds to the help
    dest: str | None = None
    switch: Any = _UNSET
    metavar: str | None = None
    nargs: str | None = None
    const: Any = None

    @property
    def name(self) -> str:
        return self.dest or self.names[0].lstrip("-").replace("-", "_")

    def default_for(self, command: str) -> Any:
        return self.defaults.get(command, self.default)

    def help_for(self, command: str, default: Any) -> str:
        text = self.help + self.notes.get(command, "")
        unset = self.unset.get(command, "") if isinstance(self.unset, Mapping) else self.unset
        return text + (f" (default: {unset})" if default is None and unset else "")


E, D, B, M = "estimate", "doctor", "bench", "demo"
PRESET_OR_TINY = {E: "the model's", D: "the model's"}

FLAGS: list[Flag] = [
    # -- the model --------------------------------------------------------------------------------------
    Flag(("--model",), "the model: a preset (sizes from its config.json: regather.tools.estimate.config) or "
         f"{TINY}, the test GPT (h=64, 2 layers, 4 heads, ffn 128, gelu with biases); sizes given override it",
         (E, D), "model", choices=MODELS, defaults={E: "qwen3-8b"},
         unset={D: f"qwen3-8b; {TINY} with --build or --moe"},
         notes={E: " (--front-end torchtitan: llama3-8b unless given)"}),
    Flag(("--hidden",), "hidden size", (M, B, E, D), "model", type=positive, defaults={M: 128}, unset=PRESET_OR_TINY),
    Flag(("--layers",), "transformer layers", (M, B, E, D), "model", type=positive, defaults={M: 2},
         unset=PRESET_OR_TINY),
    Flag(("--heads",), "attention heads", (M, B, E, D), "model", type=positive, defaults={M: 4},
         unset=PRESET_OR_TINY),
    Flag(("--kv-heads",), "query groups (GQA)", (B, E, D), "model", type=positive,
         unset={B: "--heads", E: "the model's; --heads where --heads is given",
                D: "the model's; --heads where --heads is given"}),
    Flag(("--head-dim",), "each attention head's width", (E, D), "model", type=positive,
         unset="the model's; hidden/heads where --hidden or --heads is given"),
    Flag(("--ffn",), "the dense MLP's width (0: none, every layer is MoE)", (B, E, D), "model", type=non_negative,
         unset=PRESET_OR_TINY),
    Flag(("--vocab",), "vocabulary size", (B,), "model", type=positive),
    Flag(("--activation",), "the MLP's activation", (D,), "model", choices=("gelu", "swiglu"),
         unset=f"swiglu for a preset, gelu for {TINY}"),
    Flag(("--no-bias",), f"add_bias_linear=False (a preset has no biases; {TINY} has)", (D,), "model",
         dest="add_bias_linear", switch=False, default=None),
    Flag(("--spec",), "what the base linears keep: te = Transformer Engine (transformer_impl=\"transformer_engine\", "
         "what Bridge's PEFT recipes run: LayerNormLinear keeps its ln_out for LoRA-A, fused attention its output; the "
         "qkv / fc1 / fc2 rules measured on the TE model on CPU, the rest modelled); local = megatron's local spec "
         "(what regather bench and doctor --build build)", (E, D), "model", choices=SPECS, defaults={E: "te"},
         unset={D: "te; local with --build"}),
    Flag(("--attention",), "fused: the attention keeps its output for its backward (flash-attention, TE's fused "
         "attention), so linear_proj's LoRA-A input is 0 new bytes on every strategy; unfused: megatron's local "
         "attention (saves probs and V)", (E, D), "model", choices=ATTENTION,
         unset="fused on --spec te, unfused on --spec local"),
    Flag(("--canonical",), "regather.CanonicalLoRA (one adapter per q, k, v, gate, up) on a gated SwiGLU GPT; reports "
         "the q/k/v and gate/up adapter inputs beside Megatron Bridge's CanonicalLoRA (5 x_full a layer)", (B,),
         "model", switch=True),
    # -- mixture of experts -----------------------------------------------------------------------------
    Flag(("--moe",), f"the {TINY} GPT's MLPs are experts: the test MoE (4 experts, moe ffn 64, top-2) on megatron's "
         "MoE layers (router, token dispatcher, experts)", (B, D), "experts", switch=True,
         notes={B: "; variants also <strategy>-recompute-redispatch; ranks = max(tp, ep x etp)"}),
    Flag(("--num-experts",), "experts per MoE layer (0: a dense MLP)", (B, E, D), "experts", type=non_negative,
         unset={E: "the model's", D: "the model's; 4 with --moe"}),
    Flag(("--moe-ffn",), "each expert's MLP width", (B, E, D), "experts", type=positive, unset=PRESET_OR_TINY),
    Flag(("--topk",), "experts each token is routed to (the router's top-k)", (B, E, D), "experts", type=positive,
         unset=PRESET_OR_TINY),
    Flag(("--experts",), "how the experts are built: sequential = SequentialMLP (a module per expert), grouped = "
         "TEGroupedMLP (moe_grouped_gemm=True)", (B, E, D), "experts", type=expert_kind,
         metavar="{" + ",".join(EXPERT_KINDS) + "}", unset={E: "grouped, as Bridge builds the presets",
                                                            D: f"grouped for a preset, sequential for {TINY}"},
         notes={B: " (grouped: on the TE stand-ins)"}),
    Flag(("--expert-lora",), "LoRA on grouped experts: shared = one LoRA pair for a layer's local experts "
         "(share_expert_adapters=True, Bridge's default), per-expert = one per expert (share_expert_adapters=False); "
         "SequentialMLP experts have one per expert either way", (B, E, D), "experts", choices=EXPERT_LORA,
         default="shared"),
    Flag(("--redispatch-expert-inputs",), "LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs are dispatched "
         "again in backward (with recompute_adapter_inputs)", (E, D), "experts", switch=True,
         notes={E: ": the -recompute strategies", D: ": --recompute-adapter-inputs"}),
    Flag(("--dispatcher",), "moe_token_dispatcher_type (flex: DeepEP / HybridEP, whose route regather cannot "
         "replay)", (B, E, D), "experts", choices=DISPATCHERS, default="alltoall",
         notes={B: "; the CPU bench runs alltoall and allgather"}),
    Flag(("--ep",), "expert parallel size", (B, E, D), "experts", type=positive, default=1),
    Flag(("--etp",), "expert tensor parallel size", (B, E, D), "experts", type=positive, default=1),
    Flag(("--shared-expert-ffn",), "the shared expert's width (0: none)", (B,), "experts", type=non_negative),
    Flag(("--moe-layer-freq",), "every n-th layer is MoE, the others dense (--ffn)", (B,), "experts", type=positive),
    # -- the run ------------------------------------------------------------------------------------------
    Flag(("--front-end",), "megatron: megatron-core's GPT and regather.LoRA; torchtitan: torchtitan's dense llama3 / "
         "qwen3 blocks under its own sharding config, torchtitan's own LoRAConverter as the baseline", (B, E), "run",
         choices=FRONT_ENDS, default="megatron",
         notes={E: " (targets wqkv,wo,w1,w2,w3 and rank 8 unless --targets / --lora-rank say otherwise; Megatron's "
                   "MoE, recipe and attention options do not apply)",
                B: " (torchtitan 0.3.0's llama3, TP + SP, partial_dtensor; ranks = tp; bytes per adapter kind)"}),
    Flag(("--torchtitan",), "= --front-end torchtitan", (B, E), "run", dest="front_end", switch="torchtitan",
         default="megatron"),
    Flag(("--tp",), "tensor parallel size", (M, B, E, D), "run", type=positive, default=2,
         notes={M: " (= the CPU ranks spawned)", B: " (= the CPU ranks spawned; --moe: max(tp, ep x etp))",
                D: " (--build: the CPU ranks spawned)"}),
    Flag(("--no-sp",), "sequence parallelism off", (E, D), "run", dest="sp", switch=False, default=True),
    Flag(("--pp",), "pipeline stages (layers per GPU = layers/pp)", (E, D), "run", type=positive, default=1),
    Flag(("--cp",), "context parallel size: each CP rank's linears see seq/cp tokens of every sample (megatron's "
         "context_parallel_size; it runs through Transformer Engine's attention, so --spec te or --attention fused)",
         (E, D), "run", type=positive, default=1),
    Flag(("--in-flight",), "micro-batches whose activations are alive at once on this GPU (a pipeline schedule's; "
         "1 without pipeline parallelism)", (E, D), "run", type=positive, default=1),
    Flag(("--later-stage",), "this GPU is a later pipeline stage (its input comes from p2p and requires grad; "
         "needs --pp > 1)", (E,), "run", dest="first_stage", switch=False, default=True),
    Flag(("--gpu-memory",), "the GPU's memory in GiB, set beside the per-GPU total (an H100 80 GB: 80)", (E, D),
         "run", type=positive_number, default=80),
    Flag(("--seq",), "sequence length (tokens per sample)", (M, B, E, D), "run", type=positive, defaults={M: 128},
         unset={E: f"8192 for a preset, 32 for {TINY}", D: f"8192 for a preset, 32 for {TINY}"}),
    Flag(("--micro-batch",), "micro-batch size (samples)", (M, B, E, D), "run", type=positive, defaults={M: 4},
         unset={E: f"1 for a preset, 2 for {TINY}", D: f"1 for a preset, 2 for {TINY}"}),
    Flag(("--dtype",), "activation dtype (bf16, fp16, fp32: the same)", (B, E, D), "run",
         choices=tuple(sorted(DTYPE_BYTES)), default="bfloat16", notes={B: "; the CPU bench runs float32 and bfloat16"}),
    Flag(("--grad-dtype",), "LoRA-A's gradient dtype, for lowrank's dA all-reduce", (E,), "run",
         choices=tuple(sorted(DTYPE_BYTES)), unset="--dtype; float32 with gradient-accumulation fusion"),
    Flag(("--input-requires-grad",), "the decoder input requires grad (Megatron Bridge's "
         "maybe_enable_recompute_inputs_grad, HF's enable_input_require_grads): layer 0's producers keep their input, "
         "so its linear_qkv recomputes its input too under recompute_adapter_inputs", (B, E, D), "run", switch=True),
    Flag(("--recipe",), recipe_help(), (E, D), "run", nargs="?", const=True, default=False,
         choices=tuple(sorted(LAYOUTS)), metavar="LAYOUT",
         notes={E: ". The report then sets the targets beside the recipe's and the reference's"}),
    Flag(("--norm-upcasts",), "--front-end torchtitan, bf16/fp16: the norms keep an fp32 copy of their input "
         "(torch's composite rms_norm, as on CPU), so wqkv/w1/w3 keep their shard under -recompute (default: the "
         "norm keeps its input, as CUDA's fused rms_norm)", (E,), "run", switch=True),
    # -- LoRA ---------------------------------------------------------------------------------------------
    Flag(("--strategy",), "what LoRA asks for: gather (Bridge's default), regather "
         "(sequence_parallel_input_regather=True), lowrank", (D,), "lora", choices=STRATEGY_NAMES, default="regather"),
    Flag(("--strategies",), "comma list of strategies and variants: gather, regather, lowrank, each with -recompute "
         "(recompute_adapter_inputs=True); regather-plain (no early re-gather); regather-classic (regather with the "
         "classic output path, lean_transients=False), gather-lean (gather with the lean one); "
         "<strategy>-recompute-redispatch (MoE); torchtitan (torchtitan's own LoRA) and <strategy>[-plain][-recompute] on --front-end torchtitan",
         (B, E), "lora", type=strategies,
         unset={E: "every megatron one: " + ",".join(KNOWN_STRATEGIES[:6]) + "; --front-end torchtitan: "
                   + ",".join(TITAN_VARIANTS),
                B: "every one this build implements, for the model asked; gather always included"}),
    Flag(("--targets",), "comma list of the linears LoRA adapts, by the front end's names: megatron's "
         + ",".join(ALL_TARGETS) + "; CanonicalLoRA's " + ",".join(CANONICAL_TARGETS) + "; torchtitan's "
         + ",".join(TITAN_TARGETS), (B, E, D), "lora", type=targets,
         unset={E: "megatron's four (--front-end torchtitan: its five), or the recipe's",
                D: "megatron's four, or the recipe's",
                B: "megatron's four (--canonical: CanonicalLoRA's seven; --torchtitan: its five)"}),
    Flag(("--lora-rank",), "LoRA rank (Bridge's dim)", (M, B, E, D), "lora", type=positive, defaults={M: 8},
         unset={E: f"16 for a preset, 8 for {TINY} and --front-end torchtitan, or the recipe's dim",
                D: f"16 for a preset, 8 for {TINY}, or the recipe's dim"}),
    Flag(("--lora-alpha",), "LoRA alpha (the update is scaled by alpha / rank; any positive number)", (B,), "lora",
         type=positive_number),
    Flag(("--recompute-adapter-inputs",), "LoRA(recompute_adapter_inputs=True): which adapter inputs are rebuilt in "
         "backward, from what", (D,), "lora", switch=True),
    Flag(("--peft",), "the PEFT scheme: lora, or dora (regather.DoRA, Megatron Bridge's other scheme: a trainable "
         "magnitude per output feature; what it keeps beyond LoRA is reported apart)", (E, D, B), "lora",
         choices=PEFTS, default="lora"),
    Flag(("--dora-output",), "--peft dora: DoRA's pre-magnitude output keep (as Bridge does) or rebuild in backward "
         "(DoRA(recompute_dora_output=True): one more base GEMM per adapter)", (E,), "lora", choices=DORA_OUTPUTS,
         default="keep"),
    Flag(("--recompute-dora-output",), "--peft dora: DoRA(recompute_dora_output=True), the pre-magnitude output "
         "rebuilt in backward instead of kept", (D, B), "lora", switch=True),
    Flag(("--bridge-lora",), "the run uses Megatron Bridge's own LoRA (--strategy regather: with "
         "sequence_parallel_input_regather=True): checks what it asks Transformer Engine for", (D,), "lora",
         switch=True),
    Flag(("--te-version",), "the Transformer Engine version of the run (--spec te: whether recompute releases the "
         "ln_out TE keeps for LoRA)", (E, D), "lora", type=te_version,
         unset={D: "the one installed here, if any", E: "the newest read"}),
    # -- features doctor checks ------------------------------------------------------------------------------
    Flag(("--use-nccl-ub",), "NCCL user-buffer registration (nccl_ub)", (D,), "features", switch=True),
    Flag(("--cuda-graphs",), "CUDA graphs (cuda_graph_impl)", (D,), "features", switch=True),
    Flag(("--cpu-offloading",), "activation offloading to CPU", (D,), "features", switch=True),
    Flag(("--recompute-granularity",), "megatron's activation recompute (recompute_granularity): full checkpoints "
         "whole layers, so nothing inside them (LoRA's inputs included) is kept after the forward; selective the "
         "--recompute-modules", (E, D), "features", choices=("full", "selective"), unset="none"),
    Flag(("--recompute-method",), "megatron's recompute_method (with --recompute-granularity full): uniform = groups "
         "of --recompute-num-layers layers, block = only the first --recompute-num-layers layers", (E, D),
         "features", choices=("uniform", "block"), unset="uniform with --recompute-granularity full (as Bridge's "
                                                         "recipes set it), else none"),
    Flag(("--recompute-num-layers",), "megatron's recompute_num_layers (with --recompute-granularity full)", (E, D),
         "features", type=positive, unset="1 with --recompute-granularity full (as Bridge's recipes set it), else "
                                          "none"),
    Flag(("--recompute-modules",), "comma list, some of " + ", ".join(RECOMPUTE_MODULES) + " (megatron's "
         "recompute_modules, with --recompute-granularity selective; none named: megatron's default, core_attn)",
         (E, D), "features", type=recompute_modules, default=(), unset="none"),

    # -- measurement --------------------------------------------------------------------------------------------
    Flag(("--steps",), "training steps per strategy (the strategies' steps interleaved)", (M, B), "measure",
         type=positive, defaults={M: 30}),
    Flag(("--warmup",), "first steps left out of the time medians", (M, B), "measure", type=non_negative,
         defaults={M: 3}),
    Flag(("--lr",), "learning rate (Adam)", (M,), "measure", type=float, default=3e-3),
    Flag(("--timeout",), "expected seconds, more than 0: ranks still computing are stopped after 3x this "
         "(REGATHER_TEST_TIMEOUT_SCALE), ranks making no progress after 60 s (REGATHER_STALL_TIMEOUT)", (M, B),
         "measure", type=seconds, defaults={M: 170.0}),
    Flag(("--quiet",), "no progress line", (B,), "measure", switch=True),
    Flag(("--ac",), "--front-end torchtitan: torchtitan's activation checkpointing on every block, SelectiveAC or "
         "FullAC (default configs); bytes: the allocator's", (B,), "measure", choices=("none", "selective", "full"),
         default="none"),
    Flag(("--compile",), "--front-end torchtitan: torchtitan's apply_compile (each block, fullgraph=True, inductor); "
         "bytes: the allocator's", (B,), "measure", switch=True),
    # -- output -------------------------------------------------------------------------------------------------
    Flag(("--json",), "the report as JSON (everything in it)", (E, D), "output", switch=True),
    Flag(("--verbose",), "every adapter's decision, one line each", (D,), "output", switch=True),
    Flag(("--build",), f"build the {TINY} GPT on --tp CPU gloo ranks and ask its adapters (regather.decisions, then "
         "each adapter's decision in one training step for the recompute checks)", (D,), "output", switch=True),
    Flag(("--out",), "write bench.json, bench.md (and bench.png) into this folder, created if missing (checked "
         "before the run)", (B,), "output", metavar="DIR", unset="none: the report is printed only"),
    Flag(("--render",), "run nothing: print (and with --out re-write) the reports of an earlier bench.json", (B,),
         "output", metavar="JSON", unset="none: run the bench"),
]


def flags_of(command: str) -> list[Flag]:
    """The flags ``command`` takes, in the table's order."""
    return [f for f in FLAGS if command in f.commands]


def add_flags(parser, command: str, defaults: Mapping[str, Any] | None = None,
              titles: Mapping[str, str] | None = None) -> None:
    """Add ``command``'s flags to its ``parser`` in groups (:data:`GROUPS`, titled ``titles`` where the
    command says more), each with the command's default (``defaults`` by destination, over the table's)
    and ``--version``."""
    from regather import __version__

    for key, title in GROUPS.items():
        mine = [f for f in flags_of(command) if f.group == key]
        if not mine:
            continue
        group = parser.add_argument_group((titles or {}).get(key, title))
        for flag in mine:
            default = (defaults or {}).get(flag.name, flag.default_for(command))
            if flag.switch is True and default is None:
                default = False
            kwargs = {"default": default, "help": flag.help_for(command, default)}
            if flag.dest:
                kwargs["dest"] = flag.dest
            if flag.switch is not _UNSET:
                kwargs.update(action="store_const", const=flag.switch)
            else:
                kwargs.update({k: v for k, v in (("type", flag.type), ("choices", flag.choices),
                                                  ("metavar", flag.metavar), ("nargs", flag.nargs),
                                                  ("const", flag.const)) if v is not None})
            group.add_argument(*flag.names, **kwargs)
    parser.add_argument("--version", action="version", version=f"regather {__version__}")


def add_command(subparsers, command: str, help: str, description: str, **kwargs):
    """The sub-parser of ``command`` with its flags (:func:`add_flags`; ``kwargs``: its ``defaults`` and
    ``titles``), registered on the top parser so that an unknown flag is refused in its name."""
    p = subparsers.add_parser(command, help=help, description=description, formatter_class=HelpFormatter)
    add_flags(p, command, **kwargs)
    return p

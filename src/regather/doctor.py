"""``regather doctor``: the reference's failure-diagnosis table as a command.

For an environment (``os.environ`` by default) and a model/run configuration
it reports findings, each with its fix:

==================== ======== ==================================================
code                 level    when
==================== ======== ==================================================
alloc-conf           warning  ``PYTORCH_CUDA_ALLOC_CONF`` lacks ``expandable_segments:True``
nccl-ub              error    expandable segments with NCCL user-buffer registration
                              (``--use-nccl-ub`` / config ``nccl_ub``)
cuda-graph-register  error    CUDA graphs + expandable segments, ``NCCL_GRAPH_REGISTER`` not ``0``
cpu-offload-pp       error    CPU offloading with pipeline parallelism > 1
regather-off         warning  LoRA + SP keeps full gathered LoRA-A inputs (strategy gather)
                              while adapters could re-gather
regather-no-effect   info     re-gather asked, but SP is off or TP is 1
adapter              info /   every LoRA adapter's decision (strategy used and why);
                     warning  a fallback that is not by design is a warning
saving               info     estimated LoRA-A input memory saved per GPU
==================== ======== ==================================================

Everything is a pure function of an env mapping and a :class:`Setup`, so each
finding is testable without GPUs. Adapter decisions come from the same
:func:`regather.eligibility.unsupported_reason` every adapter runs; with
``--build`` the tiny megatron-core GPT is built on ``tp`` CPU gloo ranks, LoRA
is applied and :func:`regather.decisions` is listed instead.

The saving uses :func:`regather.estimate.adapter_input_bytes` (``s*b*h*e`` on
the gather path against ``s*b*h*e/t`` when re-gathering, i.e.
``s*b*h*e*(t-1)/t`` per adapter and micro-batch in flight), counted only for
the adapters whose decision is not the gather path.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Mapping, Optional

ALL_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
LEVELS = ("info", "warning", "error")


@dataclass(frozen=True)
class Finding:
    code: str
    level: str  # info | warning | error
    message: str
    fix: Optional[str] = None

    def __str__(self) -> str:
        text = f"[{self.level.upper():7}] {self.code}: {self.message}"
        return text + (f"\n          fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class Setup:
    """The run configuration doctor reasons about (megatron / Bridge names where they exist)."""

    # model (defaults: the tiny test GPT)
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 128
    moe: bool = False
    # parallelism and batch
    tp: int = 2
    pp: int = 1
    sp: bool = True
    seq: int = 32
    micro_batch: int = 2
    in_flight: int = 1
    dtype: str = "bfloat16"
    # LoRA
    strategy: str = "regather"
    targets: tuple = ALL_TARGETS
    lora_rank: int = 8
    # features that change eligibility or the allocator
    use_nccl_ub: bool = False
    cuda_graphs: bool = False
    cpu_offloading: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_modules: tuple = ()


# -- environment / configuration findings --------------------------------------------


def alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """``PYTORCH_CUDA_ALLOC_CONF`` (or torch's newer ``PYTORCH_ALLOC_CONF``) as a dict."""
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    out = {}
    for item in raw.split(","):
        if ":" in item:
            k, v = item.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def expandable_segments(env: Mapping[str, str]) -> bool:
    return alloc_conf(env).get("expandable_segments", "").lower() in ("true", "1")


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def nccl_ub_enabled(env: Mapping[str, str], setup: Setup) -> bool:
    """``--use-nccl-ub`` / config ``nccl_ub``, or the env spelling ``REGATHER_NCCL_UB``/``NCCL_UB``."""
    return setup.use_nccl_ub or _truthy(env.get("NCCL_UB", "")) or _truthy(env.get("REGATHER_NCCL_UB", ""))


def env_findings(env: Mapping[str, str], setup: Setup) -> list[Finding]:
    """The allocator / NCCL / offloading rows of the failure-diagnosis table."""
    out = []
    expandable = expandable_segments(env)
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF")
    ub = nccl_ub_enabled(env, setup)
    if not expandable and not ub:
        out.append(Finding(
            "alloc-conf", "warning",
            f"PYTORCH_CUDA_ALLOC_CONF={raw!r} does not set expandable_segments:True: OOM on one rank "
            "despite headroom on others is usually allocator fragmentation",
            "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (zero throughput cost)",
        ))
    if expandable and ub:
        out.append(Finding(
            "nccl-ub", "error",
            f"PYTORCH_CUDA_ALLOC_CONF={raw!r} enables expandable segments together with NCCL user-buffer "
            "registration (--use-nccl-ub / nccl_ub=True): the two are incompatible (RuntimeError)",
            "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF, or disable --use-nccl-ub",
        ))
    graph_register = env.get("NCCL_GRAPH_REGISTER")
    if setup.cuda_graphs and expandable and graph_register != "0":
        out.append(Finding(
            "cuda-graph-register", "error",
            f"CUDA graphs with expandable segments need NCCL_GRAPH_REGISTER=0 "
            f"(it is {graph_register!r}); MCore's CudaGraphManager enforces it on pre-Blackwell GPUs",
            "export NCCL_GRAPH_REGISTER=0",
        ))
    if setup.cpu_offloading and setup.pp > 1:
        out.append(Finding(
            "cpu-offload-pp", "error",
            f"CPU offloading (cpu_offloading=True) with pipeline_model_parallel_size={setup.pp}: "
            "megatron-core raises 'Currently there is no support for Pipeline parallelism with CPU offloading'",
            "set cpu_offloading=False, or pipeline_model_parallel_size=1",
        ))
    return out


# -- adapter decisions -----------------------------------------------------------------


def _config_namespace(setup: Setup):
    """The TransformerConfig attributes eligibility reads."""
    return SimpleNamespace(
        cpu_offloading=setup.cpu_offloading,
        cpu_offloading_activations=True,
        fine_grained_activation_offloading=False,
        cuda_graph_impl="local" if setup.cuda_graphs else "none",
        recompute_granularity=setup.recompute_granularity,
        recompute_method=setup.recompute_method,
        recompute_modules=list(setup.recompute_modules),
    )


def _requested(setup: Setup):
    from regather.strategies import Strategy

    return Strategy.parse(setup.strategy)


def analytic_decisions(setup: Setup) -> dict[str, dict]:
    """``{path: {"requested", "used", "reason"}}`` for every adapter, from the eligibility rules."""
    from regather.eligibility import AdapterFacts, RunState, unsupported_reason
    from regather.strategies import Strategy

    requested = _requested(setup)
    config = _config_namespace(setup)
    state = RunState(training=True, grad_enabled=True, in_recompute=False, lora_a_trainable=True)
    out = {}
    for layer in range(setup.layers // max(setup.pp, 1)):
        for name in setup.targets:
            module = "self_attention" if name in ("linear_qkv", "linear_proj") else "mlp"
            facts = AdapterFacts(
                base_name=name, column_parallel=name in COLUMN_PARALLEL,
                sequence_parallel=setup.sp and setup.tp > 1, tp_size=setup.tp,
                is_expert=setup.moe and module == "mlp",
            )
            reason = None if requested == Strategy.GATHER else unsupported_reason(facts, config, state)
            used = Strategy.GATHER if reason else requested
            out[f"decoder.layers.{layer}.{module}.{name}"] = {
                "requested": requested.value, "used": used.value, "reason": reason}
    return out


def _build_rank(rank, world_size, setup: Setup):
    """Rank body for ``--build``: the tiny GPT with LoRA, then ``regather.decisions``."""
    import dataclasses

    import torch

    from regather.lora import LoRA, decisions
    from regather.strategies import Strategy
    from regather.testing.models import TinyGPT, build_gpt

    overrides = {}
    if setup.recompute_granularity:
        overrides["recompute_granularity"] = setup.recompute_granularity
        if setup.recompute_granularity == "full":
            overrides.update(recompute_method=setup.recompute_method or "uniform", recompute_num_layers=1)
        elif setup.recompute_modules:
            overrides["recompute_modules"] = list(setup.recompute_modules)
    model = build_gpt(TinyGPT(num_layers=setup.layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
                              ffn_hidden_size=setup.ffn, seq_length=setup.seq),
                      setup.tp, setup.sp, torch.float32, **overrides)
    # features a CPU build cannot turn on; eligibility reads them from the shared config
    model.config.cuda_graph_impl = "local" if setup.cuda_graphs else getattr(model.config, "cuda_graph_impl", "none")
    model.config.cpu_offloading = setup.cpu_offloading
    requested = _requested(setup)
    kwargs = dict(target_modules=list(setup.targets), dim=setup.lora_rank, alpha=2 * setup.lora_rank)
    if "strategy" in {f.name for f in dataclasses.fields(LoRA)}:
        kwargs["strategy"] = requested.value
    else:
        kwargs["sequence_parallel_input_regather"] = requested == Strategy.REGATHER
    model = LoRA(**kwargs)(model, training=True)
    return {path: {"requested": d.requested.value, "used": d.used.value, "reason": d.reason}
            for path, d in decisions(model).items()}


def built_decisions(setup: Setup, timeout: float = 180.0) -> dict[str, dict]:
    """Build the GPT on ``setup.tp`` gloo ranks (CPU) and list rank 0's decisions."""
    from regather.testing.dist import run_ranks

    return run_ranks(_build_rank, setup.tp, setup, timeout=timeout)[0]


_BY_DESIGN = ("base layer", "module is in eval mode", "autograd is disabled", "running inside")


def _natural(path: str):
    """Sort key that puts layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def adapter_findings(setup: Setup, decisions: Mapping[str, Mapping]) -> list[Finding]:
    out = []
    for path in sorted(decisions, key=_natural):
        d = decisions[path]
        if d["reason"] is None:
            out.append(Finding("adapter", "info", f"{path}: {d['used']}"))
            continue
        expected = d["reason"].startswith(_BY_DESIGN) or "expert" in d["reason"]
        fix = None if expected else _fix_for_reason(d["reason"])
        out.append(Finding("adapter", "info" if expected else "warning",
                           f"{path}: asked {d['requested']}, uses {d['used']}: {d['reason']}", fix))
    column = [p for p in decisions if p.rsplit(".", 1)[-1] in COLUMN_PARALLEL]
    if setup.strategy == "gather" and setup.sp and setup.tp > 1 and column and not setup.moe:
        out.append(Finding(
            "regather-off", "warning",
            f"LoRA + SP keeps the full gathered LoRA-A input of {len(column)} column-parallel adapter(s) "
            "until backward (strategy 'gather')",
            "LoRA(sequence_parallel_input_regather=True) (or strategy='regather'); check the fallbacks below",
        ))
    if setup.strategy != "gather" and (not setup.sp or setup.tp <= 1):
        out.append(Finding(
            "regather-no-effect", "info",
            f"strategy {setup.strategy!r} has no effect with sequence_parallel={setup.sp}, TP={setup.tp}",
            None,
        ))
    return out


def _fix_for_reason(reason: str) -> Optional[str]:
    if "recompute" in reason:
        return "drop 'mlp' from recompute_modules, or use selective recompute of core_attn instead of full"
    if "CUDA graphs" in reason:
        return "CUDA graphs capture the adapter's collectives; re-gather runs only without them"
    if "offloading" in reason:
        return "turn CPU activation offloading off for re-gather to apply"
    if "frozen" in reason:
        return "make LoRA-A trainable"
    return None


def per_adapter_saving(setup: Setup, target: str = "linear_qkv") -> tuple[int, str]:
    """Bytes one re-gathering adapter saves per GPU (all micro-batches in flight), and how it was computed."""
    try:
        from regather import estimate as est
    except ImportError:
        est = None
    t, e = setup.tp, _dtype_bytes(setup.dtype)
    if est is not None:
        model = est.Model("doctor", hidden=setup.hidden, layers=1, heads=setup.heads, ffn=setup.ffn)
        run = est.Run(tp=t, sp=setup.sp, seq=setup.seq, micro_batch=setup.micro_batch,
                      in_flight=setup.in_flight, dtype=setup.dtype, targets=(target,))
        saved = est.adapter_input_bytes(model, run, "gather")[target] - est.adapter_input_bytes(
            model, run, "regather")[target]
        return saved, "regather.estimate.adapter_input_bytes (gather minus regather)"
    saved = setup.seq * setup.micro_batch * setup.hidden * e * (t - 1) // t * setup.in_flight
    return saved, "s*b*h*e*(t-1)/t per adapter and micro-batch in flight (regather.estimate not available)"


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}[dtype]


def saving_finding(setup: Setup, decisions: Mapping[str, Mapping]) -> Finding:
    local = [p for p, d in decisions.items() if d["used"] != "gather"]
    per, how = per_adapter_saving(setup)
    total = per * len(local)
    return Finding(
        "saving", "info",
        f"estimated LoRA-A input memory saved per GPU: {total:,} bytes ({total / 2**30:.3f} GiB) = "
        f"{len(local)} re-gathering adapter(s) x {per:,} bytes [{how}; s={setup.seq}, b={setup.micro_batch}, "
        f"h={setup.hidden}, t={setup.tp}, {setup.dtype}, {setup.in_flight} micro-batch(es) in flight]",
    )


def diagnose(env: Mapping[str, str], setup: Setup, decisions: Optional[Mapping[str, Mapping]] = None
             ) -> list[Finding]:
    """Every finding for ``env`` and ``setup`` (decisions: analytic unless given)."""
    if decisions is None:
        decisions = analytic_decisions(setup)
    return env_findings(env, setup) + adapter_findings(setup, decisions) + [saving_finding(setup, decisions)]


# -- command line ----------------------------------------------------------------------


def _csv(value: str) -> tuple:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="diagnose allocator/NCCL/offload settings and every LoRA adapter's strategy",
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Setup()
    for flag in ("hidden", "layers", "heads", "ffn", "tp", "pp", "seq", "micro-batch", "in-flight", "lora-rank"):
        p.add_argument(f"--{flag}", type=int, default=getattr(d, flag.replace("-", "_")))
    p.add_argument("--moe", action="store_true", help="the MLPs are experts (fc1/fc2 never re-gather)")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--strategy", default=d.strategy, help="gather | regather | lowrank")
    p.add_argument("--targets", type=_csv, default=",".join(ALL_TARGETS))
    p.add_argument("--use-nccl-ub", action="store_true", help="NCCL user-buffer registration (nccl_ub)")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--cpu-offloading", action="store_true")
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    p.add_argument("--recompute-modules", type=_csv, default=())
    p.add_argument("--build", action="store_true",
                   help="build the GPT on --tp CPU gloo ranks and list regather.decisions(model)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def setup_from_args(args) -> Setup:
    return Setup(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, moe=args.moe,
                 tp=args.tp, pp=args.pp, sp=args.sp, seq=args.seq, micro_batch=args.micro_batch,
                 in_flight=args.in_flight, dtype=args.dtype, strategy=args.strategy, targets=tuple(args.targets),
                 lora_rank=args.lora_rank, use_nccl_ub=args.use_nccl_ub, cuda_graphs=args.cuda_graphs,
                 cpu_offloading=args.cpu_offloading, recompute_granularity=args.recompute_granularity,
                 recompute_method=args.recompute_method, recompute_modules=tuple(args.recompute_modules))


def main(args, env: Optional[Mapping[str, str]] = None) -> int:
    from regather.strategies import Strategy

    setup = setup_from_args(args)
    Strategy.parse(setup.strategy)  # a clear error for an unknown strategy
    env = os.environ if env is None else env
    decisions = built_decisions(setup) if args.build else None
    findings = diagnose(env, setup, decisions)
    if args.json:
        print(json.dumps({"setup": asdict(setup), "findings": [asdict(f) for f in findings]}, indent=1))
    else:
        print(f"regather doctor: TP={setup.tp} PP={setup.pp} SP={'on' if setup.sp else 'off'} "
              f"strategy={setup.strategy} ({'built model' if args.build else 'eligibility rules'})")
        for f in findings:
            print(f)
    return 1 if any(f.level == "error" for f in findings) else 0

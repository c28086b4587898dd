"""``regather doctor``: the reference's failure-diagnosis table as a command.

The command line: the setup's flags (megatron / Bridge names where they exist), the findings as
text or ``--json``; exit status 1 when a finding is an error. The findings are described in
:mod:`regather.tools.doctor`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import asdict

from regather.megatron.reasons import ALL_TARGETS, DISPATCHERS
from regather.tools.doctor.setup import MOE_EXPERTS, Setup


def _csv(value: str) -> tuple:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="diagnose allocator/NCCL/offload settings and every LoRA adapter's strategy",
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Setup(num_experts=MOE_EXPERTS)
    for flag in ("hidden", "layers", "heads", "ffn", "tp", "pp", "seq", "micro-batch", "in-flight", "lora-rank",
                 "num-experts", "moe-ffn", "topk", "ep", "etp"):
        p.add_argument(f"--{flag}", type=int, default=getattr(d, flag.replace("-", "_")))
    p.add_argument("--moe", action="store_true", help="the MLPs are experts (fc1/fc2 never re-gather)")
    p.add_argument("--experts", choices=["sequential", "grouped"], default=d.experts,
                   help="with --moe: SequentialMLP or TEGroupedMLP experts (moe_grouped_gemm)")
    p.add_argument("--dispatcher", choices=DISPATCHERS, default=d.dispatcher, help="moe_token_dispatcher_type")
    p.add_argument("--no-share-expert-adapters", dest="share_expert_adapters", action="store_false",
                   help="grouped experts: one LoRA pair per expert (share_expert_adapters=False)")
    p.add_argument("--redispatch-expert-inputs", action="store_true",
                   help="LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs dispatched again in backward")
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
    p.add_argument("--recompute-adapter-inputs", action="store_true",
                   help="LoRA(recompute_adapter_inputs=True): which adapter inputs are rebuilt in backward, from what")
    p.add_argument("--input-requires-grad", action="store_true",
                   help="the decoder input requires grad (Bridge's maybe_enable_recompute_inputs_grad, HF's "
                        "enable_input_require_grads): layer 0's producers then keep their input")
    p.add_argument("--activation", choices=["gelu", "swiglu"], default=d.activation, help="the MLP's activation")
    p.add_argument("--no-bias", dest="add_bias_linear", action="store_false",
                   help="add_bias_linear=False (Qwen/Llama-style linears without bias)")
    p.add_argument("--bridge-lora", action="store_true",
                   help="the run uses Megatron Bridge's own LoRA (--strategy regather: with "
                        "sequence_parallel_input_regather=True): checks what it asks Transformer Engine for")
    p.add_argument("--te-version", default=None,
                   help="the Transformer Engine version of the run (default: the one installed here, if any)")
    p.add_argument("--build", action="store_true",
                   help="build the GPT on --tp CPU gloo ranks and ask its adapters (regather.decisions, then "
                        "each adapter's decision in one training step for the recompute checks)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def setup_from_args(args) -> Setup:
    """The :class:`Setup` of the flags: ``--num-experts`` counts only with ``--moe``."""
    return Setup(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn,
                 num_experts=args.num_experts if args.moe else 0, experts=args.experts, moe_ffn=args.moe_ffn,
                 topk=args.topk, ep=args.ep, etp=args.etp, dispatcher=args.dispatcher,
                 share_expert_adapters=args.share_expert_adapters,
                 redispatch_expert_inputs=args.redispatch_expert_inputs,
                 tp=args.tp, pp=args.pp, sp=args.sp, seq=args.seq, micro_batch=args.micro_batch,
                 in_flight=args.in_flight, dtype=args.dtype, strategy=args.strategy, targets=tuple(args.targets),
                 lora_rank=args.lora_rank, use_nccl_ub=args.use_nccl_ub, cuda_graphs=args.cuda_graphs,
                 cpu_offloading=args.cpu_offloading, recompute_granularity=args.recompute_granularity,
                 recompute_method=args.recompute_method, recompute_modules=tuple(args.recompute_modules),
                 recompute_adapter_inputs=args.recompute_adapter_inputs,
                 input_requires_grad=args.input_requires_grad, activation=args.activation,
                 add_bias_linear=args.add_bias_linear, bridge_lora=getattr(args, "bridge_lora", False),
                 te_version=getattr(args, "te_version", None) or _installed_te())


def _installed_te() -> str | None:
    from regather.megatron.dense.te import installed_version

    return installed_version()


def main(args, env: Mapping[str, str] | None = None) -> int:
    import json

    from regather.core.strategies import Strategy
    from regather.tools.doctor.built import built_decisions
    from regather.tools.doctor.findings import diagnose

    setup = setup_from_args(args)
    Strategy.parse(setup.strategy)  # a clear error for an unknown strategy
    env = os.environ if env is None else env
    decisions = built_decisions(setup) if args.build else None
    findings = diagnose(env, setup, decisions)
    if args.json:
        print(json.dumps({"setup": {"moe": setup.moe, **asdict(setup)}, "findings": [asdict(f) for f in findings]},
                         indent=1))
    else:
        print(f"regather doctor: TP={setup.tp} PP={setup.pp} SP={'on' if setup.sp else 'off'} "
              f"strategy={setup.strategy}{' + recompute_adapter_inputs' if setup.recompute_adapter_inputs else ''} "
              f"({'built model' if args.build else 'eligibility rules'})")
        for f in findings:
            print(f)
    return 1 if any(f.level == "error" for f in findings) else 0

"""Print the tables of docs/torchtitan.md's "Activation checkpointing and torch.compile" section
(allocator bytes over the frozen model, per rank).

Without arguments: the partial_dtensor tables from the spawn test_titan_ac_compile.py reads
(``Module.parallelize`` and torchtitan's AC / compile calls, no FSDP)::

    PYTHONPATH=src:.:tests/distributed/torchtitan .venv/bin/python tests/distributed/torchtitan/measure_titan_ac.py

With ``--backend {spmd_types,partial_dtensor,full_dtensor}``: the per-backend tables, through
torchtitan's own parallelize_llama with FSDP2 (what test_titan_spmd.py runs on spmd_types), one
spawn per setting; a setting that fails on this torch prints its error instead of a table::

    PYTHONPATH=src:.:tests/distributed/torchtitan .venv-torch214/bin/python \\
        tests/distributed/torchtitan/measure_titan_ac.py --backend spmd_types
"""

import argparse

import torch
import workers_titan_ac as W
from tests.harness.numerics import max_rel_err

from regather.tools.cpu.dist import run_ranks


def _plain(name: str) -> str:
    """A parameter name without the wrappers' segments (checkpoint_wrapper's, torch.compile's)."""
    return ".".join(p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod"))


def _table(setting: str, runs: dict, fp64: dict, names: list[str]) -> None:
    titan = runs["torchtitan"]
    frozen = runs.get("frozen")
    print(f"\n{setting}\n| run | over the frozen model, KiB per rank | loss, LoRA gradients vs torchtitan's |")
    print("|---|---:|---|")
    for name in names:
        if name == "frozen":
            continue
        r = runs[name]
        exact = torch.equal(r["loss"], titan["loss"]) and all(torch.equal(r["grads"][n], g)
                                                               for n, g in titan["grads"].items())
        grads = {_plain(n): g for n, g in r["grads"].items()}
        worst = max(max_rel_err(grads[_plain(n)].double(), g) for n, g in fp64["grads"].items())
        same = "(reference)" if name == "torchtitan" else ("bit-identical" if exact else
                                                           f"max rel. error vs fp64 {worst:.1e}")
        over = f"{(r['alive'] - frozen['alive']) / 1024:+,.1f}" if frozen else f"{(r['alive'] - titan['alive']) / 1024:+,.1f} vs torchtitan's"
        print(f"| {name} | {over} | {same} |")
    w1 = {n: {_plain(p): d for p, d in r["decisions"].items()}.get("layers.0.feed_forward.w1")
          for n, r in runs.items() if r["decisions"]}
    print("decisions (layers.0.feed_forward.w1):", w1)


def partial_dtensor_tables() -> None:
    res = run_ranks(W.ac_compile_suite, 2, timeout=900)[0]
    for setting in ("selective", "full", "compile", "aot_eager"):
        _table(setting, res[setting], res["fp64"]["torchtitan"], W.SUITE[setting])


def backend_tables(backend: str, settings: list[str], dp_shard: int) -> None:
    fp64 = run_ranks(W.spmd_group_suite, 2, ["fp64"], timeout=900)[0]["fp64"]["torchtitan"]
    print(f"backend {backend}, torch {torch.__version__}, parallelize_llama with FSDP2, dp_shard {dp_shard} x TP2, "
          f"{2 * dp_shard} gloo ranks")
    for setting in settings:
        try:
            res = run_ranks(W.spmd_group_suite, 2 * dp_shard, [setting], backend, True, timeout=1500)[0]
        except Exception as exc:
            print(f"\n{setting}: fails: {str(exc).splitlines()[0][:400]}")
            continue
        _table(setting, res[setting], fp64, list(res[setting]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("spmd_types", "partial_dtensor", "full_dtensor"))
    parser.add_argument("--settings", default=",".join(s for s in W.SPMD_SUITE if s != "fp64"),
                        help="comma-separated settings of workers_titan_ac.SPMD_SUITE (with --backend)")
    parser.add_argument("--dp-shard", type=int, default=1, help="FSDP2's dp_shard (with --backend): 2 * dp_shard ranks")
    args = parser.parse_args()
    if args.backend is None:
        partial_dtensor_tables()
    else:
        backend_tables(args.backend, args.settings.split(","), args.dp_shard)


if __name__ == "__main__":
    main()

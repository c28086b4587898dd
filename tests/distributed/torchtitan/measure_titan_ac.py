"""Print the tables of docs/torchtitan.md's "Activation checkpointing and torch.compile" section from
the spawn test_titan_ac_compile.py reads (allocator bytes over the frozen model, per rank):

    PYTHONPATH=src:.:tests/distributed/torchtitan .venv/bin/python tests/distributed/torchtitan/measure_titan_ac.py
"""

import torch
import workers_titan_ac as W
from tests.harness.numerics import max_rel_err

from regather.tools.cpu.dist import run_ranks


def _plain(name: str) -> str:
    """A parameter name without the wrappers' segments (checkpoint_wrapper's, torch.compile's)."""
    return ".".join(p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod"))


def main() -> None:
    res = run_ranks(W.ac_compile_suite, 2, timeout=900)[0]
    fp64 = res["fp64"]["torchtitan"]
    for setting in ("selective", "full", "compile", "aot_eager"):
        runs = res[setting]
        titan = runs["torchtitan"]
        print(f"\n{setting}\n| run | over the frozen model, KiB per rank | loss, LoRA gradients vs torchtitan's |")
        print("|---|---:|---|")
        for name in W.SUITE[setting][1:]:
            r = runs[name]
            exact = torch.equal(r["loss"], titan["loss"]) and all(torch.equal(r["grads"][n], g)
                                                                   for n, g in titan["grads"].items())
            grads = {_plain(n): g for n, g in r["grads"].items()}
            worst = max(max_rel_err(grads[_plain(n)].double(), g) for n, g in fp64["grads"].items())
            same = "(reference)" if name == "torchtitan" else ("bit-identical" if exact else
                                                               f"max rel. error vs fp64 {worst:.1e}")
            print(f"| {name} | {(r['alive'] - runs['frozen']['alive']) / 1024:+,.1f} | {same} |")
        print("decisions (regather):", runs.get("regather", {}).get("decisions", {}))


if __name__ == "__main__":
    main()

"""Print the bytes table of docs/torchtitan.md: torchtitan's LoRA against regather's on the llama3
debugmodel (2 layers, TP2 + SP, 2 gloo ranks), per rank, from the same spawn the tests read.

    PYTHONPATH=tests/distributed/torchtitan .venv/bin/python tests/distributed/torchtitan/measure_titan.py
"""

import torch
import workers_titan as W

from regather.tools.cpu.dist import run_ranks


def main() -> None:
    res = run_ranks(W.llama3_suite, 2, timeout=300)[0]
    frozen, titan = res["frozen"], res["torchtitan"]
    print("| run | saved KiB per rank | over the frozen model | loss, LoRA gradients vs torchtitan's |")
    print("|---|---:|---:|---|")
    for name in ["frozen", "torchtitan", *W.LLAMA3_RUNS]:
        r = res[name]
        if name in ("frozen", "torchtitan"):
            same = "—" if name == "frozen" else "(reference)"
        else:
            exact = torch.equal(r["loss"], titan["loss"]) and all(
                torch.equal(r["grads"][n], g) for n, g in titan["grads"].items())
            worst = max((r["grads"][n] - g).abs().max().item() for n, g in titan["grads"].items())
            same = "bit-identical" if exact else f"max abs diff {worst:.1e}"
        print(f"| {name} | {r['saved'] / 1024:,.1f} | {(r['saved'] - frozen['saved']) / 1024:+,.1f} | {same} |")


if __name__ == "__main__":
    main()

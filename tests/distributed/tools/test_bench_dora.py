"""``regather bench --peft dora`` on two gloo ranks, and byte-for-byte agreement with ``regather estimate
--peft dora``: what DoRA's magnitude keeps (``dora_output:<base>`` saved bytes: the pre-magnitude output, its
scale and norm; only the latter two with ``--recompute-dora-output``) per strategy, the LoRA-A inputs as LoRA's."""

from dataclasses import replace

import pytest

from regather.tools.bench import runner
from regather.tools.estimate import Model, Run, estimate
from regather.tools.shapes import ModelShape, RunShape, shape_fields

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
STRATEGIES = ("gather", "regather", "lowrank", "regather-recompute")


@pytest.mark.parametrize("rebuild", [False, True], ids=["keep", "rebuild"])
def test_dora_bench_agrees_with_estimate(rebuild):
    spec = runner.BenchSpec(steps=2, warmup=1, strategies=STRATEGIES, quiet=True, timeout=150, peft="dora",
                            recompute_dora_output=rebuild)
    summary = runner.run(spec)
    model = Model(name="tiny", gated_mlp=False, **shape_fields(ModelShape, spec))  # bench's GPT: not gated
    run = replace(Run(**shape_fields(RunShape, spec)), peft="dora", dora_output="rebuild" if rebuild else "keep")
    est = estimate(model, run, STRATEGIES)
    for name, e in est.items():
        row = summary["strategies"][name]
        assert row["saved_dora_output_bytes"] == e["dora_output_bytes"], (name, row["saved_bytes_by_label"])
        assert row["saved_adapter_input_bytes"] == e["adapter_input_bytes"], name
        if not rebuild:  # z kept: at least one [s, b, o/t] per column adapter
            assert row["saved_dora_output_bytes"] >= spec.seq * spec.micro_batch * spec.ffn // spec.tp * 4, name
        assert row["max_rel_grad_diff"] < 1e-4, name  # the same function (another norm / token-sum order)

"""regather's torchtitan front end under torchtitan's activation checkpointing: its SelectiveAC (the
trainer's default) and its FullAC, on the real torchtitan 0.3.0, llama3 debugmodel cut to 2 layers, TP2 + SP,
2 gloo ranks, LoRA r8 on every linear; one spawn (workers_titan_ac.ac_compile_suite, the eager settings;
the compiled ones are test_titan_ac_compile.py's, a spawn of their own so the two run side by side). Bytes:
the allocator's, alive at the end of the forward, over the frozen model (saved-tensor hooks are blind inside
checkpoints).

Measured here (KiB per rank over the frozen model): SelectiveAC torchtitan's LoRA +2,080, every regather
variant +0.1; FullAC +0.1 for all.
"""

import pytest

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)

import workers_titan_ac as W

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
RANK_R_ONE = 2 * 128 * 8 * 4        # one rank-r tensor [b, s, r] fp32: 8 KiB
RANK_R_MODEL = 10 * RANK_R_ONE       # the ten of the model: 80 KiB


@pytest.fixture(scope="module")
def suite():
    return run_ranks(W.ac_compile_suite, 2, ("selective", "full"), timeout=300)


def _over_frozen(runs: dict, name: str) -> int:
    return runs[name]["alive"] - runs["frozen"]["alive"]


@pytest.mark.parametrize("setting", ["selective", "full"])
def test_activation_checkpointing_every_strategy_runs_bit_identical_at_no_new_bytes(suite, setting):
    for ranks in suite:
        runs = ranks[setting]
        titan = _over_frozen(runs, "torchtitan")
        for name in W.SUITE[setting][2:]:
            W.bit_identical(runs[name], runs["torchtitan"])  # the same ops, recomputed
            ours = _over_frozen(runs, name)
            # the frozen model's own cache unchanged: LoRA adds at most its rank-r tensors
            assert ours <= RANK_R_MODEL, (setting, name, ours)
            if setting == "selective":
                assert ours <= 0.05 * titan, (name, ours, titan)
        assert len(runs["regather"]["decisions"]) == 10


def test_selective_ac_torchtitans_lora_shifts_the_cache_ours_does_not(suite):
    runs = suite[0]["selective"]
    # torchtitan's LoRA matmuls enter the every-second-matmul count: the cache grows by MiBs
    assert _over_frozen(runs, "torchtitan") > 1024 * 1024



"""Assertions on the per-rank results of ``integration_cases.run_cases``, and the test
class every topology file instantiates (``class TestTP2(TopologyTests): TOPOLOGY = "tp2"``).

Bit-exact (``rtol=0, atol=0``) wherever the maths is the same GEMMs (regather, plain
regather, shared regather against shared gather); lowrank and the shared gather against
the plain gather sum in another order, so they are held to a relative error of 1e-6 in
fp32 on the first step and 3e-6 after it (``integration_cases.tolerance``).
"""

from __future__ import annotations

import pytest
import torch
from integration_cases import (
    CASES,
    CONTROL,
    MICRO_BATCHES,
    RECOMPUTE_TWIN,
    SYNC_TWIN,
    TOPOLOGIES,
    cases_for,
    reference_of,
    run_cases,
    runs_for,
    tolerance,
)
from tests.harness.spawn_groups import SpawnGroups

REL_FUSED_WGRAD = 1e-6  # megatron's fused wgrad (one GEMM into main_grad) vs GEMM + add
# One spawn per case group (``case_groups``), run by the first test that asks for one of its
# runs: a test pays for one group, not for the topology's whole matrix (the whole TP=2 x DP=2
# matrix in one spawn took 149 s inside ``make test`` on 2 cores, a fifth of its 720 s ceiling;
# spawn_groups says more). run_ranks' ``timeout`` is what one group should take (21-47 s measured
# per group inside the integration run on 2 cores); its hard ceiling is 3x that, hangs are caught
# by its stall check; a failing pipeline run may add megatron's 30-s group timeout per failing
# strategy.
SPAWN_TIMEOUT = 240
TEST_TIMEOUT = 900  # the group's spawn runs inside the test that first asks for it
ELIGIBLE = ("linear_qkv", "linear_fc1")  # column-parallel bases: the strategies apply there


def case_groups(topology: str) -> list[list[str]]:
    """The topology's cases, one spawn each, but ``param_gather`` and ``param_sync`` together (the
    test that compares them asks for both)."""
    groups: list[list[str]] = []
    for case in cases_for(topology):
        if case == "param_sync" and groups and groups[-1] == ["param_gather"]:
            groups[-1].append(case)
        else:
            groups.append([case])
    return groups


def spawn(topology: str) -> SpawnGroups:
    return SpawnGroups(run_cases, TOPOLOGIES[topology].world, case_groups(topology), topology,
                       timeout=SPAWN_TIMEOUT)


# -- helpers ---------------------------------------------------------------------------


def results(ranks, case, strategy) -> list[dict]:
    """Every rank's result of one run; fails the test with the most telling rank's error."""
    runs = [r["runs"][(case, strategy)] for r in ranks.ranks(case)]
    errors = [run["error"] for run in runs if run["error"] is not None]
    if errors:
        # the cause first: a rank that raised, before ranks that only waited for it (a p2p /
        # collective timeout) or saw a failure elsewhere
        def rank_of(e):
            return ("other rank(s)" in e, "Timed out" in e)

        errors.sort(key=rank_of)
        last_lines = sorted({e.strip().splitlines()[-1] for e in errors})
        pytest.fail(f"{case}/{strategy} failed on {len(errors)} rank(s): {last_lines}\n{errors[0]}",
                    pytrace=False)
    return [run["result"] for run in runs]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def same(got, ref, what: str, rel: float | None) -> None:
    """Bit-identical when ``rel`` is None, else norm-relative error <= ``rel``."""
    if isinstance(got, torch.Tensor):
        assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape} vs {ref.shape}"
        if rel is None:
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
        else:
            err = _rel(got, ref)
            assert err <= rel, f"{what}: relative error {err:.3g} > {rel:g}"
        return
    if isinstance(got, dict):
        assert got.keys() == ref.keys(), f"{what}: {sorted(got)} vs {sorted(ref)}"
        for k in ref:
            same(got[k], ref[k], f"{what} {k}", rel)
        return
    if isinstance(got, (list, tuple)):
        assert len(got) == len(ref), f"{what}: {len(got)} vs {len(ref)} entries"
        for i, (g, r) in enumerate(zip(got, ref)):
            same(g, r, f"{what}[{i}]", rel)
        return
    if rel is None or ref is None:
        assert got == ref, f"{what}: {got!r} != {ref!r}"
    else:
        assert abs(got - ref) <= rel * abs(ref), f"{what}: {got!r} vs {ref!r} (rel > {rel:g})"


def _expected_decision(strategy: str, path: str, first_chunk: bool = False) -> str | None:
    """The decision of an eligible adapter (None: not checked). ``first_chunk``: the chunk holding
    the embedding (pipeline rank 0, chunk 0), whose first layer's input needs no gradient."""
    recompute = strategy in RECOMPUTE_TWIN
    base = RECOMPUTE_TWIN.get(strategy, strategy)
    used = {"regather-plain": "regather", "regather-shared": "regather", "gather-shared": "gather",
            "lowrank-finalize": "lowrank"}.get(base, base)
    name = path.rsplit(".", 1)[-1]
    if not recompute:
        return used if path.endswith(ELIGIBLE) else None
    if name in ("linear_fc2", "linear_proj"):
        head = "gather" if used == "gather" else ROW_FALLBACK.format(used, name)
        return head + (RECOMPUTED_FC2 if name == "linear_fc2" else KEPT.format(NO_PRODUCER))
    if used == "gather":
        return "gather" + KEPT.format(GATHER_PATH)
    if name == "linear_qkv" and first_chunk and ".layers.0." in path:
        return used + KEPT.format(FROZEN_INPUT)
    return used + ", input recomputed from " + ("input_layernorm" if name == "linear_qkv" else "pre_mlp_layernorm")


ROW_FALLBACK = "gather (asked {}: base layer {!r} is row-parallel (its input is split over hidden, not sequence))"
RECOMPUTED_FC2 = ", input recomputed from the MLP activation (gelu)"
KEPT = ", input kept (recompute asked: {})"
GATHER_PATH = ("the gather path keeps its input as it is (recompute of a column-parallel adapter's input needs "
               "regather or lowrank)")
NO_PRODUCER = "linear_proj has no recomputable producer (only linear_qkv, linear_fc1 and linear_fc2 do)"
FROZEN_INPUT = "input_layernorm: it keeps nothing for its backward (neither its input nor its weights need a gradient)"


def dp_groups(res: list[dict]) -> dict:
    """(tp rank, pp rank) -> [result of each DP replica]."""
    groups: dict = {}
    for r in res:
        c = r["coords"]
        groups.setdefault((c["tp"], c["pp"]), []).append(r)
    return groups


# -- the tests each topology runs ------------------------------------------------------


class TopologyTests:
    """Subclass with ``TOPOLOGY = "<name in integration_cases.TOPOLOGIES>"``."""

    TOPOLOGY: str = ""

    @pytest.fixture(scope="class")
    def ranks(self):
        return spawn(self.TOPOLOGY)

    @pytest.fixture
    def topo(self):
        return TOPOLOGIES[self.TOPOLOGY]

    # parametrised per class by conftest.pytest_generate_tests: run = (case, strategy)
    @pytest.mark.timeout(TEST_TIMEOUT)
    def test_run_matches_reference(self, ranks, run):
        """Losses, fp32 main_grads (after finalize_model_grads), parameters (after each
        optimizer step) and the LoRA weights each forward read, against the case's
        gather run; the strategy really ran on the eligible adapters."""
        case, strategy = run
        got = results(ranks, case, strategy)
        if strategy == CONTROL:
            assert all(r["decisions"] == {} for r in got)
            return
        ref = results(ranks, case, reference_of(strategy))
        # right after an optimizer step with an overlapped param gather only this rank's shard
        # of each bucket is updated (the rest arrives in the next forward): those weights are
        # compared as read ("used") and after the final synchronous gather ("final_param")
        check_param = not CASES[case].ddp.overlap_param_gather
        for rank, (g, r) in enumerate(zip(got, ref)):
            assert g["coords"] == r["coords"]
            for path, decision in g["decisions"].items():
                first_chunk = g["coords"]["pp"] == 0 and path.startswith("chunk0.")
                want = _expected_decision(strategy, path, first_chunk)
                if want is not None:
                    assert decision == want, f"rank {rank} {path}: {decision} (wanted {want})"
            where = f"rank {rank} {case}/{strategy} vs {reference_of(strategy)}"
            for step in range(len(r["main_grad"])):
                rel = tolerance(strategy, step)
                same(g["loss"][step], r["loss"][step], f"{where} step {step} loss", rel)
                same(g["main_grad"][step], r["main_grad"][step], f"{where} step {step} main_grad", rel)
                same(g["used"][step], r["used"][step], f"{where} step {step} used", rel)
                if check_param:
                    same(g["param"][step], r["param"][step], f"{where} step {step} param", rel)
            same(g["final_param"], r["final_param"], f"{where} final_param", tolerance(strategy, 1))

    # parametrised per class by conftest.pytest_generate_tests: rc_run = a recompute run whose
    # twin (same strategy without recompute) is in the same case
    @pytest.mark.timeout(TEST_TIMEOUT)
    def test_recompute_matches_its_twin_exactly(self, ranks, rc_run):
        """recompute_adapter_inputs changes where LoRA-A's input comes from, never a value: every
        loss, main_grad, used weight and parameter bit-identical to the same strategy without
        recompute in the same case (lowrank included)."""
        case, strategy = rc_run
        twin = RECOMPUTE_TWIN[strategy]
        got, ref = results(ranks, case, strategy), results(ranks, case, twin)
        for rank, (g, r) in enumerate(zip(got, ref)):
            where = f"rank {rank} {case}/{strategy} vs {twin}"
            for key in ("loss", "main_grad", "used", "final_param"):
                same(g[key], r[key], f"{where} {key}", None)
            if not CASES[case].ddp.overlap_param_gather:
                same(g["param"], r["param"], f"{where} param", None)

    @pytest.mark.timeout(TEST_TIMEOUT)
    def test_run_trains_consistently(self, ranks, run):
        """Every micro-batch of a step read the same LoRA weights; the optimizer changed them;
        with overlapped grad reduce the LoRA parameters span several DDP buckets;
        without an overlapped param gather the next forward reads what the step wrote; the
        loss exists on the last stage only; DP replicas read and end with the same weights."""
        case, strategy = run
        got = results(ranks, case, strategy)
        overlapped = CASES[case].ddp.overlap_param_gather
        for rank, g in enumerate(got):
            if CASES[case].ddp.overlap_grad_reduce:  # small buckets: several per bucketed chunk
                # (megatron buckets only the first chunk of the first stage; one bucket elsewhere)
                assert g["buckets"][0] >= (3 if g["coords"]["pp"] == 0 else 1), g["buckets"]
                assert all(n == 1 for n in g["buckets"][1:]), g["buckets"]
            assert all(all(step.values()) for step in g["used_consistent"]), f"rank {rank}"
            assert (g["loss"][0] is not None) == g["coords"]["last_stage"]
            if g["loss"][0] is not None:
                assert all(len(step) == MICRO_BATCHES for step in g["loss"])
                assert all(torch.isfinite(torch.tensor(step)).all() for step in g["loss"])
            for step in range(len(g["param"])):
                changed = [n for n in g["param"][step]
                           if not torch.equal(g["param"][step][n],
                                              (g["param"][step - 1] if step else g["initial_param"])[n])]
                assert changed, f"rank {rank} step {step}: the optimizer changed nothing"
            if not overlapped:
                for step in range(1, len(g["used"])):
                    for key, (a, b) in g["used"][step].items():
                        name = f"{key}.adapter.linear_in.weight"
                        same(a, g["param"][step - 1][name], f"rank {rank} step {step} {key} A", None)
                        same(b, g["param"][step - 1][name.replace("linear_in", "linear_out")],
                             f"rank {rank} step {step} {key} B", None)
        for coords, replicas in dp_groups(got).items():
            for other in replicas[1:]:
                where = f"{case}/{strategy} TP/PP rank {coords}: DP replicas"
                same(other["used"], replicas[0]["used"], f"{where} used", None)
                same(other["final_param"], replicas[0]["final_param"], f"{where} final_param", None)

    @pytest.mark.timeout(TEST_TIMEOUT)
    def test_layout(self, ranks, topo):
        """The schedule megatron picked and the layers each chunk holds."""
        g = results(ranks, "sync", "gather")
        schedule = ("forward_backward_no_pipelining" if topo.pp == 1 else
                    "forward_backward_pipelining_with_interleaving" if topo.vpp else
                    "forward_backward_pipelining_without_interleaving")
        chunks = topo.vpp or 1
        per_chunk = topo.num_layers // (topo.pp * chunks)
        for r in g:
            assert r["schedule"] == schedule
            pp = r["coords"]["pp"]
            want = [[1 + (v * topo.pp + pp) * per_chunk + i for i in range(per_chunk)] for v in range(chunks)]
            assert r["layers"] == want

    @pytest.mark.timeout(TEST_TIMEOUT)
    def test_megatron_control_fused_and_overlapped(self, ranks):
        """Megatron's own trainable linears through the same DDP / fusion / overlap setup: the
        harness works without adapters (fused wgrad stand-in, dummy wgrad under overlap)."""
        fused, plain = results(ranks, "overlap_fused", CONTROL), results(ranks, "sync", CONTROL)
        for rank, (f, p) in enumerate(zip(fused, plain)):
            if p["loss"][0] is not None:  # same weights, same batch: the first losses agree
                same(f["loss"][0], p["loss"][0], f"rank {rank} step 0 loss", None)
            same(f["main_grad"], p["main_grad"], f"rank {rank} main_grad", REL_FUSED_WGRAD)


class ParamGatherTests:
    """DP > 1 only: the distributed optimizer with an overlapped param all-gather."""

    @pytest.mark.timeout(TEST_TIMEOUT)
    @pytest.mark.parametrize("strategy", CASES["param_gather"].strategies)
    def test_overlapped_param_gather_reads_the_synchronous_weights(self, ranks, strategy):
        """With overlap_param_gather the forward must read exactly the weights the synchronous
        param all-gather (same options, overlap off) gives it, on every step."""
        got = results(ranks, "param_gather", strategy)
        twin = SYNC_TWIN.get(strategy, strategy)
        ref = results(ranks, "param_sync", twin)
        for rank, (g, r) in enumerate(zip(got, ref)):
            same(g["used"], r["used"], f"rank {rank} param_gather/{strategy} vs param_sync/{twin} used", None)
            same(g["final_param"], r["final_param"], f"rank {rank} final_param", None)


def generate(metafunc) -> None:
    """``pytest_generate_tests`` body: ``run`` = every (case, strategy) of the class's topology."""
    cls = metafunc.cls
    if cls is None:
        return
    pairs = runs_for(cls.TOPOLOGY)
    if "run" in metafunc.fixturenames:
        metafunc.parametrize("run", pairs, ids=[f"{c}-{s}" for c, s in pairs])
    if "rc_run" in metafunc.fixturenames:
        rc = [(c, s) for c, s in pairs if RECOMPUTE_TWIN.get(s) in CASES[c].strategies]
        metafunc.parametrize("rc_run", rc, ids=[f"{c}-{s}" for c, s in rc])



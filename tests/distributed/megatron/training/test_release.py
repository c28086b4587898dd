"""Many training runs in one process (the integration matrices train up to 30 per spawn): each
run's model, DDP, optimizer and process groups are freed when the next run sets up, on the
megatron-core this runs against (0.16.1 in ``make test``, 0.19.2 in ``make test-compat``).

Before ``megatron_train.release_training`` and the RotaryEmbedding cache clear, every run left
its groups alive (three gloo threads per group): on TP=2 x DP=2 under 0.19.2 a rank had 1,061
threads by the end of the matrix, and the load they made on 2 cores ran the matrix past its
ceiling. Counted here: the gloo threads of a rank after each run's teardown, which must be
those of the default group alone, and weak references to the run's DDP and optimizer.
"""

import pytest

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> int:
    import os

    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() in GLOO_THREADS
        except OSError:  # the thread just ended
            pass
    return n


def runs_then_teardown(rank, world_size, runs):
    """Trains ``runs`` (case, strategy) of the tp2 matrix; after each, tears down and counts."""
    import weakref

    import torch.distributed as dist
    from integration_cases import spec_for
    from tests.harness import megatron_train as mt
    from tests.harness.megatron_train import build as mt_build  # where train() looks build_optimizer up

    mt.warm_up()
    before = gloo_threads()  # the default group's threads (and nothing else yet)
    built = []
    build = mt_build.build_optimizer

    def recording_build(model, spec):  # weak references to what each run builds
        optimizer = build(model, spec)
        built.append([weakref.ref(m) for m in model] + [weakref.ref(optimizer)])
        return optimizer

    mt_build.build_optimizer = recording_build
    out = []
    try:
        for case, strategy in runs:
            _result, error = mt.train_agreed(spec_for("tp2", case, strategy))
            live_groups = len(dist.distributed_c10d._world.pg_map)
            mt.teardown_parallel()
            out.append({"run": (case, strategy), "error": error, "groups_while_built": live_groups,
                        "groups_after": len(dist.distributed_c10d._world.pg_map),
                        "gloo_threads_after": gloo_threads(),
                        "alive_after": sum(r() is not None for r in built[-1])})
    finally:
        mt_build.build_optimizer = build
    return {"before": before, "runs": out}


# the overlapped grad reduce + distributed optimizer case leaked most (its optimizer holds
# views of the params); megatron's own trainable linears and regather's adapters both
RUNS = [("overlap_fused", "megatron"), ("overlap_fused", "regather"), ("sync", "lowrank"),
        ("overlap_fused", "regather-rc")]


def test_each_run_frees_its_model_optimizer_and_groups():
    ranks = run_ranks(runs_then_teardown, 2, RUNS, timeout=120)
    for rank, res in enumerate(ranks):
        assert res["before"] > 0, "no gloo thread counted for the default group: the count is broken"
        for run in res["runs"]:
            assert run["error"] is None, run["error"]
            assert run["groups_while_built"] > 1, run  # megatron's groups existed during the run
            assert run["groups_after"] == 1, run  # the default group only
            assert run["alive_after"] == 0, f"rank {rank}: {run}: DDP chunks or optimizer still alive"
            assert run["gloo_threads_after"] == res["before"], f"rank {rank}: {run} vs {res['before']} before"

"""``regather.DoRA`` / ``regather.bridge.DoRA`` against Megatron Bridge 0.6.2's own ``DoRA`` (issue 47).

- Where Bridge is right — column-parallel bases (``linear_qkv``, ``linear_fc1``) at TP2 with SP on and off,
  every base at TP1 — regather's gather path (``regather.DoRA`` and ``regather.bridge.DoRA`` through Bridge's
  PEFT protocol) is Bridge's bit for bit: logits, per-token loss, decoder-input gradient, every LoRA and
  magnitude gradient. regather + ``recompute_adapter_inputs`` + ``recompute_dora_output`` (another norm and token-sum order; ``z``
  rebuilt from the inputs the norms and the MLP activation keep) is within the fp64 rule of a float64
  ``regather.DoRA`` with the same weights.
- Row-parallel bases at TP2 + SP: Bridge takes each rank's *slice* norm ``||W0_i + s·B A_i||`` (no sum over
  TP: the function depends on the TP size) and leaves the row magnitude's gradient as this rank's sequence
  shard's part (no TP sum: megatron sums only parameters tagged ``sequence_parallel``, so Bridge's TP
  replicas of the magnitude drift apart). ``dora_norm="per_rank_slice"`` reproduces Bridge's forward bit for
  bit and every gradient but the row magnitudes', which are the TP sum of Bridge's; the default whole-row
  norm is within the fp64 rule of float64 where Bridge is far off.
- On the TE model (column bases, TP2 + SP) Bridge's DoRA asks TE for the gathered LayerNorm output: right
  on TE <= 2.3 (its forward is regather's gather path's bit for bit; its gradients below a fused norm sum
  LoRA's share before TE's reduce-scatter, regather's after: the fp64 rule), its decoder input gradient lost
  on TE >= 2.4; regather's strategies take the local output and are right on both. At TP1 (all four
  linears, nothing gathered) regather's gather path is Bridge's bit for bit on the TE model too.

Two spawns of two gloo ranks (workers_bridge_dora)."""

import pytest
import torch
from tests.harness.bridge_env import INSTALL_HINT, bridge_available
from tests.harness.numerics import check_rounding, max_rel_err
from workers_bridge_dora import parity_worker, te_worker

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(600)]
EXACT = dict(rtol=0, atol=0)
ROW_MAGNITUDES = ("linear_proj.adapter.weight_magnitude", "linear_fc2.adapter.weight_magnitude")


@pytest.fixture(scope="module")
def parity():
    return run_ranks(parity_worker, 2, timeout=360)


@pytest.fixture(scope="module")
def te():
    return run_ranks(te_worker, 2, timeout=360)


def _same(a, b, what, skip=()):
    for key in ("logits", "loss", "input_grad"):
        torch.testing.assert_close(a[key], b[key], **EXACT, msg=f"{what}: {key}")
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in b["grads"].items():
        if not any(s in name for s in skip):
            torch.testing.assert_close(a["grads"][name], grad, **EXACT, msg=f"{what}: {name}")


def _fp64(got, same, fp64, what, rank=0):
    for key in ("logits", "loss", "input_grad"):
        check_rounding(got[key], same[key], fp64[key], f"{what}: {key}")
    for name, grad in fp64["grads"].items():
        mine = got["grads"][name]
        if mine.shape != grad.shape:  # lowrank's replicated LoRA-A [r, h]: this rank's rows
            mine = mine.chunk(2, 0)[rank]
        check_rounding(mine, same["grads"][name], grad, f"{what}: {name}")


@pytest.mark.parametrize("layout", ["tp2sp-column", "tp2-column", "tp1-all"])
def test_gather_path_is_bridges_dora_bit_for_bit(parity, layout):
    for res in parity:
        r = res[layout]
        assert len(r["bridge"]["grads"]) == 3 * (2 if "column" in layout else 4) * 2  # A, B, magnitude per adapter
        assert any(n.endswith("weight_magnitude") for n in r["bridge"]["grads"])
        for name in ("classic", "rb"):
            _same(r[name], r["bridge"], f"rank {res['rank']} {layout} {name}")
        _fp64(r["regather"], r["classic"], r["fp64"], f"rank {res['rank']} {layout} regather + rebuild")
        assert r["types"] == ["regather.megatron.dense.dora.DoRALinear"]


def test_row_bases_at_tp2_per_slice_option_is_bridges_forward(parity):
    """Bridge's forward bit for bit; every gradient too but the row magnitudes', which Bridge leaves as each
    rank's part: regather's is their sum over TP (two terms: the same bits in either order)."""
    bridge = [res["tp2sp-all-slice"]["bridge"] for res in parity]
    for res in parity:
        r = res["tp2sp-all-slice"]
        _same(r["slice"], r["bridge"], f"rank {res['rank']} per-slice", skip=ROW_MAGNITUDES)
        for name, grad in r["slice"]["grads"].items():
            if name.endswith(ROW_MAGNITUDES):
                torch.testing.assert_close(grad, bridge[0]["grads"][name] + bridge[1]["grads"][name], **EXACT)
                assert not torch.equal(bridge[0]["grads"][name], bridge[1]["grads"][name])  # Bridge's replicas drift


def test_row_bases_at_tp2_whole_row_against_float64(parity):
    for res in parity:
        r = res["tp2sp-all"]
        errs = {name: max_rel_err(r[name]["logits"], r["fp64"]["logits"]) for name in ("bridge", "classic", "regather")}
        print(f"rank {res['rank']} TP2 + SP, DoRA on all four linears, logits vs float64 (whole-row norm): "
              + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()))
        assert errs["bridge"] > 1e3 * max(errs["classic"], 1e-7), errs  # Bridge's slice norm: another function
        rows = [n for n in r["fp64"]["grads"] if n.endswith(ROW_MAGNITUDES)]
        dm = {name: max(max_rel_err(r[name]["grads"][n], r["fp64"]["grads"][n]) for n in rows)
              for name in ("bridge", "classic", "regather")}
        print(f"rank {res['rank']} row magnitudes' gradients vs float64: "
              + ", ".join(f"{k} {v:.3g}" for k, v in dm.items()))
        assert len(rows) == 4 and dm["bridge"] > 0.1, dm  # its shard's part of the sum, under another norm
        _fp64(r["classic"], r["classic"], r["fp64"], f"rank {res['rank']} classic")
        _fp64(r["regather"], r["classic"], r["fp64"], f"rank {res['rank']} regather + recompute + rebuild")
        # fc2 rebuilds z from fc1's output, which the activation keeps (layer 0 included: fc1 trains)
        fc2 = {p: d for p, d in r["decisions"].items() if p.endswith("linear_fc2")}
        assert len(fc2) == 2 and all("input recomputed from" in d for d in fc2.values()), r["decisions"]


def test_te_model_bridge_loses_the_input_gradient_on_te_2_4(te):
    for res in te:
        for behaviour in ("te<=2.3", "te2.8-2.20"):
            r = res[behaviour]
            results, fp64 = r["results"], r["fp64"]
            assert r["flags"]["bridge"] == [(True, True)], r["flags"]  # Bridge asks for the gathered output
            assert all(r["flags"][v] == [(True, False)] for v in results if v != "bridge"), r["flags"]
            errs = {v: max_rel_err(x["input_grad"], fp64["input_grad"]) for v, x in results.items()}
            print(f"rank {res['rank']} {behaviour}: decoder input gradient vs float64: "
                  + ", ".join(f"{v} {e:.3g}" for v, e in errs.items()))
            for v in ("classic", "rb/regather", "rb/lowrank"):
                _fp64(results[v], results["classic"], fp64, f"rank {res['rank']} {behaviour} {v}", res["rank"])
            if behaviour == "te2.8-2.20":
                assert errs["bridge"] > 1e3 * max(errs["classic"], 1e-7), errs
            else:
                # the same forward bit for bit; TE <= 2.3 adds LoRA's share of the gathered output's gradient
                # before its sequence reduce-scatter, regather (local output) after it: every gradient below
                # a fused norm in another summation order, within the fp64 rule
                for key in ("logits", "loss"):
                    torch.testing.assert_close(results["bridge"][key], results["classic"][key], **EXACT)
                _fp64(results["bridge"], results["classic"], fp64, f"rank {res['rank']} {behaviour} bridge")


def test_te_model_at_tp1_gather_path_is_bridges_dora_bit_for_bit(te):
    for res in te:
        _same(res["tp1"]["classic"], res["tp1"]["bridge"], f"rank {res['rank']} TE model TP1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from workers_bridge_dora import ckpt_worker

    return run_ranks(ckpt_worker, 2, str(tmp_path_factory.mktemp("dora_ckpt")), timeout=360)


def test_checkpoints_both_ways(ckpt):
    """Bridge's DoRA state dict (``…adapter.weight_magnitude``: ``[o/t]`` on a column base, ``[o]`` on a row
    base) loads strictly into every strategy and is written back unchanged; regather's loads into Bridge the
    Bridge way; megatron dist checkpoints both ways (Bridge's own save filter and adapter loader), and a TP2
    checkpoint into TP1 (the column magnitude put together from its halves)."""
    h, wide, o_qkv = 64, 128, 3 * 64
    for res in ckpt:
        shapes = res["bridge_magnitude_shapes"]
        assert len(shapes) == 8
        for key, shape in shapes.items():
            want = {"linear_qkv": o_qkv // 2, "linear_fc1": wide // 2, "linear_proj": h, "linear_fc2": h}
            assert shape == (want[key.split(".")[-3]],), (key, shape)
        for strategy in ("gather", "regather", "lowrank"):
            r = res[f"sd bridge->{strategy}"]
            assert r["before"] > 1e-3 and r["writes_bridge_state_dict"], r
            d = res[f"dist bridge->{strategy}"]
            if strategy == "gather":  # Bridge's expression: the same function bit for bit
                assert r["after"] == 0.0 and d["full"] == 0.0 and d["bridge_loader"] == 0.0, (r, d)
            else:  # the lean norm and token sums, lowrank's LoRA-A: the same function, fp32 rounding apart
                assert r["after"] < 1e-5 and d["full"] < 1e-5 and d["bridge_loader"] < 1e-5, (r, d)
        assert res["sd bridge->whole-row"] == {"missing": [], "unexpected": []}
        assert res["sd base->unwrapped"] == {"missing": [], "unexpected": []}
        r = res["sd regather->bridge"]
        assert r["unexpected"] == [] and not any(".adapter." in k for k in r["missing"]), r
        assert len(r["magnitudes"]) == 8 and r["diff"] == 0.0, r
        assert res["dist regather->bridge"] == 0.0
    # Bridge's own dist checkpoint of its own model: the row magnitude is declared replicated, so one rank's
    # copy is saved, but Bridge's ranks hold different values (each its slice norm): rank 1 loads rank 0's,
    # and the model comes back another function
    saved0, saved1 = (r["bridge row magnitudes"]["saved"] for r in ckpt)
    loaded1 = ckpt[1]["bridge row magnitudes"]["loaded"]
    for name in saved0:
        assert not torch.equal(saved0[name], saved1[name]) and torch.equal(loaded1[name], saved0[name]), name
    assert all(r["dist bridge->bridge"] > 1e-3 for r in ckpt), [r["dist bridge->bridge"] for r in ckpt]
    assert all(r["dist tp2->tp1 loss diff"] < 1e-5 for r in ckpt)

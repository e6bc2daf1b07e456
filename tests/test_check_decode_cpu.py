"""CPU test of tools/check_decode.py's run path (the GPU check of the one-launch decode kernel).

The GPU pieces are replaced by torch stand-ins on the CPU: the kernel library by a function that
does what MoeDecode's contract says (x, w13[, w13s], w2[, w2s], topk_weights, topk_ids, out, h,
bar[, b13, b2][, tl]) with the reference math, the layer by a stand-in, CUDA-graph timing by one
call. What is checked is the tool's own logic, so that a GPU call does not find it broken: the
argument order per precision, the references, the edge routings, the build.json handling and the
timeline summary. The kernel's numerics are checked on the GPU (same tool, real library)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import check_decode  # noqa: E402

from moe_aot.harness.fp8 import dequantize_w2, dequantize_w13  # noqa: E402
from moe_aot.harness.reference import moe_reference  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

EVENTS = ["entry", "tables", "phase1_done", "end", "p2_full_wait_ns"]  # "_ns": a duration, not a time


class _Decode:
    """MoeDecode's contract in torch (see templates/decode.py), for one spec."""

    def __init__(self, spec, state: dict):
        self.spec, self.timeline, self.calls, self.state = spec, state["timeline"], state["calls"], state

    def __call__(self, *args):
        s = self.spec
        args = list(args)
        tl = args.pop() if self.timeline else None
        if s.precision == "bf16":
            x, w13, w2, tw, ids, out, h, bar, *bias = args
        else:
            x, q13, s13, q2, s2, tw, ids, out, h, bar, *bias = args
            assert q13.dtype == q2.dtype == torch.float8_e4m3fn and s13.dtype == s2.dtype == torch.float32
            w13, w2 = dequantize_w13(q13, s13, s.precision), dequantize_w2(q2, s2, s.precision)
        assert len(bias) == (2 if s.bias else 0)
        assert h.shape[0] % ids.shape[1] == 0 and h.shape[0] >= ids.numel() and bar.dtype == torch.int32
        assert bar.numel() == 2
        self.calls.append(ids.shape[0])
        ref = moe_reference(x, w13.float(), w2.float(), tw, ids, s.activation, 16, *bias)
        out.copy_(ref.to(out.dtype))
        # one 64-bit count, ctas arrivals per launch, never reset
        bar.view(torch.int64)[0] += 0 if self.state["stuck"] else self.state["ctas"]
        if tl is not None:  # every CTA reaches every event, 1 us apart, the first CTA 0.5 us early
            tl.zero_()
            tl[:, :len(EVENTS)] = 10_000 + 1000 * torch.arange(len(EVENTS))
            tl[0, :len(EVENTS)] -= 500


class _Layer:
    def __init__(self, spec, store):
        self.spec, self.device = spec, torch.device("cpu")

    def workspace(self, tokens):
        return None

    def forward(self, x, w13, w2, tw, ids, out, workspace):
        out.zero_()

    def variant_for(self, tokens):
        return type("V", (), {"name": lambda self, spec: "four_kernels"})()


@pytest.fixture
def fakes(monkeypatch):
    import moe_aot.harness.measure as measure
    import moe_aot.runtime.layer as layer_mod
    import moe_aot.runtime.library as library
    import moe_aot.runtime.store as store

    state = {"specs": [], "timeline": False, "calls": [], "stuck": False, "ctas": 4}
    monkeypatch.setattr(check_decode, "_specs", lambda precision, models: state["specs"])
    monkeypatch.setattr(library.KernelLibrary, "from_dir", staticmethod(
        lambda path: _Decode(dict(state["specs"])[path.name], state)))
    monkeypatch.setattr(layer_mod, "MoeLayer", _Layer)
    monkeypatch.setattr(store, "KernelStore", lambda: None)
    monkeypatch.setattr(measure, "graph_times_us", lambda fns, replays, warmup_s=0.0: [f() or 10.0 for f in fns])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return state


def _tiny(precision: str, **kw):
    return make_spec(experts=16, top_k=4, hidden=256, intermediate=128, precision=precision, target="sm_90a", **kw)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8-block128"])
def test_run_checks_every_point_with_the_precisions_arguments(precision, fakes, tmp_path, monkeypatch):
    spec = _tiny(precision) if precision != "bf16" else _tiny("bf16", activation="swigluoai", bias=True)
    fakes["specs"] = [("tiny", spec)]
    kdir = tmp_path / "k"
    (kdir / "tiny").mkdir(parents=True)
    (kdir / "build.json").write_text(json.dumps({"precision": precision, "max_tokens": 2, "ctas": 4}))
    monkeypatch.setattr(sys, "argv", ["check_decode.py", "--run", str(kdir), "--out", str(tmp_path / "o"),
                                      "--replays", "1"])
    with pytest.raises(SystemExit) as done:
        check_decode.main()
    assert done.value.code == 0
    rows = json.loads((tmp_path / "o" / "decode.json").read_text())
    assert [r["tokens"] for r in rows] == [1, 2] and all(r["ok"] for r in rows)
    assert all(r["precision"] == precision and r["rel_err"] < 1e-2 for r in rows)
    # fp8: the error against the fp8 layer's own math (x and h quantized) is reported, not bounded
    assert all((r["rel_err_vs_layer_math"] is None) == (precision == "bf16") for r in rows)
    assert all(r["rel_err_vs_layer_math"] is None or 0 < r["rel_err_vs_layer_math"] < 0.2 for r in rows)
    # four routings per point (two random, invalid ids, all tokens on the same experts) + the timing
    assert fakes["calls"].count(1) == 4 + 4 and fakes["calls"].count(2) == 4 + 4


def test_timeline_builds_report_each_event(fakes, tmp_path, monkeypatch):
    fakes["specs"], fakes["timeline"] = [("tiny", _tiny("fp8"))], True
    kdir = tmp_path / "k"
    (kdir / "tiny").mkdir(parents=True)
    (kdir / "build.json").write_text(json.dumps({"precision": "fp8", "max_tokens": 1, "ctas": 4, "timeline": True,
                                                 "events": EVENTS}))
    monkeypatch.setattr(sys, "argv", ["check_decode.py", "--run", str(kdir), "--out", str(tmp_path / "o"),
                                      "--replays", "1"])
    with pytest.raises(SystemExit) as done:
        check_decode.main()
    assert done.value.code == 0
    (row,) = json.loads((tmp_path / "o" / "decode.json").read_text())
    # [first CTA, median, last] in us after the first CTA's entry; durations as they are
    assert row["timeline_us"] == {ev: [k, k + 0.5, k + 0.5] for k, ev in enumerate(EVENTS[:-1])} | {
        "p2_full_wait_ns": [13.5, 14.0, 14.0]}
    # and per CTA (CTA 0 half a microsecond early)
    assert row["timeline_cta_us"]["end"] == [3.0, 3.5, 3.5, 3.5]
    assert row["timeline_cta_us"]["p2_full_wait_ns"] == [13.5, 14.0, 14.0, 14.0]


def test_by_units_groups_ctas_by_their_phase2_units():
    """10 phase-2 units on 4 CTAs: CTAs 0, 1 take three, CTAs 2, 3 two; events a CTA never reached
    (None) are left out of its group's median."""
    per_cta = {"end": [5.0, 7.0, 3.0, None], "p2_full_wait_ns": [1.0, 1.0, 0.5, 0.5]}
    line = check_decode._by_units(per_cta, 10, 4)
    assert line.startswith("2 units x 2 CTAs: barrier - end 3.0 ")
    assert "p2 full wait 0.5" in line and "3 units x 2 CTAs: barrier - end 6.0 " in line


@pytest.mark.parametrize("stuck", [False, True])
def test_the_barrier_count_is_checked(stuck, fakes, tmp_path, monkeypatch):
    """bar is the grid barrier's two words; a launch that leaves its 64-bit count where it was (a
    barrier that did not complete) fails the point, one that moves it by ctas passes."""
    fakes["specs"], fakes["stuck"] = [("tiny", _tiny("bf16"))], stuck
    kdir = tmp_path / "k"
    (kdir / "tiny").mkdir(parents=True)
    (kdir / "build.json").write_text(json.dumps({"precision": "bf16", "max_tokens": 2, "ctas": 4}))
    monkeypatch.setattr(sys, "argv", ["check_decode.py", "--run", str(kdir), "--out", str(tmp_path / "o"),
                                      "--replays", "1"])
    with pytest.raises(SystemExit) as done:
        check_decode.main()
    rows = json.loads((tmp_path / "o" / "decode.json").read_text())
    assert done.value.code == (1 if stuck else 0)
    assert all(r["ok"] != stuck and r["barrier_ok"] != stuck for r in rows)


def test_run_refuses_what_the_build_cannot_do(tmp_path, monkeypatch, capsys):
    kdir = tmp_path / "k"
    kdir.mkdir()
    (kdir / "build.json").write_text(json.dumps({"precision": "fp8", "max_tokens": 1}))
    for extra, why in ((["--precision", "bf16"], "holds fp8 kernels"), (["--max-tokens", "2"], "take 1..1 tokens")):
        monkeypatch.setattr(sys, "argv", ["check_decode.py", "--run", str(kdir), *extra])
        with pytest.raises(SystemExit):
            check_decode.main()
        assert why in capsys.readouterr().err

"""The fused backward as a tunable unit (issue 11, item 3): its variant value and name, the
bucket's default and candidates, the tuner's walk over them (records, the combination of the
parts that beat the default, the confirmation round), picks derived, exported, read back, built
and served by the runtime's lookup. The measuring is faked here (tests/test_gpu_autograd.py and
the H200 runs measure for real); one test compiles a small layer's candidates for real."""
from __future__ import annotations

import dataclasses
import json

import pytest

from moe_aot import backward_tune, picks
from moe_aot import gemm_limits as limits
from moe_aot.database import Database
from moe_aot.spec import make_spec
from moe_aot.tuner import Outcome
from moe_aot.variants import (
    TORCH_DATA,
    BackwardVariant,
    GemmTiles,
    WgradTiles,
    backward_candidates,
    backward_gemm_tiles,
    backward_kernels,
    backward_workload,
    can_implement_backward,
    combine_backward,
    default_backward,
    parse_variant,
    wgrad_preferred,
)

PRESETS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b")
GPU = "Fake GPU 80GB"
TC = "fake-dsl|cu13.0|sm_90a|x86-64|fmt1|srcfake"
PARTS = ("dh", "dx", "wgrad")
# a committed pick (cache/tuned/NVIDIA_H200.jsonl, gpt-oss-120b at 1024 tokens): 128-row names are keys
COMMITTED = "moe_bwd_sm90a_bf16_e128k4h2880i2880b_swigluoai_dhn192k64s4hopws_dxn192k64s4hopws_wb128x192s5a64x192s7"


@pytest.mark.parametrize("model", PRESETS)
@pytest.mark.parametrize("tokens", [1024, 4096, 16384])
def test_candidates_start_at_the_default_and_change_one_part_each(model, tokens):
    spec = make_spec(model)
    cands = backward_candidates(spec, tokens)
    base = default_backward(spec, tokens)
    assert cands[0] == base
    # last, torch's data GEMMs (every GEMM torch's, around the compiled GLU backward), once
    assert cands[-1] == TORCH_DATA and cands.count(TORCH_DATA) == 1
    assert [kv.role for kv in TORCH_DATA.kernels(spec)] == ["glu_bwd"]
    cands = cands[:-1]
    # the default is what the backward ran before it was tunable: 128-row routing tiles, the data
    # GEMMs' first valid tiles, the compiled weight gradients exactly where the measured rule says
    assert base.tile_m == 128 and (base.dh, base.dx) == backward_gemm_tiles(spec)
    assert (base.wgrad is not None) == wgrad_preferred(spec, tokens)
    assert len(cands) == len(set(cands)) >= 4
    # the data path at 64-row tiles, as one part: the default's tiles (valid at 64 rows at every
    # preset), then both GEMMs on the ping-pong core
    pp = {part: dataclasses.replace(getattr(base, part), mma="hoppp") for part in ("dh", "dx")}
    assert [v for v in cands if v.tile_m != base.tile_m] == \
        [dataclasses.replace(base, tile_m=64), dataclasses.replace(base, tile_m=64, **pp)]
    for v in cands[1:]:
        if v.tile_m == base.tile_m:
            assert sum(getattr(v, p) != getattr(base, p) for p in PARTS) == 1, v
    for v in cands:
        assert can_implement_backward(spec, v) == (True, "")
        name = v.name(spec)
        assert name.startswith("moe_bwd_sm90a_bf16_") and spec.shape_tag in name
        assert BackwardVariant.parse(name) == v == parse_variant(name)
        kvs = v.kernels(spec)
        assert [kv.role for kv in kvs] == ["routing", "dh", "dx", "combine"] + (["wgrad", "wgrad"] if v.wgrad else [])
        assert [kv.kwargs()["tile_m"] for kv in kvs[:3]] == [v.tile_m] * 3  # dX reads dH's rows of this routing


def test_backward_names_keep_every_128_row_key_and_name_the_64_row_tiles():
    spec = make_spec("gpt-oss-120b")
    v = BackwardVariant.parse(COMMITTED)
    assert v.tile_m == 128 and v.name(spec) == COMMITTED == parse_variant(COMMITTED).name(spec)
    v64 = dataclasses.replace(v, tile_m=64)
    name = v64.name(spec)
    assert name == COMMITTED.replace("_swigluoai_dh", "_swigluoai_m64_dh")
    assert BackwardVariant.parse(name) == v64 == parse_variant(name)
    # every field changes the name
    others = [v64, dataclasses.replace(v, dh=GemmTiles(64, 64, 4, "hopws")),
              dataclasses.replace(v, dx=GemmTiles(192, 64, 3, "hopws")), dataclasses.replace(v, wgrad=None)]
    assert len({u.name(spec) for u in [v, *others]}) == 1 + len(others)
    assert {f.name for f in dataclasses.fields(BackwardVariant)} == {"tile_m", "dh", "dx", "wgrad"}
    # the 64-row kernels: the routing and the data GEMMs built at 64 rows, the weight gradients the same
    k128, k64 = v.kernels(spec), v64.kernels(spec)
    assert [kv.name for kv in k64[:3]] == [kv.name.replace("_m128_", "_m64_").replace("_t128x", "_t64x")
                                           for kv in k128[:3]]
    assert k64[3:] == k128[3:]
    with pytest.raises(ValueError, match="not a backward variant name"):  # the default height is not spelled
        BackwardVariant.parse(COMMITTED.replace("_dh", "_m128_dh"))


def test_torch_data_gemms_are_one_named_variant_outside_the_combination():
    """variants.TORCH_DATA: its name round-trips, it compiles only the GLU backward (the kernel that
    path runs; build --backward compiles it anyway), no other combination of torch's and compiled
    parts is valid, and combine_backward takes no part from it."""
    spec = make_spec("deepseek-v3")
    name = TORCH_DATA.name(spec)
    assert name == "moe_bwd_sm90a_bf16_e256k8h7168i2048_swiglu_dtorch_wtorch"
    assert BackwardVariant.parse(name) == TORCH_DATA == parse_variant(name) and TORCH_DATA.torch_data
    assert TORCH_DATA.kernels(spec) == [kv for kv in backward_kernels(spec) if kv.role == "glu_bwd"]
    assert can_implement_backward(spec, TORCH_DATA) == (True, "")
    base = default_backward(spec, 4096)
    pair = backward_candidates(spec, 4096)[-2].wgrad  # the TMA-store weight gradients
    for bad in (dataclasses.replace(TORCH_DATA, wgrad=pair), dataclasses.replace(TORCH_DATA, tile_m=64),
                dataclasses.replace(base, dh=None), dataclasses.replace(base, dx=None)):
        ok, why = can_implement_backward(spec, bad)
        assert not ok and why.startswith("torch's data GEMMs go with torch's weight gradients"), bad
    for bad in (name.replace("_wtorch", "_wb128x192s5a64x192s7").replace("dtorch", "dtorchx"),
                name.replace("_dtorch", "_m64_dtorch").replace("_m64_dtorch", "_m128_dtorch")):
        with pytest.raises(ValueError, match="not a backward variant name"):
            BackwardVariant.parse(bad)
    # the fastest "part" being torch's whole path changes nothing in the combination
    w = next(v for v in backward_candidates(spec, 4096)[1:] if v.wgrad != base.wgrad)
    assert combine_backward(base, [TORCH_DATA]) == base
    assert combine_backward(base, [TORCH_DATA, w]) == w


def test_no_backward_variants_where_there_is_no_fused_backward():
    for spec in (make_spec("deepseek-v3", precision="fp8"), make_spec("qwen3-30b-a3b", target="sm_121a"),
                 make_spec("qwen3-30b-a3b", target="sm_100a")):
        assert default_backward(spec, 4096) is None and backward_candidates(spec, 4096) == []
        assert backward_tune.candidate_kernels([spec], (4096,)) == []


def test_invalid_backward_tiles_are_refused_with_the_reason():
    spec = make_spec("qwen3-30b-a3b")
    base = default_backward(spec, 4096)
    ok, why = can_implement_backward(spec, dataclasses.replace(base, dx=GemmTiles(96, 64, 4, "hopws")))
    assert not ok and why.startswith("dX tiles n96k64s4hopws at tile_m 128: ") and "multiple of 64" in why
    # each GEMM at the variant's own height: a 256-wide ping-pong tile holds 64 rows, not 128
    wide = GemmTiles(256, 64, 4, "hoppp")
    ok, why = can_implement_backward(spec, dataclasses.replace(base, dx=wide))
    assert not ok and why.startswith("dX tiles n256k64s4hoppp at tile_m 128: ") and "registers" in why
    assert can_implement_backward(spec, dataclasses.replace(base, dx=wide, tile_m=64)) == (True, "")
    for m in (32, 96, 256):
        ok, why = can_implement_backward(spec, dataclasses.replace(base, tile_m=m))
        assert not ok and why == limits.check_backward_tile_m(m)[1]
        assert why.startswith(f"the backward's tile_m {m} must be 64 or 128: ") and why.count(".") == 0
    bad = (WgradTiles(256, 256, 4), base.wgrad[1])
    ok, why = can_implement_backward(spec, dataclasses.replace(base, wgrad=bad))
    assert not ok and why.startswith("dW13 tiles 256x256s4: ")
    ok, why = can_implement_backward(make_spec("qwen3-30b-a3b", precision="fp8"), base)
    assert not ok and "bf16" in why
    with pytest.raises(ValueError, match="not a backward variant name"):
        BackwardVariant.parse("moe_bwd_sm90a_bf16_e128k8h2048i768_swiglu_dhn128k64s5hoppp_wtorch")


def test_the_combination_takes_each_part_from_its_fastest_winner():
    spec = make_spec("deepseek-v3")
    base = default_backward(spec, 4096)
    c = backward_candidates(spec, 4096)
    dhs = [v for v in c[1:] if v.dh != base.dh]
    dxs = [v for v in c[1:] if v.dx != base.dx]
    w = next(v for v in c[1:] if v.wgrad != base.wgrad)
    got = combine_backward(base, [dhs[1], dxs[0], dhs[0], w])  # fastest first
    assert (got.tile_m, got.dh, got.dx, got.wgrad) == (128, dhs[1].dh, dxs[0].dx, w.wgrad)
    assert combine_backward(base, []) == base
    # 64-row tiles and a dH or dX tile of 128 rows are compiled apart: the faster of them goes in
    rows = [v for v in c if v.tile_m == 64]
    assert combine_backward(base, [rows[1], dhs[0], rows[0], w]) == dataclasses.replace(rows[1], wgrad=w.wgrad)
    got = combine_backward(base, [dxs[0], rows[0], w])
    assert (got.tile_m, got.dh, got.dx, got.wgrad) == (128, base.dh, dxs[0].dx, w.wgrad)


class FakeBackwardMeasurer:
    """Times that are a function of the variant's parts, so the best combination is known; a
    dX tile of 64 columns gives a wrong result, as a broken kernel would."""
    gpu = GPU
    driver = "999.0 (CUDA 13.0)"

    def __init__(self, torch_us: float = 1100.0):
        self.calls: list[str] = []
        self.torch_us = torch_us  # TORCH_DATA's time: by default slower than the default

    def __call__(self, spec, v, tokens) -> Outcome:
        self.calls.append(v.name(spec))
        if v.torch_data:
            t = self.torch_us
            return Outcome("ok", median_us=t, stats={"median_us": t, "replays": 20}, rel_err=4e-3)
        if v.dx.tile_n == 64:
            return Outcome("wrong_result", rel_err=0.4, error="relative error of dx 0.4")
        t = 1000.0 + {256: 0, 128: -30, 192: 10}[v.dh.tile_n] + {256: 0, 192: 15, 128: 20}[v.dx.tile_n]
        t += 0 if v.wgrad is None else (-50 if v.wgrad[0].tma_store else -20)
        t += 5 if v.dh.mma == "hoppp" else 0
        t += (-10 if v.tile_m == 64 else 0) + (2 if v.dx.mma == "hoppp" else 0)
        return Outcome("ok", median_us=t, stats={"median_us": t, "replays": 20}, rel_err=4e-3)


def _fake_compile(db, specs, buckets):
    for spec, kv in backward_tune.candidate_kernels(specs, buckets):
        db.put_workload(spec.workload_key, spec.workload_dict())
        db.put_workload(backward_workload(spec), spec.workload_dict())
        if not db.has_artifact(kv.name, TC):
            db.put_artifact(name=kv.name, workload=spec.workload_key, role=kv.role, target=spec.target, toolchain=TC,
                            status="ok", library=b"fake:" + kv.name.encode(), meta={})


def test_tuning_records_every_candidate_and_the_combination_and_picks_the_fastest(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    spec = make_spec("deepseek-v3")
    with Database(url) as db:
        _fake_compile(db, [spec], (4096,))
    m = FakeBackwardMeasurer()
    n = backward_tune.tune_backward(url, [spec], (4096,), m, confirm_k=2, progress=lambda s: None)
    assert n == 1
    base = default_backward(spec, 4096)
    cands = backward_candidates(spec, 4096)
    with Database(url, readonly=True) as db:
        recs = db.records(backward_workload(spec), spec.target, GPU, 4096)
        assert db.records(spec.workload_key) == []  # the forward's records are not touched
        trials = [r for r in recs if picks.confirmation(r) is None]
        # every candidate once, then the combination of the winning parts: 64-row tiles (10 us ahead
        # of the default; dH 128x128 cooperative, 5 us ahead, was measured at 128 rows only, so it
        # does not join them) and weight gradients with TMA stores
        combo = dataclasses.replace(base, tile_m=64, wgrad=cands[-2].wgrad)
        assert [r.variant for r in trials] == [v.name(spec) for v in cands] + [combo.name(spec)]
        wrong = [r for r in trials if r.status == "wrong_result"]
        assert [BackwardVariant.parse(r.variant).dx.tile_n for r in wrong] == [64]
        assert all(r.content and r.toolchain == TC for r in trials)
        # a complete confirmation round: the two best and the default, mirrored
        again = [r for r in recs if picks.confirmation(r) is not None]
        assert len(again) == 6 and picks.complete_rounds(recs) == {picks.confirmation(again[0])["round"]}
        [p] = picks.derive_picks(db, spec, GPU, backward=True)
        assert p.variant == combo.name(spec) and p.default == base.name(spec)
        assert p.median_us == 1000 - 30 + 5 - 10 - 50 and p.default_us == 1000 - 30 + 5 - 20
        [best] = db.all_best(workload=backward_workload(spec))
        assert best.variant == combo.name(spec)
    # measuring again finds every record: nothing is measured twice
    calls = len(m.calls)
    backward_tune.tune_backward(url, [spec], (4096,), m, confirm_k=2, progress=lambda s: None)
    assert len(m.calls) == calls


def test_torch_data_gemms_are_picked_exported_and_built_where_they_are_fastest(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    spec = make_spec("deepseek-v3")
    with Database(url) as db:
        _fake_compile(db, [spec], (16384,))
    backward_tune.tune_backward(url, [spec], (16384,), FakeBackwardMeasurer(torch_us=800.0), confirm_k=2,
                                progress=lambda s: None)
    out = tmp_path / "tuned"
    with Database(url, readonly=True) as db:
        [p] = picks.derive_picks(db, spec, GPU, backward=True)
        assert p.variant == TORCH_DATA.name(spec) and p.median_us == 800.0
        picks.export_tuned(db, out, GPU)
    with Database(f"sqlite:///{tmp_path / 'fresh.sqlite'}") as db:
        kernels, planned = picks.backward_build_plan(db, [spec], (16384,), GPU, out)
    assert [(t, v) for _, _, t, v, _ in planned] == [(16384, TORCH_DATA)]
    assert {kv.role for _, kv in kernels} >= {"glu_bwd", "dh", "dx"}  # the pick's and the default's


def test_backward_picks_are_exported_read_back_built_and_served(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    spec = make_spec("deepseek-v3")
    with Database(url) as db:
        _fake_compile(db, [spec], (4096,))
    backward_tune.tune_backward(url, [spec], (4096,), FakeBackwardMeasurer(), confirm_k=0,
                                progress=lambda s: None)
    out = tmp_path / "tuned"
    with Database(url, readonly=True) as db:
        [path] = picks.export_tuned(db, out, GPU)
        [pick] = picks.derive_picks(db, spec, GPU, backward=True)
    lines = [json.loads(t) for t in path.read_text().splitlines()]
    assert [(e["workload"], e["tokens"], e["variant"]) for e in lines] == \
        [(backward_workload(spec), 4096, pick.variant)]
    assert picks.read_tuned_file(path) == lines
    # a fresh database builds from the text: every bucket's default backward and the pick
    fresh = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    with Database(fresh) as db:
        kernels, planned = picks.backward_build_plan(db, [spec], (4096, 16384), GPU, out)
    names = [kv.name for _, kv in kernels]
    assert len(names) == len(set(names))
    want = {kv.name for t in (4096, 16384) for kv in default_backward(spec, t).kernels(spec)}
    want |= {kv.name for kv in BackwardVariant.parse(pick.variant).kernels(spec)}
    assert set(names) == want
    assert [(s, g, t, v.name(spec), us) for s, g, t, v, us in planned] == \
        [(spec, GPU, 4096, pick.variant, pick.median_us)]
    # a text pick measured against another default is left out, and said
    stale = dict(lines[0], default=BackwardVariant(GemmTiles(256, 64, 4, "hopws"),
                                                   GemmTiles(256, 64, 4, "hopws")).name(spec))
    path.write_text(json.dumps(stale) + "\n")
    left: list = []
    with Database(fresh) as db:
        _, planned = picks.backward_build_plan(db, [spec], (4096,), GPU, out, left)
    assert planned == [] and [e["variant"] for e in left] == [pick.variant]
    # the runtime's lookup reads the deployed pick for its GPU
    from moe_aot.runtime.store import KernelStore

    store = KernelStore(url)
    monkeypatch.setattr("moe_aot.runtime.store.usable", lambda *a: (True, ""))
    assert store.picks(spec, GPU, backward=True) == {4096: BackwardVariant.parse(pick.variant)}
    assert store.picks(spec, GPU) == {}  # the forward has none


def test_tune_backward_refuses_layers_without_a_fused_backward_and_forward_only_options(tmp_path):
    from click.testing import CliRunner

    from moe_aot.cli import main

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    r = CliRunner().invoke(main, ["tune", "--backward", "--compile-only", "--gpu", "NVIDIA H200", "--model",
                                  "qwen3-30b-a3b", "--precision", "fp8", "--db", url])
    assert r.exit_code != 0 and "no layer given has a fused backward to tune" in r.output
    r = CliRunner().invoke(main, ["tune", "--backward", "--compile-only", "--gpu", "NVIDIA H200", "--model",
                                  "qwen3-30b-a3b", "--try", "m16r1_glun32k128s6warp_downn32k128s6warp", "--db", url])
    assert r.exit_code != 0 and "--seed-picks and --try are the forward's" in r.output


def test_tune_backward_compile_only_compiles_every_candidate_kernel(tmp_path):
    """Real compiles (the DSL on this CPU machine) of a small layer's candidates at one bucket."""
    from click.testing import CliRunner

    from moe_aot.cli import main

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    args = ["--experts", "8", "--top-k", "2", "--hidden", "512", "--intermediate", "256"]
    r = CliRunner().invoke(main, ["tune", "--backward", "--compile-only", "--gpu", "NVIDIA H200", *args,
                                  "--tokens", "1024", "--db", url, "-j", "2"])
    assert r.exit_code == 0, r.output
    spec = make_spec(experts=8, top_k=2, hidden=512, intermediate=256)
    want = {kv.name for _, kv in backward_tune.candidate_kernels([spec], (1024,))}
    rows64 = {kv.name for v in backward_candidates(spec, 1024) if v.tile_m == 64 for kv in v.kernels(spec)[:3]}
    assert len(rows64) == 4  # the routing, dH and dX (cooperative and ping-pong) at 64 rows
    with Database(url, readonly=True) as db:
        got = {a.name for a in db.list_artifacts(status="ok")}
        assert want <= got and rows64 <= got
        for v in backward_candidates(spec, 1024):  # what the tuner keys its records by
            picks.variant_content(db, spec, v)


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("swigluoai", True)])
def test_the_tuners_backward_check_passes_true_gradients_and_catches_wrong_ones(activation, bias):
    """harness.backward.check_backward (the tuner's check before it times a backward variant) on
    the CPU: the torch path's bf16 gradients pass; a wrong expert's weight gradient, a wrong dx
    row, a NaN, or an expert without rows given a nonzero gradient, each fail."""
    import torch

    from moe_aot.harness.backward import check_backward
    from moe_aot.harness.verify import random_routing
    from moe_aot.integrations.autograd import moe_backward

    spec = make_spec(experts=8, top_k=2, hidden=64, intermediate=64, activation=activation, bias=bias)
    gen = torch.Generator().manual_seed(3)
    E, H, I, M = 8, 64, 64, 40
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16()
    b13 = (torch.randn(E, 2 * I, generator=gen) * 0.5).bfloat16() if bias else None
    b2 = (torch.randn(E, H, generator=gen) * 0.5).bfloat16() if bias else None
    x = torch.randn(M, H, generator=gen).bfloat16()
    grad = torch.randn(M, H, generator=gen).bfloat16()
    tw, ids = random_routing(M, spec, "cpu", only_even=True, generator=gen)  # odd experts get no rows
    grads = moe_backward(grad, x, w13, w2, tw, ids, activation, 16, b13, b2)
    errs = check_backward(spec, grads, x, w13, w2, tw, ids, grad, b13, b2)
    assert errs.pop("ok"), errs
    assert set(errs) == {"dx", "dx_row", "dtopk_weights", "dw13", "dw2"} | ({"db13", "db2"} if bias else set())
    assert max(errs.values()) < 1e-2

    def broken(i, fn):
        g = [t.clone() if t is not None else None for t in grads]
        fn(g[i])
        return check_backward(spec, g, x, w13, w2, tw, ids, grad, b13, b2)["ok"]

    assert not broken(1, lambda t: t[2].mul_(1.1))  # one expert's dW13 off by 10%
    assert not broken(2, lambda t: t[4, :, 3].zero_())  # a column of one expert's dW2
    assert not broken(0, lambda t: t[7].mul_(-1))  # one token's dx
    assert not broken(0, lambda t: t[0, 0].fill_(float("nan")))
    assert not broken(1, lambda t: t[1, 0, 0].fill_(1e-3))  # an expert without rows
    assert not broken(3, lambda t: t.mul_(1.05))  # the routing weights' gradient


def test_backward_timing_falls_back_to_one_input_set_where_two_do_not_fit(monkeypatch):
    """measure_backward's timing: all input sets' graphs where they fit; the first set alone where
    capturing them all runs out of memory (torch's weight gradients at DeepSeek-V3 16384 tokens on
    80 GB); None where one does not fit either. The GPU timing is faked, the control flow is real."""
    import torch

    from moe_aot.harness import backward as hb

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    calls = []

    def timed(limit):
        def fake(fns, replays, warmup_s, nvml):
            calls.append(len(fns))
            if len(fns) > limit:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (faked)")
            return [f() for f in fns], {"sm_mhz": 1980}
        return fake

    fns = [lambda: 1.0, lambda: 2.0]
    monkeypatch.setattr(hb, "timed_graphs", timed(2))
    assert hb._timed_fitting(fns, 10, 0.0, None) == ([1.0, 2.0], {"sm_mhz": 1980}, 2) and calls == [2]
    calls.clear()
    monkeypatch.setattr(hb, "timed_graphs", timed(1))
    assert hb._timed_fitting(fns, 10, 0.0, None) == ([1.0], {"sm_mhz": 1980}, 1) and calls == [2, 1]
    calls.clear()
    monkeypatch.setattr(hb, "timed_graphs", timed(0))
    assert hb._timed_fitting(fns, 10, 0.0, None) is None and calls == [2, 1]
    calls.clear()
    assert hb._timed_fitting(fns[:1], 10, 0.0, None) is None and calls == [1]  # one set: tried once

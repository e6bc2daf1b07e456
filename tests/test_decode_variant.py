"""The one-launch decode kernel as a variant of the 1-token bucket: its name and rules, its
compile through the compiler, the runtime serving it (and falling back to the bucket's default
four kernels), the tuner measuring it beside the four-kernel candidates, the references."""
from __future__ import annotations

import ctypes
import inspect

import pytest
import torch
from test_runtime_cpu import _recording_layer, _seen
from tuner_fakes import GPU, FakeMeasurer, fake_compile

from moe_aot import gemm_limits as limits
from moe_aot import measure_worker, picks, tuner
from moe_aot.compiler import compile_into
from moe_aot.database import Database
from moe_aot.runtime.library import KernelArgumentError
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
from moe_aot.variants import (
    DecodeVariant,
    LayerVariant,
    can_implement,
    decode_candidates,
    default_variant,
    parse_variant,
    training_kernels,
)

MODELS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b"]


def _specs():
    out = []
    for model in MODELS:
        for precision in limits.DECODE_PRECISIONS:
            try:
                out.append(make_spec(model, precision=precision))
            except ValueError:
                continue  # gpt-oss has no fp8 layer (H = I = 2880)
    return out


def test_candidates_name_and_parse_back_at_the_one_token_bucket_only():
    specs = _specs()
    assert len(specs) == 13  # five bf16 presets, four in each fp8 format
    for spec in specs:
        cands = decode_candidates(spec, 1)
        assert [(v.producer, v.sync, v.warps, v.seg_bytes) for v in cands] == [
            ("bulk", "grid", 16, 2048), ("bulk", "grid", 8, 4096), ("bulk", "grid", 16, 4096)], spec.label()
        for v in cands:
            name = v.name(spec)
            head = f"moe_decode_sm90a_{spec.precision_tag}_{spec.shape_tag}_{spec.activation}"
            assert name.startswith(f"{head}_t1w{v.warps}s")
            assert parse_variant(name) == v and can_implement(spec, v) == (True, "ok")
            # the ring as deep as shared memory holds, spelled out in the name
            assert v.stages == limits.decode_layout(spec.hidden, spec.intermediate, 1, v.warps, 0, v.seg_bytes,
                                                    spec.precision)[2]
            [kv] = v.kernels(spec)
            assert kv.role == "decode" and kv.name == name
        for tokens in (16, 64, 4096):
            assert decode_candidates(spec, tokens) == []
    # other targets have no cooperative decode kernel
    assert decode_candidates(make_spec("qwen3-30b-a3b", target="sm_100a"), 1) == []
    with pytest.raises(ValueError, match="not a decode variant name"):
        DecodeVariant.parse("moe_layer_sm90a_bf16_e128k8h2048i768_swiglu_m16r1_glun32k64s8warp_downn32k64s8warp")
    assert isinstance(parse_variant(default_variant(specs[0], 1).name(specs[0])), LayerVariant)


def test_can_implement_explains_each_refusal():
    spec = make_spec("qwen3-30b-a3b")
    v = decode_candidates(spec, 1)[0]
    cases = [(make_spec("qwen3-30b-a3b", target="sm_100a"), v, "built for sm_90a, not sm_100a"),
             (spec, DecodeVariant(1, 8, v.stages, ctas=148), "exceeds sm_90a's 132 SMs"),
             (spec, DecodeVariant(1, 8, 0), "stages 0 must be at least 1"),
             (spec, DecodeVariant(1, 6, v.stages), "warps 6 must be one of"),
             (spec, DecodeVariant(9, 8, v.stages), "max_tokens 9 must be in 1..8"),
             (spec, DecodeVariant(1, 8, v.stages, producer="tma"), "producer 'tma' must be one of")]
    for s, bad, why in cases:
        ok, msg = can_implement(s, bad)
        assert not ok and why in msg, (bad, msg)


def test_the_variants_arguments_are_the_templates_constructor():
    """The compiler builds MoeDecode(**kv.kwargs()): every argument the template takes is named
    by the variant (nothing left to a template default that could change under a name), but for
    the measuring build (timeline) and the experiments (rotate, lanes), which no served kernel turns on."""
    pytest.importorskip("cutlass")
    from moe_aot_templates.decode import MoeDecode

    spec = make_spec("gpt-oss-120b")
    [kv] = decode_candidates(spec, 1)[0].kernels(spec)
    takes = [p for p in inspect.signature(MoeDecode.__init__).parameters if p != "self"]
    assert sorted(kv.kwargs()) == sorted(set(takes) - {"timeline", "rotate", "lanes"}) and kv.kwargs()["bias"] is True


SPEC = make_spec(experts=8, top_k=2, hidden=256, intermediate=128)
FP8_SPEC = make_spec(experts=8, top_k=2, hidden=256, intermediate=256, precision="fp8-block128")


@pytest.fixture(scope="module")
def decode_db(tmp_path_factory):
    """The small bf16 layer's 1-token default, its decode candidates and the fp8 layer's bulk
    decode kernel, compiled for real."""
    url = f"sqlite:///{tmp_path_factory.mktemp('dec') / 'k.sqlite'}"
    with Database(url) as db:
        results = compile_into(db, [(SPEC, default_variant(SPEC, 1)), *((SPEC, v) for v in decode_candidates(SPEC, 1)),
                                    (FP8_SPEC, decode_candidates(FP8_SPEC, 1)[0])], jobs=1)
    assert all(r.artifact is not None for r in results), [r.error for r in results]
    return url


def test_decode_kernels_compile_with_the_runtime_arguments(decode_db):
    """One kernel per candidate, whose arguments are what the runtime passes: the caller's
    tensors, then h and the barrier words (fp8: each weight with its scales)."""
    import json
    import sqlite3

    con = sqlite3.connect(decode_db[len("sqlite:///"):])
    for spec, v, want in ((SPEC, decode_candidates(SPEC, 1)[1], ["x", "w13", "w2"]),
                          (FP8_SPEC, decode_candidates(FP8_SPEC, 1)[0], ["x", "w13", "w13s", "w2", "w2s"])):
        [(role, workload, meta)] = con.execute("SELECT role, workload, meta FROM moe_aot_artifacts WHERE name = ?",
                                               (v.name(spec),)).fetchall()
        args = json.loads(meta)["args"]
        assert (role, workload) == ("decode", spec.workload_key)
        assert [a["name"] for a in args if a["kind"] == "tensor"] == want + ["topk_weights", "topk_ids", "out", "h",
                                                                            "bar"]
        h, bar = args[-3], args[-2]
        assert h["static_shape"] == [2, spec.intermediate] and bar["static_shape"] == [v.bar_words(spec)]
    con.close()


def _bf16_args(M):
    bf = torch.bfloat16
    return [torch.zeros(M, 256, dtype=bf), torch.zeros(8, 256, 256, dtype=bf), torch.zeros(8, 256, 128, dtype=bf),
            torch.zeros(M, 2), torch.zeros(M, 2, dtype=torch.int32)]


@pytest.mark.parametrize("native", [True, False])
def test_the_runtime_serves_the_decode_pick_and_falls_back_to_the_buckets_default(decode_db, tmp_path, monkeypatch,
                                                                                   native):
    import moe_aot.runtime.launch as launch

    dec = decode_candidates(SPEC, 1)[0]
    dflt = default_variant(SPEC, 1)
    layer = _recording_layer(decode_db, SPEC, tmp_path, monkeypatch, variant=dec, tokens=1, also=(dflt,))
    if not native:
        monkeypatch.setattr(launch, "_native_fn", False)
    layer._sms = 132  # an H200's SMs (the CPU stand-in has none)
    assert layer.served(1) == dec and layer.decode_for(1) == dec
    assert layer.variant_for(1) == dflt  # the four kernels of the bucket, for what the decode kernel does not take
    assert layer.served(2) == dflt and layer.decode_for(2) is None  # past its max_tokens
    out = torch.zeros(1, 256, dtype=torch.bfloat16)
    layer.forward(*_bf16_args(1), out=out)
    lib = layer._libs[dec.name(SPEC)]._lib
    ws = layer._workspace
    [(h, bar)] = ws.decode.values()
    assert h.shape == (2, 128) and h.dtype == torch.bfloat16 and bar.tolist() == [0, 0]  # zeroed once
    if launch._building is not None:
        launch._building.join()
    new, out2 = _bf16_args(1), torch.zeros_like(out)
    assert layer.forward(*new, out=out2) is out2  # the repeated call: the caller's new pointers, one launch
    p = [t.data_ptr() for t in new]
    assert _seen(lib, 9) == p + [out2.data_ptr(), h.data_ptr(), bar.data_ptr(), 1234]
    assert layer._last.native is native and len(layer._last.bound) == 1
    assert list(layer.launchers(1)) == ["decode"]
    # a bad input is refused by the repeated path's checks, before the launch
    calls = ctypes.c_long.in_dll(lib, "calls").value
    with pytest.raises(KernelArgumentError, match="x must be torch.bfloat16"):
        layer.forward(new[0].float(), *new[1:], out=out2)
    assert ctypes.c_long.in_dll(lib, "calls").value == calls
    # two tokens: the bucket's default four kernels, the decode kernel untouched
    route = layer.kernels(2)[1]
    layer.forward(*_bf16_args(2), out=torch.zeros(2, 256, dtype=torch.bfloat16))
    assert ctypes.c_long.in_dll(lib, "calls").value == calls and ctypes.c_long.in_dll(route._lib, "calls").value == 1


def test_a_gpu_with_fewer_sms_than_the_decode_kernels_ctas_runs_the_four_kernels(decode_db, tmp_path, monkeypatch):
    dec = decode_candidates(SPEC, 1)[0]
    dflt = default_variant(SPEC, 1)
    layer = _recording_layer(decode_db, SPEC, tmp_path, monkeypatch, variant=dec, tokens=1, also=(dflt,))
    layer._sms = 114  # an H100 PCIe
    assert layer.served(1) == dflt
    layer.forward(*_bf16_args(1), out=torch.zeros(1, 256, dtype=torch.bfloat16))
    assert dec.name(SPEC) not in layer._libs and not (layer._workspace.decode or {})


def test_the_fp8_decode_kernel_takes_the_weights_with_their_scales(decode_db, tmp_path, monkeypatch):
    dec = decode_candidates(FP8_SPEC, 1)[0]
    layer = _recording_layer(decode_db, FP8_SPEC, tmp_path, monkeypatch, variant=dec, tokens=1)
    layer._sms = 132
    f8 = torch.float8_e4m3fn

    def make():
        return [torch.zeros(1, 256, dtype=torch.bfloat16), (torch.zeros(8, 512, 256, dtype=f8), torch.ones(8, 4, 2)),
                (torch.zeros(8, 256, 256, dtype=f8), torch.ones(8, 2, 2)), torch.zeros(1, 2),
                torch.zeros(1, 2, dtype=torch.int32)]

    layer.forward(*make(), out=torch.zeros(1, 256, dtype=torch.bfloat16))
    new, out = make(), torch.zeros(1, 256, dtype=torch.bfloat16)
    assert layer.forward(*new, out=out) is out
    x, (w13, w13s), (w2, w2s), tw, ids = new
    [(h, bar)] = layer._workspace.decode.values()
    lib = layer._libs[dec.name(FP8_SPEC)]._lib
    assert _seen(lib, 11) == [t.data_ptr() for t in (x, w13, w13s, w2, w2s, tw, ids, out, h, bar)] + [1234]
    with pytest.raises(KernelArgumentError, match="w13 scales must have shape"):
        layer.forward(x, (w13, w13s[:, :1]), (w2, w2s), tw, ids, out=out)


def test_a_decode_pick_has_no_training_twin_and_no_pdl_twin_in_the_seeds(tmp_path):
    dec = decode_candidates(SPEC, 1)[0]
    assert training_kernels(SPEC, dec) == []
    path = tmp_path / "tuned"
    path.mkdir()
    picks.write_tuned(path, "NVIDIA H200", [{"workload": SPEC.workload_key, "target": SPEC.target, "gpu": "NVIDIA H200",
                                             "tokens": 1, "variant": dec.name(SPEC), "median_us": 10.0,
                                             "default": default_variant(SPEC, 1).name(SPEC), "default_us": 12.0}])
    seeds = tuner.seed_variants(path, "NVIDIA H200", [SPEC], [1])[(SPEC.workload_key, 1)]
    assert seeds[0] == dec and all(isinstance(v, LayerVariant) for v in seeds[1:])


@pytest.mark.parametrize("decode_us, wins", [(1.0, True), (60.0, False)])
def test_the_tuner_measures_the_decode_candidates_beside_the_four_kernel_ones(tmp_path, decode_us, wins):
    """compile-only then measure (the H200 flow): the 1-token study holds the default, then the
    decode candidates, then the seeds and proposals; the pick is the decode kernel only where it measured
    fastest, and the runtime's store hands it back as a DecodeVariant."""
    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    Database(url).close()
    spec = make_spec("qwen3-30b-a3b")
    twin = default_variant(spec, 1).pdl_twin()
    added = tuner.prepare(url, [spec], [1, 16], GPU, trials=5, jobs=0, compile_fn=fake_compile, seed=0,
                          seeds={(spec.workload_key, 1): [twin]})
    assert added == 10
    storage = tuner.open_storage(url)
    one = tuner.open_study(storage, spec, GPU, 1)
    names = [t.user_attrs["variant"] for t in one.get_trials(deepcopy=False)]
    cands = [v.name(spec) for v in decode_candidates(spec, 1)]
    # the default, the decode candidates, then the given seeds
    assert names[0] == default_variant(spec, 1).name(spec) and names[1:4] == cands and names[4] == twin.name(spec)
    sixteen = tuner.open_study(storage, spec, GPU, 16)
    assert not any("moe_decode_" in t.user_attrs["variant"] for t in sixteen.get_trials(deepcopy=False))
    done = measure_worker.measure(url, FakeMeasurer(decode_us=decode_us), confirm=0)
    with Database(url) as db:
        # every trial measured, but sampled proposals that failed to compile (finished at prepare)
        failed = sum(r.status == "compile_error" for t in (1, 16)
                     for r in db.records(spec.workload_key, spec.target, GPU, t))
    assert done + failed == 10 and done >= 9
    with Database(url) as db:
        recs = {r.variant: r for r in db.records(spec.workload_key, spec.target, GPU, 1)}
        assert [recs[c].median_us for c in cands] == [decode_us, decode_us + 1.5, decode_us + 0.5]
        [pick] = [p for p in picks.derive_picks(db, spec, GPU) if p.tokens == 1]
        assert (pick.variant == cands[0]) is wins
    got = KernelStore(url).picks(spec, GPU)
    assert isinstance(got[1], DecodeVariant) is wins and isinstance(got[16], LayerVariant)


def test_the_tuner_in_one_process_also_tries_the_decode_candidates(tmp_path):
    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    Database(url).close()
    spec = make_spec("qwen3-30b-a3b")
    tuner.tune(url, [spec], [1], FakeMeasurer(decode_us=1.0), trials=4, jobs=0, compile_fn=fake_compile, seed=0,
               confirm=0)
    with Database(url) as db:
        measured = {r.variant for r in db.records(spec.workload_key, spec.target, GPU, 1)}
        assert {v.name(spec) for v in decode_candidates(spec, 1)} <= measured
        [pick] = picks.derive_picks(db, spec, GPU)
        assert pick.variant == decode_candidates(spec, 1)[0].name(spec)


def test_served_reference_is_the_decode_kernels_math_where_it_serves():
    """fp8: the decode kernel keeps x and h unquantized, so its reference is the dequantized
    weights' (an invalid id contributes nothing); the four kernels' quantize both."""
    from moe_aot.harness import fp8 as hf8
    from moe_aot.harness.reference import moe_reference
    from moe_aot.harness.verify import layer_reference, random_routing, served_reference
    from moe_aot.runtime.layer import prepare_fp8_weights
    from moe_aot.variants import INTERLEAVE

    torch.manual_seed(0)
    s = FP8_SPEC
    gate, up = torch.randn(8, 256, 256) / 16, torch.randn(8, 256, 256) / 16
    w2f = torch.randn(8, 256, 256) / 16
    w13, w2 = prepare_fp8_weights(gate, up, w2f, s.precision)
    x = torch.randn(3, 256).bfloat16()
    tw, ids = random_routing(3, s, "cpu")
    ids[0, 0] = -1

    class Served:  # what served_reference asks of a layer
        spec = s

        def __init__(self, decode):
            self.decode = decode

        def decode_for(self, M):
            return decode_candidates(s, 1)[0] if self.decode else None

        def variant_for(self, M):
            return default_variant(s, 1)

    got = served_reference(Served(True), x, w13, w2, tw, ids)
    dw13 = torch.stack([hf8.dequantize_w13(*w13, s.precision, e, INTERLEAVE) for e in range(8)])
    dw2 = torch.stack([hf8.dequantize_w2(*w2, s.precision, e) for e in range(8)])
    want = moe_reference(x, dw13, dw2, tw, ids, s.activation, INTERLEAVE)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    four = served_reference(Served(False), x, w13, w2, tw, ids)
    assert torch.equal(four, layer_reference(s, x, w13, w2, tw, ids, default_variant(s, 1).h_block))
    assert not torch.allclose(four, want, rtol=1e-3, atol=1e-4)  # x and h in e4m3: another number

"""The DGX Spark layer's sm_90a stand-in (gemm_limits.STANDINS: target "sm_121a-standin") and the
runtime's block-scaled forward (mxfp8, nvfp4) on the CPU: the stand-in is the Spark layer under
its own name and keys, its kernels compile for sm_90a, no lookup mistakes it for a Spark (or an
sm_90a) kernel, the forward launches the five kernels with the documented arguments and refuses
bad weights in one sentence, and the harness's check catches wrong kernels. The kernels' numerics
run on an H100/H200: tests/test_gpu_spark_standin.py, tools/spark_standin.py."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from moe_aot import blockscale
from moe_aot import gemm_limits as limits
from moe_aot.compiler import compile_into
from moe_aot.database import Database
from moe_aot.harness import blockscaled as bsref
from moe_aot.harness.reference import routing_reference
from moe_aot.hosts import host_for
from moe_aot.runtime import blockscaled as bw
from moe_aot.runtime import layer as layer_mod
from moe_aot.runtime.layer import Workspace
from moe_aot.runtime.library import KernelArgumentError
from moe_aot.runtime.store import KernelMissingError, KernelStore, parse_toolchain, usable
from moe_aot.spec import BENCH_TOKENS, SUPPORTED_PRECISIONS, TARGETS, SpecError, make_spec
from moe_aot.variants import TARGET_LIMITS, GemmTiles, LayerVariant, can_implement, candidate_space, default_variant

STANDIN = "sm_121a-standin"
SMALL = dict(experts=8, top_k=2, hidden=256, intermediate=128)


def test_the_standin_is_the_spark_layer_under_its_own_names():
    """Limits, precisions and default variants are sm_121a's; every kernel name differs from the
    Spark's and says it is a stand-in; the block-scaled GEMMs take standin=True and the x
    quantizer software e2m1, nothing else differs."""
    s = limits.STANDINS[STANDIN]
    assert (s.model, s.arch) == ("sm_121a", "sm_90a") and limits.gpu_arch(STANDIN) == "sm_90a"
    assert limits.SMEM_CAPACITY[STANDIN] == limits.SMEM_CAPACITY["sm_121a"] == 99 * 1024
    assert TARGET_LIMITS[STANDIN] == TARGET_LIMITS["sm_121a"] and TARGET_LIMITS[STANDIN]["sms"] == 48
    assert SUPPORTED_PRECISIONS[STANDIN] == SUPPORTED_PRECISIONS["sm_121a"] and STANDIN in TARGETS
    assert host_for(STANDIN).name == "x86-64"  # the H200's host, not the Spark's aarch64
    assert STANDIN not in limits.E2M1_CVT_TARGETS  # sm_90a rounds e2m1 in software
    for precision in ("bf16", "fp8", "mxfp8", "nvfp4", "w4a8-mx"):
        spark = make_spec("qwen3-30b-a3b", precision=precision, target="sm_121a")
        stand = dataclasses.replace(spark, target=STANDIN)
        for tokens in BENCH_TOKENS:
            v = default_variant(stand, tokens)
            assert v == default_variant(spark, tokens)
            mine, theirs = v.kernels(stand), v.kernels(spark)
            assert not {k.name for k in mine} & {k.name for k in theirs}
            assert all("_sm121a_standin_" in k.name for k in mine)
            for a, b in zip(mine, theirs):
                extra = dict(a.params).items() - dict(b.params).items()
                gemm = a.role in ("glu", "down") and precision in limits.BLOCKSCALED
                want = {("standin", True)} if gemm else {("e2m1", "sw")} if a.role == "bsquant" else set()
                assert extra == want, (a.name, extra)
    small = make_spec(**SMALL, precision="nvfp4", target=STANDIN)
    assert candidate_space(small) == candidate_space(dataclasses.replace(small, target="sm_121a"))


def test_the_standin_refuses_what_the_spark_refuses():
    spec = make_spec(experts=8, top_k=2, hidden=1024, intermediate=512, precision="mxfp8", target=STANDIN)
    big = LayerVariant(64, GemmTiles(128, 256, 4), GemmTiles(128, 256, 4))  # ~200 KB of stages: fits sm_90a
    ok, why = can_implement(spec, big)
    assert not ok and f"{STANDIN} allows {99 * 1024}" in why
    assert can_implement(dataclasses.replace(spec, target="sm_121a"), big)[1] == why.replace(STANDIN, "sm_121a")
    with pytest.raises(SpecError, match=f"not yet supported for {STANDIN}"):
        make_spec(**SMALL, precision="mxfp4-w", target=STANDIN)
    hopper = LayerVariant(64, GemmTiles(128, 64, 4, "hopws"), GemmTiles(128, 64, 4, "hopws"))
    ok, why = can_implement(make_spec(**SMALL, target=STANDIN), hopper)  # sm_90a's own cores: not the Spark's
    assert not ok and f"hopws MMA is not available on {STANDIN}" in why


@pytest.fixture(scope="module")
def standin_db(tmp_path_factory):
    """The small layer's 16-token default kernels for the stand-in, mxfp8, nvfp4 and w4a8-mx (~35 s)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('standin') / 'k.sqlite'}"
    specs = [make_spec(**SMALL, precision=p, target=STANDIN) for p in ("mxfp8", "nvfp4", "w4a8-mx")]
    with Database(url) as db:
        res = compile_into(db, [(s, default_variant(s, 16)) for s in specs], jobs=1)
    assert all(r.error is None for r in res), [r.error for r in res if r.error]
    return url, {s.precision: s for s in specs}


def test_standin_kernels_are_sm_90a_builds_keyed_as_stand_ins(standin_db):
    url, specs = standin_db
    store = KernelStore(url)
    with Database(url) as db:
        arts = db.list_artifacts(target=STANDIN)
        metas = [db.get_artifact(a.name, a.toolchain).meta for a in arts]
    # routing shared by all three precisions, x's mxfp8 quantizer by mxfp8 and w4a8-mx
    assert len(arts) == 12 and all(a.status == "ok" for a in arts)
    for a, meta in zip(arts, metas):
        tc = parse_toolchain(a.toolchain)
        assert (tc["arch"], tc["host"]) == (STANDIN, "x86-64")
        assert meta["toolchain"]["arch"] == STANDIN and meta["toolchain"]["gpu_arch"] == "sm_90a"
        # fails closed for the Spark and for sm_90a layers alike
        assert usable(a.toolchain, STANDIN, None)[0]
        assert not usable(a.toolchain, "sm_121a", None)[0] and not usable(a.toolchain, "sm_90a", None)[0]
    assert not usable(arts[0].toolchain.replace(f"|{STANDIN}|x86-64|", "|sm_121a|aarch64|"), STANDIN, None)[0]
    for spec in specs.values():
        names = [kv.name for kv in default_variant(spec, 16).kernels(spec)]
        assert store.has_kernels(names, STANDIN)
        assert not store.has_kernels(names, "sm_121a") and not store.has_kernels(names, "sm_90a")
        with pytest.raises(KernelMissingError, match=f"built for {STANDIN}, this GPU needs sm_121a"):
            store.load(names[2], "sm_121a")


def test_workspace_holds_the_quantized_x_and_h():
    for precision, bits, vec in (("mxfp8", 8, 32), ("nvfp4", 4, 16), ("w4a8-mx", 8, 32)):  # x and h's format
        spec = make_spec(**SMALL, precision=precision, target=STANDIN)
        ws = Workspace.allocate(spec, 37, "cpu")
        assert ws.xq.shape == (37, 256 * bits // 8) and ws.xs.shape == (37, 256 // vec)
        assert ws.hq.dtype == ws.hs.dtype == ws.xq.dtype == torch.uint8 and ws.h.numel() == 0
        assert ws.hq.shape[0] == ws.sorted_ids.numel() and ws.hq.shape[1] == 128 * bits // 8
        assert (ws.xg is not None) == (precision == "nvfp4")


def _weights(spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    e, h, i, fmt = spec.experts, spec.hidden, spec.intermediate, spec.precision
    wfmt = limits.BS_FORMATS[fmt][1]  # the weights' format (w4a8-mx: mxfp4, packed)
    bits, vec = limits.BS_ELEM_BITS[wfmt], limits.BLOCKSCALE_BLOCK[wfmt]
    nv = fmt == "nvfp4"

    def w(n, k, amax):
        return bw.BlockScaledWeight(torch.randint(0, 255, (e, n, k * bits // 8), dtype=torch.uint8, generator=gen),
                                    torch.randint(0, 255, (e, n, k // vec), dtype=torch.uint8, generator=gen),
                                    torch.rand(e, generator=gen) if nv else None,
                                    torch.rand(1, generator=gen) if amax and nv else None)

    return w(2 * i, h, False), w(h, i, True)


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4", "w4a8-mx"])
def test_block_scaled_forward_launches_the_five_kernels_with_their_arguments(standin_db, precision, tmp_path,
                                                                               monkeypatch):
    """First call: routing, bsquant, GEMM1, GEMM2, combine in that order, checked and bound; a
    repeated call re-checks the inputs and swaps only the caller's pointers (nvfp4: x's amax taken
    into the workspace, or w13's calibrated one; h's from w2). Bad weights are refused before any
    launch, in one sentence."""
    from test_runtime_cpu import _recording_layer, _seen

    url, specs = standin_db
    spec = specs[precision]
    layer = _recording_layer(url, spec, tmp_path, monkeypatch)
    M, nv = 16, precision == "nvfp4"

    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        w13, w2 = _weights(spec, seed)
        return [torch.randn(M, 256, generator=gen).to(torch.bfloat16), w13, w2, torch.zeros(M, 2),
                torch.zeros(M, 2, dtype=torch.int32)]

    out = torch.zeros(M, 256, dtype=torch.bfloat16)
    layer.forward(*make(0), out=out)
    _, libs = layer.role_kernels(M)
    assert list(libs) == ["routing", "bsquant", "glu", "down", "combine"]
    ws = layer._workspace
    new, out2 = make(1), torch.zeros_like(out)
    assert layer.forward(*new, out=out2) is out2
    x, w13, w2, tw, ids = new
    p = lambda t: t.data_ptr()  # noqa: E731
    xg, w13g, w2g, hg = ((p(ws.xg),), (p(w13.global_amax),), (p(w2.global_amax),), (p(w2.input_amax),)) if nv \
        else ((),) * 4
    assert _seen(libs["routing"]._lib, 6)[0] == p(ids)
    assert _seen(libs["bsquant"]._lib, 4 + nv) == [p(x), p(ws.xq), p(ws.xs), *xg, 1234]
    assert _seen(libs["glu"]._lib, 9 + 3 * nv) == [p(ws.xq), p(ws.xs), p(w13.values), p(w13.scales),
                                                   p(ws.sorted_ids), p(ws.tile_expert), p(ws.hq), p(ws.hs),
                                                   *xg, *w13g, *hg, 1234]
    assert _seen(libs["down"]._lib, 9 + 2 * nv) == [p(ws.hq), p(ws.hs), p(w2.values), p(w2.scales),
                                                    p(ws.sorted_ids), p(ws.tile_expert), p(tw), p(ws.y),
                                                    *hg, *w2g, 1234]
    assert _seen(libs["combine"]._lib, 4) == [p(ws.y), p(ids), p(out2), 1234]
    if nv:
        assert ws.xg.item() == x.float().abs().amax().item()  # taken on the device, exact
        calibrated = w13._replace(input_amax=torch.tensor([3.0]))
        layer.forward(x, calibrated, w2, tw, ids, out=out2)
        assert _seen(libs["bsquant"]._lib, 5)[3] == _seen(libs["glu"]._lib, 12)[8] == p(calibrated.input_amax)
    calls = ctypes.c_long.in_dll(libs["glu"]._lib, "calls").value
    refusals = [((tuple(w13[:3]), w2), "w13 must be a BlockScaledWeight for precision"),
                ((w13._replace(scales=w13.scales[:, :, :1]), w2), "w13 scales must have shape"),
                ((w13, w2._replace(values=w2.values.view(torch.int8))), "w2 values must be torch.uint8")]
    if nv:
        refusals += [((w13, w2._replace(input_amax=None)), "w2's input_amax .* is needed for precision nvfp4"),
                     ((w13._replace(global_amax=None), w2), "w13's global_amax must be an fp32 \\[experts\\] tensor")]
    else:
        refusals += [((w13._replace(global_amax=torch.ones(8)), w2), "w13's global_amax must be None"),
                     ((w13, w2._replace(input_amax=torch.ones(1))), "w2's input_amax must be None")]
    for (a, b), msg in refusals:
        with pytest.raises(KernelArgumentError, match=msg):
            layer.forward(x, a, b, tw, ids, out=out2)
    assert ctypes.c_long.in_dll(libs["glu"]._lib, "calls").value == calls  # refused before any launch


def test_moe_forward_reads_the_block_scaled_precision_off_the_weights(monkeypatch):
    seen = []

    class _Layer:
        def forward(self, *args):
            return "ran"

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(layer_mod, "_layer_for", lambda *a: (seen.append(a), _Layer())[1])
    x, ids, tw = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2)
    for precision in ("mxfp8", "nvfp4", "w4a8-mx"):  # w4a8-mx: packed values with ue8m0 scales
        w13, w2 = _weights(make_spec(**SMALL, precision=precision, target=STANDIN))
        assert layer_mod.moe_forward(x, w13, w2, tw, ids, target=STANDIN) == "ran"
        e, k, h, i, act, prec, bias, _, _, target = seen[-1]
        assert (e, k, h, i, act, prec, bias, target) == (8, 2, 256, 128, "swiglu", precision, False, STANDIN)


def _torch_forward(spec, tile_m, x, w13, w2, tw, ids, ws):
    """What the five kernels write, computed by the torch reference (the right answer)."""
    M, K, fmt = x.shape[0], spec.top_k, spec.precision
    counts, offsets, sorted_ids, tile_expert = routing_reference(ids, spec.experts, tile_m)
    R, T = sorted_ids.numel(), tile_expert.numel()
    ws.sorted_ids[:R], ws.tile_expert[:T] = sorted_ids, tile_expert
    gx = x.float().abs().amax().reshape(1) if fmt == "nvfp4" else None
    xq = blockscale.quantize(x, limits.BS_FORMATS[fmt][0], gx)  # w4a8-mx: x in mxfp8
    ws.xq[:M], ws.xs[:M] = xq.values, xq.scales
    hq = bsref.quantize_h(bsref.h_padded(bsref.glu_pairs(xq, w13, ids, spec.activation, fmt), sorted_ids), fmt,
                          w2.input_amax)
    ws.hq[:R], ws.hs[:R] = hq.values, hq.scales
    y = bsref.down_rows(hq, w2, sorted_ids, tile_expert, tw, fmt, tile_m)
    return y.view(M, K, -1).sum(1).to(torch.bfloat16)


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4", "w4a8-mx"])
def test_check_forward_passes_the_right_answer_and_fails_wrong_ones(precision):
    """harness.blockscaled.check_forward (what the GPU tests and the tuner judge by) on torch
    stand-ins of the kernels: right passes; swapped h rows, an unwritten padding row, a dropped
    routing weight, a wrong x scale byte each fail."""
    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=256, precision=precision, target=STANDIN)
    gen = torch.Generator().manual_seed(3)
    w13, w2 = bsref.random_weights(spec, "cpu", generator=gen)
    M = 37
    x = torch.randn(M, spec.hidden, generator=gen).to(torch.bfloat16)
    tw = torch.rand(M, 2, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(M)]).to(torch.int32)
    variant = default_variant(spec, M)

    class _Layer:  # what check_forward asks of a MoeLayer
        pass

    layer = _Layer()
    layer.spec, layer.variant_for = spec, lambda tokens: variant
    ws = Workspace.allocate(spec, M, "cpu")
    bsref.poison(ws)
    out = _torch_forward(spec, variant.tile_m, x, w13, w2, tw, ids, ws)
    r = bsref.check_forward(layer, x, w13, w2, tw, ids, out, ws)
    assert r["ok"], r
    assert r["rel_err"] < 1e-2 and r["h_err"] == r["h_err_reference"]
    ref = bsref.layer_reference(x, w13, w2, tw, ids, precision, spec.activation, variant.tile_m)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2

    def broken(how):
        ws2 = Workspace.allocate(spec, M, "cpu")
        bsref.poison(ws2)
        o = _torch_forward(spec, variant.tile_m, x, w13, w2, tw, ids, ws2)
        _, offsets, sorted_ids, _ = routing_reference(ids, spec.experts, variant.tile_m)
        used = sorted_ids[: int(offsets[-1])]
        if how == "swap":
            a, b = (int(r) for r in (used >= 0).nonzero()[:2, 0])
            ws2.hq[[a, b]] = ws2.hq[[b, a]]
        elif how == "padding":
            row = int((used < 0).nonzero()[0, 0])
            ws2.hq[row], ws2.hs[row] = bsref.POISON_BYTE, bsref.POISON_BYTE
        elif how == "weight":
            o = _torch_forward(spec, variant.tile_m, x, w13, w2, tw * torch.tensor([1.0, 0.0]), ids, ws2)
        elif how == "xscale":
            ws2.xs[5, 0] ^= 1
        return bsref.check_forward(layer, x, w13, w2, tw, ids, o, ws2)

    for how in ("swap", "padding", "weight", "xscale"):
        assert not broken(how)["ok"], how

    # verify.check_stages (moe-aot verify, the GPU tests) runs one forward into a poisoned
    # workspace and reports the three stages from check_forward
    from moe_aot.harness.verify import check_stages

    layer.workspace = lambda tokens, ws=Workspace.allocate(spec, M, "cpu"): ws
    layer.forward = lambda x, w13, w2, tw, ids, out, workspace: out.copy_(
        _torch_forward(spec, variant.tile_m, x, w13, w2, tw, ids, workspace))
    rows = check_stages(layer, x, w13, w2, tw, ids)
    assert [r["stage"] for r in rows] == ["routing", "glu", "layer"] and all(r["ok"] for r in rows), rows


def test_a_standin_layer_refuses_a_gpu_of_another_arch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = make_spec(**SMALL, precision="nvfp4", target=STANDIN)
    for cc, target in (((12, 1), "sm_121a"), ((10, 0), "sm_100a")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        with pytest.raises(KernelArgumentError, match=f"sm_90a builds of the sm_121a layer, for checks on sm_90a "
                                                      f"GPUs; this GPU is {target}"):
            layer_mod.MoeLayer(spec, store=object(), device=torch.device("cuda", 0), variants={})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert layer_mod.MoeLayer(spec, store=object(), device=torch.device("cuda", 0), variants={}).spec is spec

"""gpt-oss (hidden = intermediate = 2880) on the DGX Spark's block-scaled layers (issue 12, item 3),
on the CPU: K padded to whole 128-element k-tiles (gemm_limits.bs_padded_k: 2944, zero values
and zero scale bytes), the clamped SwiGLU and the expert biases. The rules and their refusals;
the weight preparation and the checkpoint import at 2880 against PyTorch references; the layer's
CPU reference at gpt-oss's shape against an unpadded fp32 computation; check_forward's criteria on
torch stand-in kernels (the right answer passes, unwritten padding or a dropped bias fails); the
w4a8-mx layer compiling for sm_121a (its SASS) and for its sm_90a stand-in into a database."""
from __future__ import annotations

import re
import subprocess

import pytest
from sass_tools import cuobjdump

torch = pytest.importorskip("torch")

import cross_tools  # noqa: E402

from moe_aot import blockscale  # noqa: E402
from moe_aot import gemm_limits as limits  # noqa: E402
from moe_aot import variants as V  # noqa: E402
from moe_aot.glu import glu_fn  # noqa: E402
from moe_aot.harness import blockscaled as bsref  # noqa: E402
from moe_aot.harness.reference import routing_reference  # noqa: E402
from moe_aot.layout import interleave_gate_up  # noqa: E402
from moe_aot.runtime import blockscaled as bw  # noqa: E402
from moe_aot.runtime.layer import Workspace  # noqa: E402
from moe_aot.spec import SpecError, make_spec  # noqa: E402

SPARK, STANDIN = "sm_121a", "sm_121a-standin"
H = I = 2880
HP = 2944  # 2880 padded to whole 128-element k-tiles
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _gpt_oss_decode(b, s):
    """gpt-oss's own decode (transformers' convert_moe_packed_tensors): [E, N, G, 16], [E, N, G] ->
    [E, N, 32 G], low nibble first, value * 2^(scale - 127)."""
    vals = torch.stack((E2M1[(b & 0xF).long()], E2M1[(b >> 4).long()]), dim=-1).flatten(-2)
    return (vals * torch.exp2(s.float() - 127).unsqueeze(-1)).flatten(-2)


def test_k_is_padded_to_whole_k_tiles_and_the_rest_refused_in_one_sentence():
    assert [limits.bs_padded_k(k) for k in (2880, 2048, 32, 2944)] == [2944, 2048, 128, 2944]
    ok, why = limits.check_blockscaled("glu", "w4a8-mx", 2 * I, H, 16, 64, 128, 6, "warp", arch=SPARK)
    assert ok, why
    ok, why = limits.check_blockscaled("down", "w4a8-mx", H, I, 16, 64, 256, 4, "warp", arch=SPARK)
    assert not ok and why == ("w4a8-mx: K=2944 (padded from 2880) must be a multiple of tile_k 256 "
                              "and N=2880 of tile_n 64")
    ok, why = limits.check_blockscaled("down", "mxfp8", H + 16, I, 16, 64, 128, 4, "warp", arch=SPARK)
    assert not ok and "multiples of 32" in why
    for precision in limits.BLOCKSCALED:
        for target in (SPARK, STANDIN):
            spec = make_spec("gpt-oss-120b", precision=precision, target=target)
            assert spec.bias and spec.activation == "swigluoai"
            for tokens in (1, 16, 64, 256, 1024):
                v = V.default_variant(spec, tokens)
                assert V.can_implement(spec, v) == (True, "ok")
                kvs = v.kernels(spec)
                assert kvs[1].kwargs()["k_out"] == HP and kvs[1].name.endswith("_k2880_p2944_" +
                                                                               ("sw" if target == STANDIN else "hw"))
                assert all(dict(kv.params).get("bias") for kv in kvs[2:4])
                assert all(f"x{limits.BS_TILE_K[0]}_" in kv.name for kv in kvs[2:4])  # 128-wide k-tiles
    with pytest.raises(SpecError, match=r"^hidden must be a multiple of 128 for precision mxfp8 on sm_100a"):
        make_spec("gpt-oss-120b", precision="mxfp8", target="sm_100a")
    with pytest.raises(SpecError, match="not built for the mxfp8 tcgen05 kernels of sm_100a"):
        make_spec("qwen3-30b-a3b", precision="mxfp8", target="sm_100a", bias=True)
    with pytest.raises(SpecError, match="hidden must be a multiple of 64"):  # every layer's rule, before ours
        make_spec("gpt-oss-120b", precision="w4a8-mx", target=SPARK, hidden=2880 + 16)
    with pytest.raises(ValueError, match="k_out=2880 must be 0 or a multiple"):
        V.BlockScaleShape("mxfp8", 2880, SPARK, 2880)
    # the workspace holds x and h K-padded (the layer's N, hidden, stays y's width)
    ws = Workspace.allocate(make_spec("gpt-oss-120b", precision="w4a8-mx", target=STANDIN), 5, "cpu")
    assert ws.xq.shape == (5, HP) and ws.xs.shape == (5, HP // 32)
    assert ws.hq.shape[1] == HP and ws.hs.shape[1] == HP // 32 and ws.y.shape[1] == H


def test_w4a8_mx_weights_at_2880_are_the_reference_quantization_padded_with_zeros():
    """prepare_w13 / prepare_w2 at gpt-oss's shape: each row's first 2880 elements are
    blockscale.quantize's MXFP4 bytes of that row, the padding to 2944 zero codes with zero scale
    bytes (dequantized: 0), w13's rows and biases interleaved in blocks of 16."""
    g = torch.Generator().manual_seed(11)
    E = 1
    gate, up = (torch.randn(E, I, H, generator=g) * H ** -0.5 for _ in range(2))
    down = torch.randn(E, H, I, generator=g) * I ** -0.5
    bg, bu, b2 = torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g)
    w13 = bw.prepare_w13(gate, up, "w4a8-mx", b_gate=bg, b_up=bu)
    w2 = bw.prepare_w2(down, "w4a8-mx", bias=b2)
    assert w13.values.shape == (E, 2 * I, HP // 2) and w13.scales.shape == (E, 2 * I, HP // 32)
    assert w2.values.shape == (E, H, HP // 2) and w2.scales.shape == (E, H, HP // 32)
    qg, qu, q2 = (blockscale.quantize(w[0], "mxfp4") for w in (gate, up, down))
    assert torch.equal(w13.values[0, :, : H // 2], interleave_gate_up(qg.values[None], qu.values[None])[0])
    assert torch.equal(w13.scales[0, :, : H // 32], interleave_gate_up(qg.scales[None], qu.scales[None])[0])
    assert torch.equal(w2.values[0, :, : I // 2], q2.values) and torch.equal(w2.scales[0, :, : I // 32], q2.scales)
    for w in (w13, w2):
        assert not w.values[..., H // 2:].any() and not w.scales[..., H // 32:].any()
    d13, d2 = bw.dequantize(w13, "w4a8-mx"), bw.dequantize(w2, "w4a8-mx")
    want13 = interleave_gate_up(blockscale.dequantize(qg, "mxfp4")[None], blockscale.dequantize(qu, "mxfp4")[None])
    assert torch.equal(d13[..., :H], want13) and not d13[..., H:].any()
    assert torch.equal(d2[0, :, :I], blockscale.dequantize(q2, "mxfp4")) and not d2[..., I:].any()
    assert w13.bias.dtype == w2.bias.dtype == torch.bfloat16
    assert torch.equal(w13.bias, interleave_gate_up(bg[..., None], bu[..., None])[..., 0].to(torch.bfloat16))
    assert torch.equal(w2.bias, b2.to(torch.bfloat16))
    gw, uw = bw.split_w13(w13)
    assert torch.equal(gw.bias, bg.to(torch.bfloat16)) and torch.equal(uw.bias, bu.to(torch.bfloat16))
    with pytest.raises(ValueError, match="give both the gate and the up biases, or neither"):
        bw.prepare_w13(gate[:, :32], up[:, :32], "w4a8-mx", b_gate=bg[:, :32])
    with pytest.raises(ValueError, match=r"w2's bias must be \[E, H\]"):
        bw.prepare_w2(down[:, :32], "w4a8-mx", bias=b2)


def test_gpt_oss_checkpoint_at_2880_imports_padded_and_round_trips():
    """from_gpt_oss at gpt-oss-120b's own row length: the bytes kept, K padded with zero codes and
    scale bytes, dequantizing to gpt-oss's decode (then zeros); the biases regrouped as w13's rows;
    to_gpt_oss / gpt_oss_biases give the checkpoint's bytes back; wrong biases refused."""
    g = torch.Generator().manual_seed(12)
    E = 1
    blocks = torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 130, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g)
    dblocks = torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8, generator=g)
    dscales = torch.randint(118, 130, (E, H, I // 32), dtype=torch.uint8, generator=g)
    b13 = torch.randn(E, 2 * I, generator=g).to(torch.bfloat16)
    b2 = torch.randn(E, H, generator=g).to(torch.bfloat16)
    w13, w2 = bw.from_gpt_oss(blocks, scales, dblocks, dscales, b13, b2)
    assert w13.values.shape == (E, 2 * I, HP // 2) and w2.scales.shape == (E, H, HP // 32)
    want = _gpt_oss_decode(blocks, scales)
    d13 = bw.dequantize(w13, "w4a8-mx")
    assert torch.equal(d13[..., :H], interleave_gate_up(want[:, 0::2], want[:, 1::2])) and not d13[..., H:].any()
    d2 = bw.dequantize(w2, "w4a8-mx")
    assert torch.equal(d2[..., :I], _gpt_oss_decode(dblocks, dscales)) and not d2[..., I:].any()
    assert torch.equal(w13.bias, interleave_gate_up(b13[:, 0::2, None], b13[:, 1::2, None])[..., 0])
    assert torch.equal(w2.bias, b2)
    for got, orig in zip(bw.to_gpt_oss(w13, w2) + bw.gpt_oss_biases(w13, w2), (blocks, scales, dblocks, dscales,
                                                                               b13, b2)):
        assert torch.equal(got, orig)
    with pytest.raises(ValueError, match="^give both gate_up_proj_bias and down_proj_bias, or neither$"):
        bw.from_gpt_oss(blocks, scales, dblocks, dscales, b13)
    with pytest.raises(ValueError, match=r"^gate_up_proj_bias must be \[E, 2I\]"):
        bw.from_gpt_oss(blocks, scales, dblocks, dscales, b13[:, :64], b2)


def _unpadded_layer(x, w13, w2, tw, ids, fmt, tile_m):
    """The layer at gpt-oss's shape without any padding: x and h quantized at K = 2880, the
    weights' first 2880 columns, the clamped SwiGLU with the biases, in fp32 (written out here,
    apart from harness/blockscaled.py)."""
    act = limits.BS_FORMATS[fmt][0]
    xd = blockscale.dequantize(blockscale.quantize(x, act), act)
    d13, d2 = bw.dequantize(w13, fmt)[..., :H], bw.dequantize(w2, fmt)[..., :I]
    fn = glu_fn("swigluoai")
    M, K = ids.shape
    _, _, sorted_ids, tile_expert = routing_reference(ids, w13.values.shape[0], tile_m)
    h = torch.zeros(sorted_ids.numel(), I)
    for r, p in enumerate(sorted_ids.tolist()):
        if p >= 0:
            e = int(ids.reshape(-1)[p])
            s = d13[e] @ xd[p // K] + w13.bias[e].float()
            s = s.reshape(-1, 2, 16)
            h[r] = fn(s[:, 0].reshape(-1), s[:, 1].reshape(-1))
    hd = blockscale.dequantize(blockscale.quantize(h, act), act)
    out = torch.zeros(M * K, H)
    for r, p in enumerate(sorted_ids.tolist()):
        if p >= 0:
            e = tile_expert[r // tile_m]
            out[p] = (d2[e] @ hd[r] + w2.bias[e].float()) * tw.reshape(-1)[p]
    return out.view(M, K, H).sum(1)


def test_the_layer_reference_at_gpt_oss_shape_is_the_unpadded_layer():
    """harness/blockscaled.layer_reference (K-padded, as the kernels store it) equals the layer
    computed with no padding at all: the padding adds exactly nothing."""
    spec = make_spec("gpt-oss-120b", experts=2, top_k=2, precision="w4a8-mx", target=STANDIN)
    g = torch.Generator().manual_seed(13)
    w13, w2 = bsref.random_weights(spec, "cpu", generator=g)
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 0], [1, 0]], dtype=torch.int32)
    tw = torch.rand(3, 2, generator=g)
    ref = bsref.layer_reference(x, w13, w2, tw, ids, "w4a8-mx", "swigluoai", 16)
    want = _unpadded_layer(x, w13, w2, tw, ids, "w4a8-mx", 16)
    assert ref.shape == (3, H) and torch.allclose(ref, want, rtol=1e-5, atol=1e-5), (ref - want).abs().max()
    assert ((want - _unpadded_layer(x, w13._replace(bias=torch.zeros_like(w13.bias)), w2, tw, ids, "w4a8-mx",
                                    16)).norm() / want.norm()).item() > 0.05  # the biases count


def _torch_forward(spec, tile_m, x, w13, w2, tw, ids, ws, drop_b2=False):
    """What the five kernels write, K-padded, by the torch reference (the right answer)."""
    M, K, fmt = x.shape[0], spec.top_k, spec.precision
    _, _, sorted_ids, tile_expert = routing_reference(ids, spec.experts, tile_m)
    R, T = sorted_ids.numel(), tile_expert.numel()
    ws.sorted_ids[:R], ws.tile_expert[:T] = sorted_ids, tile_expert
    gx = x.float().abs().amax().reshape(1) if fmt == "nvfp4" else None
    xq = bsref.quantize_x(x, fmt, gx)
    ws.xq[:M], ws.xs[:M] = xq.values, xq.scales
    hq = bsref.quantize_h(bsref.h_padded(bsref.glu_pairs(xq, w13, ids, spec.activation, fmt), sorted_ids), fmt,
                          w2.input_amax)
    ws.hq[:R], ws.hs[:R] = hq.values, hq.scales
    w2 = w2._replace(bias=torch.zeros_like(w2.bias)) if drop_b2 else w2
    y = bsref.down_rows(hq, w2, sorted_ids, tile_expert, tw, fmt, tile_m)
    return y.view(M, K, -1).sum(1).to(torch.bfloat16)


@pytest.mark.parametrize("precision", limits.BLOCKSCALED)
def test_check_forward_at_a_padded_shape_fails_unwritten_padding_and_a_dropped_bias(precision):
    """check_forward (the GPU check's judge) at a K-padded shape with gpt-oss's activation and
    biases (H = I = 320, padded to 384; the same code as 2880 -> 2944): the right answer passes; h's K
    padding left poisoned in one row, x's padding poisoned, GEMM2's bias dropped each fail."""
    spec = make_spec(experts=8, top_k=2, hidden=320, intermediate=320, activation="swigluoai", bias=True,
                     precision=precision, target=STANDIN)
    gen = torch.Generator().manual_seed(3)
    w13, w2 = bsref.random_weights(spec, "cpu", generator=gen)
    M = 37
    x = torch.randn(M, spec.hidden, generator=gen).to(torch.bfloat16)
    tw = torch.rand(M, 2, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(M)]).to(torch.int32)
    variant = V.default_variant(spec, M)

    class _Layer:  # what check_forward asks of a MoeLayer
        pass

    layer = _Layer()
    layer.spec, layer.variant_for = spec, lambda tokens: variant

    def run(how=None):
        ws = Workspace.allocate(spec, M, "cpu")
        bsref.poison(ws)
        o = _torch_forward(spec, variant.tile_m, x, w13, w2, tw, ids, ws, drop_b2=how == "b2")
        if how == "hpad":
            row = int((ws.sorted_ids[:16] >= 0).nonzero()[0, 0])
            ws.hq[row, -8:] = bsref.POISON_BYTE
        elif how == "xpad":
            ws.xs[3, -1] = bsref.POISON_BYTE
        return bsref.check_forward(layer, x, w13, w2, tw, ids, o, ws)

    r = run()
    assert r["ok"] and r["h_k_padding_zero"] and r["x_bytes_equal"], r
    assert not run("hpad")["ok"] and not run("hpad")["h_k_padding_zero"]
    assert not run("xpad")["ok"]
    assert not run("b2")["ok"]


# -- compiled (needs the DSL) -------------------------------------------------------------------------
GPT_OSS_SMALL = dict(experts=8, top_k=4, hidden=H, intermediate=I, activation="swigluoai", bias=True)  # GPT_OSS_CHECK


@pytest.fixture(scope="module")
def gpt_oss_standin_db(tmp_path_factory):
    """The stand-in kernels of GPT_OSS_CHECK's layer at its 16-token default, w4a8-mx and nvfp4 (~1 min)."""
    pytest.importorskip("cutlass")
    from moe_aot.compiler import compile_into
    from moe_aot.database import Database

    url = f"sqlite:///{tmp_path_factory.mktemp('gptoss') / 'k.sqlite'}"
    specs = [make_spec(**GPT_OSS_SMALL, precision=p, target=STANDIN) for p in ("w4a8-mx", "nvfp4")]
    with Database(url) as db:
        res = compile_into(db, [(s, V.default_variant(s, 16)) for s in specs], jobs=1)
    assert all(r.error is None for r in res), [r.error for r in res if r.error]
    return url, {s.precision: s for s in specs}


def _random_weights(spec, seed=0):
    """Random bytes in the K-padded shapes the layer takes, with bf16 biases (no quantization: fast)."""
    gen = torch.Generator().manual_seed(seed)
    e, fmt = spec.experts, spec.precision
    wfmt = limits.BS_FORMATS[fmt][1]
    bits, vec, nv = limits.BS_ELEM_BITS[wfmt], limits.BLOCKSCALE_BLOCK[wfmt], fmt == "nvfp4"

    def w(n, amax):
        return bw.BlockScaledWeight(torch.randint(0, 255, (e, n, HP * bits // 8), dtype=torch.uint8, generator=gen),
                                    torch.randint(0, 255, (e, n, HP // vec), dtype=torch.uint8, generator=gen),
                                    torch.rand(e, generator=gen) if nv else None,
                                    torch.rand(1, generator=gen) if amax and nv else None,
                                    bias=torch.randn(e, n, generator=gen).to(torch.bfloat16))

    return w(2 * I, False), w(H, True)


@pytest.mark.parametrize("precision", ["w4a8-mx", "nvfp4"])
def test_gpt_oss_forward_binds_the_padded_operands_and_the_biases(gpt_oss_standin_db, precision, tmp_path,
                                                                 monkeypatch):
    """MoeLayer.forward at gpt-oss's shape against libraries of the compiled kernels' ABI that
    record their pointers: the weights, x's and h's workspace buffers pass the kernels' own
    static-shape checks at the padded K (2944), the biases follow the global amaxes in GEMM1's and
    GEMM2's arguments, first call and repeated call alike; weights without their biases, or
    unpadded ones, are refused before any launch in one sentence."""
    from test_runtime_cpu import _recording_layer, _seen

    from moe_aot.runtime.library import KernelArgumentError

    url, specs = gpt_oss_standin_db
    spec = specs[precision]
    layer = _recording_layer(url, spec, tmp_path, monkeypatch)
    M, nv = 16, precision == "nvfp4"

    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        w13, w2 = _random_weights(spec, seed)
        return [torch.randn(M, H, generator=gen).to(torch.bfloat16), w13, w2, torch.zeros(M, 4),
                torch.zeros(M, 4, dtype=torch.int32)]

    out = torch.zeros(M, H, dtype=torch.bfloat16)
    layer.forward(*make(0), out=out)
    _, libs = layer.role_kernels(M)
    ws = layer._workspace
    assert ws.xq.shape[1] == HP * (4 if nv else 8) // 8 and ws.hs.shape[1] == HP // (16 if nv else 32)
    for second in (False, True):
        new, out2 = make(1 + second), torch.zeros_like(out)
        assert layer.forward(*new, out=out2) is out2
        x, w13, w2, tw, ids = new
        p = lambda t: t.data_ptr()  # noqa: E731
        xg, w13g, w2g, hg = ((p(ws.xg),), (p(w13.global_amax),), (p(w2.global_amax),), (p(w2.input_amax),)) if nv \
            else ((),) * 4
        assert _seen(libs["bsquant"]._lib, 4 + nv) == [p(x), p(ws.xq), p(ws.xs), *xg, 1234]
        assert _seen(libs["glu"]._lib, 10 + 3 * nv) == [p(ws.xq), p(ws.xs), p(w13.values), p(w13.scales),
                                                        p(ws.sorted_ids), p(ws.tile_expert), p(ws.hq), p(ws.hs),
                                                        *xg, *w13g, *hg, p(w13.bias), 1234]
        assert _seen(libs["down"]._lib, 10 + 2 * nv) == [p(ws.hq), p(ws.hs), p(w2.values), p(w2.scales),
                                                         p(ws.sorted_ids), p(ws.tile_expert), p(tw), p(ws.y),
                                                         *hg, *w2g, p(w2.bias), 1234]
    for (a, b), msg in (((w13._replace(bias=None), w2), "^w13's bias must be a bf16 tensor: the spec of"),
                        ((w13, w2._replace(bias=w2.bias[:, :64])), r"^b2 must have shape \(8, 2880\)"),
                        ((w13._replace(values=w13.values[..., :H // 2].contiguous()), w2),
                         "^w13 values must have shape")):
        with pytest.raises(KernelArgumentError, match=msg):
            layer.forward(x, a, b, tw, ids, out=out2)


def test_gpt_oss_w4a8_mx_layer_compiles_for_sm_121a_and_its_standin(tmp_path):
    """`moe-aot build --model gpt-oss-120b --precision w4a8-mx` for sm_121a (aarch64 host code) and
    sm_121a-standin compiles the five kernels of the decode default into a database; the sm_121a
    GEMMs' SASS holds only the mixed block-scaled MMA, their PTX the expert biases' bf16 loads and
    no local memory; x's quantizer writes 2944-wide rows."""
    pytest.importorskip("cutlass")
    cross_tools.require(cross_tools.CROSS_CC)
    from click.testing import CliRunner

    from moe_aot.cli import main
    from moe_aot.compiler import build_template
    from moe_aot.kernel_build import compile_kernel

    runner = CliRunner()
    for target in (SPARK, STANDIN):
        url = f"sqlite:///{tmp_path / (target + '.sqlite')}"
        res = runner.invoke(main, ["build", "--model", "gpt-oss-120b", "--precision", "w4a8-mx", "--target", target,
                                   "--tokens", "1", "--db", url, "-j", "1"])
        assert res.exit_code == 0, res.output
        assert "5 compiled, 0 failed" in res.output, res.output
    spec = make_spec("gpt-oss-120b", precision="w4a8-mx", target=SPARK)
    kvs = V.default_variant(spec, 1).kernels(spec)
    quant = compile_kernel(build_template(kvs[1]), SPARK, kvs[1].name)
    qargs = {a["name"]: a for a in quant.meta["args"]}
    assert qargs["x"]["static_shape"][1] == H and qargs["q"]["static_shape"][1] == HP
    assert qargs["sf"]["static_shape"][1] == HP // 32
    tool = cuobjdump()
    for kv in kvs[2:4]:
        art = compile_kernel(build_template(kv), SPARK, kv.name)
        body = art.ptx[art.ptx.index(".entry"):]
        assert set(re.findall(r"mma\.sync\S*", body)) == {
            "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e4m3.e2m1.f32.ue8m0"}
        assert "ld.local" not in body and "st.local" not in body
        args = {a["name"]: a for a in art.meta["args"]}
        assert list(args)[-2:] == ["b13" if kv.role == "glu" else "b2", "stream"], list(args)
        # the K-padded rows the runtime passes (x, h: 2944 e4m3 bytes; weights 1472 e2m1 bytes)
        a, w = ("xq", "w13q") if kv.role == "glu" else ("hq", "w2q")
        assert args[a]["static_shape"][1] == HP and args[w]["static_shape"][2] == HP // 2, (args[a], args[w])
        if kv.role == "glu":
            assert args["hq"]["static_shape"][1] == HP
        if tool is not None:
            cubin = tmp_path / f"{kv.role}.cubin"
            cubin.write_bytes(art.cubin)
            sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
            assert set(re.findall(r"\b[A-Z]MMA\S*", sass)) == {"QMMA.SF.16832.F32.E4M3.E2M1.E8"}

"""The fp8 layer on the CPU: formats (quantization, weight preparation, DeepSeek-V3 checkpoint
import), the spec and variant rules, and real compiles of the fp8 kernels (their numerics are
checked on the GPU: tests/test_gpu_fp8.py, tools/check_fp8_kernels.py)."""
from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
from sass_tools import cuobjdump

torch = pytest.importorskip("torch")


from moe_aot import gemm_limits as limits  # noqa: E402
from moe_aot import variants as V  # noqa: E402
from moe_aot.harness import fp8 as fp8_ref  # noqa: E402
from moe_aot.harness.reference import moe_reference, rel_err, routing_reference  # noqa: E402
from moe_aot.layout import interleave_gate_up, split_gate_up  # noqa: E402
from moe_aot.runtime import fp8  # noqa: E402
from moe_aot.runtime.layer import prepare_fp8_weights  # noqa: E402
from moe_aot.spec import SpecError, make_spec  # noqa: E402


def _e4m3_half_step(v):
    """Half the e4m3 spacing at |v| (values scaled into [0, 448]): 2^(e-4), subnormals 2^-10."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6))) - 4)


@pytest.mark.parametrize("block", [None, 64, 128])
def test_quantize_rows_rounds_to_nearest_e4m3(block):
    t = torch.randn(7, 256) * torch.logspace(-3, 2, 7).unsqueeze(1)
    q, s = fp8_ref.quantize_rows(t, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == ((7,) if block is None else (7, 256 // block))
    b = 256 if block is None else block
    scaled = t.view(7, 256 // b, b) / s.view(7, 256 // b, 1)
    assert scaled.abs().amax(-1).sub(limits.FP8_MAX).abs().max() < 1e-3  # each block's amax -> 448
    err = (q.float().view_as(scaled) - scaled).abs()
    assert (err <= _e4m3_half_step(scaled) * (1 + 1e-6)).all()
    back = fp8_ref.dequantize_rows(q, s, block)
    assert rel_err(back, t) < 0.04


@pytest.mark.parametrize("precision", fp8.FP8)
def test_prepare_w13_dequantizes_to_the_interleaved_weights(precision):
    torch.manual_seed(0)
    gate = torch.randn(3, 256, 384)
    up = torch.randn(3, 256, 384) * 3  # other magnitudes than gate: its scales must stay its own
    w13, s = fp8.prepare_w13(gate, up, precision, 16)
    assert w13.shape == (3, 512, 384) and w13.dtype == torch.float8_e4m3fn
    assert s.shape == ((3, 2) if precision == "fp8" else (3, 4, 3))
    want = interleave_gate_up(gate, up)
    got = fp8_ref.dequantize_w13(w13, s, precision)
    assert rel_err(got, want) < 0.04
    # row by row: each interleaved row is a gate or an up row, within half an e4m3 step of it
    g, u = split_gate_up(got)
    for mine, ref in ((g, gate), (u, up)):
        assert rel_err(mine, ref) < 0.04
    assert torch.equal(fp8_ref.dequantize_w13(w13, s, precision, expert=2), got[2])


def test_block128_checkpoint_import_equals_quantizing_here():
    """DeepSeek-V3's experts as shipped (e4m3 + weight_scale_inv per 128x128 block) become the
    same tensors as quantizing their dequantized values here."""
    torch.manual_seed(1)
    gate, up = torch.randn(2, 256, 512), torch.randn(2, 256, 512)
    down = torch.randn(2, 512, 256)
    (gq, gs), (uq, us), (dq, ds) = (fp8.quantize_blocks(w) for w in (gate, up, down))
    w13, w13s, w2, w2s = fp8.from_block128_checkpoint(gq, gs, uq, us, dq, ds)
    (p13, p13s), (p2, p2s) = prepare_fp8_weights(gate, up, down, "fp8-block128")
    assert torch.equal(w13.view(torch.uint8), p13.view(torch.uint8)) and torch.equal(w13s, p13s)
    assert torch.equal(w2.view(torch.uint8), p2.view(torch.uint8)) and torch.equal(w2s, p2s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.from_block128_checkpoint(gate, gs, uq, us, dq, ds)
    with pytest.raises(ValueError, match="one scale per 128x128 block"):
        fp8.from_block128_checkpoint(gq, gs[:, :1], uq, us, dq, ds)


@pytest.mark.parametrize("precision", fp8.FP8)
def test_fp8_reference_tracks_the_bf16_layer(precision):
    torch.manual_seed(2)
    e, k, h, i, m = 4, 2, 256, 256, 9
    gate, up = torch.randn(e, i, h) / h ** 0.5, torch.randn(e, i, h) / h ** 0.5
    down = torch.randn(e, h, i) / i ** 0.5
    x = torch.randn(m, h).bfloat16()
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)]).int()
    tw = torch.softmax(torch.randn(m, k), -1)
    w13, w2 = prepare_fp8_weights(gate, up, down, precision)
    got = fp8_ref.moe_fp8_reference(x, w13, w2, tw, ids, precision)
    want = moe_reference(x, interleave_gate_up(gate, up), down, tw, ids)
    assert 1e-3 < rel_err(got, want) < 0.1  # e4m3 costs a few percent, never nothing
    # no tokens: an empty output, as the bf16 reference gives
    assert fp8_ref.moe_fp8_reference(x[:0], w13, w2, tw[:0], ids[:0], precision).shape == (0, h)


def test_spec_accepts_fp8_with_128_multiples_on_every_target():
    assert make_spec("deepseek-v3", precision="fp8-block128").workload_key.endswith("_fp8-block128")
    assert make_spec("qwen3-30b-a3b", precision="FP8").precision == "fp8"
    with pytest.raises(SpecError, match="multiple of 128 for precision fp8"):
        make_spec("gpt-oss-120b", precision="fp8")
    for target in ("sm_100a", "sm_121a"):  # the mma.sync kernels (templates/warp_fp8.py)
        spec = make_spec("deepseek-v3", precision="fp8", target=target)
        for tokens in V.token_buckets():
            v = V.default_variant(spec, tokens)
            assert v.glu.mma == v.down.mma == "warp" and V.can_implement(spec, v)[0]
    with pytest.raises(SpecError, match="not yet supported for sm_100a"):
        make_spec("gpt-oss-120b", precision="mxfp4-w", target="sm_100a")


@pytest.mark.parametrize("precision", fp8.FP8)
def test_fp8_variants_and_their_refusals(precision):
    spec = make_spec("deepseek-v3", precision=precision)
    v = V.default_variant(spec, 4096)
    kvs = v.kernels(spec)
    assert [kv.role for kv in kvs] == list(V.PRECISION_ROLES[precision])
    for kv in kvs:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kv.name), kv.name
    assert dict(kvs[2].params)["precision"] == precision
    bf = make_spec("deepseek-v3")
    assert "precision" not in dict(V.default_variant(bf, 4096).kernels(bf)[1].params)  # bf16 kernels as before
    space = V.candidate_space(spec)
    assert space and all(t.mma in ("hopws", "warp") and t.tile_k in (128, 256)
                         for var in space for t in (var.glu, var.down))
    # 2-CTA clusters (the weight tile multicast to an expert's pair of M tiles): 128-row hopws only
    assert {(var.tile_m, t.mma) for var in space for t in (var.glu, var.down) if t.cluster > 1} == {(128, "hopws")}
    # 256-wide k-tiles: GEMM1's on the cooperative core only
    assert {(role, t.mma) for var in space for role, t in (("glu", var.glu), ("down", var.down))
            if t.tile_k == 256} == {("glu", "hopws")}
    # 256 columns only in cooperative tiles promoted in two 128-column parts (64 or 128 rows)
    assert {var.glu.tile_n for var in space if var.glu.mma == "hopws"} == {128, 256}
    wide = {var.tile_m for var in space for t in (var.glu, var.down) if t.mma == "hopws" and t.tile_n > 128}
    assert wide == {64, 128}
    assert {var.glu.tile_n for var in space if var.glu.mma == "warp"} == {128, 256}
    assert {var.tile_m for var in space if var.glu.mma == "warp"} == set(V.TILE_M)
    # GEMM1 promoted once per 2 (4) k-tiles: "fp8" only (its scales are the same for every K block),
    # cooperative tiles promoted in column parts, never GEMM2
    promoted = [var for var in space if var.glu.promote > 1]
    assert all(var.down.promote == 1 for var in space)
    if precision == "fp8":
        assert promoted and all(var.glu.mma == "hopws" and var.glu.tile_n > 128 and var.glu.stages > var.glu.promote
                                for var in promoted)
        assert {var.glu.promote for var in promoted} <= set(limits.PROMOTE_EVERY[1:])
    else:
        assert not promoted
    G = V.GemmTiles
    for tm, glu, down, why in (
            (64, G(128, 128, 6, "hopws"), G(192, 128, 4, "hopws"), "accumulator registers"),
            (128, G(192, 128, 4, "hopws"), G(128, 128, 6, "hopws"), "multiple of 128"),
            (128, G(128, 64, 6, "hopws"), G(128, 128, 6, "hopws"), "tile_k 64 must be 128"),
            (64, G(128, 128, 8, "hoppp"), G(128, 128, 6, "hoppp"), "runs on mma in"),
            (64, G(128, 128, 6, "hopws", 2), G(128, 128, 6, "hopws"), "cluster"),
            (16, G(128, 64, 6, "warp"), G(32, 128, 8, "warp"), "tile_k 64 must be one of (128, 256)"),
            (16, G(128, 256, 4, "warp"), G(32, 128, 8, "warp"), "256-wide k-tiles are GEMM1's"),
            (64, G(128, 128, 6, "hopws"), G(128, 256, 4, "hopws"), "256-wide k-tiles are GEMM1's"),
            (16, G(64, 128, 6, "warp"), G(32, 128, 8, "warp"), "tile_n 64 must be a multiple of 128"),
            (128, G(256, 128, 3, "warp"), G(32, 128, 8, "warp"), "with its partial sums"),
            (128, G(256, 128, 4, "hopws"), G(256, 128, 4, "hopws", promote=2), "same scales for every K block"),
            (128, G(128, 128, 6, "hopws", promote=2), G(128, 128, 6, "hopws"), "same scales for every K block"),
            (128, G(256, 128, 4, "hopws", promote=3), G(256, 128, 4, "hopws"), "must be one of"),
            (128, G(256, 128, 4, "hopws"), G(256, 128, 4, "hopws", fast_act=True), "fast_act is GEMM1's")):
        ok, reason = V.can_implement(spec, V.LayerVariant(tm, glu, down))
        assert not ok and why in reason, reason
    glu_p = G(256, 128, 4, "hopws", promote=2)
    ok, reason = V.can_implement(spec, V.LayerVariant(128, glu_p, G(256, 128, 4, "hopws"), h_block=128))
    assert ok == (precision == "fp8"), reason  # block128's weight scales differ per K block
    if precision == "fp8":
        ok, reason = V.can_implement(spec, V.LayerVariant(128, G(256, 128, 4, "hopws", promote=4),
                                                          G(256, 128, 4, "hopws"), h_block=128))
        assert not ok and "below the 4 stages" in reason, reason  # the producer keeps a stage
    if precision == "fp8-block128":
        ok, reason = V.can_implement(spec, V.LayerVariant(16, G(128, 128, 6, "warp"), G(256, 128, 4, "warp")))
        assert not ok and "must divide 128" in reason, reason


@pytest.mark.parametrize("mma", ["hopws", "hopws256", "hopws256h128", "hopws64x256", "hopwsk256", "hopwsc2",
                                 "hopwsp2", "warp", "warp256h128"])
def test_fp8_kernels_compile(tmp_path, mma):
    """The routing launch that quantizes x and both fp8 GEMMs compile on this CPU machine into libraries whose
    cubins hold fp8 wgmma (QGMMA) on the Hopper core, e4m3 mma.sync on the mma.sync one; both
    take the same arguments. With h scaled per 128 columns (h_block 128), GEMM2 waits for its
    wgmmas and promotes once per k-tile and part, half as often as with 64."""
    pytest.importorskip("cutlass")
    from moe_aot.compiler import build_template
    from moe_aot.kernel_build import compile_kernel

    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=256, precision="fp8-block128")
    if mma == "hopws":
        v = V.LayerVariant(128, V.GemmTiles(128, 128, 3, "hopws"), V.GemmTiles(128, 128, 3, "hopws"))
        want_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    elif mma == "hopws256":  # 128x256 tiles promoted in two 128-column parts (GEMM2: "fp8" only)
        spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=256, precision="fp8")
        v = V.LayerVariant(128, V.GemmTiles(256, 128, 3, "hopws"), V.GemmTiles(256, 128, 3, "hopws"))
        want_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    elif mma == "hopws256h128":  # block128's GEMM2 too: a part's k-tile is one weight block and one h block
        v = V.LayerVariant(128, V.GemmTiles(256, 128, 3, "hopws"), V.GemmTiles(256, 128, 3, "hopws"), h_block=128)
        want_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    elif mma == "hopws64x256":  # the decode tile of 256 columns: one warpgroup, promoted in two parts
        v = V.LayerVariant(64, V.GemmTiles(256, 128, 3, "hopws"), V.GemmTiles(256, 128, 3, "hopws"), h_block=128)
        want_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    elif mma == "hopwsk256":  # GEMM1's 256-wide k-tiles: two 128-byte atoms and scale blocks per k-tile
        spec = make_spec(experts=8, top_k=2, hidden=512, intermediate=256, precision="fp8-block128")
        v = V.LayerVariant(64, V.GemmTiles(128, 256, 3, "hopws"), V.GemmTiles(128, 128, 3, "hopws"))
        want_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    elif mma == "hopwsc2":  # 2-CTA clusters: an expert's pair of M tiles shares each weight tile by multicast
        v = V.LayerVariant(128, V.GemmTiles(256, 128, 3, "hopws", 2), V.GemmTiles(256, 128, 3, "hopws", 2),
                           h_block=128)
        want_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    elif mma == "hopwsp2":  # "fp8" GEMM1 promoted once per 2 k-tiles (the tensor cores sum 256 of K), fast_act
        spec = make_spec(experts=8, top_k=2, hidden=512, intermediate=256, precision="fp8")
        v = V.LayerVariant(128, V.GemmTiles(256, 128, 3, "hopws", promote=2, fast_act=True),
                           V.GemmTiles(256, 128, 3, "hopws"), h_block=128)
        want_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    elif mma == "warp256h128":  # 8 lanes share a row's 128-column h block in GEMM1's epilogue
        v = V.LayerVariant(16, V.GemmTiles(256, 128, 2, "warp"), V.GemmTiles(32, 128, 2, "warp"), h_block=128)
        want_mma = r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32"
    else:
        v = V.LayerVariant(16, V.GemmTiles(128, 128, 2, "warp"), V.GemmTiles(32, 128, 2, "warp"))
        want_mma = r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3\.f32"
    assert V.can_implement(spec, v)[0]
    for kv in v.kernels(spec):
        if kv.role not in ("routing", "glu", "down") or (kv.role == "routing" and mma == "warp"):
            continue
        art = compile_kernel(build_template(kv), "sm_90a", kv.name)
        assert art.library[:4] == b"\x7fELF"
        if kv.role != "routing":
            assert re.search(want_mma, art.ptx), kv.name
        if mma == "hopwsc2" and kv.role != "routing":
            # the weights' multicast TMA (a pair of one expert) and the plain one (two experts'
            # leftover tiles), the pair list's ballots, and no local memory
            body = art.ptx[art.ptx.index(".entry"):]
            assert ".multicast::cluster" in body and "vote.sync.ballot" in body, kv.name
            assert "ld.local" not in body and "st.local" not in body, kv.name
        tool = cuobjdump()
        if mma == "hopwsp2" and kv.role == "glu":
            # per group of 2 k-tiles and part: 8 k32 wgmmas (2 parts: 16 in the loop body), one wait
            # each and one promotion; the kernel's name says so
            assert "_hopws_p2_fa_" in kv.name and len(re.findall(want_mma, art.ptx)) == 16, kv.name
            # fast_act: the SiLU's reciprocal is rcp.approx per element (not rcp.rn, a Newton step
            # and a slow path each); only the h blocks' scales (amax / 448) keep an exact one
            assert art.ptx.count("rcp.approx.ftz.f32") == 64 and art.ptx.count("rcp.rn.f32") == 2, kv.name
            if tool:
                cubin = tmp_path / f"{kv.role}.cubin"
                cubin.write_bytes(art.cubin)
                sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
                assert len(re.findall(r"WARPGROUP\.DEPBAR", sass)) == 2, kv.name
                assert len(re.findall(r"\bQGMMA\b", sass)) == 16 and not re.search(r"\b(STL|LDL)\b", sass), kv.name
        if mma == "hopws256" and kv.role == "glu":  # without fast_act: rcp.rn as the committed picks were built
            assert art.ptx.count("rcp.approx") == 0 and art.ptx.count("rcp.rn.f32") >= 64, kv.name
        if mma in ("hopws64x256", "hopwsk256") and kv.role != "routing" and tool:  # no spills at 64 rows either
            cubin = tmp_path / f"{kv.role}.cubin"
            cubin.write_bytes(art.cubin)
            usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
            assert "STACK:0" in usage and "LOCAL:0" in usage, usage
            if mma == "hopws64x256":  # both parts of every K block, as at 128 rows
                assert len(re.findall(want_mma, art.ptx)) == 8, kv.name
        if mma.startswith("hopws256") and kv.role != "routing":
            # both parts of every K block: GEMM1 one block of 4 k32 wgmmas per k-tile, GEMM2 two
            # of 2 (its h scales per 64 columns) or, with h_block 128, one of 4; B's second part
            # 16 KB into the stage
            assert len(re.findall(want_mma, art.ptx)) == 8, kv.name
            if tool:  # one partial sum of a part beside the 64x256 accumulators: ptxas spills nothing
                cubin = tmp_path / f"{kv.role}.cubin"
                cubin.write_bytes(art.cubin)
                usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True,
                                       text=True, check=True).stdout
                assert "STACK:0" in usage and "LOCAL:0" in usage, usage
                sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
                assert not re.search(r"\b(STL|LDL)\b", sass), kv.name
                # the mainloop's k-tile: its waits for the wgmmas (one per promotion), its
                # promotions (64 FFMA each: a part's 64x128 partial sums over 128 threads)
                waits, ffma = len(re.findall(r"WARPGROUP\.DEPBAR", sass)), len(re.findall(r"\bFFMA\b", sass))
                promotions = 2 if kv.role == "glu" or v.h_block == 128 else 4
                assert waits == promotions, (kv.name, waits)
                if kv.role == "down":  # (GEMM1's epilogue has FFMAs of its own)
                    assert ffma == 64 * promotions, (kv.name, ffma)
        if mma == "warp256h128" and kv.role == "glu" and tool:  # lanes of a 128-column h block: 3 butterflies
            cubin = tmp_path / f"{kv.role}.cubin"
            cubin.write_bytes(art.cubin)
            sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
            assert len(re.findall(r"SHFL\.BFLY", sass)) == 3, kv.name
        names = [a["name"] for a in art.meta["args"]]
        if kv.role in ("glu", "down"):  # hs [R, I / h_block], R dynamic
            hs = next(a for a in art.meta["args"] if a["name"] == "hs")
            assert hs["static_shape"] == [None, spec.intermediate // v.h_block], hs
        want = {"routing": ["topk_ids", "expert_counts", "expert_offsets", "sorted_ids", "tile_expert", "x", "xq",
                            "xs"], "glu": ["x", "xs", "w13", "w13s", "sorted_ids", "tile_expert", "h", "hs"],
                "down": ["h", "hs", "w2", "w2s", "sorted_ids", "tile_expert", "topk_weights", "y"]}[kv.role]
        assert names[:len(want)] == want, names


def test_fp8_gemms_build_for_dgx_spark():
    """sm_121a gets fp8 from the mma.sync kernels, in aarch64 host libraries; there its e4m3 MMA
    is native (QMMA), where sm_90a converts to f16 first (the same template's sm_90a build is what
    the H200 checks: tools/check_fp8_kernels.py --only f8w16)."""
    import cross_tools

    cross_tools.require(cross_tools.CROSS_CC)
    pytest.importorskip("cutlass")
    from moe_aot.compiler import build_template
    from moe_aot.kernel_build import compile_kernel

    spec = make_spec(experts=8, top_k=2, hidden=256, intermediate=256, precision="fp8", target="sm_121a")
    v = V.default_variant(spec, 16)
    assert v.glu.mma == v.down.mma == "warp"
    for kv in v.kernels(spec):
        if kv.role not in ("glu", "down"):
            continue
        art = compile_kernel(build_template(kv), "sm_121a", kv.name)
        assert int.from_bytes(art.library[18:20], "little") == 183  # EM_AARCH64
        assert (int.from_bytes(art.cubin[48:52], "little") >> 8) & 0xFF == 121
        assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in art.ptx, kv.name


def test_h_block_is_the_layers_both_gemms_take_it_and_names_say_it():
    """h's scale block is one field of the layer variant: 128 only where GEMM1's tiles hold whole
    128-column blocks of h (tile_n 256), only for fp8; both GEMMs' names and arguments carry it;
    the 128x256 defaults take 128 (re-tuned: tuning_2026-12-02x), the decode defaults keep 64."""
    G = V.GemmTiles
    spec = make_spec("mixtral-8x7b", precision="fp8")
    assert V.default_variant(spec, 4096).h_block == 128
    assert V.default_variant(make_spec("qwen3-30b-a3b", precision="fp8"), 16).h_block == limits.H_SCALE_BLOCK
    base = dataclasses.replace(V.default_variant(spec, 4096), h_block=limits.H_SCALE_BLOCK)
    assert base.glu.tile_n == 256
    twin = base.h_block_twin(spec)
    assert twin is not None and twin.h_block == 128 and (twin.glu, twin.down) == (base.glu, base.down)
    assert twin.h_block_twin(spec) is None
    assert V.can_implement(spec, twin) == (True, "ok")
    old = {kv.role: kv for kv in base.kernels(spec)}
    new = {kv.role: kv for kv in twin.kernels(spec)}
    for role in ("glu", "down"):
        assert new[role].name != old[role].name and "_h128" in new[role].name, new[role].name
        assert new[role].kwargs()["h_block"] == 128 and "h_block" not in old[role].kwargs()
        assert not re.search(r"_h\d", old[role].name)  # 64: named and built as before
    for role in ("routing", "combine"):
        assert new[role] == old[role] and new[role].params == old[role].params
    assert twin.name(spec).endswith("_h128") and V.LayerVariant.parse(twin.name(spec)) == twin
    pdl = twin.pdl_twin()
    assert pdl.name(spec).endswith("_h128_pdl") and V.LayerVariant.parse(pdl.name(spec)) == pdl
    # refusals, each in one sentence naming the h block
    narrow = V.LayerVariant(128, G(128, 128, 6, "hopws"), G(256, 128, 4, "hopws"), h_block=128)
    ok, why = V.can_implement(spec, narrow)
    assert not ok and "h_block 128" in why and "tile_n 128 holds 64 h columns" in why, why
    assert narrow.h_block_twin(spec) is None and dataclasses.replace(narrow, h_block=64).h_block_twin(spec) is None
    ok, why = V.can_implement(spec, dataclasses.replace(twin, h_block=96))
    assert not ok and "must be one of (64, 128)" in why, why
    bf = make_spec("mixtral-8x7b")
    ok, why = V.can_implement(bf, dataclasses.replace(V.default_variant(bf, 4096), h_block=128))
    assert not ok and "only fp8 layers" in why, why
    # the decode tiles (mma.sync 16x256 GEMM1 too) may write 128-column blocks, 128-wide ones not
    warp = V.LayerVariant(16, G(256, 128, 4, "warp"), G(64, 128, 6, "warp"), h_block=128)
    assert V.can_implement(spec, warp)[0]
    assert not V.can_implement(spec, dataclasses.replace(warp, glu=G(128, 128, 6, "warp")))[0]
    # the tuner's space holds both blocks, 128 only beside 256-wide GEMM1 tiles
    space = V.candidate_space(make_spec(experts=8, top_k=2, hidden=1024, intermediate=1024, precision="fp8"))
    assert {v.h_block for v in space} == {64, 128}
    assert {v.glu.tile_n for v in space if v.h_block == 128} == {256}
    assert {v.h_block for v in V.candidate_space(make_spec(experts=8, top_k=2, hidden=1024, intermediate=1024))} \
        == {64}
    for model in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"):
        for precision in fp8.FP8:
            s = make_spec(model, precision=precision)
            for t in V.token_buckets():  # 128 exactly where the default's GEMM1 tiles are 256 wide
                v = V.default_variant(s, t)
                assert v.h_block == (128 if v.glu.tile_n == 256 and v.glu.mma == "hopws" else 64), (model, t)


def test_template_refuses_an_h_block_its_tiles_cannot_write():
    pytest.importorskip("cutlass")
    from moe_aot_templates.hopper_fp8 import HopperDownGemmFp8, HopperGluGemmFp8

    kw = dict(tile_m=128, tile_k=128, stages=3, mma="hopws", precision="fp8")
    with pytest.raises(ValueError, match="tile_n 128 holds 64 h columns"):
        HopperGluGemmFp8(8, 256, 256, 2, tile_n=128, h_block=128, **kw)
    assert HopperGluGemmFp8(8, 256, 256, 2, tile_n=256, h_block=128, **kw).h_block == 128
    down = HopperDownGemmFp8(8, 256, 256, 2, tile_n=128, h_block=128, **kw)
    assert (down.kblock, down.kblocks) == (128, 1)  # one promotion per k-tile
    assert (HopperDownGemmFp8(8, 256, 256, 2, tile_n=128, **kw).kblocks) == 2
    args = dict(down.fake_arguments())
    assert tuple(args["hs"].shape)[1] == 256 // 128


@pytest.mark.parametrize("precision", fp8.FP8)
def test_fp8_reference_follows_the_h_block(precision):
    """The reference quantizes h per the variant's block: a 128-column scale is the larger of
    its two 64-column ones, GEMM2's reference reads the block off hs's shape, and the layer's
    reference at 128 is what dequantizing per 128 gives (and not what 64 gives)."""
    torch.manual_seed(3)
    h = torch.randn(5, 512) * torch.logspace(-2, 1, 512)
    q64, s64 = fp8_ref.quantize_rows(h, 64)
    q128, s128 = fp8_ref.quantize_rows(h, 128)
    assert torch.equal(s128, torch.maximum(s64[:, 0::2], s64[:, 1::2]))
    e, k, hd, i, m, tm = 4, 2, 256, 512, 9, 16
    w2 = torch.randn(e, hd, i) / i ** 0.5
    w2q, w2s = fp8.prepare_w2(w2, precision)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)]).int()
    tw = torch.softmax(torch.randn(m, k), -1)
    _, _, sorted_ids, tile_expert = routing_reference(ids, e, tm)
    hr = torch.randn(sorted_ids.numel(), i)
    for block in (64, 128):
        hq, hs = fp8_ref.quantize_rows(hr, block)
        y = fp8_ref.down_fp8_reference(hq, hs, w2q, w2s, sorted_ids, tile_expert, tm, tw, precision)
        valid = sorted_ids >= 0
        p = sorted_ids[valid].long()
        experts = torch.repeat_interleave(tile_expert.long(), tm)[valid]
        rows = fp8_ref.dequantize_rows(hq, hs, block)[valid]
        wd = fp8_ref.dequantize_w2(w2q, w2s, precision)
        want = tw.reshape(-1)[p].unsqueeze(1) * torch.stack([wd[x] @ r for r, x in zip(rows, experts.tolist())])
        assert torch.allclose(y[p], want, rtol=1e-5, atol=1e-5)
    gate, up = torch.randn(e, i, hd) / hd ** 0.5, torch.randn(e, i, hd) / hd ** 0.5
    w13 = fp8.prepare_w13(gate, up, precision)
    x = torch.randn(m, hd).bfloat16()
    r64 = fp8_ref.moe_fp8_reference(x, w13, (w2q, w2s), tw, ids, precision)
    r128 = fp8_ref.moe_fp8_reference(x, w13, (w2q, w2s), tw, ids, precision, h_block=128)
    assert torch.equal(r64, fp8_ref.moe_fp8_reference(x, w13, (w2q, w2s), tw, ids, precision, h_block=64))
    assert 0 < rel_err(r128, r64) < 0.05  # another rounding of h, within what e4m3 costs


def test_fp8_pingpong_gemm2_takes_turns(monkeypatch, tmp_path):
    """The fp8 ping-pong GEMM2 that crashed under timing on 2026-12-01 (Qwen3-30B: 6 k-tiles, 6
    stages, 64x128 tiles): its two consumer warpgroups' mainloops take turns (two mbarriers of 128
    arrivals, waited on with a parity the loop flips), the race's fix. The core is still not
    offered for fp8 (FP8_MMAS); the tools widen it as here."""
    import cutlass.cute as cute
    from moe_aot_templates.hopper_fp8 import HopperDownGemmFp8
    from test_gemm_templates import _mbarrier_init_counts, _turn_parity_flips

    assert "hoppp" not in limits.FP8_MMAS
    with pytest.raises(ValueError, match="runs on mma in"):
        HopperDownGemmFp8(128, 2048, 768, 8, tile_m=64, tile_n=128, tile_k=128, stages=6, mma="hoppp",
                          precision="fp8")
    monkeypatch.setattr(limits, "FP8_MMAS", limits.WARP_SPECIALIZED)
    obj = HopperDownGemmFp8(128, 2048, 768, 8, tile_m=64, tile_n=128, tile_k=128, stages=6, mma="hoppp",
                            precision="fp8")
    ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                       options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}").__ptx__
    body = ptx[ptx.index(".entry"):]
    assert _mbarrier_init_counts(body) == [1] * 6 + [4] * 6 + [1, 1] + [128, 128] + [128, 128]
    assert _turn_parity_flips(body)

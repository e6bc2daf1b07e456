"""The weight-only MXFP4 layer ("mxfp4-w") on the CPU: the dequantizing reference by hand, the
kernels' e2m1 -> bf16 bit arithmetic emulated in torch against it for every code and scale
byte, gpt-oss checkpoint import against the checkpoint's own decode, the spec and variant rules,
and real compiles of the kernels for sm_90a (their numerics are checked on the GPU:
tests/test_gpu_w4.py, tools/check_w4.py)."""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from moe_aot import gemm_limits as limits  # noqa: E402
from moe_aot import variants as V  # noqa: E402
from moe_aot.harness import w4 as w4_ref  # noqa: E402
from moe_aot.harness.reference import moe_reference, rel_err  # noqa: E402
from moe_aot.layout import interleave_gate_up  # noqa: E402
from moe_aot.runtime import w4  # noqa: E402
from moe_aot.spec import SpecError, make_spec  # noqa: E402

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _checkpoint_decode(blocks, scales):
    """gpt-oss's own decode (openai/gpt-oss gpt_oss/torch/weights.py, Checkpoint._get_mxfp4_tensor):
    blocks [..., G, 16], scales [..., G] -> [..., G * 32], low nibble first, ldexp(lut, scale - 127)."""
    lut = torch.tensor(E2M1)
    vals = torch.stack((lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    return torch.ldexp(vals, (scales.long() - 127).unsqueeze(-1)).flatten(-2)


def test_dequantize_by_hand():
    # one expert, row 0 of 16, K = 64: block 0 codes 0..15 twice with scale 2^0, block 1 code 7
    # (6.0) with scale 2^-3 and code 9 (-0.5) with scale 2^-3; the other rows code 0
    codes = torch.tensor(list(range(16)) * 2 + [7, 9] * 16, dtype=torch.uint8)
    packed = torch.zeros(1, 16, 32, dtype=torch.uint8)
    packed[0, 0] = codes[0::2] | (codes[1::2] << 4)
    scales = torch.full((1, 16, 2), 127, dtype=torch.uint8)
    scales[0, 0, 1] = 124
    got = w4.dequantize(*w4.to_fragments(packed, scales))[0]
    want = torch.tensor(list(E2M1) * 2 + [0.75, -0.0625] * 16)
    assert torch.equal(got[0], want) and not got[1:].any()


def test_reference_by_hand_on_a_tiny_layer():
    """The mxfp4-w reference is the fp32 layer on the hand-decoded weights: one token, one
    expert, weights all code 2 (1.0) times 2^(s - 127), so every GEMM is a sum of x."""
    E, H, I = 2, 64, 64
    one = 0x22  # two codes of 1.0

    def weight(n, k, sbyte):
        return w4.W4Weight(*w4.to_fragments(torch.full((E, n, k // 2), one, dtype=torch.uint8),
                                            torch.full((E, n, k // 32), sbyte, dtype=torch.uint8)), None)

    w13, w2 = weight(2 * I, H, 126), weight(H, I, 127)  # 0.5 and 1.0 each
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([1.0, 2.0, -1.0, 0.5])  # sum 2.5: gate = up = 0.5 * 2.5
    ids, tw = torch.tensor([[1]], dtype=torch.int32), torch.tensor([[0.5]])
    out = w4_ref.moe_w4_reference(x, w13, w2, tw, ids, "swiglu")
    g = 1.25
    h = g / (1 + torch.exp(torch.tensor(-g))) * g  # silu(gate) * up, every one of the I columns
    assert torch.allclose(out, torch.full((1, H), float(0.5 * I * h)), rtol=1e-6)


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    return (bits & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _kernel_word(word: torch.Tensor, sbyte: torch.Tensor) -> torch.Tensor:
    """templates/grouped_w4.py's _word_reg / _scale_pair in torch integer and bf16 arithmetic:
    int64 words [n] (32-bit values) and scale bytes [n] -> bf16 [n, 4 outputs, 2 halves]."""
    word = word & 0xFFFFFFFF

    def rotl(x, d):
        return ((x << d) | (x >> (32 - d))) & 0xFFFFFFFF if d else x

    P = 0x81C081C0
    regs = [rotl(word, w4.ROTATE[o]) & P for o in range(3)]
    regs.append((rotl(word, 6) & 0x80C080C0) | (rotl(word, 30) & 0x01000100))
    r = torch.stack([torch.stack((_bf16(b), _bf16(b >> 16)), -1) for b in regs], 1)  # [n, 4, 2]
    c2 = torch.maximum(_bf16(sbyte << 7), _bf16(torch.tensor(0x0040)))  # max.bf16x2
    c1 = (c2.float() * 0 + 2.0 ** 126).to(torch.bfloat16)  # fma.rn.bf16x2 c2 * 0 + 2^126: one rounding
    return r * c1[:, None, None] * c2[:, None, None]  # two mul.rn.bf16x2


def test_kernel_bit_arithmetic_is_exact_for_every_code_and_scale():
    """Every e2m1 code in every slot of a word with every scale byte, through the kernel's
    conversion, equals the dequantization (exactly: bf16 holds every such product, inf where fp32's
    is inf too; byte 255 NaN), -0.0 included."""
    lut = torch.tensor(E2M1)
    words, codes = [], []
    for c in range(16):  # slot (o, f) holds code (c + 2o + f) % 16: every code in every slot
        code = [[(c + 2 * o + f) % 16 for f in range(2)] for o in range(4)]
        word = 0
        for o in range(4):
            for f in range(2):
                for cb in range(4):
                    word |= ((code[o][f] >> cb) & 1) << w4.CODE_BITS[o][f][cb]
        words.append(word)
        codes.append(code)
    w = torch.tensor(words, dtype=torch.int64).repeat(256)
    cd = torch.tensor(codes).repeat(256, 1, 1)
    s = torch.arange(256, dtype=torch.int64).repeat_interleave(16)
    got = _kernel_word(w, s).float()
    want = torch.ldexp(lut[cd], (s - 127)[:, None, None].float())
    want[s == 255] = float("nan")
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[s == 255]).all())
    fin = ~torch.isnan(want)
    assert torch.equal(got[fin], want[fin])
    assert torch.equal(torch.signbit(got[fin]), torch.signbit(want[fin]))  # -0.0 stays -0.0


def test_fragment_order_is_what_each_lane_converts():
    """Every lane's words of every chunk, converted as the kernel does, are the weights of its
    mma.sync B fragments: rows 16c + g (+ 8 for words 2, 3), columns 64kc + 32b + 16i + 8r + 2t + f
    (lane 4g + t, word 2h + b, output 2i + r, half f), scale byte 4g + 2h + b of the chunk; and
    from_fragments undoes to_fragments."""
    g = torch.Generator().manual_seed(5)
    e, n, k = 2, 32, 128
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (e, n, k // 32), dtype=torch.uint8, generator=g)
    blocks, fs = w4.to_fragments(codes, scales)
    assert blocks.shape == (e, n // 16, k // 64, 512) and fs.shape == (e, n // 16, k // 64, 32)
    back = w4.from_fragments(blocks, fs)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    dense = w4.dequantize(blocks, fs)
    words = blocks.view(torch.int32).reshape(e, n // 16, k // 64, 32, 4).to(torch.int64)
    for lane in (0, 5, 18, 31):
        gg, t = divmod(lane, 4)
        for wd in range(4):
            h, b = divmod(wd, 2)
            sb = fs[:, :, :, 4 * gg + 2 * h + b].to(torch.int64).flatten()
            got = _kernel_word(words[:, :, :, lane, wd].flatten(), sb).float().reshape(e, n // 16, k // 64, 4, 2)
            for o in range(4):
                i, r = divmod(o, 2)
                for f in range(2):
                    rows = torch.arange(n // 16) * 16 + gg + 8 * h
                    cols = torch.arange(k // 64) * 64 + 32 * b + 16 * i + 8 * r + 2 * t + f
                    assert torch.equal(got[..., o, f], dense[:, rows][:, :, cols]), (lane, wd, o, f)


def _gpt_oss_layer(e=2, h=64, i=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks13 = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, generator=g)
    scales13 = torch.randint(118, 130, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g)
    blocks2 = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, generator=g)
    scales2 = torch.randint(118, 130, (e, h, i // 32), dtype=torch.uint8, generator=g)
    b13 = torch.randn(e, 2 * i, generator=g).to(torch.bfloat16)
    b2 = torch.randn(e, h, generator=g).to(torch.bfloat16)
    return blocks13, scales13, blocks2, scales2, b13, b2


def test_gpt_oss_import_matches_the_checkpoint_decode_and_round_trips():
    """from_gpt_oss keeps the bytes and regroups rows: the dequantized w13 equals the checkpoint's
    decode with even rows as gate and odd rows as up, interleaved in blocks of 16 (the bf16
    layer's w13), w2 the checkpoint's decode; to_gpt_oss gives the checkpoint's bytes back."""
    b13q, s13, b2q, s2, b13, b2 = _gpt_oss_layer()
    w13, w2 = w4.from_gpt_oss(b13q, s13, b2q, s2, b13, b2)
    assert w13.blocks.shape == (2, 8, 1, 512) and w13.scales.shape == (2, 8, 1, 32) and w13.blocks.is_contiguous()
    dense13 = _checkpoint_decode(b13q, s13)  # [E, 2I, H], rows gate, up, gate, up, ...
    want13 = interleave_gate_up(dense13[:, 0::2], dense13[:, 1::2], V.INTERLEAVE)
    assert torch.equal(w4.dequantize(w13.blocks, w13.scales), want13)
    assert torch.equal(w4.dequantize(w2.blocks, w2.scales), _checkpoint_decode(b2q, s2))
    assert torch.equal(w13.bias, interleave_gate_up(b13[:, 0::2, None], b13[:, 1::2, None], V.INTERLEAVE)[..., 0])
    assert torch.equal(w2.bias, b2)
    for mine, theirs in zip(w4.to_gpt_oss(w13, w2), (b13q, s13, b2q, s2)):
        assert torch.equal(mine, theirs)
    # the reference of the imported layer is the fp32 layer of the checkpoint's weights
    x = torch.randn(3, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 0], [1, 1 - 1]], dtype=torch.int32)
    tw = torch.rand(3, 2)
    ref = w4_ref.moe_w4_reference(x, w13, w2, tw, ids, "swigluoai")
    want = moe_reference(x, want13, _checkpoint_decode(b2q, s2), tw, ids, "swigluoai", V.INTERLEAVE, w13.bias, b2)
    assert torch.equal(ref, want)
    with pytest.raises(ValueError, match=r"\[E, N, K/32, 16\]"):
        w4.from_gpt_oss(b13q[..., :8], s13, b2q, s2)


def test_prepare_weights_quantizes_like_blockscale_and_tracks_bf16():
    torch.manual_seed(3)
    gate, up, down = torch.randn(2, 64, 128), torch.randn(2, 64, 128) * 3, torch.randn(2, 128, 64)
    w13, w2 = w4.prepare_weights(gate, up, down)
    d13 = w4.dequantize(w13.blocks, w13.scales)
    assert rel_err(d13, interleave_gate_up(gate, up)) < 0.15  # e2m1 keeps ~2 significant bits
    assert rel_err(w4.dequantize(w2.blocks, w2.scales), down) < 0.15
    # quantizing the dequantized weights again gives the same bytes (MX round trip)
    again = w4.quantize(d13)
    assert torch.equal(again[0], w13.blocks) and torch.equal(again[1], w13.scales)


def test_spec_and_variant_rules():
    spec = make_spec("gpt-oss-120b", precision="mxfp4-w")
    assert spec.bias and spec.precision_tag == "mxfp4w"
    with pytest.raises(SpecError, match="not yet supported for sm_100a"):
        make_spec("gpt-oss-120b", precision="mxfp4-w", target="sm_100a")
    for tokens in (1, 16, 64, 256, 1024, 4096):
        v = V.default_variant(spec, tokens)
        assert V.can_implement(spec, v) == (True, "ok")
        names = [kv.name for kv in v.kernels(spec)]
        assert [kv.role for kv in v.kernels(spec)] == list(V.PRECISION_ROLES["mxfp4-w"])
        assert all("_mxfp4w_" in n for n in names if not n.startswith("moe_route"))
    bf16 = make_spec("gpt-oss-120b")
    v = V.default_variant(spec, 1)
    assert {kv.name for kv in v.kernels(spec)[1:3]}.isdisjoint(kv.name for kv in v.kernels(bf16))
    ok = V.LayerVariant(16, V.GemmTiles(128, 64, 4), V.GemmTiles(64, 64, 4))
    assert V.can_implement(spec, ok)[0]
    refusals = [
        (V.LayerVariant(64, V.GemmTiles(128, 64, 4, "hopws"), V.GemmTiles(64, 64, 4)), "runs on mma in"),
        (V.LayerVariant(16, V.GemmTiles(128, 64, 2), V.GemmTiles(64, 64, 4)), "must be >= 3"),
        (V.LayerVariant(32, V.GemmTiles(32, 32, 4), V.GemmTiles(64, 64, 4)), "multiples of 64"),
    ]
    for v, why in refusals:
        ok_, reason = V.can_implement(spec, v)
        assert not ok_ and why in reason, reason
    assert "packed weight rows" in limits.check_w4("mxfp4-w", 64, 128, 16, 16, 128, 3, "warp")[1]
    assert "scale blocks" in limits.check_w4("mxfp4-w", 64, 96, 16, 32, 64, 3, "warp")[1]
    assert limits.check_w4("bf16", 64, 48, 16, 32, 16, 1, "wgmma") == (True, "")


def test_kernels_compile_for_sm90a_with_the_expected_ptx():
    """The default pick at 1 token of gpt-oss-120b: both GEMMs compile for sm_90a; the weights
    come in as 16-byte cp.async, each lane reads its codes with 16-byte shared loads and converts
    them in registers (rotates, bf16x2 multiplies; no fp32 detour, no local memory, no shared
    store of converted weights), multiplied by bf16 mma.sync."""
    from moe_aot.compiler import build_template
    from moe_aot.kernel_build import compile_kernel

    spec = make_spec("gpt-oss-120b", precision="mxfp4-w")
    v = V.default_variant(spec, 1)
    for kv in v.kernels(spec)[1:3]:
        art = compile_kernel(build_template(kv), "sm_90a", kv.name)
        ptx = art.ptx
        assert "ld.local" not in ptx and "st.local" not in ptx, kv.name
        assert re.search(r"cp\.async\.cg\.shared\.global(\.L2::128B)? \[[^]]+\], \[[^]]+\], 16(, 16)?;", ptx), kv.name
        assert "mul.rn.bf16x2" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx, kv.name
        assert "ld.shared.v4.b32" in ptx and "shf.l.wrap.b32" in ptx, kv.name  # a lane's codes, rotated


def test_moe_forward_reads_the_layer_shape_off_fragment_order_blocks():
    """moe_forward takes mxfp4-w weights as W4Weight triples whose blocks are in fragment order
    ([E, 2I/16, H/64, 512]); blocks of another rank are refused in one sentence naming the layout."""
    import pytest
    import torch

    from moe_aot.runtime.layer import moe_forward
    from moe_aot.runtime.library import KernelArgumentError
    from moe_aot.runtime.w4 import W4Weight

    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    flat = W4Weight(torch.zeros(4, 64, 64, dtype=torch.uint8), torch.zeros(4, 64, 4, dtype=torch.uint8), None)
    with pytest.raises(KernelArgumentError, match=r"blocks must be \[experts, 2\*intermediate/16, hidden/64, 512\]"):
        moe_forward(x, flat, flat, torch.zeros(2, 2), ids)
    frag = W4Weight(torch.zeros(4, 4, 2, 512, dtype=torch.uint8), torch.zeros(4, 4, 2, 32, dtype=torch.uint8), None)
    with pytest.raises(KernelArgumentError, match="CUDA tensor"):  # past the shape: only the CPU is refused
        moe_forward(x, frag, frag, torch.zeros(2, 2), ids)

"""The block-scaled formats on the CPU: the torch reference (moe_aot/blockscale.py) against values
worked out by hand from the OCP MX and NVFP4 definitions and against brute-force rounding, its
edge cases (zeros, -0, one large value, ties, saturation, subnormals, NaN/Inf), round trips, and
the quantization kernel (templates/blockscale_quant.py) compiled for sm_90a, sm_100a and sm_121a
with the conversions each must use. Its bytes are compared with the reference on the GPU
(tests/test_gpu_blockscale.py, tools/check_blockscale.py)."""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from moe_aot import blockscale as B  # noqa: E402
from moe_aot import variants as V  # noqa: E402
from moe_aot.harness import blockscale as H  # noqa: E402


def _bf(values):
    return torch.tensor(values, dtype=torch.float32).bfloat16()


def _block(fill, head, n):
    """One row: `head` then `fill` up to n values."""
    return list(head) + [fill] * (n - len(head))


# -- the element formats against brute force ---------------------------------------------------------
def _nearest_even(v: torch.Tensor, grid: torch.Tensor, even: torch.Tensor) -> torch.Tensor:
    """Index into the non-negative `grid` nearest |v|, ties to the index whose `even` is True; |v|
    beyond the grid's end gives its last index (saturation)."""
    d = (v.abs().unsqueeze(-1) - grid).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best
    tie = cand.sum(-1) > 1
    pick = torch.where(tie, (cand & even).float().argmax(-1), cand.float().argmax(-1))
    return torch.where(v.abs() >= grid[-1], len(grid) - 1, pick)


def test_e2m1_rounds_to_nearest_even_and_saturates():
    grid = torch.tensor(B.E2M1_VALUES)
    even = torch.arange(8) % 2 == 0  # the code's mantissa bit is 0
    mids = torch.tensor([m for m, _ in B.E2M1_MIDPOINTS])
    v = torch.cat([torch.linspace(-8, 8, 4001), mids, -mids, grid, -grid, mids.nextafter(torch.zeros(7)),
                   mids.nextafter(torch.full((7,), 9.0)), torch.tensor([1e30, -1e30, float("inf"), -float("inf")])])
    codes = B.e2m1_codes(v)
    negative = torch.signbit(v).to(torch.uint8)  # -0.0 included
    want = _nearest_even(v, grid, even).to(torch.uint8) | (negative << 3)
    assert torch.equal(codes, want)
    assert torch.equal(B.e2m1_codes(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.0, -0.2])),
                       torch.tensor([0, 2, 2, 4, 4, 6, 6, 7, 8, 8], dtype=torch.uint8))
    assert torch.equal(B.e2m1_values(torch.arange(16, dtype=torch.uint8)).abs(), torch.cat([grid, grid]))


def test_e4m3_rounds_to_nearest_even_saturating_at_448():
    pos = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    even = torch.arange(0x7F) % 2 == 0
    mids = (pos[1:] + pos[:-1]) / 2
    v = torch.cat([mids, -mids, pos, torch.randn(5000) * 100, torch.tensor([449.0, 463.9, 464.0, 1e6, -1e6])])
    got = B.e4m3_bytes(v)
    want = _nearest_even(v, pos, even).to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 7)
    assert torch.equal(got, want)
    assert B.e4m3_bytes(torch.tensor([-0.0])).item() == 0x80


def test_fp4_packing_is_low_nibble_first_as_torch():
    """torch.testing._internal.common_quantized.pack_uint4 (how torch fills float4_e2m1fn_x2):
    ``data[1::2] << 4 | data[::2]``; it is not imported here (that module needs expecttest)."""
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = B.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x43]]
    assert torch.equal(B.unpack_fp4(packed), codes)


# -- the formats, worked out by hand -----------------------------------------------------------------
def test_mxfp8_by_hand():
    # block 0: amax 3 -> floor(log2 3) = 1, e = 1 - 8 = -7, byte 120; x * 2^7: 3 -> 384, 1 -> 128,
    #          0.01 (bf16 0.010009765625) -> 1.28125 -> e4m3 1.25 (step 0.125)
    # block 1: amax 1.9921875 -> e = -8, byte 119; 1.9921875 * 256 = 510 -> saturates to 448
    # block 2: zeros, one -0.0 -> byte 0, bytes 0x00 and 0x80
    # block 3: one large value 1000 -> floor(log2) = 9, e = 1, byte 128; 1000 / 2 = 500 -> 448,
    #          1 -> 0.5
    x = _bf([_block(0.0, [3.0, 1.0, 0.01, -3.0], 32) + _block(1.0, [1.9921875], 32)
             + _block(0.0, [-0.0], 32) + _block(1.0, [1000.0], 32)])
    q = B.quantize(x, "mxfp8")
    assert q.scales.tolist() == [[120, 119, 0, 128]] and q.global_amax is None
    vals = B.e4m3_values(q.values).reshape(4, 32)
    assert vals[0, :4].tolist() == [384.0, 128.0, 1.25, -384.0] and (vals[0, 4:] == 0).all()
    assert vals[1, 0] == 448.0 and (vals[1, 1:] == 256.0).all()
    assert q.values.reshape(4, 32)[2].tolist() == [0x80] + [0] * 31
    assert vals[3, 0] == 448.0 and (vals[3, 1:] == 0.5).all()
    back = B.dequantize(q, "mxfp8").reshape(4, 32)
    assert back[0, :2].tolist() == [3.0, 1.0] and back[3, 0] == 896.0  # 448 * 2


def test_mxfp4_by_hand_ties_and_saturation():
    # amax 7 -> floor(log2 7) = 2, e = 0, byte 127, elements as they are: 7 -> 6 (saturated),
    # ties 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, -5 -> -4 (to the even code), 5.5 -> 6, -0.0 -> 0x8
    x = _bf([_block(0.0, [7.0, 0.25, 0.75, 2.5, -5.0, 5.5, -0.0, 1.25, 1.75, 3.5], 32)])
    q = B.quantize(x, "mxfp4")
    assert q.scales.tolist() == [[127]] and q.values.shape == (1, 16)
    codes = B.unpack_fp4(q.values)[0]
    assert codes[:10].tolist() == [7, 0, 2, 4, 0xE, 7, 8, 2, 4, 6]
    assert B.e2m1_values(codes[:6]).tolist() == [6.0, 0.0, 1.0, 2.0, -4.0, 6.0]


def test_nvfp4_by_hand():
    # global amax 2688 -> S_enc = 448 * 6 / 2688 = 1; block amax 6 -> scale e4m3(6 * fp32(1/6)) = 1,
    # elements as they are; block amax 0.75 -> e4m3(0.125) = 0.125, inv 8: 0.75 -> 6, 0.1 -> 0.8 -> 1
    x = _bf([_block(0.0, [6.0, -2.5, 0.25], 16) + _block(0.0, [0.75, 0.1], 16)])
    q = B.quantize(x, "nvfp4", torch.tensor([2688.0]))
    assert B.e4m3_values(q.scales).tolist() == [[1.0, 0.125]]
    codes = B.unpack_fp4(q.values)[0]
    assert B.e2m1_values(codes[:3]).tolist() == [6.0, -2.0, 0.0] and B.e2m1_values(codes[16:18]).tolist() == [6.0, 1.0]
    # the default global amax is x's own (6 here): S_enc = 448, block scale e4m3(6 * (448 / 6)) = 448
    q = B.quantize(x, "nvfp4")
    assert q.global_amax.item() == 6.0 and B.e4m3_values(q.scales)[0, 0] == 448.0
    # an all-zero tensor: S_enc = 1, every scale 0, elements 0
    z = B.quantize(torch.zeros(2, 32).bfloat16(), "nvfp4")
    assert (z.scales == 0).all() and (z.values == 0).all() and B.nvfp4_encode_scale(z.global_amax).item() == 1.0


def test_exponent_range_edges():
    # a block of bf16 subnormals (amax 2^-130): its exponent is below ue8m0's range -> byte 0, and
    # x * 2^127 = 2^-3 still lands on an e4m3 value; 1.5 * 2^127 (floor(log2) 127, as bf16's
    # largest) gets byte 127 + 127 - 8, its elements 384
    tiny, big = 2.0 ** -130, 1.5 * 2.0 ** 127
    x = _bf([_block(tiny, [], 32) + _block(big, [], 32)])
    q = B.quantize(x, "mxfp8")
    assert q.scales.tolist() == [[0, 246]]
    assert (B.e4m3_values(q.values)[0, :32] == 2.0 ** -3).all()
    assert torch.equal(B.dequantize(q, "mxfp8"), x.float())
    assert B.quantize(x, "mxfp4").scales.tolist() == [[0, 252]]


def test_nonfinite_blocks_get_a_nan_scale_and_zero_elements():
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    x = x.bfloat16()
    for fmt, nan in (("mxfp8", 0xFF), ("mxfp4", 0xFF), ("nvfp4", 0x7F)):
        ga = torch.tensor([4.0]) if fmt == "nvfp4" else None
        q = B.quantize(x, fmt, ga)
        blk = B.BLOCK[fmt]
        bad = [(0, 3 // blk), (1, 40 // blk)]
        for r, b in bad:
            assert q.scales[r, b] == nan
        ok_mask = torch.ones_like(q.scales, dtype=torch.bool)
        for r, b in bad:
            ok_mask[r, b] = False
        assert (q.scales[ok_mask] != nan).all()
        back = B.dequantize(q, fmt)
        assert back[0, 3].isnan() and back[1, 40].isnan() and torch.isfinite(back[0, 64 - blk:]).all()
        vals = q.values.reshape(2, -1, blk if fmt == "mxfp8" else blk // 2)
        assert (vals[0, 3 // blk] == 0).all()
    with pytest.raises(ValueError, match="pass global_amax"):
        B.quantize(x, "nvfp4")


@pytest.mark.parametrize("fmt", B.FORMATS)
def test_round_trip(fmt):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=gen).bfloat16()
    q = B.quantize(x, fmt)
    err = (B.dequantize(q, fmt) - x.float()).norm() / x.float().norm()
    assert 1e-3 < err < (0.05 if fmt == "mxfp8" else 0.15)
    # dequantized values quantize back to the same bytes (each block's amax kept its scale)
    again = B.quantize(B.dequantize(q, fmt).bfloat16(), fmt, q.global_amax)
    assert torch.equal(again.values, q.values) and torch.equal(again.scales, q.scales)


def test_bad_input_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="format 'mxfp6' is not a block-scaled format; use one of"):
        B.quantize(torch.zeros(1, 32), "mxfp6")
    with pytest.raises(ValueError, match="K=48 must be a multiple of mxfp8's block of 32"):
        B.quantize(torch.zeros(1, 48), "mxfp8")
    with pytest.raises(ValueError, match=r"x must be a \[rows, K\] bf16 or fp32 tensor"):
        B.quantize(torch.zeros(32, dtype=torch.float16), "nvfp4")
    with pytest.raises(ValueError, match="global_amax must be a finite number >= 0"):
        B.quantize(torch.zeros(1, 32), "nvfp4", torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="NVFP4's second scale"):
        B.quantize(torch.zeros(1, 32), "mxfp4", 1.0)


def test_check_inputs_hit_the_edges():
    """The GPU check's distributions really hold what they claim (ties on midpoints, zero blocks,
    NaN scales), so a kernel that rounds ties or zeros wrongly cannot pass them."""
    gen = torch.Generator().manual_seed(2)
    for fmt in B.FORMATS:
        x, ga = H.make_input("ties", 5, 256, fmt, gen)
        q = B.quantize(x, fmt, ga)
        scale = B.dequantize(q, fmt).reshape(5, -1, B.BLOCK[fmt]).abs().amax(-1, keepdim=True)
        top = 256.0 if fmt == "mxfp8" else 6.0  # the element make_input gives each block's amax
        rel = x.float().reshape(5, -1, B.BLOCK[fmt]).abs() / scale * top  # in element units
        mids = H.E4M3_MIDPOINTS if fmt == "mxfp8" else H.E2M1_MIDPOINTS
        assert torch.isin(rel[..., 1:], mids).all(), fmt
        x, _ = H.make_input("zeros", 5, 256, fmt, gen)
        assert (x.float().view(torch.int32) == -2 ** 31).any()
        x, ga = H.make_input("nonfinite", 5, 256, fmt, gen)
        assert (B.quantize(x, fmt, ga).scales == (0x7F if fmt == "nvfp4" else 0xFF)).any()


# -- the kernel and its plumbing ---------------------------------------------------------------------
def test_kernel_names_cover_every_argument():
    names = {V.blockscale_kernel(V.BlockScaleShape(f, k, t)).name
             for f in B.FORMATS for k in (96, 2048) for t in ("sm_90a", "sm_100a", "sm_121a")}
    assert len(names) == 18
    kv = V.blockscale_kernel(V.BlockScaleShape("nvfp4", 2048, "sm_90a"))
    assert kv.role == "bsquant" and kv.kwargs() == {"fmt": "nvfp4", "k": 2048, "e2m1": "sw"}
    assert V.blockscale_kernel(V.BlockScaleShape("mxfp4", 2048, "sm_100a")).kwargs()["e2m1"] == "hw"
    # rows written k_out wide (a block-scaled layer's K padding): in the name and the arguments
    padded = V.blockscale_kernel(V.BlockScaleShape("mxfp8", 2880, "sm_121a", 2944))
    assert padded.name == "moe_bsquant_sm121a_mxfp8_k2880_p2944_hw" and padded.kwargs()["k_out"] == 2944
    assert "k_out" not in V.blockscale_kernel(V.BlockScaleShape("mxfp8", 2880, "sm_121a")).kwargs()
    with pytest.raises(ValueError, match="K=40 must be a positive multiple of nvfp4's block of 16"):
        V.BlockScaleShape("nvfp4", 40, "sm_90a")
    with pytest.raises(ValueError, match="target 'sm_89' must be one of"):
        V.BlockScaleShape("nvfp4", 32, "sm_89")


# sm_90a: e4m3 by cvt, e2m1 by the seven midpoint comparisons; sm_100a / sm_121a: e2m1 by cvt.
# NVFP4's scale arithmetic: IEEE division and reciprocal, no approximation, no flush to zero.
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a", "sm_121a"])
def test_kernel_compiles_with_the_expected_conversions(target, tmp_path):
    cute = pytest.importorskip("cutlass.cute")
    from moe_aot.compiler import build_template

    for fmt in B.FORMATS:
        kv = V.blockscale_kernel(V.BlockScaleShape(fmt, 7168 if fmt == "mxfp8" else 2880, target))
        obj = build_template(kv)
        ptx = cute.compile(obj, *[f for _, f in obj.fake_arguments()],
                           options=f"--gpu-arch {target} --keep-ptx --dump-dir {tmp_path}").__ptx__
        if len(ptx) < 1000 and ptx.endswith(".ptx"):  # some DSL builds hand back the dumped file's path
            ptx = open(ptx).read()
        body = ptx[ptx.index(".entry"):]
        hw = kv.kwargs()["e2m1"] == "hw"
        assert hw == (target != "sm_90a")
        assert ("cvt.rn.satfinite.e4m3x2.f32" in body) == (fmt != "mxfp4"), (target, fmt)
        assert ("cvt.rn.satfinite.e2m1x2.f32" in body) == (fmt != "mxfp8" and hw), (target, fmt)
        compares = set(re.findall(r"setp\.(g[te])\.f32\s+%p\d+, %\w+, 0f([0-9A-F]{8})", body))
        midpoints = {("ge" if up else "gt", torch.tensor(m).view(torch.int32).item().to_bytes(4, "big").hex().upper())
                     for m, up in B.E2M1_MIDPOINTS}
        assert (midpoints <= compares) == (fmt != "mxfp8" and not hw), (target, fmt, compares)
        assert ".ftz" not in body and "approx" not in body
        if fmt == "nvfp4":
            assert "div.rn.f32" in body and "rcp.rn.f32" in body
        assert "ld.local" not in body and "st.local" not in body
        assert body.count("ld.global.v4") >= 2  # a block's bf16 values in 16-byte loads


def test_kernels_compile_into_the_database(tmp_path):
    """The registry entry: compile_into puts the kernels into a database, each with its arguments."""
    pytest.importorskip("cutlass")
    import json
    import sqlite3

    from moe_aot.compiler import compile_into, toolchain_key
    from moe_aot.database import Database

    shapes = [V.BlockScaleShape("mxfp4", 96, "sm_90a"), V.BlockScaleShape("nvfp4", 48, "sm_90a")]
    url = f"sqlite:///{tmp_path / 'bs.sqlite'}"
    with Database(url) as db:
        res = compile_into(db, [], jobs=1, extra=[(s, V.blockscale_kernel(s)) for s in shapes])
        assert [r.error for r in res] == [None, None]
        for s in shapes:
            assert db.has_artifact(V.blockscale_kernel(s).name, toolchain_key("sm_90a"))
    rows = sqlite3.connect(tmp_path / "bs.sqlite").execute("SELECT name, meta FROM moe_aot_artifacts").fetchall()
    args = {name: [a["name"] for a in json.loads(meta)["args"]] for name, meta in rows}
    assert args == {"moe_bsquant_sm90a_mxfp4_k96_sw": ["x", "q", "sf", "stream"],
                    "moe_bsquant_sm90a_nvfp4_k48_sw": ["x", "q", "sf", "gamax", "stream"]}


def test_the_gpu_check_passes_the_reference_and_catches_a_bad_kernel(monkeypatch):
    """harness.blockscale.check on the CPU, with the reference standing in for the kernel: it passes;
    a kernel that leaves one scale byte unwritten, or rounds one tie the other way, fails."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    gen = torch.Generator().manual_seed(3)

    def good(x, fmt, g, out):
        q = B.quantize(x, fmt, g)
        out.values.copy_(q.values)
        out.scales.copy_(q.scales)
        return out

    def skips_a_scale(x, fmt, g, out):
        q = B.quantize(x, fmt, g)
        out.values.copy_(q.values)
        out.scales[:, 1:] = q.scales[:, 1:]  # scale column 0 keeps the poison
        return out

    def rounds_a_tie_up(x, fmt, g, out):
        good(x, fmt, g, out)
        out.values[0, 0] ^= 1
        return out

    for fmt in B.FORMATS:
        x, ga = H.make_input("ties", 3, 64, fmt, gen)
        assert H.check(fmt, x, ga, good, "cpu")["ok"]
        row = H.check(fmt, x, ga, skips_a_scale, "cpu")
        assert not row["ok"] and row["bad_scales"] >= 1 and row["first_bad"]["col"] == 0
        row = H.check(fmt, x, ga, rounds_a_tie_up, "cpu")
        assert not row["ok"] and row["bad_values"] == 1

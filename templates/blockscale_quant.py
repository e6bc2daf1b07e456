"""Block-scaled quantization (MXFP8, MXFP4, NVFP4) of a [rows, K] bf16 tensor, as a CuTe DSL kernel.

``BlockScaleQuant(fmt, k, e2m1, k_out)``: ``__call__(x, q, sf, gamax, stream)`` with x [M, K] bf16 ->
q [M, K'] e4m3 bytes (mxfp8) or [M, K'/2] packed e2m1 codes (mxfp4, nvfp4), sf [M, K'/block] scale
bytes (ue8m0 per 32 for mx, e4m3 per 16 for nvfp4), all uint8, row-major, K' = k_out (default K):
the columns past K are written as quantized zeros (value and scale bytes 0), the padding of a
block-scaled GEMM's K to whole k-tiles (gemm_limits.bs_padded_k); gamax [1] fp32 is
NVFP4's global amax (an input, as TransformerEngine's kernels take it; None for the mx formats).
The formats, their rounding and their edge cases (zeros, NaN, Inf) are defined, bit for bit, by
the torch reference moe_aot/blockscale.py; GPU tests compare the two byte for byte.

The quantization of one block is the module's functions (``block_amax``, ``mx_scale``,
``nvfp4_encode_scale``, ``nvfp4_scale``, ``quantize_block``): a GEMM epilogue holding a block of
fp32 values in registers calls them as this kernel does; the kernel is a loop around them. One
CTA of 128 threads per row; thread t quantizes blocks t, t + 128, ... of its row (16-byte loads).

e2m1 conversion: ``"hw"`` is PTX cvt.rn.satfinite.e2m1x2.f32 (sm_100a and later; ptxas refuses it
on sm_90a), ``"sw"`` the same rounding (nearest, ties to even, saturating at 6) from seven
comparisons: sm_90a has no e2m1 instruction. e4m3 (mxfp8's elements, NVFP4's scales) is always
cvt.rn.satfinite.e4m3x2.f32.

Constraints: K and k_out multiples of the format's block (32, 16), k_out >= K; x and q 16-byte aligned.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8, const_expr

from moe_aot import gemm_limits as limits

_THREADS = 128
_INF = float("inf")
_FLT_MAX = 3.4028234663852886e38
_ONE_SIXTH = 1.0 / 6.0  # becomes fp32(1/6), as C's 1.0f / 6.0f
E2M1_CONVERSIONS = ("hw", "sw")


@cute.jit
def block_amax(vals: cute.Tensor, n: cutlass.Constexpr):
    """max |v| over a register fragment of n fp32 values; NaN if one is NaN (IEEE maximum)."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        amax = cute.arch.fmax(amax, cute.math.absf(vals[i]), nan=True)
    return amax


@cute.jit
def mx_scale(amax: Float32, emax: cutlass.Constexpr):
    """(ue8m0 scale byte, 2^(127 - byte) as fp32) of a block with this amax: the byte is
    clamp(floor(log2(amax)) - emax + 127, 0, 254), read off amax's exponent bits (a subnormal or
    zero amax has exponent field 0 and gets byte 0, as its true exponent is below the range);
    0xFF for a NaN or Inf amax (then the factor is 2^127 and the caller writes zeros)."""
    biased = ((amax.bitcast(Int32) >> 23) & 0xFF) - emax
    finite = amax < _INF
    byte = (biased if biased > 0 else Int32(0)) if finite else Int32(limits.MX_NAN_SCALE)
    factor = ((254 - (byte if finite else Int32(0))) << 23).bitcast(Float32)
    return byte, factor


@cute.jit
def nvfp4_encode_scale(global_amax: Float32):
    """S_enc = min(448 * 6 / global_amax, FLT_MAX), 1 where global_amax is 0 (or S_enc is); a
    NaN or negative global_amax is no input (the reference refuses it)."""
    s = cute.arch.fmin(Float32(limits.FP8_MAX * limits.E2M1_MAX) / global_amax, Float32(_FLT_MAX))
    return Float32(1.0) if global_amax == 0.0 or s == 0.0 else s


@cute.jit
def nvfp4_scale(amax: Float32, s_enc: Float32):
    """(e4m3 scale byte, the factor that maps the block's values onto e2m1) of a block with this
    amax: byte = e4m3(amax * (S_enc * fp32(1/6))), factor = min(1 / (float(byte) * (1 / S_enc)),
    FLT_MAX); byte 0x7F (e4m3 NaN) for a NaN or Inf amax."""
    sf = cute.make_rmem_tensor(cute.make_layout(2), Float32)
    sf[0] = amax * (s_enc * Float32(_ONE_SIXTH))
    sf[1] = Float32(0.0)
    sf8 = sf.load().to(Float8E4M3FN)
    byte = sf8.bitcast(Uint8)[0].to(Int32)
    dec = sf8.to(Float32)[0]
    inv = cute.arch.fmin(Float32(1.0) / (dec * (Float32(1.0) / s_enc)), Float32(_FLT_MAX))
    finite = amax < _INF
    return (byte if finite else Int32(limits.E4M3_NAN)), inv


@cute.jit
def e2m1_code(v: Float32):
    """e2m1 code (sign << 3 | magnitude index) of v: nearest, ties to even, saturating at 6."""
    mag = cute.math.absf(v)
    code = Int32(0)
    for mid, tie_up in limits.E2M1_MIDPOINTS:
        if const_expr(tie_up):
            code = code + Int32(mag >= mid)
        else:
            code = code + Int32(mag > mid)
    return code | ((v.bitcast(Int32) >> 28) & 0x8)


@cute.jit
def quantize_block(vals: cute.Tensor, fmt: cutlass.Constexpr, s_enc: Float32, e2m1: cutlass.Constexpr):
    """One block of n = blockscale.BLOCK[fmt] fp32 values in registers -> (element bytes as a
    Uint8 TensorSSA: n e4m3 bytes for mxfp8, n / 2 packed e2m1 bytes for the fp4 formats; the
    scale byte as Int32). s_enc: nvfp4's nvfp4_encode_scale(global amax), unused by the mx
    formats. A block holding NaN or Inf gets the format's NaN scale byte and zero elements."""
    n = limits.BLOCKSCALE_BLOCK[fmt]
    amax = block_amax(vals, n)
    if const_expr(fmt == "nvfp4"):
        byte, factor = nvfp4_scale(amax, s_enc)
    else:
        byte, factor = mx_scale(amax, limits.MX_EMAX[fmt])
    scaled = cute.make_rmem_tensor(cute.make_layout(n), Float32)
    for i in cutlass.range_constexpr(n):
        scaled[i] = vals[i] * factor if amax < _INF else Float32(0.0)
    if const_expr(fmt == "mxfp8"):
        out = scaled.load().to(Float8E4M3FN).bitcast(Uint8)
    elif const_expr(e2m1 == "hw"):
        out = scaled.load().to(cutlass.Float4E2M1FN).bitcast(Uint8)
    else:
        packed = cute.make_rmem_tensor(cute.make_layout(n // 2), Uint8)
        for j in cutlass.range_constexpr(n // 2):
            packed[j] = (e2m1_code(scaled[2 * j]) | (e2m1_code(scaled[2 * j + 1]) << 4)).to(Uint8)
        out = packed.load()
    return out, byte


class BlockScaleQuant:
    def __init__(self, fmt: str, k: int, e2m1: str = "sw", k_out: int | None = None):
        ok, reason = self.can_implement(fmt, k, e2m1, k_out)
        if not ok:
            raise ValueError(reason)
        self.fmt, self.k, self.e2m1 = fmt, k, e2m1
        self.k_out = k if k_out is None else k_out
        self.block = limits.BLOCKSCALE_BLOCK[fmt]
        self.blocks = k // self.block
        self.blocks_out = self.k_out // self.block
        self.passes = -(-self.blocks_out // _THREADS)
        self.q_cols = self.k_out if fmt == "mxfp8" else self.k_out // 2

    @staticmethod
    def can_implement(fmt, k, e2m1="sw", k_out=None):
        if fmt not in limits.BLOCKSCALE_FORMATS:
            return False, f"format {fmt!r} must be one of {', '.join(limits.BLOCKSCALE_FORMATS)}"
        if e2m1 not in E2M1_CONVERSIONS:
            return False, f"e2m1 conversion {e2m1!r} must be one of {', '.join(E2M1_CONVERSIONS)}"
        if k <= 0 or k % limits.BLOCKSCALE_BLOCK[fmt]:
            return False, f"K={k} must be a positive multiple of {fmt}'s block of {limits.BLOCKSCALE_BLOCK[fmt]}"
        if k_out is not None and (k_out < k or k_out % limits.BLOCKSCALE_BLOCK[fmt]):
            return False, (f"k_out={k_out} must be a multiple of {fmt}'s block of {limits.BLOCKSCALE_BLOCK[fmt]} "
                           f"and at least K={k}")
        return True, ""

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        m = cute.sym_int32(symbol="M")
        k, qc, nb = self.k, self.q_cols, self.blocks_out
        return [
            ("x", make_fake_tensor(BFloat16, (m, k), (k, 1), assumed_align=16)),
            ("q", make_fake_tensor(Uint8, (m, qc), (qc, 1), assumed_align=16)),
            ("sf", make_fake_tensor(Uint8, (m, nb), (nb, 1), assumed_align=1)),
            ("gamax", make_fake_tensor(Float32, (1,), (1,), assumed_align=4) if self.fmt == "nvfp4" else None),
            ("stream", make_fake_stream()),
        ]

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, sf: cute.Tensor, gamax: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        self.kernel(x, q, sf, gamax).launch(grid=[cute.size(x, mode=[0]), 1, 1], block=[_THREADS, 1, 1],
                                            stream=stream)

    @cute.jit
    def _row(self, mT, row, n: cutlass.Constexpr, align: cutlass.Constexpr):
        base = (mT.iterator + cutlass.Int64(row) * n).align(align)
        return cute.make_tensor(base, cute.make_layout(n))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mSF: cute.Tensor, mG: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        src = self._row(mX, row, self.k, 16)  # 2K bytes, K a multiple of 16
        dst = self._row(mQ, row, self.q_cols, 16 if self.q_cols % 16 == 0 else 8)  # nvfp4 at K = 16 (2j + 1)
        s_enc = Float32(1.0)
        if const_expr(self.fmt == "nvfp4"):
            s_enc = nvfp4_encode_scale(mG[0])
        qn = self.block if const_expr(self.fmt == "mxfp8") else self.block // 2
        for j in cutlass.range_constexpr(self.passes):
            b = tidx + j * _THREADS
            if b < self.blocks:
                vals = cute.make_rmem_tensor(cute.make_layout(self.block), Float32)
                vals.store(cute.local_tile(src, (self.block,), (b,)).load().to(Float32))
                out, byte = quantize_block(vals, self.fmt, s_enc, self.e2m1)
                cute.local_tile(dst, (qn,), (b,)).store(out)
                mSF[row, b] = byte.to(Uint8)
            if const_expr(self.blocks_out > self.blocks):
                if b >= self.blocks and b < self.blocks_out:  # k_out's padding: quantized zeros
                    zeros = cute.make_rmem_tensor(cute.make_layout(qn), Uint8)
                    zeros.fill(0)
                    cute.local_tile(dst, (qn,), (b,)).store(zeros.load())
                    mSF[row, b] = Uint8(0)

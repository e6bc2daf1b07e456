"""Quantization of a layer's input to e4m3 for the fp8 GEMMs, as a CuTe DSL kernel.

``QuantizeFp8(hidden, precision)``: ``__call__(x, xq, xs, stream)`` with x [M, H] bf16 ->
xq [M, H] e4m3 and its fp32 scales xs: one per token ([M], precision "fp8") or one per token
and 128 columns ([M, H/128], "fp8-block128"). A scale is amax / 448 of what it covers (1e-12 at
least), and xq = x * 448 / amax rounded to nearest e4m3, so xq * xs reproduces x to e4m3's
precision. One CTA of 128 threads per token row; thread t reads 16-byte chunks t, t + 128, ...
of the row (8 values each): a 1x128 block is the chunks of 16 consecutive threads (amax by
shuffles within them), a token's amax is reduced over the CTA through shared memory.

Constraints: H a multiple of 128; x, xq 16-byte aligned rows.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, const_expr

from moe_aot import gemm_limits as limits

_THREADS = 128
_CHUNK = 8  # bf16 values per 16-byte load


class QuantizeFp8:
    def __init__(self, hidden: int, precision: str = "fp8-block128"):
        ok, reason = self.can_implement(hidden, precision)
        if not ok:
            raise ValueError(reason)
        self.hidden = hidden
        self.precision = precision
        self.block = precision == "fp8-block128"
        self.passes = -(-(hidden // _CHUNK) // _THREADS)

    @staticmethod
    def can_implement(hidden, precision="fp8-block128"):
        if precision not in limits.FP8:
            return False, f"precision {precision!r} must be one of {limits.FP8}"
        if hidden % limits.SCALE_BLOCK or hidden <= 0:
            return False, f"H={hidden} must be a positive multiple of {limits.SCALE_BLOCK}"
        return True, ""

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        m = cute.sym_int32(symbol="M")
        hd = self.hidden
        if self.block:
            xs = make_fake_tensor(Float32, (m, hd // limits.SCALE_BLOCK),
                                  (hd // limits.SCALE_BLOCK, 1), assumed_align=4)
        else:
            xs = make_fake_tensor(Float32, (m,), (1,), assumed_align=4)
        return [
            ("x", make_fake_tensor(BFloat16, (m, hd), (hd, 1), assumed_align=16)),
            ("xq", make_fake_tensor(Float8E4M3FN, (m, hd), (hd, 1), assumed_align=16)),
            ("xs", xs),
            ("stream", make_fake_stream()),
        ]

    @cute.jit
    def __call__(self, x: cute.Tensor, xq: cute.Tensor, xs: cute.Tensor, stream: cuda.CUstream):
        self.kernel(x, xq, xs).launch(grid=[cute.size(x, mode=[0]), 1, 1], block=[_THREADS, 1, 1],
                                      stream=stream)

    @cute.jit
    def _row(self, mT, row):
        base = (mT.iterator + cutlass.Int64(row) * self.hidden).align(16)
        return cute.make_tensor(base, cute.make_layout(self.hidden))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mXq: cute.Tensor, mXs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        chunks = self.hidden // _CHUNK
        src = self._row(mX, row)
        dst = self._row(mXq, row)
        vals = cute.make_rmem_tensor(cute.make_layout((_CHUNK, self.passes)), Float32)
        vals.fill(0.0)
        amax = Float32(0.0)
        for j in cutlass.range_constexpr(self.passes):
            c = tidx + j * _THREADS
            if c < chunks:
                v = cute.local_tile(src, (_CHUNK,), (c,)).load().to(Float32)
                for e in cutlass.range_constexpr(_CHUNK):
                    vals[e, j] = v[e]
        if const_expr(self.block):
            for j in cutlass.range_constexpr(self.passes):
                c = tidx + j * _THREADS
                bmax = Float32(0.0)
                for e in cutlass.range_constexpr(_CHUNK):
                    bmax = cute.arch.fmax(bmax, cute.math.absf(vals[e, j]))
                for s in cutlass.range_constexpr(4):  # over the 16 threads of the block
                    bmax = cute.arch.fmax(bmax, cute.arch.shuffle_sync_bfly(bmax, 1 << s))
                bmax = cute.arch.fmax(bmax, Float32(1e-12))
                if c < chunks:
                    self._store(dst, vals, j, c, limits.FP8_MAX * cute.math.rcp(bmax))
                    if tidx % 16 == 0:
                        mXs[row, c // 16] = bmax * (1.0 / limits.FP8_MAX)
        else:
            for j in cutlass.range_constexpr(self.passes):
                for e in cutlass.range_constexpr(_CHUNK):
                    amax = cute.arch.fmax(amax, cute.math.absf(vals[e, j]))
            for s in cutlass.range_constexpr(5):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1 << s))
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_array(Float32, _THREADS // 32)
            warp = tidx // 32
            if tidx % 32 == 0:
                red[warp] = amax
            cute.arch.sync_threads()
            amax = red[0]
            for w in cutlass.range_constexpr(1, _THREADS // 32):
                amax = cute.arch.fmax(amax, red[w])
            amax = cute.arch.fmax(amax, Float32(1e-12))
            inv = limits.FP8_MAX * cute.math.rcp(amax)
            for j in cutlass.range_constexpr(self.passes):
                c = tidx + j * _THREADS
                if c < chunks:
                    self._store(dst, vals, j, c, inv)
            if tidx == 0:
                mXs[row] = amax * (1.0 / limits.FP8_MAX)

    @cute.jit
    def _store(self, dst, vals, j, c, inv):
        q = cute.make_rmem_tensor(cute.make_layout(_CHUNK), Float32)
        for e in cutlass.range_constexpr(_CHUNK):
            q[e] = vals[e, j] * inv
        cute.local_tile(dst, (_CHUNK,), (c,)).store(q.load().to(Float8E4M3FN))




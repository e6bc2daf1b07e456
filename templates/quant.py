"""Quantization of a layer's input to e4m3 for the fp8 GEMMs, as CuTe DSL code.

``RowQuantFp8(hidden, precision).row(...)``: one token row of x [M, H] bf16 -> xq [M, H] e4m3 and
its fp32 scales xs, one per token ([M], precision "fp8") or one per token and 128 columns
([M, H/128], "fp8-block128"), by a group of 128 threads. A scale is amax / 448 of what it covers
(1e-12 at least), and xq = x * 448 / amax rounded to nearest e4m3, so xq * xs reproduces x to
e4m3's precision. Thread t of the group reads 16-byte chunks t, t + 128, ... of the row (8 values
each). fp8-block128: a 1x128 block is the chunks of 16 consecutive threads, so each chunk is
quantized as it arrives (its block's amax by shuffles among those 16 threads). fp8: the row's amax
is reduced over the group (shuffles, then four words of shared memory and the group's named
barrier), and the row is read a second time to quantize it (from L1 / L2: a row is at most a few
tens of KB), so no thread holds the row in registers.

The layer quantizes x inside its routing launch (templates/routing.py, ``MoeRouting(quant=...)``:
CTAs past the routing cluster run ``row`` over x's rows), so GEMM1 waits on one grid, not two.
``QuantizeFp8(hidden, precision)``: the same rows as a kernel of their own (one CTA of 128 threads
per row; ``__call__(x, xq, xs, stream)``), kept as the separate pass that the fused one is measured
against (tools/check_route_quant.py).

Constraints: H a multiple of 128; x, xq 16-byte aligned rows.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, const_expr

from moe_aot import gemm_limits as limits

GROUP = 128  # threads that quantize one row
_CHUNK = 8  # bf16 values per 16-byte load


def can_quantize(hidden, precision) -> tuple[bool, str]:
    """(ok, reason) for quantizing rows of ``hidden`` values to ``precision``."""
    if precision not in limits.FP8:
        return False, f"precision {precision!r} must be one of {limits.FP8}"
    if not isinstance(hidden, int) or hidden % limits.SCALE_BLOCK or hidden <= 0:
        return False, f"H={hidden} must be a positive multiple of {limits.SCALE_BLOCK}"
    return True, ""


def fake_quant_arguments(hidden: int, precision: str):
    """(name, fake) of x, xq and xs for cute.compile, M dynamic."""
    from cutlass.cute.runtime import make_fake_tensor

    m = cute.sym_int32(symbol="M")
    if precision == "fp8-block128":
        xs = make_fake_tensor(Float32, (m, hidden // limits.SCALE_BLOCK),
                              (hidden // limits.SCALE_BLOCK, 1), assumed_align=4)
    else:
        xs = make_fake_tensor(Float32, (m,), (1,), assumed_align=4)
    return [("x", make_fake_tensor(BFloat16, (m, hidden), (hidden, 1), assumed_align=16)),
            ("xq", make_fake_tensor(Float8E4M3FN, (m, hidden), (hidden, 1), assumed_align=16)),
            ("xs", xs)]


class RowQuantFp8:
    """Quantizes one row of x per call of ``row`` by a group of GROUP threads (module docstring)."""

    def __init__(self, hidden: int, precision: str):
        ok, reason = can_quantize(hidden, precision)
        if not ok:
            raise ValueError(reason)
        self.hidden = hidden
        self.precision = precision
        self.block = precision == "fp8-block128"
        self.passes = -(-(hidden // _CHUNK) // GROUP)

    @cute.jit
    def _row(self, mT, row):
        base = (mT.iterator + cutlass.Int64(row) * self.hidden).align(16)
        return cute.make_tensor(base, cute.make_layout(self.hidden))

    @cute.jit
    def _chunk(self, src, c):
        return cute.local_tile(src, (_CHUNK,), (c,)).load().to(Float32)

    @cute.jit
    def _store(self, dst, v, c, inv):
        cute.local_tile(dst, (_CHUNK,), (c,)).store((v * inv).to(Float8E4M3FN))

    @cute.jit
    def row(self, mX, mXq, mXs, row, t, red, bar_id):
        """Row ``row`` by thread ``t`` in [0, GROUP) of a group; ``red``: the group's 4 words of
        shared memory, ``bar_id``: its named barrier (GROUP threads). A group may call it for
        several rows in turn (its second barrier frees ``red`` for the next row)."""
        chunks = self.hidden // _CHUNK
        src = self._row(mX, row)
        dst = self._row(mXq, row)
        if const_expr(self.block):
            for j in cutlass.range_constexpr(self.passes):
                c = t + j * GROUP
                v = cute.make_rmem_tensor(cute.make_layout(_CHUNK), Float32)
                v.fill(0.0)
                if c < chunks:
                    v.store(self._chunk(src, c))
                bmax = Float32(0.0)
                for e in cutlass.range_constexpr(_CHUNK):
                    bmax = cute.arch.fmax(bmax, cute.math.absf(v[e]))
                for s in cutlass.range_constexpr(4):  # over the 16 threads of the block
                    bmax = cute.arch.fmax(bmax, cute.arch.shuffle_sync_bfly(bmax, 1 << s))
                bmax = cute.arch.fmax(bmax, Float32(1e-12))
                if c < chunks:
                    self._store(dst, v.load(), c, limits.FP8_MAX * cute.math.rcp(bmax))
                    if t % 16 == 0:
                        mXs[row, c // 16] = bmax * (1.0 / limits.FP8_MAX)
        else:
            amax = Float32(0.0)
            for j in cutlass.range_constexpr(self.passes):
                c = t + j * GROUP
                if c < chunks:
                    v = self._chunk(src, c)
                    for e in cutlass.range_constexpr(_CHUNK):
                        amax = cute.arch.fmax(amax, cute.math.absf(v[e]))
            for s in cutlass.range_constexpr(5):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1 << s))
            if t % 32 == 0:
                red[t // 32] = amax
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=GROUP)
            amax = red[0]
            for w in cutlass.range_constexpr(1, GROUP // 32):
                amax = cute.arch.fmax(amax, red[w])
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=GROUP)  # red is free again
            amax = cute.arch.fmax(amax, Float32(1e-12))
            inv = limits.FP8_MAX * cute.math.rcp(amax)
            for j in cutlass.range_constexpr(self.passes):
                c = t + j * GROUP
                if c < chunks:
                    self._store(dst, self._chunk(src, c), c, inv)
            if t == 0:
                mXs[row] = amax * (1.0 / limits.FP8_MAX)


class QuantizeFp8:
    """x's quantization as a kernel of its own: one CTA of GROUP threads per token row."""

    def __init__(self, hidden: int, precision: str = "fp8-block128"):
        self.rows = RowQuantFp8(hidden, precision)
        self.hidden = hidden
        self.precision = precision

    @staticmethod
    def can_implement(hidden, precision="fp8-block128"):
        return can_quantize(hidden, precision)

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream

        return fake_quant_arguments(self.hidden, self.precision) + [("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, x: cute.Tensor, xq: cute.Tensor, xs: cute.Tensor, stream: cuda.CUstream):
        self.kernel(x, xq, xs).launch(grid=[cute.size(x, mode=[0]), 1, 1], block=[GROUP, 1, 1],
                                      stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mXq: cute.Tensor, mXs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        red = cutlass.memory.SmemAllocator().allocate_array(Float32, GROUP // 32)
        self.rows.row(mX, mXq, mXs, row, tidx, red, 1)

"""FP8 (e4m3) grouped GEMMs of a fused MoE layer on mma.sync: the decode regime's weight streaming.

At a few routed rows per expert a layer streams its experts' weights and does almost no math, so
what counts is bytes in flight per SM, not the tensor-core rate. These kernels are the "warp"
mainloop of grouped_gemm.py (one CTA per tile, a deep cp.async pipeline, ldmatrix, mma.sync)
with 1-byte operands: e4m3 mma.sync m16n8k32 (sm_89+), whose A and B fragments are those of
bf16's m16n8k16 in bytes, so the same swizzled 128-byte rows and ldmatrix.x4 feed it.

The formats, scales and outputs are hopper_fp8.py's (same arguments, same results up to the
order of fp32 additions): "fp8" and "fp8-block128", x and w13 / h and w2 in e4m3, GEMM1's output
h in e4m3 with one fp32 scale per row and h_block (64, or 128 from GEMM1 tile_n 256) columns,
GEMM2's y in bf16.

Scales: every MMA k-block of a K scale block (128 along K for GEMM1, h_block for GEMM2, whose A
has a scale per h_block columns) multiplies into a partial-sum fragment, which is added into the fp32
accumulator times the block's row and column scales when the block ends (``_gemm_promote``).
Each thread loads the scales of the block after the current one from global memory (L2) when a
block starts, so the loads are in flight during the block's MMAs.

GEMM1's epilogue (``_epilogue``): the fp32 gate/up tile is staged de-interleaved in shared
memory (grouped_gemm's ``_stage_acc``); h_block / 16 consecutive lanes (4 or 8) take 16 h
columns each of one row's h_block-column block, apply the GLU, reduce the block's amax with
shuffles, and store the e4m3 values (16 bytes a lane) and the scale amax / 448; padding rows get
zeros and scale 0.
GEMM2's epilogue is GroupedDownGemm's (the routing weight, bf16 rows to y).

Constraints (``gemm_limits.check_tiles`` / ``check_fp8``): tile_k 128; H and I multiples of
128; GEMM1 tile_n 128 or 256 (whole h_block-column output blocks, gate rows in one weight block);
fp8-block128 GEMM2 tile_n dividing 128; the accumulators and the partial sums within
``MAX_ACC_REGS`` per thread; no expert biases.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float8E4M3FN, Float32, Int32, const_expr

from moe_aot import gemm_limits as limits

from .grouped_gemm import GroupedDownGemm, GroupedGluGemm
from .hopper_fp8 import down_fp8_arguments, glu_fp8_arguments

HB = limits.H_SCALE_BLOCK
SB = limits.SCALE_BLOCK
_COLS_PER_LANE = 16  # h columns per lane in GEMM1's epilogue (one 16-byte e4m3 store)


class _WarpFp8:
    """The per-K-block scaling of both GEMMs (see the module docstring)."""

    def _warp_fp8_init(self, h_block):
        if not self.fp8 or self.mma != "warp":
            raise ValueError(f"{type(self).__name__} is the mma.sync fp8 GEMM; got precision "
                             f"{self.precision!r} with mma {self.mma!r}")
        ok, why = limits.check_h_block(self.precision, h_block, self.tile_n if self.glu else None)
        if not ok:
            raise ValueError(why)
        self.h_block = h_block
        self.block = self.precision == "fp8-block128"
        self.kblock = SB if self.glu else h_block  # K elements per scale block
        # GEMM1's epilogue: butterfly shuffles over the h_block / 16 lanes of one row's h block
        self.h_shuffles = (h_block // _COLS_PER_LANE).bit_length() - 1
        self.kblocks = self.tile_k // self.kblock  # scale blocks per k-tile
        # scales that change along K: GEMM1's only with fp8-block128, GEMM2's h scales always
        self.k_scales = self.block or not self.glu

    @cute.jit
    def _promote_state(self, tidx, tiled_mma, mIds, row0, expert, bn, epi):
        """(partial sums, scale row of each accumulator row, up-column flag of each element,
        current and next block's row and column scales, expert, bn, epi). The accumulator
        fragment is ((2, 2), MMA_M, MMA_N): element v + 2h + 4m holds row 8h of m16 block m."""
        tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        part = tiled_mma.make_fragment_C(tCcC.shape)
        mma_m = cute.size(tCcC, mode=[1])
        rows = cute.make_rmem_tensor(cute.make_layout(2 * mma_m), Int32)
        for s in cutlass.range_constexpr(2 * mma_m):
            r = tCcC[2 * (s % 2) + 4 * (s // 2)][0]
            if const_expr(self.glu):
                p = mIds[row0 + r]
                tok = Int32(0)  # padding rows: any valid row (their sums are zero)
                if p >= 0:
                    tok = p // self.top_k
                rows[s] = tok
            else:
                rows[s] = row0 + r
        up = cute.make_rmem_tensor(cute.make_layout(cute.size(part)), Float32)
        for i in cutlass.range_constexpr(cute.size(part)):
            up[i] = Float32(0.0)
            if const_expr(self.glu):
                if (tCcC[i][1] // self.interleave) % 2 == 1:
                    up[i] = Float32(1.0)
        sa = cute.make_rmem_tensor(cute.make_layout(2 * mma_m), Float32)
        sb = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        sa_next = cute.make_rmem_tensor(cute.make_layout(2 * mma_m), Float32)
        sb_next = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        return (part, rows, up, sa, sb, sa_next, sb_next, expert, bn, epi)

    @cute.jit
    def _promote_begin(self, pstate):
        """The first block's scales, read once the previous grid is done (GEMM2 reads GEMM1's)."""
        _, rows, _, sa, sb, sa_next, sb_next, expert, bn, epi = pstate
        self._load_scales(sa, sb, rows, expert, bn, epi, Int32(0))

    @cute.jit
    def _gemm_promote(self, tiled_mma, acc, tA, tB, kt, kb: cutlass.Constexpr, pstate):
        """MMA k-block ``kb`` of k-tile ``kt`` into the partial sums; at the end of a scale block
        acc += part * row scale * column scale (gate or up column of GEMM1)."""
        part, rows, up, sa, sb, sa_next, sb_next, expert, bn, epi = pstate
        steps = self.kblock // 32  # mma.sync k32 steps per scale block
        nblocks = self.k // self.kblock
        if const_expr(kb % steps == 0):
            part.fill(0.0)
            if const_expr(self.k_scales):
                nxt = kt * self.kblocks + kb // steps + 1
                if nxt >= nblocks:
                    nxt = Int32(nblocks - 1)
                self._load_scales(sa_next, sb_next, rows, expert, bn, epi, nxt)
        cute.gemm(tiled_mma, part, tA, tB, part)
        if const_expr(kb % steps == steps - 1):
            mma_m = cute.size(rows) // 2
            for i in cutlass.range_constexpr(cute.size(acc)):
                s = (i // 2) % 2 + 2 * ((i // 4) % mma_m)
                mult = sa[s] * sb[0]
                if const_expr(self.glu):
                    mult = mult + up[i] * (sa[s] * sb[1] - mult)
                acc[i] = acc[i] + part[i] * mult
            if const_expr(self.k_scales):
                for s in cutlass.range_constexpr(cute.size(rows)):
                    sa[s] = sa_next[s]
                sb[0] = sb_next[0]
                sb[1] = sb_next[1]


class WarpGluGemmFp8(_WarpFp8, GroupedGluGemm):
    """GEMM1 + GLU in fp8 on mma.sync: ``h = act(x . gate_e) * (x . up_e)`` with x, w13, h in e4m3.

    ``__call__(x, xs, w13, w13s, sorted_ids, tile_expert, h, hs, stream)``: as
    ``hopper_fp8.HopperGluGemmFp8`` (x [M, H] e4m3 and xs [M] or [M, H/128]; w13 [E, 2I, H] e4m3
    interleaved and w13s [E, 2] or [E, 2I/128, H/128]; h [R, I] e4m3 and hs [R, I/h_block] fp32,
    every row of every used tile written, padding rows as zeros with scale 0). Grid (2I / tile_n, T).
    """

    def __init__(self, *args, h_block: int = HB, **kwargs):
        super().__init__(*args, **kwargs)
        self._warp_fp8_init(h_block)

    def fake_arguments(self):
        return glu_fp8_arguments(self)

    @cute.jit
    def __call__(self, x: cute.Tensor, xs: cute.Tensor, w13: cute.Tensor, w13s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor, hs: cute.Tensor,
                 stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel_fp8(x, xs, w13, w13s, sorted_ids, tile_expert, h, hs).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel_fp8(self, mX: cute.Tensor, mXs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor,
                   mIds: cute.Tensor, mTileExpert: cute.Tensor, mH: cute.Tensor, mHs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mX, mW, mIds, mTileExpert, (mH, mHs, mXs, mWs, mIds))

    @cute.jit
    def _load_scales(self, sa, sb, rows, expert, bn, epi, blk):
        """x's scale of each accumulator row's token and the tile's gate and up weight scales
        for K block ``blk`` (fp8: the token's and the expert's, whatever the block)."""
        _, _, mXs, mWs, _ = epi
        for s in cutlass.range_constexpr(cute.size(rows)):
            if const_expr(self.block):
                sa[s] = mXs[rows[s], blk]
            else:
                sa[s] = mXs[rows[s]]
        if const_expr(self.block):
            gb = (bn * (self.tile_n // 2)) // SB  # the tile's gate rows lie in one 128-row block
            sb[0] = mWs[expert, 2 * gb, blk]
            sb[1] = mWs[expert, 2 * gb + 1, blk]
        else:
            sb[0] = mWs[expert, 0]
            sb[1] = mWs[expert, 1]

    @cute.jit
    def _epilogue(self, etid, sC, epi, row0, bn, expert):
        """h in e4m3 with one scale per row and h_block columns, from the staged fp32 gate/up
        tile (gate columns [0, tile_n/2), up columns after them); see the module docstring."""
        mH, mHs, _, _, mIds = epi
        hb = self.h_block
        per_block = hb // _COLS_PER_LANE  # lanes sharing one row's h block: 4 or 8 (of a warp)
        half = self.tile_n // 2
        blocks = half // hb
        lanes = self.tile_m * blocks * per_block  # a multiple of 32: whole warps idle
        for it in cutlass.range_constexpr((lanes + self.mma_threads - 1) // self.mma_threads):
            g = it * self.mma_threads + etid
            if g < lanes:
                item = g // per_block
                sub = g % per_block
                row = item // blocks
                c0 = (item % blocks) * hb + sub * _COLS_PER_LANE
                gate = cute.local_tile(sC, (1, _COLS_PER_LANE), (row, c0 // _COLS_PER_LANE)).load()
                upv = cute.local_tile(sC, (1, _COLS_PER_LANE), (row, (half + c0) // _COLS_PER_LANE)).load()
                vals = cute.make_rmem_tensor(cute.make_layout(_COLS_PER_LANE), Float32)
                vals.store(self._glu(gate, upv).reshape(vals.shape))
                amax = Float32(0.0)
                for i in cutlass.range_constexpr(_COLS_PER_LANE):
                    amax = cute.arch.fmax(amax, cute.math.absf(vals[i]))
                for bit in cutlass.range_constexpr(self.h_shuffles):  # over the block's lanes
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1 << bit))
                amax = cute.arch.fmax(amax, Float32(1e-12))
                inv = limits.FP8_MAX * cute.math.rcp(amax)
                col = bn * half + c0
                dst = cute.local_tile(self._row(mH, row0 + row, self.intermediate), (_COLS_PER_LANE,),
                                      (col // _COLS_PER_LANE,))
                dst.store((vals.load() * inv).to(Float8E4M3FN))
                if sub == 0:
                    sc = Float32(0.0)
                    if mIds[row0 + row] >= 0:
                        sc = amax * (1.0 / limits.FP8_MAX)
                    mHs[row0 + row, col // hb] = sc


class WarpDownGemmFp8(_WarpFp8, GroupedDownGemm):
    """GEMM2 in fp8 on mma.sync: ``y[p] = topk_weights.flat[p] * (h[r] . w2_e^T)``.

    ``__call__(h, hs, w2, w2s, sorted_ids, tile_expert, topk_weights, y, stream)``: as
    ``hopper_fp8.HopperDownGemmFp8`` (h [R, I] e4m3 and hs [R, I/h_block]; w2 [E, H, I] e4m3 and
    w2s [E] or [E, H/128, I/128]; y bf16). Grid (H / tile_n, T).
    """

    def __init__(self, *args, h_block: int = HB, **kwargs):
        super().__init__(*args, **kwargs)
        self._warp_fp8_init(h_block)

    def fake_arguments(self):
        return down_fp8_arguments(self)

    @cute.jit
    def __call__(self, h: cute.Tensor, hs: cute.Tensor, w2: cute.Tensor, w2s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, topk_weights: cute.Tensor,
                 y: cute.Tensor, stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel_fp8(h, hs, w2, w2s, sorted_ids, tile_expert, topk_weights, y).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel_fp8(self, mH: cute.Tensor, mHs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor,
                   mIds: cute.Tensor, mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mH, mW, mIds, mTileExpert, (mIds, mTopkW, mY, mHs, mWs))

    @cute.jit
    def _load_scales(self, sa, sb, rows, expert, bn, epi, blk):
        """h's scale of each accumulator row for h_block-column block ``blk`` and the tile's weight
        scale (fp8-block128: of its 128x128 block; fp8: the expert's)."""
        _, _, _, mHs, mWs = epi
        for s in cutlass.range_constexpr(cute.size(rows)):
            sa[s] = mHs[rows[s], blk]
        if const_expr(self.block):
            sb[0] = mWs[expert, (bn * self.tile_n) // SB, blk // (SB // self.h_block)]
        else:
            sb[0] = mWs[expert]
        sb[1] = sb[0]

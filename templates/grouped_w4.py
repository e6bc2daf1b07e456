"""Weight-only MXFP4 grouped GEMMs ("mxfp4-w"): the mma.sync GEMMs of grouped_gemm.py with their
weights read as MXFP4 and dequantized to bf16 in shared memory.

What gpt-oss ships: e2m1 weights, two per byte (element 2j in the low nibble of byte j), and one
ue8m0 scale byte per 32 weights along K (2^(byte - 127)); moe_aot/blockscale.py defines the
format bit for bit, moe_aot/runtime/w4.py prepares the operands:

  * packed weights ``wq`` [E, N, K/2] uint8, rows as the bf16 kernels' (w13: gate/up interleaved
    in blocks of ``interleave`` rows);
  * scales ``ws`` [E, K/32, N] uint8, transposed so that a k-tile's scales of tile_n rows are
    16-byte runs (gpt-oss's [E, N, K/32] rows are K/32 = 90 bytes at K = 2880: not even 4-byte
    aligned for a cp.async).

At 1-256 tokens the layer streams its weights; 4.25 bits per weight instead of 16 is the point.

The mainloop (``_mainloop``, replacing grouped_gemm's "warp" one; x's gather, the fp32 staging
and both epilogues, GLU + biases and routing weight + biases, are the bf16 classes'):

  * per k-tile one cp.async group: the gathered bf16 A rows (as the bf16 kernel), the packed
    weights (16-byte chunks) and their scales (16-byte chunks of a scale row), ``stages`` deep;
  * k-tile kt + 1 is dequantized while the MMAs of k-tile kt run: every thread converts 8
    weights at a time (one 32-bit shared load, one scale byte, bit operations and two bf16x2
    multiplies per pair, one 16-byte store) into one of two bf16 slots in the swizzled layout
    the bf16 kernel's B stages have, so the MMA side (ldmatrix, mma.sync m16n8k16) is
    unchanged; one barrier per k-tile orders the slots and the stages.

e2m1 to bf16 (``_dequant8``): the code's 3 magnitude bits placed at bf16 bits 6..8 (mantissa's
top bit, exponent's two low bits) and its sign at bit 15 give the e2m1 value times 2^-126
exactly (code 1, 0.5, lands on the subnormal 2^-127); multiplied by 2^126 and then by the scale
2^(byte - 127), both bf16 numbers, in bf16 arithmetic (which keeps subnormals), every product
is the exact dequantized weight wherever bf16 can hold it (all of them for scale bytes 0..254:
e2m1 has two significant bits). Byte 255 (ue8m0 NaN) gives NaN weights.

Constraints beyond grouped_gemm's "warp" ones (``gemm_limits.check_w4``): mma "warp" only;
K a multiple of 32; N and tile_n multiples of 16; stages >= 3; tile_n a multiple of the packed
rows one cp.async pass covers (threads / (tile_k / 32)). Shared memory:
``gemm_limits.w4_pipeline_bytes``. No pre-activation output (training is bf16's).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Uint8, const_expr

from moe_aot import gemm_limits as limits

from .grouped_gemm import PERSISTENT_CTAS, GroupedDownGemm, GroupedGluGemm

QB = limits.W4_BLOCK  # weights per scale byte
_BF16_2POW126 = 0x7E80  # bf16 bits of 2^126
_BF16_NAN = 0x7FC0


class _W4Mainloop:
    """The mxfp4-w shared memory and mainloop of both GEMMs (see the module docstring). The
    weight arguments are (packed, scales) pairs wherever the bf16 classes pass one tensor."""

    def _w4_init(self):
        if self.precision not in limits.W4:
            raise ValueError(f"{type(self).__name__} is the mxfp4-w GEMM; precision {self.precision!r} is not")
        # 16-byte chunks of one k-tile's scales: (tile_k / 32) scale rows of tile_n bytes
        self.scale_chunks = (self.tile_k // QB) * (self.tile_n // limits.W4_SCALE_CHUNK)
        if self.scale_chunks > self.mma_threads:
            raise ValueError(f"{self.scale_chunks} scale chunks per k-tile exceed the {self.mma_threads} threads")

    # ------------------------------------------------------------------ host side
    def _smem_layout_slots(self, rows, slots):
        """The swizzled K-major bf16 layout of grouped_gemm's stages, with ``slots`` stages."""
        stages = self.stages
        self.stages = slots
        try:
            return self._smem_layout_ab(rows)
        finally:
            self.stages = stages

    def _make_q_copy(self):
        """cp.async of packed weights: 16 bytes (32 weights) per thread and copy, tile_k / 32
        threads per row."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint8, num_bits_per_copy=128)
        tpr = self.tile_k // QB
        thr = cute.make_layout((self.mma_threads // tpr, tpr), stride=(tpr, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, 16)))

    def _make_s_copy(self):
        """cp.async of one k-tile's scales: one 16-byte chunk of a scale row per thread, for the
        first ``scale_chunks`` threads."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint8, num_bits_per_copy=128)
        per_row = self.tile_n // limits.W4_SCALE_CHUNK
        thr = cute.make_layout((self.tile_k // QB, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, 16)))

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _smem_tensors(self):
        """A stages (bf16), two dequantized weight slots (bf16, the bf16 kernel's B layout),
        packed weight stages and scale stages; the fp32 staging tile over the same bytes.
        Returns (sA, (sQ, sS, sD), sC_ptr)."""
        smem = cutlass.memory.SmemAllocator()
        a_bytes = self.stages * self.tile_m * self.tile_k * 2
        d_bytes = 2 * self.tile_n * self.tile_k * 2
        q_stage = self.tile_n * self.tile_k // 2
        s_stage = self.tile_n * (self.tile_k // QB)
        ab = a_bytes + d_bytes + self.stages * (q_stage + s_stage)
        base = smem.allocate(max(ab, self.tile_m * self.c_row_stride * 4), byte_alignment=1024)
        sA_layout, swizzle = self._smem_layout_ab(self.tile_m)
        sD_layout, _ = self._smem_layout_slots(self.tile_n, 2)
        sA = cute.make_tensor(cute.recast_ptr(base, swizzle, BFloat16), sA_layout)
        sD = cute.make_tensor(cute.recast_ptr(base + a_bytes, swizzle, BFloat16), sD_layout)
        q_base = base + a_bytes + d_bytes
        sQ = cute.make_tensor(cute.recast_ptr(q_base, dtype=Uint8), cute.make_layout(
            (self.tile_n, self.tile_k // 2, self.stages), stride=(self.tile_k // 2, 1, q_stage)))
        sS = cute.make_tensor(cute.recast_ptr(q_base + self.stages * q_stage, dtype=Uint8), cute.make_layout(
            (self.tile_k // QB, self.tile_n, self.stages), stride=(self.tile_n, 1, s_stage)))
        return sA, (sQ, sS, sD), cute.recast_ptr(base, dtype=cutlass.Float32)

    @cute.jit
    def _expert_weights(self, mW, expert):
        """(packed [N, K/2], scales [K/32, N]) of one expert, offsets formed in 64 bits."""
        mQ, mS = mW
        q = cute.make_tensor((mQ.iterator + cutlass.Int64(expert) * (self.n * self.k // 2)).align(16),
                             cute.select(mQ.layout, mode=[1, 2]))
        s = cute.make_tensor((mS.iterator + cutlass.Int64(expert) * (self.n * self.k // QB)).align(16),
                             cute.select(mS.layout, mode=[1, 2]))
        return q, s

    @cute.jit
    def _mainloop(self, tidx, mA, a_rows, sA, mBe, bn, sB, tiled_mma, acc):
        """acc += A[a_rows] @ dequant(B_e)[bn-tile]^T over all of K (see the module docstring)."""
        mQe, mSe = mBe
        sQ, sS, sD = sB
        k_tiles = self.k // self.tile_k
        stages = self.stages
        # A: the bf16 kernel's cp.async partitions; padding rows zero-filled in every stage
        a_copy = self._make_g2s_copy()
        thr_a = a_copy.get_slice(tidx)
        tAsA = thr_a.partition_D(sA)
        tAcA = thr_a.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        for m in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            if a_rows[m] < 0:
                for s in cutlass.range_constexpr(stages):
                    tAsA[None, m, None, s].fill(0)
        # packed weights and scales
        q_copy = self._make_q_copy()
        thr_q = q_copy.get_slice(tidx)
        tQgQ = thr_q.partition_S(cute.local_tile(mQe, (self.tile_n, self.tile_k // 2), (bn, None)))
        tQsQ = thr_q.partition_D(sQ)
        s_copy = self._make_s_copy()
        thr_s = s_copy.get_slice(tidx % self.scale_chunks)
        tSgS = thr_s.partition_S(cute.local_tile(mSe, (self.tile_k // QB, self.tile_n), (None, bn)))
        tSsS = thr_s.partition_D(sS)
        copies = (a_copy, tAsA, tAcA, q_copy, tQgQ, tQsQ, s_copy, tSgS, tSsS)
        # the dequantization's chunks: the bf16 kernel's B cp.async partition of a slot
        thr_d = self._make_g2s_copy().get_slice(tidx)
        tDsD = thr_d.partition_D(sD)  # (8 elements, CPY_N, CPY_K, slot)
        tDcD = thr_d.partition_S(cute.make_identity_tensor((self.tile_n, self.tile_k)))
        sQw = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=Int32), cute.make_layout(
            (self.tile_n, self.tile_k // 8, stages), stride=(self.tile_k // 8, 1, self.tile_n * self.tile_k // 8)))

        # prologue: k-tiles 0 .. stages-2, one group each (pdl: the weights of all of them
        # before waiting for the previous grid, A after)
        if const_expr(self.early_b):
            for s in cutlass.range_constexpr(stages - 1):
                self._load_w(s, s, tidx, copies)
            self._grid_dependency_wait()
            for s in cutlass.range_constexpr(stages - 1):
                self._load_a(s, s, a_copy, mA, a_rows, tAsA, tAcA)
                cute.arch.cp_async_commit_group()
        else:
            for s in cutlass.range_constexpr(stages - 1):
                self._load_w(s, s, tidx, copies)
                self._load_a(s, s, a_copy, mA, a_rows, tAsA, tAcA)
                cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(stages - 2)
        cute.arch.sync_threads()
        self._dequant(sQw, sS, tDsD, tDcD, Int32(0), Int32(0))

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sD)[None, None, None, 0])
        ldm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), BFloat16)
        s2r_A = cute.make_tiled_copy_A(ldm, tiled_mma)
        s2r_B = cute.make_tiled_copy_B(ldm, tiled_mma)
        tXsA = s2r_A.get_slice(tidx).partition_S(sA)
        tXrA = s2r_A.get_slice(tidx).retile(tCrA)
        tXsB = s2r_B.get_slice(tidx).partition_S(sD)
        tXrB = s2r_B.get_slice(tidx).retile(tCrB)
        num_kb = cute.size(tCrA, mode=[2])

        stage = Int32(0)  # k-tile kt's stage (A) and slot (dequantized weights)
        slot = Int32(0)
        write_stage = Int32(stages - 1)
        for kt in range(k_tiles):
            # k-tile kt + 1 has landed (the groups are one per k-tile), every thread is done
            # with k-tile kt - 1's stage and slot
            cute.arch.cp_async_wait_group(stages - 3)
            cute.arch.sync_threads()
            if kt + (stages - 1) < k_tiles:
                self._load_w(kt + (stages - 1), write_stage, tidx, copies)
                self._load_a(kt + (stages - 1), write_stage, a_copy, mA, a_rows, tAsA, tAcA)
            cute.arch.cp_async_commit_group()
            write_stage = stage
            next_stage = stage + 1
            if next_stage == stages:
                next_stage = Int32(0)
            if kt + 1 < k_tiles:
                self._dequant(sQw, sS, tDsD, tDcD, next_stage, 1 - slot)
            cute.copy(s2r_A, tXsA[None, None, 0, stage], tXrA[None, None, 0])
            cute.copy(s2r_B, tXsB[None, None, 0, slot], tXrB[None, None, 0])
            for kb in cutlass.range_constexpr(num_kb):
                if const_expr(kb + 1 < num_kb):
                    cute.copy(s2r_A, tXsA[None, None, kb + 1, stage], tXrA[None, None, kb + 1])
                    cute.copy(s2r_B, tXsB[None, None, kb + 1, slot], tXrB[None, None, kb + 1])
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            stage = next_stage
            slot = 1 - slot

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

    @cute.jit
    def _load_w(self, kt, stage, tidx, copies):
        """cp.async of k-tile ``kt``'s packed weights and scales into pipeline stage ``stage``."""
        _, _, _, q_copy, tQgQ, tQsQ, s_copy, tSgS, tSsS = copies
        cute.copy(q_copy, tQgQ[None, None, None, kt], tQsQ[None, None, None, stage])
        if tidx < self.scale_chunks:
            cute.copy(s_copy, tSgS[None, None, None, kt], tSsS[None, None, None, stage])

    @cute.jit
    def _dequant(self, sQw, sS, tDsD, tDcD, stage, slot):
        """The packed weights of pipeline stage ``stage`` -> bf16 in slot ``slot``: this thread's
        8-weight chunks, each one 32-bit word of e2m1 codes and the scale byte of its block."""
        for n in cutlass.range_constexpr(cute.size(tDsD, mode=[1])):
            for kk in cutlass.range_constexpr(cute.size(tDsD, mode=[2])):
                row, col = tDcD[0, n, kk]
                word = sQw[row, col // 8, stage]
                sbyte = Int32(sS[col // QB, row, stage]) & 0xFF  # the DSL's Uint8 loads sign-extend
                frag = self._dequant8(word, sbyte)
                cute.autovec_copy(frag, tDsD[None, n, kk, slot])

    @cute.jit
    def _dequant8(self, word, sbyte):
        """Eight bf16 weights from a 32-bit word of e2m1 codes (weight 2j in the low nibble of
        byte j) and their ue8m0 scale byte (module docstring: exact)."""
        bits = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for j in cutlass.range_constexpr(4):
            x = word >> (8 * j)
            u = (x & 0xF) | ((x & 0xF0) << 12)  # low nibble at bits 0..3, high nibble at 16..19
            bits[j] = ((u & 0x00070007) << 6) | ((u & 0x00080008) << 12)
        # the scale 2^(byte - 127) as bf16 bits: byte << 7, except the subnormal 2^-127 (byte 0)
        # and NaN (byte 255)
        sbits = sbyte << 7
        if sbyte == 0:
            sbits = Int32(0x0040)
        if sbyte == 255:
            sbits = Int32(_BF16_NAN)
        sc = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        sc[0] = Int32(_BF16_2POW126) | (Int32(_BF16_2POW126) << 16)
        sc[1] = sbits | (sbits << 16)
        s = cute.recast_tensor(sc, BFloat16)
        v = cute.recast_tensor(bits, BFloat16).load()
        out = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
        out.store(v * s[0] * s[2])
        return out


class GroupedGluGemmW4(_W4Mainloop, GroupedGluGemm):
    """GEMM1 + GLU of an mxfp4-w layer: GroupedGluGemm with MXFP4 weights.

    ``__call__(x, w13q, w13s, sorted_ids, tile_expert, h, b13, stream)``: x [M, H] bf16;
    w13q [E, 2I, H/2] uint8 (packed e2m1, rows gate/up interleaved in blocks of ``interleave``),
    w13s [E, H/32, 2I] uint8 (ue8m0, column r the scales of row r); the rest, the activations
    and the biases (b13 [E, 2I] bf16 or None) as GroupedGluGemm's.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16,
                 tile_m: int = 16, tile_n: int = 128, tile_k: int = 64, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, ctas: int = PERSISTENT_CTAS, precision: str = "mxfp4-w",
                 bias: bool = False, save_preact: bool = False):
        super().__init__(num_experts, hidden, intermediate, top_k, activation, interleave, tile_m, tile_n,
                         tile_k, stages, mma, warps_m, warps_n, pdl, ctas, precision, bias, save_preact)
        self._w4_init()

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        args = dict(super().fake_arguments())
        e, hd, i2 = self.num_experts, self.hidden, 2 * self.intermediate
        return [("x", args["x"]),
                ("w13q", make_fake_tensor(Uint8, (e, i2, hd // 2), (i2 * hd // 2, hd // 2, 1), assumed_align=16)),
                ("w13s", make_fake_tensor(Uint8, (e, hd // QB, i2), (i2 * hd // QB, i2, 1), assumed_align=16)),
                ("sorted_ids", args["sorted_ids"]), ("tile_expert", args["tile_expert"]), ("h", args["h"]),
                ("b13", args["b13"]), ("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, x: cute.Tensor, w13q: cute.Tensor, w13s: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, h: cute.Tensor, b13: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel_w4(x, w13q, w13s, sorted_ids, tile_expert, h, b13).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel_w4(self, mX: cute.Tensor, mWq: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor,
                  mTileExpert: cute.Tensor, mH: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mX, (mWq, mWs), mIds, mTileExpert, self._epi(mH, mB, mIds, mTileExpert))


class GroupedDownGemmW4(_W4Mainloop, GroupedDownGemm):
    """GEMM2 of an mxfp4-w layer: GroupedDownGemm with MXFP4 weights.

    ``__call__(h, w2q, w2s, sorted_ids, tile_expert, topk_weights, y, b2, stream)``: w2q
    [E, H, I/2] uint8, w2s [E, I/32, H] uint8; the rest as GroupedDownGemm's.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 tile_m: int = 16, tile_n: int = 64, tile_k: int = 64, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, ctas: int = PERSISTENT_CTAS, precision: str = "mxfp4-w",
                 bias: bool = False):
        super().__init__(num_experts, hidden, intermediate, top_k, tile_m, tile_n, tile_k, stages, mma,
                         warps_m, warps_n, pdl, ctas, precision, bias)
        self._w4_init()

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        args = dict(super().fake_arguments())
        e, hd, i = self.num_experts, self.hidden, self.intermediate
        return [("h", args["h"]),
                ("w2q", make_fake_tensor(Uint8, (e, hd, i // 2), (hd * i // 2, i // 2, 1), assumed_align=16)),
                ("w2s", make_fake_tensor(Uint8, (e, i // QB, hd), (hd * i // QB, hd, 1), assumed_align=16)),
                ("sorted_ids", args["sorted_ids"]), ("tile_expert", args["tile_expert"]),
                ("topk_weights", args["topk_weights"]), ("y", args["y"]), ("b2", args["b2"]),
                ("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, h: cute.Tensor, w2q: cute.Tensor, w2s: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, topk_weights: cute.Tensor, y: cute.Tensor,
                 b2: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel_w4(h, w2q, w2s, sorted_ids, tile_expert, topk_weights, y, b2).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel_w4(self, mH: cute.Tensor, mWq: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor,
                  mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mH, (mWq, mWs), mIds, mTileExpert, self._epi(mIds, mTopkW, mY, mB, mTileExpert))

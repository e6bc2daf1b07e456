"""Block-scaled grouped GEMMs ("mxfp8", "nvfp4", "w4a8-mx") for DGX Spark (sm_121a) on the warp-level
block-scaled ``mma.sync``, with GEMM1's GLU output quantized to the activations' format in its epilogue.

The two GEMMs of grouped_gemm.py (gathered-A GEMM1 + GLU, GEMM2 + routing weight, the same
routing layout: ``sorted_ids`` [R] routed pair per padded row or -1, ``tile_expert`` [T] expert
per M tile or -1) with both operands block-scaled along K (moe_aot/blockscale.py defines the
formats bit for bit):

  "mxfp8"  e4m3 values, one ue8m0 scale byte per 32 along K, for activations and weights:
           ``mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32 ... .e4m3.e4m3.f32.ue8m0``
  "nvfp4"  e2m1 values two per byte (element 2j in the low nibble), one e4m3 scale byte per 16
           along K, and one fp32 global amax per tensor (x, h: [1]; w13, w2: [E], one per expert
           and matrix): ``mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64
           ... .e2m1.e2m1.f32.ue4m3``. The MMA applies the block scales; the global scales,
           1 / S_enc of each operand (S_enc = 448 * 6 / amax, ``blockscale_quant.nvfp4_encode_scale``),
           multiply the fp32 sums in the epilogue.
  "w4a8-mx" MXFP4 weights (gpt-oss's: e2m1 two per byte, a ue8m0 scale byte per 32 along K) times
           MXFP8 activations (x, h as "mxfp8"): ``mma.sync.aligned.kind::mxf8f6f4.block_scale
           .scale_vec::1X.m16n8k32 ... .e4m3.e2m1.f32.ue8m0`` (cute.nvgpu.warp.MmaMXF8F6F4Op). Its B
           operand holds each e2m1 in a byte (two .b32 registers of four, the code at bits 5:2, the
           rest zero), while shared memory holds the weights packed: each k-block's fragment is read
           as packed codes (two bytes per lane and n8 atom: its four consecutive k) and widened in
           registers (``_e2m1_containers``) before the MMA, whose B fragment is then a Uint8 tensor
           (the DSL 4.8.1 lowering of a Float4E2M1FN fragment passes eight packed codes in the
           first register and leaves the second undefined, so the kernel never hands it one).

Operand layouts in global memory (all uint8, row-major; exactly what ``blockscale.quantize``
returns for each matrix, so no permutation beyond bf16's gate/up interleave). K below is the padded
K (``gemm_limits.bs_padded_k``): every row along K (x, h, the weights, their scales) is stored
K-padded to whole 128-element k-tiles, the padding zero values with zero scale bytes (0 in every
sum); x's padding is written by its quantizer, h's by GEMM1's epilogue (the CTAs of the last
column tile), the weights' at preparation (runtime/blockscaled.py). N is never padded:
  values  [rows, K] e4m3 bytes (mxfp8, w4a8-mx's x and h) or [rows, K/2] packed e2m1 (nvfp4,
          w4a8-mx's weights: gpt-oss's checkpoint bytes, runtime/blockscaled.from_gpt_oss)
  scales  [rows, K/vec] bytes, vec = 32 (mxfp8) or 16 (nvfp4): row r's scales of K block b at r * K/vec + b
  w13     [E, 2I, .] values and [E, 2I, H/vec] scales, rows gate/up interleaved in blocks of
          ``interleave`` (``layout.interleave_gate_up`` applied to the quantized gate and up rows;
          moe_aot/runtime/blockscaled.py prepares them); w2 [E, H, .] and [E, H, I/vec]

Shared memory, per pipeline stage: the A and B value tiles [rows, tile_k * bits / 8] bytes in
8-row atoms of min(row bytes, 128) bytes with the bf16 kernels' byte-address swizzle (16-byte
chunk index XOR row), filled by 16-byte cp.async and read by ``ldmatrix.x4.b16`` (the fp8/fp4
A and B fragments of these MMAs are byte-for-byte the bf16 m16n8k16 ones; w4a8-mx's B tile has
half of A's row bytes and is read by 2-byte shared loads, see above); the A and B scale
tiles [rows, tile_k / vec] bytes, row-major, one cp.async of 4, 8 or 16 bytes per row (the
k-tile's scales of a row are contiguous in the global layout above). The MMA's scale operand:
per m16n8kK instruction lane l supplies the scale byte(s) of A row l/4 + 8 (l % 2) (scale_vec 1X:
one byte; 4X: the four K-block scales of the row as one 32-bit word, block j in byte j) and of
B column l/4, with byte/thread selectors 0 (``cutlass.utils.blackwell_helpers``'s SM120 SFA/SFB
thread-value layouts, read here from the row-major stage tiles by ``ld.shared.b8`` / ``.b32``).
No TMA swizzled 128x4 scale atom is needed: that is the tcgen05 (sm_100a) layout; mma.sync takes
scales from registers.

GEMM1's epilogue: the fp32 accumulator tile is staged in shared memory (gate and up columns
de-interleaved, as grouped_gemm's), then each thread takes one output block of vec h columns of
one row: g and u (times the global scales for nvfp4), the GLU, and ``blockscale_quant.quantize_block``
(the bit-exact quantizer of templates/blockscale_quant.py; e2m1 by ``cvt.rn.satfinite.e2m1x2.f32``)
write the block's value bytes and its scale byte into h's layout above: exactly what GEMM2's
mainloop reads. NVFP4's h needs its global amax before GEMM1 runs: ``h_gamax`` is an input (a
calibrated amax, as TransformerEngine's kernels take one); values beyond it saturate.

x (the layer's input) is quantized by its own kernel, templates/blockscale_quant.py (role
"bsquant" in variants.PRECISION_ROLES), before GEMM1.

Constraints (``gemm_limits.check_blockscaled``):
  * sm_121a (the sm_120 family) only: no other target has these instructions; mma "warp" only.
  * tile_k in (128, 256) (a k-tile row is 64..256 value bytes and 4..16 scale bytes); the padded
    K (``gemm_limits.bs_padded_k``: K rounded up to 128, e.g. gpt-oss's 2880 to 2944) % tile_k == 0
    and N % tile_n == 0 (hidden and intermediate multiples of 32); a k-tile loop of at least
    stages - 1 tiles; 2 <= stages <= 8.
  * warps_m x warps_n (``gemm_limits.default_warps``), tile_m % (16 warps_m) == 0, tile_n %
    (16 warps_n) == 0, at most 128 fp32 accumulators per thread; tile_m and tile_n multiples of
    the rows one 16-byte cp.async pass covers.
  * GEMM1: tile_n / 2 a multiple of vec (whole output scale blocks), tile_n % (2 interleave) == 0.
  * shared memory ``gemm_limits.bs_smem_bytes`` within the target's (GB10: 101,376 B per block).
  * expert biases optional (``bias``: b13 [E, 2I] bf16 interleaved as w13's rows, added to the gate/up
    sums before the activation, not to padding rows; b2 [E, H] bf16 added to GEMM2's sums before the
    routing weight); no pre-activation output, no PDL weight prefetch (pdl=True only waits).
  * all tensors 16-byte aligned; the runtime must check it (compiled-in assumption).

The sm_90a stand-in (``standin=True``, issue 12 item 4c): the same kernels, tile loops, shared
memory, fragments and epilogues, with each block-scaled ``cute.gemm`` replaced by ``_standin_gemm``,
which decodes the value and scale fragments the kernel loaded (at the coordinates the same tiled
MMA partitions them at), multiplies in fp32 through shared-memory scratch, and adds into the same
accumulators; e2m1 rounding in software. It compiles for sm_90a (no block-scaled MMA there), so an
H200 can check everything around the instruction against the torch reference
(tools/check_blockscaled.py); the instruction's own semantics need an sm_120-family GPU.

Status: the kernels compile for sm_121a and the stand-ins for sm_90a (tests/test_blockscaled_warp.py;
w4a8-mx's to ``QMMA.SF.16832.F32.E4M3.E2M1.E8``; its stand-in ran on the H200: 44/44 checks);
none has run on an sm_120-family GPU (none was available); the stand-ins ran on the H200 (2026-12-02:
32/32 GEMM checks, and the whole stand-in layer's 154 stage checks, tools/results/NOTES.md). The K
padding and the expert biases (gpt-oss's shape, tests/test_gpt_oss_spark.py) are compiled and
CPU-tested only: not yet run on a GPU, stand-in included.
"""

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm120_utils
from cutlass import BFloat16, Float4E2M1FN, Float8E4M3FN, Float8E8M0FNU, Float32, Int32, Uint8, const_expr

from moe_aot import gemm_limits as limits
from moe_aot.layout import interleave_gate_up  # noqa: F401  (the w13 row order GEMM1 reads)

from .blockscale_quant import nvfp4_encode_scale, quantize_block
from .grouped_gemm import _COPY_ELEMS, _GroupedGemmBase, glu

VALUE_DTYPES = {"mxfp8": Float8E4M3FN, "nvfp4": Float4E2M1FN, "mxfp4": Float4E2M1FN}  # per format
SCALE_DTYPES = {"mxfp8": Float8E8M0FNU, "nvfp4": Float8E4M3FN, "mxfp4": Float8E8M0FNU}
_PIECE = 16  # bytes per cp.async of values


class _BlockScaledBase(_GroupedGemmBase):
    """The block-scaled shared memory and mainloop of both GEMMs. A and B arguments are
    (values, scales) pairs wherever grouped_gemm's pass one tensor."""

    def _bs_init(self, n, k, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, pdl, precision, standin):
        if precision not in limits.BLOCKSCALED:
            raise ValueError(f"{type(self).__name__} is a block-scaled GEMM ({', '.join(limits.BLOCKSCALED)}), "
                             f"not {precision!r}")
        warps_m, warps_n = limits.default_warps(tile_m, tile_n, warps_m, warps_n)
        self.precision = precision
        self.nvfp4 = precision == "nvfp4"
        # activations (x, h: A) and weights (B); w4a8-mx: mxfp8 x mxfp4, the MMA's e2m1 B in byte containers
        self.act_fmt, self.w_fmt = limits.BS_FORMATS[precision]
        self.mixed = self.act_fmt != self.w_fmt
        self.vec = limits.BLOCKSCALE_BLOCK[self.act_fmt]  # both operands' (w4a8-mx: 32 and 32)
        self.bits, self.w_bits = limits.BS_ELEM_BITS[self.act_fmt], limits.BS_ELEM_BITS[self.w_fmt]
        self.val_dtype, self.sf_dtype = VALUE_DTYPES[self.act_fmt], SCALE_DTYPES[self.act_fmt]
        self.w_dtype = VALUE_DTYPES[self.w_fmt]
        # K padded to whole k-tiles (gemm_limits.bs_padded_k): A's and B's rows in memory hold
        # zero values and zero scale bytes past the problem's K, which add exactly 0 to every sum
        self.n, self.k = n, limits.bs_padded_k(k)
        k = self.k
        self.k_bytes, self.k_scales = k * self.bits // 8, k // self.vec  # per row in global memory
        self.w_k_bytes = k * self.w_bits // 8
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.row_bytes, self.row_scales = limits.bs_row_bytes(precision, tile_k)  # per k-tile row
        self.w_row_bytes = limits.bs_row_bytes(precision, tile_k, weights=True)[0]
        self.stages, self.mma = stages, mma
        self.warps_m, self.warps_n = warps_m, warps_n
        self.threads = self.mma_threads = self.load_threads = warps_m * warps_n * 32
        self.persistent = False
        self.out_cols = tile_n // 2 if self.glu else tile_n
        self.acc_m_blocks, self.acc_rows = 1, 2
        self.c_row_stride = tile_n + 8
        self.pdl = bool(pdl)
        self.early_b = False
        # standin: the same kernel with the block-scaled mma.sync emulated (_standin_gemm), for sm_90a
        self.standin = bool(standin)
        self.e2m1 = "sw" if self.standin else "hw"  # sm_90a has no e2m1 conversion instruction
        self.mma_k = limits.BS_MMA_K[precision]

    # ------------------------------------------------------------------ host side
    def _make_tiled_mma(self):
        """The block-scaled mma.sync on a warps_m x warps_n grid; N permuted so that warp w owns 16
        consecutive columns of every 16 * warps_n (two n8 atoms, one ldmatrix.x4 of B)."""
        cls = cute.nvgpu.warp.MmaMXF4NVF4Op if self.nvfp4 else cute.nvgpu.warp.MmaMXF8Op
        if const_expr(self.mixed):
            # e4m3 A x e2m1 B, kind::mxf8f6f4 (the same m16n8k32 fragments and ue8m0 scale operands as mxfp8)
            cls = cute.nvgpu.warp.MmaMXF8F6F4Op
            if const_expr(self.standin):
                op = object.__new__(cls)
                for name, value in (("a_dtype", self.val_dtype), ("b_dtype", self.w_dtype), ("acc_dtype", Float32),
                                    ("sf_type", self.sf_dtype)):
                    object.__setattr__(op, name, value)
            else:
                op = cls(self.val_dtype, self.w_dtype, Float32, self.sf_dtype)
        elif const_expr(self.standin):
            # the stand-in partitions with the same atom but never issues it: built without the
            # op's sm_120-family check (the atom's layouts do not depend on the target)
            op = object.__new__(cls)
            fields = (("ab_dtype", self.val_dtype), ("acc_dtype", Float32), ("shape_mnk", (16, 8, self.mma_k)),
                      ("sf_type", self.sf_dtype), ("sf_vec_size", self.vec), ("use_sf_layout_TV", False))
            for name, value in fields:
                object.__setattr__(op, name, value)
        else:
            op = cls(self.val_dtype, Float32, self.sf_dtype)
        perm_n = cute.make_layout((8, self.warps_n, 2), stride=(1, 16, 8))
        return cute.make_tiled_mma(op, cute.make_layout((self.warps_m, self.warps_n, 1)),
                                   permutation_mnk=(16 * self.warps_m, perm_n, limits.BS_MMA_K[self.precision]))

    def _make_g2s_copy(self, row_bytes: Optional[int] = None):
        """16-byte cp.async of a [rows, row_bytes] value tile (A's row bytes unless given),
        row_bytes / 16 threads per row."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint8, num_bits_per_copy=128)
        tpr = (row_bytes or self.row_bytes) // _PIECE
        thr = cute.make_layout((self.threads // tpr, tpr), stride=(tpr, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, _PIECE)))

    def _scale_passes(self, rows: int) -> int:
        return -(-rows // self.threads)

    # ------------------------------------------------------------------ device helpers
    def _value_layout(self, rows: int, bits: int, row_bytes: Optional[int] = None):
        """(rows, row_bytes * 8 / bits elements, stages) in 8-row atoms of min(row_bytes, 128) bytes
        (A's row bytes unless given)."""
        row_bytes = row_bytes or self.row_bytes
        atom_bytes = min(row_bytes, 128)
        per = atom_bytes * 8 // bits
        atom = cute.make_layout((8, per), stride=(per, 1))
        return cute.tile_to_shape(atom, (rows, row_bytes * 8 // bits, self.stages), (0, 1, 2))

    @cute.jit
    def _smem_tensors(self):
        """Per operand (byte view of the value stages for cp.async, the same bytes as MMA elements,
        scale stages as bytes, the same as the MMA's scale type over (rows, (vec, tile_k / vec))),
        and the fp32 staging tile over the same bytes. Returns ((A views), (B views), sC_ptr)."""
        smem = cutlass.memory.SmemAllocator()
        vb, wb, sb, st = self.row_bytes, self.w_row_bytes, self.row_scales, self.stages
        a_v, b_v = st * self.tile_m * vb, st * self.tile_n * wb
        a_s, b_s = st * self.tile_m * sb, st * self.tile_n * sb
        main = max(a_v + b_v + a_s + b_s, self.tile_m * self.c_row_stride * 4)
        base = smem.allocate(main + self._standin_bytes(), byte_alignment=1024)
        views = []
        for v_off, s_off, rows, rb, dtype, bits in (
                (0, a_v + b_v, self.tile_m, vb, self.val_dtype, self.bits),
                (a_v, a_v + b_v + a_s, self.tile_n, wb, self.w_dtype, self.w_bits)):
            swizzle = cute.make_swizzle(int(math.log2(min(rb, 128) // 16)), 4, 3)
            vbytes = cute.make_tensor(cute.recast_ptr(base + v_off, swizzle, Uint8), self._value_layout(rows, 8, rb))
            velems = cute.make_tensor(cute.recast_ptr(base + v_off, swizzle, dtype),
                                      self._value_layout(rows, bits, rb))
            sbytes = cute.make_tensor(cute.recast_ptr(base + s_off, dtype=Uint8),
                                      cute.make_layout((rows, sb, st), stride=(sb, 1, rows * sb)))
            selems = cute.make_tensor(cute.recast_ptr(base + s_off, dtype=self.sf_dtype), cute.make_layout(
                (rows, (self.vec, sb), st), stride=(sb, (0, 1), rows * sb)))
            views.append((vbytes, velems, sbytes, selems))
        if const_expr(self.standin):
            views[0] += (self._standin_scratch(base + main),)
        return views[0], views[1], cute.recast_ptr(base, dtype=Float32)

    @cute.jit
    def _expert_weights(self, mW, expert):
        """(values [N, K bytes], scales [N, K/vec]) of one expert, offsets formed in 64 bits."""
        mWq, mWs = mW
        q = cute.make_tensor((mWq.iterator + cutlass.Int64(expert) * (self.n * self.w_k_bytes)).align(16),
                             cute.make_layout((self.n, self.w_k_bytes), stride=(self.w_k_bytes, 1)))
        s = cute.make_tensor((mWs.iterator + cutlass.Int64(expert) * (self.n * self.k_scales)).align(self.row_scales),
                             cute.make_layout((self.n, self.k_scales), stride=(self.k_scales, 1)))
        return q, s

    @cute.jit
    def _scale_row(self, mS, row):
        """Row ``row`` of a [rows, K/vec] scale matrix, aligned to a k-tile's scale bytes."""
        base = (mS.iterator + cutlass.Int64(row) * self.k_scales).align(self.row_scales)
        return cute.make_tensor(base, cute.make_layout(self.k_scales))

    @cute.jit
    def _load_scales(self, kt, stage, tidx, mS, s_rows, rows: cutlass.Constexpr, sS):
        """cp.async of k-tile ``kt``'s scale bytes of ``rows`` rows into ``stage``: thread t copies
        rows t, t + threads, ... (``s_rows``: their source rows, -1: padding, left zero)."""
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS), Uint8,
                                   num_bits_per_copy=8 * self.row_scales)
        for p in cutlass.range_constexpr(self._scale_passes(rows)):
            r = tidx + p * self.threads
            if r < rows:
                src_row = s_rows[p]
                if src_row >= 0:
                    src = cute.local_tile(self._scale_row(mS, src_row), (self.row_scales,), (kt,))
                    cute.copy(atom, src, sS[r, None, stage])

    @cute.jit
    def _load_a_values(self, kt, stage, tiled_copy, mA, a_rows, tAsA, tAcA):
        """cp.async of the gathered A value rows of k-tile ``kt`` (padding rows stay zero)."""
        for m in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            row = a_rows[m]
            if row >= 0:
                src_row = cute.tiled_divide(
                    cute.append_ones(self._row(mA, row, self.k_bytes), up_to_rank=2), (_PIECE, 1))
                for kk in cutlass.range_constexpr(cute.size(tAsA, mode=[2])):
                    chunk = kt * (self.row_bytes // _PIECE) + tAcA[0, 0, kk][1] // _PIECE
                    cute.copy(tiled_copy, src_row[None, chunk, 0], tAsA[None, m, kk, stage])

    @cute.jit
    def _load_tile(self, kt, stage, tidx, ld):
        """Issue the cp.async copies of k-tile ``kt`` (A and B values and scales) into ``stage``."""
        copy, mAq, mAs, a_rows, s_rows, tAsA, tAcA, sSA, tBgB, tBsB, mBs, b_rows, sSB, copy_b = ld
        self._load_a_values(kt, stage, copy, mAq, a_rows, tAsA, tAcA)
        self._load_scales(kt, stage, tidx, mAs, s_rows, self.tile_m, sSA)
        cute.copy(copy_b, tBgB[None, None, None, kt], tBsB[None, None, None, stage])
        self._load_scales(kt, stage, tidx, mBs, b_rows, self.tile_n, sSB)

    @cute.jit
    def _mainloop(self, tidx, mA, a_rows, sA, mBe, bn, sB, tiled_mma, acc, pstate=None):
        """acc += (A * SFA)[a_rows] @ (B_e * SFB_e)[bn-tile]^T over all of K: cp.async stages - 1
        k-tiles ahead (values and scales of a k-tile in one group), ldmatrix and the scale loads one
        k-block ahead of the block-scaled mma.sync, as grouped_gemm's "warp" mainloop. ``pstate``
        (grouped_gemm's per-K-block promotion state) is always None here: the MMA applies the scales."""
        mAq, mAs = mA
        mBq, mBs = mBe
        rows_a, rows_s = a_rows
        sAb, sAe, sSAb, sSA = sA[:4]
        sBb, sBe, sSBb, sSB = sB
        stages = self.stages

        copy = self._make_g2s_copy()
        thr_copy = copy.get_slice(tidx)
        tAsA = thr_copy.partition_D(sAb)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.row_bytes)))
        copy_b, thr_copy_b = copy, thr_copy
        if const_expr(self.mixed):  # the weights' rows are half as long (packed e2m1)
            copy_b = self._make_g2s_copy(self.w_row_bytes)
            thr_copy_b = copy_b.get_slice(tidx)
        tBsB = thr_copy_b.partition_D(sBb)
        tBgB = thr_copy_b.partition_S(cute.local_tile(mBq, (self.tile_n, self.w_row_bytes), (bn, None)))
        # padding rows of A: values and scales zero in every stage (a garbage scale byte could be
        # NaN, and NaN * 0 is NaN), never loaded
        for m in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            if rows_a[m] < 0:
                for s in cutlass.range_constexpr(stages):
                    tAsA[None, m, None, s].fill(0)
        for p in cutlass.range_constexpr(self._scale_passes(self.tile_m)):
            r = tidx + p * self.threads
            if r < self.tile_m:
                if rows_s[p] < 0:
                    for s in cutlass.range_constexpr(stages):
                        sSAb[r, None, s].fill(0)
        b_rows = cute.make_rmem_tensor(cute.make_layout(self._scale_passes(self.tile_n)), Int32)
        for p in cutlass.range_constexpr(self._scale_passes(self.tile_n)):
            b_rows[p] = bn * self.tile_n + tidx + p * self.threads
        ld = (copy, mAq, mAs, rows_a, rows_s, tAsA, tAcA, sSAb, tBgB, tBsB, mBs, b_rows, sSBb, copy_b)

        for s in cutlass.range_constexpr(stages - 1):
            self._load_tile(s, s, tidx, ld)
            cute.arch.cp_async_commit_group()

        # register fragments and the shared -> register copies of values (ldmatrix) and scales
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sAe)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sBe)[None, None, None, 0])
        tCrSFA = self._sf_fragment(sSA[None, None, 0], thr_mma, tidx, True)
        tCrSFB = self._sf_fragment(sSB[None, None, 0], thr_mma, tidx, False)
        ldm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.val_dtype)
        s2r_A = cute.make_tiled_copy_A(ldm, tiled_mma).get_slice(tidx)
        tCrB8 = tCrB
        if const_expr(self.mixed):
            # packed e2m1 from shared memory: a lane's four consecutive k of a B column are two bytes
            # (ldmatrix.b16 would hand it eight); then widened to the MMA's byte containers per k-block
            s2r_B = cute.make_tiled_copy_B(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.w_dtype,
                                                               num_bits_per_copy=16), tiled_mma).get_slice(tidx)
            tCrB8 = cute.make_rmem_tensor(tCrB.layout, Uint8)
        else:
            s2r_B = cute.make_tiled_copy_B(ldm, tiled_mma).get_slice(tidx)
        sf_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.sf_dtype)
        perm = tiled_mma.permutation_mnk
        s2r_SA = cute.make_tiled_copy(sf_atom, sm120_utils.get_layoutSFA_TV(tiled_mma),
                                      (cute.size(perm[0]), cute.size(perm[2]))).get_slice(tidx)
        s2r_SB = cute.make_tiled_copy(sf_atom, sm120_utils.get_layoutSFB_TV(tiled_mma),
                                      (cute.size(perm[1]), cute.size(perm[2]))).get_slice(tidx)
        views = (s2r_A.partition_S(sAe), s2r_A.retile(tCrA), s2r_B.partition_S(sBe), s2r_B.retile(tCrB),
                 cute.filter_zeros(s2r_SA.partition_S(sSA)), cute.filter_zeros(s2r_SA.retile(tCrSFA)),
                 cute.filter_zeros(s2r_SB.partition_S(sSB)), cute.filter_zeros(s2r_SB.retile(tCrSFB)))
        copies = (s2r_A, s2r_B, s2r_SA, s2r_SB)
        num_kb = cute.size(tCrA, mode=[2])
        k_tiles = self.k // self.tile_k

        cute.arch.cp_async_wait_group(stages - 2)
        cute.arch.sync_threads()
        self._s2r(copies, views, 0, 0)

        read_stage = Int32(0)  # stage the register pipeline reads from
        next_stage = Int32(0)  # stage of the next k-tile to be read
        write_stage = Int32(stages - 1)
        for kt in range(k_tiles):
            for kb in cutlass.range_constexpr(num_kb):
                if const_expr(kb == num_kb - 1):
                    read_stage = next_stage
                    cute.arch.cp_async_wait_group(stages - 2)
                    cute.arch.sync_threads()
                self._s2r(copies, views, (kb + 1) % num_kb, read_stage)
                if const_expr(kb == 0):
                    if kt + (stages - 1) < k_tiles:
                        self._load_tile(kt + (stages - 1), write_stage, tidx, ld)
                    cute.arch.cp_async_commit_group()
                    write_stage = next_stage
                    next_stage = next_stage + 1
                    if next_stage == stages:
                        next_stage = Int32(0)
                if const_expr(self.mixed):
                    self._e2m1_containers(tCrB[None, None, kb], tCrB8[None, None, kb])
                if const_expr(self.standin):
                    self._standin_gemm(tidx, tiled_mma, acc, (tCrA, tCrSFA, tCrB8, tCrSFB), sA[4], kb)
                else:
                    cute.gemm(tiled_mma, acc, [tCrA[None, None, kb], tCrSFA[None, None, kb]],
                              [tCrB8[None, None, kb], tCrSFB[None, None, kb]], acc)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

    @cute.jit
    def _e2m1_containers(self, src, dst):
        """Packed e2m1 codes (element 2j in the low nibble of byte j) -> one per byte at bits 5:2,
        the other bits zero: how kind::mxf8f6f4 takes .e2m1 operands (B: two .b32 registers of
        four elements each, as for e4m3)."""
        packed = cute.recast_tensor(src, Uint8)  # a k-block's slice of the fragment is contiguous
        for j in cutlass.range_constexpr(cute.size(packed)):
            byte = packed[j].to(Int32)
            dst[2 * j] = ((byte & 0xF) << 2).to(Uint8)
            dst[2 * j + 1] = ((byte >> 4) << 2).to(Uint8)

    def _sf_fragment(self, sf, thr_mma, tidx, a: bool, coords: bool = False):
        """This thread's register fragment of the scale tile ``sf`` [rows, (vec, tile_k / vec)] of A
        (``a``) or B as the block-scaled MMA reads it: (scale values, MMA atoms along M or N,
        k-blocks), from blackwell_helpers' SM120 thread-value partition of scale factors. (Its own
        partition_fragment_SFB merges the N and k-block modes when a warp's N atoms are one mode.)"""
        thrfrg = sm120_utils.thrfrg_SFA if a else sm120_utils.thrfrg_SFB
        thr = cute.make_tensor(sf.iterator, thrfrg(sf.layout, thr_mma))
        vmnk = thr_mma.thr_layout_vmnk.get_flat_coord(tidx)
        coord = (vmnk[0], (vmnk[1] if a else vmnk[2], vmnk[3]))
        part = cute.group_modes(cute.flatten(thr[coord, (None, None)]), 0, 2)
        part = cute.group_modes(part, 1, cute.rank(part) - 1)
        return part if coords else cute.make_fragment_like(part)

    @cute.jit
    def _s2r(self, copies, views, kb, stage):
        """Values (ldmatrix) and scale bytes of k-block ``kb`` of ``stage`` into their fragments."""
        s2r_A, s2r_B, s2r_SA, s2r_SB = copies
        tXsA, tXrA, tXsB, tXrB, tSsA, tSrA, tSsB, tSrB = views
        cute.copy(s2r_A, tXsA[None, None, kb, stage], tXrA[None, None, kb])
        cute.copy(s2r_B, tXsB[None, None, kb, stage], tXrB[None, None, kb])
        cute.copy(s2r_SA, tSsA[None, None, kb, stage], tSrA[None, None, kb])
        cute.copy(s2r_SB, tSsB[None, None, kb, stage], tSrB[None, None, kb])

    # ------------------------------------------------------------------ the sm_90a stand-in
    def _standin_bytes(self) -> int:
        """fp32 scratch of the stand-in MMA: one instruction's K of decoded A and B values and their
        scales ([rows, mma_k] and [rows, mma_k / vec] per operand); 0 for the real kernel."""
        if not self.standin:
            return 0
        return (self.tile_m + self.tile_n) * (self.mma_k + self.mma_k // self.vec) * 4

    @cute.jit
    def _standin_scratch(self, ptr):
        rows, k, nb = (self.tile_m, self.tile_n), self.mma_k, self.mma_k // self.vec
        out = []
        off = 0
        for cols in (k, nb):
            for r in rows:
                out.append(cute.make_tensor(cute.recast_ptr(ptr + off, dtype=Float32),
                                            cute.make_layout((r, cols), stride=(cols, 1))))
                off += r * cols * 4
        return tuple(out)  # (values A, values B, scales A, scales B)

    @cute.jit
    def _standin_gemm(self, tidx, tiled_mma, acc, frags, scratch, kb: cutlass.Constexpr):
        """What the block-scaled mma.sync of k-block ``kb`` computes, from the same register
        fragments: every thread writes its decoded values and scales at their tile coordinates (the
        tiled MMA's partitions of the tile, as the fragments were made) into fp32 scratch, then each
        accumulator element adds sum_k A[m, k] SA[m, k / vec] B[n, k] SB[n, k / vec] (fp32, not the
        tensor core's order). Checks everything around the instruction on a GPU without it."""
        tCrA, tCrSFA, tCrB, tCrSFB = frags
        sXA, sXB, sSA, sSB = scratch
        thr_mma = tiled_mma.get_slice(tidx)
        k0 = kb * self.mma_k
        for frag, sX, cT, b in (
                (tCrA, sXA, thr_mma.partition_A(cute.make_identity_tensor((self.tile_m, self.tile_k))), False),
                (tCrB, sXB, thr_mma.partition_B(cute.make_identity_tensor((self.tile_n, self.tile_k))), True)):
            vals = self._standin_values(frag[None, None, kb], b and self.mixed)
            crd = cT[None, None, kb]
            for i in cutlass.range_constexpr(cute.size(vals)):
                sX[crd[i][0], crd[i][1] - k0] = vals[i]
        for frag, sS, rows, a in ((tCrSFA, sSA, self.tile_m, True), (tCrSFB, sSB, self.tile_n, False)):
            # coordinates (row, (k within block, block)) of the fragment's elements, partitioned as
            # the fragment was (over the scale tile's own (rows, (vec, tile_k / vec)) shape)
            crd = self._sf_fragment(cute.make_identity_tensor((rows, (self.vec, self.row_scales))), thr_mma, tidx,
                                    a, coords=True)
            assert cute.size(crd) == cute.size(frag) and cute.rank(crd) == cute.rank(frag), (crd.layout, frag.layout)
            f = frag[None, None, kb]
            c = crd[None, None, kb]
            for i, row, blk in self._distinct_scales(c, cute.size(f), kb * (self.mma_k // self.vec)):
                sS[row, blk] = self._standin_scale(f, i)
        cute.arch.sync_threads()
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[i]
            total = Float32(0.0)
            for k in cutlass.range(self.mma_k):
                total = total + (sXA[m, k] * sSA[m, k // self.vec]) * (sXB[n, k] * sSB[n, k // self.vec])
            acc[i] = acc[i] + total
        cute.arch.sync_threads()

    @staticmethod
    def _distinct_scales(crd, n: int, blk0: int):
        """[(fragment index, row, block - blk0)] once per scale: the fragment repeats each scale over
        its block (stride 0). Plain Python at trace time (the coordinates are static)."""
        out, seen = [], set()
        for i in range(n):
            key = (crd[i][0], crd[i][1][1] - blk0)
            if key not in seen:
                seen.add(key)
                out.append((i,) + key)
        return out

    @cute.jit
    def _standin_values(self, frag, containers: cutlass.Constexpr = False):
        """A value fragment as fp32: e4m3 by the conversion sm_89+ has, e2m1 decoded from its code
        bits (element 2j in the low nibble of byte j, as in memory; ``containers``: w4a8-mx's B,
        one code per byte at bits 5:2, as the MMA takes it)."""
        out = cute.make_rmem_tensor(cute.make_layout(cute.size(frag)), Float32)
        if const_expr(containers):
            for j in cutlass.range_constexpr(cute.size(frag)):
                out[j] = self._e2m1_value((frag[j].to(Int32) >> 2) & 0xF)
        elif const_expr(self.nvfp4):
            dense = cute.make_rmem_tensor(cute.make_layout(cute.size(frag)), self.val_dtype)
            dense.store(frag.load())
            packed = cute.recast_tensor(dense, Uint8)
            for j in cutlass.range_constexpr(cute.size(packed)):
                byte = packed[j].to(Int32)
                out[2 * j] = self._e2m1_value(byte & 0xF)
                out[2 * j + 1] = self._e2m1_value(byte >> 4)
        else:
            out.store(frag.load().to(Float32))
        return out

    @cute.jit
    def _e2m1_value(self, code):
        mag = Float32(0.0)
        for c, v in ((1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0), (5, 3.0), (6, 4.0), (7, 6.0)):
            if (code & 7) == c:
                mag = Float32(v)
        return -mag if (code & 8) != 0 else mag

    @cute.jit
    def _standin_scale(self, frag, i):
        """Scale element i of a scale fragment as fp32: e4m3, or ue8m0 2^(byte - 127) (byte 0: the
        subnormal 2^-127; 0xFF: NaN)."""
        if const_expr(self.nvfp4):
            one = cute.make_rmem_tensor(cute.make_layout(2), Float8E4M3FN)
            one[0] = frag[i]
            one[1] = frag[i]
            return one.load().to(Float32)[0]
        one = cute.make_rmem_tensor(cute.make_layout(4), self.sf_dtype)
        one[0] = frag[i]
        b = cute.recast_tensor(one, Uint8)[0].to(Int32)
        v = (b << 23).bitcast(Float32)
        if b == 0:
            v = Int32(0x00400000).bitcast(Float32)
        if b == 0xFF:
            v = Int32(0x7FC00000).bitcast(Float32)
        return v

    @cute.jit
    def _global_scale(self, mG, i):
        """1 / S_enc of an NVFP4 tensor whose global amax is mG[i] (the dequantization factor)."""
        return Float32(1.0) / nvfp4_encode_scale(mG[i])

    def _fake_values(self, rows, cols):
        from cutlass.cute.runtime import make_fake_tensor

        qc, sc = cols * self.bits // 8, cols // self.vec
        return (make_fake_tensor(Uint8, (rows, qc), (qc, 1), assumed_align=16),
                make_fake_tensor(Uint8, (rows, sc), (sc, 1), assumed_align=16))

    def _fake_weights(self, e, n, k):
        from cutlass.cute.runtime import make_fake_tensor

        qc, sc = k * self.w_bits // 8, k // self.vec
        return (make_fake_tensor(Uint8, (e, n, qc), (n * qc, qc, 1), assumed_align=16),
                make_fake_tensor(Uint8, (e, n, sc), (n * sc, sc, 1), assumed_align=16))

    def _fake_amax(self, n):
        from cutlass.cute.runtime import make_fake_tensor

        return make_fake_tensor(Float32, (n,), (1,), assumed_align=4) if self.nvfp4 else None

    @cute.jit
    def _token(self, mIds, r):
        """Token row of x of padded row r (GEMM1's gather)."""
        # p >= -1, so this is p // top_k for a routed pair and -1 for padding
        return (mIds[r] + self.top_k) // self.top_k - 1

    @cute.jit
    def _scale_rows_of(self, tidx, mIds, row0, gather: cutlass.Constexpr):
        """Per scale pass of this thread, the source row of A's tile row tidx + p * threads: the
        token of its routed pair (``gather``, GEMM1; -1 for padding) or row0 + r (GEMM2)."""
        passes = self._scale_passes(self.tile_m)
        s_rows = cute.make_rmem_tensor(cute.make_layout(passes), Int32)
        for p in cutlass.range_constexpr(passes):
            r = tidx + p * self.threads
            s_rows[p] = Int32(-1)
            if r < self.tile_m:
                if const_expr(gather):
                    s_rows[p] = self._token(mIds, row0 + r)
                else:
                    s_rows[p] = row0 + r
        return s_rows


class BlockScaledGluGemm(_BlockScaledBase):
    """GEMM1 of a block-scaled MoE: ``h[r] = quant(act(x[p//top_k] . gate_e) * (x[p//top_k] . up_e))``.

    ``__call__(xq, xs, w13q, w13s, sorted_ids, tile_expert, hq, hs, x_gamax, w13_gamax, h_gamax, b13, stream)``
    (K-padded rows, see the module docstring; hq's and hs's rows I padded, GEMM2's K):
      xq [M, H*b/8], xs [M, H/vec] (M dynamic); w13q [E, 2I, H*b/8], w13s [E, 2I, H/vec], rows
      gate/up interleaved in blocks of ``interleave``; sorted_ids [R] and tile_expert [T] int32;
      hq [R, I*b/8] and hs [R, I/vec] with R = T * tile_m dynamic: GEMM2's A operand. b = 8
      (mxfp8) or 4 (nvfp4) bits per value, all uint8 (see the module docstring).
      nvfp4: x_gamax [1], w13_gamax [E], h_gamax [1] fp32 global amaxes; None for mxfp8.
      Padding rows (sorted_ids == -1) are written as quantized zeros (value and scale bytes 0);
      tiles with tile_expert == -1 are not written. Grid (2I / tile_n, T). b13 [E, 2I] bf16 with
      ``bias`` (None otherwise: no argument of the compiled kernel).
    Activation: "swiglu", "geglu", "swigluoai" (grouped_gemm.glu).
    """

    glu = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16,
                 tile_m: int = 16, tile_n: int = 64, tile_k: int = 256, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, precision: str = "mxfp8", bias: bool = False, save_preact: bool = False,
                 standin: bool = False):
        ok, reason = self.can_implement(num_experts, hidden, intermediate, top_k, activation, interleave,
                                        tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, precision=precision)
        if ok and save_preact:
            ok, reason = False, f"{precision} GEMM1 has no pre-activation output"
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k, self.activation, self.interleave = top_k, activation, interleave
        self.bias, self.save_preact = bool(bias), False
        self._bs_init(2 * intermediate, hidden, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, pdl,
                      precision, standin)
        # h's rows are GEMM2's A rows: I padded as GEMM2's K; the last column tile writes the padding
        self.h_cols = limits.bs_padded_k(intermediate)

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, activation="swiglu", interleave=16,
                      tile_m=16, tile_n=64, tile_k=256, stages=4, mma="warp", warps_m=None, warps_n=None,
                      arch=None, precision="mxfp8"):
        """(ok, reason) for this problem, these tunables and, if given, the target arch."""
        if precision not in limits.BLOCKSCALED:
            return False, f"precision {precision!r} must be one of {', '.join(limits.BLOCKSCALED)}"
        if num_experts < 1 or top_k < 1 or top_k > num_experts:
            return False, f"need 1 <= top_k={top_k} <= num_experts={num_experts}"
        ok, reason = limits.check_glu_shape(intermediate, tile_n, interleave, activation)
        if not ok:
            return ok, reason
        return limits.check_blockscaled("glu", precision, 2 * intermediate, hidden, tile_m, tile_n, tile_k, stages,
                                        mma, warps_m, warps_n, arch)

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        m = cute.sym_int32(symbol="M")
        r = cute.sym_int32(symbol="R", divisibility=self.tile_m)
        t = cute.sym_int32(symbol="T")
        e, i = self.num_experts, self.intermediate
        xq, xs = self._fake_values(m, self.k)  # K-padded rows (bs_padded_k)
        wq, ws = self._fake_weights(e, 2 * i, self.k)
        hq, hs = self._fake_values(r, self.h_cols)
        i2 = 2 * i
        return [("xq", xq), ("xs", xs), ("w13q", wq), ("w13s", ws),
                ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=16)),
                ("tile_expert", make_fake_tensor(Int32, (t,), (1,), assumed_align=16)),
                ("hq", hq), ("hs", hs),
                ("x_gamax", self._fake_amax(1)), ("w13_gamax", self._fake_amax(e)), ("h_gamax", self._fake_amax(1)),
                ("b13", make_fake_tensor(BFloat16, (e, i2), (i2, 1), assumed_align=16) if self.bias else None),
                ("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, xq: cute.Tensor, xs: cute.Tensor, w13q: cute.Tensor, w13s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, hq: cute.Tensor, hs: cute.Tensor,
                 x_gamax: Optional[cute.Tensor], w13_gamax: Optional[cute.Tensor], h_gamax: Optional[cute.Tensor],
                 b13: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel(xq, xs, w13q, w13s, sorted_ids, tile_expert, hq, hs, x_gamax, w13_gamax, h_gamax, b13).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mXq: cute.Tensor, mXs: cute.Tensor, mWq: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor,
               mTileExpert: cute.Tensor, mHq: cute.Tensor, mHs: cute.Tensor, mGx: Optional[cute.Tensor],
               mGw: Optional[cute.Tensor], mGh: Optional[cute.Tensor], mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, (mXq, mXs), (mWq, mWs), mIds, mTileExpert, (mHq, mHs, mGx, mGw, mGh, mB, mIds))

    @cute.jit
    def _a_rows(self, tidx, mIds, row0):
        """(token row of x for each A value row this thread copies, and for each scale row it
        copies); -1: padding (zero-filled, never loaded)."""
        tAcA = self._make_g2s_copy().get_slice(tidx).partition_S(
            cute.make_identity_tensor((self.tile_m, self.row_bytes)))
        cpy_m = cute.size(tAcA, mode=[1])
        a_rows = cute.make_rmem_tensor(cute.make_layout(cpy_m), Int32)
        for m in cutlass.range_constexpr(cpy_m):
            a_rows[m] = self._token(mIds, row0 + tAcA[0, m, 0][0])
        return a_rows, self._scale_rows_of(tidx, mIds, row0, True)

    @cute.jit
    def _epilogue(self, etid, sC, epi, row0, bn, expert):
        """h of the tile from the staged fp32 gate/up columns, quantized: thread ``etid`` takes the
        output blocks etid, etid + threads, ... (block j of a row: h columns bn * tile_n / 2 +
        vec j ..), writes its vec (mxfp8) or vec / 2 (nvfp4) value bytes and its scale byte."""
        mHq, mHs, mGx, mGw, mGh, mB, mIds = epi
        blocks = self.tile_n // 2 // self.vec  # output blocks per tile row
        items = self.tile_m * blocks
        qn = self.vec * self.bits // 8
        i_bytes, i_scales = self.h_cols * self.bits // 8, self.h_cols // self.vec  # h's padded row
        alpha = Float32(1.0)
        s_enc = Float32(1.0)
        if const_expr(self.nvfp4):
            alpha = self._global_scale(mGx, 0) * self._global_scale(mGw, expert)
            s_enc = nvfp4_encode_scale(mGh[0])
        for it in cutlass.range_constexpr(-(-items // self.threads)):
            item = it * self.threads + etid
            if const_expr(items % self.threads == 0) or item < items:
                row = item // blocks
                j = item % blocks
                g = cute.local_tile(sC, (1, self.vec), (row, j)).load()
                u = cute.local_tile(sC, (1, self.vec), (row, j + blocks)).load()
                if const_expr(self.nvfp4):
                    g = g * alpha
                    u = u * alpha
                if const_expr(self.bias):
                    # padding rows (no routed pair) stay quantized zeros: their bias times 0
                    on = Float32(0.0)
                    if mIds[row0 + row] >= 0:
                        on = Float32(1.0)
                    bg, bu = self._glu_bias(mB, expert, bn, j)
                    g = g + bg.reshape(g.shape) * on
                    u = u + bu.reshape(u.shape) * on
                vals = cute.make_rmem_tensor(cute.make_layout((1, self.vec)), Float32)
                vals.store(glu(g, u, self.activation))
                out, byte = quantize_block(vals, self.act_fmt, s_enc, self.e2m1)
                col = bn * blocks + j  # the block's index along I
                dst = cute.local_tile(self._row(mHq, row0 + row, i_bytes), (qn,), (col,))
                dst.store(out)
                srow = cute.make_tensor(mHs.iterator + cutlass.Int64(row0 + row) * i_scales,
                                        cute.make_layout(i_scales))
                srow[col] = byte.to(Uint8)
        pad_blocks = (self.h_cols - self.intermediate) // self.vec
        if const_expr(pad_blocks > 0):
            # h's columns past I (GEMM2's K padding): quantized zeros, written by the last column tile
            if bn == self.n // self.tile_n - 1:
                pad_items = self.tile_m * pad_blocks
                zeros = cute.make_rmem_tensor(cute.make_layout(qn), Uint8)
                zeros.fill(0)
                for it in cutlass.range_constexpr(-(-pad_items // self.threads)):
                    item = it * self.threads + etid
                    if const_expr(pad_items % self.threads == 0) or item < pad_items:
                        row = item // pad_blocks
                        col = self.intermediate // self.vec + item % pad_blocks
                        dst = cute.local_tile(self._row(mHq, row0 + row, i_bytes), (qn,), (col,))
                        dst.store(zeros.load())
                        srow = cute.make_tensor(mHs.iterator + cutlass.Int64(row0 + row) * i_scales,
                                                cute.make_layout(i_scales))
                        srow[col] = Uint8(0)

    @cute.jit
    def _glu_bias(self, mB, expert, bn, j):
        """(gate, up) biases of output block j of column tile bn as fp32 [vec] fragments: b13's
        row is interleaved as w13's rows (gate/up blocks of ``interleave``), h column c's gate at
        w13 row (c // interleave) * 2 interleave + c % interleave, its up ``interleave`` further."""
        il = self.interleave
        brow = self._row(mB, expert, self.n)
        bg = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
        bu = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
        c0 = bn * (self.tile_n // 2) + j * self.vec  # first h column of the block (a multiple of il)
        for grp in cutlass.range_constexpr(self.vec // il):
            r = (c0 // il + grp) * 2 * il
            g = cute.local_tile(brow, (il,), (r // il,)).load().to(Float32)
            u = cute.local_tile(brow, (il,), (r // il + 1,)).load().to(Float32)
            for q in cutlass.range_constexpr(il):
                bg[grp * il + q] = g[q]
                bu[grp * il + q] = u[q]
        return bg.load(), bu.load()


class BlockScaledDownGemm(_BlockScaledBase):
    """GEMM2 of a block-scaled MoE: ``y[p] = topk_weights.flat[p] * (h[r] . w2_e^T)`` for p = sorted_ids[r].

    ``__call__(hq, hs, w2q, w2s, sorted_ids, tile_expert, topk_weights, y, h_gamax, w2_gamax, b2, stream)``:
      hq [R, I*b/8] and hs [R, I/vec] (GEMM1's output, padded order, R = T * tile_m dynamic);
      w2q [E, H, I*b/8], w2s [E, H, I/vec] uint8; sorted_ids [R], tile_expert [T] int32;
      topk_weights [M, top_k] fp32; y [M*top_k, H] bf16, as GroupedDownGemm writes it.
      nvfp4: h_gamax [1] and w2_gamax [E] fp32 global amaxes; None for mxfp8.
      The routing weight (and for nvfp4 the two global scales) multiply the fp32 sums before the
      bf16 store; padding rows are not stored. Grid (H / tile_n, T). b2 [E, H] bf16 with ``bias``:
      y[p] = w * (h . w2_e^T + b2_e) (None otherwise).
    """

    glu = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 tile_m: int = 16, tile_n: int = 64, tile_k: int = 256, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, precision: str = "mxfp8", bias: bool = False, standin: bool = False):
        ok, reason = self.can_implement(num_experts, hidden, intermediate, top_k, tile_m, tile_n, tile_k, stages,
                                        mma, warps_m, warps_n, precision=precision)
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k = top_k
        self.bias = bool(bias)
        self._bs_init(hidden, intermediate, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, pdl, precision,
                      standin)

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, tile_m=16, tile_n=64, tile_k=256, stages=4,
                      mma="warp", warps_m=None, warps_n=None, arch=None, precision="mxfp8"):
        """(ok, reason) for this problem, these tunables and, if given, the target arch."""
        if precision not in limits.BLOCKSCALED:
            return False, f"precision {precision!r} must be one of {', '.join(limits.BLOCKSCALED)}"
        if num_experts < 1 or top_k < 1 or top_k > num_experts:
            return False, f"need 1 <= top_k={top_k} <= num_experts={num_experts}"
        return limits.check_blockscaled("down", precision, hidden, intermediate, tile_m, tile_n, tile_k, stages,
                                        mma, warps_m, warps_n, arch)

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        m = cute.sym_int32(symbol="M")
        mk = cute.sym_int32(symbol="MK")
        r = cute.sym_int32(symbol="R", divisibility=self.tile_m)
        t = cute.sym_int32(symbol="T")
        e, hd = self.num_experts, self.hidden
        hq, hs = self._fake_values(r, self.k)
        wq, ws = self._fake_weights(e, hd, self.k)  # K-padded rows
        return [("hq", hq), ("hs", hs), ("w2q", wq), ("w2s", ws),
                ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=16)),
                ("tile_expert", make_fake_tensor(Int32, (t,), (1,), assumed_align=16)),
                ("topk_weights", make_fake_tensor(Float32, (m, self.top_k), (self.top_k, 1), assumed_align=16)),
                ("y", make_fake_tensor(BFloat16, (mk, hd), (hd, 1), assumed_align=16)),
                ("h_gamax", self._fake_amax(1)), ("w2_gamax", self._fake_amax(e)),
                ("b2", make_fake_tensor(BFloat16, (e, hd), (hd, 1), assumed_align=16) if self.bias else None),
                ("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, hq: cute.Tensor, hs: cute.Tensor, w2q: cute.Tensor, w2s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, topk_weights: cute.Tensor, y: cute.Tensor,
                 h_gamax: Optional[cute.Tensor], w2_gamax: Optional[cute.Tensor], b2: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel(hq, hs, w2q, w2s, sorted_ids, tile_expert, topk_weights, y, h_gamax, w2_gamax, b2).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mHq: cute.Tensor, mHs: cute.Tensor, mWq: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor,
               mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor, mGh: Optional[cute.Tensor],
               mGw: Optional[cute.Tensor], mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, (mHq, mHs), (mWq, mWs), mIds, mTileExpert, (mIds, mTopkW, mY, mGh, mGw, mB))

    @cute.jit
    def _a_rows(self, tidx, mIds, row0):
        """Rows of h for each A value row and each scale row this thread copies: h is in padded
        order, so every row exists (padding rows are quantized zeros)."""
        tAcA = self._make_g2s_copy().get_slice(tidx).partition_S(
            cute.make_identity_tensor((self.tile_m, self.row_bytes)))
        cpy_m = cute.size(tAcA, mode=[1])
        a_rows = cute.make_rmem_tensor(cute.make_layout(cpy_m), Int32)
        for m in cutlass.range_constexpr(cpy_m):
            a_rows[m] = row0 + tAcA[0, m, 0][0]
        return a_rows, self._scale_rows_of(tidx, mIds, row0, False)

    @cute.jit
    def _epilogue(self, etid, sC, epi, row0, bn, expert):
        """Scaled rows of the tile scattered to y (8 columns per thread and pass); nvfp4: the
        sums times h's and the expert's w2 global dequantization factors first."""
        mIds, mTopkW, mY, mGh, mGw, mB = epi
        alpha = Float32(1.0)
        if const_expr(self.nvfp4):
            alpha = self._global_scale(mGh, 0) * self._global_scale(mGw, expert)
        tpr, rows_per_pass, passes = self._epilogue_thread_layout()
        c8 = etid % tpr
        for it in cutlass.range_constexpr(passes):
            row = it * rows_per_pass + etid // tpr
            if const_expr(self.tile_m % rows_per_pass == 0) or row < self.tile_m:
                p = mIds[row0 + row]
                if p >= 0:
                    scale = mTopkW[p // self.top_k, p % self.top_k]
                    col8 = bn * (self.tile_n // _COPY_ELEMS) + c8
                    if const_expr(self.bias):  # y = w * (h . w2_e^T (* global scales) + b2_e)
                        v = cute.local_tile(sC, (1, _COPY_ELEMS), (row, c8)).load()
                        if const_expr(self.nvfp4):
                            v = v * alpha
                        b = cute.local_tile(self._row(mB, expert, self.n), (_COPY_ELEMS,), (col8,))
                        v = (v + b.load().to(Float32).reshape(v.shape)) * scale
                    else:
                        if const_expr(self.nvfp4):
                            scale = scale * alpha
                        v = cute.local_tile(sC, (1, _COPY_ELEMS), (row, c8)).load() * scale
                    dst = cute.local_tile(self._row(mY, p, self.hidden), (_COPY_ELEMS,),
                                          (bn * (self.tile_n // _COPY_ELEMS) + c8,))
                    dst.store(v.to(BFloat16))

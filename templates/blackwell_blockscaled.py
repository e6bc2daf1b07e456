"""Block-scaled grouped GEMMs ("mxfp8", "nvfp4", "w4a8-mx") for Blackwell (sm_100a) on tcgen05 (mma="umma").

**Compiled only, never run**: no Blackwell GPU was available when this was written. These kernels
compile for sm_100a on a CPU machine (their SASS holds the block-scaled tcgen05 MMA, the scale
factor copies into tensor memory, the TMEM allocation and the TMA loads), but none has been
launched, and their numerics are unchecked.

The same two GEMMs, arguments and results as templates/blockscaled_warp.py (DGX Spark's mma.sync
kernels): GEMM1 gathers the routed token rows of the quantized x, multiplies them by the tile's
expert's interleaved gate/up weights, applies the GLU and quantizes h into the activations'
format; GEMM2 multiplies h by the down weights and writes each routed row times its routing
weight, bf16, to ``y[p]``. The MMA (PTX ``tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale``
for "mxfp8": e4m3 with a ue8m0 scale per 32 along K; ``kind::mxf4nvf4.block_scale.scale_vec::4X``
for "nvfp4": e2m1 with an e4m3 scale per 16; ``kind::mxf8f6f4`` again for "w4a8-mx": e4m3
activations times e2m1 weights, a ue8m0 scale per 32 on both, the operand types in the
instruction descriptor) reads A and B from shared memory and both operands' scale factors from
tensor memory, and accumulates in fp32 in tensor memory. NVFP4's fp32 global scales (1 / S_enc of
x or h and of the expert's weight) multiply the sums in the epilogues.

w4a8-mx (gpt-oss's MXFP4 weights, MXFP8 x and h exactly as "mxfp8" quantizes them): with an 8-bit
operand beside it, kind::mxf8f6f4 reads 4-bit operands from shared memory in the unpacked form,
16 elements per 16 bytes (8 bytes of packed e2m1, then 8 bytes of gap), so the weights' TMA uses
the unpacking data format (the DSL's ``U4_UNPACK_U8``, asked for with ``internal_type`` of a byte
over an e2m1 global tensor; CUTLASS maps its unpacked-smem e2m1 to the driver's
``CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B``, which writes exactly that): it reads the packed e2m1
bytes of w13q / w2q (two per byte, as the host prepares them) into a stage that is, at the 16-byte
granularity of the swizzle and the MMA's descriptors, mxfp8's (a byte stage of tile_k 128, the same
128-byte swizzle and shared memory); the stage's barrier counts the packed bytes that cross
(``gemm_limits.bs_umma_tx_bytes``, as NVIDIA's sm100 block-scaled collective and CuTe DSL example
count such loads). Everything else (x's gather, h's quantizer, the scale atoms) is mxfp8's.

Scale factor layouts (the tcgen05 block-scaled MMA's, PTX ISA "tcgen05 Matrix Descriptors ...
scale factor A/B layout"): per 128 rows and 4 scale columns (K blocks) one 512-byte atom, row
32 r1 + r0 of the atom (r0 < 32) and block j < 4 at byte 16 r0 + 4 r1 + j (``BlockScaledBasicChunk``);
atoms are ordered K-block group fastest, then 128-row group (``blockscaled_layout.tile_atom_to_shape_SF``;
``sf_atom_offset`` below). The row-major [rows, K/vec] scale bytes of ``moe_aot/blockscale.py``
(the sm_121a kernels' layout) are a permutation away: ``blockscale.to_tcgen05_scales`` /
``from_tcgen05_scales``.

  w13s, w2s  the weights' scales in the tcgen05 layout (each expert's N rows are whole 128-row
             groups), prepared on the host (``runtime/blockscaled.prepare_w13(..., target="sm_100a")``)
             and loaded per k-tile by TMA;
  hs         GEMM1 writes h's scales in the tcgen05 layout (R padded rows are whole 128-row tiles),
             so that GEMM2 loads them by TMA: the layout the consumer reads;
  xs         x's scales stay row-major as the ``bsquant`` kernel writes them: GEMM1 gathers token
             rows, and its loader threads copy each row's scale bytes (4 per cp.async: one row's
             4 K blocks of an atom are 4 contiguous bytes) to their place in the shared-memory atom.

Persistent warp-specialized CTAs, as blackwell_gemm.py's bf16 kernels (same tile order, same
warp roles, same hand-over of cp.async stages to the async proxy):

- warp 5 (TMA): the weight k-tiles and their scale factors (GEMM2 also h's values and scales) into
  a ``PipelineTmaUmma`` of ``stages`` buffers, values in the UMMA-canonical K-major 128-byte
  swizzled layout (a k-tile row is 128 bytes: tile_k 128 e4m3, 256 packed e2m1 or, w4a8-mx's
  weights, 128 unpacked e2m1), scales in the atoms;
- warps 6-9 (GEMM1 only): thread t gathers row t of the M tile: its 128 value bytes per k-tile
  (eight 16-byte cp.async) and its scale bytes (one or four 4-byte cp.async), then completes,
  fences (``fence.proxy.async.shared::cta``) and arrives on the stage's full barrier ``lag``
  k-tiles later;
- warp 4 (MMA): per k-tile, ``tcgen05.cp`` (32x128b, 4 warp-broadcast) of the stage's scale
  factors of A and B into tensor memory, then the k-tile's four block-scaled MMAs (tcgen05.cp and
  tcgen05.mma issued by one thread execute in order); ``tcgen05.commit`` releases the stage and
  hands the accumulator to the epilogue;
- warps 0-3 (epilogue): thread t owns TMEM lane t (tile row t) and reads its accumulator with
  ``tcgen05.ld.32x32b``. GEMM1: one chunk of 2 * vec columns is vec gate columns and their up
  partners (``interleave`` divides vec), i.e. one output scale block of h: the GLU, then
  ``blockscale_quant.quantize_block`` (bit-exact with moe_aot/blockscale.py) writes the block's
  value bytes to hq and its scale byte to hs (tcgen05 layout); padding rows as quantized zeros.
  GEMM2: (sums * alpha) * routing weight to ``y[p]``, nothing for padding rows.

TMEM: ``acc_stages`` fp32 accumulators of tile_n columns (two where they fit beside the scale
factors, else one), then the scale factors of A (16 columns) and B (tile_n / 8 columns), one
k-tile's worth, rewritten by every k-tile's tcgen05.cp.

Constraints (``gemm_limits.check_bs_umma``):
  * sm_100a only; precisions mxfp8, nvfp4, w4a8-mx; tile_m 128; tile_n 128 or 256 (whole 128-row
    scale atoms of B); tile_k 128 (mxfp8, w4a8-mx) or 256 (nvfp4): one 128-byte row of the
    activations per k-tile; 3 <= stages <= 8
    within 227 KB (``gemm_limits.bs_umma_smem_bytes``); hidden and intermediate multiples of 128.
  * GEMM1: interleave divides the scale block (16 | vec); no expert biases, no pre-activation output.
  * grid min(tiles, ctas) persistent CTAs of 320 (GEMM1) or 192 (GEMM2) threads.
  * all tensors 16-byte aligned, w4a8-mx's weight values 32 (the unpacking TMA's rule; the runtime
    checks both).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as bs_layout
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Uint8, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from moe_aot import gemm_limits as limits

from .blackwell_gemm import B200_SMS, EPI_N, EPI_WARPS, LOAD_WARP0, MMA_WARP, TMA_WARP
from .blockscale_quant import nvfp4_encode_scale, quantize_block
from .blockscaled_warp import SCALE_DTYPES, VALUE_DTYPES, BlockScaledDownGemm, BlockScaledGluGemm
from .grouped_gemm import glu

LOAD_THREADS = limits.LOAD_THREADS  # GEMM1's gather: one thread per row of the 128-row tile
_PIECE = 16  # value bytes per cp.async
_SF_PIECE = 4  # scale bytes per cp.async: one row's 4 K blocks of a scale atom
_BAR_TMEM_ALLOC, _BAR_EPI = 1, 2


def sf_atom_offset(row_tile, blocks: int, row, blk):
    """Byte offset of row ``row`` (< 128) of 128-row tile ``row_tile`` and K block ``blk`` in the
    tcgen05 scale layout of a matrix with ``blocks`` scale blocks per row: the 512-byte atom of
    (row tile, K block group), then 16 (row % 32) + 4 (row // 32) + blk % 4 inside it. Plain
    arithmetic: the same expression on Python ints (tests) and on the kernel's values."""
    return (row_tile * (blocks // 4) + blk // 4) * 512 + (row % 32) * 16 + (row // 32) * 4 + blk % 4


class _UmmaBlockScaled:
    """The persistent tcgen05 block-scaled loop of both GEMMs (see the module docstring)."""

    def _bsu_init(self, n, k, tile_m, tile_n, tile_k, stages, pdl, precision, ctas):
        self.precision = precision
        self.nvfp4 = precision == "nvfp4"
        self.act_fmt, self.w_fmt = limits.BS_FORMATS[precision]
        self.vec = limits.BLOCKSCALE_BLOCK[self.act_fmt]
        self.bits, self.w_bits = limits.BS_ELEM_BITS[self.act_fmt], limits.BS_ELEM_BITS[self.w_fmt]
        self.val_dtype, self.sf_dtype = VALUE_DTYPES[self.act_fmt], SCALE_DTYPES[self.act_fmt]
        self.w_dtype = VALUE_DTYPES[self.w_fmt]
        # w4a8-mx (e4m3 x e2m1 on kind::mxf8f6f4): the MMA reads the e2m1 weights unpacked, 16
        # per 16 bytes of shared memory, which B's TMA writes from the packed bytes (a 4-bit data
        # format unpacked to the 8-bit stride); B's stages are bytes, laid out as the e4m3 ones
        self.mixed = self.act_fmt != self.w_fmt
        self.w_smem_dtype = Uint8 if self.mixed else self.w_dtype
        self.n, self.k = n, k
        self.k_bytes, self.k_scales = k * self.bits // 8, k // self.vec  # per row in global memory
        self.tile_m, self.tile_n, self.tile_k, self.stages = tile_m, tile_n, tile_k, stages
        self.row_bytes, self.row_scales = limits.bs_row_bytes(precision, tile_k)  # per k-tile row
        self.mma = "umma"
        self.pdl = bool(pdl)
        self.persistent = True
        self.ctas = ctas
        self.standin = False
        self.acc_stages = limits.bs_umma_acc_stages(tile_n)
        self.sfa_cols, self.sfb_cols = limits.bs_umma_sf_columns(tile_m, tile_n)
        self.tmem_cols = limits.bs_umma_tmem_columns(tile_n)
        self.lag = max(1, stages - 2)  # GEMM1's loaders: k-tiles in flight before a hand-over
        self.threads = 32 * (LOAD_WARP0 + (LOAD_THREADS // 32 if self.glu else 0))
        self.epi_n = 2 * self.vec if self.glu else EPI_N

    # ------------------------------------------------------------------ host side
    def _mma_tiler(self):
        return (self.tile_m, self.tile_n, self.tile_k)

    def _make_umma(self):
        """The 1-CTA block-scaled tcgen05 MMA, A and B K-major from shared memory."""
        k_major = cute.nvgpu.OperandMajorMode.K
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.val_dtype, self.w_dtype, k_major, k_major, self.sf_dtype, self.vec, tcgen05.CtaGroup.ONE,
            (self.tile_m, self.tile_n))

    def _layouts(self, tiled_mma):
        """Staged shared-memory layouts (A, B, SFA, SFB)."""
        t = self._mma_tiler()
        return (sm100_utils.make_smem_layout_a(tiled_mma, t, self.val_dtype, self.stages),
                sm100_utils.make_smem_layout_b(tiled_mma, t, self.w_smem_dtype, self.stages),
                bs_layout.make_smem_layout_sfa(tiled_mma, t, self.vec, self.stages),
                bs_layout.make_smem_layout_sfb(tiled_mma, t, self.vec, self.stages))

    def _stage_bytes(self):
        """(A, B, SFA, SFB) bytes of one stage: gemm_limits.bs_umma_stage_bytes."""
        return limits.bs_umma_stage_bytes(self.precision, self.tile_m, self.tile_n)

    @cute.jit
    def _values(self, mQ, rows, cols, dtype: cutlass.Constexpr = None):
        """A [rows, cols] matrix of values (the activations' type, or ``dtype``) over the uint8
        bytes of ``mQ`` (cols elements per row)."""
        dtype = self.val_dtype if const_expr(dtype is None) else dtype
        return cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=dtype),
                                cute.make_layout((rows, cols), stride=(cols, 1)))

    @cute.jit
    def _scales(self, mS, rows, cols):
        """The scale factors of a [rows, cols] matrix in the tcgen05 atom layout, over the uint8
        bytes of ``mS``."""
        layout = bs_layout.tile_atom_to_shape_SF((rows, cols, 1), self.vec)
        return cute.make_tensor(cute.recast_ptr(mS.iterator, dtype=self.sf_dtype), cute.slice_(layout, (None, None, 0)))

    @cute.jit
    def _make_tma(self, mT, operand: cutlass.Constexpr, scales: cutlass.Constexpr):
        """TMA atom of one stage of ``operand`` ("a" or "b"), its values or (``scales``) scale factors."""
        tiled_mma = self._make_umma()
        a_l, b_l, sfa_l, sfb_l = self._layouts(tiled_mma)
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        internal = cutlass.Int16 if const_expr(scales) else None
        if const_expr(operand == "b" and not scales and self.mixed):
            internal = self.w_smem_dtype  # a byte stage over 4-bit data: the unpacking TMA format
        if const_expr(operand == "a"):
            smem = sfa_l if const_expr(scales) else a_l
            return cute.nvgpu.make_tiled_tma_atom_A(op, mT, cute.slice_(smem, (None, None, None, 0)),
                                                    self._mma_tiler(), tiled_mma, internal_type=internal)
        smem = sfb_l if const_expr(scales) else b_l
        return cute.nvgpu.make_tiled_tma_atom_B(op, mT, cute.slice_(smem, (None, None, None, 0)),
                                                self._mma_tiler(), tiled_mma, internal_type=internal)

    @cute.jit
    def _make_tma_w(self, mWq, mWs):
        """TMA atoms of all experts' weights seen as one [E*N, K] matrix (expert e's N tile j is
        row tile e * (N / tile_n) + j), values and scale factors."""
        rows = self.num_experts * self.n
        tma_b, mBt = self._make_tma(self._values(mWq, rows, self.k, self.w_dtype), "b", False)
        tma_sfb, mSFBt = self._make_tma(self._scales(mWs, rows, self.k), "b", True)
        return tma_b, mBt, tma_sfb, mSFBt

    def _fake_weights(self, e, n, k):
        """The weights' values and scales as BlockScaled*Gemm takes them; w4a8-mx's values 32-byte
        aligned: the driver's unpacking TMA type (CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B) wants a
        32-byte aligned global address (its other rules, K and the row pitch multiples of 128
        weights and 32 bytes, a 128-weight box, hold with tile_k 128)."""
        from cutlass.cute.runtime import make_fake_tensor

        wq, ws = super()._fake_weights(e, n, k)
        if self.mixed:
            qc = k * self.w_bits // 8
            wq = make_fake_tensor(Uint8, (e, n, qc), (n * qc, qc, 1), assumed_align=limits.BS_UMMA_UNPACK_ALIGN)
        return wq, ws

    def _launch_kw(self):
        return dict(use_pdl=self.pdl, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ the kernel body
    @cute.jit
    def _umma_tiles(self, tma, mA, mIds, mTileExpert, epi):
        """One persistent CTA: shared memory, pipelines and TMEM, then each warp to its role.
        ``tma``: (tma_a, mAt, tma_sfa, mSFAt, tma_b, mBt, tma_sfb, mSFBt), GEMM1's A entries None;
        ``mA``: GEMM1's (xq, xs), else None."""
        self._grid_dependency_wait()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tiled_mma = self._make_umma()
        a_l, b_l, sfa_l, sfb_l = self._layouts(tiled_mma)
        a_b, b_b, sfa_b, sfb_b = self._stage_bytes()
        st = self.stages

        smem = cutlass.memory.SmemAllocator()
        ab_bars = smem.allocate_array(cutlass.Int64, 2 * st, byte_alignment=8)
        acc_bars = smem.allocate_array(cutlass.Int64, 2 * self.acc_stages, byte_alignment=8)
        tmem_slot = smem.allocate_array(Int32, 1, byte_alignment=4)
        base = smem.allocate(st * (a_b + b_b + sfa_b + sfb_b), byte_alignment=1024)
        sA = cute.make_tensor(cute.recast_ptr(base, a_l.inner, self.val_dtype), a_l.outer)
        sB = cute.make_tensor(cute.recast_ptr(base + st * a_b, b_l.inner, self.w_smem_dtype), b_l.outer)
        sf_base = base + st * (a_b + b_b)
        sSFA = cute.make_tensor(cute.recast_ptr(sf_base, dtype=self.sf_dtype), sfa_l)
        sSFB = cute.make_tensor(cute.recast_ptr(sf_base + st * sfa_b, dtype=self.sf_dtype), sfb_l)
        # GEMM1's cp.async views of the A stages: values as bytes (tile_m, 128, stages) in the
        # canonical K-major 128-byte swizzle (the same bytes as the UMMA view), and the scale
        # atoms as one 4-byte piece per (row, K block group, stage)
        cp_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.row_bytes),
                                                  Uint8, st)
        sA_cp = cute.make_tensor(cute.recast_ptr(base, cp_layout.inner, Uint8), cp_layout.outer)
        groups = self.row_scales // _SF_PIECE
        sSFA_cp = cute.make_tensor(cute.recast_ptr(sf_base, dtype=Uint8), cute.make_layout(
            ((32, self.tile_m // 32), groups, _SF_PIECE, st), stride=((16, 4), 512, 1, sfa_b)))

        tx = limits.bs_umma_tx_bytes(self.precision, self.tile_n) + sfb_b  # the weights' k-tile
        producers = 1
        if const_expr(self.glu):
            producers = 1 + LOAD_THREADS  # the TMA warp's byte count and each loader thread
        else:
            tx = tx + a_b + sfa_b
        cluster = cute.make_layout((1, 1, 1, 1))
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=ab_bars, num_stages=st,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=tx, cta_layout_vmnk=cluster, defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=acc_bars, num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * EPI_WARPS),
            cta_layout_vmnk=cluster, defer_sync=True)
        tmem = cutlass.memory.TmemAllocator(
            tmem_slot, barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=_BAR_TMEM_ALLOC,
                                                                  num_threads=32 * (EPI_WARPS + 1)),
            allocator_warp_id=0)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        acc_shape = tiled_mma.partition_shape_C((self.tile_m, self.tile_n))
        acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))
        num_m_tiles = cute.size(mTileExpert, mode=[0])
        if warp == TMA_WARP:
            self._produce_tma(ab_pipe, tiled_mma, tma, sA, sB, sSFA, sSFB, mTileExpert, num_m_tiles)
        elif warp == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            acc = cute.make_tensor(acc_ptr, acc_fake.layout)
            self._mma(ab_pipe, acc_pipe, tiled_mma, sA, sB, sSFA, sSFB, acc, acc_ptr, mTileExpert, num_m_tiles)
        elif warp < EPI_WARPS:
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            acc = cute.make_tensor(tmem_ptr, acc_fake.layout)
            self._epilogue_tmem(tidx, acc_pipe, acc, epi, mIds, mTileExpert, num_m_tiles)
            # every epilogue thread's TMEM loads are done before warp 0 frees the columns
            pipeline.NamedBarrier(barrier_id=_BAR_EPI, num_threads=32 * EPI_WARPS).arrive_and_wait()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)
        else:
            if const_expr(self.glu):
                self._produce_gather(tidx - 32 * LOAD_WARP0, ab_pipe, mA, mIds, mTileExpert, sA_cp, sSFA_cp,
                                     num_m_tiles)

    @cute.jit
    def _tma_part(self, atom, smem, gmem):
        """(shared, global) TMA partitions of one operand, zero-stride modes of scales dropped."""
        s, g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 3),
                                     cute.group_modes(gmem, 0, 3))
        return cute.filter_zeros(s), cute.filter_zeros(g)

    @cute.jit
    def _produce_tma(self, ab_pipe, tiled_mma, tma, sA, sB, sSFA, sSFB, mTileExpert, num_m_tiles):
        """Warp 5: per tile and k-tile, wait for a free stage, expect its bytes and issue the TMA
        loads of the weight tile and its scale factors (and GEMM2's rows of h and theirs)."""
        tma_a, mAt, tma_sfa, mSFAt, tma_b, mBt, tma_sfb, mSFBt = tma
        k_tiles = self.k // self.tile_k
        n_tiles = self.n // self.tile_n
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        cpasync.prefetch_descriptor(tma_b)
        cpasync.prefetch_descriptor(tma_sfb)
        if const_expr(not self.glu):
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_sfa)
        thr_mma = tiled_mma.get_slice(0)
        tile_nk = (self.tile_n, self.tile_k)
        tile_mk = (self.tile_m, self.tile_k)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for t in range(bid, n_tiles * num_m_tiles, nctas):
            bn, bt = self._tile_of(t, num_m_tiles)
            expert = mTileExpert[bt]
            if expert >= 0:
                wt = expert * n_tiles + bn
                tBsB, tBgB = self._tma_part(tma_b, sB, thr_mma.partition_B(cute.local_tile(mBt, tile_nk, (wt, None))))
                tBsS, tBgS = self._tma_part(tma_sfb, sSFB,
                                            thr_mma.partition_B(cute.local_tile(mSFBt, tile_nk, (wt, None))))
                if const_expr(self.glu):
                    for kt in range(k_tiles):
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar)
                        cute.copy(tma_sfb, tBgS[None, kt], tBsS[None, state.index], tma_bar_ptr=bar)
                        state.advance()
                else:
                    tAsA, tAgA = self._tma_part(tma_a, sA,
                                                thr_mma.partition_A(cute.local_tile(mAt, tile_mk, (bt, None))))
                    tAsS, tAgS = self._tma_part(tma_sfa, sSFA,
                                                thr_mma.partition_A(cute.local_tile(mSFAt, tile_mk, (bt, None))))
                    for kt in range(k_tiles):
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar)
                        cute.copy(tma_sfb, tBgS[None, kt], tBsS[None, state.index], tma_bar_ptr=bar)
                        cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar)
                        cute.copy(tma_sfa, tAgS[None, kt], tAsS[None, state.index], tma_bar_ptr=bar)
                        state.advance()
        ab_pipe.producer_tail(state)

    def _make_g2s_copy(self):
        """16-byte cp.async of a (tile_m, 128-byte) value tile: thread t copies row t."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint8,
                                   num_bits_per_copy=8 * _PIECE)
        return cute.make_tiled_copy_tv(atom, cute.make_layout((LOAD_THREADS, 1)), cute.make_layout((1, _PIECE)))

    @cute.jit
    def _produce_gather(self, ltid, ab_pipe, mA, mIds, mTileExpert, sA_cp, sSFA_cp, num_m_tiles):
        """GEMM1's warps 6-9: thread ``ltid`` gathers row ``ltid`` of each M tile (its token's
        value bytes and scale bytes) by cp.async into the stage the TMA warp fills with B; the
        stage is handed over ``lag`` k-tiles later (blackwell_gemm's ``_produce_gather``)."""
        mXq, mXs = mA
        k_tiles = self.k // self.tile_k
        n_tiles = self.n // self.tile_n
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        tiled_copy = self._make_g2s_copy()
        tAsA = tiled_copy.get_slice(ltid).partition_D(sA_cp)  # (CPY, 1, pieces, PIPE)
        sf_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Uint8, num_bits_per_copy=8 * _SF_PIECE)
        row_sf = sSFA_cp[(ltid % 32, ltid // 32), None, None, None]  # (groups, 4, PIPE)
        groups = self.row_scales // _SF_PIECE
        pieces = self.row_bytes // _PIECE
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        handed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        pending = Int32(0)
        for t in range(bid, n_tiles * num_m_tiles, nctas):
            bn, bt = self._tile_of(t, num_m_tiles)
            if mTileExpert[bt] >= 0:
                token = self._token(mIds, bt * self.tile_m + ltid)
                src_v = cute.tiled_divide(cute.append_ones(self._row(mXq, token, self.k_bytes), up_to_rank=2),
                                          (_PIECE, 1))
                src_s = cute.make_tensor((mXs.iterator + cutlass.Int64(token) * self.k_scales).align(_SF_PIECE),
                                         cute.make_layout((_SF_PIECE, self.k_scales // _SF_PIECE), stride=(1, 4)))
                for kt in range(k_tiles):
                    ab_pipe.sync_object_empty.wait(state.index, state.phase)
                    if token >= 0:  # a padding row is never loaded (its output is written as zeros)
                        for c in cutlass.range_constexpr(pieces):
                            cute.copy(tiled_copy, src_v[None, kt * pieces + c, 0], tAsA[None, 0, c, state.index])
                        for g in cutlass.range_constexpr(groups):
                            cute.copy(sf_atom, src_s[None, kt * groups + g], row_sf[g, None, state.index])
                    cute.arch.cp_async_commit_group()
                    state.advance()
                    pending = pending + 1
                    if pending > self.lag:
                        cute.arch.cp_async_wait_group(self.lag)
                        self._hand_over(ab_pipe, handed)
                        handed.advance()
                        pending = pending - 1
        cute.arch.cp_async_wait_group(0)
        while pending > 0:
            self._hand_over(ab_pipe, handed)
            handed.advance()
            pending = pending - 1

    @cute.jit
    def _hand_over(self, ab_pipe, state):
        """This thread's completed copies into ``state``'s stage, made visible to the async proxy
        (tcgen05.cp and tcgen05.mma read it), then its arrival on the stage's full barrier."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(ab_pipe.producer_get_barrier(state))

    @cute.jit
    def _s2t(self, sSF, tSF):
        """tcgen05.cp of a stage's scale factors (shared memory) into their TMEM columns:
        (tiled copy, shared-memory descriptors per stage, TMEM destination)."""
        tSF_c = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype)
        s2t = tcgen05.make_s2t_copy(atom, tSF_c)
        thr = s2t.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(s2t, thr.partition_S(cute.filter_zeros(sSF)))
        return s2t, src, thr.partition_D(tSF_c)

    @cute.jit
    def _mma(self, ab_pipe, acc_pipe, tiled_mma, sA, sB, sSFA, sSFB, acc, acc_ptr, mTileExpert, num_m_tiles):
        """Warp 4: per tile, wait for a free accumulator; per k-tile wait for its stage, copy its
        scale factors into TMEM, issue its block-scaled MMAs and release the stage with
        tcgen05.commit; commit the accumulator to the epilogue after the tile's last k-tile."""
        k_tiles = self.k // self.tile_k
        n_tiles = self.n // self.tile_n
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        t = self._mma_tiler()
        sfa_ptr = cute.recast_ptr(acc_ptr + self.acc_stages * self.tile_n, dtype=self.sf_dtype)
        sfb_ptr = cute.recast_ptr(acc_ptr + self.acc_stages * self.tile_n + self.sfa_cols, dtype=self.sf_dtype)
        tCtSFA = cute.make_tensor(sfa_ptr, bs_layout.make_tmem_layout_sfa(
            tiled_mma, t, self.vec, cute.slice_(sSFA.layout, (None, None, None, 0))))
        tCtSFB = cute.make_tensor(sfb_ptr, bs_layout.make_tmem_layout_sfb(
            tiled_mma, t, self.vec, cute.slice_(sSFB.layout, (None, None, None, 0))))
        s2t_a, sfa_src, sfa_dst = self._s2t(sSFA, tCtSFA)
        s2t_b, sfb_src, sfb_dst = self._s2t(sSFB, tCtSFB)
        tCrA = tiled_mma.make_fragment_A(sA)  # (MMA, MMA_M, MMA_K, STAGE): shared memory descriptors
        tCrB = tiled_mma.make_fragment_B(sB)
        num_kb = cute.size(tCrA, mode=[2])
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
        for tile in range(bid, n_tiles * num_m_tiles, nctas):
            bn, bt = self._tile_of(tile, num_m_tiles)
            if mTileExpert[bt] >= 0:
                acc_pipe.producer_acquire(acc_state)
                tAcc = acc[None, None, None, acc_state.index]
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kt in range(k_tiles):
                    ab_pipe.consumer_wait(read)
                    cute.copy(s2t_a, sfa_src[None, None, None, None, read.index], sfa_dst)
                    cute.copy(s2t_b, sfb_src[None, None, None, None, read.index], sfb_dst)
                    for kb in cutlass.range_constexpr(num_kb):
                        cute.gemm(tiled_mma, tAcc, [tCrA[None, None, kb, read.index], tCtSFA[None, None, kb]],
                                  [tCrB[None, None, kb, read.index], tCtSFB[None, None, kb]], tAcc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    ab_pipe.consumer_release(read)
                    read.advance()
                acc_pipe.producer_commit(acc_state)
                acc_state.advance()
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def _epilogue_tmem(self, etid, acc_pipe, acc, epi, mIds, mTileExpert, num_m_tiles):
        """Warps 0-3: per tile, wait for its accumulator, load it from TMEM in chunks of epi_n
        columns (one row per thread), write the chunk's outputs (``_epilogue_chunk``), release
        the accumulator."""
        n_tiles = self.n // self.tile_n
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        chunk = (self.tile_m, self.epi_n)
        acc_epi = cute.flat_divide(acc[((None, None), 0, 0, None)], chunk)  # (tile_m, epi_n, 1, chunks, ACC)
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(self.epi_n)), Float32),
            acc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(etid)
        tTR_tAcc = thr_t2r.partition_S(acc_epi)
        tTR_cC = thr_t2r.partition_D(cute.flat_divide(cute.make_identity_tensor((self.tile_m, self.tile_n)), chunk))
        frag = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0, 0)].shape, Float32)
        row = tTR_cC[0][0]  # this thread's tile row (its TMEM lane)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        for t in range(bid, n_tiles * num_m_tiles, nctas):
            bn, bt = self._tile_of(t, num_m_tiles)
            expert = mTileExpert[bt]
            if expert >= 0:
                p = mIds[bt * self.tile_m + row]
                ctx = self._row_context(epi, p, expert)
                acc_pipe.consumer_wait(state)
                for c in cutlass.range_constexpr(self.tile_n // self.epi_n):
                    cute.copy(t2r, tTR_tAcc[(None, None, None, 0, c, state.index)], frag)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: frag holds the chunk
                    self._epilogue_chunk(frag, epi, ctx, p, bt, row, bn, c)
                acc_pipe.consumer_release(state)
                state.advance()


class BlackwellBlockScaledGluGemm(_UmmaBlockScaled, BlockScaledGluGemm):
    """GEMM1 of a block-scaled MoE on tcgen05 (mma="umma"): BlockScaledGluGemm's arguments and
    results, except that hs is written in the tcgen05 scale layout and w13s must be in it."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16,
                 tile_m: int = 128, tile_n: int = 128, tile_k: int = 128, stages: int = 4,
                 mma: str = "umma", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, precision: str = "mxfp8", bias: bool = False, save_preact: bool = False,
                 standin: bool = False, ctas: int = B200_SMS):
        if mma != "umma":
            raise ValueError(f"{type(self).__name__} implements mma 'umma', not {mma!r}")
        ok, reason = self.can_implement(num_experts, hidden, intermediate, top_k, activation, interleave,
                                        tile_m, tile_n, tile_k, stages, mma, precision=precision)
        if ok and (bias or save_preact or standin):
            ok, reason = False, f"{precision} GEMM1 on tcgen05 has no expert biases, pre-activation output or stand-in"
        if ok and limits.BLOCKSCALE_BLOCK[limits.BS_FORMATS[precision][0]] % interleave:
            ok, reason = False, (f"{precision} GEMM1 on tcgen05: interleave {interleave} must divide the scale block "
                                 f"(one TMEM chunk holds one block of h)")
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k, self.activation, self.interleave = top_k, activation, interleave
        self.bias = self.save_preact = False
        self.h_cols = intermediate  # h's rows as GEMM2 reads them: tcgen05 reads K unpadded (multiples of 128)
        self._bsu_init(2 * intermediate, hidden, tile_m, tile_n, tile_k, stages, pdl, precision, ctas)

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, activation="swiglu", interleave=16,
                      tile_m=128, tile_n=128, tile_k=128, stages=4, mma="umma", warps_m=None, warps_n=None,
                      arch=None, precision="mxfp8"):
        return super().can_implement(num_experts, hidden, intermediate, top_k, activation, interleave, tile_m,
                                     tile_n, tile_k, stages, mma, warps_m, warps_n, arch, precision)

    @cute.jit
    def __call__(self, xq: cute.Tensor, xs: cute.Tensor, w13q: cute.Tensor, w13s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, hq: cute.Tensor, hs: cute.Tensor,
                 x_gamax: Optional[cute.Tensor], w13_gamax: Optional[cute.Tensor], h_gamax: Optional[cute.Tensor],
                 b13: Optional[cute.Tensor], stream: cuda.CUstream):
        # b13: always None (no expert biases on tcgen05), in BlockScaledGluGemm's argument list
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_b, mBt, tma_sfb, mSFBt = self._make_tma_w(w13q, w13s)
        self.kernel_umma(tma_b, mBt, tma_sfb, mSFBt, xq, xs, sorted_ids, tile_expert, hq, hs, x_gamax, w13_gamax,
                         h_gamax).launch(grid=grid, block=block, stream=stream, **self._launch_kw())

    @cute.kernel
    def kernel_umma(self, tma_b: cute.CopyAtom, mBt: cute.Tensor, tma_sfb: cute.CopyAtom, mSFBt: cute.Tensor,
                    mXq: cute.Tensor, mXs: cute.Tensor, mIds: cute.Tensor, mTileExpert: cute.Tensor,
                    mHq: cute.Tensor, mHs: cute.Tensor, mGx: Optional[cute.Tensor], mGw: Optional[cute.Tensor],
                    mGh: Optional[cute.Tensor]):
        tma = (None, None, None, None, tma_b, mBt, tma_sfb, mSFBt)
        self._umma_tiles(tma, (mXq, mXs), mIds, mTileExpert, (mHq, mHs, mGx, mGw, mGh))

    @cute.jit
    def _row_context(self, epi, p, expert):
        """(alpha, S_enc) of the tile: nvfp4's global dequantization factor of x and the expert's
        w13 and h's encode scale; (1, 1) for mxfp8."""
        mHq, mHs, mGx, mGw, mGh = epi
        alpha = Float32(1.0)
        s_enc = Float32(1.0)
        if const_expr(self.nvfp4):
            alpha = self._global_scale(mGx, 0) * self._global_scale(mGw, expert)
            s_enc = nvfp4_encode_scale(mGh[0])
        return alpha, s_enc

    @cute.jit
    def _epilogue_chunk(self, frag, epi, ctx, p, bt, row, bn, c):
        """Chunk ``c`` of a row: vec gate columns and their up partners, in blocks of
        ``interleave``: one scale block of h (index bn * tile_n / (2 vec) + c along I), quantized;
        a padding row's block is written as quantized zeros."""
        mHq, mHs, mGx, mGw, mGh = epi
        alpha, s_enc = ctx
        g = self.interleave
        qn = self.vec * self.bits // 8
        blk = bn * (self.tile_n // self.epi_n) + c
        hrow = bt * self.tile_m + row
        out = cute.make_rmem_tensor(cute.make_layout(qn), Uint8)
        out.fill(0)
        byte = Int32(0)
        if p >= 0:
            gate = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
            up = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
            for b in cutlass.range_constexpr(self.vec // g):
                for i in cutlass.range_constexpr(g):
                    gate[b * g + i] = frag[2 * b * g + i]
                    up[b * g + i] = frag[2 * b * g + g + i]
            gv, uv = gate.load(), up.load()
            if const_expr(self.nvfp4):
                gv = gv * alpha
                uv = uv * alpha
            vals = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
            vals.store(glu(gv, uv, self.activation))
            q, byte = quantize_block(vals, self.act_fmt, s_enc, "hw")
            out.store(q)
        i_bytes = self.intermediate * self.bits // 8
        cute.local_tile(self._row(mHq, hrow, i_bytes), (qn,), (blk,)).store(out.load())
        # h's scales in the tcgen05 atom layout GEMM2's TMA reads
        off = sf_atom_offset(cutlass.Int64(bt), self.intermediate // self.vec, row, blk)
        dst = cute.make_tensor(mHs.iterator + off, cute.make_layout(1))
        dst[0] = byte.to(Uint8)


class BlackwellBlockScaledDownGemm(_UmmaBlockScaled, BlockScaledDownGemm):
    """GEMM2 of a block-scaled MoE on tcgen05 (mma="umma"): BlockScaledDownGemm's arguments and
    results, except that hs and w2s must be in the tcgen05 scale layout."""

    interleave = 0

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 tile_m: int = 128, tile_n: int = 128, tile_k: int = 128, stages: int = 4,
                 mma: str = "umma", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, precision: str = "mxfp8", bias: bool = False, standin: bool = False,
                 ctas: int = B200_SMS):
        if mma != "umma":
            raise ValueError(f"{type(self).__name__} implements mma 'umma', not {mma!r}")
        ok, reason = self.can_implement(num_experts, hidden, intermediate, top_k, tile_m, tile_n, tile_k, stages,
                                        mma, precision=precision)
        if ok and (bias or standin):
            ok, reason = False, f"{precision} GEMM2 on tcgen05 has no expert biases and no stand-in"
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k = top_k
        self.bias = False
        self._bsu_init(hidden, intermediate, tile_m, tile_n, tile_k, stages, pdl, precision, ctas)

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, tile_m=128, tile_n=128, tile_k=128, stages=4,
                      mma="umma", warps_m=None, warps_n=None, arch=None, precision="mxfp8"):
        return super().can_implement(num_experts, hidden, intermediate, top_k, tile_m, tile_n, tile_k, stages, mma,
                                     warps_m, warps_n, arch, precision)

    @cute.jit
    def __call__(self, hq: cute.Tensor, hs: cute.Tensor, w2q: cute.Tensor, w2s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, topk_weights: cute.Tensor, y: cute.Tensor,
                 h_gamax: Optional[cute.Tensor], w2_gamax: Optional[cute.Tensor], b2: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        # b2: always None (no expert biases on tcgen05), in BlockScaledDownGemm's argument list
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        rows = cute.size(hq, mode=[0])
        tma_a, mAt = self._make_tma(self._values(hq, rows, self.k), "a", False)
        tma_sfa, mSFAt = self._make_tma(self._scales(hs, rows, self.k), "a", True)
        tma_b, mBt, tma_sfb, mSFBt = self._make_tma_w(w2q, w2s)
        self.kernel_umma(tma_a, mAt, tma_sfa, mSFAt, tma_b, mBt, tma_sfb, mSFBt, sorted_ids, tile_expert,
                         topk_weights, y, h_gamax, w2_gamax).launch(grid=grid, block=block, stream=stream,
                                                                    **self._launch_kw())

    @cute.kernel
    def kernel_umma(self, tma_a: cute.CopyAtom, mAt: cute.Tensor, tma_sfa: cute.CopyAtom, mSFAt: cute.Tensor,
                    tma_b: cute.CopyAtom, mBt: cute.Tensor, tma_sfb: cute.CopyAtom, mSFBt: cute.Tensor,
                    mIds: cute.Tensor, mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor,
                    mGh: Optional[cute.Tensor], mGw: Optional[cute.Tensor]):
        tma = (tma_a, mAt, tma_sfa, mSFAt, tma_b, mBt, tma_sfb, mSFBt)
        self._umma_tiles(tma, None, mIds, mTileExpert, (mIds, mTopkW, mY, mGh, mGw))

    @cute.jit
    def _row_context(self, epi, p, expert):
        """The row's factor: its routing weight (times nvfp4's global dequantization factors of h
        and the expert's w2); 0 for a padding row."""
        mIds, mTopkW, mY, mGh, mGw = epi
        scale = Float32(0.0)
        if p >= 0:
            scale = mTopkW[p // self.top_k, p % self.top_k]
            if const_expr(self.nvfp4):
                scale = scale * (self._global_scale(mGh, 0) * self._global_scale(mGw, expert))
        return scale

    @cute.jit
    def _epilogue_chunk(self, frag, epi, ctx, p, bt, row, bn, c):
        """Chunk ``c`` of a row: sums * factor to y[p], nothing for a padding row."""
        if p >= 0:
            col = bn * self.tile_n + c * EPI_N
            dst = cute.local_tile(self._row(epi[2], p, self.hidden), (EPI_N,), (col // EPI_N,))
            dst.store((frag.load() * ctx).to(BFloat16).reshape((EPI_N,)))

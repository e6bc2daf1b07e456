"""Grouped GEMMs of a fused MoE layer: gathered-A GEMM1 with a GLU epilogue, scaled GEMM2.

Two kernels share one mainloop and one fp32 staging of the accumulator tile, and differ in how
they address A and in their epilogues:

- ``GroupedGluGemm``  (GEMM1): gathered token rows of ``x`` times the interleaved gate/up
  weights of the tile's expert, GLU activation fused, ``h`` written in padded order.
- ``GroupedDownGemm`` (GEMM2): rows of ``h`` times the down weights of the tile's expert,
  scaled by the routing weight, scattered to ``y[p]`` (one row per routed pair).

Both read the routing layout built by the router: ``sorted_ids[r]`` is the routed-pair index
``p = token * top_k + k`` of padded row ``r`` (or -1) and ``tile_expert[t]`` is the expert of
M-tile ``t`` (or -1: the CTA exits).

The mainloop here is mma="warp" (cp.async multi-stage pipeline, ldmatrix, mma.sync m16n8k16),
which compiles unchanged for sm_80, sm_90a and sm_121a (DGX Spark has no wgmma). A is loaded with
per-row cp.async, which is what makes the token gather free: each thread keeps the source row of
each A row it copies in a register for the whole K loop.
The persistent warp-specialized wgmma family "hopws" / "hoppp" lives in hopper_gemm.py and shares
this module's checks, tile order, A-row gather, wgmma shared-memory layouts, TMA atom for B and
register epilogue. (The hand-rolled warp-specialized mainloops "wgmmatma" and "wgmmap", and the
one-CTA-per-tile wgmma mainloop "wgmma", were removed once hopws beat them: "wgmma" was never
picked in 226 tuned H200 picks; their numbers are in tools/results/NOTES.md.)
"""

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, const_expr
from cutlass.tensor_utils import LayoutEnum

from moe_aot import gemm_limits as limits
from moe_aot.layout import interleave_gate_up  # noqa: F401  (the w13 layout the GLU kernels read)

_MMA_SHAPE = (16, 8, 16)
_MMA_SHAPE_FP8 = (16, 8, 32)
RASTER_GROUP = 8  # M tiles walked per N tile by consecutive CTAs (L2 reuse of weight tiles)
# the MMA families and what each can be built with: moe_aot/gemm_limits.py (DSL-free, shared
# with variants.py); "hopws"/"hoppp" (persistent, warp-specialized) live in hopper_gemm.py
_COPY_ELEMS = limits.COPY_ELEMS
_LOAD_THREADS = limits.LOAD_THREADS  # the producer warpgroup of hopws / hoppp
MMAS, _WGMMA, _PINGPONG = limits.MMAS, limits.WGMMA, limits.PINGPONG
_WARP_SPECIALIZED, _PERSISTENT = limits.WARP_SPECIALIZED, limits.PERSISTENT
PERSISTENT_CTAS = 132  # hopws's default grid: one CTA per SM of an H100 SXM / H200
# hopws with two consumer warpgroups (384 threads, 168 registers each at entry): the producer
# gives registers back to the consumers' 128 fp32 accumulators (40*128 + 232*256 <= 64K)
_REGS_LOAD, _REGS_MMA = 40, 232
# operand element type of each precision (gemm_limits.ELEM_BYTES has their sizes)
AB_DTYPES = {"bf16": BFloat16, "fp8": Float8E4M3FN, "fp8-block128": Float8E4M3FN,
             "mxfp4-w": BFloat16}  # mxfp4-w: the dequantized weights (grouped_w4.py)


@cute.jit
def glu_act(g, activation: cutlass.Constexpr, approx: cutlass.Constexpr = False):
    """The gate's activation: "swiglu" SiLU(g), "geglu" GELU(g) with the tanh approximation.
    approx (a GEMM1's ``fast_act``): the sigmoid's reciprocal as rcp.approx.ftz (one MUFU.RCP,
    <= 1 ulp) instead of cute.math.rcp with fastmath, which emits rcp.rn.f32 per element (in SASS
    MUFU.RCP, Newton FFMAs and a branch to a slow path) in an epilogue that nothing overlaps in
    cooperative tiles (NOTES 2026-12-06). 1 + exp(-g) is >= 1 or +inf (rcp 0: SiLU 0)."""
    if const_expr(activation == "swiglu"):
        if const_expr(approx):
            return g * cute.math.rcp(1.0 + cute.math.exp(-g, fastmath=True), approx=True, ftz=True)
        return g * cute.math.rcp(1.0 + cute.math.exp(-g, fastmath=True), fastmath=True)
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + cute.math.tanh(inner, fastmath=True))


@cute.jit
def glu(g, u, activation: cutlass.Constexpr, approx: cutlass.Constexpr = False):
    """h from fp32 gate and up values: act(g) * u, or for "swigluoai" (gpt-oss) the clamped form
    (min(u, L) clamped to [-L, L] + 1) * gc * sigmoid(ALPHA * gc) with gc = min(g, L)
    (gemm_limits.SWIGLUOAI_ALPHA / SWIGLUOAI_LIMIT); approx as glu_act's."""
    if const_expr(activation == "swigluoai"):
        lim = limits.SWIGLUOAI_LIMIT
        gc = cute.where(g > lim, lim, g)
        uc = cute.where(u > lim, lim, cute.where(u < -lim, -lim, u))
        e = 1.0 + cute.math.exp(-limits.SWIGLUOAI_ALPHA * gc, fastmath=True)
        if const_expr(approx):
            sig = cute.math.rcp(e, approx=True, ftz=True)
        else:
            sig = cute.math.rcp(e, fastmath=True)
        return (uc + 1.0) * (gc * sig)
    else:
        return glu_act(g, activation, approx) * u


def glu_gate_block(hb: int, interleave: int) -> int:
    """The n8 block of a GLU tile row holding the gate columns of its 8-column h block ``hb``
    (tile columns interleaved gate, up, gate, ... in blocks of ``interleave``; the up partner
    is interleave / 8 n8 blocks further)."""
    nb = interleave // 8
    return (hb // nb) * 2 * nb + hb % nb


class _GroupedGemmBase:
    """Shared mainloops and staging of the two grouped GEMMs (see the subclasses)."""

    glu = False
    # B (the weights) in N-major order: expert e's [K, N] row-major matrix, read as the MMA's B
    # (the backward's dH = dO W2_e and dX = da W13_e; hopws / hoppp only: templates/hopper_bwd.py)
    b_mn = False

    def __init__(self, n: int, k: int, tile_m: int, tile_n: int, tile_k: int,
                 stages: int, mma: str, warps_m, warps_n, pdl: bool = False,
                 ctas: int = PERSISTENT_CTAS, precision: str = "bf16"):
        if mma in _WARP_SPECIALIZED and not getattr(self, "warp_specialized", False):
            raise ValueError(f"mma={mma!r} is built by templates/hopper_gemm.py "
                             f"(HopperGluGemm / HopperDownGemm), not {type(self).__name__}")
        warps_m, warps_n = self.default_warps(tile_m, tile_n, warps_m, warps_n, mma)
        ok, reason = self._check_tiles(n, k, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n,
                                       precision)
        if not ok:
            raise ValueError(reason)
        self.precision = precision
        self.fp8 = precision in limits.FP8
        self.ab_dtype = AB_DTYPES[precision]
        self.elem_bytes = limits.ELEM_BYTES[precision]
        self.copy_elems = 16 // self.elem_bytes  # elements in one 16-byte cp.async
        self.n, self.k = n, k
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.stages, self.mma = stages, mma
        self.warps_m, self.warps_n = warps_m, warps_n
        self.mma_threads = warps_m * warps_n * 32  # threads holding accumulators (epilogue too)
        tma = mma in _WARP_SPECIALIZED
        self.persistent = mma in _PERSISTENT
        self.ctas = ctas  # hopws: the grid, at most one CTA per SM (each needs most of one)
        self.load_threads = _LOAD_THREADS if tma else self.mma_threads  # threads issuing cp.async of A
        self.threads = self.mma_threads + (_LOAD_THREADS if tma else 0)
        self.out_cols = tile_n // 2 if self.glu else tile_n
        # 64-row blocks of accumulators per warpgroup: 2 for a ping-pong warpgroup owning 128 rows
        self.acc_m_blocks = tile_m // 64 if mma in _PINGPONG else 1
        self.acc_rows = 2 * self.acc_m_blocks  # tile rows per accumulator-holding thread
        # fp32 staging rows padded by 8 floats: the MMA's accumulator stores then hit
        # distinct banks in each half-warp phase.
        self.c_row_stride = tile_n + 8
        # pdl: launched as a programmatic dependent of the previous kernel (see
        # _grid_dependency_wait). GEMM2 then fetches its first weight k-tiles, which do not depend
        # on GEMM1, before it waits for GEMM1's grid; GEMM1 waits first thing (its tile -> expert
        # map comes from the routing kernel).
        self.pdl = bool(pdl)
        self.early_b = self.pdl and not self.glu and mma not in _WARP_SPECIALIZED

    # ------------------------------------------------------------------ checks
    # the rules are moe_aot/gemm_limits.py's, one copy shared with the tuner's variants.py
    default_warps = staticmethod(limits.default_warps)
    _check_tiles = staticmethod(limits.check_tiles)
    smem_bytes = staticmethod(limits.smem_bytes)

    @classmethod
    def _check_all(cls, n, k, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, arch,
                   precision="bf16"):
        return limits.check_gemm(n, k, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, arch,
                                 precision=precision)

    # ------------------------------------------------------------------ host side
    def _smem_layout_ab(self, rows):
        # K-major tile in 8-row atoms, byte-address swizzle so that ldmatrix of 8 rows and
        # the 16-byte cp.async writes are bank-conflict free.
        atom_k = min(self.tile_k, 128 // self.elem_bytes)  # at most 128-byte rows per swizzle atom
        swizzle_bits = min(int(math.log2(atom_k * self.elem_bytes * 8 // 128)), 3)
        swizzle = cute.make_swizzle(swizzle_bits, 4, 3)
        atom = cute.make_layout((8, atom_k), stride=(atom_k, 1))
        layout = cute.tile_to_shape(atom, (rows, self.tile_k, self.stages), (0, 1, 2))
        return layout, swizzle

    def _b_layout(self) -> LayoutEnum:
        """B's order in memory and shared memory: K-major rows, or N-major with ``b_mn``."""
        return LayoutEnum.COL_MAJOR if self.b_mn else LayoutEnum.ROW_MAJOR

    def _make_tiled_mma(self, tile_n: Optional[int] = None):
        """The tile's MMA; wgmma cores: ``tile_n`` columns wide where given (hopper_fp8's column
        parts), else the tile's."""
        if const_expr(self.mma in _WGMMA):
            k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
            return sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, k_major, self._b_layout().sm90_mma_major_mode(), Float32,
                (self.tile_m // 64 // self.acc_m_blocks, 1, 1), tiler_mn=(64, tile_n or self.tile_n))
        if const_expr(self.fp8):  # e4m3 mma.sync (sm_89+): k32, the fragments of bf16's k16 in bytes
            op = cute.nvgpu.warp.MmaFP8Op(self.ab_dtype, Float32, _MMA_SHAPE_FP8)
        else:
            op = cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, _MMA_SHAPE)
        return cute.make_tiled_mma(
            op,
            cute.make_layout((self.warps_m, self.warps_n, 1)),
            # N permuted to 16 per warp so that one ldmatrix.x4 feeds two n8 atoms
            permutation_mnk=(self.warps_m * 16, self.warps_n * 16, op.shape_mnk[2]),
        )

    def _make_g2s_copy(self):
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            self.ab_dtype, num_bits_per_copy=128)
        tpr = self.tile_k // self.copy_elems
        thr = cute.make_layout((self.load_threads // tpr, tpr), stride=(tpr, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, self.copy_elems)))

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _smem_tensors(self):
        """A and B pipeline stages, and the fp32 staging tile over the same bytes."""
        smem = cutlass.memory.SmemAllocator()
        a_bytes = self.stages * self.tile_m * self.tile_k * self.elem_bytes
        b_bytes = self.stages * self.tile_n * self.tile_k * self.elem_bytes
        c_bytes = 0 if self.persistent else self.tile_m * self.c_row_stride * 4
        base = smem.allocate(max(a_bytes + b_bytes, c_bytes), byte_alignment=1024)
        if const_expr(self.mma in _WGMMA):
            # the canonical wgmma K-major 128-byte-swizzled layouts, swizzle moved to the pointer
            tile = (self.tile_m, self.tile_n, self.tile_k)
            dt = self.ab_dtype
            sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dt, self.stages)
            sB_layout = sm90_utils.make_smem_layout_b(self._b_layout(), tile, dt, self.stages)
            sA = cute.make_tensor(cute.recast_ptr(base, sA_layout.inner, dt), sA_layout.outer)
            sB = cute.make_tensor(cute.recast_ptr(base + a_bytes, sB_layout.inner, dt),
                                  sB_layout.outer)
        else:
            sA_layout, swizzle = self._smem_layout_ab(self.tile_m)
            sB_layout, _ = self._smem_layout_ab(self.tile_n)
            sA = cute.make_tensor(cute.recast_ptr(base, swizzle, self.ab_dtype), sA_layout)
            sB = cute.make_tensor(cute.recast_ptr(base + a_bytes, swizzle, self.ab_dtype), sB_layout)
        sC_ptr = cute.recast_ptr(base, dtype=Float32)
        return sA, sB, sC_ptr

    @cute.jit
    def _load_tile(self, kt, stage, tiled_copy, mA, a_rows, tAsA, tAcA, tBgB, tBsB):
        """Issue the cp.async copies of k-tile ``kt`` into pipeline stage ``stage``."""
        self._load_a(kt, stage, tiled_copy, mA, a_rows, tAsA, tAcA)
        cute.copy(tiled_copy, tBgB[None, None, None, kt], tBsB[None, None, None, stage])

    @cute.jit
    def _prologue(self, n: int, tiled_copy, mA, a_rows, tAsA, tAcA, tBgB, tBsB):
        """Issue k-tiles 0..n-1 into stages 0..n-1, one cp.async group each. With ``early_b``
        the weight copies of all n go first, then the wait for the previous grid, then A."""
        if const_expr(self.early_b):
            for s in cutlass.range_constexpr(n):
                cute.copy(tiled_copy, tBgB[None, None, None, s], tBsB[None, None, None, s])
            self._grid_dependency_wait()
            for s in cutlass.range_constexpr(n):
                self._load_a(s, s, tiled_copy, mA, a_rows, tAsA, tAcA)
                cute.arch.cp_async_commit_group()
        else:
            for s in cutlass.range_constexpr(n):
                self._load_tile(s, s, tiled_copy, mA, a_rows, tAsA, tAcA, tBgB, tBsB)
                cute.arch.cp_async_commit_group()

    @cute.jit
    def _grid_dependency_wait(self):
        """Programmatic dependent launch: block until the previous kernel in the stream has
        finished and its writes are visible, then let the next kernel's CTAs launch (they run
        their own prologue and wait in turn, so launch gaps and grid tails overlap). Every
        read of another kernel's output and every global write comes after it."""
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _mainloop(self, tidx, mA, a_rows, sA, mBe, bn, sB, tiled_mma, acc, pstate=None):
        """acc += A[a_rows] @ B_e[bn-tile]^T over all of K.

        ``a_rows`` holds, per A row this thread copies, the source row of ``mA`` (or -1:
        the shared-memory row is zero-filled once and never loaded). ``pstate``: None, or the
        state of a subclass that scales partial sums per K block (``_promote_state``; mma.sync
        only)."""
        self._mainloop_warp(tidx, mA, a_rows, sA, mBe, bn, sB, tiled_mma, acc, pstate)

    @cute.jit
    def _g2s_partitions(self, tidx, sA, mBe, bn, sB, a_rows):
        """cp.async partitions of this thread; padding A rows zero-filled in every stage."""
        tiled_copy = self._make_g2s_copy()
        thr_copy = tiled_copy.get_slice(tidx)
        tAsA = thr_copy.partition_D(sA)  # (CPY, CPY_M, CPY_K, PIPE)
        tBsB = thr_copy.partition_D(sB)
        gB = cute.local_tile(mBe, (self.tile_n, self.tile_k), (bn, None))
        tBgB = thr_copy.partition_S(gB)  # (CPY, CPY_N, CPY_K, k_tiles)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        for m in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            if a_rows[m] < 0:
                for s in cutlass.range_constexpr(self.stages):
                    tAsA[None, m, None, s].fill(0)
        return tiled_copy, tAsA, tAcA, tBgB, tBsB

    @cute.jit
    def _mainloop_warp(self, tidx, mA, a_rows, sA, mBe, bn, sB, tiled_mma, acc, pstate=None):
        """Ampere-style: cp.async stages-1 k-tiles ahead, ldmatrix one k-block ahead. With
        ``pstate`` each MMA k-block goes through ``_gemm_promote`` instead of into acc."""
        tiled_copy, tAsA, tAcA, tBgB, tBsB = self._g2s_partitions(tidx, sA, mBe, bn, sB, a_rows)
        k_tiles = self.k // self.tile_k
        stages = self.stages
        self._prologue(stages - 1, tiled_copy, mA, a_rows, tAsA, tAcA, tBgB, tBsB)

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB)[None, None, None, 0])
        ldm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.ab_dtype)
        s2r_A = cute.make_tiled_copy_A(ldm, tiled_mma)
        s2r_B = cute.make_tiled_copy_B(ldm, tiled_mma)
        thr_s2r_A = s2r_A.get_slice(tidx)
        thr_s2r_B = s2r_B.get_slice(tidx)
        tXsA = thr_s2r_A.partition_S(sA)
        tXrA = thr_s2r_A.retile(tCrA)
        tXsB = thr_s2r_B.partition_S(sB)
        tXrB = thr_s2r_B.retile(tCrB)
        num_kb = cute.size(tCrA, mode=[2])

        cute.arch.cp_async_wait_group(stages - 2)
        cute.arch.sync_threads()
        cute.copy(s2r_A, tXsA[None, None, 0, 0], tXrA[None, None, 0])
        cute.copy(s2r_B, tXsB[None, None, 0, 0], tXrB[None, None, 0])
        if const_expr(pstate is not None):
            self._promote_begin(pstate)

        read_stage = Int32(0)  # stage the register pipeline reads from
        next_stage = Int32(0)  # stage of the next k-tile to be read
        write_stage = Int32(stages - 1)
        for kt in range(k_tiles):
            for kb in cutlass.range_constexpr(num_kb):
                if const_expr(kb == num_kb - 1):
                    read_stage = next_stage
                    cute.arch.cp_async_wait_group(stages - 2)
                    cute.arch.sync_threads()
                kb_next = (kb + 1) % num_kb
                cute.copy(s2r_A, tXsA[None, None, kb_next, read_stage], tXrA[None, None, kb_next])
                cute.copy(s2r_B, tXsB[None, None, kb_next, read_stage], tXrB[None, None, kb_next])
                if const_expr(kb == 0):
                    if kt + (stages - 1) < k_tiles:
                        self._load_tile(kt + (stages - 1), write_stage, tiled_copy, mA, a_rows, tAsA,
                                        tAcA, tBgB, tBsB)
                    cute.arch.cp_async_commit_group()
                    write_stage = next_stage
                    next_stage = next_stage + 1
                    if next_stage == stages:
                        next_stage = Int32(0)
                if const_expr(pstate is None):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
                else:
                    self._gemm_promote(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], kt, kb,
                                       pstate)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

    # ------------------------------------------------------------------ shared with hopws (hopper_gemm.py)
    @cute.jit
    def _make_tma_b(self, mW):
        """TMA atom over all experts' weights seen as one [E*N, K] matrix: expert e's N-tile j
        is row tile e*(N/tile_n)+j. With ``b_mn`` the weights are [E, K, N] row-major, seen as
        (N, K, E) with N contiguous (``_b_tiles`` indexes both). The host launcher encodes the
        descriptor."""
        if const_expr(self.b_mn):
            flat = cute.make_tensor(mW.iterator, cute.make_layout(
                (self.n, self.k, self.num_experts), stride=(1, self.n, self.n * self.k)))
        else:
            flat = cute.make_tensor(mW.iterator, cute.make_layout(
                (self.num_experts * self.n, self.k), stride=(self.k, 1)))
        return self._tma_atom(flat, "b")

    @cute.jit
    def _tma_atom(self, mT, operand: cutlass.Constexpr, multicast: cutlass.Constexpr = 1):
        """TMA atom loading (tile_m or tile_n, tile_k) boxes of the row-major [rows, K] matrix
        ``mT`` into one stage of the canonical wgmma layout of ``operand`` ("a" or "b");
        ``multicast`` > 1: each of that many CTAs of a cluster loads a slice of the box into all."""
        tile = (self.tile_m, self.tile_n, self.tile_k)
        if const_expr(operand == "a"):
            layout, rows = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, self.ab_dtype,
                                                         self.stages), self.tile_m
        else:
            layout, rows = sm90_utils.make_smem_layout_b(self._b_layout(), tile, self.ab_dtype,
                                                         self.stages), self.tile_n
        if const_expr(multicast > 1):
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), mT,
                cute.slice_(layout, (None, None, 0)), (rows, self.tile_k), num_multicast=multicast)
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mT,
            cute.slice_(layout, (None, None, 0)), (rows, self.tile_k))

    @cute.jit
    def _set_regs(self, producer: bool):
        if const_expr(self.threads == 384):
            if const_expr(producer):
                cute.arch.setmaxregister_decrease(_REGS_LOAD)
            else:
                cute.arch.setmaxregister_increase(_REGS_MMA)

    @cute.jit
    def _load_a(self, kt, stage, tiled_copy, mA, a_rows, tAsA, tAcA):
        """cp.async of the gathered A rows of k-tile ``kt`` (padding rows stay zero)."""
        for m in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            row = a_rows[m]
            if row >= 0:
                src_row = cute.tiled_divide(
                    cute.append_ones(self._row(mA, row, self.k), up_to_rank=2), (self.copy_elems, 1))
                for kk in cutlass.range_constexpr(cute.size(tAsA, mode=[2])):
                    chunk = kt * (self.tile_k // self.copy_elems) + tAcA[0, 0, kk][1] // self.copy_elems
                    cute.copy(tiled_copy, src_row[None, chunk, 0], tAsA[None, m, kk, stage])

    @cute.jit
    def _row(self, mT, row, ncols: int):
        """Row ``row`` of a row-major [rows, ncols] tensor, addressed in 64 bits: plain
        indexing forms row * ncols in 32 bits, which wraps beyond 2**32 elements."""
        base = (mT.iterator + cutlass.Int64(row) * ncols).align(16)  # ncols % 8 == 0
        return cute.make_tensor(base, cute.make_layout(ncols))

    @cute.jit
    def _expert_weights(self, mW, expert):
        """[N, K] weights of one expert. The expert offset is formed in 64 bits: E*N*K can
        exceed 2**32 elements (DeepSeek-V3's w13 has 7.5e9), where plain slicing wraps."""
        offset = cutlass.Int64(expert) * (self.n * self.k)
        base = (mW.iterator + offset).align(16)  # N*K is a multiple of 8 elements
        return cute.make_tensor(base, cute.select(mW.layout, mode=[1, 2]))

    @cute.jit
    def _bias_row(self, mB, expert):
        """Row ``expert`` of a [E, N] bf16 bias (expert biases: GEMM1's b13, GEMM2's b2)."""
        return self._row(mB, expert, self.n)

    @cute.jit
    def _bias_at(self, brow, col, width: cutlass.Constexpr):
        """``width`` consecutive bias values from column ``col`` (a multiple of ``width``), in fp32."""
        return cute.local_tile(brow, (width,), (col // width,)).load().to(Float32)

    @cute.jit
    def _stage_acc(self, tidx, tiled_mma, acc, sC_ptr):
        """Write the fp32 accumulator tile to shared memory; for the GLU kernel the columns
        are de-interleaved on the way (gate -> [0, tile_n/2), up -> [tile_n/2, tile_n))."""
        if const_expr(self.glu):
            g = self.interleave
            col = cute.make_layout((g, 2, self.tile_n // (2 * g)), stride=(1, self.tile_n // 2, g))
            layout = cute.make_layout((self.tile_m, col.shape), stride=(self.c_row_stride, col.stride))
        else:
            layout = cute.make_layout((self.tile_m, self.tile_n), stride=(self.c_row_stride, 1))
        sC = cute.make_tensor(sC_ptr, layout)
        tCsC = tiled_mma.get_slice(tidx).partition_C(sC)
        cute.autovec_copy(acc, tCsC)
        cute.arch.sync_threads()  # every thread holds accumulators here
        return cute.make_tensor(
            sC_ptr, cute.make_layout((self.tile_m, self.tile_n), stride=(self.c_row_stride, 1)))

    def _epilogue_thread_layout(self):
        tpr = self.out_cols // _COPY_ELEMS
        rows_per_pass = self.mma_threads // tpr
        return tpr, rows_per_pass, (self.tile_m + rows_per_pass - 1) // rows_per_pass

    @cute.jit
    def _tile_coords(self, num_m_tiles):
        """(N tile, M tile) of this CTA. Consecutive CTAs walk RASTER_GROUP M tiles of one N
        tile before the next N tile, so the CTAs resident together share weight tiles in L2
        (a plain N-fastest order streams every expert's whole weight matrix per M tile)."""
        bx, by, _ = cute.arch.block_idx()
        return self._tile_of(by * (self.n // self.tile_n) + bx, num_m_tiles)

    @cute.jit
    def _tile_of(self, linear, num_m_tiles):
        """(N tile, M tile) of the linear tile index, in the raster order of _tile_coords."""
        n_tiles = self.n // self.tile_n
        group = linear // (RASTER_GROUP * n_tiles)
        first_m = group * RASTER_GROUP
        size = num_m_tiles - first_m
        if size > RASTER_GROUP:
            size = Int32(RASTER_GROUP)
        idx = linear - first_m * n_tiles
        return idx // size, first_m + idx % size

    @cute.jit
    def _tile(self, tidx, mA, mW, mIds, mTileExpert, epi):
        """One CTA: gather the tile's A rows, multiply by its expert's weights (mma.sync),
        stage the accumulator and run the subclass epilogue with the tensors `epi`."""
        if const_expr(not self.early_b):
            self._grid_dependency_wait()
        bn, bt = self._tile_coords(cute.size(mTileExpert, mode=[0]))
        expert = mTileExpert[bt]
        if expert >= 0:
            tiled_mma = self._make_tiled_mma()
            sA, sB, sC_ptr = self._smem_tensors()
            row0 = bt * self.tile_m
            a_rows = self._a_rows(tidx, mIds, row0)
            acc = tiled_mma.make_fragment_C(tiled_mma.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.tile_m, self.tile_n))).shape)
            acc.fill(0.0)
            pstate = self._promote_state(tidx, tiled_mma, mIds, row0, expert, bn, epi)
            self._mainloop(tidx, mA, a_rows, sA, self._expert_weights(mW, expert), bn, sB, tiled_mma, acc,
                           pstate)
            sC = self._stage_acc(tidx, tiled_mma, acc, sC_ptr)
            self._epilogue(tidx, sC, epi, row0, bn, expert)

    def _promote_state(self, tidx, tiled_mma, mIds, row0, expert, bn, epi):
        """The per-K-block scaling state of the tile (templates/warp_fp8.py); None: plain MMA."""
        return None

    @cute.jit
    def _acc_coords(self, ctid, tiled_mma):
        """(row, column) in the tile of each accumulator element of this consumer thread. A
        warpgroup's wgmma fragment is ((2, 2, tile_n/8), 1, 1): element v + 2h + 4j holds row
        r0 + 8h and column c0 + 8j + v, so elements 2i and 2i+1 are neighbours in a row. A
        ping-pong warpgroup owning 128 rows holds two such blocks, ((2, 2, tile_n/8), 2, 1), the
        second for rows r0 + 64 + 8h (see _acc_index)."""
        return tiled_mma.get_slice(ctid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n)))

    def _acc_index(self, hrow: int, j: int) -> int:
        """Flat index of the first element of n8 block ``j`` in accumulator row ``hrow`` of this
        thread (0 <= hrow < acc_rows): the fragment is ((2, 2, tile_n/8), acc_m_blocks, 1), so row
        hrow is h = hrow % 2 of 64-row block hrow // 2."""
        return 2 * (hrow % 2) + 4 * j + (self.tile_n // 2) * (hrow // 2)

    @cute.jit
    def _pair(self, acc, i):
        """Accumulator elements i and i+1 (one row, two neighbouring columns) as a 2-vector."""
        frag = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        frag[0] = acc[i]
        frag[1] = acc[i + 1]
        return frag.load()

    @cute.jit
    def _quad_transpose(self, packed, base: cutlass.Constexpr, q, quad0):
        """Lane q of the quad starting at lane ``quad0`` holds, as ``packed[base + i]``, its bf16
        pair (columns 2q, 2q + 1) of each of four 8-column blocks i; returns the four pairs of
        block q in column order (lane s's pair at s), a 16-byte chunk. Round r: lane q sends its
        pair of block q ^ r to lane q ^ r and receives that lane's pair of block q."""
        got = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for r in cutlass.range_constexpr(4):
            send = self._pick4(packed, base, q ^ r)
            got[r] = cute.arch.shuffle_sync(send, quad0 + (q ^ r))
        chunk = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for src in cutlass.range_constexpr(4):
            chunk[src] = self._pick4(got, 0, q ^ src)  # lane src's pair came in round q ^ src
        return chunk

    @cute.jit
    def _pick4(self, t, base: cutlass.Constexpr, k, stride: cutlass.Constexpr = 1):
        """t[base + stride * k] for a run-time k in 0..3, by selects (no dynamic register indexing)."""
        v = t[base]
        for i in cutlass.range_constexpr(1, 4):
            if k == i:
                v = t[base + stride * i]
        return v

    def _launch_common(self, grid_n, mTileExpert):
        if const_expr(self.persistent):
            return [cutlass.min(grid_n * cute.size(mTileExpert, mode=[0]), self.ctas), 1, 1], [self.threads, 1, 1]
        return [grid_n, cute.size(mTileExpert, mode=[0]), 1], [self.threads, 1, 1]


class GroupedGluGemm(_GroupedGemmBase):
    """GEMM1 of a fused MoE: ``h[r] = act(x[p//top_k] . gate_e) * (x[p//top_k] . up_e)``.

    ``__call__(x, w13, sorted_ids, tile_expert, h, stream)``:
      x [M, H] bf16 (M dynamic); w13 [E, 2I, H] bf16, gate/up rows interleaved in blocks of
      ``interleave`` (see ``interleave_gate_up``); sorted_ids [R] int32 and h [R, I] bf16
      with R = T * tile_m dynamic; tile_expert [T] int32.
      Padding rows (sorted_ids == -1) are written as zeros; tiles with tile_expert == -1
      are not written at all. Grid (2I / tile_n, T), one CTA per (N tile, M tile), walked in
      groups of RASTER_GROUP M tiles per N tile.

    Activation: "swiglu" = SiLU(g) * u; "geglu" = GELU(g) * u with the tanh approximation;
    "swigluoai" = gpt-oss's clamped SwiGLU (``glu``).

    Expert biases (``bias=True``, gpt-oss): ``__call__(x, w13, sorted_ids, tile_expert, h, b13,
    stream)`` with b13 [E, 2I] bf16 interleaved as w13's rows (``interleave_gate_up`` of [E, I, 1]
    gate and up biases), added in fp32 to the gate/up sums before the activation; padding rows
    are still written as zeros. Without biases b13 is None (no argument of the compiled kernel).

    Constraints:
      * bf16 in, fp32 accumulate, bf16 out; all tensors 16-byte aligned and row-major.
      * H % tile_k == 0, 2I % tile_n == 0, tile_n % (2 * interleave) == 0, interleave % 8 == 0.
      * both: tile_m and tile_n multiples of the rows one cp.async pass covers
        (threads / (tile_k / 8)); H / tile_k >= stages - 1; shared memory
        max(stages*(tile_m+tile_n)*tile_k*2, tile_m*(tile_n+8)*4) + 1 KB fits the target.
      * mma="warp": tile_k in {32, 64, 128}; 2 <= stages <= 8; warps_m x warps_n (default:
        ``default_warps``) with tile_m % (16*warps_m) == 0, tile_n % (16*warps_n) == 0, both
        <= 256, 1..8 warps, at most 128 fp32 accumulators per thread.
      * mma="hopws" is built by hopper_gemm.HopperGluGemm (this class refuses it; sm_90a only):
        tile_m in {64, 128} (one consumer warpgroup per 64 rows), tile_n a multiple of 32 up to
        256, tile_k == 64, 3 <= stages <= 8, plus a 128-thread producer warpgroup and 16 bytes of
        mbarriers per stage, in min(tiles, ctas) persistent CTAs; shared memory is the pipeline
        alone (no fp32 staging).
      * pdl=True: launched as a programmatic dependent of the previous kernel in the stream
        (sm_90+); it waits for that grid before reading sorted_ids / tile_expert.
    """

    glu = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16,
                 tile_m: int = 128, tile_n: int = 128, tile_k: int = 64, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, ctas: int = PERSISTENT_CTAS, precision: str = "bf16",
                 bias: bool = False, save_preact: bool = False, fast_act: bool = False):
        ok, reason = self.can_implement(num_experts, hidden, intermediate, top_k, activation,
                                        interleave, tile_m, tile_n, tile_k, stages, mma,
                                        warps_m, warps_n, precision=precision)
        if ok and fast_act:
            ok, reason = limits.check_fast_act("glu", precision, fast_act)
        if ok and bias and precision not in limits.BIAS_PRECISIONS:
            ok, reason = False, f"expert biases are built for {', '.join(limits.BIAS_PRECISIONS)}, not {precision}"
        if ok and save_preact:
            ok, reason = limits.check_save_preact(mma, precision)
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k, self.activation, self.interleave = top_k, activation, interleave
        self.bias = bool(bias)
        self.save_preact = bool(save_preact)
        self.fast_act = bool(fast_act)  # the activation's reciprocal as rcp.approx (glu_act)
        super().__init__(2 * intermediate, hidden, tile_m, tile_n, tile_k, stages, mma,
                         warps_m, warps_n, pdl, ctas, precision)

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, activation="swiglu",
                      interleave=16, tile_m=128, tile_n=128, tile_k=64, stages=4, mma="warp",
                      warps_m=None, warps_n=None, arch=None, precision="bf16"):
        """(ok, reason) for this problem, these tunables and, if given, the target arch."""
        if activation not in limits.ACTIVATIONS:
            return False, f"activation {activation!r} must be one of {', '.join(limits.ACTIVATIONS)}"
        if num_experts < 1 or top_k < 1 or top_k > num_experts:
            return False, f"need 1 <= top_k={top_k} <= num_experts={num_experts}"
        ok, reason = limits.check_glu_shape(intermediate, tile_n, interleave, activation)
        if not ok:
            return ok, reason
        ok, reason = limits.check_fp8("glu", precision, 2 * intermediate, hidden, tile_m, tile_n, mma,
                                      tile_k=tile_k)
        if not ok:
            return ok, reason
        return cls._check_all(2 * intermediate, hidden, tile_m, tile_n, tile_k, stages, mma,
                              warps_m, warps_n, arch, precision)

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        m = cute.sym_int32(symbol="M")
        r = cute.sym_int32(symbol="R", divisibility=self.tile_m)
        t = cute.sym_int32(symbol="T")
        e, hd, i2 = self.num_experts, self.hidden, 2 * self.intermediate
        return [
            ("x", make_fake_tensor(BFloat16, (m, hd), (hd, 1), assumed_align=16)),
            ("w13", make_fake_tensor(BFloat16, (e, i2, hd), (i2 * hd, hd, 1), assumed_align=16)),
            ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=16)),
            ("tile_expert", make_fake_tensor(Int32, (t,), (1,), assumed_align=16)),
            ("h", make_fake_tensor(BFloat16, (r, self.intermediate), (self.intermediate, 1),
                                   assumed_align=16)),
            ("b13", make_fake_tensor(BFloat16, (e, i2), (i2, 1), assumed_align=16) if self.bias else None),
            ("preact", make_fake_tensor(BFloat16, (cute.sym_int32(symbol="P"), i2), (i2, 1), assumed_align=16)
             if self.save_preact else None),
            ("stream", make_fake_stream()),
        ]

    @cute.jit
    def __call__(self, x: cute.Tensor, w13: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, h: cute.Tensor, b13: Optional[cute.Tensor],
                 preact: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel(x, w13, sorted_ids, tile_expert, h, b13).launch(grid=grid, block=block,
                                                                    stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mIds: cute.Tensor,
               mTileExpert: cute.Tensor, mH: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mX, mW, mIds, mTileExpert, self._epi(mH, mB, mIds, mTileExpert))

    def _epi(self, mH, mB, mIds, mTileExpert, mP=None):
        """The epilogue's tensors: (h,), with biases (h, b13, sorted_ids, tile_expert); with
        save_preact the pre-activation output last."""
        epi = (mH, mB, mIds, mTileExpert) if self.bias else (mH,)
        return epi + (mP,) if self.save_preact else epi

    @cute.jit
    def _a_rows(self, tidx, mIds, row0):
        """Token row of x for each A row this thread copies (-1: padding, zero-filled)."""
        thr_copy = self._make_g2s_copy().get_slice(tidx)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        cpy_m = cute.size(tAcA, mode=[1])
        a_rows = cute.make_rmem_tensor(cute.make_layout(cpy_m), Int32)
        for m in cutlass.range_constexpr(cpy_m):
            # p >= -1, so this is p // top_k for a routed pair and -1 for padding
            p = mIds[row0 + tAcA[0, m, 0][0]]
            a_rows[m] = (p + self.top_k) // self.top_k - 1
        return a_rows

    @cute.jit
    def _epilogue(self, etid, sC, epi, row0, bn, expert):
        """h rows of the tile from the staged fp32 gate/up columns; ``etid`` indexes the
        accumulator-holding threads. With biases the gate/up biases of each 8-column chunk are
        added first, and padding rows (whose sums are zero) are written as zeros."""
        mH = epi[0]
        tpr, rows_per_pass, passes = self._epilogue_thread_layout()
        half = self.tile_n // 2
        c8 = etid % tpr
        for it in cutlass.range_constexpr(passes):
            row = it * rows_per_pass + etid // tpr
            if const_expr(self.tile_m % rows_per_pass == 0) or row < self.tile_m:
                g = cute.local_tile(sC, (1, _COPY_ELEMS), (row, c8)).load()
                u = cute.local_tile(sC, (1, _COPY_ELEMS), (row, c8 + half // _COPY_ELEMS)).load()
                if const_expr(self.bias):
                    brow = self._bias_row(epi[1], expert)
                    hc = bn * half + c8 * _COPY_ELEMS  # the chunk's first h column
                    gcol = (hc // self.interleave) * 2 * self.interleave + hc % self.interleave
                    keep = Float32(0.0)
                    if epi[2][row0 + row] >= 0:
                        keep = Float32(1.0)
                    g = g + self._bias_at(brow, gcol, _COPY_ELEMS).reshape(g.shape)
                    u = u + self._bias_at(brow, gcol + self.interleave, _COPY_ELEMS).reshape(u.shape)
                    out = self._glu(g, u) * keep
                else:
                    out = self._glu(g, u)
                dst = cute.local_tile(self._row(mH, row0 + row, self.intermediate),
                                      (_COPY_ELEMS,), (bn * (half // _COPY_ELEMS) + c8,))
                dst.store(out.to(BFloat16))

    @cute.jit
    def _epilogue_regs(self, ctid, tiled_mma, acc, pairs, scales, epi, row0, bn):
        """Persistent kernels: h rows straight from the accumulators. With gate/up interleaved in
        blocks of g columns, the up partner of a gate element at column c is at c + g, g/8 n8
        blocks further in the fragment, and its h column is (c // 2g) * g + c % g: the gate
        blocks of a row, in order, give its consecutive 8-column h blocks (glu_gate_block).
        Padding rows (``pairs`` < 0, see _row_pairs) are written as zeros; ``scales`` is unused
        here.

        When a row's tile_n / 16 h blocks form groups of four (tile_n % 64 == 0), the quad
        transposes each group's bf16 pairs (_quad_transpose) and lane q stores h block 4G + q
        as one 16-byte vector, as GEMM2 does; otherwise (tile_n 32, 96, 160, 224) each lane
        stores its pairs, 4 bytes at a time."""
        mH = epi[0]
        brow = self._epi_bias_row(epi, row0)
        tCcC = self._acc_coords(ctid, tiled_mma)
        if const_expr(self.tile_n % 64 == 0):
            self._epilogue_regs_chunks(tCcC, acc, pairs, mH, brow, row0, bn)
        else:
            self._epilogue_regs_pairs(tCcC, acc, pairs, mH, brow, row0, bn)
        if const_expr(self.save_preact):
            self._epilogue_preact(tCcC, acc, pairs, epi[-1], brow, bn)

    def _epi_bias_row(self, epi, row0):
        """With biases, the bias row of the tile's expert (epi as _epi builds it); else None."""
        if not self.bias:
            return None
        return self._bias_row(epi[1], epi[3][row0 // self.tile_m])

    @cute.jit
    def _h_pair(self, acc, gi, ui, brow, col):
        """Two h values from the gate pair at accumulator index gi and its up partner at ui;
        with biases, those of the gate pair's w13 row ``col`` and its partner's added first."""
        if const_expr(self.bias or self.activation == "swigluoai"):
            g, u = self._pair(acc, gi), self._pair(acc, ui)
            if const_expr(self.bias):
                g = g + self._bias_at(brow, col, 2)
                u = u + self._bias_at(brow, col + self.interleave, 2)
            return self._glu(g, u)
        else:  # the plain GLU kernels in the order they were traced (and tuned) in
            return self._act(self._pair(acc, gi)) * self._pair(acc, ui)

    @cute.jit
    def _epilogue_regs_chunks(self, tCcC, acc, pairs, mH, brow, row0, bn):
        """_epilogue_regs in 16-byte stores: per row and group G of four h blocks, lane q
        computes its pairs of blocks 4G..4G+3 and the quad transpose leaves it block 4G + q."""
        nb = self.interleave // 8  # n8 blocks per gate (or up) block
        half = self.tile_n // 2
        lane = cute.arch.lane_idx()
        q = lane % 4
        quad0 = lane - q
        for hrow in cutlass.range_constexpr(self.acc_rows):
            r = tCcC[self._acc_index(hrow, 0)][0]
            valid = pairs[hrow] >= 0
            dst_row = self._row(mH, row0 + r, self.intermediate)
            # the h column of this lane's pair in h block 0 is its tile column 2q (< g): block
            # 4G + q starts at 32G + 8q
            col0 = bn * half + tCcC[self._acc_index(hrow, 0)][1] - 2 * q + 8 * q
            for grp in cutlass.range_constexpr(half // 32):
                packed = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                packed.fill(0)
                # a padding row (the whole quad's row) is stored as zeros without the GLU math:
                # at few rows per expert most rows are padding, and the activation's MUFU work
                # on them measured 10-25% of GEMM1 at 1-256 tokens
                if valid:
                    for i in cutlass.range_constexpr(4):
                        gi = self._acc_index(hrow, glu_gate_block(4 * grp + i, self.interleave))
                        ui = gi + 4 * nb
                        frag = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
                        frag.store(self._h_pair(acc, gi, ui, brow, bn * self.tile_n + tCcC[gi][1]).to(BFloat16))
                        packed[i] = cute.recast_tensor(frag, Int32)[0]
                # outside `if valid`: every lane of the warp takes part in the shuffles
                chunk = self._quad_transpose(packed, 0, q, quad0)
                dst = cute.local_tile(dst_row, (8,), ((col0 + 32 * grp) // 8,))
                dst.store(cute.recast_tensor(chunk, BFloat16).load())

    @cute.jit
    def _epilogue_preact(self, tCcC, acc, pairs, mP, brow, bn):
        """save_preact (training): the GLU's input of each routed row, its gate/up sums (biases
        added) in w13's interleaved column order, as bf16 to row p of ``mP`` [P, 2I], p = the
        row's routed pair m * top_k + k, so that the layout does not depend on the tiles;
        padding rows write nothing. Per row and group of four n8 blocks the quad transposes its
        bf16 pairs (_quad_transpose) and lane q stores block 4G + q as one 16-byte vector."""
        lane = cute.arch.lane_idx()
        q = lane % 4
        quad0 = lane - q
        for hrow in cutlass.range_constexpr(self.acc_rows):
            p = pairs[hrow]
            dst_row = self._row(mP, cutlass.max(p, Int32(0)), self.n)
            for grp in cutlass.range_constexpr(self.tile_n // 32):
                packed = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                for i in cutlass.range_constexpr(4):
                    ai = self._acc_index(hrow, 4 * grp + i)
                    v = self._pair(acc, ai)
                    if const_expr(self.bias):
                        v = v + self._bias_at(brow, bn * self.tile_n + tCcC[ai][1], 2)
                    frag = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
                    frag.store(v.to(BFloat16))
                    packed[i] = cute.recast_tensor(frag, Int32)[0]
                chunk = self._quad_transpose(packed, 0, q, quad0)  # every lane shuffles
                if p >= 0:
                    dst = cute.local_tile(dst_row, (8,), ((bn * self.tile_n + 32 * grp + 8 * q) // 8,))
                    dst.store(cute.recast_tensor(chunk, BFloat16).load())

    @cute.jit
    def _epilogue_regs_pairs(self, tCcC, acc, pairs, mH, brow, row0, bn):
        """_epilogue_regs in 4-byte stores: each lane its own bf16 pairs."""
        g = self.interleave
        half = self.tile_n // 2
        for hrow in cutlass.range_constexpr(self.acc_rows):
            r = tCcC[self._acc_index(hrow, 0)][0]
            valid = pairs[hrow] >= 0
            dst_row = self._row(mH, row0 + r, self.intermediate)
            for j in cutlass.range_constexpr(self.tile_n // 8):
                if const_expr((j * 8 // g) % 2 == 0):
                    gi = self._acc_index(hrow, j)
                    ui = gi + 4 * (g // 8)
                    c = tCcC[gi][1]
                    hc = (c // (2 * g)) * g + c % g
                    dst = cute.local_tile(dst_row, (2,), (bn * (half // 2) + hc // 2,))
                    if valid:
                        dst.store(self._h_pair(acc, gi, ui, brow, bn * self.tile_n + c).to(BFloat16))
                    else:
                        zero = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
                        zero.fill(0.0)
                        dst.store(zero.load())

    @cute.jit
    def _act(self, g):
        return glu_act(g, self.activation, self.fast_act)

    @cute.jit
    def _glu(self, g, u):
        return glu(g, u, self.activation, self.fast_act)


class GroupedDownGemm(_GroupedGemmBase):
    """GEMM2 of a fused MoE: ``y[p] = topk_weights.flat[p] * (h[r] . w2_e^T)`` for p = sorted_ids[r].

    ``__call__(h, w2, sorted_ids, tile_expert, topk_weights, y, stream)``:
      h [R, I] bf16 in padded order (R = T * tile_m dynamic); w2 [E, H, I] bf16;
      sorted_ids [R], tile_expert [T] int32; topk_weights [M, top_k] fp32; y [M*top_k, H] bf16.
      The routing weight is applied in fp32 before the bf16 store; padding rows are not
      stored; rows of y no pair maps to are not written. Grid (H / tile_n, T), as GEMM1.
      Expert biases (``bias=True``, gpt-oss): ``__call__(h, w2, sorted_ids, tile_expert,
      topk_weights, y, b2, stream)`` with b2 [E, H] bf16, added in fp32 before the routing weight
      (y[p] = w * (h . w2_e^T + b2_e)); without biases b2 is None.

    Constraints:
      * bf16 in, fp32 accumulate, bf16 out; all tensors 16-byte aligned and row-major.
      * I % tile_k == 0, H % tile_n == 0; the tile constraints of GroupedGluGemm (with K = I).
      * pdl=True: launched as a programmatic dependent of GEMM1; the first weight k-tiles are
        fetched before waiting for its grid, h only after.
    """

    glu = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 tile_m: int = 128, tile_n: int = 128, tile_k: int = 64, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, ctas: int = PERSISTENT_CTAS, precision: str = "bf16",
                 bias: bool = False):
        ok, reason = self.can_implement(num_experts, hidden, intermediate, top_k, tile_m,
                                        tile_n, tile_k, stages, mma, warps_m, warps_n,
                                        precision=precision)
        if ok and bias and precision not in limits.BIAS_PRECISIONS:
            ok, reason = False, f"expert biases are built for {', '.join(limits.BIAS_PRECISIONS)}, not {precision}"
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k = top_k
        self.bias = bool(bias)
        super().__init__(hidden, intermediate, tile_m, tile_n, tile_k, stages, mma,
                         warps_m, warps_n, pdl, ctas, precision)

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, tile_m=128, tile_n=128,
                      tile_k=64, stages=4, mma="warp", warps_m=None, warps_n=None, arch=None,
                      precision="bf16"):
        """(ok, reason) for this problem, these tunables and, if given, the target arch."""
        if num_experts < 1 or top_k < 1 or top_k > num_experts:
            return False, f"need 1 <= top_k={top_k} <= num_experts={num_experts}"
        ok, reason = limits.check_fp8("down", precision, hidden, intermediate, tile_m, tile_n, mma,
                                      tile_k=tile_k)
        if not ok:
            return ok, reason
        return cls._check_all(hidden, intermediate, tile_m, tile_n, tile_k, stages, mma,
                              warps_m, warps_n, arch, precision)

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        m = cute.sym_int32(symbol="M")
        mk = cute.sym_int32(symbol="MK")
        r = cute.sym_int32(symbol="R", divisibility=self.tile_m)
        t = cute.sym_int32(symbol="T")
        e, hd, i = self.num_experts, self.hidden, self.intermediate
        return [
            ("h", make_fake_tensor(BFloat16, (r, i), (i, 1), assumed_align=16)),
            ("w2", make_fake_tensor(BFloat16, (e, hd, i), (hd * i, i, 1), assumed_align=16)),
            ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=16)),
            ("tile_expert", make_fake_tensor(Int32, (t,), (1,), assumed_align=16)),
            ("topk_weights", make_fake_tensor(Float32, (m, self.top_k), (self.top_k, 1),
                                              assumed_align=16)),
            ("y", make_fake_tensor(BFloat16, (mk, hd), (hd, 1), assumed_align=16)),
            ("b2", make_fake_tensor(BFloat16, (e, hd), (hd, 1), assumed_align=16) if self.bias else None),
            ("stream", make_fake_stream()),
        ]

    @cute.jit
    def __call__(self, h: cute.Tensor, w2: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, topk_weights: cute.Tensor, y: cute.Tensor,
                 b2: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel(h, w2, sorted_ids, tile_expert, topk_weights, y, b2).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mW: cute.Tensor, mIds: cute.Tensor,
               mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mH, mW, mIds, mTileExpert, self._epi(mIds, mTopkW, mY, mB, mTileExpert))

    def _epi(self, mIds, mTopkW, mY, mB, mTileExpert):
        """The epilogue's tensors: (sorted_ids, topk_weights, y), with biases + (b2, tile_expert)."""
        return (mIds, mTopkW, mY, mB, mTileExpert) if self.bias else (mIds, mTopkW, mY)

    @cute.jit
    def _a_rows(self, tidx, mIds, row0):
        """Row of h for each A row this thread copies: h is in padded order, so every row
        exists (padding rows are zeros)."""
        thr_copy = self._make_g2s_copy().get_slice(tidx)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        cpy_m = cute.size(tAcA, mode=[1])
        a_rows = cute.make_rmem_tensor(cute.make_layout(cpy_m), Int32)
        for m in cutlass.range_constexpr(cpy_m):
            a_rows[m] = row0 + tAcA[0, m, 0][0]
        return a_rows

    @cute.jit
    def _epilogue_regs(self, ctid, tiled_mma, acc, pairs, scales, epi, row0, bn):
        """Persistent kernels: scaled rows straight from the accumulators to y (``pairs`` and
        ``scales`` from the schedule); padding rows are not stored.

        The four lanes of a quad hold one row's 8-column block j as four bf16 pairs (lane q:
        columns 8j + 2q, 2q + 1). Per group of four blocks the quad transposes its pairs with
        shuffles, so lane q holds all of block 4g + q and stores it as one 16-byte vector: a
        quarter of the store instructions of pair-wise stores (which filled the load/store
        queue: ~20% of GEMM2's stall samples, tools/results/NOTES.md)."""
        mY = epi[2]
        brow = self._epi_bias_row(epi, row0)
        tCcC = self._acc_coords(ctid, tiled_mma)
        lane = cute.arch.lane_idx()
        q = lane % 4
        quad0 = lane - q
        for hrow in cutlass.range_constexpr(self.acc_rows):
            p = pairs[hrow]
            scale = scales[hrow]
            packed = cute.make_rmem_tensor(cute.make_layout(self.tile_n // 8), Int32)
            for j in cutlass.range_constexpr(self.tile_n // 8):
                frag = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
                v = self._pair(acc, self._acc_index(hrow, j))
                if const_expr(self.bias):
                    v = v + self._bias_at(brow, bn * self.tile_n + tCcC[self._acc_index(hrow, j)][1], 2)
                frag.store((v * scale).to(BFloat16))
                packed[j] = cute.recast_tensor(frag, Int32)[0]
            dst_row = self._row(mY, p, self.hidden)  # used only where p >= 0
            # the tile column of this lane's pair in block 0 is 2q: block 4g + q starts at 32g + 8q
            col0 = bn * self.tile_n + tCcC[self._acc_index(hrow, 0)][1] - 2 * q + 8 * q
            for g in cutlass.range_constexpr(self.tile_n // 32):
                chunk = self._quad_transpose(packed, 4 * g, q, quad0)
                if p >= 0:
                    dst = cute.local_tile(dst_row, (8,), ((col0 + 32 * g) // 8,))
                    dst.store(cute.recast_tensor(chunk, BFloat16).load())

    def _epi_bias_row(self, epi, row0):
        """With biases, the bias row of the tile's expert (epi as _epi builds it); else None."""
        if not self.bias:
            return None
        return self._bias_row(epi[3], epi[4][row0 // self.tile_m])

    @cute.jit
    def _epilogue(self, etid, sC, epi, row0, bn, expert):
        """Scaled rows of the tile scattered to y; ``etid`` indexes the accumulator-holding threads."""
        mIds, mTopkW, mY = epi[0], epi[1], epi[2]
        tpr, rows_per_pass, passes = self._epilogue_thread_layout()
        c8 = etid % tpr
        for it in cutlass.range_constexpr(passes):
            row = it * rows_per_pass + etid // tpr
            if const_expr(self.tile_m % rows_per_pass == 0) or row < self.tile_m:
                p = mIds[row0 + row]
                if p >= 0:
                    scale = mTopkW[p // self.top_k, p % self.top_k]
                    v = cute.local_tile(sC, (1, _COPY_ELEMS), (row, c8)).load()
                    if const_expr(self.bias):
                        col = bn * self.tile_n + c8 * _COPY_ELEMS
                        v = v + self._bias_at(self._bias_row(epi[3], expert), col, _COPY_ELEMS).reshape(v.shape)
                    v = v * scale
                    dst = cute.local_tile(self._row(mY, p, self.hidden), (_COPY_ELEMS,),
                                          (bn * (self.tile_n // _COPY_ELEMS) + c8,))
                    dst.store(v.to(BFloat16))

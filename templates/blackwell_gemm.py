"""Blackwell (sm_100a) grouped GEMMs of a fused MoE layer on tcgen05 (mma="umma").

**Compiled only, never run**: no Blackwell GPU was available when this was written, so these
kernels have compiled for sm_100a on a CPU machine (their SASS holds the tcgen05 MMA, the TMEM
allocation and the TMA loads) but none has been launched, and their numerics are unchecked.

Same arguments, same results and same routing layout as ``GroupedGluGemm`` / ``GroupedDownGemm``
(and the Hopper ``HopperGluGemm`` / ``HopperDownGemm``): GEMM1 gathers the routed token rows of x,
multiplies them by the tile's expert's interleaved gate/up weights and writes the GLU output h
(padding rows as zeros); GEMM2 multiplies h (already in expert-sorted padded order) by the down
weights and writes each routed row scaled by its routing weight to ``y[p]``.

Persistent CTAs (at most one per SM) walk the (N tile, M tile) space of the routing layout in
the raster order of the other kernels (``_tile_of``); every warp role walks the same sequence
and skips the tiles whose ``tile_expert`` is -1. Per CTA, warp-specialized:

- warp 5 (TMA): the weight k-tiles (and GEMM2's A, rows of h) by TMA into a
  ``cutlass.pipeline.PipelineTmaUmma`` of ``stages`` A/B buffers, in the UMMA-canonical K-major
  128-byte-swizzled layouts;
- warps 6-9 (GEMM1 only): the gathered token rows of A by cp.async, each thread keeping the
  source row of each A row it copies in a register for the whole K loop (as the Hopper core
  does). cp.async writes through the generic proxy and tcgen05.mma reads through the async
  proxy, so a thread hands a stage to the MMA only after its copies of that stage completed
  (``cp.async.wait_group``, ``LAG`` k-tiles behind the newest) and it fenced them
  (``fence.proxy.async.shared::cta``): one arrival per loader thread on the stage's full barrier,
  beside the TMA warp's byte count;
- warp 4 (MMA): one thread issues ``tcgen05.mma`` (M 128, N tile_n, K 16, bf16 in, fp32 out)
  into one of ``ACC_STAGES`` TMEM accumulators; ``tcgen05.commit`` releases each A/B stage when
  its MMAs have read it, and hands the accumulator to the epilogue
  (``cutlass.pipeline.PipelineUmmaAsync``) when the tile's last MMA is done;
- warps 0-3 (epilogue): warp 0 allocates the TMEM columns (and frees them at the end); each
  thread owns one row of the tile (TMEM lane = row), loads its accumulators in chunks of
  columns with ``tcgen05.ld.32x32b``, applies the GLU (GEMM1: a chunk holds one gate block and
  its up partner, ``2 * interleave`` columns) or the bias and routing weight (GEMM2), and
  stores bf16 straight to global memory. With two accumulators the MMA of the next tile runs
  while the epilogue writes this one.

2-CTA pairs (``cluster_m=2``, ``tile_m=256``; compiled only, never run either): a cluster of
two CTAs along M multiplies each 256-row routing tile by one ``tcgen05.mma.cta_group::2`` per
k-block (M 256), which the leader CTA (rank 0) issues. Each CTA holds its 128 rows of A, half of
the weight tile's rows (the 2-CTA TMA loads of both CTAs complete on the leader's full barrier,
which expects both CTAs' bytes) and its 128 rows of the accumulators in its own TMEM; the leader's
``tcgen05.commit``s multicast to both CTAs' barriers, both CTAs' epilogue threads release an
accumulator on the leader's barrier, and the pair allocates and frees TMEM together. GEMM1's
loaders gather their own CTA's rows; the other CTA's arrive on the leader's full barrier at
cluster scope. Both CTAs of a pair walk the same tiles (pair p takes tiles p, p + pairs, ...).
Since one MMA multiplies all 256 rows by one expert's weights, the routing pads every expert to
256 rows (the layer's tile_m; gemm_limits.check_umma_pair).

Padding rows of A (GEMM1) are never loaded: their shared memory holds whatever the stage held
before, which reaches only those rows' outputs (rows of a product are independent), and the
epilogue writes zeros (GEMM1) or nothing (GEMM2) for them.

Not done yet: weight multicast across pairs (clusters of more than 2 CTAs); the TMA
``tile::gather4`` load the DSL offers for sm_100
(``cpasync.CopyBulkTensor2DGather4G2SOp``) in place of GEMM1's cp.async gather; the pre-activation
output of training (``save_preact``).

Constraints (the rules are moe_aot/gemm_limits.py's ``check_umma``):
  * sm_100a only; bf16 in, fp32 accumulate, bf16 out; tile_m 128 (one 1-CTA UMMA M) with
    cluster_m 1, or 256 (one 2-CTA UMMA M over a pair) with cluster_m 2;
    tile_n a multiple of 32 in 32..256 (GEMM1: of 2 * interleave as well); tile_k 64 (one
    128-byte swizzle atom); 3 <= stages <= 8; shared memory per CTA
    stages * (tile_m + tile_n) / cluster_m * 128 B + 1 KB (the mbarriers live in that first KB);
    ``ACC_STAGES * tile_n`` TMEM columns per CTA (rounded up to a power of two, at most 512).
  * grid min(tiles, ctas / cluster_m) * cluster_m persistent CTAs of 192 threads (GEMM2) or 320
    (GEMM1), in clusters of cluster_m; ctas a multiple of cluster_m.
  * pdl=True: every thread waits for the previous grid before its first read.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from moe_aot import gemm_limits as limits

from .grouped_gemm import GroupedDownGemm, GroupedGluGemm

MMAS = limits.UMMA
ACC_STAGES = limits.UMMA_ACC_STAGES  # TMEM accumulators: the epilogue of one tile beside the next's MMAs
B200_SMS = 148  # the default grid: one CTA per SM of a B200
EPI_WARPS = 4  # warps 0-3: one TMEM lane (tile row) per thread
MMA_WARP, TMA_WARP, LOAD_WARP0 = 4, 5, 6
LOAD_THREADS = limits.LOAD_THREADS  # GEMM1's cp.async loaders, warps 6-9
EPI_N = 32  # GEMM2's epilogue chunk: accumulator columns per tcgen05.ld
# named barriers (0 is the CTA barrier): the TMEM address handed to the MMA warp, the epilogue
# warps done with TMEM before it is freed
_BAR_TMEM_ALLOC, _BAR_EPI = 1, 2


class _Blackwell:
    """The persistent tcgen05 loop shared by both GEMMs (see the module docstring)."""

    def __init__(self, *args, mma: str = MMAS[0], ctas: int = B200_SMS, cluster_m: int = 1,
                 tile_m: int = limits.UMMA_CTA_M, **kwargs):
        if mma not in MMAS:
            raise ValueError(f"{type(self).__name__} implements mma in {MMAS}, not {mma!r}")
        ok, reason = limits.check_cluster(mma, tile_m, cluster_m)
        if ok and ctas % cluster_m:
            ok, reason = False, f"ctas {ctas} must be a multiple of cluster_m {cluster_m}"
        if not ok:
            raise ValueError(reason)
        # the shared rules see one CTA's share of the tile (tile_m: the CTA's rows, TMEM lanes);
        # route_m is the routing's tile, the MMA's M (256 over a 2-CTA pair)
        super().__init__(*args, mma=mma, ctas=ctas, tile_m=tile_m // cluster_m, **kwargs)
        self.cluster_m = cluster_m
        self.route_m = tile_m
        self.persistent = True
        self.load_threads = LOAD_THREADS
        # cp.async k-tiles a GEMM1 loader keeps in flight before it hands the oldest to the MMA
        # (at most stages - 1, or the loaders would wait on a stage whose fill they hold back)
        self.lag = max(1, self.stages - 2)
        self.threads = 32 * (LOAD_WARP0 + (LOAD_THREADS // 32 if self.glu else 0))
        self.epi_n = 2 * self.interleave if self.glu else EPI_N
        self.tmem_cols = limits.umma_tmem_columns(self.tile_n)

    # ------------------------------------------------------------------ host side
    def _mma_tiler(self):
        """The MMA's tile: (route_m, tile_n, tile_k), over both CTAs of a 2-CTA pair."""
        return (self.route_m, self.tile_n, self.tile_k)

    def _cta_group(self):
        return tcgen05.CtaGroup.TWO if self.cluster_m == 2 else tcgen05.CtaGroup.ONE

    def _cluster_vmnk(self):
        """The cluster as the pipelines see it: (pair, M, N, L) = (cluster_m, 1, 1, 1)."""
        return cute.make_layout((self.cluster_m, 1, 1, 1))

    def _make_umma(self):
        """The tcgen05 MMA: A and B K-major from shared memory, fp32 accumulators in TMEM; 1-CTA
        (M 128), or 2-CTA over a pair (cta_group::2, M 256: each CTA's shared memory holds its
        128 rows of A and half the rows of B, its TMEM its 128 rows of the accumulators)."""
        k_major = cute.nvgpu.OperandMajorMode.K
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major, k_major, Float32, self._cta_group(), (self.route_m, self.tile_n))

    def _smem_layouts(self, tiled_mma):
        tiler = self._mma_tiler()
        return (sm100_utils.make_smem_layout_a(tiled_mma, tiler, BFloat16, self.stages),
                sm100_utils.make_smem_layout_b(tiled_mma, tiler, BFloat16, self.stages))

    @cute.jit
    def _make_tma(self, mT, operand: cutlass.Constexpr):
        """TMA atom over a row-major [rows, K] matrix into one stage of the UMMA layout of
        ``operand`` ("a": tile_m rows, "b": tile_n rows)."""
        tiled_mma = self._make_umma()
        a_layout, b_layout = self._smem_layouts(tiled_mma)
        # a pair's TMA loads (each CTA its share) complete on the leader CTA's full barrier
        op = cpasync.CopyBulkTensorTileG2SOp(self._cta_group())
        vmnk = self._cluster_vmnk().shape
        if const_expr(operand == "a"):
            return cute.nvgpu.make_tiled_tma_atom_A(op, mT, cute.slice_(a_layout, (None, None, None, 0)),
                                                    self._mma_tiler(), tiled_mma, vmnk)
        return cute.nvgpu.make_tiled_tma_atom_B(op, mT, cute.slice_(b_layout, (None, None, None, 0)),
                                                self._mma_tiler(), tiled_mma, vmnk)

    @cute.jit
    def _make_tma_w(self, mW):
        """TMA atom over all experts' weights seen as one [E*N, K] matrix: expert e's N tile j is
        row tile e * (N / tile_n) + j (the host launcher encodes the descriptor)."""
        flat = cute.make_tensor(mW.iterator, cute.make_layout((self.num_experts * self.n, self.k), stride=(self.k, 1)))
        return self._make_tma(flat, "b")

    def _launch_kw(self):
        kw = dict(use_pdl=self.pdl, min_blocks_per_mp=1)
        if self.cluster_m > 1:
            kw["cluster"] = [self.cluster_m, 1, 1]
        return kw

    def _launch_common(self, grid_n, mTileExpert):
        """min(tiles, ctas / cluster_m) pairs (or CTAs) of cluster_m CTAs each."""
        units = cutlass.min(grid_n * cute.size(mTileExpert, mode=[0]), self.ctas // self.cluster_m)
        return [units * self.cluster_m, 1, 1], [self.threads, 1, 1]

    @cute.jit
    def _walk(self):
        """(first tile, step, rank): the tiles this CTA's pair (or this CTA) walks, and the CTA's
        rank in the pair (0: the leader, which issues the MMAs; 0 without a pair)."""
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        rank = Int32(0)
        if const_expr(self.cluster_m > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return bid // self.cluster_m, nctas // self.cluster_m, rank

    def _expert_bias(self, epi, expert):
        """With biases, the bias row of ``expert`` (b13 or b2, where _epi puts it); else None."""
        if not self.bias:
            return None
        return self._bias_row(epi[1] if self.glu else epi[3], expert)

    # ------------------------------------------------------------------ the kernel body
    @cute.jit
    def _umma_tiles(self, tma_a, mAt, tma_b, mWt, mA, mIds, mTileExpert, epi):
        """One persistent CTA: shared memory, pipelines and TMEM, then each warp to its role."""
        self._grid_dependency_wait()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tiled_mma = self._make_umma()
        a_layout, b_layout = self._smem_layouts(tiled_mma)

        C = self.cluster_m
        smem = cutlass.memory.SmemAllocator()
        ab_bars = smem.allocate_array(cutlass.Int64, 2 * self.stages, byte_alignment=8)
        acc_bars = smem.allocate_array(cutlass.Int64, 2 * ACC_STAGES, byte_alignment=8)
        tmem_slot = smem.allocate_array(Int32, 1, byte_alignment=4)
        dealloc_bar = None
        if const_expr(C > 1):  # the pair's TMEM release handshake (TmemAllocator's, is_two_cta)
            dealloc_bar = smem.allocate_array(cutlass.Int64, 1, byte_alignment=8)
        a_bytes = self.stages * self.tile_m * self.tile_k * 2
        b_rows = self.tile_n // C  # a CTA of a pair holds half the weight tile's rows
        base = smem.allocate(a_bytes + self.stages * b_rows * self.tile_k * 2, byte_alignment=1024)
        sA = cute.make_tensor(cute.recast_ptr(base, a_layout.inner, BFloat16), a_layout.outer)
        # GEMM1's cp.async view of this CTA's A stages, (tile_m, tile_k, stages): the canonical
        # K-major 128-byte-swizzled layout, the same bytes as the UMMA view (8-row atoms of
        # 128-byte rows stacked along M; tile_k is one atom wide)
        cp_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.tile_k),
                                                  BFloat16, self.stages)
        sA_cp = cute.make_tensor(cute.recast_ptr(base, cp_layout.inner, BFloat16), cp_layout.outer)
        sB = cute.make_tensor(cute.recast_ptr(base + a_bytes, b_layout.inner, BFloat16), b_layout.outer)

        # the bytes and arrivals each stage's full barrier waits for; a pair's MMAs wait on the
        # leader CTA's barrier for both CTAs' loads
        tx = b_rows * self.tile_k * 2 * C
        producers = 1
        if const_expr(self.glu):
            producers = 1 + LOAD_THREADS * C  # the TMA warp's byte count and each loader thread
        else:
            tx = tx + self.tile_m * self.tile_k * 2 * C
        cluster = self._cluster_vmnk()
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=ab_bars, num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=tx, cta_layout_vmnk=cluster, defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=acc_bars, num_stages=ACC_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * EPI_WARPS * C),
            cta_layout_vmnk=cluster, defer_sync=True)
        tmem = cutlass.memory.TmemAllocator(
            tmem_slot, barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=_BAR_TMEM_ALLOC,
                                                                  num_threads=32 * (EPI_WARPS + 1)),
            allocator_warp_id=0, is_two_cta=C > 1, two_cta_tmem_dealloc_mbar_ptr=dealloc_bar)
        cute.arch.mbarrier_init_fence()
        if const_expr(C > 1):  # the peer's barriers are initialized before anything signals them
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        # (MMA, MMA_M, MMA_N, ACC_STAGES): this CTA's accumulators in TMEM (address filled in later)
        acc_shape = tiled_mma.partition_shape_C((self.route_m, self.tile_n))
        acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, ACC_STAGES))
        num_m_tiles = cute.size(mTileExpert, mode=[0])
        if warp == TMA_WARP:
            self._produce_tma(ab_pipe, tiled_mma, tma_a, mAt, tma_b, mWt, sA, sB, mTileExpert, num_m_tiles)
        elif warp == MMA_WARP:
            tmem.wait_for_alloc()
            acc = cute.make_tensor(tmem.retrieve_ptr(Float32), acc_fake.layout)
            _, _, rank = self._walk()
            if rank == 0:  # a pair's leader issues the MMAs of both CTAs
                self._mma(ab_pipe, acc_pipe, tiled_mma, sA, sB, acc, mTileExpert, num_m_tiles)
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
                self._produce_gather(tidx - 32 * LOAD_WARP0, ab_pipe, mA, mIds, mTileExpert, sA_cp, num_m_tiles)

    @cute.jit
    def _produce_tma(self, ab_pipe, tiled_mma, tma_a, mAt, tma_b, mWt, sA, sB, mTileExpert, num_m_tiles):
        """Warp 5: per tile and k-tile, wait for a free stage, expect its bytes and issue the TMA
        loads of the weight tile (and GEMM2's rows of h)."""
        k_tiles = self.k // self.tile_k
        n_tiles = self.n // self.tile_n
        first, step, rank = self._walk()
        cpasync.prefetch_descriptor(tma_b)
        if const_expr(not self.glu):
            cpasync.prefetch_descriptor(tma_a)
        thr_mma = tiled_mma.get_slice(rank)  # this CTA's share of the MMA's A and B
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for t in range(first, n_tiles * num_m_tiles, step):
            bn, bt = self._tile_of(t, num_m_tiles)
            expert = mTileExpert[bt]
            if expert >= 0:
                gB = cute.local_tile(mWt, (self.tile_n, self.tile_k), (expert * n_tiles + bn, None))
                tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3),
                                                   cute.group_modes(thr_mma.partition_B(gB), 0, 3))
                if const_expr(self.glu):
                    for kt in range(k_tiles):
                        ab_pipe.producer_acquire(state)
                        cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index],
                                  tma_bar_ptr=ab_pipe.producer_get_barrier(state))
                        state.advance()
                else:
                    gA = cute.local_tile(mAt, (self.route_m, self.tile_k), (bt, None))
                    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3),
                                                       cute.group_modes(thr_mma.partition_A(gA), 0, 3))
                    for kt in range(k_tiles):
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar)
                        cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar)
                        state.advance()
        ab_pipe.producer_tail(state)

    @cute.jit
    def _produce_gather(self, ltid, ab_pipe, mA, mIds, mTileExpert, sA_cp, num_m_tiles):
        """GEMM1's warps 6-9: the gathered token rows of A by cp.async into the stage the TMA
        warp fills with B. The stage is handed over ``lag`` k-tiles later, once this thread's
        copies of it completed and were fenced for the async proxy the MMA reads through; the
        count of k-tiles copied but not yet handed over runs on across tiles."""
        k_tiles = self.k // self.tile_k
        n_tiles = self.n // self.tile_n
        first, step, rank = self._walk()
        tiled_copy = self._make_g2s_copy()
        thr_copy = tiled_copy.get_slice(ltid)
        tAsA = thr_copy.partition_D(sA_cp)  # (CPY, CPY_M, CPY_K, PIPE)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        handed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        pending = Int32(0)
        for t in range(first, n_tiles * num_m_tiles, step):
            bn, bt = self._tile_of(t, num_m_tiles)
            if mTileExpert[bt] >= 0:
                a_rows = self._a_rows(ltid, mIds, bt * self.route_m + rank * self.tile_m)
                for kt in range(k_tiles):
                    ab_pipe.sync_object_empty.wait(state.index, state.phase)
                    self._load_a(kt, state.index, tiled_copy, mA, a_rows, tAsA, tAcA)
                    cute.arch.cp_async_commit_group()
                    state.advance()
                    pending = pending + 1
                    if pending > self.lag:
                        cute.arch.cp_async_wait_group(self.lag)
                        self._hand_over(ab_pipe, handed, rank)
                        handed.advance()
                        pending = pending - 1
        cute.arch.cp_async_wait_group(0)
        while pending > 0:
            self._hand_over(ab_pipe, handed, rank)
            handed.advance()
            pending = pending - 1

    @cute.jit
    def _hand_over(self, ab_pipe, state, rank):
        """This thread's completed copies into ``state``'s stage, made visible to the async proxy
        (tcgen05.mma's reads), then its arrival on the stage's full barrier. In a pair the leader
        (rank 0) issues the MMAs that read both CTAs' stages: the other CTA's loaders arrive on the
        leader's barrier, releasing their writes at cluster scope."""
        cute.arch.fence_proxy("async.shared", space="cta")
        if rank == 0:
            cute.arch.mbarrier_arrive(ab_pipe.producer_get_barrier(state))
        else:
            cute.arch.mbarrier_arrive(ab_pipe.producer_get_barrier(state), peer_cta_rank_in_cluster=0,
                                      scope=nvvm.MemScopeKind.CLUSTER)

    @cute.jit
    def _mma(self, ab_pipe, acc_pipe, tiled_mma, sA, sB, acc, mTileExpert, num_m_tiles):
        """Warp 4: per tile, wait for a free accumulator, then per k-tile wait for its stage,
        issue its tcgen05.mma k-blocks and release the stage with tcgen05.commit; commit the
        accumulator to the epilogue after the tile's last k-tile."""
        k_tiles = self.k // self.tile_k
        n_tiles = self.n // self.tile_n
        first, step, _ = self._walk()
        tCrA = tiled_mma.make_fragment_A(sA)  # (MMA, MMA_M, MMA_K, STAGE): shared memory descriptors
        tCrB = tiled_mma.make_fragment_B(sB)
        num_kb = cute.size(tCrA, mode=[2])
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ACC_STAGES)
        for t in range(first, n_tiles * num_m_tiles, step):
            bn, bt = self._tile_of(t, num_m_tiles)
            if mTileExpert[bt] >= 0:
                acc_pipe.producer_acquire(acc_state)
                tAcc = acc[None, None, None, acc_state.index]
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kt in range(k_tiles):
                    ab_pipe.consumer_wait(read)
                    for kb in cutlass.range_constexpr(num_kb):
                        cute.gemm(tiled_mma, tAcc, tCrA[None, None, kb, read.index], tCrB[None, None, kb, read.index],
                                  tAcc)
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
        first, step, rank = self._walk()
        chunk = (self.tile_m, self.epi_n)
        # (tile_m, epi_n, 1, chunks, ACC_STAGES)
        acc_epi = cute.flat_divide(acc[((None, None), 0, 0, None)], chunk)
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(self.epi_n)), Float32),
            acc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(etid)
        tTR_tAcc = thr_t2r.partition_S(acc_epi)  # (T2R, T2R_M, T2R_N, 1, chunks, ACC_STAGES)
        # the tile coordinates of each loaded element: (T2R, T2R_M, T2R_N, 1, chunks)
        tTR_cC = thr_t2r.partition_D(cute.flat_divide(cute.make_identity_tensor((self.tile_m, self.tile_n)), chunk))
        frag = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0, 0)].shape, Float32)
        row = tTR_cC[0][0]  # this thread's tile row (its TMEM lane)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACC_STAGES)
        for t in range(first, n_tiles * num_m_tiles, step):
            bn, bt = self._tile_of(t, num_m_tiles)
            expert = mTileExpert[bt]
            if expert >= 0:
                row0 = bt * self.route_m + rank * self.tile_m  # this CTA's rows of the pair's tile
                p = mIds[row0 + row]
                scale = Float32(0.0)
                if const_expr(not self.glu):
                    if p >= 0:
                        scale = epi[1][p // self.top_k, p % self.top_k]
                brow = self._expert_bias(epi, expert)
                acc_pipe.consumer_wait(state)
                for c in cutlass.range_constexpr(self.tile_n // self.epi_n):
                    cute.copy(t2r, tTR_tAcc[(None, None, None, 0, c, state.index)], frag)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: frag holds the chunk
                    self._epilogue_chunk(frag, epi, brow, p, scale, row0 + row, bn, c)
                acc_pipe.consumer_release(state)
                state.advance()


class BlackwellGluGemm(_Blackwell, GroupedGluGemm):
    """GEMM1 + GLU with mma="umma" (same arguments and results as ``GroupedGluGemm``)."""

    def __init__(self, *args, save_preact: bool = False, **kwargs):
        if save_preact:
            raise ValueError("save_preact: the pre-activation output is not built for mma 'umma' yet")
        super().__init__(*args, **kwargs)
        if limits.UMMA_EPI_MAX_COLS < 2 * self.interleave:
            raise ValueError(f"interleave {self.interleave}: mma 'umma' loads a gate block and its up partner "
                             f"in one tcgen05.ld of at most {limits.UMMA_EPI_MAX_COLS} columns")

    @cute.jit
    def __call__(self, x: cute.Tensor, w13: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, h: cute.Tensor, b13: Optional[cute.Tensor],
                 preact: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_b, mWt = self._make_tma_w(w13)
        self.kernel_umma(tma_b, mWt, x, sorted_ids, tile_expert, h, b13).launch(
            grid=grid, block=block, stream=stream, **self._launch_kw())

    @cute.kernel
    def kernel_umma(self, tma_b: cute.CopyAtom, mWt: cute.Tensor, mX: cute.Tensor, mIds: cute.Tensor,
                    mTileExpert: cute.Tensor, mH: cute.Tensor, mB: Optional[cute.Tensor]):
        self._umma_tiles(None, None, tma_b, mWt, mX, mIds, mTileExpert, self._epi(mH, mB, mIds, mTileExpert))

    @cute.jit
    def _epilogue_chunk(self, frag, epi, brow, p, scale, row, bn, c):
        """Chunk ``c`` of a row: one gate block (``interleave`` columns) and its up partner, whose
        h columns are the block's (bn * tile_n / 2 + c * interleave onwards); a padding row's are
        written as zeros, without the GLU math."""
        g = self.interleave
        dst = cute.local_tile(self._row(epi[0], row, self.intermediate), (g,), (bn * (self.tile_n // (2 * g)) + c,))
        if p >= 0:
            gate = cute.make_rmem_tensor(cute.make_layout(g), Float32)
            up = cute.make_rmem_tensor(cute.make_layout(g), Float32)
            for i in cutlass.range_constexpr(g):
                gate[i] = frag[i]
                up[i] = frag[g + i]
            gv, uv = gate.load(), up.load()
            if const_expr(self.bias):
                col = bn * self.tile_n + c * 2 * g  # the gate block's first w13 row
                gv = gv + self._bias_at(brow, col, g)
                uv = uv + self._bias_at(brow, col + g, g)
            dst.store(self._glu(gv, uv).to(BFloat16))
        else:
            zero = cute.make_rmem_tensor(cute.make_layout(g), BFloat16)
            zero.fill(0.0)
            dst.store(zero.load())


class BlackwellDownGemm(_Blackwell, GroupedDownGemm):
    """GEMM2 with mma="umma" (same arguments and results as ``GroupedDownGemm``)."""

    interleave = 0  # no GLU

    @cute.jit
    def __call__(self, h: cute.Tensor, w2: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, topk_weights: cute.Tensor, y: cute.Tensor,
                 b2: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_a, mAt = self._make_tma(h, "a")
        tma_b, mWt = self._make_tma_w(w2)
        self.kernel_umma(tma_a, mAt, tma_b, mWt, sorted_ids, tile_expert, topk_weights, y, b2).launch(
            grid=grid, block=block, stream=stream, **self._launch_kw())

    @cute.kernel
    def kernel_umma(self, tma_a: cute.CopyAtom, mAt: cute.Tensor, tma_b: cute.CopyAtom, mWt: cute.Tensor,
                    mIds: cute.Tensor, mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor,
                    mB: Optional[cute.Tensor]):
        self._umma_tiles(tma_a, mAt, tma_b, mWt, None, mIds, mTileExpert,
                         self._epi(mIds, mTopkW, mY, mB, mTileExpert))

    @cute.jit
    def _epilogue_chunk(self, frag, epi, brow, p, scale, row, bn, c):
        """Chunk ``c`` of a row: (acc + b2) * routing weight to y[p], nothing for a padding row."""
        if p >= 0:
            v = frag.load()
            col = bn * self.tile_n + c * EPI_N
            if const_expr(self.bias):
                v = v + self._bias_at(brow, col, EPI_N).reshape(v.shape)
            dst = cute.local_tile(self._row(epi[2], p, self.hidden), (EPI_N,), (col // EPI_N,))
            dst.store((v * scale).to(BFloat16).reshape((EPI_N,)))

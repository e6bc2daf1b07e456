"""The backward's weight gradients as one grouped GEMM with a variable K per expert (sm_90a).

``HopperWgrad(num_experts, out_rows, out_cols, top_k, gather, ...)``: per expert e,

    out[e] (out_rows x out_cols, bf16) = sum over the rows r of e's segment of A[r, :]^T B[r, :]

in fp32, over the routing layout of the forward (templates/routing.py ``MoeRouting``): rows sorted
by expert and padded per expert to the routing's tile_m, ``expert_offsets`` [E + 1] the segment
bounds, ``sorted_ids`` [R] each row's routed pair p = m * top_k + k, or -1 for a padding row.
One operand is contiguous in that padded row order, the other is gathered by token: row r reads
row ``sorted_ids[r] // top_k`` of a [M, cols] tensor (zeros for a padding row). ``gather``
says which: "b" for dW13 = da^T x (A = da [R, 2I], B = x [M, H]), "a" for dW2 = dO^T (w h)
(A = dO [M, H], B = hw [R, I]). The reduction dimension K is the row dimension of both, so both
operands are MN-major in shared memory (bf16 wgmma reads either major order).

``__call__(a, b, sorted_ids, expert_offsets, expert_counts, out, stream)``. Expert e's K is its
rows counts[e] rounded up to whole 64-row k-tiles from offsets[e] (the routing's padding beyond
them is never read), read on the device: no host sync; an expert without rows gets a tile of
zeros. Every element of ``out`` is written by one CTA, in one fixed order of k-tiles: no
atomics, no split K, bitwise repeatable.

Persistent, warp-specialized CTAs (one per SM) walk the E x (out_rows / tile_m) x
(out_cols / tile_n) output tiles, expert by expert, in groups of RASTER_GROUP M tiles per N tile
(the operand strips of the resident tiles stay in L2). Per CTA:

- warpgroup 0 produces into a ``cutlass.pipeline.PipelineTmaAsync`` of ``stages`` A/B buffers:
  the contiguous operand by TMA (warp 0 alone, an MN-major box of the [cols, R] view), the
  gathered one by cp.async of 16-byte chunks from all 128 threads into the MN-major
  128-byte-swizzled layout, predicated off (zero-filled) for padding rows, each k-tile's source
  rows loaded one k-tile ahead and shared through shared memory; each thread hands its
  copies to the stage's full barrier with ``cp.async.mbarrier.arrive.noinc``, so no producer
  thread waits for its own loads;
- the consumers multiply (wgmma, one batch in flight, a stage released the batch after it was
  read) and store the tile from their accumulators, 16 bytes per lane after a quad transpose,
  while the producer already fills the next tile's stages. Cooperative (default): one consumer
  warpgroup per 64 rows of the tile (tile_m 128: two; 256: two, each with two 64-row blocks), so
  the tensor cores idle while the tile is stored. Gathered bytes cost the producer more than
  TMA'd ones (NOTES, thirteenth session), so the gathered operand goes on the narrow side: dW13
  (x gathered) in 256x128 tiles, dW2 (dO gathered) in 128x256. ``tma_store=True`` (cooperative,
  >= 128 rows): the tile leaves through shared memory instead, in (128, 32) subtiles written by
  stmatrix and stored by TMA, two buffers in flight, with no quad shuffles or 16-byte stores
  (measured 0-5% faster on the H200: the epilogue's instructions are not what limits).
  ``pingpong=True``: two consumer warpgroups, each on every other tile of the CTA's
  schedule (64x256 or 128x128 at most: 128 accumulators per thread). The producer fills the ring
  in schedule order, so one warpgroup's k-tiles follow the other's, and its mainloop runs while
  the other stores; each skips the other's k-tiles (that tile's expert's K, read from the
  routing) in its stage/phase state. The mainloops take turns in schedule order (two named
  barriers): a warpgroup starts waiting on its tile's stages only after the other has passed
  all of the previous tile's, since a parity wait more than one phase ahead of the producer
  passes at once, on a stage not yet filled. Meant for short K (DeepSeek-V3 at 4096 tokens: two
  k-tiles per tile), it measured 1.1-1.6x slower than the cooperative tiles on the H200 at every
  point (NOTES, thirteenth session): the store was not what limits.

Constraints (moe_aot/gemm_limits.py ``check_wgrad``, one sentence per refusal):
  * sm_90a; bf16 operands, fp32 accumulation, bf16 out; all tensors row-major, 16-byte aligned.
  * tile_m 64, 128 or 256, tile_n a multiple of 64 up to 256 (tile_m 256: up to 128, cooperative;
    ping-pong: tile_m * tile_n <= 64 * 256; tma_store: cooperative, tile_m >= 128), tile_k 64;
    out_rows % tile_m == 0, out_cols % tile_n == 0; 2 <= stages <= 8, shared memory stages * (tile_m + tile_n) * 128 B
    + 1 KB + barriers.
  * the routing's segments are whole k-tiles: every expert_offsets[e] is a multiple of 64
    (routing tile_m 64 or 128); the caller guarantees it, the launcher checks the routing tile_m.
  * the contiguous operand's padding rows are finite (zeros), so that with the gathered
    operand's zero-filled rows they add nothing.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.tensor_utils import LayoutEnum

from moe_aot import gemm_limits as limits

_LOAD_THREADS = limits.LOAD_THREADS  # the producer warpgroup
_CHUNK = limits.COPY_ELEMS  # bf16 elements of one 16-byte cp.async / store
_REGS_LOAD, _REGS_MMA = 40, 232  # setmaxnreg: 40 * 128 + 232 * 256 <= 64K
_TOK_BARRIER = 1  # named barrier of the producer warpgroup (0 is the CTA's)
_ORDER_BARRIER = 2  # ping-pong: warpgroup w waits on barrier 2 + w for its turn to run a mainloop
_EPI_BARRIER = 4  # tma_store: the consumers' barrier around each epilogue subtile
RASTER_GROUP = 8  # M tiles walked per N tile by consecutive tiles of an expert
PERSISTENT_CTAS = 132  # one CTA per SM of an H100 SXM / H200


class HopperWgrad:
    def __init__(self, num_experts: int, out_rows: int, out_cols: int, top_k: int, gather: str = "b",
                 tile_m: int = 128, tile_n: int = 128, tile_k: int = limits.WGRAD_TILE_K, stages: int = 4,
                 ctas: int = PERSISTENT_CTAS, pingpong: bool = False, tma_store: bool = False):
        ok, reason = limits.check_wgrad(out_rows, out_cols, gather, tile_m, tile_n, tile_k, stages, "sm_90a",
                                        pingpong, tma_store)
        if ok and (num_experts < 1 or top_k < 1 or ctas < 1):
            ok, reason = False, f"num_experts {num_experts}, top_k {top_k} and ctas {ctas} must be >= 1"
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.top_k, self.gather = num_experts, top_k, gather
        self.m, self.n = out_rows, out_cols
        self.tile_m, self.tile_n, self.tile_k, self.stages, self.ctas = tile_m, tile_n, tile_k, stages, ctas
        self.m_tiles, self.n_tiles = out_rows // tile_m, out_cols // tile_n
        self.tiles = num_experts * self.m_tiles * self.n_tiles
        # the gathered operand's tile width and columns, the contiguous one's
        self.g_cols = out_cols if gather == "b" else out_rows
        self.g_tile = tile_n if gather == "b" else tile_m
        self.c_tile = tile_m if gather == "b" else tile_n
        rows = _LOAD_THREADS // (self.g_tile // _CHUNK)  # gathered rows per pass of the producers
        self.g_passes = -(-tile_k // rows)  # cp.async per thread per k-tile
        self.g_exact = rows * (self.g_tile // _CHUNK) == _LOAD_THREADS and tile_k % rows == 0
        self.pingpong, self.tma_store = pingpong, tma_store
        # cooperative: one consumer warpgroup per 64 rows of the tile (256 rows: two of 2 x 64 rows);
        # ping-pong: two, one per tile
        self.mma_threads = 256 if pingpong else min(2 * tile_m, 256)
        self.stage_threads = 128 if pingpong else self.mma_threads  # consumer threads reading one stage

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        r = cute.sym_int32(symbol="R", divisibility=self.tile_k)
        tokens = cute.sym_int32(symbol="M")
        rows_a = tokens if self.gather == "a" else r
        rows_b = tokens if self.gather == "b" else r
        e, m, n = self.num_experts, self.m, self.n
        return [
            ("a", make_fake_tensor(BFloat16, (rows_a, m), (m, 1), assumed_align=16)),
            ("b", make_fake_tensor(BFloat16, (rows_b, n), (n, 1), assumed_align=16)),
            ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=4)),
            ("expert_offsets", make_fake_tensor(Int32, (e + 1,), (1,), assumed_align=4)),
            ("expert_counts", make_fake_tensor(Int32, (e,), (1,), assumed_align=4)),
            ("out", make_fake_tensor(BFloat16, (e, m, n), (m * n, n, 1), assumed_align=16)),
            ("stream", make_fake_stream()),
        ]

    # ------------------------------------------------------------------ host side
    def _smem_layouts(self):
        tile = (self.tile_m, self.tile_n, self.tile_k)
        sa = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, tile, BFloat16, self.stages)
        sb = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, tile, BFloat16, self.stages)
        return sa, sb

    def _make_tiled_mma(self):
        mn = LayoutEnum.COL_MAJOR.sm90_mma_major_mode()
        # ping-pong: one warpgroup per tile (128 rows as 2 blocks); cooperative: 1-2 (256 rows: 2 blocks each)
        warpgroups = 1 if self.pingpong else min(self.tile_m // 64, 2)
        return sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, mn, mn, Float32, (warpgroups, 1, 1),
                                                 tiler_mn=(64, self.tile_n))

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sorted_ids: cute.Tensor, expert_offsets: cute.Tensor,
                 expert_counts: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
        sa, sb = self._smem_layouts()
        if const_expr(self.gather == "b"):
            cont, layout, gathered = a, sa, b
        else:
            cont, layout, gathered = b, sb, a
        # the contiguous operand as the MN-major [cols, R] matrix TMA boxes are cut from
        cols = self.m if const_expr(self.gather == "b") else self.n
        mT = cute.make_tensor(cont.iterator, cute.make_layout((cols, cute.size(cont, mode=[0])), stride=(1, cols)))
        tma, mTt = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mT, cute.slice_(layout, (None, None, 0)),
            (self.c_tile, self.tile_k))
        grid = min(self.tiles, self.ctas)
        launch = dict(grid=[grid, 1, 1], block=[_LOAD_THREADS + self.mma_threads, 1, 1], stream=stream,
                      min_blocks_per_mp=1)
        if const_expr(self.tma_store):
            # out as one [E * rows, cols] matrix, stored by TMA from (128, 32) subtiles
            out2d = cute.make_tensor(out.iterator, cute.make_layout((self.num_experts * self.m, self.n),
                                                                    stride=(self.n, 1)))
            tma_c, mOutT = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), out2d,
                cute.slice_(self._epi_layout(), (None, None, 0)), limits.WGRAD_EPI_TILE)
            self.kernel_ts(tma, mTt, gathered, sorted_ids, expert_offsets, expert_counts, tma_c, mOutT).launch(
                **launch)
        else:
            self.kernel(tma, mTt, gathered, sorted_ids, expert_offsets, expert_counts, out).launch(**launch)

    def _epi_layout(self):
        """tma_store: the staged shared-memory layout of the epilogue's row-major subtiles."""
        return sm90_utils.make_smem_layout_epi(BFloat16, LayoutEnum.ROW_MAJOR, limits.WGRAD_EPI_TILE,
                                               limits.WGRAD_EPI_STAGES)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma: cute.CopyAtom, mTt: cute.Tensor, mG: cute.Tensor, mIds: cute.Tensor,
               mOffs: cute.Tensor, mCounts: cute.Tensor, mOut: cute.Tensor):
        self._body(tma, mTt, mG, mIds, mOffs, mCounts, (mOut,))

    @cute.kernel
    def kernel_ts(self, tma: cute.CopyAtom, mTt: cute.Tensor, mG: cute.Tensor, mIds: cute.Tensor,
                  mOffs: cute.Tensor, mCounts: cute.Tensor, tma_c: cute.CopyAtom, mOutT: cute.Tensor):
        self._body(tma, mTt, mG, mIds, mOffs, mCounts, (tma_c, mOutT))

    @cute.jit
    def _body(self, tma, mTt, mG, mIds, mOffs, mCounts, epi):
        """epi: (out,) for the register epilogue, (TMA store atom, out's TMA view) for tma_store."""
        tidx, _, _ = cute.arch.thread_idx()
        sA, sB, sTok = self._smem_tensors()
        sC = None
        if const_expr(self.tma_store):
            el = self._epi_layout()
            buf = cutlass.memory.SmemAllocator().allocate(cute.cosize(el.outer) * 2, byte_alignment=1024)
            sC = cute.make_tensor(cute.recast_ptr(buf, el.inner, BFloat16), el.outer)
        pipe = self._make_pipeline()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp < _LOAD_THREADS // 32:
            if const_expr(self.mma_threads == 256):  # 384 threads: the consumers take the registers
                cute.arch.setmaxregister_decrease(_REGS_LOAD)
            self._produce(tidx, warp, pipe, tma, mTt, mG, mIds, (mOffs, mCounts), sA, sB, sTok)
        else:
            if const_expr(self.mma_threads == 256):
                cute.arch.setmaxregister_increase(_REGS_MMA)
            self._consume(tidx - _LOAD_THREADS, pipe, sA, sB, (mOffs, mCounts), epi, sC)

    @cute.jit
    def _smem_tensors(self):
        sa, sb = self._smem_layouts()
        smem = cutlass.memory.SmemAllocator()
        a_bytes = self.stages * self.tile_m * self.tile_k * 2
        base = smem.allocate(a_bytes + self.stages * self.tile_n * self.tile_k * 2, byte_alignment=1024)
        sA = cute.make_tensor(cute.recast_ptr(base, sa.inner, BFloat16), sa.outer)
        sB = cute.make_tensor(cute.recast_ptr(base + a_bytes, sb.inner, BFloat16), sb.outer)
        toks = smem.allocate_array(Int32, self.tile_k * self.stages, byte_alignment=16)
        return sA, sB, cute.make_tensor(toks, cute.make_layout((self.tile_k, self.stages)))

    @cute.jit
    def _make_pipeline(self):
        """Full barriers: the TMA bytes of a stage (warp 0's elected arrival) plus one cp.async
        arrival per producer thread; empty barriers: one arrival per warp of the consumers that read
        the stage (ping-pong: one warpgroup)."""
        bars = cutlass.memory.SmemAllocator().allocate_array(Int64, 2 * self.stages, byte_alignment=8)
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=bars, num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + _LOAD_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.stage_threads // 32),
            tx_count=self.c_tile * self.tile_k * 2, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

    @cute.jit
    def _tile_of(self, t):
        """(expert, M tile, N tile) of linear tile t: experts in order; inside one, groups of
        RASTER_GROUP M tiles walked N tile by N tile."""
        per_e = self.m_tiles * self.n_tiles
        e = t // per_e
        local = t - e * per_e
        group = local // (RASTER_GROUP * self.n_tiles)
        first_m = group * RASTER_GROUP
        size = self.m_tiles - first_m
        if size > RASTER_GROUP:
            size = Int32(RASTER_GROUP)
        idx = local - first_m * self.n_tiles
        return e, first_m + idx % size, idx // size

    @cute.jit
    def _k_range(self, routing, e):
        """(first k-tile, k-tiles) of expert e: its rows from offsets[e] in whole k-tiles (a
        routing tile_m of 128 pads up to 127 rows, of which whole k-tiles are skipped)."""
        mOffs, mCounts = routing
        return mOffs[e] // self.tile_k, (mCounts[e] + self.tile_k - 1) // self.tile_k

    @cute.jit
    def _produce(self, tidx, warp, pipe, tma, mTt, mG, mIds, routing, sA, sB, sTok):
        """Warp 0 issues the contiguous operand's TMA; all 128 threads gather the other one. The
        k-tile's 64 source rows go through shared memory (``sTok``, one slot per stage): thread
        t < 64 loads row t's pair one k-tile ahead and publishes its token (-1: padding) after a
        barrier of the producer warpgroup, so no thread waits on a global load per chunk."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma)
        if const_expr(self.gather == "b"):
            sC, sG = sA, sB
        else:
            sC, sG = sB, sA
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), BFloat16,
            num_bits_per_copy=128)
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        # thread t copies chunk t % cpr of rows t // cpr, + rows, + 2 rows, ... (rows: the
        # gathered rows one pass of the warpgroup covers; 192-wide tiles leave 8 threads idle)
        cpr = self.g_tile // _CHUNK
        rows = _LOAD_THREADS // cpr
        col_chunk = tidx % cpr
        r0 = tidx // cpr
        for t in range(bid, self.tiles, nctas):
            e, mt, nt = self._tile_of(t)
            kt0, k_tiles = self._k_range(routing, e)
            ct, gt = mt, nt
            if const_expr(self.gather == "a"):
                ct, gt = nt, mt
            gC = cute.local_tile(mTt, (self.c_tile, self.tile_k), (ct, None))
            tCsC, tCgC = cute.nvgpu.cpasync.tma_partition(
                tma, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC, 0, 2))
            pid = Int32(-1)  # thread t < 64: the pair of row t of the next k-tile
            if tidx < self.tile_k and k_tiles > 0:
                pid = mIds[kt0 * self.tile_k + tidx]
            for kt in range(k_tiles):
                cur = pid
                if tidx < self.tile_k and kt + 1 < k_tiles:
                    pid = mIds[(kt0 + kt + 1) * self.tile_k + tidx]  # consumed next k-tile
                pipe.sync_object_empty.wait(state.index, state.phase)
                if warp == 0:
                    pipe.sync_object_full.arrive(state.index, None)  # elected: expect the TMA bytes
                    cute.copy(tma, tCgC[None, kt0 + kt], tCsC[None, state.index],
                              tma_bar_ptr=pipe.producer_get_barrier(state))
                if tidx < self.tile_k:
                    tok = Int32(-1)
                    if cur >= 0:
                        tok = cur // self.top_k
                    sTok[tidx, state.index] = tok
                # the slot is rewritten `stages` k-tiles later, after every producer thread has
                # passed this barrier's successors, hence finished reading it
                cute.arch.barrier(barrier_id=_TOK_BARRIER, number_of_threads=_LOAD_THREADS)
                for i in cutlass.range_constexpr(self.g_passes):
                    k = r0 + i * rows
                    if const_expr(self.g_exact):
                        self._gather_chunk(atom, mG, sG, sTok, state.index, gt * cpr + col_chunk, col_chunk, k)
                    elif tidx < rows * cpr and k < self.tile_k:
                        self._gather_chunk(atom, mG, sG, sTok, state.index, gt * cpr + col_chunk, col_chunk, k)
                cute.arch.cp_async_mbarrier_arrive_noinc(pipe.producer_get_barrier(state))
                state.advance()
        if warp == 0:
            pipe.producer_tail(state)

    @cute.jit
    def _gather_chunk(self, atom, mG, sG, sTok, stage, src_chunk, col_chunk, k):
        """cp.async of chunk ``src_chunk`` of k row ``k``'s token row into chunk ``col_chunk`` of
        that row in stage ``stage``; zero-filled (source size 0) for a padding row."""
        tok = sTok[k, stage]
        pred = cute.make_rmem_tensor(cute.make_layout((1,)), cutlass.Boolean)
        pred[0] = tok >= 0
        src = self._chunk(mG, cutlass.max(tok, 0), src_chunk)
        dst = cute.tiled_divide(cute.local_tile(sG[None, None, stage], (_CHUNK, 1), (col_chunk, k)), (_CHUNK, 1))
        cute.copy(atom, src, dst[None, 0, 0], pred=pred)

    @cute.jit
    def _chunk(self, mG, row, chunk):
        """16-byte chunk ``chunk`` of row ``row`` of the gathered [M, g_cols] operand, as a
        ((8, 1)) tensor (the shape of a shared-memory chunk, below); the row offset formed in
        64 bits."""
        base = (mG.iterator + Int64(row) * self.g_cols + chunk * _CHUNK).align(16)
        return cute.make_tensor(base, cute.make_layout(((_CHUNK, 1),), stride=((1, 0),)))

    @cute.jit
    def _consume(self, ctid, pipe, sA, sB, routing, epi, sC):
        tiled_mma = self._make_tiled_mma()
        warp_group = cute.arch.make_warp_uniform(ctid // 128)
        if const_expr(self.pingpong):
            # each warpgroup multiplies a whole tile: thread ctid % 128 of the tile's MMA
            ctid = ctid % 128
            thr_mma = tiled_mma.get_slice(0)
        else:
            thr_mma = tiled_mma.get_slice(warp_group * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        num_kb = cute.size(tCrA, mode=[2])
        coords = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = tiled_mma.make_fragment_C(coords.shape)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        ts = None
        if const_expr(self.tma_store):
            ts = self._tma_store_setup(ctid, tiled_mma, acc, sC)
        first, step = bid, nctas
        if const_expr(self.pingpong):
            # warpgroup 1 takes the schedule's odd tiles: it starts past the first tile's k-tiles
            first, step = bid + warp_group * nctas, 2 * nctas
            skip = self._k_tiles_of(routing, bid) * warp_group
            read.advance(skip)
            release.advance(skip)
        for t in range(first, self.tiles, step):
            e, mt, nt = self._tile_of(t)
            _, k_tiles = self._k_range(routing, e)
            if const_expr(self.pingpong):
                # mainloops in schedule order: wait until the previous tile's (the other
                # warpgroup's) has passed all its full barriers, so that this one never waits on a
                # barrier more than one phase ahead of the producer (parity waits alias there)
                if t > bid:
                    cute.arch.barrier(barrier_id=_ORDER_BARRIER + warp_group, number_of_threads=256)
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.fence()
            for kt in range(k_tiles):
                pipe.consumer_wait(read)
                # the gathered operand arrived by cp.async (generic proxy); wgmma reads through
                # the async proxy
                cute.arch.fence_proxy("async.shared", space="cta")
                for kb in cutlass.range_constexpr(num_kb):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kb, read.index], tCrB[None, None, kb, read.index],
                              acc)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)
                if kt > 0:
                    pipe.consumer_release(release)
                    release.advance()
                read.advance()
            if const_expr(self.pingpong):
                if t + nctas < self.tiles:  # the next tile's mainloop may start
                    cute.arch.barrier_arrive(barrier_id=_ORDER_BARRIER + 1 - warp_group, number_of_threads=256)
            cute.nvgpu.warpgroup.wait_group(0)
            if k_tiles > 0:
                pipe.consumer_release(release)
                release.advance()
            if const_expr(self.pingpong):
                # the other warpgroup's tile comes next in the ring
                skip = self._k_tiles_of(routing, t + nctas)
                read.advance(skip)
                release.advance(skip)
            if const_expr(self.tma_store):
                self._store_tma(ctid, acc, ts, sC, epi, e, mt, nt)
            else:
                self._store(acc, coords, epi[0], e, mt, nt)
        if const_expr(self.tma_store):
            ts[-1].producer_tail()  # the last subtiles' TMA stores have read their buffers

    @cute.jit
    def _tma_store_setup(self, ctid, tiled_mma, acc, sC):
        """tma_store: the register -> shared copy (stmatrix) of the accumulators in (128, 32)
        subtiles, and the pipeline that bounds the TMA stores in flight."""
        r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, BFloat16, Float32),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16), tiled_mma))
        thr = r2s.get_slice(ctid)
        tRS_sD = thr.partition_D(sC)
        tRS_rAcc = r2s.retile(acc)
        rd_shape = cute.make_layout(cute.shape(thr.partition_S(sC))[:3]).shape
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=limits.WGRAD_EPI_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads))
        return r2s, tRS_sD, tRS_rAcc, rd_shape, store_pipe

    @cute.jit
    def _store_tma(self, ctid, acc, ts, sC, epi, e, mt, nt):
        """tma_store: per (128, 32) subtile, the consumers convert their accumulators to bf16 and
        stmatrix them into one of the subtile buffers; after a barrier, consumer warp 0 stores it
        by TMA and waits until the older buffer's store has read it (PipelineTmaStore), and a
        second barrier hands that buffer back."""
        r2s, tRS_sD, tRS_rAcc, rd_shape, store_pipe = ts
        tma_c, mOutT = epi
        epi_m, epi_n = limits.WGRAD_EPI_TILE
        gC = cute.local_tile(mOutT, (self.tile_m, self.tile_n), (e * self.m_tiles + mt, nt))
        gSub = cute.zipped_divide(gC, limits.WGRAD_EPI_TILE)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gSub)
        n_subs = self.tile_n // epi_n
        subs = (self.tile_m // epi_m) * n_subs
        rD = cute.make_rmem_tensor(rd_shape, Float32)
        rD_out = cute.make_rmem_tensor(rd_shape, BFloat16)
        n_rd = cute.size(rD)
        for sub in cutlass.range_constexpr(subs):
            for v in cutlass.range_constexpr(n_rd):
                rD[v] = tRS_rAcc[sub * n_rd + v]
            rD_out.store(rD.load().to(BFloat16))
            buf = sub % limits.WGRAD_EPI_STAGES
            cute.copy(r2s, rD_out, tRS_sD[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=self.mma_threads)
            if ctid < 32:
                # the retiled accumulators ((8, tile_n / 16), row blocks, 1) run over a 128-row
                # block's columns first: subtile `sub` is column block sub % n_subs of row block
                # sub // n_subs
                cute.copy(tma_c, bSG_sD[(None, buf)], bSG_gD[(None, (sub // n_subs, sub % n_subs))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=self.mma_threads)

    @cute.jit
    def _k_tiles_of(self, routing, t):
        """Ping-pong: the k-tiles of tile t (the other warpgroup's), 0 past the schedule's end;
        branch-free, so that the states advance by it outside any branch."""
        e, _, _ = self._tile_of(cutlass.min(t, self.tiles - 1))
        _, k_tiles = self._k_range(routing, e)
        return k_tiles * Int32(t < self.tiles)

    @cute.jit
    def _store(self, acc, coords, mOut, e, mt, nt):
        """The tile from the accumulators: element v + 2h + 4j + b * tile_n / 2 of a warpgroup's
        fragment ((2, 2, tile_n / 8), blocks, 1) is row r0 + 8h + 64b, column c0 + 8j + v (blocks:
        the 64-row blocks a warpgroup holds, 2 for a 128-row ping-pong tile); per row and group of
        four n8 blocks the quad exchanges its bf16 pairs (_quad_transpose) and lane q stores
        block 4G + q as one 16-byte vector."""
        lane = cute.arch.lane_idx()
        q = lane % 4
        quad0 = lane - q
        per_block = cute.size(acc, mode=[0])
        for hb in cutlass.range_constexpr(2 * cute.size(acc, mode=[1])):
            h, base = hb % 2, (hb // 2) * per_block
            r, c = coords[base + 2 * h]
            row = (Int64(e) * self.m + mt * self.tile_m + r) * self.n
            col0 = nt * self.tile_n + c - 2 * q + 8 * q  # column of block q of this lane's group
            for grp in cutlass.range_constexpr(self.tile_n // 32):
                packed = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                for i in cutlass.range_constexpr(4):
                    j = 4 * grp + i
                    frag = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                    frag[0] = acc[base + 2 * h + 4 * j]
                    frag[1] = acc[base + 2 * h + 4 * j + 1]
                    pair = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
                    pair.store(frag.load().to(BFloat16))
                    packed[i] = cute.recast_tensor(pair, Int32)[0]
                chunk = self._quad_transpose(packed, q, quad0)
                dst = cute.make_tensor((mOut.iterator + row + col0 + 32 * grp).align(16), cute.make_layout(_CHUNK))
                dst.store(cute.recast_tensor(chunk, BFloat16).load())

    @cute.jit
    def _quad_transpose(self, packed, q, quad0):
        """Lane q of a quad holds, as packed[i], its bf16 pair (columns 2q, 2q + 1) of n8 block i
        of a group of four; returns block q's four pairs in column order (a 16-byte chunk).
        Round s: lane q sends its pair of block q ^ s to lane q ^ s and receives that lane's
        pair of block q."""
        got = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for s in cutlass.range_constexpr(4):
            got[s] = cute.arch.shuffle_sync(self._pick(packed, q ^ s), quad0 + (q ^ s))
        chunk = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for src in cutlass.range_constexpr(4):
            chunk[src] = self._pick(got, q ^ src)  # lane src's pair came in round q ^ src
        return chunk

    @cute.jit
    def _pick(self, t, k):
        """t[k] for a run-time k in 0..3, by selects (no dynamic register indexing)."""
        v = t[0]
        for i in cutlass.range_constexpr(1, 4):
            if k == i:
                v = t[i]
        return v

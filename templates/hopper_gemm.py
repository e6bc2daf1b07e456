"""Hopper grouped GEMMs of a fused MoE layer built from the DSL's own machinery (mma="hopws",
cooperative, and mma="hoppp", ping-pong).

Persistent, warp-specialized CTAs (one per SM) walk the (N tile, M tile) space of the routing
layout in the raster order of the other kernels. Per CTA:

- warpgroup 0 produces into a ``cutlass.pipeline.PipelineTmaAsync`` of ``stages`` A/B buffers
  (the canonical 128-byte-swizzled K-major wgmma layouts):
    * GEMM2 (``HopperDownGemm``): A (``h``, already in expert-sorted padded order) and B (the
      tile's expert's down weights) both by TMA, issued by warp 0 alone;
    * GEMM1 (``HopperGluGemm``): B by TMA (warp 0) and the gathered token rows of A by cp.async
      from all 128 producer threads, each of which hands its copies to the stage's full barrier
      with ``cp.async.mbarrier.arrive.noinc``, so no producer thread ever waits for its own
      loads: the pipeline runs ``stages`` k-tiles deep for A as it does for TMA.
- consumers wait on each full stage, run wgmma with one batch in flight and release the stage
  the batch before read; the epilogue (GLU or routing-weight scale) is written straight from the
  accumulators (``_epilogue_regs`` of grouped_gemm.py) while the producer already fills the next
  tile's stages. Two ways to use the consumer warpgroups:
    * "hopws" (cooperative): one warpgroup per 64 rows (two for 128-row tiles) on one tile; the
      tensor cores idle during the epilogue;
    * "hoppp" (ping-pong, 64- or 128-row tiles): two warpgroups, each on every other tile of the CTA's
      schedule. The producer fills the ring in tile order, so warpgroup 1's k-tiles follow
      warpgroup 0's: its mainloop runs while warpgroup 0 writes its epilogue, and the other
      way round. Each warpgroup skips the other's k-tiles in the ring's stage/phase state and
      reads every other schedule slot; the producer ends the schedule in both slots. The two
      mainloops take turns in schedule order (``_make_order``): a warpgroup starts waiting on
      its tile's stages only once the other has passed its last full barrier, since a parity
      wait on a stage whose previous fill has not landed would pass a phase early.

The stage/phase state runs on across tiles. Padding rows of A (GEMM1) are never loaded: they hold
whatever the stage held before, which reaches only those rows' outputs (rows of a product are
independent), and the epilogue writes zeros (GEMM1) or nothing (GEMM2) for them.

Constraints (beyond those of ``GroupedGluGemm`` / ``GroupedDownGemm`` with mma="hopws"):
  * sm_90a only (wgmma, TMA, setmaxnreg); tile_m 64 or 128, tile_n a multiple of 32 up to 256
    (hoppp at tile_m 128: up to 128, a warpgroup's accumulators in two 64-row blocks),
    tile_k 64, stages >= 3; shared memory stages * (tile_m + tile_n) * 128 B + 1 KB + barriers.
  * grid min(tiles, ctas) persistent CTAs of 128 + tile_m * 2 threads (hoppp: 384).
  * cluster_m 2: hopws with 128-row tiles only. The CTA pair takes two M tiles of one expert
    wherever the expert has two left (the weight tile multicast, read once for both), else two
    experts' last tiles (_pair_units; 10 KB of shared memory for the list). A consumer
    warpgroup whose 64 rows of the tile are all padding, or of the duplicate tile, issues no
    wgmma (skip_padding, _rows_live); single CTAs do not skip (see __init__).
  * pdl=True: every thread waits for the previous grid before its first read.
  * raster_experts (cluster_m 1): the raster groups (RASTER_GROUP M tiles walked N tile by N
    tile) end at an expert's last tile wherever the expert starts within the group's first
    RASTER_GROUP tiles, so that no expert of up to RASTER_GROUP tiles has its weight tiles read
    by two groups (two passes over them, far apart in time: with the fixed groups, ~1.2-1.5x the
    weight bytes at 4096 tokens, e.g. Qwen3 with 64-row tiles). Each producer warp walks the
    groups with a cursor (one warp-wide load of the next group's tile experts per group); the
    consumers get the tile as M tile * N tiles + N tile.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from moe_aot import gemm_limits as limits

from .grouped_gemm import _LOAD_THREADS, RASTER_GROUP, GroupedDownGemm, GroupedGluGemm

MMAS = limits.WARP_SPECIALIZED  # "hopws" cooperative, "hoppp" ping-pong
EVICT_FIRST = 0x12F0000000000000  # the L2 cache policy word of an evict-first TMA load (PTX createpolicy)
SCHED_SLOTS = 2  # tiles the producer may publish ahead of the consumers (hoppp: one per warpgroup)
CLUSTERS_M = limits.CLUSTERS_M  # CTAs per cluster along M; 2: the weight tile is multicast to both


class _HopperWs:
    """The persistent producer/consumer loop shared by both GEMMs (see the module docstring)."""

    warp_specialized = True

    @property
    def row_weights(self) -> bool:
        """Whether the schedule carries each row's routing weight (epi[1], [M, top_k]): GEMM2's
        epilogue scales by it (and the backward's dH, templates/hopper_bwd.py)."""
        return not self.glu

    def __init__(self, *args, mma: str = MMAS[0], cluster_m: int = 1, pair_list: bool = True,
                 b_evict_first: bool = False, skip_padding: bool = True, raster_experts: bool = False,
                 **kwargs):
        if mma not in MMAS:
            raise ValueError(f"{type(self).__name__} implements mma in {MMAS}, not {mma!r}")
        super().__init__(*args, mma=mma, **kwargs)  # the tile rules
        ok, reason = limits.check_cluster(mma, self.tile_m, cluster_m)
        if ok:
            ok, reason = limits.check_raster(mma, cluster_m, self.precision, raster_experts)
        if not ok:
            raise ValueError(reason)
        self.cluster_m = cluster_m
        # raster groups cut at expert boundaries (see the module docstring); False: fixed groups
        self.raster_experts = raster_experts
        # cluster_m 2: pair the M tiles of one expert (_pair_units); False: tiles 2j and 2j + 1
        # whatever their experts (the pairing measured until 2026-12-02, kept for comparisons)
        self.pair_list = pair_list
        self.b_evict_first = b_evict_first
        self.pingpong = mma in limits.PINGPONG
        # 2-CTA clusters (128-row cooperative tiles): a consumer warpgroup whose 64 rows are all
        # padding (an expert's last tile holding <= 64 rows), or the cluster's duplicate tile,
        # issues no wgmma (_rows_live). Not without clusters: there the tile then finishes
        # early, the persistent CTAs drift out of the lockstep their static raster relies on,
        # and L2 stops serving the gathered rows (DeepSeek-V3 16384: L2 hit rate 47% -> 15%,
        # GEMM1 +30%; NOTES, nineteenth session); a cluster's pair moves in step. False: every
        # warpgroup multiplies every tile (the kernels before 2026-12-03), kept for comparisons.
        self.skip_padding = skip_padding and cluster_m > 1
        # consumer threads that read one stage (and one schedule slot)
        self.stage_threads = 128 if self.pingpong else self.mma_threads
        if self.ctas % cluster_m:
            raise ValueError(f"ctas {self.ctas} must be a multiple of cluster_m {cluster_m}")

    def _b_policy(self):
        """The L2 cache policy of the weights' TMA loads: evict-first where b_evict_first (each
        weight k-tile is read by one unit of the schedule, so the gathered activation rows,
        re-read for every N tile, keep their lines), else the default (None)."""
        return Int64(EVICT_FIRST) if self.b_evict_first else None

    @cute.jit
    def _make_tma_a(self, mA):
        """TMA atom over A as a [R, K] matrix, one (tile_m, tile_k) box per k-tile of an M tile."""
        return self._tma_atom(mA, "a")

    @cute.jit
    def _make_pipeline(self):
        """Full barriers: the TMA bytes of a stage plus, for GEMM1, one cp.async arrival per
        producer thread; empty barriers: one arrival per consumer warp."""
        bars = cutlass.memory.SmemAllocator().allocate_array(Int64, 2 * self.stages, byte_alignment=8)
        tx = self.tile_n * self.tile_k * self.elem_bytes
        producers = 1
        if const_expr(self.glu):
            producers = 1 + _LOAD_THREADS
        else:
            tx = tx + self.tile_m * self.tile_k * self.elem_bytes
        # cluster_m 2: each consumer warp releases a stage in both CTAs (lane r arrives on CTA
        # r's empty barrier), since either may multicast its half of B into the other's stage
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=bars, num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.cluster_m * self.stage_threads // 32),
            tx_count=tx, cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)))

    @cute.jit
    def _make_schedule(self):
        """The tile schedule from the producer to the consumers: SCHED_SLOTS slots in shared
        memory, each the linear tile index (-1: no more tiles) and, per tile row, its routed
        pair and (GEMM2) routing weight, loaded by producer warp 0 while it runs ahead of the
        consumers, so that the consumers make no global load but their epilogue's stores."""
        alloc = cutlass.memory.SmemAllocator()
        bars = alloc.allocate_array(Int64, 2 * SCHED_SLOTS, byte_alignment=8)
        tiles = cute.make_tensor(alloc.allocate_array(Int32, SCHED_SLOTS, byte_alignment=16),
                                 cute.make_layout(SCHED_SLOTS))
        pairs = cute.make_tensor(alloc.allocate_array(Int32, SCHED_SLOTS * self.tile_m, byte_alignment=16),
                                 cute.make_layout((self.tile_m, SCHED_SLOTS)))
        scales = cute.make_tensor(alloc.allocate_array(Float32, SCHED_SLOTS * self.tile_m, byte_alignment=16),
                                  cute.make_layout((self.tile_m, SCHED_SLOTS)))
        sched = pipeline.PipelineAsync.create(
            barrier_storage=bars, num_stages=SCHED_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.stage_threads))
        return sched, tiles, pairs, scales

    @cute.jit
    def _make_order(self):
        """hoppp: the turns of the two consumer warpgroups' mainloops (``pipeline.PipelineOrder``,
        one mbarrier per warpgroup, 128 arrivals each): a warpgroup waits for its turn before its
        tile's first full-barrier wait and hands the turn on after its last one. Without it a
        warpgroup may wait on a stage whose previous fill (the other warpgroup's) has not landed:
        its parity wait then passes one phase early (the producer publishing a tile means its
        loads were issued, not that they landed), it reads a stage not yet filled and releases
        it, and the ring's phases drift apart (fp8 GEMM2 with as many stages as k-tiles crashed
        under timing, 2026-12-01; the wgrad ping-pong hung the same way, NOTES 2026-12-02). Group
        0 creates it; _consume_ws makes each warpgroup's own view."""
        bars = cutlass.memory.SmemAllocator().allocate_array(Int64, 2, byte_alignment=8)
        return pipeline.PipelineOrder.create(barrier_storage=bars, depth=1, length=2, group_id=0,
                                             producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128))

    @cute.jit
    def _order_of(self, order, warp_group):
        """hoppp: warpgroup ``warp_group``'s view of the turns of _make_order and its state
        (warpgroup 0 has the first turn: its state starts one phase on)."""
        mine = pipeline.PipelineOrder(order.sync_object_full, 1, 2, warp_group,
                                      pipeline.PipelineState(1, Int32(0), Int32(0), 1 - warp_group))
        return mine, pipeline.PipelineState(1, Int32(0), Int32(0), 1 - warp_group)

    @cute.jit
    def _hand_turn(self, order, turn):
        """hoppp: hand the turn to the other warpgroup; returns ``turn`` advanced (rebind it in
        the caller: the DSL carries a loop's state only through names assigned or whose methods
        are called in the loop, not through arguments mutated by a callee)."""
        order.arrive(turn)
        return turn

    @cute.jit
    def _ws_tiles(self, tidx, tma_a, mAt, tma_b, mWt, mA, mIds, mTileExpert, epi, tma_bm=None):
        self._grid_dependency_wait()
        tiled_mma = self._make_tiled_mma()
        sA, sB, _ = self._smem_tensors()
        pipe = self._make_pipeline()
        sched = self._make_schedule()
        order = self._make_order() if const_expr(self.pingpong) else None
        s_units = None
        if const_expr(self.cluster_m > 1):
            s_units = cute.make_tensor(
                cutlass.memory.SmemAllocator().allocate_array(Int32, limits.PAIR_LIST_WORDS, byte_alignment=16),
                cute.make_layout(limits.PAIR_LIST_WORDS))
        num_m_tiles = cute.size(mTileExpert, mode=[0])
        total = num_m_tiles * (self.n // self.tile_n)
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp < _LOAD_THREADS // 32:
            self._set_regs(True)
            if const_expr(self.cluster_m > 1):
                if const_expr(self.glu):
                    self._produce_mc(tidx, warp, pipe, sched, tma_a, mAt, tma_b, tma_bm, mWt, mA, mIds,
                                     mTileExpert, sA, sB, epi, bid, nctas, num_m_tiles, s_units)
                elif warp == 0:
                    self._produce_mc(tidx, warp, pipe, sched, tma_a, mAt, tma_b, tma_bm, mWt, mA, mIds,
                                     mTileExpert, sA, sB, epi, bid, nctas, num_m_tiles, s_units)
            elif const_expr(self.glu):
                self._produce_ws(tidx, warp, pipe, sched, tma_a, mAt, tma_b, mWt, mA, mIds, mTileExpert,
                                 sA, sB, epi, bid, nctas, total, num_m_tiles)
            elif warp == 0:
                self._produce_ws(tidx, warp, pipe, sched, tma_a, mAt, tma_b, mWt, mA, mIds, mTileExpert,
                                 sA, sB, epi, bid, nctas, total, num_m_tiles)
        else:
            self._set_regs(False)
            self._consume_ws(tidx - _LOAD_THREADS, pipe, sched, tiled_mma, sA, sB, epi, num_m_tiles, order)

    @cute.jit
    def _b_tiles(self, mWt, expert, bn):
        """The k-tiles (tile_n, tile_k, K / tile_k) of N tile ``bn`` of ``expert``'s weights in the
        TMA view of _make_tma_b."""
        if const_expr(self.b_mn):
            gB = cute.local_tile(mWt, (self.tile_n, self.tile_k), (bn, None, expert))
        else:
            gB = cute.local_tile(mWt, (self.tile_n, self.tile_k), (expert * (self.n // self.tile_n) + bn, None))
        return gB

    @cute.jit
    def _publish(self, sched, sstate, t, row0, mIds, epi):
        """Producer warp 0: hand tile ``t`` (or -1) and its rows' pairs and routing weights to
        the consumers through the schedule slot of ``sstate`` (the caller advances it)."""
        pipe_s, tiles, pairs, scales = sched
        lane = cute.arch.lane_idx()
        pipe_s.sync_object_empty.wait(sstate.index, sstate.phase)
        if t >= 0:
            for i in cutlass.range_constexpr(self.tile_m // 32):
                r = i * 32 + lane
                p = mIds[row0 + r]
                pairs[r, sstate.index] = p
                if const_expr(self.row_weights):
                    mTopkW = epi[1]
                    w = Float32(0.0)
                    if p >= 0:
                        w = mTopkW[p // self.top_k, p % self.top_k]
                    scales[r, sstate.index] = w
        if lane == 0:
            tiles[sstate.index] = t
        cute.arch.sync_warp()
        if lane == 0:
            pipe_s.producer_commit(sstate)

    @cute.jit
    def _produce_ws(self, tidx, warp, pipe, sched, tma_a, mAt, tma_b, mWt, mA, mIds, mTileExpert, sA, sB,
                    epi, bid, nctas, total, num_m_tiles):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        sstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCHED_SLOTS)
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            if const_expr(not self.glu):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
        tiled_copy = self._make_g2s_copy()
        thr_copy = tiled_copy.get_slice(tidx)
        tAsA_cp = thr_copy.partition_D(sA)  # GEMM1: (CPY, CPY_M, CPY_K, PIPE)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        copies = (tiled_copy, tAsA_cp, tAcA, sA)
        if const_expr(self.raster_experts):
            n_tiles = self.n // self.tile_n
            g_first = Int32(0)  # the group holding the walk's tile: its first M tile, size, first index
            g_size = self._group_size(mTileExpert, g_first, num_m_tiles)
            g_base = Int32(0)
            for t in range(bid, total, nctas):
                while t >= g_base + g_size * n_tiles:
                    g_base = g_base + g_size * n_tiles
                    g_first = g_first + g_size
                    g_size = self._group_size(mTileExpert, g_first, num_m_tiles)
                idx = t - g_base
                bn = idx // g_size
                bt = g_first + idx % g_size
                sstate, state = self._produce_tile(bn, bt, bt * n_tiles + bn, tidx, warp, pipe, sched, tma_a, mAt,
                                                   tma_b, mWt, mA, mIds, mTileExpert, sB, epi, copies, state, sstate)
        else:
            for t in range(bid, total, nctas):
                bn, bt = self._tile_of(t, num_m_tiles)
                sstate, state = self._produce_tile(bn, bt, t, tidx, warp, pipe, sched, tma_a, mAt, tma_b, mWt, mA,
                                                   mIds, mTileExpert, sB, epi, copies, state, sstate)
        if warp == 0:
            self._publish(sched, sstate, cutlass.Int32(-1), 0, mIds, epi)
            if const_expr(self.pingpong):  # the other warpgroup reads the other slot
                sstate.advance()
                self._publish(sched, sstate, cutlass.Int32(-1), 0, mIds, epi)
            pipe.producer_tail(state)

    @cute.jit
    def _group_size(self, mTileExpert, first, num_m_tiles):
        """raster_experts: the M tiles of the raster group starting at tile ``first``: up to the
        last expert boundary within RASTER_GROUP tiles (or the end), else RASTER_GROUP (an
        expert of more tiles is split). Lane j reads tile first + j (one load per lane)."""
        lane = cute.arch.lane_idx()
        t = first + lane
        e = Int32(-2)  # past the end: differs from every expert (and from -1, the unused tiles)
        if lane <= RASTER_GROUP:
            if t < num_m_tiles:
                e = mTileExpert[t]
        ep = cute.arch.shuffle_sync_up(e, 1)
        cut = Boolean(False)
        if lane >= 1:
            if lane <= RASTER_GROUP:
                if e != ep:
                    cut = Boolean(True)
        cuts = cute.arch.vote_ballot_sync(cut)
        size = Int32(RASTER_GROUP)
        if cuts != 0:
            size = 31 - Int32(cute.arch.clz(cuts))
        return size

    @cute.jit
    def _produce_tile(self, bn, bt, code, tidx, warp, pipe, sched, tma_a, mAt, tma_b, mWt, mA, mIds, mTileExpert,
                      sB, epi, copies, state, sstate):
        """The producers' part of tile (N tile ``bn``, M tile ``bt``): publish it as ``code``
        (warp 0) and fill its k-tiles into the ring; returns the advanced schedule and ring states."""
        tiled_copy, tAsA_cp, tAcA, sA = copies
        k_tiles = self.k // self.tile_k
        expert = mTileExpert[bt]
        if expert >= 0:
            if warp == 0:
                self._publish(sched, sstate, code, bt * self.tile_m, mIds, epi)
                sstate.advance()
            gB = self._b_tiles(mWt, expert, bn)
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
            if const_expr(self.glu):
                a_rows = self._a_rows(tidx, mIds, bt * self.tile_m)
                for kt in range(k_tiles):
                    pipe.sync_object_empty.wait(state.index, state.phase)
                    if warp == 0:
                        pipe.sync_object_full.arrive(state.index, None)  # elected: expect B's bytes
                        cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index],
                                  tma_bar_ptr=pipe.producer_get_barrier(state), cache_policy=self._b_policy())
                    self._load_a(kt, state.index, tiled_copy, mA, a_rows, tAsA_cp, tAcA)
                    cute.arch.cp_async_mbarrier_arrive_noinc(pipe.producer_get_barrier(state))
                    state.advance()
            else:
                gA = cute.local_tile(mAt, (self.tile_m, self.tile_k), (bt, None))
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                for kt in range(k_tiles):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar,
                              cache_policy=self._b_policy())
                    cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar)
                    state.advance()
        return sstate, state

    @cute.jit
    def _pair_units(self, mTileExpert, num_m_tiles, s_units):
        """cluster_m 2: the live M tiles in units of two, written by this warp into ``s_units``
        (first tiles at [0, U), second tiles at [U, 2 U), U = PAIR_LIST_TILES / 2), in the order
        of their first tile: an expert's tiles in pairs, and where its count is odd its last
        tile paired with the next such leftover (of another expert; the last leftover of all
        has second -1). Returns the unit count, ceil(live tiles / 2). One pass of 32 tiles per
        step: a tile is its expert's first when its expert differs from the previous tile's
        (the nearest first at or below a lane comes from a ballot, or from the steps before),
        at an even offset from it the first of a pair unless it is the expert's last (then a
        leftover), at an odd offset a pair's second. A unit's place is the count of pair firsts
        before it plus the leftover units (every other leftover) before it; the place of each
        leftover unit is kept at [2 U, 2 U + PAIR_LIST_EXPERTS / 2) so that the next leftover
        can fill in its second. Every entry is written once with its final value (GEMM1's four
        producer warps each build the same list, and each reads only after its own writes)."""
        U = limits.PAIR_LIST_TILES // 2
        lane = cute.arch.lane_idx()
        lt = cute.arch.lanemask_lt()
        le = cute.arch.lanemask_le()
        firsts = Int32(0)  # pair firsts so far
        left = Int32(0)  # leftovers so far
        first = Int32(0)  # the first tile of the expert the previous step ended in
        prev_e = Int32(-1)
        for c in range(0, num_m_tiles, 32):
            t = c + lane
            e = Int32(-1)
            if t < num_m_tiles:
                e = mTileExpert[t]
            en = cute.arch.shuffle_sync_down(e, 1)
            if lane == 31:
                en = Int32(-1)
                if t + 1 < num_m_tiles:
                    en = mTileExpert[t + 1]
            ep = cute.arch.shuffle_sync_up(e, 1)
            if lane == 0:
                ep = prev_e
            start = Boolean(False)
            if e >= 0:
                if e != ep:
                    start = Boolean(True)
            below = cute.arch.vote_ballot_sync(start) & le
            f = first
            if below != 0:
                f = c + 31 - Int32(cute.arch.clz(below))
            pa = Boolean(False)  # the first of a pair (its second is t + 1)
            lo = Boolean(False)  # a leftover
            if e >= 0:
                if (t - f) % 2 == 0:
                    if en == e:
                        pa = Boolean(True)
                    else:
                        lo = Boolean(True)
            pmask = cute.arch.vote_ballot_sync(pa)
            lmask = cute.arch.vote_ballot_sync(lo)
            p_before = firsts + Int32(cute.arch.popc(pmask & lt))
            q = left + Int32(cute.arch.popc(lmask & lt))
            if pa:
                u = p_before + (q + 1) // 2
                s_units[u] = t
                s_units[U + u] = t + 1
            if lo:
                if q % 2 == 0:
                    u = p_before + q // 2
                    s_units[u] = t
                    s_units[2 * U + q // 2] = u
            cute.arch.sync_warp()
            if lo:
                if q % 2 == 1:
                    s_units[U + s_units[2 * U + q // 2]] = t
            firsts = firsts + Int32(cute.arch.popc(pmask))
            left = left + Int32(cute.arch.popc(lmask))
            first = cute.arch.shuffle_sync(f, 31)
            prev_e = cute.arch.shuffle_sync(e, 31)
        cute.arch.sync_warp()
        if left % 2 == 1:  # the last leftover has no partner
            s_units[U + s_units[2 * U + left // 2]] = Int32(-1)
        cute.arch.sync_warp()
        return firsts + (left + 1) // 2

    @cute.jit
    def _unit_tiles(self, j, s_units, listed):
        """(first, second) M tile of unit j: from the unit list (second -1: none), or tiles 2j
        and 2j + 1 where the tiles did not fit the list."""
        ta = 2 * j
        tb = 2 * j + 1
        if listed:
            ta = s_units[j]
            tb = s_units[limits.PAIR_LIST_TILES // 2 + j]
        return ta, tb

    @cute.jit
    def _produce_mc(self, tidx, warp, pipe, sched, tma_a, mAt, tma_b, tma_bm, mWt, mA, mIds, mTileExpert,
                    sA, sB, epi, bid, nctas, num_m_tiles, s_units):
        """cluster_m = C = 2: cluster c walks the units (N tile, pair j of M tiles) c,
        c + clusters, ... in the raster order of _tile_of over units; CTA r of the cluster takes
        the pair's tile r. The pairs come from _pair_units: two tiles of one expert where the
        expert has two left, else two experts' last tiles; so an expert's weight tile is read
        once for up to two of its M tiles, whatever the tile counts of the experts before it.
        (Past PAIR_LIST_TILES tiles the pairs are tiles 2j and 2j + 1.) When both tiles of the
        unit have the same expert (or there is no second), each CTA loads 1/C of the weight
        tile and multicasts it to both (``tma_bm``); otherwise each loads its whole own tile
        (``tma_b``). The stage's byte count is the same either way. A CTA without a tile
        recomputes the first (so that the cluster stays in step) and is published as a
        duplicate, whose epilogue writes nothing (code -2 - t, see _consume_ws)."""
        C = self.cluster_m
        n_tiles = self.n // self.tile_n
        k_tiles = self.k // self.tile_k
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_layout = cute.make_layout((C, 1, 1))
        mask = cute.make_layout_image_mask(cta_layout, cta_layout.get_flat_coord(rank), mode=0)
        listed = num_m_tiles <= limits.PAIR_LIST_TILES
        if const_expr(not self.pair_list):
            listed = Boolean(False)
        groups = (num_m_tiles + C - 1) // C
        if listed:
            groups = self._pair_units(mTileExpert, num_m_tiles, s_units)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        sstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCHED_SLOTS)
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_bm)
            if const_expr(not self.glu):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
        tiled_copy = self._make_g2s_copy()
        thr_copy = tiled_copy.get_slice(tidx)
        tAsA_cp = thr_copy.partition_D(sA)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        for u in range(bid // C, groups * n_tiles, nctas // C):
            bn, bg = self._tile_of(u, groups)
            bt0, bt1 = self._unit_tiles(bg, s_units, listed)
            e0 = mTileExpert[bt0]
            if e0 >= 0:
                bt = bt0
                expert = e0
                shared = True
                dup = False
                er = Int32(-1)
                if bt1 >= 0 and bt1 < num_m_tiles:
                    er = mTileExpert[bt1]
                if er >= 0 and er != e0:
                    shared = False
                if rank == 1:
                    bt = bt1
                    expert = er
                if expert < 0:
                    bt = bt0
                    expert = e0
                    dup = True
                if warp == 0:
                    code = bt * n_tiles + bn
                    if dup:
                        code = -2 - code
                    self._publish(sched, sstate, code, bt * self.tile_m, mIds, epi)
                    sstate.advance()
                gB = cute.local_tile(mWt, (self.tile_n, self.tile_k), (expert * n_tiles + bn, None))
                tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                    tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                tBsBm, tBgBm = cute.nvgpu.cpasync.tma_partition(
                    tma_bm, rank, cute.make_layout(C), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                if const_expr(self.glu):
                    a_rows = self._a_rows(tidx, mIds, bt * self.tile_m)
                    for kt in range(k_tiles):
                        pipe.sync_object_empty.wait(state.index, state.phase)
                        if warp == 0:
                            pipe.sync_object_full.arrive(state.index, None)  # elected: expect B's bytes
                            self._load_b(shared, tma_b, tBgB, tBsB, tma_bm, tBgBm, tBsBm, mask, kt,
                                         state, pipe)
                        self._load_a(kt, state.index, tiled_copy, mA, a_rows, tAsA_cp, tAcA)
                        cute.arch.cp_async_mbarrier_arrive_noinc(pipe.producer_get_barrier(state))
                        state.advance()
                else:
                    gA = cute.local_tile(mAt, (self.tile_m, self.tile_k), (bt, None))
                    tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                        tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                    for kt in range(k_tiles):
                        pipe.producer_acquire(state)
                        self._load_b(shared, tma_b, tBgB, tBsB, tma_bm, tBgBm, tBsBm, mask, kt, state, pipe)
                        cute.copy(tma_a, tAgA[None, kt], tAsA[None, state.index],
                                  tma_bar_ptr=pipe.producer_get_barrier(state))
                        state.advance()
        if warp == 0:
            self._publish(sched, sstate, cutlass.Int32(-1), 0, mIds, epi)
            pipe.producer_tail(state)

    @cute.jit
    def _load_b(self, shared, tma_b, tBgB, tBsB, tma_bm, tBgBm, tBsBm, mask, kt, state, pipe):
        """k-tile ``kt`` of the weight tile into stage ``state``: this CTA's slice multicast to
        the cluster when ``shared``, else the whole tile into this CTA alone."""
        bar = pipe.producer_get_barrier(state)
        if shared:
            cute.copy(tma_bm, tBgBm[None, kt], tBsBm[None, state.index], tma_bar_ptr=bar, mcast_mask=mask,
                      cache_policy=self._b_policy())
        else:
            cute.copy(tma_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar, cache_policy=self._b_policy())

    @cute.jit
    def _more(self, t):
        """Whether a published schedule code is a tile (-1 ends the schedule)."""
        if const_expr(self.cluster_m == 1):
            return t >= 0
        return t != -1

    @cute.jit
    def _decode(self, t, num_m_tiles):
        """(N tile, M tile) of a published code: the linear raster index (cluster_m 1), or
        M tile * N tiles + N tile (raster_experts), as -2 - code for a duplicate (cluster_m > 1)."""
        if const_expr(self.cluster_m == 1 and not self.raster_experts):
            return self._tile_of(t, num_m_tiles)
        n_tiles = self.n // self.tile_n
        code = t
        if t < 0:
            code = -2 - t
        return code % n_tiles, code // n_tiles

    @cute.jit
    def _consume_ws(self, ctid, pipe, sched, tiled_mma, sA, sB, epi, num_m_tiles, order=None):
        pipe_s, tiles, s_pairs, s_scales = sched
        k_tiles = self.k // self.tile_k
        warp_group = cute.arch.make_warp_uniform(ctid // 128)
        if const_expr(self.pingpong):
            # each warpgroup multiplies a whole tile: thread ctid % 128 of the tile's MMA
            thr_mma = tiled_mma.get_slice(0)
            ctid = ctid % 128
        else:
            thr_mma = tiled_mma.get_slice(warp_group * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        num_kb = cute.size(tCrA, mode=[2])
        acc = tiled_mma.make_fragment_C(tiled_mma.get_slice(ctid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))).shape)
        tCcC = self._acc_coords(ctid, tiled_mma)
        pairs = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Int32)
        scales = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Float32)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        sstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_SLOTS)
        turn = None
        if const_expr(self.pingpong):
            # warpgroup 1 starts at the schedule's second tile, past the first tile's k-tiles
            read.advance(warp_group * k_tiles)
            release.advance(warp_group * k_tiles)
            sstate.advance(warp_group)
            order, turn = self._order_of(order, warp_group)
        pipe_s.consumer_wait(sstate)
        t = tiles[sstate.index]
        while self._more(t):
            bn, bt = self._decode(t, num_m_tiles)
            live = self._rows_live(t, warp_group, s_pairs, sstate)
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            if const_expr(self.pingpong):
                order.wait(turn)  # the other warpgroup's mainloop has passed its last full barrier
            cute.nvgpu.warpgroup.fence()
            for kt in range(k_tiles):
                pipe.consumer_wait(read)
                if const_expr(self.pingpong):
                    if kt == k_tiles - 1:  # its last full barrier passed: the other warpgroup's turn
                        turn = self._hand_turn(order, turn)  # (harmless where it has no tile left)
                if const_expr(self.glu):
                    # A arrived by cp.async (generic proxy); wgmma reads through the async proxy
                    cute.arch.fence_proxy("async.shared", space="cta")
                if live:  # (the commit inside: one closed on both paths costs a dummy wgmma)
                    for kb in cutlass.range_constexpr(num_kb):
                        cute.gemm(tiled_mma, acc, tCrA[None, None, kb, read.index],
                                  tCrB[None, None, kb, read.index], acc)
                    cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)
                if kt > 0:
                    pipe.consumer_release(release)
                    release.advance()
                read.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(release)
            release.advance()
            for hrow in cutlass.range_constexpr(self.acc_rows):
                pairs[hrow] = s_pairs[tCcC[self._acc_index(hrow, 0)][0], sstate.index]
                scales[hrow] = s_scales[tCcC[self._acc_index(hrow, 0)][0], sstate.index]
            pipe_s.consumer_release(sstate)
            sstate.advance()
            if const_expr(self.pingpong):
                # the other warpgroup's tile comes next in the schedule and in the ring
                sstate.advance()
                read.advance(k_tiles)
                release.advance(k_tiles)
            if const_expr(self.cluster_m == 1):
                self._epilogue_regs(ctid, tiled_mma, acc, pairs, scales, epi, bt * self.tile_m, bn)
            elif t >= 0:  # not a duplicate (see _produce_mc)
                self._epilogue_regs(ctid, tiled_mma, acc, pairs, scales, epi, bt * self.tile_m, bn)
            pipe_s.consumer_wait(sstate)
            t = tiles[sstate.index]


    @cute.jit
    def _rows_live(self, t, warp_group, s_pairs, sstate):
        """Whether this consumer warpgroup multiplies the published tile ``t``: False (with
        skip_padding) where its 64 rows are all padding (padding rows end an expert's last
        tile, so its first row tells) or the tile is the cluster's duplicate (code < 0); its
        accumulators then stay zero, which the epilogue stores for padding rows of GEMM1 (h)
        and does not store for GEMM2. Every warpgroup still waits for and releases each stage,
        and the pair's multicast keeps the other CTA's pace: the tensor cores idle (less power
        at the cap), the schedule does not move."""
        live = Boolean(True)
        if const_expr(self.skip_padding):
            live = s_pairs[warp_group * 64, sstate.index] >= 0
            if t < 0:
                live = Boolean(False)
        return live

    def _launch_common(self, grid_n, mTileExpert):
        """cluster_m = C > 1: C CTAs per unit of C M tiles, at most ctas CTAs in all."""
        if const_expr(self.cluster_m == 1):
            return super()._launch_common(grid_n, mTileExpert)
        C = self.cluster_m
        units = grid_n * ((cute.size(mTileExpert, mode=[0]) + C - 1) // C)
        return [cutlass.min(units, self.ctas // C) * C, 1, 1], [self.threads, 1, 1]

    def _launch_kw(self):
        """Keyword arguments of the kernel launch beyond grid and block."""
        kw = dict(use_pdl=self.pdl, min_blocks_per_mp=1)
        if self.cluster_m > 1:
            kw["cluster"] = [self.cluster_m, 1, 1]
        return kw

    @cute.jit
    def _make_tma_bm(self, mW):
        """cluster_m > 1: the weights' TMA atom that multicasts 1/cluster_m of each box to
        every CTA of the cluster (None for cluster_m 1)."""
        if const_expr(self.cluster_m == 1):
            return None
        flat = cute.make_tensor(mW.iterator, cute.make_layout(
            (self.num_experts * self.n, self.k), stride=(self.k, 1)))
        return self._tma_atom(flat, "b", self.cluster_m)[0]


class HopperGluGemm(_HopperWs, GroupedGluGemm):
    """GEMM1 + GLU with mma="hopws" (same arguments and results as ``GroupedGluGemm``)."""

    @cute.jit
    def __call__(self, x: cute.Tensor, w13: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, h: cute.Tensor, b13: Optional[cute.Tensor],
                 preact: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_b, mWt = self._make_tma_b(w13)
        if const_expr(self.cluster_m == 1):
            self.kernel_ws(tma_b, mWt, x, sorted_ids, tile_expert, h, b13, preact).launch(
                grid=grid, block=block, stream=stream, use_pdl=self.pdl, min_blocks_per_mp=1)
        else:
            self.kernel_mc(tma_b, self._make_tma_bm(w13), mWt, x, sorted_ids, tile_expert, h, b13, preact).launch(
                grid=grid, block=block, stream=stream, **self._launch_kw())

    @cute.kernel
    def kernel_ws(self, tma_b: cute.CopyAtom, mWt: cute.Tensor, mX: cute.Tensor, mIds: cute.Tensor,
                  mTileExpert: cute.Tensor, mH: cute.Tensor, mB: Optional[cute.Tensor], mP: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, None, None, tma_b, mWt, mX, mIds, mTileExpert,
                       self._epi(mH, mB, mIds, mTileExpert, mP))

    @cute.kernel
    def kernel_mc(self, tma_b: cute.CopyAtom, tma_bm: cute.CopyAtom, mWt: cute.Tensor, mX: cute.Tensor,
                  mIds: cute.Tensor, mTileExpert: cute.Tensor, mH: cute.Tensor, mB: Optional[cute.Tensor],
                  mP: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, None, None, tma_b, mWt, mX, mIds, mTileExpert,
                       self._epi(mH, mB, mIds, mTileExpert, mP), tma_bm)


class HopperDownGemm(_HopperWs, GroupedDownGemm):
    """GEMM2 with mma="hopws" (same arguments and results as ``GroupedDownGemm``)."""

    @cute.jit
    def __call__(self, h: cute.Tensor, w2: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, topk_weights: cute.Tensor, y: cute.Tensor,
                 b2: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_a, mAt = self._make_tma_a(h)
        tma_b, mWt = self._make_tma_b(w2)
        if const_expr(self.cluster_m == 1):
            self.kernel_ws(tma_a, mAt, tma_b, mWt, sorted_ids, tile_expert, topk_weights, y, b2).launch(
                grid=grid, block=block, stream=stream, use_pdl=self.pdl, min_blocks_per_mp=1)
        else:
            self.kernel_mc(tma_a, mAt, tma_b, self._make_tma_bm(w2), mWt, sorted_ids, tile_expert,
                           topk_weights, y, b2).launch(grid=grid, block=block, stream=stream, **self._launch_kw())

    @cute.kernel
    def kernel_ws(self, tma_a: cute.CopyAtom, mAt: cute.Tensor, tma_b: cute.CopyAtom,
                  mWt: cute.Tensor, mIds: cute.Tensor, mTileExpert: cute.Tensor,
                  mTopkW: cute.Tensor, mY: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, tma_a, mAt, tma_b, mWt, None, mIds, mTileExpert,
                       self._epi(mIds, mTopkW, mY, mB, mTileExpert))

    @cute.kernel
    def kernel_mc(self, tma_a: cute.CopyAtom, mAt: cute.Tensor, tma_b: cute.CopyAtom,
                  tma_bm: cute.CopyAtom, mWt: cute.Tensor, mIds: cute.Tensor, mTileExpert: cute.Tensor,
                  mTopkW: cute.Tensor, mY: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, tma_a, mAt, tma_b, mWt, None, mIds, mTileExpert,
                       self._epi(mIds, mTopkW, mY, mB, mTileExpert), tma_bm)

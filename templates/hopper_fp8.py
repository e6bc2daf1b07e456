"""FP8 (e4m3) grouped GEMMs of a fused MoE layer on the persistent Hopper core (hopper_gemm.py).

The producer, the TMA / cp.async pipeline, the tile schedule and the warp specialization
(cooperative "hopws" and ping-pong "hoppp") are hopper_gemm's, with 1-byte operands and
128-element k-tiles (one 128-byte swizzle atom per row, as bf16's 64). What changes is the
consumer: fp8 wgmma (QGMMA), and the scales.

Precisions (moe_aot/gemm_limits.py):
  * "fp8": w13 has one fp32 scale per expert for its gate and one for its up rows ([E, 2]), w2
    one per expert ([E]); x one per token ([M]).
  * "fp8-block128": w13 [E, 2I/128, H/128] (row 2b: gate rows [128b, 128b+128), row 2b+1: the
    matching up rows, i.e. DeepSeek-V3's gate and up ``weight_scale_inv`` interleaved by
    block), w2 [E, H/128, I/128] (down_proj's ``weight_scale_inv``); x [M, H/128].
  * GEMM1's output, in both: h as e4m3 [R, I] with hs [R, I/h_block], one fp32 scale per row and
    h_block columns (amax / 448 of the block's GLU outputs, computed from the fp32 accumulators).
    h_block is the layer's (gemm_limits.check_h_block): 64, or 128 where GEMM1's tiles hold
    whole 128-column blocks of h (tile_n 256); both GEMMs of a layer are built with the same.

Where the scales go: every fp8 GEMM computes the partial sums of each K block (128 for GEMM1,
h_block for GEMM2, whose A has a scale per h_block columns) on the tensor cores and adds them into an
fp32 accumulator times the block's scales (``_mainloop_promote``), software-pipelined over two
partial-sum accumulators so the next block's wgmmas run during the promotion. Hopper's fp8
wgmma accumulates with fewer bits than fp32, so "fp8" promotes too (its scales are the same for
every block), as DeepSeek-V3's kernels do.

Each consumer thread loads the scales its accumulator rows need straight from global memory
(L2), at the top of each k-tile, before it waits on the stage.

Constraints beyond hopper_gemm's: H and I multiples of 128 (2I and H for GEMM1); GEMM1's
k-tiles 128 or 256 wide (two swizzle atoms and two promotions per k-tile), GEMM2's 128; GEMM1
tile_n a multiple of 128 (whole 64-column output blocks; of 2 * h_block); promoting GEMMs at most 64
accumulators per thread (tile_n <= 128 at 64 rows per warpgroup), or cooperative tiles (64 or
128 rows) of 256 columns promoted in two 128-column parts (``_mainloop_parts``); fp8-block128 GEMM2 tile_n
(or part) dividing 128. 2-CTA clusters (cluster_m 2, 128-row cooperative tiles) as hopper_gemm's:
the pair of an expert's M tiles shares each weight tile by multicast, the scales are each CTA's
own loads; every warpgroup multiplies every tile (no skip_padding: the promotion's loop has no
per-warpgroup branch), and the duplicate tile of a pair writes nothing. ``gemm_limits.check_fp8``
holds the rules.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, const_expr

from moe_aot import gemm_limits as limits

from .grouped_gemm import glu_gate_block
from .hopper_gemm import SCHED_SLOTS, HopperDownGemm, HopperGluGemm

HB = limits.H_SCALE_BLOCK
SB = limits.SCALE_BLOCK


def glu_fp8_arguments(gemm):
    """The fake arguments of an fp8 GEMM1 template ``gemm`` (both cores): see HopperGluGemmFp8."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    m = cute.sym_int32(symbol="M")
    r = cute.sym_int32(symbol="R", divisibility=gemm.tile_m)
    t = cute.sym_int32(symbol="T")
    e, hd, i = gemm.num_experts, gemm.hidden, gemm.intermediate
    if gemm.block:
        xs = make_fake_tensor(Float32, (m, hd // SB), (hd // SB, 1), assumed_align=4)
        ws = make_fake_tensor(Float32, (e, 2 * i // SB, hd // SB),
                              (2 * i // SB * (hd // SB), hd // SB, 1), assumed_align=4)
    else:
        xs = make_fake_tensor(Float32, (m,), (1,), assumed_align=4)
        ws = make_fake_tensor(Float32, (e, 2), (2, 1), assumed_align=4)
    return [
        ("x", make_fake_tensor(Float8E4M3FN, (m, hd), (hd, 1), assumed_align=16)),
        ("xs", xs),
        ("w13", make_fake_tensor(Float8E4M3FN, (e, 2 * i, hd), (2 * i * hd, hd, 1), assumed_align=16)),
        ("w13s", ws),
        ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=16)),
        ("tile_expert", make_fake_tensor(Int32, (t,), (1,), assumed_align=16)),
        ("h", make_fake_tensor(Float8E4M3FN, (r, i), (i, 1), assumed_align=16)),
        ("hs", make_fake_tensor(Float32, (r, i // gemm.h_block), (i // gemm.h_block, 1), assumed_align=4)),
        ("stream", make_fake_stream()),
    ]


def down_fp8_arguments(gemm):
    """The fake arguments of an fp8 GEMM2 template ``gemm`` (both cores): see HopperDownGemmFp8."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    m = cute.sym_int32(symbol="M")
    mk = cute.sym_int32(symbol="MK")
    r = cute.sym_int32(symbol="R", divisibility=gemm.tile_m)
    t = cute.sym_int32(symbol="T")
    e, hd, i = gemm.num_experts, gemm.hidden, gemm.intermediate
    if gemm.block:
        ws = make_fake_tensor(Float32, (e, hd // SB, i // SB), (hd // SB * (i // SB), i // SB, 1),
                              assumed_align=4)
    else:
        ws = make_fake_tensor(Float32, (e,), (1,), assumed_align=4)
    return [
        ("h", make_fake_tensor(Float8E4M3FN, (r, i), (i, 1), assumed_align=16)),
        ("hs", make_fake_tensor(Float32, (r, i // gemm.h_block), (i // gemm.h_block, 1), assumed_align=4)),
        ("w2", make_fake_tensor(Float8E4M3FN, (e, hd, i), (hd * i, i, 1), assumed_align=16)),
        ("w2s", ws),
        ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=16)),
        ("tile_expert", make_fake_tensor(Int32, (t,), (1,), assumed_align=16)),
        ("topk_weights", make_fake_tensor(Float32, (m, gemm.top_k), (gemm.top_k, 1),
                                          assumed_align=16)),
        ("y", make_fake_tensor(BFloat16, (mk, hd), (hd, 1), assumed_align=16)),
        ("stream", make_fake_stream()),
    ]


class _Fp8Consumer:
    """The fp8 consumer loop of both GEMMs (see the module docstring)."""

    def _fp8_init(self, h_block, promote_every=1):
        if not self.fp8:
            raise ValueError(f"{type(self).__name__} is the fp8 GEMM; precision {self.precision!r} is not fp8")
        ok, why = limits.check_h_block(self.precision, h_block, self.tile_n if self.glu else None)
        if not ok:
            raise ValueError(why)
        self.h_block = h_block
        self.block = self.precision == "fp8-block128"
        # K elements per promotion: a weight/x block (GEMM1) or an h scale block (GEMM2)
        self.kblock = SB if self.glu else h_block
        self.kblocks = self.tile_k // self.kblock  # promotions per k-tile
        self.ka_per_block = self.kblock // 32  # wgmma k32 instructions per promotion
        # column parts of the tile multiplied and promoted one at a time (1: the whole tile, two
        # partial sums pipelined; gemm_limits.promote_parts)
        self.parts = limits.promote_parts(self.mma, self.tile_m, self.tile_n) if self.mma != "warp" else 1
        self.part_n = self.tile_n // self.parts
        # k-tiles summed on the tensor cores per promotion ("fp8" GEMM1 in parts: _mainloop_grouped)
        ok, why = limits.check_promote_every("glu" if self.glu else "down", self.precision, self.parts,
                                             self.k // self.tile_k, self.stages, promote_every)
        if not ok:
            raise ValueError(why)
        self.promote_every = promote_every

    @cute.jit
    def _consume_ws(self, ctid, pipe, sched, tiled_mma, sA, sB, epi, num_m_tiles, order=None):
        pipe_s, tiles, s_pairs, s_scales = sched
        k_tiles = self.k // self.tile_k
        warp_group = cute.arch.make_warp_uniform(ctid // 128)
        if const_expr(self.pingpong):
            thr_mma = tiled_mma.get_slice(0)
            ctid = ctid % 128
        else:
            thr_mma = tiled_mma.get_slice(warp_group * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_shape = tiled_mma.get_slice(ctid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))).shape
        acc = tiled_mma.make_fragment_C(acc_shape)
        part_mma = tiled_mma
        if const_expr(self.parts > 1):
            # the wgmmas of one column part: B's rows [j * part_n, (j + 1) * part_n) of a stage
            # are part j of this MMA's N mode over the stage
            part_mma = self._make_tiled_mma(self.part_n)
            thr_part = part_mma.get_slice(warp_group * 128)
            tCrA = part_mma.make_fragment_A(thr_part.partition_A(sA))
            tCrB = part_mma.make_fragment_B(thr_part.partition_B(sB))
        # one K block's partial sums (of the whole tile, or of one column part)
        part = part_mma.make_fragment_C(part_mma.get_slice(ctid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.part_n))).shape)
        tCcC = self._acc_coords(ctid, tiled_mma)
        pairs = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Int32)
        scales = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Float32)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        sstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_SLOTS)
        turn = None
        if const_expr(self.pingpong):
            read.advance(warp_group * k_tiles)
            sstate.advance(warp_group)
            order, turn = self._order_of(order, warp_group)  # hopper_gemm._make_order
        mTileExpert = epi[-1]
        pipe_s.consumer_wait(sstate)
        t = tiles[sstate.index]
        while self._more(t):
            bn, bt = self._decode(t, num_m_tiles)
            expert = mTileExpert[bt]
            # the rows' pairs and routing weights first: the promotion needs x's row scales
            for hrow in cutlass.range_constexpr(self.acc_rows):
                pairs[hrow] = s_pairs[tCcC[self._acc_index(hrow, 0)][0], sstate.index]
                scales[hrow] = s_scales[tCcC[self._acc_index(hrow, 0)][0], sstate.index]
            pipe_s.consumer_release(sstate)
            sstate.advance()
            if const_expr(self.pingpong):
                sstate.advance()
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            if const_expr(self.pingpong):
                order.wait(turn)  # the other warpgroup's mainloop is done
            if const_expr(self.promote_every > 1):
                read = self._mainloop_grouped(pipe, read, part_mma, tCrA, tCrB, acc, part, tCcC, pairs,
                                              epi, expert, bt, bn, k_tiles)
            elif const_expr(self.parts > 1):
                read = self._mainloop_parts(pipe, read, part_mma, tCrA, tCrB, acc, part, tCcC, pairs,
                                            epi, expert, bt, bn, k_tiles)
            else:
                read = self._mainloop_promote(pipe, read, tiled_mma, tCrA, tCrB, acc, part, tCcC, pairs,
                                              epi, expert, bt, bn, k_tiles)
            if const_expr(self.pingpong):  # the other warpgroup's tile comes next in the ring
                turn = self._hand_turn(order, turn)
                read.advance(k_tiles)
            if const_expr(self.cluster_m == 1):
                self._epilogue_fp8(ctid, tiled_mma, acc, tCcC, pairs, scales, epi, expert, bt * self.tile_m, bn)
            elif t >= 0:  # not the cluster's duplicate tile (see hopper_gemm's _produce_mc)
                self._epilogue_fp8(ctid, tiled_mma, acc, tCcC, pairs, scales, epi, expert, bt * self.tile_m, bn)
            pipe_s.consumer_wait(sstate)
            t = tiles[sstate.index]

    @cute.jit
    def _mainloop_promote(self, pipe, read, tiled_mma, tCrA, tCrB, acc, part, tCcC, pairs, epi,
                          expert, bt, bn, k_tiles):
        """acc = sum over K blocks b of (A_b . B_b) * a_scale(row, b) * b_scale(column, b).

        Software-pipelined over two partial-sum accumulators: block b's wgmmas run into part
        (b even) or part2 (b odd) while the other one is scaled into acc, so the tensor cores
        keep working during the promotion. Blocks are k-tiles (GEMM1) or halves of k-tiles
        (GEMM2); a stage is waited for before its first block is issued and released once its
        last block is promoted. Returns the ring state past the tile's k-tiles."""
        nblocks = k_tiles * self.kblocks
        part2 = cute.make_rmem_tensor_like(part)
        saA = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Float32)
        saB = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Float32)
        sbA = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        sbB = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        rel = read.clone()
        row0 = bt * self.tile_m
        stage = Int32(0)
        # blocks 0 and 1 (nblocks >= 2: K >= 256 for GEMM1, K >= 128 for GEMM2)
        stage, read = self._issue(pipe, read, stage, tiled_mma, part, tCrA, tCrB, 0)
        self._load_kscales(saA, sbA, tCcC, pairs, epi, expert, row0, bn, Int32(0), 0)
        stage, read = self._issue(pipe, read, stage, tiled_mma, part2, tCrA, tCrB, 1 % self.kblocks)
        self._load_kscales(saB, sbB, tCcC, pairs, epi, expert, row0, bn, Int32(1 // self.kblocks),
                           1 % self.kblocks)
        for i in range(nblocks // 2):
            b2 = 2 * i + 2
            cute.nvgpu.warpgroup.wait_group(1)  # block 2i done, 2i + 1 may run
            self._promote(acc, part, saA, sbA)
            if const_expr(self.kblocks == 1):
                pipe.consumer_release(rel)
                rel.advance()
            if b2 < nblocks:
                stage, read = self._issue(pipe, read, stage, tiled_mma, part, tCrA, tCrB, 0)
                self._load_kscales(saA, sbA, tCcC, pairs, epi, expert, row0, bn, b2 // self.kblocks, 0)
                cute.nvgpu.warpgroup.wait_group(1)  # block 2i + 1 done, 2i + 2 may run
            else:
                cute.nvgpu.warpgroup.wait_group(0)
            self._promote(acc, part2, saB, sbB)
            pipe.consumer_release(rel)
            rel.advance()
            if b2 + 1 < nblocks:
                stage, read = self._issue(pipe, read, stage, tiled_mma, part2, tCrA, tCrB, 1 % self.kblocks)
                self._load_kscales(saB, sbB, tCcC, pairs, epi, expert, row0, bn,
                                   (b2 + 1) // self.kblocks, 1 % self.kblocks)
        if const_expr(nblocks % 2 == 1):  # GEMM1 with an odd number of k-tiles: the last in part
            cute.nvgpu.warpgroup.wait_group(0)
            self._promote(acc, part, saA, sbA)
            pipe.consumer_release(rel)
            rel.advance()
        return read

    @cute.jit
    def _mainloop_parts(self, pipe, read, part_mma, tCrA, tCrB, acc, part, tCcC, pairs, epi,
                        expert, bt, bn, k_tiles):
        """_mainloop_promote for tiles promoted in column parts: per K block and part j, the
        part's wgmmas into ``part``, waited for, then added into acc's columns of part j times
        the block's scales. A warpgroup never overlaps its own wgmmas with its promotion (one
        partial-sum accumulator of a part is what the registers allow beside a 64x256 acc);
        the other consumer warpgroup's wgmmas fill the tensor cores meanwhile (a 64-row tile has
        none: it is a decode tile, where the weight stream, not the tensor cores, sets the pace). Returns the ring
        state past the tile's k-tiles."""
        sa = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Float32)
        sb = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        row0 = bt * self.tile_m
        for kt in range(k_tiles):
            pipe.consumer_wait(read)
            if const_expr(self.glu):
                cute.arch.fence_proxy("async.shared", space="cta")  # A by cp.async
            stage = read.index
            for sub in cutlass.range_constexpr(self.kblocks):
                self._load_kscales(sa, sb, tCcC, pairs, epi, expert, row0, bn, kt, sub)
                for j in cutlass.range_constexpr(self.parts):
                    if const_expr(j > 0 and self.block and not self.glu):
                        # fp8-block128 GEMM2: each 128-column part is its own weight block (the
                        # rows' h scales are the same for every part of a K block; loaded again
                        # only where a k-tile has several)
                        self._load_kscales(sa, sb, tCcC, pairs, epi, expert, row0, bn, kt, sub, j,
                                           self.kblocks > 1)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range_constexpr(self.ka_per_block):
                        k = sub * self.ka_per_block + kb
                        # the part's first wgmma overwrites it (no zero fill: a fill of the
                        # registers the last part's promotion reads made ptxas keep both live)
                        part_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb > 0)
                        cute.gemm(part_mma, part, tCrA[None, None, k, stage],
                                  cute.append_ones(tCrB[None, j, k, stage], up_to_rank=2), part)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                    self._promote(acc, part, sa, sb, j * cute.size(part))
            pipe.consumer_release(read)
            read.advance()
        return read

    @cute.jit
    def _mainloop_grouped(self, pipe, read, part_mma, tCrA, tCrB, acc, part, tCcC, pairs, epi,
                          expert, bt, bn, k_tiles):
        """_mainloop_parts with ``promote_every`` (P) k-tiles per promotion ("fp8" GEMM1, whose
        scales are the same for every K block): per group of P k-tiles and part j, the part's
        wgmmas over all P stages accumulate into ``part`` on the tensor cores, then one wait and
        one promotion into acc's columns of part j; the group's P stages are released after its
        last part. 1/P of the promotions, scale loads and waits of _mainloop_parts; the tensor
        cores' own accumulation runs over P * 128 of K instead of 128 (Hopper's fp8 wgmma keeps
        fewer bits than fp32: the kernel check measures what that costs). Returns the ring state
        past the tile's k-tiles."""
        P = self.promote_every
        sa = cute.make_rmem_tensor(cute.make_layout(self.acc_rows), Float32)
        sb = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        row0 = bt * self.tile_m
        nk = self.kblocks * self.ka_per_block  # wgmma k32 instructions per k-tile
        for grp in range(k_tiles // P):
            self._load_kscales(sa, sb, tCcC, pairs, epi, expert, row0, bn, grp * P, 0)
            for j in cutlass.range_constexpr(self.parts):
                cur = read.clone()
                cute.nvgpu.warpgroup.fence()
                for p in cutlass.range_constexpr(P):
                    if const_expr(j == 0):
                        pipe.consumer_wait(cur)
                        cute.arch.fence_proxy("async.shared", space="cta")  # A by cp.async
                    stage = cur.index
                    for k in cutlass.range_constexpr(nk):
                        # the group's first wgmma overwrites the part (no zero fill, as in _mainloop_parts)
                        part_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, p > 0 or k > 0)
                        cute.gemm(part_mma, part, tCrA[None, None, k, stage],
                                  cute.append_ones(tCrB[None, j, k, stage], up_to_rank=2), part)
                    cur.advance()
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                self._promote(acc, part, sa, sb, j * cute.size(part))
            for p in cutlass.range_constexpr(P):
                pipe.consumer_release(read)
                read.advance()
        return read

    @cute.jit
    def _issue(self, pipe, read, stage, tiled_mma, part, tCrA, tCrB, sub: cutlass.Constexpr):
        """Zero ``part`` and issue K block ``sub`` of the current k-tile into it as one wgmma
        group; the first block of a k-tile waits for its stage, the last one moves ``read`` on.
        Returns (stage, read): the DSL threads state through staged branches only as values
        rebound in the caller."""
        if const_expr(sub == 0):
            pipe.consumer_wait(read)
            if const_expr(self.glu):
                cute.arch.fence_proxy("async.shared", space="cta")  # A by cp.async
            stage = read.index
        part.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(self.ka_per_block):
            k = sub * self.ka_per_block + kb
            cute.gemm(tiled_mma, part, tCrA[None, None, k, stage], tCrB[None, None, k, stage], part)
        cute.nvgpu.warpgroup.commit_group()
        if const_expr(sub == self.kblocks - 1):
            read.advance()
        return stage, read

    @cute.jit
    def _promote(self, acc, part, sa, sb, base: cutlass.Constexpr = 0):
        """acc[base + i] += part[i] * a_scale(row) * b_scale(column class): ``part`` holds the
        whole tile (base 0) or one column part, whose elements are acc's from ``base`` on (the
        wgmma fragment orders elements by n8 block, so part j of a 64-row warpgroup's
        accumulators is the contiguous run of j * size(part))."""
        mult = cute.make_rmem_tensor(cute.make_layout((self.acc_rows, 2)), Float32)
        for hrow in cutlass.range_constexpr(self.acc_rows):
            mult[hrow, 0] = sa[hrow] * sb[0]
            mult[hrow, 1] = sa[hrow] * sb[1]
        for i in cutlass.range_constexpr(cute.size(part)):
            f = base + i
            hrow = (f // 2) % 2 + 2 * (f // (self.tile_n // 2))
            acc[f] = acc[f] + part[i] * mult[hrow, self._col_class(f)]

    def _col_class(self, i: int) -> int:
        """GEMM1: 0 where accumulator element i is a gate column, 1 where it is an up column
        (blocks of ``interleave`` alternate); GEMM2: 0."""
        if not self.glu:
            return 0
        j = (i // 4) % (self.tile_n // 8)  # its n8 block
        return (j * 8 // self.interleave) % 2


class HopperGluGemmFp8(_Fp8Consumer, HopperGluGemm):
    """GEMM1 + GLU in fp8: ``h = act(x . gate_e) * (x . up_e)`` with x, w13 and h in e4m3.

    ``__call__(x, xs, w13, w13s, sorted_ids, tile_expert, h, hs, stream)``: x [M, H] e4m3 and its
    scales xs ([M]; fp8-block128 [M, H/128]); w13 [E, 2I, H] e4m3 (gate/up interleaved as for
    bf16) and w13s ([E, 2]; fp8-block128 [E, 2I/128, H/128]); sorted_ids, tile_expert as
    ``GroupedGluGemm``; h [R, I] e4m3 and hs [R, I/h_block] fp32 written for every row of every
    used tile (padding rows: zeros and scale 0).
    """

    def __init__(self, *args, h_block: int = HB, promote_every: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self._fp8_init(h_block, promote_every)

    def fake_arguments(self):
        return glu_fp8_arguments(self)

    @cute.jit
    def __call__(self, x: cute.Tensor, xs: cute.Tensor, w13: cute.Tensor, w13s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, h: cute.Tensor, hs: cute.Tensor,
                 stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_b, mWt = self._make_tma_b(w13)
        if const_expr(self.cluster_m == 1):
            self.kernel_fp8(tma_b, mWt, x, xs, w13s, sorted_ids, tile_expert, h, hs).launch(
                grid=grid, block=block, stream=stream, use_pdl=self.pdl, min_blocks_per_mp=1)
        else:
            self.kernel_fp8_mc(tma_b, self._make_tma_bm(w13), mWt, x, xs, w13s, sorted_ids, tile_expert,
                               h, hs).launch(grid=grid, block=block, stream=stream, **self._launch_kw())

    @cute.kernel
    def kernel_fp8(self, tma_b: cute.CopyAtom, mWt: cute.Tensor, mX: cute.Tensor, mXs: cute.Tensor,
                   mWs: cute.Tensor, mIds: cute.Tensor, mTileExpert: cute.Tensor, mH: cute.Tensor,
                   mHs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, None, None, tma_b, mWt, mX, mIds, mTileExpert,
                       (mH, mHs, mXs, mWs, mTileExpert))

    @cute.kernel
    def kernel_fp8_mc(self, tma_b: cute.CopyAtom, tma_bm: cute.CopyAtom, mWt: cute.Tensor, mX: cute.Tensor,
                      mXs: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor, mTileExpert: cute.Tensor,
                      mH: cute.Tensor, mHs: cute.Tensor):
        """cluster_m 2: kernel_fp8 in 2-CTA clusters (hopper_gemm's _produce_mc: an expert's
        weight tile multicast to the pair of its M tiles)."""
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, None, None, tma_b, mWt, mX, mIds, mTileExpert,
                       (mH, mHs, mXs, mWs, mTileExpert), tma_bm)

    @cute.jit
    def _load_kscales(self, sa, sb, tCcC, pairs, epi, expert, row0, bn, kt, sub: cutlass.Constexpr,
                      part: cutlass.Constexpr = 0):
        """K block ``sub`` of k-tile ``kt`` (128 columns of K; a 256-wide k-tile holds two): x's
        scale of each accumulator row and the tile's gate and up weight scales (fp8-block128:
        those of the block; "fp8": the token's and the expert's, the same for every block, which
        keeps one code path: constant scales let the compiler fold the promotion into the
        accumulators, and ptxas then serializes the wgmmas)."""
        _, _, mXs, mWs, _ = epi
        kb = kt  # the 128-column scale block along K
        if const_expr(self.kblocks > 1):  # 256-wide k-tiles: two blocks each
            kb = kt * self.kblocks + sub
        for hrow in cutlass.range_constexpr(self.acc_rows):
            p = pairs[hrow]
            tok = Int32(0)  # padding rows: any valid address (their outputs are written as zeros)
            if p >= 0:
                tok = p // self.top_k
            if const_expr(self.block):
                sa[hrow] = mXs[tok, kb]
            else:
                sa[hrow] = mXs[tok]
        if const_expr(self.block):
            gb = (bn * (self.tile_n // 2)) // SB  # the tile's gate rows lie in one 128-row block
            sb[0] = mWs[expert, 2 * gb, kb]
            sb[1] = mWs[expert, 2 * gb + 1, kb]
        else:
            sb[0] = mWs[expert, 0]
            sb[1] = mWs[expert, 1]

    @cute.jit
    def _epilogue_fp8(self, ctid, tiled_mma, acc, tCcC, pairs, scales, epi, expert, row0, bn):
        """Per row and h_block h columns (the accumulators already scaled by the promotion): the
        GLU, the block's amax over the quad (shuffles: a warpgroup's row lies in one quad, all
        its columns, so a 128-column block needs no more than a 64-column one), its scale amax /
        448, and the e4m3 values, stored per 64 columns: the quad transposes its 16-bit pairs of
        two 8-column h blocks (one 32-bit word per pair of blocks) and lane q stores h columns
        16q..16q+15 of the 64 as one 16-byte vector; lane 0 stores the block's scale."""
        mH, mHs, _, _, _ = epi
        nb = self.interleave // 8
        half = self.tile_n // 2
        subs = self.h_block // HB  # 64-column stores per scale block
        lane = cute.arch.lane_idx()
        q = lane % 4
        quad0 = lane - q
        for hrow in cutlass.range_constexpr(self.acc_rows):
            r = tCcC[self._acc_index(hrow, 0)][0]
            valid = pairs[hrow] >= 0
            dst_row = self._row(mH, row0 + r, self.intermediate)
            for sblk in cutlass.range_constexpr(half // self.h_block):
                vals = [cute.make_rmem_tensor(cute.make_layout(16), Float32) for _ in range(subs)]
                for j in cutlass.range_constexpr(subs):
                    vals[j].fill(0.0)
                amax = Float32(0.0)
                if valid:
                    for j in cutlass.range_constexpr(subs):
                        blk = sblk * subs + j
                        for i in cutlass.range_constexpr(8):
                            gi = self._acc_index(hrow, glu_gate_block(8 * blk + i, self.interleave))
                            ui = gi + 4 * nb
                            v = self._h_pair(acc, gi, ui, None, 0)
                            vals[j][2 * i] = v[0]
                            vals[j][2 * i + 1] = v[1]
                    for j in cutlass.range_constexpr(subs):
                        for i in cutlass.range_constexpr(16):
                            amax = cute.arch.fmax(amax, cute.math.absf(vals[j][i]))
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1))
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 2))
                amax = cute.arch.fmax(amax, Float32(1e-12))
                inv = limits.FP8_MAX * cute.math.rcp(amax)
                col0 = bn * half + sblk * self.h_block  # the block's first h column
                for j in cutlass.range_constexpr(subs):
                    qv = cute.make_rmem_tensor(cute.make_layout(16), Float8E4M3FN)
                    qv.store((vals[j].load() * inv).to(Float8E4M3FN))
                    packed = cute.recast_tensor(qv, Int32)  # word u: h blocks 2u, 2u+1 of this lane
                    c = self._quad_transpose(packed, 0, q, quad0)  # c[s]: lane s's blocks 2q, 2q+1
                    words = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                    words[0] = (c[0] & 0xFFFF) | (c[1] << 16)
                    words[1] = (c[2] & 0xFFFF) | (c[3] << 16)
                    words[2] = ((c[0] >> 16) & 0xFFFF) | ((c[1] >> 16) << 16)
                    words[3] = ((c[2] >> 16) & 0xFFFF) | ((c[3] >> 16) << 16)
                    col = col0 + j * HB if j else col0
                    dst = cute.local_tile(dst_row, (16,), (col // 16 + q,))
                    dst.store(cute.recast_tensor(words, Float8E4M3FN).load())
                if q == 0:
                    sc = Float32(0.0)
                    if valid:
                        sc = amax * (1.0 / limits.FP8_MAX)
                    mHs[row0 + r, col0 // self.h_block] = sc


class HopperDownGemmFp8(_Fp8Consumer, HopperDownGemm):
    """GEMM2 in fp8: ``y[p] = topk_weights.flat[p] * (h[r] . w2_e^T)`` with h and w2 in e4m3.

    ``__call__(h, hs, w2, w2s, sorted_ids, tile_expert, topk_weights, y, stream)``: h [R, I] e4m3
    and hs [R, I/h_block] (GEMM1's fp8 output); w2 [E, H, I] e4m3 and w2s ([E]; fp8-block128
    [E, H/128, I/128]); the rest as ``GroupedDownGemm`` (y bf16).
    """

    def __init__(self, *args, h_block: int = HB, **kwargs):
        super().__init__(*args, **kwargs)
        self._fp8_init(h_block)

    def fake_arguments(self):
        return down_fp8_arguments(self)

    @cute.jit
    def __call__(self, h: cute.Tensor, hs: cute.Tensor, w2: cute.Tensor, w2s: cute.Tensor,
                 sorted_ids: cute.Tensor, tile_expert: cute.Tensor, topk_weights: cute.Tensor,
                 y: cute.Tensor, stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_a, mAt = self._make_tma_a(h)
        tma_b, mWt = self._make_tma_b(w2)
        if const_expr(self.cluster_m == 1):
            self.kernel_fp8(tma_a, mAt, tma_b, mWt, hs, w2s, sorted_ids, tile_expert, topk_weights, y).launch(
                grid=grid, block=block, stream=stream, use_pdl=self.pdl, min_blocks_per_mp=1)
        else:
            self.kernel_fp8_mc(tma_a, mAt, tma_b, self._make_tma_bm(w2), mWt, hs, w2s, sorted_ids, tile_expert,
                               topk_weights, y).launch(grid=grid, block=block, stream=stream, **self._launch_kw())

    @cute.kernel
    def kernel_fp8(self, tma_a: cute.CopyAtom, mAt: cute.Tensor, tma_b: cute.CopyAtom,
                   mWt: cute.Tensor, mHs: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor,
                   mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, tma_a, mAt, tma_b, mWt, None, mIds, mTileExpert,
                       (mIds, mTopkW, mY, mHs, mWs, mTileExpert))

    @cute.kernel
    def kernel_fp8_mc(self, tma_a: cute.CopyAtom, mAt: cute.Tensor, tma_b: cute.CopyAtom,
                      tma_bm: cute.CopyAtom, mWt: cute.Tensor, mHs: cute.Tensor, mWs: cute.Tensor,
                      mIds: cute.Tensor, mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor):
        """cluster_m 2: kernel_fp8 in 2-CTA clusters (see HopperGluGemmFp8.kernel_fp8_mc)."""
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, tma_a, mAt, tma_b, mWt, None, mIds, mTileExpert,
                       (mIds, mTopkW, mY, mHs, mWs, mTileExpert), tma_bm)

    @cute.jit
    def _load_kscales(self, sa, sb, tCcC, pairs, epi, expert, row0, bn, kt, sub: cutlass.Constexpr,
                      part: cutlass.Constexpr = 0, rows: cutlass.Constexpr = True):
        """K block ``sub`` (h_block columns) of k-tile ``kt``: h's scale of each accumulator row
        (unless ``rows`` is False) and the weight scale of column part ``part`` of the tile
        (fp8-block128: of its 128x128 block; "fp8": the expert's)."""
        _, _, _, mHs, mWs, _ = epi
        for hrow in cutlass.range_constexpr(self.acc_rows if rows else 0):
            r = tCcC[self._acc_index(hrow, 0)][0]
            sa[hrow] = mHs[row0 + r, kt * self.kblocks + sub]
        if const_expr(self.block):
            sb[0] = mWs[expert, (bn * self.tile_n + part * self.part_n) // SB, kt]
        else:
            sb[0] = mWs[expert]
        sb[1] = sb[0]

    @cute.jit
    def _epilogue_fp8(self, ctid, tiled_mma, acc, tCcC, pairs, scales, epi, expert, row0, bn):
        """GEMM2's register epilogue: the routing weight, 16-byte bf16 stores to y."""
        mIds, mTopkW, mY, _, _, _ = epi
        self._epilogue_regs(ctid, tiled_mma, acc, pairs, scales, (mIds, mTopkW, mY), row0, bn)

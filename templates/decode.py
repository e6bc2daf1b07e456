"""The whole MoE layer for a few tokens in one cooperative launch (decode; a DecodeVariant).

At 1-4 tokens the layer streams 8-32 experts' weights once and does almost no arithmetic, and
the four-kernel path pays routing, a combine and three launch gaps on top (Qwen3-30B, 1 token:
30 us against a 15.7 us floor). ``MoeDecode`` computes GEMM1 + GLU, GEMM2 + routing weight and
the top-k combine in one persistent grid of ``ctas`` CTAs (one per SM, all resident: the launch
is cooperative). Each CTA is a producer warp and ``warps`` consumer warps around a ring of
``stages`` shared-memory stages:

* the producer streams weight rows into the ring, ``warps`` row segments per stage, as 1-D bulk
  copies (``cp.async.bulk``, the DSL's ``CopyBulkG2SOp``), each stage's bytes announced on its
  full mbarrier. It never waits for the consumers' arithmetic, only for a free stage, so the
  weight stream runs on across units and across the two phases;
* phase 1, unit (expert group, block of ``warps`` h columns): consumer warp w owns h column
  c = block * warps + w and reads its gate row and its up row (two stages per row segment, the
  rows ``interleave`` apart in w13's interleaved order), dot products against x (in shared
  memory) for each token of the group, then h[q, c] = GLU(gate, up) in bf16;
* phase 2, unit (block of ``warps`` output columns, every group): warp w owns output column
  c and reads row c of each group's w2, dot products against the group's h rows, which the
  producer copies into the same stage; the warp sums topk_weight * y over the groups in group
  order (deterministic) and writes out[m, c]: the combine needs no third pass.

Between the phases a grid barrier: the consumers of each CTA arrive, one atomic add to a 64-bit
counter (``bar``, int32[2] read as one int64, zero when allocated) that only grows, by ``ctas``
per launch. Launches on one workspace never overlap, so the value a CTA reads at its start lies
in [L * ctas, (L + 1) * ctas) for launch L and names the count that completes it; no CTA resets
anything, so the words are reused by every launch as they are (CUDA-graph safe) and the last
arrival costs one atomic, not three (it took 2.5 us from the last CTA's arrival to the producers
passing with a reset counter and a generation word, H200 2026-12-05; 2**63 / 132 launches do not
wrap). Only the producers wait on it, and only before copying h: each has already filled its ring
with its first phase-2 weight segments, so the barrier's latency overlaps the weight stream.
Measured and removed (twenty-third session, H200 2026-12-05, NOTES; the variant fields stay, with
one value each, because the kernels' names spell them): a producer of four warps of 16-byte
cp.async (1-5% slower than the bulk copies at all five bf16 presets) and per-group counters in
place of the grid barrier (a producer copying a group's h as soon as that group's phase-1 units
were counted: 5-29% slower, its one polling thread serialised).

Weights: bf16, or e4m3 with the fp8 layer's scales (``precision`` "fp8": w13s [E, 2] for the
gate and up rows, w2s [E], applied to each finished dot product; "fp8-block128": DeepSeek-V3's
128x128 blocks, w13s [E, 2I/128, H/128] in runtime/fp8.py's interleaved-by-block order, w2s
[E, H/128, I/128], each lane's 16-weight chunk summed and then scaled by its block's scale, which
the lane reads from global memory before it waits for the stage). A lane loads 16 bytes of a row
at a time (8 bf16 or 16 e4m3, converted to fp32 via cvt e4m3x2 -> f16x2); x and h stay fp32 /
bf16 in both (h is a workspace no caller reads; see lanes): no tensor core runs here, so
quantizing them as the fp8 layer's GEMMs do would cost accuracy and instructions and save nothing.
The fp8 kernel's reference is therefore the bf16 layer's on the dequantized weights
(tools/check_decode.py).

Groups: the pairs of one expert, up to ``max_tokens`` of them in pair order (more than one group
only if a token repeats an expert), read the expert's rows once. Ids outside [0, E) contribute
nothing; a token with no valid pair gets zeros. x is held in fp32 (only weights are unpacked),
in shared memory in the lane-major order of _x_at, so that a warp's x loads are conflict-free;
a kernel for one token keeps its accumulators in registers, one for more loops over each group's
filled slots with per-lane accumulators in shared memory where a group has more than one (see
_dots).

Measured (H200, 2026-12-04, tools/check_decode.py; NOTES "twenty-first session"): correct at 1-4
tokens for the five presets, memcheck clean; at 1 token the bulk producer with one slot runs at
0.83-0.97x the four-kernel layer's speed (DRAM 55-77% of peak).

Measured (H200, 2026-12-05, NOTES "twenty-third" and "twenty-fourth session"): every build correct;
16 consumer warps and 4 KB segments each 3-16% faster at most presets. fp8 weights first ran at
about bf16's weights per second: 23.9 M shared-memory bank-conflict wavefronts from the row-major
fp32 x (lanes 64 bytes apart, 4-way; short-scoreboard stalls 4.3 of 8.1 cycles per issue). x is
now stored lane-major (_x_at): 1.88 M left, fp8 DeepSeek-V3 180 -> 108 us. The rest are phase 2's
h reads (e4m3's 16-element chunks, lanes 32 bytes apart). With ``lanes`` (an experiment, twenty-
fifth session, not yet run on a GPU) h is stored in a lane-major order too (_h_pos, _h_at) and
bf16 (h, and bf16 weights) is widened to fp32 by integer ops (_widen), one instruction per element
instead of 1.5: an fp8 phase-2 stage 312 -> 280 SASS instructions per lane.

Served as ``variants.DecodeVariant`` (role "decode"): a candidate of the 1-token bucket that the
tuner measures beside the four-kernel variants; the runtime launches it where it is the pick (h and
bar from its workspace), for up to ``max_tokens`` tokens on GPUs with at least ``ctas`` SMs.

Constraints:
  * sm_90a (bulk copies, mbarrier transaction counts, cooperative launch).
  * tokens M in [1, max_tokens]; hidden and intermediate multiples of 8 (fp8: 16; fp8-block128:
    128); ``interleave`` a multiple of ``warps``, intermediate of ``interleave``, hidden of
    ``warps``.
  * h [max_tokens * top_k, intermediate] bf16 and bar int32[2] are the caller's workspace; every
    element of h read is written first in the same launch.
  * bias=True (gpt-oss): b13 [E, 2I] bf16 (interleaved as w13's rows), b2 [E, H] bf16.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.cutlass_dsl import dsl_user_op

from moe_aot import gemm_limits as limits

from .grouped_gemm import glu_act

_WARP = 32
_VEC = 8  # elements per fp32 vector step of _dots (one 16-byte load of bf16)
_CHUNK = limits.DECODE_CHUNK  # bytes of a weight row a lane loads at a time
# the rules (precisions, producers, syncs, segments, the ring's layout) are gemm_limits' (DSL-free)
PRODUCERS = limits.DECODE_PRODUCERS  # {"bulk": 1}: one producer warp
PRECISIONS = limits.DECODE_PRECISIONS
SYNCS = limits.DECODE_SYNCS
SB = limits.SCALE_BLOCK
# timeline=True (a measuring build, never served): each CTA writes the %globaltimer (ns) of these
# events into tl[cta, event] (int64 [ctas, 16], zeroed by the caller; events a CTA does not reach
# stay 0). Written by thread 0 (consumer warp 0) or producer thread 0. p2_unitK_done: consumer warp
# 0 has finished its K-th phase-2 unit; producer_done: the producer has issued its last copy. The
# "_ns" events are durations, not times: the nanoseconds consumer warp 0 waited on full stages in
# phase 1 / phase 2, and the producer waited for free stages in phase 2 (what a stage's wait says:
# full waits, the weights arrive too late; empty waits, the consumers free them too late).
TIMELINE = ("entry", "tables", "producer_first_issue", "x_loaded", "first_stage_full", "phase1_done",
            "barrier_passed", "phase2_first_full", "end", "p2_unit1_done", "p2_unit2_done", "p2_unit3_done",
            "producer_done", "p1_full_wait_ns", "p2_full_wait_ns", "p2_empty_wait_ns")
TIMELINE_COLS = 16
# sync: how the producers learn that h is complete: "grid", one grid barrier after phase 1 (bar
# int32[2], one 64-bit count; see the module)
_SPIN_LIMIT = 1 << 26  # polls of a barrier word before the kernel traps (a broken count, not a hang)


@dsl_user_op
def _trap(*, loc=None, ip=None):
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


class MoeDecode:
    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16, max_tokens: int = 4,
                 warps: int = 8, stages: int = 0, seg_bytes: int = 2048, ctas: int = 132, bias: bool = False,
                 producer: str = "bulk", precision: str = "bf16", timeline: bool = False, sync: str = "grid",
                 rotate: bool = False, lanes: bool = True):
        ok, why = self.can_implement(num_experts, hidden, intermediate, top_k, activation, interleave,
                                     max_tokens, warps, stages, seg_bytes, ctas, precision=precision,
                                     producer=producer, sync=sync)
        if not ok:
            raise ValueError(why)
        self.num_experts, self.hidden, self.intermediate, self.top_k = num_experts, hidden, intermediate, top_k
        self.activation, self.interleave, self.max_tokens = activation, interleave, max_tokens
        self.warps, self.ctas, self.bias, self.timeline, self.sync = warps, ctas, bool(bias), bool(timeline), sync
        # rotate (an experiment, not a variant field): CTA b walks its phase-2 groups from group b % groups
        # on, so that the CTAs stream every expert's w2 at once rather than one expert after another
        # (the sum over groups is then in that order: deterministic per CTA, not the same for all columns)
        self.rotate = bool(rotate)
        # lanes (on by default since the 1-token picks were re-measured with it, 2026-12-05): h in
        # _h_pos's lane-major order for e4m3 weights, and bf16 (h, bf16 weights) widened to fp32 by
        # integer ops (_widen). Off: the kernel measured before (NOTES, twenty-fifth session).
        self.lanes = bool(lanes)
        self.producer = producer
        self.precision, self.fp8, self.block = precision, precision in limits.FP8, precision == "fp8-block128"
        self.wdt = Float8E4M3FN if self.fp8 else BFloat16
        self.wbytes = limits.decode_weight_bytes(precision)  # bytes per weight element
        self.wvec = _CHUNK // self.wbytes  # weight elements per 16-byte load
        self.threads = (warps + PRODUCERS[producer]) * _WARP  # warps consumers, then the producer warp
        self.pairs = max_tokens * top_k
        self.bar_words = limits.DECODE_BAR_WORDS
        self.seg1, self.seg2 = limits.decode_segments(hidden, intermediate, seg_bytes, precision)
        self.stage_bytes, self.x_elems, self.stages = limits.decode_layout(hidden, intermediate, max_tokens, warps,
                                                                           stages, seg_bytes, precision)

    can_implement = staticmethod(limits.check_decode)

    def fake_arguments(self):
        m = cute.sym_int32(symbol="M")
        e, hd, i, k, p = self.num_experts, self.hidden, self.intermediate, self.top_k, self.pairs
        wdt = self.wdt
        if self.block:
            w13s = make_fake_tensor(Float32, (e, 2 * i // SB, hd // SB), (2 * i // SB * (hd // SB), hd // SB, 1),
                                    assumed_align=4)
            w2s = make_fake_tensor(Float32, (e, hd // SB, i // SB), (hd // SB * (i // SB), i // SB, 1), assumed_align=4)
        elif self.fp8:
            w13s = make_fake_tensor(Float32, (e, 2), (2, 1), assumed_align=4)
            w2s = make_fake_tensor(Float32, (e,), (1,), assumed_align=4)
        else:
            w13s = w2s = None
        args = [
            ("x", make_fake_tensor(BFloat16, (m, hd), (hd, 1), assumed_align=16)),
            ("w13", make_fake_tensor(wdt, (e, 2 * i, hd), (2 * i * hd, hd, 1), assumed_align=16)),
            ("w13s", w13s),
            ("w2", make_fake_tensor(wdt, (e, hd, i), (hd * i, i, 1), assumed_align=16)),
            ("w2s", w2s),
            ("topk_weights", make_fake_tensor(Float32, (m, k), (k, 1), assumed_align=16)),
            ("topk_ids", make_fake_tensor(Int32, (m, k), (k, 1), assumed_align=16)),
            ("out", make_fake_tensor(BFloat16, (m, hd), (hd, 1), assumed_align=16)),
            ("h", make_fake_tensor(BFloat16, (p, i), (i, 1), assumed_align=16)),
            ("bar", make_fake_tensor(Int32, (self.bar_words,), (1,), assumed_align=16)),
        ]
        if self.bias:
            args += [("b13", make_fake_tensor(BFloat16, (e, 2 * i), (2 * i, 1), assumed_align=16)),
                     ("b2", make_fake_tensor(BFloat16, (e, hd), (hd, 1), assumed_align=16))]
        else:
            args += [("b13", None), ("b2", None)]
        tl = make_fake_tensor(Int64, (self.ctas, TIMELINE_COLS), (TIMELINE_COLS, 1), assumed_align=16)
        args += [("tl", tl if self.timeline else None)]
        return args + [("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, x: cute.Tensor, w13: cute.Tensor, w13s: Optional[cute.Tensor], w2: cute.Tensor,
                 w2s: Optional[cute.Tensor], topk_weights: cute.Tensor, topk_ids: cute.Tensor, out: cute.Tensor,
                 h: cute.Tensor, bar: cute.Tensor, b13: Optional[cute.Tensor], b2: Optional[cute.Tensor],
                 tl: Optional[cute.Tensor], stream: cuda.CUstream):
        self.kernel(x, w13, w13s, w2, w2s, topk_weights, topk_ids, out, h, bar, b13, b2, tl).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, cooperative=True)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _gmem_row(self, mW, e, row, rows: int, n: int, col, length: int):
        """``length`` elements from column ``col`` of row ``row`` of expert ``e`` of an [E, rows, n]
        tensor, addressed in 64 bits (E * rows * n exceeds 2**31 elements for DeepSeek-V3)."""
        base = (mW.iterator + (Int64(e) * rows + row) * n + col).align(16)
        return cute.make_tensor(base, cute.make_layout(length))

    @cute.jit
    def _smem_vec(self, ring, offset, length: int, dtype):
        """``length`` elements of ``dtype`` at byte ``offset`` (a multiple of 16) of the ring."""
        return cute.make_tensor(cute.recast_ptr((ring + offset).align(16), dtype=dtype), cute.make_layout(length))

    @cute.jit
    def _block_scales(self, mS, e, srow, col, length: int, lane):
        """fp8-block128: the scale of each of this lane's 16-element weight chunks of a row
        segment (``length`` elements from column ``col``) in scale row ``srow`` of expert e, loaded
        before the consumer waits for the stage (the warps of a CTA share the row block, so all but
        the first read hit L1)."""
        V = self.wvec
        nch = -(-length // (V * _WARP))
        sc = cute.make_rmem_tensor(cute.make_layout(nch), Float32)
        for i in cutlass.range_constexpr(nch):
            c = lane + i * _WARP
            if const_expr((i + 1) * _WARP * V <= length) or c * V < length:
                sc[i] = mS[e, srow, (col + c * V) // SB]
        return sc

    @cute.jit
    def _dots(self, row, length: int, lane, vec_of, nvalid, acc, sc):
        """Add this lane's share of <row, vec_of(m)> to slot m's accumulator for the group's
        filled slots m < nvalid (filled slots come first; nvalid >= 1), in fp32; _finish reduces
        each row once. The row's 16-byte chunks (8 bf16 or 16 e4m3 weights) are loaded and
        converted once, then each slot's vector (fp32 x, or bf16 h) is streamed against them, 8
        elements at a time; with block scales (sc, one per chunk) each chunk's products are summed
        and then scaled. acc is (8 registers per lane, this lane's row of slot accumulators in shared
        memory or None; see _acc). A group of one filled slot (always at max_tokens 1, and most
        groups at a few tokens over many experts) accumulates in the registers; a group of more
        loops over its slots with the accumulators in shared memory (one float per lane and slot):
        unrolled per-slot branches get if-converted, and every slot's unpack and FFMAs then issue
        predicated whatever the token count (NOTES, 2026-12-04 decode call 4)."""
        V = self.wvec
        nch = -(-length // (V * _WARP))
        w = cute.make_rmem_tensor(cute.make_layout((V, nch)), Float32)
        for i in cutlass.range_constexpr(nch):
            c = lane + i * _WARP
            if const_expr((i + 1) * _WARP * V <= length) or c * V < length:
                if const_expr(self.lanes and not self.fp8):
                    w[None, i].store(self._widen(row.iterator + c * V))
                else:
                    w[None, i].store(cute.local_tile(row, (V,), (c,)).load().to(Float32))
        racc, sacc = acc
        if const_expr(self.max_tokens == 1):
            self._dots_one(w, nch, length, lane, vec_of(0), racc[None, 0], sc)
        else:
            if nvalid == 1:
                self._dots_one(w, nch, length, lane, vec_of(0), racc[None, 0], sc)
            else:
                part = cute.make_rmem_tensor(cute.make_layout(_VEC), Float32)
                for m in range(nvalid):
                    part.fill(0.0)
                    self._dots_one(w, nch, length, lane, vec_of(m), part, sc)
                    sacc[m] = sacc[m] + part.load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

    @cute.jit
    def _dots_one(self, w, nch: int, length: int, lane, vec, dst, sc):
        """One slot's share of _dots: dst (8 fp32) += the lane's chunks of the row times vec's."""
        V = self.wvec
        for i in cutlass.range_constexpr(nch):
            c = lane + i * _WARP
            if const_expr((i + 1) * _WARP * V <= length) or c * V < length:
                self._chunk(w, i, vec, c, dst, sc)

    @cute.jit
    def _chunk(self, w, i: int, vec, c, dst, sc):
        """dst (8 fp32) += the products of weight chunk i (w's column i) and the matching elements
        of vec (chunk c of the row segment), times the chunk's block scale where there is one.
        vec is an h segment (bf16, contiguous) or an x segment (``(row pointer, first chunk)`` of
        s_x, in _x_at's order)."""
        V = self.wvec
        if const_expr(self.block):
            t = cute.make_rmem_tensor(cute.make_layout(_VEC), Float32)
            t.fill(0.0)
            for j in cutlass.range_constexpr(V // _VEC):
                wv = cute.make_tensor(w.iterator + (i * V + j * _VEC), cute.make_layout(_VEC)).load()
                t.store(t.load() + wv * self._vec8(vec, c, j))
            dst.store(dst.load() + t.load() * sc[i])
        else:
            for j in cutlass.range_constexpr(V // _VEC):
                wv = cute.make_tensor(w.iterator + (i * V + j * _VEC), cute.make_layout(_VEC)).load()
                dst.store(dst.load() + wv * self._vec8(vec, c, j))

    @cute.jit
    def _vec8(self, vec, c, j: int):
        """Elements 8j .. 8j+7 of chunk c of a segment (see _chunk), as fp32."""
        if const_expr(isinstance(vec, tuple)):
            row, k0 = vec
            v8 = cute.make_rmem_tensor(cute.make_layout(_VEC), Float32)
            for f in cutlass.range_constexpr(2):
                cute.make_tensor(v8.iterator + 4 * f, cute.make_layout(4)).store(
                    self._x_at(row, k0 + c, 2 * j + f).load())
            return v8.load()
        elif const_expr(self.lanes):
            return self._widen(vec.iterator + self._h_at(c, j))  # h, bf16 in _h_pos's order
        else:
            return cute.local_tile(vec, (_VEC,), (c * (self.wvec // _VEC) + j,)).load().to(Float32)

    @cute.jit
    def _widen(self, src):
        """8 bf16 at ``src`` (16-byte aligned) as fp32, by integer ops on the 4 words (a bf16 is the
        top half of its fp32: lo << 16, hi & 0xffff0000): one instruction per element, where the
        DSL's conversion takes two for every odd element (PRMT + SHF)."""
        words = cute.make_rmem_tensor(cute.make_layout(_VEC // 2), Int32)
        words.store(cute.make_tensor(cute.recast_ptr(src.align(16), dtype=Int32), cute.make_layout(_VEC // 2)).load())
        v8 = cute.make_rmem_tensor(cute.make_layout(_VEC), Float32)
        for i in cutlass.range_constexpr(_VEC // 2):
            v8[2 * i] = (words[i] << 16).bitcast(Float32)
            v8[2 * i + 1] = (words[i] & Int32(-65536)).bitcast(Float32)
        return v8.load()

    def _h_at(self, c, j: int):
        """Element offset, in a segment of h, of elements 8j .. 8j+7 of chunk c (the wvec elements a
        lane multiplies with one 16-byte weight load): bf16 weights, 8-element chunks, are contiguous
        (a warp's loads 16 bytes apart: no bank conflict); e4m3 weights take 16-element chunks, whose
        two halves are stored ``seg2 // 2`` elements apart, so that a warp's loads of one half hit 32
        consecutive 16-byte words (contiguous chunks, 32 bytes per lane apart, cost 2-way bank
        conflicts: 1.88 M wavefronts per fp8 DeepSeek-V3 launch, H200 2026-12-05). _h_pos writes it so."""
        if const_expr(self.wvec == _VEC or not self.lanes):
            return c * (self.wvec // _VEC) * _VEC + j * _VEC
        else:
            return c * _VEC + j * (self.seg2 // 2)

    def _h_pos(self, col):
        """Where column ``col`` of a row of h is stored (the order _h_at reads, segment by segment)."""
        if const_expr(self.wvec == _VEC or not self.lanes):
            return col
        else:
            seg, e = col // self.seg2, col % self.seg2
            return seg * self.seg2 + (e // self.wvec) * _VEC + ((e % self.wvec) // _VEC) * (self.seg2 // 2) + e % _VEC

    @cute.jit
    def _acc(self, s_acc, which: int, warp, lane):
        """Accumulators ``which`` (0: gate / y, 1: up) of this lane: (8 registers for a group of one
        filled slot, this lane's row of s_acc for groups of more; None at max_tokens 1)."""
        racc = cute.make_rmem_tensor(cute.make_layout((_VEC, 1)), Float32)
        if const_expr(self.max_tokens == 1):
            return racc, None
        else:
            MT = self.max_tokens
            return racc, cute.make_tensor(s_acc.iterator + ((which * self.warps + warp) * _WARP + lane) * MT,
                                          cute.make_layout(MT))

    @cute.jit
    def _zero(self, acc):
        racc, sacc = acc
        racc.fill(0.0)
        if const_expr(self.max_tokens > 1):
            for m in cutlass.range_constexpr(self.max_tokens):
                sacc[m] = Float32(0.0)

    @cute.jit
    def _advance(self, idx, phase):
        """The next ring stage and its phase parity (producer and consumers walk the ring alike)."""
        idx = idx + 1
        if idx == self.stages:
            idx = Int32(0)
            phase = phase ^ 1
        return idx, phase

    @cute.jit
    def _release(self, bar, lane):
        """The warp is done reading the stage: one arrival on its empty barrier, after the warp's
        lanes have met (256 arrivals on one barrier word per stage serialize)."""
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(bar)

    @cute.jit
    def _finish(self, acc, m: int, nvalid):
        """The whole row's dot product for slot m, in every lane of the warp."""
        racc, sacc = acc
        if const_expr(self.max_tokens == 1):
            part = racc[None, 0].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        else:
            part = sacc[m]
            if const_expr(m == 0):
                if nvalid == 1:
                    part = racc[None, 0].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return cute.arch.warp_reduction(part, lambda a, b: a + b)

    @cute.jit
    def _glu(self, g, u):
        """h of one column from fp32 scalars (grouped_gemm.glu's rule, for scalars)."""
        if const_expr(self.activation == "swigluoai"):
            lim = Float32(limits.SWIGLUOAI_LIMIT)
            gc, uc = g, u
            if gc > lim:
                gc = lim
            if uc > lim:
                uc = lim
            if uc < -lim:
                uc = -lim
            sig = cute.math.rcp(1.0 + cute.math.exp(-limits.SWIGLUOAI_ALPHA * gc, fastmath=True), fastmath=True)
            return (uc + 1.0) * (gc * sig)
        else:
            return glu_act(g, self.activation) * u

    @cute.jit
    def _bar64(self, mBar, sem: str):
        """The grid barrier's 64-bit counter (bar[0:2]), loaded with ``sem`` at gpu scope."""
        return cute.arch.load(cute.recast_ptr(mBar.iterator, dtype=Int64), Int64, sem=sem, scope="gpu")

    @cute.jit
    def _arrive(self, mBar, tidx, mTl, bid):
        """The consumer warps' h writes are done: fence them for other CTAs' bulk copies (the async
        proxy), meet, and add one to the grid barrier's 64-bit counter (see the module)."""
        W = self.warps
        cute.arch.fence_proxy("async.global")
        cute.arch.barrier(barrier_id=1, number_of_threads=W * _WARP)
        if tidx == 0:
            self._mark(mTl, bid, "phase1_done")
            # a release add: its own fence orders the CTA's h writes before it
            cute.arch.atomic_add(cute.recast_ptr(mBar.iterator, dtype=Int64), Int64(1), sem="release", scope="gpu")

    @cute.jit
    def _producers_see_h(self):
        """After producer thread 0 has seen h complete: the producer warp's lanes meet, then order
        their coming bulk reads of h after it (the async proxy)."""
        cute.arch.sync_warp()
        cute.arch.fence_proxy("async.global")

    @cute.jit
    def _p2_group(self, k, bid, n_groups):
        """The group of a CTA's k-th phase-2 group step (k in [0, n_groups)): k, or with rotate
        (k + bid) mod n_groups."""
        if const_expr(self.rotate):
            g = k + bid % n_groups
            if g >= n_groups:
                g = g - n_groups
            return g
        else:
            return k

    @cute.jit
    def _wait(self, bar, phase, waited):
        """mbarrier_wait; timeline builds add the nanoseconds it took to ``waited`` (returned)."""
        if const_expr(self.timeline):
            t0 = cute.arch.globaltimer()
            cute.arch.mbarrier_wait(bar, phase)
            waited = waited + (cute.arch.globaltimer() - t0)
        else:
            cute.arch.mbarrier_wait(bar, phase)
        return waited

    @cute.jit
    def _mark_value(self, mTl, bid, event: str, value):
        """timeline builds: ``value`` as this CTA's ``event`` (TIMELINE)."""
        if const_expr(self.timeline):
            mTl[bid, TIMELINE.index(event)] = value

    @cute.jit
    def _mark(self, mTl, bid, event: str):
        """timeline builds: the global timer at ``event`` (TIMELINE) for this CTA."""
        if const_expr(self.timeline):
            mTl[bid, TIMELINE.index(event)] = cute.arch.globaltimer()

    @cute.jit
    def _load_x(self, mX, s_x, M, tidx):
        """The consumer warps copy x into shared memory as fp32, in the lane-major order of
        ``_x_at`` (so a warp's x loads in _chunk hit 32 consecutive 16-byte words, no bank
        conflict): each thread's 16-byte loads of a row are unrolled, so they are in flight
        together (one memory latency per token, not one per load); the producer is streaming
        meanwhile."""
        H, n = self.hidden, self.warps * _WARP
        nx = H // _VEC
        v8 = cute.make_rmem_tensor(cute.make_layout(_VEC), Float32)
        for m in range(M):
            for j in cutlass.range_constexpr(-(-nx // n)):
                cc = tidx + j * n
                if const_expr((j + 1) * n <= nx) or cc < nx:
                    v8.store(cute.local_tile(mX[m, None], (_VEC,), (cc,)).load().to(Float32))
                    for f in cutlass.range_constexpr(2):
                        e = cc * _VEC + 4 * f  # the first element of this float4 of the row
                        self._x_at(s_x.iterator + m * H, e // self.wvec, (e % self.wvec) // 4).store(
                            cute.make_tensor(v8.iterator + 4 * f, cute.make_layout(4)).load())
        cute.arch.barrier(barrier_id=1, number_of_threads=n)

    @cute.jit
    def _x_at(self, row, k, q):
        """Float4 q of x's chunk k (the wvec elements a lane multiplies with one 16-byte weight
        load) in a row of s_x: stored at 4 * k + q * plane, plane = 4 * hidden / wvec floats, so
        lanes reading chunks k, k+1, ... of one plane read consecutive 16-byte words (measured
        2026-12-05: the row-major x, 32 or 64 bytes per lane apart, cost 2- or 4-way shared-memory
        bank conflicts, 23.9 M extra wavefronts per DeepSeek-V3 fp8 launch, and bounded the fp8
        kernel to about bf16's weights per second)."""
        return cute.make_tensor((row + 4 * k + q * (4 * self.hidden // self.wvec)).align(16), cute.make_layout(4))

    @cute.jit
    def _group_slots(self, s_slot, gi, slots):
        """Group gi's pairs into ``slots`` (filled slots first, then -1); returns how many."""
        n = Int32(0)
        for m in cutlass.range_constexpr(self.max_tokens):
            slots[m] = s_slot[gi, m]
            if slots[m] >= 0:
                n = n + 1
        return n

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW13: cute.Tensor, mW13s: Optional[cute.Tensor], mW2: cute.Tensor,
               mW2s: Optional[cute.Tensor], mTopkW: cute.Tensor, mIds: cute.Tensor, mOut: cute.Tensor,
               mH: cute.Tensor, mBar: cute.Tensor, mB13: Optional[cute.Tensor], mB2: Optional[cute.Tensor],
               mTl: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // _WARP)
        lane = cute.arch.lane_idx()
        M = cute.size(mX, mode=[0])
        K, H, I, g, W, MT = self.top_k, self.hidden, self.intermediate, self.interleave, self.warps, self.max_tokens
        S, SBy, seg1, seg2 = self.stages, self.stage_bytes, self.seg1, self.seg2
        wb, wdt = self.wbytes, self.wdt  # bytes per weight element, its type
        P = M * K
        C = self.ctas
        nseg1, nseg2 = H // seg1, I // seg2
        blocks1 = I // W  # phase-1 units per group
        units2 = H // W  # phase-2 units

        alloc = cutlass.memory.SmemAllocator()
        ring = alloc.allocate_array(Uint8, S * SBy, byte_alignment=128)
        s_x = cute.make_tensor(alloc.allocate_array(Float32, self.x_elems, byte_alignment=128),
                               cute.make_layout((MT, H), stride=(H, 1)))
        full = alloc.allocate_array(Int64, S, byte_alignment=8)
        empty = alloc.allocate_array(Int64, S, byte_alignment=8)
        s_ids = cute.make_tensor(alloc.allocate_array(Int32, self.pairs, byte_alignment=16),
                                 cute.make_layout(self.pairs))
        s_lead = cute.make_tensor(alloc.allocate_array(Int32, self.pairs, byte_alignment=16),
                                  cute.make_layout(self.pairs))
        s_exp = cute.make_tensor(alloc.allocate_array(Int32, self.pairs, byte_alignment=16),
                                 cute.make_layout(self.pairs))
        s_slot = cute.make_tensor(alloc.allocate_array(Int32, self.pairs * MT, byte_alignment=16),
                                  cute.make_layout((self.pairs, MT), stride=(MT, 1)))
        # per-lane slot accumulators of the consumer warps (more than one slot: see _dots)
        s_acc = cute.make_tensor(alloc.allocate_array(Float32, 2 * W * _WARP * MT if MT > 1 else 4,
                                                      byte_alignment=16),
                                 cute.make_layout(2 * W * _WARP * MT if MT > 1 else 4))

        # prologue: barriers, the count this launch's grid barrier waits for (sync="group": the
        # generation that selects the bank), pair ids (x is loaded by the consumers afterwards,
        # while the producer already streams)
        seen = Int64(0)
        if tidx == 0:
            self._mark(mTl, bid, "entry")
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(full + s, 1)  # the producer's arrival with the stage's bytes
                cute.arch.mbarrier_init(empty + s, W)  # one arrival per consumer warp
            cute.arch.mbarrier_init_fence()
        if warp >= W:
            # every arrival of the previous launches is counted, none of this launch's is missing
            # yet (this CTA's own is still to come): the count is in [L * C, (L + 1) * C)
            seen = (self._bar64(mBar, sem="acquire") // C + 1) * C
        if tidx < self.pairs:
            e = Int32(-1)
            if tidx < P:
                e = mIds[tidx // K, tidx % K]
                if e < 0 or e >= self.num_experts:
                    e = Int32(-1)
            s_ids[tidx] = e
        cute.arch.sync_threads()
        # a pair leads a group if it is the first, the (max_tokens+1)-th, ... pair of its expert
        if tidx < self.pairs:
            e = s_ids[tidx]
            lead = Int32(0)
            if e >= 0:
                before = Int32(0)
                for q in range(tidx):
                    if s_ids[q] == e:
                        before = before + 1
                if before % MT == 0:
                    lead = Int32(1)
            s_lead[tidx] = lead
        cute.arch.sync_threads()
        if tidx < self.pairs:
            if s_lead[tidx] != 0:
                e = s_ids[tidx]
                gi = Int32(0)
                for q in range(tidx):
                    gi = gi + s_lead[q]
                s_exp[gi] = e
                seen_pairs = Int32(0)
                for m in cutlass.range_constexpr(MT):
                    s_slot[gi, m] = Int32(-1)
                for r in range(tidx, self.pairs):
                    if s_ids[r] == e and seen_pairs < MT:
                        s_slot[gi, seen_pairs] = r
                        seen_pairs = seen_pairs + 1
        cute.arch.sync_threads()
        n_groups = Int32(0)
        for q in range(self.pairs):
            n_groups = n_groups + s_lead[q]
        n1 = n_groups * blocks1  # phase-1 units of the grid
        slots = cute.make_rmem_tensor(cute.make_layout(MT), Int32)
        if tidx == 0:
            self._mark(mTl, bid, "tables")

        if warp >= W:
            # ------------------------------------------------ the producer warp
            pt = tidx - W * _WARP  # producer thread
            idx = Int32(0)
            phase = Int32(0)
            for u in range(bid, n1, C):
                gi, blk = u // blocks1, u % blocks1
                e = s_exp[gi]
                c0 = blk * W
                gate0 = (c0 // g) * 2 * g + c0 % g
                for s in range(nseg1):
                    for half in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_wait(empty + idx, phase ^ 1)
                        self._open(full + idx, W * seg1 * wb, lane)
                        self._rows(mW13, e, gate0 + half * g, 2 * I, H, s * seg1, seg1, ring, idx, full, pt)
                        if const_expr(self.timeline and half == 0):
                            if pt == 0 and u == bid and s == 0:
                                self._mark(mTl, bid, "producer_first_issue")
                        idx, phase = self._advance(idx, phase)
            # phase 2: this CTA's stages in (unit, group, segment) order; h only after the barrier
            per_unit = n_groups * nseg2
            n2 = Int32(0)
            if bid < units2:
                n2 = ((units2 - 1 - bid) // C + 1) * per_unit
            pend = n2
            if pend > S:
                pend = Int32(S)
            first = idx
            waited = Int64(0)  # timeline builds: ns spent waiting for free stages in phase 2
            for j in range(n2):
                v = bid + (j // per_unit) * C
                gi, s = self._p2_group((j % per_unit) // nseg2, bid, n_groups), j % nseg2
                e = s_exp[gi]
                nvalid = self._group_slots(s_slot, gi, slots)
                if j == pend:
                    # the first `pend` stages hold their weight segments; wait for h, then fill in h
                    self._pending_h(mBar, seen, mH, ring, full, s_slot, slots, first, pend, per_unit, pt, mTl, bid)
                waited = self._wait(empty + idx, phase ^ 1, waited)
                self._open(full + idx, W * seg2 * wb + nvalid * seg2 * 2, lane)
                self._rows(mW2, e, v * W, H, I, s * seg2, seg2, ring, idx, full, pt)
                if j >= pend:
                    self._copy_h(mH, ring, full, s_slot, idx, gi, s, nvalid, pt)
                idx, phase = self._advance(idx, phase)
            if n2 > 0 and n2 == pend:
                # fewer stages than the ring: all of them wait for h here
                self._pending_h(mBar, seen, mH, ring, full, s_slot, slots, first, pend, per_unit, pt, mTl, bid)
            if const_expr(self.timeline):
                if pt == 0:
                    self._mark(mTl, bid, "producer_done")
                    self._mark_value(mTl, bid, "p2_empty_wait_ns", waited)
        else:
            # ------------------------------------------------ the consumer warps
            self._load_x(mX, s_x, M, tidx)
            if tidx == 0:
                self._mark(mTl, bid, "x_loaded")
            acc_g = self._acc(s_acc, 0, warp, lane)
            acc_u = self._acc(s_acc, 1, warp, lane)
            idx = Int32(0)
            phase = Int32(0)
            waited1 = Int64(0)  # timeline builds: ns consumer warp 0 waited on full stages in phase 1
            for u in range(bid, n1, C):
                gi, blk = u // blocks1, u % blocks1
                e = s_exp[gi]
                nvalid = self._group_slots(s_slot, gi, slots)
                self._zero(acc_g)
                self._zero(acc_u)
                sg, su = Float32(1.0), Float32(1.0)  # fp8: the expert's gate and up scales
                if const_expr(self.fp8 and not self.block):
                    sg, su = mW13s[e, 0], mW13s[e, 1]
                for s in range(nseg1):
                    for half in cutlass.range_constexpr(2):
                        sc = None
                        if const_expr(self.block):  # gate rows' block row 2b, up rows' 2b + 1
                            sc = self._block_scales(mW13s, e, 2 * (blk * W // SB) + half, s * seg1, seg1, lane)
                        waited1 = self._wait(full + idx, phase, waited1)
                        if const_expr(self.timeline and half == 0):
                            if tidx == 0 and u == bid and s == 0:
                                self._mark(mTl, bid, "first_stage_full")
                        row = self._smem_vec(ring, idx * SBy + warp * seg1 * wb, seg1, wdt)
                        xs = lambda m, s=s, gi=gi: (  # noqa: E731  (x's row of the slot's token, first chunk)
                            s_x.iterator + (s_slot[gi, m] // K) * H, s * (seg1 // self.wvec))
                        self._dots(row, seg1, lane, xs, nvalid, acc_g if half == 0 else acc_u, sc)
                        self._release(empty + idx, lane)
                        idx, phase = self._advance(idx, phase)
                c = blk * W + warp
                gate_row = (c // g) * 2 * g + c % g
                for m in cutlass.range_constexpr(MT):
                    gs = self._finish(acc_g, m, nvalid)
                    us = self._finish(acc_u, m, nvalid)
                    if const_expr(self.fp8 and not self.block):
                        gs, us = gs * sg, us * su
                    if lane == 0 and slots[m] >= 0:
                        if const_expr(self.bias):
                            gs = gs + mB13[e, gate_row].to(Float32)
                            us = us + mB13[e, gate_row + g].to(Float32)
                        mH[slots[m], self._h_pos(c)] = BFloat16(self._glu(gs, us))
            # h is read by other CTAs' bulk copies (the async proxy) after the grid barrier
            self._arrive(mBar, tidx, mTl, bid)
            # phase 2: out[:, c] = sum over groups of topk_weight * (h . w2_e[c] (+ b2_e[c]))
            acc = acc_g
            tot = cute.make_rmem_tensor(cute.make_layout(MT), Float32)
            waited2 = Int64(0)  # timeline builds: the same in phase 2
            for v in range(bid, units2, C):
                c = v * W + warp
                tot.fill(0.0)
                for gq in range(n_groups):
                    gi = self._p2_group(gq, bid, n_groups)
                    e = s_exp[gi]
                    nvalid = self._group_slots(s_slot, gi, slots)
                    self._zero(acc)
                    sd = Float32(1.0)  # fp8: the expert's down scale
                    if const_expr(self.fp8 and not self.block):
                        sd = mW2s[e]
                    for s in range(nseg2):
                        sc = None
                        if const_expr(self.block):
                            sc = self._block_scales(mW2s, e, v * W // SB, s * seg2, seg2, lane)
                        waited2 = self._wait(full + idx, phase, waited2)
                        if const_expr(self.timeline):
                            if tidx == 0 and v == bid and gq == 0 and s == 0:  # the CTA's first stage
                                self._mark(mTl, bid, "phase2_first_full")
                        row = self._smem_vec(ring, idx * SBy + warp * seg2 * wb, seg2, wdt)
                        hs = lambda m, idx=idx: self._smem_vec(  # noqa: E731
                            ring, idx * SBy + W * seg2 * wb + m * seg2 * 2, seg2, BFloat16)
                        self._dots(row, seg2, lane, hs, nvalid, acc, sc)
                        self._release(empty + idx, lane)
                        idx, phase = self._advance(idx, phase)
                    for m in cutlass.range_constexpr(MT):
                        y = self._finish(acc, m, nvalid)
                        if const_expr(self.fp8 and not self.block):
                            y = y * sd
                        q = slots[m]
                        if q >= 0:
                            if const_expr(self.bias):
                                y = y + mB2[e, c].to(Float32)
                            y = y * mTopkW[q // K, q % K]
                            for t in cutlass.range_constexpr(MT):
                                if q // K == t:
                                    tot[t] = tot[t] + y
                if lane == 0:
                    for t in cutlass.range_constexpr(MT):
                        if t < M:
                            mOut[t, c] = BFloat16(tot[t])
                if const_expr(self.timeline):
                    r = (v - bid) // C  # this CTA's phase-2 units so far, less one
                    if tidx == 0 and r < 3:
                        mTl[bid, TIMELINE.index("p2_unit1_done") + r] = cute.arch.globaltimer()
            if tidx == 0:
                self._mark(mTl, bid, "end")
                self._mark_value(mTl, bid, "p1_full_wait_ns", waited1)
                self._mark_value(mTl, bid, "p2_full_wait_ns", waited2)

    @cute.jit
    def _open(self, bar, nbytes, lane):
        """Announce the stage's bytes on its full barrier (one arrival) before the copies."""
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
        cute.arch.sync_warp()

    @cute.jit
    def _rows(self, mW, e, row0, rows: int, n: int, col, length: int, ring, st, full, pt):
        """Copy ``length`` elements from column ``col`` of rows row0 .. row0 + warps - 1 of expert e
        of an [E, rows, n] weight tensor into ring stage ``st`` (row r at r * length elements)."""
        self._copy_rows(lambda r: self._gmem_row(mW, e, row0 + r, rows, n, col, length).iterator,
                        self.warps, length, self.wdt, ring, st, st * self.stage_bytes, full, pt, 0)

    @cute.jit
    def _copy_h(self, mH, ring, full, s_slot, st, gi, s, nvalid, pt):
        """Copy segment s of h's row of each filled slot m of group gi into ring stage ``st``
        (after the weights' ``warps`` row segments)."""
        W, seg2, I = self.warps, self.seg2, self.intermediate
        self._copy_rows(lambda m: (mH.iterator + Int64(s_slot[gi, m]) * I + s * seg2).align(16),
                        nvalid, seg2, BFloat16, ring, st, st * self.stage_bytes + W * seg2 * self.wbytes, full, pt, W)

    @cute.jit
    def _copy_rows(self, src_of, count, length: int, dtype, ring, st, base, full, pt, first_lane: int):
        """Copy ``count`` rows of ``length`` ``dtype`` elements (row r from gmem pointer src_of(r))
        to ring bytes base + r * (the row's bytes) of stage ``st``: one bulk copy per row from lane
        first_lane + r, completing on the stage's full barrier."""
        nbytes = length * dtype.width // 8
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), dtype, num_bits_per_copy=length * dtype.width)
        if pt >= first_lane and pt < first_lane + count:
            r = pt - first_lane
            cute.copy(atom, cute.make_tensor(src_of(r), cute.make_layout(length)),
                      self._smem_vec(ring, base + r * nbytes, length, dtype), mbar_ptr=full + st)

    @cute.jit
    def _pending_h(self, mBar, seen, mH, ring, full, s_slot, slots, first, pend, per_unit, pt, mTl, bid):
        """Copy h into the ``pend`` phase-2 stages from ``first`` on, whose weight segments were
        issued before h was known complete, once the grid barrier's count reaches ``seen``."""
        S, nseg2 = self.stages, self.intermediate // self.seg2
        if pt == 0:
            # bounded: a barrier that never completes (a broken count) traps, an error the caller
            # sees, instead of hanging its process
            polls = Int32(0)
            now = self._bar64(mBar, sem="acquire")
            while now < seen and polls < _SPIN_LIMIT:
                now = self._bar64(mBar, sem="acquire")
                polls = polls + 1
            if now < seen:
                _trap()
            self._mark(mTl, bid, "barrier_passed")
        self._producers_see_h()
        for jj in range(pend):
            st = (first + jj) % S
            gi = self._p2_group((jj % per_unit) // nseg2, bid, per_unit // nseg2)
            nvalid = self._group_slots(s_slot, gi, slots)
            self._copy_h(mH, ring, full, s_slot, st, gi, jj % nseg2, nvalid, pt)

"""Device-side MoE routing and the top-k combine, as CuTe DSL kernels.

`MoeRouting` turns `topk_ids` into per-expert counts, tile-padded offsets, the expert-sorted
permutation and the tile -> expert map, on the GPU with no host synchronisation.
`MoeRoutingQuant` (the fp8 layers) is the same routing whose launch also quantizes x for GEMM1:
CTAs past the routing cluster run templates/quant.py's rows over x, beside the routing.
`MoeCombine` sums the K expert outputs of each token (already scaled by the routing weights).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from .quant import GROUP, RowQuantFp8, can_quantize, fake_quant_arguments

_WARP = 32
# Shared memory a CTA may use everywhere we target (sm_121 has 99 KiB, sm_90 227 KiB).
_SMEM_BUDGET = 96 * 1024
# MoeRoutingQuant: the CTAs that quantize x are at most this many; each group of quant.GROUP
# threads takes one row (8 per 1024-thread CTA), and loops only past 8 * _QUANT_CTAS rows: small
# CTAs balance themselves over the SMs the routing cluster leaves free (a capped grid whose every
# CTA loops would leave its last wave's CTAs a whole share of rows behind)
_QUANT_CTAS = 4096


@dsl_user_op
def _load_peer_i32(smem_ptr, cta_rank, *, loc=None, ip=None) -> Int32:
    """Int32 at `smem_ptr` in the shared memory of CTA `cta_rank` of this cluster."""
    addr = Int32(smem_ptr.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)
    value = llvm.inline_asm(
        T.i32(), [addr, Int32(cta_rank).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 ra; mapa.shared::cluster.u32 ra, $1, $2; ld.shared::cluster.u32 $0, [ra]; }",
        "=r,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(value)


class MoeRouting:
    """Counting sort of (token, k) pairs by expert, padded per expert to `tile_m` rows.

    Arguments of `__call__` (all int32, contiguous):
      topk_ids        [M, K]  expert id of each pair; pair p = m*K + k.
      expert_counts   [E]     pairs routed to each expert.
      expert_offsets  [E+1]   offsets[0] = 0, offsets[e+1] = offsets[e] + roundup(counts[e], tile_m).
      sorted_ids      [R]     rows [offsets[e], offsets[e]+counts[e]) hold expert e's pair indices
                              in ascending p; every other row is -1.
      tile_expert     [T]     e for tiles in [offsets[e]/tile_m, offsets[e+1]/tile_m), then -1.
    The caller sizes T = ceil((M*K + min(E, M*K)*(tile_m-1)) / tile_m) and R = T*tile_m; every
    entry of every output is written on every call, so buffers can be reused by CUDA graphs.
    Ids outside [0, E) are dropped: counted nowhere and placed nowhere.

    Design: one thread-block cluster of `cluster_size` CTAs (1 = a single CTA). CTA b owns the
    b-th contiguous slice of pairs and warp w of it a contiguous sub-slice. Pass 1 builds a
    per-warp histogram in shared memory; a column scan over warps gives each warp its first row
    per expert inside the CTA; the CTAs then read each other's per-expert totals through
    distributed shared memory, so each knows its own base per expert and all know the offsets.
    Pass 2 re-reads the pairs in the same order and ranks equal experts inside each 32-pair step
    with match.any + popc. Deterministic and stable, no global atomics, no workspace.
    One CTA is fastest for a few hundred tokens; large M needs the cluster (H200, E=256, K=8,
    M=16384: 161 us with 1 CTA, 28 us with 8, 20 us with 16), so cluster_size is a tunable
    the runtime should choose per token bucket.

    Constraints:
      - num_experts >= 1 and the per-warp histogram fits: 4*(num_threads/32*(E+1) + 4E + 1)
        bytes <= 96 KiB (E <= 512 at 1024 threads).
      - top_k >= 1; tile_m a power of two in [1, 1024].
      - num_threads a multiple of 32 in [32, 1024]; unroll in [1, 16];
        cluster_size in {1, 2, 4, 8, 16} (16 is a non-portable cluster size: Hopper only).
      - int32 tensors, contiguous; alignment 4 bytes (all accesses are scalar).
      - M * K and R must fit in int32.
      - pdl=True (sm_90+): lets the next kernel (GEMM1, launched as a programmatic dependent)
        launch at once; this kernel itself is launched normally and never waits.
    """

    def __init__(self, num_experts: int, top_k: int, tile_m: int,
                 num_threads: int = 1024, unroll: int = 8, cluster_size: int = 1,
                 pdl: bool = False):
        self.num_experts = num_experts
        self.pdl = bool(pdl)  # let the next kernel (GEMM1, launched as a dependent) launch early
        self.top_k = top_k
        self.tile_m = tile_m
        self.num_threads = num_threads
        self.unroll = unroll
        self.cluster_size = cluster_size
        self.num_warps = num_threads // _WARP
        # Padding the per-warp rows by one word keeps the column scan free of bank conflicts.
        self.hist_stride = num_experts + 1

    @cute.jit
    def __call__(self, topk_ids: cute.Tensor, expert_counts: cute.Tensor,
                 expert_offsets: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, stream: cuda.CUstream):
        num_pairs = cute.size(topk_ids)
        flat_ids = cute.make_tensor(topk_ids.iterator, cute.make_layout(num_pairs))
        C = self.cluster_size
        self.kernel(flat_ids, expert_counts, expert_offsets, sorted_ids, tile_expert).launch(
            grid=[C, 1, 1], block=[self.num_threads, 1, 1], cluster=[C, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ids: cute.Tensor, g_counts: cute.Tensor, g_offsets: cute.Tensor,
               g_sorted: cute.Tensor, g_tile_expert: cute.Tensor):
        self._route(ids, g_counts, g_offsets, g_sorted, g_tile_expert)

    @cute.jit
    def _route(self, ids: cute.Tensor, g_counts: cute.Tensor, g_offsets: cute.Tensor,
               g_sorted: cute.Tensor, g_tile_expert: cute.Tensor):
        E = self.num_experts
        NW = self.num_warps
        NT = self.num_threads
        U = self.unroll
        TM = self.tile_m
        C = self.cluster_size
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tid // _WARP
        lane = tid % _WARP

        if cutlass.const_expr(self.pdl):
            # The layer's first kernel, launched without programmatic dependence (the caller's
            # kernels before it need not signal); it lets GEMM1's CTAs launch at once, to wait
            # on the chip for this grid instead of being launched after it.
            cute.arch.griddepcontrol_launch_dependents()
        smem = SmemAllocator()
        s_hist = smem.allocate_tensor(
            Int32, cute.make_layout((NW, E), stride=(self.hist_stride, 1)), 16)
        s_count = smem.allocate_tensor(Int32, cute.make_layout(E), 16)   # this CTA's counts
        s_total = smem.allocate_tensor(Int32, cute.make_layout(E), 16)   # whole-input counts
        s_start = smem.allocate_tensor(Int32, cute.make_layout(E), 16)   # this CTA's first row
        s_off = smem.allocate_tensor(Int32, cute.make_layout(E + 1), 16)

        n = cute.size(ids)
        # CTA b owns 32-pair steps [b*per_cta, (b+1)*per_cta); its warp w owns per_warp of them
        # (a multiple of U; the tail past the CTA's slice is masked by `limit`).
        steps = (n + _WARP - 1) // _WARP
        per_cta = (steps + C - 1) // C
        per_warp = ((per_cta + NW - 1) // NW + U - 1) // U * U
        first_step = cta * per_cta + warp * per_warp
        limit = cutlass.min((cta + 1) * per_cta * _WARP, n)

        for i in range(tid, NW * self.hist_stride, NT):
            s_hist.iterator[i] = Int32(0)
        cute.arch.sync_threads()

        # Pass 1: per-warp histogram (shared atomics, rows private to a warp).
        for s0 in range(first_step, first_step + per_warp, U):
            keys = self._step_keys(ids, s0, lane, limit)
            for j in cutlass.range_constexpr(U):
                if keys[j] < E:
                    cute.arch.atomic_add(s_hist.iterator + (warp * self.hist_stride + keys[j]),
                                         Int32(1))
        cute.arch.sync_threads()

        # Column scan: lane l holds warp l's count of expert e; keep the exclusive prefix.
        for e in range(warp, E, NW):
            v = Int32(0)
            if lane < NW:
                v = s_hist[lane, e]
            incl = v
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            if lane < NW:
                s_hist[lane, e] = incl - v
            total = cute.arch.shuffle_sync(incl, _WARP - 1)
            if lane == 0:
                s_count[e] = total
                if cutlass.const_expr(C == 1):
                    s_total[e] = total
                    s_start[e] = Int32(0)
                    g_counts[e] = total

        if cutlass.const_expr(C > 1):
            # Every CTA reads every CTA's counts (distributed shared memory): its own base per
            # expert is the sum over lower-ranked CTAs, the totals give the offsets.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            for e in range(tid, E, NT):
                before = Int32(0)
                total = Int32(0)
                for b in cutlass.range_constexpr(C):
                    c = _load_peer_i32(s_count.iterator + e, b)
                    if b < cta:
                        before = before + c
                    total = total + c
                s_total[e] = total
                s_start[e] = before
                if cta == 0:
                    g_counts[e] = total
            # Peers may still be reading our counts: the matching wait is at the very end.
            cute.arch.cluster_arrive()
        cute.arch.sync_threads()

        # Offsets: warp 0, each lane scans a static run of experts.
        if warp == 0:
            per_lane = (E + _WARP - 1) // _WARP
            local = Int32(0)
            for i in cutlass.range_constexpr(per_lane):
                e = lane * per_lane + i
                if e < E:
                    local = local + (s_total[e] + (TM - 1)) // TM * TM
            incl = local
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            run = incl - local
            for i in cutlass.range_constexpr(per_lane):
                e = lane * per_lane + i
                if e < E:
                    s_off[e] = run
                    s_start[e] = s_start[e] + run
                    if cta == 0:
                        g_offsets[e] = run
                    run = run + (s_total[e] + (TM - 1)) // TM * TM
            total = cute.arch.shuffle_sync(incl, _WARP - 1)
            if lane == 0:
                s_off[E] = total
                if cta == 0:
                    g_offsets[E] = total
        cute.arch.sync_threads()

        # Fill work is spread over the whole cluster.
        gtid = cta * NT + tid
        gwarp = cta * NW + warp
        end = s_off[E]
        # Tile -> expert: largest e with offsets[e] <= row (binary search over offsets).
        num_tiles = cute.size(g_tile_expert)
        for t in range(gtid, num_tiles, C * NT):
            row = t * TM
            owner = Int32(-1)
            if row < end:
                lo = Int32(0)
                hi = Int32(E)
                for _ in cutlass.range_constexpr(max(1, math.ceil(math.log2(E + 1)))):
                    mid = (lo + hi + 1) // 2
                    if s_off[mid] <= row:
                        lo = mid
                    else:
                        hi = mid - 1
                owner = lo
            g_tile_expert[t] = owner
        # Padding rows at the end of each expert's segment (a warp per expert), then the tail.
        for e in range(gwarp, E, C * NW):
            for row in range(s_off[e] + s_total[e] + lane, s_off[e + 1], _WARP):
                g_sorted[row] = Int32(-1)
        num_rows = cute.size(g_sorted)
        for row in range(end + gtid, num_rows, C * NT):
            g_sorted[row] = Int32(-1)

        # Pass 2: stable scatter. Same traversal as pass 1; equal experts within one 32-pair
        # step are ranked by lane, and the step's leader advances the warp's running base.
        lt = cute.arch.lanemask_lt()
        for s0 in range(first_step, first_step + per_warp, U):
            keys = self._step_keys(ids, s0, lane, limit)
            for j in cutlass.range_constexpr(U):
                key = keys[j]
                peers = cute.arch.match_sync(0xFFFFFFFF, key)
                before = peers & lt
                rank = Int32(cute.arch.popc(before))
                base = Int32(0)
                if key < E:
                    base = s_hist[warp, key]
                cute.arch.sync_warp()
                if key < E:
                    if before == 0:
                        s_hist[warp, key] = base + Int32(cute.arch.popc(peers))
                    g_sorted[s_start[key] + base + rank] = (s0 + j) * _WARP + lane
                cute.arch.sync_warp()
        if cutlass.const_expr(C > 1):
            cute.arch.cluster_wait()

    @cute.jit
    def _step_keys(self, ids, s0, lane, limit):
        """This lane's expert id in each of the `unroll` 32-pair steps from s0; E stands for a
        pair past the slice or an id outside [0, E). Both passes read the pairs this way, so
        they see the same keys in the same order."""
        keys = []
        for j in cutlass.range_constexpr(self.unroll):
            p = (s0 + j) * _WARP + lane
            key = Int32(self.num_experts)
            if p < limit:
                v = ids[p]
                if v >= 0:
                    if v < self.num_experts:
                        key = v
            keys.append(key)
        return keys

    def can_implement(self, arch: str | None = None) -> tuple[bool, str]:
        """(ok, reason); with `arch` (e.g. "sm_90a") also the target's cluster limit."""
        E, K, TM = self.num_experts, self.top_k, self.tile_m
        if not isinstance(E, int) or E < 1:
            return False, f"num_experts must be a positive int, got {E!r}"
        if not isinstance(K, int) or K < 1:
            return False, f"top_k must be a positive int, got {K!r}"
        if not isinstance(TM, int) or TM < 1 or TM > 1024 or TM & (TM - 1):
            return False, f"tile_m must be a power of two in [1, 1024], got {TM!r}"
        nt = self.num_threads
        if not isinstance(nt, int) or nt % _WARP or not _WARP <= nt <= 1024:
            return False, f"num_threads must be a multiple of 32 in [32, 1024], got {nt!r}"
        if not isinstance(self.unroll, int) or not 1 <= self.unroll <= 16:
            return False, f"unroll must be in [1, 16], got {self.unroll!r}"
        if self.cluster_size not in (1, 2, 4, 8, 16):
            return False, f"cluster_size must be 1, 2, 4, 8 or 16, got {self.cluster_size!r}"
        if self.cluster_size > 8 and arch is not None and not arch.startswith(("sm_90", "sm_100")):
            return False, f"cluster_size {self.cluster_size} > 8 is non-portable; {arch} allows 8"
        if 4 * (self.num_warps * self.hist_stride + 4 * E + 1) > _SMEM_BUDGET:
            return False, (f"num_experts={E} needs more than {_SMEM_BUDGET} bytes of shared memory "
                           f"for the per-warp histogram of {nt} threads")
        return True, ""

    def fake_arguments(self):
        """(name, fake) pairs for cute.compile; M, R and T are dynamic, int32 aligned to 4 bytes."""
        m = cute.sym_int32(symbol="M")
        r = cute.sym_int32(symbol="R", divisibility=self.tile_m)
        t = cute.sym_int32(symbol="T")
        i32 = cutlass.Int32
        return [
            ("topk_ids", make_fake_compact_tensor(i32, (m, self.top_k), stride_order=(1, 0),
                                                  assumed_align=4)),
            ("expert_counts", make_fake_compact_tensor(i32, (self.num_experts,), assumed_align=4)),
            ("expert_offsets", make_fake_compact_tensor(i32, (self.num_experts + 1,),
                                                        assumed_align=4)),
            ("sorted_ids", make_fake_compact_tensor(i32, (r,), assumed_align=4)),
            ("tile_expert", make_fake_compact_tensor(i32, (t,), assumed_align=4)),
            ("stream", make_fake_stream()),
        ]


class MoeRoutingQuant(MoeRouting):
    """MoeRouting whose launch also quantizes the layer's input for the fp8 GEMMs.

    ``quant=(hidden, precision)``, precision "fp8" or "fp8-block128": `__call__` takes the
    routing's arguments, then x [M, hidden] bf16, xq [M, hidden] e4m3 and xs (fp8: [M];
    fp8-block128: [M, hidden/128]), x quantized as templates/quant.py describes. The grid is the
    routing cluster followed by Q more CTAs (a multiple of cluster_size, at most _QUANT_CTAS, none
    beyond what M needs), whose num_threads / 128 groups quantize rows q * groups + g, then every
    (Q * groups)-th row after it. x's quantization does not depend on the routing, so both run at
    once, and GEMM1 waits for one grid where it waited for two launches. Constraints: those of
    MoeRouting, num_threads a multiple of 128; x and xq 16-byte aligned rows.
    """

    def __init__(self, num_experts: int, top_k: int, tile_m: int, quant: tuple = (),
                 num_threads: int = 1024, unroll: int = 8, cluster_size: int = 1, pdl: bool = False):
        super().__init__(num_experts, top_k, tile_m, num_threads=num_threads, unroll=unroll,
                         cluster_size=cluster_size, pdl=pdl)
        self.quant = tuple(quant)
        self.rows = RowQuantFp8(*self.quant) if self.can_implement()[0] else None
        self.groups = num_threads // GROUP  # rows in flight per quant CTA

    def can_implement(self, arch: str | None = None) -> tuple[bool, str]:
        """MoeRouting's limits, then x's quantization: (hidden, precision) as quant.can_quantize
        takes them, a row per GROUP threads."""
        ok, reason = super().can_implement(arch)
        if not ok:
            return ok, reason
        if len(self.quant) != 2:
            return False, f"quant must be (hidden, precision), got {self.quant!r}"
        ok, reason = can_quantize(*self.quant)
        if not ok:
            return False, f"quant: {reason}"
        if self.num_threads % GROUP:
            return False, (f"quant: num_threads must be a multiple of {GROUP} (a row per {GROUP} threads), "
                           f"got {self.num_threads}")
        return True, ""

    def fake_arguments(self):
        """MoeRouting's, then x, xq and xs (M dynamic), then the stream."""
        named = super().fake_arguments()
        return named[:-1] + fake_quant_arguments(*self.quant) + named[-1:]

    @cute.jit
    def __call__(self, topk_ids: cute.Tensor, expert_counts: cute.Tensor,
                 expert_offsets: cute.Tensor, sorted_ids: cute.Tensor, tile_expert: cute.Tensor,
                 x: cute.Tensor, xq: cute.Tensor, xs: cute.Tensor, stream: cuda.CUstream):
        num_pairs = cute.size(topk_ids)
        flat_ids = cute.make_tensor(topk_ids.iterator, cute.make_layout(num_pairs))
        C = self.cluster_size
        need = (cute.size(x, mode=[0]) + self.groups - 1) // self.groups
        grid = C + (cutlass.min(need, _QUANT_CTAS) + C - 1) // C * C
        self.kernel_q(flat_ids, expert_counts, expert_offsets, sorted_ids, tile_expert, x, xq, xs).launch(
            grid=[grid, 1, 1], block=[self.num_threads, 1, 1], cluster=[C, 1, 1], stream=stream)

    @cute.kernel
    def kernel_q(self, ids: cute.Tensor, g_counts: cute.Tensor, g_offsets: cute.Tensor,
                 g_sorted: cute.Tensor, g_tile_expert: cute.Tensor, mX: cute.Tensor, mXq: cute.Tensor,
                 mXs: cute.Tensor):
        cta, _, _ = cute.arch.block_idx()
        red = SmemAllocator().allocate_array(Float32, self.num_threads // _WARP, byte_alignment=16)
        # whole clusters take one branch: the cluster's barriers stay among the routing CTAs
        if cta < self.cluster_size:
            self._route(ids, g_counts, g_offsets, g_sorted, g_tile_expert)
        else:
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()  # (as _route's CTAs do)
            self._quantize(mX, mXq, mXs, cta - self.cluster_size, red)

    @cute.jit
    def _quantize(self, mX, mXq, mXs, q, red):
        """Quant CTA q: group g (named barrier 1 + g, 4 words of ``red``) quantizes rows
        q * groups + g, then every (quant CTAs * groups)-th row after it."""
        tid, _, _ = cute.arch.thread_idx()
        nctas, _, _ = cute.arch.grid_dim()
        g = tid // GROUP
        stride = (nctas - self.cluster_size) * self.groups
        for row in range(q * self.groups + g, cute.size(mX, mode=[0]), stride):
            self.rows.row(mX, mXq, mXs, row, tid % GROUP, red + g * (GROUP // _WARP), 1 + g)


class MoeCombine:
    """out[m, :] = sum over k = 0..K-1 (in that order) of y[m*K + k, :] for pairs whose expert id
    is in [0, E); fp32 accumulation, bf16 result; a token with no valid pair gets zeros.

    Arguments of `__call__`: y [M*K, H] bf16 (already scaled by the routing weights),
    topk_ids [M, K] int32, out [M, H] bf16; all row-major contiguous.

    One thread owns 8 consecutive columns (one 16-byte vector) of one token; grid x walks tokens
    so M is not limited by the 65535 grid-y bound.

    Constraints:
      - hidden % 8 == 0 (16-byte vectors); y and out 16-byte aligned; topk_ids 4-byte aligned.
      - top_k >= 1, num_experts >= 1; num_threads a multiple of 32 in [32, 1024].
      - M * K * hidden must fit in int32 indexing (M*K*H < 2**31).
      - pdl=True (sm_90+): launched as a programmatic dependent of GEMM2; y is read only after
        GEMM2's grid has finished.
    """

    VEC = 8

    def __init__(self, num_experts: int, hidden: int, top_k: int, num_threads: int = 128,
                 pdl: bool = False):
        self.num_experts = num_experts
        self.pdl = bool(pdl)  # launched as a programmatic dependent of GEMM2
        self.hidden = hidden
        self.top_k = top_k
        self.num_threads = num_threads

    @cute.jit
    def __call__(self, y: cute.Tensor, topk_ids: cute.Tensor, out: cute.Tensor,
                 stream: cuda.CUstream):
        num_tokens = cute.size(out, mode=[0])
        vecs = self.hidden // self.VEC
        self.kernel(y, topk_ids, out).launch(
            grid=[num_tokens, (vecs + self.num_threads - 1) // self.num_threads, 1],
            block=[self.num_threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, y: cute.Tensor, ids: cute.Tensor, out: cute.Tensor):
        K = self.top_k
        if cutlass.const_expr(self.pdl):
            # Launched as a programmatic dependent of GEMM2: y is read only after its grid is done.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        tid, _, _ = cute.arch.thread_idx()
        m, by, _ = cute.arch.block_idx()
        v = by * self.num_threads + tid
        if v < self.hidden // self.VEC:
            # All K loads are issued before the first add (one 16-byte vector per pair, predicated
            # on the id being valid), so a thread waits for memory once, not K times.
            parts = []
            for k in cutlass.range_constexpr(K):
                part = cute.make_rmem_tensor(cute.make_layout((1, self.VEC)), y.element_type)
                part.fill(0.0)
                e = ids[m, k]
                if e >= 0 and e < self.num_experts:
                    part.store(cute.local_tile(y, (1, self.VEC), (m * K + k, v)).load())
                parts.append(part)
            acc = parts[0].load().to(Float32)
            for k in cutlass.range_constexpr(1, K):
                acc = acc + parts[k].load().to(Float32)
            dst = cute.local_tile(out, (1, self.VEC), (m, v))
            dst.store(acc.to(out.element_type))

    def can_implement(self) -> tuple[bool, str]:
        E, H, K = self.num_experts, self.hidden, self.top_k
        if not isinstance(E, int) or E < 1:
            return False, f"num_experts must be a positive int, got {E!r}"
        if not isinstance(K, int) or K < 1:
            return False, f"top_k must be a positive int, got {K!r}"
        if not isinstance(H, int) or H < self.VEC or H % self.VEC:
            return False, f"hidden must be a positive multiple of {self.VEC}, got {H!r}"
        nt = self.num_threads
        if not isinstance(nt, int) or nt % _WARP or not _WARP <= nt <= 1024:
            return False, f"num_threads must be a multiple of 32 in [32, 1024], got {nt!r}"
        return True, ""

    def fake_arguments(self):
        """(name, fake) pairs for cute.compile; M and M*K dynamic; y/out 16-byte aligned,
        topk_ids 4-byte aligned."""
        m = cute.sym_int32(symbol="M")
        mk = cute.sym_int32(symbol="MK", divisibility=self.top_k)
        return [
            ("y", make_fake_compact_tensor(cutlass.BFloat16, (mk, self.hidden), stride_order=(1, 0),
                                           assumed_align=16)),
            ("topk_ids", make_fake_compact_tensor(cutlass.Int32, (m, self.top_k),
                                                  stride_order=(1, 0), assumed_align=4)),
            ("out", make_fake_compact_tensor(cutlass.BFloat16, (m, self.hidden),
                                             stride_order=(1, 0), assumed_align=16)),
            ("stream", make_fake_stream()),
        ]

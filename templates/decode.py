"""The whole MoE layer for a few tokens in one cooperative launch (decode; not selectable yet).

At 1-3 tokens the layer streams 8-16 experts' weights once and does almost no arithmetic, and
the four-kernel path pays routing, a combine and three launch gaps on top (Qwen3-30B, 1 token:
30 us against a 15.7 us floor). ``MoeDecode`` does routing, GEMM1 + GLU, GEMM2 + routing weight
and the top-k combine in one persistent grid of ``ctas`` CTAs, separated by two grid-wide
barriers (the launch is cooperative, so all CTAs are resident):

1. every CTA stages the pairs' expert ids and weights and the tokens' rows of x in shared memory;
   work unit (pair p, block j of ``interleave`` gate + ``interleave`` up rows) runs only on the
   first pair of its expert's group (up to max_tokens pairs routed to one expert share one pass
   over its weights) and computes, per pair of the group, the 2*interleave dot products
   (warp-per-row, 16-byte loads, fp32 sums, shuffle reduction), then h = act(gate) * up in bf16;
2. unit (p, block of 32 rows of w2) computes y[q, rows] = h[q] . w2_e[rows] in fp32 for the pairs
   q of that expert;
3. out[m] = sum_k topk_weights[m, k] * y[m*K + k] (ids outside [0, E) contribute nothing).

No routing buffers, no padding. The barrier is a counter and a generation word in ``bar``
(int32[2], zero when allocated): the last CTA to arrive resets the counter and advances the
generation, so it is reused by every launch without a reset (CUDA-graph safe).

Constraints:
  * sm_90a (cooperative launch; the plain loads and shuffles would also run on sm_80+).
  * tokens M in [1, max_tokens]; hidden and intermediate multiples of 8; intermediate a multiple
    of ``interleave`` (16); shared memory max_tokens * hidden * 2 B for x plus 4 KB.
  * h [max_tokens * top_k, intermediate] bf16, y [max_tokens * top_k, hidden] fp32 and bar
    int32[2] are the caller's workspace; every element read is written first in the same launch.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from .grouped_gemm import glu_act

_WARP = 32
_VEC = 8  # bf16 per 16-byte load


class MoeDecode:
    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16, max_tokens: int = 4,
                 num_threads: int = 256, ctas: int = 132):
        ok, why = self.can_implement(num_experts, hidden, intermediate, top_k, activation, interleave,
                                     max_tokens, num_threads, ctas)
        if not ok:
            raise ValueError(why)
        self.num_experts, self.hidden, self.intermediate, self.top_k = num_experts, hidden, intermediate, top_k
        self.activation, self.interleave, self.max_tokens = activation, interleave, max_tokens
        self.threads, self.ctas = num_threads, ctas
        self.warps = num_threads // _WARP
        self.pairs = max_tokens * top_k
        self.rows1 = 2 * interleave  # w13 rows per phase-1 unit
        self.rows2 = 32  # w2 rows (output columns) per phase-2 unit
        # 16-byte chunks per lane of one row, and rows whose chunks are all in flight at once
        self.ch1 = -(-hidden // _VEC // _WARP)
        self.ch2 = -(-intermediate // _VEC // _WARP)
        # rows per warp whose loads are all in flight at once: up to 32 chunks (128 registers)
        self.inflight1 = self._inflight(self.rows1 // self.warps, self.ch1)
        self.inflight2 = self._inflight(self.rows2 // self.warps, self.ch2)

    @staticmethod
    def _inflight(rows_per_warp: int, chunks: int) -> int:
        n = max(1, min(rows_per_warp, 32 // chunks))
        while rows_per_warp % n:
            n -= 1
        return n

    @staticmethod
    def can_implement(num_experts, hidden, intermediate, top_k, activation="swiglu", interleave=16,
                      max_tokens=4, num_threads=256, ctas=132, arch=None):
        if activation not in ("swiglu", "geglu"):
            return False, f"activation {activation!r} must be 'swiglu' or 'geglu'"
        if hidden % _VEC or intermediate % interleave or interleave % 8:
            return False, f"hidden {hidden} must be a multiple of 8 and intermediate {intermediate} of {interleave}"
        if not 1 <= max_tokens <= 8 or max_tokens * top_k > num_threads:
            return False, f"max_tokens {max_tokens} must be in 1..8 with max_tokens*top_k <= {num_threads}"
        if num_threads % _WARP or (2 * interleave) % (num_threads // _WARP) or 32 % (num_threads // _WARP):
            return False, f"{num_threads} threads: the warps must divide the {2 * interleave} and 32 rows of a unit"
        if max_tokens * hidden * 2 + 4096 > 96 * 1024:
            return False, f"x of {max_tokens} tokens ({max_tokens * hidden * 2} B) does not fit shared memory"
        if arch is not None and arch != "sm_90a":
            return False, f"the cooperative decode kernel is built for sm_90a, not {arch}"
        return True, ""

    def fake_arguments(self):
        m = cute.sym_int32(symbol="M")
        e, hd, i, k, p = self.num_experts, self.hidden, self.intermediate, self.top_k, self.pairs
        return [
            ("x", make_fake_tensor(BFloat16, (m, hd), (hd, 1), assumed_align=16)),
            ("w13", make_fake_tensor(BFloat16, (e, 2 * i, hd), (2 * i * hd, hd, 1), assumed_align=16)),
            ("w2", make_fake_tensor(BFloat16, (e, hd, i), (hd * i, i, 1), assumed_align=16)),
            ("topk_weights", make_fake_tensor(Float32, (m, k), (k, 1), assumed_align=16)),
            ("topk_ids", make_fake_tensor(Int32, (m, k), (k, 1), assumed_align=16)),
            ("out", make_fake_tensor(BFloat16, (m, hd), (hd, 1), assumed_align=16)),
            ("h", make_fake_tensor(BFloat16, (p, i), (i, 1), assumed_align=16)),
            ("y", make_fake_tensor(Float32, (p, hd), (hd, 1), assumed_align=16)),
            ("bar", make_fake_tensor(Int32, (2,), (1,), assumed_align=16)),
            ("stream", make_fake_stream()),
        ]

    @cute.jit
    def __call__(self, x: cute.Tensor, w13: cute.Tensor, w2: cute.Tensor, topk_weights: cute.Tensor,
                 topk_ids: cute.Tensor, out: cute.Tensor, h: cute.Tensor, y: cute.Tensor,
                 bar: cute.Tensor, stream: cuda.CUstream):
        self.kernel(x, w13, w2, topk_weights, topk_ids, out, h, y, bar).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, cooperative=True)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _weight_row(self, mW, e, row, rows: int, n: int):
        """Row ``row`` of expert ``e`` of an [E, rows, n] weight tensor, addressed in 64 bits
        (E * rows * n exceeds 2**31 elements for DeepSeek-V3)."""
        base = (mW.iterator + (Int64(e) * rows + row) * n).align(16)  # n % 8 == 0
        return cute.make_tensor(base, cute.make_layout(n))

    @cute.jit
    def _grid_sync(self, bar, tidx):
        """All CTAs of the (cooperative, hence resident) grid meet here; writes before it are
        visible to every CTA after it."""
        cute.arch.sync_threads()
        if tidx == 0:
            count, gen = bar.iterator, bar.iterator + 1
            cute.arch.fence_acq_rel_gpu()
            seen = cute.arch.load(gen, Int32, sem="acquire", scope="gpu")
            old = cute.arch.atomic_add(count, Int32(1), sem="acq_rel", scope="gpu")
            if old == self.ctas - 1:
                cute.arch.atomic_exch(count, Int32(0), sem="relaxed", scope="gpu")
                cute.arch.atomic_add(gen, Int32(1), sem="release", scope="gpu")
            else:
                now = cute.arch.load(gen, Int32, sem="acquire", scope="gpu")
                while now == seen:
                    now = cute.arch.load(gen, Int32, sem="acquire", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()

    @cute.jit
    def _lead(self, s_ids, p):
        """Expert of pair p if p leads a group, else -1. The pairs of one expert are taken in
        groups of max_tokens in pair order (more than one group only if a token repeats an
        expert); the first pair of each group computes the whole group. Invalid ids: -1."""
        e = s_ids[p]
        before = Int32(0)
        for q in range(p):
            if s_ids[q] == e:
                before = before + 1
        if before % self.max_tokens != 0:
            e = Int32(-1)
        return e

    @cute.jit
    def _slot_pair(self, s_ids, p, e, slot: int, P):
        """The pair in group slot ``slot`` of the group led by pair p (expert e), or -1."""
        q = Int32(-1)
        seen = Int32(0)
        for r in range(p, P):
            if s_ids[r] == e:
                if seen == slot:
                    q = r
                seen = seen + 1
        return q

    @cute.jit
    def _dots(self, rows, n, chunks, lane, vec_of, s_dot, cols, tok_pairs):
        """s_dot[m, cols[r]] = <rows[r], vec_of(m, pair, chunk)> for every filled group slot m:
        one warp per row, several rows per warp at once. Every chunk of every row is loaded
        before any is used (all in flight), then each slot's vector chunk is loaded once and
        multiplied into every row's sum."""
        nr = len(rows)
        w = cute.make_rmem_tensor(cute.make_layout((_VEC, chunks, nr)), BFloat16)
        for r in cutlass.range_constexpr(nr):
            for i in cutlass.range_constexpr(chunks):
                c = lane + i * _WARP
                if const_expr((i + 1) * _WARP * _VEC <= n) or c * _VEC < n:
                    w[None, i, r].store(cute.local_tile(rows[r], (_VEC,), (c,)).load())
        acc = cute.make_rmem_tensor(cute.make_layout(nr), Float32)
        for m in cutlass.range_constexpr(self.max_tokens):
            if tok_pairs[m] >= 0:
                acc.fill(0.0)
                for i in cutlass.range_constexpr(chunks):
                    c = lane + i * _WARP
                    if const_expr((i + 1) * _WARP * _VEC <= n) or c * _VEC < n:
                        v = vec_of(m, tok_pairs[m], c)
                        for r in cutlass.range_constexpr(nr):
                            prod = w[None, i, r].load().to(Float32) * v
                            acc[r] = acc[r] + prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                for r in cutlass.range_constexpr(nr):
                    total = cute.arch.warp_reduction(acc[r], lambda a, b: a + b)
                    if lane == 0:
                        s_dot[m, cols[r]] = total

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW13: cute.Tensor, mW2: cute.Tensor, mTopkW: cute.Tensor,
               mIds: cute.Tensor, mOut: cute.Tensor, mH: cute.Tensor, mY: cute.Tensor, mBar: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // _WARP)
        lane = cute.arch.lane_idx()
        M = cute.size(mX, mode=[0])
        K, H, I, g = self.top_k, self.hidden, self.intermediate, self.interleave
        P = M * K

        alloc = cutlass.memory.SmemAllocator()
        s_ids = cute.make_tensor(alloc.allocate_array(Int32, self.pairs, byte_alignment=16),
                                 cute.make_layout(self.pairs))
        s_dot = cute.make_tensor(alloc.allocate_array(Float32, self.max_tokens * self.rows1, byte_alignment=16),
                                 cute.make_layout((self.max_tokens, self.rows1), stride=(self.rows1, 1)))
        s_x = cute.make_tensor(alloc.allocate_array(BFloat16, self.max_tokens * H, byte_alignment=16),
                               cute.make_layout((self.max_tokens, H), stride=(H, 1)))
        if tidx < P:
            e = mIds[tidx // K, tidx % K]
            if e < 0 or e >= self.num_experts:
                e = Int32(-1)
            s_ids[tidx] = e
        for c in range(tidx, M * (H // _VEC), self.threads):
            m, cc = c // (H // _VEC), c % (H // _VEC)
            cute.local_tile(s_x[m, None], (_VEC,), (cc,)).store(
                cute.local_tile(mX[m, None], (_VEC,), (cc,)).load())
        cute.arch.sync_threads()

        # phase 1: h[q] = act(x[m] . gate_e) * (x[m] . up_e), one unit per (pair, interleave block)
        nb1 = I // g
        rows_per_warp = self.rows1 // self.warps
        tok_pairs = cute.make_rmem_tensor(cute.make_layout(self.max_tokens), Int32)
        for u in range(bid, P * nb1, self.ctas):
            p, j = u // nb1, u % nb1
            e = self._lead(s_ids, p)
            if e >= 0:
                for m in cutlass.range_constexpr(self.max_tokens):
                    tok_pairs[m] = self._slot_pair(s_ids, p, e, m, P)
                for r0 in cutlass.range_constexpr(0, rows_per_warp, self.inflight1):
                    cols = [warp * rows_per_warp + r for r in range(r0, r0 + self.inflight1)]
                    self._dots([self._weight_row(mW13, e, j * self.rows1 + c, 2 * I, H) for c in cols], H,
                               self.ch1, lane,
                               lambda m, q, c: cute.local_tile(s_x[q // K, None], (_VEC,), (c,)).load().to(Float32),
                               s_dot, cols, tok_pairs)
                cute.arch.sync_threads()
                if tidx < self.max_tokens * g:
                    m, c = tidx // g, tidx % g
                    q = tok_pairs[m]
                    if q >= 0:
                        gate, up = s_dot[m, c], s_dot[m, g + c]
                        mH[q, j * g + c] = BFloat16(glu_act(gate, self.activation) * up)
                cute.arch.sync_threads()
        self._grid_sync(mBar, tidx)

        # phase 2: y[q, rows] = h[q] . w2_e[rows], 32 output columns per unit
        nb2 = H // self.rows2
        rows2_per_warp = self.rows2 // self.warps
        for u in range(bid, P * nb2, self.ctas):
            p, j = u // nb2, u % nb2
            e = self._lead(s_ids, p)
            if e >= 0:
                for m in cutlass.range_constexpr(self.max_tokens):
                    tok_pairs[m] = self._slot_pair(s_ids, p, e, m, P)
                for r0 in cutlass.range_constexpr(0, rows2_per_warp, self.inflight2):
                    cols = [warp * rows2_per_warp + r for r in range(r0, r0 + self.inflight2)]
                    self._dots([self._weight_row(mW2, e, j * self.rows2 + c, H, I) for c in cols], I,
                               self.ch2, lane,
                               lambda m, q, c: cute.local_tile(mH[q, None], (_VEC,), (c,)).load().to(Float32),
                               s_dot, cols, tok_pairs)
                cute.arch.sync_threads()
                if tidx < self.max_tokens * self.rows2:
                    m, c = tidx // self.rows2, tidx % self.rows2
                    q = tok_pairs[m]
                    if q >= 0:
                        mY[q, j * self.rows2 + c] = s_dot[m, c]
                cute.arch.sync_threads()
        self._grid_sync(mBar, tidx)

        # phase 3: the top-k combine
        for idx in range(bid * self.threads + tidx, M * H, self.ctas * self.threads):
            m, c = idx // H, idx % H
            acc = Float32(0.0)
            for k in cutlass.range_constexpr(self.top_k):
                if s_ids[m * K + k] >= 0:
                    acc = acc + mTopkW[m, k] * mY[m * K + k, c]
            mOut[m, c] = BFloat16(acc)

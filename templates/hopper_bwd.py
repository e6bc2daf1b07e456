"""The backward's data GEMMs of the fused MoE op (issue 11) on the persistent Hopper cores of
hopper_gemm.py (mma "hopws" cooperative or "hoppp" ping-pong), with the weights read N-major.

In the forward the weights are B in K-major order ([N, K] rows: w13 [E, 2I, H], w2 [E, H, I]).
The backward multiplies by the same matrices untransposed, so the same bytes are B in N-major
order: expert e's [K, N] row-major matrix, loaded by TMA into the canonical N-major 128-byte
swizzled wgmma layout (``b_mn``; one swizzle atom is 64 columns of N by 8 of K).

- ``HopperDhGemm`` (dH): G = dO_m W2_e for each routed row, A the rows of dO [M, H] gathered by
  token as GEMM1 gathers x (cp.async by the producer warpgroup), B = W2_e [H, I] (N = I, K = H).
  Its epilogue is the GLU's backward from the accumulators: with the forward's pre-activations
  (gate g, up u of the routed pair, ``fused_moe_train``'s preact [P + 1, 2I], row p; its last row
  zeros, which padding rows read) and the
  row's routing weight w (from the tile schedule, as GEMM2's),

      h = glu(g, u)      dh = w G      (dg, du) = glu's vector-Jacobian product at (g, u) with dh

  it writes da = (dg, du) [R, 2I] in w13's interleaved column order and hw = w h [R, I] (dW2's
  operand) in the padded row order of the routing, and per row and N tile the partial sum of
  G h (the routing weight's gradient, <dO_m, y_p> = <G, h>) to dwp [R, I / tile_n]. Padding rows
  write zeros everywhere (their A rows are never loaded: G there is whatever the stage held, and
  is replaced by zero before any use).
- ``HopperDxGemm`` (dX): y[p] = da_r W13_e for each routed row, A = da [R, 2I] (contiguous in
  padded order: TMA), B = W13_e [2I, H] (N = H, K = 2I): GEMM2's kernel with the weights read
  N-major. Its routing weights are ones (``topk_weights`` is a ones tensor: the weight is in da
  already), and the combine kernel (templates/routing.py) sums each token's rows into dx.

Constraints: bf16; sm_90a; mma hopws or hoppp, tile_m 64 or 128, tile_n a multiple of 64 up to
256 (hoppp at tile_m 128: up to 128), tile_k 64, stages >= 3, no clusters
(gemm_limits.check_backward_gemm); dH: interleave a multiple of 8 dividing I, I % tile_n == 0, H
% 64 == 0; dX: H % tile_n == 0, 2I % 64 == 0.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from moe_aot import gemm_limits as limits

from .glu_backward import dglu
from .grouped_gemm import PERSISTENT_CTAS, GroupedGluGemm, _GroupedGemmBase
from .hopper_gemm import HopperDownGemm, _HopperWs


class HopperDhGemm(_HopperWs, _GroupedGemmBase):
    """dH with the GLU's backward in its epilogue (see the module docstring).

    ``__call__(dout, w2, sorted_ids, tile_expert, topk_weights, preact, da, hw, dwp, stream)``:
    dout [M, H] bf16; w2 [E, H, I] bf16; sorted_ids [R], tile_expert [T] int32 (the routing of
    tile_m); topk_weights [M, top_k] fp32; preact [P + 1, 2I] bf16 (row p = m * top_k + k);
    da [R, 2I] bf16, hw [R, I] bf16, dwp [R, I / tile_n] fp32 written for every row of every
    tile with an expert (R = T * tile_m)."""

    glu = True  # A is gathered by token (cp.async), as GEMM1's x
    b_mn = True
    row_weights = True  # the schedule carries each row's routing weight (epi[1])
    _a_rows = GroupedGluGemm._a_rows

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16, tile_m: int = 128, tile_n: int = 128,
                 tile_k: int = 64, stages: int = 4, mma: str = "hopws", pdl: bool = False,
                 ctas: int = PERSISTENT_CTAS):
        ok, reason = self.can_implement(num_experts, hidden, intermediate, top_k, activation, interleave,
                                        tile_m, tile_n, tile_k, stages, mma)
        if not ok:
            raise ValueError(reason)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k, self.activation, self.interleave = top_k, activation, interleave
        self.bias = False
        super().__init__(intermediate, hidden, tile_m, tile_n, tile_k, stages, mma=mma, warps_m=None,
                         warps_n=None, pdl=pdl, ctas=ctas)

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, activation="swiglu", interleave=16,
                      tile_m=128, tile_n=128, tile_k=64, stages=4, mma="hopws", arch=None):
        if activation not in limits.ACTIVATIONS:
            return False, f"activation {activation!r} must be one of {', '.join(limits.ACTIVATIONS)}"
        if num_experts < 1 or top_k < 1 or top_k > num_experts:
            return False, f"need 1 <= top_k={top_k} <= num_experts={num_experts}"
        if interleave % 8 or interleave <= 0 or intermediate % interleave:
            return False, f"interleave {interleave} must be a positive multiple of 8 dividing I={intermediate}"
        return limits.check_backward_gemm(intermediate, hidden, tile_m, tile_n, tile_k, stages, mma, arch)

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        m = cute.sym_int32(symbol="M")
        r = cute.sym_int32(symbol="R", divisibility=self.tile_m)
        t = cute.sym_int32(symbol="T")
        p1 = cute.sym_int32(symbol="P1")
        e, hd, i = self.num_experts, self.hidden, self.intermediate
        nt = i // self.tile_n
        return [
            ("dout", make_fake_tensor(BFloat16, (m, hd), (hd, 1), assumed_align=16)),
            ("w2", make_fake_tensor(BFloat16, (e, hd, i), (hd * i, i, 1), assumed_align=16)),
            ("sorted_ids", make_fake_tensor(Int32, (r,), (1,), assumed_align=16)),
            ("tile_expert", make_fake_tensor(Int32, (t,), (1,), assumed_align=16)),
            ("topk_weights", make_fake_tensor(Float32, (m, self.top_k), (self.top_k, 1), assumed_align=16)),
            ("preact", make_fake_tensor(BFloat16, (p1, 2 * i), (2 * i, 1), assumed_align=16)),
            ("da", make_fake_tensor(BFloat16, (r, 2 * i), (2 * i, 1), assumed_align=16)),
            ("hw", make_fake_tensor(BFloat16, (r, i), (i, 1), assumed_align=16)),
            ("dwp", make_fake_tensor(Float32, (r, nt), (nt, 1), assumed_align=16)),
            ("stream", make_fake_stream()),
        ]

    @cute.jit
    def __call__(self, dout: cute.Tensor, w2: cute.Tensor, sorted_ids: cute.Tensor, tile_expert: cute.Tensor,
                 topk_weights: cute.Tensor, preact: cute.Tensor, da: cute.Tensor, hw: cute.Tensor,
                 dwp: cute.Tensor, stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        tma_b, mWt = self._make_tma_b(w2)
        self.kernel_ws(tma_b, mWt, dout, sorted_ids, tile_expert, topk_weights, preact, da, hw, dwp).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl, min_blocks_per_mp=1)

    @cute.kernel
    def kernel_ws(self, tma_b: cute.CopyAtom, mWt: cute.Tensor, mDO: cute.Tensor, mIds: cute.Tensor,
                  mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mP: cute.Tensor, mDA: cute.Tensor,
                  mHW: cute.Tensor, mDW: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        self._ws_tiles(tidx, None, None, tma_b, mWt, mDO, mIds, mTileExpert, (mP, mTopkW, mDA, mHW, mDW))

    @cute.jit
    def _epilogue_regs(self, ctid, tiled_mma, acc, pairs, scales, epi, row0, bn):
        """The GLU's backward from the accumulators, 8 consecutive h columns per lane: the four
        lanes of a quad hold a row's n8 blocks as fp32 pairs (lane q: columns 8j + 2q, 2q + 1);
        per group of four blocks they exchange pairs by shuffles (as _quad_transpose does for
        bf16 pairs) so that lane q holds all of block 4G + q. It then reads that block's gate and
        up pre-activations (16 bytes each: an interleave block holds whole 8-column blocks) and
        writes d gate, d up and w h as one 16-byte store each; G h is summed over the lane's
        columns, then over the quad."""
        mP, mDA, mHW, mDW = epi[0], epi[2], epi[3], epi[4]
        g = self.interleave
        i = self.intermediate
        tCcC = self._acc_coords(ctid, tiled_mma)
        lane = cute.arch.lane_idx()
        q = lane % 4
        quad0 = lane - q
        for hrow in cutlass.range_constexpr(self.acc_rows):
            r = tCcC[self._acc_index(hrow, 0)][0]
            p = pairs[hrow]
            w = scales[hrow]  # 0 for padding rows
            # a padding row reads the pre-activations' last row (zeros): the loads need no branch,
            # so that they can be issued ahead of the math of earlier blocks
            src = self._row(mP, p if p >= 0 else cute.size(mP, mode=[0]) - 1, 2 * i)
            da_row = self._row(mDA, row0 + r, 2 * i)
            hw_row = self._row(mHW, row0 + r, i)
            # the h column of block 4G + q's first element: this lane's column in block 0 is 2q
            col0 = bn * self.tile_n + tCcC[self._acc_index(hrow, 0)][1] - 2 * q + 8 * q
            dot = Float32(0.0)
            groups = self.tile_n // 32
            # gate and up blocks loaded a batch of groups at a time, before that batch's stores: the
            # stores may alias them as far as the compiler knows, so a load issued after a store
            # waits for it. A whole row per batch where the accumulators leave the registers
            # (64 per thread), else two groups (no spills at 128 accumulators).
            batch = groups if cute.size(acc) <= 64 else 2
            gates = cute.make_rmem_tensor(cute.make_layout((8, groups)), BFloat16)
            ups = cute.make_rmem_tensor(cute.make_layout((8, groups)), BFloat16)
            for grp in cutlass.range_constexpr(groups):
                c = col0 + 32 * grp
                gc = (c // g) * 2 * g + c % g  # its gate column in w13's interleaved order
                if grp % batch == 0:
                    for b in cutlass.range_constexpr(grp, min(grp + batch, groups)):
                        cb = col0 + 32 * b
                        gcb = (cb // g) * 2 * g + cb % g
                        gates[None, b].store(cute.local_tile(src, (8,), (gcb // 8,)).load())
                        ups[None, b].store(cute.local_tile(src, (8,), ((gcb + g) // 8,)).load())
                grad = self._quad_transpose_f32(acc, hrow, grp, q, quad0)  # every lane shuffles
                gate = gates[None, grp].load().to(Float32)
                up = ups[None, grp].load().to(Float32)
                if p < 0:  # a padding row: its A rows were never loaded
                    grad.fill(0.0)
                dg = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                du = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                hws = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                for e in cutlass.range_constexpr(8):
                    h, dge, due = dglu(gate[e], up[e], w * grad[e], self.activation)
                    dot = dot + grad[e] * h
                    dg[e], du[e], hws[e] = dge, due, w * h
                cute.local_tile(da_row, (8,), (gc // 8,)).store(dg.load().to(BFloat16))
                cute.local_tile(da_row, (8,), ((gc + g) // 8,)).store(du.load().to(BFloat16))
                cute.local_tile(hw_row, (8,), (c // 8,)).store(hws.load().to(BFloat16))
            dot = dot + cute.arch.shuffle_sync_bfly(dot, 1)
            dot = dot + cute.arch.shuffle_sync_bfly(dot, 2)
            if q == 0:
                mDW[row0 + r, bn] = dot

    @cute.jit
    def _quad_transpose_f32(self, acc, hrow: cutlass.Constexpr, grp: cutlass.Constexpr, q, quad0):
        """The 8 fp32 accumulators of block 4 grp + q of accumulator row ``hrow``, in column order:
        round r, lane q sends its pair of block 4 grp + (q ^ r) to lane q ^ r and receives that
        lane's pair of block 4 grp + q (columns 2 (q ^ r), +1 of the block)."""
        cand = cute.make_rmem_tensor(cute.make_layout(8), Float32)  # this lane's pairs of the 4 blocks
        for b in cutlass.range_constexpr(4):
            ai = self._acc_index(hrow, 4 * grp + b)
            cand[2 * b] = acc[ai]
            cand[2 * b + 1] = acc[ai + 1]
        got = cute.make_rmem_tensor(cute.make_layout(8), Float32)  # round r's pair at 2r, 2r + 1
        for rnd in cutlass.range_constexpr(4):
            for v in cutlass.range_constexpr(2):
                send = self._pick4(cand, v, q ^ rnd, 2)
                got[2 * rnd + v] = cute.arch.shuffle_sync(send, quad0 + (q ^ rnd))
        out = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        for src in cutlass.range_constexpr(4):  # lane src's pair came in round q ^ src
            for v in cutlass.range_constexpr(2):
                out[2 * src + v] = self._pick4(got, v, q ^ src, 2)
        return out


class HopperDxGemm(HopperDownGemm):
    """dX rows y[p] = da_r W13_e (see the module docstring): GEMM2's kernel over K = 2I with the
    weights read N-major. ``__call__(da, w13, sorted_ids, tile_expert, ones, y, None, stream)``:
    da [R, 2I] bf16; w13 [E, 2I, H] bf16; ones [M, top_k] fp32 (each row's scale); y [M * top_k, H]
    bf16, rows of routed pairs written."""

    b_mn = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int, tile_m: int = 128,
                 tile_n: int = 128, tile_k: int = 64, stages: int = 4, mma: str = "hopws", pdl: bool = False,
                 ctas: int = PERSISTENT_CTAS):
        ok, reason = limits.check_backward_gemm(hidden, 2 * intermediate, tile_m, tile_n, tile_k, stages, mma)
        if not ok:
            raise ValueError(reason)
        super().__init__(num_experts, hidden, 2 * intermediate, top_k, tile_m=tile_m, tile_n=tile_n,
                         tile_k=tile_k, stages=stages, mma=mma, pdl=pdl, ctas=ctas)
        self.layer_intermediate = intermediate

    @classmethod
    def can_implement(cls, num_experts, hidden, intermediate, top_k, tile_m=128, tile_n=128, tile_k=64,
                      stages=4, mma="hopws", warps_m=None, warps_n=None, arch=None, precision="bf16"):
        """GEMM2's rules with K = ``intermediate`` (the constructor passes 2I) and N-major weights."""
        ok, reason = super().can_implement(num_experts, hidden, intermediate, top_k, tile_m, tile_n, tile_k,
                                           stages, mma, warps_m, warps_n, arch, precision)
        if ok:
            ok, reason = limits.check_backward_gemm(hidden, intermediate, tile_m, tile_n, tile_k, stages, mma,
                                                    arch)
        return ok, reason

    def fake_arguments(self):
        args = dict(super().fake_arguments())
        from cutlass.cute.runtime import make_fake_tensor

        e, hd, i2 = self.num_experts, self.hidden, self.intermediate
        return [("da", args["h"]),
                ("w13", make_fake_tensor(BFloat16, (e, i2, hd), (i2 * hd, hd, 1), assumed_align=16)),
                ("sorted_ids", args["sorted_ids"]), ("tile_expert", args["tile_expert"]),
                ("ones", args["topk_weights"]), ("y", args["y"]), ("b2", None), ("stream", args["stream"])]

"""The GLU's backward of the fused MoE op's backward pass, as a CuTe DSL kernel.

``GluBackward(intermediate, activation, interleave)``: ``__call__(a, grad_h, w, da, hw, dw, stream)``
over P routed rows (P dynamic):

- a [P, 2I] bf16: GEMM1's pre-activations (gate and up interleaved in blocks of ``interleave``
  columns, as w13's rows; expert biases already added);
- grad_h [P, I] bf16: the dH GEMM's result G = dO_m W2_e (the output gradient not yet scaled by
  the routing weight);
- w [P] fp32: each row's routing weight;

-> da [P, 2I] bf16 (d gate, d up in a's layout, for dh = w * G), hw [P, I] bf16 (w * h with
h = glu(gate, up): dW2's operand) and dw [P] fp32 (the row's sum of G * h: the routing weight's
gradient). The math in fp32, one pass over the rows where torch needs about ten.

One CTA of 128 threads per row; thread t takes the 8-column chunks t, t + 128, ... of h, each
inside one interleave block, so its gate and up values are 16-byte loads as well; dw is reduced
by shuffles and then over the CTA's warps through shared memory.

Constraints: interleave a multiple of 8 dividing I; activation swiglu, geglu (tanh) or
swigluoai (gpt-oss's clamped SwiGLU, whose clamps pass no gradient where they bind).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, const_expr

from moe_aot import gemm_limits as limits

from .grouped_gemm import glu_gate_block

_THREADS = 128
_CHUNK = 8  # bf16 values per 16-byte load
_K0, _K1 = 0.7978845608028654, 0.044715  # GELU's tanh approximation: tanh(K0 (g + K1 g^3))


class GluBackward:
    def __init__(self, intermediate: int, activation: str = "swiglu", interleave: int = 16):
        ok, reason = self.can_implement(intermediate, activation, interleave)
        if not ok:
            raise ValueError(reason)
        self.intermediate, self.activation, self.interleave = intermediate, activation, interleave
        self.passes = -(-(intermediate // _CHUNK) // _THREADS)

    @staticmethod
    def can_implement(intermediate, activation="swiglu", interleave=16):
        if activation not in limits.ACTIVATIONS:
            return False, f"activation {activation!r} must be one of {', '.join(limits.ACTIVATIONS)}"
        if interleave % _CHUNK or interleave <= 0 or intermediate % interleave:
            return False, (f"interleave {interleave} must be a positive multiple of {_CHUNK} dividing "
                           f"I={intermediate}")
        return True, ""

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

        p = cute.sym_int32(symbol="P")
        i = self.intermediate
        return [
            ("a", make_fake_tensor(BFloat16, (p, 2 * i), (2 * i, 1), assumed_align=16)),
            ("grad_h", make_fake_tensor(BFloat16, (p, i), (i, 1), assumed_align=16)),
            ("w", make_fake_tensor(Float32, (p,), (1,), assumed_align=4)),
            ("da", make_fake_tensor(BFloat16, (p, 2 * i), (2 * i, 1), assumed_align=16)),
            ("hw", make_fake_tensor(BFloat16, (p, i), (i, 1), assumed_align=16)),
            ("dw", make_fake_tensor(Float32, (p,), (1,), assumed_align=4)),
            ("stream", make_fake_stream()),
        ]

    @cute.jit
    def __call__(self, a: cute.Tensor, grad_h: cute.Tensor, w: cute.Tensor, da: cute.Tensor, hw: cute.Tensor,
                 dw: cute.Tensor, stream: cuda.CUstream):
        self.kernel(a, grad_h, w, da, hw, dw).launch(grid=[cute.size(a, mode=[0]), 1, 1],
                                                     block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mG: cute.Tensor, mW: cute.Tensor, mDA: cute.Tensor, mHW: cute.Tensor,
               mDW: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        i = self.intermediate
        nb = self.interleave // _CHUNK  # chunks per gate (or up) block
        a_row, g_row = self._row(mA, row, 2 * i), self._row(mG, row, i)
        da_row, hw_row = self._row(mDA, row, 2 * i), self._row(mHW, row, i)
        w = mW[row]
        acc = Float32(0.0)
        for j in cutlass.range_constexpr(self.passes):
            c = tidx + j * _THREADS
            if c < i // _CHUNK:
                gi = glu_gate_block(c, self.interleave)
                gate = cute.local_tile(a_row, (_CHUNK,), (gi,)).load().to(Float32)
                up = cute.local_tile(a_row, (_CHUNK,), (gi + nb,)).load().to(Float32)
                grad = cute.local_tile(g_row, (_CHUNK,), (c,)).load().to(Float32)
                dg = cute.make_rmem_tensor(cute.make_layout(_CHUNK), Float32)
                du = cute.make_rmem_tensor(cute.make_layout(_CHUNK), Float32)
                hws = cute.make_rmem_tensor(cute.make_layout(_CHUNK), Float32)
                for e in cutlass.range_constexpr(_CHUNK):
                    h, dge, due = self._dglu(gate[e], up[e], w * grad[e])
                    acc = acc + grad[e] * h
                    dg[e], du[e], hws[e] = dge, due, w * h
                cute.local_tile(da_row, (_CHUNK,), (gi,)).store(dg.load().to(BFloat16))
                cute.local_tile(da_row, (_CHUNK,), (gi + nb,)).store(du.load().to(BFloat16))
                cute.local_tile(hw_row, (_CHUNK,), (c,)).store(hws.load().to(BFloat16))
        for s in cutlass.range_constexpr(5):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, 1 << s)
        red = cutlass.memory.SmemAllocator().allocate_array(Float32, _THREADS // 32)
        if tidx % 32 == 0:
            red[tidx // 32] = acc
        cute.arch.sync_threads()
        if tidx == 0:
            total = red[0]
            for k in cutlass.range_constexpr(1, _THREADS // 32):
                total = total + red[k]
            mDW[row] = total

    @cute.jit
    def _row(self, mT, row, n: cutlass.Constexpr):
        base = (mT.iterator + cutlass.Int64(row) * n).align(16)
        return cute.make_tensor(base, cute.make_layout(n))

    @cute.jit
    def _dglu(self, g, u, dh):
        return dglu(g, u, dh, self.activation)


@cute.jit
def dglu(g, u, dh, activation: cutlass.Constexpr):
    """(h, dL/dg, dL/du) at one element for the output gradient dh of h = glu(g, u) (fp32; also
    the dH GEMM's epilogue, templates/hopper_bwd.py)."""
    if const_expr(activation == "swiglu"):
        s = cute.math.rcp(1.0 + cute.math.exp(-g, fastmath=True), fastmath=True)
        act = g * s
        return act * u, dh * u * s * (1.0 + g * (1.0 - s)), dh * act
    elif const_expr(activation == "geglu"):
        t = cute.math.tanh(_K0 * (g + _K1 * g * g * g), fastmath=True)
        act = 0.5 * g * (1.0 + t)
        dact = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _K0 * (1.0 + 3.0 * _K1 * g * g)
        return act * u, dh * u * dact, dh * act
    else:  # swigluoai: (uc + 1) * gc * sigmoid(alpha gc), gc = min(g, L), uc = clamp(u, -L, L)
        lim, alpha = limits.SWIGLUOAI_LIMIT, limits.SWIGLUOAI_ALPHA
        gc = cute.arch.fmin(g, Float32(lim))
        uc = cute.arch.fmax(cute.arch.fmin(u, Float32(lim)), Float32(-lim))
        s = cute.math.rcp(1.0 + cute.math.exp(-alpha * gc, fastmath=True), fastmath=True)
        act = gc * s
        pass_g, pass_u = Float32(1.0), Float32(1.0)  # 0 where a clamp binds
        if g > lim:
            pass_g = Float32(0.0)
        if u > lim or u < -lim:
            pass_u = Float32(0.0)
        return (uc + 1.0) * act, dh * (uc + 1.0) * (s + alpha * act * (1.0 - s)) * pass_g, dh * act * pass_u

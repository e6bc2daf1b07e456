"""The fused MoE op's backward (issue 11, first stage): the gradients of
`torch.ops.moe_aot.fused_moe` for x, w13, w2, topk_weights and the expert biases, in torch ops.

The forward stays the AOT kernels. The backward runs the compiled data path (moe_backward_fused:
dH with the GLU's backward fused, dX, and torch's or compiled weight-gradient GEMMs) where the
database has the bucket's backward variant, else (and where the variant picked is torch's data
GEMMs, variants.TORCH_DATA) moe_backward_torch: five grouped GEMMs (`torch._grouped_mm` on CUDA:
GEMM1 recomputed unless the forward kept it, dH, dW2, dW13, dX) around the GLU's backward, which is
one compiled CuTe DSL kernel (templates/glu_backward.py, `moe-aot build --backward`) where the
database has it and torch ops otherwise. What both keep:

- saved for backward: the op's inputs only (x, weights, routing), no activation: the GLU input is
  recomputed (one GEMM1), and the routing-weight gradient needs no GEMM2 output, since
  <dO_m, h_p W2_e^T> = <dO_m W2_e, h_p> (the dH GEMM's own result, G below);
- no host synchronisation: the pairs are sorted by expert on the device (ids outside [0, E) last,
  contributing nothing) and every grouped GEMM reads its expert offsets from the device, so a
  whole training step captures in a CUDA graph;
- deterministic: per-pair results are summed per token and per expert by gathers, sums and
  grouped GEMMs, never by atomics.

For a routed pair p = (m, k) with expert e, a = x_m W13_e^T (+ b13_e) holds gate g and up u
(interleaved in blocks of `block` columns), h = glu(g, u), out_m = sum_k w_mk (h W2_e^T (+ b2_e)):

    G = dO_m W2_e                 dw_mk = <G, h> (+ <dO_m, b2_e>)
    dh = w_mk G                   dg, du = glu's vector-Jacobian product at (g, u) with dh
    dW2_e = sum_p (w_mk dO_m)^T h      db2_e = sum_p w_mk dO_m
    dW13_e = sum_p da^T x_m            db13_e = sum_p da          dx_m = sum_k da W13_e
"""
from __future__ import annotations

from typing import Optional

import torch

from ..glu import glu_fn


def route(topk_ids: torch.Tensor, experts: int):
    """Pairs sorted by expert without a host sync: `order` [P] pair indices (m * top_k + k,
    ascending within an expert, invalid ids last), `offs` [E] int32 end row of each expert's
    segment, `valid` [P] whether each sorted row is a routed pair, `expert` [P] its expert (0 for
    invalid rows)."""
    flat = topk_ids.reshape(-1).long()
    ok = (flat >= 0) & (flat < experts)
    key = torch.where(ok, flat, experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts[:experts], 0).to(torch.int32)
    valid = ok[order]
    return order, offs, valid, torch.where(valid, flat[order], 0)


def _fast(*ts) -> bool:
    """Whether torch._grouped_mm takes these operands: CUDA, bf16."""
    return all(t.is_cuda and t.dtype == torch.bfloat16 for t in ts)


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of expert e (rows offs[e-1]..offs[e] of a [P, K]) times b[e] [K, N] -> [P, N]; rows
    past offs[-1] are left undefined (callers mask them). CUDA bf16: one torch._grouped_mm;
    otherwise (CPU, float64 for gradcheck) a loop over the experts."""
    if _fast(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[e]
        start = end
    return out


def gmm_k(at: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per expert e, at[:, rows_e] [N1, rows] times b[rows_e] [rows, N2] -> [E, N1, N2] (the weight
    gradients: K is each expert's row count, read from the device); experts without rows give zeros."""
    if _fast(at, b):
        return torch._grouped_mm(at, b, offs=offs)
    out = at.new_zeros(offs.numel(), at.shape[0], b.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = at[:, start:end] @ b[start:end]
        start = end
    return out


def _split(a: torch.Tensor, block: int):
    """[P, 2I] interleaved gate/up columns -> (gate, up), each [P, I]."""
    v = a.reshape(a.shape[0], -1, 2, block)
    return v[:, :, 0].reshape(a.shape[0], -1), v[:, :, 1].reshape(a.shape[0], -1)


def _sums(rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per expert, the sum of its rows of `rows` [P, N] -> [E, N], by a grouped GEMM with a ones
    vector (deterministic, where an index_add would be atomic)."""
    ones = rows.new_ones(rows.shape[0], 8).t()  # 8 rows: 16-byte strides for bf16
    return gmm_k(ones, rows, offs)[:, 0].contiguous()


def moe_forward_torch(x, w13, w2, topk_weights, topk_ids, activation="swiglu", block=16, b13=None, b2=None):
    """The layer in torch ops on the same sorted pairs as the backward, in the inputs' dtype
    (float64 for gradcheck): sum_k w_mk (glu(x_m W13_e^T + b13_e) W2_e^T + b2_e)."""
    M, K = topk_ids.shape
    order, offs, valid, expert = route(topk_ids, w13.shape[0])
    xs = x[order // K]
    a = gmm(xs, w13.transpose(1, 2), offs)
    if b13 is not None:
        a = a + b13[expert]
    h = glu_fn(activation)(*_split(a, block))
    y = gmm(h.to(w2.dtype), w2.transpose(1, 2), offs)
    if b2 is not None:
        y = y + b2[expert]
    y = torch.where(valid[:, None], y * topk_weights.reshape(-1)[order, None].to(y.dtype), 0)
    out = torch.zeros_like(y)
    out[order] = y
    return out.reshape(M, K, -1).sum(1).to(x.dtype)


def _glu_backward(activation: str, g, u, G, w):
    """(h, dg, du) of one GLU row block: h = glu(g, u), and dg, du = glu's vector-Jacobian
    product with dh = w * G. swiglu / geglu: torch's fused activation backward kernels, in the
    operands' dtype (a handful of passes over [P, I]); swigluoai: its derivative written out, in fp32."""
    import torch.nn.functional as F

    dh = G * w
    if activation in ("swiglu", "geglu"):
        aten = torch.ops.aten
        if activation == "swiglu":
            act = F.silu(g)
            dg = aten.silu_backward(dh * u, g)
        else:
            act = F.gelu(g, approximate="tanh")
            dg = aten.gelu_backward(dh * u, g, approximate="tanh")
        return act * u, dg, dh * act
    # swigluoai, in fp32 (autograd is off inside the backward op): h = (uc + 1) gc sigmoid(alpha gc)
    # with gc = min(g, L), uc = clamp(u, -L, L); a clamp passes no gradient where it binds
    from ..glu import SWIGLUOAI_ALPHA as alpha
    from ..glu import SWIGLUOAI_LIMIT as lim

    gf, uf, dhf = g.float(), u.float(), dh.float()
    gc, uc = gf.clamp(max=lim), uf.clamp(min=-lim, max=lim)
    s = torch.sigmoid(alpha * gc)
    act = gc * s
    dg = dhf * (uc + 1) * (s + alpha * act * (1 - s)) * (gf <= lim)
    du = dhf * act * ((uf >= -lim) & (uf <= lim))
    return ((uc + 1) * act).to(g.dtype), dg.to(g.dtype), du.to(g.dtype)


def _glu_kernel(x, topk_ids, w13, activation, block, bias):
    """The layer's compiled GLU backward (moe-aot build --backward) where it applies: CUDA bf16
    operands, the kernels' interleave, a kernel in the database; else None (torch ops)."""
    from ..variants import INTERLEAVE

    if not (x.is_cuda and w13.dtype == torch.bfloat16 and block == INTERLEAVE):
        return None
    from ..runtime.layer import glu_backward_kernel

    E, I2, H = w13.shape
    return glu_backward_kernel(E, topk_ids.shape[1], H, I2 // 2, activation, bias, x.device)


def _gemm1(xs, w13, offs, b13, expert):
    """The GLU's input of the expert-sorted rows xs: xs W13_e^T (+ b13_e), [P, 2I]."""
    a = gmm(xs, w13.transpose(1, 2), offs)
    return a if b13 is None else a + b13.index_select(0, expert)


def preact_torch(x, w13, topk_ids, b13=None):
    """fused_moe_train's second output in torch ops: [P + 1, 2I] (P = M * top_k), row p = m * top_k
    + k the GLU's input x_m W13_e^T (+ b13_e) of the routed pair p, the last row zeros (rows of
    pairs with an id outside [0, E) hold zeros too here; the kernels leave them unwritten, and
    the backward never reads them)."""
    order, offs, valid, expert = route(topk_ids, w13.shape[0])
    P = order.numel()
    offs_all = torch.cat((offs[:-1], offs.new_full((1,), P)))
    a = _gemm1(x.index_select(0, order // topk_ids.shape[1]), w13, offs_all, b13, expert)
    out = a.new_zeros(P + 1, a.shape[1])
    out.index_copy_(0, torch.where(valid, order, P), a)  # invalid pairs all land on row P ...
    out[P].zero_()  # ... which is then cleared
    return out


def _plan(x, topk_ids, w13, w2, activation, block, bias):
    """(BackwardVariant, BackwardGemms, weight-gradient kernels or None) of the layer's compiled
    backward at this token count (runtime.layer.backward_plan: the bucket's tuned pick, else its
    default) where it applies: CUDA bf16 operands, the kernels' interleave, the kernels in the
    database; else None. BackwardGemms is None where the pick is torch's data GEMMs
    (variants.TORCH_DATA). USE_WGRAD_KERNELS True / False overrides a compiled data path's weight
    gradients with the default compiled ones / torch's."""
    from ..variants import INTERLEAVE

    if not (x.is_cuda and x.dtype == w13.dtype == w2.dtype == torch.bfloat16 and block == INTERLEAVE):
        return None
    from ..runtime.layer import backward_plan

    E, I2, H = w13.shape
    M, K = topk_ids.shape
    plan = backward_plan(E, K, H, I2 // 2, activation, bias, x.device, M)
    if plan is None or plan[1] is None or USE_WGRAD_KERNELS is None:
        return plan
    v, kern, wk = plan
    if USE_WGRAD_KERNELS is False:
        return v, kern, None
    if wk is None:
        from ..runtime.wgrad import wgrad_kernels_for

        wk = wgrad_kernels_for(E, K, H, I2 // 2, x.device)
    return v, kern, wk


# The compiled weight-gradient GEMMs (templates/hopper_wgrad.py): None (default) uses them where the
# bucket's backward variant has them (its tuned pick, else variants.default_backward, which says
# where they measured faster than torch's grouped GEMMs); True always, False never
# (tools/bench_backward.py --wgrad measures both).
USE_WGRAD_KERNELS: bool | None = None


def moe_backward_fused(kern, grad_out, x, w13, w2, topk_weights, topk_ids, activation, b13=None, b2=None,
                       preact=None, wk=None):
    """moe_backward on the compiled data path (``kern``: runtime.layer.BackwardGemms; ``wk``: the
    compiled weight-gradient kernels, runtime.wgrad.wgrad_kernels_for, or None for torch's):

    - the routing kernel sorts the pairs by expert, padded to tile_m rows per expert (as the
      forward's);
    - dH (templates/hopper_bwd.py) gathers dO's token rows, multiplies by W2_e read N-major and
      runs the GLU's backward in its epilogue on the forward's pre-activations: da, w h and the
      routing weight's partial gradients, in padded row order (padding rows zero);
    - dX multiplies da by W13_e read N-major into one row per pair, and the combine kernel sums
      each token's rows (every sum a fixed order: bitwise repeatable);
    - the weight gradients: torch's grouped GEMMs over the padded segments on gathered copies
      (padding rows of da and w h are zeros, those of the gathered x and dO rows too), or the
      compiled variable-K GEMMs (templates/hopper_wgrad.py, x and dO gathered in their producers)
      where the backward variant has them (``wk``).
    Without ``preact`` the pre-activations are computed first (preact_torch)."""
    M, K = topk_ids.shape
    E, I2, H = w13.shape
    P = M * K
    dev = x.device
    m = kern.tile_m
    from ..layout import max_tiles

    T = max_tiles(M, K, E, m)
    R = T * m
    i32 = dict(dtype=torch.int32, device=dev)
    ids = topk_ids.to(torch.int32).contiguous()
    counts, offsets = torch.empty(E, **i32), torch.empty(E + 1, **i32)
    sorted_ids, tile_expert = torch.empty(R, **i32), torch.empty(T, **i32)
    kern.routing(ids, counts, offsets, sorted_ids, tile_expert)
    if preact is None:
        preact = preact_torch(x, w13, topk_ids, b13)
    wdt = w13.dtype  # bf16 for the kernels (tests emulate them in float64)
    dout = grad_out.to(wdt).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    da = torch.empty(R, I2, dtype=wdt, device=dev)
    hw = torch.empty(R, I2 // 2, dtype=wdt, device=dev)
    dwp = torch.empty(R, I2 // 2 // kern.dh_tile_n, dtype=torch.float32, device=dev)
    kern.dh(dout, w2.contiguous(), sorted_ids, tile_expert, tw, preact.contiguous(), da, hw, dwp)
    y = torch.empty(P, H, dtype=wdt, device=dev)
    kern.dx(da, w13.contiguous(), sorted_ids, tile_expert, torch.ones_like(tw), y)
    dx = torch.empty(M, H, dtype=wdt, device=dev)
    kern.combine(y, ids, dx)
    del y  # [P, H]: freed before the weight gradients (DeepSeek-V3 16384: 1.9 GB)
    # per padded row: its pair (P: padding, or rows past the last tile) and token (M: a zero row)
    valid = sorted_ids >= 0
    pair = torch.where(valid, sorted_ids, P).long()
    tok = torch.where(valid, sorted_ids // K, M).long()
    zero = x.new_zeros(1, H)
    ends = offsets[1:]
    if wk is not None:
        from ..runtime.wgrad import weight_gradients

        dw13, dw2 = weight_gradients(da, x.contiguous(), dout, hw, sorted_ids, offsets, counts, K, m, wk)
    else:
        # one gathered [R, H] copy alive at a time beside the gradients (DeepSeek-V3 16384: dW13
        # alone is 15 GB, each copy 2 GB)
        xs = torch.cat((x, zero)).index_select(0, tok)
        dw13 = gmm_k(da.t(), xs, ends)
        del xs
        ds = torch.cat((dout, zero)).index_select(0, tok)
        dw2 = gmm_k(ds.t(), hw, ends)
        del ds
    dtw = torch.zeros(P + 1, dtype=torch.float32, device=dev)
    dtw.index_copy_(0, pair, dwp.sum(1))  # padding rows all land on slot P, dropped
    dtw = dtw[:P].view(M, K)
    db13 = None if b13 is None else _sums(da, ends).to(b13.dtype)
    db2 = None
    if b2 is not None:
        # the bias term of y_p = w_p (h W2_e^T + b2_e): <dO_m, b2_e> into dtopk_weights and
        # sum_p w_p dO_m into db2_e, from dO itself by two [M, E]-sized products rather than from
        # gathered [R, H] copies of its rows (gpt-oss at 16384 tokens: ~1.2 ms of ncu time less)
        live = (ids >= 0) & (ids < E)
        e = ids.clamp(0, E - 1).long()
        dtw = dtw + torch.where(live, (dout @ b2.t()).gather(1, e).float(), 0.0)
        a = torch.zeros(M, E, dtype=torch.float32, device=dev)  # a[m, e]: token m's routing weight on e
        for k in range(K):  # one target per row and step: the sums' order is fixed
            a.scatter_add_(1, e[:, k:k + 1], torch.where(live[:, k:k + 1], tw[:, k:k + 1], 0.0))
        db2 = (a.to(wdt).t() @ dout).to(b2.dtype)
    dtw = dtw.to(topk_weights.dtype)
    return dx.to(x.dtype), dw13, dw2, dtw, db13, db2


def moe_backward(grad_out, x, w13, w2, topk_weights, topk_ids, activation="swiglu", block=16, b13=None, b2=None,
                 preact=None):
    """(dx, dw13, dw2, dtopk_weights, db13, db2) of moe_forward_torch / the fused op (see the module
    docstring); db13 / db2 are None without biases. Operands in the weights' dtype, sums in fp32.
    The GLU part runs in the compiled kernel of templates/glu_backward.py where the database has
    it (CUDA, bf16), else in torch ops. ``preact``: the forward's pre-activations as
    fused_moe_train returns them (preact_torch's layout), read instead of recomputing GEMM1."""
    plan = _plan(x, topk_ids, w13, w2, activation, block, b13 is not None)
    if plan is not None and plan[1] is not None:
        return moe_backward_fused(plan[1], grad_out, x, w13, w2, topk_weights, topk_ids, activation, b13, b2, preact,
                                  plan[2])
    return moe_backward_torch(grad_out, x, w13, w2, topk_weights, topk_ids, activation, block, b13, b2, preact)


def moe_backward_torch(grad_out, x, w13, w2, topk_weights, topk_ids, activation="swiglu", block=16, b13=None,
                       b2=None, preact=None, glu=False):
    """moe_backward with torch's grouped GEMMs (dH, dW2, dW13, dX, and GEMM1 again without
    ``preact``) around the GLU's backward: the path of operands the compiled data path does not
    take, and of the backward variant variants.TORCH_DATA. ``glu``: the compiled GLU backward to
    run (runtime.layer.glu_backward_kernel), None for torch ops, False (default) to look it up."""
    M, K = topk_ids.shape
    E, I2, H = w13.shape
    wdt = w13.dtype
    order, offs, valid, expert = route(topk_ids, E)
    P = order.numel()
    # Pairs with an id outside [0, E) (sorted last) join the last expert's rows with a zero output
    # gradient and weight: every row is then computed (grouped GEMMs leave rows past the last
    # offset undefined), and theirs are zeros, with no masking pass over the large tensors.
    offs_all = torch.cat((offs[:-1], offs.new_full((1,), P)))
    tok = order // K
    tok_grad = torch.where(valid, tok, M)  # row M: a zero row appended to grad_out
    w = torch.where(valid, topk_weights.reshape(-1)[order], 0).to(wdt).view(P, 1, 1)
    xs = x.index_select(0, tok)
    if preact is not None:  # the forward kept them: gather the rows in expert order (invalid: zeros)
        a = preact.index_select(0, torch.where(valid, order, P))
    else:
        a = _gemm1(xs, w13, offs_all, b13, expert)  # GEMM1 again: its input is not saved
    d_out = torch.cat((grad_out.to(wdt), grad_out.new_zeros(1, H, dtype=wdt))).index_select(0, tok_grad)
    G = gmm(d_out, w2, offs_all).view(P, -1, block)  # dO_m W2_e, [P, I] as h's column blocks
    kernel = _glu_kernel(x, topk_ids, w13, activation, block, b13 is not None) if glu is False else glu
    if kernel is not None:  # the compiled GLU backward: one pass over the rows
        da, hw = torch.empty_like(a), torch.empty(P, I2 // 2, dtype=wdt, device=a.device)
        dw = torch.empty(P, dtype=torch.float32, device=a.device)
        kernel(a, G.view(P, -1), w.view(P).float(), da, hw, dw)
    else:
        av = a.view(P, -1, 2, block)
        h, dg, du = _glu_backward(activation, av[:, :, 0], av[:, :, 1], G, w)
        dw = (G * h).sum((1, 2), dtype=torch.float32)
        da = torch.stack((dg, du), dim=2).view(P, I2)
        hw = (h * w).view(P, -1)
    if b2 is not None:
        dw = dw + (d_out * b2.index_select(0, expert)).sum(1, dtype=torch.float32)
    dw2 = gmm_k(d_out.t(), hw, offs_all)
    dw13 = gmm_k(da.t(), xs, offs_all)
    dxs = gmm(da, w13, offs_all)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(P, device=order.device)
    dx = dxs.index_select(0, inv).view(M, K, H).sum(1, dtype=torch.float32).to(x.dtype)
    dtw = dw.index_select(0, inv).view(M, K).to(topk_weights.dtype)
    db13 = None if b13 is None else _sums(da, offs_all).to(b13.dtype)
    db2 = None if b2 is None else _sums(d_out * w.view(P, 1), offs_all).to(b2.dtype)
    return dx, dw13, dw2, dtw, db13, db2


@torch.library.custom_op("moe_aot::fused_moe_backward", mutates_args=())
def fused_moe_backward(grad_out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                       w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                       preact: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_backward as one op (opaque to torch.compile, whose graphs then hold it whole: its
    routing and kernel lookup are not traceable): (dx, dw13, dw2, dtopk_weights, db13, db2), the
    bias gradients empty without biases; ``preact`` from fused_moe_train, or None (recompute)."""
    from ..variants import INTERLEAVE

    grads = moe_backward(grad_out, x, w13, w2, topk_weights, topk_ids, activation, INTERLEAVE, w13_bias, w2_bias,
                         preact)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@fused_moe_backward.register_fake
def _fused_moe_backward_fake(grad_out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias=None, w2_bias=None,
                             preact=None):
    like = lambda t: x.new_empty(0) if t is None else torch.empty_like(t)  # noqa: E731
    return like(x), like(w13), like(w2), like(topk_weights), like(w13_bias), like(w2_bias)


def _setup_context(ctx, inputs, output):
    x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias = inputs
    ctx.activation = activation
    ctx.save_for_backward(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias)


def _backward(ctx, grad_out):
    x, w13, w2, topk_weights, topk_ids, b13, b2 = ctx.saved_tensors
    dx, dw13, dw2, dtw, db13, db2 = torch.ops.moe_aot.fused_moe_backward(grad_out, x, w13, w2, topk_weights,
                                                                         topk_ids, ctx.activation, b13, b2)
    need = ctx.needs_input_grad  # as long as the arguments the call passed
    grads = (dx, dw13, dw2, dtw, None, None, db13 if b13 is not None else None, db2 if b2 is not None else None)
    return tuple(g if n else None for g, n in zip(grads, need))


def _setup_context_train(ctx, inputs, output):
    x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias = inputs
    ctx.activation = activation
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, output[1])


def _backward_train(ctx, grad_out, _grad_preact):
    x, w13, w2, topk_weights, topk_ids, b13, b2, preact = ctx.saved_tensors
    dx, dw13, dw2, dtw, db13, db2 = torch.ops.moe_aot.fused_moe_backward(grad_out, x, w13, w2, topk_weights,
                                                                         topk_ids, ctx.activation, b13, b2, preact)
    need = ctx.needs_input_grad
    grads = (dx, dw13, dw2, dtw, None, None, db13 if b13 is not None else None, db2 if b2 is not None else None)
    return tuple(g if n else None for g, n in zip(grads, need))


def register(op, train_op=None) -> None:
    """Register the backward on the fused_moe custom op, and on fused_moe_train (called once by
    op.py)."""
    op.register_autograd(_backward, setup_context=_setup_context)
    if train_op is not None:
        train_op.register_autograd(_backward_train, setup_context=_setup_context_train)

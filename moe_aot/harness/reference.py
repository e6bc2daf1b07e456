"""PyTorch references of every kernel's semantics (fp32 math); used by tests, `verify`, the
tuner's checks, the benchmark and the op's CPU implementation. Plain torch: no DSL, no database."""
from __future__ import annotations

import torch

from ..glu import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, activation_fn, glu_fn  # noqa: F401  (re-exported)
from ..layout import max_tiles


def routing_reference(topk_ids: torch.Tensor, experts: int, tile_m: int, num_tiles: int | None = None):
    """counts [E], offsets [E+1], sorted_ids [R], tile_expert [T] exactly as the routing kernel
    defines them: pairs p = m*top_k + k grouped by expert in ascending p, each expert's segment
    padded to tile_m with -1, ids outside [0, E) dropped. T defaults to max_tiles; R = T*tile_m."""
    M, K = topk_ids.shape
    T = max_tiles(M, K, experts, tile_m) if num_tiles is None else num_tiles
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < experts)
    counts = torch.bincount(flat[valid], minlength=experts)
    padded = (counts + tile_m - 1) // tile_m * tile_m
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=topk_ids.device)
    offsets[1:] = torch.cumsum(padded, 0)
    sorted_ids = torch.full((T * tile_m,), -1, dtype=torch.int32, device=topk_ids.device)
    tile_expert = torch.full((T,), -1, dtype=torch.int32, device=topk_ids.device)
    p = torch.arange(flat.numel(), device=topk_ids.device)[valid]
    e = flat[valid]
    order = torch.argsort(e * flat.numel() + p)  # stable: by expert, then pair index
    e_sorted, p_sorted = e[order], p[order]
    start = torch.zeros(experts + 1, dtype=torch.int64, device=topk_ids.device)
    start[1:] = torch.cumsum(counts, 0)
    rank = torch.arange(p_sorted.numel(), device=topk_ids.device) - start[e_sorted]
    sorted_ids[offsets[e_sorted] + rank] = p_sorted.to(torch.int32)
    tiles_per = padded // tile_m
    tile_expert[: int(tiles_per.sum())] = torch.repeat_interleave(
        torch.arange(experts, device=topk_ids.device, dtype=torch.int32), tiles_per)
    return counts.to(torch.int32), offsets.to(torch.int32), sorted_ids, tile_expert


def glu_reference(x, w13, topk_ids, activation="swiglu", block=16, b13=None):
    """[M*top_k, I] fp32: glu(x[m] @ gate_e^T (+ gate bias), x[m] @ up_e^T (+ up bias)) for every
    pair (m, k), e = topk_ids[m, k] (b13: [E, 2I] interleaved as w13's rows); rows of invalid ids
    are zeros."""
    M, K = topk_ids.shape
    E, I2, H = w13.shape
    # split per expert below: whole-model copies (split_gate_up, fp32) can be tens of GB
    v = w13.reshape(E, I2 // (2 * block), 2, block, H)
    bv = None if b13 is None else b13.reshape(E, I2 // (2 * block), 2, block)
    ids = topk_ids.reshape(-1).long()
    out = torch.zeros(M * K, I2 // 2, dtype=torch.float32, device=x.device)
    ids = ids.to(x.device)
    xs = x.float().repeat_interleave(K, dim=0)
    fn = glu_fn(activation)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < E:
            continue
        rows = (ids == e).nonzero().squeeze(1)
        a = xs[rows]
        gate, up = (v[e, :, j].reshape(I2 // 2, H).float() for j in (0, 1))
        g, u = a @ gate.t(), a @ up.t()
        if bv is not None:
            g, u = g + bv[e, :, 0].reshape(-1).float(), u + bv[e, :, 1].reshape(-1).float()
        out[rows] = fn(g, u)
    return out


def moe_reference(x, w13, w2, topk_weights, topk_ids, activation="swiglu", block=16, b13=None, b2=None):
    """The whole layer in fp32: sum_k w[m,k] * (GLU(x[m]) @ w2_e^T (+ b2_e)); invalid ids
    contribute nothing. b13 [E, 2I] (interleaved as w13's rows) and b2 [E, H]: expert biases."""
    M, K = topk_ids.shape
    h = glu_reference(x, w13, topk_ids, activation, block, b13)
    ids = topk_ids.reshape(-1).long()
    y = torch.zeros(M * K, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w2.shape[0]:
            continue
        rows = (ids == e).nonzero().squeeze(1)
        y[rows] = h[rows] @ w2[e].float().t()
        if b2 is not None:
            y[rows] += b2[e].float()
    y = y * topk_weights.reshape(-1, 1).float()
    return y.reshape(M, K, w2.shape[1]).sum(1)  # sizes, not -1: M may be 0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row: max_r ||out_r - ref_r|| / ||ref_r|| over every row (rows whose reference is
    below a thousandth of the mean row norm count against that floor), so one wrong row fails
    even when the whole-output norm hides it."""
    out, ref = out.float(), ref.float()
    if out.numel() == 0:
        return 0.0
    if not torch.isfinite(out).all():
        return float("nan")
    norms = ref.norm(dim=1)
    floor = (norms.mean() * 1e-3).clamp_min(1e-30)
    return ((out - ref).norm(dim=1) / norms.clamp_min(floor)).max().item()

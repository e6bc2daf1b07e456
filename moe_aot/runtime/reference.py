"""PyTorch references of every kernel's semantics (fp32 math); used by tests, `verify` and the
benchmark. Plain torch: no DSL, no database."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def max_tiles(tokens: int, top_k: int, experts: int, tile_m: int) -> int:
    """Worst-case number of tile_m-row tiles after padding every expert's rows to tile_m."""
    pairs = tokens * top_k
    return max(1, math.ceil((pairs + min(experts, pairs) * (tile_m - 1)) / tile_m))


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


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, block: int = 16) -> torch.Tensor:
    """[E, I, H] gate and up -> [E, 2I, H] with rows alternating in blocks of `block`."""
    E, I, H = w_gate.shape
    if w_up.shape != w_gate.shape or I % block:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must match, I % {block} == 0")
    g = w_gate.reshape(E, I // block, block, H)
    u = w_up.reshape(E, I // block, block, H)
    return torch.stack((g, u), dim=2).reshape(E, 2 * I, H).contiguous()


def split_gate_up(w13: torch.Tensor, block: int = 16):
    E, I2, H = w13.shape
    v = w13.reshape(E, I2 // (2 * block), 2, block, H)
    return v[:, :, 0].reshape(E, I2 // 2, H), v[:, :, 1].reshape(E, I2 // 2, H)


def activation_fn(name: str):
    if name == "swiglu":
        return F.silu
    if name == "geglu":
        return lambda t: F.gelu(t, approximate="tanh")
    raise ValueError(name)


def glu_reference(x, w13, topk_ids, activation="swiglu", block=16):
    """[M*top_k, I] fp32: act(x[m] @ gate_e^T) * (x[m] @ up_e^T) for every pair (m, k), e = topk_ids[m, k];
    rows of invalid ids are zeros."""
    M, K = topk_ids.shape
    E, I2, H = w13.shape
    # split per expert below: whole-model copies (split_gate_up, fp32) can be tens of GB
    v = w13.reshape(E, I2 // (2 * block), 2, block, H)
    ids = topk_ids.reshape(-1).long()
    out = torch.zeros(M * K, I2 // 2, dtype=torch.float32, device=x.device)
    ids = ids.to(x.device)
    xs = x.float().repeat_interleave(K, dim=0)
    act = activation_fn(activation)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < E:
            continue
        rows = (ids == e).nonzero().squeeze(1)
        a = xs[rows]
        gate, up = (v[e, :, j].reshape(I2 // 2, H).float() for j in (0, 1))
        out[rows] = act(a @ gate.t()) * (a @ up.t())
    return out


def moe_reference(x, w13, w2, topk_weights, topk_ids, activation="swiglu", block=16):
    """The whole layer in fp32: sum_k w[m,k] * (GLU(x[m]) @ w2_e^T); invalid ids contribute nothing."""
    M, K = topk_ids.shape
    h = glu_reference(x, w13, topk_ids, activation, block)
    ids = topk_ids.reshape(-1).long()
    y = torch.zeros(M * K, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w2.shape[0]:
            continue
        rows = (ids == e).nonzero().squeeze(1)
        y[rows] = h[rows] @ w2[e].float().t()
    y = y * topk_weights.reshape(-1, 1).float()
    return y.reshape(M, K, -1).sum(1)


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

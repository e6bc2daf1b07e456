"""References of the fp8 layer's kernels in fp32 torch: the activations' quantization as the
kernels do it (x per token or per 1x128 block, GEMM1's output per h_block columns: the layer
variant's, 64 or 128), dequantization of
every format, GEMM1 and GEMM2 on exactly what they consume, and the whole fp8 layer. The formats
and the weights' preparation are the runtime's (moe_aot/runtime/fp8.py)."""
from __future__ import annotations

import torch

from ..gemm_limits import FP8_MAX, H_SCALE_BLOCK, SCALE_BLOCK
from ..runtime.fp8 import AMAX_FLOOR, E4M3, check_precision, x_block
from .reference import activation_fn


def quantize_rows(t: torch.Tensor, block: int | None):
    """t [..., K] -> (e4m3 [..., K], fp32 scales [..., K / block]) with one scale per ``block``
    columns of each row (``block`` None: one per row, shape [...]), as the kernels quantize."""
    t = t.float()
    k = t.shape[-1]
    b = k if block is None else block
    if k % b:
        raise ValueError(f"{k} columns do not split into blocks of {b}")
    v = t.reshape(*t.shape[:-1], k // b, b)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    q = (v * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(t.shape)
    s = (amax / FP8_MAX).squeeze(-1)
    return q, (s.squeeze(-1) if block is None else s)


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, block: int | None) -> torch.Tensor:
    """fp32 values of rows quantized by ``quantize_rows``."""
    k = q.shape[-1]
    b = k if block is None else block
    v = q.float().reshape(*q.shape[:-1], k // b, b)
    return (v * s.reshape(*q.shape[:-1], k // b, 1)).reshape(q.shape)


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    e, n, k = q.shape
    v = q.float().reshape(e, n // SCALE_BLOCK, SCALE_BLOCK, k // SCALE_BLOCK, SCALE_BLOCK)
    return (v * s.reshape(e, n // SCALE_BLOCK, 1, k // SCALE_BLOCK, 1)).reshape(e, n, k)


def dequantize_w13(w13, w13s, precision: str, expert: int | None = None, interleave: int = 16):
    """fp32 w13 ([E, 2I, H], or one expert's [2I, H]) from its fp8 layout."""
    check_precision(precision)
    q = w13 if expert is None else w13[expert:expert + 1]
    s = w13s if expert is None else w13s[expert:expert + 1]
    e, n, k = q.shape
    # interleaved row r is a gate row where (r // interleave) is even, an up row otherwise, and
    # it is row (r // 2g) * g + r % g of its matrix (g = interleave)
    r = torch.arange(n, device=q.device)
    up = (r // interleave) % 2
    if precision == "fp8-block128":
        own = (r // (2 * interleave)) * interleave + r % interleave
        srow = 2 * (own // SCALE_BLOCK) + up  # the row of interleave_block_scales' layout
        cols = s[:, srow].repeat_interleave(SCALE_BLOCK, dim=2)  # [E, N, K]
        out = q.float() * cols
    else:
        out = q.float() * s[:, up].unsqueeze(-1)
    return out if expert is None else out[0]


def dequantize_w2(w2, w2s, precision: str, expert: int | None = None):
    """fp32 w2 ([E, H, I], or one expert's [H, I]) from its fp8 layout."""
    check_precision(precision)
    q = w2 if expert is None else w2[expert:expert + 1]
    s = w2s if expert is None else w2s[expert:expert + 1]
    out = dequantize_blocks(q, s) if precision == "fp8-block128" else q.float() * s.view(-1, 1, 1)
    return out if expert is None else out[0]


def quantize_x(x, precision: str):
    """The layer's input as the quantization kernel writes it: (e4m3 [M, H], scales)."""
    return quantize_rows(x, x_block(precision))


def glu_fp8_reference(xq, xs, w13, w13s, sorted_ids, tile_expert, tile_m, top_k, precision,
                      activation="swiglu", interleave: int = 16):
    """GEMM1 on exactly what it consumes: fp32 h [R, I] in padded row order from the dequantized
    x and w13 (padding rows and unused tiles: zeros)."""
    r = sorted_ids.numel()
    i2 = w13.shape[1]
    ids = sorted_ids.long()
    row_expert = torch.repeat_interleave(tile_expert.long(), tile_m)
    h = torch.zeros(r, i2 // 2, dtype=torch.float32, device=xq.device)
    xd = dequantize_rows(xq, xs, x_block(precision))
    act = activation_fn(activation)
    for e in torch.unique(row_expert[ids >= 0]).tolist():
        rows = torch.nonzero((ids >= 0) & (row_expert == e)).squeeze(1)
        a = xd[ids[rows] // top_k]
        w = dequantize_w13(w13, w13s, precision, e, interleave)
        v = w.view(i2 // (2 * interleave), 2, interleave, -1)
        gate = v[:, 0].reshape(i2 // 2, -1)
        up = v[:, 1].reshape(i2 // 2, -1)
        h[rows] = act(a @ gate.t()) * (a @ up.t())
    return h


def down_fp8_reference(hq, hs, w2, w2s, sorted_ids, tile_expert, tile_m, topk_weights, precision):
    """GEMM2 on exactly what it consumes: fp32 y [M*top_k, H], y[p] = w_p * dequant(h[r]) @ w2_e^T
    for p = sorted_ids[r] (rows no pair maps to: zeros). h's scale block is read off the shapes
    (hs [R, I / h_block]), as GEMM2's build fixes it."""
    if hq.shape[1] % hs.shape[1]:
        raise ValueError(f"hs {tuple(hs.shape)} holds no whole scale blocks of h {tuple(hq.shape)}")
    ids = sorted_ids.long()
    row_expert = torch.repeat_interleave(tile_expert.long(), tile_m)
    mk = topk_weights.numel()
    y = torch.zeros(mk, w2.shape[1], dtype=torch.float32, device=hq.device)
    hd = dequantize_rows(hq, hs, hq.shape[1] // hs.shape[1])
    for e in torch.unique(row_expert[ids >= 0]).tolist():
        rows = torch.nonzero((ids >= 0) & (row_expert == e)).squeeze(1)
        p = ids[rows]
        y[p] = topk_weights.reshape(-1)[p].float().unsqueeze(1) * (hd[rows] @ dequantize_w2(w2, w2s, precision, e).t())
    return y


def moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, precision: str, activation="swiglu",
                      interleave: int = 16, h_block: int = H_SCALE_BLOCK):
    """The fp8 layer in fp32 on what its kernels consume: x quantized as the quantization kernel
    does, the dequantized weights, GEMM1's output quantized per ``h_block`` columns (the layer
    variant's) as its epilogue does, then GEMM2, the routing weights and the top-k sum. ``w13``,
    ``w2``: (e4m3, scales) pairs."""
    (w13q, w13s), (w2q, w2s) = w13, w2
    m, k = topk_ids.shape
    xq, xs = quantize_x(x, precision)
    xd = dequantize_rows(xq, xs, x_block(precision))
    ids = topk_ids.reshape(-1).long()
    i2 = w13q.shape[1]
    y = torch.zeros(m * k, w2q.shape[1], dtype=torch.float32, device=x.device)
    act = activation_fn(activation)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w13q.shape[0]:
            continue
        rows = (ids == e).nonzero().squeeze(1)
        a = xd[rows // k]
        w = dequantize_w13(w13q, w13s, precision, e, interleave).view(i2 // (2 * interleave), 2, interleave, -1)
        h = act(a @ w[:, 0].reshape(i2 // 2, -1).t()) * (a @ w[:, 1].reshape(i2 // 2, -1).t())
        hq, hs = quantize_rows(h, h_block)
        y[rows] = dequantize_rows(hq, hs, h_block) @ dequantize_w2(w2q, w2s, precision, e).t()
    y = y * topk_weights.reshape(-1, 1).float()
    return y.reshape(m, k, w2q.shape[1]).sum(1)  # sizes, not -1: m may be 0


def moe_dequantized_reference(x, w13, w2, topk_weights, topk_ids, precision: str, activation="swiglu",
                              interleave: int = 16):
    """The fp8 layer's weights dequantized, x and h unquantized: what the one-launch decode kernel
    computes (templates/decode.py reads e4m3 weights with their scales and keeps x and h in
    bf16 / fp32). Only the experts the routing uses are dequantized. ``w13``, ``w2``: (e4m3,
    scales) pairs."""
    from .reference import moe_reference

    (q13, s13), (q2, s2) = w13, w2
    valid = (topk_ids >= 0) & (topk_ids < q13.shape[0])
    used = torch.unique(topk_ids[valid]).tolist()
    compact = torch.full_like(topk_ids, -1)
    for j, e in enumerate(used):
        compact[topk_ids == e] = j
    if not used:  # no valid pair: zeros, as the layer gives
        return torch.zeros(x.shape[0], q2.shape[1], dtype=torch.float32, device=x.device)
    dw13 = torch.stack([dequantize_w13(q13, s13, precision, e, interleave) for e in used])
    dw2 = torch.stack([dequantize_w2(q2, s2, precision, e) for e in used])
    return moe_reference(x, dw13, dw2, topk_weights, compact, activation, interleave)

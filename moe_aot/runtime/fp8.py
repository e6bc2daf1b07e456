"""FP8 (e4m3) formats of the layer, in plain torch: weight preparation, DeepSeek-V3 checkpoint
import, quantization and dequantization references (no DSL, no database).

Formats (the kernels' ABI, moe_aot/gemm_limits.py and templates/hopper_fp8.py):
  "fp8"           w13 [E, 2I, H] e4m3, w13s [E, 2] (gate, up); w2 [E, H, I] e4m3, w2s [E];
                  x [M, H] e4m3, xs [M]
  "fp8-block128"  w13s [E, 2I/128, H/128] (row 2b: gate block b, row 2b + 1: up block b);
                  w2s [E, H/128, I/128]; xs [M, H/128]
  both            h [R, I] e4m3 with hs [R, I/64] (GEMM1's output, GEMM2's input)
A scale multiplies its values back: value = e4m3 * scale (DeepSeek's ``weight_scale_inv``).
w13's rows are gate/up interleaved in blocks of ``interleave`` rows as in bf16.
"""
from __future__ import annotations

import torch

from ..gemm_limits import FP8, FP8_MAX, H_SCALE_BLOCK, SCALE_BLOCK
from .reference import activation_fn, interleave_gate_up

E4M3 = torch.float8_e4m3fn
_TINY = 1e-12  # the kernels' floor under an amax (an all-zero block gets scale 1e-12 / 448)


def _check_precision(precision: str) -> None:
    if precision not in FP8:
        raise ValueError(f"precision {precision!r} is not an fp8 format; use one of {FP8}")


def quantize_rows(t: torch.Tensor, block: int | None):
    """t [..., K] -> (e4m3 [..., K], fp32 scales [..., K / block]) with one scale per ``block``
    columns of each row (``block`` None: one per row, shape [...]), as the kernels quantize."""
    t = t.float()
    k = t.shape[-1]
    b = k if block is None else block
    if k % b:
        raise ValueError(f"{k} columns do not split into blocks of {b}")
    v = t.reshape(*t.shape[:-1], k // b, b)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(_TINY)
    q = (v * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(t.shape)
    s = (amax / FP8_MAX).squeeze(-1)
    return q, (s.squeeze(-1) if block is None else s)


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, block: int | None) -> torch.Tensor:
    """fp32 values of rows quantized by ``quantize_rows``."""
    k = q.shape[-1]
    b = k if block is None else block
    v = q.float().reshape(*q.shape[:-1], k // b, b)
    return (v * s.reshape(*q.shape[:-1], k // b, 1)).reshape(q.shape)


def quantize_blocks(w: torch.Tensor):
    """[E, N, K] -> (e4m3 [E, N, K], fp32 [E, N/128, K/128]): one scale per 128x128 block."""
    e, n, k = w.shape
    if n % SCALE_BLOCK or k % SCALE_BLOCK:
        raise ValueError(f"weights {tuple(w.shape)}: both dimensions must be multiples of {SCALE_BLOCK}")
    v = w.float().reshape(e, n // SCALE_BLOCK, SCALE_BLOCK, k // SCALE_BLOCK, SCALE_BLOCK)
    amax = v.abs().amax(dim=(2, 4), keepdim=True).clamp_min(_TINY)
    q = (v * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(e, n, k)
    return q, (amax / FP8_MAX).reshape(e, n // SCALE_BLOCK, k // SCALE_BLOCK)


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    e, n, k = q.shape
    v = q.float().reshape(e, n // SCALE_BLOCK, SCALE_BLOCK, k // SCALE_BLOCK, SCALE_BLOCK)
    return (v * s.reshape(e, n // SCALE_BLOCK, 1, k // SCALE_BLOCK, 1)).reshape(e, n, k)


def quantize_tensor(w: torch.Tensor):
    """[E, N, K] -> (e4m3, fp32 [E]): one scale per expert."""
    amax = w.float().abs().amax(dim=(1, 2)).clamp_min(_TINY)
    q = (w.float() * (FP8_MAX / amax).view(-1, 1, 1)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, amax / FP8_MAX


def interleave_block_scales(s_gate: torch.Tensor, s_up: torch.Tensor) -> torch.Tensor:
    """Gate and up block scales [E, I/128, H/128] -> [E, 2I/128, H/128], gate block b at row 2b
    and up block b at 2b + 1: the 256 interleaved w13 rows [256b, 256b + 256) hold exactly gate and
    up rows [128b, 128b + 128) for any interleave dividing 128 (a GEMM1 tile of 128 or 256
    interleaved rows reads one gate and one up scale per K block)."""
    if s_gate.shape != s_up.shape:
        raise ValueError(f"gate scales {tuple(s_gate.shape)} and up scales {tuple(s_up.shape)} differ")
    e, ib, hb = s_gate.shape
    return torch.stack((s_gate, s_up), dim=2).reshape(e, 2 * ib, hb).contiguous()


_CHUNK = 16  # experts quantized at a time (a whole DeepSeek-V3 matrix in fp32 is 15 GB)


def prepare_w13(w_gate, w_up, precision: str, interleave: int = 16):
    """bf16 (or fp32) gate and up [E, I, H] -> (w13 e4m3 [E, 2I, H] interleaved, its scales)."""
    _check_precision(precision)
    if SCALE_BLOCK % interleave:
        raise ValueError(f"interleave {interleave} must divide {SCALE_BLOCK}")
    if w_gate.shape != w_up.shape or w_gate.dim() != 3:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must both be [E, I, H]")
    if w_gate.shape[0] > _CHUNK:
        parts = [prepare_w13(w_gate[a:a + _CHUNK], w_up[a:a + _CHUNK], precision, interleave)
                 for a in range(0, w_gate.shape[0], _CHUNK)]
        return torch.cat([q for q, _ in parts]), torch.cat([sc for _, sc in parts])
    if precision == "fp8-block128":
        qg, sg = quantize_blocks(w_gate)
        qu, su = quantize_blocks(w_up)
        scales = interleave_block_scales(sg, su)
    else:
        qg, sg = quantize_tensor(w_gate)
        qu, su = quantize_tensor(w_up)
        scales = torch.stack((sg, su), dim=1).contiguous()
    w13 = interleave_gate_up(qg.view(torch.uint8), qu.view(torch.uint8), interleave).view(E4M3)
    return w13, scales.float()


def prepare_w2(w2, precision: str):
    """bf16 (or fp32) down weights [E, H, I] -> (e4m3 [E, H, I], scales)."""
    _check_precision(precision)
    if w2.dim() != 3:
        raise ValueError(f"down weights must be [E, H, I], got {tuple(w2.shape)}")
    if w2.shape[0] > _CHUNK:
        parts = [prepare_w2(w2[a:a + _CHUNK], precision) for a in range(0, w2.shape[0], _CHUNK)]
        return torch.cat([q for q, _ in parts]), torch.cat([sc for _, sc in parts])
    q, s = quantize_blocks(w2) if precision == "fp8-block128" else quantize_tensor(w2)
    return q.contiguous(), s.float().contiguous()


def from_block128_checkpoint(gate, gate_scale_inv, up, up_scale_inv, down, down_scale_inv,
                             interleave: int = 16):
    """DeepSeek-V3-style prequantized experts, stacked over E: gate/up [E, I, H] e4m3 with
    ``weight_scale_inv`` [E, I/128, H/128], down [E, H, I] with [E, H/128, I/128] -> the
    fp8-block128 layout (w13, w13s, w2, w2s). The values are kept as they are; only the gate/up
    rows and their scales are interleaved."""
    for name, t in (("gate", gate), ("up", up), ("down", down)):
        if t.dtype != E4M3:
            raise ValueError(f"{name} weights must be float8_e4m3fn, got {t.dtype}")
    e, i, h = gate.shape
    want = (e, i // SCALE_BLOCK, h // SCALE_BLOCK)
    for name, s, shape in (("gate", gate_scale_inv, want), ("up", up_scale_inv, want),
                           ("down", down_scale_inv, (e, h // SCALE_BLOCK, i // SCALE_BLOCK))):
        if tuple(s.shape) != shape:
            raise ValueError(f"{name} weight_scale_inv has shape {tuple(s.shape)}, expected {shape} "
                             f"(one scale per 128x128 block)")
    w13 = interleave_gate_up(gate.view(torch.uint8), up.view(torch.uint8), interleave).view(E4M3)
    w13s = interleave_block_scales(gate_scale_inv.float(), up_scale_inv.float())
    return w13, w13s, down.contiguous(), down_scale_inv.float().contiguous()


def dequantize_w13(w13, w13s, precision: str, expert: int | None = None, interleave: int = 16):
    """fp32 w13 ([E, 2I, H], or one expert's [2I, H]) from its fp8 layout."""
    _check_precision(precision)
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
    _check_precision(precision)
    q = w2 if expert is None else w2[expert:expert + 1]
    s = w2s if expert is None else w2s[expert:expert + 1]
    out = dequantize_blocks(q, s) if precision == "fp8-block128" else q.float() * s.view(-1, 1, 1)
    return out if expert is None else out[0]


def x_block(precision: str) -> int | None:
    """Columns per scale of the layer's fp8 input: 128 (fp8-block128) or the whole row (fp8)."""
    _check_precision(precision)
    return SCALE_BLOCK if precision == "fp8-block128" else None


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
    for p = sorted_ids[r] (rows no pair maps to: zeros)."""
    ids = sorted_ids.long()
    row_expert = torch.repeat_interleave(tile_expert.long(), tile_m)
    mk = topk_weights.numel()
    y = torch.zeros(mk, w2.shape[1], dtype=torch.float32, device=hq.device)
    hd = dequantize_rows(hq, hs, H_SCALE_BLOCK)
    for e in torch.unique(row_expert[ids >= 0]).tolist():
        rows = torch.nonzero((ids >= 0) & (row_expert == e)).squeeze(1)
        p = ids[rows]
        y[p] = topk_weights.reshape(-1)[p].float().unsqueeze(1) * (hd[rows] @ dequantize_w2(w2, w2s, precision, e).t())
    return y


def moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, precision: str, activation="swiglu",
                      interleave: int = 16):
    """The fp8 layer in fp32 on what its kernels consume: x quantized as the quantization kernel
    does, the dequantized weights, GEMM1's output quantized per 64 columns as its epilogue does,
    then GEMM2, the routing weights and the top-k sum. ``w13``, ``w2``: (e4m3, scales) pairs."""
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
        hq, hs = quantize_rows(h, H_SCALE_BLOCK)
        y[rows] = dequantize_rows(hq, hs, H_SCALE_BLOCK) @ dequantize_w2(w2q, w2s, precision, e).t()
    y = y * topk_weights.reshape(-1, 1).float()
    return y.reshape(m, k, -1).sum(1)

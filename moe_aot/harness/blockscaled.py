"""References of the block-scaled layer's GEMMs ("mxfp8", "nvfp4"; templates/blockscaled_warp.py) in
fp32 torch, on exactly the bytes the kernels read: x, the weights and h dequantized with
moe_aot/blockscale.py, the fp32 layer of moe_aot/harness/reference.py in between, and h quantized
back as GEMM1's epilogue does (padding rows quantized zeros). Plain torch, CPU or CUDA."""
from __future__ import annotations

import torch

from .. import blockscale
from ..runtime import blockscaled as bw
from ..variants import INTERLEAVE
from .reference import glu_reference


def random_layer(experts: int, top_k: int, hidden: int, intermediate: int, tokens: int, fmt: str, device,
                 generator=None):
    """Random bf16 x, routing and weights prepared in `fmt`: (x, topk_ids, topk_weights, w13, w2),
    weights scaled so that every GEMM's sums are of order one."""
    x = torch.randn(tokens, hidden, device=device, generator=generator).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, device=device, generator=generator)
    topk_weights, topk_ids = scores.topk(top_k, dim=1)
    gate, up = (torch.randn(experts, intermediate, hidden, device=device, generator=generator) * hidden ** -0.5
                for _ in range(2))
    w2 = torch.randn(experts, hidden, intermediate, device=device, generator=generator) * intermediate ** -0.5
    return (x, topk_ids.to(torch.int32), topk_weights.float(), bw.prepare_w13(gate, up, fmt, INTERLEAVE),
            bw.prepare_w2(w2, fmt))


def glu_pairs(xq: blockscale.Quantized, w13: bw.BlockScaledWeight, topk_ids, activation: str, fmt: str):
    """[M*top_k, I] fp32: the GLU of every routed pair on the dequantized x and w13."""
    return glu_reference(blockscale.dequantize(xq, fmt), bw.dequantize(w13, fmt), topk_ids, activation, INTERLEAVE)


def h_padded(pairs: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
    """[R, I] fp32 in GEMM1's padded row order: row r holds pair sorted_ids[r], padding rows zeros."""
    out = torch.zeros(sorted_ids.numel(), pairs.shape[1], dtype=torch.float32, device=pairs.device)
    valid = sorted_ids >= 0
    out[valid] = pairs[sorted_ids[valid].long()]
    return out


def quantize_h(h: torch.Tensor, fmt: str, h_gamax: torch.Tensor | None) -> blockscale.Quantized:
    """GEMM1's output bytes for the fp32 h rows (nvfp4: relative to the given global amax)."""
    return blockscale.quantize(h, fmt, h_gamax if fmt == "nvfp4" else None)


def down_rows(hq: blockscale.Quantized, w2: bw.BlockScaledWeight, sorted_ids, tile_expert, topk_weights, fmt: str,
              tile_m: int):
    """[M*top_k, H] fp32: GEMM2's rows, y[p] = w[p] * (dequant(h[r]) . dequant(w2_e)^T) for p =
    sorted_ids[r] with e the expert of r's tile; rows no pair maps to are zeros."""
    h = blockscale.dequantize(hq, fmt)
    w = bw.dequantize(w2, fmt)
    pairs = topk_weights.numel()
    y = torch.zeros(pairs, w.shape[1], dtype=torch.float32, device=h.device)
    for t, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        rows = torch.arange(t * tile_m, (t + 1) * tile_m, device=h.device)
        p = sorted_ids[rows].long()
        keep = p >= 0
        y[p[keep]] = (h[rows[keep]] @ w[e].t()) * topk_weights.reshape(-1)[p[keep]].float().unsqueeze(1)
    return y

"""FP8 (e4m3) formats of the layer, in plain torch: weight quantization and preparation,
DeepSeek-V3 checkpoint import (no DSL, no database). The references of the kernels' fp8 math
(activation quantization, dequantization, the fp8 layer in fp32) are moe_aot/harness/fp8.py.

Formats (the kernels' ABI, moe_aot/gemm_limits.py and templates/hopper_fp8.py):
  "fp8"           w13 [E, 2I, H] e4m3, w13s [E, 2] (gate, up); w2 [E, H, I] e4m3, w2s [E];
                  x [M, H] e4m3, xs [M]
  "fp8-block128"  w13s [E, 2I/128, H/128] (row 2b: gate block b, row 2b + 1: up block b);
                  w2s [E, H/128, I/128]; xs [M, H/128]
  both            h [R, I] e4m3 with hs [R, I/h_block] (GEMM1's output, GEMM2's input; h_block
                  64 or 128, the layer variant's: gemm_limits.check_h_block)
A scale multiplies its values back: value = e4m3 * scale (DeepSeek's ``weight_scale_inv``).
w13's rows are gate/up interleaved in blocks of ``interleave`` rows as in bf16.
"""
from __future__ import annotations

import torch

from ..gemm_limits import FP8, FP8_MAX, SCALE_BLOCK
from ..layout import interleave_gate_up

E4M3 = torch.float8_e4m3fn
AMAX_FLOOR = 1e-12  # the kernels' floor under an amax (an all-zero block gets scale 1e-12 / 448)


def check_precision(precision: str) -> None:
    if precision not in FP8:
        raise ValueError(f"precision {precision!r} is not an fp8 format; use one of {FP8}")


def quantize_blocks(w: torch.Tensor):
    """[E, N, K] -> (e4m3 [E, N, K], fp32 [E, N/128, K/128]): one scale per 128x128 block."""
    e, n, k = w.shape
    if n % SCALE_BLOCK or k % SCALE_BLOCK:
        raise ValueError(f"weights {tuple(w.shape)}: both dimensions must be multiples of {SCALE_BLOCK}")
    v = w.float().reshape(e, n // SCALE_BLOCK, SCALE_BLOCK, k // SCALE_BLOCK, SCALE_BLOCK)
    amax = v.abs().amax(dim=(2, 4), keepdim=True).clamp_min(AMAX_FLOOR)
    q = (v * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(e, n, k)
    return q, (amax / FP8_MAX).reshape(e, n // SCALE_BLOCK, k // SCALE_BLOCK)


def quantize_tensor(w: torch.Tensor):
    """[E, N, K] -> (e4m3, fp32 [E]): one scale per expert."""
    amax = w.float().abs().amax(dim=(1, 2)).clamp_min(AMAX_FLOOR)
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
    check_precision(precision)
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
    check_precision(precision)
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


def x_block(precision: str) -> int | None:
    """Columns per scale of the layer's fp8 input: 128 (fp8-block128) or the whole row (fp8)."""
    check_precision(precision)
    return SCALE_BLOCK if precision == "fp8-block128" else None

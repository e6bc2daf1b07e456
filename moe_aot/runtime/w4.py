"""Weight-only MXFP4 ("mxfp4-w") weights of the layer in plain torch: gpt-oss checkpoint import,
quantization of bf16 weights, and the dequantization every reference uses (no DSL, no database).

The kernels' operands (templates/grouped_w4.py), per GEMM, as ``W4Weight(blocks, scales, bias)``:
  w13  blocks [E, 2I, H/2] uint8   e2m1 codes, two per byte (element 2j in the low nibble of
                                   byte j), rows gate/up interleaved in blocks of INTERLEAVE rows
                                   as the bf16 layer's w13 (layout.interleave_gate_up)
       scales [E, H/32, 2I] uint8  ue8m0 (2^(byte - 127)) of each 32 weights along H: column r
                                   holds row r's scales (transposed, so a tile's scales are
                                   16-byte runs for cp.async)
       bias   [E, 2I] bf16 or None interleaved as the rows (layer.prepare_biases)
  w2   blocks [E, H, I/2], scales [E, I/32, H], bias [E, H] bf16 or None
The format is moe_aot/blockscale.py's "mxfp4", bit for bit.

gpt-oss's checkpoints (Hugging Face ``openai/gpt-oss-120b``) ship per layer
``gate_up_proj_blocks`` [E, 2I, H/32, 16], ``gate_up_proj_scales`` [E, 2I, H/32],
``gate_up_proj_bias`` [E, 2I], ``down_proj_blocks`` [E, H, I/32, 16], ``down_proj_scales``
[E, H, I/32], ``down_proj_bias`` [E, H], with the gate and up rows interleaved one by one (row 2j
gate row j, row 2j + 1 up row j): openai/gpt-oss ``gpt_oss/torch/weights.py``
(``Checkpoint._get_mxfp4_tensor``: blocks [..., G, 16] -> values [..., G * 32], low nibble first,
``ldexp(lut[code], scale - 127)``) and ``gpt_oss/torch/model.py`` (``swiglu``: ``x[..., ::2]`` is the
gate, ``x[..., 1::2]`` the linear part of mlp1's output); transformers
``integrations/mxfp4.py`` (``convert_moe_packed_tensors``, the same decode, then transposed to
gate_up_proj [E, H, 2I]) and ``models/gpt_oss/modeling_gpt_oss.py`` (``GptOssExperts``:
``gate_up[..., ::2], gate_up[..., 1::2]``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import blockscale
from ..gemm_limits import W4_BLOCK
from ..layout import interleave_gate_up, split_gate_up


class W4Weight(NamedTuple):
    """One GEMM's mxfp4-w operands (see the module docstring)."""
    blocks: torch.Tensor  # uint8 [E, N, K/2]
    scales: torch.Tensor  # uint8 [E, K/32, N]
    bias: torch.Tensor | None = None  # bf16 [E, N]


def _check(name: str, t, dims: int, dtype=torch.uint8) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dims}-d {dtype} tensor, got {got}")


def _kernel_operands(blocks: torch.Tensor, scales: torch.Tensor):
    """gpt-oss's blocks [E, N, K/32, 16] and scales [E, N, K/32] -> (blocks [E, N, K/2],
    scales [E, K/32, N]), both contiguous."""
    _check("blocks", blocks, 4)
    _check("scales", scales, 3)
    e, n, g, b = blocks.shape
    if b != W4_BLOCK // 2 or tuple(scales.shape) != (e, n, g):
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be [E, N, K/32, 16] "
                         f"and [E, N, K/32] (16 bytes, 32 weights, per scale byte)")
    return blocks.reshape(e, n, g * b).contiguous(), scales.transpose(1, 2).contiguous()


def _deinterleave_rows(t: torch.Tensor):
    """gpt-oss's row order (gate, up, gate, up, ...) -> (gate rows, up rows)."""
    return t[:, 0::2], t[:, 1::2]


def from_gpt_oss(gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias=None, down_bias=None,
                 interleave: int = 16) -> tuple[W4Weight, W4Weight]:
    """One gpt-oss layer's experts as its checkpoint ships them (module docstring) -> (w13, w2)
    as the kernels read them: the same bytes, w13's rows regrouped from one-by-one to blocks of
    ``interleave`` with their scales and biases, the scales transposed. Nothing is requantized."""
    q13, s13 = _kernel_operands(gate_up_blocks, gate_up_scales)  # rows still one by one
    q2, s2 = _kernel_operands(down_blocks, down_scales)
    if q13.shape[1] % 2:
        raise ValueError(f"gate_up_proj has {q13.shape[1]} rows; gate and up rows alternate, so it must be even")
    gq, uq = _deinterleave_rows(q13)
    gs, us = _deinterleave_rows(s13.transpose(1, 2))
    w13 = interleave_gate_up(gq, uq, interleave)
    w13s = interleave_gate_up(gs, us, interleave).transpose(1, 2).contiguous()
    b13 = b2 = None
    if gate_up_bias is not None:
        gb, ub = _deinterleave_rows(gate_up_bias)
        b13 = interleave_gate_up(gb.unsqueeze(-1), ub.unsqueeze(-1), interleave).squeeze(-1).to(torch.bfloat16)
        b13 = b13.contiguous()
    if down_bias is not None:
        b2 = down_bias.to(torch.bfloat16).contiguous()
    return W4Weight(w13, w13s, b13), W4Weight(q2, s2, b2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] bf16 / fp32 -> (blocks [E, N, K/2], scales [E, K/32, N]) in MXFP4
    (blockscale.quantize, the rounding of the GPU quantizer)."""
    e, n, k = w.shape
    q = blockscale.quantize(w.reshape(e * n, k), "mxfp4")
    return q.values.reshape(e, n, k // 2), q.scales.reshape(e, n, k // W4_BLOCK).transpose(1, 2).contiguous()


def prepare_weights(w_gate, w_up, w2, b_gate=None, b_up=None, b2=None, interleave: int = 16):
    """bf16 (or fp32) gate, up [E, I, H] and down [E, H, I] weights (biases [E, I], [E, I], [E, H]
    or None) -> (w13, w2) W4Weights, quantized once at weight-load time."""
    q13, s13 = quantize(interleave_gate_up(w_gate, w_up, interleave))
    q2, s2 = quantize(w2)
    b13 = None
    if b_gate is not None:
        b13 = interleave_gate_up(b_gate.unsqueeze(-1), b_up.unsqueeze(-1), interleave).squeeze(-1)
        b13 = b13.to(torch.bfloat16).contiguous()
    return W4Weight(q13, s13, b13), W4Weight(q2, s2, None if b2 is None else b2.to(torch.bfloat16).contiguous())


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [E, N, K] weights of kernel operands (blocks [E, N, K/2], scales [E, K/32, N])."""
    e, n, half = blocks.shape
    vals = blockscale.e2m1_values(blockscale.unpack_fp4(blocks)).reshape(e, n, half * 2 // W4_BLOCK, W4_BLOCK)
    return (vals * blockscale.mx_decode_scale(scales.transpose(1, 2)).unsqueeze(-1)).reshape(e, n, half * 2)


def to_gpt_oss(w13: W4Weight, w2: W4Weight, interleave: int = 16):
    """The inverse of from_gpt_oss: (gate_up_blocks, gate_up_scales, down_blocks, down_scales) in
    the checkpoint's layout (for round-trip tests and for exporting quantized weights)."""
    g, u = split_gate_up(w13.blocks, interleave)
    gs, us = split_gate_up(w13.scales.transpose(1, 2), interleave)
    e, i, half = g.shape
    blocks = torch.stack((g, u), dim=2).reshape(e, 2 * i, half // 16, 16)
    scales = torch.stack((gs, us), dim=2).reshape(e, 2 * i, -1)
    h = w2.blocks.shape[1]
    return blocks, scales, w2.blocks.reshape(e, h, -1, 16), w2.scales.transpose(1, 2).contiguous()

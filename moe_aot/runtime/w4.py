"""Weight-only MXFP4 ("mxfp4-w") weights of the layer in plain torch: gpt-oss checkpoint import,
quantization of bf16 weights, and the dequantization every reference uses (no DSL, no database).

The kernels' operands (templates/grouped_w4.py), per GEMM of [N, K] weights, as
``W4Weight(blocks, scales, bias)``, in the kernels' fragment order (``to_fragments``):
  blocks [E, N/16, K/64, 512] uint8  the e2m1 codes of each 16-row x 64-column chunk, 4 bits each,
                                     rearranged so that lane l of a warp finds the codes of its
                                     mma.sync m16n8k16 B fragments (rows 16c + l/4 and + 8, eight
                                     k16 blocks' worth) in bytes 16l..16l+15, each 32-bit word of
                                     them eight codes whose bits sit where a rotate and a mask put
                                     them into bf16 bit positions (CODE_BITS)
  scales [E, N/16, K/64, 32] uint8   the ue8m0 bytes (2^(byte - 127)) of the chunk's 16 rows x 2
                                     blocks of 32 along K: byte 4g + 2h + b is row g + 8h, block b
  bias   [E, N] bf16 or None         as the rows (w13: layer.prepare_biases' interleave)
  w13: N = 2I (rows gate/up interleaved in blocks of INTERLEAVE, as the bf16 layer's w13), K = H;
  w2: N = H, K = I. K must be a multiple of 64, N of 16.
The values are moe_aot/blockscale.py's "mxfp4", bit for bit; ``from_fragments`` gives back the
row-major codes (element 2j in the low nibble of byte j) and scales [E, N, K/32].

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
from ..gemm_limits import W4_BLOCK, W4_CHUNK
from ..layout import interleave_gate_up, split_gate_up

CHUNK_N, CHUNK_K = W4_CHUNK  # rows x columns of one fragment-order chunk (512 code bytes, 32 scale bytes)
# Where the kernel wants each code bit: a 32-bit word yields four bf16x2 registers (outputs o = 0..3,
# each a low and a high code), output o = rotl(word, ROTATE[o]) & 0x81C081C0, except output 3, whose
# mantissa bits and signs come from rotl(word, 6) and its top exponent bits from rotl(word, 30).
# A code's bits (mantissa, exponent low, exponent high, sign) land on bf16 bits 6, 7, 8, 15 (+16 for
# the high code): e2m1 value * 2^-126 exactly (code 1, 0.5, is the subnormal 2^-127).
ROTATE = (0, 4, 10, 6)
_TARGET = (6, 7, 8, 15)


def _code_bit_positions() -> list[list[list[int]]]:
    """[output][half][code bit] -> the bit of the stored word holding it (a bijection onto 0..31)."""
    pos = [[[(t + 16 * half - (30 if o == 3 and t == 8 else ROTATE[o])) % 32 for t in _TARGET]
            for half in range(2)] for o in range(4)]
    assert sorted(b for o in pos for h in o for b in h) == list(range(32))
    return pos


CODE_BITS = _code_bit_positions()


class W4Weight(NamedTuple):
    """One GEMM's mxfp4-w operands (see the module docstring)."""
    blocks: torch.Tensor  # uint8 [E, N/16, K/64, 512], fragment order
    scales: torch.Tensor  # uint8 [E, N/16, K/64, 32]
    bias: torch.Tensor | None = None  # bf16 [E, N]


def _check_chunks(n: int, k: int) -> None:
    if n % CHUNK_N or k % CHUNK_K:
        raise ValueError(f"mxfp4-w weights of {n} rows x {k} columns: rows must be a multiple of {CHUNK_N} and "
                         f"columns of {CHUNK_K} (the kernels' fragment chunks)")


def to_fragments(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major packed codes [E, N, K/2] (element 2j in the low nibble of byte j) and scales
    [E, N, K/32] -> (blocks [E, N/16, K/64, 512], scales [E, N/16, K/64, 32]) in fragment order.

    Chunk (c, kc) holds rows 16c + (g + 8h) and columns 64kc + k, k = 32b + 16i + 8r + 2t + f:
    lane l = 4g + t, word w = 2h + b of the lane, output o = 2i + r of the word (the mma's k16
    block 2b + i, register r), f its low (0) or high (1) code."""
    e, n, half = codes.shape
    k = 2 * half
    _check_chunks(n, k)
    c, kc = n // CHUNK_N, k // CHUNK_K
    out = torch.empty(e, c, kc, 32, 4, dtype=torch.int32, device=codes.device)
    for x in range(e):  # one expert at a time: the bit planes of a whole layer would be tens of GB
        nib = torch.stack((codes[x] & 0xF, codes[x] >> 4), -1).reshape(n, k)
        # [h, g] rows, [kc, b, i, r, t, f] columns -> [c, kc, g, t, h, b, i, r, f]
        v = nib.reshape(c, 2, 8, kc, 2, 2, 2, 4, 2).permute(0, 3, 2, 7, 1, 4, 5, 6, 8)
        v = v.reshape(c, kc, 32, 4, 4, 2).to(torch.int32)
        word = torch.zeros(c, kc, 32, 4, dtype=torch.int32, device=codes.device)
        for o in range(4):
            for f in range(2):
                for cb in range(4):
                    word |= ((v[..., o, f] >> cb) & 1) << CODE_BITS[o][f][cb]
        out[x] = word
    blocks = out.view(torch.uint8).reshape(e, c, kc, 512)  # little-endian words: lane l at bytes 16l..
    s = scales.reshape(e, c, 2, 8, kc, 2).permute(0, 1, 4, 3, 2, 5).reshape(e, c, kc, 32)
    return blocks.contiguous(), s.contiguous()


def from_fragments(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_fragments: (row-major packed codes [E, N, K/2], scales [E, N, K/32])."""
    e, c, kc, _ = blocks.shape
    n, k = c * CHUNK_N, kc * CHUNK_K
    codes = torch.empty(e, n, k // 2, dtype=torch.uint8, device=blocks.device)
    for x in range(e):
        word = blocks[x].contiguous().view(torch.int32).reshape(c, kc, 32, 4)
        v = torch.zeros(c, kc, 32, 4, 4, 2, dtype=torch.int32, device=blocks.device)
        for o in range(4):
            for f in range(2):
                for cb in range(4):
                    v[..., o, f] |= ((word >> CODE_BITS[o][f][cb]) & 1) << cb
        nib = v.reshape(c, kc, 8, 4, 2, 2, 2, 2, 2).permute(0, 4, 2, 1, 5, 6, 7, 3, 8).reshape(n, k)
        codes[x] = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
    s = scales.reshape(e, c, kc, 8, 2, 2).permute(0, 1, 4, 3, 2, 5).reshape(e, n, k // W4_BLOCK)
    return codes, s.contiguous()


def _check(name: str, t, dims: int, dtype=torch.uint8) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dims}-d {dtype} tensor, got {got}")


def _row_major(blocks: torch.Tensor, scales: torch.Tensor):
    """gpt-oss's blocks [E, N, K/32, 16] and scales [E, N, K/32] -> (codes [E, N, K/2],
    scales [E, N, K/32]), both contiguous."""
    _check("blocks", blocks, 4)
    _check("scales", scales, 3)
    e, n, g, b = blocks.shape
    if b != W4_BLOCK // 2 or tuple(scales.shape) != (e, n, g):
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be [E, N, K/32, 16] "
                         f"and [E, N, K/32] (16 bytes, 32 weights, per scale byte)")
    return blocks.reshape(e, n, g * b).contiguous(), scales.contiguous()


def _deinterleave_rows(t: torch.Tensor):
    """gpt-oss's row order (gate, up, gate, up, ...) -> (gate rows, up rows)."""
    return t[:, 0::2], t[:, 1::2]


def from_gpt_oss(gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias=None, down_bias=None,
                 interleave: int = 16) -> tuple[W4Weight, W4Weight]:
    """One gpt-oss layer's experts as its checkpoint ships them (module docstring) -> (w13, w2)
    as the kernels read them: the same codes and scale bytes, w13's rows regrouped from one-by-one
    to blocks of ``interleave`` with their scales and biases, then put in fragment order
    (to_fragments). Nothing is requantized."""
    q13, s13 = _row_major(gate_up_blocks, gate_up_scales)  # rows still one by one
    q2, s2 = _row_major(down_blocks, down_scales)
    if q13.shape[1] % 2:
        raise ValueError(f"gate_up_proj has {q13.shape[1]} rows; gate and up rows alternate, so it must be even")
    gq, uq = _deinterleave_rows(q13)
    gs, us = _deinterleave_rows(s13)
    w13, w13s = to_fragments(interleave_gate_up(gq, uq, interleave), interleave_gate_up(gs, us, interleave))
    q2, s2 = to_fragments(q2, s2)
    b13 = b2 = None
    if gate_up_bias is not None:
        gb, ub = _deinterleave_rows(gate_up_bias)
        b13 = interleave_gate_up(gb.unsqueeze(-1), ub.unsqueeze(-1), interleave).squeeze(-1).to(torch.bfloat16)
        b13 = b13.contiguous()
    if down_bias is not None:
        b2 = down_bias.to(torch.bfloat16).contiguous()
    return W4Weight(w13, w13s, b13), W4Weight(q2, s2, b2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] bf16 / fp32 -> (blocks, scales) in MXFP4 (blockscale.quantize, the rounding of the
    GPU quantizer), in fragment order."""
    e, n, k = w.shape
    _check_chunks(n, k)
    q = blockscale.quantize(w.reshape(e * n, k), "mxfp4")
    return to_fragments(q.values.reshape(e, n, k // 2), q.scales.reshape(e, n, k // W4_BLOCK))


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
    """fp32 [E, N, K] weights of kernel operands (fragment-order blocks and scales)."""
    codes, scales = from_fragments(blocks, scales)
    e, n, half = codes.shape
    vals = blockscale.e2m1_values(blockscale.unpack_fp4(codes)).reshape(e, n, half * 2 // W4_BLOCK, W4_BLOCK)
    return (vals * blockscale.mx_decode_scale(scales).unsqueeze(-1)).reshape(e, n, half * 2)


def to_gpt_oss(w13: W4Weight, w2: W4Weight, interleave: int = 16):
    """The inverse of from_gpt_oss: (gate_up_blocks, gate_up_scales, down_blocks, down_scales) in
    the checkpoint's layout (for round-trip tests and for exporting quantized weights)."""
    q13, s13 = from_fragments(w13.blocks, w13.scales)
    q2, s2 = from_fragments(w2.blocks, w2.scales)
    g, u = split_gate_up(q13, interleave)
    gs, us = split_gate_up(s13, interleave)
    e, i, half = g.shape
    blocks = torch.stack((g, u), dim=2).reshape(e, 2 * i, half // 16, 16)
    scales = torch.stack((gs, us), dim=2).reshape(e, 2 * i, -1)
    h = q2.shape[1]
    return blocks, scales, q2.reshape(e, h, -1, 16), s2

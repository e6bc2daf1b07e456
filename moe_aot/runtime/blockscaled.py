"""Expert weights of the block-scaled layer ("mxfp8", "nvfp4", "w4a8-mx") in the layout its
kernels read (templates/blockscaled_warp.py), in plain torch: no DSL, no database.

"w4a8-mx"'s weights are MXFP4 (gemm_limits.BS_FORMATS: e2m1 codes two per byte, a ue8m0 scale per
32), its activations MXFP8: prepare_w13 / prepare_w2 quantize bf16 weights to MXFP4, and
from_gpt_oss takes gpt-oss's experts as its checkpoint ships them, without requantizing.

Each matrix is quantized along K with moe_aot/blockscale.py, row by row, so the kernels' layout is
the reference's own: values [E, N, K] e4m3 bytes or [E, N, K/2] packed e2m1, scales [E, N, K/vec]
bytes (row r's scale of K block b at r * K/vec + b), all uint8 and contiguous. w13's rows are
gate/up interleaved in blocks of ``interleave`` rows (layout.interleave_gate_up) after quantizing
gate and up: a row's bytes do not depend on the other rows, except through NVFP4's global amax,
which is one per expert and matrix (w13: over gate and up together; w2), fp32 [E]. An nvfp4
weight also carries the calibrated amax of its GEMM's activation input (`input_amax`, fp32 [1]):
w2's is h's, which GEMM1 needs before h exists (MoeLayer.forward refuses an nvfp4 w2 without it).

K padding (gemm_limits.bs_padded_k): the sm_121a kernels run whole 128-element k-tiles, so a K
that is no multiple of 128 (gpt-oss's hidden = intermediate = 2880) is stored padded to one (2944):
the padding columns are zero values with zero scale bytes (blockscale's encoding of a zero
block), which add exactly 0 to every sum; x and h are padded the same way by their kernels. N
(w13's 2I rows, w2's H) is never padded. ``dequantize`` keeps the padding (zeros); ``to_gpt_oss``
drops it (K is w2's N for w13, w13's N / 2 for w2).

Expert biases (gpt-oss's gate_up_proj_bias, down_proj_bias): ``bias`` bf16, w13's [E, 2I]
interleaved as its rows, w2's [E, H]; GEMM1 adds them to the gate/up sums before the
activation, GEMM2 to its sums before the routing weight (templates/blockscaled_warp.py).

Scale layout, keyed by target (gemm_limits.bs_scale_layout): the sm_121a kernels read the scales
row-major as above ("rows"); the sm_100a tcgen05 kernels (templates/blackwell_blockscaled.py) read
them in the tcgen05 MMA's 128x4 atoms ("tcgen05", blockscale.to_tcgen05_scales: the same bytes,
permuted per expert). The values are the same on both targets (w4a8-mx's stay packed: sm_100a's
TMA unpacks them on the way into shared memory). ``prepare_w13`` / ``prepare_w2`` /
``from_gpt_oss`` take ``target`` and ``for_target`` converts a prepared weight; ``scale_layout`` says
which layout a weight is in, and the layer refuses a weight in another target's layout.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import blockscale
from ..gemm_limits import BLOCKSCALED, BS_FORMATS, bs_padded_k, bs_scale_layout
from ..layout import interleave_gate_up, split_gate_up


class BlockScaledWeight(NamedTuple):
    values: torch.Tensor  # uint8 [E, N, K] (mxfp8) or [E, N, K/2] (nvfp4, w4a8-mx)
    scales: torch.Tensor  # uint8 [E, N, K/vec]
    global_amax: torch.Tensor | None  # nvfp4: fp32 [E]; mxfp8: None
    # nvfp4: the calibrated amax of this GEMM's activation input, fp32 [1] (a checkpoint's
    # per-linear activation scale, as an amax). w2's is required: GEMM1 quantizes h against it
    # before h exists. w13's may be None: the layer then takes x's amax on the device every call.
    # mxfp8: None (its scales are per block only).
    input_amax: torch.Tensor | None = None
    # the layout of `scales`: "rows" (row-major, sm_121a) or "tcgen05" (sm_100a's scale atoms)
    scale_layout: str = "rows"
    # expert biases, bf16: w13's [E, 2I] interleaved as its rows, w2's [E, H]; None: no biases
    bias: torch.Tensor | None = None


def with_input_amax(w: BlockScaledWeight, amax) -> BlockScaledWeight:
    """`w` with its activation input's calibrated amax (a float or a tensor; fp32 [1] on w's device)."""
    t = torch.as_tensor(amax, dtype=torch.float32, device=w.values.device).reshape(1).clone()
    return w._replace(input_amax=t)


def for_target(w: BlockScaledWeight, target: str | None) -> BlockScaledWeight:
    """`w` with its scales in the layout `target`'s kernels read (None: row-major, as sm_121a's)."""
    want = bs_scale_layout(target)
    if w.scale_layout == want:
        return w
    rows = blockscale.from_scale_layout(w.scales, w.scale_layout)
    return w._replace(scales=blockscale.to_scale_layout(rows, want), scale_layout=want)


def row_scales(w: BlockScaledWeight) -> BlockScaledWeight:
    """`w` with row-major scales (blockscale.quantize's layout), whatever its target."""
    return for_target(w, None)


def check_format(fmt: str) -> None:
    if fmt not in BLOCKSCALED:
        raise ValueError(f"format {fmt!r} has no block-scaled GEMMs; use one of {', '.join(BLOCKSCALED)}")


def _quantize_experts(w: torch.Tensor, fmt: str, amax: torch.Tensor | None):
    """[E, N, K] -> (values, scales) stacked per expert in the weights' format of precision `fmt`,
    expert e relative to amax[e] (nvfp4), K zero-padded to bs_padded_k(K) first (zero blocks:
    value and scale bytes 0)."""
    wfmt = BS_FORMATS[fmt][1]
    k = w.shape[2]
    if bs_padded_k(k) != k:
        w = torch.nn.functional.pad(w, (0, bs_padded_k(k) - k))
    parts = [blockscale.quantize(w[e], wfmt, None if amax is None else amax[e]) for e in range(w.shape[0])]
    return torch.stack([p.values for p in parts]), torch.stack([p.scales for p in parts])


def expert_amax(*ws: torch.Tensor) -> torch.Tensor:
    """fp32 [E]: the largest |w| of each expert over all the given [E, N, K] matrices."""
    return torch.stack([w.float().abs().amax(dim=(1, 2)) for w in ws]).amax(0)


def _bias13(b_gate, b_up, interleave: int) -> torch.Tensor | None:
    """Gate and up biases [E, I] -> b13 [E, 2I] bf16 interleaved as w13's rows (or None)."""
    if (b_gate is None) != (b_up is None):
        raise ValueError("give both the gate and the up biases, or neither")
    if b_gate is None:
        return None
    if b_gate.shape != b_up.shape or b_gate.dim() != 2:
        raise ValueError(f"gate bias {tuple(b_gate.shape)} and up bias {tuple(b_up.shape)} "
                         "must be equal [E, I] tensors")
    return interleave_gate_up(b_gate.unsqueeze(-1), b_up.unsqueeze(-1), interleave).squeeze(-1).to(torch.bfloat16)


def prepare_w13(w_gate: torch.Tensor, w_up: torch.Tensor, fmt: str, interleave: int = 16,
                target: str | None = None, b_gate: torch.Tensor | None = None,
                b_up: torch.Tensor | None = None) -> BlockScaledWeight:
    """Gate and up [E, I, H] (and their biases [E, I]) -> w13 as `target`'s GEMM1 reads it (see
    the module docstring; K padded to whole k-tiles)."""
    check_format(fmt)
    if w_gate.shape != w_up.shape or w_gate.dim() != 3:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must be equal [E, I, H] tensors")
    bias = _bias13(b_gate, b_up, interleave)
    amax = expert_amax(w_gate, w_up) if fmt == "nvfp4" else None
    qg, sg = _quantize_experts(w_gate, fmt, amax)
    qu, su = _quantize_experts(w_up, fmt, amax)
    w = BlockScaledWeight(interleave_gate_up(qg, qu, interleave), interleave_gate_up(sg, su, interleave), amax,
                          bias=None if bias is None else bias.contiguous())
    return for_target(w, target)


def prepare_w2(w2: torch.Tensor, fmt: str, target: str | None = None,
               bias: torch.Tensor | None = None) -> BlockScaledWeight:
    """w2 [E, H, I] (and its bias [E, H]) -> as `target`'s GEMM2 reads it (K padded to whole k-tiles)."""
    check_format(fmt)
    if bias is not None and tuple(bias.shape) != tuple(w2.shape[:2]):
        raise ValueError(f"w2's bias must be [E, H] = {tuple(w2.shape[:2])}, got {tuple(bias.shape)}")
    amax = expert_amax(w2) if fmt == "nvfp4" else None
    q, s = _quantize_experts(w2, fmt, amax)
    return for_target(BlockScaledWeight(q, s, amax, bias=None if bias is None else
                                        bias.to(torch.bfloat16).contiguous()), target)


def dequantize(w: BlockScaledWeight, fmt: str) -> torch.Tensor:
    """The fp32 [E, N, K] a prepared weight stands for (blockscale.dequantize per expert; K as
    stored, its padding zeros)."""
    check_format(fmt)
    w = row_scales(w)
    return torch.stack([blockscale.dequantize(blockscale.Quantized(
        w.values[e], w.scales[e], None if w.global_amax is None else w.global_amax[e:e + 1]), BS_FORMATS[fmt][1])
        for e in range(w.values.shape[0])])


def split_w13(w13: BlockScaledWeight, interleave: int = 16) -> tuple[BlockScaledWeight, BlockScaledWeight]:
    """The inverse of prepare_w13's interleave: (gate, up) prepared weights, each [E, I, .] (row-major scales)."""
    w13 = row_scales(w13)
    (qg, qu), (sg, su) = split_gate_up(w13.values, interleave), split_gate_up(w13.scales, interleave)
    bg = bu = None
    if w13.bias is not None:
        bg, bu = (b.squeeze(-1) for b in split_gate_up(w13.bias.unsqueeze(-1), interleave))
    return (BlockScaledWeight(qg, sg, w13.global_amax, w13.input_amax, bias=bg),
            BlockScaledWeight(qu, su, w13.global_amax, w13.input_amax, bias=bu))


def _gpt_oss_rows(blocks: torch.Tensor, scales: torch.Tensor, name: str):
    """gpt-oss's blocks [E, N, K/32, 16] and scales [E, N, K/32] uint8 -> (codes [E, N, K/2],
    scales [E, N, K/32]), contiguous: the checkpoint's bytes are already row-major MXFP4 (element
    2j in the low nibble, as blockscale.pack_fp4)."""
    if not isinstance(blocks, torch.Tensor) or not isinstance(scales, torch.Tensor) or blocks.dim() != 4 or \
            scales.dim() != 3 or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[3] != 16 \
            or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"{name}_blocks and {name}_scales must be uint8 [E, N, K/32, 16] and [E, N, K/32] "
                         "(gpt-oss's MXFP4 checkpoint layout)")
    e, n, g, b = blocks.shape
    codes, scales = blocks.reshape(e, n, g * b), scales
    k = g * 32
    pad = bs_padded_k(k) - k  # zero codes and zero scale bytes: blocks of value 0
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad // 2))
        scales = torch.nn.functional.pad(scales, (0, pad // 32))
    return codes.contiguous(), scales.contiguous()


def from_gpt_oss(gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias=None, down_bias=None,
                 interleave: int = 16, target: str | None = None) -> tuple[BlockScaledWeight, BlockScaledWeight]:
    """One gpt-oss layer's MXFP4 experts as its checkpoint ships them (gate_up_proj_blocks /
    _scales: rows gate, up, gate, up, ... (even rows gate); down_proj_blocks / _scales; the
    biases gate_up_proj_bias [E, 2I], interleaved the same way, and down_proj_bias [E, H]) ->
    (w13, w2) "w4a8-mx" BlockScaledWeights: the same code and scale bytes, w13's rows (and b13)
    regrouped into gate/up blocks of ``interleave``, K zero-padded to whole k-tiles (2880 ->
    2944); nothing is requantized. The biases become bf16 (the checkpoint's dtype)."""
    q13, s13 = _gpt_oss_rows(gate_up_blocks, gate_up_scales, "gate_up_proj")
    q2, s2 = _gpt_oss_rows(down_blocks, down_scales, "down_proj")
    if q13.shape[1] % 2:
        raise ValueError(f"gate_up_proj has {q13.shape[1]} rows; gate and up rows alternate, so it must be even")
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("give both gate_up_proj_bias and down_proj_bias, or neither")
    b13 = b2 = None
    if gate_up_bias is not None:
        e, n = q13.shape[:2]
        if tuple(gate_up_bias.shape) != (e, n) or tuple(down_bias.shape) != tuple(q2.shape[:2]):
            raise ValueError(f"gate_up_proj_bias must be [E, 2I] = {(e, n)} and down_proj_bias [E, H] = "
                             f"{tuple(q2.shape[:2])}, got {tuple(gate_up_bias.shape)} and {tuple(down_bias.shape)}")
        b13 = _bias13(gate_up_bias[:, 0::2], gate_up_bias[:, 1::2], interleave).contiguous()
        b2 = down_bias.to(torch.bfloat16).contiguous()
    w13 = BlockScaledWeight(interleave_gate_up(q13[:, 0::2], q13[:, 1::2], interleave),
                            interleave_gate_up(s13[:, 0::2], s13[:, 1::2], interleave), None, bias=b13)
    return for_target(w13, target), for_target(BlockScaledWeight(q2, s2, None, bias=b2), target)


def to_gpt_oss(w13: BlockScaledWeight, w2: BlockScaledWeight, interleave: int = 16):
    """The inverse of from_gpt_oss: (gate_up_blocks, gate_up_scales, down_blocks, down_scales), the
    K padding dropped (w13's K is w2's N, H; w2's K is w13's N / 2, I). The biases, where the
    weights carry them: gpt_oss_biases."""
    w13, w2 = row_scales(w13), row_scales(w2)
    e, hidden = w2.values.shape[:2]
    inter = w13.values.shape[1] // 2
    (g, u), (gs, us) = split_gate_up(w13.values, interleave), split_gate_up(w13.scales, interleave)
    g, u, gs, us = g[..., :hidden // 2], u[..., :hidden // 2], gs[..., :hidden // 32], us[..., :hidden // 32]
    blocks = torch.stack((g, u), dim=2).reshape(e, 2 * inter, hidden // 32, 16)
    scales = torch.stack((gs, us), dim=2).reshape(e, 2 * inter, -1)
    return (blocks, scales, w2.values[..., :inter // 2].reshape(e, hidden, -1, 16).contiguous(),
            w2.scales[..., :inter // 32].contiguous())


def gpt_oss_biases(w13: BlockScaledWeight, w2: BlockScaledWeight, interleave: int = 16):
    """(gate_up_proj_bias, down_proj_bias) in the checkpoint's layout (gate and up alternating), bf16."""
    g, u = (b.squeeze(-1) for b in split_gate_up(w13.bias.unsqueeze(-1), interleave))
    return torch.stack((g, u), dim=2).reshape(g.shape[0], -1), w2.bias

"""Block-scaled formats (MXFP8, MXFP4, NVFP4) in plain torch: the reference the quantization
kernels (templates/blockscale_quant.py) must match bit for bit, and their dequantization.
No DSL, no database; CPU or CUDA tensors.

A tensor x [rows, K] (bf16 or fp32) is quantized along K in blocks of BLOCK[fmt] consecutive
elements; every block gets one scale byte. Outputs are bytes (uint8), row-major:

  "mxfp8"  values [rows, K] e4m3 bytes, scales [rows, K/32] ue8m0 bytes
  "mxfp4"  values [rows, K/2] e2m1 codes packed two per byte, scales [rows, K/32] ue8m0 bytes
  "nvfp4"  values [rows, K/2] as mxfp4, scales [rows, K/16] e4m3 bytes, and one fp32 global
           amax per tensor (an input of the kernel: what the block scales are relative to)

Packing of e2m1: element 2j in the low nibble of byte j, element 2j + 1 in the high nibble (as
torch.float4_e2m1fn_x2, torch.testing._internal.common_quantized.pack_uint4, and OCP MX v1.0).
An e2m1 code is sign << 3 | magnitude index into E2M1_VALUES (0, 0.5, 1, 1.5, 2, 3, 4, 6).

MX (OCP Microscaling Formats v1.0, section 6.3, the "floor" scale of the spec's conversion):
  shared exponent  e = floor(log2(amax(block))) - EMAX[fmt]   (EMAX: e4m3 8, e2m1 2)
  scale byte       clamp(e + 127, 0, 254); a block of zeros (amax 0, e = -inf) gets byte 0, and
                   so does any block whose exponent is below ue8m0's range (values then round to
                   zero or to e4m3 subnormals as they come)
  elements         x * 2^-(byte - 127) (exact: a power of two), rounded to nearest, ties to even,
                   saturating at the element's largest magnitude (448, 6). The spec leaves the
                   overflow of the elements to the implementation; amax / 2^e lies in [2^EMAX,
                   2^(EMAX + 1)), so the largest values of a block can exceed 448 (or 6) and clamp.
                   This rounding is that of PTX `cvt.rn.satfinite.e4m3x2.f32` (mxfp8, every
                   target) and `cvt.rn.satfinite.e2m1x2.f32` (sm_100a, sm_121a); sm_90a has no
                   e2m1 conversion and the kernel rounds in software to the same result.
  NaN or +-Inf     a block holding one gets scale byte 0xFF (NaN in ue8m0, so OCP decodes the
                   whole block as NaN) and all element bytes 0.

NVFP4 (NVIDIA's two-level recipe as TransformerEngine's kernels compute it,
transformer_engine/common/cast/nvfp4/core_nvfp4.cuh: compute_global_encode_scaling_factor_FP4,
quantization_SF::compute_decoding_scaling_factor, compute_scaling_coefficient<float>), every
step an IEEE fp32 operation rounded to nearest (division correctly rounded, no approximate
reciprocal, no flush of subnormals):
  S_enc = min(fp32(448 * 6) / global_amax, FLT_MAX), and 1 where global_amax == 0 or S_enc == 0
  block scale byte  e4m3(amax(block) * (S_enc * fp32(1/6)))   (RNE, saturating at 448)
  element inverse   inv = min(1 / (float(block scale) * (1 / S_enc)), FLT_MAX)
  elements          e2m1(x * inv)   (RNE, saturating at 6)
  dequantized       e2m1 * float(block scale) * (1 / S_enc)
  global_amax       the caller's (finite, >= 0), by default amax(x); a block holding NaN or
                    +-Inf gets scale byte 0x7F (e4m3's NaN) and all element bytes 0.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import gemm_limits as limits

FORMATS = limits.BLOCKSCALE_FORMATS
BLOCK = limits.BLOCKSCALE_BLOCK
EMAX = limits.MX_EMAX  # exponent of the element format's largest power of two (OCP emax_elem)
E4M3_MAX = limits.FP8_MAX
E2M1_MAX = limits.E2M1_MAX
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding e2m1 to nearest, ties to even: |v| above (or at, where the even code is above) each
# midpoint moves one code up. Midpoints 0.25 (tie -> 0), 0.75 (-> 1.0), 1.25 (-> 1.0),
# 1.75 (-> 2.0), 2.5 (-> 2.0), 3.5 (-> 4.0), 5 (-> 4.0); above 5 the code is 6.0's (saturation).
E2M1_MIDPOINTS = limits.E2M1_MIDPOINTS  # (midpoint, the tie rounds up)
MX_NAN = limits.MX_NAN_SCALE  # ue8m0 NaN: the scale byte of a block holding NaN or Inf
E4M3_NAN = limits.E4M3_NAN  # e4m3 NaN: NVFP4's scale byte of such a block
FLT_MAX = torch.finfo(torch.float32).max
_F32 = torch.float32
ONE_SIXTH = torch.tensor(1.0, dtype=_F32) / torch.tensor(6.0, dtype=_F32)  # fp32(1/6), as C's 1.0f / 6.0f


class Quantized(NamedTuple):
    values: torch.Tensor  # uint8: e4m3 bytes [rows, K] or packed e2m1 [rows, K/2]
    scales: torch.Tensor  # uint8 [rows, K/block]: ue8m0 (mx) or e4m3 (nvfp4) bytes
    global_amax: torch.Tensor | None  # nvfp4: fp32 [1]; mx: None


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not a block-scaled format; use one of {', '.join(FORMATS)}")


def _check_input(x: torch.Tensor, fmt: str) -> None:
    check_format(fmt)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a [rows, K] bf16 or fp32 tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                         f"{' ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}")
    if x.shape[1] % BLOCK[fmt]:
        raise ValueError(f"K={x.shape[1]} must be a multiple of {fmt}'s block of {BLOCK[fmt]}")


# -- element formats ---------------------------------------------------------------------------------
def e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 bytes, nearest with ties to even, saturating at +-448 (as cvt.rn.satfinite);
    -0.0 keeps its sign (0x80), NaN gives 0x7F. torch's own conversion rounds to nearest even but
    turns values beyond 464 into NaN, hence the clamp first (which changes no in-range result)."""
    return v.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).float()


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15), nearest with ties to even, saturating at +-6 (Inf too);
    the sign is v's sign bit, so -0.0 and negatives that round to zero give 0x8. NaN is not an
    input of this format (the quantizers never feed it one) and gives a signed zero."""
    v = v.float()
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, tie_up in E2M1_MIDPOINTS:
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    sign = (v.view(torch.int32) < 0).to(torch.uint8)
    return code | (sign << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=_F32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes: element 2j in the low nibble, 2j + 1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension ({codes.shape[-1]}) must be even to pack two e2m1 codes per byte")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# -- the formats -------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, fmt: str):
    rows, k = x.shape
    v = x.float().reshape(rows, k // BLOCK[fmt], BLOCK[fmt])
    finite = torch.isfinite(v).all(-1, keepdim=True)
    amax = torch.where(finite, v.abs(), 0.0).amax(-1, keepdim=True)
    return v, amax, finite


def mx_scale_bytes(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """ue8m0 byte of each (finite, >= 0) block amax: clamp(floor(log2(amax)) - EMAX + 127, 0, 254)."""
    _, e = torch.frexp(amax.float())  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    biased = torch.where(amax > 0, e.long() - 1 - EMAX[fmt] + 127, 0)
    return biased.clamp(0, 254).to(torch.uint8)


def mx_decode_scale(b: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) for each ue8m0 byte (NaN for 0xFF); 2^-127 is an fp32 subnormal, exact."""
    out = torch.ldexp(torch.ones(b.shape, dtype=torch.float64, device=b.device), b.long() - 127).float()
    return torch.where(b == MX_NAN, torch.nan, out)


def _mx_factor(b: torch.Tensor) -> torch.Tensor:
    """2^(127 - byte) for bytes 0..253 as fp32 (normal numbers, exact): what multiplies x."""
    return ((254 - b.long()) << 23).to(torch.int32).view(_F32)


def nvfp4_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = min(448 * 6 / global_amax, FLT_MAX), 1 where global_amax is 0 (TransformerEngine's
    compute_global_encode_scaling_factor_FP4); fp32 [1]."""
    g = global_amax.float().reshape(1)
    s = torch.minimum(torch.tensor(E4M3_MAX * E2M1_MAX, dtype=_F32, device=g.device) / g,
                      torch.tensor(FLT_MAX, dtype=_F32, device=g.device))
    return torch.where((g == 0) | (s == 0), 1.0, s)


def quantize(x: torch.Tensor, fmt: str, global_amax: torch.Tensor | float | None = None) -> Quantized:
    """x [rows, K] -> Quantized(values, scales, global_amax) in `fmt` (see the module's docstring).
    global_amax (nvfp4 only): the amax the block scales are relative to; by default x's own."""
    _check_input(x, fmt)
    rows, k = x.shape
    v, amax, finite = _blocks(x, fmt)
    if fmt in EMAX:
        if global_amax is not None:
            raise ValueError(f"global_amax is NVFP4's second scale; {fmt} has none")
        sb = mx_scale_bytes(amax, fmt)
        scaled = v * _mx_factor(torch.where(finite, sb, 0))
        scale_bytes = torch.where(finite, sb, MX_NAN)
    else:
        if global_amax is None:
            if not bool(torch.isfinite(x).all()):
                raise ValueError("x holds NaN or Inf, so its amax cannot be NVFP4's global amax; pass "
                                 "global_amax (the finite amax the block scales are relative to)")
            global_amax = x.float().abs().amax()
        g = torch.as_tensor(global_amax, dtype=_F32, device=x.device).reshape(1)
        if not bool(torch.isfinite(g).all()) or bool((g < 0).any()):
            raise ValueError(f"global_amax must be a finite number >= 0, got {g.item()}")
        s_enc = nvfp4_encode_scale(g)
        sb = e4m3_bytes(amax * (s_enc * ONE_SIXTH.to(x.device)))
        s_dec = 1.0 / s_enc
        inv = torch.clamp_max(1.0 / (e4m3_values(sb) * s_dec), FLT_MAX)
        scaled = v * inv
        scale_bytes = torch.where(finite, sb, E4M3_NAN)
    if fmt == "mxfp8":
        q = torch.where(finite, e4m3_bytes(scaled), 0).reshape(rows, k)
    else:
        q = pack_fp4(torch.where(finite, e2m1_codes(scaled), 0).reshape(rows, k))
    return Quantized(q.to(torch.uint8), scale_bytes.reshape(rows, k // BLOCK[fmt]).to(torch.uint8),
                     g if fmt == "nvfp4" else None)


def dequantize(q: Quantized, fmt: str) -> torch.Tensor:
    """The fp32 values a Quantized stands for: element * block scale (* 1 / S_enc for nvfp4);
    a block with a NaN scale byte decodes to NaN."""
    check_format(fmt)
    values, scales, gamax = q
    if fmt == "mxfp8":
        elems = e4m3_values(values)
    else:
        elems = e2m1_values(unpack_fp4(values))
    rows, k = elems.shape
    if scales.shape != (rows, k // BLOCK[fmt]):
        raise ValueError(f"scales {tuple(scales.shape)} do not match values of {rows} rows and K={k} "
                         f"({fmt}: one scale per {BLOCK[fmt]})")
    if fmt in EMAX:
        s = mx_decode_scale(scales)
    else:
        s = e4m3_values(scales) * (1.0 / nvfp4_encode_scale(gamax))
    return (elems.reshape(rows, -1, BLOCK[fmt]) * s.unsqueeze(-1)).reshape(rows, k)


# -- the tcgen05 scale layout ------------------------------------------------------------------------
# sm_100a's block-scaled tcgen05.mma reads scale factors in atoms of 128 rows x 4 K blocks (512
# bytes, PTX ISA "tcgen05 ... scale factor layout"): row r = 32 r1 + r0 (r0 < 32, r1 < 4) and
# block j < 4 of an atom at byte 16 r0 + 4 r1 + j; atoms ordered K-block group fastest, then
# 128-row group (the DSL's blockscaled_layout.tile_atom_to_shape_SF). A permutation of the
# row-major [rows, K/vec] bytes above; rows a multiple of 128 and K/vec of 4.
SF_ATOM_ROWS, SF_ATOM_BLOCKS = limits.SF_ATOM_ROWS, limits.SF_ATOM_BLOCKS


def _check_sf_shape(s: torch.Tensor) -> None:
    if not isinstance(s, torch.Tensor) or s.dim() < 2 or s.shape[-2] % SF_ATOM_ROWS or s.shape[-1] % SF_ATOM_BLOCKS:
        shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"scales {shape} must be [..., rows, blocks] with rows a multiple of {SF_ATOM_ROWS} and "
                         f"blocks of {SF_ATOM_BLOCKS} (the tcgen05 scale atom)")


def to_tcgen05_scales(s: torch.Tensor) -> torch.Tensor:
    """Row-major scale bytes [..., rows, blocks] -> the same bytes in the tcgen05 atom layout (the
    same shape, contiguous; each leading index, e.g. an expert, permuted on its own)."""
    _check_sf_shape(s)
    *lead, rows, blocks = s.shape
    # (rt, r1, r0, kt, j) -> (rt, kt, r0, r1, j)
    v = s.reshape(*lead, rows // 128, 4, 32, blocks // 4, 4)
    n = len(lead)
    perm = list(range(n)) + [n, n + 3, n + 2, n + 1, n + 4]
    return v.permute(perm).reshape(*lead, rows, blocks).contiguous()


def from_tcgen05_scales(s: torch.Tensor) -> torch.Tensor:
    """The inverse of to_tcgen05_scales."""
    _check_sf_shape(s)
    *lead, rows, blocks = s.shape
    v = s.reshape(*lead, rows // 128, blocks // 4, 32, 4, 4)  # (rt, kt, r0, r1, j)
    n = len(lead)
    perm = list(range(n)) + [n, n + 3, n + 2, n + 1, n + 4]
    return v.permute(perm).reshape(*lead, rows, blocks).contiguous()


def to_scale_layout(s: torch.Tensor, layout: str) -> torch.Tensor:
    """Row-major scale bytes in `layout` (gemm_limits.BS_SCALE_LAYOUTS)."""
    if layout not in limits.BS_SCALE_LAYOUTS:
        raise ValueError(f"scale layout {layout!r} must be one of {', '.join(limits.BS_SCALE_LAYOUTS)}")
    return to_tcgen05_scales(s) if layout == "tcgen05" else s


def from_scale_layout(s: torch.Tensor, layout: str) -> torch.Tensor:
    """Scale bytes in `layout` back to row-major."""
    if layout not in limits.BS_SCALE_LAYOUTS:
        raise ValueError(f"scale layout {layout!r} must be one of {', '.join(limits.BS_SCALE_LAYOUTS)}")
    return from_tcgen05_scales(s) if layout == "tcgen05" else s

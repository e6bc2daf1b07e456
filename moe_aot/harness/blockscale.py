"""Bit-exact checks of the block-scaled quantization kernel (templates/blockscale_quant.py, launched
by moe_aot.runtime.blockscale) against its torch reference (moe_aot.blockscale, computed on the
CPU): inputs of several distributions, outputs poisoned with two different bytes in two runs (a
byte the kernel leaves unwritten cannot match the reference both times), every byte compared.
Used by tests/test_gpu_blockscale.py and tools/check_blockscale.py."""
from __future__ import annotations

import torch

from .. import blockscale as ref

# rounding midpoints of e4m3 below 256 (the values a tie lands on once a block's scale maps its
# amax into [256, 512)); every one is exact in bf16 (at most 5 significant bits)
_E4M3_POS = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_MIDS = (_E4M3_POS[1:] + _E4M3_POS[:-1]) / 2
E4M3_MIDPOINTS = _MIDS[_MIDS < 256]
E2M1_MIDPOINTS = torch.tensor([m for m, _ in ref.E2M1_MIDPOINTS])
DISTRIBUTIONS = ("normal", "wide", "zeros", "ties", "nonfinite")
POISON = (0xAB, 0x54)
# K of the kernels tools/check_blockscale.py builds, per format: under one pass of the CTA (96;
# nvfp4 also 48, whose packed rows are 24 bytes: 8-byte aligned only), the hidden sizes of
# Qwen3-30B (2048), gpt-oss (2880) and DeepSeek-V3 (7168: two passes at mx's 32)
KS = {"mxfp8": (96, 2048, 2880, 7168), "mxfp4": (96, 2048, 2880, 7168), "nvfp4": (48, 96, 2048, 2880, 7168)}


def make_input(dist: str, rows: int, k: int, fmt: str, gen: torch.Generator):
    """(x [rows, k] bf16 on the CPU, global amax for nvfp4 or None) of one distribution:
    normal; wide (normal times 2^U(-60, 60) per element and again per block: from bf16
    subnormals to ~2^122); zeros (whole blocks of +0 and -0, and scattered zeros); ties (every
    element but each block's amax on a rounding midpoint of its block's scale); nonfinite
    (normal with NaN, +Inf, -Inf in some blocks; nvfp4's global amax is the finite values')."""
    blk = ref.BLOCK[fmt]
    nb = k // blk

    def u(*shape):
        return torch.rand(*shape, generator=gen)

    def sign(*shape):
        return torch.where(u(*shape) < 0.5, -1.0, 1.0)

    x = torch.randn(rows, k, generator=gen)
    if dist == "wide":
        per_block = torch.exp2(torch.floor(u(rows, nb) * 120 - 60)).repeat_interleave(blk, 1)
        x = x * torch.exp2(torch.floor(u(rows, k) * 120 - 60)) * per_block
    elif dist == "zeros":
        x = torch.where(u(rows, k) < 0.3, 0.0, x)
        zero_blocks = (u(rows, nb) < 0.3).repeat_interleave(blk, 1)
        x = torch.where(zero_blocks, torch.where(u(rows, k) < 0.5, -0.0, 0.0), x)
    elif dist == "ties":
        scale = torch.exp2(torch.floor(u(rows, nb, 1) * 24 - 12))
        if fmt == "mxfp8":
            mids, top = E4M3_MIDPOINTS, 256.0
        else:
            mids, top = E2M1_MIDPOINTS, 6.0
        pick = mids[(u(rows, nb, blk) * len(mids)).long().clamp_max(len(mids) - 1)]
        pick[..., 0] = top  # the block's amax: its scale is exactly `scale` (nvfp4: with global 2688)
        x = (pick * sign(rows, nb, blk) * (scale if fmt != "nvfp4" else scale.clamp(2.0 ** -6, 2.0 ** 6)))
        x = x.reshape(rows, k)
    elif dist == "nonfinite":
        bad = u(rows, k) < 0.01
        kind = u(rows, k)
        x = torch.where(bad, torch.where(kind < 0.4, torch.nan, torch.where(kind < 0.7, torch.inf, -torch.inf)), x)
    elif dist != "normal":
        raise ValueError(f"distribution {dist!r} must be one of {', '.join(DISTRIBUTIONS)}")
    x = x.bfloat16()
    gamax = None
    if fmt == "nvfp4":
        if dist == "ties":
            gamax = torch.tensor([ref.E4M3_MAX * ref.E2M1_MAX])  # S_enc = 1: block scales 2^j, ties kept
        else:
            xf = x.float()
            gamax = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax().reshape(1)
    return x, gamax


def check(fmt: str, x: torch.Tensor, gamax, quantize, device) -> dict:
    """Run `quantize(x_dev, fmt, gamax_dev, out)` (the runtime's launcher) twice with outputs
    poisoned by POISON, compare every byte with the CPU reference. Returns a row: ok, the number
    of bad value / scale bytes and the first bad (row, column, got, want)."""
    want = ref.quantize(x, fmt, gamax)
    xd = x.to(device)
    gd = gamax.to(device) if gamax is not None else None
    row = {"format": fmt, "rows": x.shape[0], "k": x.shape[1], "ok": True, "bad_values": 0, "bad_scales": 0,
           "first_bad": None}
    for poison in POISON:
        out = ref.Quantized(torch.full(want.values.shape, poison, dtype=torch.uint8, device=device),
                            torch.full(want.scales.shape, poison, dtype=torch.uint8, device=device), gd)
        got = quantize(xd, fmt, gd, out)
        torch.cuda.synchronize(device)
        for name, g, w in (("values", got.values.cpu(), want.values), ("scales", got.scales.cpu(), want.scales)):
            bad = g != w
            n = int(bad.sum())
            if n:
                row["ok"] = False
                row[f"bad_{name}"] = max(row[f"bad_{name}"], n)
                if row["first_bad"] is None:
                    r, c = (int(i) for i in bad.nonzero()[0])
                    row["first_bad"] = {"tensor": name, "poison": poison, "row": r, "col": c,
                                        "got": int(g[r, c]), "want": int(w[r, c])}
    return row

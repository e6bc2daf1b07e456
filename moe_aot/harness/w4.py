"""References of the mxfp4-w layer's kernels in fp32 torch: GEMM1 + GLU and the whole layer on
exactly the weights the kernels consume, dequantized (runtime/w4.dequantize: e2m1 value times
2^(scale byte - 127), the values the kernels' bf16 weights hold exactly), and random mxfp4-w
weights for the checks."""
from __future__ import annotations

import torch

from ..runtime import w4
from ..spec import LayerSpec
from ..variants import INTERLEAVE
from .reference import glu_reference, moe_reference


def dequantized(w: w4.W4Weight) -> torch.Tensor:
    """fp32 [E, N, K] of one GEMM's W4Weight."""
    return w4.dequantize(w.blocks, w.scales)


def glu_w4_reference(x, w13: w4.W4Weight, topk_ids, activation: str, block: int = INTERLEAVE):
    """[M*top_k, I] fp32 GEMM1 + GLU of every routed pair on the dequantized weights (+ b13)."""
    return glu_reference(x, dequantized(w13), topk_ids, activation, block, w13.bias)


def moe_w4_reference(x, w13: w4.W4Weight, w2: w4.W4Weight, topk_weights, topk_ids, activation: str,
                     block: int = INTERLEAVE):
    """The whole layer in fp32 on the dequantized weights (+ expert biases)."""
    return moe_reference(x, dequantized(w13), dequantized(w2), topk_weights, topk_ids, activation, block,
                         w13.bias, w2.bias)


BIAS_STD = 0.5  # as harness.verify's bf16 biases


def random_w4_weights(spec: LayerSpec, device, scale: float = 1.0, generator=None):
    """Random bf16 weights (and biases where spec.bias) quantized to mxfp4-w, 16 experts at a
    time (gpt-oss-120b's fp32 temporaries stay a few GB): (w13, w2) W4Weights."""
    H, I, E = spec.hidden, spec.intermediate, spec.experts
    parts = []
    for a in range(0, E, 16):
        n = min(16, E - a)
        gu = torch.randn(n, 2 * I, H, device=device, generator=generator) * (scale / H ** 0.5)
        d = torch.randn(n, H, I, device=device, generator=generator) * (scale / I ** 0.5)
        parts.append(w4.prepare_weights(gu[:, :I], gu[:, I:], d, interleave=INTERLEAVE))
    b13 = b2 = None
    if spec.bias:
        b13 = (torch.randn(E, 2 * I, device=device, generator=generator) * BIAS_STD).to(torch.bfloat16)
        b2 = (torch.randn(E, H, device=device, generator=generator) * BIAS_STD).to(torch.bfloat16)
    w13 = w4.W4Weight(torch.cat([p[0].blocks for p in parts]), torch.cat([p[0].scales for p in parts]), b13)
    w2 = w4.W4Weight(torch.cat([p[1].blocks for p in parts]), torch.cat([p[1].scales for p in parts]), b2)
    return w13, w2


# The layers the mxfp4-w checks run (tests/test_gpu_w4.py, tools/check_w4.py): gpt-oss-120b and a
# smaller shape of the same kind (swigluoai, expert biases), as make_spec fields.
CHECK_LAYERS = (dict(model="gpt-oss-120b", precision="mxfp4-w"),
                dict(experts=32, top_k=4, hidden=1024, intermediate=512, activation="swigluoai", bias=True,
                     precision="mxfp4-w"))
CHECK_TOKENS = (1, 16, 37, 256, 1000)

"""References of the block-scaled layer's GEMMs ("mxfp8", "nvfp4", "w4a8-mx";
templates/blockscaled_warp.py) in fp32 torch, on exactly the bytes the kernels read: x, the weights
and h dequantized with moe_aot/blockscale.py (each in its own format: w4a8-mx's x and h mxfp8, its
weights mxfp4), the fp32 layer of moe_aot/harness/reference.py in between, and h quantized back as
GEMM1's epilogue does (padding rows quantized zeros). K is padded as the kernels store it
(gemm_limits.bs_padded_k: zero columns, quantized zeros), and the expert biases (gpt-oss) are
added where the weights carry them. Plain torch, CPU or CUDA."""
from __future__ import annotations

import torch

from .. import blockscale
from ..gemm_limits import BS_FORMATS, bs_padded_k, bs_scale_layout
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


def _act(fmt: str) -> str:
    """The format of x and h of the block-scaled precision `fmt` (w4a8-mx: mxfp8)."""
    return BS_FORMATS[fmt][0]


def pad_k(t: torch.Tensor) -> torch.Tensor:
    """t [..., K] with zero columns up to bs_padded_k(K): how the kernels store x and h."""
    k = t.shape[-1]
    return torch.nn.functional.pad(t, (0, bs_padded_k(k) - k)) if bs_padded_k(k) != k else t


def quantize_x(x: torch.Tensor, fmt: str, gx=None) -> blockscale.Quantized:
    """The quantized x the layer's bsquant kernel writes: K padded, the padding quantized zeros."""
    return blockscale.quantize(pad_k(x), _act(fmt), gx)


def glu_pairs(xq: blockscale.Quantized, w13: bw.BlockScaledWeight, topk_ids, activation: str, fmt: str):
    """[M*top_k, I] fp32: the GLU of every routed pair on the dequantized x and w13 (both K-padded
    alike, the padding zeros), w13's biases added to the gate/up sums where it carries them."""
    return glu_reference(blockscale.dequantize(xq, _act(fmt)), bw.dequantize(w13, fmt), topk_ids, activation,
                         INTERLEAVE, b13=w13.bias)


def h_padded(pairs: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
    """[R, I] fp32 in GEMM1's padded row order: row r holds pair sorted_ids[r], padding rows zeros."""
    out = torch.zeros(sorted_ids.numel(), pairs.shape[1], dtype=torch.float32, device=pairs.device)
    valid = sorted_ids >= 0
    out[valid] = pairs[sorted_ids[valid].long()]
    return out


def quantize_h(h: torch.Tensor, fmt: str, h_gamax: torch.Tensor | None) -> blockscale.Quantized:
    """GEMM1's output bytes for the fp32 h rows [R, I] (nvfp4: relative to the given global amax),
    K-padded as GEMM2 reads them."""
    return blockscale.quantize(pad_k(h), _act(fmt), h_gamax if fmt == "nvfp4" else None)


def down_rows(hq: blockscale.Quantized, w2: bw.BlockScaledWeight, sorted_ids, tile_expert, topk_weights, fmt: str,
              tile_m: int):
    """[M*top_k, H] fp32: GEMM2's rows, y[p] = w[p] * (dequant(h[r]) . dequant(w2_e)^T (+ b2_e)) for
    p = sorted_ids[r] with e the expert of r's tile; rows no pair maps to are zeros."""
    h = blockscale.dequantize(hq, _act(fmt))
    w = bw.dequantize(w2, fmt)
    pairs = topk_weights.numel()
    y = torch.zeros(pairs, w.shape[1], dtype=torch.float32, device=h.device)
    for t, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        rows = torch.arange(t * tile_m, (t + 1) * tile_m, device=h.device)
        p = sorted_ids[rows].long()
        keep = p >= 0
        s = h[rows[keep]] @ w[e].t()
        if w2.bias is not None:
            s = s + w2.bias[e].float()
        y[p[keep]] = s * topk_weights.reshape(-1)[p[keep]].float().unsqueeze(1)
    return y


# -- the whole layer (MoeLayer.forward of an mxfp8 / nvfp4 / w4a8-mx layer) -------------------------
# The DGX Spark layers checked through their sm_90a stand-in (target "sm_121a-standin") on an
# H100/H200: (layer fields, precisions, token counts). tools/spark_standin.py --build compiles their
# bucket defaults; tests/test_gpu_spark_standin.py and the tool's --run check them. The small
# layer is tools/check_blockscaled.py's (1, 7, 64, 300 tokens: buckets 1, 16, 64, 256, both the
# decode and the 64-row tiles); Qwen3-30B-A3B at decode sizes. w4a8-mx (MXFP4 weights) runs on
# both. GPT_OSS_CHECK: gpt-oss's shape (hidden = intermediate = 2880, K padded to 2944; the clamped
# SwiGLU and expert biases) with 8 experts, top-4, so that it builds and checks quickly (its
# kernels are those of gpt-oss-120b but for the expert count, a runtime bound of the same code):
# w4a8-mx, mxfp8 and nvfp4 at 1, 16, 64 tokens.
GPT_OSS_CHECK = (dict(experts=8, top_k=4, hidden=2880, intermediate=2880, activation="swigluoai", bias=True),
                 ("w4a8-mx", "mxfp8", "nvfp4"), (1, 16, 64))
STANDIN_CHECKS = (
    (dict(experts=8, top_k=2, hidden=1024, intermediate=512), ("bf16", "fp8", "mxfp8", "nvfp4", "w4a8-mx"),
     (1, 7, 64, 300)),
    (dict(model="qwen3-30b-a3b"), ("bf16", "mxfp8", "nvfp4", "w4a8-mx"), (1, 16, 64)),
    GPT_OSS_CHECK,
)
POISON_BYTE = 0xAB  # written into the workspace's quantized x and h before a checked forward
CALIBRATION_TOKENS = 64  # random tokens whose GLU outputs give nvfp4's h amax (random_weights)


def random_weights(spec, device, scale: float = 1.0, generator=None):
    """(w13, w2) BlockScaledWeights of random weights for the layer (sums of order `scale`);
    nvfp4's w2 carries h's amax calibrated on CALIBRATION_TOKENS random tokens through the
    reference (values beyond it saturate, in the kernels and the reference alike). With expert
    biases (spec.bias): random ones of order `scale` / 2."""
    E, H, I, fmt = spec.experts, spec.hidden, spec.intermediate, spec.precision
    gate, up = (torch.randn(E, I, H, device=device, generator=generator) * (scale * H ** -0.5) for _ in range(2))
    bg = bu = b2 = None
    if spec.bias:
        bg, bu, b2 = (torch.randn(E, n, device=device, generator=generator) * (scale / 2) for n in (I, I, H))
    w13 = bw.prepare_w13(gate, up, fmt, INTERLEAVE, b_gate=bg, b_up=bu)
    del gate, up
    w2 = bw.prepare_w2(torch.randn(E, H, I, device=device, generator=generator) * (scale * I ** -0.5), fmt, bias=b2)
    if fmt == "nvfp4":
        x = torch.randn(CALIBRATION_TOKENS, H, device=device, generator=generator).to(torch.bfloat16)
        ids = torch.rand(CALIBRATION_TOKENS, E, device=device, generator=generator).topk(spec.top_k, dim=1)[1]
        xq = quantize_x(x, fmt, x.float().abs().amax().reshape(1))
        w2 = bw.with_input_amax(w2, glu_pairs(xq, w13, ids.to(torch.int32), spec.activation, fmt).abs().amax())
    return w13, w2


def poison(ws) -> None:
    """Fill the workspace's quantized x and h (values and scales) with POISON_BYTE, so bytes a
    kernel leaves unwritten fail check_forward."""
    for t in (ws.xq, ws.xs, ws.hq, ws.hs):
        t.fill_(POISON_BYTE)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_forward(layer, x, w13, w2, topk_weights, topk_ids, out, ws=None) -> dict:
    """After ``layer.forward(x, w13, w2, topk_weights, topk_ids, out=out)`` (out NaN-poisoned and
    the workspace poison()-ed before it), each stage against the fp32 reference of exactly what
    its kernels consumed, read back from the workspace ``ws`` (default: the layer's):
      routing   sorted_ids, tile_expert: equal to harness.reference.routing_reference;
      x         the quantized x bytes: equal to blockscale.quantize(x) (nvfp4: x's amax, or
                w13's calibrated input_amax);
      h         GEMM1's h (the kernel's bytes) as close to the exact GLU of the dequantized x and
                w13 as the reference's own quantization of it (fp32 sums in another order may
                flip a rounding): error <= 1.25 x the reference's + 1e-3, >= 99% of the scale
                bytes equal, padding rows quantized zeros;
      layer     out against GEMM2 + routing weights + combine in fp32 on the kernel's own h and
                the dequantized w2: rel err <= TOLERANCE, worst row <= ROW_TOLERANCE, no NaN.
    Returns the numbers and "ok"."""
    from ..layout import max_tiles
    from .reference import rel_err, routing_reference, row_rel_err
    from .verify import ROW_TOLERANCE, TOLERANCE

    spec, fmt = layer.spec, layer.spec.precision
    M, K, nv = x.shape[0], spec.top_k, fmt == "nvfp4"
    ws = ws or layer.workspace(M)
    v = layer.variant_for(M)
    T = max_tiles(M, K, spec.experts, v.tile_m)
    R = T * v.tile_m
    sorted_ids, tile_expert = ws.sorted_ids[:R], ws.tile_expert[:T]
    _, offsets, want_ids, want_tiles = routing_reference(topk_ids, spec.experts, v.tile_m)
    routing_ok = torch.equal(sorted_ids, want_ids) and torch.equal(tile_expert, want_tiles)
    gx = None
    if nv:
        gx = w13.input_amax if w13.input_amax is not None else x.float().abs().amax().reshape(1)
    xq_ref = quantize_x(x, fmt, gx)  # K-padded: the padding columns quantized zeros
    x_ok = torch.equal(ws.xq[:M], xq_ref.values) and torch.equal(ws.xs[:M], xq_ref.scales)
    gh = w2.input_amax if nv else None
    rows = int(offsets[-1])  # rows of the tiles that have an expert (routing pads each to tile_m)
    h_exact = h_padded(glu_pairs(blockscale.Quantized(ws.xq[:M], ws.xs[:M], gx), w13, topk_ids, spec.activation,
                                 fmt), want_ids)[:rows]
    h_want = quantize_h(h_exact, fmt, gh)
    # h's scales as GEMM1 wrote them, row-major (sm_100a's GEMM1 writes the tcgen05 atoms: R is
    # whole 128-row tiles there)
    hs = blockscale.from_scale_layout(ws.hs[:R], bs_scale_layout(spec.target))
    h_got = blockscale.Quantized(ws.hq[:rows], hs[:rows], gh)
    pad = want_ids[:rows] < 0
    h_exact = pad_k(h_exact)  # h's K padding (GEMM1's last column tiles write it): exactly zero
    icols = spec.intermediate * ws.hq.shape[1] // h_exact.shape[1]  # value bytes of h's real columns
    iscales = spec.intermediate * hs.shape[1] // h_exact.shape[1]
    y = down_rows(blockscale.Quantized(ws.hq[:R], hs, gh), w2, want_ids, want_tiles, topk_weights, fmt, v.tile_m)
    ref = y.view(M, K, -1).sum(1)
    res = {
        "routing_equal": routing_ok, "x_bytes_equal": x_ok,
        "h_err": _rel(blockscale.dequantize(h_got, _act(fmt)), h_exact) if rows else 0.0,
        "h_err_reference": _rel(blockscale.dequantize(h_want, _act(fmt)), h_exact) if rows else 0.0,
        "h_scale_bytes_equal": (hs[:rows] == h_want.scales).float().mean().item() if rows else 1.0,
        "h_padding_zero": bool((ws.hq[:rows][pad] == 0).all() and (hs[:rows][pad] == 0).all()),
        "h_k_padding_zero": bool((ws.hq[:rows, icols:] == 0).all() and (hs[:rows, iscales:] == 0).all()),
        "rel_err": rel_err(out, ref), "row_rel_err": row_rel_err(out, ref),
        "variant": v.name(spec),
    }
    res["ok"] = bool(routing_ok and x_ok and res["h_err"] <= 1.25 * res["h_err_reference"] + 1e-3
                     and res["h_scale_bytes_equal"] >= 0.99 and res["h_padding_zero"] and res["h_k_padding_zero"]
                     and res["rel_err"] <= TOLERANCE and res["row_rel_err"] <= ROW_TOLERANCE)
    return res


def layer_reference(x, w13, w2, topk_weights, topk_ids, fmt: str, activation: str = "swiglu", tile_m: int = 16):
    """[M, H] fp32: the whole layer on quantized operands as its kernels compute it, from x alone:
    x quantized (nvfp4: against its amax or w13's input_amax), GEMM1 + GLU in fp32, h quantized
    as GEMM1's epilogue does (nvfp4: against w2's input_amax), GEMM2 with the routing weights,
    summed over top_k. (check_forward uses the kernel's own h instead, so a rounding that the
    kernel's fp32 sums flip does not count twice.)"""
    from .reference import routing_reference

    M, K, E = topk_ids.shape[0], topk_ids.shape[1], w13.values.shape[0]
    nv = fmt == "nvfp4"
    gx = (w13.input_amax if w13.input_amax is not None else x.float().abs().amax().reshape(1)) if nv else None
    xq = quantize_x(x, fmt, gx)
    _, _, sorted_ids, tile_expert = routing_reference(topk_ids, E, tile_m)
    h = h_padded(glu_pairs(xq, w13, topk_ids, activation, fmt), sorted_ids)
    y = down_rows(quantize_h(h, fmt, w2.input_amax if nv else None), w2, sorted_ids, tile_expert, topk_weights,
                  fmt, tile_m)
    return y.view(M, K, -1).sum(1)


def graph_replay_check(layer, w13, w2, tokens: int) -> dict:
    """The forward captured in a CUDA graph, replayed with new inputs written into the captured
    buffers: equal to the eager forward on them (and nothing waits for the host)."""
    from .verify import random_routing

    spec, dev = layer.spec, layer.device
    x = torch.randn(tokens, spec.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(tokens, spec, dev)
    out = torch.empty(tokens, spec.hidden, device=dev, dtype=torch.bfloat16)
    ws = layer.workspace(tokens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.forward(x, w13, w2, tw, ids, out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer.forward(x, w13, w2, tw, ids, out=out, workspace=ws)
    x2 = torch.randn_like(x)
    tw2, ids2 = random_routing(tokens, spec, dev, skew=True)
    for buf, new in ((x, x2), (tw, tw2), (ids, ids2)):
        buf.copy_(new)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    eager = layer.forward(x2, w13, w2, tw2, ids2)
    torch.cuda.synchronize()
    return {"stage": "cuda_graph", "tokens": tokens, "equal": bool(torch.equal(out, eager)),
            "ok": bool(torch.equal(out, eager)) and not bool(torch.isnan(out).any())}

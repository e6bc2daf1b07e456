"""Check stored kernels on the GPU against the fp32 PyTorch reference, stage by stage, on fresh
random inputs with NaN-poisoned outputs. Used by `moe-aot verify`, the GPU tests and tools/."""
from __future__ import annotations

import zlib

import torch

from ..gemm_limits import BLOCKSCALED, FP8, H_SCALE_BLOCK, W4
from ..layout import max_tiles
from ..runtime import fp8 as fp8_format
from ..runtime.layer import MoeLayer, split_biases
from ..runtime.store import KernelStore
from ..spec import LayerSpec
from ..variants import INTERLEAVE
from . import fp8, w4
from .reference import glu_reference, moe_reference, rel_err, routing_reference, row_rel_err

TOLERANCE = 1e-2
ROW_TOLERANCE = 3e-2  # worst single row (bf16 rows land near 5e-3; one wrong routed pair of 8 is ~0.3)


def timing_generator(spec: LayerSpec, tokens: int, index: int, device) -> torch.Generator:
    """The generator of the ``index``-th timing input set of ``spec`` at ``tokens``, seeded by
    these alone: every variant timed at one bucket (by the tuner in any order or worker, by the
    benchmark) runs on the same x and routings, so that two variants' times differ by their
    kernels and not by how many padded tiles their routings happened to need (at DeepSeek-V3 4096
    an expert's 128 +- 11 rows need one 128-row tile or two, a few percent of the tiles between
    two routings)."""
    return seeded_generator(device, spec.workload_key, tokens, index)


def seeded_generator(device, *key) -> torch.Generator:
    """A torch generator on ``device`` seeded by ``key`` alone (the same draws in every process,
    whatever was drawn before)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(repr(key).encode()))
    return gen


def random_routing(tokens: int, spec: LayerSpec, device, skew: bool = False, only_even: bool = False,
                   generator=None):
    """Distinct experts per token (as real routers give). With skew, a few experts take most
    tokens; with only_even, odd experts get no tokens at all (needs top_k <= experts / 2)."""
    E, K = spec.experts, spec.top_k
    scores = torch.rand(tokens, E, device=device, generator=generator)
    if skew:
        scores += torch.linspace(2.0, 0.0, E, device=device) ** 4
    if only_even and 2 * K <= E:
        scores[:, 1::2] = -1.0
    w, ids = torch.topk(scores, K, dim=1)
    w = torch.softmax(w, dim=1).float()
    return w.contiguous(), ids.to(torch.int32).contiguous()


BIAS_STD = 0.5  # random expert biases: N(0, 0.25), about half the spread of the GEMMs' sums


def random_weights(spec: LayerSpec, device, scale: float = 1.0):
    """Random prepared weights of the layer: bf16 w13 (interleaved) and w2, or for fp8 layers
    the (e4m3, scales) pairs of random bf16 weights quantized by prepare_fp8_weights (mxfp4-w:
    W4Weights of random weights, harness/w4.random_w4_weights; mxfp8 / nvfp4: BlockScaledWeights,
    harness/blockscaled.random_weights), or for
    layers with expert biases the (weights, biases) pairs (w13, b13), (w2, b2)."""
    H, I, E = spec.hidden, spec.intermediate, spec.experts
    if spec.precision in W4:
        return w4.random_w4_weights(spec, device, scale)
    if spec.precision in BLOCKSCALED:  # BlockScaledWeights; nvfp4's w2 with h's calibrated amax
        from . import blockscaled

        return blockscaled.random_weights(spec, device, scale)
    if spec.precision in FP8:
        # 16 experts at a time: DeepSeek-V3's bf16 weights (22 GB) are never all held at once
        parts13, parts2 = [], []
        for a in range(0, E, 16):
            n = min(16, E - a)
            gu = torch.randn(n, 2 * I, H, device=device, dtype=torch.bfloat16) * (scale / H ** 0.5)
            parts13.append(fp8_format.prepare_w13(gu[:, :I], gu[:, I:], spec.precision, INTERLEAVE))
            parts2.append(fp8_format.prepare_w2(torch.randn(n, H, I, device=device, dtype=torch.bfloat16)
                                         * (scale / I ** 0.5), spec.precision))
        return tuple((torch.cat([p[0] for p in ps]), torch.cat([p[1] for p in ps])) for ps in (parts13, parts2))
    w13 = (torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) * (scale / H ** 0.5))
    w2 = (torch.randn(E, H, I, device=device, dtype=torch.bfloat16) * (scale / I ** 0.5))
    if spec.bias:
        b13 = torch.randn(E, 2 * I, device=device, dtype=torch.bfloat16) * BIAS_STD
        b2 = torch.randn(E, H, device=device, dtype=torch.bfloat16) * BIAS_STD
        return (w13, b13), (w2, b2)
    return w13, w2


def layer_reference(spec: LayerSpec, x, w13, w2, topk_weights, topk_ids, h_block: int = H_SCALE_BLOCK):
    """The fp32 reference of the layer in its precision (fp8: on what its kernels consume, h
    quantized per ``h_block`` columns as the variant that ran does)."""
    if spec.precision in FP8:
        return fp8.moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, spec.precision, spec.activation,
                                     INTERLEAVE, h_block)
    if spec.precision in W4:
        return w4.moe_w4_reference(x, w13, w2, topk_weights, topk_ids, spec.activation, INTERLEAVE)
    if spec.precision in BLOCKSCALED:
        from . import blockscaled

        return blockscaled.layer_reference(x, w13, w2, topk_weights, topk_ids, spec.precision, spec.activation)
    w13, b13, w2, b2 = split_biases(spec, w13, w2)
    return moe_reference(x, w13, w2, topk_weights, topk_ids, spec.activation, INTERLEAVE, b13, b2)


def served_reference(layer: MoeLayer, x, w13, w2, topk_weights, topk_ids):
    """The fp32 reference of what ``layer.forward`` runs at x's token count: the four kernels'
    (layer_reference; fp8 with the variant's h block), or where the one-launch decode kernel
    serves it (MoeLayer.decode_for) that kernel's (fp8: the dequantized weights with x and h
    unquantized, fp8.moe_dequantized_reference; bf16: the same reference as the four kernels)."""
    spec, M = layer.spec, x.shape[0]
    if spec.precision in FP8 and layer.decode_for(M) is not None:
        return fp8.moe_dequantized_reference(x, w13, w2, topk_weights, topk_ids, spec.precision, spec.activation,
                                             INTERLEAVE)
    return layer_reference(spec, x, w13, w2, topk_weights, topk_ids, layer.variant_for(M).h_block)


def check_stages(layer: MoeLayer, x, w13, w2, topk_weights, topk_ids) -> list[dict]:
    """Routing (exact), GEMM1+GLU (rel err), whole layer (rel err) for one input set. mxfp8 /
    nvfp4: one forward, each stage checked on what its kernels consumed (blockscaled.check_forward)."""
    spec, M = layer.spec, x.shape[0]
    if spec.precision in BLOCKSCALED:
        return _check_stages_bs(layer, x, w13, w2, topk_weights, topk_ids)
    rows = []
    v, route, glu, down, comb = layer.kernels(M)
    T = max_tiles(M, spec.top_k, spec.experts, v.tile_m)
    dev = dict(device=x.device, dtype=torch.int32)
    bufs = [torch.full((spec.experts,), 0x7FFFFFFF, **dev), torch.full((spec.experts + 1,), 0x7FFFFFFF, **dev),
            torch.full((T * v.tile_m,), 0x7FFFFFFF, **dev), torch.full((T,), 0x7FFFFFFF, **dev)]
    xq_xs = ()
    if spec.precision in FP8:  # the routing launch quantizes x too: into poisoned (NaN) buffers
        blk = fp8_format.x_block(spec.precision)
        xq_xs = (torch.full((M, spec.hidden), 0x7F, dtype=torch.uint8, device=x.device).view(fp8_format.E4M3),
                 torch.full((M,) if blk is None else (M, spec.hidden // blk), float("nan"), device=x.device))
        route(topk_ids, *bufs, x, *xq_xs)
    else:
        route(topk_ids, *bufs)
    ref = routing_reference(topk_ids, spec.experts, v.tile_m)
    same = all(torch.equal(a, b) for a, b in zip(bufs, ref))
    rows.append({"stage": "routing", "rel_err": 0.0 if same else 1.0, "ok": same, "variant": v.name(spec)})
    counts, offsets, sorted_ids, tile_expert = ref  # GEMM1 is checked on exact routing
    if spec.precision in FP8:
        rows.append(_check_glu_fp8(layer, x, *xq_xs, w13, sorted_ids, tile_expert, offsets, v))
    else:
        rows.append(_check_glu(layer, x, w13, topk_ids, sorted_ids, tile_expert, offsets, v, glu))
    out = torch.full((M, spec.hidden), float("nan"), device=x.device, dtype=torch.bfloat16)
    layer.forward(x, w13, w2, topk_weights, topk_ids, out=out)  # what serves M: the decode kernel or v
    ref = served_reference(layer, x, w13, w2, topk_weights, topk_ids)
    e, er = rel_err(out, ref), row_rel_err(out, ref)
    rows.append({"stage": "layer", "rel_err": e, "row_rel_err": er, "ok": e <= TOLERANCE and er <= ROW_TOLERANCE,
                 "variant": layer.served(M).name(spec)})
    return rows


def _check_stages_bs(layer, x, w13, w2, topk_weights, topk_ids) -> list[dict]:
    from . import blockscaled

    spec, M = layer.spec, x.shape[0]
    ws = layer.workspace(M)
    blockscaled.poison(ws)
    out = torch.full((M, spec.hidden), float("nan"), device=x.device, dtype=torch.bfloat16)
    layer.forward(x, w13, w2, topk_weights, topk_ids, out=out, workspace=ws)
    r = blockscaled.check_forward(layer, x, w13, w2, topk_weights, topk_ids, out, ws)
    h_ok = (r["x_bytes_equal"] and r["h_err"] <= 1.25 * r["h_err_reference"] + 1e-3 and r["h_padding_zero"]
            and r["h_scale_bytes_equal"] >= 0.99)
    return [{"stage": "routing", "rel_err": 0.0 if r["routing_equal"] else 1.0, "ok": r["routing_equal"],
             "variant": r["variant"]},
            {"stage": "glu", "rel_err": r["h_err"], "h_err_reference": r["h_err_reference"],
             "x_bytes_equal": r["x_bytes_equal"], "h_scale_bytes_equal": r["h_scale_bytes_equal"],
             "pad_rows_zero": r["h_padding_zero"], "ok": h_ok, "variant": r["variant"]},
            {"stage": "layer", "rel_err": r["rel_err"], "row_rel_err": r["row_rel_err"],
             "ok": r["rel_err"] <= TOLERANCE and r["row_rel_err"] <= ROW_TOLERANCE, "variant": r["variant"]}]


def _check_glu(layer, x, w13, topk_ids, sorted_ids, tile_expert, offsets, v, glu) -> dict:
    spec = layer.spec
    T = tile_expert.numel()
    h = torch.full((T * v.tile_m, spec.intermediate), float("nan"), device=x.device, dtype=torch.bfloat16)
    if spec.precision in W4:  # (blocks, scales, bias): the kernel's own operands
        glu(x, w13.blocks, w13.scales, sorted_ids, tile_expert, h, *(() if w13.bias is None else (w13.bias,)))
        href = w4.glu_w4_reference(x, w13, topk_ids, spec.activation, INTERLEAVE)
    else:
        b13 = None
        if spec.bias:
            w13, b13 = w13
        glu(x, w13, sorted_ids, tile_expert, h, *(() if b13 is None else (b13,)))
        href = glu_reference(x, w13, topk_ids, spec.activation, INTERLEAVE, b13)
    valid = sorted_ids >= 0
    got = torch.zeros_like(href)
    got[sorted_ids[valid].long()] = h[valid].float()
    # Padding rows inside used tiles must be zeros; tiles past the last expert are not written.
    used = torch.arange(sorted_ids.numel(), device=x.device) < offsets[-1]
    pad = used & ~valid
    pad_ok = bool((h[pad] == 0).all()) if pad.any() else True
    e, er = rel_err(got, href), row_rel_err(got, href)
    return {"stage": "glu", "rel_err": e, "row_rel_err": er, "pad_rows_zero": pad_ok,
            "ok": e <= TOLERANCE and er <= ROW_TOLERANCE and pad_ok, "variant": v.name(spec)}


FP8_H_ROW_TOLERANCE = 5e-2  # a value past a rounding midpoint is one e4m3 step (6-12%) off


def _check_glu_fp8(layer, x, xq, xs, w13, sorted_ids, tile_expert, offsets, v) -> dict:
    """x's quantization (done by the routing launch: xq, xs) and GEMM1 of an fp8 layer: x's e4m3
    values and scales against torch's quantization of x, then GEMM1's dequantized output against
    the fp32 GEMM1 + GLU of exactly what it read (the kernel's own xq, xs and the weights),
    quantized the same way."""
    spec = layer.spec
    R = sorted_ids.numel()
    _, libs = layer.role_kernels(x.shape[0])
    blk = fp8_format.x_block(spec.precision)
    q_ref, s_ref = fp8.quantize_x(x, spec.precision)
    e_q = rel_err(fp8.dequantize_rows(xq, xs, blk), fp8.dequantize_rows(q_ref, s_ref, blk))
    h = torch.full((R, spec.intermediate), 0x7F, dtype=torch.uint8, device=x.device).view(fp8_format.E4M3)
    hb = v.h_block  # h's scale block, the variant's (both GEMMs are built with it)
    hs = torch.full((R, spec.intermediate // hb), float("nan"), device=x.device)
    libs["glu"](xq, xs, w13[0], w13[1], sorted_ids, tile_expert, h, hs)
    href = fp8.glu_fp8_reference(xq, xs, w13[0], w13[1], sorted_ids, tile_expert, v.tile_m, spec.top_k,
                                 spec.precision, spec.activation, INTERLEAVE)
    hq_ref, hs_ref = fp8.quantize_rows(href, hb)
    valid = sorted_ids >= 0
    got, want = fp8.dequantize_rows(h, hs, hb)[valid], fp8.dequantize_rows(hq_ref, hs_ref, hb)[valid]
    used = torch.arange(R, device=x.device) < offsets[-1]
    pad = used & ~valid
    pad_ok = bool((h[pad].float() == 0).all()) if pad.any() else True
    e, er = rel_err(got, want), row_rel_err(got, want)
    same = torch.equal(xq.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(xs, s_ref)
    return {"stage": "glu", "rel_err": e, "row_rel_err": er, "pad_rows_zero": pad_ok, "quant_rel_err": e_q,
            "x_bytes_equal": same,
            "ok": e <= TOLERANCE and er <= FP8_H_ROW_TOLERANCE and pad_ok and e_q <= TOLERANCE,
            "variant": v.name(spec)}


def verify_layer(spec: LayerSpec, tokens, db_url: str | None = None, stages=None) -> list[dict]:
    layer = MoeLayer(spec, KernelStore(db_url))
    dev = layer.device
    w13, w2 = random_weights(spec, dev)
    out = []
    for t in tokens:
        for routing in ("uniform", "skewed", "half_experts_empty"):
            x = torch.randn(t, spec.hidden, device=dev, dtype=torch.bfloat16)
            tw, ids = random_routing(t, spec, dev, skew=routing == "skewed",
                                     only_even=routing == "half_experts_empty")
            for row in check_stages(layer, x, w13, w2, tw, ids):
                row.update(tokens=t, routing=routing)
                out.append(row)
    return out

#!/usr/bin/env python3
"""Bisect why GEMM2 alone is slower inside the layer benchmark than in the kernel check (GPU).

For one model and token count, with the database's pick (MOE_AOT_DB): run the layer once on a
benchmark input set, then time the same GEMM2 library by back-to-back CUDA-graph replays with
  a) the layer's own bound launch (what tools/bench.py times),
  b) the layer's routing buffers and h, called through the library (fresh launch arguments),
  c) the reference routing (moe_aot.harness.reference.routing_reference) of the same topk_ids,
     with h recomputed into a fresh buffer by the layer's GEMM1 library,
  d) as c) with the kernel check's input distribution (topk of softmax(randn)),
and print one line per case (µs). Writes OUT/bisect_gemm2.json.

    python3 tools/bisect_gemm2.py --out OUT [--model qwen3-30b-a3b] [--tokens 4096]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    import torch

    from moe_aot.harness.measure import graph_times_us, input_sets
    from moe_aot.harness.reference import routing_reference
    from moe_aot.harness.verify import random_weights
    from moe_aot.runtime.layer import MoeLayer
    from moe_aot.runtime.store import KernelStore
    from moe_aot.spec import make_spec

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=50)
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)

    spec = make_spec(ns.model, target="sm_90a")
    layer = MoeLayer(spec, KernelStore())
    M, dev = ns.tokens, layer.device
    w13, w2 = random_weights(spec, dev)
    x, tw, ids, out = input_sets(spec, M, dev, n=1)[0]
    ws = layer.workspace(M)
    layer.forward(x, w13, w2, tw, ids, out=out, workspace=ws)
    layer.forward(x, w13, w2, tw, ids, out=out, workspace=ws)  # the bound plan
    v, route, glu, down, comb = layer.kernels(M)
    bound = layer.launchers(M, ws)

    def t(fn):
        return round(statistics.median(graph_times_us([fn], ns.replays)), 1)

    res = {"model": ns.model, "tokens": M, "variant": v.name(spec)}
    res["a_bound_launch"] = t(lambda: bound["down"](torch.cuda.current_stream().cuda_stream))
    # b) the layer's buffers through the library
    from moe_aot.layout import max_tiles

    T = max_tiles(M, spec.top_k, spec.experts, v.tile_m)
    R = T * v.tile_m
    sid, tex, h, y = ws.sorted_ids[:R], ws.tile_expert[:T], ws.h[:R], ws.y[:M * spec.top_k]
    res["b_layer_buffers"] = t(lambda: down(h, w2, sid, tex, tw, y))
    # c) the reference routing of the same ids, h recomputed by GEMM1 into fresh buffers
    _, _, sid2, tex2 = routing_reference(ids, spec.experts, v.tile_m)
    res["same_routing_as_layer"] = bool(torch.equal(sid2, sid) and torch.equal(tex2, tex))
    h2 = torch.empty(sid2.numel(), spec.intermediate, device=dev, dtype=torch.bfloat16)
    y2 = torch.empty(M * spec.top_k, spec.hidden, device=dev, dtype=torch.bfloat16)
    glu(x, w13, sid2, tex2, h2)
    res["c_reference_routing_fresh_buffers"] = t(lambda: down(h2, w2, sid2, tex2, tw, y2))
    # d) the kernel check's input distribution
    logits = torch.randn(M, spec.experts, device=dev)
    tw3, ids3 = torch.topk(torch.softmax(logits, -1), spec.top_k, dim=-1)
    tw3, ids3 = tw3.float().contiguous(), ids3.to(torch.int32).contiguous()
    _, _, sid3, tex3 = routing_reference(ids3, spec.experts, v.tile_m)
    x3 = torch.randn(M, spec.hidden, device=dev).bfloat16()
    h3 = torch.empty(sid3.numel(), spec.intermediate, device=dev, dtype=torch.bfloat16)
    glu(x3, w13, sid3, tex3, h3)
    res["d_check_distribution"] = t(lambda: down(h3, w2, sid3, tex3, tw3, y2))
    # e) the layer's routing with the check's weights scale: w2 from the check (randn / sqrt(I))
    w2c = (torch.randn(spec.experts, spec.hidden, spec.intermediate, device=dev) /
           spec.intermediate ** 0.5).bfloat16()
    res["e_check_weights"] = t(lambda: down(h2, w2c, sid2, tex2, tw, y2))
    print(json.dumps(res, indent=1), flush=True)
    (ns.out / "bisect_gemm2.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

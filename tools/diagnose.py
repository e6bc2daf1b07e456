#!/usr/bin/env python3
"""Locate a wrong result: per stage, repeated with fresh inputs, and where in h / y it is wrong.

    python3 tools/diagnose.py MODEL TOKENS [MODEL TOKENS ...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.harness.reference import glu_reference, routing_reference  # noqa: E402
from moe_aot.harness.verify import check_stages, random_routing, random_weights  # noqa: E402
from moe_aot.layout import max_tiles  # noqa: E402
from moe_aot.runtime.layer import MoeLayer  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

store = KernelStore()
args = sys.argv[1:]
for name, tokens in zip(args[::2], map(int, args[1::2])):
    spec = make_spec(name)
    layer = MoeLayer(spec, store)
    w13, w2 = random_weights(spec, layer.device)
    v = layer.variant_for(tokens)
    print(f"== {name} tokens={tokens} {v.name(spec)}", flush=True)
    for rep in range(3):
        x = torch.randn(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
        tw, ids = random_routing(tokens, spec, layer.device)
        rows = check_stages(layer, x, w13, w2, tw, ids)
        print("  ", [(r["stage"], f"{r['rel_err']:.1e}", r["ok"]) for r in rows], flush=True)
        if all(r["ok"] for r in rows):
            continue
        _, route, glu, down, comb = layer.kernels(tokens)
        counts, offsets, sorted_ids, tile_expert = routing_reference(ids, spec.experts, v.tile_m)
        h = torch.full((sorted_ids.numel(), spec.intermediate), float("nan"), device=x.device, dtype=torch.bfloat16)
        glu(x, w13, sorted_ids, tile_expert, h)
        href = glu_reference(x, w13, ids, spec.activation)
        valid = sorted_ids >= 0
        full = torch.zeros_like(h, dtype=torch.float32)
        full[valid] = href[sorted_ids[valid].long()]
        diff = (h.float() - full).abs()
        bad = (diff > 0.05 * full.abs().max()) | torch.isnan(h)
        bad[~valid] = False
        rows_bad = bad.any(1).nonzero().squeeze(1)
        cols_bad = bad.any(0).nonzero().squeeze(1)
        T = max_tiles(tokens, spec.top_k, spec.experts, v.tile_m)
        print(f"   glu: {int(bad.sum())} bad of {int(valid.sum()) * spec.intermediate}; T={T} used tiles="
              f"{int(offsets[-1]) // v.tile_m}; bad tiles {sorted(set((rows_bad // v.tile_m).tolist()))[:40]}; "
              f"bad col blocks of {v.glu.tile_n // 2}: {sorted(set((cols_bad // (v.glu.tile_n // 2)).tolist()))[:40]}; "
              f"nan {int(torch.isnan(h[valid]).sum())}", flush=True)

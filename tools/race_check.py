#!/usr/bin/env python3
"""Repeat each kernel of a layer on identical inputs and compare with the first result / the
reference: a result that moves between runs is a race (METHOD.md).

    python3 tools/race_check.py MODEL TOKENS [REPEATS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.harness.reference import rel_err, routing_reference  # noqa: E402
from moe_aot.harness.verify import random_routing, random_weights  # noqa: E402
from moe_aot.layout import max_tiles  # noqa: E402
from moe_aot.runtime.layer import MoeLayer  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

name, tokens = sys.argv[1], int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
spec = make_spec(name)
layer = MoeLayer(spec, KernelStore())
w13, w2 = random_weights(spec, layer.device)
v, route, glu, down, comb = layer.kernels(tokens)
print(v.name(spec), flush=True)
x = torch.randn(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
tw, ids = random_routing(tokens, spec, layer.device)
ref = routing_reference(ids, spec.experts, v.tile_m)
T = max_tiles(tokens, spec.top_k, spec.experts, v.tile_m)
dev = dict(device=x.device, dtype=torch.int32)
bad_route = 0
for _ in range(reps):
    bufs = [torch.full((spec.experts,), 7, **dev), torch.full((spec.experts + 1,), 7, **dev),
            torch.full((T * v.tile_m,), 7, **dev), torch.full((T,), 7, **dev)]
    route(ids, *bufs)
    bad_route += not all(torch.equal(a, b) for a, b in zip(bufs, ref))
print(f"routing: {bad_route}/{reps} runs differ from the reference", flush=True)
_, _, sorted_ids, tile_expert = ref
outs = {}
for kname, fn in (("glu", lambda h: glu(x, w13, sorted_ids, tile_expert, h)),):
    first, moved = None, 0
    for _ in range(reps):
        h = torch.full((T * v.tile_m, spec.intermediate), float("nan"), device=x.device, dtype=torch.bfloat16)
        fn(h)
        if first is None:
            first = h
        else:
            moved += not torch.equal(torch.nan_to_num(h, 7.0), torch.nan_to_num(first, 7.0))
    print(f"glu: {moved}/{reps - 1} runs differ from the first", flush=True)
    outs["h"] = first
h = outs["h"]
first, moved, maxdiff = None, 0, 0.0
valid = sorted_ids >= 0
for _ in range(reps):
    y = torch.full((tokens * spec.top_k, spec.hidden), float("nan"), device=x.device, dtype=torch.bfloat16)
    down(h, w2, sorted_ids, tile_expert, tw, y)
    if first is None:
        first = y
        href = torch.zeros_like(y, dtype=torch.float32)
        idx = sorted_ids[valid].long()
        e_of_row = torch.repeat_interleave(torch.arange(T, device=x.device), v.tile_m)[valid]
        e = tile_expert[e_of_row].long()
        for ex in torch.unique(e).tolist():
            sel = e == ex
            href[idx[sel]] = (h[valid][sel].float() @ w2[ex].float().t()) * tw.reshape(-1)[idx[sel]].unsqueeze(1)
        print(f"down: first run rel err {rel_err(y, href):.2e}", flush=True)
    else:
        diff = (torch.nan_to_num(y.float(), 1e4) - torch.nan_to_num(first.float(), 1e4)).abs()
        if diff.max() > 0:
            moved += 1
            rows = diff.amax(1).nonzero().squeeze(1)
            maxdiff = max(maxdiff, diff.max().item())
            if moved <= 3:
                print(f"   moved rows {rows[:16].tolist()} ({rows.numel()} rows), max diff {diff.max().item():.3g}",
                      flush=True)
print(f"down: {moved}/{reps - 1} runs differ from the first (max diff {maxdiff:.3g})", flush=True)
first, moved = None, 0
for _ in range(reps):
    out = torch.full((tokens, spec.hidden), float("nan"), device=x.device, dtype=torch.bfloat16)
    comb(y, ids, out)
    if first is None:
        first = out
    else:
        moved += not torch.equal(out, first)
print(f"combine: {moved}/{reps - 1} runs differ from the first", flush=True)

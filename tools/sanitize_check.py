#!/usr/bin/env python3
"""Run under `compute-sanitizer --tool memcheck`: the whole layer on inputs at the edges
(out-of-range and negative topk_ids, one token, a token count not a multiple of any tile,
all pairs on one expert), with the database's picks (at 1 token the one-launch decode kernel
where that is the pick) and again with each bucket's documented default (the persistent TMA
core "hopws" from 1024 tokens). Any out-of-bounds access makes the sanitizer report an error.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitize_check.py [model[:precision]]

(precision: bf16 by default; fp8 or fp8-block128 for the fp8 layers, checked against the fp32
reference of their fp8 math.)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.harness.reference import rel_err  # noqa: E402
from moe_aot.harness.verify import random_routing, random_weights, served_reference  # noqa: E402
from moe_aot.runtime.layer import MoeLayer  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402
from moe_aot.variants import default_variant, token_buckets  # noqa: E402

model, _, precision = (sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b").partition(":")
spec = make_spec(model, precision=precision or "bf16")
store = KernelStore()
layer = MoeLayer(spec, store)
w13, w2 = random_weights(spec, layer.device)
worst = 0.0
layer_source = "picks"
CASES = ((1, "invalid"), (37, "invalid"), (300, "one_expert"), (1100, "invalid"), (4096, "invalid"))
for M, case, source in [c + ("picks",) for c in CASES] + [c + ("defaults",) for c in CASES]:
    if source == "defaults" and layer_source == "picks":  # once, in place of the picks' layer
        del layer
        torch.cuda.empty_cache()
        layer = MoeLayer(spec, store, variants={b: default_variant(spec, b) for b in token_buckets()})
        layer_source = source
    x = torch.randn(M, spec.hidden, device=layer.device, dtype=torch.bfloat16)
    tw, ids = random_routing(M, spec, layer.device)
    if case == "invalid":
        ids[::2, 0] = spec.experts
        ids[1::3, -1] = -1
        ids[0, :] = 2 ** 31 - 1
    else:
        ids[:] = 3
    out = layer.forward(x, w13, w2, tw, ids)
    torch.cuda.synchronize()
    e = rel_err(out, served_reference(layer, x, w13, w2, tw, ids))  # the four kernels' or the decode kernel's
    worst = max(worst, e)
    del out
    torch.cuda.empty_cache()  # DeepSeek-V3's fp32 reference needs most of the GPU under memcheck
    print(f"M={M} {case} {source} {layer.served(M).name(spec)}: rel err {e:.2e}", flush=True)
print("SANITIZE_CHECK_DONE worst rel err", worst)

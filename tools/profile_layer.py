#!/usr/bin/env python3
"""One forward of the served layer per point inside an NVTX range `prof_<model>_<tokens>`, for
Nsight Compute to read the counters of exactly those kernels (not a test, not a timing).

    ncu --clock-control none --nvtx --nvtx-include 'regex:prof_.*/' --csv --page details \\
        --section SpeedOfLight ... python3 tools/profile_layer.py qwen3-30b-a3b:1 mixtral-8x7b:256

Each point runs two untimed forwards first (library loads, workspace), then the profiled one.
`python3 tools/ncu_summary.py FILE.csv` reads the result. tools/gpu_run.py --profile-layer runs it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.harness.measure import input_sets  # noqa: E402
from moe_aot.harness.verify import random_weights  # noqa: E402
from moe_aot.runtime.layer import MoeLayer  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402


def main(points: list[str]) -> None:
    store = KernelStore()
    by_model: dict[str, list[int]] = {}
    for p in points:
        model, _, tokens = p.partition(":")
        by_model.setdefault(model, []).append(int(tokens))
    for model, tokens_list in by_model.items():
        spec = make_spec(model, target="sm_90a")
        layer = MoeLayer(spec, store)
        w13, w2 = random_weights(spec, layer.device)
        for M in tokens_list:
            x, tw, ids, out = input_sets(spec, M, layer.device, n=1)[0]
            for _ in range(2):
                layer.forward(x, w13, w2, tw, ids, out=out)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"prof_{model}_{M}")
            layer.forward(x, w13, w2, tw, ids, out=out)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(model, M, layer.variant_for(M).name(spec), flush=True)
        del w13, w2, layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""One forward of the served layer per point inside an NVTX range `prof_<model>_<tokens>`, for
Nsight Compute to read the counters of exactly those kernels (not a test, not a timing).

    ncu --clock-control none --nvtx --nvtx-include 'regex:prof_.*/' --csv --page details \\
        --section SpeedOfLight ... python3 tools/profile_layer.py [--train] qwen3-30b-a3b:1 mixtral-8x7b:256

Each point runs two untimed forwards first (library loads, workspace), then the profiled one.
A point is `model:tokens` (bf16) or `model:tokens:precision` (fp8, fp8-block128: random bf16
weights quantized as `prepare_fp8_weights` does, harness.verify.random_weights); its range is then
`prof_<model>_<tokens>_<precision>`.
--train: a training step instead (fused_moe_train forward and its backward: the backward's dH, dX
and weight-gradient kernels, `moe-aot build --backward`). `python3 tools/ncu_summary.py FILE.csv`
reads the result. tools/gpu_run.py --profile-layer / --profile-train runs it.
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


def train_steps(points: list[str]) -> None:
    """Per point: two untimed training steps, then one inside the NVTX range."""
    from moe_aot.harness.verify import random_routing
    from moe_aot.integrations import op  # noqa: F401  (registers torch.ops.moe_aot)
    from moe_aot.integrations.autograd import moe_backward
    from moe_aot.integrations.functional import prepare_fused_gate_up

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for p in points:
        model, _, tokens = p.partition(":")
        spec, M = make_spec(model, target="sm_90a"), int(tokens)
        H, I, E = spec.hidden, spec.intermediate, spec.experts
        w13 = prepare_fused_gate_up((torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).bfloat16())
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).bfloat16()
        x = torch.randn(M, H, device=dev, generator=gen).bfloat16()
        tw, ids = random_routing(M, spec, dev, generator=gen)
        grad = torch.randn(M, H, device=dev, generator=gen).bfloat16()
        b13 = b2 = None
        if spec.bias:
            b13 = torch.zeros(E, 2 * I, device=dev, dtype=torch.bfloat16)
            b2 = torch.zeros(E, H, device=dev, dtype=torch.bfloat16)

        def step():
            # the backward called on this thread (autograd runs it on its own, outside the NVTX range)
            with torch.no_grad():
                _, preact = torch.ops.moe_aot.fused_moe_train(x, w13, w2, tw, ids, spec.activation, b13, b2)
                return moe_backward(grad, x, w13, w2, tw, ids, spec.activation, 16, b13, b2, preact)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"prof_{model}_{M}_train")
        step()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(model, M, "training step", flush=True)
        torch.cuda.empty_cache()


def main(points: list[str]) -> None:
    if points and points[0] == "--train":
        return train_steps(points[1:])
    store = KernelStore()
    by_layer: dict[tuple[str, str], list[int]] = {}
    for p in points:
        model, tokens, *prec = p.split(":")
        by_layer.setdefault((model, prec[0] if prec else "bf16"), []).append(int(tokens))
    for (model, precision), tokens_list in by_layer.items():
        spec = make_spec(model, precision=precision, target="sm_90a")
        layer = MoeLayer(spec, store)
        w13, w2 = random_weights(spec, layer.device)  # fp8: quantized from random bf16 ones
        tag = "" if precision == "bf16" else "_" + precision
        for M in tokens_list:
            x, tw, ids, out = input_sets(spec, M, layer.device, n=1)[0]
            for _ in range(2):
                layer.forward(x, w13, w2, tw, ids, out=out)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"prof_{model}_{M}{tag}")
            layer.forward(x, w13, w2, tw, ids, out=out)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(model, M, precision, layer.variant_for(M).name(spec), flush=True)
        del w13, w2, layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

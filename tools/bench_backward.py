#!/usr/bin/env python3
"""Benchmark of the layer's training step on the GPU (not a test): forward + backward of
torch.ops.moe_aot.fused_moe (AOT forward kernels, the backward of moe_aot/integrations/autograd.py)
against autograd through the unfused PyTorch path (tools/bench.py's torch_unfused: torch._grouped_mm
GEMMs, SiLU·up, index_add_), both captured in CUDA graphs and replayed.

    python3 tools/bench_backward.py --out DIR [--models a,b] [--tokens 4096,16384] [--replays 20] [--profile]

Per point: the forward alone and forward + backward for both (backward = the difference), their
ratio, the floor of forward + backward (3x the forward's FLOPs over the bf16 matmul rate measured
in the run, or 3x the selected experts' weight bytes over 4.8 TB/s), the activation bytes autograd
saves for the backward (saved_tensors_hooks, the weights not counted) for both, and the relative
difference between the two paths' gradients (both bf16). Build the database with
`moe-aot build --backward` so that the op's backward finds its compiled GLU kernel.
Writes DIR/bench_backward_h200.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench import graph_time_us, matmul_rate, torch_unfused  # noqa: E402

from moe_aot.harness.reference import rel_err  # noqa: E402
from moe_aot.harness.verify import random_routing  # noqa: E402
from moe_aot.integrations import op  # noqa: E402, F401
from moe_aot.integrations.functional import prepare_fused_gate_up  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

DEV = torch.device("cuda")
HBM = 4.8e12


def saved_bytes(fn, weights=()) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of fn(), not counting the
    storages of `weights` (the parameters, which training keeps anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in weights}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for ptr, n in seen.items() if ptr not in skip)


def point(spec, M, replays, rate, gen, profile=False):
    H, I, E, K = spec.hidden, spec.intermediate, spec.experts, spec.top_k
    w1 = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) * H ** -0.5).bfloat16()  # gate rows first
    w13 = prepare_fused_gate_up(w1)
    w2 = (torch.randn(E, H, I, device=DEV, generator=gen) * I ** -0.5).bfloat16()
    x = torch.randn(M, H, device=DEV, generator=gen).bfloat16()
    tw, ids = random_routing(M, spec, DEV, generator=gen)
    grad = torch.randn(M, H, device=DEV, generator=gen).bfloat16()
    ours_in = [t.clone().requires_grad_() for t in (x, w13, w2, tw)]
    ref_in = [t.clone().requires_grad_() for t in (x, w1, w2, tw)]

    def ours_fwd():
        return torch.ops.moe_aot.fused_moe(*ours_in[:4], ids)

    def ref_fwd():
        xi, w1i, w2i, twi = ref_in
        return torch_unfused(xi, w1i.transpose(1, 2), w2i.transpose(1, 2), twi, ids, E)

    def ours_step():
        return torch.autograd.grad(ours_fwd(), ours_in, grad)

    def ref_step():
        return torch.autograd.grad(ref_fwd(), ref_in, grad)

    g_ours, g_ref = ours_step(), ref_step()
    if profile:  # where each path's time goes: CUDA time per kernel over one step
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        for name, fn in (("ours", ours_step), ("torch", ref_step)):
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                fn()
                torch.cuda.synchronize()
            print(f"--- {name} step, {spec.workload_key} {M} tokens ---\n"
                  + p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70),
                  flush=True)
    # the unfused path's w1 gradient has the gate rows first: interleave it to compare with ours
    # w13 on its first 8 experts: interleaving the whole gradient would need another copy of it
    theirs = (g_ref[0], prepare_fused_gate_up(g_ref[1][:8]), g_ref[2], g_ref[3])
    g_ours = (g_ours[0], g_ours[1][:8], g_ours[2], g_ours[3])
    diffs = {n: rel_err(a, b.float()) for n, a, b in zip(("x", "w13", "w2", "topk_weights"), g_ours, theirs)}
    del g_ours, g_ref
    t = {}
    with torch.no_grad():
        t["ours_fwd"] = graph_time_us([ours_fwd], replays)
        t["torch_fwd"] = graph_time_us([ref_fwd], replays)
    t["ours_step"] = graph_time_us([ours_step], replays)
    t["torch_step"] = graph_time_us([ref_step], replays)
    flops = 6 * M * K * H * I
    selected = min(E, M * K)
    floor_step = max(3 * flops / rate, 3 * selected * 3 * H * I * 2 / HBM) * 1e6
    row = {"tokens": M, **t,
           "ours_bwd": t["ours_step"] - t["ours_fwd"], "torch_bwd": t["torch_step"] - t["torch_fwd"],
           "floor_step_us": floor_step,
           "saved_bytes_ours": saved_bytes(ours_fwd, ours_in[1:3]),
           "saved_bytes_torch": saved_bytes(ref_fwd, ref_in[1:3]),
           "grad_rel_diff": diffs}
    row["step_speedup"] = t["torch_step"] / t["ours_step"]
    row["bwd_speedup"] = row["torch_bwd"] / row["ours_bwd"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    # gpt-oss: its clamped SwiGLU and biases are not in the unfused path here; DeepSeek-V3: two
    # copies of its weights and gradients, and each path's captured gradients, do not fit one H200
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b,mixtral-8x7b")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="print the kernel table of one step of each path")
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    rate = matmul_rate()
    rows, gen = [], torch.Generator(device=DEV).manual_seed(0)
    for model in ns.models.split(","):
        spec = make_spec(model, target="sm_90a")
        for M in [int(t) for t in ns.tokens.split(",")]:
            t0 = time.perf_counter()
            r = point(spec, M, ns.replays, rate, gen, ns.profile)
            r["model"] = model
            rows.append(r)
            print(f"{model:16s} {M:6d} step ours {r['ours_step']:9.1f} torch {r['torch_step']:9.1f} "
                  f"({r['step_speedup']:.2f}x)  bwd ours {r['ours_bwd']:9.1f} torch {r['torch_bwd']:9.1f} "
                  f"({r['bwd_speedup']:.2f}x)  floor {r['floor_step_us']:.0f}  "
                  f"saved {r['saved_bytes_ours'] / 2**20:.0f} / {r['saved_bytes_torch'] / 2**20:.0f} MiB  "
                  f"diff {max(r['grad_rel_diff'].values()):.1e} "
                  f"[{time.perf_counter() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()
            (ns.out / "bench_backward_h200.json").write_text(json.dumps(
                {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
                 "matmul_tflops": rate / 1e12, "command": " ".join(sys.argv), "rows": rows}, indent=1))
    geo = lambda k: math.exp(sum(math.log(r[k]) for r in rows) / len(rows))  # noqa: E731
    lines = [f"# Training step of the fused MoE layer on {torch.cuda.get_device_name()} "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Command: `python3 tools/bench_backward.py {' '.join(sys.argv[1:])}`; bf16 matmul rate {rate / 1e12:.0f} "
             "TFLOP/s. µs, medians of CUDA-graph replays; torch = autograd through the unfused path.", "",
             "| model | tokens | fwd+bwd ours | fwd+bwd torch | torch/ours | bwd ours | bwd torch | torch/ours "
             "| step floor | step ours/floor | activations saved MiB ours / torch | grad diff |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['ours_step']:.0f} | {r['torch_step']:.0f} | "
                     f"{r['step_speedup']:.2f} | {r['ours_bwd']:.0f} | {r['torch_bwd']:.0f} | {r['bwd_speedup']:.2f} | "
                     f"{r['floor_step_us']:.0f} | {r['ours_step'] / r['floor_step_us']:.2f} | "
                     f"{r['saved_bytes_ours'] / 2**20:.0f} / {r['saved_bytes_torch'] / 2**20:.0f} | "
                     f"{max(r['grad_rel_diff'].values()):.1e} |")
    lines += ["", f"Geometric means: fwd+bwd torch/ours {geo('step_speedup'):.2f}, backward torch/ours "
              f"{geo('bwd_speedup'):.2f}."]
    (ns.out / "bench_backward_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main()

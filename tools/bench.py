#!/usr/bin/env python3
"""Benchmark of the whole fused MoE layer on the GPU (not a test).

For every model × token count of the benchmark matrix: our layer (routing included) replayed from
CUDA graphs, the unfused PyTorch path (permutation + torch._grouped_mm + SiLU·up + torch._grouped_mm
+ routing-weight multiply + index_add_) replayed the same way, and the roofline floor
max(FLOPs / bf16 matmul rate measured in this run, bytes / 4.8 TB/s). Several input sets with
different routings are replayed in turn so that consecutive replays do not find the previous
one's experts in L2; every row is checked against the fp32 reference.

    python3 tools/bench.py --out DIR [--models a,b] [--tokens 1,16,...] [--replays 100] [--pdl]

--pdl also checks and times, at every point and in the same run, the twin of our variant with
programmatic dependent launch flipped (build the database with `moe-aot build --pdl-twins`).

Writes DIR/bench_h200.json and DIR/bench_h200.md.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.runtime.layer import MoeLayer  # noqa: E402
from moe_aot.runtime.measure import graph_times_us, input_sets, measure_variant  # noqa: E402
from moe_aot.runtime.reference import moe_reference, rel_err, split_gate_up  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.runtime.verify import random_weights  # noqa: E402
from moe_aot.spec import BENCH_TOKENS, PRESETS, make_spec  # noqa: E402

HBM_BYTES_PER_S = 4.8e12


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return 2 * 8192 ** 3 / statistics.median(times)


def torch_unfused(x, w_gate_up_t, w2_t, tw, ids, experts):
    """The unfused PyTorch path most model code runs (grouped GEMMs from torch itself)."""
    M, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.zeros(experts, device=x.device, dtype=torch.int64)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))  # bincount would sync
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = x[tok]
    gu = torch._grouped_mm(a, w_gate_up_t, offs=offs)
    g, u = gu.chunk(2, dim=-1)
    h = torch.nn.functional.silu(g) * u
    y = torch._grouped_mm(h, w2_t, offs=offs)
    y = y * tw.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros(M, x.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y.float())
    return out.to(torch.bfloat16)


def graph_time_us(fns, replays: int) -> float:
    return statistics.median(graph_times_us(fns, replays))


def bench_model(name: str, tokens_list, replays: int, rate: float, store, pdl: bool = False) -> list[dict]:
    spec = make_spec(name, target="sm_90a")
    layer = MoeLayer(spec, store)
    dev = layer.device
    w13, w2 = random_weights(spec, dev)
    gate, up = split_gate_up(w13)
    w_gu_t = torch.cat([gate, up], dim=1).transpose(1, 2)  # [E, H, 2I] view of an [E, 2I, H] tensor
    w2_t = w2.transpose(1, 2)  # [E, I, H]
    rows = []
    for M in tokens_list:
        sets = input_sets(spec, M, dev)
        layer.workspace(M)
        # correctness of this very configuration, on the first set, poisoned output
        x, tw, ids, out = sets[0]
        out.fill_(float("nan"))
        layer.forward(x, w13, w2, tw, ids, out=out)
        ref = moe_reference(x, w13, w2, tw, ids, spec.activation)
        err = rel_err(out, ref)
        t_err = rel_err(torch_unfused(x, w_gu_t, w2_t, tw, ids, spec.experts), ref)
        del ref
        ours = graph_time_us([lambda s=s: layer.forward(s[0], w13, w2, s[1], s[2], out=s[3],
                                                        workspace=layer.workspace(M)) for s in sets], replays)
        theirs = graph_time_us([lambda s=s: torch_unfused(s[0], w_gu_t, w2_t, s[1], s[2], spec.experts)
                                for s in sets], replays)
        selected = statistics.mean(int(torch.unique(s[2]).numel()) for s in sets)
        flops = 6 * M * spec.top_k * spec.hidden * spec.intermediate
        bytes_ = selected * 3 * spec.hidden * spec.intermediate * 2 + 2 * M * spec.hidden * 2
        floor = max(flops / rate, bytes_ / HBM_BYTES_PER_S) * 1e6
        row = {"model": name, "tokens": M, "ours_us": round(ours, 2), "floor_us": round(floor, 2),
               "torch_us": round(theirs, 2), "rel_err": err, "torch_rel_err": t_err,
               "ours_over_floor": round(ours / floor, 3), "torch_over_ours": round(theirs / ours, 3),
               "variant": layer.variant_for(M).name(spec), "experts_selected": selected}
        if pdl:
            twin = layer.variant_for(M).pdl_twin()
            row["twin_variant"] = twin.name(spec)
            try:
                m = measure_variant(layer, twin, M, w13, w2, replays, sets)
                row.update(twin_rel_err=m["rel_err"], twin_us=round(m["median_us"], 2) if m["ok"] else None,
                           twin_over_ours=round(m["median_us"] / ours, 3) if m["ok"] else None)
            except Exception as exc:  # kernels not in the database, launch failure: reported
                row["twin_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"  twin {row['twin_variant']}: {row.get('twin_us')} us, rel err {row.get('twin_rel_err')}"
                  f"{', ' + row['twin_error'] if 'twin_error' in row else ''}", flush=True)
        rows.append(row)
        print(f"{name:16} M={M:6} ours {ours:9.1f} us  floor {floor:9.1f}  torch {theirs:9.1f}  "
              f"ours/floor {ours / floor:5.2f}  torch/ours {theirs / ours:5.2f}  err {err:.1e}", flush=True)
    del w13, w2, layer
    torch.cuda.empty_cache()
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Fused MoE layer on {result['device']} ({result['date']})", "",
             f"Command: `{result['command']}`; bf16 matmul rate measured in the run: "
             f"{result['matmul_tflops']:.0f} TFLOP/s; HBM 4.8 TB/s. Times are medians of CUDA-graph replays "
             "(µs); ratios below 1 in `torch/ours` mean PyTorch was faster.", "",
             "| model | tokens | ours µs | floor µs | ours/floor | torch µs | torch/ours | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    twins = any("twin_variant" in r for r in result["rows"])
    if twins:
        lines[-2] += " PDL-flipped twin µs | twin/ours | twin rel err |"
        lines[-1] += "---|---|---|"
    for r in result["rows"]:
        line = (f"| {r['model']} | {r['tokens']} | {r['ours_us']:.1f} | {r['floor_us']:.1f} | "
                f"{r['ours_over_floor']:.2f} | {r['torch_us']:.1f} | {r['torch_over_ours']:.2f} | {r['rel_err']:.1e} |")
        if twins:
            ok = r.get("twin_us") is not None
            err = r.get("twin_rel_err")
            line += (f" {r['twin_us']:.1f} | {r['twin_over_ours']:.3f} |" if ok else
                     f" {r.get('twin_error', 'wrong result')[:60]} | - |") + (f" {err:.1e} |" if err is not None else " - |")
        lines.append(line)
    g = result["summary"]
    lines += ["", f"Geometric mean ours/floor {g['geomean_ours_over_floor']:.2f}; "
              f"geometric mean torch/ours {g['geomean_torch_over_ours']:.2f}; max rel err {g['max_rel_err']:.1e}."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--models", default=",".join(PRESETS))
    ap.add_argument("--tokens", default=",".join(map(str, BENCH_TOKENS)))
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--pdl", action="store_true", help="also time each point's twin with PDL flipped")
    ns = ap.parse_args()
    torch.manual_seed(0)
    store = KernelStore()
    rate = matmul_rate()
    print(f"bf16 8192^3 matmul: {rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    t0 = time.time()
    for name in ns.models.split(","):
        rows += bench_model(name, [int(t) for t in ns.tokens.split(",")], ns.replays, rate, store, ns.pdl)
    geo = lambda xs: math.exp(statistics.mean(math.log(v) for v in xs))  # noqa: E731
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
        "command": "python3 tools/bench.py " + " ".join(sys.argv[1:]), "matmul_tflops": rate / 1e12,
        "hbm_tbps": HBM_BYTES_PER_S / 1e12, "seconds": round(time.time() - t0, 1), "rows": rows,
        "summary": {"geomean_ours_over_floor": geo([r["ours_over_floor"] for r in rows]),
                    "geomean_torch_over_ours": geo([r["torch_over_ours"] for r in rows]),
                    "max_rel_err": max(r["rel_err"] for r in rows)},
    }
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_h200.json").write_text(json.dumps(result, indent=1))
    (out / "bench_h200.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

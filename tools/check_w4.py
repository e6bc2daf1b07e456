#!/usr/bin/env python3
"""The weight-only MXFP4 layer ("mxfp4-w", gpt-oss's expert weights as shipped) on the GPU:
correctness against the dequantizing fp32 reference, then its speed beside our bf16 layer on the
same weights dequantized to bf16 (not a test).

On the CPU machine, build the database (the mxfp4-w kernels of harness/w4.CHECK_LAYERS and the
bf16 gpt-oss-120b layer for the comparison, every bucket the checks and timings use):

    python3 tools/check_w4.py --build --db sqlite:///cache/w4.sqlite

On the GPU machine (the runtime only, no DSL):

    python3 tools/check_w4.py --db sqlite:///cache/w4.sqlite --out DIR [--replays 100] [--skip-check]

Correctness: for each layer of CHECK_LAYERS at CHECK_TOKENS (1, 16, 37, 256, 1000) and uniform /
skewed routings, harness.verify.check_stages: routing exact, GEMM1 + GLU and the whole layer
against the fp32 reference of the dequantized weights, every row, outputs NaN-poisoned. Speed: for
gpt-oss-120b at 1, 16, 64, 256, 1024 tokens, the whole layer (routing included) replayed from
CUDA graphs (tools/bench.py graph_time_us), mxfp4-w and bf16 on the same input sets; reported
with the weight bytes of the experts the routing selects (mxfp4-w: packed weights and scales and
the bf16 biases; bf16: bf16 weights and biases) per µs as TB/s, and bf16 µs / mxfp4-w µs.
Writes DIR/check_w4.json and DIR/check_w4.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH_TOKENS = (1, 16, 64, 256, 1024)
BUILD_TOKENS = "1,16,64,256,1024"  # the buckets of CHECK_TOKENS (37 -> 64, 1000 -> 1024) and BENCH_TOKENS


def build(db_url: str, jobs: int | None) -> None:
    """Compile the default variant of every bucket for the mxfp4-w check layers and bf16 gpt-oss-120b."""
    from moe_aot.compiler import compile_into
    from moe_aot.database import Database
    from moe_aot.harness.w4 import CHECK_LAYERS
    from moe_aot.spec import make_spec
    from moe_aot.variants import default_variant

    specs = [make_spec(target="sm_90a", **f) for f in CHECK_LAYERS] + [make_spec("gpt-oss-120b", target="sm_90a")]
    pairs = [(s, default_variant(s, t)) for s in specs for t in map(int, BUILD_TOKENS.split(","))]
    db = Database(db_url)
    try:
        results = compile_into(db, pairs, jobs=jobs, progress=lambda r, d, n: print(
            f"[{d}/{n}] {'ok' if r.artifact else 'FAILED'} {r.seconds:5.1f}s {r.kernel.name}"
            + ("" if r.artifact else f": {r.error[:300]}"), flush=True))
    finally:
        db.close()
    failed = [r for r in results if r.artifact is None]
    print(f"{len(results) - len(failed)} compiled, {len(failed)} failed")
    if failed:
        sys.exit(1)


def check(store) -> list[dict]:
    import torch

    from moe_aot.harness import w4 as w4_ref
    from moe_aot.harness.verify import check_stages, random_routing
    from moe_aot.runtime.layer import MoeLayer
    from moe_aot.spec import make_spec

    rows = []
    for fields in w4_ref.CHECK_LAYERS:
        spec = make_spec(target="sm_90a", **fields)
        layer = MoeLayer(spec, store)
        w13, w2 = w4_ref.random_w4_weights(spec, layer.device)
        for tokens in w4_ref.CHECK_TOKENS:
            for routing in ("uniform", "skewed"):
                x = torch.randn(tokens, spec.hidden, device=layer.device, dtype=torch.bfloat16)
                tw, ids = random_routing(tokens, spec, layer.device, skew=routing == "skewed")
                for row in check_stages(layer, x, w13, w2, tw, ids):
                    row.update(layer=spec.label(), tokens=tokens, routing=routing)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def bench(store, replays: int) -> list[dict]:
    import torch
    from bench import WARMUP_S, graph_time_us

    from moe_aot.harness import w4 as w4_ref
    from moe_aot.harness.measure import input_sets
    from moe_aot.harness.reference import rel_err
    from moe_aot.runtime.layer import MoeLayer
    from moe_aot.spec import make_spec

    spec = make_spec("gpt-oss-120b", precision="mxfp4-w", target="sm_90a")
    bf16_spec = make_spec("gpt-oss-120b", target="sm_90a")
    layer, bf16_layer = MoeLayer(spec, store), MoeLayer(bf16_spec, store)
    w13, w2 = w4_ref.random_w4_weights(spec, layer.device)
    # the same weights as bf16 (exact: every dequantized weight is a bf16 number), interleaved alike
    b13w = (w4_ref.dequantized(w13).to(torch.bfloat16), w13.bias)
    b2w = (w4_ref.dequantized(w2).to(torch.bfloat16), w2.bias)
    H, I = spec.hidden, spec.intermediate
    w4_bytes = 2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32 + (2 * I + H) * 2  # per expert
    bf16_bytes = 3 * I * H * 2 + (2 * I + H) * 2
    rows = []
    for tokens in BENCH_TOKENS:
        sets = input_sets(spec, tokens, layer.device)
        selected = sum(int(torch.unique(ids).numel()) for _, _, ids, _ in sets) / len(sets)
        times = {}
        for name, lyr, a, b in (("mxfp4-w", layer, w13, w2), ("bf16", bf16_layer, b13w, b2w)):
            for x, tw, ids, out in sets:  # first calls: load, check, build the cached plans
                lyr.forward(x, a, b, tw, ids, out=out)
            fns = [lambda lyr=lyr, s=s, a=a, b=b: lyr.forward(s[0], a, b, s[1], s[2], out=s[3],
                                                              workspace=lyr.workspace(tokens)) for s in sets]
            times[name] = graph_time_us(fns, replays, WARMUP_S)  # one forward per replay
        x, tw, ids, out = sets[0]
        ref = w4_ref.moe_w4_reference(x, w13, w2, tw, ids, spec.activation)
        e_w4 = rel_err(layer.forward(x, w13, w2, tw, ids), ref)
        e_bf16 = rel_err(bf16_layer.forward(x, b13w, b2w, tw, ids), ref)
        row = {"tokens": tokens, "selected_experts": selected,
               "mxfp4w_us": round(times["mxfp4-w"], 2), "bf16_us": round(times["bf16"], 2),
               "speedup": round(times["bf16"] / times["mxfp4-w"], 3),
               "mxfp4w_weight_tbps": round(selected * w4_bytes / times["mxfp4-w"] / 1e6, 3),
               "bf16_weight_tbps": round(selected * bf16_bytes / times["bf16"] / 1e6, 3),
               "mxfp4w_rel_err": e_w4, "bf16_rel_err": e_bf16,
               "mxfp4w_variant": layer.variant_for(tokens).name(spec),
               "bf16_variant": bf16_layer.variant_for(tokens).name(bf16_spec)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(check_rows, bench_rows, device: str) -> str:
    lines = [f"# mxfp4-w (weight-only MXFP4) on {device}", ""]
    if check_rows:
        bad = [r for r in check_rows if not r["ok"]]
        worst = max((r.get("row_rel_err", 0.0) for r in check_rows if r["stage"] != "routing"), default=0.0)
        lines += [f"Correctness: {len(check_rows) - len(bad)} / {len(check_rows)} stage checks pass "
                  f"(worst row rel err {worst:.2e}).", ""]
        lines += [f"- FAIL {r['layer']} tokens={r['tokens']} {r['routing']} {r['stage']}: {r}" for r in bad]
        lines.append("")
    if bench_rows:
        lines += ["gpt-oss-120b, whole layer from CUDA graphs (µs per forward), weights of the selected experts "
                  "per µs:", "",
                  "| tokens | experts | mxfp4-w µs | bf16 µs | bf16 / mxfp4-w | mxfp4-w TB/s | bf16 TB/s | rel err |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in bench_rows:
            lines.append(f"| {r['tokens']} | {r['selected_experts']} | {r['mxfp4w_us']} | {r['bf16_us']} | "
                         f"{r['speedup']} | {r['mxfp4w_weight_tbps']} | {r['bf16_weight_tbps']} | "
                         f"{r['mxfp4w_rel_err']:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, help="SQLAlchemy URL of the kernel database")
    ap.add_argument("--build", action="store_true", help="compile the kernels into --db (CPU machine, needs the DSL)")
    ap.add_argument("--jobs", type=int, default=None, help="--build: parallel compile processes")
    ap.add_argument("--out", default=None, help="folder for check_w4.json and check_w4.md (GPU mode)")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--skip-check", action="store_true", help="time only")
    ap.add_argument("--skip-bench", action="store_true", help="check only")
    args = ap.parse_args()
    if args.build:
        build(args.db, args.jobs)
        return
    import torch

    from moe_aot.runtime.store import KernelStore

    if args.out is None:
        ap.error("--out is required on the GPU (or give --build)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = KernelStore(args.db)
    t0 = time.time()
    check_rows = [] if args.skip_check else check(store)
    bench_rows = [] if args.skip_bench else bench(store, args.replays)
    device = torch.cuda.get_device_name()
    (out / "check_w4.json").write_text(json.dumps({"device": device, "seconds": round(time.time() - t0, 1),
                                                   "check": check_rows, "bench": bench_rows}, indent=1))
    (out / "check_w4.md").write_text(markdown(check_rows, bench_rows, device))
    print(markdown(check_rows, bench_rows, device))
    if any(not r["ok"] for r in check_rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

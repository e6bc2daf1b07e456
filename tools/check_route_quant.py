#!/usr/bin/env python3
"""The fp8 layers' routing launch that also quantizes x (templates/routing.py MoeRoutingQuant)
against the two launches it replaces (MoeRouting, then templates/quant.py QuantizeFp8), side by
side on one GPU.

  --compile DIR          (CPU, needs the DSL) compile both forms for sm_90a into DIR/<name>/
  --run DIR --out OUT    (GPU, torch + moe_aot, no DSL) per model, precision and token count:
                         fresh random x and routing (distinct top-k ids, ~10% of them invalid),
                         outputs poisoned; checks the fused launch's routing buffers against the
                         routing reference exactly and its xq / xs byte for byte against both the
                         separate kernel's and torch's quantization of the same x; then times a
                         CUDA graph of the two launches (A) against one of the fused launch (B), in
                         mirrored rounds (A B B A ...), each round the mean of 50 replays after
                         10 untimed ones; writes OUT/route_quant.json and OUT/route_quant.md

  --layer DIR --out OUT  (GPU; the database of $MOE_AOT_DB holding the fp8 layers' served picks)
                         the whole fp8 layer as served (its pick: routing with x's quantization,
                         GEMM1, GEMM2, combine) against the same pick as it launched before
                         2026-12-04 (the plain routing of the pick's tile_m / cluster / PDL from
                         DIR, then QuantizeFp8, then the same GEMMs and combine): outputs must be
                         bitwise equal; CUDA graphs of both timed in mirrored rounds (each the mean
                         of 20 replays after 10 untimed); writes OUT/layer_ab.json and .md

The routing of --run runs in a 1-CTA cluster up to 256 tokens and a 16-CTA one above, as the
layer's defaults do; tile_m 128. --compile also compiles the plain routings --layer may need
(tile_m 16 / 64 / 128, cluster 1 / 16, with and without PDL).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (name, E, top_k, H): the fp8-capable presets (H a multiple of 128)
MODELS = [("qwen3_30b_a3b", 128, 8, 2048), ("qwen3_235b", 128, 8, 4096), ("deepseek_v3", 256, 8, 7168),
          ("mixtral_8x7b", 8, 2, 4096)]
PRECISIONS = ("fp8", "fp8-block128")
TOKENS = (1, 16, 256, 1024, 4096, 16384)
TILE_M = 128
ROUNDS = 3  # mirrored: 2 * ROUNDS timings of each form


def cluster_for(tokens: int) -> int:
    return 1 if tokens <= 256 else 16


def route_name(e, k, tm, c, pdl=False):
    return f"route_e{e}k{k}_m{tm}_c{c}{'_pdl' if pdl else ''}"


def names(model, e, k, h, prec, c):
    p = prec.replace("-", "")
    return {"route": route_name(e, k, TILE_M, c), "quant": f"quant_{p}_h{h}", "fused": f"routeq_{model}_{p}_c{c}"}


def do_compile(out_dir: Path, arch: str) -> None:
    from moe_aot_templates.quant import QuantizeFp8
    from moe_aot_templates.routing import MoeRouting, MoeRoutingQuant

    from moe_aot.kernel_build import compile_kernel

    jobs = {}
    for model, e, k, h in MODELS:
        for prec in PRECISIONS:
            for c in sorted({cluster_for(t) for t in TOKENS}):
                n = names(model, e, k, h, prec, c)
                jobs[n["route"]] = MoeRouting(e, k, TILE_M, cluster_size=c)
                jobs[n["quant"]] = QuantizeFp8(h, prec)
                jobs[n["fused"]] = MoeRoutingQuant(e, k, TILE_M, quant=(h, prec), cluster_size=c)
        for tm in (16, 64, 128):  # the plain routings of the layer A/B
            for c in (1, 16):
                for pdl in (False, True):
                    jobs[route_name(e, k, tm, c, pdl)] = MoeRouting(e, k, tm, cluster_size=c, pdl=pdl)
    for name, obj in jobs.items():
        t0 = time.perf_counter()
        art = compile_kernel(obj, arch, name)
        art.write_dir(out_dir / name)
        for ptx in (out_dir / name).glob("*.ptx"):
            ptx.unlink()  # kept small for the trip to the GPU machine
        print(f"{name:36s} {time.perf_counter() - t0:5.1f}s", flush=True)


def do_run(lib_dir: Path, out_dir: Path, tokens, models) -> int:
    import torch

    from moe_aot.harness import fp8 as fp8_ref
    from moe_aot.harness.reference import routing_reference
    from moe_aot.layout import max_tiles
    from moe_aot.runtime.library import KernelLibrary

    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(time.time()))
    libs = {}

    def lib(name):
        if name not in libs:
            libs[name] = KernelLibrary.from_dir(lib_dir / name)
        return libs[name]

    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
           "command": " ".join(sys.argv), "rows": [], "failures": []}
    lines = []

    def say(msg):
        print(msg, flush=True)
        lines.append(msg)

    for model, e, k, h in MODELS:
        if models and model not in models:
            continue
        for prec in PRECISIONS:
            blk = 128 if prec == "fp8-block128" else None
            for m in tokens:
                n = names(model, e, k, h, prec, cluster_for(m))
                route, quant, fused = lib(n["route"]), lib(n["quant"]), lib(n["fused"])
                x = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=gen) * 3
                ids = torch.rand(m, e, device=dev, generator=gen).argsort(dim=1)[:, :k].int()
                bad = torch.rand(m, k, device=dev, generator=gen) < 0.1
                ids = torch.where(bad, torch.full_like(ids, -1), ids).contiguous()
                t = max_tiles(m, k, e, TILE_M)

                def bufs():
                    i32 = dict(device=dev, dtype=torch.int32)
                    return [torch.full((e,), 0x7FFFFFFF, **i32), torch.full((e + 1,), 0x7FFFFFFF, **i32),
                            torch.full((t * TILE_M,), 0x7FFFFFFF, **i32), torch.full((t,), 0x7FFFFFFF, **i32),
                            torch.full((m, h), 0x7F, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
                            torch.full((m,) if blk is None else (m, h // blk), float("nan"), device=dev)]

                a, b = bufs(), bufs()  # A: two launches; B: the fused one
                route(ids, *a[:4])
                quant(x, *a[4:])
                fused(ids, *b[:4], x, *b[4:])
                ref = routing_reference(ids, e, TILE_M, t)
                q_ref, s_ref = fp8_ref.quantize_x(x, prec)
                u8 = torch.uint8
                checks = {
                    "routing_exact": all(torch.equal(g, r) for g, r in zip(b[:4], ref)),
                    "xq_equals_separate": torch.equal(b[4].view(u8), a[4].view(u8)) and torch.equal(b[5], a[5]),
                    "xq_equals_torch": torch.equal(b[4].view(u8), q_ref.view(u8)) and torch.equal(b[5], s_ref),
                }
                ok = checks["routing_exact"] and checks["xq_equals_separate"]

                def two():
                    route(ids, *a[:4])
                    quant(x, *a[4:])

                def one():
                    fused(ids, *b[:4], x, *b[4:])

                med, times = mirrored_us({"A": graph_of(two), "B": graph_of(one)}, ROUNDS, 50)
                row = {"model": model, "precision": prec, "tokens": m, "cluster": cluster_for(m), **checks,
                       "two_launches_us": round(med["A"], 2), "fused_us": round(med["B"], 2),
                       "fused_over_two": round(med["B"] / med["A"], 3), "rounds_us": times}
                res["rows"].append(row)
                if not ok:
                    res["failures"].append(f"{model} {prec} {m}: {checks}")
                say(f"{'ok  ' if ok else 'FAIL'} {model:14s} {prec:13s} {m:6d} c{cluster_for(m):<2d} "
                    f"two launches {med['A']:7.2f} us  fused {med['B']:7.2f} us  ({med['B'] / med['A']:.3f})  "
                    f"{checks}")
    write_results(out_dir / "route_quant", res, "Routing + x quantization: one launch against two",
                  f"Medians of {2 * ROUNDS} mirrored rounds, each the mean of 50 CUDA-graph replays (µs).",
                  {"model": "model", "precision": "precision", "tokens": "tokens", "cluster": "cluster",
                   "two launches": "two_launches_us", "fused": "fused_us", "fused / two": "fused_over_two",
                   "xq = separate": "xq_equals_separate", "xq = torch": "xq_equals_torch"})
    say(f"{len(res['rows'])} rows, {len(res['failures'])} failures")
    return 1 if res["failures"] else 0


def write_results(stem: Path, res: dict, title: str, note: str, columns: dict) -> None:
    """stem.json (everything) and stem.md: a table of res["rows"], one column per (header, key)."""
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = [f"# {title} ({res['device']}, {res['date']})", "", f"Command: `{res['command']}`. {note}", "",
          "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(str(r[k]) for k in columns.values()) + " |" for r in res["rows"]]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")


def graph_of(fn):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    return g


def mirrored_us(graphs: dict, rounds: int, replays: int, warm: int = 10) -> dict:
    """Per form (A, B), the median over 2 * rounds mirrored rounds of the mean µs of `replays`
    graph replays (after `warm` untimed ones), and every round's value."""
    import torch

    times = {f: [] for f in graphs}
    for form in ["A", "B", "B", "A"] * rounds:
        g = graphs[form]
        for _ in range(warm):
            g.replay()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(replays):
            g.replay()
        t1.record()
        t1.synchronize()
        times[form].append(t0.elapsed_time(t1) * 1e3 / replays)
    return {f: sorted(v)[len(v) // 2] for f, v in times.items()}, times


def do_layer(lib_dir: Path, out_dir: Path, tokens, models) -> int:
    """The served fp8 layer against the same pick launched as before (module docstring)."""
    import torch

    from moe_aot.harness.verify import random_routing, random_weights
    from moe_aot.layout import max_tiles
    from moe_aot.runtime.layer import MoeLayer
    from moe_aot.runtime.library import KernelLibrary
    from moe_aot.runtime.store import KernelStore
    from moe_aot.spec import make_spec

    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    store = KernelStore()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
           "command": " ".join(sys.argv), "rows": [], "failures": []}
    presets = {"qwen3_30b_a3b": "qwen3-30b-a3b", "qwen3_235b": "qwen3-235b-a22b", "deepseek_v3": "deepseek-v3",
               "mixtral_8x7b": "mixtral-8x7b"}
    for model, e, k, h in MODELS:
        if models and model not in models:
            continue
        for prec in PRECISIONS:
            layer = MoeLayer(make_spec(presets[model], precision=prec, target="sm_90a"), store)
            spec = layer.spec
            w13, w2 = random_weights(spec, dev)
            quant = KernelLibrary.from_dir(lib_dir / f"quant_{prec.replace('-', '')}_h{h}")
            for m in tokens:
                x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
                tw, ids = random_routing(m, spec, dev)
                v, libs = layer.role_kernels(m)
                ws = layer.workspace(m)
                route = KernelLibrary.from_dir(lib_dir / route_name(e, k, v.tile_m, v.route_cluster, v.pdl))
                t = max_tiles(m, k, e, v.tile_m)
                r = t * v.tile_m
                si, te = ws.sorted_ids[:r], ws.tile_expert[:t]
                xq, xs, hq, hs, y = ws.xq[:m], ws.xs[:m], ws.hq[:r], ws.h_scales(r, v.h_block), ws.y[: m * k]
                out_a, out_b = (torch.full((m, h), float("nan"), device=dev, dtype=torch.bfloat16) for _ in "ab")

                def old():  # as _forward_fp8 launched the pick before 2026-12-04
                    route(ids, ws.counts, ws.offsets, si, te)
                    quant(x, xq, xs)
                    libs["glu"](xq, xs, w13[0], w13[1], si, te, hq, hs)
                    libs["down"](hq, hs, w2[0], w2[1], si, te, tw, y)
                    libs["combine"](y, ids, out_a)

                def new():
                    layer.forward(x, w13, w2, tw, ids, out=out_b, workspace=ws)

                old()
                new()
                torch.cuda.synchronize()
                same = bool(torch.equal(out_a, out_b)) and not bool(out_b.isnan().any())
                med, times = mirrored_us({"A": graph_of(old), "B": graph_of(new)}, ROUNDS, 20)
                row = {"model": model, "precision": prec, "tokens": m, "variant": v.name(spec), "outputs_equal": same,
                       "before_us": round(med["A"], 2), "now_us": round(med["B"], 2),
                       "now_over_before": round(med["B"] / med["A"], 4), "rounds_us": times}
                res["rows"].append(row)
                if not same:
                    res["failures"].append(f"{model} {prec} {m}: outputs differ")
                print(f"{'ok  ' if same else 'FAIL'} {model:14s} {prec:13s} {m:6d} before {med['A']:9.2f} us  now "
                      f"{med['B']:9.2f} us  ({med['B'] / med['A']:.4f})  {v.name(spec)[-60:]}", flush=True)
            w13 = w2 = None  # freed before the next precision's weights
            torch.cuda.empty_cache()
    write_results(out_dir / "layer_ab", res,
                  "The fp8 layer: routing with x's quantization against routing then quantization",
                  f"The served pick both ways, same inputs; medians of {2 * ROUNDS} mirrored rounds, each the "
                  "mean of 20 CUDA-graph replays (µs).",
                  {"model": "model", "precision": "precision", "tokens": "tokens", "before (5 launches)": "before_us",
                   "now (4)": "now_us", "now / before": "now_over_before", "outputs equal": "outputs_equal"})
    print(f"{len(res['rows'])} rows, {len(res['failures'])} failures")
    return 1 if res["failures"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", type=Path)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--run", type=Path)
    ap.add_argument("--layer", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--models", default="", help="comma-separated subset of " + ", ".join(m[0] for m in MODELS))
    a = ap.parse_args()
    if a.compile:
        do_compile(a.compile, a.arch)
        return 0
    if a.layer and a.out:
        return do_layer(a.layer, a.out, [int(t) for t in a.tokens.split(",")], [m for m in a.models.split(",") if m])
    if a.run and a.out:
        return do_run(a.run, a.out, [int(t) for t in a.tokens.split(",")], [m for m in a.models.split(",") if m])
    ap.error("give --compile DIR, or --run DIR --out OUT, or --layer DIR --out OUT")
    return 2


if __name__ == "__main__":
    sys.exit(main())

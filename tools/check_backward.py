#!/usr/bin/env python3
"""The backward's data GEMMs (templates/hopper_bwd.py) on the GPU, kernel by kernel (not a test):
correctness of every routed row against an fp32 reference, and time beside torch's grouped GEMMs
on the same products, for several tile choices side by side.

    # CPU machine: compile the tile choices into a database to carry
    python3 tools/check_backward.py --compile --db sqlite:///.device/bwd.sqlite [--models ...] [--tiles ...]
    # GPU machine (no DSL needed)
    python3 tools/check_backward.py --db sqlite:///.device/bwd.sqlite --out DIR [--models ...] [--tokens 4096,16384]

Per model, token count, routing tile height (``--tile-m``: 64 and/or 128, the same on both
machines) and tile choice (``--tiles``: dH/dX tiles as NxSTAGES+MMA, e.g. 128s4hopws):
- dH: da, w h and dw of every routed row within 1e-2 (per row) of the GLU's backward in fp32 on
  G = dO_m W2_e in fp32, padding rows exactly zero;
- dX: every routed row within 1e-2 of da_r W13_e in fp32 on the kernel's own da;
- the time of each kernel alone (CUDA-graph replays, medians) as useful TFLOP/s (2 P H I for dH,
  4 P H I for dX),
  beside torch._grouped_mm doing the same product on rows sorted by expert (no GLU, no gather).
Writes DIR/check_backward.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = "qwen3-30b-a3b,qwen3-235b-a22b,gpt-oss-120b,deepseek-v3,mixtral-8x7b"
TILES = "128s4hopws,256s4hopws,128s5hoppp"
TOL = 1e-2


def parse_tiles(text: str):
    """'128s4hopws' -> GemmTiles(128, 64, 4, 'hopws')."""
    import re

    from moe_aot.variants import GemmTiles

    m = re.fullmatch(r"(\d+)s(\d+)(\w+)", text)
    if not m:
        raise SystemExit(f"--tiles entry {text!r} must look like 128s4hopws (tile_n, stages, mma)")
    return GemmTiles(int(m[1]), 64, int(m[2]), m[3])


def choices(spec, tiles: str, tile_m: int):
    """The valid (dH, dX) tile pairs of --tiles for this layer at this routing tile height (a tile
    that is not valid there is replaced by the first valid, variants.backward_gemm_tiles)."""
    from moe_aot import gemm_limits as limits
    from moe_aot.variants import backward_gemm_tiles

    default = backward_gemm_tiles(spec, tile_m)
    if default is None:
        return []
    out = []
    for t in tiles.split(","):
        t = parse_tiles(t)
        pair = []
        for d, (n, k) in zip(default, ((spec.intermediate, spec.hidden), (spec.hidden, 2 * spec.intermediate))):
            ok = limits.check_backward_gemm(n, k, tile_m, t.tile_n, 64, t.stages, t.mma, "sm_90a")[0]
            pair.append(t if ok else d)
        if tuple(pair) not in out:
            out.append(tuple(pair))
    return out


def tile_ms(text: str) -> list[int]:
    """--tile-m '64,128' -> [64, 128], each a height the backward is built for."""
    from moe_aot import gemm_limits as limits

    out = [int(m) for m in text.split(",")]
    for m in out:
        ok, why = limits.check_backward_tile_m(m)
        if not ok:
            raise SystemExit(f"--tile-m: {why}")
    return out


def compile_db(ns) -> None:
    from moe_aot.compiler import compile_into
    from moe_aot.database import Database
    from moe_aot.spec import make_spec
    from moe_aot.variants import backward_gemm_kernels

    extra = []
    for model in ns.models.split(","):
        spec = make_spec(model, target="sm_90a")
        for m in tile_ms(ns.tile_m):
            for dh, dx in choices(spec, ns.tiles, m):
                extra += [(spec, kv) for kv in backward_gemm_kernels(spec, dh, dx, m) if (spec, kv) not in extra]

    def progress(res, done, total):
        print(f"[{done}/{total}] {'ok' if res.artifact else 'FAILED'} {res.seconds:6.1f}s  {res.kernel.name}"
              + ("" if res.artifact else f": {res.error}"), flush=True)

    with Database(ns.db) as db:
        results = compile_into(db, [], jobs=ns.jobs, progress=progress, extra=extra)
    if any(r.artifact is None for r in results):
        raise SystemExit("some kernels failed to compile")


def run(ns) -> None:
    import torch
    from bench import graph_time_us

    from moe_aot.glu import glu_fn
    from moe_aot.harness.reference import row_rel_err
    from moe_aot.harness.verify import random_routing
    from moe_aot.integrations.autograd import preact_torch, route
    from moe_aot.layout import max_tiles
    from moe_aot.runtime.layer import backward_gemms
    from moe_aot.runtime.store import KernelStore
    from moe_aot.spec import make_spec
    from moe_aot.variants import INTERLEAVE

    dev = torch.device("cuda")
    store = KernelStore(ns.db)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    ns.out.mkdir(parents=True, exist_ok=True)
    for model in ns.models.split(","):
        spec = make_spec(model, target="sm_90a")
        E, K, H, I = spec.experts, spec.top_k, spec.hidden, spec.intermediate
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).bfloat16()
        b13 = (torch.randn(E, 2 * I, device=dev, generator=gen) * 0.5).bfloat16() if spec.bias else None
        for M in [int(t) for t in ns.tokens.split(",")]:
            x = torch.randn(M, H, device=dev, generator=gen).bfloat16()
            dout = torch.randn(M, H, device=dev, generator=gen).bfloat16()
            tw, ids = random_routing(M, spec, dev, generator=gen)
            ids = ids.to(torch.int32).contiguous()
            P = M * K
            preact = preact_torch(x, w13, ids, b13)
            # torch's grouped GEMMs on the same products (rows sorted by expert, unpadded)
            order, offs, _, _ = route(ids, E)
            ds = dout.index_select(0, order // K)
            a_sorted = torch.randn(P, 2 * I, device=dev, generator=gen).bfloat16() * 0.1
            # one eager launch of each product in an NVTX range: `ncu --nvtx --nvtx-include 'regex:prof_.*/'`
            # (gpu_run.py --profile-backward) profiles these and none of the timed replays
            with torch.cuda.nvtx.range(f"prof_torch_dh_{model}_{M}"):
                torch._grouped_mm(ds, w2, offs=offs)
            with torch.cuda.nvtx.range(f"prof_torch_dx_{model}_{M}"):
                torch._grouped_mm(a_sorted, w13, offs=offs)
            t_torch_dh = graph_time_us([lambda a=ds: torch._grouped_mm(a, w2, offs=offs)], ns.replays)
            t_torch_dx = graph_time_us([lambda a=a_sorted: torch._grouped_mm(a, w13, offs=offs)], ns.replays)
            del a_sorted
            flops = 2 * P * H * I  # dH; dX's product is twice that (K = 2I)
            for tm, dh_t, dx_t in [(m, *pair) for m in tile_ms(ns.tile_m) for pair in choices(spec, ns.tiles, m)]:
                kern = backward_gemms(E, K, H, I, spec.activation, spec.bias, dev, store, (dh_t, dx_t), tm)
                row = {"model": model, "tokens": M, "tile_m": tm, "dh": dh_t.tag, "dx": dx_t.tag}
                if kern is None:
                    row["error"] = "kernels not in the database"
                    rows.append(row)
                    continue
                T = max_tiles(M, K, E, kern.tile_m)
                R = T * kern.tile_m
                i32 = dict(dtype=torch.int32, device=dev)
                counts, offsets = torch.empty(E, **i32), torch.empty(E + 1, **i32)
                sorted_ids, tile_expert = torch.empty(R, **i32), torch.empty(T, **i32)
                kern.routing(ids, counts, offsets, sorted_ids, tile_expert)
                nan = float("nan")
                da = torch.full((R, 2 * I), nan, dtype=torch.bfloat16, device=dev)
                hw = torch.full((R, I), nan, dtype=torch.bfloat16, device=dev)
                dwp = torch.full((R, I // kern.dh_tile_n), nan, device=dev)
                y = torch.full((P, H), nan, dtype=torch.bfloat16, device=dev)
                ones = torch.ones_like(tw)
                tag = f"{model}_{M}_m{tm}_{dh_t.tag}_{dx_t.tag}"
                with torch.cuda.nvtx.range(f"prof_dh_{tag}"):
                    kern.dh(dout, w2, sorted_ids, tile_expert, tw, preact, da, hw, dwp)
                with torch.cuda.nvtx.range(f"prof_dx_{tag}"):
                    kern.dx(da, w13, sorted_ids, tile_expert, ones, y)
                torch.cuda.synchronize()
                # the reference, on the rows of the used tiles
                used = int(offsets[E])
                pair = sorted_ids[:used].long()
                valid = pair >= 0
                vp = pair[valid]
                rexp = tile_expert[:used // kern.tile_m].repeat_interleave(kern.tile_m)[valid].long()
                G = torch.empty(vp.numel(), I, device=dev)
                dX = torch.empty(vp.numel(), H, device=dev)
                rows_valid = torch.nonzero(valid).squeeze(1)
                for e in range(E):
                    sel = torch.nonzero(rexp == e).squeeze(1)
                    if sel.numel():
                        G[sel] = dout.index_select(0, vp[sel] // K).float() @ w2[e].float()
                        dX[sel] = da.index_select(0, rows_valid[sel]).float() @ w13[e].float()
                a = preact.index_select(0, vp).float().view(-1, I // INTERLEAVE, 2, INTERLEAVE)
                g = a[:, :, 0].reshape(-1, I).requires_grad_()
                u = a[:, :, 1].reshape(-1, I).requires_grad_()
                h = glu_fn(spec.activation)(g, u)
                w = tw.reshape(-1).index_select(0, vp).view(-1, 1)
                dg, du = torch.autograd.grad(h, (g, u), w * G)
                da_ref = torch.stack((dg.view(-1, I // INTERLEAVE, INTERLEAVE),
                                      du.view(-1, I // INTERLEAVE, INTERLEAVE)), 2).reshape(-1, 2 * I)
                dw_ref = (G * h.detach()).sum(1)
                dw = dwp[:used][valid].sum(1)
                row.update({
                    "da_row_err": row_rel_err(da[:used][valid], da_ref),
                    "hw_row_err": row_rel_err(hw[:used][valid], w * h.detach()),
                    "dw_err": ((dw - dw_ref).abs().max() / dw_ref.abs().max()).item(),
                    "padding_zero": bool((da[:used][~valid] == 0).all() and (hw[:used][~valid] == 0).all()
                                         and (dwp[:used][~valid] == 0).all()),
                    "dx_row_err": row_rel_err(y.index_select(0, vp), dX),
                })
                del G, dX, a, g, u, h, dg, du, da_ref
                row["ok"] = (row["padding_zero"] and max(row["da_row_err"], row["hw_row_err"], row["dw_err"],
                                                         row["dx_row_err"]) <= TOL)
                dh_args = (dout, w2, sorted_ids, tile_expert, tw, preact, da, hw, dwp)
                dx_args = (da, w13, sorted_ids, tile_expert, ones, y)
                t_dh = graph_time_us([lambda a=dh_args: kern.dh(*a)], ns.replays)
                t_dx = graph_time_us([lambda a=dx_args: kern.dx(*a)], ns.replays)
                row.update({"dh_us": round(t_dh, 1), "dx_us": round(t_dx, 1), "torch_dh_us": round(t_torch_dh, 1),
                            "torch_dx_us": round(t_torch_dx, 1), "dh_tflops": round(flops / t_dh / 1e6, 1),
                            "dx_tflops": round(2 * flops / t_dx / 1e6, 1),
                            "torch_dh_tflops": round(flops / t_torch_dh / 1e6, 1),
                            "torch_dx_tflops": round(2 * flops / t_torch_dx / 1e6, 1)})
                rows.append(row)
                print(json.dumps(row), flush=True)
                del da, hw, dwp, y, dh_args, dx_args
                torch.cuda.empty_cache()
            del preact, ds
            torch.cuda.empty_cache()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (ns.out / "check_backward.json").write_text(json.dumps(
        {"date": stamp, "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "rows": rows}, indent=1))
    lines = [f"# Backward data GEMMs on {torch.cuda.get_device_name()} ({stamp})", "",
             f"`python3 tools/check_backward.py {' '.join(sys.argv[1:])}`; µs (CUDA-graph medians) and useful TFLOP/s; "
             "torch = torch._grouped_mm on the same product, rows pre-sorted, no GLU.", "",
             "| model | tokens | tile_m | dH tiles | dX tiles | ok | dH µs (TFLOP/s) | torch | dX µs (TFLOP/s) "
             "| torch | worst err |",
             "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['tile_m']} | {r['dh']} | {r['dx']} | {r['error']} "
                         "|||||")
            continue
        err = max(r["da_row_err"], r["hw_row_err"], r["dw_err"], r["dx_row_err"])
        lines.append(f"| {r['model']} | {r['tokens']} | {r['tile_m']} | {r['dh']} | {r['dx']} | {r['ok']} "
                     f"| {r['dh_us']} ({r['dh_tflops']}) | {r['torch_dh_us']} ({r['torch_dh_tflops']}) | {r['dx_us']} "
                     f"({r['dx_tflops']}) | {r['torch_dx_us']} ({r['torch_dx_tflops']}) | {err:.1e} |")
    (ns.out / "check_backward.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    from moe_aot.variants import BWD_TILE_M

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="database URL (sqlite:///...)")
    ap.add_argument("--compile", action="store_true", help="compile the tile choices into --db (CPU)")
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--tiles", default=TILES, help="dH/dX tile choices, e.g. 128s4hopws,256s4hopws")
    ap.add_argument("--tile-m", default=str(BWD_TILE_M), help="routing tile heights, e.g. 64,128")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ns = ap.parse_args()
    if ns.compile:
        compile_db(ns)
    else:
        if ns.out is None:
            raise SystemExit("--out DIR is needed to run the check")
        run(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Check the fp8 kernels (templates/quant.py, hopper_fp8.py, warp_fp8.py) on a GPU against fp32
references of exactly what they consume, and time them beside the bf16 GEMMs of the same shapes.

  --compile DIR         (CPU, needs the DSL) compile the configs below for sm_90a into DIR/<name>/
  --run DIR --out OUT   (GPU, torch + moe_aot, no DSL) per model, precision, config and token
                        count: random bf16 weights (seeded per model) and inputs (per model and token
                        count, so every config of a point sees the same), quantized on the GPU (weights
                        by moe_aot.runtime.fp8, x by the quantization kernel); outputs poisoned
                        (NaN) before every run; prints errors and times, writes OUT/results.json
  --repeat N            with --run: N more runs of GEMM1 and GEMM2 back to back on freshly poisoned
                        outputs, compared bit for bit with one more run before them (a race shows
                        as runs that differ; the point then fails)
  --profile             with --run: after each check, one launch of GEMM1 and GEMM2 in NVTX
                        ranges prof_<tag>_<model>_<tokens>_{glu,down} instead of the timings, so
                        that ncu --nvtx-include "regex:prof_.*/" sees one launch of each
  --mirror ROUNDS       with --run: each config with a base (VERSUS) timed again beside it, ROUNDS
                        rounds in mirrored order (base, config, config, base, ...) of CUDA-graph
                        replays after a warm-up; base / config per GEMM, OUT/mirror.json

Checks (each over the whole output and its worst row):
  quant  dequant(xq, xs) against torch's quantize_x of the same x (and the scales themselves)
  glu    dequant(h, hs) against the fp32 GEMM1 + GLU of dequant(xq, xs) and the dequantized w13,
         quantized per h_block columns (the config's: 64, or 128) the same way: <= 1e-2 (whole),
         <= 5e-2 (worst row; a value on the other side of a rounding midpoint is one e4m3 step,
         6-12%, off); the scales within 1% of the reference's amax / 448; padding rows zero;
         the error against the unquantized fp32 h is reported (what quantizing h costs)
  down   y against dequant(h, hs) (the kernel's own GEMM1 output) @ dequant(w2)^T * routing weight
  layer  the fp8 layer's sum over top-k against the bf16 layer's fp32 reference (reported: what
         fp8 costs)
Routing comes from moe_aot.harness.reference.routing_reference (the routing kernel's semantics).
A config with a base (VERSUS) is printed beside it at the end: useful TFLOP/s of both GEMMs, base
-> config, per model, precision and token count (the h scale block's before / after, one process).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from kernel_timing import cold_l2_timer, mirrored_rounds, repeat_runs  # noqa: E402

# (name, E, top_k, H, I): the fp8-capable presets (GPT-OSS's H = 2880 is not a multiple of 128)
MODELS = [
    ("qwen3_30b_a3b", 128, 8, 2048, 768),
    ("qwen3_235b", 128, 8, 4096, 1536),
    ("deepseek_v3", 256, 8, 7168, 2048),
    ("mixtral_8x7b", 8, 2, 4096, 14336),
]
ALL = [m[0] for m in MODELS]
TOKENS = [1, 16, 256, 1024, 4096]
INTERLEAVE = 16
PRECISIONS = ("fp8", "fp8-block128")
# (tag, mma, precisions, tile_m, glu (tile_n, stages[, tile_k]), down (tile_n, stages)[, h_block]); h_block
# (GEMM1's output scale block, which GEMM2 reads) 64 unless given; bf16 rows are the bf16 GEMMs
# timed beside them (tile_k 64)
CONFIGS = [
    ("f8c", "hopws", PRECISIONS, 128, (128, 6), (128, 6)),
    ("f8c4", "hopws", PRECISIONS, 128, (128, 4), (128, 4)),
    # 128x256 tiles promoted in two 128-column parts (gemm_limits.promote_parts); fp8-block128's
    # GEMM2 tile_n must divide its 128-column weight blocks
    ("f8n256", "hopws", ("fp8",), 128, (256, 4), (256, 4)),
    ("f8n256b", "hopws", ("fp8-block128",), 128, (256, 4), (128, 6)),
    # fp8-block128's GEMM2 at 128x256 too: each 128-column part is one weight block
    ("f8n256bb", "hopws", ("fp8-block128",), 128, (256, 4), (256, 4)),
    # the same with h scaled per 128 columns (gemm_limits.check_h_block): GEMM1's epilogue reduces
    # one amax per 128 h columns, GEMM2 promotes once per k-tile and part instead of twice
    ("f8n256h", "hopws", ("fp8",), 128, (256, 4), (256, 4), 128),
    ("f8n256bbh", "hopws", ("fp8-block128",), 128, (256, 4), (256, 4), 128),
    # 128-wide GEMM2s reading 128-column h blocks (one promotion per k-tile, two partial sums)
    ("f8n256ch", "hopws", PRECISIONS, 128, (256, 4), (128, 6), 128),
    # the ping-pong core, not offered by gemm_limits.FP8_MMAS (correct since the turns of
    # 2026-12-06, no faster than f8c64s8): compiled here only when named with --only
    ("f8p", "hoppp", PRECISIONS, 64, (128, 8), (128, 6)),
    ("f8c64", "hopws", PRECISIONS, 64, (128, 6), (128, 6)),
    # the decode tile with more bytes in flight per SM: 8 (GEMM2: 7, Qwen3-30B has 6 k-tiles)
    # stages of 64x128 (192 KB), or 64x256
    # tiles (32 KB of weights per stage) promoted in two 128-column parts, h scaled per 128 columns
    ("f8c64s8", "hopws", PRECISIONS, 64, (128, 8), (128, 7)),
    ("f8c64n256", "hopws", PRECISIONS, 64, (256, 4), (256, 4), 128),
    ("f8c64n256s5", "hopws", PRECISIONS, 64, (256, 5), (256, 5), 128),
    # GEMM1 with 256-wide k-tiles (two 128-byte atoms and two promotions per k-tile; glu (tile_n,
    # stages, tile_k)): 256 bytes of each weight row per stage, as bf16's 128-wide k-tiles load
    ("f8c64k256", "hopws", PRECISIONS, 64, (128, 4, 256), (128, 6)),
    ("f8c64k256s3", "hopws", PRECISIONS, 64, (128, 3, 256), (128, 6)),
    # mma.sync (templates/warp_fp8.py): the decode regime's weight streaming
    ("f8w16", "warp", PRECISIONS, 16, (128, 6), (32, 6)),
    ("f8w16b", "warp", PRECISIONS, 16, (128, 4), (64, 6)),
    ("f8w64", "warp", PRECISIONS, 64, (128, 4), (64, 4)),
    ("f8w16n256", "warp", PRECISIONS, 16, (256, 4), (64, 6)),
    ("f8w16n256h", "warp", PRECISIONS, 16, (256, 4), (64, 6), 128),  # 8 lanes per h block
    # 2-CTA clusters ("hopws:c2"): the pair of an expert's M tiles shares each weight tile by
    # multicast (hopper_gemm's _produce_mc), against the same tiles in single CTAs
    ("f8n256hc2", "hopws:c2", ("fp8",), 128, (256, 4), (256, 4), 128),
    ("f8n256bbhc2", "hopws:c2", ("fp8-block128",), 128, (256, 4), (256, 4), 128),
    # "fp8" GEMM1 promoted once per 2 (4) k-tiles ("hopws:p2": gemm_limits.PROMOTE_EVERY), the
    # tensor cores summing 256 (512) of K per partial sum; GEMM2 as f8n256h's
    ("f8n256hp2", "hopws:p2", ("fp8",), 128, (256, 4), (256, 4), 128),
    ("bf_w16", "warp", ("bf16",), 16, (32, 8), (32, 8)),
    ("bf_hw128", "hopws", ("bf16",), 128, (256, 4), (256, 4)),
    ("bf_pp64", "hoppp", ("bf16",), 64, (256, 5), (256, 5)),
]


EXPERIMENTAL = ("f8p",)
# config -> the config it is measured against (same tiles, h scaled per 64 columns)
VERSUS = {"f8n256hc2": "f8n256h", "f8n256hp2": "f8n256h", "f8n256bbhc2": "f8n256bbh",
          "f8n256h": "f8n256", "f8n256bbh": "f8n256bb", "f8w16n256h": "f8w16n256", "f8c64s8": "f8c64", "f8p": "f8c64s8",
          "f8c64n256": "f8c64", "f8c64n256s5": "f8c64", "f8c64k256": "f8c64", "f8c64k256s3": "f8c64",
          # builds of a source change kept as a diff, not as configs (tools/results/gpu_2026-12-08/s48_h100/
          # early_release.diff): their manifests carry them, the table and --mirror pair them here
          "f8n256hp2er": "f8n256hp2", "f8n256bbher": "f8n256bbh"}


def kernels(only=None):
    for tag, mma, precs, tm, g, d, *hb in CONFIGS:
        if (only and tag not in only) or (not only and tag in EXPERIMENTAL):
            continue
        for model, e, k, h, i in MODELS:
            for prec in precs:
                p = prec.replace("-", "_")
                yield {"tag": tag, "mma": mma, "precision": prec, "model": model, "E": e, "k": k,
                       "H": h, "I": i, "tile_m": tm, "glu": g, "down": d, "h_block": hb[0] if hb else 64,
                       "glu_name": f"glu_{tag}_{p}_{model}", "down_name": f"down_{tag}_{p}_{model}",
                       "quant_name": f"quant_{p}_h{h}" if prec != "bf16" else None}


# ----------------------------------------------------------------------------- compile (CPU)
def compile_all(out_dir: Path, arch: str, only=None) -> None:
    from moe_aot_templates.grouped_gemm import GroupedDownGemm, GroupedGluGemm
    from moe_aot_templates.hopper_fp8 import HopperDownGemmFp8, HopperGluGemmFp8
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm
    from moe_aot_templates.quant import QuantizeFp8
    from moe_aot_templates.warp_fp8 import WarpDownGemmFp8, WarpGluGemmFp8

    from moe_aot import gemm_limits
    from moe_aot.kernel_build import compile_kernel

    if only and any(t in EXPERIMENTAL for t in only):
        gemm_limits.FP8_MMAS = gemm_limits.WARP_SPECIALIZED  # this tool only: the product refuses them
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest, done = [], set()
    for v in kernels(only):
        fp8 = v["precision"] != "bf16"
        tk = 128 if fp8 else 64
        if v["mma"] == "warp":
            glu_cls, down_cls = (WarpGluGemmFp8, WarpDownGemmFp8) if fp8 else (GroupedGluGemm, GroupedDownGemm)
        else:
            glu_cls, down_cls = (HopperGluGemmFp8, HopperDownGemmFp8) if fp8 else (HopperGluGemm, HopperDownGemm)
        # constructor options named only when set: the 64-block single-CTA kernels as built before
        opts = {"h_block": v["h_block"]} if v["h_block"] != 64 else {}
        # "hopws:c2": 2-CTA clusters along M; "hopws:p2": GEMM1 promoted once per 2 k-tiles
        mma, *flags = v["mma"].split(":")
        glu_opts = {}
        for f in flags:
            if f[0] == "c":
                opts["cluster_m"] = int(f[1:])
            elif f[0] == "p":
                glu_opts["promote_every"] = int(f[1:])
        objs = [
            (glu_cls(v["E"], v["H"], v["I"], v["k"], interleave=INTERLEAVE, tile_m=v["tile_m"],
                     tile_n=v["glu"][0], tile_k=v["glu"][2] if len(v["glu"]) > 2 else tk,
                     stages=v["glu"][1], mma=mma,
                     precision=v["precision"], **opts, **glu_opts), v["glu_name"]),
            (down_cls(v["E"], v["H"], v["I"], v["k"], tile_m=v["tile_m"], tile_n=v["down"][0],
                      tile_k=tk, stages=v["down"][1], mma=mma, precision=v["precision"], **opts),
             v["down_name"]),
        ]
        if fp8 and v["quant_name"] not in done:
            objs.append((QuantizeFp8(v["H"], v["precision"]), v["quant_name"]))
            done.add(v["quant_name"])
        for obj, name in objs:
            t0 = time.perf_counter()
            art = compile_kernel(obj, arch, name)
            art.write_dir(out_dir / name)
            for ptx in (out_dir / name).glob("*.ptx"):
                ptx.unlink()  # kept small for the trip to the GPU machine
            print(f"{name:44s} {arch} {time.perf_counter() - t0:6.2f}s cubin {len(art.cubin)} B", flush=True)
        manifest.append(v)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ----------------------------------------------------------------------------- run (GPU)
def run_all(kdir: Path, out_dir: Path, iters: int, tokens=None, only=None, models=None, repeat: int = 0,
            profile: bool = False, mirror: int = 0) -> int:
    import os

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts
    import torch

    from moe_aot.harness import fp8 as F8R
    from moe_aot.harness.reference import moe_reference, rel_err, routing_reference, row_rel_err
    from moe_aot.harness.verify import seeded_generator as seeded
    from moe_aot.layout import interleave_gate_up
    from moe_aot.runtime import fp8 as F8
    from moe_aot.runtime.library import KernelLibrary

    torch.backends.cuda.matmul.allow_tf32 = False
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((kdir / "manifest.json").read_text())
    if only:
        manifest = [v for v in manifest if v["tag"] in only]
    if models:
        manifest = [v for v in manifest if v["model"] in models]
    order = [m[0] for m in MODELS]
    manifest.sort(key=lambda v: (order.index(v["model"]), v["precision"]))
    dev = torch.device("cuda")
    results, failures = [], 0
    libs = {}

    def lib(name):
        if name not in libs:
            libs[name] = KernelLibrary.from_dir(kdir / name)
        return libs[name]

    timed = cold_l2_timer(dev, iters)
    pending, mirrored = [], []  # (res, glu closure, down closure) of the current model and precision

    def flush_mirror():
        """Each VERSUS pair of the model and precision just checked, re-timed side by side."""
        if pending:
            mirrored.extend(mirror_pairs(pending, mirror))
            (out_dir / "mirror.json").write_text(json.dumps(mirrored, indent=1))
        pending.clear()

    def chunked(fn, w, chunk=16):
        """fn over experts in chunks (the fp32 temporaries of a whole DeepSeek-V3 matrix are 30 GB)."""
        outs = [fn(w[s:s + chunk]) for s in range(0, w.shape[0], chunk)]
        return tuple(torch.cat(parts) for parts in zip(*outs))

    weights, wq = {}, {}
    for v in manifest:
        e, k, hd, inter, tm, prec = v["E"], v["k"], v["H"], v["I"], v["tile_m"], v["precision"]
        hb = v.get("h_block", 64)  # manifests written before h_block: 64
        if v["model"] not in weights or prec not in wq:
            flush_mirror()  # before the weights its closures use are freed
        if v["model"] not in weights:
            weights.clear()
            wq.clear()
            torch.cuda.empty_cache()
            s = 1.0 / math.sqrt(hd)
            gen = seeded(dev, v["model"])
            w_gate = (torch.randn(e, inter, hd, device=dev, generator=gen) * s).bfloat16()
            w_up = (torch.randn(e, inter, hd, device=dev, generator=gen) * s).bfloat16()
            w2 = (torch.randn(e, hd, inter, device=dev, generator=gen) / math.sqrt(inter)).bfloat16()
            weights[v["model"]] = (w_gate, w_up, w2)
        w_gate, w_up, w2 = weights[v["model"]]
        if prec not in wq:
            # one precision's weights at a time (the manifest is sorted by model, then precision):
            # DeepSeek-V3's bf16 weights, one fp8 copy and the layer check's bf16 w13 fit an 80 GB
            # card, two fp8 copies did not (the H100, 2026-12-06)
            wq.clear()
            torch.cuda.empty_cache()
            if prec == "bf16":
                wq[prec] = (interleave_gate_up(w_gate, w_up, INTERLEAVE), None, w2, None)
            else:
                parts = [F8.prepare_w13(w_gate[a:a + 16], w_up[a:a + 16], prec, INTERLEAVE)
                         for a in range(0, e, 16)]
                w13q = torch.cat([p[0] for p in parts])
                w13s = torch.cat([p[1] for p in parts])
                w2q, w2s = chunked(lambda w: F8.prepare_w2(w, prec), w2)
                wq[prec] = (w13q, w13s, w2q, w2s)
        w13, w13s, w2x, w2s = wq[prec]
        glu, down = lib(v["glu_name"]), lib(v["down_name"])
        for m in tokens or (v["tokens"] if "tokens" in v else TOKENS):
            gen = seeded(dev, v["model"], m)
            x = torch.randn(m, hd, device=dev, generator=gen).bfloat16()
            logits = torch.randn(m, e, device=dev, generator=gen)
            topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
            topk_w = topk_w.float().contiguous()
            _, _, sorted_ids, tile_expert = routing_reference(topk_ids, e, tm)
            r = sorted_ids.numel()
            ids = sorted_ids.long()
            valid = ids >= 0
            row_expert = torch.repeat_interleave(tile_expert.long(), tm)
            pad_rows = (row_expert >= 0) & ~valid
            y = torch.full((m * k, hd), float("nan"), dtype=torch.bfloat16, device=dev)
            res = {"variant": v["tag"], "mma": v["mma"], "precision": prec, "model": v["model"],
                   "tokens": m, "tile_m": tm, "glu_tiles": v["glu"], "down_tiles": v["down"], "h_block": hb,
                   "experts_used": int(torch.unique(topk_ids).numel())}
            n_exp = res["experts_used"]
            eb = 2 if prec == "bf16" else 1
            if prec == "bf16":
                h = torch.full((r, inter), float("nan"), dtype=torch.bfloat16, device=dev)
                glu_args = (x, w13, sorted_ids, tile_expert, h)
                down_args = (h, w2x, sorted_ids, tile_expert, topk_w, y)
                glu(*glu_args)
                down(*down_args)
                torch.cuda.synchronize()
                ok = bool(torch.isfinite(y).all()) and bool(torch.isfinite(h[valid].float()).all())
            else:
                quant = lib(v["quant_name"])
                blk = F8.x_block(prec)
                xq = torch.full((m, hd), 0x7F, dtype=torch.uint8, device=dev).view(F8.E4M3)  # NaN
                xs = torch.full((m,) if blk is None else (m, hd // blk), float("nan"), device=dev)
                quant(x, xq, xs)
                h = torch.full((r, inter), 0x7F, dtype=torch.uint8, device=dev).view(F8.E4M3)
                hs = torch.full((r, inter // hb), float("nan"), device=dev)
                glu_args = (xq, xs, w13, w13s, sorted_ids, tile_expert, h, hs)
                down_args = (h, hs, w2x, w2s, sorted_ids, tile_expert, topk_w, y)
                glu(*glu_args)
                down(*down_args)
                torch.cuda.synchronize()
                # quant: against torch's quantization of the same x
                xq_ref, xs_ref = F8R.quantize_x(x, prec)
                xd = F8R.dequantize_rows(xq, xs, blk)
                xd_ref = F8R.dequantize_rows(xq_ref, xs_ref, blk)
                err_q = rel_err(xd, xd_ref)
                err_qs = ((xs - xs_ref).abs() / xs_ref).max().item()
                # glu: against the reference on the kernel's own xq / xs, quantized the same way
                h_ref = F8R.glu_fp8_reference(xq, xs, w13, w13s, sorted_ids, tile_expert, tm, k, prec,
                                             "swiglu", INTERLEAVE)
                hq_ref, hs_ref = F8R.quantize_rows(h_ref, hb)
                hd_k = F8R.dequantize_rows(h, hs, hb)
                hd_ref = F8R.dequantize_rows(hq_ref, hs_ref, hb)
                err_h = rel_err(hd_k[valid], hd_ref[valid])
                row_h = row_rel_err(hd_k[valid], hd_ref[valid])
                err_h_unq = rel_err(hd_k[valid], h_ref[valid])
                err_hs = ((hs[valid] - hs_ref[valid]).abs() / hs_ref[valid]).max().item()
                pad_ok = bool((h[pad_rows].float() == 0).all()) if pad_rows.any() else True
                # down: on the kernel's own h / hs
                y_ref = F8R.down_fp8_reference(h, hs, w2x, w2s, sorted_ids, tile_expert, tm, topk_w, prec)
                err_y = rel_err(y, y_ref)
                row_y = row_rel_err(y, y_ref)
                # the fp8 layer against the bf16 layer's fp32 reference
                w13_bf = interleave_gate_up(w_gate, w_up, INTERLEAVE)
                layer = y.float().view(m, k, hd).sum(1)
                err_layer = rel_err(layer, moe_reference(x, w13_bf, w2, topk_w, topk_ids, "swiglu", INTERLEAVE))
                del w13_bf
                ok = (err_q <= 1e-2 and err_qs <= 1e-5 and err_h <= 1e-2 and row_h <= 5e-2 and err_hs <= 1e-2 and pad_ok
                      and err_y <= 1e-2 and row_y <= 3e-2)
                res.update(quant={"rel_err": err_q, "scale_err": err_qs},
                           glu_check={"rel_err": err_h, "row_err_max": row_h, "vs_unquantized": err_h_unq,
                                      "scale_err_max": err_hs,
                                      "padding_zero": pad_ok},
                           down_check={"rel_err": err_y, "row_err_max": row_y},
                           layer_vs_bf16=err_layer)
                if not profile:
                    res["quant"]["us"] = timed(lambda: quant(x, xq, xs))
            if repeat:
                # a race shows as runs that differ (METHOD.md)
                differ = repeat_runs(repeat, glu, down, glu_args, down_args,
                                     (h, y) if prec == "bf16" else (h, hs, y))
                res["repeat"] = {"runs": repeat, "differ": differ}
                ok = ok and differ == 0
            if profile:
                # one launch of each GEMM in an NVTX range, for ncu --nvtx-include "regex:prof_.*/"
                name = f"prof_{v['tag']}_{v['model']}_{m}"
                for part, fn, args in (("glu", glu, glu_args), ("down", down, down_args)):
                    torch.cuda.nvtx.range_push(f"{name}_{part}")
                    fn(*args)
                    torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()
                res["ok"] = ok
                failures += not ok
                results.append(res)
                print(f"{'PASS' if ok else 'FAIL'} {v['tag']:8s} {prec:12s} {v['model']:14s} M={m:5d} profiled "
                      f"(one launch each)", flush=True)
                continue
            t_glu = timed(lambda: glu(*glu_args))
            t_down = timed(lambda: down(*down_args))
            mk = m * k
            res["glu"] = {"us": t_glu, "TFLOPs": 2 * mk * 2 * inter * hd / t_glu / 1e6,
                          "TBps": n_exp * 2 * inter * hd * eb / t_glu / 1e6}
            res["down"] = {"us": t_down, "TFLOPs": 2 * mk * hd * inter / t_down / 1e6,
                           "TBps": n_exp * hd * inter * eb / t_down / 1e6}
            res["ok"] = ok
            failures += not ok
            results.append(res)
            if mirror and ok:
                pending.append((res, lambda f=glu, a=glu_args: f(*a), lambda f=down, a=down_args: f(*a)))
            line = (f"{'PASS' if ok else 'FAIL'} {v['tag']:8s} {prec:12s} {v['model']:14s} M={m:5d} "
                    f"glu {t_glu:8.1f}us {res['glu']['TFLOPs']:6.1f}TF {res['glu']['TBps']:4.2f}TB/s | "
                    f"down {t_down:8.1f}us {res['down']['TFLOPs']:6.1f}TF {res['down']['TBps']:4.2f}TB/s")
            if prec != "bf16":
                line += (f" | quant {res['quant']['us']:.1f}us err {err_q:.1e}/{err_qs:.1e} glu err "
                         f"{err_h:.1e}/{row_h:.1e} hs {err_hs:.0e} (unq {err_h_unq:.1e}) pad0 {pad_ok} down err "
                         f"{err_y:.1e}/{row_y:.1e} layer-vs-bf16 {err_layer:.2e}")
            if repeat:
                line += f" | repeat {res['repeat']['differ']}/{repeat} differ"
            print(line, flush=True)
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    flush_mirror()
    print(f"{len(results) - failures}/{len(results)} passed", flush=True)
    versus_table(results)
    return 1 if failures else 0


def mirror_pairs(points, rounds: int, replays: int = 20, warmup_s: float = 0.3) -> list[dict]:
    """Each VERSUS config among ``points`` ((result row, GEMM1 closure, GEMM2 closure) of one
    model and precision, on the same inputs per token count) beside its base: ``rounds`` timings
    of each in mirrored order (base, config, config, base, ...), each a CUDA-graph replay of GEMM1
    and GEMM2 in turn after ``warmup_s`` of untimed replays (the sustained clock), as
    check_gemm_kernels --ab; per kernel the median over its rounds' medians, and base / config
    (above 1: the config is faster). The cold-L2 timings above are taken one config after the
    other, so a drift of the clock between them weighs on one side only."""
    import statistics

    got = {(r["variant"], r["tokens"]): (g, d) for r, g, d in points}
    out = []
    for r, _, _ in points:
        base = VERSUS.get(r["variant"])
        if (base, r["tokens"]) not in got:
            continue
        fns = {0: got[(base, r["tokens"])], 1: got[(r["variant"], r["tokens"])]}
        times = mirrored_rounds(fns, rounds, replays, warmup_s)
        us = {t: [statistics.median(times[t][0]), statistics.median(times[t][1])] for t in (0, 1)}
        row = {"base": base, "config": r["variant"], "model": r["model"], "precision": r["precision"],
               "tokens": r["tokens"], "rounds": rounds, "base_us": us[0], "config_us": us[1],
               "rounds_us": {"base": times[0], "config": times[1]},
               "glu_base_over_config": us[0][0] / us[1][0], "down_base_over_config": us[0][1] / us[1][1]}
        out.append(row)
        print(f"  mirrored x{rounds}: {base} / {r['variant']} {r['precision']} {r['model']} M={r['tokens']}: "
              f"glu {us[0][0]:.1f} / {us[1][0]:.1f} = {row['glu_base_over_config']:.3f}, down {us[0][1]:.1f} / "
              f"{us[1][1]:.1f} = {row['down_base_over_config']:.3f}", flush=True)
    return out


def versus_table(results) -> None:
    """Each VERSUS config beside its base, same model, precision and token count: useful TFLOP/s
    of GEMM1 and GEMM2, base -> config (and the ratio)."""
    got = {(r["variant"], r["model"], r["precision"], r["tokens"]): r for r in results}
    lines = []
    for (tag, model, prec, m), r in got.items():
        base = got.get((VERSUS.get(tag), model, prec, m))
        if base is None or "glu" not in r or "glu" not in base:  # untimed (--profile)
            continue
        cells = [f"{base[g]['TFLOPs']:6.1f} -> {r[g]['TFLOPs']:6.1f} ({r[g]['TFLOPs'] / base[g]['TFLOPs']:.3f}x)"
                 for g in ("glu", "down")]
        lines.append(f"{VERSUS[tag]:>9s} -> {tag:10s} {prec:12s} {model:14s} M={m:5d} | glu {cells[0]} | "
                     f"down {cells[1]} | {'ok' if r['ok'] and base['ok'] else 'FAILED CHECK'}")
    if lines:
        print("useful TFLOP/s, base -> config (h scale block 64 -> 128):", *lines, sep="\n", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", metavar="DIR", type=Path)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--run", metavar="DIR", type=Path)
    ap.add_argument("--out", type=Path, default=Path("fp8_check_out"))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--only", help="comma-separated config tags (default: all)")
    ap.add_argument("--models", help="comma-separated model names (default: all)")
    ap.add_argument("--tokens", help="comma-separated token counts (default: %s)" % TOKENS)
    ap.add_argument("--repeat", type=int, default=0,
                    help="after each check, that many more runs back to back compared bit for bit with one more run "
                         "before them (kernel_timing.repeat_runs)")
    ap.add_argument("--profile", action="store_true",
                    help="with --run: after each check, one launch of GEMM1 and GEMM2 in NVTX ranges "
                         "prof_<tag>_<model>_<tokens>_{glu,down} (for ncu) instead of the timings")
    ap.add_argument("--mirror", type=int, default=0, metavar="ROUNDS",
                    help="with --run: each VERSUS config and its base also timed side by side, ROUNDS rounds in "
                         "mirrored order (CUDA-graph replays after a warm-up, as check_gemm_kernels --ab); "
                         "writes OUT/mirror.json")
    ns = ap.parse_args()
    only = ns.only.split(",") if ns.only else None
    if ns.compile:
        compile_all(ns.compile, ns.arch, only)
    if ns.run:
        sys.exit(run_all(ns.run, ns.out, ns.iters,
                         [int(t) for t in ns.tokens.split(",")] if ns.tokens else None, only,
                         ns.models.split(",") if ns.models else None, ns.repeat, ns.profile,
                         ns.mirror))
    if not ns.compile and not ns.run:
        ap.error("give --compile DIR and/or --run DIR")


if __name__ == "__main__":
    main()

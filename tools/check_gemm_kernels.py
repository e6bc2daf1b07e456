#!/usr/bin/env python3
"""Check the grouped-GEMM templates on a GPU against a PyTorch fp32 reference, and time them.

  --compile DIR         (CPU, needs the DSL) compile the variants below for --arch (default sm_90a;
                        those whose MMA family the arch has: variants.TARGET_LIMITS) into DIR/<name>/
  --run DIR --out OUT   (GPU, needs only torch + moe_aot.runtime) load each kernel library, run it
                        on fresh random inputs with NaN-poisoned outputs for every model shape and
                        token count, print rel err ||out-ref||/||ref|| and timings, write OUT/results.json
  --run DIR --ab A,B    (GPU) two configs side by side: the same inputs for both, both checked, then
                        --rounds timings of each in mirrored order at the sustained clock; OUT/ab.json
                        (a cold-L2 timing of one config after another reads the GPU's clock drift
                        between them as well: +-10% at the power cap, 2026-12-03)
    --base DIR          with --ab: A's binaries from DIR (the same config compiled from other
                        sources, e.g. before a template change: --ab X,X --base OLD)
  --repeat N            with --run: after each check, N more runs back to back on freshly poisoned
                        outputs, compared bit for bit with one more run before them (a race shows
                        as runs that differ; the point then fails)

Routing is built here by a small torch function with the router's semantics (the real routing
kernel lives elsewhere): per expert its routed pairs, ascending p, at rows [off_e, off_e+count_e),
off_{e+1} = off_e + roundup(count_e, tile_m), other rows -1;
T = ceil((M*k + min(E, M*k)*(tile_m-1)) / tile_m), tile_expert[t] = owner of tile t, else -1.
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

# (name, E, top_k, H, I)
MODELS = [
    ("qwen3_30b_a3b", 128, 8, 2048, 768),
    ("gpt_oss_120b", 128, 4, 2880, 2880),
    ("deepseek_v3", 256, 8, 7168, 2048),
    ("mixtral_8x7b", 8, 2, 4096, 14336),
    ("qwen3_235b", 128, 8, 4096, 1536),
    # GEMM1's shapes as GEMM2s (H = 2I, I = H): A by TMA from rows already in routed order, the
    # upper bound of what a permute-then-TMA GEMM1 could reach (compare their down with the
    # real model's glu)
    ("qwen3_30b_a3b_sw", 128, 8, 1536, 2048),
    ("gpt_oss_120b_sw", 128, 4, 5760, 2880),
    ("mixtral_8x7b_sw", 8, 2, 28672, 4096),
    ("qwen3_235b_sw", 128, 8, 3072, 4096),
]
TOKENS = [1, 16, 256, 4096]
INTERLEAVE = 16

ALL = [m[0] for m in MODELS if not m[0].endswith("_sw")]
SWAPPED = [m[0] for m in MODELS if m[0].endswith("_sw")]
# (tag, mma, models, activation, tile_m, glu tiles (n, k, stages), down tiles (n, k, stages),
#  token counts); a tile_n that does not divide N falls back to the next of 256, 192, 128, 64
CONFIGS = [
    ("base", "warp", ALL, "swiglu", 64, (128, 64, 4), (128, 64, 4), TOKENS),
    ("wide", "warp", ["qwen3_30b_a3b"], "geglu", 128, (256, 32, 3), (256, 32, 3), [1, 256, 4096]),
    ("thin", "warp", ["qwen3_30b_a3b", "qwen3_235b"], "swiglu", 16, (64, 128, 2), (64, 128, 2),
     [1, 16, 256]),
    ("dec32", "warp", ["qwen3_30b_a3b", "qwen3_235b", "deepseek_v3"], "swiglu", 16, (32, 64, 8),
     (32, 64, 8), [1, 16]),
    # (the one-CTA-per-tile wgmma configs wg128, wg128n128, wgbig, wg128s3, wg64 and wgdec went
    # with their mainloop, twenty-third session; their results are in tools/results/)
    # the DSL-machinery core (templates/hopper_gemm.py): TMA + PipelineTmaAsync, persistent
    ("hw128", "hopws", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), TOKENS + [1024]),
    ("hwbig", "hopws", ["qwen3_30b_a3b", "mixtral_8x7b"], "swiglu", 128, (256, 64, 4),
     (256, 64, 4), [16384]),
    ("hw64", "hopws", ALL, "geglu", 64, (128, 64, 4), (128, 64, 4), [1, 256, 4096]),
    ("hw64d", "hopws", ALL, "swiglu", 64, (256, 64, 4), (256, 64, 4), [16, 256, 4096]),
    ("hw128n128", "hopws", ALL, "swiglu", 128, (128, 64, 6), (128, 64, 6), [1024, 4096]),
    # 2-CTA clusters along M, weight tiles multicast to both CTAs when their M tiles share an expert
    ("hc2", "hopws:c2", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1, 16, 256, 1024, 4096]),
    # weight bytes in flight per SM: the same tiles with 3 stages instead of 4 (memory-bound points)
    ("hw128s3", "hopws", ["gpt_oss_120b", "deepseek_v3"], "swiglu", 128, (256, 64, 3), (256, 64, 3), [4096]),
    ("hc2s3", "hopws:c2", ["gpt_oss_120b", "deepseek_v3"], "swiglu", 128, (256, 64, 3), (256, 64, 3), [4096]),
    # the same 2-CTA tiles with the fixed pairs (M tiles 2j, 2j + 1 whatever their experts)
    ("hc2f", "hopws:c2:f", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1, 16, 256, 1024, 4096]),
    ("hc2fbig", "hopws:c2:f", ["qwen3_30b_a3b", "mixtral_8x7b"], "swiglu", 128, (256, 64, 4),
     (256, 64, 4), [16384]),
    # 1024-16384 tokens: the cooperative tiles alone, with the weights evict-first in L2, in
    # 2-CTA clusters (one expert's tiles paired, or the fixed pairs), and both
    ("x128", "hopws", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1024, 4096, 16384]),
    # the same tiles three stages deep (--ab x128,x128s3; --profile x128,x128s3@16384 for their bytes):
    # does a shallower ring keep GEMM1's gathered rows in L2 (the forty-sixth session's reading)?
    ("x128s3", "hopws", ALL, "swiglu", 128, (256, 64, 3), (256, 64, 3), [1024, 4096, 16384]),
    ("x128ef", "hopws:ef", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1024, 4096, 16384]),
    ("xc2f", "hopws:c2:f", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1024, 4096, 16384]),
    ("xc2", "hopws:c2", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1024, 4096, 16384]),
    ("xc2ef", "hopws:c2:ef", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1024, 4096, 16384]),
    ("xpp64", "hoppp", ALL, "swiglu", 64, (256, 64, 5), (256, 64, 5), [1024, 4096, 16384]),
    ("xpp64ef", "hoppp:ef", ALL, "swiglu", 64, (256, 64, 5), (256, 64, 5), [1024, 4096, 16384]),
    # the same tiles with the raster groups cut at expert boundaries (raster_experts):
    # --ab x128,x128xa and --ab xpp64,xpp64xa
    ("x128xa", "hopws:xa", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1024, 4096, 16384]),
    ("xpp64xa", "hoppp:xa", ALL, "swiglu", 64, (256, 64, 5), (256, 64, 5), [1024, 4096, 16384]),
    # the paired tiles with every warpgroup multiplying every tile (before 2026-12-03), beside
    # xc2 where a warpgroup whose 64 rows are all padding skips its wgmmas (--ab xc2nk,xc2)
    ("xc2nk", "hopws:c2:nk", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [1024, 4096, 16384]),
    ("hc2big", "hopws:c2", ["qwen3_30b_a3b", "mixtral_8x7b"], "swiglu", 128, (256, 64, 4),
     (256, 64, 4), [16384]),
    ("hc2geglu", "hopws:c2", ["qwen3_30b_a3b"], "geglu", 128, (128, 64, 6), (192, 64, 4), [256, 4096]),
    # ping-pong: two consumer warpgroups on alternate 64-row tiles (epilogue beside the other's MMA)
    ("pp64", "hoppp", ALL, "swiglu", 64, (256, 64, 5), (256, 64, 5), [1, 16, 256, 1024, 4096]),
    ("pp64big", "hoppp", ["qwen3_30b_a3b", "mixtral_8x7b"], "swiglu", 64, (256, 64, 5),
     (256, 64, 5), [16384]),
    ("pp64n128", "hoppp", ALL, "geglu", 64, (128, 64, 8), (128, 64, 8), [16, 256, 4096]),
    # decode: the shipped 1-16-token tiles on every model, beside longer k-tiles and narrow ping-pong
    ("dec32all", "warp", ALL, "swiglu", 16, (32, 64, 8), (32, 64, 8), [1, 16]),
    ("dec32k128", "warp", [m for m in ALL if m != "gpt_oss_120b"], "swiglu", 16, (32, 128, 4), (32, 128, 4),
     [1, 16]),
    ("pp64n64", "hoppp", ALL, "swiglu", 64, (64, 64, 8), (64, 64, 8), [1, 16]),
    # ping-pong warpgroups owning 128x128 tiles (two 64-row wgmma blocks each)
    ("pp128", "hoppp", ALL, "swiglu", 128, (128, 64, 6), (128, 64, 6), [1, 256, 1024, 4096, 16384]),
    # GEMM2s with GEMM1's shapes (the *_sw models): A by TMA in routed order, against each real GEMM1
    ("hw128sw", "hopws", SWAPPED, "swiglu", 128, (256, 64, 4), (256, 64, 4), [4096]),
    ("pp64sw", "hoppp", SWAPPED, "swiglu", 64, (256, 64, 5), (256, 64, 5), [4096]),
    ("hwbigsw", "hopws", ["qwen3_30b_a3b_sw", "mixtral_8x7b_sw"], "swiglu", 128, (256, 64, 4),
     (256, 64, 4), [16384]),
    # sm_100a (--arch sm_100a): tcgen05 with TMEM accumulators (templates/blackwell_gemm.py), compiled
    # only so far: no Blackwell GPU has run them
    ("bw128", "umma", ALL, "swiglu", 128, (256, 64, 4), (256, 64, 4), [16, 256, 1024, 4096]),
    ("bw128n128", "umma", ALL, "geglu", 128, (128, 64, 6), (128, 64, 6), [256, 4096]),
    ("bwbig", "umma", ["qwen3_30b_a3b", "mixtral_8x7b"], "swiglu", 128, (256, 64, 4), (256, 64, 4), [16384]),
    # 2-CTA pairs (cta_group::2) on 256-row tiles: the routing padded to 256 rows per expert
    ("bw2c", "umma:c2", ALL, "swiglu", 256, (256, 64, 4), (256, 64, 4), [256, 1024, 4096]),
    ("bw2cbig", "umma:c2", ["qwen3_30b_a3b", "mixtral_8x7b"], "swiglu", 256, (256, 64, 6), (256, 64, 6), [16384]),
]


def _fit_n(n_dim, tiles):
    for n in (tiles[0], 256, 192, 128, 96, 64, 32):
        if n <= tiles[0] and n_dim % n == 0:
            return (n,) + tuple(tiles[1:])
    raise ValueError(f"no tile_n for N={n_dim}")


def variants(only=None):
    models = {m[0]: m[1:] for m in MODELS}
    for tag, mma, names, act, tm, g, d, tokens in CONFIGS:
        if only and tag not in only:
            continue
        for model in names:
            e, k, h, i = models[model]
            yield {"tag": tag, "mma": mma, "model": model, "E": e, "k": k, "H": h, "I": i,
                   "act": act, "tile_m": tm, "glu": _fit_n(2 * i, g), "down": _fit_n(h, d),
                   "tokens": tokens,
                   "glu_name": f"glu_{tag}_{model}", "down_name": f"down_{tag}_{model}"}


# ----------------------------------------------------------------------------- compile (CPU)
def compile_all(out_dir: Path, arch: str, only=None) -> None:
    from moe_aot_templates.blackwell_gemm import BlackwellDownGemm, BlackwellGluGemm
    from moe_aot_templates.grouped_gemm import GroupedDownGemm, GroupedGluGemm
    from moe_aot_templates.hopper_gemm import HopperDownGemm, HopperGluGemm

    from moe_aot.gemm_limits import UMMA, WARP_SPECIALIZED
    from moe_aot.kernel_build import compile_kernel
    from moe_aot.variants import TARGET_LIMITS

    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = []
    for v in variants(only):
        # "hopws:c2": cluster_m 2 (one expert's tiles paired); ":f": the fixed pairs 2j, 2j + 1;
        # ":ef": the weights' TMA loads evict-first in L2; ":nk": every warpgroup multiplies
        # every tile (no skip of all-padding halves, hopper_gemm._rows_live); ":xa": raster groups
        # cut at expert boundaries (hopper_gemm raster_experts)
        mma, *opts = v["mma"].split(":")
        if mma not in TARGET_LIMITS[arch]["mma"]:
            continue  # e.g. wgmma on sm_100a, umma on sm_90a
        glu_cls, down_cls = ((HopperGluGemm, HopperDownGemm) if mma in WARP_SPECIALIZED
                             else (BlackwellGluGemm, BlackwellDownGemm) if mma in UMMA
                             else (GroupedGluGemm, GroupedDownGemm))
        extra = {}
        for opt in opts:
            if opt.startswith("c"):
                extra["cluster_m"] = int(opt[1:])
            else:
                extra[{"f": "pair_list", "ef": "b_evict_first", "nk": "skip_padding",
                       "xa": "raster_experts"}[opt]] = opt in ("ef", "xa")
        g = glu_cls(v["E"], v["H"], v["I"], v["k"], activation=v["act"],
                    interleave=INTERLEAVE, tile_m=v["tile_m"], tile_n=v["glu"][0],
                    tile_k=v["glu"][1], stages=v["glu"][2], mma=mma, **extra)
        d = down_cls(v["E"], v["H"], v["I"], v["k"], tile_m=v["tile_m"],
                     tile_n=v["down"][0], tile_k=v["down"][1], stages=v["down"][2],
                     mma=mma, **extra)
        for obj, name in ((g, v["glu_name"]), (d, v["down_name"])):
            t0 = time.perf_counter()
            art = compile_kernel(obj, arch, name)
            art.write_dir(out_dir / name)
            print(f"{name:40s} {arch} compile {art.meta['timing_s']['compile']:.2f}s "
                  f"export+link {art.meta['timing_s']['export_and_link']:.2f}s "
                  f"total {time.perf_counter() - t0:.2f}s cubin {len(art.cubin)} B", flush=True)
        manifest.append(v)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ----------------------------------------------------------------------------- run (GPU)
def build_routing(topk_ids, num_experts: int, tile_m: int):
    """sorted_ids, tile_expert from the runtime's reference of the routing kernel."""
    from moe_aot.harness.reference import routing_reference

    return routing_reference(topk_ids, num_experts, tile_m)[2:]


def _weights(v, dev, gen):
    """Random gate / up / down weights of v's model and w13 in the prepared interleaved layout."""
    import torch

    e, hd, inter = v["E"], v["H"], v["I"]
    s = 1.0 / math.sqrt(hd)
    w_gate = (torch.randn(e, inter, hd, device=dev, generator=gen) * s).bfloat16()
    w_up = (torch.randn(e, inter, hd, device=dev, generator=gen) * s).bfloat16()
    # prepared layout: rows [2jg, 2jg+g) gate rows [jg, jg+g), then the matching up rows
    g = INTERLEAVE
    w13 = torch.stack([w_gate.view(e, inter // g, g, hd), w_up.view(e, inter // g, g, hd)],
                      dim=2).reshape(e, 2 * inter, hd).contiguous()
    w2 = (torch.randn(e, hd, inter, device=dev, generator=gen) / math.sqrt(inter)).bfloat16()
    return w_gate, w_up, w13, w2


def _inputs(v, m, dev, gen):
    """x, the routing (top-k of random logits) and its layout at v's tile height."""
    import torch

    e, k, hd = v["E"], v["k"], v["H"]
    x = torch.randn(m, hd, device=dev, generator=gen).bfloat16()
    logits = torch.randn(m, e, device=dev, generator=gen)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    topk_w = topk_w.float().contiguous()
    sorted_ids, tile_expert = build_routing(topk_ids, e, v["tile_m"])
    return x, topk_w, topk_ids, sorted_ids, tile_expert


def _check_point(v, glu, down, weights, inputs, m, repeat=0):
    """Run both kernels once on NaN-poisoned outputs and compare with the fp32 reference, every
    row; then, where ``repeat``, that many more runs back to back, each on freshly poisoned
    outputs, compared bit for bit (kernel_timing.repeat_runs; a race shows as runs that differ).
    Returns the result row (timings None) and the two kernels' launch closures."""
    import torch

    k, hd, inter, tm = v["k"], v["H"], v["I"], v["tile_m"]
    w_gate, w_up, w13, w2 = weights
    x, topk_w, topk_ids, sorted_ids, tile_expert = inputs
    dev = x.device
    r = sorted_ids.numel()
    h = torch.full((r, inter), float("nan"), dtype=torch.bfloat16, device=dev)
    y = torch.full((m * k, hd), float("nan"), dtype=torch.bfloat16, device=dev)

    tag = f"prof_{v['tag']}_{v['model']}_{m}"
    torch.cuda.nvtx.range_push(f"{tag}_glu")
    glu(x, w13, sorted_ids, tile_expert, h)
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_push(f"{tag}_down")
    down(h, w2, sorted_ids, tile_expert, topk_w, y)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()

    def rel_err(out, ref):
        out, ref = out.float(), ref.float()
        if not torch.isfinite(out).all():
            return float("inf")
        return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    def row_err(out, ref):
        """Worst row: ||out_r - ref_r|| / ||ref_r|| over every row (one wrong row fails)."""
        out, ref = out.float(), ref.float()
        if out.numel() == 0:
            return 0.0
        if not torch.isfinite(out).all():
            return float("inf")
        return ((out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-6)).max().item()

    # fp32 reference, per expert, from the same bf16 operands
    ids = sorted_ids.long()
    valid = ids >= 0
    row_expert = torch.repeat_interleave(tile_expert.long(), tm)
    used_rows = row_expert >= 0
    h_ref = torch.zeros(r, inter, device=dev)
    y_ref = torch.zeros(m * k, hd, device=dev)
    h_in = h.float()
    for ex in torch.unique(topk_ids).tolist():
        rows = torch.nonzero(valid & (row_expert == ex)).squeeze(1)
        p = ids[rows]
        xa = x[p // k].float()
        gg = xa @ w_gate[ex].float().T
        uu = xa @ w_up[ex].float().T
        act = gg * torch.sigmoid(gg) if v["act"] == "swiglu" else \
            torch.nn.functional.gelu(gg, approximate="tanh")
        h_ref[rows] = act * uu
        y_ref[p] = topk_w.view(-1)[p].unsqueeze(1) * (h_in[rows] @ w2[ex].float().T)
    pad_rows = used_rows & ~valid
    err_h = rel_err(h[valid], h_ref[valid])
    pad_ok = bool((h[pad_rows] == 0).all().item()) if pad_rows.any() else True
    err_y = rel_err(y, y_ref)
    row_h, row_y = row_err(h[valid], h_ref[valid]), row_err(y, y_ref)
    ok = err_h <= 1e-2 and pad_ok and err_y <= 1e-2 and row_h <= 3e-2 and row_y <= 3e-2
    differ = repeat_runs(repeat, glu, down, (x, w13, sorted_ids, tile_expert, h),
                         (h, w2, sorted_ids, tile_expert, topk_w, y), (h, y)) if repeat else 0
    ok = ok and differ == 0
    res = {"variant": v["tag"], "mma": v["mma"], "tile_m": tm, "glu_tiles": v["glu"],
           "down_tiles": v["down"], "model": v["model"], "tokens": m,
           "experts_used": int(torch.unique(topk_ids).numel()),
           "tiles": int((tile_expert >= 0).sum()), "T": int(tile_expert.numel()),
           "glu": {"rel_err": err_h, "padding_zero": pad_ok, "row_err_max": row_h},
           "down": {"rel_err": err_y, "row_err_max": row_y}, "ok": ok}
    if repeat:
        res["repeat"] = {"runs": repeat, "differ": differ}
    fns = (lambda: glu(x, w13, sorted_ids, tile_expert, h),
           lambda: down(h, w2, sorted_ids, tile_expert, topk_w, y))
    return res, fns


def _rates(v, res, part, us):
    """Fill res[part]'s time and its weight-byte and useful-FLOP rates."""
    m, k, hd, inter = res["tokens"], v["k"], v["H"], v["I"]
    n = 2 * inter if part == "glu" else inter
    res[part].update({"us": us, "TBps": res["experts_used"] * n * hd * 2 / us / 1e6,
                      "TFLOPs": 2 * m * k * n * hd / us / 1e6})


def _line(res):
    g, d = res["glu"], res["down"]
    return (f"{'PASS' if res['ok'] else 'FAIL'} {res['variant']:5s} {res['model']:14s} M={res['tokens']:5d} "
            f"E_used={res['experts_used']:3d} glu err {g['rel_err']:.2e}/{g['row_err_max']:.1e} "
            f"pad0 {g['padding_zero']} {g['us']:9.1f}us {g['TBps']:5.2f}TB/s {g['TFLOPs']:6.1f}TF | "
            f"down err {d['rel_err']:.2e}/{d['row_err_max']:.1e} {d['us']:9.1f}us {d['TBps']:5.2f}TB/s "
            f"{d['TFLOPs']:6.1f}TF" + (f" | repeat {res['repeat']['differ']}/{res['repeat']['runs']} differ"
                                       if "repeat" in res else ""))


def _manifest(kdir: Path, only=None, models=None):
    manifest = json.loads((kdir / "manifest.json").read_text())
    if only:  # in the order given, so that two runs can time A B and then B A
        manifest = sorted((v for v in manifest if v["tag"] in only), key=lambda v: only.index(v["tag"]))
    if models:
        manifest = [v for v in manifest if v["model"] in models]
    # one model's weights at a time: variants of a model run back to back
    order = [m[0] for m in MODELS]
    manifest.sort(key=lambda v: order.index(v["model"]))
    return manifest


def run_all(kdir: Path, out_dir: Path, iters: int, tokens=None, only=None, models=None,
            graph: bool = False, repeat: int = 0) -> int:
    import torch

    from moe_aot.harness.verify import seeded_generator as seeded
    from moe_aot.runtime.library import KernelLibrary

    torch.backends.cuda.matmul.allow_tf32 = False
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(kdir, only, models)
    dev = torch.device("cuda")
    results, failures = [], 0

    def timed_graph(fn):
        """Back-to-back CUDA-graph replays, warm L2, as tools/bench.py times a kernel alone."""
        from moe_aot.harness.measure import graph_times_us

        return sorted(graph_times_us([fn], max(iters, 20)))[max(iters, 20) // 2]

    timed = cold_l2_timer(dev, iters)
    weights_cache = {}
    for v in manifest:
        glu = KernelLibrary.from_dir(kdir / v["glu_name"])
        down = KernelLibrary.from_dir(kdir / v["down_name"])
        key = v["model"]
        if key not in weights_cache:
            weights_cache.clear()
            torch.cuda.empty_cache()
            weights_cache[key] = _weights(v, dev, seeded(dev, key))
        for m in v["tokens"]:
            if tokens and m not in tokens:
                continue
            res, (f_glu, f_down) = _check_point(v, glu, down, weights_cache[key],
                                                _inputs(v, m, dev, seeded(dev, key, m)), m, repeat)
            _rates(v, res, "glu", timed(f_glu))
            _rates(v, res, "down", timed(f_down))
            if graph:
                g_glu, g_down = timed_graph(f_glu), timed_graph(f_down)
                print(f"      graph replays (warm): glu {g_glu:9.1f}us  down {g_down:9.1f}us", flush=True)
            failures += not res["ok"]
            results.append(res)
            print(_line(res), flush=True)
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{len(results) - failures}/{len(results)} passed", flush=True)
    return 1 if failures else 0


def run_ab(kdir: Path, out_dir: Path, pair, rounds: int, replays: int, warmup_s: float, tokens=None,
           models=None, base: Path | None = None, repeat: int = 0) -> int:
    """Two configs side by side (``pair`` = (A, B)): per model and token count both run on the
    same inputs and routing and are checked; then ``rounds`` timings of each in mirrored order
    (A B B A ...), each a CUDA-graph replay of GEMM1 and GEMM2 in turn after ``warmup_s`` of
    untimed replays (the clock a sustained load runs at); per kernel the median over its
    rounds' medians, and B / A. A's binaries come from ``base`` where given (the same config
    compiled from other sources: A and B may then be one tag). Writes OUT/ab.json."""
    import statistics

    import torch

    from moe_aot.runtime.library import KernelLibrary

    torch.backends.cuda.matmul.allow_tf32 = False
    out_dir.mkdir(parents=True, exist_ok=True)
    dirs = (base or kdir, kdir)
    by = {}  # (slot 0 = A / 1 = B, model) -> the config's manifest entry
    for slot, d in enumerate(dirs):
        by.update({(slot, v["model"]): v for v in _manifest(d, [pair[slot]], models)})
    man = sorted(by.values(), key=lambda v: [m[0] for m in MODELS].index(v["model"]))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows, failures = [], 0
    for model in dict.fromkeys(v["model"] for v in man):
        if (0, model) not in by or (1, model) not in by:
            continue
        va, vb = by[(0, model)], by[(1, model)]
        if va["tile_m"] != vb["tile_m"]:
            raise SystemExit(f"--ab: {pair} have tile heights {va['tile_m']} and {vb['tile_m']}; "
                             "the pair must share one routing layout")
        torch.cuda.empty_cache()
        weights = _weights(va, dev, gen)
        libs = {t: (KernelLibrary.from_dir(dirs[t] / by[(t, model)]["glu_name"]),
                    KernelLibrary.from_dir(dirs[t] / by[(t, model)]["down_name"])) for t in (0, 1)}
        for m in va["tokens"]:
            if (tokens and m not in tokens) or m not in vb["tokens"]:
                continue
            inputs = _inputs(va, m, dev, gen)
            res, fns = {}, {}
            for t in (0, 1):
                res[t], fns[t] = _check_point(by[(t, model)], *libs[t], weights, inputs, m, repeat)
                if base and t == 0:
                    res[t]["variant"] += "@base"
            times = mirrored_rounds(fns, rounds, replays, warmup_s)
            for t in (0, 1):
                _rates(by[(t, model)], res[t], "glu", statistics.median(times[t][0]))
                _rates(by[(t, model)], res[t], "down", statistics.median(times[t][1]))
                res[t]["glu"]["rounds_us"], res[t]["down"]["rounds_us"] = times[t]
                failures += not res[t]["ok"]
                print(_line(res[t]), flush=True)
            a, b = res[0], res[1]
            row = {"model": model, "tokens": m, "tiles": a["tiles"], "a": a, "b": b,
                   "glu_b_over_a": b["glu"]["us"] / a["glu"]["us"],
                   "down_b_over_a": b["down"]["us"] / a["down"]["us"]}
            rows.append(row)
            print(f"  {b['variant']} / {a['variant']}: glu {row['glu_b_over_a']:.3f} down {row['down_b_over_a']:.3f}",
                  flush=True)
            (out_dir / "ab.json").write_text(json.dumps({"pair": pair, "base": str(base) if base else None,
                                                         "rounds": rounds, "replays": replays,
                                                         "warmup_s": warmup_s, "rows": rows}, indent=1))
    print(f"{2 * len(rows) - failures}/{2 * len(rows)} passed", flush=True)
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", metavar="DIR", type=Path)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--run", metavar="DIR", type=Path)
    ap.add_argument("--out", type=Path, default=Path("gemm_check_out"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", help="comma-separated config tags to compile or run (default: all)")
    ap.add_argument("--models", help="comma-separated model names to run (default: each config's)")
    ap.add_argument("--graph", action="store_true",
                    help="also time each kernel by back-to-back CUDA-graph replays (warm L2), as the bench does")
    ap.add_argument("--tokens", help="comma-separated token counts to run (default: each config's)")
    ap.add_argument("--ab", metavar="A,B", help="with --run: two configs of one tile height side by side on the "
                    "same inputs, timed in mirrored rounds at the sustained clock (run_ab)")
    ap.add_argument("--rounds", type=int, default=4, help="--ab: timings of each config (default 4)")
    ap.add_argument("--replays", type=int, default=20, help="--ab: graph replays of each kernel per round")
    ap.add_argument("--warmup", type=float, default=0.3, help="--ab: seconds of untimed replays before each round")
    ap.add_argument("--base", metavar="DIR", type=Path,
                    help="--ab: config A's binaries from DIR (the same config compiled from other sources)")
    ap.add_argument("--repeat", type=int, default=0,
                    help="with --run: after each check, that many more runs compared bit for bit with the first")
    ns = ap.parse_args()
    if ns.compile:
        compile_all(ns.compile, ns.arch, ns.only.split(",") if ns.only else None)
    if ns.run and ns.ab:
        pair = ns.ab.split(",")
        if len(pair) != 2:
            ap.error(f"--ab takes two config tags A,B, not {ns.ab!r}")
        sys.exit(run_ab(ns.run, ns.out, pair, ns.rounds, ns.replays, ns.warmup,
                        [int(t) for t in ns.tokens.split(",")] if ns.tokens else None,
                        ns.models.split(",") if ns.models else None, ns.base, ns.repeat))
    if ns.run:
        sys.exit(run_all(ns.run, ns.out, ns.iters,
                         [int(t) for t in ns.tokens.split(",")] if ns.tokens else None,
                         ns.only.split(",") if ns.only else None,
                         ns.models.split(",") if ns.models else None, ns.graph, ns.repeat))
    if not ns.compile and not ns.run:
        ap.error("give --compile DIR and/or --run DIR")


if __name__ == "__main__":
    main()

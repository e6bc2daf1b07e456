#!/usr/bin/env python3
"""Benchmark of the fp8 layers on the GPU beside our bf16 layer (not a test).

For every fp8-capable model × token count and each fp8 precision: the whole layer (routing and
x's quantization included) replayed from CUDA graphs over several input sets, as tools/bench.py
times the bf16 layer; our bf16 layer on the same bf16 weights in the same run; the fp8 floor
max(FLOPs / fp8 matmul rate measured in this run (torch._scaled_mm, e4m3, 8192^3), bytes / the
GPU's HBM rate (tools/bench.py's HBM_BYTES_PER_S: 4.8 TB/s on an H200)) with the selected experts'
weights at one byte per element plus their scales and the bf16
activations in and out, and beside it the same floor with the fp8 matmul timed after
SUSTAINED_MATMUL_S of back-to-back fp8 matmuls (`x sust.`: the clock the H200 holds under a large
layer, its power cap, as tools/bench.py does for bf16); each kernel alone; the error against the
fp32 reference of the fp8 math (what the kernels must match, <= 1e-2) and against the bf16 layer's
reference of the unquantized weights (what fp8 costs, reported).

    python3 tools/bench_fp8.py --out DIR [--models a,b] [--tokens 1,16,...] [--replays 50]

Writes DIR/bench_fp8_<card>.json and DIR/bench_fp8_<card>.md (<card>: bench.card_tag, e.g. h200).
Needs the fp8 and bf16 kernels of the models in the database (`moe-aot build --precision fp8 ...`,
`--precision fp8-block128`, bf16).
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
from bench import SUSTAINED_MATMUL_S, WARMUP_S, card_tag, floor_us, graph_time_us, hbm_bytes_per_s, matmul_rate, run_for  # noqa: E402

from moe_aot.gemm_limits import FP8, SCALE_BLOCK  # noqa: E402
from moe_aot.harness.measure import graph_times_us, input_sets  # noqa: E402
from moe_aot.harness.reference import moe_reference, rel_err  # noqa: E402
from moe_aot.harness.verify import served_reference  # noqa: E402
from moe_aot.layout import interleave_gate_up  # noqa: E402
from moe_aot.runtime.layer import MoeLayer, prepare_fp8_weights  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.spec import SpecError, make_spec  # noqa: E402

MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b")
TOKENS = (1, 16, 256, 1024, 4096)


def fp8_matmul_rate(warmup_s: float = 0.0) -> float:
    """torch._scaled_mm (e4m3 x e4m3 -> bf16, per-tensor scales) at 8192^3, FLOP/s; warmup_s > 0:
    timed after that many seconds of back-to-back ones (the sustained clock), else after three."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    run_for(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), warmup_s)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return 2 * n ** 3 / statistics.median(times)


def kernel_times(layer, M, replays, spec, selected, weight_bytes_per_elem) -> dict:
    out = {}
    hi = spec.hidden * spec.intermediate
    work = {"glu": (4 * M * spec.top_k * hi, selected * 2 * hi * weight_bytes_per_elem),
            "down": (2 * M * spec.top_k * hi, selected * hi * weight_bytes_per_elem),
            "decode": (6 * M * spec.top_k * hi, selected * 3 * hi * weight_bytes_per_elem)}  # the whole layer
    for role, k in layer.launchers(M).items():
        us = statistics.median(graph_times_us([lambda k=k: k(torch.cuda.current_stream().cuda_stream)], replays))
        row = {"us": round(us, 2)}
        if role in work:
            row.update(tflops=round(work[role][0] / us / 1e6, 1), weight_tbps=round(work[role][1] / us / 1e6, 2))
        out[role] = row
    return out


def time_layer(layer, w13, w2, sets, M, replays) -> float:
    ws = layer.workspace(M)
    # after bench.py's untimed replays, as its layer timings: each layer here is timed right after
    # its fp32 references, and without them the first timing read up to 13% slower than the same
    # kernel in bench.py (2026-12-05: the bf16 layer at 1 token, 187 against 165 us)
    return graph_time_us([lambda s=s: layer.forward(s[0], w13, w2, s[1], s[2], out=s[3], workspace=ws)
                          for s in sets], replays, WARMUP_S)


def bench_model(name, tokens_list, replays, rate8, store, rate8_sustained) -> list[dict]:
    bf = make_spec(name, target="sm_90a")
    e, h, i = bf.experts, bf.hidden, bf.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = (torch.randn(e, i, h, device="cuda", generator=gen) / h ** 0.5).bfloat16()
    up = (torch.randn(e, i, h, device="cuda", generator=gen) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / i ** 0.5).bfloat16()
    w13 = interleave_gate_up(gate, up)
    layers = {"bf16": (MoeLayer(bf, store), w13, w2)}
    for p in FP8:
        spec = make_spec(name, precision=p, target="sm_90a")
        layers[p] = (MoeLayer(spec, store),) + prepare_fp8_weights(gate, up, w2, p)
    del gate, up
    rows = []
    for M in tokens_list:
        sets = input_sets(bf, M, torch.device("cuda"))
        selected = statistics.mean(int(torch.unique(s[2]).numel()) for s in sets)
        x, tw, ids, out = sets[0]
        ref_bf16 = moe_reference(x, w13, w2, tw, ids, bf.activation)
        times = {}
        row = {"model": name, "tokens": M, "experts_selected": selected}
        for p, (layer, a, b) in layers.items():
            out.fill_(float("nan"))
            layer.forward(x, a, b, tw, ids, out=out)
            err = rel_err(out, served_reference(layer, x, a, b, tw, ids))  # the four kernels' or the decode kernel's
            err_bf16 = rel_err(out, ref_bf16)
            t = time_layer(layer, a, b, sets, M, replays)
            times[p] = t
            eb = 2 if p == "bf16" else 1
            flops = 6 * M * bf.top_k * h * i
            scales = 0 if p != "fp8-block128" else selected * 3 * h * i // SCALE_BLOCK ** 2 * 4
            bytes_ = selected * 3 * h * i * eb + scales + 2 * M * h * 2
            entry = {"us": round(t, 2), "rel_err": err, "rel_err_vs_bf16_ref": err_bf16,
                     "variant": layer.served(M).name(layer.spec),
                     "kernels": kernel_times(layer, M, replays, layer.spec, selected, eb)}
            if p != "bf16":
                floor, floor_s = floor_us(flops, bytes_, rate8), floor_us(flops, bytes_, rate8_sustained)
                entry.update(floor_us=round(floor, 2), over_floor=round(t / floor, 3),
                             floor_sustained_us=round(floor_s, 2), over_sustained_floor=round(t / floor_s, 3),
                             bf16_over_this=round(times["bf16"] / t, 3))
            row[p] = entry
        del ref_bf16
        rows.append(row)
        print(f"{name:16} M={M:6} bf16 {times['bf16']:9.1f} us | " + " | ".join(
            f"{p} {row[p]['us']:9.1f} us floor {row[p]['floor_us']:8.1f} x{row[p]['over_floor']:.2f} "
            f"bf16/fp8 {row[p]['bf16_over_this']:.2f} err {row[p]['rel_err']:.1e} vs-bf16 "
            f"{row[p]['rel_err_vs_bf16_ref']:.1e}" for p in FP8), flush=True)
    del layers, w13, w2
    torch.cuda.empty_cache()
    return rows


def _kernel_cell(k: dict) -> str:
    """GEMM1, GEMM2 µs (TFLOP/s) of the four-kernel layer, or the one-launch decode kernel's, named."""
    if "glu" in k:
        return f"{k['glu']['us']:.0f} ({k['glu']['tflops']:.0f}), {k['down']['us']:.0f} ({k['down']['tflops']:.0f})"
    return ", ".join(f"{role} {v['us']:.0f} ({v['tflops']:.0f})" for role, v in k.items())


def markdown(result: dict) -> str:
    lines = [f"# FP8 fused MoE layers on {result['device']} ({result['date']})", "",
             f"Command: `{result['command']}`; fp8 matmul rate measured in the run (torch._scaled_mm, "
             f"8192^3): {result['fp8_matmul_tflops']:.0f} TFLOP/s, bf16 {result['bf16_matmul_tflops']:.0f}; "
             f"after {SUSTAINED_MATMUL_S:g} s of fp8 matmuls {result['fp8_matmul_sustained_tflops']:.0f}; "
             f"HBM {result.get('hbm_tbps', 4.8):g} TB/s. Medians of CUDA-graph replays (µs). "
             "`x floor`: time over the fp8 floor; "
             "`x sust.`: over the floor at the sustained fp8 matmul rate; "
             "`bf16/fp8`: our bf16 layer's time over this one's (same weights, same run); `err`: against "
             "the fp32 reference of the fp8 math; `vs bf16`: against the bf16 layer's reference "
             "(what fp8 costs).", "",
             "| model | tokens | bf16 µs | fp8 µs | x floor | x sust. | bf16/fp8 | err | vs bf16 | GEMM1, GEMM2 µs "
             "(TFLOP/s) | fp8-block128 µs | x floor | x sust. | bf16/fp8 | err | vs bf16 | GEMM1, GEMM2 µs "
             "(TFLOP/s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [r["model"], str(r["tokens"]), f"{r['bf16']['us']:.1f}"]
        for p in FP8:
            x = r[p]
            k = x["kernels"]
            cells += [f"{x['us']:.1f}", f"{x['over_floor']:.2f}", f"{x['over_sustained_floor']:.2f}",
                      f"{x['bf16_over_this']:.2f}", f"{x['rel_err']:.1e}",
                      f"{x['rel_err_vs_bf16_ref']:.1e}", _kernel_cell(k)]
        lines.append("| " + " | ".join(cells) + " |")
    g = result["summary"]
    lines += [""] + [f"{p}: geomean bf16/fp8 {g[p]['geomean_bf16_over_fp8']:.2f} (<= 256 tokens "
                     f"{g[p]['small_bf16_over_fp8']:.2f}, >= 4096 {g[p]['large_bf16_over_fp8']:.2f}); geomean x floor "
                     f"{g[p]['geomean_over_floor']:.2f} (sustained {g[p]['geomean_over_sustained_floor']:.2f}); "
                     f"max err {g[p]['max_rel_err']:.1e}" for p in FP8]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--replays", type=int, default=50)
    ns = ap.parse_args()
    hbm_bytes_per_s()  # a GPU without a known HBM rate has no floor: refused before anything runs
    for m in ns.models.split(","):
        try:
            make_spec(m, precision="fp8")
        except SpecError as exc:
            ap.error(f"--models: {m}: {exc}")
    torch.manual_seed(0)
    store = KernelStore()
    rate8, rate16 = fp8_matmul_rate(), matmul_rate()[0]
    rate8_s = fp8_matmul_rate(SUSTAINED_MATMUL_S)
    print(f"8192^3 matmul: fp8 {rate8 / 1e12:.0f} TFLOP/s (after {SUSTAINED_MATMUL_S:g} s: {rate8_s / 1e12:.0f}), "
          f"bf16 {rate16 / 1e12:.0f}", flush=True)
    rows, t0 = [], time.time()
    for name in ns.models.split(","):
        rows += bench_model(name, [int(t) for t in ns.tokens.split(",")], ns.replays, rate8, store, rate8_s)
    geo = lambda xs: math.exp(statistics.mean(math.log(v) for v in xs)) if xs else float("nan")  # noqa: E731
    summary = {p: {"geomean_bf16_over_fp8": geo([r[p]["bf16_over_this"] for r in rows]),
                   "small_bf16_over_fp8": geo([r[p]["bf16_over_this"] for r in rows if r["tokens"] <= 256]),
                   "large_bf16_over_fp8": geo([r[p]["bf16_over_this"] for r in rows if r["tokens"] >= 4096]),
                   "geomean_over_floor": geo([r[p]["over_floor"] for r in rows]),
                   "geomean_over_sustained_floor": geo([r[p]["over_sustained_floor"] for r in rows]),
                   "max_rel_err": max(r[p]["rel_err"] for r in rows)} for p in FP8}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "command": "python3 tools/bench_fp8.py " + " ".join(sys.argv[1:]),
              "fp8_matmul_tflops": rate8 / 1e12, "fp8_matmul_sustained_tflops": rate8_s / 1e12,
              "bf16_matmul_tflops": rate16 / 1e12, "hbm_tbps": hbm_bytes_per_s() / 1e12,
              "seconds": round(time.time() - t0, 1), "rows": rows, "summary": summary}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_fp8_{card_tag()}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Benchmark of the whole fused MoE layer on the GPU (not a test).

For every model × token count of the benchmark matrix: our layer (routing included) replayed from
CUDA graphs, the unfused PyTorch path (permutation + torch._grouped_mm + SiLU·up + torch._grouped_mm
+ routing-weight multiply + index_add_) replayed the same way, and the roofline floor
max(FLOPs / bf16 matmul rate measured in this run, bytes / the GPU's HBM rate: 4.8 TB/s on an H200,
3.35 on an H100, HBM_BYTES_PER_S). Several input sets with
different routings are replayed in turn so that consecutive replays do not find the previous
one's experts in L2; every row is checked against the fp32 reference. Beside that floor, the
same with the matmul timed after SUSTAINED_MATMUL_S of matmuls (`ours/sustained floor`): the
clock the H200 sustains under a large layer (its power cap) is ~24% below the burst's 1980 MHz.

    python3 tools/bench.py --out DIR [--models a,b] [--tokens 1,16,...] [--replays 100] [--pdl]
                           [--alts default,default_pdl] [--peers peers_h200.json]

--pdl also checks and times, at every point and in the same run, the twin of our variant with
programmatic dependent launch flipped (build the database with `moe-aot build --pdl-twins`).
--alts times other variants beside the one served: `default` (the documented default of the
bucket, when the served variant is a tuned pick), `default_pdl` (its PDL twin). Each alternative
and the served variant are timed the same way (the tuner's: harness.measure.measure_variant after
SUSTAINED_WARMUP_S of untimed replays) in the order S A A S, and the column is the ratio of the
medians of those two pairs, not of the alternative to the headline time.
Per row also the GPU's state while ours ran (SM clock and power, medians of NVML samples, and the
energy per layer from the board's energy counter over ENERGY_S of further replays), and the same
energy for the unfused path: at the large points the H200 runs at its software power cap, where
fewer joules per layer is what buys clock (NOTES, 2026-12-03, call 7).
Per row also: each grouped GEMM alone (a CUDA graph of that one kernel on the row's first
input set), as µs, TFLOP/s of useful (routed) FLOPs and TB/s of the selected experts' weights;
with --peers, the ratio of the peer's (vLLM's) time at that point to ours.

Writes DIR/bench_<card>.json and DIR/bench_<card>.md, <card> the GPU's short name (card_tag: h200,
h100, ...).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.database import SUSTAINED_WARMUP_S  # noqa: E402
from moe_aot.harness.gpustate import Nvml, Sampler  # noqa: E402
from moe_aot.harness.measure import graph_times_us, input_sets, measure_variant, timed_graphs  # noqa: E402
from moe_aot.harness.reference import glu_fn, rel_err  # noqa: E402
from moe_aot.harness.verify import random_weights, served_reference  # noqa: E402
from moe_aot.layout import split_gate_up  # noqa: E402
from moe_aot.perfmodel import device_of  # noqa: E402
from moe_aot.runtime.layer import MoeLayer, split_biases  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.spec import BENCH_TOKENS, PRESETS, make_spec  # noqa: E402
from moe_aot.variants import default_variant  # noqa: E402

# The floor's memory rate per GPU (torch.cuda.get_device_name()): the datasheet's HBM bandwidth, as
# the performance model holds it (moe_aot/perfmodel.py), for the cards this benchmark has run on.
HBM_BYTES_PER_S = {gpu: device_of(gpu).dram_bytes_s for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")}
SUSTAINED_MATMUL_S = 2.0  # matmuls before the sustained-clock timing of the floor's matmul (tools/matmul_clock.py)


def hbm_bytes_per_s(gpu: str | None = None) -> float:
    """The HBM rate of `gpu` (default: this process's GPU) for the floor; a GPU without one is refused."""
    gpu = gpu or torch.cuda.get_device_name()
    if gpu not in HBM_BYTES_PER_S:
        raise SystemExit(f"no HBM rate known for {gpu!r}, so no floor; known GPUs: {', '.join(HBM_BYTES_PER_S)} "
                         "(add it to tools/bench.py's HBM_BYTES_PER_S, its rate to moe_aot/perfmodel.py)")
    return HBM_BYTES_PER_S[gpu]


def card_tag(gpu: str | None = None) -> str:
    """The GPU's short name in the result files' names (default: this process's GPU): the first word
    after the vendor, lower case, e.g. 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    gpu = gpu or torch.cuda.get_device_name()
    words = gpu.split()
    if words and words[0].upper() == "NVIDIA":
        words = words[1:]
    tag = "".join(c for c in (words[0] if words else "").lower() if c.isalnum())
    if not tag:
        raise SystemExit(f"cannot name result files after the GPU {gpu!r}: its name has no model word")
    return tag


def floor_us(flops: float, bytes_: float, rate: float, hbm: float | None = None) -> float:
    """The roofline floor (µs): the FLOPs at matmul rate `rate` (FLOP/s) or the bytes at the HBM rate
    `hbm` (bytes/s; default: this GPU's, hbm_bytes_per_s), whichever takes longer."""
    return max(flops / rate, bytes_ / (hbm or hbm_bytes_per_s())) * 1e6


def run_for(fn, seconds: float) -> None:
    """Launch fn back to back, eight at a time between syncs, for about `seconds` (untimed: the
    load under which the GPU settles at the clock it sustains)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            fn()
        torch.cuda.synchronize()


def matmul_rate(nvml=None, warmup_s: float = 0.0) -> tuple[float, dict]:
    """FLOP/s of torch's bf16 8192^3 matmul, and the GPU's clocks and power during the timed ones;
    warmup_s > 0: after that many seconds of back-to-back matmuls (the clock the GPU sustains, as
    the tuner times candidates), else after three (the burst rate the floor has used)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    run_for(lambda: a @ b, warmup_s)
    times = []
    with Sampler(nvml) if nvml else contextlib.nullcontext() as sampler:
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
    return 2 * 8192 ** 3 / statistics.median(times), sampler.summary(10) if sampler else {}


def torch_unfused(x, w_gate_up_t, w2_t, tw, ids, experts, glu=None, b_gate_up=None, b2=None):
    """The unfused PyTorch path most model code runs (grouped GEMMs from torch itself); glu(g, u)
    (default SwiGLU) and the expert biases [E, 2I] (gate half first) / [E, H] as the layer has them."""
    M, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.zeros(experts, device=x.device, dtype=torch.int64)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))  # bincount would sync
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = x[tok]
    gu = torch._grouped_mm(a, w_gate_up_t, offs=offs)
    e_sorted = flat[order].long()
    if b_gate_up is not None:
        gu = gu + b_gate_up[e_sorted]
    g, u = gu.chunk(2, dim=-1)
    h = torch.nn.functional.silu(g) * u if glu is None else glu(g.float(), u.float()).to(g.dtype)
    y = torch._grouped_mm(h, w2_t, offs=offs)
    if b2 is not None:
        y = y + b2[e_sorted]
    y = y * tw.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    out = torch.zeros(M, x.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y.float())
    return out.to(torch.bfloat16)


WARMUP_S = 0.25  # untimed replays before each point's first timing (the clocks after the previous point)
ENERGY_S = 0.5  # after the timed replays, this long again with the board's energy counter and clocks read


def graph_time_us(fns, replays: int, warmup_s: float = 0.0) -> float:
    return statistics.median(graph_times_us(fns, replays, warmup_s))


def gemm_times(layer, M, replays: int, spec, selected: float) -> dict:
    """GEMM1 and GEMM2 each alone, replayed from a CUDA graph on the last forward's arguments
    (where the one-launch decode kernel served M: that kernel, the whole layer's weights)."""
    kernels = layer.launchers(M)
    if "decode" in kernels:
        k = kernels["decode"]
        us = statistics.median(graph_times_us([lambda k=k: k(torch.cuda.current_stream().cuda_stream)], replays))
        return {"decode": {"us": round(us, 2), "weight_tbps": round(selected * 3 * spec.hidden * spec.intermediate * 2
                                                                    / us / 1e6, 2)}}
    out = {}
    for role, flops, weights in (("glu", 4 * M * spec.top_k * spec.hidden * spec.intermediate,
                                  selected * 2 * spec.hidden * spec.intermediate * 2),
                                 ("down", 2 * M * spec.top_k * spec.hidden * spec.intermediate,
                                  selected * spec.hidden * spec.intermediate * 2)):
        k = kernels[role]
        us = statistics.median(graph_times_us(
            [lambda k=k: k(torch.cuda.current_stream().cuda_stream)], replays))
        out[role] = {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                     "weight_tbps": round(weights / us / 1e6, 2)}
    return out


def time_alt(layer, variant, served, M, w13, w2, replays, sets) -> dict:
    """`variant` beside the served one, both timed by measure_variant in the order S A A S on the
    same input sets; over_ours is median(A) / median(S) of those four timings."""
    try:
        times = {"S": [], "A": []}
        for tag in "SAAS":
            m = measure_variant(layer, served if tag == "S" else variant, M, w13, w2, replays, sets,
                                warmup_s=SUSTAINED_WARMUP_S)
            if not m["ok"]:
                return {"variant": variant.name(layer.spec) if tag == "A" else f"served {served.name(layer.spec)}",
                        "rel_err": m["rel_err"], "us": None, "over_ours": None}
            times[tag].append(m["median_us"])
        a, s = statistics.median(times["A"]), statistics.median(times["S"])
        return {"variant": variant.name(layer.spec), "rel_err": m["rel_err"], "us": round(a, 2),
                "served_us": round(s, 2), "over_ours": round(a / s, 3)}
    except Exception as exc:  # kernels not in the database, launch failure: reported
        return {"variant": variant.name(layer.spec), "error": f"{type(exc).__name__}: {exc}"[:300]}


def _out_of_memory(exc) -> None:
    print(f"  torch's unfused path: out of memory ({str(exc)[:120]})", flush=True)
    gc.collect()
    torch.cuda.empty_cache()


def torch_err(spec, x, w_gu_t, w2_t, tw, ids, unfused_kw, ref):
    """The unfused PyTorch path's relative error against our layer's reference (None: out of memory)."""
    try:
        return rel_err(torch_unfused(x, w_gu_t, w2_t, tw, ids, spec.experts, **unfused_kw), ref)
    except torch.OutOfMemoryError as exc:
        _out_of_memory(exc)
        return None


def torch_times(spec, sets, w_gu_t, w2_t, unfused_kw, replays, nvml):
    """The unfused PyTorch path replayed on the same input sets: (median µs, GPU state), or
    (None, None) where it does not fit in the GPU's memory beside our layer (DeepSeek-V3 at 16384
    tokens on an 80 GB H100: its transposed weight copies and its graphs' activations)."""
    gc.collect()  # our layer's graphs and their private memory pools
    torch.cuda.empty_cache()
    try:
        theirs, t_state = timed_graphs([lambda s=s: torch_unfused(s[0], w_gu_t, w2_t, s[1], s[2], spec.experts,
                                                                  **unfused_kw)
                                        for s in sets], replays, 0.0, nvml, ENERGY_S)
        return statistics.median(theirs), t_state
    except torch.OutOfMemoryError as exc:
        _out_of_memory(exc)
        return None, None


def bench_model(name: str, tokens_list, replays: int, rate: float, store, pdl: bool = False,
                alts=(), peers=None, nvml=None, rate_sustained: float | None = None) -> list[dict]:
    spec = make_spec(name, target="sm_90a")
    layer = MoeLayer(spec, store)
    dev = layer.device
    w13, w2 = random_weights(spec, dev)  # (weights, biases) pairs for gpt-oss (bias=True)
    W13, b13, W2, b2 = split_biases(spec, w13, w2)
    gate, up = split_gate_up(W13)
    w_gu_t = torch.cat([gate, up], dim=1).transpose(1, 2)  # [E, H, 2I] view of an [E, 2I, H] tensor
    w2_t = W2.transpose(1, 2)  # [E, I, H]
    b_gu = None if b13 is None else torch.cat(split_gate_up(b13.unsqueeze(-1)), dim=1).squeeze(-1)
    unfused_kw = dict(glu=glu_fn(spec.activation), b_gate_up=b_gu, b2=b2)
    rows = []
    for M in tokens_list:
        sets = input_sets(spec, M, dev)
        layer.workspace(M)
        # correctness of this very configuration, on the first set, poisoned output
        x, tw, ids, out = sets[0]
        out.fill_(float("nan"))
        layer.forward(x, w13, w2, tw, ids, out=out)
        ref = served_reference(layer, x, w13, w2, tw, ids)  # the four kernels', or the decode kernel's
        err = rel_err(out, ref)
        t_err = torch_err(spec, x, w_gu_t, w2_t, tw, ids, unfused_kw, ref)
        del ref
        # the model's tensors bound as defaults: they are deleted (del below) once the model is done
        ours, state = timed_graphs([lambda s=s, lay=layer, w=(w13, w2): lay.forward(s[0], *w, s[1], s[2], out=s[3],
                                                                                  workspace=lay.workspace(M))
                                    for s in sets], replays, WARMUP_S, nvml, ENERGY_S)
        ours = statistics.median(ours)
        selected = statistics.mean(int(torch.unique(s[2]).numel()) for s in sets)
        # each GEMM alone, right after the layer's replays (the same sustained clock state)
        gemms = gemm_times(layer, M, replays, spec, selected)
        theirs, t_state = torch_times(spec, sets, w_gu_t, w2_t, unfused_kw, replays, nvml)
        flops = 6 * M * spec.top_k * spec.hidden * spec.intermediate
        bytes_ = selected * 3 * spec.hidden * spec.intermediate * 2 + 2 * M * spec.hidden * 2
        floor = floor_us(flops, bytes_, rate)
        row = {"model": name, "tokens": M, "ours_us": round(ours, 2), "floor_us": round(floor, 2),
               "torch_us": theirs and round(theirs, 2), "rel_err": err, "torch_rel_err": t_err,
               "ours_over_floor": round(ours / floor, 3), "torch_over_ours": theirs and round(theirs / ours, 3),
               "variant": layer.served(M).name(spec), "experts_selected": selected}
        row["gemms"] = gemms
        if rate_sustained:  # the same floor with the matmul's rate at the clock the GPU sustains
            floor_s = floor_us(flops, bytes_, rate_sustained)
            row.update(floor_sustained_us=round(floor_s, 2), ours_over_sustained_floor=round(ours / floor_s, 3))
        if state:
            row["gpu_state"], row["torch_gpu_state"] = state, t_state
        peer = (peers or {}).get((name, M))
        if peer:
            row["vllm_us"] = peer
            row["vllm_over_ours"] = round(peer / ours, 3)
        served = layer.served(M)
        dflt = default_variant(spec, M)
        for alt in alts:
            v = {"default": dflt, "default_pdl": dflt.pdl_twin()}[alt]
            if v == served:
                continue
            row.setdefault("alts", {})[alt] = a = time_alt(layer, v, served, M, w13, w2, replays, sets)
            print(f"  {alt} {a['variant']}: {a.get('us')} us beside {a.get('served_us')} ({a.get('over_ours')} of ours)"
                  f"{', ' + a['error'] if 'error' in a else ''}", flush=True)
        if pdl and served == layer.variant_for(M):  # the one-launch decode kernel has no PDL twin
            twin = served.pdl_twin()
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
        print(f"{name:16} M={M:6} ours {ours:9.1f} us  floor {floor:9.1f}  torch {theirs or float('nan'):9.1f}  "
              f"ours/floor {ours / floor:5.2f}  torch/ours {(theirs or float('nan')) / ours:5.2f}  err {err:.1e}",
              flush=True)
    del w13, w2, W13, W2, layer
    torch.cuda.empty_cache()
    return rows


def _state_text(state, *keys) -> str:
    """`SM MHz, W, mJ per layer` of a row's GPU readings ("-" where not read)."""
    keys = keys or ("sm_mhz", "counter_w", "mj_per_replay")
    if not state:
        return "-"
    return ", ".join("-" if state.get(k) is None else f"{state[k]:.4g}" for k in keys)


def markdown(result: dict) -> str:
    lines = [f"# Fused MoE layer on {result['device']} ({result['date']})", "",
             f"Command: `{result['command']}`; bf16 matmul rate measured in the run: "
             f"{result['matmul_tflops']:.0f} TFLOP/s{_matmul_clock(result)}; HBM {result['hbm_tbps']:g} TB/s. "
             "Times are medians of CUDA-graph replays (µs); ratios below 1 in `torch/ours` mean PyTorch was "
             "faster. `SM MHz, W, mJ`: "
             f"over {ENERGY_S} s of further replays of ours, the SM clock (median of NVML samples every 20 ms), "
             "the board power and the energy per layer (both from the board's energy counter); `torch mJ`: the "
             "same energy of the unfused path.", "",
             "| model | tokens | ours µs | floor µs | ours/floor | ours/sustained floor | torch µs | torch/ours "
             "| vLLM/ours | rel err | GEMM1 µs, TFLOP/s, TB/s | GEMM2 µs, TFLOP/s, TB/s | SM MHz, W, mJ | torch mJ "
             "| variant |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    twins = any("twin_variant" in r for r in result["rows"])
    if twins:
        lines[-2] += " PDL-flipped twin µs | twin/ours | twin rel err |"
        lines[-1] += "---|---|---|"
    for r in result["rows"]:
        gm = r.get("gemms", {})
        gtxt = [f"{gm[k]['us']:.0f}, {gm[k]['tflops']:.0f}, {gm[k]['weight_tbps']:.2f}" if k in gm else "-"
                for k in ("glu", "down")]
        line = (f"| {r['model']} | {r['tokens']} | {r['ours_us']:.1f} | {r['floor_us']:.1f} | "
                f"{r['ours_over_floor']:.2f} | {r.get('ours_over_sustained_floor', float('nan')):.2f} | "
                f"{_num(r['torch_us'], '.1f')} | {_num(r['torch_over_ours'], '.2f')} | "
                f"{_num(r.get('vllm_over_ours'), '.2f', '-')} | {r['rel_err']:.1e} | {gtxt[0]} | {gtxt[1]} | "
                f"{_state_text(r.get('gpu_state'))} | {_state_text(r.get('torch_gpu_state'), 'mj_per_replay')} | "
                f"`{r['variant'].split('_', 6)[-1]}` |")
        if twins:
            ok = r.get("twin_us") is not None
            err = r.get("twin_rel_err")
            line += ((f" {r['twin_us']:.1f} | {r['twin_over_ours']:.3f} |" if ok else
                      f" {r.get('twin_error', 'wrong result')[:60]} | - |")
                     + (f" {err:.1e} |" if err is not None else " - |"))
        lines.append(line)
    g = result["summary"]
    if "geomean_vllm_over_ours" in g:
        lines += ["", f"vLLM fused_moe (../shared/bench/peers_h200.json, measured 2026-12-01 08:05 on this H200 "
                  f"model) over ours: geomean {g['geomean_vllm_over_ours']:.3f}; we are faster at "
                  f"{g['points_faster_than_vllm']} of {g['points_with_vllm']} points."]
    alts = sorted({a for r in result["rows"] for a in r.get("alts", {})})
    for a in alts:
        lines += ["", f"`{a}` over the served variant, both timed as the tuner times them, S A A S (same run): "
                  + "; ".join(f"{r['model']} {r['tokens']}: {r['alts'][a].get('over_ours')}"
                              for r in result["rows"] if a in r.get("alts", {}))]
    if "geomean_ours_over_sustained_floor" in g:
        lines += ["", f"`ours/sustained floor`: the floor with the matmul timed after {SUSTAINED_MATMUL_S:g} s of "
                  f"matmuls ({result['matmul_sustained_tflops']:.0f} TFLOP/s{_matmul_clock(result, 'sustained')}), "
                  "the clock a large layer runs at under the power cap; geomean "
                  f"{g['geomean_ours_over_sustained_floor']:.2f}."]
    lines += ["", f"Geometric mean ours/floor {g['geomean_ours_over_floor']:.2f}; "
              f"geometric mean torch/ours {g['geomean_torch_over_ours']:.2f}; max rel err {g['max_rel_err']:.1e}."]
    oom = [f"{r['model']} {r['tokens']}" for r in result["rows"] if r.get("torch_us", 0) is None]
    if oom:
        lines[-1] += (" The unfused path did not fit in the GPU's memory (OOM, left out of its geomean) at "
                      f"{', '.join(oom)}.")
    if "geomean_torch_over_ours_energy" in g:
        lines[-1] += f" Energy per layer, torch/ours: geomean {g['geomean_torch_over_ours_energy']:.2f}."
    return "\n".join(lines) + "\n"


def _num(v, fmt: str, missing: str = "OOM") -> str:
    """A table cell: the number, or `missing` (the unfused path's: it did not fit in memory)."""
    return missing if v is None else format(v, fmt)


def _matmul_clock(result, which: str = "") -> str:
    st = result.get(f"matmul_{which + '_' if which else ''}gpu_state") or {}
    return f" at {st['sm_mhz']:.0f} MHz, {st.get('power_w', float('nan')):.0f} W" if "sm_mhz" in st else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--models", default=",".join(PRESETS))
    ap.add_argument("--tokens", default=",".join(map(str, BENCH_TOKENS)))
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--pdl", action="store_true", help="also time each point's twin with PDL flipped")
    ap.add_argument("--alts", default="", help="also time these variants beside ours: default,default_pdl")
    ap.add_argument("--peers", default=None, help="peer timings (../shared/bench/peers_h200.json) for vllm_over_ours")
    ns = ap.parse_args()
    hbm_bytes_per_s()  # a GPU without a known HBM rate has no floor: refused before anything runs
    peers = None
    if ns.peers:
        peers = {(r["model"], r["tokens"]): r["vllm_us"] for r in json.loads(Path(ns.peers).read_text())["rows"]}
    torch.manual_seed(0)
    store = KernelStore()
    nvml = Nvml.of_torch_device(torch.cuda.current_device())
    rate, mm_state = matmul_rate(nvml)
    print(f"bf16 8192^3 matmul: {rate / 1e12:.0f} TFLOP/s {mm_state}", flush=True)
    rate_s, mm_state_s = matmul_rate(nvml, warmup_s=SUSTAINED_MATMUL_S)
    print(f"bf16 8192^3 matmul after {SUSTAINED_MATMUL_S} s: {rate_s / 1e12:.0f} TFLOP/s {mm_state_s}", flush=True)
    rows = []
    t0 = time.time()
    for name in ns.models.split(","):
        rows += bench_model(name, [int(t) for t in ns.tokens.split(",")], ns.replays, rate, store, ns.pdl,
                            [a for a in ns.alts.split(",") if a], peers, nvml, rate_s)
    geo = lambda xs: math.exp(statistics.mean(math.log(v) for v in xs))  # noqa: E731
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
        "command": "python3 tools/bench.py " + " ".join(sys.argv[1:]), "matmul_tflops": rate / 1e12,
        "hbm_tbps": hbm_bytes_per_s() / 1e12, "seconds": round(time.time() - t0, 1), "matmul_gpu_state": mm_state,
        "matmul_sustained_tflops": rate_s / 1e12, "matmul_sustained_gpu_state": mm_state_s,
        "rows": rows,
        "summary": {"geomean_ours_over_floor": geo([r["ours_over_floor"] for r in rows]),
                    "geomean_torch_over_ours": geo([r["torch_over_ours"] for r in rows if r["torch_over_ours"]]),
                    "max_rel_err": max(r["rel_err"] for r in rows),
                    "geomean_ours_over_sustained_floor": geo([r["ours_over_sustained_floor"] for r in rows])},
    }
    mj = [(r["torch_gpu_state"]["mj_per_replay"], r["gpu_state"]["mj_per_replay"]) for r in rows
          if "mj_per_replay" in r.get("gpu_state", {}) and "mj_per_replay" in (r.get("torch_gpu_state") or {})]
    if mj:
        result["summary"]["geomean_torch_over_ours_energy"] = geo([t / o for t, o in mj if o > 0 and t > 0])
    vl = [r["vllm_over_ours"] for r in rows if "vllm_over_ours" in r]
    if vl:
        result["summary"].update(geomean_vllm_over_ours=geo(vl), points_faster_than_vllm=sum(v > 1 for v in vl),
                                 points_with_vllm=len(vl))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{card_tag()}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

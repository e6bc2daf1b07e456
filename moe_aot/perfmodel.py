"""A performance model of the fused layer: predicted time of a variant from its bytes and FLOPs
at a device's limits, for targets nobody here can measure (the DGX Spark's GB10, B200) and to
order the tuner's candidates before a GPU sees them.

Per grouped GEMM (GEMM1: N = 2I, K = H; GEMM2: N = H, K = I), with P = tokens * top_k routed
pairs over U = E (1 - (1 - top_k / E)^tokens) experts in use (uniform routing) and so P / U rows
per expert, each padded to whole tile_m-row tiles:

- DRAM bytes: the used experts' weights once, plus a share `REREAD` of them again for every further
  M tile of an expert (sibling tiles fall out of step and miss L2: the H200 counters of
  2026-12-01/02, tools/results/NOTES.md), plus GEMM2's A (h) and each GEMM's output;
- the rate those bytes can come at: the device's streaming rate, unless the weight bytes the
  resident CTAs keep in flight (stages - 1 weight k-tiles each) are too few for the memory latency
  (Little's law);
- MMA time: the padded tiles' FLOPs over the tensor rate times the mainloop family's efficiency on
  full tiles (`MMA_EFFICIENCY`, fitted to the H200 kernel measurements), lower for narrow tiles;
- the larger of the two, times the wave quantization of non-persistent grids, plus a fixed cost
  per dependent kernel (launch, ramp and tail; less with programmatic dependent launch).

Routing and the combine are a fixed cost and a stream of y. Pure Python and cheap (microseconds
per variant): the runtime never imports it; `variants.default_variant` uses it for targets
without measured defaults, and `tools/perfmodel_check.py` checks its ranking against every H200
measurement the tuner recorded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import gemm_limits as limits


@dataclass(frozen=True)
class Device:
    """What the model knows of a GPU. Sources are given per entry in DEVICES."""
    name: str
    sms: int
    dram_bytes_s: float  # peak DRAM bandwidth
    stream_frac: float  # of the peak, what a streaming read reaches
    bf16_flops: float  # dense bf16 tensor rate with fp32 accumulation
    smem_per_sm: int  # shared memory per SM available to CTAs
    max_threads_per_sm: int
    latency_s: float  # loaded DRAM latency seen by a k-tile load
    kernel_s: float  # fixed cost per dependent kernel (launch, ramp, tail)
    pdl_save_s: float  # of that, what programmatic dependent launch hides


DEVICES = {
    # H200 SXM: 132 SMs, 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16 (NVIDIA's datasheet); streaming
    # reads reach 4.24-4.43 TB/s here (../shared/notes/gpu.md); 228 KB of shared memory and 2048
    # threads per SM (CUDA's compute capability 9.0 tables); latency and fixed cost fitted to the
    # tuner's H200 records (tools/perfmodel_check.py).
    "sm_90a": Device("NVIDIA H200", 132, 4.8e12, 0.90, 989e12, 228 * 1024, 2048, 2.5e-6, 3e-6, 2e-6),
    # B200: 148 SMs, 8 TB/s HBM3e, 2.25 PFLOP/s dense bf16 (NVIDIA's datasheet); the rest as H200.
    "sm_100a": Device("NVIDIA B200", 148, 8.0e12, 0.90, 2250e12, 228 * 1024, 2048, 2.5e-6, 3e-6, 2e-6),
    # DGX Spark (GB10): 6,144 CUDA cores = 48 SMs, 128 GB LPDDR5X at 273 GB/s, "1 PFLOP FP4 with
    # sparsity" (NVIDIA's product page), so ~500 TFLOP/s dense FP4 and, at the usual 4:1 ratio,
    # ~125 TFLOP/s dense bf16 (an estimate: no bf16 figure is published); compute capability 12.x
    # has 100 KB of shared memory (99 KB per CTA) and 1536 threads per SM. The streaming fraction
    # is a published GB10 MoE decode kernel's 208 GB/s over 273 (issue 12); LPDDR5X latency is
    # assumed ~1.5x HBM's. None of it measured here: no Spark was available.
    "sm_121a": Device("NVIDIA GB10 (DGX Spark)", 48, 273e9, 0.76, 125e12, 100 * 1024, 1536, 3.75e-6, 3e-6, 2e-6),
}
# Cards of a modeled target that differ from its entry above, by the name CUDA reports
# (torch.cuda.get_device_name). H100 SXM 80GB: the H200's die (132 SMs, 989 TFLOP/s dense bf16)
# with 3.35 TB/s HBM3 (NVIDIA's datasheet); its streaming fraction, latency and fixed costs are
# taken as the H200's, which tools/perfmodel_check.py --gpu "NVIDIA H100 80GB HBM3" checks against
# the H100's tuning records.
GPU_DEVICES = {
    "NVIDIA H100 80GB HBM3": replace(DEVICES["sm_90a"], name="NVIDIA H100 80GB HBM3", dram_bytes_s=3.35e12),
}


def device_of(gpu: str) -> Device:
    """The model's device for a GPU name: its own entry, or the modeled target's whose entry bears
    that name; any other name is refused, naming the ones the model knows."""
    known = {**{d.name: d for d in DEVICES.values()}, **GPU_DEVICES}
    if gpu not in known:
        raise ValueError(f"the performance model has no device named {gpu!r}; it knows {', '.join(sorted(known))}")
    return known[gpu]


# Fraction of the tensor rate a family's mainloop reaches on full tiles. Started from the H200
# kernel checks (tools/results/NOTES.md: mma.sync 250-335 TFLOP/s, one-CTA wgmma 440-600, the persistent
# TMA cores 560-670, of 989), then these constants, REREAD, NARROW_EXP and the H200 entry's
# latency and fixed cost were fitted to the tuner's 679 H200 measurements by coordinate descent on
# a grid (least regret of the model's pick per bucket): tools/perfmodel_check.py reports the fit,
# and a leave-one-layer-out check of it (fitted on five layers, scored on the sixth).
# "umma" (tcgen05, sm_100a): never measured (no Blackwell GPU was available); taken as the
# persistent Hopper cores' until it is.
MMA_EFFICIENCY = {"warp": 0.25, "hopws": 0.55, "hoppp": 0.55, "umma": 0.55}
REREAD = 0.5  # of an expert's weights read again per further M tile of that expert
KTILE_S = 0.1e-6  # per k-tile of a CTA, the SM's share of its loop overhead (see gemm_seconds)
NARROW_EXP = 0.25  # how a tile smaller than 64x128 loses MMA rate (its area ratio to this power)
ROUTE_S = 6e-6  # the routing kernel up to ~1k tokens (H200: 5-10 µs); more CTAs beyond


def experts_in_use(tokens: int, top_k: int, experts: int) -> float:
    """Expected number of distinct experts that tokens * top_k uniformly routed pairs reach."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def gemm_seconds(dev: Device, n: int, k: int, out_cols: int, tokens: int, top_k: int, experts: int,
                 tile_m: int, tiles, read_a: bool, pdl: bool) -> dict:
    """Predicted time of one grouped GEMM over [N, K] weights (see the module docstring), with its
    parts: bytes, flops, mem_s, mma_s, waves factor, seconds."""
    used = experts_in_use(tokens, top_k, experts)
    rows = tokens * top_k / used
    # expected whole tiles per expert: at least one; counts spread around the mean add about half
    # a tile when an expert gets several
    m_per_e = max(1.0, math.ceil(rows / tile_m) if rows <= tile_m else rows / tile_m + 0.5)
    m_tiles = used * m_per_e
    n_tiles = n // tiles.tile_n
    ctas = m_tiles * n_tiles
    w_bytes = used * n * k * 2
    dram = w_bytes * (1 + REREAD * (m_per_e - 1))
    dram += m_tiles * tile_m * out_cols * 2 + (m_tiles * tile_m * k * 2 if read_a else 0)
    flops = 2.0 * m_tiles * tile_m * n * k
    persistent = tiles.mma in limits.PERSISTENT or tiles.mma in limits.UMMA
    wm, wn = limits.default_warps(tile_m, tiles.tile_n, mma=tiles.mma)
    threads = 32 * wm * wn + (limits.LOAD_THREADS if persistent else 0)
    if tiles.mma in limits.PINGPONG:
        threads = 384
    smem = limits.smem_bytes(tile_m, tiles.tile_n, tiles.tile_k, tiles.stages, tiles.mma)
    per_sm = max(1, min(dev.smem_per_sm // smem, dev.max_threads_per_sm // threads))
    if persistent:
        per_sm = 1
    resident = min(ctas, dev.sms * per_sm)
    inflight = resident * (tiles.stages - 1) * tiles.tile_n * tiles.tile_k * 2
    rate = min(dev.dram_bytes_s * dev.stream_frac, inflight / dev.latency_s)
    mem_s = dram / rate
    narrow = min(1.0, (tile_m * tiles.tile_n) / (64 * 128)) ** NARROW_EXP  # small tiles: fewer MMAs per load
    mma_s = flops / (dev.bf16_flops * MMA_EFFICIENCY[tiles.mma] * narrow)
    # every k-tile of every CTA costs the SM a round of waits, barriers and copy issue that the
    # CTAs resident on it do not fully overlap (KTILE_S, fitted): narrow, shallow tiles pay it
    loop_s = ctas * (k / tiles.tile_k) / dev.sms * KTILE_S
    waves = ctas / (dev.sms * per_sm)
    quant = 1.0 if persistent or waves >= 8 else math.ceil(waves) / waves
    fixed = dev.kernel_s - (dev.pdl_save_s if pdl else 0.0)
    seconds = max(mem_s, mma_s, loop_s) * quant + fixed
    return {"bytes": dram, "flops": flops, "mem_s": mem_s, "mma_s": mma_s, "loop_s": loop_s, "waves": quant,
            "seconds": seconds}


def predict(spec, variant, tokens: int, dev: Device | None = None) -> dict:
    """Predicted seconds of the whole layer (routing, GEMM1, GEMM2, combine) for `variant` at
    `tokens` on `dev` (default: the spec's target's device), with each part."""
    dev = dev or DEVICES[limits.modeled_target(spec.target)]
    E, K, H, I = spec.experts, spec.top_k, spec.hidden, spec.intermediate
    glu = gemm_seconds(dev, 2 * I, H, I, tokens, K, E, variant.tile_m, variant.glu, False, variant.pdl)
    down = gemm_seconds(dev, H, I, H, tokens, K, E, variant.tile_m, variant.down, True, variant.pdl)
    route = ROUTE_S * max(1.0, tokens * K / (8192.0 * variant.route_cluster))
    y = tokens * K * H * 2 + tokens * H * 2
    combine = y / (dev.dram_bytes_s * dev.stream_frac) + dev.kernel_s - (dev.pdl_save_s if variant.pdl else 0.0)
    total = route + glu["seconds"] + down["seconds"] + combine
    return {"seconds": total, "glu": glu, "down": down, "route_s": route, "combine_s": combine}


def rank(spec, variants, tokens: int, dev: Device | None = None) -> list:
    """`variants` ordered by predicted time, fastest first."""
    return sorted(variants, key=lambda v: predict(spec, v, tokens, dev)["seconds"])

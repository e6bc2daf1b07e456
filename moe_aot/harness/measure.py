"""Timing on the GPU the way the benchmark and the tuner both measure: the whole layer replayed
from CUDA graphs, several input sets with different routings replayed in turn (so a replay does
not find the previous one's experts in L2), median over many replays, after a correctness check
against the fp32 reference on a NaN-poisoned output."""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ..gemm_limits import BLOCKSCALED
from ..runtime.layer import MoeLayer
from ..variants import LayerVariant
from .reference import rel_err
from .verify import TOLERANCE, random_routing, served_reference, timing_generator

INPUT_SETS = 4


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn`, after one call on a side stream (lazy loads and allocations happen
    outside the capture). The allocator's cached free blocks are released before that call and
    before the capture: blocks cached for another stream serve neither a new side stream nor the
    graph's private pool, so each capture would otherwise hold its outputs' bytes once more (a
    DeepSeek-V3 backward's gradients are 21 GiB per input set, which an 80 GB card cannot hold
    three times beside the weights)."""
    warm_up_on_side(fn)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def warm_up_on_side(fn) -> torch.cuda.Stream:
    """One uncaptured call of `fn` on the device's side stream, ordered after the current stream's
    work and before its later work, with the allocator's cached free blocks released before and
    after it (see capture_graph). Returns the side stream."""
    torch.cuda.empty_cache()
    side = _side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.empty_cache()
    return side


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """One side stream per device for every capture's first call: torch keeps a cuBLAS workspace
    for each (handle, stream) pair that ran a cuBLAS call, for the life of the process, so a new
    stream per capture would leave one behind each time a captured function calls cuBLAS."""
    dev = torch.cuda.current_device()
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream(dev)
    return _SIDE[dev]


def graph_times_us(fns, replays: int, warmup_s: float = 0.0) -> list[float]:
    """Per-replay times (µs) of CUDA graphs of `fns`, replayed in turn on the current stream;
    with warmup_s, the graphs are first replayed untimed for about that long (the GPU's clocks
    settle after a change of load, e.g. from one model's largest point to the next's smallest)."""
    return timed_graphs(fns, replays, warmup_s)[0]


def timed_graphs(fns, replays: int, warmup_s: float = 0.0, nvml=None,
                 energy_s: float = 0.0) -> tuple[list[float], dict]:
    """graph_times_us, and with an NVML reader (harness.gpustate.Nvml) what the GPU's clocks and
    power did (gpustate.Sampler.summary; {} without a reader): during the timed replays, or with
    energy_s, during that many seconds of further replays after them (the board's energy counter
    counts millijoules, so per-replay energy needs a window of tenths of a second)."""
    return timed_units([[capture_graph(fn)] for fn in fns], replays, warmup_s, nvml, energy_s)


def timed_units(units, replays: int, warmup_s: float = 0.0, nvml=None,
                energy_s: float = 0.0) -> tuple[list[float], dict]:
    """timed_graphs over graphs already captured: `units` is a list of lists of CUDA graphs, timed
    in turn (replay i times units[i % len(units)]), each unit's graphs replayed back to back between
    its two events (e.g. a training step's forward graph then its backward graph)."""
    from .gpustate import Sampler

    graphs = [g for unit in units for g in unit]
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    _replay_for(graphs, warmup_s)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    timed_window = nvml is not None and energy_s <= 0
    with Sampler(nvml) if timed_window else contextlib.nullcontext() as sampler:
        for i in range(replays):
            starts[i].record()
            for g in units[i % len(units)]:
                g.replay()
            ends[i].record()
        torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    if timed_window:
        return times, sampler.summary(replays)
    if nvml is None:
        return times, {}
    with Sampler(nvml) as sampler:
        n = _replay_for(graphs, energy_s) // len(graphs) * len(units)  # units replayed
    return times, sampler.summary(n)


def _replay_for(graphs, seconds: float) -> int:
    """Replay the graphs in turn, untimed, for about `seconds`; returns how many replays ran."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        n += len(graphs)
    return n


def summarize(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=10)
    return {"median_us": statistics.median(times), "min_us": min(times), "p10_us": q[0], "p90_us": q[-1],
            "replays": len(times)}


def input_sets(spec, tokens: int, device, n: int = INPUT_SETS):
    """n timing input sets (x, topk weights, topk ids, output) with different routings, the same
    ones for every variant of the bucket (verify.timing_generator)."""
    sets = []
    for i in range(n):
        gen = timing_generator(spec, tokens, i, device)
        x = torch.randn(tokens, spec.hidden, device=device, dtype=torch.bfloat16, generator=gen)
        tw, ids = random_routing(tokens, spec, device, generator=gen)
        sets.append((x, tw, ids, torch.empty(tokens, spec.hidden, device=device, dtype=torch.bfloat16)))
    return sets


def measure_variant(layer: MoeLayer, variant: LayerVariant | None, tokens: int, w13, w2,
                    replays: int = 100, sets=None, warmup_s: float = 0.0, nvml=None) -> dict:
    """Check then time `variant` (None: the layer's own choice) at `tokens`. Returns stats with
    rel_err and ok; a wrong result is reported, not timed. warmup_s: replays untimed first for about
    that long (to the sustained clock); nvml: also the clocks and power of the timed replays."""
    if variant is not None:
        layer = MoeLayer(layer.spec, layer.store, device=layer.device.index, variants={tokens: variant})
    sets = sets or input_sets(layer.spec, tokens, layer.device)
    x, tw, ids, out = sets[0]
    out.fill_(float("nan"))
    if layer.spec.precision in BLOCKSCALED:  # each stage on what its kernels consumed
        from . import blockscaled

        ws = layer.workspace(tokens)
        blockscaled.poison(ws)
        layer.forward(x, w13, w2, tw, ids, out=out, workspace=ws)
        r = blockscaled.check_forward(layer, x, w13, w2, tw, ids, out, ws)
        err, ok = r["rel_err"], r["ok"]
    else:
        layer.forward(x, w13, w2, tw, ids, out=out)
        err = rel_err(out, served_reference(layer, x, w13, w2, tw, ids))
        ok = err <= TOLERANCE
    if not ok:
        return {"ok": False, "rel_err": err}
    ws = layer.workspace(tokens)
    times, state = timed_graphs([lambda s=s: layer.forward(s[0], w13, w2, s[1], s[2], out=s[3], workspace=ws)
                                 for s in sets], replays, warmup_s, nvml)
    return {"ok": True, "rel_err": err, **summarize(times), **timing_method(warmup_s, state)}


def timing_method(warmup_s: float, state: dict) -> dict:
    """A measurement's stats on how it was timed: the warm-up before the timed replays and the
    GPU's readings during them (left out where none were taken)."""
    return {"warmup_s": warmup_s, **({"gpu_state": state} if state else {})}

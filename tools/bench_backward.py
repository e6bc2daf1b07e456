#!/usr/bin/env python3
"""Benchmark of the layer's training step on the GPU (not a test): forward + backward of
torch.ops.moe_aot.fused_moe_train ("ours": AOT forward kernels keeping GEMM1's pre-activations, the
backward of moe_aot/integrations/autograd.py reading them, with its compiled data GEMMs where the
database has them) and of the same op with the backward's GEMMs all torch's ("torch GEMMs":
the backward before templates/hopper_bwd.py) against autograd through the unfused PyTorch path
(tools/bench.py's torch_unfused: torch._grouped_mm GEMMs, SiLU·up, index_add_),
all captured in CUDA graphs and replayed.

    python3 tools/bench_backward.py --out DIR [--models a,b] [--tokens 4096,16384] [--replays 30] [--profile]
                                    [--wgrad] [--once] [--warmup S]

Per point: forward + backward and the backward alone for both, their
ratio, the floor of forward + backward (3x the forward's FLOPs over the bf16 matmul rate measured
in the run, or 3x the selected experts' weight bytes over the HBM rate, 4.8 TB/s on an H200) and
the backward's (2x each), the backward's also at the matmul rate after SUSTAINED_MATMUL_S of
matmuls (`sust.`: the clock the H200 holds at its power cap, as tools/bench.py's column), for ours
and torch's, the activation bytes autograd
saves for the backward (saved_tensors_hooks, the weights not counted) for both, and the relative
difference between ours and torch's gradients (both bf16). Build the database with
`moe-aot build --backward` so that the backward finds its compiled GLU kernel and the forward its
GEMM1s with the pre-activation output (and the tuned backward picks, `moe-aot tune --backward`).
Ours runs each bucket's backward variant (its tuned pick, else variants.default_backward; the
'backward variant' column), the compiled weight-gradient GEMMs (templates/hopper_wgrad.py) where it
has them; --wgrad: also ours with them always and never (autograd.USE_WGRAD_KERNELS True / False),
in the same run.
Ours' paths are measured in mirrored order (torch GEMMs, ours[, always, never], then the same in
reverse), each reported as the mean of its two measurements (the JSON keeps both as *_runs;
--once: each once, in order). A path's training forward and its backward are captured as two
CUDA graphs (one stream, one memory pool) and replayed in turn as forward, backward, and forward
then backward (the step), untimed for --warmup seconds (default 1), then --replays times each
(default 30), so that all three are timed at the same clocks and the backward directly. (Until
the forty-fourth session the backward was the step less a no-grad forward timed beside it; at
DeepSeek-V3 16384 tokens on an H100 that forward moved by up to 16% at one clock, and the
subtraction carried it into the backward: tools/results/NOTES.md.) The SM clock, power and
throttle reasons during each timing are printed and kept in the JSON (*_states). The cached layers'
workspaces are released between points.
A path that does not fit in the GPU's memory at a point reads OOM in its cells, the geometric means
are taken over the points where both of their paths ran, and the run goes on.
Writes DIR/bench_backward_<card>.{json,md} (<card>: bench.card_tag, e.g. h200).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench import SUSTAINED_MATMUL_S, card_tag, floor_us, hbm_bytes_per_s, matmul_rate, torch_unfused  # noqa: E402

from moe_aot.harness.gpustate import Nvml  # noqa: E402
from moe_aot.harness.measure import timed_units, warm_up_on_side  # noqa: E402
from moe_aot.harness.reference import glu_fn, rel_err  # noqa: E402
from moe_aot.harness.verify import random_routing  # noqa: E402
from moe_aot.integrations import autograd, op  # noqa: E402, F401
from moe_aot.integrations.functional import prepare_fused_bias, prepare_fused_gate_up  # noqa: E402
from moe_aot.layout import split_gate_up  # noqa: E402
from moe_aot.runtime.layer import release_workspaces  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

DEV = torch.device("cuda")


def saved_bytes(fn, weights=()) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of fn(), not counting the
    storages of `weights` (the parameters, which training keeps anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in weights}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        # detached: a node saving its own output (sigmoid's) would otherwise hold that tensor, whose
        # grad_fn is the node, in a cycle through C++ that Python's gc cannot break; the forward's
        # tensors then outlived their point (GiBs a point on an H100, forty-third session)
        return t.detach()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for ptr, n in seen.items() if ptr not in skip)


TIMING = {"warmup_s": 0.0, "nvml": None}  # main() sets them: --warmup, and the GPU's NVML reader (None: no readings)


def _path(name, spec, M, fwd, leaves, grad, replays, weights, profile):
    """One path's measurements: a sample of its gradients (x, topk_weights, the first 8 experts'
    weight gradients), its CUDA-graph times and saved bytes; its graphs are freed on return.
    (None, None) where the path does not fit in the GPU's memory (DeepSeek-V3 at 16384 tokens on an
    80 GB H100 with torch's weight-gradient GEMMs: their 14 GiB dW13 beside the weights, the
    gradients and the graph's activations); the other paths and points still run."""
    try:
        return _measure_path(name, spec, M, fwd, leaves, grad, replays, weights, profile)
    except torch.OutOfMemoryError as exc:
        why = str(exc).split(". ")[0]
    gc.collect()  # outside the handler: the traceback's frames held the failed step's tensors
    torch.cuda.empty_cache()
    print(f"  {name}, {spec.workload_key} {M} tokens: out of memory ({why})", flush=True)
    return None, None


def _measure_path(name, spec, M, fwd, leaves, grad, replays, weights, profile):
    def step():
        return torch.autograd.grad(fwd(), leaves, grad)

    g = step()
    sample = [g[0], g[3], g[1][:8].clone(), g[2][:8].clone()]
    del g
    if profile:  # where the path's time goes: CUDA time per kernel over one step
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            step()
            torch.cuda.synchronize()
        print(f"--- {name} step, {spec.workload_key} {M} tokens ---\n"
              + p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70),
              flush=True)
    # The training forward (autograd recording) and its backward alone, as two graphs on one stream
    # sharing one memory pool, replayed in turn as forward, backward, forward + backward: each is
    # timed at the same clocks, and the backward directly. Until the forty-fourth session the
    # backward was the step less a no-grad forward timed beside it, and that forward timed alone
    # moved by up to 16% at one clock (DeepSeek-V3 16384, H100; tools/results/NOTES.md).
    gf, gb, kept = capture_training(fwd, leaves, grad)
    times, state = timed_units([[gf], [gb], [gf, gb]], 3 * replays, TIMING["warmup_s"], TIMING["nvml"])
    del gf, gb, kept
    torch.cuda.empty_cache()
    t_fwd, t_bwd, t_step = (statistics.median(times[i::3]) for i in range(3))
    # state: the SM clock, power and throttle reasons during the timed replays ({} without NVML)
    print(f"  {name}, {spec.workload_key} {M} tokens: fwd {t_fwd:.1f} bwd {t_bwd:.1f} step {t_step:.1f} us "
          f"(fwd + bwd {t_fwd + t_bwd:.1f}) at {_state(state)}", flush=True)
    return {"fwd": t_fwd, "bwd": t_bwd, "step": t_step, "saved": saved_bytes(fwd, weights), "state": state}, sample


def capture_training(fwd, leaves, grad):
    """CUDA graphs of a training step's two halves: the forward `fwd()` with autograd recording
    (what it saves for the backward lands in the graph's pool) and the backward alone
    (torch.autograd.grad of that forward's output, the graph kept so that it can be replayed).
    Both are captured on one stream, so the backward's kernels run where the forward's ran, and share
    one pool (as torch.cuda.make_graphed_callables does); one uncaptured step runs first, so that
    lazy loads and allocations happen outside the captures. Returns (forward graph, backward graph,
    what must stay alive while they replay)."""
    side = warm_up_on_side(lambda: torch.autograd.grad(fwd(), leaves, grad))
    gf, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gf, stream=side):
        out = fwd()
    with torch.cuda.graph(gb, pool=gf.pool(), stream=side):
        grads = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    return gf, gb, (out, grads)


def _live_tensors(min_bytes: int = 2**28) -> list[str]:
    """The CUDA tensors of at least min_bytes that are still alive, each with its autograd node and
    what refers to it from Python (a tensor that only the gc's own list reaches is held from C++:
    an autograd node, a cycle through one): what kept memory after a point."""
    out = []
    for o in gc.get_objects():
        try:
            big = isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().nbytes() >= min_bytes
        except Exception:  # noqa: BLE001 (objects gc holds may be half-built; they are skipped)
            continue
        if big:
            refs = [type(r).__name__ + (f":{r.f_code.co_name}" if hasattr(r, "f_code") else "")
                    for r in gc.get_referrers(o)]
            out.append(f"{tuple(o.shape)} {o.dtype} {o.untyped_storage().nbytes() / 2**30:.2f} GiB, grad_fn "
                       f"{type(o.grad_fn).__name__ if o.grad_fn else None}; referrers: {', '.join(refs[:5])}")
    return out


def _state(st: dict) -> str:
    """A timing's GPU state in a log line: SM clock (median / min), power, throttle reasons."""
    return (f"{st.get('sm_mhz', '-')} / {st.get('sm_mhz_min', '-')} MHz, {st.get('power_w', '-')} W, "
            f"{','.join(st.get('reasons', [])) or '-'}")


def _weights(shape, scale, gen):
    """bf16 normal weights times `scale`, drawn one expert at a time: DeepSeek-V3's w1 drawn at once
    in fp32 is a 28 GiB temporary, which an 80 GB card cannot hold beside the rest."""
    w = torch.empty(shape, device=DEV, dtype=torch.bfloat16)
    for e in range(shape[0]):
        w[e] = torch.randn(shape[1:], device=DEV, generator=gen) * scale
    return w


def _get(res, key):
    return None if res is None else res[key]


def _bwd(res):  # the backward alone
    return None if res is None else res["bwd"]


def _ratio(a, b):
    return None if a is None or b is None else a / b


def _f(v, fmt=".0f") -> str:
    """A table cell: the number, or 'OOM' for a path that did not fit in the GPU's memory."""
    return "OOM" if v is None else format(v, fmt)


def _geo(rows, num, den) -> float | None:
    """Geometric mean of row[num] / row[den] over the rows where both paths ran."""
    rs = [r[num] / r[den] for r in rows if r.get(num) is not None and r.get(den) is not None]
    return math.exp(sum(math.log(v) for v in rs) / len(rs)) if rs else None


def _max_diff(d) -> float | None:
    return None if d is None else max(d.values())


def _per(r, num, den) -> str:
    """The cell of r[num] / r[den] (OOM where either path did not fit)."""
    return _f(_ratio(r[num], r[den]), ".2f")


def _mib(r, key) -> str:
    """The cell of r[key] bytes in MiB (OOM where the path did not fit)."""
    return _f(None if r[key] is None else r[key] / 2**20)


def _merged(results) -> dict | None:
    """One path's measurements ((result, gradients) pairs of _path, in the run's order) as one
    result: the mean of their forward, backward and step times (each a median of replays), and
    "runs" with each (fwd, bwd, step); None where none of them fit in memory."""
    ran = [r for r, _ in results if r is not None]
    if not ran:
        return None
    mean = {k: sum(r[k] for r in ran) / len(ran) for k in ("fwd", "bwd", "step")}
    return {**mean, "saved": ran[0]["saved"],
            "runs": [None if r is None else (r["fwd"], r["bwd"], r["step"]) for r, _ in results],
            "states": [None if r is None else r.get("state") for r, _ in results]}


def point(spec, M, replays, rate, gen, profile=False, wgrad=False, sustained=None, once=False):
    """Every path on the same inputs, one after the other (so that DeepSeek-V3's weights and
    gradients fit beside only one path's): ours' paths in mirrored order unless ``once``."""
    H, I, E, K = spec.hidden, spec.intermediate, spec.experts, spec.top_k
    w1 = _weights((E, 2 * I, H), H ** -0.5, gen)  # gate rows first
    w2 = _weights((E, H, I), I ** -0.5, gen).requires_grad_()
    x = torch.randn(M, H, device=DEV, generator=gen).bfloat16().requires_grad_()
    tw, ids = random_routing(M, spec, DEV, generator=gen)
    tw.requires_grad_()
    grad = torch.randn(M, H, device=DEV, generator=gen).bfloat16()
    glu = b1 = b2 = None
    if spec.bias:  # gpt-oss: its clamped SwiGLU and expert biases in both paths
        glu = glu_fn(spec.activation)
        b1 = (torch.randn(E, 2 * I, device=DEV, generator=gen) * 0.5).bfloat16()
        b2 = (torch.randn(E, H, device=DEV, generator=gen) * 0.5).bfloat16().requires_grad_()
    w13 = prepare_fused_gate_up(w1).requires_grad_()
    w1 = None  # rebuilt from w13 for torch's path: both at once do not fit beside DeepSeek-V3's gradients on 80 GB
    b13 = None if b1 is None else prepare_fused_bias(b1).requires_grad_()
    ours_extra = (b13, b2) if spec.bias else ()

    def ours_fwd():
        return torch.ops.moe_aot.fused_moe_train(x, w13, w2, tw, ids, spec.activation, *ours_extra)[0]

    leaves = [x, w13, w2, tw, *ours_extra]
    plan = autograd._plan(x, ids, w13, w2, spec.activation, 16, spec.bias)
    fused = plan is not None and plan[1] is not None  # the bucket's variant is not torch's data GEMMs (TORCH_DATA)
    auto_used = fused and plan[2] is not None

    used = {}  # per --wgrad flag: whether ours' plan then has the compiled weight gradients

    def measure(key, prof):
        """One measurement of one of ours' paths: "torch GEMMs", "ours", or ours with the compiled
        weight gradients always (True) / never (False)."""
        saved_fn, saved_flag = autograd._plan, autograd.USE_WGRAD_KERNELS
        try:
            if key == "torch GEMMs":
                autograd._plan = lambda *a: None  # the backward multiplying with torch's grouped GEMMs
            elif key in (True, False):
                autograd.USE_WGRAD_KERNELS = key
                p = autograd._plan(x, ids, w13, w2, spec.activation, 16, spec.bias)
                used[key] = p is not None and p[2] is not None
            name = key if isinstance(key, str) else f"ours, weight-gradient kernels {key}"
            return _path(name, spec, M, ours_fwd, leaves, grad, replays, (w13, w2), prof)
        finally:
            autograd._plan, autograd.USE_WGRAD_KERNELS = saved_fn, saved_flag

    # Mirrored order (A B C D, then D C B A unless `once`), each path's two measurements merged: at
    # Qwen3-235B 16384 tokens on an H100 one variant measured 22 ms right after torch's GEMM path
    # and 18.8 ms right after itself (tools/results/NOTES.md, forty-second session).
    order = ["torch GEMMs", "ours"] + ([True, False] if wgrad else [])
    runs: dict = {}
    for i, key in enumerate(order + ([] if once else order[::-1])):
        res, g = measure(key, profile and i < len(order))
        runs.setdefault(key, []).append((res, g if i < len(order) else None))  # one gradient sample per path
    recompute, ours = _merged(runs["torch GEMMs"]), _merged(runs["ours"])
    ours_g = runs["ours"][0][1]
    # ours with the compiled weight gradients always (True) / never (False)
    forced = {flag: (used[flag], _merged(runs[flag]), runs[flag][0][1]) for flag in ([True, False] if wgrad else [])}
    runs = None
    w1 = torch.cat(split_gate_up(w13.detach()), dim=1)  # the kernels' interleave undone: gate rows first
    w13 = b13 = leaves = None  # ours' weights go before torch's path runs (leaves held w13 too)
    gc.collect()
    torch.cuda.empty_cache()
    w1.requires_grad_()
    if b1 is not None:
        b1.requires_grad_()

    def ref_fwd():
        return torch_unfused(x, w1.transpose(1, 2), w2.transpose(1, 2), tw, ids, E, glu, b1, b2)

    ref, ref_g = _path("torch", spec, M, ref_fwd, [x, w1, w2, tw, *((b1, b2) if spec.bias else ())], grad, replays,
                       (w1, w2), profile)
    if ref_g is not None:
        ref_g[2] = prepare_fused_gate_up(ref_g[2])  # gate rows first -> the kernels' interleave, to compare

    def diffs(g):  # relative gradient differences against torch's path (None: one of them did not fit)
        if g is None or ref_g is None:
            return None
        return {n: rel_err(a, b.float()) for n, a, b in zip(("x", "topk_weights", "w13", "w2"), g, ref_g)}

    flops = 6 * M * K * H * I
    weight_bytes = min(E, M * K) * 3 * H * I * 2
    floor_step = floor_us(3 * flops, 3 * weight_bytes, rate)  # the backward: 2x FLOPs and weight bytes
    row = {"floor_bwd_us": floor_us(2 * flops, 2 * weight_bytes, rate),
           "floor_bwd_sustained_us": floor_us(2 * flops, 2 * weight_bytes, sustained or rate),
           "tokens": M, "floor_step_us": floor_step, "grad_rel_diff": diffs(ours_g), "fused_gemms": fused,
           "bwd_variant": plan[0].name(spec) if plan is not None else None}
    for key, res in (("ours", ours), ("torch", ref), ("recompute", recompute)):
        row.update({f"{key}_fwd": _get(res, "fwd"), f"{key}_step": _get(res, "step"), f"{key}_bwd": _bwd(res),
                    f"saved_bytes_{key}": _get(res, "saved")})
        if res is not None and "runs" in res:
            row[f"{key}_runs"] = res["runs"]
            row[f"{key}_states"] = res["states"]
        elif res is not None:
            row[f"{key}_states"] = [res.get("state")]
    row["step_speedup"] = _ratio(row["torch_step"], row["ours_step"])
    row["bwd_speedup"] = _ratio(row["torch_bwd"], row["ours_bwd"])
    row["wgrad_auto"] = auto_used
    for flag, (used, res, g) in forced.items():
        key = "wgrad" if flag else "nowgrad"
        row.update({f"{key}_used": used, f"{key}_step": _get(res, "step"), f"{key}_bwd": _bwd(res),
                    f"{key}_grad_rel_diff": diffs(g), f"{key}_runs": _get(res, "runs"),
                    f"{key}_states": _get(res, "states")})
    return row


def table_md(rows, device: str, date: str, rate: float, sustained: float, argv) -> list[str]:
    """The markdown table's lines for `rows` (point()'s), a path that ran out of memory shown as OOM
    and left out of the geometric means."""
    lines = [f"# Training step of the fused MoE layer on {device} ({date})", "",
             f"Command: `python3 tools/bench_backward.py {' '.join(argv)}`; bf16 matmul rate {rate / 1e12:.0f} "
             f"TFLOP/s, {sustained / 1e12:.0f} after {SUSTAINED_MATMUL_S:.0f} s of matmuls (`sust.`). "
             f"µs, medians of CUDA-graph replays (after {TIMING['warmup_s']:g} s of untimed ones); "
             "ours = fused_moe_train (pre-activations kept, the "
             "backward's compiled dH/dX where the database has them and the bucket's backward variant is not "
             "torch's data GEMMs: column 'fused'), torch GEMMs = the same with "
             "every backward GEMM torch's, torch = autograd through the unfused path. Ours' paths (ours, torch "
             "GEMMs, --wgrad's) run in mirrored order (A B .. B A; --once: once each), each cell the mean of "
             "its two measurements (the JSON's *_runs has both).", "",
             "| model | tokens | fused | fwd+bwd ours | torch GEMMs | torch | torch/ours | bwd ours | torch GEMMs "
             "| torch | torch/ours | step floor | step ours/floor | bwd floor | bwd ours/floor [sust.] "
             "| bwd torch/floor [sust.] | activations saved MiB ours / torch "
             "| grad diff | backward variant |", "|" + "---|" * 19]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['fused_gemms']} | {_f(r['ours_step'])} | "
                     f"{_f(r['recompute_step'])} | {_f(r['torch_step'])} | {_f(r['step_speedup'], '.2f')} | "
                     f"{_f(r['ours_bwd'])} | {_f(r['recompute_bwd'])} | {_f(r['torch_bwd'])} | "
                     f"{_f(r['bwd_speedup'], '.2f')} | {r['floor_step_us']:.0f} | "
                     f"{_per(r, 'ours_step', 'floor_step_us')} | "
                     f"{r['floor_bwd_us']:.0f} | {_per(r, 'ours_bwd', 'floor_bwd_us')} "
                     f"[{_per(r, 'ours_bwd', 'floor_bwd_sustained_us')}] | "
                     f"{_per(r, 'torch_bwd', 'floor_bwd_us')} [{_per(r, 'torch_bwd', 'floor_bwd_sustained_us')}] | "
                     f"{_mib(r, 'saved_bytes_ours')} / {_mib(r, 'saved_bytes_torch')} | "
                     f"{_f(_max_diff(r['grad_rel_diff']), '.1e')} | "
                     f"`{(r.get('bwd_variant') or '-').split('_dh')[-1]}` |")
    g2 = lambda num, den: _f(_geo(rows, num, den), ".2f")  # noqa: E731
    lines += ["", f"Geometric means (over the rows where both paths fit in memory; OOM: out of memory): "
              f"fwd+bwd torch/ours {g2('torch_step', 'ours_step')}, backward torch/ours {g2('torch_bwd', 'ours_bwd')}; "
              f"with the backward's GEMMs all torch's {g2('torch_step', 'recompute_step')} and "
              f"{g2('torch_bwd', 'recompute_bwd')}. Backward over its floor: ours {g2('ours_bwd', 'floor_bwd_us')} "
              f"[{g2('ours_bwd', 'floor_bwd_sustained_us')} sustained], torch {g2('torch_bwd', 'floor_bwd_us')} "
              f"[{g2('torch_bwd', 'floor_bwd_sustained_us')}]: a "
              "backward k times faster than torch's runs at (torch's ratio) / k of the floor."]
    wrows = [r for r in rows if "wgrad_step" in r]
    if wrows:
        lines += ["", "Ours with the compiled weight-gradient GEMMs always and never (same run; µs, torch/ours; "
                  "'ours uses': whether the backward variant above has them):", "",
                  "| model | tokens | ours uses | always: fwd+bwd | torch/ours | bwd | torch/ours | never: fwd+bwd "
                  "| torch/ours | bwd | torch/ours | grad diff |",
                  "|" + "---|" * 12]
        for r in wrows:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['wgrad_auto']} | {_f(r['wgrad_step'])} | "
                         f"{_per(r, 'torch_step', 'wgrad_step')} | {_f(r['wgrad_bwd'])} | "
                         f"{_per(r, 'torch_bwd', 'wgrad_bwd')} | "
                         f"{_f(r['nowgrad_step'])} | {_per(r, 'torch_step', 'nowgrad_step')} | "
                         f"{_f(r['nowgrad_bwd'])} | "
                         f"{_per(r, 'torch_bwd', 'nowgrad_bwd')} | {_f(_max_diff(r['wgrad_grad_rel_diff']), '.1e')} |")
        g = lambda k, p: _f(_geo(wrows, f"torch_{k}", f"{p}_{k}"), ".2f")  # noqa: E731
        lines += ["", f"Geometric means: always fwd+bwd {g('step', 'wgrad')}, backward {g('bwd', 'wgrad')}; "
                  f"never {g('step', 'nowgrad')}, {g('bwd', 'nowgrad')}."]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b,gpt-oss-120b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="print the kernel table of one step of each path")
    ap.add_argument("--wgrad", action="store_true", help="also ours with the compiled weight-gradient GEMMs")
    ap.add_argument("--once", action="store_true",
                    help="measure ours' paths once each, in order, rather than mirrored (A B .. B A, the times "
                         "of each path's two measurements averaged)")
    ap.add_argument("--warmup", type=float, default=1.0,
                    help="seconds of untimed replays of each path's graphs before they are timed (the clocks settle "
                         "after a change of load); the SM clock and power during each timing are in the JSON "
                         "(*_states) either way")
    ns = ap.parse_args()
    TIMING["warmup_s"] = ns.warmup
    TIMING["nvml"] = Nvml.of_torch_device(torch.cuda.current_device())
    hbm_bytes_per_s()  # a GPU without a known HBM rate has no floor: refused before anything runs
    ns.out.mkdir(parents=True, exist_ok=True)
    rate = matmul_rate()[0]
    sustained = matmul_rate(warmup_s=SUSTAINED_MATMUL_S)[0]
    rows, gen = [], torch.Generator(device=DEV).manual_seed(0)
    for model in ns.models.split(","):
        spec = make_spec(model, target="sm_90a")
        for M in [int(t) for t in ns.tokens.split(",")]:
            t0 = time.perf_counter()
            r = point(spec, M, ns.replays, rate, gen, ns.profile, ns.wgrad, sustained, ns.once)
            r["model"] = model
            rows.append(r)
            # the point's graphs and tensors (closures keep some in cycles), and the cached layers'
            # workspaces (GBs each at 16384 tokens), before the next point
            released = release_workspaces()
            gc.collect()
            torch.cuda.empty_cache()
            print(f"{model:16s} {M:6d} step ours {_f(r['ours_step'], '9.1f')} torch-GEMMs "
                  f"{_f(r['recompute_step'], '9.1f')} torch {_f(r['torch_step'], '9.1f')} "
                  f"({_f(r['step_speedup'], '.2f')}x)  bwd ours {_f(r['ours_bwd'], '9.1f')} recompute "
                  f"{_f(r['recompute_bwd'], '9.1f')} torch {_f(r['torch_bwd'], '9.1f')} "
                  f"({_f(r['bwd_speedup'], '.2f')}x) fused {r['fused_gemms']}  floor {r['floor_step_us']:.0f}  "
                  f"saved {_mib(r, 'saved_bytes_ours')} / {_mib(r, 'saved_bytes_torch')} MiB  "
                  f"diff {_f(_max_diff(r['grad_rel_diff']), '.1e')} "
                  f"[{time.perf_counter() - t0:.0f}s]", flush=True)
            if "wgrad_step" in r:
                print(f"{'':16s} {'':6s} weight-gradient kernels used by ours: {r['wgrad_auto']}; always "
                      f"({r['wgrad_used']}): step {_f(r['wgrad_step'], '9.1f')} bwd {_f(r['wgrad_bwd'], '9.1f')} "
                      f"({_per(r, 'torch_bwd', 'wgrad_bwd')}x); never: step "
                      f"{_f(r['nowgrad_step'], '9.1f')} bwd {_f(r['nowgrad_bwd'], '9.1f')} "
                      f"({_per(r, 'torch_bwd', 'nowgrad_bwd')}x) "
                      f"diff {_f(_max_diff(r['wgrad_grad_rel_diff']), '.1e')}", flush=True)
            print(f"{'':16s} {'':6s} after the point: {released / 2**30:.1f} GiB of workspaces released; "
                  f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
                  f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved", flush=True)
            if torch.cuda.memory_allocated() >= 2**30:  # what still holds memory after the point
                for line in _live_tensors():
                    print(f"{'':16s} {'':6s}   live: {line}", flush=True)
            (ns.out / f"bench_backward_{card_tag()}.json").write_text(json.dumps(
                {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
                 "matmul_tflops": rate / 1e12, "matmul_sustained_tflops": sustained / 1e12,
                 "command": " ".join(sys.argv), "rows": rows}, indent=1))
    lines = table_md(rows, torch.cuda.get_device_name(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rate,
                     sustained, sys.argv[1:])
    (ns.out / f"bench_backward_{card_tag()}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(line for line in lines if line.startswith("Geometric")))


if __name__ == "__main__":
    main()

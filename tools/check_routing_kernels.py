"""Compile (CPU) and check (GPU) the routing and combine kernels of templates/routing.py.

  python tools/check_routing_kernels.py --compile scratch/routing [--arch sm_90a]
  python tools/check_routing_kernels.py --run scratch/routing --out OUTDIR

--compile needs the DSL; --run needs only torch and moe_aot.runtime. --run checks every output
exactly against the pure-torch references below (buffers poisoned first), then times each kernel
with CUDA events (median of 100, each launch queued behind a GPU sleep so host overhead is hidden).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.harness.reference import routing_reference as _runtime_routing_reference  # noqa: E402
from moe_aot.layout import max_tiles  # noqa: E402

ROUTING_CONFIGS = [(e, k, tm) for e, k in [(128, 8), (128, 4), (256, 8), (8, 2)] for tm in (64, 128)]
COMBINE_CONFIGS = [(128, 2048, 8), (128, 4096, 8), (128, 2880, 4), (256, 7168, 8), (8, 4096, 2)]
MODEL_CONFIGS = [(128, 8, 2048), (128, 8, 4096), (128, 4, 2880), (256, 8, 7168), (8, 2, 4096)]
ROUTING_CLUSTERS = (1, 8, 16)
# Further tunable variants of one routing config (E=256, K=8, tile_m=128), timed beside the rest.
ROUTING_VARIANTS = [dict(num_threads=256, unroll=8, cluster_size=1),
                    dict(num_threads=512, unroll=8, cluster_size=1),
                    dict(num_threads=512, unroll=8, cluster_size=16),
                    dict(num_threads=1024, unroll=4, cluster_size=16),
                    dict(num_threads=1024, unroll=8, cluster_size=4)]
TIMING_M = [1, 16, 256, 1024, 4096, 16384]
SENTINEL = 0x7FFFFFFF


def routing_name(e, k, tm, num_threads=1024, unroll=8, cluster_size=1):
    return f"routing_e{e}_k{k}_t{tm}_n{num_threads}_u{unroll}_c{cluster_size}"


def combine_name(e, h, k):
    return f"combine_e{e}_h{h}_k{k}"


def routing_sizes(m: int, e: int, k: int, tm: int) -> tuple[int, int]:
    """(T, R): worst-case tile count and sorted_ids rows the caller allocates (0 for no tokens)."""
    t = max_tiles(m, k, e, tm) if m * k else 0
    return t, t * tm


# ----------------------------------------------------------------------------- references

def routing_reference(topk_ids, num_experts: int, tile_m: int, num_tiles: int, num_rows: int):
    """The runtime's reference of MoeRouting, sized as this script allocates."""
    assert num_rows == num_tiles * tile_m
    return _runtime_routing_reference(topk_ids, num_experts, tile_m, num_tiles)


def combine_reference(y, topk_ids, num_experts: int):
    """fp32 semantics of MoeCombine: out[m] = sum_k y[m*K+k] over valid ids (zeros if none)."""
    import torch
    m, k = topk_ids.shape
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    yf = y.float().view(m, k, -1)
    yf = torch.where(valid[..., None], yf, torch.zeros((), device=y.device))
    out = torch.zeros(m, y.shape[1], device=y.device)
    for j in range(k):
        out += yf[:, j]
    return out


# ----------------------------------------------------------------------------- compile (CPU)

def do_compile(out_dir: Path, arch: str) -> None:
    from moe_aot_templates.routing import MoeCombine, MoeRouting

    from moe_aot.compiler import compile_kernel

    jobs = [(routing_name(e, k, tm, cluster_size=c), MoeRouting(e, k, tm, cluster_size=c))
            for e, k, tm in ROUTING_CONFIGS for c in ROUTING_CLUSTERS]
    e, k, tm = 256, 8, 128
    jobs += [(routing_name(e, k, tm, **v), MoeRouting(e, k, tm, **v)) for v in ROUTING_VARIANTS]
    jobs += [(combine_name(e, h, k), MoeCombine(e, h, k)) for e, h, k in COMBINE_CONFIGS]
    times = {}
    for name, obj in jobs:
        ok, why = obj.can_implement(arch) if isinstance(obj, MoeRouting) else obj.can_implement()
        assert ok, f"{name}: {why}"
        t0 = time.perf_counter()
        art = compile_kernel(obj, arch, name)
        art.write_dir(out_dir / name)
        times[name] = {"total_s": round(time.perf_counter() - t0, 3), **art.meta["timing_s"]}
        print(f"{name}: {times[name]}", flush=True)
    (out_dir / "compile_times.json").write_text(json.dumps(times, indent=1))


# ----------------------------------------------------------------------------- run (GPU)

def make_ids(kind: str, m: int, e: int, k: int, gen):
    import torch
    dev = "cuda"
    if kind == "distinct":  # what a top-k router gives: k distinct experts per token
        return torch.rand(m, e, device=dev, generator=gen).argsort(dim=1)[:, :k].int().contiguous()
    if kind == "skewed":  # Zipf-like popularity, repeats allowed, many experts empty
        p = 1.0 / torch.arange(1, e + 1, device=dev, dtype=torch.float) ** 1.5
        return torch.multinomial(p, m * k, replacement=True, generator=gen).view(m, k).int()
    if kind == "one_expert":
        return torch.full((m, k), e - 1, dtype=torch.int32, device=dev)
    if kind == "few_experts":
        return torch.randint(0, min(e, 3), (m, k), device=dev, generator=gen, dtype=torch.int32)
    if kind == "invalid":  # distinct, then ~15% replaced by ids outside [0, E); token 0 all invalid
        ids = make_ids("distinct", m, e, k, gen)
        bad = torch.tensor([-1, e, e + 100, -7, 2**31 - 1, -2**31], device=dev, dtype=torch.int32)
        pick = torch.randint(0, bad.numel(), (m, k), device=dev, generator=gen)
        mask = torch.rand(m, k, device=dev, generator=gen) < 0.15
        ids = torch.where(mask, bad[pick], ids)
        ids[0] = -1
        return ids.contiguous()
    raise ValueError(kind)


def time_call(fn, iters=100):
    import torch
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for i in range(iters):
        torch.cuda._sleep(400_000)  # keeps the GPU busy while the host queues the launch
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(t) * 1e3 for s, t in zip(start, end))
    return ts[len(ts) // 2]


def run_routing(lib, e, k, tm, m, kind, gen):
    import torch
    ids = make_ids(kind, m, e, k, gen)
    t, r = routing_sizes(m, e, k, tm)
    outs = [torch.full((n,), SENTINEL, dtype=torch.int32, device="cuda") for n in (e, e + 1, r, t)]
    lib(ids, *outs)
    ref = routing_reference(ids, e, tm, t, r)
    bad = [name for name, a, b in zip(("counts", "offsets", "sorted_ids", "tile_expert"), outs, ref)
           if not torch.equal(a, b)]
    return ids, outs, bad


def do_run(lib_dir: Path, out_dir: Path) -> int:
    import torch

    from moe_aot.runtime.library import KernelLibrary

    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(time.time()))
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "correctness": [], "routing_us": {}, "combine_us": {}, "failures": []}
    log = open(out_dir / "log.txt", "w")

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")

    def fail(msg):
        results["failures"].append(msg)
        say("FAIL " + msg)

    libs = {}

    def lib(name):
        if name not in libs:
            libs[name] = KernelLibrary.from_dir(lib_dir / name)
        return libs[name]

    def check_routing(clusters):
        kinds = ["distinct", "skewed", "one_expert", "few_experts", "invalid"]
        for e, k, tm, c in [(*cfg, c) for cfg in ROUTING_CONFIGS for c in clusters]:
            name = routing_name(e, k, tm, cluster_size=c)
            n_ok = 0
            for m in [1, 2, 3, 16, 33, 100, 256, 1000, 4096, 16384]:
                for kind in kinds:
                    _, outs, bad = run_routing(lib(name), e, k, tm, m, kind, gen)
                    if bad:
                        fail(f"{name} M={m} {kind}: mismatch in {bad}")
                    else:
                        n_ok += 1
            # determinism: same input twice gives identical bytes
            ids = make_ids("skewed", 4096, e, k, gen)
            t, r = routing_sizes(4096, e, k, tm)
            a = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (e, e + 1, r, t)]
            b = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (e, e + 1, r, t)]
            lib(name)(ids, *a)
            lib(name)(ids, *b)
            if not all(torch.equal(x, y) for x, y in zip(a, b)):
                fail(f"{name}: two runs on the same input differ")
            results["correctness"].append(f"{name}: {n_ok}/{10 * len(kinds)} cases exact")
            say(results["correctness"][-1])
        # M = 0 (empty buffers) must not fault
        for c in clusters:
            outs = [torch.full((n,), SENTINEL, dtype=torch.int32, device="cuda") for n in (128, 129, 0, 0)]
            lib(routing_name(128, 8, 64, cluster_size=c))(
                torch.empty((0, 8), dtype=torch.int32, device="cuda"), *outs)
            if outs[0].any() or outs[1].any():
                fail(f"M=0 routing c={c}: counts/offsets not zero")
            else:
                say(f"M=0 routing c={c}: ok")

    def check_variants():
        for v in ROUTING_VARIANTS:
            name = routing_name(256, 8, 128, **v)
            for m in [1, 33, 4096, 16384]:
                for kind in ("distinct", "invalid", "skewed"):
                    _, _, bad = run_routing(lib(name), 256, 8, 128, m, kind, gen)
                    if bad:
                        fail(f"{name} M={m} {kind}: mismatch in {bad}")
            say(f"{name}: checked")

    def check_combine():
        for e, h, k in COMBINE_CONFIGS:
            name = combine_name(e, h, k)
            worst = 0.0
            for m in [1, 3, 16, 257, 4096]:
                for kind in ("distinct", "invalid"):
                    ids = make_ids(kind, m, e, k, gen)
                    y = torch.randn(m * k, h, device="cuda", generator=gen).bfloat16()
                    invalid_rows = ((ids < 0) | (ids >= e)).view(-1)
                    y[invalid_rows] = float("nan")  # must never be read
                    out = torch.full((m, h), float("nan"), dtype=torch.bfloat16, device="cuda")
                    lib(name)(y, ids, out)
                    ref = combine_reference(y, ids, e)
                    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    worst = max(worst, err)
                    empty = ~((ids >= 0) & (ids < e)).any(1)
                    if not (err < 1e-2) or torch.isnan(out).any():
                        fail(f"{name} M={m} {kind}: rel err {err:.3e}, nan={torch.isnan(out).any().item()}")
                    if empty.any() and not torch.equal(out[empty].float(), torch.zeros_like(ref[empty])):
                        fail(f"{name} M={m} {kind}: tokens with no valid pair are not zero")
                    out2 = torch.empty_like(out)
                    lib(name)(y, ids, out2)
                    if not torch.equal(out, out2):
                        fail(f"{name} M={m} {kind}: not deterministic")
            results["correctness"].append(f"{name}: worst rel err {worst:.2e}")
            say(results["correctness"][-1])

    def time_routing(name, e, k, tm):
        row = {}
        for m in TIMING_M:
            ids = make_ids("distinct", m, e, k, gen)
            t, r = routing_sizes(m, e, k, tm)
            outs = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (e, e + 1, r, t)]
            row[m] = round(time_call(lambda: lib(name)(ids, *outs, check=False)), 2)
        results["routing_us"][name] = row
        say(f"time {name}: " + ", ".join(f"M={m}: {v} us" for m, v in row.items()))

    def time_routings(clusters):
        for e, k, _ in MODEL_CONFIGS:
            for tm, cl in [(tm, cl) for tm in (64, 128) for cl in clusters]:
                time_routing(routing_name(e, k, tm, cluster_size=cl), e, k, tm)

    def time_combine():
        for e, k, h in MODEL_CONFIGS:
            name = combine_name(e, h, k)
            row = {}
            for m in TIMING_M:
                ids = make_ids("distinct", m, e, k, gen)
                y = torch.randn(m * k, h, device="cuda", generator=gen).bfloat16()
                out = torch.empty(m, h, dtype=torch.bfloat16, device="cuda")
                us = time_call(lambda: lib(name)(y, ids, out, check=False))
                gbs = (y.numel() * 2 + out.numel() * 2 + ids.numel() * 4) / (us * 1e-6) / 1e9
                ref_us = time_call(lambda: y.view(m, k, h).sum(1, dtype=torch.float32))
                row[m] = {"us": round(us, 2), "GB/s": round(gbs), "torch_sum_us": round(ref_us, 2)}
            results["combine_us"][name] = row
            say(f"time {name}: " + ", ".join(
                f"M={m}: {v['us']} us ({v['GB/s']} GB/s; torch sum {v['torch_sum_us']} us)"
                for m, v in row.items()))

    def time_variants():
        for v in ROUTING_VARIANTS:
            time_routing(routing_name(256, 8, 128, **v), 256, 8, 128)

    # Portable cluster sizes first: a failure of the non-portable size-16 launches comes last.
    stages = [("check routing c1,c8", lambda: check_routing((1, 8))),
              ("check combine", check_combine),
              ("time routing c1,c8", lambda: time_routings((1, 8))),
              ("time combine", time_combine),
              ("check routing c16", lambda: check_routing((16,))),
              ("check variants", check_variants),
              ("time routing c16", lambda: time_routings((16,))),
              ("time variants", time_variants)]
    for stage, fn in stages:
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - record and go on to the next stage
            fail(f"stage '{stage}' raised {type(exc).__name__}: {exc}")
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    say(f"{len(results['failures'])} failures")
    return 1 if results["failures"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--compile", type=Path, metavar="DIR")
    g.add_argument("--run", type=Path, metavar="DIR")
    ap.add_argument("--out", type=Path, default=Path("routing_check"))
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    if a.compile:
        do_compile(a.compile, a.arch)
        return 0
    return do_run(a.run, a.out)


if __name__ == "__main__":
    sys.exit(main())

"""Several GPUs of one host: the time per layer under expert parallelism against one GPU, and the
wall time of one model's tuning buckets measured on N GPUs against one.

    # time per layer: N ranks (NCCL, NVLink multicast off), E/N experts each, M tokens per rank
    python3 tools/bench_parallel.py layer --gpus 8 --model deepseek-v3,qwen3-235b-a22b --tokens 1,16,256,4096

  needs the kernels of the whole layer (one-GPU baseline) and of its E/N-expert share in the
  database (MOE_AOT_DB), e.g. for DeepSeek-V3 on 8 GPUs `moe-aot build --model deepseek-v3` and
  `moe-aot build --experts 32 --top-k 8 --hidden 7168 --intermediate 2048`. Prints, per model and
  token count, the EP layer's time (slowest rank, median of --iters, eager, both exchanges)
  beside one GPU with all experts at M tokens and at N*M tokens (the same work as all ranks
  together), and writes JSON to --out.

    # tuning wall time: the same prepared studies measured by 1 GPU and by N GPUs
    moe-aot tune --compile-only --gpu "NVIDIA H200" --model qwen3-30b-a3b --trials 12 --db sqlite:///prep.sqlite
    python3 tools/bench_parallel.py tune --prepared prep.sqlite --gpus 8

  copies the prepared SQLite file twice and runs `moe-aot measure --devices 0` on one copy and
  `--devices 0,..,N-1` on the other, printing both wall times and the trials each measured. (The
  PostgreSQL run is the same `moe-aot measure --devices all --db "$(tools/pg_local.sh)"` on a
  database the compile side prepared.)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _time(fn, iters: int, warmup: int = 5, group=None) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _layer_rank(rank, world, store, models, tokens, iters, out):
    import torch
    import torch.distributed as dist

    from moe_aot.harness.verify import random_routing
    from moe_aot.integrations import parallel as ep
    from moe_aot.integrations.modules import MoeExperts
    from moe_aot.runtime.layer import prepare_weights
    from moe_aot.spec import make_spec

    torch.cuda.set_device(rank)
    ep.init_expert_parallel("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    rows = []
    for model in models:
        spec = make_spec(model)
        E, H, I = spec.experts, spec.hidden, spec.intermediate
        placement = ep.Placement.contiguous(E, world)
        n = E // world
        g = torch.Generator(device=dev).manual_seed(1000 + rank)  # timing only: any weights do
        w13 = prepare_weights(*(torch.randn(n, I, H, device=dev, dtype=torch.bfloat16, generator=g) * H ** -0.5
                                for _ in range(2)))
        w2 = torch.randn(n, H, I, device=dev, dtype=torch.bfloat16, generator=g) * I ** -0.5
        layers = {x: ep.ExpertParallelMoe.from_weights(w13, w2, placement, exchange=x) for x in ep.EXCHANGES}
        whole = None
        if rank == 0:  # one GPU with every expert: the baseline
            W13 = prepare_weights(*(torch.randn(E, I, H, device=dev, dtype=torch.bfloat16, generator=g) * H ** -0.5
                                    for _ in range(2)))
            whole = MoeExperts(W13, torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * I ** -0.5)
        for m in tokens:
            x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
            tw, ids = random_routing(m, spec, dev)
            row = {"model": model, "tokens_per_rank": m, "gpus": world}
            for name, layer in layers.items():
                t = torch.tensor([_time(lambda: layer(x, tw, ids), iters, group=dist.group.WORLD)], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                row[f"ep_{name}_us"] = t.item()
            if rank == 0:
                row["one_gpu_us"] = _time(lambda: whole(x, tw, ids), iters)
                xa = torch.randn(m * world, H, device=dev, dtype=torch.bfloat16)
                twa, idsa = random_routing(m * world, spec, dev)
                row["one_gpu_all_tokens_us"] = _time(lambda: whole(xa, twa, idsa), iters)
                rows.append(row)
                print(json.dumps(row), flush=True)
            dist.barrier()
        layers = whole = w13 = w2 = None  # free before the next model
        torch.cuda.empty_cache()
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    dist.destroy_process_group()


def layer(args) -> None:
    import torch.multiprocessing as mp

    from moe_aot.integrations.parallel import multicast_off

    multicast_off()  # set before the workers start, so NCCL in each of them reads it
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_layer_rank, args=(args.gpus, f"{tmp}/store", args.model.split(","),
                                    [int(t) for t in args.tokens.split(",")], args.iters, args.out),
                 nprocs=args.gpus, join=True)
    rows = json.loads(Path(args.out).read_text())
    print(f"\n{'model':18} {'tokens/rank':>11} {'EP padded us':>12} {'EP exact us':>11} {'1 GPU us':>9} "
          f"{'1 GPU, N*M us':>13}")
    for r in rows:
        print(f"{r['model']:18} {r['tokens_per_rank']:>11} {r['ep_padded_us']:12.1f} {r['ep_exact_us']:11.1f} "
              f"{r['one_gpu_us']:9.1f} {r['one_gpu_all_tokens_us']:13.1f}")


def tune(args) -> None:
    src = Path(args.prepared)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, args.gpus):
            db = Path(tmp) / f"gpus{n}.sqlite"
            shutil.copy(src, db)
            cmd = [sys.executable, "-m", "moe_aot.cli", "measure", "--devices", ",".join(map(str, range(n))),
                   "--db", f"sqlite:///{db}", "--export-dir", str(Path(tmp) / f"tuned{n}")] + args.measure_args
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env={**os.environ}, capture_output=True, text=True)
            results[n] = {"wall_s": round(time.perf_counter() - t0, 1), "rc": proc.returncode,
                          "summary": proc.stderr.strip().splitlines()[-2:]}
            print(json.dumps({"gpus": n, **results[n]}), flush=True)
    if all(r["rc"] == 0 for r in results.values()):
        print(f"\n1 GPU {results[1]['wall_s']} s, {args.gpus} GPUs {results[args.gpus]['wall_s']} s: "
              f"{results[1]['wall_s'] / max(results[args.gpus]['wall_s'], 1e-9):.2f}x")
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("layer", help="time per layer under expert parallelism against one GPU")
    a.add_argument("--gpus", type=int, required=True)
    a.add_argument("--model", default="deepseek-v3,qwen3-235b-a22b")
    a.add_argument("--tokens", default="1,16,256,4096")
    a.add_argument("--iters", type=int, default=50)
    a.add_argument("--out", default="bench_parallel_layer.json")
    b = sub.add_parser("tune", help="tuning wall time on N GPUs against one")
    b.add_argument("--prepared", required=True, help="SQLite file with studies `tune --compile-only` prepared")
    b.add_argument("--gpus", type=int, required=True)
    b.add_argument("--out", default="bench_parallel_tune.json")
    b.add_argument("measure_args", nargs="*", help="more `moe-aot measure` arguments (after --)")
    args = ap.parse_args()
    layer(args) if args.cmd == "layer" else tune(args)


if __name__ == "__main__":
    main()

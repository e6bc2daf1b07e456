#!/usr/bin/env python3
"""Does the order of measurement change a timing? Per point, the served pick (A) and the bucket's
default (B) timed as the tuner and the benchmark time them (harness.measure.measure_variant: CUDA
graphs over several routings, median, after --warmup seconds of untimed replays: the tuner's
SUSTAINED_WARMUP_S unless given; 0 is the burst timing of the tuner before 2026-12-03) in the
order A B A B B A on the same inputs, so a bias of the first (or of the later) measurement shows
up as A1 != A2 or B1 != B2.

    python3 tools/order_check.py --out DIR [--models m1,m2] [--tokens 1,16,1024] [--bench-way]

--bench-way adds W: the pick timed the way tools/bench.py times "ours" (the served layer itself,
0.25 s of untimed warm-up replays, its workspace looked up in each replayed call), and Z: the same
without the warm-up, in the order W Z A B Z W B A, so a difference between the two ways of timing
one variant shows up as W != A, and Z says whether the warm-up (W != Z) or the layer (Z != A) makes it.

Writes DIR/order_check.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe_aot.database import SUSTAINED_WARMUP_S  # noqa: E402
from moe_aot.harness import measure  # noqa: E402
from moe_aot.harness.verify import random_weights  # noqa: E402
from moe_aot.runtime.layer import MoeLayer  # noqa: E402
from moe_aot.runtime.store import KernelStore  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402
from moe_aot.variants import bucket_for, default_variant  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b,gpt-oss-120b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--tokens", default="1,16,1024")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--warmup", type=float, default=SUSTAINED_WARMUP_S,
                    help="seconds of untimed replays before each A / B timing (the tuner's; 0: burst)")
    ap.add_argument("--bench-way", action="store_true", help="also time the pick as tools/bench.py times ours (W)")
    args = ap.parse_args()
    if args.bench_way:
        from bench import WARMUP_S, graph_time_us  # tools/bench.py's own way of timing ours
    store = KernelStore()
    rows = []
    for name in args.models.split(","):
        spec = make_spec(name)
        layer = MoeLayer(spec, store)
        w13, w2 = random_weights(spec, layer.device)
        for M in map(int, args.tokens.split(",")):
            pick, dflt = layer.variant_for(M), default_variant(spec, bucket_for(M))
            if pick == dflt:
                dflt = dflt.pdl_twin()
            sets = measure.input_sets(spec, M, layer.device)
            times = []
            try:
                order = "WZABZWBA" if args.bench_way else "ABABBA"
                for tag in order:
                    t0, wall0 = time.perf_counter(), time.time()
                    if tag in "WZ":
                        us = graph_time_us([lambda s=s, w=(w13, w2): layer.forward(s[0], *w, s[1], s[2], out=s[3],
                                                                                  workspace=layer.workspace(M))
                                            for s in sets], args.replays, WARMUP_S if tag == "W" else 0.0)
                    else:
                        m = measure.measure_variant(layer, pick if tag == "A" else dflt, M, w13, w2, args.replays,
                                                    sets, warmup_s=args.warmup)
                        us = m.get("median_us", float("nan"))
                    # (tag, µs, seconds taken, UTC start): the start lines a timing up with a clock log
                    times.append((tag, round(us, 2), round(time.perf_counter() - t0, 2), round(wall0, 3)))
            except LookupError as exc:  # a variant whose kernels the database lacks: reported, skipped
                print(name, M, "skipped:", exc, flush=True)
                continue
            a = [t for tag, t, *_ in times if tag == "A"]
            b = [t for tag, t, *_ in times if tag == "B"]
            row = {"model": name, "tokens": M, "A": pick.name(spec), "B": dflt.name(spec), "order": times,
                   "A_first_over_A_later": round(a[0] / min(a[1:]), 3),
                   "B_first_over_B_later": round(b[0] / min(b[1:]), 3),
                   "B_over_A_median": round(statistics.median(b) / statistics.median(a), 3)}
            w = [t for tag, t, *_ in times if tag == "W"]
            z = [t for tag, t, *_ in times if tag == "Z"]
            if w:
                row["W_over_A"] = round(statistics.median(w) / statistics.median(a), 3)
                row["Z_over_A"] = round(statistics.median(z) / statistics.median(a), 3)
            rows.append(row)
            print(name, M, " ".join(f"{tag}{t}" for tag, t, *_ in times),
                  f"A1/A* {row['A_first_over_A_later']} B1/B* {row['B_first_over_B_later']} "
                  f"B/A {row['B_over_A_median']}" + (f" W/A {row['W_over_A']} Z/A {row['Z_over_A']}" if w else ""),
                  flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "order_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

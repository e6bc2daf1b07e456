#!/usr/bin/env python3
"""How much of a small layer's CUDA-graph replay time is spent around its kernels rather than in
them (GPU). For each model at --tokens, and for the database's served variant and the bucket's
default four kernels, three timings in one process:

  single   the benchmark's method (tools/bench.py, the tuner): one forward per graph, an event
           pair around each replay, median over --replays;
  stream   the same graph replayed --replays times back to back between one event pair (mean):
           the host queues replays ahead of the GPU, so no replay waits for its launch;
  chain    one graph of --chain forwards captured back to back, as a whole model's graph runs its
           layers (mean per forward);
  host     the host's own time per iteration of the single loop (event, replay, event enqueued):
           where it is above the GPU's time per forward, the GPU waits for the host, and single
           includes the host's graph-launch latency;
  ahead    single again, but each run of --ahead-chunk iterations is enqueued behind a GPU sleep
           long enough for the host to finish enqueueing first, so that no replay waits for the host.

If single is above stream and chain, the difference is launch latency that a model's own graph
does not pay, and a level that changes from one process to the next is in the launch, not in
the kernels. Writes OUT/launch_gaps.json.

    python3 tools/launch_gaps.py --db URL --models qwen3-30b-a3b --precision fp8 --out DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _stream_us(graph, replays: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def _host_and_ahead_us(graph, replays: int, chunk: int) -> tuple[float, float]:
    """(host µs per single-loop iteration, median per-replay µs with the host ahead of the GPU)."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(replays):
        starts[i].record()
        graph.replay()
        ends[i].record()
    host = (time.perf_counter() - t0) * 1e6 / replays
    torch.cuda.synchronize()
    times = []
    cycles = int(max(20.0, 4 * host) * chunk * 2.0e3)  # ~4x the host's enqueue time at up to 2 GHz
    for c0 in range(0, replays, chunk):
        torch.cuda._sleep(cycles)
        idx = range(c0, min(replays, c0 + chunk))
        for i in idx:
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        times += [starts[i].elapsed_time(ends[i]) * 1e3 for i in idx]
    return host, statistics.median(times)


def measure(layer, spec, w13, w2, tokens: int, chain: int, replays: int, warmup_s: float,
            ahead_chunk: int) -> dict:
    import torch

    from moe_aot.harness.measure import _replay_for, capture_graph, graph_times_us
    from moe_aot.harness.verify import random_routing

    dev = layer.device
    x = torch.randn(tokens, spec.hidden, device=dev, dtype=torch.bfloat16)
    tw, ids = random_routing(tokens, spec, dev)
    out = torch.empty(tokens, spec.hidden, device=dev, dtype=torch.bfloat16)

    def one():
        layer.forward(x, w13, w2, tw, ids, out=out)

    def many():
        for _ in range(chain):
            layer.forward(x, w13, w2, tw, ids, out=out)

    single = statistics.median(graph_times_us([one], replays, warmup_s))
    g1 = capture_graph(one)
    _replay_for([g1], warmup_s)
    stream = _stream_us(g1, replays)
    gn = capture_graph(many)
    _replay_for([gn], warmup_s)
    chained = _stream_us(gn, max(1, replays // chain)) / chain
    host, ahead = _host_and_ahead_us(g1, replays, ahead_chunk)
    return {"variant": layer.served(tokens).name(spec), "single_us": round(single, 2),
            "stream_us": round(stream, 2), "chain_us": round(chained, 2), "host_us": round(host, 2),
            "ahead_us": round(ahead, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True, help="database URL (sqlite:///path) or path of a SQLite file")
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--precision", default="bf16,fp8", help="comma-separated")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--chain", type=int, default=20, help="forwards per graph in the chain timing")
    ap.add_argument("--replays", type=int, default=400)
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds of untimed replays before each timing")
    ap.add_argument("--ahead-chunk", type=int, default=50, help="iterations enqueued behind each GPU sleep (ahead)")
    ap.add_argument("--out", type=Path, default=Path("launch_gaps_out"))
    ap.add_argument("--picks-of", default=None, metavar="GPU", help="serve the database's picks for this GPU "
                    "name (e.g. \"NVIDIA H200\" on an H100, same SM count); default: this GPU's")
    ns = ap.parse_args()
    if ns.chain < 1 or ns.replays < ns.chain:
        ap.error(f"--chain must be >= 1 and --replays >= --chain; got --chain {ns.chain}, --replays {ns.replays}")
    if ns.ahead_chunk < 1:
        ap.error(f"--ahead-chunk must be >= 1; got {ns.ahead_chunk}")

    import torch

    from moe_aot.harness.verify import random_weights
    from moe_aot.runtime.layer import MoeLayer
    from moe_aot.runtime.store import KernelStore
    from moe_aot.spec import SpecError, make_spec
    from moe_aot.variants import bucket_for, default_variant

    if not torch.cuda.is_available():
        print("launch_gaps: no GPU here; it times kernels, so it runs only on a GPU machine", file=sys.stderr)
        return 2
    url = ns.db if "://" in ns.db else f"sqlite:///{Path(ns.db).resolve()}"
    store = KernelStore(url)
    rows = []
    b = bucket_for(ns.tokens)
    dev = torch.device("cuda", torch.cuda.current_device())
    for precision in ns.precision.split(","):
        for model in ns.models.split(","):
            try:
                spec = make_spec(model, precision=precision)
            except SpecError as e:
                print(f"skip {model} {precision}: {e}")
                continue
            w13, w2 = random_weights(spec, dev)  # one set for both sources
            for source in ("served", "default"):
                variants = ({b: default_variant(spec, b)} if source == "default"
                            else store.picks(spec, ns.picks_of) if ns.picks_of else None)
                layer = MoeLayer(spec, store, device=dev, variants=variants)
                r = {"model": model, "precision": precision, "tokens": ns.tokens, "source": source,
                     **measure(layer, spec, w13, w2, ns.tokens, ns.chain, ns.replays, ns.warmup, ns.ahead_chunk)}
                rows.append(r)
                print(f"{model:16s} {precision:5s} {source:7s} single {r['single_us']:8.2f}  stream "
                      f"{r['stream_us']:8.2f}  chain {r['chain_us']:8.2f}  host {r['host_us']:6.2f}  ahead "
                      f"{r['ahead_us']:8.2f} us  {r['variant']}", flush=True)
                del layer
            del w13, w2
            torch.cuda.empty_cache()
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "launch_gaps.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
         "command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

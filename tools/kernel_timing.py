"""Cold-L2 timing of one kernel launch, two configs timed in mirrored rounds, and repeated runs
compared bit for bit, shared by the kernel-check tools (not the product)."""
from __future__ import annotations


def mirrored_rounds(fns, rounds: int, replays: int, warmup_s: float):
    """Two configs' (GEMM1, GEMM2) launch closures ``fns[0]``, ``fns[1]`` timed in ``rounds``
    rounds of mirrored order (0 1, 1 0, 0 1, ...), each a CUDA-graph replay of the two GEMMs in
    turn after ``warmup_s`` of untimed replays; returns per config ([GEMM1's median per round],
    [GEMM2's median per round]) in µs."""
    import statistics

    from moe_aot.harness.measure import graph_times_us

    times = {t: ([], []) for t in (0, 1)}
    for r in range(rounds):
        for t in ((0, 1) if r % 2 == 0 else (1, 0)):
            per = graph_times_us(list(fns[t]), 2 * replays, warmup_s)
            times[t][0].append(statistics.median(per[0::2]))
            times[t][1].append(statistics.median(per[1::2]))
    return times


def cold_l2_timer(device, iters: int):
    """A function fn -> median µs of `iters` launches of fn, each after a 512 MB buffer larger than
    L2 is cleared, timed by CUDA events around the launch alone (one warm-up first)."""
    import torch

    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)

    def timed(fn) -> float:
        times = []
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        for _ in range(iters):
            flush.zero_()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        times.sort()
        return times[len(times) // 2]

    return timed


def repeat_runs(repeat: int, glu, down, glu_args, down_args, outs) -> int:
    """``repeat`` runs of glu then down, back to back, each on outputs ``outs`` poisoned first
    (every byte 0xFF: NaN in bf16, fp32 and e4m3); returns how many runs left any output not
    bit-identical to those of one more run before them, poisoned the same way (rows no kernel
    writes stay the same NaN). A race shows as runs that differ (METHOD.md)."""
    import torch

    first = None
    bad = torch.zeros((), dtype=torch.int32, device=outs[0].device)
    for _ in range(repeat + 1):  # run 0 is what the others are compared with
        for o in outs:
            o.view(torch.uint8).fill_(0xFF)
        glu(*glu_args)
        down(*down_args)
        if first is None:
            first = [o.clone() for o in outs]
            continue
        moved = torch.zeros((), dtype=torch.bool, device=bad.device)
        for o, f in zip(outs, first):
            moved |= (o.view(torch.uint8) != f.view(torch.uint8)).any()
        bad += moved.int()
    return int(bad.item())

"""Cold-L2 timing of one kernel launch, shared by the kernel-check tools (not the product)."""
from __future__ import annotations


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

#!/usr/bin/env python3
"""The floor's bf16 matmul rate (tools/bench.py: 8192^3, ten timed after three) beside the same
matmul timed after seconds of back-to-back matmuls: how far the H200's clock falls under a
sustained tensor-core load (its software power cap), i.e. how much of a large layer's gap to the
floor is the clock rather than the kernels. Writes OUT/matmul_clock.json; not a test.

    python3 tools/matmul_clock.py --out OUT [--warmups 0,0.5,2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import matmul_rate  # noqa: E402

from moe_aot.harness.gpustate import Nvml  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warmups", default="0,0.5,2", help="seconds of matmuls before each timing")
    ns = ap.parse_args()
    nvml = Nvml.of_torch_device(torch.cuda.current_device())  # None without NVML: no readings
    rows = []
    for w in [float(x) for x in ns.warmups.split(",")]:
        if w < 0:
            sys.exit(f"--warmups: {w} is negative; give seconds >= 0, e.g. 0,0.5,2")
        rate, state = matmul_rate(nvml, warmup_s=w)
        rows.append({"warmup_s": w, "tflops": round(rate / 1e12, 1), "gpu_state": state})
        print(f"warm-up {w:4.1f} s: {rate / 1e12:6.1f} TFLOP/s  {state}", flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name(), "rows": rows}
    (ns.out / "matmul_clock.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

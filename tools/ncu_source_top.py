#!/usr/bin/env python3
"""Top warp-stall instructions per kernel from an Nsight Compute source-page CSV (SASS), e.g.

    ncu --clock-control none --nvtx --nvtx-include "regex:prof_.*/" --section SourceCounters \\
        --page source --print-source sass --csv python3 tools/check_gemm_kernels.py --run DIR \\
        --only hw128 --models qwen3_30b_a3b --tokens 4096 --iters 1 > src.csv
    python3 tools/ncu_source_top.py src.csv[.gz] [--top 12]

Each line: the instruction's share of all stall samples of its kernel (all warps: producer and
consumer warps alike), its address and its SASS.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(text: str):
    """(kernel name, rows) per kernel section of the CSV."""
    for part in re.split(r'(?m)^"Kernel Name",', text)[1:]:
        head, body = part.split("\n", 1)
        yield head.strip().strip(",").strip('"'), list(csv.DictReader(io.StringIO(body)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        text = f.read()
    for name, rows in kernels(text):
        total = sum(int(r[SAMPLES] or 0) for r in rows)
        print(f"{name[:100]}: {len(rows)} instructions, {total} samples")
        for r in sorted(rows, key=lambda r: -int(r[SAMPLES] or 0))[: args.top]:
            share = 100 * int(r[SAMPLES] or 0) / max(total, 1)
            print(f"  {share:5.1f}%  {r['Address']:>16}  {r['Source'].strip()[:90]}")


if __name__ == "__main__":
    main()

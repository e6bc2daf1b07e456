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
    """(kernel name, rows) per kernel section of the CSV. Rows without a hex address are not the
    kernel's: the profiled command's own output (a warning on stderr) can follow the last section."""
    for part in re.split(r'(?m)^"Kernel Name",', text)[1:]:
        head, body = part.split("\n", 1)
        rows = [r for r in csv.DictReader(io.StringIO(body)) if _is_address(r.get("Address"))]
        yield head.strip().strip(",").strip('"'), rows


def _is_address(v) -> bool:
    return isinstance(v, str) and re.fullmatch(r"(0x)?[0-9a-fA-F]+", v.strip()) is not None


def _num(v) -> float:
    """A counter cell as a number ("1,234" and "" included: ncu may group digits, and leaves
    instructions without samples empty)."""
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def top_stalls(rows, n: float, count: int, columns) -> str:
    """The ``count`` largest stall reasons summed over ``rows`` (the CSV's ``stall_*`` columns),
    each as its share of the ``n`` samples of those rows."""
    stalls = {k[len("stall_"):]: sum(_num(r[k]) for r in rows) for k in columns
              if k.startswith("stall_") and "Not Issued" not in k}
    ranked = sorted(stalls.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{k} {100 * v / max(n, 1):.0f}%" for k, v in ranked)


def region_line(rows, base: int, lo: int, hi: int, name: str, total: int) -> str:
    """One SASS address range [lo, hi) of a kernel, as offsets from its first instruction at
    ``base`` (the addresses cuobjdump prints): its share of the stall samples, its top stall
    reasons, and its instructions executed and excess shared-memory wavefronts (bank conflicts)."""
    inside = [r for r in rows if lo <= int(r["Address"], 16) - base < hi]
    n = sum(_num(r[SAMPLES]) for r in inside)
    top = top_stalls(inside, n, 4, rows[0] if rows else {})
    executed = sum(_num(r.get("Instructions Executed", 0)) for r in inside)
    excess = sum(_num(r.get("L1 Wavefronts Shared Excessive", 0)) for r in inside)
    return (f"region {name} [{lo:#x}, {hi:#x}): {100 * n / max(total, 1):.1f}% of samples ({top}); "
            f"{executed:.0f} warp instructions, {excess:.0f} excess shared wavefronts")


def opcode(sass: str) -> str:
    """The opcode of one SASS line without its predicate and modifiers ("@!P0 LDG.E.128 R4, ..." ->
    "LDG")."""
    words = sass.strip().split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def opcode_lines(rows, total: int, top: int) -> list[str]:
    """The stall samples of a kernel summed per opcode (its ``top`` opcodes): share of samples,
    instructions executed and the two largest stall reasons of each."""
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(opcode(r["Source"]), []).append(r)
    lines = []
    for op, rs in sorted(groups.items(), key=lambda kv: -sum(_num(r[SAMPLES]) for r in kv[1]))[:top]:
        n = sum(_num(r[SAMPLES]) for r in rs)
        why = top_stalls(rs, n, 2, rs[0])
        executed = sum(_num(r.get("Instructions Executed", 0)) for r in rs)
        lines.append(f"  {100 * n / max(total, 1):5.1f}%  {op:10s} {len(rs):4d} instrs, {executed:12.0f} "
                     f"executed ({why})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--regions", default="", help="also the share of samples per SASS address range, "
                    "'START-END:name,...' (hex, END exclusive), e.g. a kernel's loops as read in its cuobjdump")
    ap.add_argument("--by-opcode", type=int, default=0, metavar="N",
                    help="also the samples summed per opcode (the N largest), to compare two builds of a kernel")
    args = ap.parse_args()
    regions = []
    for part in filter(None, args.regions.split(",")):
        span, name = part.split(":")
        lo, hi = (int(v, 16) for v in span.split("-"))
        regions.append((lo, hi, name))
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        text = f.read()
    for name, rows in kernels(text):
        total = sum(_num(r[SAMPLES]) for r in rows)
        print(f"{name[:100]}: {len(rows)} instructions, {total:.0f} samples")
        base = min((int(r["Address"], 16) for r in rows), default=0)  # the kernel's first instruction
        for lo, hi, region in regions:
            print("  " + region_line(rows, base, lo, hi, region, total))
        if args.by_opcode:
            print("\n".join(opcode_lines(rows, total, args.by_opcode)))
        for r in sorted(rows, key=lambda r: -_num(r[SAMPLES]))[: args.top]:
            share = 100 * _num(r[SAMPLES]) / max(total, 1)
            print(f"  {share:5.1f}%  {r['Address']:>16}  {r['Source'].strip()[:90]}")


if __name__ == "__main__":
    main()

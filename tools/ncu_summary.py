#!/usr/bin/env python3
"""Summarise Nsight Compute CSV logs (`ncu --csv --page details`, as tools/gpu_run.py --profile
writes them): per profiled kernel its NVTX range, grid and block, the headline throughputs and the
top warp-stall reasons per issued instruction.

    python3 tools/ncu_summary.py tools/results/gpu_2026-12-01/ncu_gemms_4096_v3.csv [more.csv ...]
"""
from __future__ import annotations

import collections
import csv
import io
import re
import sys

# where a kernel's bytes go: DRAM read / written, L2 sectors read / written and the read hit rate
BYTES = ["dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_op_read.sum", "lts__t_sectors_op_write.sum",
         "lts__t_sector_op_read_hit_rate.pct"]
# who asks L2 for what: the gathered rows' cp.async sectors at L1TEX, and L2's read requests / sectors
# from the SMs
REQUESTS = ["l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum", "lts__t_requests_srcunit_tex_op_read.sum",
            "lts__t_sectors_srcunit_tex_op_read.sum"]
WANT = ["Duration", "SM Frequency", "Compute (SM) Throughput", "L2 Cache Throughput", "DRAM Throughput",
        "Issue Slots Busy", "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction",
        "L2 Hit Rate", "Achieved Occupancy", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", *BYTES, *REQUESTS]
STALL = "smsp__average_warps_issue_stalled_"


def load(path: str) -> dict:
    """Kernel id -> {nvtx, grid, block, metrics: name -> (value, unit)}."""
    text = open(path).read()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    nvtx = next(k for k in rows[0] if k.startswith("thread Domain"))
    kernels = collections.OrderedDict()
    for r in rows:
        k = kernels.setdefault(r["ID"], {"nvtx": r[nvtx], "grid": r["Grid Size"], "block": r["Block Size"],
                                         "name": r.get("Kernel Name", ""), "metrics": {}})
        k["metrics"][r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
    return kernels


def main(paths) -> None:
    for path in paths:
        for kid, k in load(path).items():
            m = k["metrics"]
            rng = k["nvtx"][k["nvtx"].find("prof_"):].split(":")[0] if "prof_" in k["nvtx"] else k["nvtx"][:48]
            name = k["name"]  # the template's class, from the DSL's mangled kernel name
            found = re.search(r"(Hopper[A-Za-z0-9]+|Moe[A-Z][A-Za-z0-9]+)", name)
            short = found.group(1) if found else name[:40]
            print(kid, rng, k["grid"], k["block"], short)
            print("   ", "; ".join(f"{name}={m[name][0]}{m[name][1]}" for name in WANT if name in m))
            stalls = {n[len(STALL):].replace("_per_issue_active.ratio", ""): float(v[0])
                      for n, v in m.items() if n.startswith(STALL)}
            top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
            print("    stalls:", ", ".join(f"{n}={v:.2f}" for n, v in top))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])

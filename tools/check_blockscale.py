#!/usr/bin/env python3
"""Build (CPU) and check (GPU) the block-scaled quantization kernels of templates/blockscale_quant.py.

  python3 tools/check_blockscale.py --build DB.sqlite [--target sm_90a] [-j 2]
      (CPU, needs the DSL) compile the quantizer of every format (mxfp8, mxfp4, nvfp4) at every
      K of moe_aot.harness.blockscale.KS into the SQLite database DB.sqlite
  python3 tools/check_blockscale.py --db DB.sqlite --out OUTDIR [--seeds 3] [--rows 1,37,1000,4097]
      (GPU, torch + moe_aot, no DSL) load them with the runtime and compare every output byte
      (values and scales) with the torch reference moe_aot.blockscale for each format, K, row
      count, input distribution and seed, outputs poisoned twice with different bytes; writes
      OUTDIR/results.json (one row per check) and OUTDIR/summary.txt; exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_aot.blockscale import FORMATS  # noqa: E402
from moe_aot.harness import blockscale as H  # noqa: E402


def build(db_path: Path, target: str, jobs: int) -> int:
    from moe_aot.compiler import compile_into
    from moe_aot.database import Database
    from moe_aot.variants import BlockScaleShape, blockscale_kernel

    shapes = [BlockScaleShape(fmt, k, target) for fmt in FORMATS for k in H.KS[fmt]]
    db = Database(f"sqlite:///{db_path.resolve()}")
    try:
        results = compile_into(db, [], jobs=jobs, extra=[(s, blockscale_kernel(s)) for s in shapes],
                               progress=lambda r, i, n: print(f"[{i}/{n}] {'ok' if r.artifact else 'FAILED'} "
                                                              f"{r.seconds:5.1f}s {r.kernel.name}", flush=True))
    finally:
        db.close()
    failed = [r for r in results if r.artifact is None]
    for r in failed:
        print(f"{r.kernel.name}: {r.error}")
    print(f"{len(results) - len(failed)} compiled, {len(failed)} failed, {len(shapes) - len(results)} already "
          f"in {db_path}")
    return 1 if failed else 0


def run(db_path: Path, out: Path, seeds: int, rows_list: list[int]) -> int:
    import torch

    from moe_aot.runtime import blockscale as rt
    from moe_aot.runtime.store import KernelStore

    store = KernelStore(f"sqlite:///{db_path.resolve()}")
    dev = torch.device("cuda")
    out.mkdir(parents=True, exist_ok=True)
    rows_out, t0 = [], time.time()
    for fmt in FORMATS:
        for k in H.KS[fmt]:
            rt.quantize_kernel(fmt, k, dev, store)  # a missing kernel stops the run here, saying which
            for rows in rows_list:
                for dist in H.DISTRIBUTIONS:
                    for seed in range(seeds):
                        gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt} {k} {rows} {dist} {seed}".encode()))
                        x, gamax = H.make_input(dist, rows, k, fmt, gen)
                        row = H.check(fmt, x, gamax, lambda x, f, g, o: rt.quantize(x, f, g, o, store=store), dev)
                        row.update(dist=dist, seed=seed)
                        rows_out.append(row)
                        if not row["ok"]:
                            print(f"MISMATCH {row}", flush=True)
    bad = [r for r in rows_out if not r["ok"]]
    info = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "python": platform.python_version(),
            "driver_cuda": torch.version.cuda, "checks": len(rows_out), "failed": len(bad),
            "seconds": round(time.time() - t0, 1)}
    (out / "results.json").write_text(json.dumps({"info": info, "rows": rows_out}, indent=1))
    lines = [f"check_blockscale on {info['device']} (torch {info['torch']}): {len(rows_out) - len(bad)} of "
             f"{len(rows_out)} checks bit-exact, {len(bad)} failed, in {info['seconds']} s"]
    for fmt in FORMATS:
        mine = [r for r in rows_out if r["format"] == fmt]
        ks = ", ".join(map(str, H.KS[fmt]))
        lines.append(f"  {fmt}: {sum(r['ok'] for r in mine)}/{len(mine)} bit-exact (K {ks}; "
                     f"rows {', '.join(map(str, rows_list))}; {', '.join(H.DISTRIBUTIONS)}; {seeds} seeds)")
    lines += [f"  FAILED {r}" for r in bad[:20]]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, help="CPU: compile the kernels into this SQLite file")
    ap.add_argument("--target", default="sm_90a", help="--build: the GPU target (default sm_90a)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="--build: parallel compile processes")
    ap.add_argument("--db", type=Path, help="GPU: the SQLite file --build wrote")
    ap.add_argument("--out", type=Path, help="GPU: folder for results.json and summary.txt")
    ap.add_argument("--seeds", type=int, default=3, help="GPU: inputs per (format, K, rows, distribution)")
    ap.add_argument("--rows", default="1,37,1000,4097", help="GPU: row counts, comma-separated")
    a = ap.parse_args()
    if a.build:
        return build(a.build, a.target, a.jobs)
    if a.db and a.out:
        return run(a.db, a.out, a.seeds, [int(r) for r in a.rows.split(",")])
    ap.error("give --build DB (CPU) or --db DB --out OUTDIR (GPU)")
    return 2


if __name__ == "__main__":
    sys.exit(main())

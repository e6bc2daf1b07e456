#!/usr/bin/env python3
"""The host side of the runtime's cold start, on a machine without a GPU: in a fresh process
after `import torch`, import the runtime, open the kernel database, read the tuned picks and
the four kernel libraries of one layer (bytes and metadata; dlopen and launch need a GPU, see
tools/gpu_run.py --coldstart). Both database readers are timed, alternating, in one run: the
standard-library SQLite reader the runtime uses and the SQLAlchemy one (server databases).

    python3 tools/coldstart_cpu.py --db cache/moe_aot.sqlite [--model qwen3-30b-a3b] [--runs 7]

Writes tools/results/coldstart_cpu.json (or --out DIR).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
t0 = time.perf_counter()
from moe_aot.runtime.layer import MoeLayer
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
from moe_aot.variants import default_variant
t_import = time.perf_counter()
url, model, reader = sys.argv[1:4]
if reader == "sqlalchemy":  # what the store opens for a server URL, here on the same file
    import moe_aot.runtime.store as _store
    from moe_aot.dbread import SqlAlchemyReader
    _store.open_reader = SqlAlchemyReader
store = KernelStore(url)
t_open = time.perf_counter()
spec = make_spec(model)
picks = store.picks(spec, "NVIDIA H200")
v = picks.get(16) or default_variant(spec, 16)
sizes = []
for kv in v.kernels(spec):
    [ver] = [a for a in store.db.artifact_versions(kv.name) if a.status == "ok"][-1:]
    lib, meta = store.db.artifact(kv.name, ver.toolchain)
    sizes.append(len(lib))
t_read = time.perf_counter()
print(json.dumps({"reader": reader, "import_runtime_ms": 1e3 * (t_import - t0),
                  "open_db_ms": 1e3 * (t_open - t_import), "picks_and_4_libraries_ms": 1e3 * (t_read - t_open),
                  "total_ms": 1e3 * (t_read - t0), "library_bytes": sum(sizes),
                  "sqlalchemy_imported": "sqlalchemy" in sys.modules}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default=str(ROOT / "cache" / "moe_aot.sqlite"))
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "tools" / "results"))
    ns = ap.parse_args()
    url = f"sqlite:///{Path(ns.db).resolve()}"
    rows = []
    for i in range(ns.runs + 1):  # the first pair warms the page cache and .pyc files; dropped
        for reader in ("stdlib", "sqlalchemy"):
            out = subprocess.run([sys.executable, "-c", CHILD, url, ns.model, reader], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            if i:
                rows.append(row)
                print(row, flush=True)
    summary = {}
    for reader in ("stdlib", "sqlalchemy"):
        mine = [r for r in rows if r["reader"] == reader]
        summary[reader] = {k: round(statistics.median(r[k] for r in mine), 1)
                           for k in ("import_runtime_ms", "open_db_ms", "picks_and_4_libraries_ms", "total_ms")}
        summary[reader]["sqlalchemy_imported"] = mine[0]["sqlalchemy_imported"]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), no GPU",
              "command": "python3 tools/coldstart_cpu.py " + " ".join(sys.argv[1:]),
              "model": ns.model, "runs": ns.runs, "median": summary, "rows": rows}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coldstart_cpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median"], indent=1))


if __name__ == "__main__":
    main()

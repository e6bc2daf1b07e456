#!/usr/bin/env python3
"""The host side of the runtime's cold start and of an eager forward, on a machine without a GPU.

Every stage runs in a fresh process after `import torch`, with compiled .pyc files (as an
installed package has them; the first round of each kind writes them and is dropped):

- `load`: import the runtime, open the kernel database, read the tuned picks, load the four
  kernel libraries of one layer (`MoeLayer.kernels(16)`: the store's queries, decompress, sha256
  checks, files, dlopen). What needs a GPU -- the libraries' CUDA init and load-to-device -- is
  replaced by a plain dlopen (tools/gpu_run.py --coldstart measures it on the GPU). Each run gets
  an empty unpack folder ("cold", the first process on a machine) and a folder an earlier
  process filled ("warm", every later one).
- `stages`: the same work split by step with the standard library alone (queries, quick_check,
  decompress, sha256, write, dlopen), independent of the runtime's code.
- `host`: eager host time per forward (median of --calls calls, after 50 warm-up calls) through
  MoeLayer.forward on CPU tensors of the layer's real shapes, with the four libraries replaced by
  no-op libraries of the same argument ABI (built with gcc): the runtime's Python, checks and
  ctypes calls, without what the real launchers do on the GPU (building TMA descriptors, the
  CUDA launch itself).
- `sqlalchemy`: the load stage through the SQLAlchemy reader that server URLs use.
- `host` also times the first forward at its size (out allocated, as gpu_run.py --coldstart
  without the GPU's work) and its stages (`MoeLayer.first_call_ms`), with the native launcher
  compiled beforehand into the run's unpack folder (a later process finds it there).

    python3 tools/coldstart_cpu.py --db cache/moe_aot.sqlite [--model qwen3-30b-a3b] [--runs 7]
                                   [--compare /work/main]   # the same children on another checkout

Writes tools/results/coldstart_cpu.json (or --out DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("sqlalchemy", "optuna", "cutlass", "moe_aot_templates", "moe_aot.compiler",
         "moe_aot.tuner", "moe_aot.database", "moe_aot.kernel_build")

# No CUDA in a CPU build of torch: what the runtime asks of torch.cuda is answered here.
PATCH_CUDA = r"""
import ctypes, json, sys, time, types
import torch
torch.cuda.current_device = lambda: 0
torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
torch._C._cuda_getCurrentRawStream = lambda index: 0
"""

LOAD = PATCH_CUDA + r"""
t0 = time.perf_counter()
from moe_aot.runtime.layer import MoeLayer
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
t_import = time.perf_counter()
url, model, reader, unpack = sys.argv[1:5]
if reader == "sqlalchemy":  # what the store opens for a server URL, here on the same file
    import moe_aot.runtime.store as _store
    from moe_aot.database import SqlAlchemyReader
    _store.open_reader = SqlAlchemyReader
import moe_aot.runtime.library as L
dl = []
def no_gpu_init(self, so_path, meta, device=None):  # dlopen only: CUDA init needs a GPU
    t = time.perf_counter()
    self.meta, self.name = meta, meta["name"]
    self._lib = ctypes.CDLL(str(so_path), mode=ctypes.RTLD_LOCAL)
    dl.append(time.perf_counter() - t)
L.KernelLibrary.__init__ = no_gpu_init
store = KernelStore(url, unpack_dir=unpack)
t_open = time.perf_counter()
spec = make_spec(model)
picks = store.picks(spec, "NVIDIA H200")
t_picks = time.perf_counter()
layer = MoeLayer(spec, store, device=torch.device("cpu"), variants=picks)
v, *libs = layer.kernels(16)
t_load = time.perf_counter()
heavy = sorted({m if m in HEAVY else m.split(".")[0] for m in sys.modules if m.split(".")[0] in HEAVY or m in HEAVY})
print(json.dumps({"import_runtime_ms": 1e3 * (t_import - t0), "open_db_ms": 1e3 * (t_open - t_import),
                  "picks_ms": 1e3 * (t_picks - t_open), "load_4_kernels_ms": 1e3 * (t_load - t_picks),
                  "of_which_dlopen_ms": 1e3 * sum(dl), "total_ms": 1e3 * (t_load - t0),
                  "heavy_modules": heavy, "moe_aot": __import__("moe_aot").__file__}))
""".replace("HEAVY", repr(HEAVY))

STAGES = r"""
import ctypes, hashlib, json, os, sqlite3, sys, tempfile, time, zlib
path, names = sys.argv[1], sys.argv[2].split(",")
ms = lambda t: 1e3 * (time.perf_counter() - t)
out = {}
t = time.perf_counter()
con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
con.execute("SELECT version FROM moe_aot_schema_version").fetchall()
out["connect_and_schema_ms"] = ms(t)
t = time.perf_counter()
con.execute("PRAGMA quick_check(1)").fetchall()
out["quick_check_ms"] = ms(t)
per = {k: 0.0 for k in ("query_meta_ms", "query_blob_ms", "decompress_ms", "sha256_ms", "write_ms",
                        "read_back_and_sha256_ms", "dlopen_ms")}
folder = tempfile.mkdtemp()
raw_bytes = packed_bytes = 0
for n in names:
    t = time.perf_counter()
    con.execute("SELECT toolchain, status, created_at, sha256, meta FROM moe_aot_artifacts WHERE name = ?",
                (n,)).fetchall()
    per["query_meta_ms"] += ms(t)
    t = time.perf_counter()
    [(blob,)] = con.execute("SELECT library FROM moe_aot_artifacts WHERE name = ?", (n,)).fetchall()
    per["query_blob_ms"] += ms(t)
    t = time.perf_counter()
    raw = zlib.decompress(blob)
    per["decompress_ms"] += ms(t)
    t = time.perf_counter()
    digest = hashlib.sha256(raw).hexdigest()
    per["sha256_ms"] += ms(t)
    t = time.perf_counter()
    p = os.path.join(folder, f"lib{digest}.so")
    with open(p, "wb") as f:
        f.write(raw)
    per["write_ms"] += ms(t)
    t = time.perf_counter()
    with open(p, "rb") as f:
        hashlib.sha256(f.read()).hexdigest()
    per["read_back_and_sha256_ms"] += ms(t)
    t = time.perf_counter()
    ctypes.CDLL(p, mode=ctypes.RTLD_LOCAL)
    per["dlopen_ms"] += ms(t)
    raw_bytes += len(raw)
    packed_bytes += len(blob)
out.update({f"4_libraries_{k}": v for k, v in per.items()}, library_bytes=raw_bytes, stored_bytes=packed_bytes)
print(json.dumps(out))
"""

HOST = PATCH_CUDA + r"""
torch.Tensor.is_cuda = property(lambda self: True)  # CPU tensors stand in for CUDA ones
from moe_aot.runtime.layer import MoeLayer
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
url, model, tokens, calls, unpack = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
spec = make_spec(model)
store = KernelStore(url, unpack_dir=unpack)
layer = MoeLayer(spec, store, device=torch.device("cpu"), variants=store.picks(spec, "NVIDIA H200"))
layer.kernels(tokens)  # loaded before the first forward, as gpu_run.py --coldstart does
M, bf = tokens, torch.bfloat16
x = torch.empty(M, spec.hidden, dtype=bf)
w13 = torch.empty(spec.experts, 2 * spec.intermediate, spec.hidden, dtype=bf)
w2 = torch.empty(spec.experts, spec.hidden, spec.intermediate, dtype=bf)
tw = torch.empty(M, spec.top_k)
ids = torch.zeros(M, spec.top_k, dtype=torch.int32)
out = torch.empty(M, spec.hidden, dtype=bf)
res = {"tokens": M}
t = time.perf_counter()
layer.forward(x, w13, w2, tw, ids)  # the first call at this size, out allocated (as gpu_run.py --coldstart)
res["first_forward_ms"] = 1e3 * (time.perf_counter() - t)
res.update({f"first_call_{k}_ms": v for k, v in getattr(layer, "first_call_ms", {}).items()})
res["native_launch"] = getattr(layer._last, "native", None)
for label, kw in (("out_given", {"out": out}), ("out_allocated", {})):
    for _ in range(50):
        layer.forward(x, w13, w2, tw, ids, **kw)
    ts = []
    for _ in range(calls):
        t = time.perf_counter_ns()
        layer.forward(x, w13, w2, tw, ids, **kw)
        ts.append(time.perf_counter_ns() - t)
    ts.sort()
    res[f"host_us_median_{label}"] = ts[len(ts) // 2] / 1e3
    res[f"host_us_p90_{label}"] = ts[int(len(ts) * 0.9)] / 1e3
print(json.dumps(res))
"""

PREBUILD = r"""
import json, sys
from moe_aot.runtime.launch import native_launcher
print(json.dumps({"native_launcher": bool(native_launcher(sys.argv[1]))}))
"""

NOOP_C = r"""
/* stands in for kernel library {name}: same entry points and packed-call ABI, launches nothing */
void {init}(void **a) {{ *(int *)a[1] = 0; }}
void {load}(void **a) {{ *(int *)a[2] = 0; }}
void {run}(void **a) {{ (void)a; }}
"""


def fake_database(db: Path, model: str, folder: Path) -> Path:
    """A copy of `db` whose four kernels of the 16-token bucket are no-op libraries (gcc)."""
    sys.path.insert(0, str(ROOT))
    from moe_aot.dbread import pack, sha
    from moe_aot.runtime.store import KernelStore
    from moe_aot.spec import make_spec
    from moe_aot.variants import bucket_for, default_variant

    spec = make_spec(model)
    picks = KernelStore(f"sqlite:///{db}").picks(spec, "NVIDIA H200")
    v = picks[bucket_for(16, tuple(sorted(picks)))] if picks else default_variant(spec, 16)
    path = folder / "fake.sqlite"
    src, dst = sqlite3.connect(f"file:{db}?mode=ro", uri=True), sqlite3.connect(path)
    src.backup(dst)
    for kv in v.kernels(spec):
        for toolchain, meta in dst.execute("SELECT toolchain, meta FROM moe_aot_artifacts WHERE name = ?",
                                           (kv.name,)).fetchall():
            meta = json.loads(meta)
            abi = meta["host_abi"]
            c = folder / f"{kv.name}.c"
            c.write_text(NOOP_C.format(name=kv.name, init=abi["init"], load=abi["load_to_device"], run=abi["run"]))
            so = folder / f"{kv.name}.so"
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(so), str(c)], check=True)
            lib = so.read_bytes()
            meta["sha256"]["library"] = sha(lib)
            dst.execute("UPDATE moe_aot_artifacts SET library = ?, sha256 = ?, meta = ? WHERE name = ? AND "
                        "toolchain = ?", (pack(lib), sha(lib), json.dumps(meta), kv.name, toolchain))
    dst.commit()
    dst.close()
    return path, [kv.name for kv in v.kernels(spec)]


def child(code: str, args: list[str], checkout: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(checkout), PYTHONPYCACHEPREFIX=str(Path(tempfile.gettempdir()) / "moe_aot_pyc"))
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=checkout, env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_rows(rows: list[dict]) -> dict:
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    summary = {k: round(statistics.median(r[k] for r in rows), 2) for k in keys}
    summary.update({k: v for k, v in rows[0].items() if k not in keys})
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default=str(ROOT / "cache" / "moe_aot.sqlite"))
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1000, help="forwards timed per host-time run")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--compare", default=None, metavar="CHECKOUT",
                    help="also run every child on this checkout's moe_aot (e.g. the main branch), alternating")
    ap.add_argument("--out", default=str(ROOT / "tools" / "results"))
    ns = ap.parse_args()
    db = Path(ns.db).resolve()
    url = f"sqlite:///{db}"
    checkouts = {"this": ROOT} | ({"compare": Path(ns.compare).resolve()} if ns.compare else {})
    work = Path(tempfile.mkdtemp(prefix="moe_aot_coldstart_"))
    fake, names = fake_database(db, ns.model, work)
    for label, checkout in checkouts.items():  # the launcher every later process finds compiled
        child(PREBUILD, [str(work / f"fake_{label}")], checkout)
    rows = {}
    for i in range(ns.runs + 1):  # the first round writes .pyc files and warms the page cache: dropped
        for label, checkout in checkouts.items():
            warm = work / f"warm_{label}"
            got = {
                "load_cold": child(LOAD, [url, ns.model, "stdlib", str(Path(tempfile.mkdtemp(dir=work)))], checkout),
                "load_warm": child(LOAD, [url, ns.model, "stdlib", str(warm)], checkout),
                "sqlalchemy": child(LOAD, [url, ns.model, "sqlalchemy", str(warm)], checkout),
                "stages": child(STAGES, [str(db), ",".join(names)], checkout),
                "host": child(HOST, [f"sqlite:///{fake}", ns.model, str(ns.tokens), str(ns.calls),
                                     str(work / f"fake_{label}")], checkout),
            }
            if i:
                for kind, row in got.items():
                    rows.setdefault(label, {}).setdefault(kind, []).append(row)
                print(label, {k: {kk: round(vv, 2) for kk, vv in r.items() if isinstance(vv, float)}
                              for k, r in got.items()}, flush=True)
    summary = {label: {kind: median_rows(r) for kind, r in kinds.items()} for label, kinds in rows.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores), no GPU",
              "command": "python3 tools/coldstart_cpu.py " + " ".join(sys.argv[1:]),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(),
              "model": ns.model, "runs": ns.runs, "checkouts": {k: str(v) for k, v in checkouts.items()},
              "median": summary, "rows": rows}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coldstart_cpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median"], indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A whole GPU run in one command, on a machine without the DSL (the product's AOT story).

    python3 tools/gpu_run.py --out $OUT [--db cache/moe_aot.sqlite] [--tests]
        [--coldstart [--coldstart-compare DIR [--coldstart-compare-db FILE]] [--coldstart-diag]]
        [--bench ARGS] [--bench-fp8 ARGS] [--check-backward ARGS] [--profile-backward ARGS] [--bench-backward ARGS]
        [--gemm-peers ARGS] [--profile-layer MODEL:TOKENS,...] [--profile-kernels REGEX]
        [--gemm-check DIR [--profile TAGS@TOKENS]] [--measure] [--sanitize MODELS] [--spark-standin DIR]

1. installs the wheels brought along in .whl/ (sqlalchemy, ...) into /tmp/site;
2. records the device (name, driver, torch);
3. measures the runtime's cold start in a fresh process (import, open database, load, first launch);
4. runs the GPU tests (pytest -m gpu) against the kernels in the database;
5. runs tools/bench.py if asked;
6. runs tools/check_gemm_kernels.py on precompiled GEMM kernels if asked;
7. profiles chosen GEMM configs with Nsight Compute (hardware counters) if asked, beside a
   cuBLAS matmul of comparable size as the local ceiling;
and writes everything under --out (logs, junit xml, JSON), printing a short summary last.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_summary import BYTES, REQUESTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SITE = "/tmp/site"

COLD_START = r"""
import time, json, os, sys
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t_cuda = time.perf_counter()
from moe_aot.runtime.layer import MoeLayer
from moe_aot.runtime.store import KernelStore
from moe_aot.spec import make_spec
t_import = time.perf_counter()
heavy = sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("sqlalchemy", "optuna", "cutlass")})
store = KernelStore()
t_open = time.perf_counter()
spec = make_spec(sys.argv[1])
layer = MoeLayer(spec, store)
t_picks = time.perf_counter()
_, *libs = layer.kernels(16)
t_load = time.perf_counter()
stages = {k: round(sum(getattr(l, "load_ms", {}).get(k, 0) for l in libs), 3)
          for k in ("dlopen", "init", "load_to_device")}
x = torch.randn(16, spec.hidden, device="cuda", dtype=torch.bfloat16)
w13 = torch.randn(spec.experts, 2 * spec.intermediate, spec.hidden, device="cuda", dtype=torch.bfloat16)
w2 = torch.randn(spec.experts, spec.hidden, spec.intermediate, device="cuda", dtype=torch.bfloat16)
ids = torch.randint(0, spec.experts, (16, spec.top_k), device="cuda", dtype=torch.int32)
tw = torch.rand(16, spec.top_k, device="cuda")
out = torch.empty(16, spec.hidden, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t_data = time.perf_counter()
layer.forward(x, w13, w2, tw, ids); torch.cuda.synchronize()
t_first = time.perf_counter()
n = 200
for _ in range(n):
    layer.forward(x, w13, w2, tw, ids)
t_host = time.perf_counter(); torch.cuda.synchronize()
med = {}
for label, kw in (("out_allocated", {}), ("out_given", {"out": out})):
    ts = []
    for _ in range(20):  # 20 x 50 timed calls, synchronised between batches so launches never queue up
        for _ in range(50):
            t = time.perf_counter_ns()
            layer.forward(x, w13, w2, tw, ids, **kw)
            ts.append(time.perf_counter_ns() - t)
        torch.cuda.synchronize()
    ts.sort()
    med[f"eager_host_us_median_1000_{label}"] = ts[len(ts) // 2] / 1e3
plan = next(iter(getattr(layer, "_fast", {}).values()), None)
diag = {}
if os.environ.get("MOE_AOT_COLDSTART_DIAG") == "1":  # after every standard number: where host time goes
    def median_us(fn, batches=20, per=50):
        ts = []
        for _ in range(batches):
            for _ in range(per):
                t = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t)
            torch.cuda.synchronize()
        ts.sort()
        return ts[len(ts) // 2] / 1e3
    layer.forward(x, w13, w2, tw, ids, out=out)
    for lib in libs:
        getattr(lib, "shim_stats", lambda reset=False: None)(reset=True)
    if getattr(plan, "native", False):
        fn, ptr = plan._fn, plan._plan_ptr
        diag["native_call_us"] = median_us(lambda: fn(ptr))  # the four launchers alone, one ctypes call
        n_calls = 1000
    else:
        n_calls = 0
    diag["shim"] = {l.name.split("_sm90a")[0]: getattr(l, "shim_stats", lambda: None)() for l in libs}
    if n_calls and all(diag["shim"].values()):
        st = list(diag["shim"].values())
        diag["shim_driver_launch_us_per_launch"] = sum(v["driver_ns"] for v in st) / 1e3 / (4 * n_calls)
        diag["shim_launch_us_per_launch"] = sum(v["launch_ns"] for v in st) / 1e3 / (4 * n_calls)
        diag["shim_calls_per_forward"] = {k: sum(v.get(k, 0) for v in st) / n_calls for k in
                                          sorted({k for v in st for k in v if k.startswith("cuda")})}
    diag["forward_us_again"] = median_us(lambda: layer.forward(x, w13, w2, tw, ids, out=out))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.forward(x, w13, w2, tw, ids, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer.forward(x, w13, w2, tw, ids, out=out)
    g.replay(); torch.cuda.synchronize()
    diag["graph_replay_host_us"] = median_us(g.replay)
    e = torch.empty(1, device="cuda")
    diag["torch_one_kernel_us"] = median_us(lambda: e.add_(1))  # a torch launch, for scale
print(json.dumps({"model": sys.argv[1], "cuda_context_ms": 1e3 * (t_cuda - t0),
                  "import_runtime_ms": 1e3 * (t_import - t_cuda), "open_db_ms": 1e3 * (t_open - t_import),
                  "picks_ms": 1e3 * (t_picks - t_open), "load_4_kernels_ms": 1e3 * (t_load - t_picks),
                  "load_stages_ms": stages, "first_forward_ms": 1e3 * (t_first - t_data),
                  "cold_start_ms_excluding_cuda_context": 1e3 * ((t_import - t_cuda) + (t_open - t_import)
                                                                 + (t_load - t_open) + (t_first - t_data)),
                  "eager_host_us_per_forward": 1e6 * (t_host - t_first) / n, **med,
                  "first_call_stages_ms": getattr(layer, "first_call_ms", None), "diag": diag,
                  "native_launch": getattr(plan, "native", None), "eager_graphs": getattr(plan, "graphs", None),
                  "heavy_modules": heavy,
                  "moe_aot_from": sys.modules["moe_aot"].__file__}))
"""


BYTECODE_STATE = r"""
import json, os, sys, glob
import moe_aot
pkg = os.path.dirname(moe_aot.__file__)
print(json.dumps({"dont_write_bytecode": sys.flags.dont_write_bytecode, "pycache_prefix": sys.pycache_prefix,
                  "env": {k: v for k, v in os.environ.items() if k.startswith("PYTHON") and k != "PYTHONPATH"},
                  "package_writable": os.access(pkg, os.W_OK),
                  "pyc_files": len(glob.glob(os.path.join(pkg, "**", "__pycache__", "*.pyc"), recursive=True))}))
"""


def bytecode_state(env):
    """Whether this checkout's modules can have .pyc files, and how many there are."""
    rc, log, _ = sh([sys.executable, "-c", BYTECODE_STATE], env=dict(env, PYTHONSAFEPATH="1"), timeout=60)
    lines = [x for x in log.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if rc == 0 and lines else {"error": log[-500:]}


def sh(cmd, log=None, env=None, timeout=None):
    """Run cmd; a command past `timeout` is killed and returns rc 124 with what it printed."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        rc, out = 124, text(exc.stdout) + text(exc.stderr) + f"\n[killed after {timeout} s]\n"
    if log:
        Path(log).write_text(out)
    return rc, out, time.perf_counter() - t0


DUMP_RECORDS = r"""
import dataclasses, json, sys
from moe_aot.database import Database
with Database(sys.argv[1]) as db:
    rows = [dataclasses.asdict(r) for r in db.records()]
for r in rows:
    r["created_at"] = r["created_at"].isoformat()
json.dump(rows, open(sys.argv[2], "w"), indent=1)
print(len(rows), "records written to", sys.argv[2])
"""
NCU_SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats",
                "SchedulerStats", "Occupancy", "LaunchStats", "InstructionStats"]
NCU_METRICS = ["regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio",
               "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
               "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
               "smsp__inst_executed_pipe_lsu.sum", "sm__cycles_elapsed.avg.per_second"]
# the byte counters that tools/ncu_summary.py prints, and the clock they were read at
NCU_BYTES = [*BYTES, "sm__cycles_elapsed.avg.per_second"]
# `--profile` only (its run falls back to the sections where ncu lacks a name): who asks L2 for what
NCU_REQUESTS = REQUESTS
CUBLAS_CEILING = r"""
import torch
for n in (4096, 8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b; torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(f"prof_cublas_{n}"); a @ b; torch.cuda.nvtx.range_pop(); torch.cuda.synchronize()
"""


def kernel_filter(regex) -> list[str]:
    """ncu's arguments limiting it to the kernels whose names match ``regex`` (none for None)."""
    return ["--kernel-name", f"regex:{regex}"] if regex else []


def details_profile(out, tag, sections, metrics, target, env, timeout, kernels=None):
    """ncu's details page (``sections`` and ``metrics``) over the NVTX prof_ ranges of the command
    ``target``, saved as out/ncu_<tag>.csv with tools/ncu_summary.py's summary in
    out/ncu_<tag>_summary.txt; returns summary's entry."""
    cmd = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", "regex:prof_.*/", "--csv",
           "--page", "details", *[a for sec in sections for a in ("--section", sec)],
           "--metrics", ",".join(metrics), "--log-file", str(out / f"ncu_{tag}.csv"), *kernel_filter(kernels),
           *target]
    rc, log, secs = sh(cmd, log=out / f"ncu_{tag}.log", env=env, timeout=timeout)
    print(f"ncu {tag}", rc, log[-1500:], flush=True)
    if rc == 0:
        _, text, _ = sh([sys.executable, "tools/ncu_summary.py", str(out / f"ncu_{tag}.csv")], env=env)
        (out / f"ncu_{tag}_summary.txt").write_text(text)
        print(text[-6000:], flush=True)
    return {"rc": rc, "seconds": round(secs, 1)}


def source_profile(out, tag, target, env, top, regions="", kernels=None):
    """ncu's SASS-level stall sampling (SourceCounters) over the command ``target``, saved as
    out/<tag>.csv.gz, with tools/ncu_source_top.py's summary (``top`` instructions per kernel, and
    the samples per address range of ``regions``) in out/<tag>_top.txt; returns summary's entry.
    ``kernels``: only the kernels whose names match this regex."""
    csv_path = out / f"{tag}.csv"
    cmd = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", "regex:prof_.*/", "--section",
           "SourceCounters", "--page", "source", "--print-source", "sass", "--csv",
           *kernel_filter(kernels), *target]
    rc, log, secs = sh(cmd, env=env, timeout=400)
    csv_path.write_text(log)
    if rc == 0:
        _, text, _ = sh([sys.executable, "tools/ncu_source_top.py", str(csv_path), "--top", str(top),
                         *(["--regions", regions] if regions else [])], env=env)
        (out / f"{tag}_top.txt").write_text(text)
        print(text[-6000:], flush=True)
    subprocess.run(["gzip", "-f", str(csv_path)])
    return {"rc": rc, "seconds": round(secs, 1)}


def profile(ns, out, env):
    """Nsight Compute over one launch of each profiled GEMM (and cuBLAS), CSV under out/."""
    if ns.gemm_check is None:
        sys.exit("--profile needs --gemm-check DIR (the compiled configs)")
    tags, _, tokens = ns.profile.partition("@")
    base = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", "regex:prof_.*/", "--csv",
            "--page", "details", *[a for sec in NCU_SECTIONS for a in ("--section", sec)],
            "--metrics", ",".join(dict.fromkeys(NCU_METRICS + NCU_BYTES + NCU_REQUESTS))]
    result = {}
    runs = {"gemms": [sys.executable, "tools/check_gemm_kernels.py", "--run", ns.gemm_check, "--out",
                      str(out / "prof_check"), "--iters", "1", "--only", tags, "--tokens", tokens or "4096",
                      "--models", ns.profile_models],
            "cublas": [sys.executable, "-c", CUBLAS_CEILING]}
    for name, cmd in runs.items():
        rc, log, secs = sh(base + ["--log-file", str(out / f"ncu_{name}.csv"), *cmd], env=env, timeout=560)
        if rc and "metric" in log.lower():  # a metric name this ncu does not know: sections alone
            rc, log, secs = sh(base[:-2] + ["--log-file", str(out / f"ncu_{name}.csv"), *cmd], env=env,
                               timeout=560)
        (out / f"ncu_{name}.log").write_text(log)
        result[name] = {"rc": rc, "seconds": round(secs, 1)}
        print(f"ncu {name}: rc {rc} in {secs:.0f} s", log[-1500:] if rc else "", flush=True)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--db", default=str(ROOT / "cache" / "moe_aot.sqlite"))
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--test-args", default="", help="extra pytest arguments, e.g. '-k qwen3'")
    ap.add_argument("--test-files", default="tests/test_gpu_layer.py,tests/test_gpu_fp8.py,tests/test_gpu_autograd.py,"
                    "tests/test_gpu_decode.py",
                    help="comma-separated GPU test files (the database must hold their kernels)")
    ap.add_argument("--coldstart", action="store_true")
    ap.add_argument("--coldstart-compare", default=None, metavar="DIR",
                    help="with --coldstart: also time the moe_aot package under DIR (e.g. scratch/before from "
                         "`git archive main moe_aot | tar -x -C scratch/before`), alternating with this checkout's")
    ap.add_argument("--coldstart-compare-db", default=None, metavar="FILE",
                    help="the SQLite database the compared checkout reads (default: --db), e.g. one built "
                         "by that checkout")
    ap.add_argument("--coldstart-diag", action="store_true",
                    help="with --coldstart: one more process per model and checkout, run after the timed "
                         "ones, splitting the eager host time (the launchers alone, the shim's own "
                         "counters with MOE_AOT_SHIM_STATS=1, a CUDA-graph replay for scale)")
    ap.add_argument("--spark-standin", default=None, metavar="DIR",
                    help="tools/spark_standin.py --run DIR (the DGX Spark layers' sm_90a stand-ins built by "
                         "--build DIR: checks, graph replays, tune -> measure) into OUT/spark_standin")
    ap.add_argument("--bench", default=None, help="arguments for tools/bench.py ('' for defaults)")
    ap.add_argument("--gemm-peers", default=None, metavar="ARGS",
                    help="arguments for tools/gemm_peers.py ('' for defaults): our GEMMs beside torch's grouped GEMMs")
    ap.add_argument("--profile-layer", default=None, metavar="POINTS",
                    help="ncu over one forward of the served layer per point, e.g. 'qwen3-30b-a3b:1,mixtral-8x7b:256'")
    ap.add_argument("--profile-source", default=None, metavar="POINTS",
                    help="ncu's SASS-level stall sampling over one forward per point (tools/ncu_source_top.py "
                         "reads it), e.g. 'qwen3-30b-a3b:16:fp8'")
    ap.add_argument("--profile-train", metavar="POINTS",
                    help="ncu over one training step (fused_moe_train and its backward) per point, e.g. "
                         "'qwen3-30b-a3b:4096'")
    ap.add_argument("--profile-kernels", default=None, metavar="REGEX",
                    help="with --profile-layer / --profile-train / --profile-backward / --profile-source-backward: "
                         "only the kernels whose names match REGEX (ncu --kernel-name regex:REGEX), e.g. "
                         "'HopperD[hx]Gemm|[Gg]roup': every section over every kernel of a DeepSeek-V3 16384 "
                         "training step takes more than 270 s")
    ap.add_argument("--bench-fp8", default=None, help="arguments for tools/bench_fp8.py ('' for defaults)")
    ap.add_argument("--check-backward", default=None, metavar="ARGS",
                    help="arguments for tools/check_backward.py (its --db and --out are given)")
    ap.add_argument("--profile-backward", default=None, metavar="ARGS",
                    help="ncu (SpeedOfLight and the byte counters of NCU_BYTES) over the launches that "
                         "tools/check_backward.py ARGS puts in NVTX ranges: one eager launch of our dH and dX per "
                         "tile choice and of torch's grouped GEMMs on the same products")
    ap.add_argument("--profile-source-backward", default=None, metavar="ARGS",
                    help="ncu's SASS-level stall sampling over the same launches as --profile-backward "
                         "(with --profile-kernels: only the matching kernels, e.g. HopperDhGemm)")
    ap.add_argument("--bench-backward", default=None, metavar="ARGS",
                    help="arguments for tools/bench_backward.py (its --out is given)")
    ap.add_argument("--gemm-check", default=None, metavar="DIR",
                    help="run tools/check_gemm_kernels.py on the kernels compiled into DIR "
                         "(check_gemm_kernels.py --compile DIR on the CPU machine)")
    ap.add_argument("--profile", default=None, metavar="TAGS@TOKENS",
                    help="ncu over check_gemm_kernels.py configs in --gemm-check DIR, e.g. "
                         "'hw128,pp64@4096' (one launch of each GEMM per point, clocks untouched)")
    ap.add_argument("--profile-models", default="qwen3_30b_a3b,deepseek_v3")
    ap.add_argument("--measure-args", default="", help="extra `moe-aot measure` arguments, e.g. '--confirm 2'")
    ap.add_argument("--measure-timeout", type=float, default=420,
                    help="seconds before `moe-aot measure` is stopped (its records so far are kept)")
    ap.add_argument("--tune-backward", default=None, metavar="ARGS",
                    help="`moe-aot tune --backward ARGS` on --db (candidates compiled by `tune --backward "
                         "--compile-only` here), picks exported to OUT/tuned, records to OUT/records_backward.json; "
                         "before the benchmarks, which then run the picks")
    ap.add_argument("--tune-backward-timeout", type=float, default=420)
    ap.add_argument("--measure", action="store_true",
                    help="moe-aot measure on --db (trials left ready by `tune --compile-only`), then the "
                         "records as JSON and the picks as cache/tuned text under --out")
    ap.add_argument("--keep-db", action="store_true",
                    help="copy --db (with what its write-ahead log holds) to OUT/db.sqlite at the end: the picks "
                         "and records `--measure` wrote, for the next call to carry")
    ap.add_argument("--decode", default=None, metavar="DIR",
                    help="tools/check_decode.py on the one-launch decode kernels compiled into DIR "
                         "(several: DIR1,DIR2, each timed beside the layer)")
    ap.add_argument("--decode-profile", action="store_true", help="with --decode: ncu of one launch per model")
    ap.add_argument("--decode-profile-source", default=None, metavar="REGIONS",
                    help="with --decode: ncu's SASS-level stall sampling of one launch per model of the first "
                         "directory, summed per address range by tools/ncu_source_top.py --regions REGIONS "
                         "('' for none), e.g. '0x3d80-0x5700:phase1,0x5d40-0x71a0:phase2'")
    ap.add_argument("--decode-profile-models", default="", metavar="MODELS",
                    help="with --decode-profile(-source): only these presets (the regions are one kernel's)")
    ap.add_argument("--decode-args", default="", help="with --decode: extra check_decode.py --run arguments "
                    "(e.g. --max-tokens 1; by default each directory is checked at 1..the tokens it was compiled for)")
    ap.add_argument("--sanitize", default=None, metavar="MODELS",
                    help="compute-sanitizer memcheck over tools/sanitize_check.py for these presets "
                         "(model[:precision], e.g. deepseek-v3:fp8-block128)")
    ap.add_argument("--skip-check", action="store_true", help="with --profile: do not run the whole check first")
    ap.add_argument("--gemm-check-args", default="", help="extra check_gemm_kernels.py arguments (--only ...)")
    ap.add_argument("--gemm-check-timeout", type=int, default=560)
    ap.add_argument("--gemm-smoke", default="", metavar="ARGS",
                    help="check_gemm_kernels.py arguments of one quick point run first (e.g. '--only hc2 "
                         "--models qwen3_30b_a3b --tokens 4096'); if it fails or hangs, the rest is skipped")
    ap.add_argument("--gemm-smoke-timeout", type=int, default=90)
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)

    wheels = sorted(glob.glob(str(ROOT / ".whl" / "*.whl")))
    if wheels:
        rc, log, _ = sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--target", SITE, *wheels])
        if rc:
            print(log)
            sys.exit("installing the brought wheels failed")
    env = dict(os.environ, PYTHONPATH=f"{SITE}:{ROOT}", MOE_AOT_DB=f"sqlite:///{Path(ns.db).resolve()}",
               PYTHONUNBUFFERED="1")
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv}
    rc, smi, _ = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
                     "--format=csv,noheader"])
    summary["device"] = smi.strip()
    rc, tv, _ = sh([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"], env=env)
    summary["torch"] = tv.strip()
    rc, dsl, _ = sh([sys.executable, "-c", "import cutlass"], env=env)
    summary["dsl_installed_here"] = rc == 0
    print(f"device: {summary['device']}; torch {summary['torch']}; DSL installed here: {rc == 0}", flush=True)

    if ns.measure:
        (out / "tuned").mkdir(exist_ok=True)
        cmd = [sys.executable, "-c", "from moe_aot.cli import main; main()", "measure", "--db", env["MOE_AOT_DB"],
               "--export-dir", str(out / "tuned"), *shlex.split(ns.measure_args)]
        rc, log, secs = sh(cmd, log=out / "measure.log", env=env, timeout=ns.measure_timeout)
        summary["measure"] = {"rc": rc, "seconds": round(secs, 1)}
        print(log[-3000:], flush=True)
        rc2, log2, _ = sh([sys.executable, "-c", DUMP_RECORDS, env["MOE_AOT_DB"], str(out / "records.json")], env=env)
        summary["measure"]["records_dump_rc"] = rc2
        print(log2[-1500:], flush=True)

    if ns.tune_backward is not None:
        (out / "tuned").mkdir(exist_ok=True)
        cmd = [sys.executable, "-c", "from moe_aot.cli import main; main()", "tune", "--backward", "--db",
               env["MOE_AOT_DB"], "--export-dir", str(out / "tuned"), *shlex.split(ns.tune_backward)]
        rc, log, secs = sh(cmd, log=out / "tune_backward.log", env=env, timeout=ns.tune_backward_timeout)
        summary["tune_backward"] = {"rc": rc, "seconds": round(secs, 1)}
        print(log[-4000:], flush=True)
        rc2, log2, _ = sh([sys.executable, "-c", DUMP_RECORDS, env["MOE_AOT_DB"], str(out / "records_backward.json")],
                          env=env)
        summary["tune_backward"]["records_dump_rc"] = rc2

    if ns.coldstart:
        rows = []
        # The first process also pays for writing .pyc files of the brought packages; the second
        # is what every later process start costs.
        # PYTHONSAFEPATH: `python -c` would otherwise put the working directory (this checkout)
        # first on sys.path, and the compared checkout would import this one's moe_aot
        checkouts = {"this": dict(env, PYTHONSAFEPATH="1")}
        if ns.coldstart_compare:
            checkouts["compare"] = dict(env, PYTHONSAFEPATH="1",
                                        PYTHONPATH=f"{SITE}:{Path(ns.coldstart_compare).resolve()}")
            if ns.coldstart_compare_db:
                checkouts["compare"]["MOE_AOT_DB"] = f"sqlite:///{Path(ns.coldstart_compare_db).resolve()}"
        summary["bytecode"] = bytecode_state(env)
        print("bytecode before", summary["bytecode"], flush=True)
        # one process with no .pyc to read or write: what an import costs when every module is
        # compiled from source (a checkout whose __pycache__ is missing or not writable)
        nopyc = dict(checkouts["this"], PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=f"/tmp/nopyc-{os.getpid()}")
        runs = [("qwen3-30b-a3b", "this+no-pyc", nopyc)]
        # then every checkout's modules compiled once, as `pip install` does for an installed
        # package, so that the timed processes below read .pyc files
        compiled = {}
        for label, cenv in checkouts.items():
            src = str(Path(cenv["PYTHONPATH"].split(":")[-1]) / "moe_aot")
            rc, log, secs = sh([sys.executable, "-m", "compileall", "-q", src], env=cenv, timeout=120)
            compiled[label] = {"rc": rc, "seconds": round(secs, 2), "tail": log[-300:]}
        summary["compileall"] = compiled
        summary["bytecode_after_compileall"] = bytecode_state(env)
        print("compileall", compiled, summary["bytecode_after_compileall"], flush=True)
        runs += [(m, label, cenv) for m in ("qwen3-30b-a3b", "qwen3-30b-a3b", "deepseek-v3", "deepseek-v3")
                 for label, cenv in checkouts.items()]
        if ns.coldstart_diag:
            runs += [(m, label + "+diag", dict(cenv, MOE_AOT_COLDSTART_DIAG="1", MOE_AOT_SHIM_STATS="1"))
                     for m in ("qwen3-30b-a3b", "deepseek-v3") for label, cenv in checkouts.items()]
        for model, label, cenv in runs:
            rc, log, _ = sh([sys.executable, "-c", COLD_START, model], env=cenv, timeout=300)
            line = [x for x in log.splitlines() if x.startswith("{")]
            rows.append(json.loads(line[-1]) if rc == 0 and line else {"model": model, "error": log[-2000:]})
            rows[-1]["checkout"] = label
            print("coldstart", rows[-1], flush=True)
        summary["coldstart"] = rows
        # where an import's time goes, module by module, in one more process after the timed ones
        rc, log, _ = sh([sys.executable, "-X", "importtime", "-c",
                         "import torch; torch.zeros(1, device='cuda'); import moe_aot.runtime.layer"],
                        env=checkouts["this"], timeout=120)
        (out / "importtime.txt").write_text(log)

    if ns.tests:
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
               f"--junitxml={out / 'gpu_tests.xml'}", *ns.test_files.split(","), *shlex.split(ns.test_args)]
        rc, log, secs = sh(cmd, log=out / "gpu_tests.log", env=env, timeout=540)
        summary["tests"] = {"rc": rc, "seconds": round(secs, 1), "tail": log.strip().splitlines()[-1:]}
        print(log[-6000:], flush=True)

    if ns.spark_standin:
        cmd = [sys.executable, "tools/spark_standin.py", "--run", ns.spark_standin, "--out", str(out / "spark_standin")]
        rc, log, secs = sh(cmd, log=out / "spark_standin.log", env=env, timeout=560)
        summary["spark_standin"] = {"rc": rc, "seconds": round(secs, 1), "tail": log.strip().splitlines()[-3:]}
        print(log[-4000:], flush=True)

    if ns.bench is not None:
        cmd = [sys.executable, "tools/bench.py", "--out", str(out), *ns.bench.split()]
        rc, log, secs = sh(cmd, log=out / "bench.log", env=env, timeout=560)
        summary["bench"] = {"rc": rc, "seconds": round(secs, 1)}
        print(log[-8000:], flush=True)

    def check_backward(out_dir, args, *extra):
        """tools/check_backward.py over --db, writing into out_dir."""
        return [sys.executable, "tools/check_backward.py", "--db", f"sqlite:///{Path(ns.db).resolve()}", "--out",
                str(out_dir), *extra, *args.split()]

    if ns.check_backward is not None:
        rc, log, secs = sh(check_backward(out, ns.check_backward), log=out / "check_backward.log", env=env,
                           timeout=560)
        summary["check_backward"] = {"rc": rc, "seconds": round(secs, 1)}
    if ns.profile_backward is not None:
        summary["profile_backward"] = details_profile(
            out, "backward", ["SpeedOfLight"], NCU_BYTES,
            check_backward(out / "prof_backward", ns.profile_backward, "--replays", "2"), env, 560,
            ns.profile_kernels)
    if ns.profile_source_backward is not None:
        summary["profile_source_backward"] = source_profile(
            out, "ncu_source_backward",
            check_backward(out / "prof_source_backward", ns.profile_source_backward, "--replays", "2"), env, 24,
            kernels=ns.profile_kernels)
    if ns.bench_backward is not None:
        cmd = [sys.executable, "tools/bench_backward.py", "--out", str(out), *ns.bench_backward.split()]
        rc, log, secs = sh(cmd, log=out / "bench_backward.log", env=env, timeout=560)
        summary["bench_backward"] = {"rc": rc, "seconds": round(secs, 1)}
    if ns.bench_fp8 is not None:
        cmd = [sys.executable, "tools/bench_fp8.py", "--out", str(out), *ns.bench_fp8.split()]
        rc, log, secs = sh(cmd, log=out / "bench_fp8.log", env=env, timeout=560)
        summary["bench_fp8"] = {"rc": rc, "seconds": round(secs, 1)}
        print(log[-8000:], flush=True)

    if ns.gemm_peers is not None:
        cmd = [sys.executable, "tools/gemm_peers.py", "--out", str(out), *ns.gemm_peers.split()]
        rc, log, secs = sh(cmd, log=out / "gemm_peers.log", env=env, timeout=560)
        summary["gemm_peers"] = {"rc": rc, "seconds": round(secs, 1)}
        print(log[-6000:], flush=True)

    for tag, points, flags in (("layer", ns.profile_layer, []), ("train", ns.profile_train, ["--train"])):
        if points:
            summary[f"profile_{tag}"] = details_profile(
                out, tag, NCU_SECTIONS, NCU_METRICS,
                [sys.executable, "tools/profile_layer.py", *flags, *points.split(",")], env, 400, ns.profile_kernels)

    if ns.profile_source:
        summary["profile_source"] = source_profile(
            out, "ncu_source", [sys.executable, "tools/profile_layer.py", *ns.profile_source.split(",")], env, 16)

    if ns.gemm_check is not None and not ns.skip_check:
        check = [sys.executable, "tools/check_gemm_kernels.py", "--run", ns.gemm_check]
        if ns.gemm_smoke:
            # one point first, under a short limit: a kernel that hangs costs seconds, not the call
            rc, log, secs = sh(check + ["--out", str(out / "gemm_smoke"), *ns.gemm_smoke.split()],
                               log=out / "gemm_smoke.log", env=env, timeout=ns.gemm_smoke_timeout)
            summary["gemm_smoke"] = {"rc": rc, "seconds": round(secs, 1)}
            print("smoke:", log[-3000:], flush=True)
            if rc:
                ns.profile = None
        if not ns.gemm_smoke or summary["gemm_smoke"]["rc"] == 0:
            cmd = check + ["--out", str(out / "gemm"), *ns.gemm_check_args.split()]
            rc, log, secs = sh(cmd, log=out / "gemm_check.log", env=env, timeout=ns.gemm_check_timeout)
            summary["gemm_check"] = {"rc": rc, "seconds": round(secs, 1)}
            print(log[-8000:], flush=True)

    if ns.decode is not None:
        summary["decode"] = {}
        for i, kdir in enumerate(ns.decode.split(",")):
            cmd = [sys.executable, "tools/check_decode.py", "--run", kdir, "--out", str(out / f"decode{i}"),
                   *ns.decode_args.split()]
            rc, log, secs = sh(cmd, log=out / f"decode{i}.log", env=env, timeout=300)
            summary["decode"][kdir] = {"rc": rc, "seconds": round(secs, 1)}
            print(log[-2500:], flush=True)
        # one launch per model of the first directory, in NVTX ranges for ncu
        prof = [sys.executable, "tools/check_decode.py", "--run", ns.decode.split(",")[0], "--profile",
                *ns.decode_args.split(), *(["--models", ns.decode_profile_models] if ns.decode_profile_models else [])]
        if ns.decode_profile:
            cmd = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", "regex:prof_.*/", "--csv",
                   "--page", "details", *[a for sec in NCU_SECTIONS for a in ("--section", sec)],
                   "--metrics", ",".join(NCU_METRICS), "--log-file", str(out / "ncu_decode.csv"),
                   *prof, "--out", str(out / "decode_prof")]
            rc, log, secs = sh(cmd, env=env, timeout=300)
            summary["decode"]["ncu"] = {"rc": rc, "seconds": round(secs, 1)}
            print("ncu decode", rc, log[-800:] if rc else "", flush=True)
        if ns.decode_profile_source is not None:
            summary["decode"]["ncu_source"] = source_profile(
                out, "ncu_decode_source", [*prof, "--out", str(out / "decode_prof_source")], env, 24,
                ns.decode_profile_source)

    if ns.profile is not None:
        summary["profile"] = profile(ns, out, env)

    if ns.sanitize:
        summary["sanitize"] = {}
        for model in ns.sanitize.split(","):
            cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", sys.executable,
                   "tools/sanitize_check.py", model]
            rc, log, secs = sh(cmd, log=out / f"sanitize_{model.replace(':', '_')}.log", env=env, timeout=400)
            summary["sanitize"][model] = {"rc": rc, "seconds": round(secs, 1),
                                          "summary": [ln for ln in log.splitlines() if "ERROR SUMMARY" in ln][-1:]}
            print(f"sanitize {model}: rc {rc} in {secs:.0f} s", log[-1200:], flush=True)

    if ns.keep_db:
        import sqlite3

        src, dst = sqlite3.connect(Path(ns.db).resolve()), sqlite3.connect(out / "db.sqlite")
        src.backup(dst)  # the pages a write-ahead log still holds too
        src.close(), dst.close()
        summary["kept_db"] = str(out / "db.sqlite")

    (out / "gpu_run.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1)[-3000:])


if __name__ == "__main__":
    main()

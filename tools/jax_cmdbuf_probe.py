#!/usr/bin/env python3
"""Does XLA put the moe-aot custom call into a command buffer (CUDA graph)? One fresh process per
XLA flag set (XLA reads XLA_FLAGS once, and aborts on an unknown flag), each dumping what XLA built:

    python3 tools/jax_cmdbuf_probe.py cache/moe_aot.sqlite --out $OUT/cmdbuf \
        [--model qwen3-30b-a3b] [--tokens 16] [--iters 200] [--only NAME,NAME]

Where to look, from XLA's source (xla/backends/gpu/runtime/command_buffer_conversion_pass.cc,
xla/service/gpu/gpu_executable.cc RunThunkPasses): command buffers are formed on the thunk
sequence after compilation, by the thunk pass CommandBufferConversionPass, not in the HLO. So the
optimized HLO never has a command-buffer computation (what tools/jax_smoke.py looks for);
XLA writes `<module>.thunk_sequence.txt` before the thunk passes and, when they changed anything,
`<module>.thunk_sequence_after_thunk_passes.txt`, where a converted call sits indented under a
`kCommandBuffer` line. A typed-FFI custom call is converted when CUSTOM_CALL is in
--xla_gpu_enable_command_buffer, its handler is registered for the GPU with the
COMMAND_BUFFER_COMPATIBLE trait (ffi::FindHandler(target, "gpu"), the trait ORed from the
registration and the handler's metadata answer), and the run of consecutive convertible thunks
counts at least max(1, --xla_gpu_graph_min_graph_size) thunks (default 5).

Per configuration, under --out/NAME/: the dump (dump/), stderr with the VLOG lines if any
(stderr.txt), result.json. Per function (the lone call, and the call between ordinary XLA ops):
where the custom call sits in the thunk sequence after the thunk passes, whether the HLO shows a
command buffer, whether each output (four calls over three input sets: warm-up, recording, then
updates with new buffers) equals the eager output of the configuration without command buffers
bit for bit, and per-call times (same inputs back to back, and two input sets alternating, which
makes XLA update the graph). --out/summary.json gathers them with the jaxlib/plugin versions and
which command-buffer flag names the XLA binaries hold (a name can be there as a reserved field of
xla.proto's DebugOptions and still be refused: jaxlib 0.10.2 holds
xla_gpu_experimental_enable_command_buffer_on_thunks and aborts on it as unknown; whether a flag
parses is what its configuration's rc says). Exit status 0 when every configuration that
should run ran and every output matched.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import mmap
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "moe_aot_fused_moe"
CB = "--xla_gpu_enable_command_buffer"
MIN = "--xla_gpu_graph_min_graph_size"
VMODULE = ("command_buffer_conversion_pass=2,command_buffer_thunk=2,command_executor=2,custom_call_thunk=2,"
           "ffi_registry=3,gpu_executable=1")
# (name, XLA flags, extra environment, whether the custom call is expected inside a command buffer)
CONFIGS = [
    ("off", f"{CB}=", {}, False),  # no command buffers: the reference outputs and times
    ("fusion_cc_min1", f"{CB}=FUSION,CUSTOM_CALL {MIN}=1", {}, True),  # tools/jax_smoke.py's flags
    ("fusion_cc_min1_vlog", f"{CB}=FUSION,CUSTOM_CALL {MIN}=1",
     {"TF_CPP_VMODULE": VMODULE, "TF_CPP_MIN_LOG_LEVEL": "0"}, True),  # the same, saying why (fewer calls)
    ("old_thunks_flag", f"{CB}=FUSION,CUSTOM_CALL {MIN}=1 --xla_gpu_experimental_enable_command_buffer_on_thunks=true",
     {}, None),  # known to jaxlib 0.10.2 (default true there), removed since: expected to abort as unknown
    ("defaults", "", {}, False),  # XLA's defaults: CUSTOM_CALL among the types, but min graph size 5
    ("cc_only_min1", f"{CB}=CUSTOM_CALL {MIN}=1", {}, True),
    ("min1_only", f"{MIN}=1", {}, True),  # the default command types with min graph size 1
]
# flag names looked up in the XLA binaries (the PJRT plugin compiles and runs the GPU executables)
FLAG_STRINGS = ["xla_gpu_enable_command_buffer", "xla_gpu_graph_min_graph_size",
                "xla_gpu_experimental_enable_command_buffer_on_thunks", "xla_gpu_command_buffer_update_mode",
                "xla_gpu_command_buffer_scheduling_mode", "xla_gpu_command_buffer_unroll_loops",
                "xla_enable_command_buffers_during_profiling", "xla_cmd_buffer_trace_cache_size",
                "thunk_sequence_after_thunk_passes", "custom_call_with_traits",
                "does not support custom call traits"]


def db_url(db: str | None) -> str | None:
    """A path (cache/moe_aot.sqlite) or a URL (sqlite:///...) -> the URL the store takes."""
    if not db:
        return os.environ.get("MOE_AOT_DB")
    return db if "://" in db else f"sqlite:///{Path(db).resolve()}"


# -- reading what XLA dumped ----------------------------------------------------------------------
def thunk_placement(dump_dir, module: str) -> dict:
    """Where the custom calls of `module` sit in its thunk sequence after XLA's thunk passes:
    {"file", "kinds" (top-level thunk kinds in order), "custom_calls": [inside a command buffer?],
    "in_command_buffer": all of them inside one (None: no custom call found)}. Without the
    after-passes file (XLA writes it only when a pass changed the sequence) the sequence before
    the passes is the final one."""
    files = glob.glob(os.path.join(str(dump_dir), f"*.{module}.thunk_sequence*.txt"))
    # the newest compilation of that module (module_NNNN.<name>...: XLA numbers modules in order)
    prefixes = {os.path.basename(f).split(".thunk_sequence")[0] for f in files}
    newest = max(prefixes, key=lambda p: (int(m.group(1)) if (m := re.match(r"module_(\d+)", p)) else -1, p),
                 default=None)
    after = [f for f in files if os.path.basename(f) == f"{newest}.thunk_sequence_after_thunk_passes.txt"]
    before = [f for f in files if os.path.basename(f) == f"{newest}.thunk_sequence.txt"]
    path = after[0] if after else (before[0] if before else None)
    out = {"file": os.path.basename(path) if path else None, "after_passes_written": bool(after),
           "kinds": [], "custom_calls": [], "in_command_buffer": None}
    if path is None:
        return out
    text = Path(path).read_text(errors="replace")
    out["text_head"] = text[:1500]
    open_buffers: list[int] = []  # indents of the kCommandBuffer lines we are under
    for line in text.splitlines():
        m = re.search(r"\b(k[A-Z][A-Za-z0-9]*)", line)
        if not m:
            continue
        indent = len(line) - len(line.lstrip())
        while open_buffers and indent <= open_buffers[-1]:
            open_buffers.pop()
        kind = m.group(1)
        if not open_buffers:
            out["kinds"].append(kind)
        if kind == "kCustomCall":
            out["custom_calls"].append(bool(open_buffers))
        if kind == "kCommandBuffer":
            open_buffers.append(indent)
    if out["custom_calls"]:
        out["in_command_buffer"] = all(out["custom_calls"])
    return out


def hlo_placement(text: str, target: str = TARGET) -> dict:
    """The HLO computations holding the custom call (the old way of looking: XLA no longer
    outlines command buffers in the HLO, so this stays False)."""
    blocks, name = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            parts = line.split()
            name = parts[1] if parts[0] == "ENTRY" else parts[0]
            blocks[name] = []
        elif name is not None:
            blocks[name].append(line)
    holders = [n for n, body in blocks.items() if any(f'custom_call_target="{target}"' in ln for ln in body)]
    return {"computations": holders, "hlo_command_buffer": any("command_buffer" in n for n in holders)}


def binary_flags() -> dict:
    """jaxlib's and the CUDA plugin's versions and which flag names their binaries hold (without
    importing jax, so it also works where a flag set aborts)."""
    info: dict = {}
    # longest first, so that a name that is the prefix of another is still seen where it stands alone
    pattern = re.compile(b"|".join(re.escape(x.encode()) for x in sorted(FLAG_STRINGS, key=len, reverse=True)))
    for mod in ("jaxlib", "jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_cuda12_pjrt",
                "jax_cuda13_pjrt"):
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for base in spec.submodule_search_locations:
            for so in glob.glob(os.path.join(base, "**", "*.so*"), recursive=True):
                if os.path.getsize(so) < 20_000_000:  # the XLA binaries are hundreds of MB
                    continue
                try:  # one pass over the file for all the names
                    with open(so, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                        found = {m.group(0).decode() for m in pattern.finditer(mm)}
                    info[so] = {s: s in found for s in FLAG_STRINGS}
                except (OSError, ValueError) as exc:
                    info[so] = {"error": str(exc)}
    try:
        from importlib import metadata

        info["versions"] = {d: metadata.version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin",
                                                             "jax-cuda12-pjrt", "jax-cuda13-plugin",
                                                             "jax-cuda13-pjrt")
                            if _has_dist(metadata, d)}
    except Exception as exc:  # metadata is a nicety
        info["versions"] = {"error": str(exc)}
    try:
        spec = importlib.util.find_spec("jaxlib")
        vfile = Path(spec.submodule_search_locations[0]) / "version.py"
        m = re.search(r"_git_hash[^=]*=\s*['\"]([0-9a-f]+)['\"]", vfile.read_text())
        info["jaxlib_git_hash"] = m.group(1) if m else None  # the jax commit jaxlib was built from
    except Exception:
        info["jaxlib_git_hash"] = None
    return info


def _has_dist(metadata, name) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


# -- one configuration, in its own process ----------------------------------------------------------
def worker(ns) -> int:
    out = Path(ns.out) / ns.worker
    dump = out / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    result: dict = {"name": ns.worker, "xla_flags": os.environ.get("XLA_FLAGS", ""), "functions": {}}
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    import jax
    import jax.numpy as jnp
    import jaxlib
    import numpy as np

    result["jax"], result["jaxlib"] = jax.__version__, jaxlib.__version__
    dev = jax.devices()[0]
    result["device"] = f"{dev} {getattr(dev, 'device_kind', '')}"

    import jax_smoke

    import moe_aot.integrations.jax as mj
    from moe_aot.spec import make_spec

    mj.register()
    result["traits_registered"] = dict(mj.REGISTERED_TRAITS)
    spec = make_spec(ns.model, target="sm_90a")
    M = ns.tokens
    w13, w2 = jax_smoke.weights(jax.random.PRNGKey(0), spec)

    def inputs(seed):
        kx, kr = jax.random.split(jax.random.PRNGKey(1000 + seed))
        x = jax.random.normal(kx, (M, spec.hidden), jnp.float32).astype(jnp.bfloat16)
        tw, ids = jax_smoke.routing(kr, M, spec.experts, spec.top_k, ("uniform", "invalid", "skew")[seed % 3])
        return x, tw, ids

    sets = [inputs(s) for s in range(3)]

    def moe_call(x, w13, w2, tw, ids):  # the custom call alone: one thunk
        return mj.fused_moe(x, w13, w2, tw, ids, db=ns.db)

    def moe_block(x, w13, w2, tw, ids):  # between ordinary XLA ops, as in a model
        h = (x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
        y = mj.fused_moe(h, w13, w2, tw, ids, db=ns.db)
        return (y.astype(jnp.float32) * 2.0 + x.astype(jnp.float32) * 1e-3).astype(jnp.bfloat16)

    def eager_block(x, w13, w2, tw, ids):  # the same op by op (each op its own executable)
        h = (x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
        y = mj.fused_moe(h, w13, w2, tw, ids, db=ns.db)
        return (y.astype(jnp.float32) * 2.0 + x.astype(jnp.float32) * 1e-3).astype(jnp.bfloat16)

    bits = lambda a: np.asarray(a).view(np.uint16)  # noqa: E731  bf16 bit patterns
    ref_dir = Path(ns.out) / "off"
    for fname, fn, eager in (("moe_call", moe_call, moe_call), ("moe_block", moe_block, eager_block)):
        f: dict = {}
        result["functions"][fname] = f
        try:
            jitted = jax.jit(fn)
            compiled = jitted.lower(sets[0][0], w13, w2, *sets[0][1:]).compile()
            f.update(hlo_placement(compiled.as_text()))
            f["thunks"] = thunk_placement(dump, f"jit_{fname}")
            f["in_command_buffer"] = f["thunks"]["in_command_buffer"]
            # eager outputs in this process (the "off" process's are the reference for all)
            eager_out = [bits(eager(x, w13, w2, tw, ids)) for x, tw, ids in sets]
            if ns.worker == "off":
                for i, e in enumerate(eager_out):
                    np.save(out / f"eager_{fname}_{i}.npy", e)
            refs = []
            for i in range(3):
                p = ref_dir / f"eager_{fname}_{i}.npy"
                refs.append(np.load(p) if p.exists() else eager_out[i])
            f["reference"] = "eager outputs of 'off'" if (ref_dir / f"eager_{fname}_0.npy").exists() else \
                "eager outputs of this process"
            calls = []
            for k, i in enumerate((0, 1, 2, 0)):  # warm-up, record, update with new buffers, back
                x, tw, ids = sets[i]
                o = bits(compiled(x, w13, w2, tw, ids))
                bf = np.dtype(jnp.bfloat16)
                diff = o.view(bf).astype(np.float32) - refs[i].view(bf).astype(np.float32)
                calls.append({"call": k, "inputs": i, "equal": bool(np.array_equal(o, refs[i])),
                              "max_abs": float(np.max(np.abs(diff)))})
            f["calls"] = calls
            f["eager_equal_here"] = all(np.array_equal(eager_out[i], refs[i]) for i in range(3))
            f["matches_eager"] = all(c["equal"] for c in calls)
            ref = jax.jit(mj.moe_reference)(*((sets[0][0] if fname == "moe_call" else
                                               (sets[0][0].astype(jnp.float32) * 0.5).astype(jnp.bfloat16)),
                                              w13, w2, *sets[0][1:]))
            got = compiled(*sets[0][:1], w13, w2, *sets[0][1:])
            if fname == "moe_block":
                got = (got.astype(jnp.float32) - sets[0][0].astype(jnp.float32) * 1e-3) / 2.0
            f["vs_jnp_reference"] = {k: v for k, v in jax_smoke.row_report(got, ref).items()
                                     if k in ("rel_err", "row_rel_err", "n_nonfinite_rows")}
            f["time_us"] = time_calls(compiled, sets, w13, w2, ns.iters)
        except Exception as exc:  # record and go on with the next function
            import traceback

            f["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            f["traceback"] = traceback.format_exc()[-3000:]
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


def time_calls(compiled, sets, w13, w2, iters: int) -> dict:
    """Per-call times in µs: `same` = the same inputs back to back (a graph replays unchanged),
    `alternating` = two input sets in turn (new addresses each call: the graph is updated), both
    the wall time per call with the queue kept full (dispatch and GPU overlapped) and the host
    time of the dispatch alone (median). Each after 10 untimed calls."""
    import jax

    res = {}
    for label, order in (("same", [0]), ("alternating", [0, 1])):
        args = [(sets[i][0], w13, w2, sets[i][1], sets[i][2]) for i in order]
        for k in range(10):
            out = compiled(*args[k % len(args)])
        jax.block_until_ready(out)
        host = []
        t0 = time.perf_counter()
        for k in range(iters):
            t = time.perf_counter_ns()
            out = compiled(*args[k % len(args)])
            host.append(time.perf_counter_ns() - t)
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t0) / iters * 1e6
        host.sort()
        res[label] = {"wall_per_call": round(wall, 2), "host_dispatch_median": round(host[len(host) // 2] / 1e3, 2)}
    return res


# -- the driver -------------------------------------------------------------------------------------
def run_config(ns, name, flags, env_extra, budget_s) -> dict:
    out = Path(ns.out) / name
    (out / "dump").mkdir(parents=True, exist_ok=True)
    xla_flags = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), flags,
                                     f"--xla_dump_to={out / 'dump'}") if x).strip()
    env = dict(os.environ, XLA_FLAGS=xla_flags, PYTHONUNBUFFERED="1", **env_extra)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in ("/tmp/site",) if os.path.isdir(p)] +
                                        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    if ns.db:
        env["MOE_AOT_DB"] = ns.db
    iters = min(ns.iters, 20) if "TF_CPP_VMODULE" in env_extra else ns.iters  # VLOG per execution is slow
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", ns.out, "--model", ns.model,
           "--tokens", str(ns.tokens), "--iters", str(iters)] + (["--db", ns.db] if ns.db else [])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = "timeout", exc.stdout or "", exc.stderr or ""
        stdout = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    (out / "stderr.txt").write_text(stderr)
    (out / "stdout.txt").write_text(stdout)
    res = {"name": name, "flags": flags, "env": env_extra, "rc": rc, "seconds": round(time.time() - t0, 1)}
    rfile = out / "result.json"
    if rfile.exists():
        res.update(json.loads(rfile.read_text()))
    unknown = re.findall(r"Unknown flags? in XLA_FLAGS: (.*)", stderr)
    if unknown:
        res["unknown_flag"] = unknown[0].strip()
    if rc != 0:
        res["stderr_tail"] = stderr[-2500:]
    # what the conversion pass said, when VLOG was on
    said = [ln.strip() for ln in stderr.splitlines()
            if re.search(r"command buffer|CommandBuffer|command_buffer|not lowered|min graph size|FFI handler",
                         ln, re.IGNORECASE)]
    if said:
        res["log_lines"] = said[:40]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db_path", nargs="?", default=None, help="kernel database: a path or URL (default MOE_AOT_DB)")
    ap.add_argument("--db", default=None, help="same as the positional argument")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--budget", type=float, default=170, help="seconds for all configurations together")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    ns.db = db_url(ns.db or ns.db_path)
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    if ns.worker:
        return worker(ns)

    t_start = time.time()
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv,
               "db": ns.db, "model": ns.model, "tokens": ns.tokens, "binaries": binary_flags(), "configs": []}
    print(json.dumps({"versions": summary["binaries"].get("versions"),
                      "jaxlib_git_hash": summary["binaries"].get("jaxlib_git_hash"),
                      "flags_in_binaries": {os.path.basename(k): [s for s, v in d.items() if v is True]
                                            for k, d in summary["binaries"].items()
                                            if isinstance(d, dict) and ".so" in k}}),
          flush=True)
    names = ns.only.split(",") if ns.only else [c[0] for c in CONFIGS]
    ok = True
    for name, flags, env_extra, expect in CONFIGS:
        if name not in names:
            continue
        left = ns.budget - (time.time() - t_start)
        if left < 15:
            summary["configs"].append({"name": name, "skipped": "out of time"})
            print(f"{name}: skipped (out of time)", flush=True)
            continue
        res = run_config(ns, name, flags, env_extra, budget_s=min(75.0, left))
        res["expected_in_command_buffer"] = expect
        summary["configs"].append(res)
        print(line(res), flush=True)
        fns = res.get("functions", {})
        if name != "old_thunks_flag":
            ok &= res["rc"] == 0 and bool(fns) and all(f.get("matches_eager") for f in fns.values())
    Path(ns.out, "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"summary: {Path(ns.out, 'summary.json')} ({time.time() - t_start:.0f} s)", flush=True)
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


def line(res: dict) -> str:
    """One line per configuration: per function, thunk placement / outputs / times."""
    head = f"{res['name']:<20} rc {res['rc']!s:<7} {res.get('seconds', 0):5.1f} s"
    if "unknown_flag" in res:
        return f"{head}  unknown flag: {res['unknown_flag']}"
    parts = []
    for fname, f in res.get("functions", {}).items():
        if "error" in f:
            parts.append(f"{fname}: ERROR {f['error'][:160]}")
            continue
        t = f.get("time_us", {})
        parts.append(f"{fname}: cmdbuf {f.get('in_command_buffer')} (top {'/'.join(f['thunks']['kinds'][:6])}) "
                     f"eager-equal {f.get('matches_eager')} "
                     f"{t.get('same', {}).get('wall_per_call')}/{t.get('alternating', {}).get('wall_per_call')} us")
    if not parts and res.get("stderr_tail"):
        parts.append("stderr: " + res["stderr_tail"][-300:].replace("\n", " | "))
    return head + "  " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
